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

from .quantize import quantize_nvfp4, row_global_scale
from .routing import Routing

ACTIVATIONS = ("silu",)


def silu_and_mul(h: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """[rows, I] `dtype` = SiLU(h[:, :I]) * h[:, I:] in fp32, rounded once; h [rows, 2 I]."""
    gate, up = h.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(dtype)


def silu_and_mul_nvfp4(h: torch.Tensor, routing: Routing, global_scale: torch.Tensor) -> tuple:
    """The fp4-A path's activation: `silu_and_mul` rounded to bf16, then `quantize_nvfp4` with global_scale (fp32
    [] / [1], or [E] per expert by each sorted row's): (codes uint8 [rows, I/2], scales e4m3 [rows, I/16])."""
    return quantize_nvfp4(silu_and_mul(h), row_global_scale(global_scale, routing.row_expert))
