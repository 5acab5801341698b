"""The MoE layer's activation between its two GEMMs: SiLU(gate) * up of GEMM1's rows.

GEMM1's output h [rows, 2 I] holds each row's gate columns first, then its up columns (the checkpoint's w13 order,
gate rows then up rows). Both halves are widened to fp32, SiLU(gate) * up computed in fp32 (torch's silu), and the
result rounded once: to the activation dtype (bf16) for a 16-bit GEMM2 (W4A16), or, on the fp4-A path, to bf16 and
then quantized to NVFP4 with a2_gscale, as vLLM's silu_and_mul followed by scaled_fp4_experts_quant does (its fused
silu_and_mul_nvfp4_quant rounds to the 16-bit type before quantizing too).

Zero columns stay zero: SiLU(0) * 0 = 0, so the K padding of `prepare_moe_layer` (zero weight rows) gives zero
activations, whose NVFP4 blocks are all-zero (codes 0, scale 0). A GEMM1 epilogue may compute this later (then the
gate and up columns of one tile come interleaved); these functions are the stage's statement until then.
"""
import torch
import torch.nn.functional as F

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute

import nvfp4_moe.simt as simt

from nvfp4_moe.quantize import quantize_nvfp4, row_global_scale
from nvfp4_moe.routing import Routing

ACTIVATIONS = ("silu",)


def silu_and_mul(h: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """[rows, I] `dtype` = SiLU(h[:, :I]) * h[:, I:] in fp32, rounded once; h [rows, 2 I]."""
    gate, up = h.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(dtype)


def silu_and_mul_nvfp4(h: torch.Tensor, routing: Routing, global_scale: torch.Tensor) -> tuple:
    """The fp4-A path's activation: `silu_and_mul` rounded to bf16, then `quantize_nvfp4` with global_scale (fp32
    [] / [1], or [E] per expert by each sorted row's): (codes uint8 [rows, I/2], scales e4m3 [rows, I/16])."""
    return quantize_nvfp4(silu_and_mul(h), row_global_scale(global_scale, routing.row_expert))


# ---------------------------------------------------------------------------------------------------------
# The activation kernel (the layer's GPU path)
# ---------------------------------------------------------------------------------------------------------
class SiluMulKernel:
    """Between the layer's GEMMs: each routed row r < offs[E-1] of GEMM1's h bf16 [T k, 2 I] (gate columns, then
    up columns) to SiLU(gate) * up, one block of 16 columns a thread, grid (I / 16 / threads, T k): in fp32
    (`simt.silu`: torch's x / (1 + exp(-x)) with exp within 2 ulp of expf), the product rounded to bf16 once,
    then written as bf16 [T k, I] (W4A16's GEMM2 A), or with `fp4` quantized (`simt.quantize16`, with a2_gscale,
    a scalar or the row's expert's) into codes [T k, I/2] and row-major scales [T k, I/16]. Rows past offs[E-1]
    are left as they are: GEMM2 reads none of them."""

    threads = 128

    def __init__(self, num_experts: int, intermediate: int, fp4: bool, per_expert_scale: bool):
        assert intermediate % 16 == 0
        self.num_experts, self.intermediate, self.fp4, self.per_expert_scale = (num_experts, intermediate, fp4,
                                                                                per_expert_scale)
        self.blocks = intermediate // 16

    @cute.jit
    def __call__(self, h: cutlass.Int64, offs: cutlass.Int64, row_expert: cutlass.Int64, global_scale: cutlass.Int64,
                 a: cutlass.Int64, a_scale: cutlass.Int64, rows: cutlass.Int32, stream: cuda.CUstream):
        self.kernel(h, offs, row_expert, global_scale, a, a_scale).launch(
            grid=((self.blocks + self.threads - 1) // self.threads, rows, 1), block=(self.threads, 1, 1),
            stream=stream)

    @cute.kernel
    def kernel(self, h: cutlass.Int64, offs: cutlass.Int64, row_expert: cutlass.Int64, global_scale: cutlass.Int64,
               a: cutlass.Int64, a_scale: cutlass.Int64):
        tid, _, _ = cute.arch.thread_idx()
        bx, row, _ = cute.arch.block_idx()
        b = bx * self.threads + tid
        routed = simt.ld_global_nc_s32(offs + 4 * (self.num_experts - 1))
        if b < self.blocks:
            if row < routed:
                self.row_block(h, row_expert, global_scale, a, a_scale, row, b)

    @cute.jit
    def row_block(self, h: cutlass.Int64, row_expert: cutlass.Int64, global_scale: cutlass.Int64, a: cutlass.Int64,
                  a_scale: cutlass.Int64, row, b):
        """Block b (16 columns) of routed row `row`."""
        I = self.intermediate
        src = h + cutlass.Int64(row) * (4 * I) + 32 * b
        gate = simt.load_bf16x16(src)
        up = simt.load_bf16x16(src + 2 * I)
        values = [simt.round_bf16(simt.mul_rn(simt.silu(g), u)) for g, u in zip(gate, up)]
        if cutlass.const_expr(self.fp4):
            if cutlass.const_expr(self.per_expert_scale):
                gs = simt.expert_global_scale(global_scale, row_expert, row)
            else:
                gs = simt.ld_global_nc_f32(global_scale)
            sf, w0, w1 = simt.quantize16(values, gs)
            simt.store_nvfp4_block(a, a_scale, row, I, b, sf, w0, w1)
        else:
            words = [simt.f32x2_to_bf16x2(values[2 * i], values[2 * i + 1]) for i in range(8)]
            simt.store_words(a + cutlass.Int64(row) * (2 * I) + 32 * b, words)
