#!POPCORN leaderboard nvfp4_group_gemm
#!POPCORN gpu B200
"""NVFP4 block-scaled grouped GEMM for the GPU MODE `nvfp4_group_gemm` task, in CuTe DSL.

What it computes, for every group g of G:

    C_g[m, n] = sum_k (A_g[m, k] * SFA_g[m, k // 16]) * (B_g[n, k] * SFB_g[n, k // 16])

with A_g [m, k] and B_g [n, k] in e2m1 (fp4, two per byte, K contiguous), one e4m3 scale per 16
consecutive k-elements, fp32 accumulation and fp16 output written into the caller's C_g.
Both kernels read the scales in the blocked tcgen05 layout (the `sfasfb_reordered_tensors`): the task's
generator keeps the plain scales on the CPU, and one 128-row x 256-k tile's blocked scales are 2 KB of
contiguous bytes (its padding rows exist, so no load runs out of bounds).

Constraints (stated once, in `can_implement`): L == 1; any M >= 1; N a multiple of 128; K a multiple of
256; the task generator's dense layouts; every tensor the kernel reads on one CUDA device, 16-byte aligned.

Blackwell (sm_100a), `Sm100BlockScaledGroupedGemmKernel`: one CTA per 128x128 output tile of any group.
Warp 0 rewrites this CTA's four TMA descriptors (A, B, SFA, SFB) for its group, then loads 128x256
K-slices by TMA and issues tcgen05 block-scaled MMAs into tensor memory; all four warps then move the
accumulator from tensor memory to registers and store fp16 to global memory. Built here, never run: no
B200 was available to this project.

Hopper (sm_90a), `Sm90BlockScaledGroupedGemmKernel`: no fp4 tensor cores, so both operands are dequantized
exactly to fp16 in the kernel (every e2m1 x e4m3 product is exact in fp16) and multiplied by fp16 wgmma
with fp32 accumulation; one persistent launch for all groups (`GroupTileScheduler`), TMA loads of the
packed fp4 bytes, bulk copies of the blocked scales, TMA-store epilogue. Checked on an H200.

How to use it:
    custom_kernel(data)      GPU MODE entry point; data = (abc, sfasfb, sfasfb_reordered, problem_sizes)
    can_implement(data)      (ok, reason) on CPU or GPU tensors, no GPU needed
    compile_for(num_groups, arch=None, variant=None)
                             build only; to build without a GPU set CUTE_DSL_ARCH=sm_100a (or sm_90a) and ask
                             the DSL to keep the cubin (4.3.x: CUTE_DSL_KEEP_CUBIN=1, 4.8.x: CUTE_DSL_KEEP=cubin)
                             in CUTE_DSL_DUMP_DIR. DSL 4.3.x then raises DSLRuntimeError (no CUDA driver) after
                             writing the cubin; 4.8.x returns.
Builds with nvidia-cutlass-dsl 4.3.5 and 4.8.1.
"""
import dataclasses
import enum
import functools
import importlib.metadata
import os
from collections import OrderedDict
from typing import Callable, Optional

import torch

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_utils
import cutlass.utils.blockscaled_layout as blockscaled_utils
import cutlass.utils.hopper_helpers as sm90_utils
import cutlass._mlir.dialects.cute as _cute_ir
import cutlass._mlir.dialects.cute_nvgpu as _cute_nvgpu_ir
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op
from cutlass.cute.nvgpu import cpasync, tcgen05, warpgroup
from cutlass.cute.runtime import make_ptr

from task import input_t, output_t

# ---------------------------------------------------------------------------------------------------------
# DSL version shims: every difference between nvidia-cutlass-dsl 4.3.x and 4.8.x that this file meets.
# ---------------------------------------------------------------------------------------------------------
try:  # 4.8: allocators moved to cutlass.memory (cutlass.utils keeps deprecated aliases)
    from cutlass.memory import SmemAllocator, TmemAllocator
except ImportError:  # 4.3
    from cutlass.utils import SmemAllocator, TmemAllocator
try:  # 4.8: tensormap helpers moved to cutlass.tensor_utils
    from cutlass.tensor_utils import TensorMapManager, TensorMapUpdateMode
except ImportError:  # 4.3
    from cutlass.utils import TensorMapManager, TensorMapUpdateMode

DSL_VERSION = importlib.metadata.version("nvidia-cutlass-dsl")
_OperandMajorMode = getattr(cute.nvgpu, "OperandMajorMode", None) or warpgroup.OperandMajorMode  # 4.8 / 4.3


# ---------------------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Sm100GemmConfig:
    """Compile-time configuration of `Sm100BlockScaledGroupedGemmKernel` (everything baked in but G)."""

    # One CTA-group tcgen05 MMA covers 128 rows; K = 256 is four 64-deep NVFP4 MMA instructions, which is
    # one 128-byte swizzle row of fp4 per operand row.
    mma_tiler_mnk: tuple = (128, 128, 256)
    mma_inst_k: int = 64
    # NOTES: warp 0 both loads and multiplies, waiting on each load before its MMAs, so more stages would
    # buy nothing until loading and MMA get their own warps.
    num_ab_stages: int = 1
    # One output tile per CTA, so one accumulator.
    num_acc_stages: int = 1
    # Four warps: one thread per accumulator row (tensor-memory lane) in the epilogue.
    threads_per_cta: int = 128
    # NOTES: the accumulator (128 fp32 columns) and both scale tensors would fit in 256 columns; the seed's
    # 512 (all of an SM's tensor memory) is kept in this reorganisation, so co-resident CTAs take turns.
    num_tmem_cols: int = 512
    sf_vec_size: int = 16
    ab_dtype: type = cutlass.Float4E2M1FN
    sf_dtype: type = cutlass.Float8E4M3FN
    c_dtype: type = cutlass.Float16
    acc_dtype: type = cutlass.Float32

    def __post_init__(self):
        # The kernel is written and checked for exactly these values; anything else needs new work.
        supported = dict(mma_tiler_mnk=(128, 128, 256), mma_inst_k=64, num_ab_stages=1, num_acc_stages=1,
                         threads_per_cta=128, sf_vec_size=16)
        for name, value in supported.items():
            if getattr(self, name) != value:
                raise ValueError(f"Sm100GemmConfig.{name}={getattr(self, name)!r}: only {value!r} is supported")

    @property
    def tile_mn(self) -> tuple:
        return self.mma_tiler_mnk[:2]


SM100_CONFIG = Sm100GemmConfig()


@dataclasses.dataclass(frozen=True)
class Sm90GemmConfig:
    """Compile-time configuration of `Sm90BlockScaledGroupedGemmKernel` (everything baked in but G).

    blocks_per_wg: 64-row blocks of B per consumer warpgroup. 1 -> tile 128 (M) x 128 (N); 2 -> 128 x 256,
    each fp16 A buffer then feeds twice the MMA work (about 1.47x the time of a 128 x 128 tile for 2x the
    work on the H200), but there are half as many tiles to spread over the SMs.
    num_stages: depth of the fp4 + scale ring (0: the most that fits, 4 for 128 x 128, 3 for 128 x 256).
    """

    blocks_per_wg: int = 1
    num_stages: int = 0

    def __post_init__(self):
        if self.blocks_per_wg not in (1, 2):
            raise ValueError(f"Sm90GemmConfig.blocks_per_wg={self.blocks_per_wg}: only 1 or 2 is supported")

    @property
    def tile_mn(self) -> tuple:
        return (128, 128 * self.blocks_per_wg)


# The kernels custom_kernel can pick from, per arch family, by name; the first of each is the default.
KERNEL_VARIANTS = {
    "sm_10": {"tile128": SM100_CONFIG},
    "sm_90": {"tile128": Sm90GemmConfig(blocks_per_wg=1), "tile256": Sm90GemmConfig(blocks_per_wg=2)},
}
# Relative time of one 128 x 256 Hopper tile against one 128 x 128 tile (H200, sm90_dev/NOTES.md v3).
SM90_TILE256_COST = 1.47

# TMA needs 16-byte aligned global addresses; the kernel assumes it of every operand and of C.
GMEM_ALIGN_BYTES = 16
# A TMA descriptor is 128 bytes on a 128-byte boundary; DSL 4.8 wants that proven by the pointer types.
TENSORMAP_BYTES = 128
# The pointer and size tables are read as int64 / int32 rows; 16 bytes is what torch always gives.
METADATA_ALIGN_BYTES = 16
# K a multiple of the tile's K, as the task guarantees: only whole K tiles were built and reasoned about.
K_MULTIPLE = 256

TORCH_AB_DTYPE = torch.float4_e2m1fn_x2
TORCH_SF_DTYPE = torch.float8_e4m3fn
TORCH_C_DTYPE = torch.float16


class UnsupportedDeviceError(RuntimeError):
    """The GPU has no kernel here (kernels exist for B200, compute capability 10.0, and Hopper, 9.0)."""


# ---------------------------------------------------------------------------------------------------------
# Host path shared by every kernel: the per-group metadata tables, the launch-metadata cache and its key
# ---------------------------------------------------------------------------------------------------------
class PtrColumn(enum.IntEnum):
    """Columns of the int64 pointer table [G, 5]."""

    A = 0
    B = 1
    C = 2
    SFA = 3  # blocked (reordered) scales of A
    SFB = 4  # blocked (reordered) scales of B


class SizeColumn(enum.IntEnum):
    """Columns of the int32 size table [G, 4]."""

    M = 0
    N = 1
    K = 2
    L = 3


def ceil_div(a: int, b: int) -> int:
    return (a + b - 1) // b


def num_output_tiles(sizes, tile_mn: tuple) -> int:
    return sum(ceil_div(m, tile_mn[0]) * ceil_div(n, tile_mn[1]) for m, n, _, _ in sizes)


def pack_group_metadata(data, device: torch.device) -> tuple:
    """The two tables every kernel reads, on `device`: pointers int64 [G, PtrColumn], sizes int32 [G, SizeColumn]."""
    abc, _, sfasfb_r, sizes = data
    rows = [(a.data_ptr(), b.data_ptr(), c.data_ptr(), sfa_r.data_ptr(), sfb_r.data_ptr())
            for (a, b, c), (sfa_r, sfb_r) in zip(abc, sfasfb_r)]
    ptr_table = torch.tensor(rows, dtype=torch.int64).to(device)
    size_table = torch.tensor([tuple(s) for s in sizes], dtype=torch.int32).to(device)
    return ptr_table, size_table


def aligned_device_buffer(num_bytes: int, align: int, device: torch.device) -> torch.Tensor:
    """Uninitialised int64 buffer of `num_bytes` whose first byte is `align`-aligned, whatever the allocator."""
    raw = torch.empty((num_bytes + align) // 8, dtype=torch.int64, device=device)
    skip = (-raw.data_ptr() % align) // 8
    return raw[skip: skip + num_bytes // 8]


def gmem_ptr(dtype, address: int, align: int):
    """A CuTe global-memory pointer argument; the alignment is part of the compiled kernel's signature."""
    return make_ptr(dtype, address, cute.AddressSpace.gmem, assumed_align=align)


def launch_metadata_key(data, tile_mn: tuple = SM100_CONFIG.tile_mn) -> tuple:
    """Everything the launch metadata (pointer/size tables, descriptor workspace) is built from.

    Device, every pointer the kernel reads or writes, every problem size, and the tile shape that sets the
    number of CTAs. Strides are not in it: `can_implement` pins them to a function of the sizes.
    Pure function of tensor metadata; works on CPU tensors.
    """
    abc, _, sfasfb_r, sizes = data
    groups = tuple(
        (a.data_ptr(), b.data_ptr(), c.data_ptr(), sfa_r.data_ptr(), sfb_r.data_ptr(), *size)
        for (a, b, c), (sfa_r, sfb_r), size in zip(abc, sfasfb_r, sizes)
    )
    return (abc[0][0].device, tuple(tile_mn), groups)


@dataclasses.dataclass(frozen=True)
class LaunchMetadata:
    """Device data of one launch, kept alive as long as its cache entry."""

    ptr_table: torch.Tensor  # int64 [G, PtrColumn]
    size_table: torch.Tensor  # int32 [G, SizeColumn]
    workspace: torch.Tensor  # TMA descriptors (Sm100: 4 per CTA of the grid; Sm90: 4 per persistent CTA)
    num_tiles: int
    launch_args: tuple  # what the compiled kernel is called with
    kernel_key: tuple  # compile_key of the kernel these arguments are for


# Bounded: the benchmark cycles through 15 input sets per shape; 64 covers that with room, and entries
# of freed tensors fall out instead of piling up.
LAUNCH_METADATA_CACHE_SIZE = 64
_launch_metadata: "OrderedDict[tuple, LaunchMetadata]" = OrderedDict()


def cached_launch_metadata(key: tuple, build: Callable[[], LaunchMetadata]) -> LaunchMetadata:
    """The entry for `key`, built on a miss; least recently used entries are dropped past the bound."""
    entry = _launch_metadata.get(key)
    if entry is None:
        entry = _launch_metadata[key] = build()
        if len(_launch_metadata) > LAUNCH_METADATA_CACHE_SIZE:
            _launch_metadata.popitem(last=False)
    else:
        _launch_metadata.move_to_end(key)
    return entry


# ---------------------------------------------------------------------------------------------------------
# Device helpers shared by every kernel
# ---------------------------------------------------------------------------------------------------------
@cute.jit
def group_tile_coord(
    problem_sizes: cute.Tensor,
    tile_idx: cutlass.Int32,
    tile_m: cutlass.Constexpr[int],
    tile_n: cutlass.Constexpr[int],
    num_groups: cutlass.Constexpr[int],
):
    """Output tile `tile_idx` of all groups' tile grids laid end to end -> (group, tile row, tile column).

    Tiles are numbered group by group, M fastest within a group. The launch grid holds exactly the total
    tile count, so the last group takes whatever is left and needs no test.
    """
    group_idx = cutlass.Int32(0)
    tile_in_group = tile_idx
    for g in cutlass.range_constexpr(num_groups - 1):
        tiles_g = (cute.ceil_div(problem_sizes[g, int(SizeColumn.M)], tile_m)
                   * cute.ceil_div(problem_sizes[g, int(SizeColumn.N)], tile_n))
        if group_idx == g:
            if tile_in_group >= tiles_g:
                group_idx = group_idx + 1
                tile_in_group = tile_in_group - tiles_g
    tiles_m = cute.ceil_div(problem_sizes[group_idx, int(SizeColumn.M)], tile_m)
    return group_idx, tile_in_group % tiles_m, tile_in_group // tiles_m


def make_operand_tensors(a_addr, b_addr, sfa_addr, sfb_addr, m, n, k, ab_dtype, sf_dtype, sf_vec_size: int):
    """Global tensors A (m, k, l), B (n, k, l) (K contiguous) and their blocked scale tensors.

    The host builds them on placeholder addresses and sizes to make the TMA atoms, the kernel on each
    group's real ones to rewrite the descriptors: one statement of the layouts for both.
    """
    a_ptr, b_ptr, sfa_ptr, sfb_ptr = (
        cute.make_ptr(dtype, addr, cute.AddressSpace.gmem, assumed_align=GMEM_ALIGN_BYTES)
        for dtype, addr in ((ab_dtype, a_addr), (ab_dtype, b_addr), (sf_dtype, sfa_addr), (sf_dtype, sfb_addr))
    )
    # (M, K, L) and (N, K, L), K contiguous, rows 16-byte aligned since K % 256 == 0
    a_layout = cute.make_layout((m, k, 1), stride=(cute.assume(k, 32), 1, cute.assume(m * k, 32)))
    b_layout = cute.make_layout((n, k, 1), stride=(cute.assume(k, 32), 1, cute.assume(n * k, 32)))
    # ((Atom_M, Rest_M), (Atom_K, Rest_K), L): the cuBLAS/tcgen05 blocked scale layout
    sfa_layout = blockscaled_utils.tile_atom_to_shape_SF(a_layout.shape, sf_vec_size)
    sfb_layout = blockscaled_utils.tile_atom_to_shape_SF(b_layout.shape, sf_vec_size)
    return (
        cute.make_tensor(a_ptr, a_layout),
        cute.make_tensor(b_ptr, b_layout),
        cute.make_tensor(sfa_ptr, sfa_layout),
        cute.make_tensor(sfb_ptr, sfb_layout),
    )


class GroupTileScheduler:
    """Static persistent schedule over the tiles of all groups.

    Tiles are numbered group by group; inside a group the m-tile index runs fastest (CTAs working at the
    same time share B, the large operand, through L2). CTA b takes tiles b, b + grid, b + 2 grid, ...
    Every role of a CTA walks the same sequence independently.
    """

    def __init__(self, num_groups: int, tile_m: int, tile_n: int):
        self.num_groups = num_groups
        self.tile_m = tile_m
        self.tile_n = tile_n

    @cute.jit
    def decode(self, sizes: cute.Tensor, tile_idx: cutlass.Int32):
        """tile_idx -> (group, m-tile, n-tile, M, N, K); sizes is the [G, 4] (m, n, k, l) table."""
        g = cutlass.Int32(0)
        m_tile = cutlass.Int32(0)
        n_tile = cutlass.Int32(0)
        m_size = cutlass.Int32(0)
        n_size = cutlass.Int32(0)
        k_size = cutlass.Int32(0)
        base = cutlass.Int32(0)
        for gi in cutlass.range_constexpr(self.num_groups):
            mi = sizes[gi, 0]
            ni = sizes[gi, 1]
            ki = sizes[gi, 2]
            tiles_m = (mi + (self.tile_m - 1)) // self.tile_m
            count = tiles_m * (ni // self.tile_n)
            if tile_idx >= base and tile_idx < base + count:
                local = tile_idx - base
                g = cutlass.Int32(gi)
                m_tile = local % tiles_m
                n_tile = local // tiles_m
                m_size = mi
                n_size = ni
                k_size = ki
            base = base + count
        return g, m_tile, n_tile, m_size, n_size, k_size

    def num_tiles(self, problem_sizes) -> int:
        return sum(((m + self.tile_m - 1) // self.tile_m) * (n // self.tile_n) for m, n, _, _ in problem_sizes)


@cute.jit
def update_tensormap(tma_atom: cute.CopyAtom, tensor: cute.Tensor, desc_addr: cutlass.Int64):
    """Rewrites address/shape/stride of the descriptor at desc_addr (global) for `tensor` and makes it
    visible to the TMA unit. Executed by a whole warp."""
    ptr = tensormap_ptr(desc_addr)
    cpasync.update_tma_descriptor(tma_atom, tensor, ptr)
    cute.arch.sync_warp()
    cpasync.fence_tma_desc_release()
    cpasync.fence_tma_desc_acquire(ptr)


# ---------------------------------------------------------------------------------------------------------
# Blackwell (sm_100a) kernel
# ---------------------------------------------------------------------------------------------------------
class NamedBarrierId(enum.IntEnum):
    # 0 is the CTA-wide barrier (cute.arch.barrier)
    TMEM_ALLOC = 1


class TensorMapSlot(enum.IntEnum):
    """A CTA's TMA descriptors, in workspace and shared-memory order."""

    A = 0
    B = 1
    SFA = 2
    SFB = 3


class Sm100BlockScaledGroupedGemmKernel:
    """NVFP4 grouped GEMM on tcgen05: C_g = (A_g * SFA_g) @ (B_g * SFB_g)^T, one CTA per 128x128 tile.

    Grid: (total output tiles over all groups, 1, 1); CTA t finds its group and tile with
    `group_tile_coord` from the int32 size table. 128 threads:

    * warp 0 writes the CTA's four TMA descriptors (A, B, SFA, SFB) for its group: copies the host-made
      templates into shared memory, patches base address and sizes, releases them to this CTA's slot
      of the global workspace, then, per 256-deep K tile: TMA loads A, B, SFA, SFB (ab pipeline,
      producer: TMA transaction bytes, consumer: warp 0), copies the scales to tensor memory, issues
      four 128x128x64 block-scaled MMAs into the tensor-memory accumulator, and releases the stage.
      After the last K tile it commits the accumulator (acc pipeline, producer: warp 0's MMA commit).
    * warps 0-3 (epilogue, acc pipeline consumer, 128 arrivals): thread i loads accumulator row i
      (tensor-memory lane i) to registers, converts to fp16 and stores the valid columns of that row.

    Shared memory: 4 descriptors (512 B), barriers, the tensor-memory address, one stage of A and B
    (16 KiB each, 128-byte swizzle, 1024-byte aligned) and of SFA and SFB (2 KiB each).
    """

    num_tensormaps = len(TensorMapSlot)

    def __init__(self, config: Sm100GemmConfig):
        self.config = config
        self.tile_m, self.tile_n, self.tile_k = config.mma_tiler_mnk

    @staticmethod
    def tensormap_workspace_bytes(num_tiles: int) -> int:
        return num_tiles * Sm100BlockScaledGroupedGemmKernel.num_tensormaps * TENSORMAP_BYTES

    # -----------------------------------------------------------------------------------------------------
    # Host side: MMA, shared-memory layouts, TMA atoms on placeholder tensors, launch
    # -----------------------------------------------------------------------------------------------------
    @cute.jit
    def __call__(
        self,
        ptr_table_ptr: cute.Pointer,
        size_table_ptr: cute.Pointer,
        tensormap_workspace_ptr: cute.Pointer,
        num_tiles: cutlass.Int32,
        num_groups: cutlass.Constexpr[int],
    ):
        cfg = self.config
        ptr_table = cute.make_tensor(ptr_table_ptr, cute.make_layout((num_groups, len(PtrColumn)),
                                                                     stride=(len(PtrColumn), 1)))
        size_table = cute.make_tensor(size_table_ptr, cute.make_layout((num_groups, len(SizeColumn)),
                                                                       stride=(len(SizeColumn), 1)))
        # (tile, descriptor, 16 x int64): 512 bytes per CTA
        words = TENSORMAP_BYTES // 8
        tensormaps = cute.make_tensor(
            tensormap_workspace_ptr,
            cute.make_layout((num_tiles, self.num_tensormaps, words), stride=(self.num_tensormaps * words, words, 1)),
        )

        tiled_mma = cute.make_tiled_mma(
            tcgen05.MmaMXF4NVF4Op(cfg.sf_dtype, (self.tile_m, self.tile_n, cfg.mma_inst_k),
                                  tcgen05.CtaGroup.ONE, tcgen05.OperandSource.SMEM)
        )
        a_smem_layout_staged = sm100_utils.make_smem_layout_a(tiled_mma, cfg.mma_tiler_mnk, cfg.ab_dtype,
                                                              cfg.num_ab_stages)
        b_smem_layout_staged = sm100_utils.make_smem_layout_b(tiled_mma, cfg.mma_tiler_mnk, cfg.ab_dtype,
                                                              cfg.num_ab_stages)
        sfa_smem_layout_staged = blockscaled_utils.make_smem_layout_sfa(tiled_mma, cfg.mma_tiler_mnk,
                                                                        cfg.sf_vec_size, cfg.num_ab_stages)
        sfb_smem_layout_staged = blockscaled_utils.make_smem_layout_sfb(tiled_mma, cfg.mma_tiler_mnk,
                                                                        cfg.sf_vec_size, cfg.num_ab_stages)

        # The TMA atoms are made once on placeholder tensors; each CTA rewrites address and sizes in its
        # own copy of the descriptors. The placeholder sizes are runtime values on purpose: static ones
        # would make the TMA coordinate tensors, which the kernel tiles for every group, static 64x64 ones
        # (the built kernel changes); runtime sizes keep their extents open.
        placeholder = cutlass.Int32(64)
        a0, b0, sfa0, sfb0 = make_operand_tensors(
            0, 0, 0, 0, placeholder, placeholder, placeholder, cfg.ab_dtype, cfg.sf_dtype, cfg.sf_vec_size)
        cluster_layout_vmnk = cute.tiled_divide(cute.make_layout((1, 1, 1)), (tiled_mma.thr_id.shape,))
        load_op = cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.ONE)
        a_smem_layout = cute.slice_(a_smem_layout_staged, (None, None, None, 0))
        b_smem_layout = cute.slice_(b_smem_layout_staged, (None, None, None, 0))
        sfa_smem_layout = cute.slice_(sfa_smem_layout_staged, (None, None, None, 0))
        sfb_smem_layout = cute.slice_(sfb_smem_layout_staged, (None, None, None, 0))
        tma_atom_a, mA_mkl = cute.nvgpu.make_tiled_tma_atom_A(
            load_op, a0, a_smem_layout, cfg.mma_tiler_mnk, tiled_mma, cluster_layout_vmnk.shape)
        tma_atom_b, mB_nkl = cute.nvgpu.make_tiled_tma_atom_B(
            load_op, b0, b_smem_layout, cfg.mma_tiler_mnk, tiled_mma, cluster_layout_vmnk.shape)
        # Scales go through TMA as 16-bit elements, as in CUTLASS's block-scaled examples and the seed.
        tma_atom_sfa, mSFA_mkl = cute.nvgpu.make_tiled_tma_atom_A(
            load_op, sfa0, sfa_smem_layout, cfg.mma_tiler_mnk, tiled_mma, cluster_layout_vmnk.shape,
            internal_type=cutlass.Int16)
        tma_atom_sfb, mSFB_nkl = cute.nvgpu.make_tiled_tma_atom_B(
            load_op, sfb0, sfb_smem_layout, cfg.mma_tiler_mnk, tiled_mma, cluster_layout_vmnk.shape,
            internal_type=cutlass.Int16)
        num_tma_load_bytes = (
            cute.size_in_bytes(cfg.ab_dtype, a_smem_layout) + cute.size_in_bytes(cfg.ab_dtype, b_smem_layout)
            + cute.size_in_bytes(cfg.sf_dtype, sfa_smem_layout) + cute.size_in_bytes(cfg.sf_dtype, sfb_smem_layout)
        ) * cute.size(tiled_mma.thr_id.shape)

        # No smem argument: the DSL sizes dynamic shared memory from the kernel's allocations.
        self.kernel(
            tiled_mma,
            tma_atom_a, mA_mkl, tma_atom_b, mB_nkl,
            tma_atom_sfa, mSFA_mkl, tma_atom_sfb, mSFB_nkl,
            ptr_table, size_table, tensormaps,
            a_smem_layout_staged, b_smem_layout_staged, sfa_smem_layout_staged, sfb_smem_layout_staged,
            num_tma_load_bytes, num_groups,
        ).launch(grid=(num_tiles, 1, 1), block=(cfg.threads_per_cta, 1, 1), cluster=(1, 1, 1))

    # -----------------------------------------------------------------------------------------------------
    # Device side
    # -----------------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        tiled_mma: cute.TiledMma,
        tma_atom_a: cute.CopyAtom,
        mA_mkl: cute.Tensor,
        tma_atom_b: cute.CopyAtom,
        mB_nkl: cute.Tensor,
        tma_atom_sfa: cute.CopyAtom,
        mSFA_mkl: cute.Tensor,
        tma_atom_sfb: cute.CopyAtom,
        mSFB_nkl: cute.Tensor,
        ptr_table: cute.Tensor,
        size_table: cute.Tensor,
        tensormaps: cute.Tensor,
        a_smem_layout_staged: cute.ComposedLayout,
        b_smem_layout_staged: cute.ComposedLayout,
        sfa_smem_layout_staged: cute.Layout,
        sfb_smem_layout_staged: cute.Layout,
        num_tma_load_bytes: cutlass.Constexpr[int],
        num_groups: cutlass.Constexpr[int],
    ):
        cfg = self.config
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        tile_idx, _, _ = cute.arch.block_idx()
        group_idx, tile_coord_m, tile_coord_n = group_tile_coord(
            size_table, tile_idx, self.tile_m, self.tile_n, num_groups)
        m = size_table[group_idx, int(SizeColumn.M)]
        n = size_table[group_idx, int(SizeColumn.N)]
        k = size_table[group_idx, int(SizeColumn.K)]

        # ---- shared memory -----------------------------------------------------------------------------
        @cute.struct
        class SharedStorage:
            tensormap_buffer: cute.struct.Align[
                cute.struct.MemRange[cutlass.Int64, self.num_tensormaps * TENSORMAP_BYTES // 8], TENSORMAP_BYTES
            ]
            ab_mbar: cute.struct.MemRange[cutlass.Int64, cfg.num_ab_stages * 2]
            acc_mbar: cute.struct.MemRange[cutlass.Int64, cfg.num_acc_stages * 2]
            tmem_holding_buf: cutlass.Int32

        smem = SmemAllocator()
        storage = smem.allocate(SharedStorage)
        # Swizzled operand buffers on 1024 bytes, the 128-byte swizzle pattern's period.
        # (MMA, MMA_M, MMA_K, STAGE)
        sA = smem.allocate_tensor(element_type=cfg.ab_dtype, layout=a_smem_layout_staged.outer,
                                  byte_alignment=1024, swizzle=a_smem_layout_staged.inner)
        # (MMA, MMA_N, MMA_K, STAGE)
        sB = smem.allocate_tensor(element_type=cfg.ab_dtype, layout=b_smem_layout_staged.outer,
                                  byte_alignment=1024, swizzle=b_smem_layout_staged.inner)
        # (MMA, MMA_M, MMA_K, STAGE)
        sSFA = smem.allocate_tensor(element_type=cfg.sf_dtype, layout=sfa_smem_layout_staged, byte_alignment=128)
        # (MMA, MMA_N, MMA_K, STAGE)
        sSFB = smem.allocate_tensor(element_type=cfg.sf_dtype, layout=sfb_smem_layout_staged, byte_alignment=128)

        ab_producer, ab_consumer = pipeline.PipelineTmaUmma.create(
            barrier_storage=storage.ab_mbar.data_ptr(),
            num_stages=cfg.num_ab_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            tx_count=num_tma_load_bytes,
        ).make_participants()
        acc_producer, acc_consumer = pipeline.PipelineUmmaAsync.create(
            barrier_storage=storage.acc_mbar.data_ptr(),
            num_stages=cfg.num_acc_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, cfg.threads_per_cta),
        ).make_participants()

        # ---- this CTA's TMA descriptors ----------------------------------------------------------------
        tensormap_manager = TensorMapManager(TensorMapUpdateMode.SMEM, TENSORMAP_BYTES)
        tensormap_gmem_ptrs = tuple(
            tensormap_manager.get_tensormap_ptr(tensormaps[(tile_idx, int(slot), None)].iterator)
            for slot in TensorMapSlot
        )
        # The struct member's pointer type only carries 8-byte alignment; the descriptor ops need the
        # 128 bytes that the Align above guarantees, so the pointer is remade with it.
        tensormap_smem_base = cute.make_ptr(cutlass.Int64, storage.tensormap_buffer.data_ptr().toint(),
                                            cute.AddressSpace.smem, assumed_align=TENSORMAP_BYTES)
        tensormap_smem_ptrs = tuple(tensormap_smem_base + int(slot) * (TENSORMAP_BYTES // 8)
                                    for slot in TensorMapSlot)
        mA_group, mB_group, mSFA_group, mSFB_group = make_operand_tensors(
            ptr_table[group_idx, int(PtrColumn.A)], ptr_table[group_idx, int(PtrColumn.B)],
            ptr_table[group_idx, int(PtrColumn.SFA)], ptr_table[group_idx, int(PtrColumn.SFB)],
            m, n, k, cfg.ab_dtype, cfg.sf_dtype, cfg.sf_vec_size,
        )
        tma_atoms = (tma_atom_a, tma_atom_b, tma_atom_sfa, tma_atom_sfb)
        self._write_tensormaps(warp_idx, tensormap_manager, tma_atoms, (mA_group, mB_group, mSFA_group, mSFB_group),
                               tensormap_gmem_ptrs, tensormap_smem_ptrs)
        # The loads below read the descriptors warp 0 just released.
        cute.arch.barrier()

        # ---- global tiles and their TMA partitions ------------------------------------------------------
        tile_mnl = (tile_coord_m, tile_coord_n, 0)
        # (bM, bK, RestM, RestK, RestL)
        gA_mkl = cute.local_tile(mA_mkl, cute.slice_(cfg.mma_tiler_mnk, (None, 0, None)), (None, None, None))
        # (bN, bK, RestN, RestK, RestL)
        gB_nkl = cute.local_tile(mB_nkl, cute.slice_(cfg.mma_tiler_mnk, (0, None, None)), (None, None, None))
        # (bM, bK, RestM, RestK, RestL)
        gSFA_mkl = cute.local_tile(mSFA_mkl, cute.slice_(cfg.mma_tiler_mnk, (None, 0, None)), (None, None, None))
        # (bN, bK, RestN, RestK, RestL)
        gSFB_nkl = cute.local_tile(mSFB_nkl, cute.slice_(cfg.mma_tiler_mnk, (0, None, None)), (None, None, None))
        # A one-CTA MMA has a single MMA "thread": the whole CTA.
        thr_mma = tiled_mma.get_slice(0)
        # (MMA, MMA_M, MMA_K, RestM, RestK, RestL)
        tCgA = thr_mma.partition_A(gA_mkl)
        # (MMA, MMA_N, MMA_K, RestN, RestK, RestL)
        tCgB = thr_mma.partition_B(gB_nkl)
        # (MMA, MMA_M, MMA_K, RestM, RestK, RestL)
        tCgSFA = thr_mma.partition_A(gSFA_mkl)
        # (MMA, MMA_N, MMA_K, RestN, RestK, RestL)
        tCgSFB = thr_mma.partition_B(gSFB_nkl)

        # ((atom_v, rest_v), STAGE), ((atom_v, rest_v), RestM, RestK, RestL)
        tAsA, tAgA = self._tma_partition(tma_atom_a, sA, tCgA)
        # ((atom_v, rest_v), STAGE), ((atom_v, rest_v), RestN, RestK, RestL)
        tBsB, tBgB = self._tma_partition(tma_atom_b, sB, tCgB)
        # Scale tensors broadcast over the 16 k-elements of a block (stride 0): drop those modes.
        # ((atom_v, rest_v), STAGE), ((atom_v, rest_v), RestM, RestK, RestL)
        tAsSFA, tAgSFA = self._tma_partition(tma_atom_sfa, sSFA, tCgSFA)
        tAsSFA, tAgSFA = cute.filter_zeros(tAsSFA), cute.filter_zeros(tAgSFA)
        # ((atom_v, rest_v), STAGE), ((atom_v, rest_v), RestN, RestK, RestL)
        tBsSFB, tBgSFB = self._tma_partition(tma_atom_sfb, sSFB, tCgSFB)
        tBsSFB, tBgSFB = cute.filter_zeros(tBsSFB), cute.filter_zeros(tBgSFB)
        # ((atom_v, rest_v), RestK)
        tAgA = tAgA[(None, tile_mnl[0], None, tile_mnl[2])]
        tBgB = tBgB[(None, tile_mnl[1], None, tile_mnl[2])]
        tAgSFA = tAgSFA[(None, tile_mnl[0], None, tile_mnl[2])]
        tBgSFB = tBgSFB[(None, tile_mnl[1], None, tile_mnl[2])]

        # ---- tensor memory: accumulator, then SFA, then SFB columns -----------------------------------
        # (MMA, MMA_M, MMA_K, STAGE)
        tCrA = tiled_mma.make_fragment_A(sA)
        # (MMA, MMA_N, MMA_K, STAGE)
        tCrB = tiled_mma.make_fragment_B(sB)
        # (MMA, MMA_M, MMA_N)
        tCtAcc_layout = tiled_mma.make_fragment_C(tiled_mma.partition_shape_C(cfg.mma_tiler_mnk[:2])).layout
        tmem = TmemAllocator(
            storage.tmem_holding_buf,
            barrier_for_retrieve=pipeline.NamedBarrier(barrier_id=NamedBarrierId.TMEM_ALLOC,
                                                       num_threads=cfg.threads_per_cta),
        )
        tmem.allocate(cfg.num_tmem_cols)
        tmem.wait_for_alloc()
        acc_tmem_ptr = tmem.retrieve_ptr(cfg.acc_dtype)
        # (MMA, MMA_M, MMA_N)
        tCtAcc = cute.make_tensor(acc_tmem_ptr, tCtAcc_layout)
        sfa_tmem_ptr = cute.recast_ptr(acc_tmem_ptr + tcgen05.find_tmem_tensor_col_offset(tCtAcc),
                                       dtype=cfg.sf_dtype)
        # (MMA, MMA_M, MMA_K)
        tCtSFA = cute.make_tensor(sfa_tmem_ptr, blockscaled_utils.make_tmem_layout_sfa(
            tiled_mma, cfg.mma_tiler_mnk, cfg.sf_vec_size, cute.slice_(sfa_smem_layout_staged, (None, None, None, 0))))
        sfb_tmem_ptr = cute.recast_ptr(
            acc_tmem_ptr + tcgen05.find_tmem_tensor_col_offset(tCtAcc) + tcgen05.find_tmem_tensor_col_offset(tCtSFA),
            dtype=cfg.sf_dtype)
        # (MMA, MMA_N, MMA_K)
        tCtSFB = cute.make_tensor(sfb_tmem_ptr, blockscaled_utils.make_tmem_layout_sfb(
            tiled_mma, cfg.mma_tiler_mnk, cfg.sf_vec_size, cute.slice_(sfb_smem_layout_staged, (None, None, None, 0))))
        tiled_copy_s2t_sfa, tCsSFA_s2t, tCtSFA_s2t = self._s2t_copy_and_partition(sSFA, tCtSFA)
        tiled_copy_s2t_sfb, tCsSFB_s2t, tCtSFB_s2t = self._s2t_copy_and_partition(sSFB, tCtSFB)

        # ---- output tile, partitioned before the main loop changes tiled_mma's fields ---------------------
        # (M, N, L), N contiguous; any N, so no divisibility is claimed for the row stride
        mC_mnl = cute.make_tensor(
            cute.make_ptr(cfg.c_dtype, ptr_table[group_idx, int(PtrColumn.C)], cute.AddressSpace.gmem,
                          assumed_align=GMEM_ALIGN_BYTES),
            cute.make_layout((m, n, 1), stride=(n, 1, m * n)),
        )
        # (bM, bN)
        gC = cute.local_tile(mC_mnl, cute.slice_(cfg.mma_tiler_mnk, (None, None, 0)), tile_mnl)
        # (bM, bN) -> (m, n) within the tile, for the bounds test
        cC = cute.make_identity_tensor(cute.slice_(cfg.mma_tiler_mnk, (None, None, 0)))
        # (MMA, MMA_M, MMA_N)
        tCgC = thr_mma.partition_C(gC)
        # (MMA, MMA_M, MMA_N)
        tCcC = thr_mma.partition_C(cC)
        residue_mn = (m - tile_coord_m * self.tile_m, n - tile_coord_n * self.tile_n)

        # ---- warp 0: TMA loads and MMAs ----------------------------------------------------------------
        if warp_idx == 0:
            k_tile_cnt = cute.ceil_div(k, self.tile_k)
            self._mainloop(
                k_tile_cnt, tiled_mma, ab_producer, ab_consumer, acc_producer, tensormap_manager,
                tensormap_gmem_ptrs, tma_atoms, (tAgA, tBgB, tAgSFA, tBgSFB), (tAsA, tBsB, tAsSFA, tBsSFB),
                tiled_copy_s2t_sfa, tCsSFA_s2t, tCtSFA_s2t, tiled_copy_s2t_sfb, tCsSFB_s2t, tCtSFB_s2t,
                tCrA, tCrB, tCtAcc, tCtSFA, tCtSFB,
            )

        # ---- all warps: epilogue -------------------------------------------------------------------------
        tmem.relinquish_alloc_permit()
        self._epilogue(tidx, acc_consumer, tCtAcc, tCgC, tCcC, residue_mn)

        # Every thread has read its accumulator row before the columns are given back.
        cute.arch.barrier()
        tmem.free(acc_tmem_ptr)

    # -----------------------------------------------------------------------------------------------------
    # Warp 0, first: descriptors for this CTA's group
    # -----------------------------------------------------------------------------------------------------
    @cute.jit
    def _write_tensormaps(self, warp_idx, tensormap_manager, tma_atoms, group_tensors, gmem_ptrs, smem_ptrs):
        """Copy the host-made descriptors to shared memory, patch in the group's tensors, release to gmem."""
        if warp_idx == 0:
            for atom, smem_ptr in zip(tma_atoms, smem_ptrs):
                tensormap_manager.init_tensormap_from_atom(atom, smem_ptr, 0)
            tensormap_manager.update_tensormap(group_tensors, tma_atoms, gmem_ptrs, 0, smem_ptrs)
            for gmem_ptr_ in gmem_ptrs:
                tensormap_manager.fence_tensormap_update(gmem_ptr_)

    # -----------------------------------------------------------------------------------------------------
    # Warp 0: main loop (TMA producer and MMA issuer)
    # -----------------------------------------------------------------------------------------------------
    @cute.jit
    def _mainloop(
        self, k_tile_cnt, tiled_mma, ab_producer, ab_consumer, acc_producer, tensormap_manager,
        tensormap_gmem_ptrs, tma_atoms, tma_gmem, tma_smem,
        tiled_copy_s2t_sfa, tCsSFA_s2t, tCtSFA_s2t, tiled_copy_s2t_sfb, tCsSFB_s2t, tCtSFB_s2t,
        tCrA, tCrB, tCtAcc, tCtSFA, tCtSFB,
    ):
        tma_desc_ptrs = tuple(tensormap_manager.get_tensormap_ptr(p, cute.AddressSpace.generic)
                              for p in tensormap_gmem_ptrs)
        acc_empty = acc_producer.acquire_and_advance()
        # The first MMA of the tile overwrites the accumulator.
        tiled_mma.set(tcgen05.Field.ACCUMULATE, False)
        num_kblocks = cute.size(tCrA, mode=[2])
        for k_tile in range(k_tile_cnt):
            ab_empty = ab_producer.acquire_and_advance()
            for atom, tXgX, tXsX, desc_ptr in zip(tma_atoms, tma_gmem, tma_smem, tma_desc_ptrs):
                cute.copy(atom, tXgX[(None, k_tile)], tXsX[(None, ab_empty.index)],
                          tma_bar_ptr=ab_empty.barrier, tma_desc_ptr=desc_ptr)

            ab_full = ab_consumer.wait_and_advance()
            # The MMA reads its scales from tensor memory.
            # ((ATOM_V, REST_V), Rest_Tiler, MMA_MN, MMA_K)
            s2t_stage = (None, None, None, None, ab_full.index)
            cute.copy(tiled_copy_s2t_sfa, tCsSFA_s2t[s2t_stage], tCtSFA_s2t)
            cute.copy(tiled_copy_s2t_sfb, tCsSFB_s2t[s2t_stage], tCtSFB_s2t)
            # tCtAcc += tCrA * tCtSFA * tCrB * tCtSFB, one 64-deep instruction per k-block
            for kblock_idx in cutlass.range(num_kblocks, unroll_full=True):
                tiled_mma.set(tcgen05.Field.SFA, tCtSFA[(None, None, kblock_idx)].iterator)
                tiled_mma.set(tcgen05.Field.SFB, tCtSFB[(None, None, kblock_idx)].iterator)
                kblock = (None, None, kblock_idx, ab_full.index)
                cute.gemm(tiled_mma, tCtAcc, tCrA[kblock], tCrB[kblock], tCtAcc)
                tiled_mma.set(tcgen05.Field.ACCUMULATE, True)
            ab_full.release()
        acc_empty.commit()

    # -----------------------------------------------------------------------------------------------------
    # Warps 0-3: epilogue (tensor memory -> registers -> fp16 global stores)
    # -----------------------------------------------------------------------------------------------------
    @cute.jit
    def _epilogue(self, tidx, acc_consumer, tCtAcc, tCgC, tCcC, residue_mn):
        cfg = self.config
        # 32 lanes x 32 bits, 128 columns per load: thread i gets row i of the 128x128 accumulator.
        tiled_copy_t2r = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition.x128, tcgen05.Pack.NONE), cfg.acc_dtype),
            tCtAcc[None, 0, 0],
        )
        thr_copy_t2r = tiled_copy_t2r.get_slice(tidx)
        # (TmemCpy, NumTmemCpy)
        tDtAcc = thr_copy_t2r.partition_S(tCtAcc[None, 0, 0])
        # (TmemCpy, NumTmemCpy)
        tDgC = thr_copy_t2r.partition_D(tCgC[None, 0, 0])
        # (TmemCpy, NumTmemCpy): the same partition of the coordinates, so predicates line up with tDgC
        tDcC = thr_copy_t2r.partition_D(tCcC[None, 0, 0])
        tDrAcc = cute.make_rmem_tensor(tDgC.shape, cfg.acc_dtype)
        tDrC = cute.make_rmem_tensor(tDgC.shape, cfg.c_dtype)
        tDpC = cute.make_rmem_tensor(tDgC.shape, cutlass.Boolean)
        for i in cutlass.range_constexpr(cute.size(tDpC)):
            tDpC[i] = cute.elem_less(tDcC[i], residue_mn)

        acc_full = acc_consumer.wait_and_advance()
        cute.copy(tiled_copy_t2r, tDtAcc, tDrAcc)
        tDrC.store(tDrAcc.load().to(cfg.c_dtype))
        # NOTES: element-wise predicated stores handle any M and N; a TMA-store epilogue is the known faster way.
        store_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), cfg.c_dtype,
                                         num_bits_per_copy=cfg.c_dtype.width)
        cute.copy(store_atom, cute.flatten(tDrC), cute.flatten(tDgC), pred=cute.flatten(tDpC))
        acc_full.release()

    # -----------------------------------------------------------------------------------------------------
    # Partition helpers
    # -----------------------------------------------------------------------------------------------------
    @staticmethod
    def _tma_partition(tma_atom, sX, tCgX):
        """((atom_v, rest_v), STAGE) smem and ((atom_v, rest_v), Rest...) gmem views for one TMA atom."""
        return cpasync.tma_partition(tma_atom, 0, cute.make_layout(1),
                                     cute.group_modes(sX, 0, 3), cute.group_modes(tCgX, 0, 3))

    def _s2t_copy_and_partition(self, sSF, tCtSF):
        """tcgen05.cp of one scale tensor from shared to tensor memory, and its source/destination views."""
        copy_atom_s2t = cute.make_copy_atom(tcgen05.Cp4x32x128bOp(tcgen05.CtaGroup.ONE), self.config.sf_dtype)
        # (MMA, MMA_MN, MMA_K, STAGE)
        tCsSF_compact = cute.filter_zeros(sSF)
        # (MMA, MMA_MN, MMA_K)
        tCtSF_compact = cute.filter_zeros(tCtSF)
        tiled_copy_s2t = tcgen05.make_s2t_copy(copy_atom_s2t, tCtSF_compact)
        thr_copy_s2t = tiled_copy_s2t.get_slice(0)
        # ((ATOM_V, REST_V), Rest_Tiler, MMA_MN, MMA_K, STAGE)
        tCsSF_s2t = tcgen05.get_s2t_smem_desc_tensor(tiled_copy_s2t, thr_copy_s2t.partition_S(tCsSF_compact))
        # ((ATOM_V, REST_V), Rest_Tiler, MMA_MN, MMA_K)
        tCtSF_s2t = thr_copy_s2t.partition_D(tCtSF_compact)
        return tiled_copy_s2t, tCsSF_s2t, tCtSF_s2t


# ---------------------------------------------------------------------------------------------------
# Hopper device helpers: inline PTX (explicit so the same code builds on DSL 4.3.5 and 4.8.1)
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


@dsl_user_op
def mbar_init(addr, count: int, *, loc=None, ip=None):
    _asm(None, [_i32(addr, loc, ip)], f"mbarrier.init.shared::cta.b64 [$0], {count};", "r,~{memory}",
         True, loc, ip)


@dsl_user_op
def fence_mbar_init(*, loc=None, ip=None):
    _asm(None, [], "fence.mbarrier_init.release.cluster;", "~{memory}", True, loc, ip)


@dsl_user_op
def mbar_arrive(addr, *, loc=None, ip=None):
    _asm(None, [_i32(addr, loc, ip)], "mbarrier.arrive.shared::cta.b64 _, [$0];", "r,~{memory}",
         True, loc, ip)


@dsl_user_op
def mbar_arrive_if(addr, pred, *, loc=None, ip=None):
    """Arrive where pred != 0, without a branch (keeps the wgmma pipeline free of control flow)."""
    _asm(None, [_i32(addr, loc, ip), _i32(pred, loc, ip)],
         "{\n.reg .pred p;\nsetp.ne.b32 p, $1, 0;\n@p mbarrier.arrive.shared::cta.b64 _, [$0];\n}",
         "r,r,~{memory}", True, loc, ip)


@dsl_user_op
def mbar_arrive_expect_tx(addr, tx_bytes: int, pred, *, loc=None, ip=None):
    _asm(None, [_i32(addr, loc, ip), _i32(pred, loc, ip)],
         "{\n.reg .pred p;\nsetp.ne.b32 p, $1, 0;\n"
         f"@p mbarrier.arrive.expect_tx.shared::cta.b64 _, [$0], {tx_bytes};\n}}",
         "r,r,~{memory}", True, loc, ip)


@dsl_user_op
def mbar_wait(addr, parity, *, loc=None, ip=None):
    _asm(None, [_i32(addr, loc, ip), _i32(parity, loc, ip)],
         "{\n.reg .pred p;\nLAB_WAIT:\n"
         "mbarrier.try_wait.parity.shared::cta.b64 p, [$0], $1;\n"
         "@p bra DONE;\nbra LAB_WAIT;\nDONE:\n}",
         "r,r,~{memory}", True, loc, ip)


@dsl_user_op
def tma_load_2d(smem_dst, desc_addr, c0, c1, mbar, pred, *, loc=None, ip=None):
    """One TMA tile load (box from the descriptor) completing on `mbar`; issued where pred != 0."""
    _asm(None, [_i32(smem_dst, loc, ip), _i64(desc_addr, loc, ip), _i32(c0, loc, ip), _i32(c1, loc, ip),
                _i32(mbar, loc, ip), _i32(pred, loc, ip)],
         "{\n.reg .pred p;\nsetp.ne.b32 p, $5, 0;\n"
         "@p cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
         " [$0], [$1, {$2, $3}], [$4];\n}",
         "r,l,r,r,r,r,~{memory}", True, loc, ip)


@dsl_user_op
def bulk_load(smem_dst, gmem_src, num_bytes: int, mbar, pred, *, loc=None, ip=None):
    """Non-tensor bulk copy global -> shared completing on `mbar`; issued where pred != 0."""
    _asm(None, [_i32(smem_dst, loc, ip), _i64(gmem_src, loc, ip), _i32(mbar, loc, ip), _i32(pred, loc, ip)],
         "{\n.reg .pred p;\nsetp.ne.b32 p, $3, 0;\n"
         f"@p cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$0], [$1], {num_bytes}, [$2];\n}}",
         "r,l,r,r,~{memory}", True, loc, ip)


@dsl_user_op
def tma_store_2d(desc_addr, c0, c1, smem_src, pred, *, loc=None, ip=None):
    """One TMA tile store (box from the descriptor) in the current bulk group; issued where pred != 0."""
    _asm(None, [_i64(desc_addr, loc, ip), _i32(c0, loc, ip), _i32(c1, loc, ip), _i32(smem_src, loc, ip),
                _i32(pred, loc, ip)],
         "{\n.reg .pred p;\nsetp.ne.b32 p, $4, 0;\n"
         "@p cp.async.bulk.tensor.2d.global.shared::cta.tile.bulk_group [$0, {$1, $2}], [$3];\n}",
         "l,r,r,r,r,~{memory}", True, loc, ip)


@dsl_user_op
def bulk_commit(*, loc=None, ip=None):
    _asm(None, [], "cp.async.bulk.commit_group;", "~{memory}", True, loc, ip)


@dsl_user_op
def bulk_wait_read_all(*, loc=None, ip=None):
    _asm(None, [], "cp.async.bulk.wait_group.read 0;", "~{memory}", True, loc, ip)


@dsl_user_op
def bulk_wait_all(*, loc=None, ip=None):
    _asm(None, [], "cp.async.bulk.wait_group 0;", "~{memory}", True, loc, ip)


@dsl_user_op
def fence_async_smem(*, loc=None, ip=None):
    """Orders this thread's ordinary shared-memory stores before later async-proxy reads (wgmma, TMA)."""
    _asm(None, [], "fence.proxy.async.shared::cta;", "~{memory}", True, loc, ip)


@dsl_user_op
def named_barrier(barrier_id, num_threads: int, *, loc=None, ip=None):
    _asm(None, [_i32(barrier_id, loc, ip)], f"bar.sync $0, {num_threads};", "r,~{memory}", True, loc, ip)


@dsl_user_op
def ld_shared_u32(addr, *, loc=None, ip=None):
    r = _asm(T.i32(), [_i32(addr, loc, ip)], "ld.shared.b32 $0, [$1];", "=r,r,~{memory}", True, loc, ip)
    return cutlass.Uint32(r)


@dsl_user_op
def ld_shared_v2(addr, *, loc=None, ip=None):
    r = _asm(llvm.StructType.get_literal([T.i32(), T.i32()]), [_i32(addr, loc, ip)],
             "ld.shared.v2.b32 {$0, $1}, [$2];", "=r,=r,r,~{memory}", True, loc, ip)
    return [cutlass.Uint32(llvm.extractvalue(T.i32(), r, [i], loc=loc, ip=ip)) for i in range(2)]


@dsl_user_op
def ld_shared_v4(addr, *, loc=None, ip=None):
    r = _asm(llvm.StructType.get_literal([T.i32()] * 4), [_i32(addr, loc, ip)],
             "ld.shared.v4.b32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,r,~{memory}", True, loc, ip)
    return [cutlass.Uint32(llvm.extractvalue(T.i32(), r, [i], loc=loc, ip=ip)) for i in range(4)]


@dsl_user_op
def st_shared_v4(addr, v0, v1, v2, v3, *, loc=None, ip=None):
    _asm(None, [_i32(addr, loc, ip), _u32(v0, loc, ip), _u32(v1, loc, ip), _u32(v2, loc, ip),
                _u32(v3, loc, ip)],
         "st.shared.v4.b32 [$0], {$1, $2, $3, $4};", "r,r,r,r,r,~{memory}", True, loc, ip)


@dsl_user_op
def st_shared_f16_scaled(addr, acc_value, *, loc=None, ip=None):
    """Stores fp16(acc * 2^14) (undoes the 2^-14 of the operand encoding; exact)."""
    _asm(None, [_i32(addr, loc, ip), cutlass.Float32(acc_value).ir_value(loc=loc, ip=ip)],
         "{\n.reg .b16 h;\n.reg .f32 f;\nmul.f32 f, $1, 0f46800000;\ncvt.rn.f16.f32 h, f;\n"
         "st.shared.b16 [$0], h;\n}",
         "r,f,~{memory}", True, loc, ip)


@dsl_user_op
def scale_to_f16x2(scale_word, selector, *, loc=None, ip=None):
    """One e4m3 byte of `scale_word` (picked by the prmt `selector`, 0x4b4b for byte b) as fp16x2
    {s * 2^7, s * 2^7}. Exact for every finite e4m3 (subnormals included); e4m3 NaN gives fp16 NaN."""
    r = _asm(T.i32(), [_u32(scale_word, loc, ip), _u32(selector, loc, ip)],
             "{\n.reg .b32 x, a, b, c, z;\n.reg .pred p;\n"
             "mov.b32 z, 0;\nprmt.b32 x, $1, z, $2;\n"
             "shl.b32 a, x, 7;\nand.b32 a, a, 0x3F803F80;\n"
             "shl.b32 b, x, 8;\nand.b32 b, b, 0x80008000;\n"
             "or.b32 a, a, b;\n"
             "mov.b32 c, 0x78007800;\n"
             "mul.rn.f16x2 $0, a, c;\n"
             "and.b32 b, x, 0x7F;\n"
             "setp.eq.u32 p, b, 0x7F;\n"
             "@p mov.b32 $0, 0x7E007E00;\n}",
             "=r,r,r", False, loc, ip)
    return cutlass.Uint32(r)


@dsl_user_op
def fp4x8_to_f16x2x4(word, scale_f16x2, *, loc=None, ip=None):
    """8 e2m1 nibbles (nibble i = bits 4i..4i+3) -> 4 fp16x2 registers, register i holding
    (nibble i, nibble i+4) * scale. The nibble's s.e1.e0.m bits land on fp16 bits 15, 11, 10, 9, which
    is the e2m1 value * 2^-14 (the e=0 case is an fp16 subnormal); times scale * 2^7 (exact)."""
    r = _asm(llvm.StructType.get_literal([T.i32()] * 4), [_u32(word, loc, ip), _u32(scale_f16x2, loc, ip)],
             "{\n.reg .b32 m, s;\n"
             "shl.b32 m, $4, 9;\nand.b32 m, m, 0x0E000E00;\nshl.b32 s, $4, 12;\nand.b32 s, s, 0x80008000;\n"
             "or.b32 m, m, s;\nmul.rn.f16x2 $0, m, $5;\n"
             "shl.b32 m, $4, 5;\nand.b32 m, m, 0x0E000E00;\nshl.b32 s, $4, 8;\nand.b32 s, s, 0x80008000;\n"
             "or.b32 m, m, s;\nmul.rn.f16x2 $1, m, $5;\n"
             "shl.b32 m, $4, 1;\nand.b32 m, m, 0x0E000E00;\nshl.b32 s, $4, 4;\nand.b32 s, s, 0x80008000;\n"
             "or.b32 m, m, s;\nmul.rn.f16x2 $2, m, $5;\n"
             "shr.b32 m, $4, 3;\nand.b32 m, m, 0x0E000E00;\nand.b32 s, $4, 0x80008000;\n"
             "or.b32 m, m, s;\nmul.rn.f16x2 $3, m, $5;\n}",
             "=r,=r,=r,=r,r,r", False, loc, ip)
    return [cutlass.Uint32(llvm.extractvalue(T.i32(), r, [i], loc=loc, ip=ip)) for i in range(4)]


@dsl_user_op
def tensormap_ptr(addr_i64, *, loc=None, ip=None):
    """A 128-byte aligned global address as a TMA-descriptor pointer (for the tensormap ops)."""
    value = cutlass.Int64(addr_i64).ir_value(loc=loc, ip=ip)
    aligned_ty = _cute_ir.ConstrainedIntType.get(128, value.type.width)
    aligned = _cute_ir.assume(aligned_ty, value, loc=loc, ip=ip)
    ptr_ty = _cute_ir.PtrType.get(_cute_nvgpu_ir.TmaDescriptorTiledType.get(), cute.AddressSpace.gmem, 128)
    return _cute_ir.inttoptr(ptr_ty, aligned, loc=loc, ip=ip)


# ---------------------------------------------------------------------------------------------------------
# Hopper (sm_90a) kernel
# ---------------------------------------------------------------------------------------------------------
class Sm90BlockScaledGroupedGemmKernel:
    """Grouped NVFP4 GEMM for sm_90a; see the module docstring for roles, pipelines and encodings.

    blocks_per_wg (bpw, compile time) = 64-row blocks of B per consumer warpgroup: 1 -> tile 128 (n) x 128
    (m); 2 -> tile 256 x 128 (each fp16 A buffer feeds twice the MMA work: ~25 % less time per MAC on the
    H200, but half as many tiles). Registers (setmaxnreg): producer 24, transform 64, consumers 208.
    Shared memory: stages (4 x 18 KB | 3 x 27 KB) + 3 x 32 KB fp16 A + 2 x 16 KB epilogue, ~205 / 214 KB.
    Named barriers: EPILOGUE_BARRIER + consumer index (128 threads each).
    """

    EPILOGUE_BARRIER = 2

    A_BYTES = 128 * 64  # A fp4 rows of one stage: 128 x 64 B (128 k)
    SF_BYTES = 1024  # one 128-row scale slice for 128 k
    A16_BYTES = 128 * 128 * 2  # one fp16 A buffer: 128 rows x 128 k
    C_BYTES = 128 * 64 * 2  # one epilogue slab per consumer warpgroup: 128 m x 64 n fp16
    NUM_A16 = 3
    DESC_BYTES = 128
    DESCS_PER_CTA = 4  # A, B, C (consumer 0), C (consumer 1)

    def __init__(self, num_groups: int, config: Sm90GemmConfig):
        blocks_per_wg, num_stages = config.blocks_per_wg, config.num_stages
        self.num_groups = num_groups
        self.bpw = blocks_per_wg
        self.num_stages = num_stages or (4 if blocks_per_wg == 1 else 3)
        self.tile_m = 128  # rows of A per tile (wgmma N)
        self.tile_n = 128 * blocks_per_wg  # rows of B per tile (2 consumer warpgroups x bpw x wgmma M 64)
        self.k_chunk = 128  # k elements per stage
        self.b_bytes = self.tile_n * 64
        self.stage_bytes = self.A_BYTES + self.b_bytes + self.SF_BYTES * (1 + blocks_per_wg)
        self.threads = 512
        self.producer_regs = 24
        self.transform_regs = 64
        self.consumer_regs = 208
        self.scheduler = GroupTileScheduler(num_groups, self.tile_m, self.tile_n)

    @cute.jit
    def __call__(self, ptrs_ptr: cute.Pointer, sizes_ptr: cute.Pointer, workspace_ptr: cute.Pointer,
                 total_tiles: cutlass.Int32, grid_x: cutlass.Int32):
        G = self.num_groups
        ptrs = cute.make_tensor(ptrs_ptr, cute.make_layout((G, 5), stride=(5, 1)))
        sizes = cute.make_tensor(sizes_ptr, cute.make_layout((G, 4), stride=(4, 1)))
        workspace = cute.make_tensor(workspace_ptr, cute.make_layout((1,)))

        # Template descriptors (address/shape/stride are rewritten per group in the kernel).
        fp4_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW64, cutlass.Uint8)
        null_u8 = cute.make_ptr(cutlass.Uint8, 0, cute.AddressSpace.gmem, assumed_align=16)
        template_ab = cute.make_tensor(null_u8, cute.make_layout((512, 128), stride=(128, 1)))
        tma_a, _ = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), template_ab,
                                               cute.tile_to_shape(fp4_atom, (128, 64), order=(0, 1)), (128, 64))
        tma_b, _ = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), template_ab,
                                               cute.tile_to_shape(fp4_atom, (self.tile_n, 64), order=(0, 1)),
                                               (self.tile_n, 64))
        # C^T view: (N, M) with n contiguous; one box = 64 n x 128 m.
        c_smem_layout = cute.make_layout((64, self.tile_m), stride=(1, 64))
        null_f16 = cute.make_ptr(cutlass.Float16, 0, cute.AddressSpace.gmem, assumed_align=16)
        template_c = cute.make_tensor(null_f16, cute.make_layout((256, 256), stride=(1, 256)))
        tma_c, _ = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), template_c,
                                               c_smem_layout, (64, self.tile_m))

        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            cutlass.Float16, cutlass.Float16, _OperandMajorMode.K, _OperandMajorMode.K, cutlass.Float32,
            (1, 1, 1), (64, self.tile_m), warpgroup.OperandSource.RMEM)
        a16_layout = cute.tile_to_shape(
            warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, cutlass.Float16),
            (self.tile_m, self.k_chunk, self.NUM_A16), order=(0, 1, 2))

        @cute.struct
        class SharedStorage:
            full_bar: cute.struct.MemRange[cutlass.Int64, self.num_stages]
            empty_bar: cute.struct.MemRange[cutlass.Int64, self.num_stages]
            a16_full_bar: cute.struct.MemRange[cutlass.Int64, self.NUM_A16]
            a16_empty_bar: cute.struct.MemRange[cutlass.Int64, self.NUM_A16]
            stages: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, self.num_stages * self.stage_bytes], 1024]
            a16: cute.struct.Align[cute.struct.MemRange[cutlass.Float16, cute.cosize(a16_layout)], 1024]
            c_stage: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, 2 * self.C_BYTES], 1024]

        self.shared_storage = SharedStorage

        self.kernel(tma_a, tma_b, tma_c, tiled_mma, a16_layout, ptrs, sizes, workspace, total_tiles).launch(
            grid=(grid_x, 1, 1), block=(self.threads, 1, 1), min_blocks_per_mp=1)

    @cute.kernel
    def kernel(self, tma_a: cute.CopyAtom, tma_b: cute.CopyAtom, tma_c: cute.CopyAtom,
               tiled_mma: cute.TiledMma, a16_layout: cute.ComposedLayout, ptrs: cute.Tensor,
               sizes: cute.Tensor, workspace: cute.Tensor, total_tiles: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())

        smem = SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        full_bar = storage.full_bar.data_ptr().toint()
        empty_bar = storage.empty_bar.data_ptr().toint()
        a16_full = storage.a16_full_bar.data_ptr().toint()
        a16_empty = storage.a16_empty_bar.data_ptr().toint()
        stages = storage.stages.data_ptr().toint()
        a16_base = storage.a16.data_ptr().toint()
        c_base = storage.c_stage.data_ptr().toint()
        sA16 = storage.a16.get_tensor(a16_layout.outer, swizzle=a16_layout.inner)

        if tidx == 0:
            for s in cutlass.range_constexpr(self.num_stages):
                mbar_init(full_bar + 8 * s, 1)
                mbar_init(empty_bar + 8 * s, 3 * 128)  # every transform and consumer thread
            for b in cutlass.range_constexpr(self.NUM_A16):
                mbar_init(a16_full + 8 * b, 128)  # every transform thread
                mbar_init(a16_empty + 8 * b, 2 * 128)  # every consumer thread
            fence_mbar_init()
        cute.arch.sync_threads()

        ws_cta = workspace.iterator.toint() + cutlass.Int64(bid) * (self.DESCS_PER_CTA * self.DESC_BYTES)

        if warp < 4:
            cute.arch.warpgroup_reg_dealloc(self.producer_regs)
            if warp == 0:
                self.producer(tma_a, tma_b, ptrs, sizes, ws_cta, total_tiles, bid, grid, full_bar,
                              empty_bar, stages)
        elif warp < 8:
            cute.arch.warpgroup_reg_dealloc(self.transform_regs)
            self.transform(sizes, total_tiles, bid, grid, tidx, full_bar, empty_bar, stages, a16_base,
                           a16_full, a16_empty)
        else:
            cute.arch.warpgroup_reg_alloc(self.consumer_regs)
            self.consumer(tma_c, tiled_mma, sA16, ptrs, sizes, ws_cta, total_tiles, bid, grid, tidx, warp,
                          full_bar, empty_bar, stages, a16_full, a16_empty, c_base)

    # -----------------------------------------------------------------------------------------------
    # Producer warp
    # -----------------------------------------------------------------------------------------------
    @cute.jit
    def producer(self, tma_a, tma_b, ptrs, sizes, ws_cta, total_tiles, bid, grid, full_bar, empty_bar,
                 stages):
        lane = cute.arch.lane_idx()
        leader = cutlass.Int32(0)
        if lane == 0:
            leader = cutlass.Int32(1)
        desc_a = ws_cta
        desc_b = ws_cta + self.DESC_BYTES
        if lane == 0:
            cpasync.copy_tensormap(tma_a, tensormap_ptr(desc_a))
            cpasync.copy_tensormap(tma_b, tensormap_ptr(desc_b))
        cute.arch.sync_warp()

        chunk = cutlass.Int32(0)
        last_g = cutlass.Int32(-1)
        tile = cutlass.Int32(bid)
        while tile < total_tiles:
            g, m_tile, n_tile, m_size, n_size, k_size = self.scheduler.decode(sizes, tile)
            if g != last_g:
                if chunk > 0:
                    # Drain: every load issued with the old descriptors has landed and been consumed.
                    last = chunk - 1
                    mbar_wait(empty_bar + 8 * (last % self.num_stages), (last // self.num_stages) % 2)
                kb = k_size // 2
                a_tensor = cute.make_tensor(
                    cute.make_ptr(cutlass.Uint8, ptrs[g, 0], cute.AddressSpace.gmem, assumed_align=16),
                    cute.make_layout((m_size, kb), stride=(kb, 1)))
                b_tensor = cute.make_tensor(
                    cute.make_ptr(cutlass.Uint8, ptrs[g, 1], cute.AddressSpace.gmem, assumed_align=16),
                    cute.make_layout((n_size, kb), stride=(kb, 1)))
                update_tensormap(tma_a, a_tensor, desc_a)
                update_tensormap(tma_b, b_tensor, desc_b)
                last_g = g
            sfa = ptrs[g, 3]
            sfb = ptrs[g, 4]
            rest_k = k_size // 64
            sfa_row = cutlass.Int64(m_tile * rest_k) * 512
            for c in range(k_size // self.k_chunk):
                s = chunk % self.num_stages
                phase = (chunk // self.num_stages) % 2
                mbar_wait(empty_bar + 8 * s, phase ^ 1)
                full = full_bar + 8 * s
                stage = stages + s * self.stage_bytes
                mbar_arrive_expect_tx(full, self.stage_bytes, leader)
                tma_load_2d(stage, desc_a, c * 64, m_tile * self.tile_m, full, leader)
                tma_load_2d(stage + self.A_BYTES, desc_b, c * 64, n_tile * self.tile_n, full, leader)
                sf_off = cutlass.Int64(c) * 1024
                sf_stage = stage + self.A_BYTES + self.b_bytes
                bulk_load(sf_stage, sfa + sfa_row + sf_off, self.SF_BYTES, full, leader)
                for nb in cutlass.range_constexpr(self.bpw):
                    sfb_row = cutlass.Int64((n_tile * self.bpw + nb) * rest_k) * 512
                    bulk_load(sf_stage + (1 + nb) * self.SF_BYTES, sfb + sfb_row + sf_off, self.SF_BYTES,
                              full, leader)
                chunk = chunk + 1
            tile = tile + grid

    # -----------------------------------------------------------------------------------------------
    # Transform warpgroup: A fp4 (stage) -> fp16 buffer (the wgmma B operand), one row per thread
    # -----------------------------------------------------------------------------------------------
    @cute.jit
    def transform(self, sizes, total_tiles, bid, grid, tidx, full_bar, empty_bar, stages, a16_base,
                  a16_full, a16_empty):
        row = tidx % 128
        a_row_off = row * 64
        a_swz16 = ((row >> 1) & 3) * 16
        sfa_off = (row % 32) * 16 + ((row // 32) % 4) * 4
        sel0 = cutlass.Uint32((4 << 12) | (4 << 4))
        a16_row = row * 128
        a16_swz16 = (row % 8) * 16
        chunk = cutlass.Int32(0)
        tile = cutlass.Int32(bid)
        while tile < total_tiles:
            g, m_tile, n_tile, m_size, n_size, k_size = self.scheduler.decode(sizes, tile)
            for _ in range(k_size // self.k_chunk):
                s = chunk % self.num_stages
                b = chunk % self.NUM_A16
                mbar_wait(full_bar + 8 * s, (chunk // self.num_stages) % 2)
                stage = stages + s * self.stage_bytes
                # words[q'] = physical k 32 q' + [0, 32) of this row: word (q', t) covers 32 q' + 8 t + [0, 8)
                words = [ld_shared_v4(stage + a_row_off + ((16 * qq) ^ a_swz16)) for qq in range(4)]
                sf_a = stage + self.A_BYTES + self.b_bytes + sfa_off
                sf = [ld_shared_u32(sf_a + 512 * sub) for sub in range(2)]
                mbar_arrive(empty_bar + 8 * s)
                mbar_wait(a16_empty + 8 * b, ((chunk // self.NUM_A16) % 2) ^ 1)
                a16 = a16_base + b * self.A16_BYTES + a16_row
                for t in cutlass.range_constexpr(4):
                    # scale block of word (q', t): 2 q' + t // 2 -> word q' // 2, byte 2 (q' % 2) + t // 2
                    conv = [fp4x8_to_f16x2x4(words[qq][t], scale_to_f16x2(
                        sf[qq // 2], sel0 | cutlass.Uint32((2 * (qq % 2) + t // 2) * 0x101))) for qq in range(4)]
                    for i in cutlass.range_constexpr(4):
                        s_log = 2 * t + i // 2  # logical k16 step; slot i % 2 selects k 8..15 of the step
                        addr = a16 + (s_log // 4) * 16384 + ((((2 * s_log + i % 2) % 8) * 16) ^ a16_swz16)
                        st_shared_v4(addr, conv[0][i], conv[1][i], conv[2][i], conv[3][i])
                fence_async_smem()
                mbar_arrive(a16_full + 8 * b)
                chunk = chunk + 1
            tile = tile + grid

    # -----------------------------------------------------------------------------------------------
    # Consumer warpgroups
    # -----------------------------------------------------------------------------------------------
    @cute.jit
    def consumer(self, tma_c, tiled_mma, sA16, ptrs, sizes, ws_cta, total_tiles, bid, grid, tidx, warp,
                 full_bar, empty_bar, stages, a16_full, a16_empty, c_base):
        # warp-uniform values stay in uniform registers (TMA operands must not need a predicated R2UR)
        wg = warp // 4 - 2
        w = warp % 4
        tid = tidx % 128
        lane = tid % 32
        leader = cutlass.Int32(0)
        if tid == 0:
            leader = cutlass.Int32(1)
        desc_c = ws_cta + (2 + wg) * self.DESC_BYTES
        if tid == 0:
            cpasync.copy_tensormap(tma_c, tensormap_ptr(desc_c))
        cute.arch.sync_warp()

        thr_mma = tiled_mma.get_slice(tid)
        # (MMA, MMA_N, MMA_K, A16 buffer)
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sA16))
        # (MMA, MMA_M, MMA_N) per 64-row block of B
        accs = [cute.make_rmem_tensor(tiled_mma.partition_shape_C((64, self.tile_m)), cutlass.Float32)
                for _ in range(self.bpw)]
        # (MMA, MMA_M, MMA_K=2): register-sourced wgmma A operand for a quarter chunk (32 k), per block,
        # two buffers (even / odd quarter)
        frag_shape = tiled_mma.partition_shape_A((64, 32))
        frags = [[cute.make_rmem_tensor(frag_shape, cutlass.Float16) for _ in range(2)] for _ in range(self.bpw)]
        tiled_mma.set(warpgroup.Field.ACCUMULATE, True)

        # Per-thread constants, kept to a few registers: every other offset is base + compile-time constant.
        # B: rows r, r + 8 of each 64-row block (r + 8 and r + 64 keep the SW64 swizzle and the scale-slice
        # position: +512 / +4096 bytes of B, +128 / +8 bytes of SFB), 16-byte column chunk q.
        q = lane % 4
        b_row = 64 * self.bpw * wg + 16 * w + lane // 4
        b_off = b_row * 64 + 16 * (q ^ ((b_row >> 1) & 3))
        sfb_off = (b_row // 128) * self.SF_BYTES + (q // 2) * 512 + (b_row % 32) * 16 + ((b_row // 32) % 4) * 4
        b_sel = cutlass.Uint32((4 << 12) | (4 << 4)) | cutlass.Uint32(2 * (q % 2) * 0x101)
        chunk = cutlass.Int32(0)
        last_g = cutlass.Int32(-1)
        tile = cutlass.Int32(bid)
        while tile < total_tiles:
            g, m_tile, n_tile, m_size, n_size, k_size = self.scheduler.decode(sizes, tile)
            if g != last_g:
                if w == 0:
                    if lane == 0:
                        bulk_wait_all()
                    cute.arch.sync_warp()
                    c_tensor = cute.make_tensor(
                        cute.make_ptr(cutlass.Float16, ptrs[g, 2], cute.AddressSpace.gmem, assumed_align=16),
                        cute.make_layout((n_size, m_size), stride=(1, n_size)))
                    update_tensormap(tma_c, c_tensor, desc_c)
                last_g = g

            for blk in cutlass.range_constexpr(self.bpw):
                accs[blk].fill(0.0)
            first = cutlass.Int32(1)
            for _ in range(k_size // self.k_chunk):
                self.consume_chunk(chunk, first, frags, accs, tCrB, tiled_mma, full_bar, empty_bar, stages,
                                   a16_full, a16_empty, b_off, sfb_off, b_sel)
                first = cutlass.Int32(0)
                chunk = chunk + 1
            warpgroup.wait_group(0)
            mbar_arrive(a16_empty + 8 * ((chunk - 1) % self.NUM_A16))

            # Epilogue: per block, acc (64 n x 128 m) -> fp16 slab [m][n] in shared memory -> TMA store.
            c_slab = cute.arch.make_warp_uniform(c_base + wg * self.C_BYTES)
            m0 = cute.arch.make_warp_uniform(m_tile * self.tile_m)
            for blk in cutlass.range_constexpr(self.bpw):
                if tid == 0:
                    bulk_wait_read_all()  # the previous store has read the slab (no-op when none is pending)
                named_barrier(self.EPILOGUE_BARRIER + wg, 128)
                acc = accs[blk]
                for v in cutlass.range_constexpr(cute.size(acc)):
                    n_local = 16 * w + lane // 4 + 8 * ((v // 2) % 2)
                    m_local = 2 * (lane % 4) + (v % 2) + 8 * (v // 4)
                    st_shared_f16_scaled(c_slab + (m_local * 64 + n_local) * 2, acc[v])
                fence_async_smem()
                named_barrier(self.EPILOGUE_BARRIER + wg, 128)
                n0 = cute.arch.make_warp_uniform(n_tile * self.tile_n + 64 * (self.bpw * wg + blk))
                tma_store_2d(desc_c, n0, m0, c_slab, leader)
                if tid == 0:
                    bulk_commit()
            tile = tile + grid
        if tid == 0:
            bulk_wait_all()

    @cute.jit
    def consume_chunk(self, chunk, first, frags, accs, tCrB, tiled_mma, full_bar, empty_bar, stages, a16_full,
                      a16_empty, b_off, sfb_off, b_sel):
        s = chunk % self.num_stages
        buf = chunk % self.NUM_A16
        mbar_wait(full_bar + 8 * s, (chunk // self.num_stages) % 2)
        stage = stages + s * self.stage_bytes
        sf_b = stage + self.A_BYTES + self.b_bytes + self.SF_BYTES

        # -- this thread's B rows (r, r + 8 of each block) and their scale words; then release the stage
        b_rows = [(blk, half) for blk in range(self.bpw) for half in range(2)]
        b_words = [ld_shared_v4(stage + self.A_BYTES + b_off + 4096 * blk + 512 * half) for blk, half in b_rows]
        b_sf = [ld_shared_u32(sf_b + sfb_off + 8 * blk + 128 * half) for blk, half in b_rows]
        mbar_arrive(empty_bar + 8 * s)
        b_sc = [[scale_to_f16x2(b_sf[r], b_sel + e * 0x101) for e in range(2)] for r in range(2 * self.bpw)]
        mbar_wait(a16_full + 8 * buf, (chunk // self.NUM_A16) % 2)

        # -- per quarter (32 k = word t of each row): dequantize into the register fragment and issue
        # 2 k-steps of wgmma per block; a fragment buffer is rewritten two quarters later.
        for t in cutlass.range_constexpr(4):
            warpgroup.wait_group(1)
            if t == 1:
                # every wgmma of the previous chunk has retired: its fp16 A buffer can be refilled
                mbar_arrive_if(a16_empty + 8 * ((chunk + self.NUM_A16 - 1) % self.NUM_A16), 1 - first)
            for blk in cutlass.range_constexpr(self.bpw):
                frag_u32 = cute.recast_tensor(frags[blk][t % 2], cutlass.Uint32)
                o0 = fp4x8_to_f16x2x4(b_words[2 * blk][t], b_sc[2 * blk][t // 2])
                o1 = fp4x8_to_f16x2x4(b_words[2 * blk + 1][t], b_sc[2 * blk + 1][t // 2])
                for i in cutlass.range_constexpr(4):
                    step = i // 2
                    slot = i % 2
                    frag_u32[4 * step + 2 * slot] = o0[i]
                    frag_u32[4 * step + 2 * slot + 1] = o1[i]
            warpgroup.fence()
            for blk in cutlass.range_constexpr(self.bpw):
                for step in cutlass.range_constexpr(2):
                    cute.gemm(tiled_mma, accs[blk], frags[blk][t % 2][(None, None, step)],
                              tCrB[(None, None, 2 * t + step, buf)], accs[blk])
            warpgroup.commit_group()


# ---------------------------------------------------------------------------------------------------------
# Compile cache
# ---------------------------------------------------------------------------------------------------------
def compile_key(num_groups: int, arch: str, config=SM100_CONFIG) -> tuple:
    """The key of a compiled kernel: everything baked into it.

    The group count is static (the group search is unrolled over it); the target arch and the DSL version
    decide the code; the config (Sm100GemmConfig or Sm90GemmConfig) holds tile shape, stages and the rest.
    Problem sizes and pointers are not in it: the kernels read them from device tables at run time.
    """
    return ("nvfp4_grouped_gemm", arch, DSL_VERSION, config, int(num_groups))


_compiled_kernels: dict = {}


def _compile(key: tuple) -> Callable:
    _, arch, _, config, num_groups = key
    # Placeholder addresses: only the pointer types (dtype, alignment) and the group count are baked in.
    ptr_table = gmem_ptr(cutlass.Int64, 0, METADATA_ALIGN_BYTES)
    size_table = gmem_ptr(cutlass.Int32, 0, METADATA_ALIGN_BYTES)
    workspace = gmem_ptr(cutlass.Int64, 0, TENSORMAP_BYTES)
    if isinstance(config, Sm100GemmConfig) and arch.startswith("sm_10"):
        kernel = Sm100BlockScaledGroupedGemmKernel(config)
        return cute.compile(kernel, ptr_table, size_table, workspace, cutlass.Int32(1), num_groups)
    if isinstance(config, Sm90GemmConfig) and arch.startswith("sm_90"):
        kernel = Sm90BlockScaledGroupedGemmKernel(num_groups, config)
        return cute.compile(kernel, ptr_table, size_table, workspace, cutlass.Int32(1), cutlass.Int32(1))
    raise UnsupportedDeviceError(f"no kernel for {arch} with {type(config).__name__}: kernels exist for sm_100 "
                                 "(Blackwell) and sm_90 (Hopper)")


def compiled_kernel(key: tuple) -> Callable:
    fn = _compiled_kernels.get(key)
    if fn is None:
        fn = _compiled_kernels[key] = _compile(key)
    return fn


def _target_arch(device: Optional[torch.device]) -> str:
    """The arch the DSL compiles for: CUTE_DSL_ARCH if set, else the device's."""
    forced = os.environ.get("CUTE_DSL_ARCH")
    if forced:
        return forced
    if device is None:
        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device and CUTE_DSL_ARCH is not set: set CUTE_DSL_ARCH=sm_100a (or "
                               "sm_90a) to build without a GPU")
        device = torch.device("cuda", torch.cuda.current_device())
    major, minor = _device_capability(device.index)
    return f"sm_{major}{minor}a"


@functools.lru_cache(maxsize=None)
def _device_capability(index: int) -> tuple:
    return torch.cuda.get_device_capability(index)


@functools.lru_cache(maxsize=None)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _arch_family(arch: str) -> Optional[str]:
    return next((family for family in KERNEL_VARIANTS if arch.startswith(family)), None)


def _check_device(device: torch.device) -> None:
    major, minor = _device_capability(device.index)
    if (major, minor) not in ((10, 0), (9, 0)):
        raise UnsupportedDeviceError(
            f"{torch.cuda.get_device_name(device)} ({device}) has compute capability {major}.{minor}; kernels "
            "exist for Blackwell B200 (10.0, sm_100a) and Hopper (9.0, sm_90a) only.")


def compile_for(num_groups: int, arch: Optional[str] = None, variant: Optional[str] = None) -> Callable:
    """Build a kernel for `num_groups` groups, without launching it, through custom_kernel's cache.

    The DSL builds for CUTE_DSL_ARCH when it is set (no GPU needed), else for the current GPU; `arch`, when
    given, must name that same target. `variant` names an entry of KERNEL_VARIANTS for that arch (default:
    its first). Returns the compiled kernel.

    Without a CUDA driver, DSL 4.3.x writes the cubin (when asked to keep it) and then raises
    cutlass.base_dsl.common.DSLRuntimeError, whose message begins "ICE" and names the cause
    "CudaDriverDependencyError: CUDA Driver Dependency Error", while loading it; DSL 4.8.x loads lazily and
    returns.
    """
    target = _target_arch(None)
    if arch is not None and arch != target:
        raise ValueError(f"compile_for(arch={arch!r}), but the DSL builds for {target!r} (CUTE_DSL_ARCH or the GPU)")
    family = _arch_family(target)
    if family is None:
        raise UnsupportedDeviceError(f"no kernel for {target}: kernels exist for sm_100a and sm_90a")
    variants = KERNEL_VARIANTS[family]
    if variant is not None and variant not in variants:
        raise ValueError(f"no variant {variant!r} for {target}: {', '.join(variants)}")
    return compiled_kernel(compile_key(num_groups, target, variants[variant or next(iter(variants))]))


# ---------------------------------------------------------------------------------------------------------
# Constraints: the one statement of what custom_kernel accepts
# ---------------------------------------------------------------------------------------------------------
def _strides_match(t: torch.Tensor, expected: tuple) -> bool:
    """Strides equal `expected` in every dimension longer than 1 (a length-1 dimension is never stepped)."""
    return all(size == 1 or stride == want for size, stride, want in zip(t.shape, t.stride(), expected))


# Names of a group's tensors, in the order `_group_spec` describes them.
GROUP_TENSOR_NAMES = ("a", "b", "c", "sfa", "sfb", "sfa_reordered", "sfb_reordered")
# The ones the kernel reads or writes (the plain scales are only in the data for the reference).
KERNEL_TENSOR_NAMES = ("a", "b", "c", "sfa_reordered", "sfb_reordered")


@functools.lru_cache(maxsize=4096)
def _group_spec(size: tuple) -> tuple:
    """(reason, None) if problem size (m, n, k, l) cannot run, else (None, per-tensor (dtype, shape, strides)).

    strides is what the kernel reads the tensor with, None for a tensor it does not read. Cached: the
    per-call check then only compares tensor metadata with this table.
    """
    m, n, k, l = size
    if l != 1:
        return "L must be 1", None
    if m < 1:
        return "M must be at least 1", None
    if n < 1 or n % SM100_CONFIG.tile_mn[1]:
        # NOTES: partial N tiles would take the masked path that partial M tiles take, but no task shape
        # has one and no B200 has run it here: rejected rather than trusted unverified.
        return f"N must be a positive multiple of {SM100_CONFIG.tile_mn[1]} (the tile width)", None
    if k < K_MULTIPLE or k % K_MULTIPLE:
        return f"K must be a positive multiple of {K_MULTIPLE}", None
    if max(m * k, n * k, m * n) >= 2**31:
        return "a tensor has 2**31 or more elements; the kernel indexes with 32-bit integers", None
    sf_k = k // SM100_CONFIG.sf_vec_size
    rest_k = ceil_div(sf_k, 4)
    rest_m, rest_n = ceil_div(m, 128), ceil_div(n, 128)
    # Dense layouts as the task's generator makes them: a [m, k/2, l] is a permuted (l, m, k/2) tensor, so
    # row stride k/2 and K contiguous; the blocked scales are (l, rest_mn, rest_k, 32, 4, 4) contiguous,
    # shown as [32, 4, rest_mn, 4, rest_k, l]: one 128-row x 4-scale atom is 512 contiguous bytes.
    return None, (
        (TORCH_AB_DTYPE, (m, k // 2, 1), (k // 2, 1, m * k // 2)),  # a
        (TORCH_AB_DTYPE, (n, k // 2, 1), (k // 2, 1, n * k // 2)),  # b
        (TORCH_C_DTYPE, (m, n, 1), (n, 1, m * n)),  # c
        (TORCH_SF_DTYPE, (m, sf_k, 1), None),  # sfa
        (TORCH_SF_DTYPE, (n, sf_k, 1), None),  # sfb
        (TORCH_SF_DTYPE, (32, 4, rest_m, 4, rest_k, 1), (16, 4, rest_k * 512, 1, 512, rest_m * rest_k * 512)),
        (TORCH_SF_DTYPE, (32, 4, rest_n, 4, rest_k, 1), (16, 4, rest_k * 512, 1, 512, rest_n * rest_k * 512)),
    )


def _where(i: int, size) -> str:
    return f"group {i} (m, n, k, l) = {tuple(size)}"


def _tensor_reason(name: str, t, dtype, shape: tuple, strides: Optional[tuple]) -> str:
    """Why tensor `name` does not match its (dtype, shape, strides) entry."""
    if not isinstance(t, torch.Tensor):
        return f"{name} is a {type(t).__name__}, not a torch.Tensor"
    if t.dtype != dtype:
        return f"{name} has dtype {t.dtype}, expected {dtype}"
    if t.shape != shape:
        return f"{name} has shape {tuple(t.shape)}, expected {shape}"
    return (f"{name} has strides {t.stride()}, the kernel reads it with strides {strides} "
            "(dimensions of length 1 excepted)")


def can_implement(data) -> tuple:
    """(True, "") if `custom_kernel(data)` can run this input, else (False, reason).

    The one statement of the constraint set (with `_group_spec`). Pure Python on tensor metadata; needs no
    GPU. Per group: problem size (m, n, k, l) a 4-tuple of ints with L == 1, M >= 1, N % 128 == 0,
    K % 256 == 0; dtypes and shapes of all seven tensors; the strides the kernel reads a, b, c and both
    blocked scales with. The plain scales are not read: only their dtype and shape are checked, and they
    may stay on the CPU, as the task's generator leaves them. Then every tensor the kernel reads must be on
    one CUDA device with 16-byte aligned data. Layouts of all groups are checked before devices, so a
    wrong layout is reported as such on CPU tensors too.
    """
    if not (isinstance(data, (tuple, list)) and len(data) == 4):
        return False, "data must be a 4-tuple (abc_tensors, sfasfb_tensors, sfasfb_reordered_tensors, problem_sizes)"
    names = ("abc_tensors", "sfasfb_tensors", "sfasfb_reordered_tensors", "problem_sizes")
    for name, part in zip(names, data):
        if not isinstance(part, (list, tuple)):
            return False, f"{name} must be a list, got {type(part).__name__}"
    abc, sfasfb, sfasfb_r, sizes = data
    if len(sizes) == 0:
        return False, "no groups: problem_sizes is empty"
    lengths = [len(part) for part in data]
    if len(set(lengths)) != 1:
        return False, "the four lists differ in length: " + ", ".join(f"{n}={v}" for n, v in zip(names, lengths))
    tile_m, tile_n = SM100_CONFIG.tile_mn
    num_tiles = 0
    for i, size in enumerate(sizes):
        if not (isinstance(size, (tuple, list)) and len(size) == 4 and all(type(v) is int for v in size)):
            return False, f"group {i}: problem size {size!r} is not a 4-tuple of ints (m, n, k, l)"
        size = tuple(size)
        for part, arity, what in ((abc, 3, "(a, b, c)"), (sfasfb, 2, "(sfa, sfb)"),
                                  (sfasfb_r, 2, "(sfa_reordered, sfb_reordered)")):
            if not (isinstance(part[i], (tuple, list)) and len(part[i]) == arity):
                return False, f"{_where(i, size)}: entry must be {what}"
        reason, spec = _group_spec(size)
        if reason:
            return False, f"{_where(i, size)}: {reason}"
        tensors = (*abc[i], *sfasfb[i], *sfasfb_r[i])
        for name, t, (dtype, shape, strides) in zip(GROUP_TENSOR_NAMES, tensors, spec):
            # Exact strides first: the generator's; the general test only when they differ.
            if not (isinstance(t, torch.Tensor) and t.dtype == dtype and t.shape == shape
                    and (strides is None or t.stride() == strides or _strides_match(t, strides))):
                return False, f"{_where(i, size)}: {_tensor_reason(name, t, dtype, shape, strides)}"
        num_tiles += ceil_div(size[0], tile_m) * ceil_div(size[1], tile_n)
    if num_tiles >= 2**31:
        return False, f"{num_tiles} output tiles in all: more than one launch grid holds"
    device = abc[0][0].device
    if device.type != "cuda":
        return False, f"the tensors are on {device}: the kernel needs every tensor it reads on one CUDA device"
    for i in range(len(sizes)):
        for name, t in zip(KERNEL_TENSOR_NAMES, (*abc[i], *sfasfb_r[i])):
            if t.device != device:
                return False, (f"{_where(i, sizes[i])}: {name} is on {t.device}, group 0's a is on {device}; the "
                               "kernel needs every tensor it reads on one CUDA device")
            if t.data_ptr() % GMEM_ALIGN_BYTES:
                return False, (f"{_where(i, sizes[i])}: {name} data is not {GMEM_ALIGN_BYTES}-byte aligned "
                               "(TMA needs it)")
    return True, ""


# ---------------------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------------------
def _build_sm100_launch_metadata(data, device: torch.device, kernel_key: tuple) -> LaunchMetadata:
    config = kernel_key[3]
    ptr_table, size_table = pack_group_metadata(data, device)
    num_tiles = num_output_tiles(data[3], config.tile_mn)
    workspace = aligned_device_buffer(Sm100BlockScaledGroupedGemmKernel.tensormap_workspace_bytes(num_tiles),
                                      TENSORMAP_BYTES, device)
    launch_args = (
        gmem_ptr(cutlass.Int64, ptr_table.data_ptr(), METADATA_ALIGN_BYTES),
        gmem_ptr(cutlass.Int32, size_table.data_ptr(), METADATA_ALIGN_BYTES),
        gmem_ptr(cutlass.Int64, workspace.data_ptr(), TENSORMAP_BYTES),
        num_tiles,
    )
    return LaunchMetadata(ptr_table, size_table, workspace, num_tiles, launch_args, kernel_key)


def _build_sm90_launch_metadata(data, device: torch.device, kernel_key: tuple) -> LaunchMetadata:
    config = kernel_key[3]
    ptr_table, size_table = pack_group_metadata(data, device)
    num_tiles = num_output_tiles(data[3], config.tile_mn)
    grid = min(num_tiles, _num_sms(device.index))  # persistent: one CTA per SM at most
    workspace = aligned_device_buffer(grid * Sm90BlockScaledGroupedGemmKernel.DESCS_PER_CTA * TENSORMAP_BYTES,
                                      TENSORMAP_BYTES, device)
    launch_args = (
        gmem_ptr(cutlass.Int64, ptr_table.data_ptr(), METADATA_ALIGN_BYTES),
        gmem_ptr(cutlass.Int32, size_table.data_ptr(), METADATA_ALIGN_BYTES),
        gmem_ptr(cutlass.Int64, workspace.data_ptr(), TENSORMAP_BYTES),
        cutlass.Int32(num_tiles),
        cutlass.Int32(grid),
    )
    return LaunchMetadata(ptr_table, size_table, workspace, num_tiles, launch_args, kernel_key)


def choose_sm90_config(problem_sizes, num_sms: int) -> Sm90GemmConfig:
    """Larger tiles convert less per MMA but fill the SMs worse: the fewer estimated tile rounds wins."""
    small, large = KERNEL_VARIANTS["sm_90"]["tile128"], KERNEL_VARIANTS["sm_90"]["tile256"]
    if any(n % large.tile_mn[1] for _, n, _, _ in problem_sizes):
        return small
    rounds_small = ceil_div(num_output_tiles(problem_sizes, small.tile_mn), num_sms)
    rounds_large = ceil_div(num_output_tiles(problem_sizes, large.tile_mn), num_sms)
    return large if rounds_large * SM90_TILE256_COST < rounds_small else small


def launch_metadata(data, device: torch.device) -> LaunchMetadata:
    """The cached launch metadata of `data` on `device`, with the compile key of the kernel it is for."""
    arch = _target_arch(device)
    sizes = data[3]
    if arch.startswith("sm_90"):
        config, build = choose_sm90_config(sizes, _num_sms(device.index)), _build_sm90_launch_metadata
    else:
        config, build = SM100_CONFIG, _build_sm100_launch_metadata
    kernel_key = compile_key(len(sizes), arch, config)
    return cached_launch_metadata(launch_metadata_key(data, config.tile_mn),
                                  lambda: build(data, device, kernel_key))


def custom_kernel(data: input_t) -> output_t:
    """GPU MODE entry point: writes every group's C = (A * SFA) @ (B * SFB)^T and returns the list of C.

    Raises ValueError(reason) when `can_implement` rejects the input, UnsupportedDeviceError on a GPU that
    is neither Blackwell (sm_100) nor Hopper (sm_90); both before anything is compiled or launched.
    """
    ok, reason = can_implement(data)
    if not ok:
        raise ValueError(reason)
    abc_tensors = data[0]
    device = abc_tensors[0][0].device
    _check_device(device)
    meta = launch_metadata(data, device)
    compiled_kernel(meta.kernel_key)(*meta.launch_args)
    return [c for _, _, c in abc_tensors]
