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

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass.utils import SmemAllocator

import nvfp4_moe.simt as simt


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


# ---------------------------------------------------------------------------------------------------------
# The routing kernel (the layer's GPU path)
# ---------------------------------------------------------------------------------------------------------
class RouteKernel:
    """The layer's first launch: one CTA of 1024 threads turns topk_ids [T, k] (and expert_map) into
    - `offs` int32 [E]: the cumulative ends of the local experts' valid pairs (`route`'s, exactly);
    - `inverse` int32 [T k]: the row of each pair in expert order, -1 for an invalid pair (no row: nothing reads
      or computes it);
    - `row_expert` int32 [T k]: the local expert of each row below offs[E-1] (the rows past it are not written).
    Three phases, a barrier between them: each pair's key counted in shared memory (`atomic_add_shared`, whose
    old value is the pair's rank among its expert's pairs); the counts scanned by warp 0 into the experts'
    first rows and `offs`; each pair's row = its expert's first row + its rank.

    The ranks follow the atomics' order, so the rows of one expert may come in another order on another run
    (`route`'s stable sort keeps pair order). Nothing downstream depends on it: a GEMM row's result is that
    row's alone (no split-K; every K step in the same order whatever the tile holds), and the combine sums a
    token's pairs in j order through `inverse`. The layer's output is bitwise the same run to run (the GPU
    tests check it), and a row of `row_expert` names its pair's expert whatever the order.
    One CTA, no wait for any other: the call completes beside other kernels. At T k pairs per 1024 threads
    (prefill T = 2048, k = 8: 16 a thread) it is a few microseconds."""

    threads = 1024

    def __init__(self, num_experts: int, top_k: int, wide_ids: bool, mapped: bool):
        self.num_experts, self.top_k, self.wide_ids, self.mapped = num_experts, top_k, wide_ids, mapped
        self.per_lane = (num_experts + 31) // 32

    @cute.jit
    def __call__(self, ids: cutlass.Int64, expert_map: cutlass.Int64, map_size: cutlass.Int32, offs: cutlass.Int64,
                 inverse: cutlass.Int64, row_expert: cutlass.Int64, num_tokens: cutlass.Int32, stream: cuda.CUstream):
        self.kernel(ids, expert_map, map_size, offs, inverse, row_expert, num_tokens).launch(
            grid=(1, 1, 1), block=(self.threads, 1, 1), stream=stream)

    @cute.jit
    def local_expert(self, ids: cutlass.Int64, expert_map: cutlass.Int64, map_size: cutlass.Int32, p):
        """Pair p's local expert in [0, E), or -1 (module docstring's validity rule)."""
        E = self.num_experts
        key = simt.ld_global_nc_id(ids + cutlass.Int64(p) * (8 if self.wide_ids else 4), self.wide_ids)
        if cutlass.const_expr(self.mapped):
            local = cutlass.Int32(-1)
            if key >= 0:
                if key < map_size:
                    local = simt.ld_global_nc_s32(expert_map + 4 * cutlass.Int64(key))
            key = local
        if key >= E:
            key = cutlass.Int32(-1)
        if key < 0:
            key = cutlass.Int32(-1)
        return key

    @cute.jit
    def scan(self, s_counts: cute.Tensor, s_first: cute.Tensor, offs: cutlass.Int64, lane):
        """Warp 0: lane l's experts l P .. l P + P - 1, an exclusive scan of the counts (lane-local, then across the
        lanes by shuffles) into the experts' first rows (shared) and their ends (`offs`)."""
        E, P = self.num_experts, self.per_lane
        run = cutlass.Int32(0)
        local = []
        for j in cutlass.range_constexpr(P):
            local.append(run)
            run = run + s_counts[lane * P + j]
        incl = simt.warp_inclusive_sum(run, lane)
        base = incl - run
        for j in cutlass.range_constexpr(P):
            i = lane * P + j
            s_first[i] = base + local[j]
            if i < E:
                simt.st_global_s32(offs + 4 * cutlass.Int64(i), base + local[j] + s_counts[i])

    @cute.kernel
    def kernel(self, ids: cutlass.Int64, expert_map: cutlass.Int64, map_size: cutlass.Int32, offs: cutlass.Int64,
               inverse: cutlass.Int64, row_expert: cutlass.Int64, num_tokens: cutlass.Int32):
        P = self.per_lane
        tid, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()

        @cute.struct
        class SharedStorage:
            counts: cute.struct.MemRange[cutlass.Int32, 32 * P]
            first: cute.struct.MemRange[cutlass.Int32, 32 * P]

        storage = SmemAllocator().allocate(SharedStorage)
        s_counts = storage.counts.get_tensor(cute.make_layout((32 * P,)))
        s_first = storage.first.get_tensor(cute.make_layout((32 * P,)))
        counts_at = storage.counts.data_ptr().toint()
        pairs = num_tokens * self.top_k
        for i in cutlass.range(tid, 32 * P, self.threads, unroll=1):
            s_counts[i] = cutlass.Int32(0)
        cute.arch.barrier()
        # ---- 1. counts; each valid pair's rank (kept in `inverse` until phase 3: the same thread reads it)
        for p in cutlass.range(tid, pairs, self.threads, unroll=1):
            key = self.local_expert(ids, expert_map, map_size, p)
            rank = cutlass.Int32(-1)
            if key >= 0:
                rank = simt.atomic_add_shared(counts_at + 4 * key, cutlass.Int32(1))
            simt.st_global_s32(inverse + 4 * cutlass.Int64(p), rank)
        cute.arch.barrier()
        # ---- 2. warp 0: lane l's experts l P .. l P + P - 1, an exclusive scan (lane-local, then across lanes)
        if warp == 0:
            self.scan(s_counts, s_first, offs, lane)
        cute.arch.barrier()
        # ---- 3. rows
        for p in cutlass.range(tid, pairs, self.threads, unroll=1):
            rank = simt.ld_global_s32(inverse + 4 * cutlass.Int64(p))
            if rank >= 0:
                key = self.local_expert(ids, expert_map, map_size, p)
                row = s_first[key] + rank
                simt.st_global_s32(inverse + 4 * cutlass.Int64(p), row)
                simt.st_global_s32(row_expert + 4 * cutlass.Int64(row), key)
