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

from .routing import Routing


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
