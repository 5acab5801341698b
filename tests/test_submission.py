"""submission.py without a GPU: the file rules of the leaderboard, validation, the launch-metadata cache key."""
import dataclasses
import os
import re
import subprocess
import sys
from collections import OrderedDict

import pytest
import torch

import reference
import submission
import submission_sm90
from bringup import FILE_RULES
from conftest import ROOT, check_table_rows

SUBMISSION = ROOT / "submission.py"


# ---------------------------------------------------------------------------------------------------------
# The leaderboard's file rules: the two header lines, never the runner's forbidden word (any case, comments
# and identifiers too), under 1 MB, nothing imported from this repository but the runner's task.py. One
# statement of them (bringup.FILE_RULES), which `eval.py export` applies to every copy it writes too.
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rule", list(FILE_RULES))
def test_file_rule(rule):
    assert FILE_RULES[rule](SUBMISSION.read_text()) is None


@pytest.mark.parametrize("path, most", [("submission.py", 2720), ("README.md", 250)])
def test_the_house_limits(path, most):
    """The leaderboard file holds what runs on a B200 and the shared host path; the README is a user's ten minutes
    (history goes to docs/). Both crept over once (2,723 and 264 lines) as features landed."""
    lines = len((ROOT / path).read_text().splitlines())
    assert lines <= most, f"{path}: {lines} lines, at most {most}"


def test_the_design_notes_it_points_to_exist():
    # The notes moved out of the file stay reachable: every docs/B200_DESIGN.md#anchor it names is a heading there
    # (GitHub's anchors: lower case, punctuation dropped, spaces as hyphens).
    headings = re.findall(r"^#+ (.+)$", (ROOT / "docs" / "B200_DESIGN.md").read_text(), re.M)
    anchors = {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}
    named = set(re.findall(r"docs/B200_DESIGN\.md#([\w-]+)", SUBMISSION.read_text()))
    assert named and named <= anchors, sorted(named - anchors)


# ---------------------------------------------------------------------------------------------------------
# can_implement: one statement of the constraints, evaluated before any compile or launch
# ---------------------------------------------------------------------------------------------------------
def _data(m=(96, 40), n=(128, 256), k=(256, 512), seed=1):
    return reference.generate_input(m=m, n=n, k=k, g=len(m), seed=seed)


def _replace(data, group, slot, index, tensor):
    data = [list(x) for x in data]
    entry = list(data[slot][group])
    entry[index] = tensor
    data[slot][group] = tuple(entry)
    return tuple(data)


def _reason(data):
    ok, reason = submission.can_implement(data)
    assert not ok
    return reason


def _raises(data, match):
    with pytest.raises(ValueError, match=match):
        submission.custom_kernel(data)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the generator puts the data on the GPU there")
def test_cpu_tensors_are_rejected():
    data = _data()
    assert re.search(r"cuda|gpu", _reason(data), re.IGNORECASE)
    _raises(data, r"(?i)cuda|gpu")


def _on_meta(data):
    """The same data on the meta device: shapes and dtypes without storage, so that each test meets the
    check it is about rather than the device check."""
    abc, sfs, sfs_r, sizes = data
    meta = lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
    return ([tuple(meta(t) for t in x) for x in abc], sfs, [tuple(meta(t) for t in x) for x in sfs_r], sizes)


def test_wrong_dtype_names_group_and_problem():
    data = _data()
    a = data[0][1][0]
    bad = _replace(data, 1, 0, 0, a.view(torch.uint8))
    reason = _reason(bad)
    assert "group 1" in reason and "(40, 256, 512, 1)" in reason and "dtype" in reason.lower()
    _raises(bad, "group 1")


def test_wrong_output_dtype():
    data = _data()
    c = data[0][0][2]
    reason = _reason(_replace(data, 0, 0, 2, c.float()))
    assert "group 0" in reason and "dtype" in reason.lower()


def test_wrong_shape():
    data = _data()
    b = data[0][0][1]
    reason = _reason(_replace(data, 0, 0, 1, b[:64]))
    assert "group 0" in reason and "shape" in reason.lower()


def test_wrong_strides():
    data = _data()
    a = data[0][0][0]
    # Same shape, but M-major instead of K-contiguous.
    a_t = a.view(torch.uint8).permute(2, 1, 0).contiguous().permute(2, 1, 0).view(torch.float4_e2m1fn_x2)
    assert a_t.shape == a.shape and a_t.stride() != a.stride()
    reason = _reason(_replace(data, 0, 0, 0, a_t))
    assert "group 0" in reason and "stride" in reason.lower()


def test_k_not_multiple_of_256():
    data = _data(m=(64,), n=(128,), k=(128,))
    reason = _reason(data)
    assert "group 0" in reason and "256" in reason
    _raises(data, "256")


def test_n_not_multiple_of_128():
    data = _on_meta(_data(m=(64, 64), n=(128, 200), k=(256, 256)))
    reason = _reason(data)
    assert "group 1" in reason and "(64, 200, 256, 1)" in reason and "128" in reason


def test_l_not_one():
    data = _data(m=(64,), n=(128,), k=(256,))
    abc, sfs, sfs_r, sizes = data
    sizes = [(64, 128, 256, 2)]
    reason = _reason((abc, sfs, sfs_r, sizes))
    assert "group 0" in reason and re.search(r"\bL\b|\bl\b", reason)


def test_mismatched_lengths_and_empty():
    abc, sfs, sfs_r, sizes = _data()
    assert "length" in _reason((abc, sfs, sfs_r, sizes[:1])).lower()
    assert "length" in _reason((abc[:1], sfs, sfs_r, sizes)).lower()
    assert "empty" in _reason(([], [], [], [])).lower()
    _raises(([], [], [], []), "(?i)empty")


def test_sizes_disagree_with_tensors():
    abc, sfs, sfs_r, sizes = _data()
    reason = _reason((abc, sfs, sfs_r, [sizes[0], (48, 256, 512, 1)]))
    assert "group 1" in reason


def test_tensors_on_different_devices():
    data = _data()
    mixed = _replace(data, 0, 0, 2, torch.empty_strided(data[0][0][2].shape, data[0][0][2].stride(),
                                                        dtype=torch.float16, device="meta"))
    assert "device" in _reason(mixed).lower()


def test_valid_shapes_pass_every_check_but_the_device():
    # On meta tensors every shape/dtype/stride check passes; only "not a CUDA device" remains.
    for m, n in [((1, 1000), (128, 256)), ((129, 40), (7168, 128))]:
        reason = _reason(_on_meta(_data(m=m, n=n, k=(256, 7168))))
        assert re.search(r"(?i)cuda|gpu", reason) and "group" not in reason.lower(), reason


# ---------------------------------------------------------------------------------------------------------
# The launch-metadata cache is keyed on everything it depends on
# ---------------------------------------------------------------------------------------------------------
def test_metadata_key_covers_problem_sizes():
    # Regression: the seed-era cache keyed launch metadata on the pointers and the tile count only, so the
    # same buffers reused with other problem sizes (same tile count) ran with the stale sizes.
    data = _data(m=(96, 40), n=(128, 256), k=(256, 512))
    abc, sfs, sfs_r, sizes = data
    other = (abc, sfs, sfs_r, [(90, 128, 256, 1), (40, 256, 512, 1)])  # same pointers, same tile count
    assert submission.launch_metadata_key(data) != submission.launch_metadata_key(other)


def test_metadata_key_covers_every_pointer():
    data = _data()
    key = submission.launch_metadata_key(data)
    for slot, index in [(0, 0), (0, 1), (0, 2), (2, 0), (2, 1)]:
        t = data[slot][1][index]
        assert submission.launch_metadata_key(_replace(data, 1, slot, index, t.clone())) != key, (slot, index)
    assert submission.launch_metadata_key(data) == key  # deterministic


# ---------------------------------------------------------------------------------------------------------
# Blackwell tile table (choose_sm100_config): the model's choice per problem, checked on the task's shapes
# ---------------------------------------------------------------------------------------------------------
def _sizes(case):
    return [(m, n, k, 1) for m, n, k in zip(case["m"], case["n"], case["k"])]


def test_tile_table_rows_fit_an_sm():
    for row in submission.SM100_TILE_TABLE:
        assert row.smem_bytes <= submission.DYNAMIC_SMEM_BUDGET
        assert row.tmem_cols_used <= row.tmem_alloc_cols <= 512
        assert row.num_ab_stages >= 2 and row.num_c_stages >= 2
    assert {row.tile_mn[1] for row in submission.SM100_TILE_TABLE} == {64, 128, 256}


def test_tile_table_keeps_128_on_the_benchmarks():
    # The benchmarks have 120-728 tiles of 128x128 for 148 SMs: halving N doubles the rounds of B2/B3,
    # N = 256 halves the CTAs busy on them; B0/B1 are DRAM-bound in the model.
    from conftest import load_task_yml
    for case in load_task_yml()["benchmarks"]:
        assert submission.choose_sm100_config(_sizes(case), 148).tile_mn == (128, 128), case


def test_tile_table_narrows_n_when_tiles_are_few():
    # 32 tiles of 128x128 on 148 SMs: 64 of 128x64 still fit in one round, each K step moves fewer bytes.
    sizes = [(128, 4096, 4096, 1)]
    assert submission.choose_sm100_config(sizes, 148).tile_mn == (128, 64)
    assert (submission.sm100_predicted_us(sizes, submission.SM100_TILE_N64, 148)
            < submission.sm100_predicted_us(sizes, submission.SM100_TILE_N128, 148))
    # The same problem on 40 SMs: 64 narrow tiles would take two rounds.
    assert submission.choose_sm100_config(sizes, 40).tile_mn == (128, 128)


def test_tile_table_widens_n_over_full_waves_only_when_n_allows():
    # 296 tiles of 128x128 = two full rounds; 148 tiles of 128x256 = one, with fewer bytes per column. Long
    # K (128 steps), so that the 8 % the wide rows save per round clears the margin beside the fixed cost.
    sizes = [(128 * 37, 1024, 32768, 1)]
    assert submission.num_output_tiles(sizes, (128, 128)) == 296
    assert submission.choose_sm100_config(sizes, 148).tile_mn == (128, 256)
    # An N that is not a multiple of 256 never gets the 256 row (no partial N tiles by choice).
    odd = [(128 * 37, 1152, 32768, 1)]
    assert submission.choose_sm100_config(odd, 148).tile_mn != (128, 256)


def test_tile_table_takes_the_default_row_when_every_group_is_empty():
    # Nothing runs (custom_kernel launches nothing), but `eval.py compile` asks what a case file's all-empty
    # case would run: the default row, not a crash in the model (it had no tile to take the busiest CTA of).
    empty = [(0, 128, 256, 1), (0, 256, 512, 1)]
    assert submission.sm100_predicted_us(empty, submission.SM100_TILE_N128, 148) >= submission.SM100_FIXED_US
    assert submission.choose_sm100_config(empty, 148) is submission.SM100_TILE_TABLE[0]


def test_predicted_time_follows_the_work():
    row, fixed = submission.SM100_TILE_N128, submission.SM100_FIXED_US
    # Square enough that the K steps, not DRAM, bound it in the model: 144 tiles (one round), then 288 (two).
    one_round = submission.sm100_predicted_us([(1536, 1536, 8192, 1)], row, 148) - fixed
    two_rounds = submission.sm100_predicted_us([(3072, 1536, 8192, 1)], row, 148) - fixed
    assert 1.9 * one_round < two_rounds < 2.1 * one_round
    assert one_round == pytest.approx(32 * submission.sm100_k_step_cycles(row) / submission.SM100_CLOCK_HZ * 1e6)
    # A tall thin problem reuses nothing: DRAM bounds it.
    thin = [(128 * 148, 128, 8192, 1)]
    # at the DRAM rate measured on a B200 (gau-nernst/gpu-mode-kernels, nvidia/README.md: 5914.80 GB/s)
    dram_us = ((128 * 148 + 128) * 8192 // 2 + (128 * 148 + 128) * 8192 // 16 + 2 * 128 * 148 * 128) / 5914.80e9 * 1e6
    assert submission.sm100_predicted_us(thin, row, 148) - fixed == pytest.approx(dram_us)


def test_predicted_time_reads_no_weights_of_empty_groups():
    # Regression: the model's DRAM bytes counted B and SFB of groups with M = 0, which have no tile, so no load
    # (a MoE step with most experts empty looked weight-bound on experts it never reads).
    row, fixed = submission.SM100_TILE_N128, submission.SM100_FIXED_US
    thin = [(128 * 148, 128, 8192, 1)]  # DRAM-bound in the model (test_predicted_time_follows_the_work)
    empty_experts = [(0, 4096, 7168, 1)] * 64
    assert submission.sm100_predicted_us(thin + empty_experts, row, 148) == submission.sm100_predicted_us(thin, row, 148)
    assert submission.sm100_predicted_us(empty_experts, row, 148) == fixed
    # a non-empty group's weights still count
    one_token = [(1, 4096, 7168, 1)]
    weights_us = (4096 * 7168 // 2 + 4096 * 7168 // 16) / submission.SM100_DRAM_BYTES_PER_S * 1e6
    assert submission.sm100_predicted_us(one_token + empty_experts, row, 148) - fixed > weights_us


def test_model_constants_are_the_public_measurements():
    # The fixed cost per call is what the best documented entry (gau-nernst/gpu-mode-kernels,
    # nvidia/nvfp4_group_gemm/README.md) takes beyond its DRAM traffic at the measured rate: per benchmark,
    # its best times 27.9 / 18.8 / 8.48 / 6.43 us less the bytes every kernel must move.
    from conftest import load_task_yml
    best_us = (27.9, 18.8, 8.48, 6.43)
    left = []
    for case, measured in zip(load_task_yml()["benchmarks"], best_us):
        moved = sum((m + n) * k // 2 + (m + n) * k // 16 + 2 * m * n for m, n, k, _ in _sizes(case))
        left.append(measured - moved / 5914.80e9 * 1e6)
    assert submission.SM100_DRAM_BYTES_PER_S == 5914.80e9
    assert [round(x, 2) for x in left] == [3.45, 4.95, 5.36, 4.45]
    assert left[3] < submission.SM100_FIXED_US < sum(left) / 4  # between benchmark 3's and the mean
    # With them the model is no longer below that entry's own DRAM time on benchmark 0 (with 7.7 TB/s: 20.3 us).
    b0 = _sizes(load_task_yml()["benchmarks"][0])
    assert submission.sm100_predicted_us(b0, submission.choose_sm100_config(b0, 148), 148) > best_us[0] - left[0]


def test_tile_table_variant_is_used_on_blackwell_only_for_persistent(monkeypatch):
    sizes = [(128, 4096, 4096, 1)]
    data = (None, None, None, sizes)
    monkeypatch.setattr(submission, "_target_arch", lambda device: "sm_100a")
    monkeypatch.setattr(submission, "_device_sm_count", lambda index: 148)
    device = torch.device("cuda", 0)
    monkeypatch.setattr(submission, "KERNEL_VARIANT", "persistent")
    assert submission.kernel_config(data, device) is submission.SM100_TILE_N64
    monkeypatch.setattr(submission, "KERNEL_VARIANT", "persistent_n128")
    assert submission.kernel_config(data, device) is submission.SM100_TILE_N128
    monkeypatch.setattr(submission, "KERNEL_VARIANT", "seed")
    assert submission.kernel_config(data, device) is submission.SM100_CONFIG


def test_programmatic_dependent_launch_is_a_compile_time_choice(monkeypatch):
    # Default on for the persistent kernels of both arches, off for the seed's structure; part of the config,
    # so of the compile key: kernels built with and without it never mix.
    assert submission.USE_PDL == (os.environ.get("NVFP4_PDL", "1") == "1")
    for config in (submission.SM100_TILE_N128, submission.SM100_TILE_N64, submission.SM100_TILE_N256,
                   *submission_sm90.SM90_VARIANT_CONFIGS.values()):
        assert config.use_pdl == submission.USE_PDL
    assert not hasattr(submission.SM100_CONFIG, "use_pdl")
    off = dataclasses.replace(submission.SM100_TILE_N128, use_pdl=False)
    assert submission.compile_key(2, "sm_100a", off) != submission.compile_key(2, "sm_100a", submission.SM100_TILE_N128)


def test_bad_pdl_setting_fails_at_import():
    env = dict(os.environ, NVFP4_PDL="yes")
    proc = subprocess.run([sys.executable, "-c", "import submission"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode != 0 and "NVFP4_PDL='yes'" in proc.stderr


def test_set_pdl_changes_the_config_custom_kernel_runs(monkeypatch):
    monkeypatch.setattr(submission, "_target_arch", lambda device: "sm_90a")
    monkeypatch.setattr(submission, "_device_sm_count", lambda index: 132)
    monkeypatch.setattr(submission, "USE_PDL", submission.USE_PDL)  # restored after the test
    data = (None, None, None, [(128, 4096, 1536, 1)] * 2)
    device = torch.device("cuda", 0)
    for on in (False, True, False):
        submission.set_pdl(on)
        config = submission.kernel_config(data, device)
        assert config.use_pdl is on
        # the same tile as the table's choice, only the launch setting differs
        assert dataclasses.replace(config, use_pdl=False) == dataclasses.replace(
            submission_sm90.choose_sm90_config(data[3], 132), use_pdl=False)


def test_pinned_table_ring_hands_out_aligned_pieces_and_wraps(monkeypatch):
    monkeypatch.setattr(torch, "empty", lambda n, dtype, pin_memory: torch.arange(n, dtype=dtype))
    ring = submission.PinnedTableRing(16)
    first, second = ring.take(5), ring.take(6)
    assert (len(first), int(first[0]), len(second), int(second[0])) == (6, 0, 6, 6)  # 16-byte multiples
    third = ring.take(6)  # 12 + 6 > 16: back to the start
    assert int(third[0]) == 0 and third.data_ptr() == first.data_ptr()
    with pytest.raises(ValueError, match="exceed"):
        ring.take(17)
    for groups in (1, 2, 3, 8, 64):
        ptr_words, words = submission.table_words(groups)
        assert ptr_words % 2 == 0 and ptr_words >= 5 * groups and words - ptr_words == 2 * groups


class FakeEvent:
    """Stands in for KernelQueueEvent: logs record/query/synchronize; `done` is what query() answers."""

    def __init__(self, log):
        self.log, self.id, self.done = log, len([e for e in log if e[0] == "new"]), False
        log.append(("new", self.id))

    def record(self):
        self.log.append(("record", self.id))
        self.done = False

    def query(self):
        self.log.append(("query", self.id))
        return self.done

    def synchronize(self):
        self.log.append(("synchronize", self.id))
        self.done = True


def _fake_ring(monkeypatch, words):
    # Host memory stands in for the pinned buffer (and for device buffers): arange shows each piece's offset.
    monkeypatch.setattr(torch, "empty", lambda n, dtype, device=None, pin_memory=False: torch.arange(n, dtype=dtype))
    log = []
    return submission.PinnedTableRing(words, new_event=lambda: FakeEvent(log)), log


def _events(ring):
    return {event.id: event for _, event in ring.pending if event is not None}


def test_pinned_table_ring_first_lap_only_records(monkeypatch):
    ring, log = _fake_ring(monkeypatch, 3 * 14)
    pieces = []
    for _ in range(3):
        pieces.append(ring.take(14))
        ring.uploaded()
    assert [int(p[0]) for p in pieces] == [0, 14, 28]
    # One event per upload, recorded once; nothing queried or waited for: no word was handed out twice.
    assert log == [("new", 0), ("record", 0), ("new", 1), ("record", 1), ("new", 2), ("record", 2)]


def test_pinned_table_ring_waits_for_a_pending_upload_before_reuse(monkeypatch):
    ring, log = _fake_ring(monkeypatch, 3 * 14)
    for _ in range(3):
        ring.take(14)
        ring.uploaded()
    events = _events(ring)
    events[1].done = True  # the second upload ran; the first is still queued
    log.clear()
    piece = ring.take(14)  # the first piece's words again
    assert int(piece[0]) == 0
    assert log == [("query", 0), ("synchronize", 0)]  # waited, and only for the piece it reuses
    log.clear()
    ring.uploaded()
    assert log == [("record", 0)]  # the completed event is recorded again, not made anew
    log.clear()
    ring.take(14)  # the second piece: its upload is done, so a query and no wait
    assert log == [("query", 1)]
    ring.uploaded()
    assert ("new", 3) not in log  # steady state: one record per miss, no new event


def test_pinned_table_ring_checks_every_piece_a_larger_piece_covers_newest_first(monkeypatch):
    ring, log = _fake_ring(monkeypatch, 16)
    for _ in range(4):
        ring.take(4)
        ring.uploaded()
    events = _events(ring)
    log.clear()
    piece = ring.take(10)  # wraps; covers the first three 4-word pieces
    assert int(piece[0]) == 0 and len(piece) == 10
    # The newest first: once it is waited for, the older ones on its queue answer their query at once.
    assert log == [("query", 2), ("synchronize", 2), ("query", 1), ("synchronize", 1),
                   ("query", 0), ("synchronize", 0)]
    assert [event.id for _, event in ring.pending if event is not None] == [3]
    events[3].done = True
    log.clear()
    ring.uploaded()
    ten = ring.pending[-1][1].id  # the 10-word piece's event: a spare one, recorded again
    assert ten in (0, 1, 2) and log == [("record", ten)]
    log.clear()
    piece = ring.take(10)  # 10 + 10 > 16: wraps again; covers the 10-word piece and the last 4-word one
    assert int(piece[0]) == 0
    assert log == [("query", ten), ("synchronize", ten), ("query", 3)]


def test_pinned_table_ring_skips_pieces_whose_upload_never_launched(monkeypatch):
    ring, log = _fake_ring(monkeypatch, 2 * 14)
    ring.take(14)  # e.g. the upload raised before it was launched: no event, nothing reads the piece
    ring.take(14)
    ring.uploaded()
    log.clear()
    ring.take(14)  # reuses the first piece: nothing to wait for
    assert log == []
    with pytest.raises(RuntimeError, match="twice"):
        ring.uploaded()
        ring.uploaded()


def test_pinned_table_ring_keeps_pieces_whose_wait_failed(monkeypatch):
    ring, log = _fake_ring(monkeypatch, 2 * 14)
    for _ in range(2):
        ring.take(14)
        ring.uploaded()
    first = ring.pending[0][1]
    first.synchronize = lambda: (_ for _ in ()).throw(RuntimeError("device lost"))
    with pytest.raises(RuntimeError, match="device lost"):
        ring.take(14)
    assert len(ring.pending) == 2 and ring.pending[0][1] is first  # still guarded: the next take waits again
    first.done = True
    assert int(ring.take(14)[0]) == 0 and ring.pending[0][0] == 14


def _groups(data) -> tuple:
    """The launch-metadata key's table contents (every group's pointers, then every group's sizes), which the
    tables are packed from."""
    return submission.launch_metadata_key(data)[2]


def test_launch_metadata_records_the_upload_of_its_staging_piece(monkeypatch):
    # _build_launch_metadata launches the upload, then records the piece's event: nothing in between.
    data = _data()
    ring, log = _fake_ring(monkeypatch, 64)
    monkeypatch.setattr(submission, "_table_ring", ring)
    calls = []
    monkeypatch.setattr(submission, "compiled_kernel", lambda key: "upload kernel")
    monkeypatch.setattr(submission, "_target_arch", lambda device: "sm_90a")
    monkeypatch.setattr(submission, "_device_sm_count", lambda index: 132)
    monkeypatch.setattr(submission, "aligned_device_buffer", lambda n, align, device: torch.zeros(n // 8 + 16,
                                                                                              dtype=torch.int64))

    def make_launcher(kernel, raw_args, to_dsl=None):
        return lambda: calls.append(("upload", list(log)))

    monkeypatch.setattr(submission, "make_launcher", make_launcher)
    config = submission_sm90.choose_sm90_config(data[3], 132)
    submission._build_launch_metadata(data, torch.device("cpu"), config, _groups(data))
    assert calls == [("upload", [])]  # the upload launched before any record
    assert log == [("new", 0), ("record", 0)]
    assert ring.pending[-1][1].id == 0


def test_the_hopper_work_list_goes_up_with_the_tables(monkeypatch):
    # A new problem shape's work list is staged after the tables in the same pinned piece and copied by the
    # same upload on the kernels' queue (no torch copy, which would wait for the device); the GEMM gets its
    # address right after the three table addresses.
    data = _data(m=(96, 40, 0, 200), n=(128, 256, 384, 128), k=(256, 512, 256, 768))
    ring, _ = _fake_ring(monkeypatch, 4096)
    monkeypatch.setattr(submission, "_table_ring", ring)
    monkeypatch.setattr(submission, "compiled_kernel", lambda key: "upload kernel")
    monkeypatch.setattr(submission, "_target_arch", lambda device: "sm_90a")
    monkeypatch.setattr(submission, "_device_sm_count", lambda index: 132)
    monkeypatch.setattr(submission, "aligned_device_buffer", lambda n, align, device: torch.zeros(n // 8 + 16,
                                                                                              dtype=torch.int64))
    uploads = []
    monkeypatch.setattr(submission, "make_launcher",
                        lambda kernel, raw_args, to_dsl=None: lambda: uploads.append(tuple(raw_args)))
    to = torch.Tensor.to

    def to_no_device(self, *args, **kwargs):  # a dtype change is fine; a copy to a device would wait for it
        if "device" in kwargs or any(isinstance(x, (torch.device, str)) for x in args):
            pytest.fail("a torch copy to the device")
        return to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to_no_device)
    config = submission_sm90.SM90_VARIANT_CONFIGS["sm90_a16_mexact"]
    metadata = submission._build_launch_metadata(data, torch.device("cpu"), config, _groups(data))
    sizes = tuple(map(tuple, data[3]))
    words = submission_sm90.sm90_work_words(sizes, 132, config.widths, config.split_k)
    plan = submission_sm90.plan_sm90_work(sizes, 132, config.widths, config.split_k)
    _, table_words = submission.table_words(len(sizes))
    ((staging_address, buffer_address, count),) = uploads
    assert count == table_words + (words.numel() + 1) // 2 == metadata.tables.numel()
    staging = ring.buffer[:count]
    assert staging_address == staging.data_ptr() and buffer_address == metadata.tables.data_ptr()
    assert torch.equal(staging[table_words:].view(torch.int32)[:words.numel()], words)
    check_table_rows(staging, data)  # the tables themselves: each group's pointers, then its (m, n, k, l)
    assert metadata.work_list.data_ptr() == buffer_address + 8 * table_words
    assert metadata.launch_args[3:] == (metadata.work_list.data_ptr(), plan.num_tiles, plan.num_ctas)
    # a work list longer than the staging ring takes an ordinary copy (the tables still go by the ring)
    small = submission.PinnedTableRing(count - 1, new_event=ring.new_event)
    monkeypatch.setattr(submission, "_table_ring", small)
    monkeypatch.setattr(torch.Tensor, "to", to)
    uploads.clear()
    long = submission._build_launch_metadata(data, torch.device("cpu"), config, _groups(data))
    assert uploads[0][2] == table_words and torch.equal(long.work_list, words)
    assert long.launch_args[3] == long.work_list.data_ptr()
    monkeypatch.setattr(submission, "_table_ring", ring)
    # the 128-row build reads no work list: address 0, nothing staged after the tables
    uploads.clear()
    tile128 = submission._build_launch_metadata(data, torch.device("cpu"), submission_sm90.SM90_VARIANT_CONFIGS["sm90_tile128"],
                                             _groups(data))
    assert uploads[0][2] == table_words and tile128.work_list is None and tile128.launch_args[3] == 0


def _stub_full_path(monkeypatch):
    """custom_kernel's full path on CPU tensors with everything past the host logic stubbed out: returns
    (seen, launches): what the stubs were given, and one entry per launch."""
    seen, launches = {}, []
    monkeypatch.setattr(submission, "_prepared_calls", {})
    monkeypatch.setattr(submission, "_check_input", lambda data: ("", None))  # CPU tensors here
    monkeypatch.setattr(submission, "_check_device", lambda device: seen.setdefault("device", device))
    monkeypatch.setattr(submission, "_target_arch", lambda device: "sm_90a")
    monkeypatch.setattr(submission, "kernel_config",
                        lambda data, device: seen.setdefault("config_sizes", data[3]) and "config")
    monkeypatch.setattr(submission, "compiled_gemm",
                        lambda num_groups, arch, config: seen.setdefault("num_groups", num_groups) and "kernel")

    def launch_metadata(data, device, config, pointers):
        seen["metadata_data"] = data
        return type("Metadata", (), {"launch_args": (1, 2, 3, 4, 5)})()

    monkeypatch.setattr(submission, "launch_metadata", launch_metadata)
    monkeypatch.setattr(submission, "make_call_launcher", lambda num_groups, arch, config, kernel, metadata:
                        lambda: launches.append((kernel, metadata.launch_args)))
    return seen, launches


def test_launch_metadata_cache_is_bounded_by_device_bytes(monkeypatch):
    # Every decode step of a MoE layer is a new entry (a Hopper workspace holds the call's A as fp16): past the
    # byte bound the oldest entries go, the newest stays whatever its size, and prepared calls holding a
    # dropped entry go with it (else they would keep its device memory).
    monkeypatch.setattr(submission, "_launch_metadata", OrderedDict())
    monkeypatch.setattr(submission, "LAUNCH_METADATA_CACHE_BYTES", 1000)
    entry = lambda size: submission.LaunchMetadata(None, None, 1, 1, (), (), device_bytes=size)  # noqa: E731
    made = {name: entry(size) for name, size in (("a", 400), ("b", 300), ("c", 300), ("e", 200), ("d", 2000))}
    prepared = {("call", name): submission._PreparedCall((), (), None, made[name], ()) for name in made}
    monkeypatch.setattr(submission, "_prepared_calls", dict(prepared))
    for name in "abc":
        assert submission.cached_launch_metadata(name, lambda: made[name]) is made[name]
    assert list(submission._launch_metadata) == ["a", "b", "c"]  # 1000 bytes: at the bound
    assert submission.cached_launch_metadata("a", lambda: pytest.fail("a hit builds nothing")) is made["a"]
    submission.cached_launch_metadata("e", lambda: made["e"])
    assert list(submission._launch_metadata) == ["c", "a", "e"]  # "b" was the least recently used
    assert ("call", "b") not in submission._prepared_calls and ("call", "a") in submission._prepared_calls
    submission.cached_launch_metadata("d", lambda: made["d"])
    assert list(submission._launch_metadata) == ["d"]  # the newest stays, alone over the bound
    assert set(submission._prepared_calls) == {("call", "d")}


def test_fast_path_never_touches_the_ring(monkeypatch):
    class Untouchable:
        def __getattr__(self, name):
            raise AssertionError(f"the prepared-call path used the ring ({name})")

    _, launches = _stub_full_path(monkeypatch)
    data = _data()
    first = submission.custom_kernel(data)
    monkeypatch.setattr(submission, "_table_ring", Untouchable())
    assert submission._prepared_call(data) is not None
    out = submission.custom_kernel(data)
    assert len(launches) == 2 and all(o is c for o, (_, _, c) in zip(out, data[0])) and out is not first


@pytest.mark.parametrize("change", ["set_", "resize_", "storage_resize"])
def test_prepared_call_is_dropped_when_a_tensor_data_moves(monkeypatch, change):
    """The prepared launch holds addresses: after `set_`, a `resize_` that moves the data, or the storage made
    again under the same tensor object, the next call takes the full path (and its new addresses)."""
    seen, launches = _stub_full_path(monkeypatch)
    data = _data()
    submission.custom_kernel(data)
    assert submission._prepared_call(data) is not None
    a = data[0][1][0]
    before = a.data_ptr()
    if change == "set_":
        a.set_(a.clone())
    elif change == "resize_":
        a.resize_(a.shape[0] * 64, *a.shape[1:])
    else:
        a.untyped_storage().resize_(a.untyped_storage().nbytes() * 64)
    assert a.data_ptr() != before
    assert submission._prepared_call(data) is None
    seen.clear()
    submission.custom_kernel(data)
    assert seen["metadata_data"] is data and len(launches) == 2
    assert submission._prepared_call(data) is not None  # made again, with the new addresses


# ---------------------------------------------------------------------------------------------------------
# Groups with M = 0: accepted, never launched, their C returned as given
# ---------------------------------------------------------------------------------------------------------
def test_m_zero_passes_every_check_but_the_device():
    data = _on_meta(_data(m=(0, 40, 0), n=(128, 256, 384), k=(256, 512, 768)))
    reason = _reason(data)
    assert re.search(r"(?i)cuda|gpu", reason) and "group" not in reason.lower(), reason


def test_all_groups_empty_needs_no_device():
    # Nothing is read or launched: the CPU tensors of the generator are accepted as they are.
    data = _data(m=(0, 0), n=(128, 256), k=(256, 512))
    assert submission.can_implement(data) == (True, "")


def test_empty_groups_skip_the_stride_and_device_checks():
    # An empty group is never launched: its tensors may have any strides and be anywhere (their addresses,
    # often 0 for a tensor without elements, are never read either).
    abc, sfs, sfs_r, sizes = _data(m=(0, 0), n=(128, 256), k=(512, 256))
    a, b, c = abc[0]
    odd_a = torch.empty_strided(tuple(a.shape), (1, 0, 3), dtype=a.dtype, device="meta")
    odd_c = torch.empty_strided(tuple(c.shape), (1, 0, 7), dtype=torch.float16)
    data = ([(odd_a, b, odd_c), abc[1]], sfs, sfs_r, sizes)
    assert submission.can_implement(data) == (True, "")
    # A tensor with elements keeps its stride check, in an empty group too (b is [n, k/2, 1]).
    b_t = b.view(torch.uint8).permute(2, 1, 0).contiguous().permute(2, 1, 0).view(b.dtype)
    assert "stride" in _reason(([(a, b_t, c), abc[1]], sfs, sfs_r, sizes))


def test_empty_group_tensors_keep_their_dtype_and_shape_checks():
    data = _on_meta(_data(m=(0, 40), n=(128, 256), k=(256, 512)))
    a, _, c = data[0][0]
    sfa, _ = data[1][0]
    sfa_r, _ = data[2][0]
    meta = lambda shape, dtype: torch.empty(shape, dtype=dtype, device="meta")
    for slot, index, tensor, what in [
        (0, 2, meta((0, 128, 1), torch.float32), "dtype"),
        (0, 2, meta((1, 128, 1), torch.float16), "shape"),
        (0, 0, meta((0, 64, 1), submission.TORCH_AB_DTYPE), "shape"),
        (1, 0, torch.empty((0, 8, 1), dtype=submission.TORCH_SF_DTYPE), "shape"),
        (2, 0, meta((32, 4, 1, 4, 1, 1), submission.TORCH_SF_DTYPE), "shape"),
        (2, 0, meta(tuple(sfa_r.shape), torch.uint8), "dtype"),
    ]:
        reason = _reason(_replace(data, 0, slot, index, tensor))
        assert "group 0" in reason and "(0, 128, 256, 1)" in reason and what in reason.lower(), reason


@pytest.mark.parametrize("m", [-1, -128, 0.0, 1.5, True, None, "0"])
def test_negative_or_non_int_m_is_rejected(m):
    abc, sfs, sfs_r, sizes = _on_meta(_data(m=(0, 40), n=(128, 256), k=(256, 512)))
    reason = _reason((abc, sfs, sfs_r, [(m, 128, 256, 1), sizes[1]]))
    assert "group 0" in reason, reason
    if m in (-1, -128):
        assert "M must be at least 0" in reason


def test_generator_and_reference_handle_m_zero():
    data = _data(m=(0, 40), n=(128, 256), k=(256, 512))
    (a, b, c), (sfa, sfb), (sfa_r, sfb_r), size = data[0][0], data[1][0], data[2][0], data[3][0]
    assert (tuple(a.shape), tuple(c.shape), tuple(sfa.shape), tuple(sfa_r.shape)) == (
        (0, 128, 1), (0, 128, 1), (0, 16, 1), (32, 4, 0, 4, 4, 1))
    out = reference.ref_kernel(data)
    assert out[0] is c and out[0].shape == (0, 128, 1)


def test_first_launched_group_skips_the_empty_ones():
    assert submission.first_launched_group([(0, 128, 256, 1), (0, 256, 256, 1), (8, 128, 256, 1)]) == 2
    assert submission.first_launched_group([(64, 128, 256, 1)]) == 0
    assert submission.first_launched_group([(0, 128, 256, 1), (0, 128, 512, 1)]) is None


def test_all_empty_input_returns_every_c_and_launches_nothing(monkeypatch):
    for name in ("_check_device", "kernel_config", "compiled_gemm", "launch_metadata", "make_launcher"):
        monkeypatch.setattr(submission, name, lambda *args, _name=name, **kwargs: pytest.fail(f"{_name} called"))
    monkeypatch.setattr(submission, "_prepared_calls", {})
    data = _data(m=(0, 0, 0), n=(128, 256, 384), k=(256, 512, 256))
    cs = [c for _, _, c in data[0]]
    out = submission.custom_kernel(data)
    assert isinstance(out, list) and len(out) == 3 and all(o is c for o, c in zip(out, cs))
    assert submission._prepared_call(data) is not None  # the repeated call is a prepared one
    again = submission.custom_kernel(data)
    assert again is not out and all(o is c for o, c in zip(again, cs))


def test_empty_groups_stay_in_the_tables_and_the_compile(monkeypatch):
    # One compile per group count as given: the empty groups reach the tables (the kernels give them no
    # tile), so a new pattern of empty groups needs no new kernel.
    seen, launches = _stub_full_path(monkeypatch)
    data = _data(m=(0, 64, 0, 40), n=(128, 256, 384, 128), k=(256, 512, 256, 768))
    cs = [c for _, _, c in data[0]]
    out = submission.custom_kernel(data)
    assert len(out) == 4 and all(o is c for o, c in zip(out, cs))  # every C, in order, the same objects
    assert seen["num_groups"] == 4 and seen["config_sizes"] is data[3]
    assert seen["metadata_data"] is data
    assert seen["device"] == data[0][1][0].device  # the first non-empty group's
    assert launches == [("kernel", (1, 2, 3, 4, 5))]
    again = submission.custom_kernel(data)  # the prepared call: launches again, every C again
    assert len(launches) == 2 and all(o is c for o, c in zip(again, cs))


def test_a_new_pattern_of_empty_groups_keeps_the_compile_key():
    # What the kernels are compiled for holds the group count, never which groups are empty.
    config = submission.SM100_TILE_N128
    sizes = [[(0, 4096, 7168, 1), (8, 4096, 7168, 1), (24, 4096, 7168, 1)],
             [(5, 4096, 7168, 1), (0, 4096, 7168, 1), (0, 4096, 7168, 1)]]
    keys = {submission.compile_key(len(s), "sm_100a", config) for s in sizes}
    assert len(keys) == 1
    # ... while the launch metadata key tells them apart (the tables differ)
    assert submission.num_output_tiles(sizes[0], config.tile_mn) == 2 * 32
    assert submission.num_output_tiles(sizes[1], config.tile_mn) == 32


def test_the_table_upload_is_built_once_for_every_group_count(monkeypatch):
    # Regression: the upload kernel (its word count at run time, nothing per group count in its code) was
    # compiled anew for every group count, a compile per new MoE layer shape for nothing.
    upload = submission.TABLE_UPLOAD_CONFIG
    for arch in ("sm_100a", "sm_90a"):
        keys = {submission.compile_key(groups, arch, upload, "upload") for groups in (1, 2, 8, 64, 256)}
        assert len(keys) == 1, keys
    gemm = {submission.compile_key(groups, "sm_100a", submission.SM100_TILE_N128) for groups in (1, 2, 8)}
    assert len(gemm) == 3  # the GEMMs' tables have static layouts per group count
    built = []
    monkeypatch.setattr(submission, "_compiled_kernels", {})
    monkeypatch.setattr(submission.cute, "compile", lambda kernel, *args, **options: built.append(kernel) or kernel)
    for groups in (1, 3, 128):
        submission.compiled_kernel(submission.compile_key(groups, "sm_100a", upload, "upload"))
    assert len(built) == 1 and isinstance(built[0], submission.TableUploadKernel)


class FakeDriver:
    """cuda-python's driver module as KernelQueueEvent uses it; every call logged; `fail_record` makes the
    next cuEventRecord answer that error once."""

    def __init__(self):
        from cuda.bindings import driver

        self.CUresult = driver.CUresult
        self.calls, self.next_handle, self.fail_record, self.pending = [], 100, None, set()

    def cuEventCreate(self, flags):
        self.next_handle += 1
        self.calls.append(("create", flags, self.next_handle))
        return (self.CUresult.CUDA_SUCCESS, self.next_handle)

    def cuEventRecord(self, handle, queue):
        self.calls.append(("record", handle, queue))
        if self.fail_record is not None:
            error, self.fail_record = self.fail_record, None
            return (error,)
        self.pending.add(handle)
        return (self.CUresult.CUDA_SUCCESS,)

    def cuEventQuery(self, handle):
        self.calls.append(("query", handle))
        return (self.CUresult.CUDA_ERROR_NOT_READY if handle in self.pending else self.CUresult.CUDA_SUCCESS,)

    def cuEventSynchronize(self, handle):
        self.calls.append(("synchronize", handle))
        self.pending.discard(handle)
        return (self.CUresult.CUDA_SUCCESS,)

    def cuEventDestroy(self, handle):
        self.calls.append(("destroy", handle))
        return (self.CUresult.CUDA_SUCCESS,)


def test_kernel_queue_event_records_on_the_legacy_default_queue(monkeypatch):
    driver = FakeDriver()
    monkeypatch.setattr(submission.KernelQueueEvent, "_driver", driver)
    event = submission.KernelQueueEvent()
    assert event.query() and driver.calls == []  # nothing recorded yet: complete, no driver call
    event.record()
    assert driver.calls == [("create", 2, 101), ("record", 101, 1)]  # timing off; the legacy queue's handle
    assert submission.LEGACY_DEFAULT_QUEUE == 1
    assert not event.query()
    event.synchronize()
    assert event.query()
    driver.calls.clear()
    event.record()  # recorded again: no new event
    assert driver.calls == [("record", 101, 1)]
    # Another context (device) is current: the driver refuses the event; it is made again there.
    driver.calls.clear()
    driver.fail_record = driver.CUresult.CUDA_ERROR_INVALID_HANDLE
    event.record()
    assert driver.calls == [("record", 101, 1), ("destroy", 101), ("create", 2, 102), ("record", 102, 1)]
    driver.fail_record = driver.CUresult.CUDA_ERROR_LAUNCH_FAILED
    with pytest.raises(RuntimeError, match="cuEventRecord"):
        event.record()
    event.close()
    assert driver.calls[-1] == ("destroy", 102) and event.handle is None


def test_the_leaderboard_file_alone_names_the_missing_hopper_module(tmp_path):
    # The leaderboard receives submission.py alone: it imports and serves a B200 without the Hopper module,
    # and asking it for the Hopper backend says which file is missing, in one line.
    for name in ("submission.py", "task.py", "utils.py"):
        (tmp_path / name).write_text((ROOT / name).read_text())
    probe = ("import submission\n"
             "assert submission.backend_for_arch('sm_100a') is submission.SM100_BACKEND\n"
             "try:\n"
             "    submission.backend_for_arch('sm_90a')\n"
             "except submission.UnsupportedDeviceError as err:\n"
             "    print('ERR', err)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = proc.stdout.strip().splitlines()[-1]
    assert line.startswith("ERR ") and "submission_sm90.py" in line and "B200 only" in line


def test_the_hopper_backend_loads_from_beside_submission():
    import submission_sm90

    assert submission.backend_for_arch("sm_90a") is submission_sm90.BACKEND
    assert submission.backend_of(submission_sm90.SM90_VARIANT_CONFIGS["sm90_tile128"]) is submission_sm90.BACKEND
    with pytest.raises(submission.UnsupportedDeviceError, match="sm_80"):
        submission.backend_for_arch("sm_80")


def test_b200_tile_row_is_chosen_once_per_weight_shape(monkeypatch):
    # "persistent" picks its tile-table row on the first call of a weight shape (G, each N and K) and SM
    # count and keeps it for other M (a MoE layer's routing): 2 x 1000 rows alone would take 128x256, 0 + 8
    # rows 128x128, and each row is a kernel of its own (a compile, seconds, in a serving loop). Another
    # weight shape or SM count chooses afresh; a forced row wins.
    backend = submission.Sm100Backend()
    big, small = [(1000, 4096, 7168, 1)] * 2, [(0, 4096, 7168, 1), (8, 4096, 7168, 1)]
    assert backend.config(big, 148) is submission.SM100_TILE_N256
    assert backend.config(small, 148) is submission.SM100_TILE_N256  # the weight shape keeps its row ...
    assert backend.config(small, 132) is submission.choose_sm100_config(small, 132)  # ... per SM count
    three = small + [(8, 4096, 7168, 1)]  # another group count: chosen afresh
    assert backend.config(three, 148) is submission.choose_sm100_config(three, 148) is submission.SM100_TILE_N128
    monkeypatch.setattr(submission, "KERNEL_VARIANT", "persistent_n64")
    assert backend.config(big, 148) is submission.SM100_TILE_N64
