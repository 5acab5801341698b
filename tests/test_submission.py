"""submission.py without a GPU: the file rules of the leaderboard, validation, the launch-metadata cache key."""
import dataclasses
import os
import re
import subprocess
import sys

import pytest
import torch

import reference
import submission
from conftest import ROOT

SUBMISSION = ROOT / "submission.py"


# ---------------------------------------------------------------------------------------------------------
# The leaderboard's file rules
# ---------------------------------------------------------------------------------------------------------
def test_header_lines():
    lines = SUBMISSION.read_text().splitlines()
    assert lines[0] == "#!POPCORN leaderboard nvfp4_group_gemm"
    assert lines[1] == "#!POPCORN gpu B200"


def test_no_forbidden_word():
    # The runner rejects a file containing this word in any case (comments and identifiers too).
    assert re.search("stream", SUBMISSION.read_text(), flags=re.IGNORECASE) is None


def test_size_limit():
    assert SUBMISSION.stat().st_size < 1_000_000


def test_imports_only_what_the_runner_has():
    # One self-contained file: nothing from this repository but the runner's task.py.
    local = {"reference", "utils", "eval"}
    for line in SUBMISSION.read_text().splitlines():
        match = re.match(r"\s*(?:from|import)\s+([A-Za-z_][\w.]*)", line)
        if match:
            assert match[1].split(".")[0] not in local, line


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
        assert row.smem_bytes <= submission.SM100_DYNAMIC_SMEM_BUDGET
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
    # 296 tiles of 128x128 = two full rounds; 148 tiles of 128x256 = one, with fewer bytes per column.
    sizes = [(128 * 37, 1024, 4096, 1)]
    assert submission.num_output_tiles(sizes, (128, 128)) == 296
    assert submission.choose_sm100_config(sizes, 148).tile_mn == (128, 256)
    # An N that is not a multiple of 256 never gets the 256 row (no partial N tiles by choice).
    odd = [(128 * 37, 1152, 4096, 1)]
    assert submission.choose_sm100_config(odd, 148).tile_mn != (128, 256)


def test_predicted_time_follows_the_work():
    row, fixed = submission.SM100_TILE_N128, submission.SM100_FIXED_US
    # Square enough that the K steps, not DRAM, bound it in the model: 144 tiles (one round), then 288 (two).
    one_round = submission.sm100_predicted_us([(1536, 1536, 8192, 1)], row, 148) - fixed
    two_rounds = submission.sm100_predicted_us([(3072, 1536, 8192, 1)], row, 148) - fixed
    assert 1.9 * one_round < two_rounds < 2.1 * one_round
    assert one_round == pytest.approx(32 * submission.sm100_k_step_cycles(row) / submission.SM100_CLOCK_HZ * 1e6)
    # A tall thin problem reuses nothing: DRAM bounds it.
    thin = [(128 * 148, 128, 8192, 1)]
    dram_us = ((128 * 148 + 128) * 8192 // 2 + (128 * 148 + 128) * 8192 // 16 + 2 * 128 * 148 * 128) / 7.7e12 * 1e6
    assert submission.sm100_predicted_us(thin, row, 148) - fixed == pytest.approx(dram_us)


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
                   *submission.SM90_VARIANT_CONFIGS.values()):
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
            submission.choose_sm90_config(data[3], 132), use_pdl=False)


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
