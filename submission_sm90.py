"""The Hopper (sm_90a) backend of the NVFP4 grouped GEMM in submission.py: how the kernel is tested on an H200.

Hopper has no fp4 tensor cores, so both operands are dequantized exactly to fp16 (every e2m1 x e4m3 product
is exact in fp16) and multiplied by fp16 wgmma with fp32 accumulation (`Sm90BlockScaledGroupedGemmKernel`).
By default (`sm90_auto`: `sm90_a16_mexact`, or `sm90_a16_mexact128` or `sm90_a16_narrow` where its plan is
predicted shorter, `choose_sm90_config`) one persistent launch per call: first every thread of every CTA
writes its share of all groups' A as fp16 into the launch's workspace and a grid-wide barrier orders that
before any fp16 A load (`Sm90GemmConfig.a16_fused`); then the CTAs walk a host-planned work list
(`plan_sm90_work`: each group's M split into tiles 64-192 rows wide, dealt longest first to the least-loaded
CTA; where whole tiles are at most one per SM, tiles' K may be split across CTAs instead,
`Sm90GemmConfig.split_k`; where they are many per SM, as in a MoE layer whose every step is a new shape, a
vectorised plan, `_sm90_bulk_plan`; the words go up with the tables): a producer warp TMA-loads fp16 A, the
packed fp4 B and its blocked scales, two consumer warpgroups dequantize B in registers as the wgmma A operand,
run the mainloop compiled for the tile's width, and store C^T tiles by TMA (a part of a split tile first meets
the other parts' fp32 partials in the workspace: `Sm90BlockScaledGroupedGemmKernel.split_fixup`). Barriers and
copies are the DSL's pipeline classes and TMA atoms, as on Blackwell; inline PTX is left for the operand
conversions and hand-addressed shared memory. `sm90_tile128` uses 128-row tiles on the round-robin
`GroupTileScheduler` and converts A in a transform warpgroup of every CTA. `sm90_a16_narrow` is the M-exact
kernel built for tiles 16-128 rows wide, for MoE experts with tens of tokens each; `sm90_a16_pairs` is that
kernel at widths 16-32 with two pairs of consumer warpgroups taking alternate parts of the work list, which
`sm90_auto` takes where the non-empty groups average at most `SM90_NARROW_MEAN_ROWS` rows.

What this module shares with the B200 kernels, from submission.py: the host path (constraint check,
pointer/size tables, launch-metadata and compile caches, the prepared-call fast path, the launch paths), the
group tile scheduler and the per-group descriptor preparation (`GroupTensormapKernel`). It plugs into that
host path as one `KernelBackend` (`Sm90Backend`, at the end of this file); submission.py loads this file from
beside itself on the first call on an sm_90 GPU (or with CUTE_DSL_ARCH=sm_90a). The leaderboard receives
submission.py alone and never needs it.

How to use it (besides submission.custom_kernel):
    set_sm90_variant(name)   one of SM90_VARIANTS ("sm90_auto": choose_sm90_config's choice, M-exact tiles
                             planned per problem; the others force one variant; NVFP4_SM90_VARIANT=name at
                             import)
    set_sm90_overrides(**fields)   Sm90GemmConfig fields over every build's, for side-by-side runs (`bench.py
                             --ab`): a lever under measurement is a field that no variant sets yet
    plan_sm90_work(sizes, num_sms, ...)   the M-exact kernel's host plan, no GPU needed
docs/HOPPER_NOTES.md has the design and the measured log.
"""
import dataclasses
import enum
import functools
import heapq
from collections import defaultdict
from typing import Optional

import torch

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op
from cutlass.cute.nvgpu import cpasync, warpgroup

import submission as host
from submission import (
    DYNAMIC_SMEM_BUDGET, KERNEL_VARIANTS, TENSORMAP_BYTES, USE_PDL, GemmSchedule, GroupTensormapKernel,
    GroupTileScheduler, KernelBackend, PtrColumn, SizeColumn, SmemAllocator, TmaDescriptorRows,
    _check_choice, _check_setter_name, _choice_from_env, ceil_div, compile_key, compiled_kernel,
    descriptor_table, fence_smem_for_async_proxy, group_tables, kernel_args, make_launcher,
    num_output_tiles, register_backend,
)

_OperandMajorMode = getattr(cute.nvgpu, "OperandMajorMode", None) or warpgroup.OperandMajorMode  # 4.8 / 4.3


# ---------------------------------------------------------------------------------------------------------
# Configuration: the Hopper variants and the M-exact plan
# ---------------------------------------------------------------------------------------------------------
# M-exact Hopper tiles (Sm90GemmConfig.m_exact): the widths a tile's A rows (the wgmma N) can take. A build
# takes the widths between its min_width and max_width; each is its own compiled mainloop, chosen per tile at
# run time. 192 is the widest whose three fp16 A buffers (48 KB each) fit in shared memory beside the B
# stages and the epilogue slabs. A kernel built for widths up to 128 fits four 32 KB buffers instead: a
# deeper A prefetch. The narrow builds (16-128, and 16-32 with consumer pairs) are for experts with few tokens
# (`SM90_NARROW_MEAN_ROWS`, `choose_sm90_config`).
# NOTES: at most five widths per build: with a sixth mainloop (32 beside 64-192) ptxas serialized every wgmma
# of the kernel ("insufficient register resources", C7512; tests/test_build.py checks the SASS for it). No
# width 8: DSL 4.3.5 rejects the register-sourced 64x8x16 wgmma of this kernel at IR verification ("'cute.gemm'
# op invalid layout of A/B/D", B (1,1):(0,0)); 4.8.1 builds it. At 16 a chunk's MMA (128 cycles) is already
# small beside its B conversion.
SM90_WIDTHS = (16, 32, 64, 96, 128, 160, 192)
SM90_MAX_BUILD_WIDTHS = 5
SM90_DEFAULT_WIDTHS = (64, 96, 128, 160, 192)  # the widest build's (`sm90_a16_mexact`)


def sm90_widths(max_width: int, min_width: int = SM90_DEFAULT_WIDTHS[0]) -> tuple:
    """The M-exact widths of a build: those of SM90_WIDTHS from `min_width` to `max_width`. A tile's width
    index (the work list's word, the kernel's per-width mainloop) is its index in this tuple."""
    return tuple(w for w in SM90_WIDTHS if min_width <= w <= max_width)


# `sm90_auto` takes the consumer-pairs build (widths 16-32) where the non-empty groups average at most this many
# rows. NOTES: it measured 6-8 % faster than the narrow build (then widths 16-64, one consumer pair) on the three
# DeepSeek-V3 decode cases (H100, DSL 4.5.2, docs/HOPPER_NOTES.md v29), and 4-6 % slower on Qwen3's 32 rows per
# expert, where the wide builds run. Measured on the H200 (DSL 4.3.5, v23), the narrow build against the wide builds
# on the five MoE decode cases of bench.py --moe: 17-19 % faster on the three DeepSeek-V3 ones (8.4 and 3.2 rows per
# active expert), 7 % faster on Qwen3 down and 2 % slower on Qwen3 up (32.5 rows). The benchmarks and task.yml
# shapes (40-512 rows) keep the wide builds. Its weight ring stays at 4 stages: 12 stages measured 1-3 % slower on
# all five (with the fp16 A loads in a warp of their own too, a form that was also wrong on two benchmark shapes and
# was removed), so weight bytes in flight are not what holds it back.
SM90_NARROW_MEAN_ROWS = 16
# Cost of one 128-k chunk of an M-exact tile, in rows of MMA: its W rows plus the B conversion and
# pipeline work that does not shrink with W (H200: a 128-row a16 chunk took 0.86 us, 0.67 us of it MMA).
SM90_CHUNK_OVERHEAD_ROWS = 36
# Cost of starting and finishing a tile (first loads, epilogue), in the same unit (about 1.5 us).
SM90_TILE_OVERHEAD = 300
# The least a 128-k chunk costs, whatever its width: streaming its 9 KB of B and scales, the SM's share of
# the DRAM rate when every SM streams (4.14 TB/s / 132 SMs: 0.29 us, at the 5.2 ns per unit that the
# 128-row chunk's 0.86 us gives). It binds only tiles narrower than 20 rows: there the plan balances weight
# bytes per SM rather than MMA rows.
SM90_CHUNK_FLOOR = 56
# What A can be (`Sm90GemmConfig.a_input`): NVFP4 codes with scales, or 16-bit values (W4A16)
SM90_A_INPUTS = ("fp4", "f16", "bf16")


@dataclasses.dataclass(frozen=True)
class Sm90GemmConfig:
    """Compile-time configuration of `Sm90BlockScaledGroupedGemmKernel` (everything baked in but G).

    A tile is 128 rows of B (two consumer warpgroups x 64, the wgmma M) by 128 rows of A, or (m_exact) by one
    of SM90_WIDTHS. (Tiles of 256 rows of B lost on every benchmark and are retired: docs/HOPPER_NOTES.md.)
    num_stages: depth of the fp4 + scale ring (0: 4).
    a16_prepass: A (the small operand) is converted to fp16 once per call into the launch's workspace (in the
      GEMM's own launch, or by `Sm90AConvertKernel`: a16_fused), and the GEMM TMA-loads it (no transform
      warpgroup work); False: the transform warpgroup converts A in every CTA that needs it (once per N tile).
    a16_fused: with a16_prepass, the conversion is the first phase of the GEMM's own launch (every CTA converts
      its share, then a grid-wide barrier, `sm90_grid_arrive_and_wait`, orders it before the first fp16 A
      load): one launch per call, host cost per cached call that of a single-launch variant (H200: 5.3 vs
      10.0 us for two launches, 5.0 for `sm90_tile128`). False: `Sm90AConvertKernel` runs as a launch of its
      own before the GEMM; kept as the measured comparison (on the GPU it was 0.7 / 1.4 % faster on bench0 /
      bench2 and 1.9 / 3.3 % slower on bench1 / bench3: docs/HOPPER_NOTES.md v16), tested on the GPU.
      NOTES: the grid-wide barrier completes only while every CTA is resident at once, so a fused call waits
      for any kernel that holds an SM (another queue's, MPS, green contexts); custom_kernel's default keeps it
      (the leaderboard times it alone), the MoE entry's builds turn it off.
    m_exact: M-exact tiles (with a16_prepass): a tile covers one M split of a group, as wide as the
      split rounded up to one of SM90_WIDTHS (the wgmma N), so a group of M <= 192 is one tile row and B is
      converted once per split instead of once per 128 rows; the host plans the splits and a cost-balanced
      work list per CTA (`plan_sm90_work`) instead of the round-robin `GroupTileScheduler`.
    max_width: m_exact only: the widest tile (one of SM90_WIDTHS; the plan splits groups so that none is wider).
      The fp16 A buffers are this many rows, so a narrower maximum leaves room for more of them
      (`Sm90BlockScaledGroupedGemmKernel.num_a16`) and for more stages.
    min_width: m_exact only: the narrowest tile (one of SM90_WIDTHS); the build's widths are those of
      SM90_WIDTHS from min_width to max_width (at most SM90_MAX_BUILD_WIDTHS). Below 32, the fp16 A loads and
      the C^T stores go as min_width-row TMA boxes (else 32).
    consumer_pairs: 1, or 2 (m_exact with widths up to 32 only: `sm90_a16_pairs`): two pairs of consumer warpgroups
      per CTA, which take alternate parts of the CTA's work list (pair p the parts of parity p), each with its
      own epilogue slabs, so that one pair's part start and end (first wait, drain, epilogue) overlap the other
      pair's mainloop (docs/HOPPER_NOTES.md v41: 2 % faster on dsv3-down-256, 7 % on 2-chunk parts, than the
      pairs taking alternate chunks of every part and joining their accumulators, v29). The transform
      warpgroup, idle with the prepass, is left out: 640 threads, consumers at 112 registers.
    a16_buffers: fp16 A buffers (0: as many as fit beside the stages, at most 4); `sm90_a16_pairs` takes 8
      (14 % faster than 4 when its pairs split each part's chunks, v29b).
    split_k: m_exact only: the plan may split a tile's K across CTAs where whole tiles leave SMs idle
      (`plan_sm90_work`); the parts' fp32 partials meet in the workspace and the last part to finish stores
      the tile. A planning choice only: the kernel runs either plan, so it is not part of the compile key.
    The MoE entry's switches (nvfp4_moe/gemm.py, whose builds also set a16_fused off: its preparation launch
    converts A, so no grid-wide barrier; the leaderboard's builds leave them off, their PTX unchanged):
    group_alpha: the epilogue multiplies each group's output by its fp32 scale (an NVFP4 checkpoint's global
      scale), whose bits the size table's L column holds.
    bf16_out: C is written as bf16 (round to nearest) instead of fp16.
    a_input: "fp4" (NVFP4 A and its scales, the leaderboard's), or "f16" / "bf16": A given as 16-bit values
      (W4A16, the MoE entry's): the fp16 A region of the workspace, its conversion and the grid barrier go, the
      producer TMA-loads A from the caller's tensor (the pointer table's A column) into the A buffers as it is,
      and the consumers convert B to A's type (m_exact builds only).
    """

    num_stages: int = 0
    use_pdl: bool = USE_PDL  # programmatic dependent launch
    a16_prepass: bool = False
    a16_fused: bool = True
    m_exact: bool = False
    max_width: int = SM90_DEFAULT_WIDTHS[-1]
    min_width: int = SM90_DEFAULT_WIDTHS[0]
    split_k: bool = True
    consumer_pairs: int = 1
    a16_buffers: int = 0
    group_alpha: bool = False
    bf16_out: bool = False
    a_input: str = "fp4"

    def __post_init__(self):
        if self.m_exact != self.a16_prepass:
            raise ValueError("Sm90GemmConfig: m_exact and a16_prepass go together (the M-exact tiles load fp16 A; "
                             "128-row tiles convert A in the kernel)")
        for name, default in (("max_width", SM90_DEFAULT_WIDTHS[-1]), ("min_width", SM90_DEFAULT_WIDTHS[0])):
            value = getattr(self, name)
            if value not in SM90_WIDTHS or (value != default and not self.m_exact):
                raise ValueError(f"Sm90GemmConfig.{name}={value}: one of {SM90_WIDTHS}, and only with m_exact")
        if self.consumer_pairs not in (1, 2) or (self.consumer_pairs == 2 and not (self.m_exact and self.max_width <= 32)):
            raise ValueError(f"Sm90GemmConfig.consumer_pairs={self.consumer_pairs}: 1, or 2 with m_exact and "
                             "max_width <= 32")
        if self.a_input not in SM90_A_INPUTS or (self.a_input != "fp4" and not self.m_exact):
            raise ValueError(f"Sm90GemmConfig.a_input={self.a_input!r}: one of {SM90_A_INPUTS}; 16-bit A only with "
                             "m_exact")
        if self.m_exact and not 0 < len(self.widths) <= SM90_MAX_BUILD_WIDTHS:
            raise ValueError(f"Sm90GemmConfig: widths {self.min_width}-{self.max_width} give {len(self.widths)} "
                             f"mainloops; a build takes 1 to {SM90_MAX_BUILD_WIDTHS}")

    @property
    def widths(self) -> tuple:
        """m_exact: the tile widths the kernel is built for (`sm90_widths`); else the one width, 128."""
        return sm90_widths(self.max_width, self.min_width) if self.m_exact else (128,)

    @property
    def tile_mn(self) -> tuple:
        """(rows of A, rows of B) of a tile; m_exact: the widest of its per-group widths."""
        return (self.widths[-1], 128)


# Hopper's kernels by name. custom_kernel picks one per problem (choose_sm90_config); compile_for and the
# tests can name one.
SM90_VARIANT_CONFIGS = {
    "sm90_tile128": Sm90GemmConfig(),
    "sm90_a16_mexact": Sm90GemmConfig(a16_prepass=True, m_exact=True),
    "sm90_a16_mexact128": Sm90GemmConfig(a16_prepass=True, m_exact=True, max_width=128),
    # widths 16-128: on the Qwen3 decode cases 4.5 % / 7.8 % faster than the wide builds, where 16-64 was 2 %
    # slower / 2 % faster (H100, docs/HOPPER_NOTES.md v36)
    "sm90_a16_narrow": Sm90GemmConfig(a16_prepass=True, m_exact=True, max_width=128, min_width=16),
    # sm90_auto's build for experts with a few rows each: twice the consumer warps per SM, the pairs on
    # alternate parts; 8 stages and 8 fp16 A buffers (when the pairs split each part's chunks, with 4 A buffers it
    # measured 8-10 % slower than narrow on the DeepSeek-V3 decode cases, with 8 6-8 % faster; the pairs on
    # alternate parts then 2 % faster on dsv3-down-256: H100, docs/HOPPER_NOTES.md v29, v41)
    "sm90_a16_pairs": Sm90GemmConfig(a16_prepass=True, m_exact=True, max_width=32, min_width=16, consumer_pairs=2,
                                     num_stages=8, a16_buffers=8),
}


def choose_sm90_config(problem_sizes, num_sms: int) -> Sm90GemmConfig:
    """M-exact tiles with A converted once per call, for every problem: on the H200 they were faster than or
    level with every other variant on each benchmark (docs/HOPPER_NOTES.md v11); their plan
    (`plan_sm90_work`) already weighs tile widths and split-K against filling the SMs.
    - Experts with a few tokens each (the non-empty groups average at most `SM90_NARROW_MEAN_ROWS` rows):
      `sm90_a16_pairs` (tiles 16-32 rows wide, two consumer pairs), measured 6-8 % faster than
      `sm90_a16_narrow` (16-64, docs/HOPPER_NOTES.md v29), which was 17-19 % faster than the wide builds on
      the DeepSeek-V3 decode cases (v23).
    - Else the build for widths 16-128 (`sm90_a16_narrow`) where its plan's predicted makespan is shorter
      than both wide builds': tiles of 16 and 32 rows for experts with tens of tokens. Qwen3-30B-A3B decode
      (32 rows per expert on average): predicted 25 % / 18 % shorter, measured 4.5 % / 7.8 % faster on the
      H100 (docs/HOPPER_NOTES.md v36). Where its plan only ties (bench0, bench3: no tile under 64 rows) the
      wide builds keep the shape.
    - Else the build for widths up to 128 (`sm90_a16_mexact128`, one fp16 A buffer more: a deeper A prefetch
      the plan's model does not see) wherever its plan's predicted makespan is no longer than the widest
      build's; else `sm90_a16_mexact`. Measured on the H200 (docs/HOPPER_NOTES.md v17, v22): equal plans
      (bench3) 2.0 % faster at 128, equal makespans with different plans (bench0) 6 % faster at 128; where
      the 128 plan is predicted longer (bench1: 19 %, bench2: 19 %) it measured 16 % and 11 % slower.
    Empty groups do not count. No sizes (`compile_for`): `sm90_a16_mexact`."""
    sizes = tuple(tuple(size) for size in problem_sizes if size[0] != 0)
    return _choose_sm90_config(sizes, num_sms)


@functools.lru_cache(maxsize=256)
def _choose_sm90_config(sizes: tuple, num_sms: int) -> Sm90GemmConfig:
    """`choose_sm90_config` once per problem shape (comparing three plans is O(tiles) each)."""
    if sizes and sum(size[0] for size in sizes) <= SM90_NARROW_MEAN_ROWS * len(sizes):
        return SM90_VARIANT_CONFIGS["sm90_a16_pairs"]
    if not sizes:
        return SM90_VARIANT_CONFIGS["sm90_a16_mexact"]
    wide, mid, narrow = (SM90_VARIANT_CONFIGS[name] for name in ("sm90_a16_mexact", "sm90_a16_mexact128",
                                                                 "sm90_a16_narrow"))
    wide_ms, mid_ms, narrow_ms = (plan_sm90_work(sizes, num_sms, config.widths, config.split_k).makespan
                                  for config in (wide, mid, narrow))
    if narrow_ms < min(wide_ms, mid_ms):
        return narrow
    return mid if mid_ms <= wide_ms else wide


@dataclasses.dataclass(frozen=True)
class Sm90WorkPlan:
    """The M-exact kernel's schedule for one problem: how each group's M is split, and which tiles (or, with
    split-K, K ranges of tiles: parts) each CTA runs (`plan_sm90_work`). `words()` is its device form, what
    the kernel reads."""

    widths: tuple  # the build's tile widths (`Sm90GemmConfig.widths`); a part's width index is into these
    splits: tuple  # per group: (number of M splits, width of each: one of `widths`)
    # per CTA: its parts in order, each SM90_PART_WORDS words: (group, first row, width index, N tile, first
    # 128-k chunk, chunks, split tile index or -1 for a whole tile, part | parts << 8 | first slot << 16)
    cta_tiles: tuple
    makespan: float  # the busiest CTA's cost (SM90 cost units)
    num_split_tiles: int = 0  # tiles whose K is split over several parts (split-K); each has one counter
    num_slots: int = 0  # fp32 partial-accumulator slots: one per part of a split tile

    @property
    def num_tiles(self) -> int:
        """Parts in the plan (a whole tile is one part)."""
        return sum(len(tiles) for tiles in self.cta_tiles)

    @property
    def num_ctas(self) -> int:
        return len(self.cta_tiles)

    def word_tensor(self, partials_kb: int = 0) -> torch.Tensor:
        """`words()` as a CPU int32 tensor."""
        return torch.tensor(self.words(partials_kb), dtype=torch.int32)

    def words(self, partials_kb: int = 0) -> list:
        """int32 words: a header of SM90_PART_WORDS-word rows (the partial slots' workspace offset in KB, then
        the CTAs' first-part offsets, grid + 1 of them), then SM90_PART_WORDS words per part, each CTA's
        parts contiguous."""
        offsets, total = [], 0
        for tiles in self.cta_tiles:
            offsets.append(total)
            total += len(tiles)
        offsets.append(total)
        header = sm90_work_header(partials_kb, offsets)
        # the chunks word carries a split part's flag in bit 16 (`SM90_SPLIT_FLAG`): the kernel keeps only
        # that word live across a part's mainloop
        return header + [word | (SM90_SPLIT_FLAG if i == 5 and tile[6] >= 0 else 0)
                         for tiles in self.cta_tiles for tile in tiles for i, word in enumerate(tile)]


# Words per part in the Hopper work list (`Sm90WorkPlan.cta_tiles`), and the flag of a split part in its
# chunks word.
SM90_PART_WORDS = 8
SM90_SPLIT_FLAG = 1 << 16


def sm90_work_header(partials_kb: int, offsets: list) -> list:
    """The work list's header words: the partial slots' workspace offset in KB, then each CTA's first-part
    offset and the part count (grid + 1 words), padded to whole SM90_PART_WORDS-word rows (the kernel finds
    the parts after them: `Sm90BlockScaledGroupedGemmKernel.part_entry`)."""
    header = [partials_kb, *offsets]
    return header + [0] * (-len(header) % SM90_PART_WORDS)
# Split-K: a part of a split tile writes its fp32 partial accumulator to a slot, and the last part to finish
# reads all of the tile's slots back and stores the tile: cost per part, in cost units per row of A (the
# write, and its share of the read, of 512 bytes per row of A; a first estimate, for the H200 to settle).
SM90_SPLIT_COST_PER_ROW = 1.5
# Split-K: no part shorter than this many 128-k chunks (a part costs a tile's start and finish).
SM90_MIN_PART_CHUNKS = 2
# Split-K: at most this many split tiles (one arrival counter each per consumer warpgroup in the workspace),
# and parts per tile (the last part reads them all back: its fix-up grows with their number).
SM90_MAX_SPLIT_TILES = 1024
SM90_MAX_PARTS = 4
# Split-K is planned where whole tiles are at most one per SM (the whole-tile plan leaves SMs idle for the
# whole call: bench2, 120 tiles of 32 chunks on 132 SMs, measured 10 % faster with it) and taken where it
# predicts a makespan this much shorter. NOTES: with more tiles per SM it measured slower than predicted
# (bench0, 2.2 tiles per SM: 3 % slower instead of 9 % faster; docs/HOPPER_NOTES.md v17), so it is not tried.
SM90_SPLIT_K_GAIN = 0.97


def sm90_chunk_cost(width: int) -> float:
    """Cost of one 128-k chunk of a tile of `width` rows: its MMA rows and the work that does not shrink with
    the width, or the chunk's share of the DRAM rate where that is more (`SM90_CHUNK_FLOOR`)."""
    return max(width + SM90_CHUNK_OVERHEAD_ROWS, SM90_CHUNK_FLOOR)


def sm90_tile_cost(width: int, k: int) -> float:
    return (k // 128) * sm90_chunk_cost(width) + SM90_TILE_OVERHEAD


def sm90_part_cost(width: int, chunks: int, split: bool) -> float:
    """Cost of one part: `chunks` 128-k chunks of a tile of `width` rows, plus the fix-up share if split."""
    return (chunks * sm90_chunk_cost(width) + SM90_TILE_OVERHEAD
            + (SM90_SPLIT_COST_PER_ROW * width if split else 0))


def _sm90_split_width(m: int, splits: int, widths: tuple) -> int:
    """The narrowest of `widths` that `splits` tiles of M rows need (splits >= M / the widest)."""
    return next(w for w in widths if w * splits >= m)


def _sm90_makespan(problem_sizes, splits: list, num_sms: int, widths: tuple) -> float:
    """The predicted makespan of `splits`: the longest-first assignment's own where tiles are few per CTA
    (there whole tiles decide it), else the load bound max(mean load, largest tile), which that assignment
    meets to within one tile and which costs O(G) instead of a simulation of every tile."""
    count, total, largest = 0, 0.0, 0.0
    for (m, n, k, _), s in zip(problem_sizes, splits):
        if s == 0:  # an empty group: no tile
            continue
        cost = sm90_tile_cost(_sm90_split_width(m, s, widths), k)
        count += s * (n // 128)
        total += s * (n // 128) * cost
        largest = max(largest, cost)
    grid = min(num_sms, count)
    if count > SM90_SIMULATED_TILES_PER_CTA * grid:
        return max(total / grid, largest)
    return _sm90_assign(problem_sizes, splits, num_sms, widths)[0]


# Up to this many tiles per CTA the plan search simulates the assignment (`_sm90_makespan`).
SM90_SIMULATED_TILES_PER_CTA = 8


def _sm90_group_widths(problem_sizes, splits: list, widths: tuple) -> tuple:
    """`Sm90WorkPlan.splits` of `splits`: per group (number of M splits, width of each)."""
    return tuple((s, _sm90_split_width(m, s, widths)) for (m, _, _, _), s in zip(problem_sizes, splits))


def _sm90_tiles(problem_sizes, splits: list, widths: tuple) -> list:
    """Every tile of `splits`: (group, first row, width, N tile), in group, M split, N tile order."""
    tiles = []
    for g, ((m, n, _, _), s) in enumerate(zip(problem_sizes, splits)):
        width = _sm90_split_width(m, s, widths)
        tiles += [(g, i * width, width, nt) for i in range(s) for nt in range(n // 128)]
    return tiles


def _sm90_assign(problem_sizes, splits: list, num_sms: int, widths: tuple) -> tuple:
    """Longest-processing-time assignment of every tile to the least loaded CTA: (makespan, per-CTA parts)."""
    tiles = [(sm90_tile_cost(w, problem_sizes[g][2]), g, m0, w, nt)
             for g, m0, w, nt in _sm90_tiles(problem_sizes, splits, widths)]
    tiles.sort(key=lambda t: -t[0])  # stable: equal costs keep group, split, N order
    grid = min(num_sms, len(tiles))
    heap = [(0.0, cta) for cta in range(grid)]
    per_cta = [[] for _ in range(grid)]
    for cost, g, m0, w, nt in tiles:
        load, cta = heapq.heappop(heap)
        per_cta[cta].append((g, m0, widths.index(w), nt, 0, problem_sizes[g][2] // 128, -1, 0))
        heapq.heappush(heap, (load + cost, cta))
    return max(load for load, _ in heap), per_cta


def _sm90_split_k_fill(tiles: list, chunks: list, limit: float, grid: int):
    """Deal `tiles` (each `chunks[i]` 128-k chunks) in order onto at most `grid` CTAs of at most `limit`
    cost each, splitting a tile's K where it does not fit whole: per CTA its parts (tile index, first chunk,
    chunks), or None where `grid` CTAs do not suffice."""
    ctas, load = [[]], 0.0
    for t, ((_, _, width, _), count) in enumerate(zip(tiles, chunks)):
        k0, parts = 0, 1
        while k0 < count:
            rest = count - k0
            whole = sm90_part_cost(width, rest, k0 > 0)
            if whole <= limit - load:
                ctas[-1].append((t, k0, rest))
                load += whole
                break
            take = int((limit - load - sm90_part_cost(width, 0, True)) // sm90_chunk_cost(width))
            if parts < SM90_MAX_PARTS and take >= SM90_MIN_PART_CHUNKS and rest - take >= SM90_MIN_PART_CHUNKS:
                ctas[-1].append((t, k0, take))
                load += sm90_part_cost(width, take, True)
                k0, parts = k0 + take, parts + 1
            elif load == 0.0:
                return None  # the rest fits no CTA whole and may not be split further
            if len(ctas) == grid:
                return None
            ctas.append([])
            load = 0.0
    return ctas


def _sm90_split_k(problem_sizes, splits: list, num_sms: int, widths: tuple) -> Optional[Sm90WorkPlan]:
    """Split-K plan of the tiles of `splits`: tiles in order, dealt onto the CTAs as contiguous runs of
    equal cost (the shortest limit that `_sm90_split_k_fill` meets, by bisection), a tile that does not fit
    whole split in K across consecutive CTAs. None where nothing is split (then the whole-tile plan is
    better) or the counters would not suffice."""
    tiles = _sm90_tiles(problem_sizes, splits, widths)
    chunks = [problem_sizes[g][2] // 128 for g, _, _, _ in tiles]
    total = sum(sm90_tile_cost(w, problem_sizes[g][2]) for g, _, w, _ in tiles)
    grid = min(num_sms, len(tiles) * max(chunks))
    lo, hi = total / grid, total
    best = _sm90_split_k_fill(tiles, chunks, hi, grid)
    for _ in range(24):
        mid = (lo + hi) / 2
        ctas = _sm90_split_k_fill(tiles, chunks, mid, grid)
        if ctas is None:
            lo = mid
        else:
            hi, best = mid, ctas
    parts_of = defaultdict(list)
    for b, parts in enumerate(best):
        for j, (t, _, _) in enumerate(parts):
            parts_of[t].append((b, j))
    split = {t: i for i, t in enumerate(t for t in sorted(parts_of) if len(parts_of[t]) > 1)}
    if not split or len(split) > SM90_MAX_SPLIT_TILES:
        return None
    info, slots = {}, 0
    for t in split:
        for p, where in enumerate(parts_of[t]):
            info[where] = p | (len(parts_of[t]) << 8) | (slots << 16)
        slots += len(parts_of[t])
    cta_tiles, makespan = [], 0.0
    for b, parts in enumerate(best):
        row, load = [], 0.0
        for j, (t, k0, count) in enumerate(parts):
            g, m0, width, nt = tiles[t]
            s = split.get(t, -1)
            row.append((g, m0, widths.index(width), nt, k0, count, s, info.get((b, j), 0)))
            load += sm90_part_cost(width, count, s >= 0)
        cta_tiles.append(tuple(row))
        makespan = max(makespan, load)
    return Sm90WorkPlan(widths, _sm90_group_widths(problem_sizes, splits, widths), tuple(cta_tiles), makespan,
                        len(split), slots)


@dataclasses.dataclass(frozen=True, eq=False)
class Sm90BulkPlan:
    """`plan_sm90_work`'s plan where whole tiles are many per CTA (MoE layers: hundreds of experts, a new
    split of tokens every step, so a plan per call): the schedule of `Sm90WorkPlan` (whole tiles only), held
    as tensors and made by torch's CPU ops, so that planning a new routing costs about a millisecond of
    host time instead of up to 27 (`_sm90_bulk_plan`)."""

    widths: tuple  # as Sm90WorkPlan's
    splits: tuple  # as Sm90WorkPlan's
    parts: torch.Tensor  # [tiles, SM90_PART_WORDS] int32: Sm90WorkPlan.cta_tiles' words, CTA after CTA
    offsets: torch.Tensor  # [grid + 1] int64: each CTA's first row of `parts`, then the row count
    makespan: float  # the busiest CTA's cost (SM90 cost units)
    num_split_tiles: int = 0
    num_slots: int = 0

    @property
    def num_tiles(self) -> int:
        return self.parts.shape[0]

    @property
    def num_ctas(self) -> int:
        return self.offsets.numel() - 1

    @property
    def cta_tiles(self) -> tuple:
        """Sm90WorkPlan.cta_tiles' form (for inspection and the tests; the host path uses `word_tensor`)."""
        rows, bounds = self.parts.tolist(), self.offsets.tolist()
        return tuple(tuple(map(tuple, rows[a:b])) for a, b in zip(bounds, bounds[1:]))

    def word_tensor(self, partials_kb: int = 0) -> torch.Tensor:
        """Sm90WorkPlan.words() as a CPU int32 tensor (no split parts, so no flag)."""
        header = torch.tensor(sm90_work_header(partials_kb, self.offsets.tolist()), dtype=torch.int32)
        return torch.cat([header, self.parts.reshape(-1)])

    def words(self, partials_kb: int = 0) -> list:
        return self.word_tensor(partials_kb).tolist()


# `_sm90_bulk_plan`: its last laps of tiles go to the least loaded CTAs first (the snake order before them
# leaves CTAs up to a tile apart; measured on the planner's model, one such lap brought the MoE decode shapes
# to the longest-first plan's makespan, two brought shapes with mixed K within 1 %).
SM90_BULK_TAIL_LAPS = 2


def _segments(counts: torch.Tensor) -> tuple:
    """Segments of `counts[i]` elements each (int64, zeros allowed), end to end: per element its segment i
    and its index within it, two int64 tensors of counts.sum() elements.

    NOTES: what torch.repeat_interleave(arange, counts) and arange - repeat_interleave(starts, counts) give,
    but by bincount and cumsum, which run on one thread. repeat_interleave opens a parallel region whatever
    its size: on a 2-core host with another process busy, 0.5-3.6 ms per call where one thread took 25 µs."""
    total = int(counts.sum())
    starts = torch.cumsum(counts, 0) - counts
    # segment i of an element: how many segments after the first start at or before it
    segment = torch.cumsum(torch.bincount(starts[1:], minlength=total + 1)[:total], 0)
    return segment, torch.arange(total) - starts.index_select(0, segment)


def sm90_split_choice(m: torch.Tensor, widths: tuple, width_costs: torch.Tensor) -> tuple:
    """Per group of M = m[g] rows (int64): among the candidates of each width cap, fewest tiles first (the
    fewest tiles of at most that width, each as narrow as covers M: `_sm90_split_width`), the one whose tiles
    cost least in all (the first of equal costs: fewest tiles). width_costs [G, len(widths)]: a tile's cost at
    each width, per group. Returns (tile count, width index into `widths`, tile cost), int64 per group. The bulk
    plan's rule, and the MoE entry's (moe.py, which makes it on the GPU)."""
    w = torch.tensor(widths, dtype=torch.int64)
    count = ((m[:, None] + w - 1) // w).flip(1)
    width_index = (w * count[:, :, None] >= m[:, None, None]).int().argmax(-1)
    tile_cost = width_costs.gather(1, width_index)
    pick = (count * tile_cost).argmin(1, keepdim=True)
    return tuple(t.gather(1, pick)[:, 0] for t in (count, width_index, tile_cost))


def _sm90_bulk_plan(problem_sizes: tuple, num_sms: int, widths: tuple) -> Optional[Sm90BulkPlan]:
    """The plan where whole tiles are more than SM90_SIMULATED_TILES_PER_CTA per CTA and none costs more than
    a CTA's mean load; None elsewhere (`plan_sm90_work` then searches). There the predicted makespan is the
    mean load (`_sm90_makespan`), so each group takes, on its own, the split count whose tiles cost least
    in all (of the fewest tiles of at most each width; ties: fewer tiles). Tiles go longest first (stable:
    group, split, N order, as `_sm90_assign` sorts them) to the CTAs in snake order (0 .. grid - 1, then
    back), the last SM90_BULK_TAIL_LAPS laps to the least loaded CTAs first: a CTA's load within one tile of
    the mean. Vectorised over groups and tiles: 0.8-1.8 ms per new routing of the `bench.py --moe` shapes
    (2k-17k tiles, words included), where the search, the longest-first assignment and the word list took
    13-27 ms for the DeepSeek-V3 ones (2-core CPU, torch 2.13).

    NOTES: rows are taken by index_select / gather / masked_select, not advanced indexing, and nothing calls
    repeat_interleave or searchsorted: on the CPU those open parallel regions at small sizes, which stall
    while another process holds the other cores (the re-routed call up to twice as long on Qwen3 with one
    core of two busy; docs/HOPPER_NOTES.md v32)."""
    sizes = torch.tensor(problem_sizes, dtype=torch.int64).reshape(-1, 4)
    m, n_tiles, chunks = sizes[:, 0], sizes[:, 1] // 128, sizes[:, 2] // 128
    w = torch.tensor(widths, dtype=torch.int64)
    # `sm90_tile_cost` of each (K, width index): the groups' K take a few values
    ks = sorted({k for _, _, k, _ in problem_sizes})
    costs = torch.tensor([[sm90_tile_cost(width, k) for width in widths] for k in ks], dtype=torch.int64)
    k_index = (sizes[:, 2, None] > torch.tensor(ks, dtype=torch.int64)).sum(1)  # each K's place in ks
    count, width_index, tile_cost = sm90_split_choice(m, widths, costs.index_select(0, k_index))
    width = w.index_select(0, width_index)
    tiles = count * n_tiles
    num_tiles = int(tiles.sum())
    grid = min(num_sms, num_tiles)
    total = int((tiles * tile_cost).sum())
    longest = int(torch.where(count > 0, tile_cost, 0).max())  # of a tile
    if num_tiles <= SM90_SIMULATED_TILES_PER_CTA * grid or longest * grid > total:
        return None
    # One row per M split, longest tiles first: its part words but the N tile's.
    group, index = _segments(count)
    split_cost, order = torch.sort(tile_cost.index_select(0, group), descending=True, stable=True)
    group, index = group.index_select(0, order), index.index_select(0, order)
    of_group = lambda t: t.index_select(0, group)  # noqa: E731
    split_words = torch.stack([group, index * of_group(width), of_group(width_index), torch.zeros_like(group),
                               torch.zeros_like(group), of_group(chunks), torch.full_like(group, -1),
                               torch.zeros_like(group)], 1).to(torch.int32)
    # Tile t of that order: split tile_split[t], N tile n_tile[t] (each split's N tiles in turn).
    tile_split, n_tile = _segments(of_group(n_tiles))
    cost = split_cost.index_select(0, tile_split).double()
    # Laps of `grid` tiles: all but the last SM90_BULK_TAIL_LAPS go to the CTAs in snake order (lap t // grid,
    # seat t % grid, forwards on even laps, backwards on odd ones), each of the last ones to the CTAs from the
    # least loaded up (its tiles longest first). Row c of `seats`: CTA c's tiles in order (-1: none).
    laps = -(-num_tiles // grid)
    head_laps = max(0, laps - SM90_BULK_TAIL_LAPS)
    lap, cta = torch.arange(head_laps)[None, :], torch.arange(grid)[:, None]
    seats = [lap * grid + torch.where(lap % 2 == 0, cta, grid - 1 - cta)]
    loads = cost.index_select(0, seats[0].reshape(-1)).view(grid, head_laps).sum(1)
    for start in range(head_laps * grid, num_tiles, grid):
        count_here = min(grid, num_tiles - start)
        least = torch.argsort(loads, stable=True)[:count_here]
        column = torch.full((grid,), -1, dtype=torch.int64)
        column.index_copy_(0, least, torch.arange(start, start + count_here))
        loads.index_add_(0, least, cost[start:start + count_here])
        seats.append(column[:, None])
    seats = torch.cat(seats, 1)
    valid = seats >= 0
    position = seats.masked_select(valid)  # CTA after CTA
    parts = split_words.index_select(0, tile_split.index_select(0, position))
    parts[:, 3] = n_tile.index_select(0, position)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(valid.sum(1), 0)])
    return Sm90BulkPlan(widths, tuple(zip(count.tolist(), width.tolist())), parts, offsets, float(loads.max()))


# Plans per problem shape: a MoE layer in decode has a new one every step (and a plan of 14k tiles holds ~0.5 MB),
# so the cache keeps only the recent ones (the benchmark's 15 input sets per shape share one).
@functools.lru_cache(maxsize=32)
def plan_sm90_work(problem_sizes: tuple, num_sms: int, widths: tuple = SM90_DEFAULT_WIDTHS,
                   split_k: bool = True):
    """M splits and a balanced work list for the M-exact Hopper kernel (host side, once per problem shape).

    Whole tiles: start from the best of "every group split into the fewest tiles of at most `cap` rows" over
    each cap in `widths` (the kernel's tile widths, `Sm90GemmConfig.widths`); then,
    greedily, the group whose extra split lowers the predicted makespan (`_sm90_makespan`) most gets one,
    while that gains more than 1 %. More splits fill more SMs but convert B once more per split and pad more
    rows. Tiles go to CTAs longest first, each to the least loaded (`_sm90_assign`), so uneven widths still
    balance. Host cost: ~5 ms for the benchmarks, ~0.1 s for 128 groups of up to 3000 rows (66k tiles).

    Split-K (`split_k`, where whole tiles are at most one per SM): for each cap, the fewest splits' tiles dealt as
    equal-cost runs with tiles split in K across CTAs (`_sm90_split_k`); splitting K converts no B twice, so
    the widest tiles can fill the SMs. Taken where its predicted makespan, fix-up included, beats the
    whole-tile plan's by 3 %.

    Where whole tiles are many per CTA (MoE layers), the vectorised `_sm90_bulk_plan` instead.
    """
    bulk = _sm90_bulk_plan(problem_sizes, num_sms, widths)
    if bulk is not None:
        return bulk
    starts = []
    for cap in widths:
        splits = [ceil_div(m, cap) for m, _, _, _ in problem_sizes]
        starts.append((_sm90_makespan(problem_sizes, splits, num_sms, widths), splits))
    best, splits = min(starts, key=lambda t: t[0])
    while True:
        trials = []
        for g, (m, _, _, _) in enumerate(problem_sizes):
            s = splits[g] + 1
            if _sm90_split_width(m, s, widths) < _sm90_split_width(m, splits[g], widths):
                trial = splits[:g] + [s] + splits[g + 1:]
                trials.append((_sm90_makespan(problem_sizes, trial, num_sms, widths), trial))
        if not trials:
            break
        makespan, trial = min(trials, key=lambda t: t[0])
        if makespan > 0.99 * best:
            break
        best, splits = makespan, trial
    makespan, per_cta = _sm90_assign(problem_sizes, splits, num_sms, widths)
    plan = Sm90WorkPlan(widths, _sm90_group_widths(problem_sizes, splits, widths),
                        tuple(tuple(tiles) for tiles in per_cta), makespan)
    if split_k and plan.num_tiles <= num_sms:
        for _, cap_splits in starts:  # each cap's fewest splits
            other = _sm90_split_k(problem_sizes, cap_splits, num_sms, widths)
            if other is not None and other.makespan < SM90_SPLIT_K_GAIN * plan.makespan:
                plan = other
    return plan


@functools.lru_cache(maxsize=32)
def sm90_work_words(problem_sizes: tuple, num_sms: int, widths: tuple, split_k: bool) -> torch.Tensor:
    """`plan_sm90_work`'s words as a CPU int32 tensor, made once per problem shape, build widths and plan
    kind; the host path uploads them with the tables (`GemmSchedule.work_words`), on the kernels' queue."""
    plan = plan_sm90_work(problem_sizes, num_sms, widths, split_k)
    partials_kb = Sm90BlockScaledGroupedGemmKernel.partials_offset(problem_sizes) // 1024 if plan.num_slots else 0
    return plan.word_tensor(partials_kb)


# How custom_kernel picks its Hopper kernel: "sm90_auto" per problem (choose_sm90_config), or one entry of
# SM90_VARIANT_CONFIGS forced (eval.py bringup runs each). Part of the prepared-call key, as KERNEL_VARIANT
# is; NVFP4_SM90_VARIANT=name at import, set_sm90_variant(name) at run time.
SM90_VARIANTS = ("sm90_auto", *SM90_VARIANT_CONFIGS)
DEFAULT_SM90_VARIANT = "sm90_auto"
SM90_VARIANT = _choice_from_env("NVFP4_SM90_VARIANT", DEFAULT_SM90_VARIANT, SM90_VARIANTS,
                                ("NVFP4_KERNEL_VARIANT", "B200", lambda name: name in KERNEL_VARIANTS))


def set_sm90_variant(name: str) -> None:
    """Select how custom_kernel picks its Hopper tile from now on (one of SM90_VARIANTS)."""
    global SM90_VARIANT
    if isinstance(name, str) and name in KERNEL_VARIANTS:
        raise ValueError(f"{name!r} is a B200 kernel variant: use submission.set_variant({name!r}); "
                         f"set_sm90_variant takes a Hopper variant, one of {', '.join(SM90_VARIANTS)}")
    _check_setter_name("set_sm90_variant", "Hopper variant", name, SM90_VARIANTS)
    SM90_VARIANT = name
    # The prepared calls are keyed by the B200 settings alone: a call prepared for another Hopper variant
    # must not be reused.
    host.forget_prepared_calls()


# Side-by-side runs on a GPU (`bench.py --ab`): Sm90GemmConfig fields that every Hopper build custom_kernel and
# compile_for take, over their variant's own. A lever under measurement is such a field, off in every variant
# until a run decides (docs/HOPPER_NOTES.md gives each one's prediction first).
SM90_OVERRIDES: dict = {}


def sm90_override_types() -> dict:
    """The type of each Sm90GemmConfig field an override may set (use_pdl has its own setter, set_pdl)."""
    return {field.name: type(getattr(Sm90GemmConfig(), field.name)) for field in dataclasses.fields(Sm90GemmConfig)
            if field.name != "use_pdl"}


def set_sm90_overrides(**fields) -> None:
    """Exactly these Sm90GemmConfig fields (none: the variants' own) over every Hopper build from now on, e.g.
    `set_sm90_overrides(max_width=128)` or `(num_stages=8)`; each setting is its own compiled kernel (the
    fields are in the compile key). An unknown field or a value of another type raises here; a combination a
    build cannot take raises Sm90GemmConfig's ValueError when that build is chosen."""
    global SM90_OVERRIDES
    types = sm90_override_types()
    for name, value in fields.items():
        if name not in types:
            raise ValueError(f"set_sm90_overrides: {name!r} is not a field it sets; choose from {', '.join(types)}")
        if type(value) is not types[name]:
            raise TypeError(f"set_sm90_overrides: {name} takes a {types[name].__name__}, not {value!r}")
    SM90_OVERRIDES = dict(fields)
    host.forget_prepared_calls()  # as set_sm90_variant: a prepared call holds the other setting's launch


def with_sm90_overrides(config: Sm90GemmConfig) -> Sm90GemmConfig:
    """`config` with SM90_OVERRIDES over its fields."""
    return dataclasses.replace(config, **SM90_OVERRIDES) if SM90_OVERRIDES else config


# ---------------------------------------------------------------------------------------------------
# Hopper device helpers: pipeline states, and inline PTX for the operand conversions and shared-memory
# accesses (the data path; barriers and TMA use the DSL's pipeline classes and copy atoms)
# ---------------------------------------------------------------------------------------------------


def _asm(res_type, args, ptx, constraints, side_effects, loc, ip):
    return llvm.inline_asm(res_type, args, ptx, constraints, has_side_effects=side_effects,
                           is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


def _i32(x, loc, ip):
    return cutlass.Int32(x).ir_value(loc=loc, ip=ip)


def _u32(x, loc, ip):
    return cutlass.Uint32(x).ir_value(loc=loc, ip=ip)


def _i64(x, loc, ip):
    return cutlass.Int64(x).ir_value(loc=loc, ip=ip)


def ring_state(n, stages: int, producer: bool = False):
    """The pipeline state of the n-th use of a ring of `stages` buffers, computed rather than carried (every
    role counts the chunks it has passed): buffer n % stages, phase (n / stages) % 2, the producer's flipped
    (its first pass finds every buffer empty).

    NOTES: n counts from 0, so it is taken unsigned: / and % by a power of two are then a shift and a mask, not
    signed-division fix-ups in every chunk (docs/HOPPER_NOTES.md v28: 7-10 % fewer instructions per chunk).
    Both results are marked warp-uniform (every role's count is): unmarked, ptxas computed the producer's fp16
    A buffer index in vector registers and moved it to uniform ones under the elected lane (predicated R2UR,
    illegal on sm_90a; tests/test_build.py counts them)."""
    u = cutlass.Uint32(n)
    index = cute.arch.make_warp_uniform(cutlass.Int32(u % stages))
    phase = cute.arch.make_warp_uniform(cutlass.Int32((u // stages) % 2))
    return pipeline.PipelineState(stages, n, index, phase ^ 1 if producer else phase)


@cute.jit
def warp_inclusive_sum(value, lane):
    """The sum of `value` over lanes 0 .. `lane` of the warp: an inclusive scan by five shuffles, every lane taking
    part (the conversion's item counts here; the MoE preparation's and the layer's routing counts)."""
    incl = value
    for d in cutlass.range_constexpr(5):
        below = cute.arch.shuffle_sync(incl, (lane - (1 << d)) & 31)
        incl = incl + below * cutlass.Int32(lane >= (1 << d))
    return incl


def release_read_stage(pipe, state):
    """Releases a stage of the TMA pipeline `pipe` from every thread that read it with plain shared-memory
    loads: each thread arrives on the stage's empty barrier, which counts threads (the Hopper kernel's
    stage ring is created so).

    NOTES: the DSL's `consumer_release` arrives from lane 0 of each warp only. Then nothing in the memory
    model orders lane 1's load of a scale word before the producer's next bulk copy into that stage, and
    compute-sanitizer's racecheck reported exactly that write-after-read hazard (multi-group runs, once the
    ring wraps). A warp sync first would order it, but ptxas drops the WARPSYNC of a converged warp, so the
    tool cannot see it. A warp's 32 arrivals issue as one instruction, yet the kernel measured 0-2 % slower
    with them than with lane 0's alone (H200; docs/HOPPER_NOTES.md v16)."""
    pipe.sync_object_empty.arrive(state.index, None)


def with_tx_count(pipe, tx_count: int):
    """The TMA pipeline `pipe` expecting `tx_count` bytes per stage instead of its own, on the same barriers
    (the Hopper M-exact kernel's fp16 A ring: a tile of each width loads its own byte count)."""
    full = pipe.sync_object_full.recast_to_new_op_type(pipe.sync_object_full.op_type)
    full.tx_count = tx_count
    return dataclasses.replace(pipe, sync_object_full=full)


def byte_tensor(address, num_bytes: int, gmem: bool = False):
    """`num_bytes` bytes at `address` (shared memory, or global memory with gmem=True) as a tensor, for a
    bulk copy (16-byte aligned)."""
    space = cute.AddressSpace.gmem if gmem else cute.AddressSpace.smem
    return cute.make_tensor(cute.make_ptr(cutlass.Uint8, address, space, assumed_align=16),
                            cute.make_layout((num_bytes,)))


@dataclasses.dataclass(frozen=True)
class Sm90SharedAddresses:
    """Shared-memory base addresses of the Hopper kernel's buffers, for the hand-addressed loads and stores
    (the operand conversions read B, A and the scales; the epilogue writes the C^T slabs)."""

    b: object
    a: object
    sf: object
    a16: object
    c: object


@dsl_user_op
def ld_shared_u32(addr, *, loc=None, ip=None):
    r = _asm(T.i32(), [_i32(addr, loc, ip)], "ld.shared.b32 $0, [$1];", "=r,r,~{memory}", True, loc, ip)
    return cutlass.Uint32(r)


def _load_v4(ptx: str, addr, elem, reg: str, addr_reg: str, side_effects: bool, loc, ip) -> list:
    """An inline-PTX load of four `elem` values ($0-$3) from `addr` ($4): the four values, as MLIR values."""
    constraints = ",".join([f"={reg}"] * 4 + [addr_reg]) + (",~{memory}" if side_effects else "")
    r = _asm(llvm.StructType.get_literal([elem] * 4), [addr], ptx, constraints, side_effects, loc, ip)
    return [llvm.extractvalue(elem, r, [i], loc=loc, ip=ip) for i in range(4)]


def _store_v4(ptx: str, addr, values: list, val_reg: str, addr_reg: str, loc, ip) -> None:
    """An inline-PTX store of four values ($1-$4, MLIR values) to `addr` ($0)."""
    _asm(None, [addr, *values], ptx, ",".join([addr_reg] + [val_reg] * 4) + ",~{memory}", True, loc, ip)


@dsl_user_op
def ld_shared_v4(addr, *, loc=None, ip=None):
    words = _load_v4("ld.shared.v4.b32 {$0, $1, $2, $3}, [$4];", _i32(addr, loc, ip), T.i32(), "r", "r", True,
                     loc, ip)
    return [cutlass.Uint32(w) for w in words]


@dsl_user_op
def st_shared_v4(addr, v0, v1, v2, v3, *, loc=None, ip=None):
    _store_v4("st.shared.v4.b32 [$0], {$1, $2, $3, $4};", _i32(addr, loc, ip),
              [_u32(v, loc, ip) for v in (v0, v1, v2, v3)], "r", "r", loc, ip)


@dsl_user_op
def stmatrix_f16_scaled(addr, values, exponent: int, alpha_bits=None, bf16: bool = False, *, loc=None, ip=None):
    """`stmatrix .trans` of four 8 x 8 fp16 matrices: matrix i's fragment register is
    fp16x2(values[2 i] * 2^exponent, values[2 i + 1] * 2^exponent), the low half first (the power of two undoes
    the operand encodings', `Sm90BlockScaledGroupedGemmKernel.EPILOGUE_EXPONENT`; exact). Lanes 8 i to 8 i + 7
    give the addresses of matrix i's 16-byte rows; a row holds one fragment column (.trans).
    alpha_bits (the MoE entry's `group_alpha`): an fp32's bits, by which every value is multiplied too (after
    the exact power of two, so one rounding); bf16: the halves are bf16 (round to nearest) instead of fp16."""
    assert len(values) == 8
    regs = "h0, h1, h2, h3"
    factor = f"0f{(127 + exponent) << 23:08X}"  # 2^exponent as an f32 immediate
    ptx = "{\n.reg .b32 " + regs + ";\n.reg .f32 lo, hi;\n"
    operands = [_i32(addr, loc, ip)] + [cutlass.Float32(v).ir_value(loc=loc, ip=ip) for v in values]
    constraints = ["r"] + ["f"] * len(values)
    if alpha_bits is not None:
        ptx += f".reg .f32 alpha;\nmov.b32 alpha, ${1 + len(values)};\nmul.f32 alpha, alpha, {factor};\n"
        factor = "alpha"
        operands.append(_i32(alpha_bits, loc, ip))
        constraints.append("r")
    for i in range(4):
        ptx += (f"mul.f32 lo, ${1 + 2 * i}, {factor};\nmul.f32 hi, ${2 + 2 * i}, {factor};\n"
                f"cvt.rn.{'bf16x2' if bf16 else 'f16x2'}.f32 h{i}, hi, lo;\n")
    ptx += f"stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [$0], {{{regs}}};\n}}"
    _asm(None, operands, ptx, ",".join(constraints) + ",~{memory}", True, loc, ip)


@dsl_user_op
def scale_to_f16x2(scale_word, selector, *, loc=None, ip=None):
    """One e4m3 byte of `scale_word` as fp16x2 {s * 2^7, s * 2^7}: the prmt `selector` (0x11 * b for byte b)
    copies byte b into both bytes of the low half, the hardware e4m3x2 -> f16x2 conversion (sm_89+) widens
    them, exactly for every e4m3 code (subnormals included; e4m3 NaN gives fp16 NaN), and the product with
    2^7 is exact (448 * 2^7 < 65504). Three instructions (was ten with the bit-level decode)."""
    r = _asm(T.i32(), [_u32(scale_word, loc, ip), _u32(selector, loc, ip)],
             "{\n.reg .b32 x, z, c;\n.reg .b16 lo, hi;\n"
             "mov.b32 z, 0;\nprmt.b32 x, $1, z, $2;\nmov.b32 {lo, hi}, x;\n"
             "cvt.rn.f16x2.e4m3x2 x, lo;\n"
             "mov.b32 c, 0x58005800;\nmul.rn.f16x2 $0, x, c;\n}",
             "=r,r,r", False, loc, ip)
    return cutlass.Uint32(r)


@dsl_user_op
def ld_shared_u16(addr, *, loc=None, ip=None):
    """16 bits of shared memory, zero-extended into a 32-bit register."""
    r = _asm(T.i32(), [_i32(addr, loc, ip)], "ld.shared.u16 $0, [$1];", "=r,r,~{memory}", True, loc, ip)
    return cutlass.Uint32(r)


@dsl_user_op
def scale_pair_to_f16x2(scale_pair, bf16: bool = False, *, loc=None, ip=None):
    """The two e4m3 bytes in the low 16 bits of `scale_pair` as fp16x2 {s0, s1} (byte 0 the low half), by the
    hardware e4m3x2 -> f16x2 conversion alone: exact for every code, e4m3 NaN gives fp16 NaN
    (the consumers' B scales: `fp4x8_to_f16x2x4` takes each as a broadcast half).
    bf16 (W4A16 with bf16 A): bf16x2 {s0 * 2^112, s1 * 2^112} instead, through fp32 (exact: at most 4 significant
    bits, 448 * 2^112 < 2^127; NaN stays NaN), the factor that makes `fp4x8_to_f16x2x4`'s bf16 codes (value *
    2^-126) times it the value * 2^-14, as in fp16."""
    ptx = "{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, $1;\ncvt.rn.f16x2.e4m3x2 $0, lo;\n}"
    if bf16:
        ptx = ("{\n.reg .b16 lo, hi;\n.reg .b32 x;\n.reg .f32 f0, f1;\nmov.b32 {lo, hi}, $1;\n"
               "cvt.rn.f16x2.e4m3x2 x, lo;\nmov.b32 {lo, hi}, x;\ncvt.f32.f16 f0, lo;\ncvt.f32.f16 f1, hi;\n"
               "mul.f32 f0, f0, 0f77800000;\nmul.f32 f1, f1, 0f77800000;\ncvt.rn.bf16x2.f32 $0, f1, f0;\n}")
    r = _asm(T.i32(), [_u32(scale_pair, loc, ip)], ptx, "=r,r", False, loc, ip)
    return cutlass.Uint32(r)


@dsl_user_op
def fp4x8_to_f16x2x4(word, scale_f16x2, half: Optional[int] = None, bf16: bool = False, *, loc=None, ip=None):
    """8 e2m1 nibbles (nibble i = bits 4i..4i+3) -> 4 fp16x2 registers, register i holding
    (nibble i, nibble i+4) * scale. A nibble's s.e1.e0.m bits go to fp16 bits 15, 11, 10, 9, which is the
    e2m1 value * 2^-14 (the e = 0 case is an fp16 subnormal); times the scale operand: `scale_to_f16x2`'s
    scale * 2^7, or a half of `scale_pair_to_f16x2`'s, the scale alone (exact either way: the product is a
    multiple of 2^-24 with at most 6 significant bits, an fp16 value, subnormal or not).

    Byte-wise (11 integer instructions + 4 multiplies per word, was 15 + 4): each byte's high nibble
    (u = word & 0xF0..) already has its sign at the byte's bit 7, and u >> 3 brings its magnitude to bits
    1-3 (u's own bits 1-3 are zero, and u >> 3 is zero at bit 7), so (u | u >> 3) masked with 0x8E per byte
    (one lop3, (a | b) & c) is that nibble's fp16 high byte; the low nibbles (w = word & 0x0F..) get the
    same from w << 4 | w << 1. Bytes 1 and 3 are the high bytes of the two fp16 halves as they stand
    (registers 2, 3); bytes 0 and 2 move up by 8 (registers 0, 1). H200: 3-8 % faster (docs/HOPPER_NOTES.md
    v18).

    half (0 or 1): `scale_f16x2` holds two scales (`scale_pair_to_f16x2`) and this one multiplies by that
    half of it in both lanes (a register broadcast that ptxas folds into each HMUL2 operand); "split" (W4A16's
    weight layout, `moe.w4a16_codes`): registers 0 and 1 by half 0, registers 2 and 3 by half 1.

    bf16 (W4A16 with bf16 A): the halves are bf16, the scale `scale_pair_to_f16x2(..., bf16=True)`'s: each fp16
    code h above (bits 15, 11, 10, 9 only) becomes the bf16 code with the same bits at 15, 8, 7, 6 (h & 0x9000 |
    (h >> 3) & ~0x9000 per half, one lop3: h >> 3 moves no bit across the halves), the e2m1 value * 2^-126
    (e = 0 a bf16 subnormal), times the scale * 2^112: the value * 2^-14 again, exact (a normal bf16 with at
    most 6 significant bits). Two more integer instructions per register."""
    scales = ["$5"] * 4 if half is None else (["s", "s", "s2", "s2"] if half == "split" else ["s"] * 4)
    if half == "split":
        broadcast = "mov.b32 {s0, s1}, $5;\nmov.b32 s, {s0, s0};\nmov.b32 s2, {s1, s1};\n"
    else:
        broadcast = "" if half is None else f"mov.b32 {{s0, s1}}, $5;\nmov.b32 s, {{s{half}, s{half}}};\n"
    mul = "mul.rn.bf16x2" if bf16 else "mul.rn.f16x2"
    to_bf16 = "shr.b32 t2, h, 3;\nlop3.b32 h, h, t2, 0x90009000, 0xE4;\n" if bf16 else ""
    r = _asm(llvm.StructType.get_literal([T.i32()] * 4), [_u32(word, loc, ip), _u32(scale_f16x2, loc, ip)],
             "{\n.reg .b32 u, t, w, a, h, s" + (", t2" if bf16 else "") + (", s2" if half == "split" else "")
             + ";\n.reg .b16 s0, s1;\n" + broadcast
             + "and.b32 u, $4, 0xF0F0F0F0;\nshr.b32 t, u, 3;\n"
             f"lop3.b32 h, u, t, 0x8E008E00, 0xA8;\n{to_bf16}{mul} $3, h, {scales[3]};\n"
             f"lop3.b32 h, u, t, 0x008E008E, 0xA8;\nshl.b32 h, h, 8;\n{to_bf16}{mul} $1, h, {scales[1]};\n"
             "and.b32 w, $4, 0x0F0F0F0F;\nshl.b32 a, w, 4;\nshl.b32 w, w, 1;\n"
             f"lop3.b32 h, a, w, 0x8E008E00, 0xA8;\n{to_bf16}{mul} $2, h, {scales[2]};\n"
             f"lop3.b32 h, a, w, 0x008E008E, 0xA8;\nshl.b32 h, h, 8;\n{to_bf16}{mul} $0, h, {scales[0]};\n}}",
             "=r,=r,=r,=r,r,r", False, loc, ip)
    return [cutlass.Uint32(llvm.extractvalue(T.i32(), r, [i], loc=loc, ip=ip)) for i in range(4)]


@dsl_user_op
def ld_global_u32(addr, fresh: bool = False, *, loc=None, ip=None):
    """One 32-bit word of read-only global memory. fresh=True: loaded where it stands, never hoisted out of a
    loop or merged with an earlier load of the same word (a value that would otherwise stay live in a
    register across the mainloop)."""
    r = _asm(T.i32(), [_i64(addr, loc, ip)], "ld.global.nc.b32 $0, [$1];", "=r,l" + (",~{memory}" if fresh else ""),
             fresh, loc, ip)
    return cutlass.Uint32(r)


@dsl_user_op
def st_global_v4(addr, v0, v1, v2, v3, *, loc=None, ip=None):
    _store_v4("st.global.v4.b32 [$0], {$1, $2, $3, $4};", _i64(addr, loc, ip),
              [_u32(v, loc, ip) for v in (v0, v1, v2, v3)], "r", "l", loc, ip)


@dsl_user_op
def ld_global_v4(addr, fresh: bool = False, *, loc=None, ip=None):
    """Four 32-bit words of read-only global memory (16-byte aligned); `fresh` as for `ld_global_u32`."""
    words = _load_v4("ld.global.nc.v4.b32 {$0, $1, $2, $3}, [$4];", _i64(addr, loc, ip), T.i32(), "r", "l", fresh,
                     loc, ip)
    return [cutlass.Uint32(w) for w in words]


@dsl_user_op
def st_global_v4_f32(addr, v0, v1, v2, v3, *, loc=None, ip=None):
    _store_v4("st.global.v4.f32 [$0], {$1, $2, $3, $4};", _i64(addr, loc, ip),
              [cutlass.Float32(v).ir_value(loc=loc, ip=ip) for v in (v0, v1, v2, v3)], "f", "l", loc, ip)


@dsl_user_op
def ld_global_cg_v4_f32(addr, *, loc=None, ip=None):
    """Four floats written by other CTAs of this grid (after `sm90_split_arrive`): cached in L2 only; never hoisted
    or merged."""
    values = _load_v4("ld.global.cg.v4.f32 {$0, $1, $2, $3}, [$4];", _i64(addr, loc, ip), T.f32(), "f", "l", True,
                      loc, ip)
    return [cutlass.Float32(v) for v in values]


@dsl_user_op
def sm90_split_arrive(counter_addr, leader, last_arrival, barrier_id, *, loc=None, ip=None):
    """A consumer warpgroup's arrival on a split-K tile's counter, after its threads stored their partials:
    named barrier `barrier_id` (128 threads), then the leader adds 1 (acq_rel, GPU scope: the warpgroup's
    stores are released with it, the other parts' acquired), and the warpgroup learns by a barrier reduction
    whether it was the last of the tile's parts (the add returned `last_arrival`). The last resets the counter
    to 0 for the next launch on this workspace (zeroed once by the preparation kernel). Returns 1 there, else
    0. The CUTLASS split-K semaphore's pattern: barrier, then one thread's release."""
    r = _asm(T.i32(), [_i64(counter_addr, loc, ip), _i32(leader, loc, ip), _u32(last_arrival, loc, ip),
                       _i32(barrier_id, loc, ip)],
             "{\n.reg .pred lead, last, r;\n.reg .b32 old;\n"
             "setp.ne.s32 lead, $2, 0;\n"
             "bar.sync $4, 128;\n"
             "mov.b32 old, 0xFFFFFFFF;\n"
             "@lead atom.acq_rel.gpu.global.add.u32 old, [$1], 1;\n"
             "setp.eq.u32 last, old, $3;\n"
             "@last st.relaxed.gpu.global.u32 [$1], 0;\n"
             "bar.red.or.pred r, $4, 128, last;\n"
             "selp.s32 $0, 1, 0, r;\n}",
             "=r,l,r,r,r,~{memory}", True, loc, ip)
    return cutlass.Int32(r)


@dsl_user_op
def st_global_u32(addr, v, *, loc=None, ip=None):
    _asm(None, [_i64(addr, loc, ip), _u32(v, loc, ip)], "st.global.b32 [$0], $1;", "l,r,~{memory}", True, loc, ip)


def element_address(tensor: cute.Tensor, coord: tuple):
    """The global address (an integer) of `tensor`'s element at `coord`."""
    return (tensor.iterator + cute.crd2idx(coord, tensor.layout)).toint()


@dsl_user_op
def prefetch_global_l1(addr, *, loc=None, ip=None):
    """A hint: the line of global memory at `addr` into this SM's L1 (and L2); nothing waits for it."""
    _asm(None, [_i64(addr, loc, ip)], "prefetch.global.L1 [$0];", "l", True, loc, ip)


@dsl_user_op
def prefetch_tensormap(addr, *, loc=None, ip=None):
    """A hint: the TMA descriptor at generic address `addr` into the descriptor cache."""
    _asm(None, [_i64(addr, loc, ip)], "prefetch.tensormap [$0];", "l", True, loc, ip)


@dsl_user_op
def fence_global_for_async_proxy(*, loc=None, ip=None):
    """Orders this thread's generic-proxy global accesses with its later async-proxy (TMA) ones."""
    _asm(None, [], "fence.proxy.async.global;", "~{memory}", True, loc, ip)


@dsl_user_op
def sm90_grid_arrive_and_wait(sync_addr, last_arrival, *, loc=None, ip=None):
    """One thread per CTA: arrive on the grid barrier at `sync_addr` (word 0 the arrival count, word 1 the
    generation; both zero when the workspace is prepared) and wait until every CTA of the grid has arrived.
    `last_arrival` is the grid size - 1. Self-resetting (the last CTA to arrive zeroes the count, then bumps
    the generation with release semantics), so one workspace serves every launch on it.

    NOTES: safe only because every CTA of the grid is resident at once: the grid is at most one CTA per SM
    and the kernel takes a whole SM. The generation is read before this CTA's arrival (acq_rel orders it),
    so it cannot see the flip it waits for."""
    _asm(None, [_i64(sync_addr, loc, ip), _u32(last_arrival, loc, ip)],
         "{\n.reg .b32 gen, old, cur;\n.reg .pred p;\n"
         "ld.relaxed.gpu.global.b32 gen, [$0+4];\n"
         "atom.acq_rel.gpu.global.add.u32 old, [$0], 1;\n"
         "setp.ne.u32 p, old, $1;\n"
         "@p bra WAIT_${:uid};\n"
         "st.relaxed.gpu.global.b32 [$0], 0;\n"
         "add.u32 cur, gen, 1;\n"
         "st.release.gpu.global.b32 [$0+4], cur;\n"
         "bra DONE_${:uid};\n"
         "WAIT_${:uid}:\n"
         "ld.acquire.gpu.global.b32 cur, [$0+4];\n"
         "setp.eq.u32 p, cur, gen;\n"
         "@p bra WAIT_${:uid};\n"
         "DONE_${:uid}:\n}",
         "l,r,~{memory}", True, loc, ip)


# Bytes of the Hopper workspace's grid-barrier words (arrival count, generation), after the descriptor rows;
# then the split-K arrival counters, one per split tile and consumer warpgroup.
SM90_SYNC_BYTES = 128
SM90_COUNTER_BYTES = SM90_MAX_SPLIT_TILES * 2 * 4


@cute.jit
def sm90_a16_group_offset(sizes: cute.Tensor, group, num_groups: cutlass.Constexpr[int]) -> cutlass.Int64:
    """Byte offset of group `group`'s fp16 A (M x K x 2 bytes, groups in order) in a Hopper prepass
    workspace: after the descriptor rows and the grid-barrier words
    (`Sm90BlockScaledGroupedGemmKernel.a16_offset`)."""
    offset = cutlass.Int64(Sm90BlockScaledGroupedGemmKernel.a16_offset(num_groups))
    for i in cutlass.range(group, unroll=1):
        offset = offset + cutlass.Int64(sizes[i, int(SizeColumn.M)]) * sizes[i, int(SizeColumn.K)] * 2
    return offset


class Sm90AConvertKernel:
    """The Hopper prepass (config.a16_prepass): every group's A, e2m1 x e4m3, to exact fp16 in the
    workspace, once per call, so that the GEMM loads it by TMA instead of converting it in every CTA.

    Grid (x, G): CTA (x, g) converts items x * 256 + [0, 256) of group g; an item is one quarter (32 k)
    of one 128-k chunk of one row: 16 bytes of A (four 32-bit words) and their two scale words in, 64
    contiguous bytes of fp16 out. The values and their order inside a chunk are exactly what the transform
    warpgroup writes to shared memory (same encoding: value * 2^-14 * scale * 2^7, undone in the epilogue;
    same k permutation, which B's register conversion matches), so a TMA load of a 64-k box with the
    128-byte swizzle puts them where the wgmma expects them. Launched without programmatic dependent launch:
    it waits for the previous GEMM on the queue, which may still read an earlier call's fp16 A. It does not
    trigger the GEMM's early launch either: measured no gain (docs/HOPPER_NOTES.md, dead experiments; a GEMM
    CTA needs the SM's whole register file, so it cannot start beside a prepass CTA).
    """

    threads = 256

    def __init__(self, num_groups: int):
        self.num_groups = num_groups

    @cute.jit
    def __call__(self, ptrs_ptr: cute.Pointer, sizes_ptr: cute.Pointer, workspace_ptr: cute.Pointer,
                 grid_x: cutlass.Int32):
        ptrs, sizes = group_tables(ptrs_ptr, sizes_ptr, self.num_groups)
        workspace = cute.make_tensor(workspace_ptr, cute.make_layout((1,)))
        self.kernel(ptrs, sizes, workspace).launch(grid=(grid_x, self.num_groups, 1), block=(self.threads, 1, 1))

    @cute.kernel
    def kernel(self, ptrs: cute.Tensor, sizes: cute.Tensor, workspace: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bx, g, _ = cute.arch.block_idx()
        m = sizes[g, int(SizeColumn.M)]
        k = sizes[g, int(SizeColumn.K)]
        item = bx * self.threads + tidx
        if item < m * (k // 128) * 4:
            sm90_convert_a_item(ptrs, g, k, item,
                                workspace.iterator.toint() + sm90_a16_group_offset(sizes, g, self.num_groups))


@cute.jit
def sm90_convert_a_items(ptrs: cute.Tensor, sizes: cute.Tensor, a16_base, num_groups: cutlass.Constexpr[int],
                         first, stride):
    """Items first, first + stride, ... of the items of all groups in a row (`Sm90AConvertKernel` says what an
    item is): the GEMM's fused conversion, each of its threads a strided share of the whole. Item p (counted
    across groups) lands at a16_base + 64 p: a group's fp16 A is its items in order, 64 bytes each, the groups
    back to back (`sm90_a16_group_offset`).

    Per 32 groups, lane j takes group g0 + j's item count and the warp an inclusive scan of them (shuffles);
    each lane then finds the group of each of its items among those 32 by a binary search over the scan (five
    shuffles). A thread's cost is G / 32 scans plus its own items, two at a time (their loads in flight together).
    NOTES: the items are numbered across groups, so every CTA takes a share of each group (a position restarted at
    each group left every group's items to the first CTAs: the fused call measured 7.5 / 11 us slower than the
    separate conversion launch on the two G = 8 benchmarks). Every thread used to walk every group (the sizes by
    shuffle, the split of its share by a division per group): at G = 128 / 256 that walk took about a tenth of the
    MoE decode calls' time on Qwen3-30B-A3B (ncu source counters, H100; docs/HOPPER_NOTES.md v30)."""
    lane = cute.arch.lane_idx()
    done = cutlass.Int32(0)  # the items of the groups before g0
    pos = first  # this thread's next item
    for g0 in cutlass.range(0, num_groups, 32, unroll=1):
        count = cutlass.Int32(0)
        lane_k = cutlass.Int32(0)
        if g0 + lane < num_groups:
            lane_k = sizes[g0 + lane, int(SizeColumn.K)]
            count = sizes[g0 + lane, int(SizeColumn.M)] * (lane_k // 128) * 4
        incl = warp_inclusive_sum(count, lane)  # items of groups g0 .. g0 + lane
        end = done + cute.arch.shuffle_sync(incl, 31)
        while cute.arch.vote_any_sync(pos < end):
            for u in cutlass.range_constexpr(2):
                item = pos + u * stride
                # the first lane j whose groups' items run past `item` (lanes of empty groups never are)
                j = cutlass.Int32(0)
                for step in cutlass.range_constexpr(4, -1, -1):
                    through = done + cute.arch.shuffle_sync(incl, j + (1 << step) - 1)  # items to lane j + 2^step - 1
                    j = j + (1 << step) * cutlass.Int32(through <= item)
                k = cute.arch.shuffle_sync(lane_k, j)
                group_first = done + cute.arch.shuffle_sync(incl - count, j)
                if item < end:
                    sm90_convert_a_item(ptrs, g0 + j, k, item - group_first,
                                        a16_base + cutlass.Int64(group_first) * 64)
            pos = pos + stride * (cutlass.Int32(pos < end) + cutlass.Int32(pos + stride < end))
        done = end


@cute.jit
def sm90_convert_a_item(ptrs: cute.Tensor, g, k, item, group_base):
    """One item of group g's A (K = k, its scales blocked) to fp16 at `group_base` (the group's fp16 A in the
    workspace)."""
    sm90_convert_a_item_at(ptrs[g, int(PtrColumn.A)], ptrs[g, int(PtrColumn.SFA)], k, item, group_base)


@cute.jit
def sm90_convert_a_item_at(a_base, sfa_base, k, item, group_base, sfa_row_major: cutlass.Constexpr[bool] = False):
    """`sm90_convert_a_item` on the addresses of the rows' codes (`a_base`, K / 2 bytes a row) and scales
    (`sfa_base`); sfa_row_major: the scales [rows, K / 16] row-major as a quantization kernel writes them (the MoE
    entry's preparation kernel converts so, straight from the caller's tensors), else blocked."""
    chunks = k // 128
    t = item % 4
    chunk = (item // 4) % chunks
    row = item // (4 * chunks)
    # A: physical k 32 qq + 8 t + [0, 8) of this chunk is word t of the 16-byte column qq.
    a_row = a_base + cutlass.Int64(row) * (k // 2) + chunk * 64 + 4 * t
    words = [ld_global_u32(a_row + 16 * qq) for qq in range(4)]
    # Blocked scales: 512-byte (32 x 4 x 4) atoms, rest_k = K / 64 of them per 128 rows; a chunk is
    # two atoms (sub), byte (row % 32) * 16 + ((row // 32) % 4) * 4 + k-block % 4.
    if cutlass.const_expr(sfa_row_major):
        # row-major: the same four k-blocks per word, consecutive (sub: k-blocks 4 sub .. 4 sub + 3 of the chunk)
        sf_row = sfa_base + cutlass.Int64(row) * (k // 16) + chunk * 8
        sf = [ld_global_u32(sf_row + 4 * sub) for sub in range(2)]
    else:
        sf_row = (sfa_base + cutlass.Int64(row // 128) * (k // 64) * 512
                  + chunk * 1024 + (row % 32) * 16 + ((row // 32) % 4) * 4)
        sf = [ld_global_u32(sf_row + 512 * sub) for sub in range(2)]
    conv = [fp4x8_to_f16x2x4(words[qq], scale_to_f16x2(
        sf[qq // 2], cutlass.Uint32((2 * (qq % 2) + t // 2) * 0x11))) for qq in range(4)]
    out = group_base + cutlass.Int64(row) * k * 2 + chunk * 256 + 64 * t
    for i in cutlass.range_constexpr(4):
        st_global_v4(out + 16 * i, conv[0][i], conv[1][i], conv[2][i], conv[3][i])


# ---------------------------------------------------------------------------------------------------------
# Hopper (sm_90a) kernel
# ---------------------------------------------------------------------------------------------------------
class Sm90TensorMapSlot(enum.IntEnum):
    """The Hopper kernel's TMA descriptors of one group, in workspace order."""

    A = 0
    B = 1
    C = 2  # C^T view (n contiguous), stored by both consumer warpgroups


class Sm90BlockScaledGroupedGemmKernel:
    """Grouped NVFP4 GEMM for sm_90a; see the module docstring for roles, pipelines and encodings.

    Descriptors: one row of three (A, B, C^T) per group, written once per input set by
    `GroupTensormapKernel` (the Blackwell persistent kernel's scheme and code); the producer and the
    consumers only acquire a group's row when their tile changes group.

    Tile: 128 rows of B (each consumer warpgroup one 64-row wgmma M block) by tile_m rows of A (the wgmma N).
    Registers (setmaxnreg): producer 24, transform 64, consumers 208 (prepass: 24, 24, 232; consumer_pairs = 2:
    producer 24, no transform warpgroup, four consumer warpgroups at 112).
    Shared memory: 4 stages (18 KB; prepass 9 KB) + fp16 A buffers of tile_m x 128 k (32 KB; m_exact up to
    192 rows 48 KB), as many as fit up to 4 (`num_a16`: 3 without the prepass or at 192 rows, else 4), or
    `Sm90GemmConfig.a16_buffers` of them (`sm90_a16_pairs`: 8 stages and 8 buffers of 8 KB)
    + 2 x 16 KB epilogue (consumer_pairs = 2: 4 x 16 KB): ~205 KB without the prepass, 213 / 196 KB for m_exact up
    to 192 / 128 rows.
    Named barriers: EPILOGUE_BARRIER + epilogue slab (128 threads each: a slab per consumer warpgroup);
    consumer_pairs = 2 also ORDER_BARRIER + pair (512 threads each: the pairs' turns, `consume_tile`).
    Pipelines (the DSL's classes, as the Blackwell kernels use): the stage ring is a `PipelineTmaAsync`
    (producer TMA and bulk copies -> consumer warps, and the transform warps that read A from it); the fp16 A
    ring a `PipelineTmaAsync` with the prepass (its byte count per tile width, `with_tx_count`), else a
    `PipelineAsync` (transform threads -> consumer threads); each consumer warpgroup's C^T stores a
    `PipelineTmaStore`. Chunk counters give every pipeline state (`ring_state`). Loads and stores are TMA
    copy atoms on the prepared descriptors; the scale slices bulk copies.

    config.a16_prepass: A arrives as fp16, converted once per call into the workspace after the descriptor rows
    and the grid-barrier words (`a16_offset`), by this launch's first phase (a16_fused) or `Sm90AConvertKernel`;
    the producer TMA-loads it straight into the fp16 A buffers (a16_full completes on the transaction bytes),
    the transform warpgroup has nothing to do, and a stage holds only B and SFB.

    Workspace (m_exact): descriptor rows | grid-barrier words | split-K counters (one per split tile and
    consumer warpgroup, SM90_MAX_SPLIT_TILES of them, zeroed by `prepare_workspace`, reset by the last part)
    | fp16 A (`a16_offset`) | split-K partial slots (`partials_offset`, `slot_bytes` each; the work list's
    first word gives their offset). Split-K (`split_fixup`): a part's consumer warpgroups write their fp32
    accumulators to the part's slot and arrive on the tile's counter; the last part reads every slot back in
    slot order and runs the epilogue; the others skip it.
    """

    EPILOGUE_BARRIER = 2  # + epilogue slab (0 .. 3)
    # consumer_pairs = 2: + pair p: pair p has passed its part's chunks, the other pair's turn at the rings
    # (`consume_tile`); 512 threads each (pair p arrives, the other pair waits)
    ORDER_BARRIER = 6
    SLOT_ROWS = 128  # rows of B in a split-K partial slot (the tile's)

    A_BYTES = 128 * 64  # A fp4 rows of one stage: 128 x 64 B (128 k)
    SF_BYTES = 1024  # one 128-row scale slice for 128 k
    C_BYTES = 128 * 64 * 2  # one epilogue slab per consumer warpgroup: 128 m x 64 n fp16
    SMEM_SLACK = 4096  # of DYNAMIC_SMEM_BUDGET: barriers and the alignment of the shared-memory regions
    # The accumulator holds the products' sum times 2^-EPILOGUE_EXPONENT: each operand's e2m1 code is its value
    # times 2^-14 (`fp4x8_to_f16x2x4`), times its scale: A's times 2^7 (`scale_to_f16x2`), 2^-7 in all; B's
    # alone (`scale_pair_to_f16x2`), 2^-14 (docs/HOPPER_NOTES.md v34).
    EPILOGUE_EXPONENT = 21
    # a_input "f16" / "bf16": A's values as they are, B's as above: 2^-14 (`fp4x8_to_f16x2x4`, both forms)
    A16_INPUT_EPILOGUE_EXPONENT = 14
    descriptor_slots = tuple(Sm90TensorMapSlot)

    def __init__(self, num_groups: int, config: "Sm90GemmConfig"):
        self.config = config
        self.num_groups = num_groups
        self.num_stages = config.num_stages or 4
        self.m_exact = config.m_exact
        # rows of A per tile (wgmma N): one width, or (m_exact) one of config.widths per tile, chosen at run time
        self.widths = config.widths
        self.tile_m = self.widths[-1]
        self.tile_n = 128  # rows of B per tile (2 consumer warpgroups x wgmma M 64)
        self.k_chunk = 128  # k elements per stage
        self.prepass = config.a16_prepass
        # a_input "f16" / "bf16" (W4A16): A is TMA-loaded from the caller's tensor, nothing converts it
        self.a16_input = config.a_input != "fp4"
        self.a16_dtype = cutlass.BFloat16 if config.a_input == "bf16" else cutlass.Float16  # the wgmma operands'
        self.fused_convert = config.a16_prepass and config.a16_fused and not self.a16_input  # this launch's phase 1
        self.epilogue_exponent = self.A16_INPUT_EPILOGUE_EXPONENT if self.a16_input else self.EPILOGUE_EXPONENT
        self.a16_bytes = self.tile_m * self.k_chunk * 2  # one fp16 A buffer: tile_m rows x 128 k
        # TMA boxes of the fp16 A loads and of the C^T stores, in rows of A: a width is a whole number of them
        self.box_rows = min(32, self.widths[0]) if self.m_exact else 128
        self.b_bytes = self.tile_n * 64
        # A stage: B fp4 (sB), A fp4 (sA), scale slices [SFA | SFB] (sSF); with the prepass A and SFA are
        # not loaded.
        self.a_stage_bytes = 0 if self.prepass else self.A_BYTES
        self.sfa_in_stage = 0
        self.sfb_in_stage = 0 if self.prepass else self.SF_BYTES
        self.sf_stage_bytes = self.sfb_in_stage + self.SF_BYTES
        self.stage_bytes = self.b_bytes + self.a_stage_bytes + self.sf_stage_bytes  # the TMA bytes of a stage
        # fp16 A buffers: as many as fit beside the stages and the epilogue slabs (barriers and alignment
        # padding in SMEM_SLACK), at most 4: 3 of 48 KB (m_exact up to 192 rows, or no prepass), 4 of 32 KB
        # otherwise; or the config's `a16_buffers`. A buffer is refilled only after the wgmmas that read it
        # retire, so the deeper ring loads A further ahead (measured: 4 instead of 3 buffers, 5 % / 3 % faster on
        # bench2 / bench3; 8 instead of 4 for the consumer pairs, 14 %).
        self.pairs = config.consumer_pairs
        self.c_slabs = 2 * self.pairs  # epilogue slabs: one per consumer warpgroup
        free = DYNAMIC_SMEM_BUDGET - self.SMEM_SLACK - self.num_stages * self.stage_bytes - self.c_slabs * self.C_BYTES
        self.num_a16 = config.a16_buffers or min(4, free // self.a16_bytes)
        if self.num_a16 * self.a16_bytes > free or self.num_a16 < max(2, self.pairs):
            raise ValueError(f"Sm90GemmConfig.a16_buffers={config.a16_buffers}: {max(2, self.pairs)} to "
                             f"{free // self.a16_bytes} buffers of {self.a16_bytes} bytes fit this build")
        # warpgroups: the producer's, the transform warpgroup (not with consumer_pairs = 2), the consumers
        self.first_consumer_wg = 1 if self.pairs == 2 else 2
        self.threads = 128 * (self.first_consumer_wg + 2 * self.pairs)
        self.producer_regs = 24
        # With the prepass the transform warpgroup is idle and gives its registers to the consumers:
        # 128 x (24 + 24) + 256 x 232 = 65536. NOTES: the widest accumulator (64 x 192 of m_exact) needs them:
        # with 208, ptxas serializes every wgmma (C7512) or spills.
        self.transform_regs = 24 if self.prepass else 64
        # consumer_pairs = 2: launched at 96 (65536 / 640, in steps of 8); the producer's 72 given back make 112
        # for the consumers (widths up to 32 keep their wgmmas pipelined there, one word spilled outside the
        # chunk loop; docs/HOPPER_NOTES.md, open items)
        self.consumer_regs = 112 if self.pairs == 2 else (232 if self.prepass else 208)

    @cute.jit
    def group_sizes(self, sizes: cute.Tensor, group: cutlass.Int32):
        """(group, M, N, K) of one group from the [G, 4] size table."""
        return (group, sizes[group, int(SizeColumn.M)], sizes[group, int(SizeColumn.N)],
                sizes[group, int(SizeColumn.K)])

    @staticmethod
    def sync_offset(num_groups: int) -> int:
        """Byte offset of the grid-barrier words in the workspace (after the descriptor rows)."""
        return num_groups * len(Sm90TensorMapSlot) * TENSORMAP_BYTES

    def sync_address(self, tensormaps: cute.Tensor):
        """Address of this launch's grid-barrier words (the workspace is `tensormaps`' buffer)."""
        return tensormaps.iterator.toint() + self.sync_offset(self.num_groups)

    def counters_address(self, tensormaps: cute.Tensor):
        """Address of the split-K arrival counters (after the grid-barrier words): split tile s, consumer
        warpgroup wg at + 8 s + 4 wg."""
        return self.sync_address(tensormaps) + SM90_SYNC_BYTES

    @staticmethod
    def a16_offset(num_groups: int) -> int:
        """Byte offset of the fp16 A region in the workspace (after the grid-barrier words, rounded up to 1024
        bytes, at least the alignment the region had before they came; prepass only)."""
        sync_end = Sm90BlockScaledGroupedGemmKernel.sync_offset(num_groups) + SM90_SYNC_BYTES + SM90_COUNTER_BYTES
        return ceil_div(sync_end, 1024) * 1024

    @staticmethod
    def partials_offset(problem_sizes) -> int:
        """Byte offset of the split-K partial slots in an m_exact workspace (after the fp16 A, 1024-aligned);
        a function of the problem shape, so the work list carries it (in KB)."""
        a16 = sum(m * k * 2 for m, _, k, _ in problem_sizes)
        return ceil_div(Sm90BlockScaledGroupedGemmKernel.a16_offset(len(problem_sizes)) + a16, 1024) * 1024

    @staticmethod
    def slot_bytes(config: "Sm90GemmConfig") -> int:
        """One partial slot: the tile's fp32 accumulator, SLOT_ROWS rows of B x the widest tile's rows of A."""
        return Sm90BlockScaledGroupedGemmKernel.SLOT_ROWS * config.tile_mn[0] * 4

    @staticmethod
    def workspace_bytes(config: "Sm90GemmConfig", problem_sizes, plan: Optional["Sm90WorkPlan"] = None) -> int:
        """Descriptor rows, the grid-barrier words and split-K counters, then (prepass) every group's A as
        fp16, M x K x 2 bytes each, then (a split-K plan) its partial slots."""
        if plan is not None and plan.num_slots:
            kernel = Sm90BlockScaledGroupedGemmKernel
            return kernel.partials_offset(problem_sizes) + plan.num_slots * kernel.slot_bytes(config)
        a16 = sum(m * k * 2 for m, _, k, _ in problem_sizes) if config.a16_prepass and config.a_input == "fp4" else 0
        return Sm90BlockScaledGroupedGemmKernel.a16_offset(len(problem_sizes)) + a16

    def smem_box_layouts(self) -> tuple:
        """Shared-memory layout of one TMA box per descriptor slot (A, B, C^T): what the atoms are built for
        and what the kernel's shared-memory views are tiled from. A: fp16 box_rows x 64 k (128-byte swizzle)
        with the prepass, else fp4 128 rows x 128 k (64 bytes, 64-byte swizzle); B: fp4 tile_n rows x 128 k;
        C^T: 64 n x box_rows m, n contiguous (128-byte rows, 128-byte swizzle: the epilogue's stmatrix rows)."""
        fp4_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW64, cutlass.Uint8)
        if cutlass.const_expr(self.prepass):
            a16_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, self.a16_dtype)
            a_box = cute.tile_to_shape(a16_atom, (self.box_rows, 64), order=(0, 1))
        else:
            a_box = cute.tile_to_shape(fp4_atom, (128, 64), order=(0, 1))
        b_box = cute.tile_to_shape(fp4_atom, (self.tile_n, 64), order=(0, 1))
        c_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.MN_SW128, cutlass.Float16)
        c_box = cute.tile_to_shape(c_atom, (64, self.box_rows), order=(0, 1))
        return a_box, b_box, c_box

    def tma_setup(self) -> tuple:
        """The TMA atoms and their coordinate tensors, in `descriptor_slots` order (host side of both jit
        functions that use them: this GEMM's and `GroupTensormapKernel`'s). Runtime placeholder extents keep
        the coordinate tensors open; each group's descriptors get its real addresses and sizes
        (`group_descriptor_tensors`)."""
        placeholder = cutlass.Int32(128)
        a_box, b_box, c_box = self.smem_box_layouts()

        def null_tensor(dtype, stride):
            ptr = cute.make_ptr(dtype, 0, cute.AddressSpace.gmem, assumed_align=16)
            return cute.make_tensor(ptr, cute.make_layout((placeholder, placeholder), stride=stride))

        a_dtype = self.a16_dtype if cutlass.const_expr(self.prepass) else cutlass.Uint8
        a_rows = self.box_rows if cutlass.const_expr(self.prepass) else 128
        load, store = cpasync.CopyBulkTensorTileG2SOp(), cpasync.CopyBulkTensorTileS2GOp()
        tma_a, g_a = cpasync.make_tiled_tma_atom(load, null_tensor(a_dtype, (placeholder, 1)), a_box, (a_rows, 64))
        tma_b, g_b = cpasync.make_tiled_tma_atom(load, null_tensor(cutlass.Uint8, (placeholder, 1)), b_box,
                                                 (self.tile_n, 64))
        # C^T view: (N, M), n contiguous
        tma_c, g_c = cpasync.make_tiled_tma_atom(store, null_tensor(cutlass.Float16, (1, placeholder)), c_box,
                                                 (64, self.box_rows))
        return (tma_a, tma_b, tma_c), (g_a, g_b, g_c)

    def descriptor_atoms(self) -> tuple:
        """The TMA atoms of the descriptors, in `descriptor_slots` order (host side of a jit function)."""
        return self.tma_setup()[0]

    def a16_address(self, ptrs: cute.Tensor, sizes: cute.Tensor, group, tensormaps: cute.Tensor):
        """Where group `group`'s 16-bit A starts (prepass; device side): the caller's tensor (W4A16: the pointer
        table's A column), else its fp16 A in the workspace, after the earlier groups' (`sm90_a16_group_offset`).
        The MoE entry's subclass reads it from the pointer table for NVFP4 A too (its preparation converts A)."""
        if self.a16_input:
            return ptrs[group, int(PtrColumn.A)]
        return tensormaps.iterator.toint() + sm90_a16_group_offset(sizes, group, self.num_groups)

    def group_descriptor_tensors(self, ptrs: cute.Tensor, sizes: cute.Tensor, group,
                                 tensormaps: cute.Tensor) -> tuple:
        """Group `group`'s global tensors, in `descriptor_slots` order (device side): A and B as fp4 bytes
        (rows, K / 2) (prepass: A as fp16 (rows, K) in the workspace), C transposed as (N, M), n contiguous."""
        _, m_size, n_size, k_size = self.group_sizes(sizes, group)
        kb = k_size // 2
        if cutlass.const_expr(self.prepass):
            a_tensor = cute.make_tensor(
                cute.make_ptr(self.a16_dtype, self.a16_address(ptrs, sizes, group, tensormaps),
                              cute.AddressSpace.gmem, assumed_align=16),
                cute.make_layout((m_size, k_size), stride=(k_size, 1)))
        else:
            a_tensor = cute.make_tensor(
                cute.make_ptr(cutlass.Uint8, ptrs[group, int(PtrColumn.A)], cute.AddressSpace.gmem,
                              assumed_align=16),
                cute.make_layout((m_size, kb), stride=(kb, 1)))
        b_tensor = cute.make_tensor(
            cute.make_ptr(cutlass.Uint8, ptrs[group, int(PtrColumn.B)], cute.AddressSpace.gmem, assumed_align=16),
            cute.make_layout((n_size, kb), stride=(kb, 1)))
        c_tensor = cute.make_tensor(
            cute.make_ptr(cutlass.Float16, ptrs[group, int(PtrColumn.C)], cute.AddressSpace.gmem, assumed_align=16),
            cute.make_layout((n_size, m_size), stride=(1, n_size)))
        return a_tensor, b_tensor, c_tensor

    @cute.jit
    def prepare_workspace(self, tensormaps: cute.Tensor, group):
        """`GroupTensormapKernel`'s extra step (once per input set, ahead of the first GEMM on this workspace):
        zero the grid-barrier words of the fused A conversion and the split-K counters (both self-resetting
        after that)."""
        if cutlass.const_expr(self.fused_convert):
            if group == 0 and cute.arch.lane_idx() == 0:
                sync = self.sync_address(tensormaps)
                st_global_u32(sync, cutlass.Uint32(0))
                st_global_u32(sync + 4, cutlass.Uint32(0))
        if cutlass.const_expr(self.m_exact):
            counters = self.counters_address(tensormaps)
            for i in cutlass.range(group * 32 + cute.arch.lane_idx(), SM90_COUNTER_BYTES // 4, self.num_groups * 32,
                                   unroll=1):
                st_global_u32(counters + 4 * i, cutlass.Uint32(0))

    def a16_outer(self, width: int, num_buffers: int):
        """The fp16 A buffers seen by a tile of `width` rows (the wgmma B operand, K-major, 128-byte swizzle
        applied on top): rows 0..width-1 of every 64-k half of every buffer. A buffer holds tile_m rows per
        half whatever the width, so that buffers stay put when consecutive tiles have different widths."""
        return cute.make_layout(((8, width // 8), (64, 2), num_buffers),
                                stride=((64, 512), (1, self.tile_m * 64), self.tile_m * self.k_chunk))

    @cute.jit
    def __call__(self, ptrs_ptr: cute.Pointer, sizes_ptr: cute.Pointer, workspace_ptr: cute.Pointer,
                 work_ptr: cute.Pointer, total_tiles: cutlass.Int32, grid_x: cutlass.Int32):
        """custom_kernel's entry: launched on the device's legacy default queue."""
        self.launch(ptrs_ptr, sizes_ptr, workspace_ptr, work_ptr, total_tiles, grid_x, None)

    @cute.jit
    def on_stream(self, ptrs_ptr: cute.Pointer, sizes_ptr: cute.Pointer, workspace_ptr: cute.Pointer,
                  work_ptr: cute.Pointer, total_tiles: cutlass.Int32, grid_x: cutlass.Int32, stream: cuda.CUstream):
        """The MoE entry's (moe.py): launched on `stream`, torch's current one (a CUDA graph captures it)."""
        self.launch(ptrs_ptr, sizes_ptr, workspace_ptr, work_ptr, total_tiles, grid_x, stream)

    @cute.jit
    def launch(self, ptrs_ptr: cute.Pointer, sizes_ptr: cute.Pointer, workspace_ptr: cute.Pointer,
               work_ptr: cute.Pointer, total_tiles: cutlass.Int32, grid_x: cutlass.Int32, stream):
        G = self.num_groups
        ptrs, sizes = group_tables(ptrs_ptr, sizes_ptr, G)
        tensormaps = descriptor_table(workspace_ptr, G, len(self.descriptor_slots))
        work = cute.make_tensor(work_ptr, cute.make_layout((1,)))  # m_exact: the plan's words (address only)
        atoms, coords = self.tma_setup()

        @cute.struct
        class SharedStorage:
            # [full x num_stages | empty x num_stages] of the stage ring and of the fp16 A ring; the A ring has
            # a spare empty barrier per consumer pair after them (see `consume_chunk`)
            stage_bars: cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages]
            a16_bars: cute.struct.MemRange[cutlass.Int64, 2 * self.num_a16 + self.pairs]
            sB: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, self.num_stages * self.b_bytes], 1024]
            sA: cute.struct.Align[
                cute.struct.MemRange[cutlass.Uint8, max(self.num_stages * self.a_stage_bytes, 16)], 1024]
            sSF: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, self.num_stages * self.sf_stage_bytes], 128]
            a16: cute.struct.Align[cute.struct.MemRange[self.a16_dtype, self.num_a16 * self.a16_bytes // 2], 1024]
            sC: cute.struct.Align[cute.struct.MemRange[cutlass.Float16, self.c_slabs * self.C_BYTES // 2], 1024]

        self.shared_storage = SharedStorage

        on = {} if cutlass.const_expr(stream is None) else {"stream": stream}
        self.kernel(ptrs, sizes, tensormaps, work, total_tiles, atoms, coords).launch(
            grid=(grid_x, 1, 1), block=(self.threads, 1, 1), min_blocks_per_mp=1, use_pdl=self.config.use_pdl, **on)

    @cute.kernel
    def kernel(self, ptrs: cute.Tensor, sizes: cute.Tensor, tensormaps: cute.Tensor, work: cute.Tensor,
               total_tiles: cutlass.Int32, atoms: tuple, coords: tuple):
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if cutlass.const_expr(self.config.use_pdl):
            # As the Blackwell kernel: the next launch may start early; global memory after the wait below.
            cute.arch.griddepcontrol_launch_dependents()

        smem = SmemAllocator()
        storage = smem.allocate(self.shared_storage)

        # ---- pipelines: stage ring (producer TMA -> consumers, and the transform warpgroup without the
        # prepass; every reading thread releases, `release_read_stage`) and fp16 A ring (producer TMA with the
        # prepass, else the transform warpgroup -> consumers)
        consumer_warps = 8 if cutlass.const_expr(self.prepass) else 12
        stage_pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.stage_bars.data_ptr(), num_stages=self.num_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32 * consumer_warps),
            tx_count=self.stage_bytes, defer_sync=True)
        # A-ring releases per buffer: one per consumer warp (TMA pipeline) or per consumer thread (PipelineAsync)
        a16_releases = 8 if cutlass.const_expr(self.prepass) else 256
        if cutlass.const_expr(self.prepass):
            a16_pipe = pipeline.PipelineTmaAsync.create(
                barrier_storage=storage.a16_bars.data_ptr(), num_stages=self.num_a16,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, a16_releases),
                tx_count=self.a16_bytes, defer_sync=True)
        else:
            a16_pipe = pipeline.PipelineAsync.create(
                barrier_storage=storage.a16_bars.data_ptr(), num_stages=self.num_a16,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 128),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, a16_releases), defer_sync=True)
        spare = storage.a16_bars.data_ptr() + 2 * self.num_a16  # the A ring's spare barriers (`consume_chunk`)
        if warp == 0:
            # NOTES: the same arrival count as the ring's empty barriers, so that a release completes exactly one
            # phase: a warp's 32 arrivals merge into one arrive of count 32, and an arrive larger than the pending
            # count is undefined (measured: a launch failure with count 1 in the PipelineAsync ring).
            for p in range(self.pairs):
                cute.arch.mbarrier_init(spare + p, a16_releases)
        # One CTA-wide sync makes every barrier initialisation visible before any role uses it.
        pipeline.pipeline_init_arrive()
        pipeline.pipeline_init_wait()
        if cutlass.const_expr(self.config.use_pdl):
            cute.arch.griddepcontrol_wait()
        if cutlass.const_expr(self.fused_convert):
            # ---- phase 1: every thread of every CTA converts its share of A to fp16 in the workspace; the
            # producer waits for the whole grid's share (`producer`) before its first fp16 A load.
            workspace = tensormaps.iterator.toint()
            sm90_convert_a_items(ptrs, sizes, workspace + self.a16_offset(self.num_groups), self.num_groups,
                                 bid * self.threads + tidx, grid * self.threads)
            fence_global_for_async_proxy()
            cute.arch.barrier()  # the CTA's conversion is done before its arrival on the grid barrier

        # ---- shared-memory views and their TMA partitions ----------------------------------------------
        tma_a, tma_b, tma_c = atoms
        g_a, g_b, g_c = coords
        a_box, b_box, c_box = self.smem_box_layouts()
        # (box, stage)
        sB = storage.sB.get_tensor(cute.make_layout((b_box.outer.shape, self.num_stages),
                                                    stride=(b_box.outer.stride, self.b_bytes)), swizzle=b_box.inner)
        gB = cute.group_modes(cute.local_tile(g_b, (self.tile_n, 64), (None, None)), 0, 2)  # (box, RestN, RestK)
        tBsB, tBgB = cpasync.tma_partition(tma_b, 0, cute.make_layout(1), sB, gB)
        if cutlass.const_expr(self.prepass):
            # (box, box within a half, half, buffer): the fp16 A buffers as box_rows-row boxes
            sA = storage.a16.get_tensor(cute.make_layout(
                (a_box.outer.shape, self.tile_m // self.box_rows, 2, self.num_a16),
                stride=(a_box.outer.stride, self.box_rows * 64, self.tile_m * 64, self.tile_m * self.k_chunk)),
                swizzle=a_box.inner)
            a_tile = (self.box_rows, 64)
        else:
            # (box, stage): A fp4 of a stage
            sA = storage.sA.get_tensor(cute.make_layout((a_box.outer.shape, self.num_stages),
                                                        stride=(a_box.outer.stride, self.A_BYTES)), swizzle=a_box.inner)
            a_tile = (128, 64)
        tAsA, tAgA = cpasync.tma_partition(tma_a, 0, cute.make_layout(1), sA,
                                           cute.group_modes(cute.local_tile(g_a, a_tile, (None, None)), 0, 2))
        # (box, box within a slab, slab): the epilogue slabs as box_rows-row boxes of C^T
        sC = storage.sC.get_tensor(cute.make_layout((c_box.outer.shape, 128 // self.box_rows, self.c_slabs),
                                                    stride=(c_box.outer.stride, self.box_rows * 64,
                                                            self.C_BYTES // 2)), swizzle=c_box.inner)
        gC = cute.group_modes(cute.local_tile(g_c, (64, self.box_rows), (None, None)), 0, 2)  # (box, RestN, RestM)
        tCsC, tCgC = cpasync.tma_partition(tma_c, 0, cute.make_layout(1), sC, gC)
        swizzle = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, self.a16_dtype).inner
        # per width: the fp16 A buffers as the wgmma B operand
        sA16 = [storage.a16.get_tensor(self.a16_outer(w, self.num_a16), swizzle=swizzle) for w in self.widths]
        smem = Sm90SharedAddresses(storage.sB.data_ptr().toint(), storage.sA.data_ptr().toint(),
                                   storage.sSF.data_ptr().toint(), storage.a16.data_ptr().toint(),
                                   storage.sC.data_ptr().toint())

        descriptors = TmaDescriptorRows(True, tensormaps, bid)

        if warp < 4:
            cute.arch.warpgroup_reg_dealloc(self.producer_regs)
            if warp == 0:
                self.producer(ptrs, sizes, work, descriptors, total_tiles, bid, grid, stage_pipe, a16_pipe,
                              (tma_a, tma_b), (tAgA, tBgB), (tAsA, tBsB), smem)
        elif warp < 4 * self.first_consumer_wg:
            cute.arch.warpgroup_reg_dealloc(self.transform_regs)
            if cutlass.const_expr(not self.prepass):
                self.transform(sizes, work, total_tiles, bid, grid, tidx, stage_pipe, a16_pipe, smem)
        else:
            cute.arch.warpgroup_reg_alloc(self.consumer_regs)
            self.consumer(sA16, ptrs, sizes, work, descriptors, total_tiles, bid, grid, tidx, warp, stage_pipe,
                          a16_pipe, tma_c, tCsC, tCgC, smem)

    # -----------------------------------------------------------------------------------------------
    # Tile sequence of a CTA (every role walks it on its own)
    # -----------------------------------------------------------------------------------------------
    @cute.jit
    def tile_range(self, work: cute.Tensor, total_tiles, bid, grid):
        """[begin, end) of this CTA's tile positions: its slice of the work list (m_exact), else the count
        of tiles bid, bid + grid, ... below total_tiles."""
        if cutlass.const_expr(self.m_exact):
            base = work.iterator.toint()
            return cutlass.Int32(ld_global_u32(base + 4 * (bid + 1))), cutlass.Int32(ld_global_u32(base + 4 * (bid + 2)))
        return cutlass.Int32(0), (total_tiles - bid + grid - 1) // grid

    @cute.jit
    def part_entry(self, work: cute.Tensor, i, grid):
        """Address of part i's words in the work list: after the header (the partials' offset and grid + 1
        part offsets, in SM90_PART_WORDS-word rows), SM90_PART_WORDS words per part (`Sm90WorkPlan.words`)."""
        row_bytes = 4 * SM90_PART_WORDS
        return (work.iterator.toint() + row_bytes * ((grid + 2 + SM90_PART_WORDS - 1) // SM90_PART_WORDS)
                + row_bytes * cutlass.Int64(i))

    @cute.jit
    def next_part_entry(self, work: cute.Tensor, i, end, grid):
        """Address of the work-list words of the part after part i (part i's own when it is the CTA's last: a
        select, not a branch)."""
        return self.part_entry(work, i + cutlass.Int32(i + 1 < end), grid)

    @cute.jit
    def prefetch_next_part(self, work: cute.Tensor, i, end, grid):
        """m_exact: the next part's work-list entry into L1, so that the next `tile_at` finds it there
        (docs/HOPPER_NOTES.md v33)."""
        if cutlass.const_expr(self.m_exact):
            prefetch_global_l1(self.next_part_entry(work, i, end, grid))

    @cute.jit
    def prefetch_next_group(self, ptrs: cute.Tensor, sizes: cute.Tensor, work: cute.Tensor, descriptors, i, end,
                            grid, last_g):
        """m_exact, the producer once part i's loads are issued: the next part's group's size row and scale
        pointers into L1, the next loads of its chain (`group_sizes`, then `produce_tile`'s pointers) before its
        first TMA load; where that group is not `last_g` (the one whose descriptors this thread acquired last),
        its A and B descriptors acquired now and prefetched into the descriptor cache, so that its first TMA load
        does not fetch them. Its group comes from the entry `prefetch_next_part` brought in. What the producer
        would wait for between one part's last TMA load and the next one's first (docs/HOPPER_NOTES.md v33; done
        when part i starts instead, v39, it measured 2 % slower on Qwen3). Returns the group whose descriptors are
        acquired (NOTES: acquiring the next group's early is sound: every row was written by the preparation
        kernel before this launch and is never rewritten, so the loads in flight on part i's row are untouched)."""
        if cutlass.const_expr(self.m_exact):
            g = cutlass.Int32(ld_global_u32(self.next_part_entry(work, i, end, grid), True))
            for table, column in ((sizes, int(SizeColumn.K)), (ptrs, int(PtrColumn.SFA)), (ptrs, int(PtrColumn.SFB))):
                prefetch_global_l1(element_address(table, (g, column)))
            g = cute.arch.make_warp_uniform(g)
            if g != last_g:
                slots = (Sm90TensorMapSlot.A, Sm90TensorMapSlot.B)
                descriptors.acquire(g, slots)
                for desc in descriptors.for_tma(g, slots):
                    prefetch_tensormap(desc.toint())
                last_g = g
        return last_g

    @cute.jit
    def tile_at(self, i, work: cute.Tensor, scheduler, walk, bid, grid):
        """This CTA's part at position i: (group, first row, width index, N tile, first 128-k chunk, chunks,
        1 if it is a part of a split tile else 0), and the scheduler's walk state (group, first tile of the group,
        tiles in the group; unchanged with a work list). Without a work list every part is a whole tile."""
        group, group_first, group_tiles = walk
        if cutlass.const_expr(self.m_exact):
            entry = self.part_entry(work, i, grid)
            g, m0, width_idx, n_tile = [cutlass.Int32(x) for x in ld_global_v4(entry)]
            k0, chunk_word, _, _ = [cutlass.Int32(x) for x in ld_global_v4(entry + 16)]
            # warp-uniform: the chunk count drives the ring states that address every wgmma's fp16 A buffer
            # (see `split_fixup`'s NOTES on what a non-uniform value there costs)
            k0 = cute.arch.make_warp_uniform(k0)
            chunk_word = cute.arch.make_warp_uniform(chunk_word)
            chunks, split = chunk_word & (SM90_SPLIT_FLAG - 1), chunk_word >> 16
        else:
            tile = bid + i * grid
            group, group_first, group_tiles = scheduler.find_group(tile, group, group_first, group_tiles)
            m_tile, n_tile = scheduler.tile_coord(tile, group_first, scheduler.size_table[group, int(SizeColumn.M)])
            g, m0, width_idx = group, m_tile * self.tile_m, cutlass.Int32(0)
            k0, chunks = cutlass.Int32(0), scheduler.size_table[group, int(SizeColumn.K)] // self.k_chunk
            split = cutlass.Int32(0)
        return g, m0, width_idx, n_tile, k0, chunks, split, (group, group_first, group_tiles)

    # -----------------------------------------------------------------------------------------------
    # Producer warp: per 128-k chunk, the stage (B and its scales; A fp4 too without the prepass) and the fp16 A
    # -----------------------------------------------------------------------------------------------
    @cute.jit
    def producer(self, ptrs, sizes, work, descriptors, total_tiles, bid, grid, stage_pipe, a16_pipe, atoms,
                 gmem_parts, smem_parts, smem):
        # One bulk copy (not a tensor copy) per 1 KB scale slice.
        sf_atom = cute.make_copy_atom(cpasync.CopyBulkG2SOp(), cutlass.Uint8, num_bits_per_copy=self.SF_BYTES * 8)
        # with the prepass the fp16 A ring expects a tile's own bytes: width rows x 128 k (else the producer
        # does not load A into it)
        a16_pipes = [with_tx_count(a16_pipe, width * self.k_chunk * 2) if cutlass.const_expr(self.prepass)
                     else a16_pipe for width in self.widths]
        if cutlass.const_expr(self.fused_convert):
            # this CTA's arrival (its conversion is done: the kernel's barrier after phase 1), then every CTA's
            if cute.arch.lane_idx() == 0:
                sm90_grid_arrive_and_wait(self.sync_address(descriptors.tensormaps), cutlass.Uint32(grid - 1))
            cute.arch.sync_warp()
            fence_global_for_async_proxy()  # the other CTAs' fp16 A, written by the generic proxy, before TMA loads
        chunk = cutlass.Int32(0)
        last_g = cutlass.Int32(-1)
        scheduler = GroupTileScheduler(sizes, self.tile_m, self.tile_n)
        walk = scheduler.first_state()
        begin, end = self.tile_range(work, total_tiles, bid, grid)
        for i in range(begin, end):
            g, m0, width_idx, n_tile, k0, chunks, _, walk = self.tile_at(i, work, scheduler, walk, bid, grid)
            self.prefetch_next_part(work, i, end, grid)
            _, _, _, k_size = self.group_sizes(sizes, g)
            # Warp-uniform group: the descriptor addresses stay in uniform registers for the TMA issue.
            g = cute.arch.make_warp_uniform(g)
            if g != last_g:
                # Group g's row was written by the preparation kernel and is never rewritten: loads still in
                # flight on the previous group's row need no drain.
                descriptors.acquire(g, (Sm90TensorMapSlot.A, Sm90TensorMapSlot.B))
                last_g = g
            for w in cutlass.range_constexpr(len(self.widths)):
                if width_idx == w:
                    self.produce_tile(self.widths[w], chunk, ptrs, descriptors, g, m0, n_tile, k_size, k0, chunks,
                                      stage_pipe, a16_pipes[w], atoms, gmem_parts, smem_parts, sf_atom, smem)
            last_g = self.prefetch_next_group(ptrs, sizes, work, descriptors, i, end, grid, last_g)
            chunk = chunk + chunks

    @cute.jit
    def produce_tile(self, width: int, chunk, ptrs, descriptors, g, m0, n_tile, k_size, k0, chunks, stage_pipe,
                     a16_pipe, atoms, gmem_parts, smem_parts, sf_atom, smem):
        """The loads of one part (chunks k0 .. k0 + chunks - 1 of a tile of `width` rows of A): per 128-k chunk
        a stage (B, its scales; A fp4 and its scales without the prepass) and, with the prepass, the chunk's
        fp16 A into buffer chunk % num_a16."""
        tma_a, tma_b = atoms
        tAgA, tBgB = gmem_parts
        tAsA, tBsB = smem_parts
        desc_a, desc_b = descriptors.for_tma(g, (Sm90TensorMapSlot.A, Sm90TensorMapSlot.B))
        lane = cute.arch.lane_idx()
        sfa = ptrs[g, int(PtrColumn.SFA)]
        sfb = ptrs[g, int(PtrColumn.SFB)]
        rest_k = k_size // 64
        sfa_row = cutlass.Int64((m0 // 128) * rest_k) * 512
        for c in range(chunks):
            kc = k0 + c  # the chunk's position in K
            state = ring_state(chunk + c, self.num_stages, producer=True)
            stage_pipe.producer_acquire(state)  # waits for the stage, then expects its bytes
            full = stage_pipe.producer_get_barrier(state)
            if cutlass.const_expr(not self.prepass):
                cute.copy(tma_a, tAgA[(None, m0 // 128, kc)], tAsA[(None, state.index)], tma_bar_ptr=full,
                          tma_desc_ptr=desc_a)
            cute.copy(tma_b, tBgB[(None, n_tile, kc)], tBsB[(None, state.index)], tma_bar_ptr=full,
                      tma_desc_ptr=desc_b)
            if lane == 0:  # bulk copies are not elected by the DSL
                sf_off = cutlass.Int64(kc) * 1024
                sf_stage = smem.sf + state.index * self.sf_stage_bytes
                if cutlass.const_expr(not self.prepass):
                    cute.copy(sf_atom, byte_tensor(sfa + sfa_row + sf_off, self.SF_BYTES, gmem=True),
                              byte_tensor(sf_stage + self.sfa_in_stage, self.SF_BYTES), mbar_ptr=full)
                sfb_row = cutlass.Int64(n_tile * rest_k) * 512
                cute.copy(sf_atom, byte_tensor(sfb + sfb_row + sf_off, self.SF_BYTES, gmem=True),
                          byte_tensor(sf_stage + self.sfb_in_stage, self.SF_BYTES), mbar_ptr=full)
            if cutlass.const_expr(self.prepass):
                # fp16 A of this chunk: box_rows-row boxes of each 64-k half into the ring's next fp16 A buffer,
                # once the consumers have retired the wgmmas that read its previous contents.
                a16_state = ring_state(chunk + c, self.num_a16, producer=True)
                a16_pipe.producer_acquire(a16_state)
                a16_full = a16_pipe.producer_get_barrier(a16_state)
                for h in cutlass.range_constexpr(2):
                    for j in cutlass.range_constexpr(width // self.box_rows):
                        cute.copy(tma_a, tAgA[(None, m0 // self.box_rows + j, 2 * kc + h)],
                                  tAsA[(None, j, h, a16_state.index)], tma_bar_ptr=a16_full, tma_desc_ptr=desc_a)

    # -----------------------------------------------------------------------------------------------
    # Transform warpgroup: A fp4 (stage) -> fp16 buffer (the wgmma B operand), one row per thread
    # -----------------------------------------------------------------------------------------------
    @cute.jit
    def transform(self, sizes, work, total_tiles, bid, grid, tidx, stage_pipe, a16_pipe, smem):
        row = tidx % 128
        a_row_off = row * 64
        a_swz16 = ((row >> 1) & 3) * 16
        sfa_off = (row % 32) * 16 + ((row // 32) % 4) * 4
        a16_row = row * 128
        a16_swz16 = (row % 8) * 16
        chunk = cutlass.Int32(0)
        scheduler = GroupTileScheduler(sizes, self.tile_m, self.tile_n)
        walk = scheduler.first_state()
        begin, end = self.tile_range(work, total_tiles, bid, grid)
        for i in range(begin, end):
            _, _, _, _, _, chunks, _, walk = self.tile_at(i, work, scheduler, walk, bid, grid)
            for _ in range(chunks):
                state = ring_state(chunk, self.num_stages)
                a16_state = ring_state(chunk, self.num_a16, producer=True)
                stage_pipe.consumer_wait(state)
                stage_a = smem.a + state.index * self.A_BYTES
                # words[q'] = physical k 32 q' + [0, 32) of this row: word (q', t) covers 32 q' + 8 t + [0, 8)
                words = [ld_shared_v4(stage_a + a_row_off + ((16 * qq) ^ a_swz16)) for qq in range(4)]
                sf_a = smem.sf + state.index * self.sf_stage_bytes + self.sfa_in_stage + sfa_off
                sf = [ld_shared_u32(sf_a + 512 * sub) for sub in range(2)]
                a16_pipe.producer_acquire(a16_state)
                a16 = smem.a16 + a16_state.index * self.a16_bytes + a16_row
                for t in cutlass.range_constexpr(4):
                    # scale block of word (q', t): 2 q' + t // 2 -> word q' // 2, byte 2 (q' % 2) + t // 2
                    conv = [fp4x8_to_f16x2x4(words[qq][t], scale_to_f16x2(
                        sf[qq // 2], cutlass.Uint32((2 * (qq % 2) + t // 2) * 0x11))) for qq in range(4)]
                    for i in cutlass.range_constexpr(4):
                        s_log = 2 * t + i // 2  # logical k16 step; slot i % 2 selects k 8..15 of the step
                        addr = a16 + (s_log // 4) * (self.a16_bytes // 2) + ((((2 * s_log + i % 2) % 8) * 16) ^ a16_swz16)
                        st_shared_v4(addr, conv[0][i], conv[1][i], conv[2][i], conv[3][i])
                # the stores are visible to the wgmma (async proxy) before this thread's arrival
                fence_smem_for_async_proxy()
                a16_pipe.producer_commit(a16_state)
                # The stage once its loaded words have been used (the conversion above). Released right after its
                # loads, the producer's next TMA write into the stage raced them: whole rows of a tile wrong in 9 of
                # 12 runs of the runner's pattern (H100, docs/HOPPER_NOTES.md r43b; the consumers' twin: r43c).
                release_read_stage(stage_pipe, state)
                chunk = chunk + 1

    # -----------------------------------------------------------------------------------------------
    # Consumer warpgroups
    # -----------------------------------------------------------------------------------------------
    @cute.jit
    def consumer(self, sA16, ptrs, sizes, work, descriptors, total_tiles, bid, grid, tidx, warp, stage_pipe,
                 a16_pipe, tma_c, tCsC, tCgC, smem):
        # warp-uniform values stay in uniform registers (TMA operands must not need a predicated R2UR)
        # consumer warpgroup wg (0, 1: its 64 rows of B), of pair `pair` with consumer_pairs = 2
        wg = warp // 4 - self.first_consumer_wg
        pair = cutlass.Int32(0)
        if cutlass.const_expr(self.pairs == 2):
            pair = wg // 2
            wg = wg % 2
        w = warp % 4
        tid = tidx % 128
        lane = tid % 32

        # One tiled MMA per width: C^T block (64 rows of B) x (width rows of A), A operand from registers.
        tiled_mmas = [sm90_utils.make_trivial_tiled_mma(
            self.a16_dtype, self.a16_dtype, _OperandMajorMode.K, _OperandMajorMode.K, cutlass.Float32,
            (1, 1, 1), (64, width), warpgroup.OperandSource.RMEM) for width in self.widths]
        # (MMA, MMA_M, MMA_K=2): register-sourced wgmma A operand for a quarter chunk (32 k), two buffers (even
        # / odd quarter); the same shape for every width
        frag_shape = tiled_mmas[0].partition_shape_A((64, 32))
        frags = [cute.make_rmem_tensor(frag_shape, self.a16_dtype) for _ in range(2)]
        # Warp 0 of each consumer warpgroup stores its slab. The DSL does not elect a lane for the TMA store (the
        # PTX has every lane of the warp issue it); with warp-uniform operands the SASS issues it once per warp.
        c_store = pipeline.PipelineTmaStore.create(
            num_stages=1, producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32))
        # this warpgroup's epilogue slab and barrier (a runtime id: a NamedBarrier object wants a compile-time one)
        slab = wg + 2 * pair
        epilogue_barrier = self.EPILOGUE_BARRIER + slab

        # Per-thread constants, kept to a few registers: every other offset is base + compile-time constant.
        # B: rows r, r + 8 of each 64-row block (r + 8 and r + 64 keep the SW64 swizzle and the scale-slice
        # position: +512 / +4096 bytes of B, +128 / +8 bytes of SFB), 16-byte column chunk q.
        q = lane % 4
        b_row = 64 * wg + 16 * w + lane // 4
        b_off = b_row * 64 + 16 * (q ^ ((b_row >> 1) & 3))
        # SFB: this thread's two scale bytes of row b_row (k blocks 2 q, 2 q + 1), one 16-bit word; W4A16: the
        # row's eight scales of the chunk, two 32-bit words
        if cutlass.const_expr(self.a16_input):
            sfb_off = (b_row % 32) * 16 + ((b_row // 32) % 4) * 4
        else:
            sfb_off = ((b_row // 128) * self.SF_BYTES + (q // 2) * 512 + (b_row % 32) * 16
                       + ((b_row // 32) % 4) * 4 + 2 * (q % 2))
        chunk = cutlass.Int32(0)
        last_g = cutlass.Int32(-1)
        scheduler = GroupTileScheduler(sizes, self.tile_m, self.tile_n)
        walk = scheduler.first_state()
        begin, end = self.tile_range(work, total_tiles, bid, grid)
        for i in range(begin, end):
            g, m0, width_idx, n_tile, _, chunks, is_split, walk = self.tile_at(i, work, scheduler, walk, bid, grid)
            g = cute.arch.make_warp_uniform(g)
            # consumer_pairs = 2: this pair's parts are those of its parity (every role still counts every
            # part's chunks)
            own_part = cutlass.Int32(1)
            if cutlass.const_expr(self.pairs == 2):
                own_part = cute.arch.make_warp_uniform(cutlass.Int32((i - begin) % 2 == pair))
            if own_part != 0:
                if g != last_g:
                    if w == 0:  # the warp that issues this warpgroup's TMA stores
                        descriptors.acquire(g, (Sm90TensorMapSlot.C,))
                    last_g = g
                for wi in cutlass.range_constexpr(len(self.widths)):
                    if width_idx == wi:
                        self.consume_tile(self.widths[wi], tiled_mmas[wi], sA16[wi], frags, chunk, chunks, is_split, i,
                                          grid, work, sizes, descriptors, descriptors.for_tma(g, (Sm90TensorMapSlot.C,))[0],
                                          m0, n_tile, wg, w, tid, stage_pipe, a16_pipe, tma_c, tCsC, tCgC, c_store,
                                          (slab, epilogue_barrier), smem, b_off, sfb_off,
                                          (pair, cutlass.Int32(i > begin), cutlass.Int32(i + 1 < end)))
            chunk = chunk + chunks
        if w == 0:
            c_store.producer_tail()  # the stores have completed before the CTA retires

    @cute.jit
    def consume_tile(self, width: int, tiled_mma, sA16, frags, chunk, num_chunks, is_split, i, grid, work, sizes,
                     descriptors,
                     desc_c, m0, n_tile, wg, w, tid, stage_pipe, a16_pipe, tma_c, tCsC, tCgC, c_store,
                     epilogue, smem, b_off, sfb_off, team):
        """One part of a tile of `width` rows of A: its K loop into the accumulator (64 n x width m); a part of
        a split tile then meets the others' (`split_fixup`); the epilogue, where the tile is complete (fp16
        slabs of at most 128 m x 64 n, TMA-stored as box_rows-row boxes of C^T).
        epilogue: (this warpgroup's epilogue slab, its named barrier).
        team: (pair, 1 if the CTA had a part before this one, 1 if it has one after): with consumer_pairs = 2
        the pairs take turns at the rings (below)."""
        thr_mma = tiled_mma.get_slice(tid)
        # (MMA, MMA_N, MMA_K, A16 buffer)
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sA16))
        # (MMA, MMA_M, MMA_N): this warpgroup's 64 rows of B by the tile's rows of A
        acc = cute.make_rmem_tensor(tiled_mma.partition_shape_C((64, width)), cutlass.Float32)
        tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
        acc.fill(0.0)
        pair = team[0] if cutlass.const_expr(self.pairs == 2) else 0
        # consume_chunk's arguments after (ring count, first), the same for every chunk of the part (NOTES: a
        # tuple, not a closure: the DSL refuses a nested function that captures values across its loops)
        rest = (self.num_a16 + pair, frags, acc, tCrB, tiled_mma, stage_pipe, a16_pipe, smem, b_off, sfb_off)
        # Two chunks per iteration (the second never the part's first, so its spare-buffer select folds away),
        # an odd last one after the loop: the counter, test and branch and the ring's bookkeeping once per two
        # chunks (docs/HOPPER_NOTES.md v35). NOTES: branch-free within the loop on purpose: a dynamic `if`
        # between wgmma groups makes ptxas wait for every wgmma group (WARPGROUP.DEPBAR 0 instead of 1 in the
        # SASS): the MMAs serialize. The odd chunk's `if` comes after the loop's last wgmma group, and the SASS
        # keeps every wait pipelined (tests/test_build.py counts the loop bodies and WARPGROUP.DEPBAR 1).
        if cutlass.const_expr(self.pairs == 2):
            # NOTES: the pairs take turns at the rings. A ring wait is a phase-parity test, which cannot tell
            # a chunk from the one a lap (num_stages chunks) earlier: a pair that waited for its part's first
            # chunk while the other pair still had more than a lap of its own part to go would pass at once,
            # on the earlier chunk's data. So a pair starts its part's chunks only once the other pair has
            # passed the waits of its part's last chunk (then the producer has filled every chunk before
            # this one); its drain and epilogue still overlap the other pair's chunks. One barrier per direction:
            # with one for both, a pair with a short part could arrive and then wait on the same barrier before
            # the other pair's wait there, and complete it with its own two halves (measured: a hang).
            if team[1] != 0:
                cute.arch.barrier(barrier_id=self.ORDER_BARRIER + 1 - pair, number_of_threads=512)
        for j in range(num_chunks // 2):
            self.consume_chunk(chunk + 2 * j, cutlass.Int32(j == 0), *rest)
            self.consume_chunk(chunk + 2 * j + 1, cutlass.Int32(0), *rest)
        if num_chunks % 2 == 1:
            self.consume_chunk(chunk + (num_chunks - 1), cutlass.Int32(num_chunks == 1), *rest)
        if cutlass.const_expr(self.pairs == 2):
            if team[2] != 0:  # the other pair's turn: it has the next part
                cute.arch.barrier_arrive(barrier_id=self.ORDER_BARRIER + pair, number_of_threads=512)
        warpgroup.wait_group(0)
        a16_pipe.consumer_release(ring_state(chunk + num_chunks - 1, self.num_a16))
        self.finish_tile(width, acc, is_split, i, grid, work, sizes, descriptors, desc_c, m0, n_tile, wg, w, tid, tma_c,
                         tCsC, tCgC, c_store, epilogue, smem)

    @cute.jit
    def finish_tile(self, width: int, acc, is_split, i, grid, work, sizes, descriptors, desc_c, m0, n_tile, wg, w,
                    tid, tma_c, tCsC, tCgC, c_store, epilogue, smem):
        """A tile part's accumulator to C: split-K's meeting of the parts where it is one (`split_fixup`), then
        the epilogue where the tile is complete. epilogue: (slab, named barrier) of this warpgroup.
        group_alpha: the group's scale bits (the size table's L column) read here, the group from the part's
        entry, as the split words are (nothing more kept live across the mainloop)."""
        slab, epilogue_barrier = epilogue
        complete = cutlass.Int32(1)
        if cutlass.const_expr(self.m_exact):
            if is_split != 0:
                # the split words, read here rather than kept live across the mainloop (NOTES: kept live,
                # DSL 4.5.2's build spilled consumer registers)
                _, _, split, slot = [cutlass.Int32(x) for x in ld_global_v4(self.part_entry(work, i, grid) + 16, True)]
                complete = self.split_fixup(width, acc, split, slot, work, descriptors.tensormaps, wg, tid,
                                            epilogue_barrier)
        alpha_bits = None
        if cutlass.const_expr(self.config.group_alpha):
            g = cutlass.Int32(ld_global_u32(self.part_entry(work, i, grid), True))
            alpha_bits = ld_global_u32(element_address(sizes, (g, int(SizeColumn.L))), True)
        if complete != 0:
            self.epilogue(width, acc, desc_c, m0, n_tile, wg, w, tid, tma_c, tCsC, tCgC, c_store, slab,
                          epilogue_barrier, smem, alpha_bits)

    @cute.jit
    def split_fixup(self, width: int, acc, split, slot, work, tensormaps, wg, tid, epilogue_barrier):
        """Split-K: this warpgroup's part of split tile `split` writes its fp32 accumulator to its slot and
        arrives on the tile's counter; the last part to arrive reads every slot back, in slot order (so the
        sum does not depend on which part finished last), into `acc` and returns 1: it stores the tile.
        `slot`: part index | parts << 8 | first slot << 16 (`Sm90WorkPlan.cta_tiles`).
        A slot: [consumer warpgroup][v4 j][thread] of 16 bytes, so each access of a warpgroup is 2 KB in a row."""
        part = slot & 0xFF
        parts = (slot >> 8) & 0xFF
        slot_bytes = self.slot_bytes(self.config)
        workspace = tensormaps.iterator.toint()
        # the work list's first word: the slots' offset in the workspace, in KB (computed here, not kept live
        # across the tile loop: the consumers have no register to spare)
        partials = workspace + cutlass.Int64(ld_global_u32(work.iterator.toint(), True)) * 1024
        first = partials + cutlass.Int64(slot >> 16) * slot_bytes + wg * (slot_bytes // 2) + tid * 16
        own = first + cutlass.Int64(part) * slot_bytes
        for j in cutlass.range_constexpr(width // 8):
            st_global_v4_f32(own + 2048 * j, acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3])
        counter = self.counters_address(tensormaps) + 8 * split + 4 * wg
        # NOTES: the same in every thread (a barrier reduction), and ptxas must be told: unmarked, the branches
        # on it made the tile loop divergent, the wgmma descriptors left the uniform registers (DSL 4.5.2
        # SASS: 213 R2UR instead of 53, two per wgmma) and whole tiles ran 5 % slower (H200, bench0 / bench1)
        last = cute.arch.make_warp_uniform(sm90_split_arrive(counter, cutlass.Int32(tid == 0), parts - 1,
                                                             epilogue_barrier))
        if last != 0:
            for j in cutlass.range_constexpr(width // 8):
                v = ld_global_cg_v4_f32(first + 2048 * j)
                for e in cutlass.range_constexpr(4):
                    acc[4 * j + e] = v[e]
            for q in cutlass.range(1, parts, unroll=1):
                for j in cutlass.range_constexpr(width // 8):
                    v = ld_global_cg_v4_f32(first + cutlass.Int64(q) * slot_bytes + 2048 * j)
                    for e in cutlass.range_constexpr(4):
                        acc[4 * j + e] = acc[4 * j + e] + v[e]
        return last

    @cute.jit
    def epilogue(self, width: int, acc, desc_c, m0, n_tile, wg, w, tid, tma_c, tCsC, tCgC, c_store, slab,
                 epilogue_barrier, smem, alpha_bits=None):
        """Per pass of at most 128 rows of A: acc -> fp16 slab [m][n] in shared memory (128-byte rows of 64 n,
        128-byte swizzle) by stmatrix -> TMA stores of box_rows x 64 boxes of C^T.

        NOTES: value v of the accumulator is n 16 w + lane / 4 + 8 h, m 8 q + 2 (lane % 4) + v % 2, where
        q = v / 4 and h = (v / 2) % 2: per (q, h) an 8 x 8 block in the m8n8 fragment order, n its rows and m
        its columns. `stmatrix .trans` writes it as 8 slab rows m of 16 bytes (8 n), 16-byte chunk 2 w + h
        swizzled by m % 8, so the 8 rows of a matrix fill all 32 banks: one wavefront per matrix, where one
        16-bit store per value with 4-way bank conflicts made 8 per matrix (docs/HOPPER_NOTES.md v31)."""
        lane = tid % 32
        c_slab = smem.c + slab * self.C_BYTES
        n0 = n_tile * self.tile_n + 64 * wg
        row = lane % 8  # the slab row (m % 8) whose address this lane gives
        for p in cutlass.range_constexpr((width + 127) // 128):
            rows = min(128, width - 128 * p)
            if w == 0:
                c_store.producer_acquire()  # the previous store has read the slab (no-op when none is pending)
            cute.arch.barrier(barrier_id=epilogue_barrier, number_of_threads=128)
            # per instruction the four matrices of blocks q = 2 j, 2 j + 1 (h = 0, 1 each): widths are multiples
            # of 16 (SM90_WIDTHS)
            for j in cutlass.range_constexpr(rows // 16):
                addr = c_slab + (16 * j + 8 * (lane // 16) + row) * 128 + ((2 * w + (lane // 8) % 2) ^ row) * 16
                stmatrix_f16_scaled(addr, [acc[64 * p + 8 * j + e] for e in range(8)], self.epilogue_exponent,
                                    alpha_bits, self.config.bf16_out)
            fence_smem_for_async_proxy()
            cute.arch.barrier(barrier_id=epilogue_barrier, number_of_threads=128)
            if w == 0:
                for j in cutlass.range_constexpr(rows // self.box_rows):
                    cute.copy(tma_c, tCsC[(None, j, slab)],
                              tCgC[(None, n0 // 64, (m0 + 128 * p) // self.box_rows + j)], tma_desc_ptr=desc_c)
                c_store.producer_commit()

    @cute.jit
    def consume_chunk(self, chunk, first, spare, frags, acc, tCrB, tiled_mma, stage_pipe, a16_pipe, smem, b_off,
                      sfb_off):
        state = ring_state(chunk, self.num_stages)
        a16_state = ring_state(chunk, self.num_a16)
        stage_pipe.consumer_wait(state)
        stage_b = smem.b + state.index * self.b_bytes
        sf_b = smem.sf + state.index * self.sf_stage_bytes + self.sfb_in_stage

        # -- this thread's B rows (r, r + 8) and their scale words; the stage is released once every loaded value
        # has been used (below)
        b_words = [ld_shared_v4(stage_b + b_off + 512 * half) for half in range(2)]
        # per row one register of both scales (one 16-bit load, one conversion: no byte select, no 2^7 per
        # scale), word t taking its half t // 2, which `fp4x8_to_f16x2x4` broadcasts (docs/HOPPER_NOTES.md v34)
        bf16 = self.config.a_input == "bf16"  # W4A16 with bf16 A: B converted to bf16
        if cutlass.const_expr(self.a16_input):
            # W4A16 (A in its natural k order, B's nibbles in `moe.w4a16_codes`' order): word t of a row spans the
            # k-blocks 2 t, 2 t + 1 of the chunk, so each row's eight scales (two words: k-blocks 0-3, 4-7)
            b_scale_words = [[ld_shared_u32(sf_b + sfb_off + 128 * r + 512 * sub) for sub in range(2)]
                             for r in range(2)]
        else:
            b_pairs = [scale_pair_to_f16x2(ld_shared_u16(sf_b + sfb_off + 128 * half)) for half in range(2)]
        a16_pipe.consumer_wait(a16_state)
        # The previous chunk's fp16 A buffer, released at t == 1 below once its wgmmas have retired. A tile's
        # first chunk releases its pair's spare barrier after the ring instead (`spare`: index num_a16 + pair):
        # the tile before released its last buffer after its final wait; a select, not a branch (see
        # consume_tile's NOTES).
        prev_index = ring_state(chunk + (self.num_a16 - 1), self.num_a16).index
        prev_state = pipeline.PipelineState(self.num_a16, chunk, first * spare + (1 - first) * prev_index, 0)

        # -- per quarter (32 k = word t of each row): dequantize into the register fragment and issue
        # 2 k-steps of wgmma; a fragment buffer is rewritten two quarters later.
        for t in cutlass.range_constexpr(4):
            warpgroup.wait_group(1)
            if t == 1:
                # every wgmma of the previous chunk has retired: its fp16 A buffer can be refilled
                a16_pipe.consumer_release(prev_state)
            if t == (3 if self.a16_input else 1):
                # The stage, once every value loaded from it has been used: the conversions of quarter t - 1 (both
                # rows' words at t = 0, W4A16's second scale words at t = 2) issued before that quarter's wgmma,
                # which precedes this wait, and ptxas keeps an arrival after a wgmma wait (SASS: the release
                # follows the conversions' HMUL2s). Released right after the loads, or after the conversion in
                # source order (ptxas hoisted that arrival above the HMUL2s: it reads no loaded register), the
                # arrival can overtake the loads and the stage be refilled under them: sm90_tile128 in the runner's
                # leaderboard mode, one column of a tile wrong (docs/HOPPER_NOTES.md, r43c).
                release_read_stage(stage_pipe, state)
            frag_u32 = cute.recast_tensor(frags[t % 2], cutlass.Uint32)
            if cutlass.const_expr(self.a16_input):
                # word t: k-blocks 2 t, 2 t + 1 (bytes 0-1 or 2-3 of scale word t // 2), "split" over its registers
                sc = [(scale_pair_to_f16x2(b_scale_words[r][t // 2] >> (16 * (t % 2)), bf16), "split") for r in range(2)]
            else:
                sc = [(b_pairs[r], t // 2) for r in range(2)]
            o0 = fp4x8_to_f16x2x4(b_words[0][t], *sc[0], bf16)
            o1 = fp4x8_to_f16x2x4(b_words[1][t], *sc[1], bf16)
            for i in cutlass.range_constexpr(4):
                step = i // 2
                slot = i % 2
                frag_u32[4 * step + 2 * slot] = o0[i]
                frag_u32[4 * step + 2 * slot + 1] = o1[i]
            warpgroup.fence()
            for step in cutlass.range_constexpr(2):
                cute.gemm(tiled_mma, acc, frags[t % 2][(None, None, step)],
                          tCrB[(None, None, 2 * t + step, a16_state.index)], acc)
            warpgroup.commit_group()


# ---------------------------------------------------------------------------------------------------------
# The backend: what the shared host path asks of the Hopper kernels
# ---------------------------------------------------------------------------------------------------------
def sm90_gemm_args(raw_args: tuple) -> tuple:
    """The DSL arguments of the Hopper GEMM: the three tables, its work list (address; 0 unless m_exact),
    tile count and grid size."""
    return kernel_args(raw_args, num_tables=4)


# An H100 SXM / H200: only what choose_sm90_config weighs when compile_for has no sizes; nothing is baked in.
SM90_COMPILE_SMS = 132


class Sm90Backend(KernelBackend):
    """Hopper (sm_90a): `Sm90BlockScaledGroupedGemmKernel`, M-exact tiles planned per problem by default."""

    arch_prefix = "sm_90"
    config_types = (Sm90GemmConfig,)
    variant_configs = SM90_VARIANT_CONFIGS

    def config(self, sizes, num_sms: int) -> Sm90GemmConfig:
        forced = SM90_VARIANT_CONFIGS.get(SM90_VARIANT)
        return with_sm90_overrides(forced or self.weight_shape_choice(sizes, num_sms, choose_sm90_config))

    def compile_config(self, variant: Optional[str]) -> Sm90GemmConfig:
        if variant is not None:
            _check_choice("Hopper variant", variant, tuple(SM90_VARIANT_CONFIGS))
        return with_sm90_overrides(SM90_VARIANT_CONFIGS[variant] if variant is not None
                                   else choose_sm90_config((), SM90_COMPILE_SMS))

    def key_config(self, config: Sm90GemmConfig) -> Sm90GemmConfig:
        return dataclasses.replace(config, split_k=True)  # the plan's choice: the same kernel runs both

    def parts(self, config: Sm90GemmConfig) -> tuple:
        """The GEMM, the descriptor preparation (once per input set) and, where A is converted by a launch
        of its own, that prepass (every call, before the GEMM)."""
        separate_convert = config.a16_prepass and not config.a16_fused
        return ("gemm", "tensormaps", "convert") if separate_convert else ("gemm", "tensormaps")

    def compile(self, part: str, config: Sm90GemmConfig, num_groups: int, options: dict):
        kernel = Sm90BlockScaledGroupedGemmKernel(num_groups, config)
        if part == "tensormaps":
            return cute.compile(GroupTensormapKernel(kernel), *kernel_args((0, 0, 0)), num_groups, **options)
        if part == "convert":
            return cute.compile(Sm90AConvertKernel(num_groups), *kernel_args((0, 0, 0, 1)), **options)
        return cute.compile(kernel, *sm90_gemm_args((0, 0, 0, 0, 1, 1)), **options)

    def schedule(self, config: Sm90GemmConfig, problem_sizes, device, num_sms: int) -> GemmSchedule:
        if config.m_exact:
            sizes = tuple(map(tuple, problem_sizes))
            plan = plan_sm90_work(sizes, num_sms, config.widths, config.split_k)
            num_tiles, num_ctas = plan.num_tiles, plan.num_ctas
            work_words = sm90_work_words(sizes, num_sms, config.widths, config.split_k)
        else:
            num_tiles, work_words = num_output_tiles(problem_sizes, config.tile_mn), None
            plan, num_ctas = None, min(num_tiles, num_sms)
        prepass = ()
        if "convert" in self.parts(config):
            items = max(m * (k // 128) * 4 for m, _, k, _ in problem_sizes)
            prepass = (ceil_div(items, Sm90AConvertKernel.threads),)
        # the GEMM's work-list address: the host path's, after the tables, for a work list; else 0 (unread)
        counts = (num_tiles, num_ctas) if work_words is not None else (0, num_tiles, num_ctas)
        return GemmSchedule(num_tiles, num_ctas,
                            Sm90BlockScaledGroupedGemmKernel.workspace_bytes(config, problem_sizes, plan),
                            counts, prepass_counts=prepass, work_words=work_words)

    def call_launcher(self, num_groups: int, arch: str, config: Sm90GemmConfig, kernel, metadata):
        gemm = make_launcher(kernel, metadata.launch_args, sm90_gemm_args)
        if "convert" not in self.parts(config):
            return gemm
        convert = make_launcher(compiled_kernel(compile_key(num_groups, arch, config, "convert")),
                                metadata.prepass_args)

        def launch():
            convert()
            return gemm()

        return launch


BACKEND = register_backend(Sm90Backend())
