"""`python bench.py --moe`: the kernel on routed-expert GEMMs of real MoE layers, where most experts get a
few tokens, some none, and the time goes to streaming the active experts' weights.

A case is one expert GEMM of a layer: E experts, each B [N, K] (NVFP4 weights), and the rows that top-k
routing of T tokens sends to each expert as its A [M_e, K]; an expert that no token picked has M_e = 0 and
its tensors have 0 rows (the task's data layout allows it). Routing is seeded: expert popularity follows a
Zipf law (rank^-s) over a shuffle of the experts and each token draws top-k distinct experts by it, so
popularity is skewed and some experts stay empty. Values are full range: every e2m1 code, e4m3 scales of
both signs with subnormals (not only the task generator's 0, ±0.5, ±1, ±1.5 and {1, 2}).

Per case, in one process: the first call (seconds, compiles included: the DSL's disk cache is off), then
`--moe-patterns` calls on tokens routed anew over the same weights (another set of empty experts, the same
expert count), counting the kernel compiles of each (growth of submission's compile cache, read only);
every output of these calls checked element by element against an independent float64 decode; then the
median µs of `--moe-calls` calls of the kernel, of torch._grouped_mm and of a cuBLAS loop (torch.mm per
non-empty expert), both on bf16 operands dequantized beforehand (not timed), each call timed alone with CUDA
events, L2 flushed before it. Floors: the fp4 bytes of the active experts at the DRAM read rate, and bf16's
(bytes with 2-byte operands, or tensor-core time, whichever is larger). Progress goes to stderr, the
markdown table and its notes to stdout; exit 1 when an output missed its tolerance or a case failed.

Diagnostics: the `parts-k*` cases (PART_CASES, run only when named) give 128 experts 16 rows each with K from 256
to 2048, so a line through their times parts a part's fixed cost from its chunks'; `--moe-shared-weights` points
every expert at one expert's weights, which then come from L2: the kernel without the weights' DRAM traffic.
"""
import cProfile
import dataclasses
import io
import math
import os
import pstats
import statistics
import sys
import time
from typing import Callable, Optional

import torch

import harness
import reference
from utils import clear_l2_cache

# NOTES: DRAM read rate of the H200 this project measures on (torch, 4 GiB read: 4.14 TB/s; a copy, read +
# write, reached 4.25). Weight streaming is a read, so the floors use the read rate.
DRAM_READ_BYTES_PER_S = 4.14e12
# NOTES: torch bf16 8192^3 matmul on random data, same H200; the ceiling of the bf16 peers' tensor cores.
BF16_FLOPS_PER_S = 790e12

# The check: the leaderboard's rtol = atol = 1e-3, widened by the fp32 summation error of full-range data,
# 2^-24 x sqrt(K) x sum_k |a_k b_k| (at K = 7168 fp32 accumulation alone can miss 1e-3 on near-cancelling
# elements; the task's narrow data never does).
CHECK_TOL = dict(rtol=1e-3, atol=1e-3, sum_rel=2.0 ** -24)
# Scale codes: every finite e4m3 code (both signs, zero and subnormals) whose exponent field is at most
# this, so up to 7.5 (A) and 1.875 (B); results then stay well inside fp16 at K = 7168 (rms about 900).
A_SCALE_EXP_MAX, B_SCALE_EXP_MAX = 9, 7


@dataclasses.dataclass(frozen=True)
class MoeCase:
    name: str  # what --moe-cases selects
    layer: str  # the model and GEMM, for the table
    n: int
    k: int
    experts: int
    tokens: int
    top_k: int = 8
    zipf: float = 1.0  # popularity exponent s: expert of rank r is picked with weight r^-s
    seed: int = 1
    rows: int = 0  # > 0: every expert gets exactly this many rows (no routing draw; experts x rows = tokens x top_k)


# Zipf exponents (seed 1, torch 2.13): 1.0 leaves 13 (256 tokens) and 95 (64 tokens) of DeepSeek-V3's 256
# experts empty; Qwen3's 4096 routed rows over 128 experts need 1.6 for a few (2-6) empties.
MOE_CASES = (
    MoeCase("dsv3-up-256", "DeepSeek-V3 gate/up", 4096, 7168, 256, 256),
    MoeCase("dsv3-up-64", "DeepSeek-V3 gate/up", 4096, 7168, 256, 64),
    MoeCase("dsv3-down-256", "DeepSeek-V3 down", 7168, 2048, 256, 256),
    MoeCase("qwen3-up-512", "Qwen3-30B-A3B gate/up", 1536, 2048, 128, 512, zipf=1.6),
    MoeCase("qwen3-down-512", "Qwen3-30B-A3B down", 2048, 768, 128, 512, zipf=1.6),
    MoeCase("prefill-dsv3-up-4096", "prefill: DeepSeek-V3 gate/up", 4096, 7168, 32, 4096),
)


# Diagnostic cases, run only when named (`--moe-cases parts-k256,parts-k2048`): 128 experts of 16 rows each, N 1536,
# K 256 to 2048, so that every CTA runs the same parts (11.6 per SM on 132 SMs) of 2 to 16 chunks each; a line
# through their times parts a part's fixed cost from its chunks' (docs/HOPPER_NOTES.md d37).
PART_CASES = tuple(MoeCase(f"parts-k{k}", "uniform: 128 experts x 16 rows", 1536, k, 128, 256, rows=16)
                   for k in (256, 512, 1024, 2048))


def select_cases(names: Optional[str]) -> list:
    """The cases named in a comma-separated list (MOE_CASES when None; PART_CASES only by name); ValueError
    naming an unknown one."""
    return harness.pick_by_name(names, MOE_CASES, MOE_CASES + PART_CASES, "--moe-cases")


# bench.py's options that --moe does not take, by their argparse names
OTHER_OPTIONS = (("cases", "a case file"), ("repeats", "--repeats"), ("plot", "--plot"), ("skip_slow", "--skip-slow"),
                 ("launch_paths", "--launch-paths"), ("pdl_ab", "--pdl-ab"), ("no_humming", "--no-humming"))


def foreign_option(args, defaults: dict, options: tuple) -> Optional[str]:
    """The first of `options` ((argparse name, flag) pairs) given a value other than its default, or None."""
    return next((flag for dest, flag in options if getattr(args, dest) != defaults[dest]), None)


def options_problem(args, defaults: dict) -> Optional[str]:
    """What is wrong with bench.py's MoE options (one line), or None; fills in the defaults of --moe-calls
    (20) and --moe-patterns (3) when --moe is given."""
    given = [f"--moe-{o}" for o in ("cases", "calls", "patterns") if getattr(args, f"moe_{o}") is not None]
    given += ["--moe-profile"] if getattr(args, "moe_profile", False) else []
    given += ["--moe-shared-weights"] if getattr(args, "moe_shared_weights", False) else []
    if not args.moe:
        return f"{given[0]} needs --moe" if given else None
    other = foreign_option(args, defaults, OTHER_OPTIONS)
    if other:
        return f"{other} does not apply to --moe (it runs its own cases; its options: --moe-cases, " \
               "--moe-calls, --moe-patterns, --moe-profile, --moe-shared-weights, --ab)"
    try:
        select_cases(args.moe_cases)
    except ValueError as err:
        return str(err)
    args.moe_calls = args.moe_calls or 20
    args.moe_patterns = 3 if args.moe_patterns is None else args.moe_patterns
    return None


def route(case: MoeCase, seed: int) -> list:
    """Rows per expert: each of the case's tokens picks top_k distinct experts, drawn without replacement
    with weights rank^-zipf over a seeded shuffle of the experts; sums to tokens x top_k. A case with `rows` gives
    every expert that many, whatever the seed."""
    if case.rows:
        return [case.rows] * case.experts
    gen = torch.Generator().manual_seed(seed)
    rank = torch.randperm(case.experts, generator=gen).double() + 1
    weight = (rank ** -case.zipf).float()
    picks = torch.multinomial(weight.expand(case.tokens, -1), case.top_k, replacement=False, generator=gen)
    return torch.bincount(picks.flatten(), minlength=case.experts).tolist()


# ---------------------------------------------------------------------------------------------------------
# Inputs, and an independent float64 decoder (from the bit definitions of e2m1 and e4m3, not reference.py)
# ---------------------------------------------------------------------------------------------------------
def e2m1_value(code: int) -> float:
    """Bit 3 sign, bits 2..1 exponent (bias 1), bit 0 mantissa; exponent 0 is subnormal."""
    exponent, mantissa = (code >> 1) & 3, code & 1
    magnitude = mantissa / 2 if exponent == 0 else math.ldexp(1 + mantissa / 2, exponent - 1)
    return -magnitude if code & 8 else magnitude


def e4m3_value(code: int) -> float:
    """e4m3fn: bit 7 sign, bits 6..3 exponent (bias 7), bits 2..0 mantissa; S.1111.111 is NaN."""
    exponent, mantissa = (code >> 3) & 15, code & 7
    if exponent == 15 and mantissa == 7:
        return math.nan
    magnitude = math.ldexp(mantissa / 8, -6) if exponent == 0 else math.ldexp(1 + mantissa / 8, exponent - 7)
    return -magnitude if code & 0x80 else magnitude


def scale_codes(exp_max: int) -> list:
    return [c for c in range(256) if (c >> 3) & 15 <= exp_max and c & 0x7F != 0x7F]


def dequantize(packed: torch.Tensor, scales: torch.Tensor, dtype=torch.float64) -> torch.Tensor:
    """[rows, k/2] fp4x2 (element 2j in the low nibble of byte j) and [rows, k/16] e4m3 -> [rows, k] `dtype`
    on packed's device (exact in float64, float32 and bf16: every e2m1 x e4m3 product fits them)."""
    codes = packed.view(torch.uint8)
    e2m1 = torch.tensor([e2m1_value(c) for c in range(16)], dtype=dtype, device=codes.device)
    e4m3 = torch.tensor([e4m3_value(c) for c in range(256)], dtype=dtype, device=codes.device)
    values = torch.stack((e2m1[(codes & 15).long()], e2m1[(codes >> 4).long()]), dim=-1).flatten(-2)
    scale = e4m3[scales.to(codes.device).contiguous().view(torch.uint8).long()]
    return values * scale.repeat_interleave(16, dim=1)


def _fp4(rows: int, k: int, gen, device) -> torch.Tensor:
    """[rows, k/2, 1] fp4x2 of random bytes (every e2m1 code), the task's (l, rows, k/2) layout permuted."""
    raw = torch.randint(0, 256, (1, rows, k // 2), generator=gen, dtype=torch.uint8, device=device)
    return raw.permute(1, 2, 0).view(torch.float4_e2m1fn_x2)


def _scales(rows: int, k: int, exp_max: int, gen, device) -> torch.Tensor:
    pool = torch.tensor(scale_codes(exp_max), dtype=torch.uint8, device=device)
    pick = torch.randint(0, len(pool), (1, rows, k // 16), generator=gen, device=device)
    return pool[pick].view(torch.float8_e4m3fn).permute(1, 2, 0)


def make_weights(case: MoeCase, device, shared: bool = False) -> list:
    """(b, sfb, sfb_reordered) of every expert, seeded by the case; shared: every expert's are the first expert's
    tensors (`--moe-shared-weights`)."""
    gen = torch.Generator(device).manual_seed(case.seed)
    torch.manual_seed(case.seed)  # the reordered scales' padding
    weights = []
    for _ in range(1 if shared else case.experts):
        b, sfb = _fp4(case.n, case.k, gen, device), _scales(case.n, case.k, B_SCALE_EXP_MAX, gen, device)
        weights.append((b, sfb, reference.create_reordered_scale_factor_tensor(1, case.n, case.k, sfb)))
    return weights * case.experts if shared else weights


def make_input(case: MoeCase, ms: list, weights: list, seed: int, device):
    """The task's input tuple: per expert (a, b, c), (sfa, sfb), reordered scales and (m, n, k, 1); A and
    SFA drawn for `ms` rows, C poisoned with NaN, B and its scales the given weights."""
    gen = torch.Generator(device).manual_seed(seed)
    torch.manual_seed(seed)
    abc, sfs, sfs_reordered, sizes = [], [], [], []
    for m, (b, sfb, sfb_r) in zip(ms, weights):
        a, sfa = _fp4(m, case.k, gen, device), _scales(m, case.k, A_SCALE_EXP_MAX, gen, device)
        c = torch.full((1, m, case.n), math.nan, dtype=torch.float16, device=device).permute(1, 2, 0)
        abc.append((a, b, c))
        sfs.append((sfa, sfb))
        sfs_reordered.append((reference.create_reordered_scale_factor_tensor(1, m, case.k, sfa), sfb_r))
        sizes.append((m, case.n, case.k, 1))
    return abc, sfs, sfs_reordered, sizes


def worst_error_ratio(data, outputs) -> float:
    """Largest |out - exact| / tolerance over every element of every expert (CHECK_TOL; exact = the float64
    decode's product); inf for a non-finite output, a wrong shape or a wrong count."""
    abc, sfs, _, sizes = data
    if len(outputs) != len(sizes):
        return math.inf
    worst = 0.0
    for (a, b, _), (sfa, sfb), (m, n, k, _), out in zip(abc, sfs, sizes, outputs):
        if tuple(out.shape) != (m, n, 1):
            return math.inf
        if m == 0:
            continue
        a64, b64 = dequantize(a[:, :, 0], sfa[:, :, 0]), dequantize(b[:, :, 0], sfb[:, :, 0])
        worst = max(worst, block_error_ratio(a64, b64, out[:, :, 0], CHECK_TOL))
    return worst


def block_error_ratio(a64: torch.Tensor, b64: torch.Tensor, out: torch.Tensor, tol: dict) -> float:
    """Largest |out - a64 b64^T| / (atol + rtol |exact| + sum_rel sqrt(K) sum_k |a b|) over one expert's block
    (float64 operands [M, K] and [N, K]); inf for a non-finite element."""
    exact = a64 @ b64.T
    bound = (tol["atol"] + tol["rtol"] * exact.abs()
             + tol["sum_rel"] * math.sqrt(a64.shape[1]) * (a64.abs() @ b64.abs().T))
    ratio = (out.to(device=exact.device, dtype=torch.float64) - exact).abs() / bound
    return ratio.nan_to_num(nan=math.inf).max().item()


# ---------------------------------------------------------------------------------------------------------
# Floors, peers, timing
# ---------------------------------------------------------------------------------------------------------
def floors(n: int, k: int, ms: list) -> dict:
    """Bytes and µs of the two floors of one call. fp4: B + SFB of the experts with M > 0, A + SFA of every
    row, fp16 C. bf16: B of those experts and A in bf16, C; its µs the larger of those bytes at the DRAM
    rate and 2 M N K at the bf16 tensor-core rate (`bf16_bound` says which)."""
    active, rows = sum(1 for m in ms if m), sum(ms)
    fp4_bytes = active * (n * k // 2 + n * k // 16) + rows * (k // 2 + k // 16) + rows * n * 2
    bf16_bytes = active * n * k * 2 + rows * k * 2 + rows * n * 2
    flops = 2 * rows * n * k
    bytes_us, flops_us = bf16_bytes / DRAM_READ_BYTES_PER_S * 1e6, flops / BF16_FLOPS_PER_S * 1e6
    return dict(fp4_bytes=fp4_bytes, fp4_us=fp4_bytes / DRAM_READ_BYTES_PER_S * 1e6, bf16_bytes=bf16_bytes,
                flops=flops, bf16_us=max(bytes_us, flops_us), bf16_bound="flops" if flops_us > bytes_us else "bytes")


def median_us(fn: Callable[[], object], calls: int) -> float:
    """Median µs of `calls` calls, each alone between CUDA events, L2 flushed before it; one untimed call first.

    NOTES: the flush writes 256 MiB (5x the H200's L2), not the runner's 64 GB: the bf16 peers' weights
    (15 GB for DeepSeek-V3 gate/up) share the GPU with it."""
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(calls):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        clear_l2_cache()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) * 1e3)
    return statistics.median(samples)


def time_peers(data, calls: int, times: dict, notes: list, label: str) -> None:
    """torch._grouped_mm (all experts, empty ones as repeated offsets) and torch.mm per non-empty expert, on
    bf16 operands dequantized here (not timed), into times["grouped_mm"] and times["cuBLAS loop"]."""
    abc, sfs, _, sizes = data
    ms = [size[0] for size in sizes]
    a16 = torch.cat([dequantize(a[:, :, 0], sfa[:, :, 0], torch.float32).bfloat16() for (a, _, _), (sfa, _) in
                     zip(abc, sfs)])
    n, k = sizes[0][1:3]
    b16 = torch.empty((len(sizes), n, k), dtype=torch.bfloat16, device=a16.device)  # [E, N, K], filled in place
    for e, ((_, b, _), (_, sfb)) in enumerate(zip(abc, sfs)):
        b16[e] = dequantize(b[:, :, 0], sfb[:, :, 0], torch.float32)
    offs = torch.tensor(ms, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(a16.device)
    starts = [0, *offs.tolist()[:-1]]
    work = [(a16[s:s + m], b16[e].t(), torch.empty((m, b16.shape[1]), dtype=torch.bfloat16, device=a16.device))
            for e, (s, m) in enumerate(zip(starts, ms)) if m]

    def cublas_loop():
        for a, b_t, c in work:
            torch.mm(a, b_t, out=c)

    for name, fn in (("grouped_mm", lambda: torch._grouped_mm(a16, b16.transpose(1, 2), offs=offs)),
                     ("cuBLAS loop", cublas_loop)):
        try:
            times[name] = median_us(fn, calls)
        except Exception as err:  # a peer that cannot run costs its cell, not the run
            notes.append(f"{name} on {label}: failed, {type(err).__name__}: {' '.join(str(err).split())[:200]}")


def compile_counter(submission) -> Optional[Callable[[], int]]:
    """The size of submission's compile cache (one entry per compiled kernel part), read only; None without one."""
    cache = getattr(submission, "_compiled_kernels", None)
    return (lambda: len(cache)) if isinstance(cache, dict) else None


@dataclasses.dataclass
class MoeRow:
    case: MoeCase
    ms: list  # rows per expert of the timed input
    times: dict = dataclasses.field(default_factory=dict)  # µs: "kernel", "grouped_mm", "cuBLAS loop"
    first_s: Optional[float] = None
    compiles_first: Optional[int] = None
    compiles_later: Optional[int] = None
    later_empties: list = dataclasses.field(default_factory=list)  # empty experts of each re-routed input
    later_host_ms: list = dataclasses.field(default_factory=list)  # host ms of each re-routed call (GPU busy)
    worst: float = 0.0  # worst |err| / tolerance over every checked output
    error: Optional[str] = None  # why the case stopped


# Clock cycles of device work queued before each re-routed call (torch.cuda._sleep): ~100 ms at 1.98 GHz, several
# times a re-routed call's host time, so a call that waited for the device takes at least that long (with ~20 ms
# a 20-30 ms call could not be told from a wait).
BUSY_CYCLES = 200_000_000
BUSY_MS = BUSY_CYCLES / 1.98e6


class DeviceWaitProbe:
    """Taken right after the device work queued before a re-routed call: `note` afterwards says, where that
    work had finished by the time the call returned (so the call ran past it, or waited for the device), how
    many device allocations and allocator retries the call made (a retry frees the allocator's cache, and
    freeing device memory waits for the device): the facts to tell a slow host path from a wait."""

    STATS = ("num_device_alloc", "num_alloc_retries")

    def __init__(self):
        self.queued = torch.cuda.Event()
        self.queued.record()
        self.stats = self._stats()

    @classmethod
    def _stats(cls) -> tuple:
        stats = torch.cuda.memory_stats()
        return tuple(stats.get(key, 0) for key in cls.STATS)

    def note(self, what: str, host_ms: float) -> Optional[str]:
        if not self.queued.query():
            return None
        allocs, retries = (after - before for after, before in zip(self._stats(), self.stats))
        return (f"{what}: {host_ms:.1f} ms on the host, and the ~{BUSY_MS:.0f} ms of device work queued "
                f"before it had finished by its end; in the call {allocs} device allocations (cudaMalloc) and "
                f"{retries} allocator retries (a retry frees the cache, which waits for the device)")


def profile_lines(fn: Callable[[], object], top: int = 15) -> list:
    """Runs fn once under cProfile: the `top` entries by cumulative time (pstats' table), as lines."""
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        fn()
    finally:
        profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(top)
    return [line for line in text.getvalue().splitlines() if line.strip()]


def run_case(case: MoeCase, submission, calls: int, patterns: int, device, notes: list,
             profile: bool = False, shared: bool = False) -> MoeRow:
    say = lambda what: harness.progress(f"[{case.name}] {what}")  # noqa: E731
    count = compile_counter(submission)
    on_gpu = torch.device(device).type == "cuda"
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    keep_gpu_busy = (lambda: torch.cuda._sleep(BUSY_CYCLES)) if on_gpu else (lambda: None)
    row = MoeRow(case, route(case, case.seed))
    weights = make_weights(case, device, shared)
    data = make_input(case, row.ms, weights, case.seed, device)
    say(f"{sum(1 for m in row.ms if m == 0)} of {case.experts} experts empty, max M {max(row.ms)}; first call")
    before = count() if count else 0
    start = time.perf_counter()
    out = submission.custom_kernel(data)
    sync()
    row.first_s = time.perf_counter() - start
    row.compiles_first = count() - before if count else None
    row.worst = worst_error_ratio(data, out)
    later = 0
    for p in range(1, patterns + 1):
        ms = route(case, case.seed + p)
        row.later_empties.append(sum(1 for m in ms if m == 0))
        say(f"re-routed tokens {p}/{patterns}: {row.later_empties[-1]} experts empty")
        other = make_input(case, ms, weights, case.seed + p, device)
        before = count() if count else 0
        sync()
        keep_gpu_busy()  # a call that waited for the device would wait for this too
        probe = DeviceWaitProbe() if on_gpu else None
        start = time.perf_counter()
        out = submission.custom_kernel(other)
        row.later_host_ms.append((time.perf_counter() - start) * 1e3)
        if probe is not None:
            note = probe.note(f"{case.name} re-routed call {p}", row.later_host_ms[-1])
            if note:
                notes.append(note)
        sync()
        later += count() - before if count else 0
        row.worst = max(row.worst, worst_error_ratio(other, out))
        del other, out
    row.compiles_later = later if count else None
    if profile:  # one more routing, profiled (its host time is not in the table: the profiler slows it)
        other = make_input(case, route(case, case.seed + patterns + 1), weights, case.seed + patterns + 1, device)
        sync()
        keep_gpu_busy()
        say("profile of a re-routed call (GPU busy), by cumulative time:")
        for line in profile_lines(lambda: submission.custom_kernel(other)):
            harness.progress("    " + line)
        sync()
        del other
    say(f"timing the kernel ({calls} calls)")
    row.times["kernel"] = median_us(lambda: submission.custom_kernel(data), calls)
    say("dequantizing to bf16 (not timed), timing torch._grouped_mm and the cuBLAS loop")
    time_peers(data, calls, row.times, notes, case.name)
    return row


# ---------------------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------------------
HEADER = ("case", "N × K", "experts (empty)", "tokens × top-k (max M)", "kernel µs", "TFLOP/s", "GB/s",
          "fp4 floor µs (kernel/floor)", "bf16 floor µs (kernel/floor)", "grouped_mm µs (peer/kernel)",
          "cuBLAS loop µs (peer/kernel)", "first call s", "re-routed call host ms", "compiles first / later (empties)",
          "check err/tol")


def _count(value: Optional[int]) -> str:
    return "n/a" if value is None else str(value)


def row_cells(row: MoeRow) -> list:
    case, ms = row.case, row.ms
    f = floors(case.n, case.k, ms)
    kernel = row.times.get("kernel")
    cells = [f"{case.layer} ({case.name})", f"{case.n} × {case.k}",
             f"{case.experts} ({sum(1 for m in ms if m == 0)})", f"{case.tokens} × {case.top_k} ({max(ms)})"]
    if kernel is None:
        cells += ["-"] * 3
    else:
        cells += [f"{kernel:.1f}", f"{f['flops'] / kernel / 1e6:.1f}", f"{f['fp4_bytes'] / kernel / 1e3:.0f}"]
    ratio = (lambda us: f" ({kernel / us:.2f}×)") if kernel else (lambda us: "")
    cells += [f"{f['fp4_us']:.1f}{ratio(f['fp4_us'])}", f"{f['bf16_us']:.1f} {f['bf16_bound']}{ratio(f['bf16_us'])}"]
    for peer in ("grouped_mm", "cuBLAS loop"):
        us = row.times.get(peer)
        cells.append("-" if us is None else f"{us:.1f}" + (f" ({us / kernel:.2f}×)" if kernel else ""))
    cells.append("-" if row.first_s is None else f"{row.first_s:.1f}")
    cells.append(f"{statistics.median(row.later_host_ms):.2f}" if row.later_host_ms else "-")
    empties = ", ".join(str(e) for e in row.later_empties)
    cells.append(f"{_count(row.compiles_first)} / {_count(row.compiles_later)}" + (f" ({empties})" if empties else ""))
    if row.error:
        cells.append(f"ERROR: {row.error}")
    else:
        cells.append(f"{row.worst:.3f}" + ("" if row.worst <= 1 else " FAIL"))
    return cells


def table_lines(rows: list) -> list:
    """The markdown table: a header, its rule, one line per case."""
    return ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)] + [
        "| " + " | ".join(row_cells(row)) + " |" for row in rows]


def notes_lines(gpu: str, submission, calls: int, patterns: int) -> list:
    counted = compile_counter(submission) is not None
    flag = os.environ.get("CUTE_DSL_DISABLE_FILE_CACHING", "")
    cache = "off" if flag not in ("", "0") else "on: CUTE_DSL_DISABLE_FILE_CACHING is not set"
    return [
        f"{gpu}; kernel: submission.custom_kernel (nvidia-cutlass-dsl {getattr(submission, 'DSL_VERSION', '?')}, "
        f"launch path {getattr(submission, 'LAUNCH_PATH', '?')}); each µs the median of {calls} calls, each timed "
        "alone with CUDA events, L2 flushed (256 MiB written) before it.",
        f"fp4 floor: bytes of B + SFB of the non-empty experts, A + SFA and fp16 C, at {DRAM_READ_BYTES_PER_S / 1e12}"
        " TB/s (DRAM read, measured on an H200). bf16 floor: the same with bf16 A and B (no scales) at that rate, "
        f"or 2 M N K at {BF16_FLOPS_PER_S / 1e12:.0f} TFLOP/s, whichever is larger (named in the cell). GB/s: fp4 "
        "floor bytes / kernel time.",
        "Peers on bf16 operands dequantized beforehand (not timed): torch._grouped_mm over all experts (empty ones "
        "as repeated offsets), cuBLAS loop = torch.mm per non-empty expert.",
        f"Inputs: every e2m1 code; e4m3 scales of both signs, zero and subnormals, up to "
        f"{e4m3_value(scale_codes(A_SCALE_EXP_MAX)[-1] & 0x7F)} (A) and "
        f"{e4m3_value(scale_codes(B_SCALE_EXP_MAX)[-1] & 0x7F)} (B). Routing: each token picks top-k distinct "
        "experts with weights rank^-s over a seeded shuffle (s per case).",
        f"First call: seconds, compiles included (the DSL's disk cache {cache}). Compiles: kernels added to "
        "submission._compiled_kernels (every part: GEMM, table upload, ...), on the first call of the case (the "
        f"cache carries over from earlier cases) / on {patterns} later calls with tokens routed anew over the "
        "same weights (their counts of empty experts in parentheses)." if counted else
        "Compiles: n/a (submission has no _compiled_kernels cache to read).",
        "Re-routed call host ms: wall time of a custom_kernel call on a new routing (a new problem shape: "
        "constraint check, plan, tables and work list, launches), issued while the GPU still runs about "
        f"{BUSY_MS:.0f} ms of queued work, so a call that waited for the device would take at least "
        "that long; the median over the re-routed calls.",
        "Check: every output element of the first and the re-routed calls (outputs NaN-poisoned) against a float64 "
        "decode: |out - exact| <= 1e-3 + 1e-3 |exact| + 2^-24 sqrt(K) sum|a b|; the worst ratio shown, above 1 "
        "fails.",
    ]


SHARED_WEIGHTS_NOTE = ("Weights shared (--moe-shared-weights): every expert's B and scales are one expert's tensors, so "
                       "after the first touch they come from L2: the kernel's time without the weights' DRAM traffic "
                       "(a diagnostic). The floors are still those of distinct weights.")


def main(args, submission, device="cuda") -> int:
    """bench.py --moe after bench.py parsed its options and imported the submission on a CUDA GPU."""
    cases = select_cases(args.moe_cases)
    calls, patterns = args.moe_calls, args.moe_patterns
    shared = getattr(args, "moe_shared_weights", False)
    rows, notes = [], []
    if shared:
        notes.append(SHARED_WEIGHTS_NOTE)
    if any(case.rows for case in cases):
        notes.append("parts-k* cases: no routing draw; every expert gets the same rows, so every re-routed call "
                     "repeats the first call's shape.")
    for idx, case in enumerate(cases):
        harness.progress(f"[{idx + 1}/{len(cases)}] {case.name}: {case.layer}, N {case.n} K {case.k}, "
                         f"{case.experts} experts, {case.tokens} tokens x top-{case.top_k}")
        try:
            rows.append(run_case(case, submission, calls, patterns, torch.device(device), notes,
                                 getattr(args, "moe_profile", False), shared))
        except Exception as err:  # one case's failure is its row, and the run goes on
            harness.progress(f"[{case.name}] failed: {type(err).__name__}: {err}")
            rows.append(MoeRow(case, route(case, case.seed), error=f"{type(err).__name__}: "
                                                                  f"{' '.join(str(err).split())[:120]}"))
        torch.cuda.empty_cache()
    print("\n".join(table_lines(rows) + [""] + notes_lines(torch.cuda.get_device_name(), submission, calls, patterns)
                    + notes))
    return 1 if any(row.error or row.worst > 1 for row in rows) else 0


if __name__ == "__main__":
    sys.exit(harness.not_a_command("bench_moe.py", "not a command of its own: python bench.py --moe runs its cases "
                                                   "(python bench.py --help lists the options)", sys.argv[1:]))
