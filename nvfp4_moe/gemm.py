"""A MoE layer's routed-expert GEMM with the routing on the GPU: `nvfp4_moe_mm`, in torch._grouped_mm's convention.

    out[offs[e-1]:offs[e]] = alpha[e] * (A[offs[e-1]:offs[e]] * SFA) @ (B[e] * SFB[e])^T    for every expert e

- `a` [T, K/2] NVFP4 activations (e2m1 pairs, `torch.float4_e2m1fn_x2` or uint8), tokens sorted by expert;
  `a_scale` [T, K/16] e4m3, row-major as a quantization kernel writes it. Or (W4A16, Hopper only) `a` [T, K]
  bf16 or fp16 as the layer has it and `a_scale` None: A is TMA-loaded as it is and B converted exactly to A's
  type (every e2m1 x e4m3 product is exact in both), fp32 accumulation (`Sm90GemmConfig.a_input`); a B200
  refuses it (its tensor cores take fp4 for both operands);
- `b`, `b_scale`: the weights made once per layer by `prepare_moe_weights(b [E, N, K/2], b_scale [E, N, K/16])`
  (the scales re-laid out in the blocked order the kernels read, [E, N/128, K/64, 512]);
- `offs` int32 [E] on the GPU: cumulative ends of the experts' rows; `alpha` fp32 [E] (optional): each expert's
  global scale, applied in the epilogue; `out` [T, N] fp16 or bf16 (optional; else made, `out_dtype`).

One call is two launches on torch's current CUDA queue and no host work that reads the routing or grows with E
(Hopper):
- `MoePrepareKernel` (one CTA per expert, then row blocks) turns `offs` into the pointer and size tables, the
  M-exact kernel's work list (each expert's tile width by the host planner's rule, `_sm90_bulk_plan`, the tiles
  widest first dealt in snake order to a fixed grid of SM-count CTAs) and the experts' TMA descriptors; its row
  blocks convert NVFP4 A to the GEMM's fp16 A and zero the rows of `out` past the last end;
- the Hopper GEMM (`MoeSm90Gemm`: `Sm90BlockScaledGroupedGemmKernel` with the MoE switches: alpha, bf16 out;
  with 16-bit A, `a_input`) runs the work list.
No block of either launch waits for another block, so a call completes beside any other kernel (a
communication kernel resident on some SMs, MPS or green contexts with fewer SMs): the CTAs that get an SM do the
work of those that wait. A layer step can be captured in a CUDA graph and replayed after new routing is written
into the same tensors, and `torch.ops.nvfp4_moe.mm` (a torch.library op with a fake implementation) traces
under `torch.compile(fullgraph=True)`.

Caches (`cache_info`, `clear_caches`): compiles, one per (E, N, K, build, out dtype, A's kind, PDL); buffers, one
growing arena per (device, CUDA queue) that has called, at most 1.25 x the largest call's need, and one per
CUDA-graph capture under way, made from the graph's memory pool (so graphs replayed at the same time never share
buffers; the first call may be inside a capture). Calls from several threads are serialised around their launches.

Bad `offs` never read or write out of bounds: each end is clamped to [0, T] and to at least the previous end
(a running maximum), so a decreasing entry makes its expert empty and rows past T belong to no expert. Rows of
`out` that no expert covers (after the last end) are written as zeros.

On a B200 (sm_100a) the same call runs `MoeSm100PrepareKernel` (the tables, A's scales re-laid out blocked per
expert, the descriptors, the tile count) and custom_kernel's persistent kernel with the MoE switches; that path
is built and SASS-checked on every DSL version but has never run (no B200 here). Other GPUs: UnsupportedDeviceError.
"""
import contextlib
import ctypes
import dataclasses
import functools
import threading
from typing import Optional

import torch

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass.utils import SmemAllocator

import submission as host
import submission_sm90 as sm90
from submission import PtrColumn, SizeColumn, TENSORMAP_BYTES, ceil_div, descriptor_table, table_words

# ---------------------------------------------------------------------------------------------------------
# The schedule's rule (what MoePrepareKernel computes on the GPU; `plan_reference` is its torch mirror)
# ---------------------------------------------------------------------------------------------------------
MAX_EXPERTS = 1024  # one lane holds E / 32 experts' values through the scans
ALPHA_ONE_BITS = 0x3F800000  # 1.0f: the size table's L column without alpha


def moe_builds() -> dict:
    """The Hopper builds the entry picks from, by the mean rows per expert T / E (a shape, never the routing):
    the consumer-pairs build (widths 16-32) for a few tokens per expert, as custom_kernel's `sm90_auto` picks
    it (`SM90_NARROW_MEAN_ROWS`); widths 16-128 up to 64 rows per expert; widths 64-128 above."""
    def moe(name: str):
        # a16_fused off: the GEMM has no conversion phase and no grid-wide barrier (MoePrepareKernel converts A)
        return dataclasses.replace(sm90.SM90_VARIANT_CONFIGS[name], a16_fused=False, group_alpha=True,
                                   split_k=False)
    return {"pairs": moe("sm90_a16_pairs"), "narrow": moe("sm90_a16_narrow"), "wide": moe("sm90_a16_mexact128")}


def b200_config(out_dtype) -> "host.Sm100PersistentConfig":
    """The B200 build: custom_kernel's persistent kernel with 128 x 128 tiles, the tile count from the
    preparation kernel, alpha in the epilogue, C in `out_dtype`."""
    c_dtype = cutlass.BFloat16 if out_dtype == torch.bfloat16 else cutlass.Float16
    return host.Sm100PersistentConfig(c_dtype=c_dtype, device_tile_count=True, group_alpha=True)


def choose_build(num_tokens: int, num_experts: int) -> str:
    mean = num_tokens / max(num_experts, 1)
    if mean <= sm90.SM90_NARROW_MEAN_ROWS:
        return "pairs"
    return "narrow" if mean <= 64 else "wide"


def blocked_scale_word(row, word, words_per_row):
    """Where word `word` of row `row` of a [rows, K / 16] scale matrix (its k-blocks 4 word .. 4 word + 3) sits in
    the blocked layout (`reference.to_blocked`), counted in 32-bit words: 512-byte atoms of 128 rows x 4 k-blocks,
    `words_per_row` = K / 64 atoms per 128 rows, row r at byte (r % 32) * 16 + ((r // 32) % 4) * 4 of its atom.
    Plain arithmetic: the B200 preparation kernel calls it on device integers, the tests on Python's."""
    return ((row // 128) * words_per_row + word) * 128 + (row % 32) * 4 + (row // 32) % 4


def max_parts(num_tokens: int, num_experts: int, n: int, widths: tuple) -> int:
    """Parts the work list can hold for T tokens, whatever the routing: an expert of M rows takes at most
    ceil(M / narrowest) splits, so sum_e ceil(M_e / w0) <= T / w0 + E, times the N tiles."""
    return (num_tokens // widths[0] + num_experts) * (n // 128)


def header_words(grid: int) -> int:
    """The work list's header: the partials' offset and grid + 1 part offsets, in whole 8-word rows."""
    return sm90.SM90_PART_WORDS * ceil_div(grid + 2, sm90.SM90_PART_WORDS)


def plan_reference(offs: torch.Tensor, num_tokens: int, n: int, k: int, widths: tuple, grid: int) -> dict:
    """What MoePrepareKernel writes, computed by torch and Python on the CPU (the tests' independent statement of
    the rule): per expert its first row, rows, splits and width index; the parts CTA after CTA (int32 [tiles, 8])
    and the header offsets (grid + 1 of them)."""
    offs = offs.to("cpu", torch.int64)
    ends = torch.cummax(offs.clamp(0, num_tokens), 0).values
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), ends[:-1]])
    m = ends - starts
    width_costs = torch.tensor([[sm90.sm90_tile_cost(x, k) for x in widths]], dtype=torch.int64).expand(len(m), -1)
    splits, width_index, _ = sm90.sm90_split_choice(m, widths, width_costs)
    n_tiles = n // 128
    tiles = splits * n_tiles
    parts = []
    for e in range(offs.numel()):
        width = widths[int(width_index[e])]
        for j in range(int(tiles[e])):
            parts.append((e, (j // n_tiles) * width, int(width_index[e]), j % n_tiles, 0, k // 128, -1, 0))
    # the sequence: widest width first, then expert, split, N tile; snake over `grid` CTAs
    order = sorted(range(len(parts)), key=lambda i: -parts[i][2])  # stable: expert, split, N tile order kept
    laps, rest = divmod(len(parts), grid)
    per_cta = [[] for _ in range(grid)]
    for position, i in enumerate(order):
        lap, seat = divmod(position, grid)
        per_cta[seat if lap % 2 == 0 else grid - 1 - seat].append(parts[i])
    assert all(len(p) == laps + (1 if (c < rest if laps % 2 == 0 else c >= grid - rest) else 0)
               for c, p in enumerate(per_cta))
    offsets = [0]
    for p in per_cta:
        offsets.append(offsets[-1] + len(p))
    parts = [part for p in per_cta for part in p]
    return {"starts": starts, "m": m, "splits": splits, "width_index": width_index,
            "parts": torch.tensor(parts, dtype=torch.int32).reshape(-1, 8), "offsets": offsets}


# ---------------------------------------------------------------------------------------------------------
# The per-call preparation kernel
# ---------------------------------------------------------------------------------------------------------
@cute.jit
def clamped_ends(offs: cutlass.Int64, num_experts: cutlass.Constexpr[int], num_tokens, lane):
    """(the clamped ends of lane `lane`'s experts l * P .. l * P + P - 1 as a list, the running maximum through
    them and every earlier lane's: an inclusive scan across the warp). Lane 31's is the last end: the rows that
    any expert covers."""
    P = ceil_div(num_experts, 32)
    offs_t = cute.make_tensor(cute.make_ptr(cutlass.Int32, offs, cute.AddressSpace.gmem, assumed_align=4),
                              cute.make_layout((num_experts,)))
    ends = []
    run = cutlass.Int32(0)
    for j in cutlass.range_constexpr(P):
        i = lane * P + j
        v = cutlass.Int32(0)
        if i < num_experts:
            v = offs_t[i]
        v = cutlass.min(cutlass.max(v, cutlass.Int32(0)), num_tokens)
        run = cutlass.max(run, v)
        ends.append(run)
    incl = run
    for d in cutlass.range_constexpr(5):
        below = cute.arch.shuffle_sync(incl, (lane - (1 << d)) & 31)
        incl = cutlass.max(incl, below * cutlass.Int32(lane >= (1 << d)))
    return ends, incl


# Rows of C that one of the preparation kernels' row blocks zeroes (`row_blocks`)
ZERO_ROWS_PER_BLOCK = 4


def row_blocks(num_tokens, k: int, threads: int, convert: bool) -> tuple:
    """(conversion blocks, zeroing blocks) a preparation launch adds after its E expert blocks for T tokens: with
    `convert` (Hopper, NVFP4 A) one item of A a thread (`sm90_convert_a_item_at`: K / 32 items a row), then a block
    per ZERO_ROWS_PER_BLOCK rows of C. Host arithmetic on ints or on the launch's Int32."""
    converting = (num_tokens * (k // 32) + (threads - 1)) // threads if convert else 0
    return converting, (num_tokens + (ZERO_ROWS_PER_BLOCK - 1)) // ZERO_ROWS_PER_BLOCK


@cute.jit
def row_work(block, offs: cutlass.Int64, num_experts: cutlass.Constexpr[int], num_tokens, a: cutlass.Int64,
             sfa: cutlass.Int64, a16: cutlass.Int64, c: cutlass.Int64, n: cutlass.Constexpr[int],
             k: cutlass.Constexpr[int], threads: cutlass.Constexpr[int], convert: cutlass.Constexpr[bool], converting):
    """Row block `block` (counted after the expert blocks) of a preparation launch, rows of the call that no
    expert's count depends on, so no block waits for another:
    - with `convert` (Hopper, NVFP4 A), blocks 0 .. converting - 1: thread-item `block * threads + thread` of the
      routed rows' A to fp16 at `a16` (row r at a16 + 2 K r), as the fused conversion phase wrote it (the GEMM's
      fp16 A);
    - the blocks after: the rows ZERO_ROWS_PER_BLOCK (block - converting) .. + ZERO_ROWS_PER_BLOCK - 1 of C that
      lie past the last end of `offs` (no expert covers them; the GEMM never writes them) zeroed, so that a
      caller's padding rows read 0, never garbage or NaN.
    Each warp finds the last end itself (`clamped_ends`)."""
    tid, _, _ = cute.arch.thread_idx()
    lane = cute.arch.lane_idx()
    _, incl = clamped_ends(offs, num_experts, num_tokens, lane)
    routed = cute.arch.shuffle_sync(incl, 31)
    if cutlass.const_expr(convert):
        if block < converting:
            item = block * threads + tid
            row = item // (k // 32)
            if row < routed:
                sm90.sm90_convert_a_item_at(a + cutlass.Int64(row) * (k // 2), sfa + cutlass.Int64(row) * (k // 16),
                                            k, item % (k // 32), a16 + cutlass.Int64(row) * (k * 2), True)
        else:
            zero_rows(block - converting, routed, num_tokens, c, n, tid, threads)
    else:
        zero_rows(block, routed, num_tokens, c, n, tid, threads)


@cute.jit
def zero_rows(block, routed, num_tokens, c: cutlass.Int64, n: cutlass.Constexpr[int], tid,
              threads: cutlass.Constexpr[int]):
    """Zeroing block `block` of `row_work`: its rows of C (N 16-bit values each) at or past `routed`."""
    for i in cutlass.range_constexpr(ZERO_ROWS_PER_BLOCK):
        row = block * ZERO_ROWS_PER_BLOCK + i
        if row >= routed and row < num_tokens:
            c_row = c + cutlass.Int64(row) * (n * 2)
            for w in cutlass.range(tid, n // 8, threads, unroll=1):
                sm90.st_global_v4(c_row + 16 * w, cutlass.Uint32(0), cutlass.Uint32(0), cutlass.Uint32(0),
                                  cutlass.Uint32(0))


@cute.jit
def expert_rows(offs: cutlass.Int64, num_experts: cutlass.Constexpr[int], num_tokens, lane):
    """(first rows, rows) of lane `lane`'s experts, l * P .. l * P + P - 1 (P = ceil(E / 32)), as two lists: each
    end of `offs` clamped to [0, T] and to at least the ends before it (`nvfp4_moe_mm`'s rule): a running
    maximum, lane-local then across the warp (shuffles). Both arches' preparation kernels start with it."""
    P = ceil_div(num_experts, 32)
    ends, incl = clamped_ends(offs, num_experts, num_tokens, lane)
    prev = cute.arch.shuffle_sync(incl, (lane - 1) & 31) * cutlass.Int32(lane >= 1)
    starts, counts = [], []
    for j in cutlass.range_constexpr(P):
        end = cutlass.max(ends[j], prev)
        starts.append(prev)
        counts.append(end - prev)
        prev = end
    return starts, counts

def prepared_tables(tables, workspace, num_experts: int, slots: int) -> tuple:
    """The pointer table, size table and descriptor rows a preparation kernel writes (host side of its jit
    function): `tables` holds the first two (`table_words`), `workspace` starts with the third."""
    gmem = cute.AddressSpace.gmem
    ptr_words = table_words(num_experts)[0]
    ptr_table = cute.make_tensor(cute.make_ptr(cutlass.Int64, tables, gmem, assumed_align=16),
                                 cute.make_layout((num_experts, len(PtrColumn)), stride=(len(PtrColumn), 1)))
    size_table = cute.make_tensor(cute.make_ptr(cutlass.Int32, tables + 8 * ptr_words, gmem, assumed_align=16),
                                  cute.make_layout((num_experts, len(SizeColumn)), stride=(len(SizeColumn), 1)))
    tensormaps = descriptor_table(cute.make_ptr(cutlass.Int64, workspace, gmem, assumed_align=TENSORMAP_BYTES),
                                  num_experts, slots)
    return ptr_table, size_table, tensormaps

@cute.jit
def write_expert_rows(ptr_table: cute.Tensor, size_table: cute.Tensor, e, start, m, addresses: tuple,
                      n: cutlass.Constexpr[int], k: cutlass.Constexpr[int], a_row_bytes: cutlass.Constexpr[int]):
    """Expert e's pointer row (A and C at its first row `start`, A's rows `a_row_bytes` each: K / 2 of NVFP4,
    2 K of 16-bit values; its SFA as given, B and SFB at its weight slice) and size row (M, N, K, alpha's bits:
    1.0 where there is no alpha). addresses: (a, its SFA, b, sfb, c, alpha or 0)."""
    a, sfa, b, sfb, c, alpha = addresses
    ptr_table[e, int(PtrColumn.A)] = a + cutlass.Int64(start) * a_row_bytes
    ptr_table[e, int(PtrColumn.SFA)] = sfa
    ptr_table[e, int(PtrColumn.C)] = c + cutlass.Int64(start) * (n * 2)
    ptr_table[e, int(PtrColumn.B)] = b + cutlass.Int64(e) * (n * k // 2)
    ptr_table[e, int(PtrColumn.SFB)] = sfb + cutlass.Int64(e) * (n * k // 16)
    alpha_bits = cutlass.Int32(ALPHA_ONE_BITS)
    if alpha != 0:
        alpha_bits = cutlass.Int32(sm90.ld_global_u32(alpha + 4 * cutlass.Int64(e)))
    size_table[e, int(SizeColumn.M)] = m
    size_table[e, int(SizeColumn.N)] = cutlass.Int32(n)
    size_table[e, int(SizeColumn.K)] = cutlass.Int32(k)
    size_table[e, int(SizeColumn.L)] = alpha_bits

class MoeSm90Gemm(sm90.Sm90BlockScaledGroupedGemmKernel):
    """Hopper: the M-exact kernel with the MoE switches (`moe_builds`). Its config has `a16_fused` off, so the
    GEMM converts nothing and has no grid-wide barrier; with NVFP4 A, MoePrepareKernel's row blocks write the
    fp16 A and its pointer table's A column holds each expert's fp16 A address, where the descriptors point."""

    def a16_address(self, ptrs, sizes, group, tensormaps):
        return ptrs[group, int(PtrColumn.A)]


class MoePrepareKernel:
    """Per call, before the GEMM on the same queue, one warp per expert e (grid E):
    1. every warp scans `offs` (clamped: `nvfp4_moe_mm`'s rule) and each expert's splits and width
       (`plan_reference`'s rule), lane l holding experts l * P .. l * P + P - 1 (P = ceil(E / 32)), and per
       width the tiles of earlier experts (warp scans), into shared arrays;
    2. warp e writes expert e's pointer row (A, SFA, C at its first row; B, SFB at its weight slice) and
       size row (M, N, K, alpha's bits), and its tiles' parts: the tiles form one sequence, widest width
       first (the host planner's longest-first order: a tile's cost grows with its width), then by expert,
       split and N tile; position p goes to CTA p % grid on even laps (p // grid) and grid - 1 - p % grid on
       odd ones (snake), as the CTA's part p // grid. Each CTA's load is within one tile of the mean, and at
       any moment the CTAs work on a window of `grid` neighbouring tiles (an expert's N tiles together: its
       A and, across splits, its B tiles shared in L2, as in the host's plans);
    3. warp 0 writes the header (`cta_offset`: closed form);
    4. warp e writes expert e's TMA descriptors (the code of `GroupTensormapKernel`) and its share of the
       GEMM's workspace reset (`prepare_workspace`).
    Then the row blocks (`row_work`): with NVFP4 A, the routed rows' A converted to the GEMM's fp16 A in the
    workspace (the pointer table's A column points there: `MoeSm90Gemm`); C's rows past the last end zeroed.
    No block waits for another (the GEMM, a launch of its own, has no grid-wide barrier either), so the call
    completes beside any other kernel, on as many SMs as it gets.
    Launched without programmatic dependent launch: it waits for the GEMM before it on the queue, which reads
    the same tables, work list, descriptors and fp16 A."""

    threads = 32

    @cute.jit
    def cta_offset(self, cta, laps, rest):
        """CTA `cta`'s first part in the work list (`cta` = grid: the part count): every CTA has `laps` parts
        and the last, partial lap's `rest` tiles go to CTAs 0 .. rest - 1 (an even lap) or grid - rest ..
        grid - 1 (an odd one)."""
        extra = cutlass.min(cta, rest)
        if laps % 2 == 1:
            extra = cutlass.max(cta - (self.grid - rest), cutlass.Int32(0))
        return cta * laps + extra

    def __init__(self, gemm, num_experts: int, n: int, k: int, grid: int, zero_tail: bool = True):
        self.gemm = gemm
        self.zero_tail = zero_tail  # the layer's GEMMs: off (nothing reads the rows past the last end)
        self.write_row = host.GroupTensormapKernel(gemm).write_row
        self.num_experts = num_experts
        self.n, self.k, self.grid = n, k, grid
        self.widths = gemm.widths
        self.per_lane = ceil_div(num_experts, 32)
        self.header_words = header_words(grid)
        self.costs = tuple(sm90.sm90_tile_cost(w, k) for w in self.widths)
        self.convert = not gemm.a16_input  # NVFP4 A: this launch converts it to the GEMM's fp16 A

    @cute.jit
    def __call__(self, offs: cutlass.Int64, a: cutlass.Int64, sfa: cutlass.Int64, b: cutlass.Int64,
                 sfb: cutlass.Int64, c: cutlass.Int64, alpha: cutlass.Int64, tables: cutlass.Int64,
                 workspace: cutlass.Int64, work: cutlass.Int64, num_tokens: cutlass.Int32, stream: cuda.CUstream):
        E = self.num_experts
        ptr_table, size_table, tensormaps = prepared_tables(tables, workspace, E, len(self.gemm.descriptor_slots))
        converting, zeroing = row_blocks(num_tokens, self.k, self.threads, self.convert)
        if cutlass.const_expr(not self.zero_tail):
            zeroing = 0
        self.kernel(self.gemm.descriptor_atoms(), ptr_table, size_table, tensormaps, offs, a, sfa, b, sfb, c,
                    alpha, work, num_tokens, converting).launch(grid=(E + converting + zeroing, 1, 1),
                                                                block=(self.threads, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, atoms: tuple, ptr_table: cute.Tensor, size_table: cute.Tensor, tensormaps: cute.Tensor,
               offs: cutlass.Int64, a: cutlass.Int64, sfa: cutlass.Int64, b: cutlass.Int64, sfb: cutlass.Int64,
               c: cutlass.Int64, alpha: cutlass.Int64, work: cutlass.Int64, num_tokens: cutlass.Int32,
               converting: cutlass.Int32):
        E = self.num_experts
        e, _, _ = cute.arch.block_idx()
        # the GEMM's fp16 A (NVFP4 A; `MoeSm90Gemm`): the caller's rows in order, after the workspace's head
        a16 = tensormaps.iterator.toint() + self.gemm.a16_offset(E)
        if e >= E:
            row_work(e - E, offs, E, num_tokens, a, sfa, a16, c, self.n, self.k, self.threads, self.convert,
                     converting)
        else:
            self.expert_work(atoms, ptr_table, size_table, tensormaps, offs, a if not self.convert else a16, sfa, b,
                             sfb, c, alpha, work, num_tokens, e)

    @cute.jit
    def expert_work(self, atoms: tuple, ptr_table: cute.Tensor, size_table: cute.Tensor, tensormaps: cute.Tensor,
                    offs: cutlass.Int64, a16: cutlass.Int64, sfa: cutlass.Int64, b: cutlass.Int64, sfb: cutlass.Int64,
                    c: cutlass.Int64, alpha: cutlass.Int64, work: cutlass.Int64, num_tokens: cutlass.Int32, e):
        """Expert block e (steps 1-4 of the class docstring); `a16`: the GEMM's 16-bit A (the caller's with W4A16,
        the workspace's fp16 copy with NVFP4 A), 2 K bytes a row."""
        E, P = self.num_experts, self.per_lane
        n, k = self.n, self.k
        lane = cute.arch.lane_idx()
        slots = self.gemm.descriptor_slots

        @cute.struct
        class SharedStorage:
            tensormap_buffer: cute.struct.Align[
                cute.struct.MemRange[cutlass.Int64, len(slots) * TENSORMAP_BYTES // 8], TENSORMAP_BYTES]
            start: cute.struct.MemRange[cutlass.Int32, 32 * P]
            rows: cute.struct.MemRange[cutlass.Int32, 32 * P]
            choice: cute.struct.MemRange[cutlass.Int32, 32 * P]  # width index | splits << 8
            before: cute.struct.MemRange[cutlass.Int32, 32 * P]  # tiles of the same width in earlier experts

        storage = SmemAllocator().allocate(SharedStorage)
        s_start = storage.start.get_tensor(cute.make_layout((32 * P,)))
        s_rows = storage.rows.get_tensor(cute.make_layout((32 * P,)))
        s_choice = storage.choice.get_tensor(cute.make_layout((32 * P,)))
        s_before = storage.before.get_tensor(cute.make_layout((32 * P,)))
        num_widths = len(self.widths)
        n_tiles = n // 128

        # ---- 1. the experts' rows (`expert_rows`), then per expert the candidate of least total cost (fewest
        # tiles first), and its tiles counted per width (lane-local runs)
        starts, counts = expert_rows(offs, E, num_tokens, lane)
        runs = [cutlass.Int32(0) for _ in range(num_widths)]
        local = []
        for j in cutlass.range_constexpr(P):
            m = counts[j]
            best_count = cutlass.Int32(0)
            best_width = cutlass.Int32(0)
            best_total = cutlass.Int32(0)
            for ci in cutlass.range_constexpr(num_widths - 1, -1, -1):
                cap = self.widths[ci]
                count = (m + (cap - 1)) // cap
                # the narrowest width whose `count` tiles cover m
                wi = cutlass.Int32(num_widths - 1)
                cost = cutlass.Int32(self.costs[-1])
                for x in cutlass.range_constexpr(num_widths - 1, -1, -1):
                    if self.widths[x] * count >= m:
                        wi = cutlass.Int32(x)
                        cost = cutlass.Int32(self.costs[x])
                total = count * cost
                if cutlass.const_expr(ci == num_widths - 1):  # the first candidate: the fewest tiles
                    best_total, best_count, best_width = total, count, wi
                else:
                    if total < best_total:  # strictly: the first of equal totals stays
                        best_total = total
                        best_count = count
                        best_width = wi
            tiles = best_count * n_tiles
            before = cutlass.Int32(0)
            for x in cutlass.range_constexpr(num_widths):
                on = cutlass.Int32(best_width == x)
                before = before + runs[x] * on
                runs[x] = runs[x] + tiles * on
            local.append((starts[j], m, best_width | (best_count << 8), before))
        # ---- per width: exclusive scan of the lanes' tile counts, and the totals
        bases, totals = [], []
        for x in cutlass.range_constexpr(num_widths):
            t_incl = sm90.warp_inclusive_sum(runs[x], lane)
            bases.append(t_incl - runs[x])
            totals.append(cute.arch.shuffle_sync(t_incl, 31))
        for j in cutlass.range_constexpr(P):
            start, m, choice, before = local[j]
            i = lane * P + j
            s_start[i] = start
            s_rows[i] = m
            s_choice[i] = choice
            base = cutlass.Int32(0)
            for x in cutlass.range_constexpr(num_widths):
                base = base + bases[x] * cutlass.Int32((choice & 0xFF) == x)
            s_before[i] = base + before
        cute.arch.barrier()
        all_tiles = cutlass.Int32(0)
        for x in cutlass.range_constexpr(num_widths):
            all_tiles = all_tiles + totals[x]
        laps = all_tiles // self.grid
        rest = all_tiles % self.grid

        # ---- 2. expert e's table rows and parts
        start = s_start[e]
        m = s_rows[e]
        choice = s_choice[e]
        wi = choice & 0xFF
        count = choice >> 8
        if lane == 0:
            write_expert_rows(ptr_table, size_table, e, start, m, (a16, sfa + cutlass.Int64(start) * (k // 16), b,
                                                                  sfb, c, alpha), n, k, 2 * k)
        # this expert's first position in the sequence: the tiles of wider widths, then those of its width in
        # earlier experts
        width = cutlass.Int32(self.widths[0])
        first = s_before[e]
        for x in cutlass.range_constexpr(num_widths):
            if wi == x:
                width = cutlass.Int32(self.widths[x])
                for y in cutlass.range_constexpr(x + 1, num_widths):
                    first = first + totals[y]
        parts = work + 4 * self.header_words
        for j in cutlass.range(lane, count * n_tiles, 32, unroll=1):
            position = first + j
            lap = position // self.grid
            seat = position % self.grid
            cta = seat
            if lap % 2 == 1:
                cta = self.grid - 1 - seat
            entry = parts + 32 * cutlass.Int64(self.cta_offset(cta, laps, rest) + lap)
            sm90.st_global_v4(entry, cutlass.Uint32(e), cutlass.Uint32((j // n_tiles) * width), cutlass.Uint32(wi),
                              cutlass.Uint32(j % n_tiles))
            sm90.st_global_v4(entry + 16, cutlass.Uint32(0), cutlass.Uint32(k // 128), cutlass.Uint32(0xFFFFFFFF),
                              cutlass.Uint32(0))

        # ---- 3. the header (warp 0): word 0 the partials' offset (none), then the CTAs' first parts
        if e == 0:
            if lane == 0:
                sm90.st_global_u32(work, cutlass.Uint32(0))
            for cta in cutlass.range(lane, self.grid + 1, 32, unroll=1):
                offset = cutlass.Uint32(self.cta_offset(cta, laps, rest))
                sm90.st_global_u32(work + 4 * (1 + cutlass.Int64(cta)), offset)

        # ---- 4. expert e's descriptors (from the rows just written) and the workspace reset
        cute.arch.barrier()
        buffer = storage.tensormap_buffer.data_ptr()
        if m > 0:
            self.write_row(atoms, ptr_table, size_table, tensormaps, e, buffer)
        self.gemm.prepare_workspace(tensormaps, e)


class MoeSm100Gemm(host.Sm100PersistentGroupedGemmKernel):
    """B200: the persistent kernel (`Sm100PersistentConfig` with the MoE switches: `device_tile_count`,
    `group_alpha`, `c_dtype`), launched on a given queue."""

    @staticmethod
    def launch_options(queue) -> dict:
        return {} if queue is None else {"stream": queue}

    @cute.jit
    def on_stream(self, ptr_table_ptr: cute.Pointer, size_table_ptr: cute.Pointer, workspace_ptr: cute.Pointer,
                  num_tiles: cutlass.Int32, num_ctas: cutlass.Int32, num_groups: cutlass.Constexpr[int],
                  stream: cuda.CUstream):
        self.launch(ptr_table_ptr, size_table_ptr, workspace_ptr, num_tiles, num_ctas, num_groups, stream)

class MoeSm100PrepareKernel:
    """B200, per call, before the persistent GEMM on the same queue: CTA e (4 warps) for expert e.
    1. warp 0 scans `offs` (`expert_rows`), each expert's rows rounded up to the blocked scale layout's
       128-row blocks and its tiles (128-row M tiles x N / tile_n), into shared arrays; CTA 0 writes the tile
       count after the descriptor rows, which the GEMM reads instead of a launch argument;
    2. thread 0 writes expert e's pointer row (A, C at its first row; SFA at its block of `sfa_blocked`; B,
       SFB at its weight slice) and size row (M, N, K, alpha's bits);
    3. the CTA copies the expert's rows of `a_scale` (row-major) into `sfa_blocked` in the blocked order the
       kernel's TMA reads (32-bit words: four k-blocks of one row); rows past M in its last 128-row block stay
       as they are (they only reach output rows the TMA store clips);
    4. warp 0 writes expert e's TMA descriptors (`GroupTensormapKernel.write_row`).
    Then the row blocks (`row_work`): C's rows past the last end zeroed.
    Launched without programmatic dependent launch, as the Hopper one. Built and SASS-checked for sm_100a; never
    run (no B200 here)."""

    threads = 128

    def __init__(self, gemm, num_experts: int, n: int, k: int, zero_tail: bool = True):
        self.gemm = gemm
        self.zero_tail = zero_tail
        self.write_row = host.GroupTensormapKernel(gemm).write_row
        self.num_experts, self.n, self.k = num_experts, n, k
        self.per_lane = ceil_div(num_experts, 32)
        self.n_tiles = n // gemm.config.mma_tiler_mnk[1]
        self.count_offset = gemm.tensormap_workspace_bytes(num_experts)  # the tile count's int32

    @cute.jit
    def __call__(self, offs: cutlass.Int64, a: cutlass.Int64, sfa: cutlass.Int64, b: cutlass.Int64,
                 sfb: cutlass.Int64, c: cutlass.Int64, alpha: cutlass.Int64, tables: cutlass.Int64,
                 workspace: cutlass.Int64, sfa_blocked: cutlass.Int64, num_tokens: cutlass.Int32,
                 stream: cuda.CUstream):
        E = self.num_experts
        ptr_table, size_table, tensormaps = prepared_tables(tables, workspace, E, len(self.gemm.descriptor_slots))
        _, zeroing = row_blocks(num_tokens, self.k, self.threads, False)
        if cutlass.const_expr(not self.zero_tail):
            zeroing = 0
        self.kernel(self.gemm.descriptor_atoms(), ptr_table, size_table, tensormaps, offs, a, sfa, b, sfb, c,
                    alpha, workspace, sfa_blocked, num_tokens).launch(grid=(E + zeroing, 1, 1),
                                                                      block=(self.threads, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, atoms: tuple, ptr_table: cute.Tensor, size_table: cute.Tensor, tensormaps: cute.Tensor,
               offs: cutlass.Int64, a: cutlass.Int64, sfa: cutlass.Int64, b: cutlass.Int64, sfb: cutlass.Int64,
               c: cutlass.Int64, alpha: cutlass.Int64, workspace: cutlass.Int64, sfa_blocked: cutlass.Int64,
               num_tokens: cutlass.Int32):
        e, _, _ = cute.arch.block_idx()
        if e >= self.num_experts:  # a row block: C's rows past the last end zeroed (`row_work`)
            row_work(e - self.num_experts, offs, self.num_experts, num_tokens, a, sfa, cutlass.Int64(0), c, self.n,
                     self.k, self.threads, False, cutlass.Int32(0))
        else:
            self.expert_work(atoms, ptr_table, size_table, tensormaps, offs, a, sfa, b, sfb, c, alpha, workspace,
                             sfa_blocked, num_tokens, e)

    @cute.jit
    def expert_work(self, atoms: tuple, ptr_table: cute.Tensor, size_table: cute.Tensor, tensormaps: cute.Tensor,
                    offs: cutlass.Int64, a: cutlass.Int64, sfa: cutlass.Int64, b: cutlass.Int64, sfb: cutlass.Int64,
                    c: cutlass.Int64, alpha: cutlass.Int64, workspace: cutlass.Int64, sfa_blocked: cutlass.Int64,
                    num_tokens: cutlass.Int32, e):
        """Expert block e: steps 1-4 of the class docstring."""
        E, P = self.num_experts, self.per_lane
        n, k = self.n, self.k
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        slots = self.gemm.descriptor_slots

        @cute.struct
        class SharedStorage:
            tensormap_buffer: cute.struct.Align[
                cute.struct.MemRange[cutlass.Int64, len(slots) * TENSORMAP_BYTES // 8], TENSORMAP_BYTES]
            start: cute.struct.MemRange[cutlass.Int32, 32 * P]
            rows: cute.struct.MemRange[cutlass.Int32, 32 * P]
            padded_before: cute.struct.MemRange[cutlass.Int32, 32 * P]  # rows of the blocked SFA before it

        storage = SmemAllocator().allocate(SharedStorage)
        s_start = storage.start.get_tensor(cute.make_layout((32 * P,)))
        s_rows = storage.rows.get_tensor(cute.make_layout((32 * P,)))
        s_padded = storage.padded_before.get_tensor(cute.make_layout((32 * P,)))

        # ---- 1. rows, 128-row blocks and tiles per expert; the tile count
        if warp == 0:
            starts, counts = expert_rows(offs, E, num_tokens, lane)
            blocks_run = cutlass.Int32(0)
            blocks_before = []
            for j in cutlass.range_constexpr(P):
                blocks_before.append(blocks_run)
                blocks_run = blocks_run + (counts[j] + 127) // 128
            incl = sm90.warp_inclusive_sum(blocks_run, lane)
            for j in cutlass.range_constexpr(P):
                i = lane * P + j
                s_start[i] = starts[j]
                s_rows[i] = counts[j]
                s_padded[i] = 128 * (incl - blocks_run + blocks_before[j])
            if e == 0 and lane == 31:
                sm90.st_global_u32(workspace + self.count_offset, cutlass.Uint32(incl * self.n_tiles))
        cute.arch.barrier()
        start = s_start[e]
        m = s_rows[e]
        sfa_rows = sfa_blocked + cutlass.Int64(s_padded[e]) * (k // 16)

        # ---- 2. expert e's table rows
        if tidx == 0:
            write_expert_rows(ptr_table, size_table, e, start, m, (a, sfa_rows, b, sfb, c, alpha), n, k, k // 2)

        # ---- 3. A's scales, row-major -> blocked: word w of row r is k-blocks 4 w .. 4 w + 3
        words = k // 64
        src_rows = sfa + cutlass.Int64(start) * (k // 16)
        for i in cutlass.range(tidx, m * words, self.threads, unroll=1):
            r = i // words
            w = i % words
            word = sm90.ld_global_u32(src_rows + cutlass.Int64(r) * (k // 16) + 4 * w)
            sm90.st_global_u32(sfa_rows + 4 * cutlass.Int64(blocked_scale_word(r, w, words)), word)

        # ---- 4. expert e's descriptors, from the rows above
        cute.arch.barrier()
        buffer = storage.tensormap_buffer.data_ptr()
        if warp == 0:
            if m > 0:
                self.write_row(atoms, ptr_table, size_table, tensormaps, e, buffer)


# ---------------------------------------------------------------------------------------------------------
# Launching with arguments set in place
# ---------------------------------------------------------------------------------------------------------
class CellLauncher:
    """A compiled kernel launched through the DSL's C entry with its argument array packed once, each argument
    read from a ctypes cell of ours: a call sets the cells that change (pointers, the CUDA queue) and launches,
    with no DSL argument conversion (about 1 µs of host time instead of tens)."""

    def __init__(self, kernel, dsl_args: tuple, cell_types: tuple, device_index: int):
        exe_args, _ = kernel.generate_execution_args(*dsl_args)
        if len(exe_args) != len(dsl_args):
            raise RuntimeError(f"moe: the DSL passes {len(exe_args)} C arguments for {len(dsl_args)} (one each "
                               "expected); this DSL version's entry is not supported by CellLauncher")
        executor = host._executor(kernel, device_index)
        packed = executor._get_invoke_packed_args(list(exe_args))
        self.packed = (ctypes.c_void_p * len(packed))(*packed)
        self.cells = [cell_type() for cell_type in cell_types]
        for i, cell in enumerate(self.cells):
            self.packed[i] = ctypes.addressof(cell)
        self.capi, self.result = executor.jit_module.capi_func, executor.cuda_result
        self.keep_alive = (kernel, dsl_args, exe_args)

    def __call__(self, values: tuple):
        for cell, value in zip(self.cells, values):
            cell.value = value
        self.capi(self.packed)
        if self.result is not None and self.result.value:
            raise RuntimeError(f"moe: kernel launch failed with CUDA error {self.result.value}")


# ---------------------------------------------------------------------------------------------------------
# Weights, checks, and the call
# ---------------------------------------------------------------------------------------------------------
def w4a16_codes(codes: torch.Tensor) -> torch.Tensor:
    """The W4A16 order of e2m1 codes [..., K/2] (uint8, two per byte, low nibble first): within each 128-k chunk of
    a row, byte 16 q + 4 t + j holds the two k that the Hopper consumer thread of column q converts as nibbles
    n = 2 j and 2 j + 1 of its word t, n < 4 being k = 32 t + 8 n + 2 q and n >= 4 being k = 32 t + 8 (n - 4) + 2 q
    + 1 (its fragment's k-steps 2 t, 2 t + 1 at the k the wgmma expects: `fp4x8_to_f16x2x4` pairs nibbles i and
    i + 4 into one register). So a 16-bit A in its natural k order meets B's matching k, and each word spans the
    k-blocks 2 t and 2 t + 1 (its scales "split" over its registers). A permutation within every 64 bytes."""
    k = codes.shape[-1] * 2
    flat = codes.reshape(-1, k // 128, 64)
    nibbles = torch.stack((flat & 15, flat >> 4), dim=-1).reshape(flat.shape[0], k // 128, 128)
    picked = nibbles[:, :, w4a16_order().to(codes.device)].reshape(flat.shape[0], k // 128, 64, 2)
    return (picked[..., 0] | (picked[..., 1] << 4)).reshape(codes.shape)


@functools.lru_cache(maxsize=None)
def w4a16_order() -> torch.Tensor:
    """`w4a16_codes`' order: nibble 2 byte + h of a 128-k chunk (h = 0 the low nibble) holds natural k order[...]."""
    order = torch.empty(64, 2, dtype=torch.long)
    for q in range(4):
        for t in range(4):
            for j in range(4):
                for h in range(2):
                    n = 2 * j + h
                    order[16 * q + 4 * t + j, h] = 32 * t + 8 * (n % 4) + 2 * q + n // 4
    return order.flatten()


def prepare_moe_weights(b: torch.Tensor, b_scale: torch.Tensor, w4a16: bool = False) -> tuple:
    """Once per layer: (b as uint8 [E, N, K/2] contiguous, b_scale in the kernels' blocked order as
    [E, N/128, K/64, 512] e4m3), from b [E, N, K/2] (fp4x2 or uint8) and b_scale [E, N, K/16] e4m3.
    w4a16: the weights for 16-bit activations (Hopper): the codes in `w4a16_codes`' order as int8
    [E, N, K/128, 64], one row of 64 bytes per 128-k chunk: a shape and dtype no raw checkpoint tensor has, by
    which `nvfp4_moe_mm` tells the layouts apart (it reads no values), so unpermuted codes are refused."""
    if b.dim() != 3 or b_scale.dim() != 3:
        raise ValueError(f"prepare_moe_weights: b [E, N, K/2] and b_scale [E, N, K/16]; got {tuple(b.shape)} and "
                         f"{tuple(b_scale.shape)}")
    num_experts, n, half_k = b.shape
    k = 2 * half_k
    if tuple(b_scale.shape) != (num_experts, n, k // 16) or n % 128 or k % 256:
        raise ValueError(f"prepare_moe_weights: b [E, N, K/2] with N % 128 == 0 and K % 256 == 0, b_scale "
                         f"[E, N, K/16]; got b {tuple(b.shape)}, b_scale {tuple(b_scale.shape)}")
    if b_scale.dtype != torch.float8_e4m3fn:
        raise ValueError(f"prepare_moe_weights: b_scale must be torch.float8_e4m3fn, not {b_scale.dtype}")
    codes = b.contiguous().view(torch.uint8)
    if w4a16:
        codes = w4a16_codes(codes).view(torch.int8).view(num_experts, n, k // 128, 64)
    scales = b_scale.contiguous().view(torch.uint8)
    # [E, N/128, 4 (r // 32 % 4), 32 (r % 32), K/64, 4 (k-block % 4)] -> [E, N/128, K/64, 32, 4, 4]
    blocked = scales.view(num_experts, n // 128, 4, 32, k // 64, 4).permute(0, 1, 4, 3, 2, 5).contiguous()
    return codes, blocked.view(num_experts, n // 128, k // 64, 512).view(torch.float8_e4m3fn)


_FP4_DTYPES = (torch.uint8,) + ((torch.float4_e2m1fn_x2,) if hasattr(torch, "float4_e2m1fn_x2") else ())
OUT_DTYPES = (torch.float16, torch.bfloat16)
# 16-bit A (W4A16, Hopper): the GEMM's `a_input` per dtype; NVFP4 A is "fp4"
A16_INPUTS = {torch.float16: "f16", torch.bfloat16: "bf16"}


def check_moe_args(a, a_scale, b, b_scale, offs, alpha, out, out_dtype, storage: bool = True) -> tuple:
    """(T, E, N, K, out dtype, A's kind: "fp4", or "f16" / "bf16" for 16-bit A) from the tensors' metadata alone
    (no value is read); ValueError naming the first argument that does not fit. storage=False (the fake
    implementation, tracing): shapes, dtypes and devices only (no addresses)."""
    def need(ok: bool, message: str):
        if not ok:
            raise ValueError(f"nvfp4_moe_mm: {message}")

    a_input = A16_INPUTS.get(a.dtype, "fp4")
    need(a.dim() == 2 and (a.dtype in _FP4_DTYPES or a_input != "fp4"),
         f"a must be [T, K/2] float4_e2m1fn_x2 or uint8 (NVFP4), or [T, K] bfloat16 or float16 (W4A16, Hopper); got "
         f"{tuple(a.shape)} {a.dtype}")
    num_tokens, k = a.shape[0], a.shape[1] * (1 if a_input != "fp4" else 2)
    half_k = k // 2
    if a_input != "fp4":
        need(b.dim() == 4 and b.dtype == torch.int8 and tuple(b.shape[2:]) == (k // 128, 64),
             f"b must be prepare_moe_weights(..., w4a16=True)'s [E, N, K/128, 64] int8 with K/128 = {k // 128} for "
             f"{a.dtype} a (the codes in the W4A16 order); got {tuple(b.shape)} {b.dtype}"
             + (" (raw [E, N, K/2] codes go through prepare_moe_weights(b, b_scale, w4a16=True) once per layer)"
                if b.dim() == 3 else ""))
    else:
        need(b.dim() == 3 and b.dtype == torch.uint8 and b.shape[2] == half_k,
             f"b must be prepare_moe_weights' [E, N, K/2] uint8 with K/2 = {half_k} for NVFP4 a; got "
             f"{tuple(b.shape)} {b.dtype}"
             + (" (W4A16 weights take 16-bit a)" if b.dtype == torch.int8 else ""))
    num_experts, n = b.shape[0], b.shape[1]
    need(k % 256 == 0 and k > 0, f"K = {k} must be a positive multiple of 256")
    need(n % 128 == 0 and n > 0, f"N = {n} must be a positive multiple of 128")
    need(0 < num_experts <= MAX_EXPERTS, f"E = {num_experts} experts: 1 to {MAX_EXPERTS}")
    if a_input != "fp4":
        need(a_scale is None, f"a_scale must be None with {a.dtype} a (W4A16: A's values are given as they are)")
    else:
        need(a_scale is not None and tuple(a_scale.shape) == (num_tokens, k // 16)
             and a_scale.dtype == torch.float8_e4m3fn,
             f"a_scale must be [T, K/16] = [{num_tokens}, {k // 16}] float8_e4m3fn with NVFP4 a; got "
             + ("None" if a_scale is None else f"{tuple(a_scale.shape)} {a_scale.dtype}"))
    need(tuple(b_scale.shape) == (num_experts, n // 128, k // 64, 512) and b_scale.dtype == torch.float8_e4m3fn,
         f"b_scale must be prepare_moe_weights' [E, N/128, K/64, 512] float8_e4m3fn "
         f"({num_experts}, {n // 128}, {k // 64}, 512); got {tuple(b_scale.shape)} {b_scale.dtype} (raw [E, N, K/16] "
         "scales go through prepare_moe_weights once per layer)")
    need(tuple(offs.shape) == (num_experts,) and offs.dtype == torch.int32,
         f"offs must be int32 [E] = [{num_experts}]; got {tuple(offs.shape)} {offs.dtype}")
    if alpha is not None:
        need(tuple(alpha.shape) == (num_experts,) and alpha.dtype == torch.float32,
             f"alpha must be float32 [E] = [{num_experts}]; got {tuple(alpha.shape)} {alpha.dtype}")
    if out is not None:
        need(tuple(out.shape) == (num_tokens, n) and out.dtype in OUT_DTYPES,
             f"out must be [T, N] = [{num_tokens}, {n}] float16 or bfloat16; got {tuple(out.shape)} {out.dtype}")
        out_dtype = out.dtype
    need(out_dtype in OUT_DTYPES, f"out_dtype must be torch.float16 or torch.bfloat16, not {out_dtype}")
    tensors = [("a", a), ("a_scale", a_scale), ("b", b), ("b_scale", b_scale), ("offs", offs), ("alpha", alpha),
               ("out", out)]
    device = a.device
    for name, t in tensors:
        if t is None:
            continue
        need(t.device == device, f"{name} is on {t.device}, a on {device}: every tensor on one GPU")
        need(t.is_contiguous(), f"{name} must be contiguous")
        if storage:
            need(t.data_ptr() % 16 == 0 or name in ("offs", "alpha"), f"{name} must be 16-byte aligned")
    if storage:
        need(device.type == "cuda", f"the tensors are on {device}: the entry runs on a CUDA GPU")
    return num_tokens, num_experts, n, k, out_dtype, a_input


@dataclasses.dataclass(frozen=True)
class _MoeKernels:
    """One (device, E, N, K, build, out dtype, A's kind, PDL)'s two kernels as launchers. They hold no buffer:
    every call sets every address, its buffers carved from its queue's arena (`_Arena`)."""

    prepare: CellLauncher
    gemm: CellLauncher
    hopper: bool
    grid: int
    ptr_words: int  # the pointer table's words: the size table follows it


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What a checked signature's calls reuse: the kernels, and where the tables, the workspace (descriptors; on
    Hopper the fp16 A after them) and the work list (B200: the blocked copy of A's scales) lie in the arena."""

    kernels: _MoeKernels
    nbytes: int
    workspace: int
    tables: int
    work: int


class _Arena:
    """One growing device buffer that every call of a queue (or of one CUDA-graph capture) carves its buffers
    from. Calls on one queue run in order, so they share it; it grows to max(need, 1.25 x its size), so it is at
    most 1.25 x the largest call's need. A smaller one is freed on the queue it was made on (torch's caching
    allocator reuses its memory only after the work queued there before), a capture's into the graph's pool."""

    def __init__(self, device: torch.device):
        self.device, self.buffer, self.base, self.nbytes = device, None, 0, 0

    def reserve(self, nbytes: int) -> int:
        if nbytes > self.nbytes:
            size = ceil_div(max(nbytes, self.nbytes * 5 // 4), 4096) * 4096
            self.buffer = None
            self.buffer = host.aligned_device_buffer(size, 1024, self.device)
            self.base, self.nbytes = self.buffer.data_ptr(), size
        return self.base


_compiled: dict = {}  # (kind, E, N, K, config, grid) -> compiled kernel
_kernels: dict = {}  # (device, E, N, K, build, out dtype, A's kind, PDL) -> _MoeKernels
_arenas: dict = {}  # (device, queue) -> _Arena
_capture_arenas: dict = {}  # (device, capture id) -> (_Arena, queue): one per CUDA-graph capture
_signatures: dict = {}  # `_signature` -> its _Plan, or None for an empty T
_LOCK = threading.Lock()  # a call's launches and its arena: one caller at a time (the launchers' argument cells)
# the compiles of first calls: one at a time (threads first calling new shapes at once; the DSL does not say its
# compiler is thread-safe), re-entrant (the layer's plan compiles its stage kernels, then the entry's GEMMs); never
# taken while _LOCK is held
_COMPILE_LOCK = threading.RLock()
MAX_SIGNATURES = 1024  # a serving engine has a few shapes per layer kind and batch size


def _compile(kind: str, num_experts: int, n: int, k: int, config, grid: int, zero_tail: bool = True):
    key = (kind, num_experts, n, k, config, grid, zero_tail and kind == "prepare")
    fn = _compiled.get(key)
    if fn is None and isinstance(config, host.Sm100PersistentConfig):
        gemm = MoeSm100Gemm(config)
        queue = cuda.CUstream(0)
        if kind == "prepare":
            ints = (cutlass.Int64(0),) * 10
            fn = cute.compile(MoeSm100PrepareKernel(gemm, num_experts, n, k, zero_tail), *ints, cutlass.Int32(1),
                              queue)
        else:
            fn = cute.compile(gemm.on_stream, *host.kernel_args((0, 0, 0, 0, 1)), num_experts, queue)
        _compiled[key] = fn
    elif fn is None:
        gemm = MoeSm90Gemm(num_experts, config)
        queue = cuda.CUstream(0)
        if kind == "prepare":
            ints = (cutlass.Int64(0),) * 10
            fn = cute.compile(MoePrepareKernel(gemm, num_experts, n, k, grid, zero_tail), *ints, cutlass.Int32(1),
                              queue)
        else:
            fn = cute.compile(gemm.on_stream, *sm90.sm90_gemm_args((0, 0, 0, 0, 0, 1)), queue)
        _compiled[key] = fn
    return fn


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _hopper_config(build: str, out_dtype, a_input: str):
    return dataclasses.replace(moe_builds()[build], bf16_out=out_dtype == torch.bfloat16, a_input=a_input,
                               use_pdl=host.USE_PDL)


def _kernels_for(device: torch.device, num_tokens: int, num_experts: int, n: int, k: int, out_dtype,
                 a_input: str, zero_tail: bool = True) -> tuple:
    """(the kernels, the build) of a call of T tokens: compiled and wrapped once per key (`_kernels`).
    zero_tail=False (the layer's GEMMs): the rows of C past the last end are left as they are."""
    major, _ = host._device_capability(device.index)
    if major not in (9, 10):
        raise host.UnsupportedDeviceError(f"nvfp4_moe_mm runs on Hopper (sm_90) and B200 (sm_100) GPUs; this GPU is "
                                          f"sm_{major}x")
    if major == 10 and a_input != "fp4":
        raise ValueError("nvfp4_moe_mm: 16-bit a (W4A16) runs on Hopper only; on a B200 give NVFP4 a [T, K/2] with "
                         "its a_scale (the fp4 tensor cores take both operands in fp4)")
    build = choose_build(num_tokens, num_experts) if major == 9 else "b200"
    key = (device.index, num_experts, n, k, build, out_dtype, a_input, host.USE_PDL, zero_tail)
    kernels = _kernels.get(key)
    if kernels is not None:
        return kernels, build
    grid = _sm_count(device.index)
    config = _hopper_config(build, out_dtype, a_input) if major == 9 else dataclasses.replace(
        b200_config(out_dtype), use_pdl=host.USE_PDL)
    prepare = CellLauncher(_compile("prepare", num_experts, n, k, config, grid, zero_tail),
                           (*(cutlass.Int64(0),) * 10, cutlass.Int32(1), cuda.CUstream(0)),
                           (ctypes.c_int64,) * 10 + (ctypes.c_int32, ctypes.c_void_p), device.index)
    if major == 9:
        gemm = CellLauncher(_compile("gemm", num_experts, n, k, config, grid),
                            (*sm90.sm90_gemm_args((0, 0, 0, 0, 0, grid)), cuda.CUstream(0)),
                            (ctypes.c_int64,) * 4 + (ctypes.c_int32,) * 2 + (ctypes.c_void_p,), device.index)
    else:
        gemm = CellLauncher(_compile("gemm", num_experts, n, k, config, grid),
                            (*host.kernel_args((0, 0, 0, 0, grid)), cuda.CUstream(0)),
                            (ctypes.c_int64,) * 3 + (ctypes.c_int32,) * 2 + (ctypes.c_void_p,), device.index)
    kernels = _kernels[key] = _MoeKernels(prepare, gemm, major == 9, grid, table_words(num_experts)[0])
    return kernels, build


def buffer_bytes(hopper: bool, num_tokens: int, num_experts: int, n: int, k: int, a_input: str, widths: tuple,
                 grid: int) -> tuple:
    """(bytes in all, workspace offset, tables offset, work offset) of one call's buffers in its arena, each
    1024-aligned: the workspace (Hopper: descriptor rows and counters, then with NVFP4 A the fp16 A, 2 K bytes a
    token; B200: the descriptor rows and the tile count), the pointer and size tables, and the work list (Hopper:
    header and at most `max_parts` parts of 32 bytes) or the blocked copy of A's scales (B200: each expert's rows
    rounded up to 128, at most T + 127 E rows of K / 16 bytes)."""
    def up(x: int) -> int:
        return ceil_div(x, 1024) * 1024

    if hopper:
        workspace = MoeSm90Gemm.a16_offset(num_experts) + (num_tokens * k * 2 if a_input == "fp4" else 0)
        work = 4 * (header_words(grid) + 8 * max_parts(num_tokens, num_experts, n, widths))
    else:
        workspace = MoeSm100Gemm.tensormap_workspace_bytes(num_experts) + 128
        work = (num_tokens + 127 * num_experts) * (k // 16)
    tables = up(workspace)
    work_at = tables + up(8 * table_words(num_experts)[1])
    return work_at + up(work), 0, tables, work_at


def signature_of(tensors: tuple, device_index: int) -> tuple:
    """What checks read of `tensors` (None where one is absent): shapes, dtypes, devices, contiguity, read cheaply;
    and the current queue of CUDA device `device_index` (None for -1, the CPU). The entry's and the layer's cache
    keys: a call whose signature was checked before skips the checks (only the addresses are checked each call)."""
    return (tuple(None if t is None else (t.shape, t.dtype, t.get_device(), t.is_contiguous()) for t in tensors),
            torch._C._cuda_getCurrentRawStream(device_index) if device_index >= 0 else None)


def _signature(a, a_scale, b, b_scale, offs, alpha, out) -> tuple:
    """The entry's `signature_of` (`_moe_mm_into`)."""
    tensors = (a, a_scale, b, b_scale, offs, out) if alpha is None else (a, a_scale, b, b_scale, offs, out, alpha)
    return signature_of(tensors, a.get_device())


def _plan_for(signature, a, a_scale, b, b_scale, offs, alpha, out) -> Optional[_Plan]:
    """The checks and the kernels of a new signature; None when T = 0 (nothing to launch)."""
    num_tokens, num_experts, n, k, out_dtype, a_input = check_moe_args(a, a_scale, b, b_scale, offs, alpha, out,
                                                                        out.dtype)
    if num_tokens == 0:
        return None
    return plan(a.device, num_tokens, num_experts, n, k, out_dtype, a_input)


def plan(device: torch.device, num_tokens: int, num_experts: int, n: int, k: int, out_dtype, a_input: str,
         zero_tail: bool = True) -> _Plan:
    """The kernels and buffer layout of a checked call of T > 0 rows (the entry's, and each of the layer's
    GEMMs: `launch`)."""
    with _COMPILE_LOCK, torch.cuda.device(device), _relaxed_capture():  # a first call inside a capture compiles here
        kernels, build = _kernels_for(device, num_tokens, num_experts, n, k, out_dtype, a_input, zero_tail)
    widths = moe_builds()[build].widths if kernels.hopper else ()
    return _Plan(kernels, *buffer_bytes(kernels.hopper, num_tokens, num_experts, n, k, a_input, widths, kernels.grid))


def launch(plan: _Plan, base: int, offs: int, a: int, a_scale: int, b: int, b_scale: int, out: int, alpha: int,
           num_tokens: int, queue: int) -> None:
    """A plan's two launches on `queue` with its buffers at `base` (an arena's, plan.nbytes long) and the
    operands' addresses (0 for no a_scale / alpha); the caller holds _LOCK and the device."""
    kernels = plan.kernels
    tables, workspace, work = base + plan.tables, base + plan.workspace, base + plan.work
    kernels.prepare((offs, a, a_scale, b, b_scale, out, alpha, tables, workspace, work, num_tokens, queue))
    if kernels.hopper:
        kernels.gemm((tables, tables + 8 * kernels.ptr_words, workspace, work, 0, kernels.grid, queue))
    else:
        kernels.gemm((tables, tables + 8 * kernels.ptr_words, workspace, 0, kernels.grid, queue))


def _capture_id(queue: int) -> Optional[int]:
    """The id of the CUDA-graph capture under way on `queue`, or None."""
    result = cuda.cuStreamGetCaptureInfo(cuda.CUstream(queue))
    if result[0] != cuda.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"nvfp4_moe_mm: cuStreamGetCaptureInfo failed: {result[0]}")
    active = result[1] == cuda.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_ACTIVE
    return int(result[2]) if active else None


@contextlib.contextmanager
def _relaxed_capture():
    """This thread's CUDA-graph capture mode relaxed while it compiles and loads kernels, so that a first call
    inside a capture needs no eager warm-up (module loading is not a queue operation, but a global-mode capture
    refuses it). Nothing changes outside a capture."""
    if not torch.cuda.is_available() or not torch.cuda.is_current_stream_capturing():
        yield
        return
    relaxed = cuda.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
    err, previous = cuda.cuThreadExchangeStreamCaptureMode(relaxed)
    if err != cuda.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"nvfp4_moe_mm: cuThreadExchangeStreamCaptureMode failed: {err}")
    try:
        yield
    finally:
        cuda.cuThreadExchangeStreamCaptureMode(previous)


def _arena(device: torch.device, queue: int, capturing: bool) -> _Arena:
    """The arena of this call: its queue's, or (inside a CUDA-graph capture) the capture's own, made from the
    graph's memory pool, so that graphs replayed at the same time never share buffers. Captures that have ended
    let go of theirs (the graph keeps the memory: its pool)."""
    if _capture_arenas:
        for key, (_, q) in list(_capture_arenas.items()):
            if _capture_id(q) != key[1]:
                del _capture_arenas[key]
    if not capturing:
        arena = _arenas.get((device.index, queue))
        if arena is None:
            arena = _arenas[(device.index, queue)] = _Arena(device)
        return arena
    key = (device.index, _capture_id(queue))
    entry = _capture_arenas.get(key)
    if entry is None:
        entry = _capture_arenas[key] = (_Arena(device), queue)
    return entry[0]


def _moe_mm_into(a, a_scale, b, b_scale, offs, alpha, out) -> None:
    """One call: the checks (once per signature), then the two launches with this call's addresses, under the
    tensors' device, one caller at a time."""
    signature = _signature(a, a_scale, b, b_scale, offs, alpha, out)
    try:
        plan = _signatures[signature]
    except KeyError:
        plan = _plan_for(signature, a, a_scale, b, b_scale, offs, alpha, out)
        if len(_signatures) >= MAX_SIGNATURES:
            _signatures.clear()
        _signatures[signature] = plan
    if plan is None:
        return
    pas = 0 if a_scale is None else a_scale.data_ptr()
    pa, pb, pbs, po = a.data_ptr(), b.data_ptr(), b_scale.data_ptr(), out.data_ptr()
    if (pa | pas | pb | pbs | po) & 15:
        check_moe_args(a, a_scale, b, b_scale, offs, alpha, out, out.dtype)  # names the misaligned one
    queue = signature[1]
    with _on_device(a.device):
        capturing = torch.cuda.is_current_stream_capturing()
        with _LOCK:
            base = _arena(a.device, queue, capturing).reserve(plan.nbytes)
            launch(plan, base, offs.data_ptr(), pa, pas, pb, pbs, po, 0 if alpha is None else alpha.data_ptr(),
                   a.shape[0], queue)


def _on_device(device: torch.device):
    """A guard that makes `device` current for the launches (the DSL launches on the current device's context),
    or nothing when it already is."""
    return contextlib.nullcontext() if torch.cuda.current_device() == device.index else torch.cuda.device(device)


def cache_info() -> dict:
    """What the entry holds: compiled kernels, kernel sets, checked signatures, and the arenas (device memory:
    one per device and CUDA queue that has called, one per CUDA-graph capture under way) with their bytes."""
    arenas = [("queue", key, arena.nbytes) for key, arena in _arenas.items()]
    arenas += [("capture", key, entry[0].nbytes) for key, entry in _capture_arenas.items()]
    return {"compiled": len(_compiled), "kernel_sets": len(_kernels), "signatures": len(_signatures),
            "arenas": arenas, "arena_bytes": sum(nbytes for _, _, nbytes in arenas)}


def clear_caches(compiled: bool = False) -> None:
    """Lets go of every arena and checked signature (their memory returns to torch's allocator, reused only after
    the work queued before on its queue), and with `compiled` the kernels too. Not while a CUDA graph that calls
    the entry is being captured: the capture's arena would go with it."""
    with _LOCK:
        _signatures.clear()
        _arenas.clear()
        _capture_arenas.clear()
        if compiled:
            _kernels.clear()
            _compiled.clear()


# ---------------------------------------------------------------------------------------------------------
# The torch ops
# ---------------------------------------------------------------------------------------------------------
@torch.library.custom_op("nvfp4_moe::mm", mutates_args=())
def _mm_op(a: torch.Tensor, a_scale: Optional[torch.Tensor], b: torch.Tensor, b_scale: torch.Tensor, offs: torch.Tensor,
           alpha: Optional[torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty((a.shape[0], b.shape[1]), dtype=out_dtype, device=a.device)
    _moe_mm_into(a, a_scale, b, b_scale, offs, alpha, out)
    return out


@_mm_op.register_fake
def _mm_fake(a, a_scale, b, b_scale, offs, alpha, out_dtype):
    check_moe_args(a, a_scale, b, b_scale, offs, alpha, None, out_dtype, storage=False)
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


@torch.library.custom_op("nvfp4_moe::mm_out", mutates_args=("out",))
def _mm_out_op(a: torch.Tensor, a_scale: Optional[torch.Tensor], b: torch.Tensor, b_scale: torch.Tensor, offs: torch.Tensor,
               alpha: Optional[torch.Tensor], out: torch.Tensor) -> None:
    _moe_mm_into(a, a_scale, b, b_scale, offs, alpha, out)


@_mm_out_op.register_fake
def _mm_out_fake(a, a_scale, b, b_scale, offs, alpha, out):
    check_moe_args(a, a_scale, b, b_scale, offs, alpha, out, out.dtype, storage=False)


def nvfp4_moe_mm(a: torch.Tensor, a_scale: Optional[torch.Tensor], b: torch.Tensor, b_scale: torch.Tensor, offs: torch.Tensor,
                 alpha: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None,
                 out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The MoE layer's expert GEMM (module docstring). Eagerly it calls the implementation directly (the torch
    dispatcher's Python op costs host microseconds per call); under torch.compile, the registered op."""
    if torch.compiler.is_compiling():
        if out is None:
            return torch.ops.nvfp4_moe.mm(a, a_scale, b, b_scale, offs, alpha, out_dtype)
        torch.ops.nvfp4_moe.mm_out(a, a_scale, b, b_scale, offs, alpha, out)
        return out
    if out is None:
        out = torch.empty((a.shape[0], b.shape[1]), dtype=out_dtype, device=a.device)
    _moe_mm_into(a, a_scale, b, b_scale, offs, alpha, out)
    return out
