#!POPCORN leaderboard nvfp4_group_gemm
#!POPCORN gpu B200
"""NVFP4 block-scaled grouped GEMM for the GPU MODE `nvfp4_group_gemm` task, in CuTe DSL: for every group g,
C_g[m, n] = sum_k (A_g[m, k] * SFA_g[m, k // 16]) * (B_g[n, k] * SFB_g[n, k // 16]), A_g and B_g e2m1 (two per
byte, K contiguous), one e4m3 scale per 16 k (read in the blocked tcgen05 layout, `sfasfb_reordered_tensors`),
fp32 accumulation, fp16 C_g written in place. Constraints: `can_implement`.

On a B200 (sm_100a) it runs the kernel variant `KERNEL_VARIANT`: "persistent" (the default,
`Sm100PersistentGroupedGemmKernel`, one CTA per SM over every group's tiles, its tile chosen per weight shape
by `choose_sm100_config`; "persistent_n64", "persistent_n128", "persistent_n256" force one) or "seed"
(`Sm100BlockScaledGroupedGemmKernel`, one CTA per 128x128 tile, the last fallback). No B200 has run it yet.
On Hopper (sm_90a) the backend in `submission_sm90.py`, loaded from beside this file, runs the same host path.
Every kernel runs on the legacy default queue of the current device (README.md, "Which GPU queue").
NOTES: docs/B200_DESIGN.md#module-overview (the longer overview: constraints, variants, host path, queue).

How to use it (each function's docstring has the details):
    custom_kernel(data)      GPU MODE entry point; data = (abc, sfasfb, sfasfb_reordered, problem_sizes)
    can_implement(data)      (ok, reason) on CPU or GPU tensors; check_problem_sizes(sizes): its size rules
    set_variant(name)        one of KERNEL_VARIANTS (NVFP4_KERNEL_VARIANT; default: DEFAULT_KERNEL_VARIANT)
    set_launch_path(name) / set_pdl(on)   LAUNCH_PATHS (NVFP4_LAUNCH_PATH); programmatic launch (NVFP4_PDL=0: off)
    compile_for(num_groups, arch=None, variant=None)   build only (CUTE_DSL_ARCH=sm_100a builds without a GPU)
Builds with nvidia-cutlass-dsl 4.3.5, 4.5.2 and 4.8.1.
"""
import array
import contextlib
import ctypes
import dataclasses
import enum
import functools
import importlib.metadata
import importlib.util
import os
import sys
from collections import OrderedDict, deque
from itertools import chain, compress
from operator import attrgetter, eq, is_, or_
from typing import Callable, Optional

import torch

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_utils
import cutlass.utils.blockscaled_layout as blockscaled_utils
from cutlass._mlir import ir
from cutlass._mlir.dialects import cute as cute_ir, cute_nvgpu as cute_nvgpu_ir
from cutlass.cute.nvgpu import cpasync, tcgen05
from cutlass.cute.runtime import make_ptr

try:
    from task import input_t, output_t
except ImportError:  # installed as a library (pip install): the runner's task.py is absent; the same names, unbound
    from typing import TypeVar

    input_t, output_t = TypeVar("input_t"), TypeVar("output_t")

# ---------------------------------------------------------------------------------------------------------
# DSL version shims: every difference between nvidia-cutlass-dsl 4.3.x and 4.8.x that this file meets.
# ---------------------------------------------------------------------------------------------------------
try:  # 4.8: allocators moved to cutlass.memory (cutlass.utils keeps deprecated aliases)
    from cutlass.memory import SmemAllocator, TmemAllocator
except ImportError:  # 4.3
    from cutlass.utils import SmemAllocator, TmemAllocator
try:  # 4.8: tensormap helpers and LayoutEnum moved to cutlass.tensor_utils
    from cutlass.tensor_utils import LayoutEnum, TensorMapManager, TensorMapUpdateMode
except ImportError:  # 4.3
    from cutlass.utils import LayoutEnum, TensorMapManager, TensorMapUpdateMode

DSL_VERSION = importlib.metadata.version("nvidia-cutlass-dsl")


def fence_smem_for_async_proxy():
    """Orders this thread's shared-memory stores before later async-proxy reads (TMA store). 4.3 takes enums
    (cute.arch.ProxyKind / SharedSpace), 4.8 takes strings ("async.shared", "cta")."""
    if hasattr(cute.arch, "ProxyKind"):
        cute.arch.fence_proxy(cute.arch.ProxyKind.async_shared, space=cute.arch.SharedSpace.shared_cta)
    else:
        cute.arch.fence_proxy("async.shared", space="cta")


# ---------------------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------------------
def _choice_from_env(variable: str, default: str, choices: tuple, other: Optional[tuple] = None) -> str:
    """Environment variable `variable` (`default` when unset or empty), which must be one of `choices`.
    `other`: (the other arch's variable, what its variants are called, a test of a name that belongs there)."""
    value = os.environ.get(variable) or default
    if value not in choices:
        if other is not None and other[2](value):
            raise ValueError(f"{variable}={value!r}: {other[1]} variants are set with {other[0]}, not {variable}, "
                             f"which takes one of {', '.join(choices)}")
        raise ValueError(f"{variable}={value!r}: choose one of {', '.join(choices)}")
    return value


def _check_choice(what: str, name: str, choices: tuple) -> None:
    if name not in choices:
        raise ValueError(f"unknown {what} {name!r}; choose one of {', '.join(choices)}")


# Programmatic dependent launch for the persistent kernels (both arches; docs/B200_DESIGN.md#persistent-kernel).
# Off with NVFP4_PDL=0 at import or set_pdl() (both builds stay cached).
USE_PDL = _choice_from_env("NVFP4_PDL", "1", ("0", "1")) == "1"


def set_pdl(on: bool) -> None:
    """Launch the persistent kernels with (True) or without programmatic dependent launch from now on."""
    global USE_PDL
    if not isinstance(on, bool):  # "0" or "off" are truthy: converted, they would silently turn PDL on
        raise TypeError(f"set_pdl() takes True or False, not {on!r} ({type(on).__name__})")
    USE_PDL = on


def _check_setter_name(setter: str, what: str, name, choices: tuple) -> None:
    """A setter's argument: a str (TypeError otherwise) that is one of `choices` (ValueError otherwise)."""
    if not isinstance(name, str):
        raise TypeError(f"{setter}() takes a {what} name (str), one of {', '.join(choices)}; not {name!r} "
                        f"({type(name).__name__})")
    _check_choice(what, name, choices)

# Hardware budgets (the CUDA occupancy tables): 227 KiB of shared memory per block, static and dynamic
# together, on sm_100 and on sm_90 alike; an sm_100 SM's 512 tensor-memory columns of 128 lanes x 32 bit.
SMEM_CAPACITY = 232448
SM100_TMEM_COLUMNS = 512
# Static shared memory the DSL gives every kernel built here (cuobjdump -res-usage SHARED), outside the
# dynamic allocation the kernel sizes itself.
DSL_STATIC_SMEM_BYTES = 1024
DYNAMIC_SMEM_BUDGET = SMEM_CAPACITY - DSL_STATIC_SMEM_BYTES


@dataclasses.dataclass(frozen=True)
class Sm100TileConfig:
    """What both Blackwell kernels' configurations have: the tcgen05 block-scaled tile and the dtypes."""

    # (M, N, K) of one CTA's output tile and K step. M = 128 is one 1-CTA tcgen05 MMA; K = 256 is four
    # 64-deep NVFP4 instructions and one 128-byte swizzle row of fp4 per operand row.
    mma_tiler_mnk: tuple = (128, 128, 256)
    mma_inst_k: int = 64
    sf_vec_size: int = 16
    ab_dtype: type = cutlass.Float4E2M1FN
    sf_dtype: type = cutlass.Float8E4M3FN
    c_dtype: type = cutlass.Float16
    acc_dtype: type = cutlass.Float32

    @property
    def tile_mn(self) -> tuple:
        return self.mma_tiler_mnk[:2]

    @property
    def mma_tiler_sfb(self) -> tuple:
        """The tile SFB is loaded with: N rounded up to whole 128-row scale blocks (tcgen05 reads the scales
        of 128 rows of B at a time; an N = 64 tile uses half of a block, CUTLASS's dense example's scheme)."""
        tile_m, tile_n, tile_k = self.mma_tiler_mnk
        return (tile_m, ceil_div(tile_n, 128) * 128, tile_k)


@dataclasses.dataclass(frozen=True)
class Sm100GemmConfig(Sm100TileConfig):
    """Compile-time configuration of the seed kernel `Sm100BlockScaledGroupedGemmKernel`."""

    # NOTES: warp 0 both loads and multiplies, waiting on each load before its MMAs, so more stages would
    # buy nothing until loading and MMA get their own warps (they do in the persistent kernel).
    num_ab_stages: int = 1
    # One output tile per CTA, so one accumulator.
    num_acc_stages: int = 1
    # Four warps: one thread per accumulator row (tensor-memory lane) in the epilogue.
    threads_per_cta: int = 128
    # NOTES: the accumulator (128 fp32 columns) and both scale tensors would fit in 256 columns; the seed's
    # 512 (all of an SM's tensor memory) is kept in this reorganisation, so co-resident CTAs take turns.
    num_tmem_cols: int = 512

    def __post_init__(self):
        # The kernel is written and checked for exactly these values; anything else needs new work.
        supported = dict(mma_tiler_mnk=(128, 128, 256), mma_inst_k=64, num_ab_stages=1, num_acc_stages=1,
                         threads_per_cta=128, sf_vec_size=16)
        for name, value in supported.items():
            if getattr(self, name) != value:
                raise ValueError(f"Sm100GemmConfig.{name}={getattr(self, name)!r}: only {value!r} is supported")


@dataclasses.dataclass(frozen=True)
class Sm100PersistentConfig(Sm100TileConfig):
    """Compile-time configuration of `Sm100PersistentGroupedGemmKernel` (everything baked in but G).
    The stage counts are properties derived from the shared-memory budget (DYNAMIC_SMEM_BUDGET), not fields."""

    # Two accumulators in tensor memory: the epilogue drains tile i while the MMA warp fills tile i + 1.
    # (N = 256 fits one: 2 x 256 columns leave none for the scales.)
    num_acc_stages: int = 2
    # Output written in 128 x 32 fp16 slices (8 KiB): what sm100_utils.compute_epilogue_tile_shape picks
    # for an fp16 row-major C without source; checked against the DSL's layout at build time.
    epi_tile_n: int = 32
    # At least two C slices in flight; spare shared memory adds more.
    min_c_stages: int = 2
    # Barriers (2 per A/B and accumulator stage) and the tensor-memory address fit in the first 1 KiB,
    # ahead of the 1024-byte aligned buffers.
    smem_header_bytes: int = 1024
    # Programmatic dependent launch (USE_PDL).
    use_pdl: bool = USE_PDL
    # The MoE entry's switches (moe.py; custom_kernel's leaves them off): the tile count from the int32 after the
    # descriptor rows (written on the GPU), not the launch's; each group's C times the fp32 in its size row's L.
    device_tile_count: bool = False
    group_alpha: bool = False

    # Passing a stage count gets this error, not the dataclass's bare "unexpected keyword argument".
    _DERIVED_FIELDS = ("num_ab_stages", "num_c_stages")

    def __new__(cls, *args, **kwargs):
        derived = [name for name in cls._DERIVED_FIELDS if name in kwargs]
        if derived:
            raise TypeError(f"{cls.__name__}({derived[0]}=...): the stage counts are derived from the shared-memory "
                            "budget (DYNAMIC_SMEM_BUDGET), not set: they follow from mma_tiler_mnk, epi_tile_n, "
                            "min_c_stages and smem_header_bytes")
        return super().__new__(cls)

    def __post_init__(self):
        tile_m, tile_n, tile_k = self.mma_tiler_mnk
        # NOTES: only the 1-CTA, M = 128 MMA is written, N = 64, 128 or 256 (docs/B200_DESIGN.md#persistent-kernel).
        if (tile_m != 128 or tile_n not in (64, 128, 256) or tile_k != 256 or self.mma_inst_k != 64
                or self.sf_vec_size != 16):
            raise ValueError(f"Sm100PersistentConfig: tile {self.mma_tiler_mnk} / inst_k {self.mma_inst_k} / "
                             f"sf_vec {self.sf_vec_size}: only (128, 64|128|256, 256) / 64 / 16 is built and checked")
        if self.tmem_cols_used > SM100_TMEM_COLUMNS:
            raise ValueError(f"{self.tmem_cols_used} tensor-memory columns needed, {SM100_TMEM_COLUMNS} exist")
        if self.num_ab_stages < 2:
            raise ValueError("fewer than 2 A/B stages fit in shared memory")

    @property
    def ab_stage_bytes(self) -> int:
        """A, B (fp4) and SFA, SFB (one e4m3 per 16 k, rows padded to 128) of one K step."""
        tile_m, tile_n, tile_k = self.mma_tiler_mnk
        sf_rows = tile_m + ceil_div(tile_n, 128) * 128
        return (tile_m + tile_n) * tile_k // 2 + sf_rows * tile_k // self.sf_vec_size

    @property
    def c_stage_bytes(self) -> int:
        return self.mma_tiler_mnk[0] * self.epi_tile_n * self.c_dtype.width // 8

    @property
    def num_ab_stages(self) -> int:
        free = DYNAMIC_SMEM_BUDGET - self.smem_header_bytes - self.min_c_stages * self.c_stage_bytes
        return free // self.ab_stage_bytes

    @property
    def num_c_stages(self) -> int:
        free = DYNAMIC_SMEM_BUDGET - self.smem_header_bytes - self.num_ab_stages * self.ab_stage_bytes
        return free // self.c_stage_bytes

    @property
    def smem_bytes(self) -> int:
        return (self.smem_header_bytes + self.num_ab_stages * self.ab_stage_bytes
                + self.num_c_stages * self.c_stage_bytes)

    @property
    def tmem_cols_used(self) -> int:
        """Accumulators (one fp32 column per output column) plus one K step of SFA and SFB: a 128-row x
        4-scale block takes 4 columns (32 lanes x 16 bytes, copied to all four lane quarters)."""
        tile_m, tile_n, tile_k = self.mma_tiler_mnk
        sf_cols_per_128_rows = tile_k // self.sf_vec_size // 4 * 4
        return self.num_acc_stages * tile_n + sf_cols_per_128_rows * (ceil_div(tile_m, 128) + ceil_div(tile_n, 128))

    @property
    def tmem_alloc_cols(self) -> int:
        """The allocation: a power of two of at least 32 columns."""
        cols = 32
        while cols < self.tmem_cols_used:
            cols *= 2
        return cols


def ceil_div(a: int, b: int) -> int:
    return (a + b - 1) // b


class Sm100Warp(enum.IntEnum):
    """Warp roles of the persistent kernel (warps 0-3: epilogue, one thread per accumulator row)."""

    EPILOGUE0 = 0
    EPILOGUE1 = 1
    EPILOGUE2 = 2
    EPILOGUE3 = 3
    MMA = 4
    TMA = 5


SM100_CONFIG = Sm100GemmConfig()

# Blackwell tile table: the rows "persistent" chooses from per weight shape (choose_sm100_config), 1-CTA 128-row
# MMAs (N = 256 leaves tensor memory for one accumulator), stage counts derived from the shared-memory budget.
SM100_TILE_N64 = Sm100PersistentConfig(mma_tiler_mnk=(128, 64, 256))
SM100_TILE_N128 = Sm100PersistentConfig(mma_tiler_mnk=(128, 128, 256))
SM100_TILE_N256 = Sm100PersistentConfig(mma_tiler_mnk=(128, 256, 256), num_acc_stages=1)
SM100_TILE_TABLE = (SM100_TILE_N128, SM100_TILE_N64, SM100_TILE_N256)  # the first is the default row

# The kernels custom_kernel can run, a fallback ladder newest first (set_variant switches; every variant's
# kernels stay cached). "persistent"'s config is the default row compile_for builds (docs/B200_DESIGN.md#1-what-runs).
VARIANT_CONFIGS = {
    "persistent": SM100_TILE_N128,
    "persistent_n64": SM100_TILE_N64,
    "persistent_n128": SM100_TILE_N128,
    "persistent_n256": SM100_TILE_N256,
    "seed": SM100_CONFIG,
}
TILE_TABLE_VARIANTS = frozenset({"persistent"})  # variants whose tile comes from the table
KERNEL_VARIANTS = tuple(VARIANT_CONFIGS)


# The default variant, on the one marked line `eval.py export --variant NAME -o FILE` rewrites (or edit it by hand).
DEFAULT_KERNEL_VARIANT = "persistent"  # eval.py export --variant NAME rewrites this line
# Every Hopper variant's name starts so (submission_sm90.SM90_VARIANTS): set_variant and NVFP4_KERNEL_VARIANT
# name the Hopper setter and variable.
SM90_VARIANT_PREFIX = "sm90_"
KERNEL_VARIANT = _choice_from_env("NVFP4_KERNEL_VARIANT", DEFAULT_KERNEL_VARIANT, KERNEL_VARIANTS,
                                  ("NVFP4_SM90_VARIANT", "Hopper (sm90_*)", lambda n: n.startswith(SM90_VARIANT_PREFIX)))


def set_variant(name: str) -> None:
    """Select the kernel custom_kernel launches from now on (one of KERNEL_VARIANTS)."""
    global KERNEL_VARIANT
    if isinstance(name, str) and name.startswith(SM90_VARIANT_PREFIX):
        raise ValueError(f"{name!r} is a Hopper variant: use submission_sm90.set_sm90_variant({name!r}); set_variant "
                         f"takes a B200 kernel variant, one of {', '.join(KERNEL_VARIANTS)}")
    _check_setter_name("set_variant", "kernel variant", name, KERNEL_VARIANTS)
    KERNEL_VARIANT = name


# B200 model behind the tile table (docs/B200_DESIGN.md, section 4; unverified until measured on a B200).
SM100_CLOCK_HZ = 1.5e9
SM100_MMA_CYCLES_PER_N = 2  # a 128 x N x 256 NVFP4 K step at 32768 dense FP4 FLOP per clock per SM
SM100_SM_FEED_BYTES_PER_CYCLE = 200e9 / SM100_CLOCK_HZ  # assumed L2 -> one SM's shared memory rate
# NOTES: measured on the competition's B200, not a datasheet's (docs/B200_DESIGN.md#model-constants).
SM100_DRAM_BYTES_PER_S = 5914.80e9
# NOTES: per call as the runner times it, as the best documented entry implies it (docs/B200_DESIGN.md#model-constants).
SM100_FIXED_US = 4.5
# A row other than the default must beat it by this much in the model to be chosen.
SM100_TILE_MARGIN = 0.05


def sm100_k_step_cycles(config: Sm100TileConfig) -> float:
    """Cycles of one 256-deep K step of one tile: the MMA or the feed of its A/B/SFA/SFB bytes."""
    tile_m, tile_n, _ = config.mma_tiler_mnk
    return max(SM100_MMA_CYCLES_PER_N * tile_n, config.ab_stage_bytes / SM100_SM_FEED_BYTES_PER_CYCLE)


def sm100_predicted_us(problem_sizes, config: Sm100TileConfig, num_sms: int) -> float:
    """Modelled time (µs) per call of the persistent kernel, as the runner times it: the busiest CTA of the
    static round-robin (tiles b, b + grid, ...), or the DRAM traffic of the whole problem if that takes
    longer, plus SM100_FIXED_US. An empty group (M = 0) has no tile, so its weights (B, SFB) are never read."""
    step_us = sm100_k_step_cycles(config) / SM100_CLOCK_HZ * 1e6
    tile_m, tile_n, tile_k = config.mma_tiler_mnk
    costs = []
    for m, n, k, _ in problem_sizes:
        costs += [ceil_div(k, tile_k) * step_us] * (ceil_div(m, tile_m) * ceil_div(n, tile_n))
    grid = min(len(costs), num_sms)
    busiest = max((sum(costs[cta::grid]) for cta in range(grid)), default=0.0)  # every group empty: no tile
    dram_bytes = sum((m + n) * k // 2 + (m + n) * k // config.sf_vec_size + 2 * m * n
                     for m, n, k, _ in problem_sizes if m)
    return max(busiest, dram_bytes / SM100_DRAM_BYTES_PER_S * 1e6) + SM100_FIXED_US


def choose_sm100_config(problem_sizes, num_sms: int) -> Sm100PersistentConfig:
    """The tile-table row the model predicts fastest; the default row unless another beats it by
    SM100_TILE_MARGIN. N = 256 is a candidate only when every N is a multiple of 256."""
    return _choose_sm100_config(tuple(tuple(size) for size in problem_sizes), num_sms)


@functools.lru_cache(maxsize=256)
def _choose_sm100_config(problem_sizes: tuple, num_sms: int) -> Sm100PersistentConfig:
    default = SM100_TILE_TABLE[0]
    best, best_us = default, sm100_predicted_us(problem_sizes, default, num_sms) * (1 - SM100_TILE_MARGIN)
    for row in SM100_TILE_TABLE[1:]:
        if any(n % row.tile_mn[1] for _, n, _, _ in problem_sizes):
            continue
        row_us = sm100_predicted_us(problem_sizes, row, num_sms)
        if row_us < best_us:
            best, best_us = row, row_us
    return best


def variant_config(variant: str):
    return VARIANT_CONFIGS[variant]


# TMA needs 16-byte aligned global addresses; the kernel assumes it of every operand and of C.
GMEM_ALIGN_BYTES = 16
# A TMA descriptor is 128 bytes on a 128-byte boundary; DSL 4.8 wants that proven by the pointer types.
TENSORMAP_BYTES = 128
# The pointer and size tables are read as int64 / int32 rows; 16 bytes is what torch always gives.
METADATA_ALIGN_BYTES = 16
# K a multiple of the tile's K, as the task guarantees: only whole K tiles were built and reasoned about.
K_MULTIPLE = 256
# N a multiple of the tile's N: partial N tiles are never built.
N_MULTIPLE = 128

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


def num_output_tiles(sizes, tile_mn: tuple) -> int:
    return sum(ceil_div(m, tile_mn[0]) * ceil_div(n, tile_mn[1]) for m, n, _, _ in sizes)


def table_words(num_groups: int) -> tuple:
    """(words before the size table, words in all): pointer table [G, PtrColumn] padded to 16 bytes, size table."""
    ptr_words = ceil_div(num_groups * len(PtrColumn), 2) * 2
    return ptr_words, ptr_words + num_groups * len(SizeColumn) // 2


# The kernels' queue: the DSL launches them with handle 0, the legacy default queue of the current device; 1 is
# the driver's explicit handle of that queue (cuda.h's CU_..._LEGACY), whatever per-thread defaults are built in.
LEGACY_DEFAULT_QUEUE = 1


def _cuda_driver():
    """cuda-python's driver bindings: a dependency of the DSL, which imports them itself."""
    try:
        from cuda.bindings import driver
    except ImportError:  # cuda-python before 12.6 named the module cuda.cuda
        from cuda import cuda as driver
    return driver


class KernelQueueEvent:
    """A CUDA event recorded on the kernels' queue (LEGACY_DEFAULT_QUEUE of the current device) through the
    driver, not on torch's current queue; remade in a new context (docs/B200_DESIGN.md#host-path-helpers)."""

    _driver = None
    _flags = 2  # CU_EVENT_DISABLE_TIMING: a cheaper record, and no timing is read

    def __init__(self):
        KernelQueueEvent._driver = KernelQueueEvent._driver or _cuda_driver()
        self.handle = None

    def _check(self, result: tuple, what: str):
        if int(result[0]) != 0:
            raise RuntimeError(f"{what} failed: {result[0]!r}")
        return result[1] if len(result) > 1 else None

    def record(self) -> None:
        driver = self._driver
        if self.handle is not None:
            result = driver.cuEventRecord(self.handle, LEGACY_DEFAULT_QUEUE)
            if int(result[0]) == 0:
                return
            invalid = (driver.CUresult.CUDA_ERROR_INVALID_HANDLE, driver.CUresult.CUDA_ERROR_INVALID_CONTEXT)
            if result[0] not in invalid:
                self._check(result, "cuEventRecord")
            self.close()  # made in another context
        self.handle = self._check(driver.cuEventCreate(self._flags), "cuEventCreate")
        self._check(driver.cuEventRecord(self.handle, LEGACY_DEFAULT_QUEUE), "cuEventRecord")

    def query(self) -> bool:  # True when all work the last record captured has completed (or none was recorded)
        if self.handle is None:
            return True
        result = self._driver.cuEventQuery(self.handle)
        if result[0] == self._driver.CUresult.CUDA_ERROR_NOT_READY:
            return False
        self._check(result, "cuEventQuery")
        return True

    def synchronize(self) -> None:  # blocks the host until the recorded work has completed
        if self.handle is not None:
            self._check(self._driver.cuEventSynchronize(self.handle), "cuEventSynchronize")

    def close(self) -> None:
        handle, self.handle = self.handle, None
        if handle is not None:
            with contextlib.suppress(Exception):  # the driver may already be shut down at interpreter exit
                self._driver.cuEventDestroy(handle)

    def __del__(self):
        self.close()


class PinnedTableRing:
    """Pinned host memory for the tables' staging copies, allocated once (page-locking per miss would cost a
    driver call each), handed out round-robin in 16-byte pieces of `words`. A piece is not handed out again
    while its upload may be pending: `uploaded()` records an event, `take()` waits for older pieces' events
    (NOTES: docs/B200_DESIGN.md#host-path-helpers). `new_event`: default `KernelQueueEvent`, a test's fake."""

    def __init__(self, words: int, new_event: Optional[Callable[[], object]] = None):
        self.words = words
        self.new_event = new_event or KernelQueueEvent
        self.buffer = None
        self.next = 0  # offset of the next piece in this lap
        self.lap = 0
        # [lap * words + offset, event or None] of every piece that may still be read, oldest first; None
        # until `uploaded()` (a piece whose upload was never launched is read by nothing).
        self.pending = deque()
        self.spare = []  # events whose recorded work has completed, for the next records

    def take(self, words: int) -> torch.Tensor:
        if self.buffer is None:
            self.buffer = torch.empty(self.words, dtype=torch.int64, pin_memory=True)
        words = ceil_div(words, 2) * 2
        if words > self.words:
            raise ValueError(f"{words} table words exceed the staging ring ({self.words})")
        if self.next + words > self.words:
            self.next, self.lap = 0, self.lap + 1
        start = self.lap * self.words + self.next
        # Pieces never straddle the ring's end, so every earlier piece sharing a word with this one began
        # before start + words - self.words in the ring's linear order (it is at least a lap older).
        self._retire(start + words - self.words)
        piece = self.buffer[self.next:self.next + words]
        self.pending.append([start, None])
        self.next += words
        return piece

    def uploaded(self) -> None:
        """Records the event of the piece last taken; call right after launching the upload that reads it."""
        entry = self.pending[-1]
        if entry[1] is not None:
            raise RuntimeError("uploaded() called twice for one piece")
        event = self.spare.pop() if self.spare else self.new_event()
        event.record()
        entry[1] = event

    def _retire(self, before: int) -> None:
        """Waits for the uploads of every pending piece that began before linear position `before`."""
        pending = self.pending
        count = next((i for i, entry in enumerate(pending) if entry[0] >= before), len(pending))
        for i in range(count - 1, -1, -1):  # newest first; dropped only once all are done (an error keeps them)
            event = pending[i][1]
            if event is not None and not event.query():
                event.synchronize()
        self.spare.extend(event for event in [pending.popleft()[1] for _ in range(count)] if event is not None)


# 4 MiB: 1,170 tables of 64 groups, 9,362 of 8 groups.
TABLE_RING_WORDS = 1 << 19
_table_ring = PinnedTableRing(TABLE_RING_WORDS)


def _int_tensor(typecode: str, values: tuple) -> torch.Tensor:
    """A CPU tensor of `values` (at least one) as array.array `typecode` ("q": int64, "i": int32) stores them.
    NOTES: torch.tensor parses element by element (~0.2 ms for 256 groups); array.array is one C loop."""
    return torch.frombuffer(array.array(typecode, values), dtype=torch.int64 if typecode == "q" else torch.int32)


def pack_group_metadata(contents: tuple, device: torch.device, work_words: Optional[torch.Tensor] = None) -> tuple:
    """The two tables every kernel reads, from `contents` (`launch_metadata_key`'s: the groups' pointers
    column by column and their sizes group by group), then the GEMM's `work_words` where it has them:
    (staging piece, device buffer, pointer table [G, PtrColumn], size table [G, SizeColumn], work list or None);
    the caller uploads the piece (`TableUploadKernel`), then calls `_table_ring.uploaded()`."""
    pointers, sizes = contents
    num_groups = len(sizes) // len(SizeColumn)
    ptr_words, words = table_words(num_groups)
    work_len = 0 if work_words is None else work_words.numel()
    if words + ceil_div(work_len, 2) > _table_ring.words:
        # NOTES: a work list too long for the staging ring (over ~130k tiles: a problem that keeps the GPU
        # busy for tens of milliseconds) goes up by an ordinary torch copy, which waits for the device.
        staging, tables, ptr_table, size_table, _ = pack_group_metadata(contents, device)
        return staging, tables, ptr_table, size_table, work_words.to(device)
    staging = _table_ring.take(words + ceil_div(work_len, 2))
    staging[:num_groups * len(PtrColumn)].view(num_groups, len(PtrColumn)).t()[:] = (
        _int_tensor("q", pointers).view(len(PtrColumn), num_groups))
    staging[ptr_words:words].view(torch.int32)[:] = _int_tensor("i", sizes)
    if work_words is not None:
        staging[words:].view(torch.int32)[:work_len] = work_words
    tables = torch.empty(staging.numel(), dtype=torch.int64, device=device)
    ptr_table = tables[:num_groups * len(PtrColumn)].view(num_groups, len(PtrColumn))
    size_table = tables[ptr_words:words].view(torch.int32).view(num_groups, len(SizeColumn))
    work_list = None if work_words is None else tables[words:].view(torch.int32)[:work_len]
    return staging, tables, ptr_table, size_table, work_list


def aligned_device_buffer(num_bytes: int, align: int, device: torch.device) -> torch.Tensor:
    """Uninitialised int64 buffer of `num_bytes` whose first byte is `align`-aligned, whatever the allocator."""
    raw = torch.empty((num_bytes + align) // 8, dtype=torch.int64, device=device)
    skip = (-raw.data_ptr() % align) // 8
    return raw[skip: skip + num_bytes // 8]


def gmem_ptr(dtype, address: int, align: int):
    """A CuTe global-memory pointer argument; the alignment is part of the compiled kernel's signature."""
    return make_ptr(dtype, address, cute.AddressSpace.gmem, assumed_align=align)


def group_tables(ptr_table_ptr, size_table_ptr, num_groups: int) -> tuple:
    """The tables every kernel reads, as tensors: pointers int64 [G, PtrColumn], sizes int32 [G, SizeColumn]."""
    return (
        cute.make_tensor(ptr_table_ptr, cute.make_layout((num_groups, len(PtrColumn)), stride=(len(PtrColumn), 1))),
        cute.make_tensor(size_table_ptr, cute.make_layout((num_groups, len(SizeColumn)),
                                                          stride=(len(SizeColumn), 1))),
    )


def descriptor_table(workspace_ptr, num_rows, slots: int):
    """A TMA-descriptor workspace as a tensor: [rows, slot, 16 x int64], 128 bytes per descriptor."""
    words = TENSORMAP_BYTES // 8
    return cute.make_tensor(workspace_ptr, cute.make_layout((num_rows, slots, words), stride=(slots * words, words, 1)))


def kernel_tensors(abc, sfasfb_reordered) -> tuple:
    """The tensors the kernels read and write (KERNEL_TENSOR_NAMES, the PtrColumn order), a tuple per name."""
    a, b, c = zip(*abc)
    sfa_r, sfb_r = zip(*sfasfb_reordered)
    return a, b, c, sfa_r, sfb_r


def kernel_pointers(tensors: tuple) -> tuple:
    """The addresses of `kernel_tensors`, name after name: every group's a, then every b, c, blocked sfa and
    blocked sfb (the pointer table [G, PtrColumn] transposed)."""
    return tuple(map(torch.Tensor.data_ptr, chain.from_iterable(tensors)))


def launch_metadata_key(data, tile_mn: tuple = SM100_CONFIG.tile_mn, pointers: Optional[tuple] = None) -> tuple:
    """Everything the launch metadata (tables, descriptor workspace) is built from: (device, tile shape, the
    tables' contents: (`kernel_pointers`, given or read here, every group's (m, n, k, l) one after another))."""
    abc, _, sfasfb_r, sizes = data
    if pointers is None:
        pointers = kernel_pointers(kernel_tensors(abc, sfasfb_r))
    return (abc[0][0].device, tuple(tile_mn), (pointers, tuple(chain.from_iterable(sizes))))


@dataclasses.dataclass(frozen=True)
class LaunchMetadata:
    """Device data of one launch, kept alive as long as its cache entry."""

    tables: torch.Tensor  # device buffer of the pointer table int64 [G, PtrColumn] and size table int32 [G, SizeColumn]
    workspace: torch.Tensor  # TMA descriptors (seed: 4 per tile; persistent: 5 per group)
    num_tiles: int
    num_ctas: int
    launch_args: tuple  # plain ints the GEMM is launched with: the three table addresses, then its counts
    table_args: tuple  # the three table addresses: what a descriptor preparation kernel is launched with
    prepass_args: tuple = ()  # Hopper a16_prepass: `Sm90AConvertKernel`'s table addresses and grid x
    work_list: Optional[torch.Tensor] = None  # Hopper m_exact: the plan's words on the device, after the tables
    device_bytes: int = 0  # device memory the entry holds (tables, workspace, a work list of its own)


# Bounded by entries (the benchmark cycles through 15 input sets per shape) and by bytes (a Hopper workspace
# holds the call's A as fp16); the oldest go first, with their prepared calls (docs/B200_DESIGN.md#cache-bounds).
LAUNCH_METADATA_CACHE_SIZE = 64
LAUNCH_METADATA_CACHE_BYTES = 2 << 30
_launch_metadata: "OrderedDict[tuple, LaunchMetadata]" = OrderedDict()


def drop_oldest(cache: dict, max_entries: int, max_bytes: int, nbytes: Callable[[object], int]) -> list:
    """Drops `cache`'s oldest entries (its iteration order first) while it holds more than `max_entries`, or
    more than `max_bytes` by `nbytes` and more than one; returns them (NOTES: docs/B200_DESIGN.md#cache-bounds)."""
    held = sum(map(nbytes, dict.values(cache)))
    dropped = []
    while len(cache) > max_entries or (held > max_bytes and len(cache) > 1):
        old = cache.pop(next(iter(cache)))
        held -= nbytes(old)
        dropped.append(old)
    return dropped


def cached_launch_metadata(key: tuple, build: Callable[[], LaunchMetadata]) -> LaunchMetadata:
    """The entry for `key`, built on a miss; least recently used entries are dropped past the bounds."""
    entry = _launch_metadata.get(key)
    if entry is None:
        entry = _launch_metadata[key] = build()
        dropped = drop_oldest(_launch_metadata, LAUNCH_METADATA_CACHE_SIZE, LAUNCH_METADATA_CACHE_BYTES,
                              attrgetter("device_bytes"))
        if dropped:
            _forget_prepared_calls_of(dropped)
    else:
        _launch_metadata.move_to_end(key)
    return entry


# ---------------------------------------------------------------------------------------------------------
# Table upload (both arches): pinned host staging buffer -> device tables, on the kernels' queue
# ---------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class TableUploadConfig:
    """Compile-time configuration of `TableUploadKernel` (one build serves every group count)."""

    threads: int = 128


TABLE_UPLOAD_CONFIG = TableUploadConfig()


def upload_args(raw_args: tuple) -> tuple:
    """The DSL arguments of `TableUploadKernel` from (staging address, device table address, int64 words)."""
    staging, tables, num_words = raw_args
    return (*(gmem_ptr(cutlass.Int64, address, METADATA_ALIGN_BYTES) for address in (staging, tables)),
            cutlass.Int32(num_words))


class TableUploadKernel:
    """Copies a launch's tables (`table_words(G)` int64 words, then the GEMM's work list where it has one:
    `GemmSchedule.work_words`) from pinned host memory to the device, ahead of every kernel that reads them."""

    def __init__(self, config: TableUploadConfig):
        self.threads = config.threads

    @cute.jit
    def __call__(self, staging_ptr: cute.Pointer, tables_ptr: cute.Pointer, num_words: cutlass.Int32):
        staging = cute.make_tensor(staging_ptr, cute.make_layout(num_words))
        tables = cute.make_tensor(tables_ptr, cute.make_layout(num_words))
        self.kernel(staging, tables, num_words).launch(grid=(1, 1, 1), block=(self.threads, 1, 1))

    @cute.kernel
    def kernel(self, staging: cute.Tensor, tables: cute.Tensor, num_words: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        for word in cutlass.range(tidx, num_words, self.threads, unroll=1):
            tables[word] = staging[word]


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
    Group by group, M fastest; the grid is the total tile count, so the last group takes what is left."""
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


class GroupTileScheduler:
    """Static persistent schedule over the output tiles of all groups (arch-neutral).
    Tiles numbered group by group, M fastest; CTA b takes tiles b, b + grid, ..., every warp role walking them
    itself, a forward search finding each tile's group (docs/B200_DESIGN.md#group-tile-scheduler)."""

    def __init__(self, size_table: cute.Tensor, tile_m: int, tile_n: int):
        self.size_table = size_table
        self.tile_m = tile_m
        self.tile_n = tile_n

    # A DSL value (the role loops carry it): its runtime part is the size table.
    def __extract_mlir_values__(self):
        return cutlass.extract_mlir_values(self.size_table)

    def __new_from_mlir_values__(self, values):
        return GroupTileScheduler(cutlass.new_from_mlir_values(self.size_table, values), self.tile_m, self.tile_n)

    @cute.jit
    def tiles_in_group(self, group: cutlass.Int32) -> cutlass.Int32:
        m = self.size_table[group, int(SizeColumn.M)]
        n = self.size_table[group, int(SizeColumn.N)]
        return ((m + (self.tile_m - 1)) // self.tile_m) * ((n + (self.tile_n - 1)) // self.tile_n)

    @cute.jit
    def first_state(self):
        """(group, first tile of the group, tiles in the group) before any search: group 0."""
        return cutlass.Int32(0), cutlass.Int32(0), self.tiles_in_group(cutlass.Int32(0))

    @cute.jit
    def find_group(self, tile_idx: cutlass.Int32, group: cutlass.Int32, group_first: cutlass.Int32,
                   group_tiles: cutlass.Int32):
        """Advances (group, first tile, tile count) until tile_idx lies in the group; tile_idx < num_tiles."""
        while tile_idx >= group_first + group_tiles:
            group_first = group_first + group_tiles
            group = group + 1
            group_tiles = self.tiles_in_group(group)
        return group, group_first, group_tiles

    @cute.jit
    def tile_coord(self, tile_idx: cutlass.Int32, group_first: cutlass.Int32, m: cutlass.Int32):
        """(tile row, tile column) of tile_idx inside its group, whose first tile is group_first."""
        local = tile_idx - group_first
        tiles_m = (m + (self.tile_m - 1)) // self.tile_m
        return local % tiles_m, local // tiles_m


def make_operand_tensors(a_addr, b_addr, sfa_addr, sfb_addr, m, n, k, ab_dtype, sf_dtype, sf_vec_size: int):
    """Global tensors A (m, k, l), B (n, k, l) (K contiguous) and their blocked scale tensors: one statement of
    the layouts for the host's TMA atoms (placeholders) and the kernel's descriptors (each group's)."""
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


def make_output_tensor(c_addr, m, n, c_dtype):
    """Global C (m, n, l), N contiguous; N % 128 == 0, so every row starts 16-byte aligned (TMA store)."""
    c_ptr = cute.make_ptr(c_dtype, c_addr, cute.AddressSpace.gmem, assumed_align=GMEM_ALIGN_BYTES)
    return cute.make_tensor(c_ptr, cute.make_layout((m, n, 1), stride=(cute.assume(n, 128), 1,
                                                                      cute.assume(m * n, 128))))


# NOTES: the DSL's own template copy stages only 64 of the 128 bytes on 4.5.2 and 4.8.1, so the templates are
# staged here, whole, through dialect ops (docs/B200_DESIGN.md#descriptor-templates-staged-whole).
_TMA_ATOM_FIELD_KINDS = ((cpasync.CopyBulkTensorTileS2GOp, "tmastore"),
                         (cpasync.CopyReduceBulkTensorTileS2GOp, "tmareduce"))


def descriptor_template_words(atom: cute.CopyAtom) -> cute.Tensor:
    """The host-made 128-byte TMA descriptor of `atom` (a kernel parameter) as 16 Int64 words, in the kernel."""
    kind = next((kind for op, kind in _TMA_ATOM_FIELD_KINDS if isinstance(atom.op, op)), "tmaload")
    field = ir.Attribute.parse(f"#cute_nvgpu.atom_copy_field_{kind}<tma_descriptor_ptr>")
    ptr_type = cute_ir.PtrType.get(cute_nvgpu_ir.TmaDescriptorTiledType.get(), cute_ir.AddressSpace.generic, 64)
    desc_ptr = cute_nvgpu_ir.atom_get_value(ptr_type, cute_nvgpu_ir.atom_make_exec_tma(atom._trait.value), field)
    desc_addr = cutlass.Int64(cute_ir.ptrtoint(cutlass.Int64.mlir_type, getattr(desc_ptr, "value", desc_ptr)))
    words = cute.make_ptr(cutlass.Int64, desc_addr, cute.AddressSpace.generic, assumed_align=64)
    return cute.make_tensor(words, cute.make_layout(TENSORMAP_BYTES // 8))


@cute.jit
def stage_descriptor_templates(atoms: tuple, smem_ptrs: tuple, warp_id: cutlass.Constexpr[int]):
    """All 128 bytes of each host-made descriptor of `atoms` into the shared-memory slot at the matching
    `smem_ptrs` (Int64 pointers), from one lane of warp `warp_id`, then syncs that warp."""
    if cute.arch.make_warp_uniform(cute.arch.warp_idx()) == warp_id:
        with cute.arch.elect_one():
            for atom, smem_ptr in zip(atoms, smem_ptrs):
                template = descriptor_template_words(atom)
                staged = cute.make_tensor(smem_ptr, cute.make_layout(TENSORMAP_BYTES // 8))
                for i in cutlass.range_constexpr(TENSORMAP_BYTES // 8):
                    staged[i] = template[i]
        cute.arch.sync_warp()


# NOTES: a Blackwell driver issue may set bit 85 (the 128 KB out-of-bounds mode) of an encoded descriptor; it is
# cleared in the staged copy, bit 21 of word 1, as CUTLASS and Triton do (docs/B200_DESIGN.md#descriptor-bit-85).
TMA_DESC_OOB_128K_WORD = 1
TMA_DESC_OOB_128K_BIT = 21


@cute.jit
def clear_oob_128k_bit(smem_ptrs: tuple):
    """Clears bit 85 (the 128 KB out-of-bounds address mode) of each TMA descriptor staged in shared memory
    at `smem_ptrs` (Int64 pointers), from one lane of the calling warp, then syncs the warp. Blackwell only."""
    with cute.arch.elect_one():
        for smem_ptr in smem_ptrs:
            words = cute.make_tensor(smem_ptr, cute.make_layout(TENSORMAP_BYTES // 8))
            words[TMA_DESC_OOB_128K_WORD] = words[TMA_DESC_OOB_128K_WORD] & ~(1 << TMA_DESC_OOB_128K_BIT)
    cute.arch.sync_warp()


class TmaDescriptorRows:
    """Where a kernel's TMA descriptors live in its global workspace (rows of `len(Sm100TensorMapSlot)`
    128-byte descriptors) and how a warp role gets them. up_front=True (the GEMMs): row g is group g's, only
    acquired; False (the preparation kernel): CTA b stages, patches and releases row b (NOTES:
    docs/B200_DESIGN.md#tma-descriptor-rows)."""

    def __init__(self, up_front: bool, tensormaps: cute.Tensor, cta_idx, smem_staging_ptr=None):
        self.up_front = up_front
        self.tensormaps = tensormaps
        self.cta_idx = cta_idx
        # The struct member's pointer type only carries 8-byte alignment; the descriptor ops need the 128
        # bytes that the shared-storage Align guarantees, so the pointer is remade with it. Up-front rows
        # are only acquired and need no staging buffer (None).
        self.smem_staging_ptr = None if smem_staging_ptr is None else cute.make_ptr(
            cutlass.Int64, smem_staging_ptr.toint(), cute.AddressSpace.smem, assumed_align=TENSORMAP_BYTES)
        self.manager = TensorMapManager(TensorMapUpdateMode.SMEM, TENSORMAP_BYTES)

    def _runtime_parts(self) -> tuple:
        return (self.tensormaps, self.cta_idx) + (() if self.smem_staging_ptr is None else (self.smem_staging_ptr,))

    def __extract_mlir_values__(self):
        parts = [cutlass.extract_mlir_values(x) for x in self._runtime_parts()]
        self._value_counts = [len(p) for p in parts]
        return [v for p in parts for v in p]

    def __new_from_mlir_values__(self, values):
        new = object.__new__(TmaDescriptorRows)
        new.up_front, new.manager, new._value_counts = self.up_front, self.manager, self._value_counts
        rebuilt, start = [], 0
        for old, count in zip(self._runtime_parts(), self._value_counts):
            rebuilt.append(cutlass.new_from_mlir_values(old, values[start:start + count]))
            start += count
        new.tensormaps, new.cta_idx = rebuilt[:2]
        new.smem_staging_ptr = rebuilt[2] if len(rebuilt) > 2 else None
        return new

    def _row(self, group):
        return group if self.up_front else self.cta_idx

    def _gmem_ptr(self, row, slot):
        return self.manager.get_tensormap_ptr(self.tensormaps[(row, int(slot), None)].iterator)

    def _smem_ptr(self, slot):
        return self.smem_staging_ptr + int(slot) * (TENSORMAP_BYTES // 8)

    def stage_from_atoms(self, atoms: tuple, slots: tuple, warp_id: int):
        """Per-CTA rows only: the host-made descriptors of `atoms`, whole, into the staging slots (by `warp_id`)."""
        if not self.up_front:
            stage_descriptor_templates(atoms, tuple(self._smem_ptr(slot) for slot in slots), warp_id)

    def clear_oob_128k_bit(self, slots: tuple):
        """Per-CTA rows only, Blackwell only, between `stage_from_atoms` and `patch`: bit 85 cleared."""
        clear_oob_128k_bit(tuple(self._smem_ptr(slot) for slot in slots))

    def patch(self, tensors: tuple, atoms: tuple, slots: tuple, warp_id: int):
        """Per-CTA rows only: staging slots rewritten for `tensors`, released to this CTA's row."""
        self.manager.update_tensormap(tensors, atoms, tuple(self._gmem_ptr(self.cta_idx, s) for s in slots),
                                      warp_id, tuple(self._smem_ptr(s) for s in slots))

    def acquire(self, group, slots: tuple):
        """Makes the row used for `group` visible to this thread's TMA operations."""
        for slot in slots:
            self.manager.fence_tensormap_update(self._gmem_ptr(self._row(group), slot))

    def for_tma(self, group, slots: tuple) -> tuple:
        """Generic-address descriptor pointers for the TMA copies of a tile of `group`."""
        return tuple(self.manager.get_tensormap_ptr(self._gmem_ptr(self._row(group), slot), cute.AddressSpace.generic)
                     for slot in slots)


# ---------------------------------------------------------------------------------------------------------
# Blackwell (sm_100a) seed kernel (variant "seed")
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


class Sm100LoadSetup:
    """The block-scaled MMA, staged shared-memory layouts of A, B, SFA, SFB and their TMA load atoms, made on
    placeholder tensors of runtime sizes (static ones would fix the TMA coordinate tensors' extent)."""

    def __init__(self, tiled_mma, tiled_mma_sfb, smem_layouts_staged, atoms, gmem_tensors, stage_bytes):
        self.tiled_mma = tiled_mma
        self.tiled_mma_sfb = tiled_mma_sfb  # the MMA shape SFB is tiled and loaded with (N rounded up to 128)
        self.smem_layouts_staged = smem_layouts_staged  # (A, B, SFA, SFB), each (..., STAGE)
        self.atoms = atoms  # TMA load atoms (A, B, SFA, SFB)
        self.gmem_tensors = gmem_tensors  # their TMA coordinate tensors
        self.stage_bytes = stage_bytes  # bytes one K step's four loads bring in

    @staticmethod
    def make(cfg, num_stages: int, placeholder) -> "Sm100LoadSetup":
        tiler = cfg.mma_tiler_mnk

        def block_scaled_mma(tile):
            return cute.make_tiled_mma(tcgen05.MmaMXF4NVF4Op(cfg.sf_dtype, (tile[0], tile[1], cfg.mma_inst_k),
                                                             tcgen05.CtaGroup.ONE, tcgen05.OperandSource.SMEM))

        tiled_mma = block_scaled_mma(tiler)
        tiled_mma_sfb = tiled_mma if cfg.mma_tiler_sfb == tiler else block_scaled_mma(cfg.mma_tiler_sfb)
        staged = (
            sm100_utils.make_smem_layout_a(tiled_mma, tiler, cfg.ab_dtype, num_stages),
            sm100_utils.make_smem_layout_b(tiled_mma, tiler, cfg.ab_dtype, num_stages),
            blockscaled_utils.make_smem_layout_sfa(tiled_mma, tiler, cfg.sf_vec_size, num_stages),
            blockscaled_utils.make_smem_layout_sfb(tiled_mma, tiler, cfg.sf_vec_size, num_stages),
        )
        a0, b0, sfa0, sfb0 = make_operand_tensors(
            0, 0, 0, 0, placeholder, placeholder, placeholder, cfg.ab_dtype, cfg.sf_dtype, cfg.sf_vec_size)
        cluster_shape = cute.tiled_divide(cute.make_layout((1, 1, 1)), (tiled_mma.thr_id.shape,)).shape
        load_op = cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.ONE)
        a_layout, b_layout, sfa_layout, sfb_layout = (cute.slice_(x, (None, None, None, 0)) for x in staged)
        tma_atom_a, mA_mkl = cute.nvgpu.make_tiled_tma_atom_A(load_op, a0, a_layout, tiler, tiled_mma, cluster_shape)
        tma_atom_b, mB_nkl = cute.nvgpu.make_tiled_tma_atom_B(load_op, b0, b_layout, tiler, tiled_mma, cluster_shape)
        # Scales go through TMA as 16-bit elements, as in CUTLASS's block-scaled examples and the seed.
        tma_atom_sfa, mSFA_mkl = cute.nvgpu.make_tiled_tma_atom_A(
            load_op, sfa0, sfa_layout, tiler, tiled_mma, cluster_shape, internal_type=cutlass.Int16)
        # (The SFB shared-memory layout above already rounds N up to 128 rows.)
        tma_atom_sfb, mSFB_nkl = cute.nvgpu.make_tiled_tma_atom_B(
            load_op, sfb0, sfb_layout, cfg.mma_tiler_sfb, tiled_mma_sfb, cluster_shape, internal_type=cutlass.Int16)
        stage_bytes = (cute.size_in_bytes(cfg.ab_dtype, a_layout) + cute.size_in_bytes(cfg.ab_dtype, b_layout)
                       + cute.size_in_bytes(cfg.sf_dtype, sfa_layout) + cute.size_in_bytes(cfg.sf_dtype, sfb_layout))
        return Sm100LoadSetup(tiled_mma, tiled_mma_sfb, staged, (tma_atom_a, tma_atom_b, tma_atom_sfa, tma_atom_sfb),
                              (mA_mkl, mB_nkl, mSFA_mkl, mSFB_nkl), stage_bytes)


def sm100_s2t_copy_and_partition(sf_dtype, sSF, tCtSF):
    """tcgen05.cp of one scale tensor from shared to tensor memory, and its source/destination views."""
    copy_atom_s2t = cute.make_copy_atom(tcgen05.Cp4x32x128bOp(tcgen05.CtaGroup.ONE), sf_dtype)
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


class Sm100BlockScaledGroupedGemmKernel:
    """NVFP4 grouped GEMM on tcgen05: C_g = (A_g * SFA_g) @ (B_g * SFB_g)^T, one CTA per 128x128 tile.

    Grid: total output tiles (`group_tile_coord`). 128 threads: warp 0 writes the CTA's four TMA descriptors,
    then per 256-deep K tile loads A, B, SFA, SFB (ab pipeline), copies the scales to tensor memory and issues
    four 128x128x64 MMAs, then commits (acc); warps 0-3 (epilogue): thread i stores row i as fp16, predicated.
    NOTES: docs/B200_DESIGN.md#seed-kernel (pipelines, shared memory).
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
        ptr_table, size_table = group_tables(ptr_table_ptr, size_table_ptr, num_groups)
        # (tile, descriptor, 16 x int64): 512 bytes per CTA
        tensormaps = descriptor_table(tensormap_workspace_ptr, num_tiles, self.num_tensormaps)

        # The TMA atoms are made once on placeholder tensors; each CTA patches its own copy of the descriptors.
        loads = Sm100LoadSetup.make(cfg, cfg.num_ab_stages, cutlass.Int32(64))
        tiled_mma = loads.tiled_mma
        a_smem_layout_staged, b_smem_layout_staged, sfa_smem_layout_staged, sfb_smem_layout_staged = \
            loads.smem_layouts_staged
        tma_atom_a, tma_atom_b, tma_atom_sfa, tma_atom_sfb = loads.atoms
        mA_mkl, mB_nkl, mSFA_mkl, mSFB_nkl = loads.gmem_tensors
        num_tma_load_bytes = loads.stage_bytes * cute.size(tiled_mma.thr_id.shape)

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
        # Remade with the 128-byte alignment the Align above guarantees (TmaDescriptorRows.__init__ says why).
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
        """Stage the host-made descriptors whole, clear their bit 85, patch in the group's tensors, release."""
        if warp_idx == 0:
            stage_descriptor_templates(tma_atoms, smem_ptrs, 0)
            clear_oob_128k_bit(smem_ptrs)
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
        return sm100_s2t_copy_and_partition(self.config.sf_dtype, sSF, tCtSF)


# ---------------------------------------------------------------------------------------------------------
# Blackwell (sm_100a) persistent kernel and its descriptor preparation
# ---------------------------------------------------------------------------------------------------------
class Sm100BarrierId(enum.IntEnum):
    """Named barriers of the persistent kernel (0 is the CTA-wide barrier)."""

    EPILOGUE = 1  # the four epilogue warps, around each shared-memory C slice
    TMEM_ALLOC = 2  # epilogue warps + MMA warp: the tensor-memory address is in shared memory


class Sm100TensorMapSlot(enum.IntEnum):
    """The TMA descriptors of one workspace row (a group's, or a CTA's), in workspace order."""

    A = 0
    B = 1
    SFA = 2
    SFB = 3
    C = 4


LOAD_SLOTS = (Sm100TensorMapSlot.A, Sm100TensorMapSlot.B, Sm100TensorMapSlot.SFA, Sm100TensorMapSlot.SFB)


@dataclasses.dataclass(frozen=True)
class Sm100TmaSetup:
    """What the host side of both persistent jit functions builds the same way: the MMA, shared-memory
    layouts, and TMA atoms made on placeholder tensors (whose descriptors get rewritten per group)."""

    tiled_mma: object
    tiled_mma_sfb: object  # SFB's MMA shape (N rounded up to 128); the same object when N is a multiple of 128
    a_smem_layout_staged: object
    b_smem_layout_staged: object
    sfa_smem_layout_staged: object
    sfb_smem_layout_staged: object
    c_smem_layout_staged: object
    epi_tile: object
    tma_atoms: tuple  # (A, B, SFA, SFB, C), Sm100TensorMapSlot order
    tma_tensors: tuple  # coordinate tensors of the atoms, same order
    ab_stage_bytes: int


class Sm100PersistentGroupedGemmKernel:
    """NVFP4 grouped GEMM on tcgen05, persistent and warp-specialized: C_g = (A_g * SFA_g) @ (B_g * SFB_g)^T.

    Grid: (min(output tiles, SMs), 1, 1), one CTA per SM; every role walks the tiles b, b + grid, ... of
    `GroupTileScheduler`. 192 threads, roles by warp (`Sm100Warp`):

    * warp 5, TMA producer: per 256-deep K step, loads of A, B, SFA, SFB into stage s of the ab pipeline.
    * warp 4, MMA issuer: per K step, tcgen05.cp of the scales to tensor memory and four 128xNx64 MMAs,
      stage s released on their commit; per tile, the accumulator committed.
    * warps 0-3, epilogue: per 128x32 slice, tensor memory -> registers -> fp16 -> shared memory -> TMA store
      by warp 0 (rows >= M clipped); the accumulator released after the last slice.

    Pipelines: ab (PipelineTmaUmma, TMA warp -> MMA warp), acc (PipelineUmmaAsync, MMA warp -> epilogue warps),
    c (PipelineTmaStore, epilogue warp 0). Descriptors: a row per group, prepared by `GroupTensormapKernel`, only
    acquired here (NOTES: docs/B200_DESIGN.md#persistent-kernel-spec: arrive counts, descriptors, memories).
    """

    threads_per_cta = 32 * len(Sm100Warp)
    num_epilogue_warps = 4
    num_tensormaps = len(Sm100TensorMapSlot)
    # `GroupTensormapKernel` clears bit 85 of this kernel's descriptors (Blackwell: see clear_oob_128k_bit).
    clears_oob_128k_bit = True

    def __init__(self, config: Sm100PersistentConfig):
        self.config = config
        self.tile_m, self.tile_n, self.tile_k = config.mma_tiler_mnk
        self.num_ab_stages = config.num_ab_stages
        self.num_acc_stages = config.num_acc_stages
        self.num_c_stages = config.num_c_stages

    @staticmethod
    def tensormap_workspace_bytes(num_groups: int) -> int:
        return num_groups * Sm100PersistentGroupedGemmKernel.num_tensormaps * TENSORMAP_BYTES

    @staticmethod
    def launch_options(queue) -> dict:
        """The launch's options for `queue` (None: the legacy default queue; moe.py's subclass names others)."""
        return {}

    # -----------------------------------------------------------------------------------------------------
    # Host side: MMA, shared-memory layouts, TMA atoms on placeholder tensors, launch
    # -----------------------------------------------------------------------------------------------------
    def _tma_setup(self) -> Sm100TmaSetup:
        """Called inside both jit host functions, so the prepared descriptors match the GEMM's atoms."""
        cfg = self.config
        tiler = cfg.mma_tiler_mnk
        # A runtime placeholder size (Sm100LoadSetup says why); the descriptors get each group's real ones.
        placeholder = cutlass.Int32(128)
        loads = Sm100LoadSetup.make(cfg, self.num_ab_stages, placeholder)
        tiled_mma = loads.tiled_mma
        a_smem_layout_staged, b_smem_layout_staged, sfa_smem_layout_staged, sfb_smem_layout_staged = \
            loads.smem_layouts_staged
        tma_atom_a, tma_atom_b, tma_atom_sfa, tma_atom_sfb = loads.atoms
        mA_mkl, mB_nkl, mSFA_mkl, mSFB_nkl = loads.gmem_tensors
        epi_tile = sm100_utils.compute_epilogue_tile_shape(tiler, False, LayoutEnum.ROW_MAJOR, cfg.c_dtype)
        c_smem_layout_staged = sm100_utils.make_smem_layout_epi(cfg.c_dtype, LayoutEnum.ROW_MAJOR, epi_tile,
                                                                self.num_c_stages)
        c0 = make_output_tensor(0, placeholder, placeholder, cfg.c_dtype)
        c_smem_layout = cute.slice_(c_smem_layout_staged, (None, None, 0))
        tma_atom_c, mC_mnl = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), c0, c_smem_layout,
                                                         epi_tile)

        # The config's byte counts (which set the stage counts) must be the DSL's.
        ab_stage_bytes = loads.stage_bytes
        c_stage_bytes = cute.size_in_bytes(cfg.c_dtype, c_smem_layout)
        if ab_stage_bytes != cfg.ab_stage_bytes or c_stage_bytes != cfg.c_stage_bytes:
            raise ValueError(f"stage bytes: DSL A/B/SF {ab_stage_bytes}, C {c_stage_bytes}; config "
                             f"{cfg.ab_stage_bytes}, {cfg.c_stage_bytes}")
        return Sm100TmaSetup(
            tiled_mma, loads.tiled_mma_sfb, a_smem_layout_staged, b_smem_layout_staged, sfa_smem_layout_staged,
            sfb_smem_layout_staged,
            c_smem_layout_staged, epi_tile, (tma_atom_a, tma_atom_b, tma_atom_sfa, tma_atom_sfb, tma_atom_c),
            (mA_mkl, mB_nkl, mSFA_mkl, mSFB_nkl, mC_mnl), ab_stage_bytes)

    # ---- what `GroupTensormapKernel` needs to prepare this kernel's descriptors -----------------------------
    descriptor_slots = tuple(Sm100TensorMapSlot)

    def descriptor_atoms(self) -> tuple:
        """The TMA atoms of the descriptors, in `descriptor_slots` order (host side of a jit function)."""
        return self._tma_setup().tma_atoms

    def group_descriptor_tensors(self, ptr_table: cute.Tensor, size_table: cute.Tensor, group,
                                 tensormaps: cute.Tensor) -> tuple:
        """Group `group`'s global tensors, in `descriptor_slots` order (device side)."""
        cfg = self.config
        m = size_table[group, int(SizeColumn.M)]
        n = size_table[group, int(SizeColumn.N)]
        k = size_table[group, int(SizeColumn.K)]
        return (
            *make_operand_tensors(ptr_table[group, int(PtrColumn.A)], ptr_table[group, int(PtrColumn.B)],
                                  ptr_table[group, int(PtrColumn.SFA)], ptr_table[group, int(PtrColumn.SFB)],
                                  m, n, k, cfg.ab_dtype, cfg.sf_dtype, cfg.sf_vec_size),
            make_output_tensor(ptr_table[group, int(PtrColumn.C)], m, n, cfg.c_dtype),
        )

    @cute.jit
    def __call__(
        self,
        ptr_table_ptr: cute.Pointer,
        size_table_ptr: cute.Pointer,
        tensormap_workspace_ptr: cute.Pointer,
        num_tiles: cutlass.Int32,
        num_ctas: cutlass.Int32,
        num_groups: cutlass.Constexpr[int],
    ):
        self.launch(ptr_table_ptr, size_table_ptr, tensormap_workspace_ptr, num_tiles, num_ctas, num_groups, None)

    @cute.jit
    def launch(self, ptr_table_ptr: cute.Pointer, size_table_ptr: cute.Pointer, tensormap_workspace_ptr: cute.Pointer,
               num_tiles: cutlass.Int32, num_ctas: cutlass.Int32, num_groups: cutlass.Constexpr[int], queue):
        cfg = self.config
        # The pointer table is the preparation kernel's: the GEMM reads sizes and descriptors only.
        _, size_table = group_tables(ptr_table_ptr, size_table_ptr, num_groups)
        tensormaps = descriptor_table(tensormap_workspace_ptr, num_groups, self.num_tensormaps)
        setup = self._tma_setup()

        @cute.struct
        class SharedStorage:
            ab_mbar: cute.struct.MemRange[cutlass.Int64, self.num_ab_stages * 2]
            acc_mbar: cute.struct.MemRange[cutlass.Int64, self.num_acc_stages * 2]
            tmem_holding_buf: cutlass.Int32
            # (EPI_TILE_M, EPI_TILE_N, STAGE)
            sC: cute.struct.Align[cute.struct.MemRange[cfg.c_dtype, cute.cosize(setup.c_smem_layout_staged.outer)],
                                  1024]
            # (MMA, MMA_M, MMA_K, STAGE)
            sA: cute.struct.Align[cute.struct.MemRange[cfg.ab_dtype, cute.cosize(setup.a_smem_layout_staged.outer)],
                                  1024]
            # (MMA, MMA_N, MMA_K, STAGE)
            sB: cute.struct.Align[cute.struct.MemRange[cfg.ab_dtype, cute.cosize(setup.b_smem_layout_staged.outer)],
                                  1024]
            # (MMA, MMA_M, MMA_K, STAGE)
            sSFA: cute.struct.Align[cute.struct.MemRange[cfg.sf_dtype, cute.cosize(setup.sfa_smem_layout_staged)], 128]
            # (MMA, MMA_N, MMA_K, STAGE)
            sSFB: cute.struct.Align[cute.struct.MemRange[cfg.sf_dtype, cute.cosize(setup.sfb_smem_layout_staged)], 128]

        self.shared_storage = SharedStorage
        if cutlass.const_expr(SharedStorage.size_in_bytes() != cfg.smem_bytes):
            raise ValueError(f"shared memory: DSL {SharedStorage.size_in_bytes()} B, config {cfg.smem_bytes} B")

        # No smem argument: the DSL sizes dynamic shared memory from the kernel's allocation.
        self.kernel(
            setup.tiled_mma, setup.tiled_mma_sfb, *setup.tma_atoms, *setup.tma_tensors,
            size_table, tensormaps, num_tiles,
            setup.a_smem_layout_staged, setup.b_smem_layout_staged, setup.sfa_smem_layout_staged,
            setup.sfb_smem_layout_staged, setup.c_smem_layout_staged, setup.epi_tile, setup.ab_stage_bytes,
        ).launch(grid=(num_ctas, 1, 1), block=(self.threads_per_cta, 1, 1), cluster=(1, 1, 1), use_pdl=cfg.use_pdl,
                 **self.launch_options(queue))

    # -----------------------------------------------------------------------------------------------------
    # Device side: setup shared by all roles, then dispatch on the warp index
    # -----------------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        tiled_mma: cute.TiledMma,
        tiled_mma_sfb: cute.TiledMma,
        tma_atom_a: cute.CopyAtom,
        tma_atom_b: cute.CopyAtom,
        tma_atom_sfa: cute.CopyAtom,
        tma_atom_sfb: cute.CopyAtom,
        tma_atom_c: cute.CopyAtom,
        mA_mkl: cute.Tensor,
        mB_nkl: cute.Tensor,
        mSFA_mkl: cute.Tensor,
        mSFB_nkl: cute.Tensor,
        mC_mnl: cute.Tensor,
        size_table: cute.Tensor,
        tensormaps: cute.Tensor,
        num_tiles: cutlass.Int32,
        a_smem_layout_staged: cute.ComposedLayout,
        b_smem_layout_staged: cute.ComposedLayout,
        sfa_smem_layout_staged: cute.Layout,
        sfb_smem_layout_staged: cute.Layout,
        c_smem_layout_staged: cute.ComposedLayout,
        epi_tile: cute.Tile,
        num_tma_load_bytes: cutlass.Constexpr[int],
    ):
        cfg = self.config
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        cta_idx, _, _ = cute.arch.block_idx()
        num_ctas, _, _ = cute.arch.grid_dim()
        if cutlass.const_expr(cfg.use_pdl):
            # The next launch may start its CTAs (they wait for this grid before touching global memory).
            cute.arch.griddepcontrol_launch_dependents()

        # ---- shared memory and pipelines -----------------------------------------------------------------
        smem = SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        ab_pipeline = pipeline.PipelineTmaUmma.create(
            barrier_storage=storage.ab_mbar.data_ptr(),
            num_stages=self.num_ab_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            tx_count=num_tma_load_bytes,
            defer_sync=True,
        )
        acc_pipeline = pipeline.PipelineUmmaAsync.create(
            barrier_storage=storage.acc_mbar.data_ptr(),
            num_stages=self.num_acc_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_epilogue_warps),
            defer_sync=True,
        )
        tmem = TmemAllocator(
            storage.tmem_holding_buf,
            barrier_for_retrieve=pipeline.NamedBarrier(barrier_id=Sm100BarrierId.TMEM_ALLOC,
                                                       num_threads=32 * (self.num_epilogue_warps + 1)),
            allocator_warp_id=int(Sm100Warp.EPILOGUE0),
        )
        # One CTA-wide sync makes every barrier initialisation visible before any role uses it.
        pipeline.pipeline_init_arrive()
        pipeline.pipeline_init_wait()
        if cutlass.const_expr(cfg.use_pdl):
            # Everything below reads or writes global memory: the previous grid on the queue (which may
            # have written these inputs, or prepared these descriptors) must be complete and visible.
            cute.arch.griddepcontrol_wait()
        if cutlass.const_expr(cfg.device_tile_count):  # written by the launch before (the wait above, with PDL)
            count = tensormaps.iterator.toint() + self.tensormap_workspace_bytes(cute.size(tensormaps, mode=[0]))
            num_tiles = cute.make_tensor(cute.make_ptr(cutlass.Int32, count, cute.AddressSpace.gmem, assumed_align=16),
                                         cute.make_layout(1))[0]

        # Swizzled operand buffers on 1024 bytes, the 128-byte swizzle pattern's period.
        # (EPI_TILE_M, EPI_TILE_N, STAGE)
        sC = storage.sC.get_tensor(c_smem_layout_staged.outer, swizzle=c_smem_layout_staged.inner)
        # (MMA, MMA_M, MMA_K, STAGE)
        sA = storage.sA.get_tensor(a_smem_layout_staged.outer, swizzle=a_smem_layout_staged.inner)
        # (MMA, MMA_N, MMA_K, STAGE)
        sB = storage.sB.get_tensor(b_smem_layout_staged.outer, swizzle=b_smem_layout_staged.inner)
        # (MMA, MMA_M, MMA_K, STAGE)
        sSFA = storage.sSFA.get_tensor(sfa_smem_layout_staged)
        # (MMA, MMA_N, MMA_K, STAGE)
        sSFB = storage.sSFB.get_tensor(sfb_smem_layout_staged)

        # ---- TMA descriptors: the workspace's row per group, prepared before this launch -------------------
        descriptors = TmaDescriptorRows(True, tensormaps, cta_idx)

        # ---- global tiles (coordinate tensors of the placeholder shapes; the descriptors bound them) ------
        # (bM, bK, RestM, RestK, RestL)
        gA_mkl = cute.local_tile(mA_mkl, cute.slice_(cfg.mma_tiler_mnk, (None, 0, None)), (None, None, None))
        # (bN, bK, RestN, RestK, RestL)
        gB_nkl = cute.local_tile(mB_nkl, cute.slice_(cfg.mma_tiler_mnk, (0, None, None)), (None, None, None))
        # (bM, bK, RestM, RestK, RestL)
        gSFA_mkl = cute.local_tile(mSFA_mkl, cute.slice_(cfg.mma_tiler_mnk, (None, 0, None)), (None, None, None))
        # (bN_sfb, bK, RestN_sfb, RestK, RestL): whole 128-row scale blocks, also for N = 64 tiles
        gSFB_nkl = cute.local_tile(mSFB_nkl, cute.slice_(cfg.mma_tiler_sfb, (0, None, None)), (None, None, None))
        # (bM, bN, RestM, RestN, RestL)
        gC_mnl = cute.local_tile(mC_mnl, cute.slice_(cfg.mma_tiler_mnk, (None, None, 0)), (None, None, None))
        # A one-CTA MMA has a single MMA "thread": the whole CTA.
        thr_mma = tiled_mma.get_slice(0)
        # (MMA, MMA_M, MMA_K, RestM, RestK, RestL)
        tCgA = thr_mma.partition_A(gA_mkl)
        # (MMA, MMA_N, MMA_K, RestN, RestK, RestL)
        tCgB = thr_mma.partition_B(gB_nkl)
        # (MMA, MMA_M, MMA_K, RestM, RestK, RestL)
        tCgSFA = thr_mma.partition_A(gSFA_mkl)
        # (MMA, MMA_N_sfb, MMA_K, RestN_sfb, RestK, RestL)
        tCgSFB = tiled_mma_sfb.get_slice(0).partition_B(gSFB_nkl)
        # (MMA, MMA_M, MMA_N, RestM, RestN, RestL)
        tCgC = thr_mma.partition_C(gC_mnl)

        # (MMA, MMA_M, MMA_K, STAGE)
        tCrA = tiled_mma.make_fragment_A(sA)
        # (MMA, MMA_N, MMA_K, STAGE)
        tCrB = tiled_mma.make_fragment_B(sB)
        # (MMA, MMA_M, MMA_N, ACC_STAGE): layout only, placed in tensor memory by each role
        acc_shape = tiled_mma.partition_shape_C(cfg.mma_tiler_mnk[:2])
        tCtAcc_layout = tiled_mma.make_fragment_C(cute.append(acc_shape, self.num_acc_stages)).layout

        scheduler = GroupTileScheduler(size_table, self.tile_m, self.tile_n)
        tma_atoms = (tma_atom_a, tma_atom_b, tma_atom_sfa, tma_atom_sfb)

        if warp_idx == Sm100Warp.TMA:
            self._load_role(scheduler, num_tiles, cta_idx, num_ctas, size_table, ab_pipeline, descriptors,
                            tma_atoms, (sA, sB, sSFA, sSFB), (tCgA, tCgB, tCgSFA, tCgSFB))
        if warp_idx == Sm100Warp.MMA:
            tmem.wait_for_alloc()
            acc_tmem_ptr = tmem.retrieve_ptr(cfg.acc_dtype)
            self._mma_role(scheduler, num_tiles, cta_idx, num_ctas, size_table, tiled_mma, ab_pipeline,
                           acc_pipeline, acc_tmem_ptr, tCtAcc_layout, tCrA, tCrB, sSFA, sSFB,
                           sfa_smem_layout_staged, sfb_smem_layout_staged)
        if warp_idx < Sm100Warp.MMA:
            tmem.allocate(cfg.tmem_alloc_cols)
            tmem.wait_for_alloc()
            acc_tmem_ptr = tmem.retrieve_ptr(cfg.acc_dtype)
            self._epilogue_role(scheduler, num_tiles, cta_idx, num_ctas, warp_idx, tidx, size_table, acc_pipeline,
                                acc_tmem_ptr, tCtAcc_layout, descriptors, tma_atom_c, sC, tCgC, epi_tile)
            # Every epilogue thread has read its last accumulator (and the MMA warp has written its last:
            # the epilogue waited for it) before the columns are given back.
            tmem.relinquish_alloc_permit()
            pipeline.NamedBarrier(barrier_id=Sm100BarrierId.EPILOGUE,
                                  num_threads=32 * self.num_epilogue_warps).arrive_and_wait()
            tmem.free(acc_tmem_ptr)

    # -----------------------------------------------------------------------------------------------------
    # Warp 5: TMA producer
    # -----------------------------------------------------------------------------------------------------
    @cute.jit
    def _load_role(self, scheduler, num_tiles, cta_idx, num_ctas, size_table, ab_pipeline, descriptors, tma_atoms,
                   smem_tensors, gmem_partitions):
        cfg = self.config
        # ((atom_v, rest_v), STAGE) and ((atom_v, rest_v), RestMN, RestK, RestL) per operand; the scale
        # tensors broadcast over the 16 k-elements of a block (stride 0), so those modes are dropped.
        partitions = [cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(sX, 0, 3),
                                            cute.group_modes(tCgX, 0, 3))
                      for atom, sX, tCgX in zip(tma_atoms, smem_tensors, gmem_partitions)]
        tma_smem = [tXsX for tXsX, _ in partitions[:2]] + [cute.filter_zeros(tXsX) for tXsX, _ in partitions[2:]]
        tma_gmem = [tXgX for _, tXgX in partitions[:2]] + [cute.filter_zeros(tXgX) for _, tXgX in partitions[2:]]

        producer_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_ab_stages)
        group, group_first, group_tiles = scheduler.first_state()
        last_group = cutlass.Int32(-1)
        tile_idx = cutlass.Int32(cta_idx)
        while tile_idx < num_tiles:
            group, group_first, group_tiles = scheduler.find_group(tile_idx, group, group_first, group_tiles)
            m = size_table[group, int(SizeColumn.M)]
            k = size_table[group, int(SizeColumn.K)]
            tile_m_idx, tile_n_idx = scheduler.tile_coord(tile_idx, group_first, m)
            group_changed = group != last_group
            k_tile_cnt = (k + (self.tile_k - 1)) // self.tile_k
            # ((atom_v, rest_v), RestK)
            # An N = 64 tile's scales are half of the 128-row SFB block its pair of tiles shares.
            sfb_block_idx = tile_n_idx
            if cutlass.const_expr(cfg.mma_tiler_sfb[1] != self.tile_n):
                sfb_block_idx = tile_n_idx // (cfg.mma_tiler_sfb[1] // self.tile_n)
            tile_gmem = (
                tma_gmem[0][(None, tile_m_idx, None, 0)],
                tma_gmem[1][(None, tile_n_idx, None, 0)],
                tma_gmem[2][(None, tile_m_idx, None, 0)],
                tma_gmem[3][(None, sfb_block_idx, None, 0)],
            )
            producer_state.reset_count()
            empty_ready = cutlass.Boolean(True)
            if producer_state.count < k_tile_cnt:
                empty_ready = ab_pipeline.producer_try_acquire(producer_state)
            if group_changed:
                descriptors.acquire(group, LOAD_SLOTS)
            tma_desc_ptrs = descriptors.for_tma(group, LOAD_SLOTS)
            for k_tile in cutlass.range(0, k_tile_cnt, 1, unroll=1):
                ab_pipeline.producer_acquire(producer_state, empty_ready)
                for atom, tXgX, tXsX, desc in zip(tma_atoms, tile_gmem, tma_smem, tma_desc_ptrs):
                    cute.copy(atom, tXgX[(None, producer_state.count)], tXsX[(None, producer_state.index)],
                              tma_bar_ptr=ab_pipeline.producer_get_barrier(producer_state), tma_desc_ptr=desc)
                producer_state.advance()
                empty_ready = cutlass.Boolean(True)
                if producer_state.count < k_tile_cnt:
                    empty_ready = ab_pipeline.producer_try_acquire(producer_state)
            last_group = group
            tile_idx = tile_idx + num_ctas
        # The CTA may not retire while its loads are in flight.
        ab_pipeline.producer_tail(producer_state)

    # -----------------------------------------------------------------------------------------------------
    # Warp 4: MMA issuer
    # -----------------------------------------------------------------------------------------------------
    @cute.jit
    def _mma_role(self, scheduler, num_tiles, cta_idx, num_ctas, size_table, tiled_mma, ab_pipeline,
                  acc_pipeline, acc_tmem_ptr, tCtAcc_layout, tCrA, tCrB, sSFA, sSFB, sfa_smem_layout_staged,
                  sfb_smem_layout_staged):
        cfg = self.config
        # (MMA, MMA_M, MMA_N, ACC_STAGE)
        tCtAcc_base = cute.make_tensor(acc_tmem_ptr, tCtAcc_layout)
        acc_cols = tcgen05.find_tmem_tensor_col_offset(tCtAcc_base)
        sfa_tmem_ptr = cute.recast_ptr(acc_tmem_ptr + acc_cols, dtype=cfg.sf_dtype)
        # (MMA, MMA_M, MMA_K)
        tCtSFA = cute.make_tensor(sfa_tmem_ptr, blockscaled_utils.make_tmem_layout_sfa(
            tiled_mma, cfg.mma_tiler_mnk, cfg.sf_vec_size, cute.slice_(sfa_smem_layout_staged, (None, None, None, 0))))
        sfb_tmem_ptr = cute.recast_ptr(acc_tmem_ptr + acc_cols + tcgen05.find_tmem_tensor_col_offset(tCtSFA),
                                       dtype=cfg.sf_dtype)
        # (MMA, MMA_N, MMA_K)
        tCtSFB = cute.make_tensor(sfb_tmem_ptr, blockscaled_utils.make_tmem_layout_sfb(
            tiled_mma, cfg.mma_tiler_mnk, cfg.sf_vec_size, cute.slice_(sfb_smem_layout_staged, (None, None, None, 0))))
        # The config's column count (which sized the allocation) must be the DSL's.
        tmem_cols = (acc_cols + tcgen05.find_tmem_tensor_col_offset(tCtSFA)
                     + tcgen05.find_tmem_tensor_col_offset(tCtSFB))
        if cutlass.const_expr(tmem_cols != cfg.tmem_cols_used):
            raise ValueError(f"tensor-memory columns: DSL {tmem_cols}, config {cfg.tmem_cols_used}")
        tiled_copy_s2t_sfa, tCsSFA_s2t, tCtSFA_s2t = self._s2t_copy_and_partition(sSFA, tCtSFA)
        tiled_copy_s2t_sfb, tCsSFB_s2t, tCtSFB_s2t = self._s2t_copy_and_partition(sSFB, tCtSFB)
        num_kblocks = cute.size(tCrA, mode=[2])
        # N = 64: tensor memory holds the scales of the whole 128-row block (tcgen05.cp copies blocks); the
        # MMA of an odd N tile starts two columns in, at its 64 rows (CUTLASS's dense block-scaled scheme).
        half_block_sfb = cfg.mma_tiler_sfb[1] != self.tile_n
        sfb_cols_per_half_block = 2

        ab_consumer_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_ab_stages)
        acc_producer_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_acc_stages)
        group, group_first, group_tiles = scheduler.first_state()
        tile_idx = cutlass.Int32(cta_idx)
        while tile_idx < num_tiles:
            group, group_first, group_tiles = scheduler.find_group(tile_idx, group, group_first, group_tiles)
            k = size_table[group, int(SizeColumn.K)]
            k_tile_cnt = (k + (self.tile_k - 1)) // self.tile_k
            # (MMA, MMA_M, MMA_N)
            tCtAcc = tCtAcc_base[(None, None, None, acc_producer_state.index)]
            # (MMA, MMA_N, MMA_K): the scales this tile's MMAs read
            tCtSFB_mma = tCtSFB
            if cutlass.const_expr(half_block_sfb):
                _, tile_n_idx = scheduler.tile_coord(tile_idx, group_first, size_table[group, int(SizeColumn.M)])
                tCtSFB_mma = cute.make_tensor(
                    cute.recast_ptr(acc_tmem_ptr + acc_cols + tcgen05.find_tmem_tensor_col_offset(tCtSFA)
                                    + (tile_n_idx % 2) * sfb_cols_per_half_block, dtype=cfg.sf_dtype),
                    tCtSFB.layout)

            ab_consumer_state.reset_count()
            full_ready = cutlass.Boolean(True)
            if ab_consumer_state.count < k_tile_cnt:
                full_ready = ab_pipeline.consumer_try_wait(ab_consumer_state)
            acc_pipeline.producer_acquire(acc_producer_state)
            # The first MMA of the tile overwrites the accumulator.
            tiled_mma.set(tcgen05.Field.ACCUMULATE, False)
            for k_tile in range(k_tile_cnt):
                ab_pipeline.consumer_wait(ab_consumer_state, full_ready)
                # The MMA reads its scales from tensor memory; tcgen05 ops of one thread run in order, so
                # the previous K step's MMAs have read the old scales before these copies land.
                # ((ATOM_V, REST_V), Rest_Tiler, MMA_MN, MMA_K)
                s2t_stage = (None, None, None, None, ab_consumer_state.index)
                cute.copy(tiled_copy_s2t_sfa, tCsSFA_s2t[s2t_stage], tCtSFA_s2t)
                cute.copy(tiled_copy_s2t_sfb, tCsSFB_s2t[s2t_stage], tCtSFB_s2t)
                # tCtAcc += tCrA * tCtSFA * tCrB * tCtSFB, one 64-deep instruction per k-block
                for kblock_idx in cutlass.range(num_kblocks, unroll_full=True):
                    tiled_mma.set(tcgen05.Field.SFA, tCtSFA[(None, None, kblock_idx)].iterator)
                    tiled_mma.set(tcgen05.Field.SFB, tCtSFB_mma[(None, None, kblock_idx)].iterator)
                    kblock = (None, None, kblock_idx, ab_consumer_state.index)
                    cute.gemm(tiled_mma, tCtAcc, tCrA[kblock], tCrB[kblock], tCtAcc)
                    tiled_mma.set(tcgen05.Field.ACCUMULATE, True)
                # Frees the stage once these MMAs have read it (tcgen05.commit to the empty barrier).
                ab_pipeline.consumer_release(ab_consumer_state)
                ab_consumer_state.advance()
                full_ready = cutlass.Boolean(True)
                if ab_consumer_state.count < k_tile_cnt:
                    full_ready = ab_pipeline.consumer_try_wait(ab_consumer_state)
            acc_pipeline.producer_commit(acc_producer_state)
            acc_producer_state.advance()
            tile_idx = tile_idx + num_ctas
        # The epilogue has taken every accumulator before the CTA retires.
        acc_pipeline.producer_tail(acc_producer_state)

    # -----------------------------------------------------------------------------------------------------
    # Warps 0-3: epilogue (tensor memory -> registers -> fp16 -> shared memory -> TMA store)
    # -----------------------------------------------------------------------------------------------------
    @cute.jit
    def _epilogue_role(self, scheduler, num_tiles, cta_idx, num_ctas, warp_idx, tidx, size_table, acc_pipeline,
                       acc_tmem_ptr, tCtAcc_layout, descriptors, tma_atom_c, sC, tCgC, epi_tile):
        cfg = self.config
        store_warp = int(Sm100Warp.EPILOGUE0)
        epilogue_barrier = pipeline.NamedBarrier(barrier_id=Sm100BarrierId.EPILOGUE,
                                                 num_threads=32 * self.num_epilogue_warps)
        c_slot = (Sm100TensorMapSlot.C,)

        # (MMA, MMA_M, MMA_N, ACC_STAGE)
        tCtAcc_base = cute.make_tensor(acc_tmem_ptr, tCtAcc_layout)
        copy_atom_t2r = sm100_utils.get_tmem_load_op(cfg.mma_tiler_mnk, LayoutEnum.ROW_MAJOR, cfg.c_dtype,
                                                     cfg.acc_dtype, epi_tile, False)
        # (EPI_TILE_M, EPI_TILE_N, EPI_M, EPI_N, ACC_STAGE)
        tAcc_epi = cute.flat_divide(tCtAcc_base[((None, None), 0, 0, None)], epi_tile)
        tiled_copy_t2r = tcgen05.make_tmem_copy(copy_atom_t2r, tAcc_epi[(None, None, 0, 0, 0)])
        thr_copy_t2r = tiled_copy_t2r.get_slice(tidx)
        # (T2R, T2R_M, T2R_N, EPI_M, EPI_N, ACC_STAGE)
        tTR_tAcc_base = thr_copy_t2r.partition_S(tAcc_epi)
        # (EPI_TILE_M, EPI_TILE_N, EPI_M, EPI_N, RestM, RestN, RestL)
        gC_epi = cute.flat_divide(tCgC[((None, None), 0, 0, None, None, None)], epi_tile)
        # (T2R, T2R_M, T2R_N, EPI_M, EPI_N, RestM, RestN, RestL)
        tTR_gC = thr_copy_t2r.partition_D(gC_epi)
        # (T2R, T2R_M, T2R_N)
        tTR_rAcc = cute.make_rmem_tensor(tTR_gC[(None, None, None, 0, 0, 0, 0, 0)].shape, cfg.acc_dtype)
        tTR_rC = cute.make_rmem_tensor(tTR_rAcc.shape, cfg.c_dtype)
        copy_atom_r2s = sm100_utils.get_smem_store_op(LayoutEnum.ROW_MAJOR, cfg.c_dtype, cfg.acc_dtype,
                                                      tiled_copy_t2r)
        tiled_copy_r2s = cute.make_tiled_copy_D(copy_atom_r2s, tiled_copy_t2r)
        thr_copy_r2s = tiled_copy_r2s.get_slice(tidx)
        # (R2S, R2S_M, R2S_N, C_STAGE)
        tRS_sC = thr_copy_r2s.partition_D(sC)
        # (R2S, R2S_M, R2S_N)
        tRS_rC = tiled_copy_r2s.retile(tTR_rC)
        # ((ATOM_V, REST_V), C_STAGE) and ((ATOM_V, REST_V), EPI_M, EPI_N, RestM, RestN, RestL)
        bSG_sC, bSG_gC_all = cpasync.tma_partition(tma_atom_c, 0, cute.make_layout(1), cute.group_modes(sC, 0, 2),
                                                   cute.group_modes(gC_epi, 0, 2))

        c_pipeline = pipeline.PipelineTmaStore.create(
            num_stages=self.num_c_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32 * self.num_epilogue_warps),
        )
        acc_consumer_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_acc_stages)
        group, group_first, group_tiles = scheduler.first_state()
        last_group = cutlass.Int32(-1)
        num_slices_stored = cutlass.Int32(0)
        tile_idx = cutlass.Int32(cta_idx)
        while tile_idx < num_tiles:
            group, group_first, group_tiles = scheduler.find_group(tile_idx, group, group_first, group_tiles)
            m = size_table[group, int(SizeColumn.M)]
            tile_m_idx, tile_n_idx = scheduler.tile_coord(tile_idx, group_first, m)
            group_changed = group != last_group
            # ((ATOM_V, REST_V), EPI)
            bSG_gC = cute.group_modes(bSG_gC_all[(None, None, None, tile_m_idx, tile_n_idx, 0)], 1, 3)
            # (T2R, T2R_M, T2R_N, EPI)
            tTR_tAcc = cute.group_modes(tTR_tAcc_base[(None, None, None, None, None, acc_consumer_state.index)],
                                        3, 5)
            acc_pipeline.consumer_wait(acc_consumer_state)
            if group_changed:
                if warp_idx == store_warp:
                    descriptors.acquire(group, c_slot)
            c_desc_ptr = descriptors.for_tma(group, c_slot)[0]

            if cutlass.const_expr(cfg.group_alpha):  # the size row's L column read as an fp32
                alpha = cute.make_tensor(cute.make_ptr(cutlass.Float32, size_table.iterator.toint(),
                                                       cute.AddressSpace.gmem, assumed_align=16),
                                         size_table.layout)[group, int(SizeColumn.L)]
            num_slices = cute.size(tTR_tAcc.shape, mode=[3])
            for slice_idx in cutlass.range(num_slices):
                cute.copy(tiled_copy_t2r, tTR_tAcc[(None, None, None, slice_idx)], tTR_rAcc)
                acc = tiled_copy_r2s.retile(tTR_rAcc).load()
                if cutlass.const_expr(cfg.group_alpha):
                    acc = acc * alpha
                tRS_rC.store(acc.to(cfg.c_dtype))
                c_buffer = (num_slices_stored + slice_idx) % self.num_c_stages
                cute.copy(tiled_copy_r2s, tRS_rC, tRS_sC[(None, None, None, c_buffer)])
                # The slice is in shared memory and visible to the TMA unit before warp 0 stores it.
                fence_smem_for_async_proxy()
                epilogue_barrier.arrive_and_wait()
                if warp_idx == store_warp:
                    cute.copy(tma_atom_c, bSG_sC[(None, c_buffer)], bSG_gC[(None, slice_idx)], tma_desc_ptr=c_desc_ptr)
                    c_pipeline.producer_commit()
                    # The next slice buffer has been read out by its earlier store.
                    c_pipeline.producer_acquire()
                epilogue_barrier.arrive_and_wait()
            num_slices_stored = num_slices_stored + num_slices
            # All of this accumulator is in registers or shared memory: the MMA warp may refill it.
            with cute.arch.elect_one():
                acc_pipeline.consumer_release(acc_consumer_state)
            acc_consumer_state.advance()
            last_group = group
            tile_idx = tile_idx + num_ctas
        # Stores complete before the CTA retires.
        c_pipeline.producer_tail()

    # -----------------------------------------------------------------------------------------------------
    # Partition helpers
    # -----------------------------------------------------------------------------------------------------
    def _s2t_copy_and_partition(self, sSF, tCtSF):
        return sm100_s2t_copy_and_partition(self.config.sf_dtype, sSF, tCtSF)


class GroupTensormapKernel:
    """Writes every group's TMA descriptors for a GEMM that prepares them up front (the Blackwell persistent
    kernel and the Hopper kernel: both arches run this code). One warp per group: CTA g stages, clears bit 85
    where the GEMM `clears_oob_128k_bit`, patches and releases row g (docs/B200_DESIGN.md#descriptor-preparation).
    """

    def __init__(self, gemm):
        self.gemm = gemm

    @cute.jit
    def __call__(
        self,
        ptr_table_ptr: cute.Pointer,
        size_table_ptr: cute.Pointer,
        tensormap_workspace_ptr: cute.Pointer,
        num_groups: cutlass.Constexpr[int],
    ):
        ptr_table, size_table = group_tables(ptr_table_ptr, size_table_ptr, num_groups)
        tensormaps = descriptor_table(tensormap_workspace_ptr, num_groups, len(self.gemm.descriptor_slots))
        self.kernel(self.gemm.descriptor_atoms(), ptr_table, size_table, tensormaps).launch(
            grid=(num_groups, 1, 1), block=(32, 1, 1), cluster=(1, 1, 1))

    @cute.kernel
    def kernel(self, atoms: tuple, ptr_table: cute.Tensor, size_table: cute.Tensor, tensormaps: cute.Tensor):
        group, _, _ = cute.arch.block_idx()
        slots = self.gemm.descriptor_slots

        @cute.struct
        class SharedStorage:
            tensormap_buffer: cute.struct.Align[
                cute.struct.MemRange[cutlass.Int64, len(slots) * TENSORMAP_BYTES // 8], TENSORMAP_BYTES
            ]

        buffer = SmemAllocator().allocate(SharedStorage).tensormap_buffer.data_ptr()
        # An empty group (M = 0) has no tile, so no descriptor: TMA has no zero-length dimension.
        if size_table[group, int(SizeColumn.M)] > 0:
            self.write_row(atoms, ptr_table, size_table, tensormaps, group, buffer)
        prepare_workspace = getattr(self.gemm, "prepare_workspace", None)
        if cutlass.const_expr(prepare_workspace is not None):
            prepare_workspace(tensormaps, group)

    @cute.jit
    def write_row(self, atoms: tuple, ptr_table: cute.Tensor, size_table: cute.Tensor, tensormaps: cute.Tensor,
                  group: cutlass.Int32, buffer: cute.Pointer):
        """Group `group`'s descriptors, staged in `buffer` as a per-CTA row is, released to row `group`."""
        slots = self.gemm.descriptor_slots
        rows = TmaDescriptorRows(False, tensormaps, group, buffer)
        rows.stage_from_atoms(atoms, slots, 0)
        if cutlass.const_expr(getattr(self.gemm, "clears_oob_128k_bit", False)):
            rows.clear_oob_128k_bit(slots)
        rows.patch(self.gemm.group_descriptor_tensors(ptr_table, size_table, group, tensormaps), atoms, slots, 0)


# ---------------------------------------------------------------------------------------------------------
# Arch backends: what each GPU arch plugs into the shared host path
# ---------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class GemmSchedule:
    """How one GEMM launch covers a problem: what its launch metadata holds besides the tables."""

    num_tiles: int
    num_ctas: int
    workspace_bytes: int  # descriptors (and the arch's own scratch) the launch's workspace holds
    counts: tuple  # the GEMM's launch ints after the table addresses (and the work list's)
    # a work list (int32 on the CPU), uploaded after the tables; its address follows the three table addresses
    work_words: Optional[torch.Tensor] = None
    prepass_counts: tuple = ()  # a prepass launch's ints after the table addresses; () when there is none


# Weight shapes whose per-problem config a backend remembers (`KernelBackend.weight_shape_choice`).
WEIGHT_SHAPE_CHOICES = 256


class KernelBackend:
    """One arch's kernels behind the shared host path; each method is one decision the host path leaves to
    the arch: `config` (what custom_kernel runs), `compile_config` (what compile_for builds by name), `key_config`
    (what the compile key holds), `parts` (its kernels, "gemm" first), `compile`, `schedule` (its GemmSchedule),
    `call_launcher`. A backend lives in its kernel's file and registers itself (docs/B200_DESIGN.md#arch-backends)."""

    arch_prefix = ""  # the target arches it builds for start so ("sm_100a": "sm_10")
    config_types: tuple = ()  # the config classes it compiles
    variant_configs: dict = {}  # variant name -> config, what compile_for takes

    def __init__(self):
        self._weight_shape_choices: "OrderedDict[tuple, object]" = OrderedDict()

    def weight_shape_choice(self, sizes, num_sms: int, choose: Callable):
        """`choose(sizes, num_sms)` (the arch's per-problem choice) on the first call of a weight shape (the
        group count, each group's N and K) and SM count, kept for other M (docs/B200_DESIGN.md#arch-backends)."""
        shape = (tuple((n, k) for _, n, k, _ in sizes), num_sms)
        config = self._weight_shape_choices.get(shape)
        if config is None:
            config = self._weight_shape_choices[shape] = choose(sizes, num_sms)
            if len(self._weight_shape_choices) > WEIGHT_SHAPE_CHOICES:
                self._weight_shape_choices.popitem(last=False)
        return config

    def key_config(self, config):
        return config

    def call_launcher(self, num_groups: int, arch: str, config, kernel: Callable, metadata) -> Callable[[], object]:
        return make_launcher(kernel, metadata.launch_args)


class Sm100Backend(KernelBackend):
    """Blackwell (sm_100a): the persistent kernel, its tile chosen per weight shape, or a variant forced."""

    arch_prefix = "sm_10"
    config_types = (Sm100GemmConfig, Sm100PersistentConfig)
    variant_configs = VARIANT_CONFIGS

    def config(self, sizes, num_sms: int):
        if KERNEL_VARIANT in TILE_TABLE_VARIANTS:
            return self.weight_shape_choice(sizes, num_sms, choose_sm100_config)
        return variant_config(KERNEL_VARIANT)

    def compile_config(self, variant: Optional[str]):
        if variant is not None:
            _check_choice("kernel variant", variant, KERNEL_VARIANTS)
        return variant_config(variant or KERNEL_VARIANT)

    def parts(self, config) -> tuple:
        """The GEMM, and the persistent kernel's descriptor preparation (once per input set)."""
        if isinstance(config, Sm100PersistentConfig):
            return ("gemm", "tensormaps")
        return ("gemm",)

    def compile(self, part: str, config, num_groups: int, options: dict):
        if isinstance(config, Sm100PersistentConfig):
            kernel = Sm100PersistentGroupedGemmKernel(config)
            if part == "tensormaps":
                return cute.compile(GroupTensormapKernel(kernel), *kernel_args((0, 0, 0)), num_groups, **options)
            return cute.compile(kernel, *kernel_args((0, 0, 0, 1, 1)), num_groups, **options)
        kernel = Sm100BlockScaledGroupedGemmKernel(config)
        return cute.compile(kernel, *kernel_args((0, 0, 0, 1)), num_groups, **options)

    def schedule(self, config, problem_sizes, device, num_sms: int) -> GemmSchedule:
        num_tiles = num_output_tiles(problem_sizes, config.tile_mn)
        if isinstance(config, Sm100PersistentConfig):
            num_ctas = min(num_tiles, num_sms)
            workspace = Sm100PersistentGroupedGemmKernel.tensormap_workspace_bytes(len(problem_sizes))
            return GemmSchedule(num_tiles, num_ctas, workspace, (num_tiles, num_ctas))
        workspace = Sm100BlockScaledGroupedGemmKernel.tensormap_workspace_bytes(num_tiles)
        return GemmSchedule(num_tiles, num_tiles, workspace, (num_tiles,))


_backends: dict = {}  # arch prefix -> backend
_backends_by_config: dict = {}  # config class -> backend


def register_backend(backend: KernelBackend) -> KernelBackend:
    _backends[backend.arch_prefix] = backend
    for config_type in backend.config_types:
        _backends_by_config[config_type] = backend
    return backend


SM100_BACKEND = register_backend(Sm100Backend())
# Arches whose backend lives in a file of its own beside this one, loaded on first use: the leaderboard
# receives this file alone, and a B200 never needs another.
BACKEND_MODULES = {"sm_90": "submission_sm90"}


def _load_backend_module(name: str):
    """The module `name`.py beside this file (imported once; it imports this module as `submission`)."""
    module = sys.modules.get(name)
    if module is not None:
        return module
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), name + ".py")
    if not os.path.isfile(path):
        raise UnsupportedDeviceError(f"this GPU's kernel is in {name}.py, which is not beside {__file__}: the "
                                     "leaderboard file alone runs on a B200 only")
    sys.modules.setdefault("submission", sys.modules[__name__])
    spec = importlib.util.spec_from_file_location(name, path)
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def backend_for_arch(arch: str) -> KernelBackend:
    """The backend of a target arch ("sm_100a", "sm_90a"), loading its file where it has one."""
    for prefix, name in BACKEND_MODULES.items():
        if arch.startswith(prefix) and prefix not in _backends:
            _load_backend_module(name)
    for prefix, backend in _backends.items():
        if arch.startswith(prefix):
            return backend
    raise UnsupportedDeviceError(f"no kernel for {arch}: kernels exist for sm_100a (Blackwell) and sm_90a (Hopper)")


def backend_of(config) -> KernelBackend:
    """The backend that compiles `config`."""
    return _backends_by_config[type(config)]


# ---------------------------------------------------------------------------------------------------------
# Compile cache
# ---------------------------------------------------------------------------------------------------------
def compile_key(num_groups: int, arch: str, config=None, part: str = "gemm") -> tuple:
    """The key of a compiled kernel: everything baked into it. The group count (the tables' static layouts;
    0 for the table upload, whose code does not depend on it: its word count comes at run time); target arch
    and DSL version; the config (default KERNEL_VARIANT's; its class names the kernel, it holds tile, stages,
    dtypes and descriptor scheme, less what `KernelBackend.key_config` leaves to run time); `part`, one of the
    backend's ("gemm", "tensormaps", ...) or "upload"; the launch ABI. Problem sizes, pointers, tile count and
    grid size are read at run time, so are not in it."""
    if config is None:
        config = variant_config(KERNEL_VARIANT)
    backend = _backends_by_config.get(type(config))
    if backend is not None:
        config = backend.key_config(config)
    groups = 0 if isinstance(config, TableUploadConfig) else int(num_groups)
    return ("nvfp4_grouped_gemm", part, arch, DSL_VERSION, config, groups, _launch_abi())


_compiled_kernels: dict = {}


def kernel_args(raw_args: tuple, num_tables: int = 3) -> tuple:
    """The DSL arguments of a kernel from plain ints: pointer table, size table, descriptor workspace (and with
    num_tables=4 the Hopper GEMM's work list) as typed, aligned pointers, then Int32 counts."""
    dtypes_aligns = ((cutlass.Int64, METADATA_ALIGN_BYTES), (cutlass.Int32, METADATA_ALIGN_BYTES),
                     (cutlass.Int64, TENSORMAP_BYTES), (cutlass.Int32, METADATA_ALIGN_BYTES))[:num_tables]
    tables = tuple(gmem_ptr(dtype, address, align) for (dtype, align), address in zip(dtypes_aligns, raw_args))
    return (*tables, *(cutlass.Int32(count) for count in raw_args[num_tables:]))


def _compile(key: tuple) -> Callable:
    _, part, arch, _, config, num_groups, abi = key
    options = {"options": "--enable-tvm-ffi"} if abi == "tvm_ffi" else {}
    if isinstance(config, TableUploadConfig):  # arch-neutral, one build for every group count
        return cute.compile(TableUploadKernel(config), *upload_args((0, 0, 1)), **options)
    backend = _backends_by_config.get(type(config))
    if backend is None or not arch.startswith(backend.arch_prefix):
        raise UnsupportedDeviceError(f"no kernel for {arch} with {type(config).__name__}: kernels exist for "
                                     "sm_100a (Blackwell) and sm_90a (Hopper)")
    return backend.compile(part, config, num_groups, options)


def compiled_kernel(key: tuple) -> Callable:
    fn = _compiled_kernels.get(key)
    if fn is None:
        fn = _compiled_kernels[key] = _compile(key)
    return fn


# ---------------------------------------------------------------------------------------------------------
# Launch paths: how a compiled kernel is called, cheapest first
# ---------------------------------------------------------------------------------------------------------
def _tvm_ffi_importable() -> bool:
    with contextlib.suppress(ImportError):
        return importlib.import_module("tvm_ffi") is not None  # the apache-tvm-ffi package
    return False


# "tvm_ffi": the DSL's TVM-FFI entry, plain ints in one C call (needs apache-tvm-ffi); "prepacked" (the default):
# the DSL's ctypes entry, its argument array packed once per prepared call; "dsl": the DSL's documented path.
# NOTES: prepacked measured fastest per cached call, tvm_ffi opt-in (docs/B200_DESIGN.md#launch-paths-measured).
LAUNCH_PATHS = ("tvm_ffi", "prepacked", "dsl")
DEFAULT_LAUNCH_PATH = "prepacked"
LAUNCH_PATH = _choice_from_env("NVFP4_LAUNCH_PATH", DEFAULT_LAUNCH_PATH, LAUNCH_PATHS)


def set_launch_path(name: str) -> None:
    """Select how custom_kernel launches (one of LAUNCH_PATHS); kernels and prepared calls are cached per path."""
    global LAUNCH_PATH
    _check_setter_name("set_launch_path", "launch path", name, LAUNCH_PATHS)
    if name == "tvm_ffi" and not _tvm_ffi_importable():
        raise ValueError("launch path 'tvm_ffi' needs the apache-tvm-ffi package (import tvm_ffi failed)")
    LAUNCH_PATH = name


def compiled_gemm(num_groups: int, arch: str, config) -> Callable:
    """The compiled GEMM for LAUNCH_PATH (a failed build raises; no path is ever swapped for another)."""
    return compiled_kernel(compile_key(num_groups, arch, config, "gemm"))


def _launch_abi() -> str:
    """The compiled entry LAUNCH_PATH calls: "tvm_ffi" or the DSL's ctypes one."""
    return "tvm_ffi" if LAUNCH_PATH == "tvm_ffi" else "ctypes"


_executors: dict = {}


def _executor(kernel: Callable, device_index: int):
    """The DSL's executor of a compiled kernel bound to a device, made once (binding costs far more than a launch)."""
    key = (id(kernel), device_index)
    entry = _executors.get(key)
    if entry is None or entry[0] is not kernel:
        entry = _executors[key] = (kernel, kernel.to(None))
    return entry[1]


def make_launcher(kernel: Callable, raw_args: tuple, to_dsl: Callable = kernel_args) -> Callable[[], object]:
    """A no-argument callable that launches `kernel`, compiled for _launch_abi(), with `raw_args` (plain ints;
    `to_dsl` makes the ctypes entry's DSL arguments from them), by LAUNCH_PATH. "prepacked" packs the C argument
    array once, pointing at storage the converted arguments own, which the closure keeps alive."""
    if _launch_abi() == "tvm_ffi":
        # 4.8 wraps the TVM-FFI function for keyword arguments; the positional function is underneath.
        return functools.partial(getattr(kernel, "_tvm_ffi_function", None) or kernel, *raw_args)
    args = to_dsl(raw_args)
    exe_args, adapted_args = kernel.generate_execution_args(*args)
    if LAUNCH_PATH == "dsl":
        exe_args = tuple(exe_args)

        def launch():
            # 4.3 appends to the list it is given, so each launch gets its own.
            return kernel.run_compiled_program(list(exe_args))
    else:
        executor = _executor(kernel, torch.cuda.current_device() if torch.cuda.is_available() else -1)
        # NOTES: the DSL's own packing (private; same name and meaning in 4.3 and 4.8): the argument
        # addresses, then the CUDA-result slot and the kernel function handles. Copied: 4.8 reuses its buffer.
        packed = executor._get_invoke_packed_args(list(exe_args))
        packed = (ctypes.c_void_p * len(packed))(*packed)
        capi, result = executor.jit_module.capi_func, executor.cuda_result

        def launch():
            capi(packed)
            if result is not None and result.value:
                raise RuntimeError(f"kernel launch failed with CUDA error {result.value}")
    launch.keep_alive = (kernel, args, exe_args, adapted_args)
    return launch


def _target_arch(device: Optional[torch.device]) -> str:
    """The arch the DSL compiles for: CUTE_DSL_ARCH if set, else the device's."""
    forced = os.environ.get("CUTE_DSL_ARCH")
    if forced:
        return forced
    if device is None:
        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device and CUTE_DSL_ARCH is not set: set CUTE_DSL_ARCH=sm_100a to build "
                               "without a GPU")
        device = torch.device("cuda", torch.cuda.current_device())
    major, minor = _device_capability(device.index)
    return f"sm_{major}{minor}a"


@functools.lru_cache(maxsize=None)
def _device_capability(index: int) -> tuple:
    return torch.cuda.get_device_capability(index)


@functools.lru_cache(maxsize=None)
def _device_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _check_device(device: torch.device) -> None:
    major, minor = _device_capability(device.index)
    if (major, minor) not in ((10, 0), (9, 0)):
        raise UnsupportedDeviceError(
            f"{torch.cuda.get_device_name(device)} ({device}) has compute capability {major}.{minor}; kernels "
            "exist for Blackwell B200 (10.0, sm_100a) and Hopper (9.0, sm_90a) only.")


def kernel_parts(config) -> tuple:
    """The compiled kernels a config launches, the GEMM first (its backend's `parts`)."""
    return backend_of(config).parts(config)


def make_call_launcher(num_groups: int, arch: str, config, kernel: Callable, metadata) -> Callable[[], object]:
    """What one custom_kernel call launches (its backend's `call_launcher`)."""
    return backend_of(config).call_launcher(num_groups, arch, config, kernel, metadata)


def compile_for(num_groups: int, arch: Optional[str] = None, variant: Optional[str] = None) -> Callable:
    """Build the kernels for `num_groups` groups, without launching them, through custom_kernel's cache, for
    CUTE_DSL_ARCH when set (no GPU needed), else the current GPU (`arch` must name that target); `variant`: one
    of its backend's `variant_configs`. Returns the compiled GEMM (docs/B200_DESIGN.md#building-without-a-gpu)."""
    target = _target_arch(None)
    if arch is not None and arch != target:
        raise ValueError(f"compile_for(arch={arch!r}), but the DSL builds for {target!r} (CUTE_DSL_ARCH or the GPU)")
    config = backend_for_arch(target).compile_config(variant)
    return [compiled_kernel(compile_key(num_groups, target, config, part)) for part in kernel_parts(config)][0]


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
    """(reason, None) if problem size (m, n, k, l) cannot run, else (None, per-tensor (dtype, shape, strides)),
    strides being what the kernel reads the tensor with (None: not read). Cached."""
    m, n, k, l = size
    if l != 1:
        return "L must be 1", None
    if m < 0:
        return "M must be at least 0", None
    if n < 1 or n % N_MULTIPLE:
        # NOTES: partial N tiles would take the masked path that partial M tiles take, but no task shape
        # has one and no B200 has run it here: rejected rather than trusted unverified.
        return f"N must be a positive multiple of {N_MULTIPLE} (the tile width)", None
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


@functools.lru_cache(maxsize=4096)
def _group_signature(size: tuple) -> Optional[tuple]:
    """What `_group_metadata` reads from a group of size (m, n, k, l) whose tensors are laid out exactly as
    the task's generator makes them, or None where the size cannot run: `can_implement`'s fast path."""
    _, spec = _group_spec(size)
    if spec is None:
        return None
    signature = [True]
    for dtype, shape, strides in spec:
        signature += (dtype, shape) if strides is None else (dtype, shape, strides)
    return tuple(signature)


def _group_metadata(abc_entry, sfs_entry, sfs_reordered_entry) -> tuple:
    """One group's tensor metadata in `_group_signature`'s order, led by whether all seven are tensors;
    raises on entries that are not three, two and two objects with tensor attributes."""
    (a, b, c), (sfa, sfb), (sfa_r, sfb_r) = abc_entry, sfs_entry, sfs_reordered_entry
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and isinstance(c, torch.Tensor)
            and isinstance(sfa, torch.Tensor) and isinstance(sfb, torch.Tensor)
            and isinstance(sfa_r, torch.Tensor) and isinstance(sfb_r, torch.Tensor),
            a.dtype, a.shape, a.stride(), b.dtype, b.shape, b.stride(), c.dtype, c.shape, c.stride(),
            sfa.dtype, sfa.shape, sfb.dtype, sfb.shape,
            sfa_r.dtype, sfa_r.shape, sfa_r.stride(), sfb_r.dtype, sfb_r.shape, sfb_r.stride())


def _generator_layouts(abc, sfasfb, sfasfb_r, sizes) -> bool:
    """Whether every group's tensors are laid out exactly as the task's generator makes them: their
    `_group_metadata` equal to `_group_signature` of their valid sizes. Raises as `_group_metadata` does."""
    return all(map(eq, map(_group_metadata, abc, sfasfb, sfasfb_r), map(_group_signature, map(tuple, sizes))))


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


_FOUR_INTS = (int,) * 4
# The device type of the tensors the kernels read. tests/host_path.py sets "cpu" to time the host path on CPU
# tensors, the driver's part stubbed.
KERNEL_DEVICE_TYPE = "cuda"


def check_problem_sizes(problem_sizes) -> tuple:
    """(True, "") if custom_kernel can run groups of these sizes ((m, n, k, l) each), else (False, reason
    naming the group): `can_implement`'s size rules alone, without tensors. Per group a 4-tuple of ints that
    `_group_spec` accepts; at least one group; fewer than 2**31 output tiles in all."""
    if not isinstance(problem_sizes, (list, tuple)):
        return False, f"problem_sizes must be a list, got {type(problem_sizes).__name__}"
    if len(problem_sizes) == 0:
        return False, "no groups: problem_sizes is empty"
    tile_m, tile_n = SM100_CONFIG.tile_mn
    num_tiles = 0
    for i, size in enumerate(problem_sizes):
        if not (isinstance(size, (tuple, list)) and len(size) == 4 and tuple(map(type, size)) == _FOUR_INTS):
            return False, f"group {i}: problem size {size!r} is not a 4-tuple of ints (m, n, k, l)"
        reason, _ = _group_spec(tuple(size))
        if reason:
            return False, f"{_where(i, size)}: {reason}"
        num_tiles += -(-size[0] // tile_m) * -(-size[1] // tile_n)
    if num_tiles >= 2**31:
        return False, f"{num_tiles} output tiles in all: more than one launch grid holds"
    return True, ""


def can_implement(data) -> tuple:
    """(True, "") if `custom_kernel(data)` can run this input, else (False, reason).

    The one statement of the constraint set, with `_group_spec` (its size rules alone: `check_problem_sizes`);
    pure Python on tensor metadata, no GPU needed: every group's sizes and tensor layouts first, then one CUDA
    device and 16-byte alignment for the groups with M > 0 (docs/B200_DESIGN.md#constraint-check).
    """
    reason, _ = _check_input(data)
    return not reason, reason


def _check_input(data) -> tuple:
    """`can_implement`'s answer as (reason, pointers): reason "" where custom_kernel can run `data`, and then
    its `kernel_pointers`, read once for the alignment check and the launch metadata (None: all groups empty)."""
    if not (isinstance(data, (tuple, list)) and len(data) == 4):
        return "data must be a 4-tuple (abc_tensors, sfasfb_tensors, sfasfb_reordered_tensors, problem_sizes)", None
    names = ("abc_tensors", "sfasfb_tensors", "sfasfb_reordered_tensors", "problem_sizes")
    for name, part in zip(names, data):
        if not isinstance(part, (list, tuple)):
            return f"{name} must be a list, got {type(part).__name__}", None
    abc, sfasfb, sfasfb_r, sizes = data
    lengths = [len(part) for part in data]
    if len(sizes) and len(set(lengths)) != 1:
        return "the four lists differ in length: " + ", ".join(f"{n}={v}" for n, v in zip(names, lengths)), None
    ok, reason = check_problem_sizes(sizes)
    if not ok:
        return reason, None
    try:  # the generator's exact layouts (every tensor of a MoE step, every call): one pass, no Python loop
        generators = _generator_layouts(abc, sfasfb, sfasfb_r, sizes)
    except Exception:  # NOTES: any error is left to _layout_reason, which names (or raises) it at its group
        generators = False
    if not generators:
        reason = _layout_reason(abc, sfasfb, sfasfb_r, sizes)
        if reason:
            return reason, None
    first = first_launched_group(sizes)
    if first is None:
        return "", None  # every group is empty: nothing is read, written or launched
    device = abc[first][0].device
    if device.type != KERNEL_DEVICE_TYPE:
        return f"the tensors are on {device}: the kernel needs every tensor it reads on one CUDA device", None
    launched = [size[0] > 0 for size in sizes]
    tensors = kernel_tensors(abc, sfasfb_r)
    read = [t for column in tensors for t in compress(column, launched)]
    if [t.device for t in read].count(device) != len(read):
        return _placement_reason(tensors, sizes, first, device), None
    pointers = kernel_pointers(tensors)  # of the empty groups too: the tables hold every group's
    if functools.reduce(or_, compress(pointers, launched * len(tensors)), 0) % GMEM_ALIGN_BYTES:
        return _placement_reason(tensors, sizes, first, device), None
    return "", pointers


def _layout_reason(abc, sfasfb, sfasfb_r, sizes) -> str:
    """Why the first group whose layout `custom_kernel` cannot read cannot be read, or "" where all can: the
    generator's exact layout first, the per-tensor checks (any stride of a length-1 dimension) where it differs."""
    for i, size in enumerate(sizes):
        size = tuple(size)
        try:
            if _generator_layouts(abc[i:i + 1], sfasfb[i:i + 1], sfasfb_r[i:i + 1], (size,)):
                continue
        except (TypeError, ValueError, AttributeError):
            pass  # not tensors, or entries of another length: the checks below name it
        for part, arity, what in ((abc, 3, "(a, b, c)"), (sfasfb, 2, "(sfa, sfb)"),
                                  (sfasfb_r, 2, "(sfa_reordered, sfb_reordered)")):
            if not (isinstance(part[i], (tuple, list)) and len(part[i]) == arity):
                return f"{_where(i, size)}: entry must be {what}"
        _, spec = _group_spec(size)
        tensors = (*abc[i], *sfasfb[i], *sfasfb_r[i])
        for name, t, (dtype, shape, strides) in zip(GROUP_TENSOR_NAMES, tensors, spec):
            # Exact strides first: the generator's; the general test only when they differ.
            if not (isinstance(t, torch.Tensor) and t.dtype == dtype and t.shape == shape
                    and (strides is None or 0 in shape or t.stride() == strides or _strides_match(t, strides))):
                return f"{_where(i, size)}: {_tensor_reason(name, t, dtype, shape, strides)}"
    return ""


def _placement_reason(tensors: tuple, sizes, first: int, device: torch.device) -> str:
    """Why the kernel cannot read the first tensor (of `kernel_tensors`, in group order) of a group with M > 0
    that is not on `device` (group `first`'s) or not aligned for TMA; called where one is."""
    for i, size in enumerate(sizes):
        if size[0] == 0:
            continue
        for name, column in zip(KERNEL_TENSOR_NAMES, tensors):
            t = column[i]
            if t.device != device:
                return (f"{_where(i, size)}: {name} is on {t.device}, group {first}'s a is on {device}; "
                        "the kernel needs every tensor it reads on one CUDA device")
            if t.data_ptr() % GMEM_ALIGN_BYTES:
                return f"{_where(i, size)}: {name} data is not {GMEM_ALIGN_BYTES}-byte aligned (TMA needs it)"
    return ""


# ---------------------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------------------
def _build_launch_metadata(data, device: torch.device, config, contents: tuple) -> LaunchMetadata:
    schedule = backend_of(config).schedule(config, data[3], device, _device_sm_count(device.index))
    staging, table_buffer, ptr_table, size_table, work_list = pack_group_metadata(contents, device,
                                                                                  schedule.work_words)
    workspace = aligned_device_buffer(schedule.workspace_bytes, TENSORMAP_BYTES, device)
    tables = (ptr_table.data_ptr(), size_table.data_ptr(), workspace.data_ptr())
    # The tables (and the work list) reach the device on the kernels' own queue, ahead of every kernel that
    # reads them: a new problem shape never makes the host wait for the device.
    upload = compiled_kernel(compile_key(len(data[3]), _target_arch(device), TABLE_UPLOAD_CONFIG, "upload"))
    make_launcher(upload, (staging.data_ptr(), table_buffer.data_ptr(), staging.numel()), upload_args)()
    _table_ring.uploaded()  # the staging piece is handed out again only once this upload has run
    prepass_args = (*tables, *schedule.prepass_counts) if schedule.prepass_counts else ()
    work_args = () if work_list is None else (work_list.data_ptr(),)
    own_list = work_list is not None and work_list.untyped_storage().data_ptr() != table_buffer.untyped_storage().data_ptr()
    held = sum(t.numel() * t.element_size() for t in (table_buffer, workspace, work_list if own_list else None)
               if t is not None)
    return LaunchMetadata(table_buffer, workspace, schedule.num_tiles, schedule.num_ctas,
                          (*tables, *work_args, *schedule.counts), tables, prepass_args, work_list, held)


def kernel_config(data, device: torch.device):
    """The config custom_kernel runs for this input here: its arch backend's choice (`config`), USE_PDL as now."""
    config = backend_for_arch(_target_arch(device)).config(data[3], _device_sm_count(device.index))
    if getattr(config, "use_pdl", USE_PDL) != USE_PDL:  # set_pdl() since import
        config = dataclasses.replace(config, use_pdl=USE_PDL)
    return config


def launch_metadata(data, device: torch.device, config=None, pointers: Optional[tuple] = None) -> LaunchMetadata:
    """The launch metadata of `config` (default: kernel_config) for these pointers (`kernel_pointers`, given
    or read here) and sizes, built (descriptors prepared where the kernel has that part) on a cache miss."""
    config = config or kernel_config(data, device)
    key = (config, launch_metadata_key(data, config.tile_mn, pointers))

    def build():
        metadata = _build_launch_metadata(data, device, config, key[1][2])
        if "tensormaps" in kernel_parts(config):
            # Queued ahead of every GEMM that will use this workspace; it completes before they start.
            prepare = compiled_kernel(compile_key(len(data[3]), _target_arch(device), config, "tensormaps"))
            make_launcher(prepare, metadata.table_args)()
        return metadata

    return cached_launch_metadata(key, build)


@dataclasses.dataclass(frozen=True)
class _PreparedCall:
    """Everything a repeated call on the same input objects needs: the launch, nothing else. It holds the
    input's lists and their items, so no id of them is reused while the entry lives."""

    lists: tuple  # (abc_tensors, sfasfb_reordered_tensors, problem_sizes) of the call
    items: tuple  # their items when the entry was made
    launch: Callable[[], object]  # make_launcher(compiled kernel, metadata.launch_args); _launch_nothing
    metadata: Optional[LaunchMetadata]  # None when every group is empty
    outputs: tuple  # every group's C, empty ones included; a new list of them is returned each call
    held_bytes: int = 0  # bytes of the A, SFA and C tensors it keeps alive (from the sizes)
    tensors: tuple = ()  # every tensor of the items that the launch reads or writes (a, b, c, sfa, sfb per group)
    pointers: list = dataclasses.field(default_factory=list)  # their addresses when the entry was made


# The benchmark times 15 input sets per shape; 16 entries hold them. An entry keeps its call's tensors alive,
# so past PREPARED_CALL_CACHE_BYTES of them the oldest go (docs/B200_DESIGN.md#prepared-calls).
PREPARED_CALL_CACHE_SIZE = 16
PREPARED_CALL_CACHE_BYTES = 1 << 30
_prepared_calls: dict = {}


def _prepared_call(data) -> Optional[_PreparedCall]:
    """The prepared call for exactly these input objects, or None (then the full path runs).
    NOTES: identity of the lists and of each item is checked, and each used tensor's address (`set_`, `resize_` or
    a storage made again keep the objects, not the addresses): docs/B200_DESIGN.md#prepared-calls."""
    entry = _prepared_calls.get((KERNEL_VARIANT, LAUNCH_PATH, USE_PDL, id(data)))
    if entry is None or type(data) is not tuple or len(data) != 4:
        return None
    abc, sfr, sizes = entry.lists
    abc_items, sfr_items, size_items = entry.items
    if (data[0] is abc and data[2] is sfr and data[3] is sizes
            and len(abc) == len(abc_items) and len(sfr) == len(sfr_items) and len(sizes) == len(size_items)
            and all(map(is_, abc, abc_items)) and all(map(is_, sfr, sfr_items)) and all(map(is_, sizes, size_items))
            and list(map(torch.Tensor.data_ptr, entry.tensors)) == entry.pointers):
        return entry
    return None


def forget_prepared_calls() -> None:
    """Drops every prepared call (a setting outside their key changed: submission_sm90.set_sm90_variant)."""
    _prepared_calls.clear()


def _forget_prepared_calls_of(dropped: list) -> None:
    """Drops the prepared calls that hold launch metadata the metadata cache dropped (and its device memory)."""
    gone = {id(metadata) for metadata in dropped}
    for key in [key for key, entry in _prepared_calls.items() if id(entry.metadata) in gone]:
        del _prepared_calls[key]


def first_launched_group(sizes) -> Optional[int]:
    """The first group with M > 0 (its tensors name the device), or None when every group is empty."""
    return next((i for i, size in enumerate(sizes) if size[0] != 0), None)


def _launch_nothing() -> None:
    """The launch of an input whose groups are all empty."""


def _prepare_call(data) -> _PreparedCall:
    """The full path: constraint check, device check, compile (cached per group count), launch metadata
    (cached). Every group reaches the tables, empty ones too; with every group empty nothing is launched."""
    reason, pointers = _check_input(data)
    if reason:
        raise ValueError(reason)
    abc, _, sfr, sizes = data
    first = first_launched_group(sizes)
    if first is None:
        metadata, launch = None, _launch_nothing
    else:
        device = abc[first][0].device
        _check_device(device)
        config = kernel_config(data, device)
        kernel = compiled_gemm(len(sizes), _target_arch(device), config)
        metadata = launch_metadata(data, device, config, pointers)
        launch = make_call_launcher(len(sizes), _target_arch(device), config, kernel, metadata)
    held = sum(m * (k // 2 + k // 16 + 2 * n) for m, n, k, _ in sizes)
    tensors = tuple(chain(chain.from_iterable(abc), chain.from_iterable(sfr)))
    entry = _PreparedCall(lists=(abc, sfr, sizes), items=(tuple(abc), tuple(sfr), tuple(sizes)),
                          launch=launch, metadata=metadata, outputs=tuple(c for _, _, c in abc), held_bytes=held,
                          tensors=tensors, pointers=list(map(torch.Tensor.data_ptr, tensors)))
    # Only immutable items make identity a proof of equal contents.
    if type(data) is tuple and all(type(x) is tuple for part in entry.items for x in part):
        key = (KERNEL_VARIANT, LAUNCH_PATH, USE_PDL, id(data))
        _prepared_calls.pop(key, None)  # (an entry of a dead input whose id this one took): re-inserted last
        _prepared_calls[key] = entry
        drop_oldest(_prepared_calls, PREPARED_CALL_CACHE_SIZE, PREPARED_CALL_CACHE_BYTES, attrgetter("held_bytes"))
    return entry


def custom_kernel(data: input_t) -> output_t:
    """GPU MODE entry point: writes every group's C = (A * SFA) @ (B * SFB)^T and returns the list of C.

    Raises ValueError(reason) when `can_implement` rejects the input, UnsupportedDeviceError on a GPU that is
    neither a B200 (sm_100) nor a Hopper (sm_90), before anything is compiled or launched. A repeated call on
    the same input objects skips to the launch (`_prepared_call`). Queue: README.md, "Which GPU queue".
    """
    entry = _prepared_call(data)
    if entry is None:
        entry = _prepare_call(data)
    entry.launch()
    return list(entry.outputs)
