"""The MoE layer's stage kernels on a GPU, each against an independent statement of its stage:
- RouteKernel against test_layer's Python loop: `offs` exactly, `inverse` a bijection of the valid pairs onto the
  rows 0 .. offs[E-1] - 1 with each pair inside its expert's range, -1 for every invalid pair (-1 ids, ids out of
  range, experts of other ranks), `row_expert` each row's expert; int32 and int64 ids, E up to 1024, T up to 2048;
- GatherQuantizeKernel bit for bit against test_layer's reference quantizer (`ref_quantize`: e4m3 and e2m1 by
  nearest-even search): every finite bf16 bit pattern, scalar and per-expert global scales, the prequantized copy,
  the bf16 copy, router weights on the input; rows of no pair are never written (poisoned, they stay so);
- SiluMulKernel against SiLU(gate) * up in float64: within one bf16 rounding plus 2^-20 (fp32 exp and division),
  and its NVFP4 output bit for bit the reference quantizer of its own bf16 values; rows past offs[E-1] untouched;
- CombineKernel bit for bit against `combine.combine` (fp32 products and sums in j order, then bf16), NaN rows of
  invalid pairs masked, fp32 / bf16 / fp16 weights and none.
Skipped without an sm_90 or sm_100 GPU and nvidia-cutlass-dsl."""
import math

import pytest
import torch

from conftest import cuda_capability, have_dsl

CAPABILITY = cuda_capability()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not (have_dsl() and CAPABILITY in ((9, 0), (10, 0))),
                                                  reason="needs an sm_90 or sm_100 GPU and the DSL")]

from test_layer import loop_routing, ref_quantize  # noqa: E402

POISON = 0x7B  # a byte no stage writes where it should not


def _layer():
    import nvfp4_moe.layer as layer

    return layer


def _launch(kernel, types: str, *values):
    layer = _layer()
    launcher = layer._launcher(kernel, types, torch.cuda.current_device())
    launcher((*values, torch.cuda.current_stream().cuda_stream))


def _route(ids: torch.Tensor, num_experts: int, expert_map=None) -> tuple:
    from nvfp4_moe.routing import RouteKernel

    pairs = ids.numel()
    offs = torch.full((num_experts,), -7, dtype=torch.int32, device="cuda")
    inverse = torch.full((max(pairs, 1),), -7, dtype=torch.int32, device="cuda")
    row_expert = torch.full((max(pairs, 1),), -7, dtype=torch.int32, device="cuda")
    kernel = RouteKernel(num_experts, ids.shape[1], ids.dtype == torch.int64, expert_map is not None)
    _launch(kernel, "qqiqqqi", ids.data_ptr(), 0 if expert_map is None else expert_map.data_ptr(),
            0 if expert_map is None else expert_map.numel(), offs.data_ptr(), inverse.data_ptr(), row_expert.data_ptr(),
            ids.shape[0])
    torch.cuda.synchronize()
    return offs.cpu(), inverse[:pairs].cpu(), row_expert[:pairs].cpu()


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("mapped", [False, True])
@pytest.mark.parametrize("experts, tokens, top_k", [(16, 1, 8), (16, 37, 8), (256, 256, 8), (1024, 2048, 8),
                                                     (8, 2048, 2), (128, 5, 1)])
def test_route_kernel(dtype, mapped, experts, tokens, top_k):
    gen = torch.Generator().manual_seed(experts + tokens)
    num_global = 2 * experts if mapped else experts
    expert_map = None
    if mapped:  # this rank holds every other global expert, in a shuffled local order
        expert_map = torch.full((num_global,), -1, dtype=torch.int32)
        expert_map[1::2] = torch.randperm(experts, generator=gen).int()
    ids = torch.randint(-1, num_global + 2, (tokens, top_k), generator=gen).to(dtype)  # -1 and ids out of range
    ids[0, 0] = 0
    if dtype == torch.int64 and tokens > 1:
        ids[1, 0] = 2 ** 32 + 1  # its int32 truncation (1) is a valid expert: the kernel must see it as invalid
    offs, inverse, row_expert = _route(ids.cuda(), experts, None if expert_map is None else expert_map.cuda())
    local, counts = loop_routing(ids, experts, expert_map)
    ends = [sum(counts[:e + 1]) for e in range(experts)]
    assert offs.tolist() == ends
    valid = torch.tensor([e is not None for e in local])
    assert (inverse[~valid] == -1).all(), "an invalid pair has a row"
    rows = inverse[valid]
    assert sorted(rows.tolist()) == list(range(ends[-1])), "the valid pairs' rows are not a bijection"
    for p in valid.nonzero().flatten().tolist():
        e, r = local[p], int(inverse[p])
        assert (ends[e - 1] if e else 0) <= r < ends[e] and int(row_expert[r]) == e


def test_route_kernel_all_invalid():
    ids = torch.full((64, 8), -1, dtype=torch.int32, device="cuda")
    offs, inverse, _ = _route(ids, 32)
    assert offs.eq(0).all() and inverse.eq(-1).all()


def _gather(mode, x, inverse, row_expert, rows, hidden, top_k, gs=None, per_expert=False, x_scale=None,
            weights=None):
    from nvfp4_moe.quantize import GatherQuantizeKernel

    weight_dtype = {None: "f32", torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}[
        None if weights is None else weights.dtype]
    fp4 = mode != "bf16"
    a = torch.full((rows, hidden // 2 if fp4 else 2 * hidden), POISON, dtype=torch.uint8, device="cuda")
    a_scale = torch.full((rows, hidden // 16), POISON, dtype=torch.uint8, device="cuda")
    kernel = GatherQuantizeKernel(hidden, top_k, mode, per_expert, weights is not None, weight_dtype)
    _launch(kernel, "qqqqqqqqi", x.data_ptr(), 0 if x_scale is None else x_scale.data_ptr(), inverse.data_ptr(),
            row_expert.data_ptr(), 0 if gs is None else gs.data_ptr(), 0 if weights is None else weights.data_ptr(),
            a.data_ptr(), a_scale.data_ptr(), x.shape[0])
    torch.cuda.synchronize()
    return a.cpu(), a_scale.cpu()


def _full_range_x(tokens: int, hidden: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    bits = torch.randint(-2 ** 15, 2 ** 15, (tokens, hidden), generator=gen, dtype=torch.int32).to(torch.int16)
    x = bits.view(torch.bfloat16)
    x = torch.where(x.isfinite(), x, torch.zeros_like(x))
    # half the tokens in a narrow band per block (the scale is then set by a few values)
    band = torch.randn(tokens // 2, hidden, generator=gen) * torch.exp2(torch.randint(-20, 20, (tokens // 2, hidden // 16),
                                                                                   generator=gen).float()
                                                                     ).repeat_interleave(16, 1)
    x[: tokens // 2] = band.bfloat16()
    return x


def _routing_of(tokens: int, experts: int, top_k: int, seed: int) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]).int()
    ids[1, -1] = -1  # a padding slot
    ids[2, :] = -1  # a padding token
    ids = ids.cuda()
    from nvfp4_moe.routing import RouteKernel

    pairs = ids.numel()
    offs = torch.empty(experts, dtype=torch.int32, device="cuda")
    inverse = torch.empty(pairs, dtype=torch.int32, device="cuda")
    row_expert = torch.full((pairs,), -1, dtype=torch.int32, device="cuda")
    _launch(RouteKernel(experts, top_k, False, False), "qqiqqqi", ids.data_ptr(), 0, 0, offs.data_ptr(),
            inverse.data_ptr(), row_expert.data_ptr(), tokens)
    return ids, offs, inverse, row_expert


@pytest.mark.parametrize("per_expert", [False, True])
@pytest.mark.parametrize("gs", [1.0, 2688.0, 1e-20, 1e20])
def test_gather_quantize_bit_exact(per_expert, gs):
    tokens, experts, top_k, hidden = 48, 8, 4, 2048
    x = _full_range_x(tokens, hidden, seed=int(per_expert))
    ids, offs, inverse, row_expert = _routing_of(tokens, experts, top_k, seed=3)
    scales = torch.full((1,), gs, dtype=torch.float32)
    if per_expert:
        scales = gs * (0.5 + torch.rand(experts, generator=torch.Generator().manual_seed(9)))
    rows = tokens * top_k
    a, a_scale = _gather("fp4", x.cuda(), inverse, row_expert, rows, hidden, top_k, scales.cuda(), per_expert)
    inv, rexp, routed = inverse.cpu(), row_expert.cpu(), int(offs[-1])
    assert (a[routed:] == POISON).all() and (a_scale[routed:] == POISON).all(), "rows of no pair were written"
    pair_rows = inv.view(tokens, top_k)
    for t in range(tokens):
        for j in range(top_k):
            r = int(pair_rows[t, j])
            if r < 0:
                continue
            row_gs = scales[int(rexp[r])] if per_expert else scales[0]
            codes, sf = ref_quantize(x[t:t + 1], row_gs.double())
            assert torch.equal(a_scale[r], sf[0]), f"token {t} pair {j}: scales differ"
            assert torch.equal(a[r], codes[0]), f"token {t} pair {j}: codes differ"


def test_gather_copies_prequantized_and_bf16():
    tokens, experts, top_k, hidden = 33, 16, 8, 1024
    gen = torch.Generator().manual_seed(5)
    ids, offs, inverse, row_expert = _routing_of(tokens, experts, top_k, seed=4)
    codes = torch.randint(0, 256, (tokens, hidden // 2), generator=gen, dtype=torch.uint8)
    scales = torch.randint(0, 127, (tokens, hidden // 16), generator=gen, dtype=torch.uint8)
    rows = tokens * top_k
    a, a_scale = _gather("codes", codes.cuda(), inverse, row_expert, rows, hidden, top_k, x_scale=scales.cuda())
    x = torch.randn(tokens, hidden, generator=gen).bfloat16()
    a16, _ = _gather("bf16", x.cuda(), inverse, row_expert, rows, hidden, top_k)
    inv, routed = inverse.cpu().view(tokens, top_k), int(offs[-1])
    assert (a[routed:] == POISON).all() and (a16[routed:] == POISON).all()
    for t in range(tokens):
        for j in range(top_k):
            r = int(inv[t, j])
            if r >= 0:
                assert torch.equal(a[r], codes[t]) and torch.equal(a_scale[r], scales[t])
                assert torch.equal(a16[r].view(torch.bfloat16), x[t])


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
def test_gather_weight_on_input(wdtype):
    """k = 1: x times its router weight (rounded to bf16, as torch's x * w.to(x.dtype)) before the gather."""
    tokens, experts, hidden = 40, 8, 512
    gen = torch.Generator().manual_seed(6)
    ids, offs, inverse, row_expert = _routing_of(tokens, experts, 1, seed=6)
    x = torch.randn(tokens, hidden, generator=gen).bfloat16()
    w = torch.rand(tokens, 1, generator=gen).to(wdtype)
    weighted = x * w.to(x.dtype)
    a16, _ = _gather("bf16", x.cuda(), inverse, row_expert, tokens, hidden, 1, weights=w.cuda())
    gs = torch.tensor([600.0])
    a, a_scale = _gather("fp4", x.cuda(), inverse, row_expert, tokens, hidden, 1, gs.cuda(), weights=w.cuda())
    codes, sf = ref_quantize(weighted, 600.0)
    inv = inverse.cpu()
    for t in range(tokens):
        r = int(inv[t])
        if r >= 0:
            assert torch.equal(a16[r].view(torch.bfloat16), weighted[t])
            assert torch.equal(a[r], codes[t]) and torch.equal(a_scale[r], sf[t])


def _silu_mul(h: torch.Tensor, offs: torch.Tensor, row_expert: torch.Tensor, experts: int, inter: int, fp4: bool,
              gs=None, per_expert=False) -> tuple:
    from nvfp4_moe.activation import SiluMulKernel

    rows = h.shape[0]
    a = torch.full((rows, inter // 2 if fp4 else 2 * inter), POISON, dtype=torch.uint8, device="cuda")
    a_scale = torch.full((rows, inter // 16), POISON, dtype=torch.uint8, device="cuda")
    _launch(SiluMulKernel(experts, inter, fp4, per_expert), "qqqqqqi", h.data_ptr(), offs.data_ptr(),
            row_expert.data_ptr(), 0 if gs is None else gs.data_ptr(), a.data_ptr(), a_scale.data_ptr(), rows)
    torch.cuda.synchronize()
    return a.cpu(), a_scale.cpu()


@pytest.mark.parametrize("inter", [512, 768])
def test_silu_mul_kernel(inter):
    tokens, experts, top_k = 40, 8, 4
    ids, offs, inverse, row_expert = _routing_of(tokens, experts, top_k, seed=7)
    rows = tokens * top_k
    gen = torch.Generator().manual_seed(8)
    h = (torch.randn(rows, 2 * inter, generator=gen) * 4).bfloat16()
    h[:, :16] = torch.tensor([0.0, -0.0, 100.0, -100.0, -89.0, -88.0, 1e-30, -1e-30, 3.0, -3.0, 0.5, -0.5, 20.0,
                              -20.0, -1.2785, 1.0]).bfloat16()
    a16, _ = _silu_mul(h.cuda(), offs, row_expert, experts, inter, False)
    routed = int(offs[-1])
    assert (a16[routed:] == POISON).all(), "rows past the last end were written"
    gate, up = h[:routed].double().chunk(2, dim=-1)
    exact = gate / (1 + torch.exp(-gate)) * up
    got = a16[:routed].view(torch.bfloat16).double()
    # one bf16 rounding (2^-8 relative) of a value within 2^-20 of the exact one; below 1e-30 absolute: fp32's
    # exp overflows for gate < -88.7 (SiLU is then -0, as torch's fp32 silu) and ex2.approx flushes subnormals
    err = (got - exact).abs()
    bound = exact.abs() * (2.0 ** -8 + 2.0 ** -20) + 1e-30
    assert (err <= bound).all(), f"largest excess {(err - bound).max().item():g} at {(err - bound).argmax().item()}"
    # torch's own fp32 statement on the GPU: within one bf16 step of it (exp differs by an ulp or two)
    torch_fp32 = (torch.nn.functional.silu(gate.float().cuda()) * up.float().cuda()).bfloat16().cpu().double()
    step = torch_fp32.abs() * 2.0 ** -7 + 1e-30
    assert ((got - torch_fp32).abs() <= step).all()
    # NVFP4: the reference quantizer of the kernel's own bf16 values, bit for bit (per-expert scale)
    scales = 300.0 * (0.5 + torch.rand(experts, generator=gen))
    a, a_scale = _silu_mul(h.cuda(), offs, row_expert, experts, inter, True, scales.cuda(), True)
    rexp = row_expert.cpu()
    for r in range(routed):
        codes, sf = ref_quantize(a16[r:r + 1].view(torch.bfloat16), scales[int(rexp[r])].double())
        assert torch.equal(a[r], codes[0]) and torch.equal(a_scale[r], sf[0]), f"row {r}"
    assert (a[routed:] == POISON).all()


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16, torch.float16, None])
def test_combine_kernel_bit_exact(wdtype):
    from nvfp4_moe.combine import CombineKernel, combine
    from nvfp4_moe.routing import route

    tokens, experts, hidden = 50, 16, 1024
    top_k = 1 if wdtype is None else 8
    ids, offs, inverse, row_expert = _routing_of(tokens, experts, top_k, seed=10)
    rows = tokens * top_k
    gen = torch.Generator().manual_seed(11)
    y = (torch.randn(rows, hidden, generator=gen) * 3).bfloat16()
    y[int(offs[-1]):] = math.nan  # rows of no pair: never computed
    w = torch.rand(tokens, top_k, generator=gen).to(wdtype or torch.float32)
    out = torch.full((tokens, hidden), math.nan, dtype=torch.bfloat16, device="cuda")
    weight_dtype = None if wdtype is None else {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}[wdtype]
    yc, wc = y.cuda(), w.cuda()
    _launch(CombineKernel(hidden, top_k, weight_dtype), "qqqqi", yc.data_ptr(), inverse.data_ptr(), wc.data_ptr(),
            out.data_ptr(), tokens)
    torch.cuda.synchronize()
    # the torch statement on the same rows: its routing's rows re-pointed at the kernel's
    r = route(ids.cpu(), experts)
    inv = inverse.cpu().long()
    y_sorted = torch.full_like(y, math.nan)
    valid = inv >= 0
    y_sorted[r.inverse[valid]] = y[inv[valid]]
    expected = combine(y_sorted, r, None if wdtype is None else w)
    assert torch.equal(out.cpu().view(torch.int16), expected.view(torch.int16))
    assert out[2].eq(0).all() and not out[2].signbit().any(), "a padding token's output is +0"
