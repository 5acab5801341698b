"""bench.py --moe on the CPU: routing, the inputs it builds (as submission.can_implement takes them), its
float64 check, the floors (one case by hand), the table, the command line, and a whole run with stand-ins."""
import argparse
import math
import os
import types

import pytest
import torch

import bench
import bench_moe as bm
import reference
import submission
from conftest import bench_usage_error, dequant_f64, e2m1_value, e4m3_value

TINY = bm.MoeCase("tiny", "Tiny gate/up", 256, 512, 8, 6, top_k=2, zipf=1.5)


def _tiny_input(ms=None, seed=1):
    ms = bm.route(TINY, seed) if ms is None else ms
    return bm.make_input(TINY, ms, bm.make_weights(TINY, "cpu"), seed, "cpu")


@pytest.mark.parametrize("case", bm.MOE_CASES, ids=lambda c: c.name)
def test_routing_sends_tokens_times_top_k_rows(case):
    ms = bm.route(case, case.seed)
    assert len(ms) == case.experts and sum(ms) == case.tokens * case.top_k
    assert max(ms) <= case.tokens  # a token picks an expert at most once
    assert bm.route(case, case.seed) == ms  # seeded
    assert bm.route(case, case.seed + 1) != ms


@pytest.mark.parametrize("case", [c for c in bm.MOE_CASES if not c.name.startswith("prefill")], ids=lambda c: c.name)
def test_decode_cases_have_empty_experts_and_skew(case):
    for seed in range(case.seed, case.seed + 4):  # the timed input and the three re-routed ones
        ms = bm.route(case, seed)
        assert 0 < ms.count(0) < case.experts
        assert max(ms) > 4 * sum(ms) / case.experts  # skewed: the top expert far above the mean


@pytest.mark.parametrize("case", bm.PART_CASES, ids=lambda c: c.name)
def test_part_cases_give_every_expert_the_same_rows(case):
    for seed in (case.seed, case.seed + 1):
        assert bm.route(case, seed) == [16] * 128
    assert case.experts * case.rows == case.tokens * case.top_k
    assert bm.select_cases(case.name) == [case]


def test_part_cases_run_only_when_named():
    assert bm.select_cases(None) == list(bm.MOE_CASES)
    assert not set(bm.PART_CASES) & set(bm.MOE_CASES)
    assert [c.k for c in bm.select_cases("parts-k256,parts-k2048")] == [256, 2048]


def test_shared_weights_are_one_experts_tensors():
    own, shared = bm.make_weights(TINY, "cpu"), bm.make_weights(TINY, "cpu", shared=True)
    assert len(shared) == len(own) == TINY.experts
    assert all(w is shared[0] for w in shared)
    raw = lambda t: t.view(torch.uint8)  # noqa: E731  (torch compares no fp4 tensors)
    assert torch.equal(raw(shared[0][0]), raw(own[0][0])) and not torch.equal(raw(own[1][0]), raw(own[0][0]))


def test_default_cases_are_the_layers_asked_for():
    shapes = {(c.n, c.k, c.experts, c.tokens) for c in bm.MOE_CASES}
    assert shapes == {(4096, 7168, 256, 256), (4096, 7168, 256, 64), (7168, 2048, 256, 256),
                      (1536, 2048, 128, 512), (2048, 768, 128, 512), (4096, 7168, 32, 4096)}
    assert all(c.top_k == 8 for c in bm.MOE_CASES)
    ok = [submission.check_problem_sizes([(1, c.n, c.k, 1)]) for c in bm.MOE_CASES]
    assert all(flag for flag, _ in ok), ok


def test_inputs_have_the_layout_can_implement_accepts():
    data = _tiny_input([3, 0, 5, 0, 1, 0, 2, 1])
    ok, reason = submission.can_implement(data)
    # every layout check passed: only the device (CPU here) is refused
    assert not ok and reason.startswith("the tensors are on cpu"), reason
    (a, b, c), (sfa, sfb), (sfa_r, _) = data[0][1], data[1][1], data[2][1]
    assert a.shape == (0, 256, 1) and c.shape == (0, 256, 1) and sfa.shape == (0, 32, 1) and sfa_r.shape[2] == 0
    assert b.shape == (256, 256, 1) and sfb.shape == (256, 32, 1)
    assert data[3][:3] == [(3, 256, 512, 1), (0, 256, 512, 1), (5, 256, 512, 1)]
    # the same check refuses a wrong stride, so the assertion above can fail
    abc = list(data[0])
    a0 = abc[0][0]
    abc[0] = (torch.empty_strided(a0.shape, (1, 3, 768), dtype=a0.dtype), *abc[0][1:])
    ok, reason = submission.can_implement((abc, *data[1:]))
    assert not ok and "strides" in reason, reason


def test_inputs_are_full_range_and_outputs_poisoned():
    data = _tiny_input([40, 0, 30, 10, 0, 20, 12, 8])
    codes = torch.cat([a[:, :, 0].contiguous().view(torch.uint8).flatten() for a, _, _ in data[0]])
    assert set((codes & 15).tolist()) == set(range(16)) and set((codes >> 4).tolist()) == set(range(16))
    sfa = torch.cat([s[:, :, 0].contiguous().view(torch.uint8).flatten() for s, _ in data[1]]).tolist()
    sfb = torch.cat([s[:, :, 0].contiguous().view(torch.uint8).flatten() for _, s in data[1]]).tolist()
    for scales, top in ((sfa, 7.5), (sfb, 1.875)):
        values = [e4m3_value(c) for c in scales]
        assert max(values) == top and min(values) == -top  # both signs, the widest allowed
        assert any(0 < abs(v) < 2 ** -6 for v in values)  # subnormals
        assert not any(math.isnan(v) for v in values)
    assert all(torch.isnan(c).all() for _, _, c in data[0])


def test_decoder_matches_the_test_suites_on_every_code():
    packed = torch.arange(256, dtype=torch.uint8).repeat(2, 4)  # [2, 1024]: every byte, k = 2048
    scales = torch.arange(256, dtype=torch.uint8).view(2, 128)
    scales[scales == 0x7F], scales[scales == 0xFF] = 0x38, 0xB8  # no NaN codes
    got = bm.dequantize(packed.view(torch.float4_e2m1fn_x2), scales.view(torch.float8_e4m3fn))
    assert torch.equal(got, dequant_f64(packed.view(torch.float4_e2m1fn_x2), scales.view(torch.float8_e4m3fn)))
    assert [bm.e2m1_value(c) for c in range(16)] == [e2m1_value(c) for c in range(16)]
    assert all(bm.e4m3_value(c) == e4m3_value(c) or math.isnan(e4m3_value(c)) for c in range(256))


def test_check_passes_fp32_results_and_catches_a_wrong_element():
    data = _tiny_input()
    out = reference.ref_kernel(data)
    assert bm.worst_error_ratio(data, out) <= 1
    first = next(i for i, (m, *_) in enumerate(data[3]) if m)
    wrong = [c.clone() for c in out]
    wrong[first][0, 5, 0] += 0.01 + 0.01 * wrong[first][0, 5, 0].abs()  # about 10x the tolerance
    assert bm.worst_error_ratio(data, wrong) > 5
    wrong[first][0, 5, 0] = math.nan
    assert bm.worst_error_ratio(data, wrong) == math.inf
    assert bm.worst_error_ratio(data, out[:-1]) == math.inf
    assert bm.worst_error_ratio(data, [c[:, :128] for c in out]) == math.inf


def test_floors_from_bytes_by_hand():
    f = bm.floors(4096, 7168, [3, 0, 5])
    # fp4: 2 active experts x (B 4096 x 3584 + SFB 4096 x 448) + 8 rows x (3584 + 448) + C 8 x 4096 x 2
    assert f["fp4_bytes"] == 2 * (14_680_064 + 1_835_008) + 8 * 4032 + 65_536 == 33_127_936
    assert f["fp4_us"] == pytest.approx(33_127_936 / 4.14e12 * 1e6) == pytest.approx(8.0019, abs=1e-4)
    # bf16: 2 x 4096 x 7168 x 2 + 8 x 7168 x 2 + C; 2 x 8 x 4096 x 7168 FLOPs take 0.59 µs: bytes bound
    assert f["bf16_bytes"] == 117_440_512 + 114_688 + 65_536 and f["bf16_bound"] == "bytes"
    assert f["bf16_us"] == pytest.approx(117_620_736 / 4.14e12 * 1e6)
    prefill = bm.floors(4096, 7168, [4096])
    assert prefill["bf16_bound"] == "flops" and prefill["bf16_us"] == pytest.approx(2 * 4096 ** 2 * 7168 / 790e12 * 1e6)
    assert bm.floors(4096, 7168, [0, 0])["fp4_bytes"] == 0


def _row(**kw):
    row = bm.MoeRow(bm.MoeCase("c", "Layer", 4096, 7168, 3, 1), [3, 0, 5], first_s=12.34, compiles_first=3,
                    compiles_later=0, later_empties=[1, 0], later_host_ms=[0.91, 0.52, 0.47], worst=0.25)
    row.times.update({"kernel": 16.0, "grouped_mm": 40.0})
    for key, value in kw.items():
        setattr(row, key, value)
    return row


def test_table_cells():
    head, rule, line = bm.table_lines([_row()])
    assert head.count("|") == rule.count("|") == line.count("|") == len(bm.HEADER) + 1
    cells = [c.strip() for c in line.strip("|").split("|")]
    fp4_us, bf16_us = 33_127_936 / 4.14e12 * 1e6, 117_620_736 / 4.14e12 * 1e6
    assert cells == ["Layer (c)", "4096 × 7168", "3 (1)", "1 × 8 (5)", "16.0", f"{469_762_048 / 16e6:.1f}",
                     f"{33_127_936 / 16e3:.0f}", f"{fp4_us:.1f} ({16 / fp4_us:.2f}×)",
                     f"{bf16_us:.1f} bytes ({16 / bf16_us:.2f}×)", "40.0 (2.50×)", "-", "12.3", "0.52", "3 / 0 (1, 0)",
                     "0.250"]


def test_table_marks_failures_and_missing_values():
    cells = [c.strip() for c in bm.table_lines([_row(worst=1.5, compiles_first=None, compiles_later=None)])[2]
             .strip("|").split("|")]
    assert cells[-1] == "1.500 FAIL" and cells[-2] == "n/a / n/a (1, 0)"
    row = _row(error="RuntimeError: boom", first_s=None, later_host_ms=[])
    row.times.clear()
    cells = [c.strip() for c in bm.table_lines([row])[2].strip("|").split("|")]
    assert cells[4:7] == ["-", "-", "-"] and cells[-1] == "ERROR: RuntimeError: boom" and cells[11:13] == ["-", "-"]
    assert "×" not in cells[7] and "×" not in cells[8]


# ---------------------------------------------------------------------------------------------------------
# The command line, and a whole run on the CPU with a stand-in submission
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("args,piece", [
    (["--moe", "--moe-cases", "dsv3-up-256,nope"], "--moe-cases: unknown case 'nope'; choose from dsv3-up-256, "),
    (["--moe", "--moe-cases", ","], "--moe-cases: no case named"),
    (["--moe-cases", "dsv3-up-256"], "--moe-cases needs --moe"),
    (["--moe-calls", "5"], "--moe-calls needs --moe"),
    (["--moe-profile"], "--moe-profile needs --moe"),
    (["--moe-shared-weights"], "--moe-shared-weights needs --moe"),
    (["--moe", "--moe-calls", "0"], "--moe-calls: '0' is not a positive integer"),
    (["--moe", "--repeats", "5"], "--repeats does not apply to --moe"),
    (["--moe", "task.yml"], "a case file does not apply to --moe"),
])
def test_moe_mistakes_are_one_line_before_the_gpu_check(capsys, monkeypatch, args, piece):
    assert piece in bench_usage_error(capsys, monkeypatch, args, bm)


def test_help_lists_the_moe_cases(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--moe-cases A,B" in out and ", ".join(c.name for c in bm.MOE_CASES) in out


class StandIn:
    """A submission whose kernel is the reference and whose compile cache grows per new non-empty count, as
    today's (0b3467b) does."""

    DSL_VERSION, LAUNCH_PATH = "4.x", "prepacked"

    def __init__(self, error: float = 0.0):
        self._compiled_kernels, self.error = {}, error

    def custom_kernel(self, data):
        active = sum(1 for m, *_ in data[3] if m)
        self._compiled_kernels.setdefault(("gemm", active), None)
        out = reference.ref_kernel(data)
        for c in out:
            c += self.error
        return out


def _run(monkeypatch, capsys, stand_in, patterns=2, profile=False, shared=False):
    monkeypatch.setattr(bm, "MOE_CASES", (TINY,))
    monkeypatch.setattr(bm, "median_us", lambda fn, calls: [fn()] and 10.0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Stand-in GPU")
    args = argparse.Namespace(moe_cases=None, moe_calls=3, moe_patterns=patterns, moe_profile=profile,
                              moe_shared_weights=shared)
    code = bm.main(args, stand_in, device="cpu")
    out, err = capsys.readouterr()
    return code, out.splitlines(), err


def test_a_whole_run_prints_the_table_and_counts_compiles(monkeypatch, capsys):
    code, lines, err = _run(monkeypatch, capsys, StandIn())
    assert code == 0
    assert lines[0].startswith("| case |") and lines[1].startswith("|---|") and lines[3] == ""
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    empties = [bm.route(TINY, TINY.seed + p).count(0) for p in (1, 2)]
    seen, later = {bm.route(TINY, TINY.seed).count(0)}, 0
    for e in empties:  # the stand-in compiles once per new count of empty experts
        later += e not in seen
        seen.add(e)
    assert cells[4] == "10.0" and cells[9].startswith("10.0 (1.00×)") and cells[10].startswith("10.0 (1.00×)")
    assert float(cells[12]) > 0  # the re-routed calls' host ms (the stand-in computes on the CPU)
    assert cells[13] == f"1 / {later} ({empties[0]}, {empties[1]})"
    assert float(cells[14]) <= 1
    assert lines[4].startswith("Stand-in GPU; kernel: submission.custom_kernel (nvidia-cutlass-dsl 4.x")
    assert "[1/1] tiny" in err and "[tiny] re-routed tokens 2/2" in err


def test_the_profile_of_a_re_routed_call_goes_to_stderr(monkeypatch, capsys):
    stand_in = StandIn()
    code, lines, err = _run(monkeypatch, capsys, stand_in, patterns=1, profile=True)
    assert code == 0 and lines[0].startswith("| case |")
    profile = err.split("[tiny] profile of a re-routed call (GPU busy), by cumulative time:\n")[1]
    assert "cumulative" in profile and "custom_kernel" in profile  # pstats' table, the stand-in's entry in it
    assert "profile" not in "\n".join(lines)  # the table and its notes are unchanged


def test_a_run_on_shared_weights_checks_them_and_says_so(monkeypatch, capsys):
    seen = []
    real = bm.make_weights
    monkeypatch.setattr(bm, "make_weights", lambda case, device, shared=False: seen.append(shared)
                        or real(case, device, shared))
    code, lines, _ = _run(monkeypatch, capsys, StandIn(), patterns=1, shared=True)
    assert code == 0 and seen == [True] and float(lines[2].strip("|").split("|")[14]) <= 1
    assert bm.SHARED_WEIGHTS_NOTE in lines
    code, lines, _ = _run(monkeypatch, capsys, StandIn(), patterns=1)
    assert code == 0 and seen == [True, False] and bm.SHARED_WEIGHTS_NOTE not in lines


def test_a_wrong_kernel_fails_the_run_but_prints_the_table(monkeypatch, capsys):
    code, lines, _ = _run(monkeypatch, capsys, StandIn(error=1.0), patterns=0)
    assert code == 1 and lines[2].endswith(" FAIL |")


def test_a_case_that_raises_is_its_row(monkeypatch, capsys):
    broken = types.SimpleNamespace(custom_kernel=lambda data: (_ for _ in ()).throw(ValueError("no\nway")))
    code, lines, err = _run(monkeypatch, capsys, broken)
    assert code == 1 and lines[2].endswith("| ERROR: ValueError: no way |")
    assert "Compiles: n/a" in "\n".join(lines) and "[tiny] failed: ValueError" in err


def test_moe_mode_hands_its_options_over_with_the_dsl_disk_cache_off(monkeypatch):
    monkeypatch.setenv("CUTE_DSL_DISABLE_FILE_CACHING", "")  # restored after the test, whatever bench.py sets
    monkeypatch.delenv("CUTE_DSL_DISABLE_FILE_CACHING")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    seen = []
    monkeypatch.setattr(bm, "main", lambda args, sub: seen.append((args.moe_cases, args.moe_calls, args.moe_patterns))
                        or 0)
    assert bench.main(["--moe"]) == 0 and bench.main(["--moe", "--moe-cases", "qwen3-up-512", "--moe-calls", "7",
                                                      "--moe-patterns", "0"]) == 0
    assert seen == [(None, 20, 3), ("qwen3-up-512", 7, 0)]
    assert os.environ["CUTE_DSL_DISABLE_FILE_CACHING"] == "1"


class _Event:
    done = False

    def record(self):
        pass

    def query(self):
        return self.done


def test_a_re_routed_call_that_outlasted_the_queued_work_gets_a_note_with_its_allocations(monkeypatch):
    stats = iter([{"num_device_alloc": 5, "num_alloc_retries": 0}, {"num_device_alloc": 7, "num_alloc_retries": 1},
                  {"num_device_alloc": 7}])
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda: next(stats))
    probe = bm.DeviceWaitProbe()
    assert probe.note("x", 3.0) is None  # the queued work still ran when the call returned: no note
    _Event.done = True
    try:
        note = probe.note("dsv3-down-256 re-routed call 1", 41.6)
    finally:
        _Event.done = False
    assert note.startswith("dsv3-down-256 re-routed call 1: 41.6 ms on the host")
    assert "2 device allocations" in note and "1 allocator retries" in note
    assert bm.DeviceWaitProbe().stats == (7, 0)  # a counter this torch lacks counts as zero, not an error
