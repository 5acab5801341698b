"""bench.py --moe --serving on the CPU: the command line, the cases, the GPU routing generator (run on CPU
tensors), the float64 check, the floor, the table, and a whole run with torch's GPU calls stood in for."""
import argparse
import contextlib
import math
import sys
import time
import types

import pytest
import torch

import bench
import bench_moe
import bench_serving as bs
from conftest import bench_usage_error, dequant_f64

TINY = bench_moe.MoeCase("tiny", "Tiny gate/up", 256, 512, 8, 6, top_k=2, zipf=1.5)


# ---------------------------------------------------------------------------------------------------------
# The command line and the cases
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("args,piece", [
    (["--moe", "--serving", "--serving-cases", "dsv3-up-64,nope"], "--serving-cases: unknown case 'nope'; choose "
                                                                   "from dsv3-up-64, dsv3-up-256, dsv3-down-64, "),
    (["--moe", "--serving", "--serving-cases", ","], "--serving-cases: no case named"),
    (["--serving"], "--serving needs --moe"),
    (["--moe", "--serving-steps", "5"], "--serving-steps needs --serving"),
    (["--serving-check-steps", "1"], "--serving-check-steps needs --serving"),
    (["--moe", "--serving", "--serving-steps", "0"], "--serving-steps: '0' is not a positive integer"),
    (["--moe", "--serving", "--moe-calls", "5"], "--moe-calls does not apply to --moe --serving"),
    (["--moe", "--serving", "--moe-cases", "dsv3-up-64"], "--moe-cases does not apply to --moe --serving"),
    (["--moe", "--serving", "--ab", "default", "pdl=off"], "--ab does not apply to --moe --serving"),
    (["--moe", "--serving", "task.yml"], "a case file does not apply to --moe --serving"),
])
def test_serving_mistakes_are_one_line_exit_2_before_the_gpu_check(capsys, monkeypatch, args, piece):
    assert piece in bench_usage_error(capsys, monkeypatch, args, bs)


def test_serving_hands_its_options_over_with_defaults(monkeypatch):
    monkeypatch.setenv("CUTE_DSL_DISABLE_FILE_CACHING", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench_moe, "main", lambda *a, **k: pytest.fail("ran bench_moe"))
    seen = []
    monkeypatch.setattr(bs, "main", lambda args, module: seen.append(
        (args.serving_cases, args.serving_steps, args.serving_check_steps, args.no_humming, module)) or 0)
    assert bench.main(["--moe", "--serving"]) == 0
    assert bench.main(["--moe", "--serving", "--serving-cases", "qwen3-up-512", "--serving-steps", "7",
                       "--serving-check-steps", "0", "--no-humming"]) == 0
    assert seen == [(None, 20, 3, False, bench), ("qwen3-up-512", 7, 0, True, bench)]


def test_cases_are_the_layers_asked_for_and_reuse_bench_moes():
    cases = bs.select_cases(None)
    assert [(c.name, c.n, c.k, c.experts, c.tokens, c.top_k) for c in cases] == [
        ("dsv3-up-64", 4096, 7168, 256, 64, 8), ("dsv3-up-256", 4096, 7168, 256, 256, 8),
        ("dsv3-down-64", 7168, 2048, 256, 64, 8), ("qwen3-up-512", 1536, 2048, 128, 512, 8),
        ("qwen3-down-512", 2048, 768, 128, 512, 8), ("mixtral-up-64", 28672, 4096, 8, 64, 2),
        ("prefill-dsv3-up-4096", 4096, 7168, 32, 4096, 8)]
    assert sum(c in bench_moe.MOE_CASES for c in cases) == 5  # all but DeepSeek-V3 down at 64 tokens, Mixtral
    assert [c.name for c in bs.select_cases(" qwen3-down-512,dsv3-up-64")] == ["qwen3-down-512", "dsv3-up-64"]
    import nvfp4_moe.gemm as moe

    for c in cases:  # the entry's weight shape rules (N % 128, K % 256), on meta tensors
        b, scale = moe.prepare_moe_weights(torch.empty((c.experts, c.n, c.k // 2), dtype=torch.uint8, device="meta"),
                                           torch.empty((c.experts, c.n, c.k // 16), dtype=torch.float8_e4m3fn,
                                                       device="meta"))
        assert scale.shape == (c.experts, c.n // 128, c.k // 64, 512)


# ---------------------------------------------------------------------------------------------------------
# Routing, check, floor
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", [TINY, bs.SERVING_CASES[0], bs.SERVING_CASES[3]], ids=lambda c: c.name)
def test_routing_gives_valid_offs_and_rows_gathered_by_expert(case):
    torch.manual_seed(3)
    router = bs.Router(case, torch.device("cpu"))
    rows = case.tokens * case.top_k
    token, offs = router.route()
    assert offs.dtype == torch.int32 and offs.shape == (case.experts,) and int(offs[-1]) == rows
    assert bool((offs.diff() >= 0).all()) and int(offs[0]) >= 0
    assert sorted(token.tolist()) == sorted(list(range(case.tokens)) * case.top_k)  # every token top_k times
    ends = offs.tolist()
    for e, (start, end) in enumerate(zip([0] + ends[:-1], ends)):  # a token picks an expert at most once
        assert len(set(token[start:end].tolist())) == end - start
    a, a_scale, offs2 = router.nvfp4()
    assert a.shape == (rows, case.k // 2) and a.dtype == torch.uint8 and a.is_contiguous()
    assert a_scale.shape == (rows, case.k // 16) and a_scale.dtype == torch.float8_e4m3fn
    assert not torch.equal(offs, offs2)  # a new routing per draw
    assert 0 < bs.active_experts(offs) <= case.experts


@pytest.mark.parametrize("down", [False, True], ids=["gate-up", "down"])
def test_indexed_draws_and_humming_indexed_check(down):
    """Router.indexed's shapes, and humming_indexed_peer's check on an indexed GEMM stood in for by a float64 one
    (humming's semantics: block i of the aligned ids is expert_ids[i]'s, pair p < T top-k reads A row p // top_k and
    writes out row p): right output passes, a swapped pair fails."""
    import dataclasses

    case = dataclasses.replace(TINY, name="tiny-down", layer="Tiny down") if down else TINY
    torch.manual_seed(6)
    router = bs.Router(case, torch.device("cpu"))
    a, flat = router.indexed(torch.float16)
    pairs = case.tokens * case.top_k
    assert a.shape == ((pairs if down else case.tokens), case.k) and flat.shape == (pairs,) and flat.dtype == torch.int64
    assert all(len(set(row)) == case.top_k for row in flat.view(case.tokens, case.top_k).tolist())
    b, b_scale = bs.make_weights(case, torch.device("cpu"))
    swap = []

    def indexed_gemm(n, k, experts, rows, codes, scales):
        block = 4

        def call(a, out, sorted_ids, expert_ids, padded, top_k):
            ids = sorted_ids.tolist()
            for i in range(int(padded[0]) // block):
                w = dequant_f64(codes[int(expert_ids[i])], scales[int(expert_ids[i])])
                for p in ids[i * block:(i + 1) * block]:
                    if p < rows:
                        out[p] = (a[p // top_k].double() @ w.T).to(out.dtype)
            if swap:
                out[[0, 1]] = out[[1, 0]]
        return call, block

    stub = types.SimpleNamespace(humming_indexed_gemm=indexed_gemm, align_block_size=bench.align_block_size)
    make, call, check = bs.humming_indexed_peer(stub, case, b, b_scale, router)
    inputs = make()
    assert check(*inputs) <= 1
    swap.append(True)
    assert check(*inputs) > 1


def test_offsets_are_the_cumulative_bincount():
    torch.manual_seed(4)
    for experts, rows in ((8, 12), (256, 512), (32, 32768)):
        ids = torch.randint(0, experts, (rows,)).sort().values
        ids[:rows // 3] = 0  # a popular first expert, and empty ones
        expected = torch.cumsum(torch.bincount(ids, minlength=experts), 0).to(torch.int32)
        assert torch.equal(bs.offsets(ids, torch.arange(experts)), expected)


def test_routing_is_skewed_towards_the_first_rank():
    torch.manual_seed(5)
    case = bs.SERVING_CASES[0]
    router = bs.Router(case, torch.device("cpu"))
    counts = torch.zeros(case.experts, dtype=torch.int64)
    for _ in range(4):
        offs = router.route()[1]
        rows = torch.diff(offs.long(), prepend=torch.zeros(1, dtype=torch.int64))
        assert bs.active_experts(offs) == int((rows > 0).sum()) < case.experts  # some experts empty
        counts += rows
    assert int(counts.argmax()) == int(router.log_weight.argmax())  # rank 1 gets the most rows
    assert counts.max() > 4 * counts.sum() / case.experts


def _tiny_step(seed=2):
    torch.manual_seed(seed)
    b, b_scale = bs.make_weights(TINY, torch.device("cpu"))
    a, a_scale, offs = bs.Router(TINY, torch.device("cpu")).nvfp4()
    ends = offs.tolist()
    exact = torch.cat([dequant_f64(a[s:e], a_scale[s:e]) @ dequant_f64(b[i], b_scale[i]).T
                       for i, (s, e) in enumerate(zip([0] + ends[:-1], ends))])
    return a, a_scale, b, b_scale, offs, exact


def test_check_passes_bf16_results_and_catches_a_wrong_element():
    a, a_scale, b, b_scale, offs, exact = _tiny_step()
    out = exact.to(torch.bfloat16)
    assert bs.worst_error_ratio(a, a_scale, b, b_scale, offs, out) <= 1
    wrong = out.clone()
    wrong[3, 5] = exact[3, 5] + 0.1 + 0.1 * exact[3, 5].abs()  # about 10x the tolerance
    assert bs.worst_error_ratio(a, a_scale, b, b_scale, offs, wrong) > 5
    wrong[3, 5] = math.nan
    assert bs.worst_error_ratio(a, a_scale, b, b_scale, offs, wrong) == math.inf
    assert bs.worst_error_ratio(a, a_scale, b, b_scale, offs, out[:-1]) == math.inf
    assert bs.worst_error_ratio(a, a_scale, b, b_scale, offs - 1, out) == math.inf  # offs not ending at the rows


def test_weights_are_full_range():
    b, b_scale = bs.make_weights(TINY, torch.device("cpu"))
    assert b.shape == (8, 256, 256) and b_scale.shape == (8, 256, 32)
    assert set((b & 15).flatten().tolist()) == set(range(16))
    values = [bench_moe.e4m3_value(c) for c in b_scale.view(torch.uint8).flatten().tolist()]
    assert max(values) == 1.875 and min(values) == -1.875 and any(0 < abs(v) < 2 ** -6 for v in values)
    assert torch.equal(bs.make_weights(TINY, torch.device("cpu"))[0], b)  # seeded by the case


def test_weight_floor_by_hand():
    total, us = bs.weight_floor(4096, 7168, 2, 4e12)
    assert total == 2 * (4096 * 3584 + 4096 * 448) == 33_030_144
    assert us == pytest.approx(33_030_144 / 4e12 * 1e6) == pytest.approx(8.2575, abs=1e-4)
    assert bs.weight_floor(2048, 768, 60.5, 3e12)[0] == 60.5 * (2048 * 384 + 2048 * 48)
    assert bs.weight_floor(1536, 2048, 0, 4e12) == (0, 0)
    assert bs.active_experts(torch.tensor([0, 3, 3, 8, 8], dtype=torch.int32)) == 2


def test_table_cells():
    row = bs.Row(TINY, "eager", wall=20.0, host=3.25, kernel=10.0, routing=5.0, floor=4.0, worst=0.5,
                 peers={"grouped_mm": (50.0, 40.0)})
    head, rule, line = bs.table_lines([row])
    assert head.count("|") == rule.count("|") == line.count("|") == len(bs.HEADER) + 1
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells == ["Tiny gate/up (tiny)", "6 × 2", "eager", "20.0", "3.2", "10.0", "5.0", "-", "-", "50.0", "40.0",
                     "-", "-", "-", "-", "4.0 (2.50×)", "-", "-", "0.500"]
    peers = bs.Row(TINY, "eager", kernel=10.0, floor=4.0, worst=0.5, peers={"humming indexed": (30.0, 9.0)},
                   peer_worst={"humming": 3.5, "humming indexed": 0.25})
    cells = [c.strip() for c in bs.table_lines([peers])[2].strip("|").split("|")]
    assert cells[11:17] == ["-", "-", "30.0", "9.0", "4.0 (2.50×)", "3.500 FAIL; 0.250"]
    w4a16 = bs.Row(TINY, "eager", kernel=10.0, floor=4.0, worst=0.5, worst16=2.0, peers={"w4a16": (12.0, 6.0)})
    cells = [c.strip() for c in bs.table_lines([w4a16])[2].strip("|").split("|")]
    assert cells[7:9] == ["12.0", "6.0 (1.50×)"] and cells[-2:] == ["2.000 FAIL", "0.500"]
    graph = bs.Row(TINY, "graph: GEMM alone", wall=8.0, host=1.0, floor=4.0)
    assert [c.strip() for c in bs.table_lines([graph])[2].strip("|").split("|")][-4:] == ["4.0 (2.00×)", "-", "-", "-"]
    failed = bs.Row(TINY, "eager", worst=1.5)
    assert bs.table_lines([failed])[2].endswith(" 1.500 FAIL |")


# ---------------------------------------------------------------------------------------------------------
# A whole run on the CPU: CUDA events, queues and graphs stood in for, the GEMM a float64 reference
# ---------------------------------------------------------------------------------------------------------
class _Event:
    def __init__(self, enable_timing=False):
        self.t = None

    def record(self):
        self.t = time.perf_counter()

    def elapsed_time(self, end):
        return (end.t - self.t) * 1e3


class _Graph:
    """Replays the captured function, writing its results into the tensors the capture returned."""

    def capture(self, fn):
        self.fn, self.static = fn, fn()
        return self.static

    def replay(self):
        new = self.fn()
        for old, fresh in zip(self.static or (), new or ()):
            old.copy_(fresh)


@pytest.fixture
def cpu_run(monkeypatch, capsys):
    import nvfp4_moe

    real_moe = nvfp4_moe.gemm
    def gemm(a, a_scale, b, b_scale, offs, out):  # the reference on prepared weights: decode the blocked scales
        if b.dtype == torch.int8:  # W4A16's [E, N, K/128, 64]: one row of codes per expert row
            b = b.reshape(b.shape[0], b.shape[1], -1)
        e_, n, k = b.shape[0], b.shape[1], 2 * b.shape[2]
        if b.dtype == torch.int8:  # W4A16's order of the codes back to the natural one
            nibbles = torch.stack((b.view(torch.uint8) & 15, b.view(torch.uint8) >> 4), -1).reshape(-1, k // 128, 128)
            natural = torch.empty_like(nibbles)
            natural[:, :, real_moe.w4a16_order()] = nibbles
            natural = natural.reshape(e_, n, k // 2, 2)
            b = natural[..., 0] | (natural[..., 1] << 4)
        plain = b_scale.view(torch.uint8).view(e_, n // 128, k // 64, 32, 4, 4).permute(0, 1, 4, 3, 2, 5)
        plain = plain.reshape(e_, n, k // 16).view(torch.float8_e4m3fn)
        ends = offs.tolist()
        for i, (s, e) in enumerate(zip([0] + ends[:-1], ends)):
            if e > s:
                a64 = a[s:e].double() if a_scale is None else dequant_f64(a[s:e], a_scale[s:e])  # W4A16: as it is
                out[s:e] = (a64 @ dequant_f64(b[i], plain[i]).T).to(out.dtype)
        return out

    fake_moe = types.SimpleNamespace(prepare_moe_weights=real_moe.prepare_moe_weights,
                                     nvfp4_moe_mm=lambda a, s, b, bs_, offs, out: gemm(a, s, b, bs_, offs, out))
    monkeypatch.setattr(nvfp4_moe, "gemm", fake_moe)  # what bench_serving's `import nvfp4_moe.gemm as moe` binds
    queue = types.SimpleNamespace(wait_stream=lambda other: None)
    for name, value in (("Event", _Event), ("synchronize", lambda: None), ("Stream", lambda: queue),
                        ("current_stream", lambda: queue), ("stream", lambda q: contextlib.nullcontext()),
                        ("get_device_name", lambda *a: "Stand-in GPU"), ("empty_cache", lambda: None),
                        ("_sleep", lambda cycles: None)):
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(bs, "capture", lambda fn, side: (lambda g: (g, g.capture(fn)))(_Graph()))
    monkeypatch.setattr(bs, "clear_l2_cache", lambda: None)
    monkeypatch.setattr(bs, "dram_read_rate", lambda: 4e12)
    monkeypatch.setattr(bs, "SERVING_CASES", (TINY,))

    def run(check_steps=2):
        args = argparse.Namespace(serving_cases=None, serving_steps=3, serving_check_steps=check_steps,
                                  no_humming=True)
        code = bs.main(args, bench, device="cpu")
        out, err = capsys.readouterr()
        return code, out.splitlines(), err
    return run


def test_a_whole_run_prints_three_checked_rows(cpu_run):
    code, lines, err = cpu_run()
    assert code == 0, "\n".join(lines + err.splitlines())
    assert lines[0].startswith("| case |") and lines[1].startswith("|---|") and lines[5] == ""
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:5]]
    assert [r[2] for r in rows] == ["eager", "graph: routing + GEMM", "graph: GEMM alone"]
    assert float(rows[0][-1]) <= 1 and float(rows[1][-1]) <= 1 and rows[2][-1] == "-"
    assert float(rows[0][-2]) <= 1 and rows[1][-2] == rows[2][-2] == "-"  # the W4A16 steps' check
    assert all(float(rows[0][i]) >= 0 for i in (3, 4, 5, 6, 7)) and rows[1][5] == "-"
    assert float(rows[0][8].split()[0]) >= 0 and rows[0][8].endswith("×)")  # W4A16 kernel µs (/floor)
    assert lines[6].startswith("Stand-in GPU; nvfp4_moe_mm with bf16 out; 3 steps per loop")
    assert "humming column left out (--no-humming): the humming cells stay empty." in lines
    assert "[1/1] tiny" in err and "[tiny] CUDA graphs" in err


def test_a_wrong_gemm_fails_the_run(cpu_run, monkeypatch):
    moe = sys.modules["nvfp4_moe"].gemm  # the stand-in (cpu_run)
    right = moe.nvfp4_moe_mm
    monkeypatch.setattr(moe, "nvfp4_moe_mm", lambda *a, out: right(*a, out=out).add_(1.0))
    code, lines, _ = cpu_run(check_steps=1)
    assert code == 1 and lines[2].endswith(" FAIL |") and lines[3].endswith(" FAIL |")


def test_a_wrong_w4a16_result_fails_the_run(cpu_run, monkeypatch):
    moe = sys.modules["nvfp4_moe"].gemm  # the stand-in (cpu_run)
    right = moe.nvfp4_moe_mm
    monkeypatch.setattr(moe, "nvfp4_moe_mm", lambda a, s, *rest, out: right(a, s, *rest, out=out).add_(
        1.0 if s is None else 0.0))
    code, lines, _ = cpu_run(check_steps=1)
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    assert code == 1 and cells[-2].endswith(" FAIL") and float(cells[-1]) <= 1


def test_w4a16_benchmark_table_on_tiny_shapes(cpu_run, monkeypatch):
    """The benchmark-shape table with the reference as the GEMM and time stood in for: its cells, the floor by
    hand, the checks; a wrong W4A16 output shows above 1."""
    monkeypatch.setattr(bench_moe, "median_us", lambda fn, calls: (fn(), 7.0)[1])
    cases = [([40, 0, 24], 256, 256), ([8], 128, 512)]
    lines = bs.benchmark_w4a16_lines(bench, False, 4e12, cases=cases, device="cpu")
    assert len(lines) == 4 and lines[0].startswith("| benchmark")
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    floor = (3 * (256 * 128 + 256 * 16) + 64 * 256 * 2 + 64 * 256 * 2) / 4e12 * 1e6
    assert cells[1:7] == ["7.0", "7.0", "-", "-", "7.0", f"{floor:.1f} ({7.0 / floor:.2f}×)"]
    assert [float(x) <= 1 for x in cells[7].split(";")[0].split(",")] == [True, True]
    moe = sys.modules["nvfp4_moe"].gemm  # the stand-in (cpu_run)
    right = moe.nvfp4_moe_mm
    monkeypatch.setattr(moe, "nvfp4_moe_mm", lambda *a, out: right(*a, out=out).add_(1.0))
    bad = bs.benchmark_w4a16_lines(bench, False, 4e12, cases=cases[:1], device="cpu")
    assert all(float(x) > 1 for x in bad[2].split("|")[8].split(";")[0].split(","))


def test_a_graph_that_cannot_be_captured_is_its_row_and_the_peers_still_run(cpu_run, monkeypatch):
    monkeypatch.setattr(bs, "capture", lambda fn, side: (_ for _ in ()).throw(RuntimeError("capture\nrefused")))
    code, lines, err = cpu_run(check_steps=1)
    assert code == 1 and lines[3].endswith("| ERROR: RuntimeError: capture refused |")
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    assert cells[2] == "eager" and float(cells[-1]) <= 1 and "[tiny] CUDA graphs failed" in err
    assert cells[9] != "-" or any(line.startswith("grouped_mm on tiny: failed") for line in lines)
