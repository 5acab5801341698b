"""Times the submission against torch baselines on the benchmark shapes, in one run, with the runner's method.

    python bench.py [FILE] [--repeats N] [--plot roofline.png] [--skip-slow] [--launch-paths P,Q] [--no-humming]
    python bench.py [FILE] --pdl-ab ROUNDS
    python bench.py [FILE] --ab A B [C ...] [--ab-rounds N] [--repeats N]
    python bench.py --moe [--moe-cases A,B] [--moe-calls N] [--moe-patterns N] [--moe-profile] [--moe-shared-weights]
    python bench.py --moe --ab A B [C ...] [--ab-rounds N] [--moe-cases A,B] [--moe-calls N] [--moe-shared-weights]
    python bench.py --moe --serving [--serving-cases A,B] [--serving-steps N] [--serving-check-steps N] [--serving-schedule]
                                    [--no-humming]

For every benchmark case of FILE (default task.yml) it times, each on the same 15 input sets:
  kernel         submission.custom_kernel(data)
  dequant+mm     reference.ref_kernel: torch dequantization then fp32 matmul, per group (no tensor cores fp4)
  cuBLAS loop    torch.mm per group on bf16 operands dequantized beforehand (dequantization not timed)
  grouped_mm     torch._grouped_mm on the same pre-dequantized bf16 operands (one call for all groups)
  humming        where `import humming` works (humming-kernels 0.1.19, vllm-project/humming): its grouped
                 W4A16 GEMM, one call for all groups, on A already in fp16 (humming has no fp4 x fp4 path on
                 Hopper) times NVFP4 B (packed fp4, e4m3 block-16 scales) given once to humming's own
                 transform (not timed); its result is checked against the reference (rtol = atol = 1e-3)
  A→fp16         that exact dequantization of A for humming (concatenation + one Triton kernel), timed alone
Timing is the runner's: L2 flushed, CUDA events around 15 back-to-back calls on the 15 inputs, mean per
call over repeats. It prints µs, × of each baseline against the kernel, and the two floors of this GPU
(bf16 tensor-core time at the measured matrix rate, and the fp4 bytes at the measured copy bandwidth),
then the host time of one custom_kernel call on its own (CPU wall time per call, launches only).
With --launch-paths (names from submission.LAUNCH_PATHS) it also times the kernel and its host cost once per
launch path, side by side, next to the host cost of one small torch kernel launch.
With --ab it only times the kernel under two or more settings A, B, ..., in turn (A B C, C B A, ...) in
--ab-rounds rounds in one process on the same inputs, each setting's output checked first; it prints each
setting's median µs over the rounds and its ratio to A's. A setting is comma-separated items: variant=NAME (a
B200 or Hopper variant), sm90.FIELD=VALUE (a Sm90GemmConfig field over the chosen Hopper build's, an integer
or on/off, such as a lever under measurement: submission_sm90.set_sm90_overrides), pdl=on|off, or default;
what it leaves unnamed is the module's default. With --moe it does so on the MoE cases (bench_moe's timing and
check). --pdl-ab ROUNDS is --ab pdl=on pdl=off --ab-rounds ROUNDS.
With --moe it runs bench_moe.py's cases instead: routed-expert GEMMs of DeepSeek-V3 and Qwen3-30B-A3B layers
(128-256 experts, top-8 routing with skewed popularity, some experts empty, full-range values), the kernel
against torch._grouped_mm and a cuBLAS loop on bf16, the fp4-bytes and bf16 floors, the first call's time
and its compiles; a markdown table on stdout (bench_moe.py's docstring says how). --moe-profile adds, on
stderr, a profile of one more re-routed call per case: where a new routing's host time goes.
--moe-cases also takes the diagnostic cases parts-k256, parts-k512, parts-k1024 and parts-k2048 (128 experts of 16
rows each, K 256 to 2048: a part's fixed cost against its chunks'), which only run when named, and
--moe-shared-weights points every expert at one expert's weights (then read from L2): the kernel without the
weights' DRAM traffic.
With --moe --serving it runs bench_serving.py instead: nvfp4_moe.nvfp4_moe_mm in a decode loop with a new routing
drawn on the GPU every step, eager and in CUDA graphs, beside torch._grouped_mm and humming (bench_serving.py says how).
Notes under the table say whether humming passed the check (and its worst |err|/tol), or why its column is
absent (humming-kernels not importable, or --no-humming).
"""
import argparse
import dataclasses
import glob
import itertools
import json
import math
import os
import re
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_moe  # noqa: E402
import bench_serving  # noqa: E402
import harness  # noqa: E402  (cases, work counts)
import reference  # noqa: E402
from utils import clear_l2_cache_large, verbose_allclose  # noqa: E402

NUM_INPUTS = 15
# Ceilings measured on an H200 (torch bf16 8192^3 matmul on random data; device-to-device copy).
H200_BF16_FLOPS = 790e12
H200_BYTES_PER_S = 4.3e12


def _time_per_call(fn, inputs, repeats: int) -> float:
    """Mean µs per call: events around len(inputs) back-to-back calls, L2 flushed before each batch.

    Every input is called once first, so compiles and first-call work (launch metadata of new pointers)
    stay out of the mean; the runner's harness pays them in its first repeat and averages them over up to
    100 repeats (`eval.py benchmark` measures exactly that way).
    """
    for data in inputs:
        fn(data)
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        # the runner's order: wait, flush, record; the calls queue behind the flush (no wait after it)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        clear_l2_cache_large()
        start.record()
        for data in inputs:
            fn(data)
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / len(inputs))
    return statistics.fmean(samples)


def _dequantized_bf16(data):
    """Per group (A [m, k], B [n, k]) in bf16, exact (every e2m1 x e4m3 product fits bf16)."""
    abc, sfs, _, _ = data
    return [(reference.dequantize(a[:, :, 0], sfa[:, :, 0]).to(torch.bfloat16),
             reference.dequantize(b[:, :, 0], sfb[:, :, 0]).to(torch.bfloat16)) for (a, b, _), (sfa, sfb) in
            zip(abc, sfs)]


def _grouped_operands(pre):
    """torch._grouped_mm operands: A stacked over groups [sum m, k], B [G, k, n] (column-major), offsets."""
    a = torch.cat([x for x, _ in pre]).contiguous()
    b = torch.stack([y for _, y in pre]).transpose(1, 2)
    offs = torch.tensor([x.shape[0] for x, _ in pre], dtype=torch.int32, device=a.device).cumsum(0, dtype=torch.int32)
    return a, b, offs


# ---------------------------------------------------------------------------------------------------------
# humming-kernels (vllm-project/humming): an optional peer column. Hopper has no fp4 x fp4 tensor cores and
# humming does W4A16 there: fp16 A times NVFP4 B (e2m1, e4m3 scales per 16 k, an fp32 scale per group).
# ---------------------------------------------------------------------------------------------------------
HUMMING_TOL = dict(rtol=1e-3, atol=1e-3)  # the leaderboard's

try:  # humming imports Triton itself, so it is here whenever the humming column is
    import triton
    import triton.language as tl
except ImportError:
    triton = None
else:
    @triton.jit
    def _nvfp4_to_fp16(q_ptr, s_ptr, out_ptr, rows, K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
        # out[r, k] = e2m1 code k of row r (two per byte of q, the low nibble first) x e4m3 scale s[r, k // 16];
        # exact: every such product is an fp16 value
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)[:, None]
        k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)[None, :]
        inside = (r < rows) & (k < K)
        code = (tl.load(q_ptr + r * (K // 2) + k // 2, mask=inside, other=0).to(tl.int32) >> (k % 2 * 4)) & 15
        exponent = (code >> 1) & 3
        half_mantissa = (code & 1).to(tl.float32) * 0.5
        power = tl.where(exponent == 3, 4.0, tl.where(exponent == 2, 2.0, 1.0))
        magnitude = tl.where(exponent == 0, half_mantissa, (1.0 + half_mantissa) * power)
        scale = tl.load(s_ptr + r * (K // 16) + k // 16, mask=inside, other=0).to(tl.float8e4nv, bitcast=True)
        value = tl.where(code >= 8, -magnitude, magnitude) * scale.to(tl.float32)
        tl.store(out_ptr + r * K + k, value.to(tl.float16), mask=inside)


def _one_line(err: BaseException, limit: int = 300) -> str:
    text = f"{type(err).__name__}: {' '.join(str(err).split())}"
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _nvcc_home() -> Optional[str]:
    """The toolkit of the nvcc on PATH, through a wrapper script that execs the real one; None without headers."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None
    real = os.path.realpath(nvcc)
    try:
        with open(real, "rb") as f:
            head = f.read(4096)
    except OSError:
        head = b""
    found = re.search(rb"(/[^\s\"']+/bin/nvcc)\b", head) if head.startswith(b"#!") else None
    if found:
        real = os.path.realpath(found.group(1).decode())
    home = os.path.dirname(os.path.dirname(real))
    return home if os.path.isdir(os.path.join(home, "include")) else None


def humming_problem() -> Optional[str]:
    """Why `import humming` fails here, in one line, or None once it worked.

    humming reads its environment when imported, so it is set first: HUMMING_DISABLE_PARALLEL_BUILD=1 (else
    the import starts background rebuilds of helper binaries the wheel ships), and CUDA_HOME from the nvcc on
    PATH where humming's own search ($CUDA_HOME, $CUDA_PATH, /usr/local/cuda*) has nothing. After the import,
    the NVRTC library's folder goes on LD_LIBRARY_PATH: humming's compile helper process loads it by path and
    it then looks for its builtins library there.
    """
    os.environ.setdefault("HUMMING_DISABLE_PARALLEL_BUILD", "1")
    toolkit = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or glob.glob("/usr/local/cuda*/bin/nvcc")
    home = None if toolkit else _nvcc_home()
    if home:
        os.environ["CUDA_HOME"] = home
    try:
        import humming  # noqa: F401
    except Exception as err:  # a missing wheel, or one of its imports (triton, cuda-bindings) failing
        return _one_line(err)
    try:
        from humming.utils.nvrtc import _find_nvrtc_lib_dir

        lib_dir = _find_nvrtc_lib_dir()[0]
    except Exception:  # no NVRTC (or no CUDA torch): humming compiles with nvcc instead
        lib_dir = None
    paths = [p for p in os.environ.get("LD_LIBRARY_PATH", "").split(":") if p]
    if lib_dir and lib_dir not in paths:
        os.environ["LD_LIBRARY_PATH"] = ":".join([lib_dir, *paths])
    return None


def humming_note(skip: bool) -> Optional[str]:
    """The note that replaces the humming column, or None when it is shown."""
    if skip:
        return "humming column left out (--no-humming)"
    problem = humming_problem()
    return f"humming-kernels not importable: {problem}" if problem else None


def humming_expert_layout(ms) -> list:
    """humming's expert_layout of a grouped-contiguous GEMM: the first row of each group in A, then the total."""
    return [0, *itertools.accumulate(ms)]


def humming_weight(data) -> dict:
    """B of every group as humming takes NVFP4 MoE weights, before its transform: the packed bytes as int32
    [g, n, k/8] (humming's element i of a word is bits 4i..4i+3: two e2m1 per byte, the low nibble first, as
    here), the plain e4m3 scales [g, n, k/16] (moved to B's device) and a global scale of 1 per group."""
    abc, sfs, _, _ = data
    weight = torch.stack([b[:, :, 0].view(torch.uint8) for _, b, _ in abc])
    scales = torch.stack([sfb[:, :, 0].view(torch.uint8) for _, sfb in sfs]).to(weight.device)
    return humming_weight_of_codes(weight, scales.view(torch.float8_e4m3fn))


def humming_weight_of_codes(codes: torch.Tensor, scales: torch.Tensor, scale_2: Optional[torch.Tensor] = None) -> dict:
    """`humming_weight`'s dict from the codes uint8 [g, n, k/2] and the e4m3 scales [g, n, k/16] of every group, and
    their fp32 global scales [g] (1 where None)."""
    if scale_2 is None:
        scale_2 = torch.ones(codes.shape[0], dtype=torch.float32, device=codes.device)
    return {"weight": codes.view(torch.int32), "weight_scale": scales, "weight_scale_2": scale_2}


def align_block_size(flat_ids: torch.Tensor, num_experts: int, block: int) -> tuple:
    """vLLM's moe_align_block_size in torch, no host read: (sorted pair ids int32 [capacity], each expert's padded
    to a multiple of `block` with the sentinel T k; expert id int32 per block; padded count int32 [1]). capacity =
    T k + E (block - 1), rounded up to a block: every routing fits."""
    pairs = flat_ids.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat_ids.device)
    counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids))
    padded = (counts + block - 1) // block * block
    padded_end = padded.cumsum(0)
    key, order = torch.sort(flat_ids, stable=True)
    rank_in_expert = torch.arange(pairs, device=flat_ids.device) - (counts.cumsum(0) - counts)[key]
    capacity = -(-(pairs + num_experts * (block - 1)) // block) * block
    sorted_ids = torch.full((capacity,), pairs, dtype=torch.int32, device=flat_ids.device)
    sorted_ids.scatter_(0, (padded_end - padded)[key] + rank_in_expert, order.to(torch.int32))
    starts = torch.arange(0, capacity, block, device=flat_ids.device)
    expert_ids = torch.searchsorted(padded_end, starts, right=True).clamp(max=num_experts - 1).to(torch.int32)
    return sorted_ids, expert_ids, padded_end[-1:].to(torch.int32)


def humming_indexed_gemm(n: int, k: int, experts: int, rows: int, codes: torch.Tensor, scales: torch.Tensor,
                         scale_2: Optional[torch.Tensor] = None) -> tuple:
    """humming's W4A16 indexed MoE GEMM as vLLM calls it, on NVFP4 weights (codes uint8 [E, n, k/2], e4m3 scales
    [E, n, k/16], global scales [E] or 1) through its transform here (not timed), its tile chosen by its heuristic
    for `rows` routed pairs: (call, block). call(a fp16 [T, k], out fp16 [T top_k, n], sorted_ids, expert_ids,
    padded, top_k) -> out, row p of out being pair p (token p // top_k), with `align_block_size(flat_ids, E,
    block)`'s three tensors. Compiles humming's kernel (minutes the first time); raises where humming cannot."""
    from humming import ops
    from humming.transform import transform_humming_tensors

    def build():
        config, tuning, kernel = _humming_build(n, k, experts, rows, "indexed")
        w = transform_humming_tensors(config, humming_weight_of_codes(codes, scales, scale_2))
        return kernel, w, int(tuning["block_shape"][0])

    kernel, w, block = _with_compiler_fallback(build)
    locks = torch.zeros(1 << 16, dtype=torch.int32, device=codes.device)  # stream-K counters, if its tile uses any

    def call(a, out, sorted_ids, expert_ids, padded, top_k):
        ops.launch_kernel(configs=kernel, inputs=a, weight=w["weight"], weight_scale=w["weight_scale"],
                          weight_scale_2=w["weight_scale_2"], outputs=out, sorted_ids=sorted_ids,
                          expert_ids=expert_ids, num_tokens_padded=padded, locks=locks, top_k=top_k)
        return out

    return call, block


def humming_launch(kernel, w: dict, a: torch.Tensor, out: torch.Tensor, layout: torch.Tensor, locks: torch.Tensor):
    """One humming grouped W4A16 GEMM: out = a (fp16, groups' rows back to back at `layout`) times the weights `w`
    (through humming's transform); locks: its stream-K counters, if its tile uses any."""
    from humming import ops

    ops.launch_kernel(configs=kernel, inputs=a, weight=w["weight"], weight_scale=w["weight_scale"],
                      weight_scale_2=w["weight_scale_2"], outputs=out, expert_layout=layout, locks=locks)


def worst_ratio(outputs, expected, rtol: float, atol: float) -> float:
    """Largest |out - ref| / (atol + rtol |ref|) over every element (inf where out is NaN)."""
    worst = 0.0
    for out, ref in zip(outputs, expected):
        if out.numel():
            ratio = (out.float() - ref.float()).abs() / (atol + rtol * ref.float().abs())
            worst = max(worst, ratio.nan_to_num(nan=math.inf).max().item())
    return worst


def _humming_build(n: int, k: int, experts: int, rows: int, gemm_type: str) -> tuple:
    """(humming's layer config for fp16 A x NVFP4 B over `experts` groups, the tile its own heuristic picks for
    `rows` rows, that kernel compiled or taken from humming's disk cache) of one of its MoE forms: gemm_type
    "grouped_contiguous" (A's rows of all groups back to back) or "indexed" (vLLM's: A's rows through sorted pair
    ids)."""
    from humming import dtypes
    from humming.kernel.humming import HummingKernel
    from humming.schema import HummingWeightSchema
    from humming.transform import prepare_layer_config
    from humming.tune import get_heuristics_config

    device = torch.cuda.current_device()
    schema = HummingWeightSchema(b_dtype=dtypes.float4e2m1, bs_dtype=dtypes.float8e4m3, weight_scale_group_size=16,
                                 weight_scale_type="group", weight_scale_2_type="tensor")
    layer = prepare_layer_config(shape_n=n, shape_k=k, weight_schema=schema, num_experts=experts,
                                 torch_dtype=torch.float16, device=device)
    tuning = dict(get_heuristics_config(layer, shape_m=rows, gemm_type=gemm_type, device=device))
    return layer, tuning, HummingKernel.prepare_kernels(layer.to_str(), json.dumps({"gemm_type": gemm_type}),
                                                        json.dumps(tuning), device=device)


def _humming_kernel(n: int, k: int, ms: list):
    """`_humming_build`'s grouped-contiguous kernel for groups of `ms` rows."""
    return _humming_build(n, k, len(ms), sum(ms), "grouped_contiguous")


def _humming_weight_of(layer, data) -> dict:
    """B of `data` through humming's own transform (repacked for its kernel): weight preparation, not timed."""
    from humming.transform import transform_humming_tensors

    return transform_humming_tensors(layer, humming_weight(data))


def _with_compiler_fallback(build):
    """build() with humming's default compiler (NVRTC where cuda-bindings has it), then once with nvcc, which
    stays chosen for later cases if it worked; HUMMING_COMPILER set by the user is left alone."""
    if os.environ.get("HUMMING_COMPILER"):
        return build()
    try:
        return build()
    except Exception as first:
        os.environ["HUMMING_COMPILER"] = "nvcc"
        try:
            return build()
        except Exception as second:
            del os.environ["HUMMING_COMPILER"]
            raise RuntimeError(f"default compiler: {_one_line(first, 200)}; nvcc: {_one_line(second, 200)}") from second


def _a_to_fp16(item) -> None:
    """A of all groups, packed fp4 -> [sum m, k] fp16 in item["a16"] (timed as the A→fp16 column)."""
    packed = torch.cat(item["a"])
    rows, k = item["a16"].shape
    _nvfp4_to_fp16[(triton.cdiv(rows, 32), triton.cdiv(k, 256))](packed, item["sfa"], item["a16"], rows, K=k,
                                                                  BLOCK_R=32, BLOCK_K=256)


def humming_case(case, inputs, repeats: int, times: dict) -> str:
    """Times humming (into times["humming"]) and A's dequantization for it (times["A→fp16"]) on the inputs of
    one case; returns the note on its check, or on why it could not run."""
    label = harness._short(case)
    ms, ns, ks = (list(case.args[key]) for key in ("m", "n", "k"))
    if len(set(ns)) > 1 or len(set(ks)) > 1:
        return f"humming {label}: not run (one grouped call needs the same n and k in every group)"
    try:
        from humming.jit.runtime import KernelRuntime

        def build():
            layer, tuning, kernel = _humming_kernel(ns[0], ks[0], ms)
            return layer, tuning, kernel, _humming_weight_of(layer, inputs[0])  # the transform compiles too

        layer, tuning, kernel, first = _with_compiler_fallback(build)
        compiler = KernelRuntime._get_compiler().__name__.replace("Compiler", "")
        device = first["weight"].device
        layout = torch.tensor(humming_expert_layout(ms), dtype=torch.int32, device=device)
        locks = torch.zeros(1 << 16, dtype=torch.int32, device=device)  # stream-K counters, if its tile uses any
        sets = []
        for i, data in enumerate(inputs):  # weight preparation and operand buffers, none of it timed
            abc, sfs, _, _ = data
            sets.append(dict(
                w=first if i == 0 else _humming_weight_of(layer, data),
                a=[a[:, :, 0].view(torch.uint8) for a, _, _ in abc],
                sfa=torch.cat([sfa[:, :, 0].view(torch.uint8) for sfa, _ in sfs]).to(device),
                a16=torch.empty((sum(ms), ks[0]), dtype=torch.float16, device=device),
                c=torch.empty((sum(ms), ns[0]), dtype=torch.float16, device=device)))

        def gemm(item):
            humming_launch(kernel, item["w"], item["a16"], item["c"], layout, locks)

        for item, data in zip(sets, inputs):
            _a_to_fp16(item)
            exact = torch.cat([reference.dequantize(a[:, :, 0], sfa[:, :, 0]) for (a, _, _), (sfa, _) in
                               zip(data[0], data[1])])
            if not torch.equal(item["a16"].float(), exact):
                raise RuntimeError("the Triton A→fp16 kernel differs from reference.dequantize")
        times["A→fp16"] = _time_per_call(_a_to_fp16, sets, repeats)
        worst, passed = 0.0, True
        for item, data in zip(sets, inputs):
            item["c"].fill_(math.nan)
            gemm(item)
            expected = [c[:, :, 0] for c in reference.ref_kernel(harness._clone_data(data))]
            outputs = list(item["c"].split(ms))
            worst = max(worst, worst_ratio(outputs, expected, **HUMMING_TOL))
            passed &= not any(verbose_allclose(o, e, **HUMMING_TOL) for o, e in zip(outputs, expected))
        times["humming"] = _time_per_call(gemm, sets, repeats)
    except Exception as err:  # a peer that fails costs its column on this case, not the run
        times.pop("A→fp16", None)
        return f"humming {label}: failed, {_one_line(err)}"
    verdict = "passes" if passed else "FAILS"
    return (f"humming {label}: {verdict} rtol = atol = 1e-3 on all {len(inputs)} inputs, worst |err|/tol "
            f"{worst:.3f} (tile {tuning.get('block_shape')}, compiled with {compiler})")


def host_us_per_call(custom_kernel, inputs, calls: int = 300) -> float:
    """Median CPU wall time of one custom_kernel call (launch only, no synchronisation), over batches."""
    for data in inputs:
        custom_kernel(data)
    torch.cuda.synchronize()
    per_call = []
    for _ in range(max(1, calls // len(inputs))):
        t0 = time.perf_counter()
        for data in inputs:
            custom_kernel(data)
        per_call.append((time.perf_counter() - t0) * 1e6 / len(inputs))
    torch.cuda.synchronize()
    return statistics.median(per_call)


def torch_launch_us(calls: int = 3000) -> float:
    """Host µs of launching one tiny torch kernel (an in-place add): the cost of any launch from Python."""
    x = torch.zeros(1, device="cuda")
    return host_us_per_call(lambda _: x.add_(1), [None] * 15, calls)


def case_inputs(case) -> list:
    """The NUM_INPUTS input sets of a benchmark case, seeded as the runner seeds them."""
    return [reference.generate_input(**dict(case.args, seed=case.args["seed"] + 42 * (i + 1)))
            for i in range(NUM_INPUTS)]


def wrong(custom_kernel, case, inputs, what: str) -> bool:
    """Checks custom_kernel on a copy of the first input; prints why and returns True if it is wrong."""
    ok, msg = reference.check_implementation(inputs[0], custom_kernel(harness._clone_data(inputs[0])))
    if not ok:
        print(f"bench.py: {what} is wrong on {harness._short(case)}: {msg}", file=sys.stderr)
    return not ok


# ---------------------------------------------------------------------------------------------------------
# --ab: the kernel under two settings, alternating in one process on the same inputs
# ---------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class KernelSetting:
    """What `--ab` switches between: a kernel variant (B200 or Hopper; None: the defaults), Hopper config fields
    over the chosen build's (`submission_sm90.set_sm90_overrides`: a lever under measurement, or any other
    field) and programmatic dependent launch (None: the module's default)."""

    text: str
    variant: Optional[str] = None
    overrides: tuple = ()  # (field, value) pairs
    pdl: Optional[bool] = None


SETTING_FORMS = "variant=NAME, sm90.FIELD=VALUE, pdl=on|off, or default"
AB_NAMES = "ABCDEFGH"  # what --ab calls its settings, in the order given


def _override_value(kind: type, value: str):
    """A --ab value for an Sm90GemmConfig field of type `kind` (on/off for a switch), or None if it is not one."""
    if kind is bool:
        return {"on": True, "off": False}.get(value)
    return int(value) if kind is int and value.isdigit() else None


def parse_setting(text: str, variants: tuple, field_types: dict) -> KernelSetting:
    """A `--ab` setting: comma-separated items of SETTING_FORMS (FIELD a key of `field_types`), each kind once;
    ValueError naming the item that is wrong."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise ValueError(f"--ab: empty setting {text!r}; give {SETTING_FORMS}")
    variant, overrides, pdl = None, {}, None
    for item in items:
        if item == "default":
            continue
        key, _, value = item.partition("=")
        if key == "variant":
            ok, expected = value in variants and variant is None, f"one of {', '.join(variants)}, once"
            variant = value
        elif key == "pdl":
            ok, expected = value in ("on", "off") and pdl is None, "on or off, once"
            pdl = value == "on"
        elif key.startswith("sm90."):
            field = key[len("sm90."):]
            kind = field_types.get(field)
            setting = kind and _override_value(kind, value)
            ok = setting is not None and field not in overrides
            expected = (f"a field of {', '.join(field_types)}" if kind is None else
                        "on or off" if kind is bool else "a non-negative integer") + ", once"
            overrides[field] = setting
        else:
            ok, expected = False, SETTING_FORMS
        if not ok:
            raise ValueError(f"--ab: {item!r} in setting {text!r}: expected {expected}")
    return KernelSetting(text, variant, tuple(overrides.items()), pdl)


def apply_setting(submission, sm90, setting: KernelSetting, default_pdl: bool) -> None:
    """Makes `setting` the kernel custom_kernel runs from now on; what it leaves unnamed goes back to the
    module defaults (each setter also drops the prepared calls of the previous setting)."""
    b200 = setting.variant if setting.variant in submission.KERNEL_VARIANTS else submission.DEFAULT_KERNEL_VARIANT
    hopper = setting.variant if setting.variant in sm90.SM90_VARIANTS else sm90.DEFAULT_SM90_VARIANT
    submission.set_variant(b200)
    sm90.set_sm90_variant(hopper)
    sm90.set_sm90_overrides(**dict(setting.overrides))
    submission.set_pdl(default_pdl if setting.pdl is None else setting.pdl)


def ab_legend(settings: tuple) -> str:
    """The settings of --ab by name: "A = default, B = sm90.num_stages=8"."""
    return ", ".join(f"{name} = {setting.text}" for name, setting in zip(AB_NAMES, settings))


def ab_summary(label: str, settings: tuple, times: tuple) -> str:
    """One result line of --ab: A's median µs over the rounds, then each other setting's with the ratio of the
    medians to A's and the range of the per-round ratios."""
    base = statistics.median(times[0])
    cells = [f"A {base:9.2f}"]
    for name, other in zip(AB_NAMES[1:], times[1:]):
        ratios = [b / a for a, b in zip(times[0], other)]
        median = statistics.median(other)
        cells.append(f"{name} {median:9.2f} ({name}/A {median / base:.3f}, rounds {min(ratios):.3f} to "
                     f"{max(ratios):.3f})")
    return f"{harness.fit_label(label, 52):<52} " + "  ".join(cells)


def ab_rounds(settings: tuple, rounds: int, apply: Callable, check: Callable[[int], bool],
              time_once: Callable[[], float]) -> Optional[tuple]:
    """Times every setting in `rounds` rounds, in the order A B C ..., then ... C B A, and so on (so drift
    cancels): per round `apply(i)` selects setting i, `check(i)` (first round only) returns False when its
    output is wrong, `time_once()` gives µs. Returns each setting's times, or None when a check failed."""
    times = tuple([] for _ in settings)
    order = list(range(len(settings)))
    for rnd in range(rounds):
        for i in order if rnd % 2 == 0 else order[::-1]:
            apply(i)
            if rnd == 0 and not check(i):
                return None
            times[i].append(time_once())
    return times


def ab(submission, cases, settings: tuple, rounds: int, repeats: int) -> int:
    """bench.py --ab on FILE's benchmarks: the kernel's µs per call under settings A, B, ... (the timing above,
    `repeats` repeats per round), each setting's kernel checked on a copy of the first input first."""
    sm90, default_pdl = hopper_module(), submission.USE_PDL
    print(f"--ab: {ab_legend(settings)}; {rounds} rounds, the settings in turn, forwards then backwards, "
          f"{repeats} repeats each; µs per call (timing as above), the median over the rounds")
    status = 0
    for case in cases:
        inputs = case_inputs(case)
        times = ab_rounds(settings, rounds, lambda i: apply_setting(submission, sm90, settings[i], default_pdl),
                          lambda i: not wrong(submission.custom_kernel, case, inputs, f"setting {settings[i].text}"),
                          lambda: _time_per_call(submission.custom_kernel, inputs, repeats))
        if times is None:
            status = 1
            break
        print(ab_summary(harness._short(case), settings, times), flush=True)
    apply_setting(submission, sm90, KernelSetting("default"), default_pdl)
    return status


def ab_moe(submission, case_names: Optional[str], settings: tuple, rounds: int, calls: int,
           shared: bool = False) -> int:
    """bench.py --moe --ab: the MoE cases' kernel µs (bench_moe's timing: the median of `calls` calls, each alone,
    L2 flushed) under settings A, B, ...; each setting's first call checked on NaN-poisoned outputs against the
    float64 decode."""
    sm90, default_pdl = hopper_module(), submission.USE_PDL
    print(f"--moe --ab: {ab_legend(settings)}; {rounds} rounds, the settings in turn, forwards then backwards, "
          f"each the median µs of {calls} calls (each alone, L2 flushed); the median over the rounds")
    status = 0
    for case in bench_moe.select_cases(case_names):
        harness.progress(f"[{case.name}] routing, weights and inputs")
        data = bench_moe.make_input(case, bench_moe.route(case, case.seed),
                                    bench_moe.make_weights(case, "cuda", shared), case.seed, "cuda")

        def check(i: int) -> bool:
            for _, _, c in data[0]:
                c.fill_(math.nan)  # what this setting's call does not write shows as NaN
            worst = bench_moe.worst_error_ratio(data, submission.custom_kernel(data))
            if worst > 1:
                print(f"bench.py: setting {settings[i].text} is wrong on {case.name}: worst |err|/tol {worst:.3f}",
                      file=sys.stderr)
            return worst <= 1

        times = ab_rounds(settings, rounds, lambda i: apply_setting(submission, sm90, settings[i], default_pdl),
                          check, lambda: bench_moe.median_us(lambda: submission.custom_kernel(data), calls))
        if times is None:
            status = 1
            break
        print(ab_summary(f"{case.name} ({case.layer})", settings, times), flush=True)
        del data
        torch.cuda.empty_cache()
    apply_setting(submission, sm90, KernelSetting("default"), default_pdl)
    return status


# the options that --ab (and --pdl-ab) leave no use for, by their argparse names
NOT_WITH_AB = (("plot", "--plot"), ("skip_slow", "--skip-slow"), ("launch_paths", "--launch-paths"),
               ("no_humming", "--no-humming"), ("moe_patterns", "--moe-patterns"), ("moe_profile", "--moe-profile"))


def ab_options_problem(args, defaults: dict) -> Optional[str]:
    """What is wrong with the --ab options (one line), or None."""
    if args.ab is not None and not 2 <= len(args.ab) <= len(AB_NAMES):
        return f"--ab takes 2 to {len(AB_NAMES)} settings, got {len(args.ab)}"
    if args.ab and args.pdl_ab:
        return "--ab and --pdl-ab: give one of them (--pdl-ab N is --ab pdl=on pdl=off --ab-rounds N)"
    if not (args.ab or args.pdl_ab):
        return "--ab-rounds needs --ab" if args.ab_rounds != defaults["ab_rounds"] else None
    if args.pdl_ab and args.ab_rounds != defaults["ab_rounds"]:
        return "--ab-rounds does not apply to --pdl-ab (its value is the rounds)"
    others = [flag for dest, flag in NOT_WITH_AB if getattr(args, dest) != defaults[dest]]
    return f"{others[0]} does not apply to --ab (it times the kernel alone)" if others else None


def hopper_module():
    """submission_sm90, the Hopper kernel's module (its variants and setters)."""
    import submission_sm90

    return submission_sm90


def _positive_int(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return int(text)


def _non_negative_int(text: str) -> int:
    if not text.strip().isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a non-negative integer")
    return int(text)


def plot_problem(path: str):
    """Why a plot cannot be written to `path` (checked before any timing, which takes minutes), or None."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        return "--plot needs matplotlib, which does not import: pip install -e '.[plot]' (or pip install matplotlib)"
    formats = FigureCanvasBase.get_supported_filetypes()
    suffix = Path(path).suffix[1:].lower()
    if suffix not in formats:
        return f"--plot {path}: matplotlib cannot write {'.' + suffix if suffix else 'a file without a suffix'}; " \
               f"use one of {', '.join('.' + f for f in sorted(formats))}"
    if not Path(path).resolve().parent.is_dir():
        return f"--plot {path}: directory {Path(path).resolve().parent} does not exist"
    return None


def _launch_path_names() -> tuple:
    """submission.LAUNCH_PATHS, for the help (the names only, where the submission does not import)."""
    try:
        import submission

        return tuple(submission.LAUNCH_PATHS)
    except Exception:
        return ("see submission.LAUNCH_PATHS",)


def main(argv=None) -> int:
    if "--moe" in (sys.argv[1:] if argv is None else argv):
        # Before the DSL is imported (the parser's help imports the submission): the first call's time must
        # include real compiles, not the DSL's disk cache.
        os.environ.setdefault("CUTE_DSL_DISABLE_FILE_CACHING", "1")
    parser = harness.OneLineArgumentParser(prog="bench.py", description=__doc__,
                                      formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("cases", nargs="?", default=str(HERE / "task.yml"),
                        help="task.yml (its benchmarks; the default) or a runner text file")
    parser.add_argument("--repeats", type=_positive_int, default=10)
    parser.add_argument("--plot", metavar="PNG", help="write a roofline plot of the methods (needs matplotlib)")
    parser.add_argument("--skip-slow", action="store_true", help="leave out dequant+mm (slowest baseline)")
    parser.add_argument("--launch-paths", metavar="P,Q",
                        help=f"also time these launch paths, comma-separated: {', '.join(_launch_path_names())}")
    parser.add_argument("--ab", nargs="+", metavar="SETTING",
                        help=f"only time the kernel under two to {len(AB_NAMES)} settings A B ..., alternating; a "
                             f"setting: {SETTING_FORMS} (comma-separated)")
    parser.add_argument("--ab-rounds", type=_positive_int, default=4, metavar="N",
                        help="rounds of --ab or --pdl-ab (4)")
    parser.add_argument("--pdl-ab", metavar="ROUNDS", type=_positive_int,
                        help="--ab pdl=on pdl=off with ROUNDS rounds")
    parser.add_argument("--no-humming", action="store_true",
                        help="leave out the humming-kernels column (its first run per shape compiles for minutes)")
    moe = parser.add_argument_group("MoE benchmark")
    moe.add_argument("--moe", action="store_true", help="run the MoE cases (bench_moe.py) instead of FILE's")
    moe.add_argument("--moe-cases", metavar="A,B", help="only these MoE cases, comma-separated: "
                     + ", ".join(case.name for case in bench_moe.MOE_CASES) + "; by name only: "
                     + ", ".join(case.name for case in bench_moe.PART_CASES))
    moe.add_argument("--moe-calls", type=_positive_int, metavar="N", help="timed calls per method (median; 20)")
    moe.add_argument("--moe-patterns", type=_non_negative_int, metavar="N",
                     help="later calls on tokens routed anew, for the compile count (3)")
    moe.add_argument("--moe-profile", action="store_true",
                     help="print a profile of one more re-routed call per case (stderr): where its host time goes")
    moe.add_argument("--moe-shared-weights", action="store_true",
                     help="every expert's weights are one expert's (read from L2 after the first touch): the "
                          "kernel's time without the weights' DRAM traffic, a diagnostic")
    moe.add_argument("--serving", action="store_true",
                     help="with --moe: the serving loop (bench_serving.py), a new GPU routing per step, eager and "
                          "in CUDA graphs")
    moe.add_argument("--serving-cases", metavar="A,B", help="only these serving cases, comma-separated: "
                     + ", ".join(case.name for case in bench_serving.SERVING_CASES))
    moe.add_argument("--serving-steps", type=_positive_int, metavar="N", help="steps per timed loop (20)")
    moe.add_argument("--serving-check-steps", type=_non_negative_int, metavar="N",
                     help="steps checked against a float64 decode (3)")
    moe.add_argument("--serving-schedule", action="store_true", default=None,
                     help="with --serving: also the entry's kernel (its schedule made on the GPU) beside "
                          "custom_kernel's (planned on the host) on bench_moe's routings")
    args = parser.parse_args(argv)
    defaults = {dest: parser.get_default(dest) for dest in vars(args)}
    problem = ab_options_problem(args, defaults) or bench_serving.options_problem(args, defaults)
    problem = problem or (None if args.serving else bench_moe.options_problem(args, defaults))
    if problem:
        return harness.usage_error("bench.py", problem)
    # Every mistake is reported before the GPU check and before any timing.
    problem = plot_problem(args.plot) if args.plot else None
    if problem:
        return harness.usage_error("bench.py", problem)
    try:
        cases = harness.load_cases(args.cases, "benchmarks")
    except harness.CaseFileError as err:
        return harness.usage_error("bench.py", str(err))
    try:
        import submission
    except Exception as err:
        return harness.usage_error("bench.py", f"cannot import submission.py: {type(err).__name__}: {err}")
    from submission import custom_kernel

    default_path = submission.LAUNCH_PATH
    paths = [p for p in args.launch_paths.split(",") if p] if args.launch_paths is not None else []
    choices = ", ".join(submission.LAUNCH_PATHS)
    if args.launch_paths is not None and not paths:
        return harness.usage_error("bench.py", f"--launch-paths names no launch path; choose from {choices}")
    unknown = [p for p in paths if p not in submission.LAUNCH_PATHS]
    if unknown:
        return harness.usage_error("bench.py", f"--launch-paths: unknown launch path {unknown[0]!r}; choose from "
                                               f"{choices}")
    try:
        for path in paths:
            submission.set_launch_path(path)  # unknown or unusable names fail here
    except ValueError as err:
        return harness.usage_error("bench.py", f"--launch-paths: {err}")
    finally:
        submission.set_launch_path(default_path)
    texts = args.ab or (("pdl=on", "pdl=off") if args.pdl_ab else ())
    try:
        settings = ()
        if texts:  # the Hopper module only where a setting may name its variants or fields
            sm90 = hopper_module()
            settings = tuple(parse_setting(text, (*submission.KERNEL_VARIANTS, *sm90.SM90_VARIANTS),
                                           sm90.sm90_override_types()) for text in texts)
    except ValueError as err:
        return harness.usage_error("bench.py", str(err))
    if not torch.cuda.is_available():
        return harness.usage_error("bench.py", f"no usable CUDA GPU (torch {torch.__version__}, "
                                          "torch.cuda.is_available() is False)")
    if args.serving:
        return bench_serving.main(args, sys.modules[__name__])
    if args.moe and settings:
        return ab_moe(submission, args.moe_cases, settings, args.ab_rounds, args.moe_calls,
                      args.moe_shared_weights)
    if args.moe:
        return bench_moe.main(args, submission)
    if settings:
        return ab(submission, cases, settings, args.pdl_ab or args.ab_rounds, args.repeats)
    by_path = []  # (case, {path: (kernel µs, host µs)})
    note = humming_note(args.no_humming)
    notes = [note] if note else [
        f"humming = humming-kernels {sys.modules['humming'].__version__}, grouped W4A16: A given in fp16 (A→fp16 is "
        "that exact dequantization, timed alone: humming + A→fp16 is its cost from fp4 A) x NVFP4 B transformed "
        "by humming beforehand (not timed)"]
    rows = []
    for idx, case in enumerate(cases):
        print(f"[{idx + 1}/{len(cases)}] {harness._short(case)}", file=sys.stderr, flush=True)
        inputs = case_inputs(case)
        if wrong(custom_kernel, case, inputs, "the kernel"):
            return 1
        times = {"kernel": _time_per_call(custom_kernel, inputs, args.repeats)}
        pre = [_dequantized_bf16(d) for d in inputs]
        # Outputs allocated up front (bf16: cuBLAS writes the operands' type), so only the products are timed.
        loop_in = [(p, [torch.empty((a.shape[0], b.shape[0]), dtype=torch.bfloat16, device=a.device) for a, b in p])
                   for p in pre]

        def cublas_loop(item):
            for (a, b), c in zip(*item):
                torch.mm(a, b.t(), out=c)

        times["cuBLAS loop"] = _time_per_call(cublas_loop, loop_in, args.repeats)
        same_nk = len({(b.shape[0], b.shape[1]) for _, b in pre[0]}) == 1
        if same_nk and hasattr(torch, "_grouped_mm"):
            grouped_in = [_grouped_operands(p) for p in pre]
            times["grouped_mm"] = _time_per_call(lambda t: torch._grouped_mm(t[0], t[1], offs=t[2]), grouped_in,
                                                 args.repeats)
        if not args.skip_slow:
            times["dequant+mm"] = _time_per_call(reference.ref_kernel, inputs, max(3, args.repeats // 3))
        del pre, loop_in
        if note is None:
            print(f"[{idx + 1}/{len(cases)}] humming (compiles its kernels on a first run: minutes)", file=sys.stderr,
                  flush=True)
            notes.append(humming_case(case, inputs, args.repeats, times))
        flops, bytes_ = harness.case_work(case.args)
        fp4_bytes = sum((m + n) * k / 2 for m, n, k in zip(case.args["m"], case.args["n"], case.args["k"]))
        floors = {"bf16 floor": flops / H200_BF16_FLOPS * 1e6, "fp4-bytes floor": fp4_bytes / H200_BYTES_PER_S * 1e6}
        host = host_us_per_call(custom_kernel, inputs)
        rows.append((case, times, floors, host, flops, bytes_))
        timed = {}
        for path in paths:
            submission.set_launch_path(path)
            if wrong(custom_kernel, case, inputs, f"launch path {path}"):
                return 1
            timed[path] = (_time_per_call(custom_kernel, inputs, args.repeats), host_us_per_call(custom_kernel, inputs))
        submission.set_launch_path(default_path)
        by_path.append((case, timed))
        torch.cuda.empty_cache()

    gpu = torch.cuda.get_device_name()
    print(f"\n{gpu}, timing: L2 flushed, events around {NUM_INPUTS} calls on {NUM_INPUTS} inputs, "
          f"mean of {args.repeats} repeats; × = baseline time / kernel time")
    names = ["kernel", "grouped_mm", "cuBLAS loop", "dequant+mm"] + (["humming", "A→fp16"] if note is None else [])
    print("\n".join(table_lines(rows, names) + notes))
    if paths:
        print(f"\nlaunch paths (default here: {default_path}); kernel µs per call / host µs per call; one small torch "
              f"kernel launch costs {torch_launch_us():.1f} µs of host time")
        print(f"{'case':<52}" + "".join(f"{p:>22}" for p in paths))
        for case, timed in by_path:
            print(f"{harness.fit_label(harness._short(case), 52):<52}"
                  + "".join(f"{timed[p][0]:>13.1f} / {timed[p][1]:>5.1f}" for p in paths))
    if args.plot:
        _plot(rows, args.plot, gpu)
    return 0


def table_lines(rows, names) -> list:
    """The table: µs per call of each method in `names` per case ('-' where it did not run), × = its time /
    the kernel's (not for A→fp16, which is no GEMM), the floors and host time, then the geometric means."""
    lines = [f"{'case':<52}" + "".join(f"{n + ' µs':>16}" for n in names)
             + f"{'bf16 floor':>12}{'fp4 floor':>11}{'host µs':>9}"]
    geo = {n: [] for n in names}
    for case, times, floors, host, _, _ in rows:
        cells = []
        for n in names:
            if n not in times:
                cells.append(f"{'-':>16}")
                continue
            geo[n].append(times[n])
            ratio = "" if n in ("kernel", "A→fp16") else f" ({times[n] / times['kernel']:.1f}×)"
            cells.append(f"{times[n]:>{16 - len(ratio)}.1f}{ratio}")
        lines.append(f"{harness.fit_label(harness._short(case), 52):<52}" + "".join(cells)
                     + f"{floors['bf16 floor']:>12.1f}{floors['fp4-bytes floor']:>11.1f}{host:>9.1f}")
    lines.append(f"{'geometric mean':<52}" + "".join(
        f"{harness.geomean(geo[n]):>16.1f}" if len(geo[n]) == len(rows) else f"{'-':>16}" for n in names))
    return lines


def _plot(rows, path: str, gpu: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    xs = [10 ** (i / 20) for i in range(0, 81)]
    ax.plot(xs, [min(H200_BF16_FLOPS, x * H200_BYTES_PER_S) / 1e12 for x in xs], "k-", lw=1, label="H200 bf16 roof")
    style = {"kernel": ("o", "tab:green"), "grouped_mm": ("s", "tab:purple"), "cuBLAS loop": ("^", "tab:red"),
             "dequant+mm": ("x", "tab:brown"), "humming": ("D", "tab:orange")}  # A→fp16 is no GEMM: not plotted
    for case, times, _, _, flops, bytes_ in rows:
        for n, t in times.items():
            if n not in style:
                continue
            marker, color = style[n]
            ax.scatter(flops / bytes_, flops / t / 1e6, marker=marker, color=color, label=n)
    handles, labels = ax.get_legend_handles_labels()
    uniq = dict(zip(labels, handles))
    ax.legend(uniq.values(), uniq.keys())
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("FLOP per byte (fp4 operands, scales, fp16 output)")
    ax.set_ylabel("TFLOP/s")
    ax.set_title(f"nvfp4 grouped GEMM benchmarks on {gpu}")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    print(f"roofline written to {path}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
