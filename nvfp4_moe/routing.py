"""A MoE layer's routing metadata, made on the GPU from the router's `topk_ids`: `route`.

    topk_ids [T, k] (int32 or int64): token t's j-th expert, a global expert id, or -1 (a padding token's slot)
    expert_map int32 [E_global] (optional, expert parallelism): the local id of each global expert, or -1 for an
        expert of another rank

A pair p = t * k + j is *valid* when its id is in [0, E_global) and maps to a local expert in [0, E); every other
pair (id -1, an id out of range, an expert of another rank) is invalid: no GEMM row computes it, and the combine
adds exactly 0 for it. The pairs are sorted by local expert, stably (so equal experts keep their pair order and the
result depends on the routing alone), the invalid ones last as if of expert E:

- `Routing.order` int64 [T k]: the pair of each sorted row; row r belongs to expert `row_expert[r]`;
- `Routing.inverse` int64 [T k]: the sorted row of each pair (order[inverse[p]] == p);
- `Routing.counts` int32 [E]: valid pairs per local expert; `Routing.offs` int32 [E]: their cumulative ends, the
  GEMM entry's convention (expert e's rows are offs[e-1]:offs[e]; rows from offs[E-1] on are the invalid pairs).

Everything is torch operations on the tensors' device with fixed shapes: no value is read on the host (no .item(),
no nonzero, no bincount, which reads the ids' range), so a CUDA graph captured at a maximum T replays it for any
routing written into the same `topk_ids`. The counts are a scatter_add of ones into E + 1 slots (slot E the invalid
pairs'); integer additions commute, so they are deterministic. A kernel may replace `route` later with the same
outputs (the sort is a counting sort of E + 1 keys).
"""
import dataclasses
from typing import Optional

import torch


@dataclasses.dataclass(frozen=True)
class Routing:
    """What `route` makes of one routing (module docstring): per sorted row its pair and expert, per pair its row
    and validity, per expert its count and end."""

    order: torch.Tensor  # int64 [T k]: pair of sorted row r
    inverse: torch.Tensor  # int64 [T k]: sorted row of pair p
    row_expert: torch.Tensor  # int64 [T k]: local expert of sorted row r, E for an invalid pair
    valid: torch.Tensor  # bool [T, k]: pair t * k + j goes to a local expert
    counts: torch.Tensor  # int32 [E]
    offs: torch.Tensor  # int32 [E]: cumulative ends
    top_k: int

    @property
    def row_token(self) -> torch.Tensor:
        """int64 [T k]: the token of each sorted row (the row of x that it gathers)."""
        return self.order // self.top_k


def local_expert_ids(topk_ids: torch.Tensor, num_experts: int, expert_map: Optional[torch.Tensor] = None) -> torch.Tensor:
    """int64 [T k]: each pair's local expert in [0, E), or E for an invalid pair (module docstring)."""
    ids = topk_ids.reshape(-1).long()
    if expert_map is None:
        return torch.where((ids >= 0) & (ids < num_experts), ids, num_experts)
    in_range = (ids >= 0) & (ids < expert_map.shape[0])
    local = expert_map.long()[ids.clamp(0, expert_map.shape[0] - 1)]
    return torch.where(in_range & (local >= 0) & (local < num_experts), local, num_experts)


def route(topk_ids: torch.Tensor, num_experts: int, expert_map: Optional[torch.Tensor] = None) -> Routing:
    """The routing metadata of `topk_ids` [T, k] for E = `num_experts` local experts (module docstring), on
    topk_ids' device, without a host sync."""
    if topk_ids.dim() != 2 or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"route: topk_ids must be [T, k] int32 or int64; got {tuple(topk_ids.shape)} {topk_ids.dtype}")
    num_tokens, top_k = topk_ids.shape
    key = local_expert_ids(topk_ids, num_experts, expert_map)
    slots = torch.zeros(num_experts + 1, dtype=torch.int32, device=key.device)
    slots.scatter_add_(0, key, torch.ones_like(key, dtype=torch.int32))
    counts = slots[:num_experts]
    row_expert, order = torch.sort(key, stable=True)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    return Routing(order=order, inverse=inverse, row_expert=row_expert,
                   valid=(key < num_experts).view(num_tokens, top_k), counts=counts,
                   offs=counts.cumsum(0, dtype=torch.int32), top_k=top_k)
