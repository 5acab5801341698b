"""Checks, times and builds the nvfp4_group_gemm submission.

Two ways to run it:

* As the GPU MODE runner does: with `POPCORN_FD` set, `python eval.py MODE FILE` (MODE one of test,
  benchmark, leaderboard, profile) speaks the runner's protocol on that file descriptor (`key: value` lines),
  with its timing (CUDA events around 15 calls on 15 inputs, L2 flushed before each batch, the same stop
  rules and re-checks) and its exit codes.
* By hand: `python eval.py test|benchmark|leaderboard|profile [FILE]` prints a readable table to stdout
  (per case mean ± error in µs, TFLOP/s, GB/s, % of the B200 speed of light where FILE gives it, and the
  geometric mean) and progress to stderr. FILE defaults to task.yml (its `tests` for test, its `benchmarks`
  otherwise); the runner's one-case-per-line text format is read too. `--variants A,B` runs the mode once
  per kernel variant, one table each, selected in the worker as set_variant (B200: persistent, seed, ...)
  or set_sm90_variant (Hopper: sm90_auto, sm90_tile128, ...) would; the names must be of the GPU's own
  arch (a name of the other arch ends in one line naming its arch, exit status 2). `--variant` is the same
  option (compile's and export's spelling), here and in bringup; compile and export take `--variant` only,
  and name it when given `--variants` (an unknown option close to a known one is named with it).

Without a mode (bare `python eval.py`) it prints the modes on stderr and exits with status 2, as argparse
does for a missing argument: nothing is run.

`python eval.py compile [--arch sm_100a|sm_90a] [--variant NAME] [--groups G ...] [FILE]` needs no GPU: it
builds every kernel the cases of FILE would run (the tile custom_kernel picks for each case on a B200 with 148
SMs, or an H100/H200 with 132; one kernel per tile and group count) and prints one row per kernel, named by
the variant that runs it (the default's own name for the default's builds): OK or the error, registers, shared
memory per CTA (static, dynamic and their sum), tensor memory, the shared-memory stages (B200: A/B and C
stages, from kernel_resources; Hopper: the fp4 + scale ring and the fp16 A buffers) and the counts
of the SASS instructions that matter; then the kernel of every case. A variant that forces one tile (--variant
persistent_n256, ...) is not built for a case whose N that tile does not divide: the case is marked n/a, as
bringup skips it. It needs `cuobjdump` and `nvdisasm` (the nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm
wheels); `python eval.py compile --help` lists the variants of each arch.

A mistake (an unknown mode or option, a case file that does not parse, an unknown key in a case) ends in
one line on stderr naming it and exit status 2 (113 for a bad case file with `POPCORN_FD` set, as the
runner). By hand, and in compile and bringup, a case whose shape the kernel refuses (the size rules of
submission.can_implement, as submission.check_problem_sizes states them: N a multiple of 128, K of 256, ...)
is such a mistake too, named with its line before any GPU or build work; with `POPCORN_FD` set the cases go
to the kernel as the runner's would. `python eval.py MODE --help` lists a mode's options.

`python eval.py bringup [--quick] [--json PATH] [--jobs N]` (a B200, or an H100/H200 for the Hopper tiles): the
first run on a new GPU: the environment; every kernel variant built in parallel worker processes (one per
core by default, within host and GPU memory), then checked through every task.yml test and edge cases
(outputs poisoned, crashes and hangs cost one case), with a time-left estimate as it goes; the benchmarks of
every variant that passed, one variant at a time in a worker of its own, timed as `eval.py benchmark` times
them (on a B200 beside the tile model's prediction); and the fastest passing variant with the one line that
makes it the default (bringup.py).
`python eval.py export --variant NAME -o FILE [--force]` needs no GPU: a copy of submission.py whose default
variant is NAME, checked against the leaderboard's file rules; FILE must not exist yet (an existing file,
submission.py included, is overwritten only with --force) and must end in .py (else --force too); `-o -` writes
it to stdout; a directory, a name ending in '/' or an empty one is refused.

Run modes need a CUDA GPU; without one they exit with status 2 and a one-line reason.
"""
import base64
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

from harness import (  # noqa: F401  (eval.X names kept for the tests and for scripts that use them)
    BENCHMARK_LIMITS, GENERATOR_KEYS, NUM_ITERATIONS_PER_BENCHMARK, WARMUP_LIMITS, CaseFileError, OneLineArgumentParser,
    Stats, TestCase, _clone_data, _init_worker, _run_single_benchmark, _run_single_profile, _run_single_test, _short,
    apply_secret_seed, calculate_stats, case_sizes, case_work, find_cuda_tool, find_cuobjdump, fit_label, geomean,
    gpu_problem, load_cases, make_pool, not_applicable, parse_case_line, progress, usage_error)

# The runner disables CuTe DSL's on-disk cache so that every benchmark compiles the same way.
os.environ["CUTE_DSL_DISABLE_FILE_CACHING"] = "1"

HERE = Path(__file__).resolve().parent
RUN_MODES = ("test", "benchmark", "leaderboard", "profile")


def hopper_module():
    # The module that holds the Hopper (sm_90a) kernel and its names (SM90_VARIANTS, set_sm90_variant, ...).
    import submission_sm90

    return submission_sm90


# The arches with kernels, by the name CUTE_DSL_ARCH and the DSL give them, and what a reader calls them.
ARCH_NAMES = {"sm_100a": "B200", "sm_90a": "Hopper"}


def arch_family(arch: str) -> Optional[str]:
    """The key of ARCH_NAMES whose kernels a target `arch` (sm_100a, sm_90a, ...) builds, or None."""
    return "sm_90a" if arch.startswith("sm_90") else "sm_100a" if arch.startswith("sm_10") else None


def arch_variants(arch: str) -> tuple:
    """The variant names of `arch`: what set_variant (sm_100a) or set_sm90_variant (sm_90a) takes."""
    if arch_family(arch) == "sm_90a":
        return tuple(hopper_module().SM90_VARIANTS)
    import submission

    return tuple(submission.KERNEL_VARIANTS)


def select_variant(arch: str, name: str) -> None:
    """Make `name` the kernel custom_kernel runs in this process on `arch`, through the submission's setter."""
    if arch_family(arch) == "sm_90a":
        hopper_module().set_sm90_variant(name)
    else:
        import submission

        submission.set_variant(name)


def _start_worker(arch: str, variant: Optional[str]) -> None:
    """The spawned worker's start (make_pool's initializer): the runner's settings, then the variant."""
    _init_worker()
    if variant:
        select_variant(arch, variant)


# The SASS instructions compile counts (all of them in its JSON), with what each count says.
# WGDEP1: `WARPGROUP.DEPBAR.LE gsb0, 0x1`, a wait that leaves one wgmma group in flight. A Hopper kernel
# without any has its wgmmas serialized by ptxas (its C7512 "Potential Performance Loss" info).
# PR2UR: `@P0 R2UR`, a move to a uniform register under a per-lane predicate, which ptxas emits for a TMA or
# bulk copy whose operands it computes inside a one-lane branch; on sm_90a it is an illegal instruction
# (CUDA error 715, per the CUTLASS CuTe-DSL Hopper grouped GEMM example), so a build with one would fail at
# run time (docs/HOPPER_NOTES.md, "SASS pitfall met"). For sm_100a ptxas emits the predicated form
# `R2UR.BROADCAST` instead, which this does not count.
SASS_MEANING = {
    "UTCOMMA": "tcgen05 MMAs (block-scaled)",
    "UTCQMMA": "tcgen05 MMAs, the other SASS form",
    "UTMALDG": "TMA loads",
    "UTMASTG": "TMA stores",
    "UTCCP": "tcgen05 copies (scales into tensor memory)",
    "HGMMA": "wgmma instructions",
    "STSM": "stmatrix stores (the Hopper epilogue's fp16 slab)",
    "WGDEP1": "wgmma waits that leave one group in flight (0: ptxas serialized the wgmmas)",
    "PR2UR": "R2UR under a lane predicate (an illegal instruction on sm_90a: must be 0)",
    "STG": "plain global stores",
    "LDL": "local-memory loads (register spills)",
    "STL": "local-memory stores (register spills)",
    "PREEXIT": "griddepcontrol.launch_dependents (programmatic dependent launch)",
    "ACQBULK": "griddepcontrol.wait (programmatic dependent launch)",
    "PFL1": "L1 prefetches of global memory (`CCTL.E.PF1`: the Hopper producer's next work-list entry)",
    "TMAPF": "TMA descriptor prefetches (`UTMACCTL.PF`: the Hopper producer's next group's descriptors)",
    "LDS16": "16-bit shared-memory loads (`LDS.U16`: a Hopper consumer's two B scales of a row)",
    "HBCAST1": "HMUL2 with a broadcast high half (`.H1_H1`: the second of those scales)",
    "EARLYREL": "arrivals while a stage's LDS.128 result is still unread (must be 0: docs/HOPPER_NOTES.md r43c)",
}
SASS_OPS = tuple(SASS_MEANING)
# The columns of each arch's table: its own instructions only.
ARCH_SASS_OPS = {
    "sm_100a": ("UTCOMMA", "UTCQMMA", "UTMALDG", "UTMASTG", "UTCCP", "STG", "LDL", "STL", "PREEXIT", "ACQBULK"),
    "sm_90a": ("HGMMA", "WGDEP1", "STSM", "UTMALDG", "UTMASTG", "STG", "LDL", "STL", "PREEXIT", "ACQBULK", "PR2UR",
               "EARLYREL"),
}


class PopcornOutput:
    """The runner's channel: `key: value` lines on file descriptor POPCORN_FD."""

    def __init__(self, fd: int):
        self.file = os.fdopen(fd, "w")
        os.set_inheritable(fd, False)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc_val, exc_tb):
        self.file.close()

    def print(self, *args, **kwargs):
        print(*args, **kwargs, file=self.file, flush=True)

    def log(self, key, value):
        self.print(f"{key}: {value}")




# ---------------------------------------------------------------------------------------------------------
# The runner's protocol (POPCORN_FD set)
# ---------------------------------------------------------------------------------------------------------
def run_testing(logger: PopcornOutput, pool, tests: list[TestCase]) -> int:
    passed = True
    logger.log("test-count", len(tests))
    for idx, test in enumerate(tests):
        logger.log(f"test.{idx}.spec", test.spec)
        good, message = pool.apply(_run_single_test, (test,))
        if not good:
            logger.log(f"test.{idx}.status", "fail")
            logger.log(f"test.{idx}.error", message)
            passed = False
        else:
            logger.log(f"test.{idx}.status", "pass")
            if message:
                logger.log(f"test.{idx}.message", message)
    logger.log("check", "pass" if passed else "fail")
    return 0 if passed else 112


def _log_benchmark(logger: PopcornOutput, idx: int, result) -> bool:
    if isinstance(result, Stats):
        for field in dataclasses.fields(Stats):
            logger.log(f"benchmark.{idx}.{field.name}", getattr(result, field.name))
        return True
    logger.log(f"benchmark.{idx}.status", "fail")
    logger.log(f"benchmark.{idx}.error", str(result))
    return False


def run_benchmarking(logger: PopcornOutput, pool, tests: list[TestCase]) -> int:
    pool.apply(_run_single_benchmark, (tests[0], False, *WARMUP_LIMITS))  # warm-up: compile, caches
    passed = True
    logger.log("benchmark-count", len(tests))
    for idx, test in enumerate(tests):
        logger.log(f"benchmark.{idx}.spec", test.spec)
        passed &= _log_benchmark(logger, idx, pool.apply(_run_single_benchmark, (test, False, *BENCHMARK_LIMITS)))
    logger.log("check", "pass" if passed else "fail")
    return 0 if passed else 112


def run_leaderboard(logger: PopcornOutput, pool, tests: list[TestCase]) -> int:
    for test in tests:
        pool.apply(_run_single_benchmark, (test, False, 50, 5e8))
    logger.log("benchmark-count", len(tests))
    passed = True
    for idx, test in enumerate(tests):
        result = pool.apply(_run_single_benchmark, (test, True, 100, 30e9))
        logger.log(f"benchmark.{idx}.spec", test.spec)
        if not _log_benchmark(logger, idx, result):
            passed = False
            break
    logger.log("check", "pass" if passed else "fail")
    return 0


def run_profiling(logger: PopcornOutput, pool, tests: list[TestCase]) -> int:
    logger.log("benchmark-count", len(tests))
    for idx, test in enumerate(tests):
        logger.log(f"benchmark.{idx}.spec", test.spec)
        report = pool.apply(_run_single_profile, (test,))
        logger.log(f"benchmark.{idx}.report", base64.b64encode(report.encode("utf-8"), b"+*").decode("utf-8"))
    logger.log("check", "pass")
    return 0


def popcorn_main(fd: str, argv: list[str]) -> int:
    runners = {"test": run_testing, "benchmark": run_benchmarking, "leaderboard": run_leaderboard,
               "profile": run_profiling}
    if len(argv) < 2 or argv[0] not in runners:
        return usage_error("eval.py", f"with POPCORN_FD set, give a mode and a case file: python eval.py MODE FILE "
                                      f"(MODE one of {', '.join(runners)}); got {' '.join(argv) or 'nothing'}")
    mode, case_file = argv[0], argv[1]
    try:
        os.fstat(int(fd))
    except (ValueError, OSError):
        return usage_error("eval.py", f"POPCORN_FD={fd!r} is not an open file descriptor")
    seed = os.getenv("POPCORN_SEED")
    os.unsetenv("POPCORN_SEED")
    try:
        seed = int(seed) if seed else None
    except ValueError:
        return usage_error("eval.py", f"POPCORN_SEED={seed!r} is not an integer")
    from utils import set_seed  # imports torch: after the checks that need nothing

    set_seed(seed or 42)
    try:
        tests = load_cases(case_file, "benchmarks" if mode in ("benchmark", "leaderboard") else "tests")
    except CaseFileError as err:
        print(f"eval.py: {err}", file=sys.stderr)
        return 113
    apply_secret_seed(tests, seed)
    problem = gpu_problem()
    if problem:
        print(f"eval.py: cannot run '{mode}': {problem}", file=sys.stderr)
        return 2
    with PopcornOutput(int(fd)) as logger:
        with make_pool() as pool:
            return runners[mode](logger, pool, tests)


# ---------------------------------------------------------------------------------------------------------
# By hand (no POPCORN_FD): readable tables
# ---------------------------------------------------------------------------------------------------------

UNSUPPORTED_DEVICE = "UnsupportedDeviceError"


def _unsupported(message: str, mode: str) -> bool:
    """The submission has no kernel for this GPU: say so once instead of failing every case."""
    if UNSUPPORTED_DEVICE not in message:
        return False
    print(f"eval.py: cannot run '{mode}': {message.split(UNSUPPORTED_DEVICE + ': ', 1)[-1]}", file=sys.stderr)
    return True


def human_test(pool, tests: list[TestCase]) -> int:
    failures = 0
    for idx, test in enumerate(tests):
        progress(f"[{idx + 1}/{len(tests)}] test {_short(test)}")
        good, message = pool.apply(_run_single_test, (test, True))
        if not good and _unsupported(message, "test"):
            return 2
        failures += not good
        print(f"{'PASS' if good else 'FAIL'}  {_short(test)}" + ("" if good else f"\n      {message}"), flush=True)
    print(f"{len(tests) - failures}/{len(tests)} passed")
    return 0 if failures == 0 else 1



def format_benchmark_table(rows: list[tuple[TestCase, Any]]) -> str:
    """rows of (case, Stats or error string) -> the table, with the geometric mean of the means."""
    lines = [f"{'case':<70} {'mean ± err [µs]':>18} {'TFLOP/s':>8} {'GB/s':>7} {'% SOL':>6}"]
    means = []
    for case, result in rows:
        if not isinstance(result, Stats):
            lines.append(f"{_short(case):<70} FAILED: {result}")
            continue
        mean_us, err_us = result.mean / 1e3, result.err / 1e3
        means.append(mean_us)
        flops, bytes_ = case_work(case.args)
        sol = f"{100.0 * case.sol_us / mean_us:6.1f}" if case.sol_us else f"{'-':>6}"
        lines.append(f"{_short(case):<70} {mean_us:9.2f} ± {err_us:6.2f} {flops / mean_us / 1e6:8.1f} "
                     f"{bytes_ / mean_us / 1e3:7.0f} {sol}")
    if means and len(means) == len(rows):
        geo = geomean(means)
        sols = [c.sol_us for c, _ in rows]
        geo_sol = geomean(sols) if all(sols) else None
        lines.append(f"{'geometric mean':<70} {geo:9.2f} µs" +
                     (f"   (B200 speed of light {geo_sol:.2f} µs)" if geo_sol else ""))
    return "\n".join(lines)


def human_benchmark(pool, tests: list[TestCase], recheck: bool) -> int:
    progress("warm-up (compile and first launch)...")
    warm = pool.apply(_run_single_benchmark, (tests[0], False, *WARMUP_LIMITS, True))
    if isinstance(warm, str) and _unsupported(warm, "benchmark"):
        return 2
    rows = []
    for idx, test in enumerate(tests):
        progress(f"[{idx + 1}/{len(tests)}] benchmark {_short(test)}")
        rows.append((test, pool.apply(_run_single_benchmark, (test, recheck, *BENCHMARK_LIMITS, True))))
    print(format_benchmark_table(rows))
    return 0 if all(isinstance(r, Stats) for _, r in rows) else 1


def human_profile(pool, tests: list[TestCase]) -> int:
    for idx, test in enumerate(tests):
        progress(f"[{idx + 1}/{len(tests)}] profile {_short(test)}")
        print(f"== {_short(test)}\n{pool.apply(_run_single_profile, (test,))}")
    return 0


# ---------------------------------------------------------------------------------------------------------
# compile: build without a GPU and read the SASS
# ---------------------------------------------------------------------------------------------------------
# Runs in a fresh interpreter with CUTE_DSL_ARCH set: builds, then reports as one JSON line. Without a GPU,
# nvidia-cutlass-dsl 4.3.5 writes the cubin and then fails to load it (no driver): that counts as built.
_BUILD_SCRIPT = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
start = time.time()
result = {"ok": True, "error": "", "info": {}}
seen_smem = []


def watch_launches():
    # Best effort: the DSL knows the dynamic shared memory of a launch it builds (4.3.x says so at launch
    # time; 4.8.x sizes it later and reports 0, shown as unknown).
    import gc
    for cls in [c for c in gc.get_objects() if isinstance(c, type) and c.__name__ == "KernelLauncher"]:
        def launch(self, *args, _launch=cls.launch, **kwargs):
            out = _launch(self, *args, **kwargs)
            try:
                seen_smem.append(int(self.dsl._get_smem_usage()))
            except Exception:
                pass
            return out
        cls.launch = launch


def watch_compiles():
    # Exact on every DSL version: the dynamic shared memory a kernel asks for at launch is its SharedStorage
    # struct (`self.shared_storage`, set while it is built); the first one built is the GEMM.
    import cutlass.cute as cute
    compile_ = cute.compile

    def compile(kernel, *args, **kwargs):
        try:
            return compile_(kernel, *args, **kwargs)
        finally:  # also where 4.3.x built the cubin and then failed to load it (no driver)
            storage = getattr(kernel, "shared_storage", None)
            if storage is not None and "shared_storage_bytes" not in result["info"]:
                try:
                    result["info"]["shared_storage_bytes"] = int(storage.size_in_bytes())
                except Exception:
                    pass
    cute.compile = compile


try:
    watch_compiles()
    import submission
    watch_launches()
    info = submission.compile_for(int(sys.argv[2]), sys.argv[3], *sys.argv[4:])
    result["info"].update(info if isinstance(info, dict) else {})
except BaseException as err:
    chain, e = [], err
    while e is not None and len(chain) < 8:
        chain.append(type(e).__name__ + ": " + str(e))
        e = e.__cause__ or e.__context__ or getattr(e, "cause", None)
    text = " | ".join(chain)
    no_driver = "CudaDriverDependencyError" in text or "CUDA Driver Dependency" in text
    result.update(ok=no_driver, error="" if no_driver else text[:2000], loaded=False)
result["seconds"] = round(time.time() - start, 2)
if seen_smem and max(seen_smem) > 0:
    result["info"]["dynamic_smem_bytes"] = max(seen_smem)
try:  # the submission's own account of its shared and tensor memory (B200 kernels), no build needed
    if sys.argv[3].startswith("sm_10"):
        from eval import kernel_resources
        planned = kernel_resources(*sys.argv[4:])
        result["info"]["planned_smem_bytes"] = planned.get("smem_bytes", planned.get("smem_bytes_min"))
        result["info"]["planned_smem_is_min"] = "smem_bytes" not in planned
        result["info"]["tmem_cols"] = f"{planned.get('tmem_cols_used', '?')}/{planned.get('tmem_alloc_cols', '?')}"
except Exception:
    pass
print("BUILD_RESULT " + json.dumps(result, default=str))
"""


# An instruction's start in cuobjdump's SASS (its address), and its optional predicate.
_SASS_AT = r"/\*[0-9a-f]{4,}\*/\s+"
_SASS_PREDICATE = r"(?:@!?U?P[T0-9]+\s+)?"
# The counts of SASS_MEANING that are not an opcode's: an opcode with its modifiers or operands.
SASS_PATTERNS = {
    "WGDEP1": r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*0x1\b",
    "PR2UR": _SASS_AT + r"@!?P[0-6]\s+R2UR\s",
    "PFL1": _SASS_AT + _SASS_PREDICATE + r"CCTL\.E\.PF1\s",
    "TMAPF": _SASS_AT + _SASS_PREDICATE + r"UTMACCTL\.PF\s",
    "LDS16": _SASS_AT + _SASS_PREDICATE + r"LDS\.U16\s",
    "HBCAST1": _SASS_AT + _SASS_PREDICATE + r"HMUL2\s[^;\n]*\.H1_H1\b",
}


# One SASS instruction: predicate, opcode with modifiers, operands.
_SASS_INSTRUCTION = re.compile(_SASS_AT + _SASS_PREDICATE + r"([A-Z][A-Z0-9_.]*)\s*([^;\n]*);")
# Opcodes whose first register operand is read, not written.
_SASS_NO_DEST = ("ST", "RED", "BAR", "BRA", "SYNCS", "UTMA", "UBLKCP", "WARPGROUP", "MEMBAR", "FENCE", "CCTL", "EXIT",
                 "RET", "CALL", "BSYNC", "BSSY", "NOP", "YIELD", "WARPSYNC")


def early_releases(sass: str) -> int:
    """EARLYREL: the `SYNCS.ARRIVE` instructions (barrier arrivals) issued while an `LDS.128` before them (a
    thread's load of a TMA stage's fp4 words) has had none of its registers read yet, in program order. A load
    completes asynchronously and only a read of its result waits for it (one scoreboard per load instruction), so
    such an arrival may release the stage before the load has read it: the defect of docs/HOPPER_NOTES.md r43c.
    Any barrier's arrival counts (the SASS does not say which barrier a stage's is). The narrower loads (scale
    words) are not followed: W4A16's second scale words are read after the A ring's release at quarter 1,
    rightly, and before the stage's at quarter 3."""
    pending, early = [], 0
    for match in _SASS_INSTRUCTION.finditer(sass):
        op, operands = match[1], match[2]
        registers = [int(r) for r in re.findall(r"\bR(\d+)\b", operands)]
        writes = not op.startswith(_SASS_NO_DEST) and re.match(r"\s*R\d+\b", operands) is not None
        read = set(registers[1:] if writes else registers)
        pending = [loaded for loaded in pending if not loaded & read]
        if op.startswith("SYNCS.ARRIVE") and pending:
            early += 1
        if op.startswith("LDS.128") and writes:
            pending.append(set(range(registers[0], registers[0] + 4)))
    return early


def count_sass(sass: str) -> dict[str, int]:
    counts = dict.fromkeys(SASS_OPS, 0)
    for match in re.finditer(_SASS_AT + _SASS_PREDICATE + r"([A-Z][A-Z0-9_]*)", sass):
        if match[1] in counts:
            counts[match[1]] += 1
    for op, pattern in SASS_PATTERNS.items():
        counts[op] = len(re.findall(pattern, sass))
    counts["EARLYREL"] = early_releases(sass)
    return counts


def parse_resource_usage(text: str) -> dict[str, int]:
    usage = {}
    for key in ("REG", "SHARED", "LOCAL", "STACK"):
        found = re.findall(rf"\b{key}:(\d+)", text)
        if found:
            usage[key] = max(int(x) for x in found)
    return usage


def build_one(num_groups: int, arch: str, cuobjdump: str, variant: Optional[str] = None) -> dict:
    """Builds the submission for `num_groups` groups (its default kernel for `arch`, or the named variant)
    in a subprocess and reads its cubin."""
    with tempfile.TemporaryDirectory(prefix="nvfp4-build-") as dump:
        env = dict(os.environ, CUTE_DSL_ARCH=arch, CUTE_DSL_DUMP_DIR=dump, CUTE_DSL_KEEP_CUBIN="1",
                   CUTE_DSL_KEEP_PTX="1", CUTE_DSL_KEEP="cubin,ptx", CUTE_DSL_DISABLE_FILE_CACHING="1",
                   PYTHONWARNINGS="ignore")
        proc = subprocess.run([sys.executable, "-c", _BUILD_SCRIPT, str(HERE), str(num_groups), arch,
                               *([variant] if variant else [])],
                              env=env, capture_output=True, text=True, timeout=1800)
        line = [x for x in proc.stdout.splitlines() if x.startswith("BUILD_RESULT ")]
        if not line:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            return {"ok": False, "error": f"build process exited {proc.returncode}: {' / '.join(tail)}"}
        result = json.loads(line[-1][len("BUILD_RESULT "):])
        cubins = sorted(Path(dump).rglob(f"*.{arch}.cubin")) or sorted(Path(dump).rglob("*.cubin"))
        if result["ok"] and not cubins:
            result.update(ok=False, error=result["error"] or "the build wrote no cubin")
        if cubins:
            tool_env = dict(os.environ, NVDISASM_PATH=str(Path(find_cuda_tool("nvdisasm")).parent))
            sass = subprocess.run([cuobjdump, "-sass", str(cubins[-1])], capture_output=True, text=True,
                                  env=tool_env).stdout
            if not re.search(r"/\*[0-9a-f]{4,}\*/", sass):
                result.update(ok=False, error=f"cuobjdump printed no SASS for {cubins[-1].name}")
            res = subprocess.run([cuobjdump, "-res-usage", str(cubins[-1])], capture_output=True, text=True,
                                 env=tool_env).stdout
            result["sass"] = count_sass(sass)
            result["resources"] = parse_resource_usage(res)
        return result


# The SM counts custom_kernel sees on the leaderboard's B200 and on an H100/H200 (SXM): its tile choice
# depends on them, and compile has no GPU to ask.
COMPILE_NUM_SMS = {"sm_100a": 148, "sm_90a": 132}
COMPILE_GPUS = {"sm_100a": "a B200", "sm_90a": "an H100/H200"}


@dataclasses.dataclass(frozen=True)
class PlannedKernel:
    """One kernel compile builds: the name compile_for builds it by, its output tile (M x N), G, and the
    variant that runs it (`shown`: the default's builds are the default's, though compile_for builds the
    tile-table row the default picked by the variant that forces that row)."""

    variant: str
    tile_mn: tuple  # M-exact Hopper tiles: the widest
    groups: int
    m_rows: str = ""  # the tile's rows of A where they vary per tile (M-exact: "64-192")
    shown: str = ""

    @property
    def label(self) -> str:
        return f"{self.shown or self.variant} {self.m_rows or self.tile_mn[0]}x{self.tile_mn[1]} g={self.groups}"


def planned_kernel(arch: str, variant: Optional[str], groups: int, sizes=None) -> PlannedKernel:
    """The kernel custom_kernel would run on `arch` for a problem of these sizes ((m, n, k, 1) per group), as
    submission.kernel_config picks it with COMPILE_NUM_SMS; without sizes, the one compile_for builds by
    default. `variant` stands for the submission's own choice (set_sm90_variant on sm_90a, set_variant on
    sm_100a)."""
    import submission

    num_sms = COMPILE_NUM_SMS[arch]
    if arch.startswith("sm_90"):
        hopper = hopper_module()
        named = hopper.SM90_VARIANT_CONFIGS
        chosen = variant or hopper.SM90_VARIANT
        if chosen in named:
            config = named[chosen]
        else:  # per problem, or compile_for's default for a bare group count
            config = hopper.choose_sm90_config(sizes or (), num_sms)
    else:
        named = submission.VARIANT_CONFIGS
        chosen = variant or submission.KERNEL_VARIANT
        by_table = sizes and chosen in submission.TILE_TABLE_VARIANTS
        config = submission.choose_sm100_config(sizes, num_sms) if by_table else named[chosen]
    # compile_for builds by name: every tile-table row is also a variant of its own.
    name = chosen if named.get(chosen) == config else next((n for n, c in named.items() if c == config), None)
    if name is None:
        raise LookupError(f"submission.py chose a {arch} kernel that no variant names ({config}); compile_for "
                          "cannot build it")
    m_rows = f"{config.widths[0]}-{config.widths[-1]}" if getattr(config, "m_exact", False) else ""
    return PlannedKernel(name, tuple(config.tile_mn), groups, m_rows, shown=chosen)


def _case_sizes(case: TestCase) -> list[tuple]:
    return case_sizes(case.args)


def compile_legend(arch: str) -> list:
    """What the columns of compile's table for `arch` say, one line each."""
    lines = ["columns:",
             "  kernel     the variant that runs it, its tile MxN and G (a default that picks its tile per problem "
             "keeps the default's name; the JSON's built_as names the variant compile_for builds that kernel as)",
             "  status     OK, or ERROR with the error on the next line",
             "  regs       registers per thread",
             "  static[B]  shared memory per CTA the DSL declares statically (cuobjdump -res-usage SHARED)",
             "  dynamic[B] shared memory per CTA the kernel asks for at launch: its SharedStorage struct as built, "
             "else the DSL's launch record, else the kernel's own plan (kernel_resources; '>=': a lower bound); "
             "? where none gives it",
             "  smem[B]    static + dynamic: what a CTA takes of the 232448 bytes (227 KiB) a block may have"]
    if arch.startswith("sm_10"):
        lines.append("  tmem       tensor-memory columns used/allocated")
    lines.append(f"  stages     {STAGES_MEANING[arch_family(arch)]}")
    lines.append("  s          seconds the build took (a fresh process: import and build)")
    lines += [f"  {op:<10} count of {SASS_MEANING[op]}" for op in ARCH_SASS_OPS[arch]]
    return lines


# What compile's `stages` column counts on each arch (kernel_stages), in its order.
STAGES_MEANING = {
    "sm_100a": "shared-memory stages: A/B (TMA loads) / C (epilogue stores), as kernel_resources plans "
               "them (- where the kernel has no C stages)",
    "sm_90a": "shared-memory rings: fp4 + scale stages / fp16 A buffers (the Hopper kernel's num_stages / num_a16)",
}


def kernel_resources(variant: Optional[str] = None) -> dict:
    """Shared memory, tensor-memory columns, stages and threads of a B200 variant's kernel (no build needed):
    what its config derives, the persistent kernel's stage counts from the shared-memory budget."""
    import submission

    cfg = submission.SM100_BACKEND.compile_config(variant)
    if isinstance(cfg, submission.Sm100PersistentConfig):
        return dict(kernel="Sm100PersistentGroupedGemmKernel", tile_mnk=cfg.mma_tiler_mnk,
                    threads=submission.Sm100PersistentGroupedGemmKernel.threads_per_cta,
                    ab_stages=cfg.num_ab_stages, ab_stage_bytes=cfg.ab_stage_bytes, acc_stages=cfg.num_acc_stages,
                    c_stages=cfg.num_c_stages, c_stage_bytes=cfg.c_stage_bytes, smem_bytes=cfg.smem_bytes,
                    smem_budget=submission.DYNAMIC_SMEM_BUDGET, tmem_cols_used=cfg.tmem_cols_used,
                    tmem_alloc_cols=cfg.tmem_alloc_cols)
    # The seed: one stage of fp4 A, B and their e4m3 scales, beside its four descriptors.
    rows, tile_k = cfg.tile_mn[0] + cfg.tile_mn[1], cfg.mma_tiler_mnk[2]
    ab_stage_bytes = rows * tile_k // 2 + rows * tile_k // cfg.sf_vec_size
    descriptor_bytes = submission.Sm100BlockScaledGroupedGemmKernel.num_tensormaps * submission.TENSORMAP_BYTES
    return dict(kernel="Sm100BlockScaledGroupedGemmKernel", tile_mnk=cfg.mma_tiler_mnk, threads=cfg.threads_per_cta,
                ab_stages=cfg.num_ab_stages, ab_stage_bytes=ab_stage_bytes, acc_stages=cfg.num_acc_stages,
                tmem_alloc_cols=cfg.num_tmem_cols, smem_bytes_min=ab_stage_bytes * cfg.num_ab_stages + descriptor_bytes)


def kernel_stages(arch: str, kernel: PlannedKernel) -> dict:
    """The pipeline depths of a kernel compile builds, in STAGES_MEANING's order (no build needed); empty
    where the submission cannot say."""
    import submission

    try:
        if arch_family(arch) == "sm_90a":
            config = submission.backend_for_arch(arch).compile_config(kernel.variant)
            gemm = hopper_module().Sm90BlockScaledGroupedGemmKernel(kernel.groups, config)
            return {"ring_stages": gemm.num_stages, "a16_buffers": gemm.num_a16}
        planned = kernel_resources(kernel.variant)
        return {"ab_stages": planned["ab_stages"], "c_stages": planned.get("c_stages")}
    except Exception:
        return {}


def stages_cell(stages: dict) -> str:
    return "/".join("-" if v is None else str(v) for v in stages.values()) if stages else "?"


def forced_tile_n(arch: str, variant: Optional[str]) -> Optional[int]:
    """The N of the one tile `variant` forces on every case (None where the variant, or the default when
    None, picks its tile per problem)."""
    import submission

    if arch_family(arch) == "sm_90a":
        config = hopper_module().SM90_VARIANT_CONFIGS.get(variant or hopper_module().SM90_VARIANT)
    else:
        chosen = variant or submission.KERNEL_VARIANT
        config = None if chosen in submission.TILE_TABLE_VARIANTS else submission.VARIANT_CONFIGS[chosen]
    return None if config is None else config.tile_mn[1]


def smem_cells(result: dict) -> tuple:
    """(static, dynamic, static + dynamic) shared memory per CTA of a build, as compile's table shows them."""
    static = result.get("resources", {}).get("SHARED")
    info = result.get("info", {})
    sources = ("shared_storage_bytes", "dynamic_smem_bytes", "planned_smem_bytes")
    source = next((key for key in sources if info.get(key) is not None), None)
    dynamic = info[source] if source else None
    mark = ">=" if source == "planned_smem_bytes" and info.get("planned_smem_is_min") else ""
    return ("?" if static is None else str(static), "?" if dynamic is None else f"{mark}{dynamic}",
            "?" if static is None or dynamic is None else f"{mark}{static + dynamic}")


def _looks_like_a_file(token: str) -> bool:
    return Path(token).exists() or "/" in token or token.endswith((".yml", ".yaml", ".txt"))


def _group_counts(items: list[str], cases_given: bool):
    """--groups values -> (group counts, a case file that came last in the list, or an error)."""
    counts, case_file = [], None
    for index, item in enumerate(items):
        for token in item.split(",") if "," in item else [item]:
            if re.fullmatch(r"\s*[+-]?[0-9]+\s*", token):
                if int(token) < 1:
                    return [], None, f"--groups {token.strip()}: a group count must be at least 1"
                counts.append(int(token))
            elif index == len(items) - 1 and "," not in item and not cases_given and _looks_like_a_file(token):
                case_file = token  # `--groups 1 16 task.yml`: the list ends where the case file starts
            else:
                return [], None, f"--groups: {token!r} is not a group count (a positive integer)"
    return counts, case_file, None


def compile_main(argv: list[str]) -> int:
    prog = "eval.py compile"
    try:
        import submission

        names = {arch: arch_variants(arch) for arch in COMPILE_NUM_SMS}
        import_error = None
    except Exception as err:
        names, import_error = {}, f"cannot import submission.py: {type(err).__name__}: {err}"
    variant_help = "; ".join(f"{arch}: {', '.join(v)}" for arch, v in names.items()) or "see submission.py"
    parser = OneLineArgumentParser(
        prog=prog, description="Build the kernels without a GPU: one row per kernel built (registers, shared and "
                               "tensor memory, stages, SASS counts), then the kernel each case runs.")
    parser.add_argument("--arch", default="sm_100a", choices=tuple(COMPILE_NUM_SMS))
    parser.add_argument("cases", nargs="?", help="task.yml (tests and benchmarks; the default) or a runner text file")
    parser.add_argument("--groups", nargs="+", action="extend", default=[], metavar="G",
                        help="also build the default kernel for these group counts (--groups 1 16 or --groups 1,16)")
    parser.add_argument("--json", metavar="PATH", help="also write the results, per case, as JSON")
    parser.add_argument("--variant", help="build as if set_variant (sm_100a) or set_sm90_variant (sm_90a) had "
                                          "chosen this variant instead of the submission's default; those that "
                                          f"pick their tile per problem still do ({variant_help})")
    args = parser.parse_args(argv)
    groups, trailing_case_file, problem = _group_counts(args.groups, args.cases is not None)
    if problem:
        return usage_error(prog, problem)
    if import_error:
        return usage_error(prog, import_error)
    case_file = args.cases or trailing_case_file or str(HERE / "task.yml")
    if args.variant is not None and args.variant not in names[args.arch]:
        other = [arch for arch, v in names.items() if args.variant in v]
        hint = f" (it is an {other[0]} kernel: add --arch {other[0]})" if other else ""
        return usage_error(prog, f"--variant {args.variant!r} is not an {args.arch} kernel; choose one of "
                                 f"{', '.join(names[args.arch])}{hint}")
    if args.json and not Path(args.json).resolve().parent.is_dir():
        return usage_error(prog, f"--json {args.json}: directory {Path(args.json).resolve().parent} does not exist")
    try:  # both lists of a task.yml, or the one it has; every case against the kernel's shape rules
        cases = load_cases(case_file, ("tests", "benchmarks"), submission.check_problem_sizes)
    except CaseFileError as err:
        return usage_error(prog, str(err))
    cuobjdump = find_cuobjdump()
    if cuobjdump is None:
        return usage_error(prog, "cuobjdump or nvdisasm not found "
                                 "(pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")

    arch, variant = args.arch, args.variant
    # A forced tile that does not divide a case's N never runs it (partial N tiles are never built; bringup
    # skips such a case as not applicable): the case is marked so, and nothing is built for it.
    tile_n = forced_tile_n(arch, variant)
    table = []  # (label, groups, the kernel that runs it or None, why it is not applicable), cases first
    for case in cases:
        g, reason = case.args["g"], not_applicable(case.args, tile_n)
        kernel = None if reason else planned_kernel(arch, variant, g, _case_sizes(case))
        table.append((_short(case), g, kernel, reason))
    table += [(f"g={g} (--groups)", g, planned_kernel(arch, variant, g), None) for g in groups]
    wanted = [(label, kernel) for label, _, kernel, _ in table if kernel is not None]
    skipped = len(table) - len(wanted)
    kernels = sorted({kernel for _, kernel in wanted}, key=lambda k: (k.groups, k.tile_mn, k.variant))
    builds: dict[PlannedKernel, dict] = {}
    for kernel in kernels:
        progress(f"building {arch} {kernel.label}...")
        builds[kernel] = build_one(kernel.groups, arch, cuobjdump, kernel.variant)
    stages = {kernel: kernel_stages(arch, kernel) for kernel in kernels}

    if arch.startswith("sm_90"):
        chosen, setter = variant or hopper_module().SM90_VARIANT, "set_sm90_variant"
        per_problem = chosen not in hopper_module().SM90_VARIANT_CONFIGS
    else:
        chosen, setter = variant or submission.KERNEL_VARIANT, "set_variant"
        per_problem = chosen in submission.TILE_TABLE_VARIANTS
    how = (f"each case's tile as custom_kernel picks it on {COMPILE_GPUS[arch]} ({COMPILE_NUM_SMS[arch]} SMs)"
           if per_problem else f"variant {chosen} for every case, as custom_kernel runs it after {setter}({chosen!r})")
    print(f"{arch}: {len(kernels)} kernel{'s' if len(kernels) != 1 else ''} built (variant, tile MxN, groups); {how}")
    if skipped:
        print(f"{arch}: {skipped} case{'s' if skipped != 1 else ''} not applicable: {chosen} forces {tile_n}-wide "
              f"tiles, and their N is not a multiple of {tile_n} (marked n/a below; nothing built for them)")
    print("\n".join(compile_legend(arch)))
    blackwell = arch.startswith("sm_10")
    ops = ARCH_SASS_OPS[arch]
    width = max([len("kernel"), *(len(k.label) for k in kernels)])
    print(f"{'kernel':<{width}} {'status':<6} {'regs':>4} {'static[B]':>9} {'dynamic[B]':>10} {'smem[B]':>9} "
          + (f"{'tmem':>7} " if blackwell else "") + f"{'stages':>6} {'s':>5}  " + " ".join(f"{op:>7}" for op in ops))
    failed = False
    for kernel in kernels:
        result = builds[kernel]
        res, sass, info = result.get("resources", {}), result.get("sass", {}), result.get("info", {})
        static, dynamic, total = smem_cells(result)
        failed |= not result["ok"]
        print(f"{kernel.label:<{width}} {'OK' if result['ok'] else 'ERROR':<6} {res.get('REG', '?'):>4} {static:>9} "
              f"{dynamic:>10} {total:>9} " + (f"{info.get('tmem_cols', '-'):>7} " if blackwell else "")
              + f"{stages_cell(stages[kernel]):>6} {result.get('seconds', '?'):>5}  "
              + " ".join(f"{sass.get(op, '?'):>7}" for op in ops))
        if not result["ok"]:
            print(f"    {result['error']}")
    print(f"\n{'kernel':<{width}} case")
    for label, _, kernel, reason in table:
        if kernel is None:
            print(f"{'n/a':<{width}} {label}   (not applicable: {chosen} {reason})")
        else:
            print(f"{kernel.label:<{width}} {label}")
    if args.json:
        report = [dict(case=label, groups=g, arch=arch, variant=chosen, ok=None, not_applicable=reason)
                  if kernel is None else
                  dict(builds[kernel], case=label, groups=kernel.groups, arch=arch, variant=kernel.shown,
                       built_as=kernel.variant, kernel=kernel.label, tile_mn=list(kernel.tile_mn),
                       smem=dict(zip(("static", "dynamic", "total"), smem_cells(builds[kernel]))),
                       stages=stages[kernel])
                  for label, g, kernel, reason in table]
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))
    return 1 if failed else 0


# ---------------------------------------------------------------------------------------------------------
# Modes besides the run modes: name -> entry point taking the arguments after the mode. Each parses its own
# arguments; main() knows every name before it looks for a GPU.
def _bringup_mode(argv: list[str]) -> int:
    import bringup

    return bringup.bringup_main(argv)


def _export_mode(argv: list[str]) -> int:
    import bringup

    return bringup.export_main(argv)


TOOL_MODES = {"compile": compile_main, "bringup": _bringup_mode, "export": _export_mode}


def _submission_problem(variants: Optional[list[str]]) -> Optional[str]:
    """Why the submission cannot start as asked (a bad NVFP4_* variable, an unknown --variants name), or None.
    Checked here because the workers would only fail on it with a traceback, once per case."""
    try:
        import submission

        hopper_module()  # NVFP4_SM90_VARIANT is read there
    except Exception as err:
        return f"cannot import submission.py: {type(err).__name__}: {err}"
    if variants is None:
        return None
    names = {arch: arch_variants(arch) for arch in ARCH_NAMES}
    owner = {name: arch for arch, arch_names in names.items() for name in arch_names}
    unknown = [v for v in variants if v not in owner]
    if unknown or not variants:
        what = f"unknown kernel variant {unknown[0]!r}" if unknown else "no kernel variant named"
        return (f"--variants: {what}; choose names of the GPU's own arch, comma-separated: "
                + "; ".join(f"{ARCH_NAMES[arch]} ({arch}): {', '.join(n)}" for arch, n in names.items()))
    first = {}
    for name in variants:
        first.setdefault(owner[name], name)
    if len(first) > 1:
        b200, hopper = first["sm_100a"], first["sm_90a"]
        return (f"--variants: {b200!r} is a B200 (sm_100a) variant and {hopper!r} a Hopper (sm_90a) one; name "
                "the variants of the GPU's own arch only")
    return None


def variants_arch(variants: list[str]) -> tuple:
    """(the GPU's target arch, None) where every --variants name is one of its variants, else (None, a line
    that says which arch the first other name belongs to). Needs the GPU (or CUTE_DSL_ARCH)."""
    import submission

    target = submission._target_arch(None)
    family = arch_family(target)
    for name in variants:
        owner = next(arch for arch in ARCH_NAMES if name in arch_variants(arch))
        if owner != family:
            here = (f"this GPU is {target} ({ARCH_NAMES[family]}), whose variants are "
                    f"{', '.join(arch_variants(family))}" if family else
                    f"this GPU is {target}, which has no kernel here (only {', '.join(ARCH_NAMES)})")
            return None, f"--variants: {name!r} is a {ARCH_NAMES[owner]} ({owner}) kernel variant, but {here}"
    return target, None


def size_rule():
    """(submission.check_problem_sizes, None), or (None, why it cannot be had): the shape rules of the
    submission's can_implement, which every case read by hand is checked against before any GPU work."""
    try:
        import submission
    except Exception as err:
        return None, f"cannot import submission.py: {type(err).__name__}: {err}"
    rule = getattr(submission, "check_problem_sizes", None)
    if rule is None:
        return None, "submission.py has no check_problem_sizes(problem_sizes), the size rules of its can_implement"
    return rule, None


MODE_HELP = {
    "test": "Check the submission on every case of FILE's tests: PASS or FAIL per case, with the runner's check "
            "(reference.check_implementation, rtol = atol = 1e-3).",
    "benchmark": "Time every case of FILE's benchmarks with the runner's method (CUDA events around 15 calls on 15 "
                 "inputs, L2 flushed before each batch, its stop rules): mean ± error in µs, TFLOP/s, GB/s, % of "
                 "the B200 speed of light where FILE gives it, and the geometric mean.",
    "leaderboard": "As benchmark, with the leaderboard's re-check of every output after each timed batch (the "
                   "reference run once per input set, not at every re-check as the runner does: the same result).",
    "profile": "One torch profiler table per case of FILE's benchmarks (the kernels by GPU time).",
}


# One line per mode, for bare `python eval.py`.
MODE_SUMMARY = {
    "test": "check every task.yml test against the reference: PASS or FAIL per case (needs a GPU)",
    "benchmark": "time the task.yml benchmarks with the runner's method (needs a GPU)",
    "leaderboard": "as benchmark, re-checking every output after each timed batch (needs a GPU)",
    "profile": "a torch profiler table per benchmark (needs a GPU)",
    "compile": "build the kernels without a GPU: registers, shared memory, SASS counts per kernel",
    "bringup": "first run on a new GPU: build, check and time every variant, name the fastest",
    "export": "write a copy of submission.py with another default variant (no GPU)",
}


def bare_usage() -> str:
    """What bare `python eval.py` prints (on stderr, exit status 2: argparse's way with a missing argument)."""
    return "\n".join(["usage: python eval.py MODE [FILE] [options]   (python eval.py --help: everything; "
                      "python eval.py MODE --help: a mode's options)", "modes:"]
                     + [f"  {mode:<12} {line}" for mode, line in MODE_SUMMARY.items()]
                     + ["eval.py: no mode given; on a machine without a GPU, start with: python eval.py compile"])


def mode_parser(mode: str) -> OneLineArgumentParser:
    """The arguments of a run mode by hand (what `eval.py MODE --help` prints)."""
    try:
        names = "; ".join(f"{ARCH_NAMES[arch]}: {', '.join(arch_variants(arch))}" for arch in ARCH_NAMES)
    except Exception:
        names = "submission.py's variants"
    section = "tests" if mode == "test" else "benchmarks"
    parser = OneLineArgumentParser(
        prog=f"eval.py {mode}", add_help=False,
        description=MODE_HELP[mode] + " Needs a CUDA GPU. Every case is first checked against the kernel's shape "
                    "rules (submission.check_problem_sizes, those of can_implement): a case it refuses, like a file "
                    "that does not parse, ends in one line on stderr and exit status 2, before any GPU work.",
        epilog="With POPCORN_FD set, eval.py speaks the GPU MODE runner's protocol instead (python eval.py --help).")
    parser.add_argument("cases", nargs="?", default=str(HERE / "task.yml"), metavar="FILE",
                        help=f"task.yml (its '{section}' list; the default) or a runner text file, one case per line")
    parser.add_argument("--variants", "--variant", metavar="A,B",
                        help="run the mode once per kernel variant, comma-separated, one table each; the names of "
                             "the GPU's own arch, selected as set_variant (B200) or set_sm90_variant (Hopper) would "
                             f"({names}); --variant is the same option")
    parser.add_argument("-h", "--help", action="store_true", help="show this help and exit")
    return parser


def main(argv: list[str]) -> int:
    fd = os.getenv("POPCORN_FD")
    modes = RUN_MODES + tuple(TOOL_MODES)
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    if argv and argv[0] in TOOL_MODES:
        return TOOL_MODES[argv[0]](argv[1:])
    parser = OneLineArgumentParser(prog="eval.py", add_help=False)
    parser.add_argument("mode", nargs="?")
    parser.add_argument("cases", nargs="?", default=str(HERE / "task.yml"))
    parser.add_argument("--variants", "--variant", metavar="A,B")  # --variant: compile's and export's spelling
    parser.add_argument("-h", "--help", action="store_true")
    if fd:  # the runner's protocol: its own arguments, MODE FILE
        mode = argv[0] if argv else None
        if mode is None:
            return popcorn_main(fd, argv)
    else:  # intermixed: options may come before, between or after MODE and FILE
        known = parser.parse_known_intermixed_args(argv)[0]
        mode = known.mode
        if mode is None:
            if known.help:  # `eval.py --variants x -h`: all of the help, as `eval.py --help`
                print(__doc__)
                return 0
            print(bare_usage(), file=sys.stderr)
            return 2
    if mode not in modes:
        return usage_error("eval.py", f"unknown mode {mode!r}; choose one of {', '.join(modes)} "
                                      "(python eval.py --help)")
    if fd:
        return popcorn_main(fd, argv)
    if mode in TOOL_MODES:  # `eval.py --quick bringup`: options before a tool mode are that mode's
        rest = list(argv)
        rest.remove(mode)
        return TOOL_MODES[mode](rest)
    args = parser.parse_intermixed_args(argv)
    if args.help:
        print(mode_parser(mode).format_help(), end="")
        return 0
    variants = [] if args.variants is None else [v for v in args.variants.split(",") if v]
    if args.variants is not None or any(key.startswith("NVFP4_") for key in os.environ):
        problem = _submission_problem(variants if args.variants is not None else None)
        if problem:
            return usage_error("eval.py", problem)
    rule, problem = size_rule()
    if problem:
        return usage_error("eval.py", problem)
    try:
        tests = load_cases(args.cases, "tests" if mode == "test" else "benchmarks", rule)
    except CaseFileError as err:
        return usage_error("eval.py", str(err))
    problem = gpu_problem()
    if problem:
        print(f"eval.py: cannot run '{mode}': {problem}", file=sys.stderr)
        return 2
    arch = None
    if variants:
        arch, problem = variants_arch(variants)
        if problem:
            return usage_error("eval.py", problem)
    status = 0
    for variant in variants or [None]:
        if variant:
            print(f"== kernel variant {variant}", flush=True)
        # The spawned worker imports the submission afresh and starts on this variant (the setter of its arch).
        with make_pool(_start_worker, (arch, variant)) as pool:
            if mode == "test":
                status |= human_test(pool, tests)
            elif mode == "profile":
                status |= human_profile(pool, tests)
            else:
                status |= human_benchmark(pool, tests, recheck=(mode == "leaderboard"))
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
