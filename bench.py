"""Times the submission against torch baselines on the benchmark shapes, in one run, with the runner's method.

    python bench.py [FILE] [--repeats N] [--plot roofline.png] [--skip-slow] [--launch-paths P,Q]
    python bench.py [FILE] --pdl-ab ROUNDS

For every benchmark case of FILE (default task.yml) it times, each on the same 15 input sets:
  kernel         submission.custom_kernel(data)
  dequant+mm     reference.ref_kernel: torch dequantization then fp32 matmul, per group (no tensor cores fp4)
  cuBLAS loop    torch.mm per group on bf16 operands dequantized beforehand (dequantization not timed)
  grouped_mm     torch._grouped_mm on the same pre-dequantized bf16 operands (one call for all groups)
Timing is the runner's: L2 flushed, CUDA events around 15 back-to-back calls on the 15 inputs, mean per
call over repeats. It prints µs, × of each baseline against the kernel, and the two floors of this GPU
(bf16 tensor-core time at the measured matrix rate, and the fp4 bytes at the measured copy bandwidth),
then the host time of one custom_kernel call on its own (CPU wall time per call, launches only).
With --launch-paths (names from submission.LAUNCH_PATHS) it also times the kernel and its host cost once per
launch path, side by side, next to the host cost of one small torch kernel launch.
With --pdl-ab it only times the kernel with and without programmatic dependent launch (submission.set_pdl),
alternating in ROUNDS rounds in one process on the same inputs, and prints medians and paired differences.
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import eval as ev  # noqa: E402  (cases, work counts)
import reference  # noqa: E402
from utils import clear_l2_cache_large  # noqa: E402

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
        clear_l2_cache_large()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
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
    ok, msg = reference.check_implementation(inputs[0], custom_kernel(ev._clone_data(inputs[0])))
    if not ok:
        print(f"bench.py: {what} is wrong on {ev._short(case)}: {msg}", file=sys.stderr)
    return not ok


def pdl_ab(submission, cases, rounds: int, repeats: int) -> int:
    """Kernel µs per call with and without programmatic dependent launch, alternating (ABBA) in one process."""
    default = submission.USE_PDL
    print(f"programmatic dependent launch on vs off, {rounds} alternating rounds of {repeats} repeats each; "
          "µs per call (timing as above)")
    for case in cases:
        inputs = case_inputs(case)
        times = {True: [], False: []}
        for rnd in range(rounds):
            for on in (True, False) if rnd % 2 == 0 else (False, True):
                submission.set_pdl(on)
                # each setting's kernel checked once
                setting = f"the kernel with PDL {'on' if on else 'off'}"
                if rnd < 2 and wrong(submission.custom_kernel, case, inputs, setting):
                    return 1
                times[on].append(_time_per_call(submission.custom_kernel, inputs, repeats))
        diffs = [a - b for a, b in zip(times[True], times[False])]
        print(f"{ev.fit_label(ev._short(case), 52):<52} on {statistics.median(times[True]):8.2f}"
              f"  off {statistics.median(times[False]):8.2f}"
              f"  paired diff median {statistics.median(diffs):+6.2f} (min {min(diffs):+.2f}, max {max(diffs):+.2f})",
              flush=True)
    submission.set_pdl(default)
    return 0


def _positive_int(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
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


def main(argv=None) -> int:
    parser = ev.OneLineArgumentParser(prog="bench.py", description=__doc__,
                                      formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("cases", nargs="?", default=str(HERE / "task.yml"),
                        help="task.yml (its benchmarks; the default) or a runner text file")
    parser.add_argument("--repeats", type=_positive_int, default=10)
    parser.add_argument("--plot", metavar="PNG", help="write a roofline plot of the four methods (needs matplotlib)")
    parser.add_argument("--skip-slow", action="store_true", help="leave out dequant+mm (slowest baseline)")
    parser.add_argument("--launch-paths", metavar="P,Q", help="also time these launch paths (submission.LAUNCH_PATHS)")
    parser.add_argument("--pdl-ab", metavar="ROUNDS", type=_positive_int,
                        help="only time the kernel with and without programmatic dependent launch, alternating")
    args = parser.parse_args(argv)
    # Every mistake is reported before the GPU check and before any timing.
    problem = plot_problem(args.plot) if args.plot else None
    if problem:
        return ev.usage_error("bench.py", problem)
    try:
        cases = ev.load_cases(args.cases, "benchmarks")
    except ev.CaseFileError as err:
        return ev.usage_error("bench.py", str(err))
    try:
        import submission
    except Exception as err:
        return ev.usage_error("bench.py", f"cannot import submission.py: {type(err).__name__}: {err}")
    from submission import custom_kernel

    default_path = submission.LAUNCH_PATH
    paths = [p for p in args.launch_paths.split(",") if p] if args.launch_paths is not None else []
    if args.launch_paths is not None and not paths:
        return ev.usage_error("bench.py", f"--launch-paths names no launch path; choose from "
                                          f"{', '.join(submission.LAUNCH_PATHS)}")
    try:
        for path in paths:
            submission.set_launch_path(path)  # unknown or unusable names fail here
    except ValueError as err:
        return ev.usage_error("bench.py", f"--launch-paths: {err}")
    finally:
        submission.set_launch_path(default_path)
    if not torch.cuda.is_available():
        return ev.usage_error("bench.py", f"no usable CUDA GPU (torch {torch.__version__}, "
                                          "torch.cuda.is_available() is False)")
    by_path = []  # (case, {path: (kernel µs, host µs)})

    if args.pdl_ab:
        return pdl_ab(submission, cases, args.pdl_ab, args.repeats)
    rows = []
    for idx, case in enumerate(cases):
        print(f"[{idx + 1}/{len(cases)}] {ev._short(case)}", file=sys.stderr, flush=True)
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
        flops, bytes_ = ev.case_work(case.args)
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
    names = ["kernel", "grouped_mm", "cuBLAS loop", "dequant+mm"]
    head = f"{'case':<52}" + "".join(f"{n + ' µs':>16}" for n in names) + f"{'bf16 floor':>12}{'fp4 floor':>11}{'host µs':>9}"
    print(head)
    geo = {n: [] for n in names}
    for case, times, floors, host, _, _ in rows:
        cells = []
        for n in names:
            if n not in times:
                cells.append(f"{'-':>16}")
                continue
            geo[n].append(times[n])
            ratio = "" if n == "kernel" else f" ({times[n] / times['kernel']:.1f}×)"
            cells.append(f"{times[n]:>{16 - len(ratio)}.1f}{ratio}")
        print(f"{ev.fit_label(ev._short(case), 52):<52}" + "".join(cells)
              + f"{floors['bf16 floor']:>12.1f}{floors['fp4-bytes floor']:>11.1f}{host:>9.1f}")
    geo_line = f"{'geometric mean':<52}"
    for n in names:
        vals = geo[n]
        geo_line += f"{ev.geomean(vals):>16.1f}" if len(vals) == len(rows) else f"{'-':>16}"
    print(geo_line)
    if paths:
        print(f"\nlaunch paths (default here: {default_path}); kernel µs per call / host µs per call; one small torch "
              f"kernel launch costs {torch_launch_us():.1f} µs of host time")
        print(f"{'case':<52}" + "".join(f"{p:>22}" for p in paths))
        for case, timed in by_path:
            print(f"{ev.fit_label(ev._short(case), 52):<52}"
                  + "".join(f"{timed[p][0]:>13.1f} / {timed[p][1]:>5.1f}" for p in paths))
    if args.plot:
        _plot(rows, args.plot, gpu)
    return 0


def _plot(rows, path: str, gpu: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    xs = [10 ** (i / 20) for i in range(0, 81)]
    ax.plot(xs, [min(H200_BF16_FLOPS, x * H200_BYTES_PER_S) / 1e12 for x in xs], "k-", lw=1, label="H200 bf16 roof")
    style = {"kernel": ("o", "tab:green"), "grouped_mm": ("s", "tab:purple"), "cuBLAS loop": ("^", "tab:red"),
             "dequant+mm": ("x", "tab:brown")}
    for case, times, _, _, flops, bytes_ in rows:
        for n, t in times.items():
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
