"""bench_layer.py's CPU side: options, cases, the floor's arithmetic, the routing draw, the baselines' torch pieces
(the plain-torch NVFP4 quantizer against nvfp4_moe.quantize, the torch moe_align_block_size against its loop
definition), the table; and that it needs a GPU (one line, exit 2) before touching one."""
import pytest
import torch

import bench
import bench_layer

quantize = pytest.importorskip("nvfp4_moe.quantize")


def test_options_defaults_and_quick():
    args = bench_layer.parse_args([])
    assert [c.name for c in args.cases] == ["dsv3", "qwen3", "mixtral"]
    assert args.tokens == (1, 8, 32, 128, 256, 2048) and args.repeats == 10 and not args.no_humming
    quick = bench_layer.parse_args(["--quick", "--cases", "qwen3"])
    assert quick.tokens == bench_layer.QUICK_TOKENS and quick.repeats == bench_layer.QUICK_REPEATS
    assert [c.name for c in quick.cases] == ["qwen3"]
    given = bench_layer.parse_args(["--tokens", "4,2048", "--repeats", "5", "--quick"])
    assert given.tokens == (4, 2048) and given.repeats == 5


@pytest.mark.parametrize("argv, message", [
    (["--cases", "llama"], "--cases: unknown case 'llama'; choose from dsv3, qwen3, mixtral"),
    (["--tokens", "0,8"], "expected positive integers"),
    (["--repeats", "2,3"], "expected a positive integer"),
    (["--quik"], "did you mean --quick?"),
])
def test_options_mistakes_are_one_line(capsys, argv, message):
    with pytest.raises(SystemExit) as stop:
        bench_layer.parse_args(argv)
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and "\n" not in err and message in err, err


def test_help(capsys):
    with pytest.raises(SystemExit) as stop:
        bench_layer.parse_args(["--help"])
    assert stop.value.code == 0 and "Mixtral-8x7B" in capsys.readouterr().out


def test_cases_are_the_issues():
    shapes = {c.name: (c.experts, c.hidden, c.intermediate, c.top_k) for c in bench_layer.LAYER_CASES}
    assert shapes == {"dsv3": (256, 7168, 2048, 8), "qwen3": (128, 2048, 768, 8), "mixtral": (8, 4096, 14336, 2)}


def test_floor_arithmetic():
    dsv3 = bench_layer.select_cases("dsv3")[0]
    # w13 [4096, 7168] + w2 [7168, 2048]: 3 x 2048 x 7168 values at 0.5 + 1/16 byte each
    assert bench_layer.expert_weight_bytes(dsv3) == 3 * 2048 * 7168 * 9 // 16 == 24_772_608
    assert bench_layer.floor_bytes(dsv3, 10, 8) == 10 * 24_772_608 + 2 * 8 * 7168 * 2
    assert bench_layer.floor_us(dsv3, 10, 8, 1e12) == pytest.approx((10 * 24_772_608 + 229_376) / 1e6)


def test_zipf_routing():
    qwen3 = bench_layer.select_cases("qwen3")[0]
    ids, weights = bench_layer.zipf_routing(qwen3, 256, seed=3)
    assert ids.shape == (256, 8) and ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert all(len(set(row)) == 8 for row in ids.tolist()), "top-k experts are distinct"
    assert torch.allclose(weights.sum(1), torch.ones(256))
    again, _ = bench_layer.zipf_routing(qwen3, 256, seed=3)
    assert torch.equal(ids, again) and not torch.equal(ids, bench_layer.zipf_routing(qwen3, 256, seed=4)[0])
    counts = torch.bincount(ids.flatten().long(), minlength=128)
    assert counts.max() > 3 * counts.float().mean(), "popularity is skewed"
    assert bench_layer.active_experts(ids, 128) == int((counts > 0).sum())


def test_naive_quantizer_is_nvfp4():
    """The glue's plain-torch quantizer: the same scales, and codes that differ from the exact rule only where a
    value lies on a rounding midpoint (it rounds those up, and divides where the rule multiplies by a reciprocal)."""
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 1024, generator=gen) * 3).bfloat16()
    gs = torch.tensor(448.0 * 6 / 12)
    codes, scales = bench_layer.naive_nvfp4_quant(x, gs)
    exact_codes, exact_scales = quantize.quantize_nvfp4(x, gs)
    assert torch.equal(scales.view(torch.uint8), exact_scales.view(torch.uint8))
    assert (codes == exact_codes).float().mean() > 0.99  # bytes: two codes each


def loop_alignment(flat_ids: list, num_experts: int, block: int) -> tuple:
    """humming's testing definition (moe_align_block_size): per expert its pair ids, padded to a block with the
    sentinel len(flat_ids); an expert id per block."""
    sorted_ids, expert_ids = [], []
    for e in range(num_experts):
        mine = [p for p, i in enumerate(flat_ids) if i == e]
        blocks = -(-len(mine) // block)
        sorted_ids += mine + [len(flat_ids)] * (blocks * block - len(mine))
        expert_ids += [e] * blocks
    return sorted_ids, expert_ids


@pytest.mark.parametrize("block", [1, 16, 64])
def test_align_block_size_against_loop(block):
    gen = torch.Generator().manual_seed(block)
    flat = torch.randint(0, 12, (37 * 4,), generator=gen)
    flat[flat == 5] = 4  # an empty expert
    sorted_ids, expert_ids, padded = bench.align_block_size(flat, 12, block)
    want_ids, want_experts = loop_alignment(flat.tolist(), 12, block)
    assert int(padded) == len(want_ids) and padded.dtype == torch.int32
    assert sorted_ids[:len(want_ids)].tolist() == want_ids and expert_ids[:len(want_experts)].tolist() == want_experts
    assert (sorted_ids[len(want_ids):] == len(flat)).all() and sorted_ids.numel() % block == 0
    assert sorted_ids.numel() >= len(flat) + 12 * (block - 1)  # any routing fits


def test_table_cells():
    row = bench_layer.LayerRow(bench_layer.LAYER_CASES[2], 8, 6, 100.0,
                               times={"fp4": 125.0, "glue": 300.0, "bf16": 900.0, "non-GEMM": 25.0, "host": 80.0,
                                      "graph": 110.0, "non-GEMM graph": 11.0},
                               errors={"fp4": 0.1234})
    lines = bench_layer.table_lines([row])
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    assert len(cells) == len(bench_layer.HEADER) == lines[1].count("---|")
    assert cells[:5] == ["Mixtral-8x7B (8 × top-2)", "8", "6 of 8", "125.0 (1.25×)", "-"]
    assert cells[9] == "25.0 (20%)" and cells[11:] == ["110.0", "11.0 (10%)", "0.123; -"]


def test_needs_a_gpu(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench_layer.main(["--quick"]) == 2
    assert capsys.readouterr().err.strip() == "bench_layer.py: needs a CUDA GPU (Hopper or B200)"
