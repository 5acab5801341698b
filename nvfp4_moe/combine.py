"""The MoE layer's last stage: each token's k expert rows weighted and summed, deterministically: `combine`.

    out[t] = sum over j = 0 .. k-1 of  w[t, j] * y[inverse[t k + j]]       (valid pairs only)

y [T k, H] is GEMM2's output in sorted (expert) order; `inverse` (routing) gives each pair's row. The rows are
gathered into [T, k, H] and summed over j in that fixed order in fp32 (each term y * w one fp32 rounding, each add
one), then rounded once to the output dtype. The order depends on nothing but k, so a token's sum is bitwise the
same on every run and whatever the other tokens are (no atomics, unlike a scatter-add finalize).

An invalid pair (a padding token's -1, an expert of another rank) adds exactly 0 by a torch.where mask, never by a
multiplication: its row of y lies past the last offset, which no GEMM computes, and NaN * 0 is NaN. A token whose
pairs are all invalid gets exact zeros; with expert parallelism each rank's out holds its local experts' share,
for the engine's all-reduce to add. With the router weights applied to x already (apply_router_weight_on_input),
`topk_weights` is None and the rows are summed as they are.
"""
from typing import Optional

import torch

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute

import nvfp4_moe.simt as simt

from nvfp4_moe.routing import Routing


def combine(y: torch.Tensor, routing: Routing, topk_weights: Optional[torch.Tensor], out_dtype=torch.bfloat16,
            out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[T, H] `out_dtype` (into `out` when given) from y [T k, H] and topk_weights [T, k] (any float dtype, widened
    to fp32) or None (module docstring)."""
    num_tokens, top_k = routing.valid.shape
    rows = y[routing.inverse].view(num_tokens, top_k, y.shape[-1])
    total = torch.zeros((num_tokens, y.shape[-1]), dtype=torch.float32, device=y.device)
    for j in range(top_k):
        term = rows[:, j].float()
        if topk_weights is not None:
            term = term * topk_weights[:, j:j + 1].float()
        total = total + torch.where(routing.valid[:, j:j + 1], term, 0.0)
    if out is None:
        return total.to(out_dtype)
    return out.copy_(total)


# ---------------------------------------------------------------------------------------------------------
# The combine kernel (the layer's GPU path)
# ---------------------------------------------------------------------------------------------------------
class CombineKernel:
    """The layer's last launch: out bf16 [T, H] from GEMM2's y bf16 [T k, H], one thread per 8 columns of a
    token, grid (H / 8 / threads, T): for j = 0 .. k-1 in order, the pair's row (`inverse`; -1: none) times its
    router weight (fp32 `mul.rn`, the weight widened from `weight_dtype`; none with weights applied on the
    input), added in fp32 (`add.rn`), then rounded to bf16 once: `combine`'s statement, bit for bit. A pair of no
    row adds nothing by a select (its clamped row's load may be anything, NaN included); the sum starts at +0
    and never becomes -0, so a token with no valid pair is +0 as torch's zeros."""

    threads = 128

    def __init__(self, hidden: int, top_k: int, weight_dtype: Optional[str]):
        self.hidden, self.top_k, self.weight_dtype = hidden, top_k, weight_dtype
        self.chunks = hidden // 8

    @cute.jit
    def __call__(self, y: cutlass.Int64, inverse: cutlass.Int64, weights: cutlass.Int64, out: cutlass.Int64,
                 num_tokens: cutlass.Int32, stream: cuda.CUstream):
        self.kernel(y, inverse, weights, out).launch(
            grid=((self.chunks + self.threads - 1) // self.threads, num_tokens, 1), block=(self.threads, 1, 1),
            stream=stream)

    @cute.kernel
    def kernel(self, y: cutlass.Int64, inverse: cutlass.Int64, weights: cutlass.Int64, out: cutlass.Int64):
        tid, _, _ = cute.arch.thread_idx()
        bx, t, _ = cute.arch.block_idx()
        c = bx * self.threads + tid
        if c < self.chunks:
            self.chunk(y, inverse, weights, out, t, c)

    @cute.jit
    def chunk(self, y: cutlass.Int64, inverse: cutlass.Int64, weights: cutlass.Int64, out: cutlass.Int64, t, c):
        """Columns 8 c .. 8 c + 7 of token t."""
        H, k = self.hidden, self.top_k
        acc = [cutlass.Float32(0.0) for _ in range(8)]
        for j in cutlass.range_constexpr(k):
            row = simt.ld_global_nc_s32(inverse + 4 * (cutlass.Int64(t) * k + j))
            valid = cutlass.Int32(row >= 0)
            words = simt.ld_global_v4(y + cutlass.Int64(cutlass.max(row, cutlass.Int32(0))) * (2 * H) + 16 * c)
            terms = []
            for i in cutlass.range_constexpr(4):
                terms.extend(simt.bf16x2_to_f32(words[i]))
            if cutlass.const_expr(self.weight_dtype is not None):
                w = simt.load_f32_weight(weights + (cutlass.Int64(t) * k + j) * simt.WEIGHT_BYTES[self.weight_dtype],
                                         self.weight_dtype)
                terms = [simt.mul_rn(v, w) for v in terms]
            acc = [simt.add_rn(s, simt.select_f32(valid, v, cutlass.Float32(0.0))) for s, v in zip(acc, terms)]
        words = [simt.f32x2_to_bf16x2(acc[2 * i], acc[2 * i + 1]) for i in range(4)]
        simt.st_global_v4(out + cutlass.Int64(t) * (2 * H) + 16 * c, words[0], words[1], words[2], words[3])
