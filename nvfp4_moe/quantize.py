"""NVFP4 quantization of 16-bit rows by vLLM's `scaled_fp4_quant` rule: `quantize_nvfp4`, and the MoE layer's
stage that gathers x's rows into expert order and quantizes them, `gather_quantize_nvfp4`.

Per block of 16 values x of a row (its k-block b), with the row's global scale gs (fp32):

    amax = max |x|                                   exact (16-bit values widened to fp32)
    SF   = e4m3(gs * (amax * fp32(1/6)))             two fp32 products; saturated to 448, rounded to nearest even
    outs = 1 / (fp32(SF) * (1 / gs)), 0 where SF = 0 fp32, each operation correctly rounded
    q    = e2m1(x * outs)                            fp32 product; nearest even on the grid {0, 0.5, 1, 1.5, 2, 3, 4,
                                                     6}, |v| > 6 saturated to 6, the sign kept (also on a zero)

Codes two per byte, element 2 j in the low nibble of byte j: uint8 [rows, K/2]; scales row-major e4m3
[rows, K/16], what the GEMM entry's NVFP4 `a_scale` takes. The dequantized value is q * SF / gs: the GEMM
multiplies codes by SF and its alpha carries 1 / gs (a ModelOpt checkpoint's g1_alphas hold the input scale).

NOTES: the steps are those of vLLM's `cvt_warp_fp16_to_fp4` (csrc/quantization/fp4/nvfp4_utils.cuh):
SFValue = SFScaleVal * (vecMax * rcp(6)); __nv_fp8_e4m3(SFValue) (satfinite, round to nearest); outputScale =
SFValue != 0 ? rcp(SF * rcp(SFScaleVal)) : 0; cvt.rn.satfinite.e2m1x2.f32 of x * outputScale. Its reciprocals
are rcp.approx.ftz.f32, within 1 ulp of the correctly rounded reciprocal that torch's division gives here, so a
code can differ from vLLM's only where x * outs lies within an ulp (fp32) of a rounding boundary of the e2m1
grid; 1/6 is taken as fp32(1/6) = 0x3E2AAAAB, the correctly rounded reciprocal. torch's own conversion to
float8_e4m3fn turns values of 480 and above into NaN, so SF is clamped to 448 first (the satfinite rule).
SF = 0 (an all-zero block, or one whose gs amax / 6 is under half the smallest e4m3 subnormal, 2^-10) makes
outs 0, so every code is a zero: +0, or -0 (code 8) where x is negative or -0, as vLLM's are; the block decodes
to exactly 0. x must be finite.

All torch operations, fixed shapes, no host sync: a kernel (the gather fused with the quantization, one block of
16 per thread pair as vLLM's) may replace `gather_quantize_nvfp4` with the same outputs bit for bit.
"""
import torch

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute

import nvfp4_moe.simt as simt
from nvfp4_moe.routing import Routing

BLOCK = 16  # values per e4m3 scale
E4M3_MAX = 448.0
# e2m1 rounding boundaries of |v|, nearest even: a boundary that rounds up to an even code (0.75 -> 1, 1.75 -> 2,
# 3.5 -> 4) counts from it (>=), one that rounds down to an even code (0.25 -> 0, 1.25 -> 1, 2.5 -> 2, 5 -> 4) from
# just above it (>); the code is the number of boundaries passed.
_UP_TO_EVEN = (0.75, 1.75, 3.5)
_DOWN_TO_EVEN = (0.25, 1.25, 2.5, 5.0)
_SIGN = 8


def e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """uint8 e2m1 codes of fp32 `v`: round to nearest even on the e2m1 grid, |v| > 6 saturated, the sign kept."""
    magnitude = v.abs()
    code = torch.zeros(v.shape, dtype=torch.uint8, device=v.device)
    for bound in _UP_TO_EVEN:
        code += magnitude >= bound
    for bound in _DOWN_TO_EVEN:
        code += magnitude > bound
    return code | (torch.signbit(v).to(torch.uint8) * _SIGN)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K] codes -> [..., K/2] bytes, element 2 j in the low nibble of byte j."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def quantize_nvfp4(x: torch.Tensor, global_scale: torch.Tensor) -> tuple:
    """(codes uint8 [rows, K/2], scales float8_e4m3fn [rows, K/16]) of x [rows, K] (16-bit, or fp32 holding
    16-bit values; K % 16 == 0) by the module's rule; global_scale fp32 [] or [1] (every row) or [rows]."""
    rows, k = x.shape
    if k % BLOCK:
        raise ValueError(f"quantize_nvfp4: K = {k} must be a multiple of {BLOCK}")
    gs = global_scale.to(torch.float32).reshape(-1, 1, 1)
    blocks = x.to(torch.float32).reshape(rows, k // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    sf = (gs * (amax * (1.0 / 6.0))).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    sf32 = sf.to(torch.float32)
    out_scale = torch.where(sf32 != 0, 1.0 / (sf32 * (1.0 / gs)), 0.0)
    codes = e2m1_codes(blocks * out_scale).view(rows, k)
    return pack_e2m1(codes), sf.view(rows, k // BLOCK)


def row_global_scale(global_scale: torch.Tensor, row_expert: torch.Tensor) -> torch.Tensor:
    """The global scale of each sorted row: a scalar ([] or [1]) as it is, a per-expert [E] one by the row's
    expert (an invalid row, expert E, takes expert E - 1's: its codes are never read)."""
    if global_scale.numel() == 1:
        return global_scale.reshape(1)
    return global_scale[row_expert.clamp(max=global_scale.numel() - 1)]


def gather_quantize_nvfp4(x: torch.Tensor, routing: Routing, global_scale: torch.Tensor) -> tuple:
    """The fp4-A path's first stage: x [T, H] (16-bit) gathered into expert order (sorted row r is token
    routing.row_token[r]) and quantized with global_scale (fp32 [] / [1], or [E] per expert by the row's):
    (codes uint8 [T k, H/2], scales e4m3 [T k, H/16]), the GEMM's `a` and `a_scale`."""
    return quantize_nvfp4(x[routing.row_token], row_global_scale(global_scale, routing.row_expert))


# ---------------------------------------------------------------------------------------------------------
# The gather kernel (the layer's GPU path)
# ---------------------------------------------------------------------------------------------------------
GATHER_MODES = ("fp4", "codes", "bf16")


class GatherQuantizeKernel:
    """The layer's second launch: token t's row of x written to each of its valid pairs' rows (`inverse`, from
    `routing.RouteKernel`), one block of 16 values a thread, grid (H / 16 / threads, T):
    - "fp4": x bf16 [T, H] quantized by `quantize_nvfp4`'s statement (`simt.quantize16`, bit for bit) with the
      row's global scale (a scalar, or per expert by `row_expert`), into codes uint8 [T k, H/2] and row-major
      scales e4m3 [T k, H/16];
    - "codes": x already NVFP4 (uint8 [T, H/2], scales [T, H/16]): its codes and scales copied;
    - "bf16": x bf16 copied (W4A16's A, [T k, H]).
    `weight_on_input` (k = 1, "fp4" and "bf16"): x's values times the token's router weight first, the weight
    rounded to bf16 and each product to bf16 (torch's x * w.to(x.dtype)). A pair of no row (-1) writes nothing.
    Rows past offs[E-1] are never written: no GEMM reads them."""

    threads = 128

    def __init__(self, hidden: int, top_k: int, mode: str, per_expert_scale: bool, weight_on_input: bool,
                 weight_dtype: str):
        assert mode in GATHER_MODES and hidden % BLOCK == 0
        self.hidden, self.top_k, self.mode = hidden, top_k, mode
        self.per_expert_scale, self.weight_on_input, self.weight_dtype = per_expert_scale, weight_on_input, weight_dtype
        self.blocks = hidden // BLOCK

    @cute.jit
    def __call__(self, x: cutlass.Int64, x_scale: cutlass.Int64, inverse: cutlass.Int64, row_expert: cutlass.Int64,
                 global_scale: cutlass.Int64, weights: cutlass.Int64, a: cutlass.Int64, a_scale: cutlass.Int64,
                 num_tokens: cutlass.Int32, stream: cuda.CUstream):
        self.kernel(x, x_scale, inverse, row_expert, global_scale, weights, a, a_scale).launch(
            grid=((self.blocks + self.threads - 1) // self.threads, num_tokens, 1), block=(self.threads, 1, 1),
            stream=stream)

    @cute.kernel
    def kernel(self, x: cutlass.Int64, x_scale: cutlass.Int64, inverse: cutlass.Int64, row_expert: cutlass.Int64,
               global_scale: cutlass.Int64, weights: cutlass.Int64, a: cutlass.Int64, a_scale: cutlass.Int64):
        tid, _, _ = cute.arch.thread_idx()
        bx, t, _ = cute.arch.block_idx()
        b = bx * self.threads + tid
        if b < self.blocks:
            self.token_block(x, x_scale, inverse, row_expert, global_scale, weights, a, a_scale, t, b)

    @cute.jit
    def token_block(self, x: cutlass.Int64, x_scale: cutlass.Int64, inverse: cutlass.Int64, row_expert: cutlass.Int64,
                    global_scale: cutlass.Int64, weights: cutlass.Int64, a: cutlass.Int64, a_scale: cutlass.Int64, t,
                    b):
        """Block b (16 values) of token t, to each of the token's rows."""
        H, k = self.hidden, self.top_k
        if cutlass.const_expr(self.mode == "codes"):
            codes = simt.ld_global_v2(x + cutlass.Int64(t) * (H // 2) + 8 * b)
            scale = simt.ld_global_u8(x_scale + cutlass.Int64(t) * (H // 16) + b)
            for j in cutlass.range_constexpr(k):
                row = simt.ld_global_nc_s32(inverse + 4 * (cutlass.Int64(t) * k + j))
                if row >= 0:
                    simt.store_nvfp4_block(a, a_scale, row, H, b, scale, codes[0], codes[1])
        else:
            values = simt.load_bf16x16(x + cutlass.Int64(t) * (2 * H) + 32 * b)
            if cutlass.const_expr(self.weight_on_input):
                w = simt.load_f32_weight(weights + cutlass.Int64(t) * simt.WEIGHT_BYTES[self.weight_dtype],
                                         self.weight_dtype)
                w16 = simt.round_bf16(w)
                values = [simt.round_bf16(simt.mul_rn(v, w16)) for v in values]
            if cutlass.const_expr(self.mode == "bf16"):
                words = [simt.f32x2_to_bf16x2(values[2 * i], values[2 * i + 1]) for i in range(8)]
                for j in cutlass.range_constexpr(k):
                    row = simt.ld_global_nc_s32(inverse + 4 * (cutlass.Int64(t) * k + j))
                    if row >= 0:
                        simt.store_words(a + cutlass.Int64(row) * (2 * H) + 32 * b, words)
            elif cutlass.const_expr(not self.per_expert_scale):
                sf, w0, w1 = simt.quantize16(values, simt.ld_global_nc_f32(global_scale))
                for j in cutlass.range_constexpr(k):
                    row = simt.ld_global_nc_s32(inverse + 4 * (cutlass.Int64(t) * k + j))
                    if row >= 0:
                        simt.store_nvfp4_block(a, a_scale, row, H, b, sf, w0, w1)
            else:
                for j in cutlass.range_constexpr(k):
                    row = simt.ld_global_nc_s32(inverse + 4 * (cutlass.Int64(t) * k + j))
                    if row >= 0:
                        self.quantize_row(values, row_expert, global_scale, a, a_scale, row, b)

    @cute.jit
    def quantize_row(self, values: list, row_expert: cutlass.Int64, global_scale: cutlass.Int64, a: cutlass.Int64,
                     a_scale: cutlass.Int64, row, b):
        """Block b of `row` quantized with its expert's global scale, and stored."""
        sf, w0, w1 = simt.quantize16(values, simt.expert_global_scale(global_scale, row_expert, row))
        simt.store_nvfp4_block(a, a_scale, row, self.hidden, b, sf, w0, w1)
