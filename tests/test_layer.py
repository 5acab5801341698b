"""The MoE layer (nvfp4_moe.layer and its stages) on the CPU, against a reference written here from the rules, not
from the code under test: the GEMM entry replaced by an exact float64 torch GEMM (`reference_gemm`, which also
decodes the kernels' weight layouts and writes NaN into the rows past the last offset, as no expert computes them).

Reference quantizer (`ref_sf`, `ref_grid`): SF = e4m3(gs * (amax * fp32(1/6))) by nearest-even search in the table
of e4m3 values (saturated at 448), q = the nearest e2m1 grid value of x * (1 / (SF * (1 / gs))) by distance, ties
to the even code, the sign kept; fp32 arithmetic emulated in float64 (a product or quotient of fp32 values
computed in float64 and rounded to fp32 is the correctly rounded fp32 result).

The layer's bound (`reference_layer`): interval arithmetic in float64 over the stages, one rounding per stored
stage. For every valid pair the rows of GEMM1 are computed exactly from the exactly quantized x (the quantizer is
bit-exact, tested on its own), then each stage's interval widens by what can happen there:
- GEMM1 and GEMM2 in fp32: |result - exact| <= K 2^-24 sum_k |a_k w_k| (the real GEMM; the reference GEMM here:
  float64, K 2^-52), then bf16 rounding: the stored value lies in [rnd(lo), rnd(hi)] (rounding is monotone);
- SiLU(gate) * up in fp32: the exact range over the gate and up intervals (SiLU's minimum at -1.2785 taken into
  account), widened by 2^-20 of its magnitude for fp32's exp, division and product, then bf16 rounding;
- NVFP4 requantization of the activation (fp4-A path): each block's SF lies between the SFs of its smallest and
  largest possible amax; for every e4m3 value in between, q(a) * SF is monotone in a, so the dequantized value
  lies between the least q(lo) * SF and the largest q(hi) * SF;
- combine: the products y w widened by 2^-24 each, the k fp32 adds by k 2^-24 sum |terms|, then bf16 rounding.
The layer's output must lie in the final interval; with the reference GEMM most intervals have width 0 up to
the last rounding.
"""
import math

import pytest
import torch

from conftest import dequant_f64, e4m3_value

layer = pytest.importorskip("nvfp4_moe.layer")
from nvfp4_moe import combine as combine_mod  # noqa: E402
from nvfp4_moe import quantize, routing  # noqa: E402

U32 = 2.0 ** -24  # fp32 unit roundoff
U64 = 2.0 ** -53
E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
E4M3_POSITIVE = torch.tensor([e4m3_value(c) for c in range(127)], dtype=torch.float64)  # codes 0 .. 0x7E, ascending
SILU_MIN_AT = -1.2784645427610738  # SiLU's only minimum


# ---------------------------------------------------------------------------------------------------------
# The reference quantizer
# ---------------------------------------------------------------------------------------------------------
def f32(t: torch.Tensor) -> torch.Tensor:
    """float64 values rounded to fp32 (and back to float64)."""
    return t.to(torch.float32).to(torch.float64)


def ref_e4m3(v: torch.Tensor) -> tuple:
    """(codes int64, values float64) of non-negative float64 `v`: the nearest e4m3 value, ties to the even code,
    saturated at 448."""
    upper = torch.searchsorted(E4M3_POSITIVE, v.clamp(max=448.0)).clamp(max=126)
    lower = (upper - 1).clamp(min=0)
    down, up = v - E4M3_POSITIVE[lower], E4M3_POSITIVE[upper] - v
    take_lower = (down < up) | ((down == up) & (lower % 2 == 0))
    code = torch.where(take_lower, lower, upper)
    return code, E4M3_POSITIVE[code]


def ref_sf(amax: torch.Tensor, gs: torch.Tensor) -> tuple:
    """(e4m3 code, value) of the block scale of amax (float64) under global scale gs (fp32 values in float64)."""
    return ref_e4m3(f32(gs * f32(amax * f32(torch.tensor(1.0 / 6.0, dtype=torch.float64)))))


def ref_grid(x: torch.Tensor, sf: torch.Tensor, gs: torch.Tensor) -> tuple:
    """(e2m1 codes int64, their signed grid values float64) of x (float64 holding 16-bit values) at block scale
    value sf (broadcast to x) under gs: the nearest grid value of x * outs, ties to the even code, 6 beyond it."""
    out_scale = torch.where(sf != 0, f32(1.0 / f32(sf * f32(1.0 / gs))), torch.zeros_like(sf))
    v = f32(x * out_scale)
    distance = (v.abs().clamp(max=6.0).unsqueeze(-1) - E2M1_GRID).abs()  # beyond 6: saturated
    nearest = distance == distance.min(dim=-1, keepdim=True).values
    index = (nearest * (2 - torch.arange(8) % 2)).argmax(dim=-1)  # of two nearest, the even code
    negative = torch.signbit(v)
    return index + 8 * negative, torch.where(negative, -E2M1_GRID[index], E2M1_GRID[index])


def ref_quantize(x: torch.Tensor, gs) -> tuple:
    """(codes uint8 [rows, K/2] packed low nibble first, scale codes uint8 [rows, K/16]) of x [rows, K] (16-bit)
    with gs a float or float64 [rows]."""
    rows, k = x.shape
    blocks = x.double().view(rows, k // 16, 16)
    gs = torch.as_tensor(gs, dtype=torch.float64).reshape(-1, 1)
    sf_code, sf = ref_sf(blocks.abs().amax(-1), gs)
    codes = ref_grid(blocks, sf.unsqueeze(-1), gs.unsqueeze(-1))[0].view(rows, k)
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8), sf_code.to(torch.uint8)


def bf16_bits(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int16).view(torch.bfloat16)


# ---------------------------------------------------------------------------------------------------------
# The quantizer, bit for bit
# ---------------------------------------------------------------------------------------------------------
def _assert_same_quantization(x: torch.Tensor, gs: torch.Tensor):
    codes, scales = quantize.quantize_nvfp4(x, gs)
    ref_codes, ref_scales = ref_quantize(x, gs.double().expand(x.shape[0]) if gs.numel() > 1 else gs.double())
    assert scales.dtype == torch.float8_e4m3fn and codes.dtype == torch.uint8
    bad = (scales.view(torch.uint8) != ref_scales).nonzero()
    assert not len(bad), f"scale {bad[0].tolist()}: {scales.view(torch.uint8)[tuple(bad[0])]} vs {ref_scales[tuple(bad[0])]}"
    bad = (codes != ref_codes).nonzero()
    assert not len(bad), f"codes {bad[0].tolist()}: {codes[tuple(bad[0])]:#04x} vs {ref_codes[tuple(bad[0])]:#04x}"


@pytest.mark.parametrize("gs", [1.0, 672.0, 2.0 ** -7, 3.3e4])
def test_quantizer_random_rows(gs):
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(64, 512, generator=gen)
    x *= torch.exp2(torch.randint(-12, 12, (64, 32), generator=gen).float()).repeat_interleave(16, 1)
    _assert_same_quantization(x.bfloat16(), torch.tensor(gs, dtype=torch.float32))
    _assert_same_quantization(x.bfloat16(), torch.rand(64, generator=gen) * gs + gs / 4)  # a scale per row


def test_quantizer_full_range_bits():
    """Every finite bf16 bit pattern may appear (subnormals, 3e38, -0): SF saturates, SF rounds to 0, and so on."""
    gen = torch.Generator().manual_seed(3)
    bits = torch.randint(-2 ** 15, 2 ** 15, (256, 256), generator=gen, dtype=torch.int32).to(torch.int16)
    x = bits.view(torch.bfloat16)
    x = torch.where(x.isfinite(), x, torch.zeros_like(x))
    for gs in (1.0, 1e-30, 1e30):
        _assert_same_quantization(x, torch.tensor(gs))
    # blocks of one magnitude band each: the SF is then set by a few values
    small = x.float().view(256, 16, 16) * torch.exp2(-torch.arange(16.0)).view(1, 16, 1)
    _assert_same_quantization(small.view(256, 256).bfloat16(), torch.tensor(448.0))


def test_quantizer_ties_and_zeros():
    """Hand-checked codes. With gs = 1 and a block whose amax is 6, SF = 1 (6 * fp32(1/6) rounds to 1) and x * outs
    is x: the halfway points go to the even code, beyond 6 saturates, the sign stays on zero."""
    halfway = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -5.0, -0.0, 0.1, -0.1, 6.0, -6.0]
    expected = [0, 2, 2, 4, 4, 6, 6, 7, 8, 10, 14, 8, 0, 8, 7, 15]
    x = torch.tensor([halfway, [0.0] * 16, [-0.0] * 16, [1e-5] + [0.0] * 15], dtype=torch.bfloat16)
    codes, scales = quantize.quantize_nvfp4(x, torch.tensor(1.0))
    nibbles = torch.stack((codes & 15, codes >> 4), -1).view(4, 16)
    assert nibbles[0].tolist() == expected
    assert scales.view(torch.uint8)[:, 0].tolist() == [0x38, 0, 0, 0]  # 1.0, then SF 0 for the last three
    assert nibbles[1].tolist() == [0] * 16 and nibbles[2].tolist() == [8] * 16  # -0 keeps its sign
    assert nibbles[3].tolist() == [0] * 16  # 1e-5 / 6 is under half the smallest e4m3: SF 0, q 0
    _assert_same_quantization(x, torch.tensor(1.0))


def test_quantizer_saturates_scale_before_conversion():
    """Regression: torch's float8_e4m3fn conversion makes values of 480 and above NaN; SF must saturate to 448."""
    x = torch.full((1, 16), 3.0e4, dtype=torch.bfloat16)
    codes, scales = quantize.quantize_nvfp4(x, torch.tensor(1.0))
    assert scales.float().item() == 448.0 and codes.unique().tolist() == [0x77]


# ---------------------------------------------------------------------------------------------------------
# Routing against a Python loop
# ---------------------------------------------------------------------------------------------------------
def loop_routing(topk_ids, num_experts, expert_map=None):
    """(local expert of each pair or None, counts) by plain Python."""
    local = []
    for i in topk_ids.flatten().tolist():
        if expert_map is not None:
            i = int(expert_map[i]) if 0 <= i < len(expert_map) else -1
        local.append(i if 0 <= i < num_experts else None)
    return local, [local.count(e) for e in range(num_experts)]


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("mapped", [False, True])
@pytest.mark.parametrize("tokens", [0, 1, 37])
def test_routing_against_loop(dtype, mapped, tokens):
    gen = torch.Generator().manual_seed(tokens + 5 * mapped)
    num_global, top_k = 12, 3
    expert_map = None
    num_experts = num_global
    if mapped:  # rank 1 of 2 holds experts 6..11 as 0..5
        num_experts = 6
        expert_map = torch.tensor([-1] * 6 + list(range(6)), dtype=torch.int32)
    ids = torch.randint(-1, num_global + 1, (tokens, top_k), generator=gen).to(dtype)  # -1 and one out of range
    r = routing.route(ids, num_experts, expert_map)
    local, counts = loop_routing(ids, num_experts, expert_map)
    assert r.counts.tolist() == counts and r.counts.dtype == torch.int32
    assert r.offs.dtype == torch.int32 and r.offs.tolist() == [sum(counts[:e + 1]) for e in range(num_experts)]
    assert r.valid.flatten().tolist() == [e is not None for e in local]
    pairs = tokens * top_k
    assert sorted(r.order.tolist()) == list(range(pairs))
    assert torch.equal(r.order[r.inverse], torch.arange(pairs))
    # sorted rows: the valid pairs by expert, each expert's in pair order (stable), then the invalid in pair order
    expected = sorted(range(pairs), key=lambda p: (num_experts if local[p] is None else local[p], p))
    assert r.order.tolist() == expected
    assert r.row_expert.tolist() == [num_experts if local[p] is None else local[p] for p in expected]
    assert torch.equal(r.row_token, r.order // top_k)


# ---------------------------------------------------------------------------------------------------------
# The reference GEMM (replaces the entry on the CPU) and the weights' layouts
# ---------------------------------------------------------------------------------------------------------
def _w4a16_natural_k() -> torch.Tensor:
    """Natural k of nibble 2 b + h of a 128-k chunk in the W4A16 order (docs/MOE_ENTRY.md): byte b = 16 q + 4 t + j
    holds nibbles n = 2 j + h of column q's word t, at k = 32 t + 8 (n % 4) + 2 q + n // 4."""
    order = []
    for b in range(64):
        q, t, j = b // 16, (b // 4) % 4, b % 4
        for h in range(2):
            n = 2 * j + h
            order.append(32 * t + 8 * (n % 4) + 2 * q + n // 4)
    return torch.tensor(order)


def natural_codes(b: torch.Tensor) -> torch.Tensor:
    """Prepared codes (uint8 [E, N, K/2], or W4A16's int8 [E, N, K/128, 64]) -> uint8 [E, N, K/2] in k order."""
    if b.dim() == 3:
        return b
    experts, n, chunks, _ = b.shape
    raw = b.view(torch.uint8)
    nibbles = torch.stack((raw & 15, raw >> 4), -1).reshape(experts, n, chunks, 128)
    natural = torch.empty_like(nibbles)
    natural[..., _w4a16_natural_k()] = nibbles
    return (natural[..., 0::2] | (natural[..., 1::2] << 4)).reshape(experts, n, chunks * 64)


def row_major_scales(blocked: torch.Tensor) -> torch.Tensor:
    """Blocked scales [E, N/128, K/64, 512] -> [E, N, K/16]: atoms of 128 rows x 4 k-blocks, row r at byte
    (r % 32) * 16 + ((r // 32) % 4) * 4 + k-block % 4 of its atom."""
    experts, n_tiles, k_tiles, _ = blocked.shape
    atoms = blocked.view(torch.uint8).view(experts, n_tiles, k_tiles, 32, 4, 4)
    return atoms.permute(0, 1, 4, 3, 2, 5).reshape(experts, n_tiles * 128, k_tiles * 4).view(torch.float8_e4m3fn)


def decoded_weights(b: torch.Tensor, b_scale: torch.Tensor) -> torch.Tensor:
    """float64 [E, N, K] of prepared weights."""
    codes, scales = natural_codes(b), row_major_scales(b_scale)
    return torch.stack([dequant_f64(codes[e], scales[e]) for e in range(codes.shape[0])])


def reference_gemm(a, a_scale, b, b_scale, offs, alpha=None, out=None, out_dtype=torch.bfloat16):
    """The entry's contract (nvfp4_moe_mm) in float64, rounded once to bf16: rows of each expert's range times its
    weights and alpha; rows past the last end NaN (no expert computes them)."""
    a64 = a.double() if a_scale is None else dequant_f64(a, a_scale)
    w64 = decoded_weights(b, b_scale)
    result = torch.full((a.shape[0], b.shape[1]), math.nan, dtype=torch.float64)
    start = 0
    for e, end in enumerate(offs.tolist()):
        scale = 1.0 if alpha is None else float(alpha[e])
        result[start:end] = scale * (a64[start:end] @ w64[e].T)
        start = end
    result = result.to(out_dtype)
    return result if out is None else out.copy_(result)


@pytest.fixture
def exact_gemm(monkeypatch):
    monkeypatch.setattr(layer, "_expert_gemm", reference_gemm)


# ---------------------------------------------------------------------------------------------------------
# Checkpoints and the reference layer
# ---------------------------------------------------------------------------------------------------------
def make_checkpoint(experts: int, hidden: int, intermediate: int, seed: int) -> dict:
    """A ModelOpt-like layer: every e2m1 code, positive e4m3 block scales over 2^-6 .. 2 with some zeros and
    subnormals, per-expert weight global scales (w13_scale_2, w2_scale_2)."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.tensor([c for c in range(0x48) if c == 0 or c >= 0x04], dtype=torch.uint8)  # up to 2.0

    def scales(*shape):
        return pool[torch.randint(0, len(pool), shape, generator=gen)].view(torch.float8_e4m3fn)

    return dict(
        w13=torch.randint(0, 256, (experts, 2 * intermediate, hidden // 2), generator=gen, dtype=torch.uint8),
        w13_scale=scales(experts, 2 * intermediate, hidden // 16),
        w2=torch.randint(0, 256, (experts, hidden, intermediate // 2), generator=gen, dtype=torch.uint8),
        w2_scale=scales(experts, hidden, intermediate // 16),
        w13_scale_2=torch.rand(experts, generator=gen) * 0.5 + 0.25,
        w2_scale_2=torch.rand(experts, generator=gen) * 0.5 + 0.25)


def decoded_checkpoint(ckpt: dict) -> tuple:
    """float64 (w13 [E, 2I, H], w2 [E, H, I]) of the raw checkpoint."""
    return tuple(torch.stack([dequant_f64(ckpt[name][e], ckpt[name + "_scale"][e]) for e in range(len(ckpt[name]))])
                 for name in ("w13", "w2"))


def rnd(t: torch.Tensor) -> torch.Tensor:
    """float64 rounded to bf16 (and back)."""
    return t.to(torch.bfloat16).to(torch.float64)


def interval_product(al, ah, bl, bh) -> tuple:
    corners = torch.stack((al * bl, al * bh, ah * bl, ah * bh))
    return corners.min(0).values, corners.max(0).values


def silu64(g: torch.Tensor) -> torch.Tensor:
    return g / (1.0 + torch.exp(-g))


def act_interval(gl, gh, ul, uh) -> tuple:
    """The bf16 activation's range (ours: fp32 SiLU(gate) * up rounded to bf16) over gate in [gl, gh], up in
    [ul, uh]."""
    sl = torch.minimum(silu64(gl), silu64(gh))
    sl = torch.where((gl <= SILU_MIN_AT) & (SILU_MIN_AT <= gh), silu64(torch.tensor(SILU_MIN_AT)), sl)
    sh = torch.maximum(silu64(gl), silu64(gh))
    pl, ph = interval_product(sl, sh, ul, uh)
    slack = 2.0 ** -20 * torch.maximum(pl.abs(), ph.abs()) + 2.0 ** -140
    return rnd(pl - slack), rnd(ph + slack)


def requantized_interval(al, ah, gs: torch.Tensor) -> tuple:
    """The range of q * SF (NVFP4 of the bf16 activation, its codes times block scales) over a in [al, ah] per
    element; gs float64 [rows, 1]."""
    rows, width = al.shape
    lo_b, hi_b = al.view(rows, -1, 16), ah.view(rows, -1, 16)
    straddles = (lo_b <= 0) & (hi_b >= 0)
    least = torch.where(straddles, torch.zeros_like(lo_b), torch.minimum(lo_b.abs(), hi_b.abs())).amax(-1)
    most = torch.maximum(lo_b.abs(), hi_b.abs()).amax(-1)
    gs = gs.unsqueeze(-1)
    code_lo, _ = ref_sf(least, gs.squeeze(-1))
    code_hi, _ = ref_sf(most, gs.squeeze(-1))
    span = int((code_hi - code_lo).max()) if code_hi.numel() else 0
    assert span <= 3, f"the activation's interval spans {span + 1} block scales (at most 4 are followed)"
    dl = torch.full_like(lo_b, math.inf)
    dh = torch.full_like(lo_b, -math.inf)
    for step in range(4):
        code = (code_lo + step).clamp(max=126)
        live = (code_lo + step <= code_hi).unsqueeze(-1)
        sf = E4M3_POSITIVE[code].unsqueeze(-1)
        low = ref_grid(lo_b, sf, gs)[1] * sf
        high = ref_grid(hi_b, sf, gs)[1] * sf
        dl = torch.where(live, torch.minimum(dl, low), dl)
        dh = torch.where(live, torch.maximum(dh, high), dh)
    return dl.view(rows, width), dh.view(rows, width)


def gemm_interval(al, ah, w, alpha: float, fp32_terms: bool) -> tuple:
    """Range of the stored bf16 GEMM output for inputs in [al, ah] (rows) times w [N, K] and alpha: the exact
    range, the accumulation bound (fp32: K 2^-24, else float64's K 2^-52) of sum |a w|, then bf16 rounding."""
    mid, rad = (al + ah) / 2, (ah - al) / 2
    centre = alpha * (mid @ w.T)
    k = w.shape[1]
    spread = abs(alpha) * (rad @ w.abs().T) + abs(alpha) * k * (U32 if fp32_terms else 2 * U64) * (
        (mid.abs() + rad) @ w.abs().T)
    return rnd(centre - spread), rnd(centre + spread)


def reference_layer(ckpt: dict, x, topk_ids, topk_weights, path: str, g1, g2, gs1=None, gs2=None, expert_map=None,
                    on_input=False, x_q=None, fp32_gemm=False) -> tuple:
    """(lo, hi, sum of |terms|) float64 [T, H]: the interval of the layer's bf16 output (module docstring) for
    the raw checkpoint `ckpt` with alphas g1, g2 [E]; path "fp4" (gs1, gs2 floats or [E]), "fp4 prequantized"
    (x_q = (codes, scales), gs2) or "w4a16"; fp32_gemm: the GEMMs accumulate in fp32 (the real entry)."""
    w13, w2 = decoded_checkpoint(ckpt)
    experts, two_i, hidden = w13.shape
    tokens, top_k = topk_ids.shape
    local, _ = loop_routing(topk_ids, experts, expert_map)
    lo = torch.zeros(tokens, hidden, dtype=torch.float64)
    hi = torch.zeros_like(lo)
    terms = torch.zeros_like(lo)
    slack = torch.zeros_like(lo)
    weights = topk_weights.double()
    if on_input:
        x = (x.double() * topk_weights.to(torch.bfloat16).double()).to(torch.bfloat16)

    def per_expert(scale, e):
        return float(torch.as_tensor(scale).reshape(-1)[e if torch.as_tensor(scale).numel() > 1 else 0])

    for e in range(experts):
        pairs = [p for p in range(tokens * top_k) if local[p] == e]
        if not pairs:
            continue
        rows = torch.tensor(pairs) // top_k
        if path == "fp4":
            codes, scale_codes = ref_quantize(x[rows], per_expert(gs1, e))
            a = dequant_f64(codes, scale_codes.view(torch.float8_e4m3fn))
        elif path == "fp4 prequantized":
            a = dequant_f64(x_q[0][rows], x_q[1][rows])
        else:
            a = x[rows].double()
        hl, hh = gemm_interval(a, a, w13[e], float(g1[e]), fp32_gemm)
        half = two_i // 2
        al, ah = act_interval(hl[:, :half], hh[:, :half], hl[:, half:], hh[:, half:])
        if path != "w4a16":
            gs = torch.full((len(pairs), 1), per_expert(gs2, e), dtype=torch.float64)
            al, ah = requantized_interval(al, ah, gs)
        yl, yh = gemm_interval(al, ah, w2[e], float(g2[e]), fp32_gemm)
        for p, yl_p, yh_p in zip(pairs, yl, yh):
            t, j = divmod(p, top_k)
            w = torch.tensor(1.0, dtype=torch.float64) if on_input else weights[t, j]
            tl, th = interval_product(yl_p, yh_p, w, w)
            size = torch.maximum(tl.abs(), th.abs())
            lo[t] += tl
            hi[t] += th
            terms[t] += size
            slack[t] += U32 * size
    slack += top_k * U32 * terms
    return rnd(lo - slack), rnd(hi + slack), terms


def assert_within(out: torch.Tensor, bounds: tuple, what: str):
    lo, hi = bounds[:2]
    o = out.double()
    bad = ~((lo <= o) & (o <= hi))
    if bad.any():
        t, h = bad.nonzero()[0].tolist()
        raise AssertionError(f"{what}: out[{t}, {h}] = {o[t, h].item()!r} outside [{lo[t, h].item()!r}, "
                             f"{hi[t, h].item()!r}] ({int(bad.sum())} of {bad.numel()} elements)")


class Case:
    """A small layer (by default E 8, H 256, I 384: padded to 512) with routed tokens: experts 2 and 5 never chosen,
    a padding token (all -1) and a padding slot, router weights in [0.1, 1.1). Its tensors live on the CPU; the
    layer runs on `device` (the CPU with the reference GEMM, or a GPU), the reference always on the CPU."""

    def __init__(self, tokens: int, top_k: int = 4, seed: int = 0, experts: int = 8, hidden: int = 256,
                 intermediate: int = 384, device: str = "cpu"):
        gen = torch.Generator().manual_seed(seed)
        self.ckpt = make_checkpoint(experts, hidden, intermediate, seed)
        self.experts, self.hidden, self.top_k, self.device = experts, hidden, top_k, torch.device(device)
        x = torch.randn(tokens, hidden, generator=gen)
        x *= torch.exp2(torch.randint(-3, 3, (tokens, hidden // 16), generator=gen).float()).repeat_interleave(16, 1)
        self.x = x.bfloat16()
        chosen = torch.tensor([e for e in range(experts) if e not in (2, 5)])
        scores = torch.rand(tokens, len(chosen), generator=gen)
        self.topk_ids = chosen[scores.topk(top_k, dim=1).indices].to(torch.int32)
        if tokens > 2:
            self.topk_ids[1] = -1  # a padding token
            self.topk_ids[2, -1] = -1  # a padding slot
        self.topk_weights = torch.rand(tokens, top_k, generator=gen) + 0.1
        self.gs1 = torch.tensor(448.0 * 6 / 8)  # |x| up to about 8: 4 x 2^2
        self.gs1_per_expert = self.gs1 * torch.exp2(torch.randint(-2, 3, (experts,), generator=gen).float())
        # a2_gscale from the activations' largest magnitude (every token through every expert): a few blocks' SF
        # saturate at 448, most do not
        w13 = decoded_checkpoint(self.ckpt)[0] * self.ckpt["w13_scale_2"].double().view(-1, 1, 1)
        gate, up = (self.x.double() @ w13.transpose(1, 2)).chunk(2, dim=-1)
        largest = float((silu64(gate) * up).abs().max()) if tokens else 1.0
        self.gs2 = torch.tensor(448.0 * 6 / largest * 4)

    def on(self, t):
        """t on the layer's device (None as it is)."""
        return None if t is None else t.to(self.device)

    def weights(self, w4a16: bool, gs1=None, experts: slice = slice(None)):
        """prepare_moe_layer's weights (of the experts in `experts`) with each path's alphas (module docstring of
        nvfp4_moe.layer), on the layer's device."""
        c = {name: self.on(t[experts]) for name, t in self.ckpt.items()}
        gs1 = self.gs1 if gs1 is None else gs1
        if w4a16:
            g1, g2 = c["w13_scale_2"], c["w2_scale_2"]
        else:
            g1 = c["w13_scale_2"] * (1.0 / self.on(gs1 if gs1.numel() == 1 else gs1[experts]))
            g2 = c["w2_scale_2"] * (1.0 / self.on(self.gs2))
        return layer.prepare_moe_layer(c["w13"], c["w13_scale"], c["w2"], c["w2_scale"], g1.float().contiguous(),
                                       g2.float().contiguous(), w4a16=w4a16)

    def inputs(self, path: str, expert_map=None, on_input=False) -> tuple:
        """(x, topk_ids, topk_weights, the other keyword arguments) of `path` (one of PATHS) on the layer's device; a
        per-expert a1_gscale is the local experts' (as an engine holds it)."""
        gs1 = _local(self.gs1_per_expert if path == "fp4 per-expert gs" else self.gs1, expert_map)
        kwargs = dict(expert_map=self.on(expert_map), apply_router_weight_on_input=on_input)
        x = self.x
        if path == "fp4 prequantized":
            x, scales = self.prequantized()
            kwargs.update(a2_gscale=self.on(self.gs2), x_scale=self.on(scales))
        elif path != "w4a16":
            kwargs.update(a1_gscale=self.on(gs1), a2_gscale=self.on(self.gs2))
        return self.on(x), self.on(self.topk_ids), self.on(self.topk_weights), kwargs

    def call(self, path: str, weights, expert_map=None, on_input=False):
        """The layer's output on `path` with the case's inputs."""
        x, ids, tw, kwargs = self.inputs(path, expert_map, on_input)
        return layer.nvfp4_moe_layer(x, ids, tw, weights, **kwargs)

    def prequantized(self) -> tuple:
        codes, scales = ref_quantize(self.x, float(self.gs1))
        return codes, scales.view(torch.float8_e4m3fn)

    def reference(self, path: str, weights, expert_map=None, on_input=False) -> tuple:
        """reference_layer's bounds for `path` and the prepared `weights`' alphas (fp32 GEMMs off the CPU)."""
        gs1 = self.gs1_per_expert if path == "fp4 per-expert gs" else self.gs1
        return reference_layer(_local_ckpt(self.ckpt, expert_map), self.x, self.topk_ids, self.topk_weights,
                               "fp4" if path == "fp4 per-expert gs" else path, weights.g1_alphas.cpu(),
                               weights.g2_alphas.cpu(), gs1=_local(gs1, expert_map), gs2=self.gs2,
                               expert_map=expert_map, on_input=on_input,
                               x_q=self.prequantized() if path == "fp4 prequantized" else None,
                               fp32_gemm=self.device.type != "cpu")


PATHS = ("fp4", "fp4 per-expert gs", "fp4 prequantized", "w4a16")


def run_path(case: Case, path: str, expert_map=None, weights=None, on_input=False) -> tuple:
    """(layer output on the CPU, reference bounds) of one path on `case`."""
    gs1 = case.gs1_per_expert if path == "fp4 per-expert gs" else case.gs1
    w = weights or case.weights(path == "w4a16", gs1)
    out = case.call(path, w, expert_map, on_input)
    return out.cpu(), case.reference(path, w, expert_map, on_input)


def _local(values, expert_map):
    """A per-expert tensor's entries of the local experts (expert_map's order); scalars as they are."""
    if expert_map is None or values.numel() == 1:
        return values
    order = sorted((int(local), g) for g, local in enumerate(expert_map.tolist()) if local >= 0)
    return values[[g for _, g in order]]


def _local_ckpt(ckpt: dict, expert_map) -> dict:
    if expert_map is None:
        return ckpt
    return {name: _local(t, expert_map) for name, t in ckpt.items()}


def check_expert_parallel(case: Case, path: str, ranks: int):
    """Each of `ranks` ranks holds E / ranks experts (its slice of the checkpoint and an expert_map); its output is
    within its experts' reference bounds, and the shares sum to the whole layer within each output's bf16 rounding
    (half an ulp: at most 2^-8 of its magnitude), the fp32 sums' different grouping (k 2^-24 sum |terms| each) and
    the widths of the outputs' intervals (a real GEMM's rows may round differently in the two calls)."""
    full, full_ref = run_path(case, path)
    total = torch.zeros(full.shape, dtype=torch.float64)
    sizes = full.double().abs()
    widths = full_ref[1] - full_ref[0]
    per = case.experts // ranks
    for rank in range(ranks):
        mine = slice(rank * per, (rank + 1) * per)
        expert_map = torch.full((case.experts,), -1, dtype=torch.int32)
        expert_map[mine] = torch.arange(per, dtype=torch.int32)
        gs1 = case.gs1_per_expert if path == "fp4 per-expert gs" else case.gs1
        weights = case.weights(path == "w4a16", gs1, mine)
        out, ref = run_path(case, path, expert_map=expert_map, weights=weights)
        assert_within(out, ref, f"{path}, rank {rank} of {ranks}")
        total += out.double()
        sizes += out.double().abs()
        widths += ref[1] - ref[0]
    bound = 2.0 ** -8 * sizes + 2 * case.top_k * U32 * full_ref[2] + widths
    worst = ((total - full.double()).abs() - bound).max()
    assert worst <= 0, f"{path}: the {ranks} ranks' outputs sum to the layer only within {worst} more than the bound"


# ---------------------------------------------------------------------------------------------------------
# The layer
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("tokens", [0, 1, 33])
def test_layer_against_reference(exact_gemm, path, tokens):
    case = Case(tokens)
    out, ref = run_path(case, path)
    assert out.shape == (tokens, case.hidden) and out.dtype == torch.bfloat16
    assert_within(out, ref, path)
    if tokens > 2:
        assert out[1].eq(0).all() and not out[1].signbit().any(), "a padding token's output is +0"
        width = (ref[1] - ref[0]).abs().median() / ref[0].abs().median()
        assert width < 2.0 ** -6, f"the reference interval is too wide to test anything: {width}"


def test_layer_weights_on_input(exact_gemm):
    case = Case(9, top_k=1, seed=2)
    for path in ("fp4", "w4a16"):
        out, ref = run_path(case, path, on_input=True)
        assert_within(out, ref, f"{path}, weights on input")
    with pytest.raises(ValueError, match=r"^nvfp4_moe_layer: apply_router_weight_on_input needs top-k 1"):
        run_path(Case(4, top_k=2), "fp4", on_input=True)


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("path", ["fp4", "fp4 per-expert gs", "w4a16"])
def test_expert_parallel_ranks_sum_to_layer(exact_gemm, ranks, path):
    check_expert_parallel(Case(33, seed=4), path, ranks)


def test_layer_is_deterministic(exact_gemm):
    case = Case(33, seed=6)
    w = case.weights(False)
    first = layer.nvfp4_moe_layer(case.x, case.topk_ids, case.topk_weights, w, case.gs1, case.gs2)
    for _ in range(3):
        again = layer.nvfp4_moe_layer(case.x, case.topk_ids, case.topk_weights, w, case.gs1, case.gs2)
        assert torch.equal(first.view(torch.int16), again.view(torch.int16))


def test_layer_into_out(exact_gemm):
    case = Case(5, seed=8)
    w = case.weights(True)
    expected = layer.nvfp4_moe_layer(case.x, case.topk_ids, case.topk_weights, w)
    out = torch.full_like(expected, math.nan)
    assert layer.nvfp4_moe_layer(case.x, case.topk_ids, case.topk_weights, w, out=out) is out
    assert torch.equal(out, expected)


def test_combine_masks_nan_rows():
    """Rows past the last offset may hold anything (NaN): an invalid pair adds exactly 0, never NaN * 0."""
    ids = torch.tensor([[0, -1], [-1, -1], [1, 0]])
    r = routing.route(ids, 2)
    y = torch.full((6, 8), math.nan, dtype=torch.bfloat16)
    y[:int(r.offs[-1])] = 1.0
    out = combine_mod.combine(y, r, torch.full((3, 2), 0.5))
    assert out.tolist() == [[0.5] * 8, [0.0] * 8, [1.0] * 8]


def test_real_gemm_refuses_cpu_tensors():
    case = Case(3)
    with pytest.raises(ValueError, match="runs on a CUDA GPU"):
        layer.nvfp4_moe_layer(case.x, case.topk_ids, case.topk_weights, case.weights(False), case.gs1, case.gs2)


# ---------------------------------------------------------------------------------------------------------
# Preparation: layouts, the K padding, the rules
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("w4a16", [False, True])
def test_prepare_pads_intermediate_with_zeros(w4a16):
    case = Case(1, seed=9)
    c, w = case.ckpt, case.weights(w4a16)
    assert (w.intermediate, w.padded_intermediate, w.hidden, w.num_experts, w.w4a16) == (384, 512, 256, 8, w4a16)
    w13, w2 = decoded_weights(w.w13, w.w13_scale), decoded_weights(w.w2, w.w2_scale)
    raw13, raw2 = decoded_checkpoint(c)
    assert torch.equal(w13[:, :384], raw13[:, :384]) and torch.equal(w13[:, 512:896], raw13[:, 384:])
    assert not w13[:, 384:512].any() and not w13[:, 896:].any()
    assert torch.equal(w2[:, :, :384], raw2) and not w2[:, :, 384:].any()


def test_prepare_rules():
    c = make_checkpoint(2, 256, 64, 0)
    args = [c["w13"], c["w13_scale"], c["w2"], c["w2_scale"], c["w13_scale_2"], c["w2_scale_2"]]
    assert layer.prepare_moe_layer(*args).padded_intermediate == 256  # I = 64: padded 4x (allowed, costly)
    bad_h = make_checkpoint(2, 384, 256, 0)
    with pytest.raises(ValueError, match=r"^prepare_moe_layer: H = 384 must be a multiple of 256"):
        layer.prepare_moe_layer(bad_h["w13"], bad_h["w13_scale"], bad_h["w2"], bad_h["w2_scale"],
                                bad_h["w13_scale_2"], bad_h["w2_scale_2"])
    with pytest.raises(ValueError, match=r"^prepare_moe_layer: w2_scale must be \[2, 256, 4\]"):
        layer.prepare_moe_layer(*args[:3], c["w2_scale"][:, :, :2], *args[4:])
    with pytest.raises(ValueError, match=r"^prepare_moe_layer: g1_alphas and g2_alphas must be float32"):
        layer.prepare_moe_layer(*args[:4], c["w13_scale_2"].double(), c["w2_scale_2"])


def test_layer_checks_name_the_rule():
    case = Case(4)
    fp4, w16 = case.weights(False), case.weights(True)
    x, ids, tw = case.x, case.topk_ids, case.topk_weights
    calls = [
        (lambda: layer.nvfp4_moe_layer(x, ids, tw, fp4), "W4A16 path: its weights come from"),
        (lambda: layer.nvfp4_moe_layer(x, ids, tw, w16, case.gs1, case.gs2), "NVFP4 activations take weights"),
        (lambda: layer.nvfp4_moe_layer(x, ids, tw, fp4, case.gs1), "the fp4-A path needs a2_gscale"),
        (lambda: layer.nvfp4_moe_layer(x, ids, tw, fp4, case.gs1, case.gs2, activation="gelu"), "activation 'gelu'"),
        (lambda: layer.nvfp4_moe_layer(x, ids.float(), tw, fp4, case.gs1, case.gs2), "topk_ids must be"),
        (lambda: layer.nvfp4_moe_layer(x, ids, tw[:, :1], fp4, case.gs1, case.gs2), "topk_weights must be"),
        (lambda: layer.nvfp4_moe_layer(x.half(), ids, tw, fp4, case.gs1, case.gs2), "x must be bfloat16"),
        (lambda: layer.nvfp4_moe_layer(x, ids, tw, fp4, case.gs1.double(), case.gs2), "a1_gscale must be float32"),
        (lambda: layer.nvfp4_moe_layer(x, ids, tw, fp4, case.gs1, case.gs2, expert_map=ids[0].long()),
         "expert_map must be int32"),
    ]
    for call, message in calls:
        with pytest.raises(ValueError) as err:
            call()
        text = str(err.value)
        assert text.startswith("nvfp4_moe_layer: ") and message in text and "\n" not in text, text


# ---------------------------------------------------------------------------------------------------------
# The torch ops: fake implementations, tracing
# ---------------------------------------------------------------------------------------------------------
def _op_args(case: Case, w, gs1, gs2):
    return (case.x, None, case.topk_ids, case.topk_weights, w.w13, w.w13_scale, w.w2, w.w2_scale, w.g1_alphas,
            w.g2_alphas, gs1, gs2, None, "silu", False)


@pytest.mark.parametrize("w4a16", [False, True])
def test_fake_op_shapes(w4a16):
    from torch._subclasses.fake_tensor import FakeTensorMode

    case = Case(7)
    w = case.weights(w4a16)
    args = _op_args(case, w, None if w4a16 else case.gs1, None if w4a16 else case.gs2)
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        out = torch.ops.nvfp4_moe.layer(*fake)
        assert out.shape == (7, case.hidden) and out.dtype == torch.bfloat16
        torch.ops.nvfp4_moe.layer_out(*fake, torch.empty(7, case.hidden, dtype=torch.bfloat16))
        with pytest.raises(ValueError, match="out must be bfloat16"):
            torch.ops.nvfp4_moe.layer_out(*fake, torch.empty(7, case.hidden))


def test_opcheck(exact_gemm):
    """torch's op checks with the reference GEMM; not test_schema, whose input comparison multiplies tensors, which
    torch's CPU kernels do not for float8_e4m3fn (the scales)."""
    case = Case(5)
    w = case.weights(False)
    torch.library.opcheck(torch.ops.nvfp4_moe.layer.default, _op_args(case, w, case.gs1, case.gs2),
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))


def test_compile_fullgraph_traces_the_op(exact_gemm):
    case = Case(6, seed=3)
    w = case.weights(False)

    def step(x, ids, weights):
        return layer.nvfp4_moe_layer(x, ids, weights, w, case.gs1, case.gs2) * 2

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(case.x, case.topk_ids, case.topk_weights),
                       step(case.x, case.topk_ids, case.topk_weights))
