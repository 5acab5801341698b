"""`eval.py bringup`: the first run of the submission on a new GPU; `eval.py export`: a copy of
submission.py with another default kernel variant; and the leaderboard's file rules, which the tests and
export share.

bringup (needs a B200, or an H100/H200 for the Hopper tiles):

    python eval.py bringup [--quick] [--json PATH] [--variants a,b] [--timeout S] [--jobs N] [--sanitizer]

0. checks what needs no GPU first: the variant names (either arch's), task.yml and every case's shape
   against the kernel's rules (submission.check_problem_sizes); a mistake is one line and exit status 2;
1. prints the environment (GPU, compute capability, driver, nvidia-cutlass-dsl, torch, Python, launch path,
   programmatic dependent launch);
2. builds and checks every kernel variant (B200: submission.KERNEL_VARIANTS, "persistent" choosing its tile
   per problem, the persistent_n* variants forcing one tile row; Hopper: submission_sm90.SM90_VARIANTS), in
   parallel worker processes (--jobs, by default one per core within the build units and the available host
   and GPU memory): each variant's kernels, one build unit per group count its cases and benchmarks need,
   are split over shards; a shard's worker first builds its units' kernels (compiled, not launched:
   build_kernels), then runs the task.yml tests and the edge cases of EDGE_CASES (plus groups
   with M = 0 where can_implement accepts them) with those group counts: each case called twice (a fresh
   input, then the same input objects again: the prepared-call path), the output poisoned with NaN before
   each call and compared with the runner's check (reference.check_implementation). Progress lines carry an
   estimate of the time left ("[build 3/42, ~40 s left]"). The DSL keeps compiled kernels per process only
   (cute.compile bypasses its file cache), hence a case runs in the worker that built its kernels. Then the
   runner's own pattern with every result checked (job_pattern): each benchmark's 15 input sets called back
   to back, in several batches on the same inputs, outputs NaN-poisoned before each batch; and on a B200 the
   TMA descriptors of one call of the skewed case read back from the launch's workspace, bit 85 reported
   per group and operand (job_descriptors: the kernels clear it; a set bit fails the variant), and bytes
   64-127 of each per operand (the template's, staged whole: reported, not judged);
3. times the task.yml benchmarks of every variant that failed no check, once every build and test worker
   has exited: one variant at a time, each in a fresh worker of its own (closed, with its inputs and its L2
   flush tensor, before the next variant's starts), which builds the benchmarks' kernels and then runs
   eval.py benchmark's method with its limits, harness._run_single_benchmark itself (the runner's: a warm-up
   on the first benchmark, then CUDA events around 15 calls on 15 inputs, L2 flushed before each batch), so
   that its numbers are eval.py benchmark's on the same GPU (`--quick` changes no timing). On a B200 the tile
   model's time (submission.sm100_predicted_us) stands beside each benchmark of a persistent variant, in the
   table and the JSON ("predicted_us");
4. with --sanitizer, runs the runner's pattern on every benchmark again under compute-sanitizer memcheck,
   once with programmatic dependent launch and once without (NVFP4_PDL), each in a fresh process
   (run_sanitizer; skipped with a note where compute-sanitizer is not installed); an error fails the variant;
5. recommends the fastest variant (geometric mean over the benchmarks) that passed every check, with the one
   line of submission.py that makes it the default and the `eval.py export` command that writes that copy.

Every worker process runs one variant, selected through the environment before it imports the submission
(NVFP4_KERNEL_VARIANT; NVFP4_SM90_VARIANT on Hopper). Every call into a worker
has a timeout; a worker that crashes, hangs or leaves the CUDA context unusable is killed, the case recorded
as CRASH / TIMEOUT / ERROR with the first line of the error, and a fresh worker takes the next case (it
compiles what it needs as it goes; a variant is abandoned after MAX_WORKER_LOSSES lost workers). A job that
ran out of memory (GPU or host) beside the other workers is no verdict on the variant: it runs again alone
once they have exited, and that outcome counts. Each job gives back the GPU memory it left (its inputs,
torch's cached blocks) before its worker takes the next. The workers' own output goes to one log file per
shard and one per timing worker (their directory is named in the report). Exit status: 0 with a
recommendation, 1 without one, 2 when it cannot run (no usable GPU, a GPU without a kernel here, a
usage mistake): one line on stderr.

export (no GPU needed):

    python eval.py export --variant NAME -o FILE [--force]

writes submission.py with NAME on its marked default line (DEFAULT_KERNEL_VARIANT for a B200 variant,
DEFAULT_SM90_VARIANT for a Hopper one), after checking the copy against FILE_RULES; it refuses to write a
file that breaks them, and fails if the marked line is not found exactly once. FILE must be new: an existing
file (submission.py itself included) is overwritten only with --force, and the refusal says when git tracks it.
A FILE whose name does not end in .py (the leaderboard's kind of file) is written only with --force. `-o -` writes the copy to stdout. FILE names a file, never a directory: a directory, a path ending in '/', an
empty name or one in a directory that does not exist is refused (output_refusal).

This module is no command of its own: `python bringup.py` names the two above and exits with status 2 (0 with --help).
"""
import argparse
import concurrent.futures
import dataclasses
import functools
import importlib
import importlib.metadata
import json
import math
import multiprocessing
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Optional

import harness

HERE = Path(__file__).resolve().parent
SUBMISSION = HERE / "submission.py"
TASK_YML = HERE / "task.yml"


def first_line(text) -> str:
    """The first non-empty line of an error or message (at most 300 characters)."""
    if isinstance(text, BaseException):
        text = f"{type(text).__name__}: {text}"
    for line in str(text).splitlines():
        if line.strip():
            return line.strip()[:300]
    return str(text).strip()[:300]


def _parse(parser: argparse.ArgumentParser, argv: list):
    """(args, None), or (None, exit status) after a usage mistake or --help."""
    try:
        return parser.parse_args(argv), None
    except SystemExit as exit_:
        return None, (exit_.code if isinstance(exit_.code, int) else 2)


# ---------------------------------------------------------------------------------------------------------
# The leaderboard's file rules for the submitted file (tests/test_submission.py checks submission.py with
# them; export checks every copy it writes)
# ---------------------------------------------------------------------------------------------------------
HEADER_LINES = ("#!POPCORN leaderboard nvfp4_group_gemm", "#!POPCORN gpu B200")
FORBIDDEN_WORD = "stream"  # the runner rejects a file containing it anywhere, in any case
SIZE_LIMIT_BYTES = 1_000_000
# Modules of this repository a submission must not import (the runner only has its own task.py).
LOCAL_MODULES = frozenset({"reference", "utils", "harness", "eval", "bench", "bringup"})


def rule_header(text: str) -> Optional[str]:
    lines = text.splitlines()[:2]
    if lines != list(HEADER_LINES):
        return f"the first two lines must be {HEADER_LINES[0]!r} and {HEADER_LINES[1]!r}, not {lines!r}"
    return None


def rule_forbidden_word(text: str) -> Optional[str]:
    found = re.search(FORBIDDEN_WORD, text, flags=re.IGNORECASE)
    if found:
        line = text.count("\n", 0, found.start()) + 1
        return f"line {line} contains the runner's forbidden word {found[0]!r} (in any case, anywhere)"
    return None


def rule_size(text: str) -> Optional[str]:
    size = len(text.encode("utf-8"))
    if size >= SIZE_LIMIT_BYTES:
        return f"{size} bytes: the runner takes files under {SIZE_LIMIT_BYTES} bytes"
    return None


def rule_self_contained(text: str) -> Optional[str]:
    for lineno, line in enumerate(text.splitlines(), start=1):
        match = re.match(r"\s*(?:from|import)\s+([A-Za-z_][\w.]*)", line)
        if match and match[1].split(".")[0] in LOCAL_MODULES:
            return f"line {lineno} imports {match[1]!r}, which the runner does not have: {line.strip()!r}"
    return None


FILE_RULES = {
    "header": rule_header,
    "forbidden_word": rule_forbidden_word,
    "size": rule_size,
    "self_contained": rule_self_contained,
}


def file_rule_problems(text: str) -> list:
    """Every broken file rule, one message each (empty: the file may be submitted)."""
    return [f"{name}: {problem}" for name, rule in FILE_RULES.items() if (problem := rule(text))]


# ---------------------------------------------------------------------------------------------------------
# export: submission.py with another default variant (one marked line changed)
# ---------------------------------------------------------------------------------------------------------
MARKER_COMMENT = "# eval.py export --variant NAME rewrites this line"
# Which line holds the default for a variant of each kind, in which file. Only the B200 one is in the
# leaderboard file, so only it is marked for export; the Hopper default is edited in its own module.
DEFAULT_LINE_NAMES = {"b200": "DEFAULT_KERNEL_VARIANT", "sm90": "DEFAULT_SM90_VARIANT"}
DEFAULT_LINE_FILES = {"b200": "submission.py", "sm90": "submission_sm90.py"}


class ExportError(ValueError):
    """export cannot write the copy; the message says why, in one line."""


def default_line(kind: str, variant: str) -> str:
    """The line of DEFAULT_LINE_FILES[kind] that makes `variant` the default of its kind ("b200": the marked
    line of submission.py; "sm90": submission_sm90.py's)."""
    line = f'{DEFAULT_LINE_NAMES[kind]} = "{variant}"'
    return f"{line}  {MARKER_COMMENT}" if kind == "b200" else line


def variant_kind(variant: str, b200_variants, sm90_variants) -> str:
    if variant in b200_variants:
        return "b200"
    if variant in sm90_variants:
        raise ExportError(f"{variant!r} is a Hopper variant: the leaderboard file (submission.py) holds the B200 "
                          f"kernels only; the Hopper default is the {DEFAULT_LINE_NAMES['sm90']} line of "
                          f"{DEFAULT_LINE_FILES['sm90']}")
    raise ExportError(f"unknown variant {variant!r}; choose a B200 one: {', '.join(b200_variants)}")


def marked_line(text: str, kind: str) -> tuple:
    """(index, line) of the one marked default line of `kind` in `text`; ExportError unless there is exactly
    one line assigning that name, and it has the marker's exact form."""
    name = DEFAULT_LINE_NAMES[kind]
    pattern = re.compile(rf'{name} = "[A-Za-z0-9_]+"  {re.escape(MARKER_COMMENT)}')
    lines = text.split("\n")
    assigning = [i for i, line in enumerate(lines) if re.match(rf"{name}\s*(?::[^=]*)?=", line)]
    marked = [i for i in assigning if pattern.fullmatch(lines[i])]
    if len(assigning) != 1 or len(marked) != 1:
        raise ExportError(f"submission.py must have exactly one line assigning {name}, of the form "
                          f"{default_line(kind, 'NAME')!r}; found {len(assigning)} assigning it, "
                          f"{len(marked)} of that form")
    return marked[0], lines[marked[0]]


def export_text(text: str, variant: str, b200_variants, sm90_variants) -> str:
    """`text` (submission.py) with `variant` on its marked default line, checked against FILE_RULES."""
    kind = variant_kind(variant, b200_variants, sm90_variants)
    index, _ = marked_line(text, kind)
    lines = text.split("\n")
    lines[index] = default_line(kind, variant)
    exported = "\n".join(lines)
    problems = file_rule_problems(exported)
    if problems:
        raise ExportError("the copy would break the leaderboard's file rules: " + "; ".join(problems))
    return exported


def git_tracked(path: Path) -> bool:
    """Whether git tracks `path` (False where git or a repository is missing)."""
    try:
        proc = subprocess.run(["git", "ls-files", "--error-unmatch", "--", path.name], cwd=path.parent,
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return proc.returncode == 0


def overwrite_refusal(path: Path) -> Optional[str]:
    """Why export will not write `path` without --force (it exists; a file git tracks is named as such), or
    None for a new file."""
    if not path.exists() and not path.is_symlink():
        return None
    if git_tracked(path.resolve()):
        return f"{path} exists and is tracked by git"
    return f"{path} exists"


# `-o -`: the copy goes to stdout.
STDOUT_NAME = "-"


def output_refusal(output: str) -> Optional[str]:
    """Why export will not write to `output` (whatever --force says), or None: it must name a file, in a
    directory that exists. A name ending in '/' names a directory, which export never writes into."""
    if output == "":
        return f"-o is empty; name the file to write (or {STDOUT_NAME} for stdout)"
    path = Path(output)
    if path.is_dir():
        return f"-o {output} is a directory; name the file to write"
    if output.endswith(("/", os.sep)):
        return f"-o {output}: no such directory, and a name ending in '/' is a directory's; name the file to write"
    if not path.resolve().parent.is_dir():
        return f"-o {output}: directory {path.parent} does not exist"
    return None


def export_main(argv: list) -> int:
    parser = harness.OneLineArgumentParser(prog="eval.py export",
                            description="Write a copy of submission.py whose default kernel variant is NAME.")
    parser.add_argument("--variant", required=True, metavar="NAME",
                        help="a B200 variant (submission.KERNEL_VARIANTS): the leaderboard file's default")
    parser.add_argument("-o", "--output", required=True, metavar="FILE",
                        help=f"where to write the copy: a new .py file (in a directory that exists), unless --force; "
                             f"{STDOUT_NAME} for stdout")
    parser.add_argument("--force", action="store_true",
                        help="overwrite FILE if it exists (submission.py itself included), or write a FILE whose name "
                             "does not end in .py")
    args, status = _parse(parser, argv)
    if args is None:
        return status
    to_stdout = args.output == STDOUT_NAME
    refusal = None if to_stdout else output_refusal(args.output)
    if refusal:
        print(f"eval.py export: {refusal}", file=sys.stderr)
        return 2
    if not to_stdout and not args.output.endswith(".py") and not args.force:
        print(f"eval.py export: -o {args.output} does not end in .py, as a file for the leaderboard must; name a .py "
              "file, or pass --force to write it anyway", file=sys.stderr)
        return 2
    refusal = None if to_stdout else overwrite_refusal(Path(args.output))
    if refusal and not args.force:
        print(f"eval.py export: {refusal}; pass --force to overwrite it, or name a new file", file=sys.stderr)
        return 2
    try:
        import submission
        import submission_sm90
    except Exception as err:
        print(f"eval.py export: cannot import submission.py: {first_line(err)}", file=sys.stderr)
        return 2
    try:
        text = export_text(SUBMISSION.read_text(), args.variant, submission.KERNEL_VARIANTS,
                           submission_sm90.SM90_VARIANTS)
    except ExportError as err:
        print(f"eval.py export: {err}", file=sys.stderr)
        return 2
    kind = variant_kind(args.variant, submission.KERNEL_VARIANTS, submission_sm90.SM90_VARIANTS)
    if to_stdout:  # the copy alone on stdout; what it is, on stderr
        sys.stdout.write(text)
        sys.stdout.flush()
        print(f"eval.py export: wrote submission.py with the line {default_line(kind, args.variant)!r} to stdout",
              file=sys.stderr)
        return 0
    try:
        Path(args.output).write_text(text)
    except OSError as err:
        print(f"eval.py export: cannot write {args.output}: {err.strerror or err}", file=sys.stderr)
        return 2
    print(f"wrote {args.output}: submission.py with the line {default_line(kind, args.variant)!r}")
    return 0


# ---------------------------------------------------------------------------------------------------------
# bringup: the cases
# ---------------------------------------------------------------------------------------------------------
# Shapes the task's tests do not reach. Most have every N a multiple of 256, so the forced 256-wide tiles
# (persistent_n256, sm90_tile256), which never run other N, get them too; "n128" and "mixed" are for the rest.
EDGE_CASES = {
    "m1": dict(m=(1,), n=(256,), k=(256,), g=1, seed=21),
    "m_odd": dict(m=(1, 7, 33, 127, 129, 250), n=(128, 256, 128, 384, 128, 256), k=(256, 512, 256, 768, 256, 512),
                  g=6, seed=22),
    "m_odd_n256": dict(m=(1, 8, 33, 127, 129, 1000), n=(256, 512, 256, 768, 256, 512),
                       k=(256, 512, 256, 768, 256, 512), g=6, seed=23),
    "m_many_tiles": dict(m=(1000, 300, 257), n=(256, 512, 256), k=(512, 256, 256), g=3, seed=24),
    "k256": dict(m=(128, 64, 200, 8), n=(512, 256, 1024, 256), k=(256, 256, 256, 256), g=4, seed=25),
    "k7168": dict(m=(72, 129), n=(256, 512), k=(7168, 7168), g=2, seed=26),
    "g16": dict(m=tuple(1 + (37 * i) % 300 for i in range(16)), n=tuple(256 * (1 + i % 3) for i in range(16)),
                k=tuple(256 * (1 + (5 * i) % 7) for i in range(16)), g=16, seed=27),
    "n128": dict(m=(128, 256, 40, 512), n=(128, 128, 128, 128), k=(512, 1024, 256, 256), g=4, seed=28),
    "mixed": dict(m=(8, 200, 1, 384), n=(4096, 128, 768, 256), k=(1536, 256, 7168, 512), g=4, seed=29),
    # Skewed groups (NVIDIA/cutlass #3165 faulted on such with a descriptor rewritten under in-flight loads):
    # M = 8 beside M = 8192 at K = 7168, N from 256 to 7168; a CTA of the round-robin crosses groups of
    # 1 to 128 tiles. Every N a multiple of 256, so every forced tile runs it. Also the case whose prepared
    # descriptors bringup reads back on a B200 (job_descriptors).
    "skewed": dict(m=(8, 8192, 8, 200), n=(4096, 256, 7168, 1536), k=(7168, 7168, 7168, 7168), g=4, seed=30),
}
# The case job_descriptors runs on a B200.
DESCRIPTOR_CASE = "skewed"
# Groups with M = 0 (an empty group among others, first and last, all of them): run only where the
# submission's can_implement accepts them (m0_accepted).
M0_CASES = {
    "m0_some": dict(m=(0, 128, 0, 200), n=(256, 256, 512, 256), k=(256, 512, 256, 768), g=4, seed=31),
    "m0_first_last": dict(m=(0, 64, 0), n=(256, 512, 256), k=(256, 256, 256), g=3, seed=32),
    "m0_all": dict(m=(0, 0), n=(256, 512), k=(256, 512), g=2, seed=33),
}


def _case_spec(args: dict) -> str:
    return f"g={args['g']} m={list(args['m'])} n={list(args['n'])} k={list(args['k'])}"


def cpu_input(reference, args: dict):
    """The task generator's input for `args`, built on the CPU even where a GPU exists."""
    import torch

    saved = reference._device
    reference._device = lambda: torch.device("cpu")
    try:
        return reference.generate_input(**args)
    finally:
        reference._device = saved


def m0_accepted(submission, reference, args: dict) -> bool:
    """Whether can_implement accepts the groups of `args` whose M is 0. On CPU tensors it always refuses
    (the device check comes last), so the answer is: it refuses this input for the same reason as the same
    input with every M = 0 made 1, or accepts it."""
    ok, reason = submission.can_implement(cpu_input(reference, args))
    if ok:
        return True
    ones = dict(args, m=tuple(m or 1 for m in args["m"]))
    ok_ones, reason_ones = submission.can_implement(cpu_input(reference, ones))
    return not ok_ones and reason == reason_ones


def build_cases(tests: list, accepts_m0: Callable[[dict], bool]) -> list:
    """The correctness cases, in order: task.yml's tests (test1..), EDGE_CASES, the accepted M0_CASES."""
    cases = [dict(label=f"test{i + 1}", kind="test", args=dict(t.args)) for i, t in enumerate(tests)]
    cases += [dict(label=name, kind="edge", args=dict(args)) for name, args in EDGE_CASES.items()]
    cases += [dict(label=name, kind="m0", args=dict(args)) for name, args in M0_CASES.items() if accepts_m0(args)]
    for case in cases:
        case["args"] = {key: list(v) if isinstance(v, tuple) else v for key, v in case["args"].items()}
        case["spec"] = _case_spec(case["args"])
    return cases


def pattern_case_args(args: dict, count: int = harness.NUM_ITERATIONS_PER_BENCHMARK) -> list:
    """The input sets of the runner's timing pattern for one benchmark case: `count` of them, the seed
    advanced by 42 before each, as the runner's harness (harness._run_single_benchmark) makes them; `args`
    itself is left as it is."""
    sets = []
    for index in range(count):
        one = dict(args)
        if "seed" in one:
            one["seed"] = args["seed"] + 42 * (index + 1)
        sets.append(one)
    return sets


not_applicable = harness.not_applicable  # eval.py compile marks the same cases


# ---------------------------------------------------------------------------------------------------------
# bringup: the worker process (one per variant) and what it runs
# ---------------------------------------------------------------------------------------------------------
def _cuda_usable() -> bool:
    """Whether the CUDA context still works (after an illegal address, for example, it never does again)."""
    try:
        import torch

        torch.cuda.synchronize()
        return float(torch.ones(1, device="cuda").sum().item()) == 1.0
    except Exception:
        return False


def _release_gpu_memory() -> None:
    """Gives back what a job left on the GPU: the submission's prepared calls (each keeps its input's tensors
    alive: 16 input sets of a benchmark, ~2 GB) and torch's cached blocks (torch keeps freed blocks
    otherwise). The L2 flush tensor stays (utils.clear_l2_cache_large: one per process, as in eval.py
    benchmark); it goes with the timing worker."""
    import torch

    loaded = sys.modules.get("submission")
    if hasattr(loaded, "forget_prepared_calls"):
        loaded.forget_prepared_calls()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        try:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        except Exception:  # a lost context: the job's own answer says so (cuda_ok)
            pass


def _gives_back_gpu_memory(job: Callable) -> Callable:
    """`job`, followed by _release_gpu_memory, pass or fail: a worker waiting for its next job holds no input
    sets of its last one beside the other workers."""
    @functools.wraps(job)
    def run(*args):
        try:
            return job(*args)
        finally:
            _release_gpu_memory()

    return run


def job_hello() -> dict:
    """What the worker runs: the variant it took from the environment, its launch path, the device."""
    import torch

    import submission
    import submission_sm90

    return dict(pid=os.getpid(), kernel_variant=submission.KERNEL_VARIANT,
                sm90_variant=submission_sm90.SM90_VARIANT, launch_path=submission.LAUNCH_PATH,
                pdl=submission.USE_PDL, dsl=submission.DSL_VERSION, device=torch.cuda.get_device_name(),
                capability=list(torch.cuda.get_device_capability()))


def _max_abs_error(out, expected) -> float:
    worst = 0.0
    for o, e in zip(out, expected):
        if o.numel() == 0:
            continue
        diff = (o.float() - e.float().to(o.device)).abs()
        if diff.isnan().any():
            return math.inf
        worst = max(worst, float(diff.max()))
    return worst


@_gives_back_gpu_memory
def job_check(args: dict) -> dict:
    """One correctness case: a fresh input, then the same input objects again (the prepared-call path);
    the output poisoned with NaN before each call (an element the kernel never writes stays NaN and fails
    the check), each compared with the runner's check."""
    import torch

    from reference import check_implementation, generate_input
    from submission import custom_kernel

    start = time.perf_counter()
    args = {key: tuple(v) if isinstance(v, list) else v for key, v in args.items()}
    data = generate_input(**args)  # the runner's check writes the reference's result into its C tensors
    run = harness._clone_data(data)
    worst = 0.0
    for call in ("first call", "repeated call"):
        for _, _, c in run[0]:
            c.fill_(float("nan"))
        torch.cuda.synchronize()
        try:
            out = custom_kernel(run)
            torch.cuda.synchronize()
        except Exception as err:
            return dict(status="error", error=f"{call}: {first_line(err)}", cuda_ok=_cuda_usable(),
                        seconds=round(time.perf_counter() - start, 2))
        unwritten = sum(int(torch.isnan(c).sum()) for c in out if c.numel())
        good, message = check_implementation(data, out)
        error = _max_abs_error(out, [c for _, _, c in data[0]]) if len(out) == len(data[0]) else math.inf
        worst = max(worst, error)
        if not good:
            return dict(status="fail", error=f"{call}: {first_line(message)}", max_abs_err=error,
                        unwritten=unwritten, seconds=round(time.perf_counter() - start, 2))
    return dict(status="pass", max_abs_err=worst, unwritten=0, seconds=round(time.perf_counter() - start, 2))


def build_kernels(problem_sizes, device=None) -> list:
    """Build, without launching, every kernel custom_kernel launches for groups of these sizes ((m, n, k, l)
    each) on `device` (default: the current GPU), by custom_kernel's own choices and cache: `kernel_config`'s
    GEMM for LAUNCH_PATH, its other parts and the table upload. Returns their compile keys (none when every
    group is empty). `eval.py bringup` builds each variant's kernels with it before its cases run."""
    import submission
    import torch

    sizes = [tuple(size) for size in problem_sizes]
    if submission.first_launched_group(sizes) is None:
        return []
    device = device if device is not None else torch.device("cuda", torch.cuda.current_device())
    submission._check_device(device)
    arch, config = submission._target_arch(device), submission.kernel_config((None, None, None, sizes), device)
    keys = [submission.compile_key(len(sizes), arch, config, part) for part in submission.kernel_parts(config)]
    keys.append(submission.compile_key(len(sizes), arch, submission.TABLE_UPLOAD_CONFIG, "upload"))
    for key in keys:
        submission.compiled_kernel(key)
    return keys


def job_build(problems: list) -> dict:
    """Builds, and launches nothing, every kernel custom_kernel runs for these problems (case args) in this
    worker, through its own choices and cache (`build_kernels`), so that the cases and benchmarks this worker
    runs with them compile nothing."""
    start = time.perf_counter()
    keys = set()
    for args in problems:
        try:
            keys.update(build_kernels(harness.case_sizes(args)))
        except Exception as err:
            return dict(status="error", error=f"{_case_spec(args)}: {first_line(err)}", kernels=len(keys),
                        seconds=round(time.perf_counter() - start, 2))
    return dict(status="ok", kernels=len(keys), seconds=round(time.perf_counter() - start, 2))


@_gives_back_gpu_memory
def job_benchmark(test, max_repeats: int, max_time_ns: float) -> dict:
    """One benchmark with eval.py benchmark's (the runner's) method, harness._run_single_benchmark itself; its
    obligatory check of all 15 inputs first."""
    start = time.perf_counter()
    result = harness._run_single_benchmark(test, False, max_repeats, max_time_ns, True)
    seconds = round(time.perf_counter() - start, 2)
    if isinstance(result, harness.Stats):
        return dict(status="ok", mean_us=result.mean / 1e3, err_us=result.err / 1e3, best_us=result.best / 1e3,
                    worst_us=result.worst / 1e3, runs=result.runs, seconds=seconds)
    return dict(status="fail", error=first_line(result), cuda_ok=_cuda_usable(), seconds=seconds)


def _tuples(args: dict) -> dict:
    return {key: tuple(v) if isinstance(v, list) else v for key, v in args.items()}


def _listed(args: dict) -> dict:
    """Case args as build_cases keeps them (lists, not tuples): what job_build takes."""
    return {key: list(v) if isinstance(v, tuple) else v for key, v in args.items()}


def pattern_failures(checks: list, outputs: list) -> list:
    """(index, first line of the check's message) of every output in `outputs` that `checks[i]` (the runner's
    check, the reference run once: `reference.reference_check`) rejects."""
    failures = []
    for index, (check, out) in enumerate(zip(checks, outputs)):
        good, message = check(out)
        if not good:
            failures.append((index, first_line(message)))
    return failures


@_gives_back_gpu_memory
def job_pattern(args: dict, repeats: int) -> dict:
    """The runner's timing pattern, with every result checked: the 15 input sets of a benchmark
    (pattern_case_args) called back to back without a sync in between, the same input objects in each of
    `repeats` batches (after the first, every call takes the prepared-call path, as in the timed repeats);
    every output poisoned with NaN before each batch, so a call that writes nothing fails too, and every one
    checked after it (the runner's leaderboard mode re-checks, but never poisons)."""
    import torch

    from reference import generate_input, reference_check
    from submission import custom_kernel

    start = time.perf_counter()
    inputs = [generate_input(**_tuples(one)) for one in pattern_case_args(args)]
    checks = [reference_check(harness._clone_data(data)) for data in inputs]  # the reference once per input set
    for batch in range(1, repeats + 1):
        try:
            for data in inputs:
                for _, _, c in data[0]:
                    c.fill_(float("nan"))
            torch.cuda.synchronize()
            outputs = [custom_kernel(data) for data in inputs]
            torch.cuda.synchronize()
        except Exception as err:
            return dict(status="error", error=f"batch {batch}: {first_line(err)}", cuda_ok=_cuda_usable(),
                        seconds=round(time.perf_counter() - start, 2))
        failures = pattern_failures(checks, outputs)
        if failures:
            index, message = failures[0]
            return dict(status="fail", error=f"batch {batch}, input {index + 1} of {len(inputs)}: {message}",
                        wrong=len(failures), batch=batch, seconds=round(time.perf_counter() - start, 2))
    return dict(status="pass", batches=repeats, inputs=len(inputs), seconds=round(time.perf_counter() - start, 2))


# Bit 85 of a TMA descriptor (the 128 KB out-of-bounds address mode; submission.clear_oob_128k_bit): bit 21
# of its 64-bit word 1. A descriptor is 128 bytes, 16 such words.
DESCRIPTOR_BIT = 85
DESCRIPTOR_WORDS = 16
# Bytes 64-127 of a descriptor (words 8-15): what DSL 4.5.2 and 4.8.1 left unstaged before the kernels staged
# the templates whole (submission.stage_descriptor_templates); the read-back reports them.
DESCRIPTOR_UPPER_WORDS = slice(8, 16)


def _descriptor_table(workspace, slots: int):
    """`workspace` (int64 words, rows of `slots` descriptors of DESCRIPTOR_WORDS words each, in order; any
    shape, any device) as a CPU tensor [rows, slots, DESCRIPTOR_WORDS]."""
    import torch

    words = workspace.reshape(-1)
    if words.dtype != torch.int64 or words.numel() % (slots * DESCRIPTOR_WORDS):
        raise ValueError(f"a workspace of {words.numel()} {words.dtype} words is not rows of {slots} descriptors "
                         f"of {DESCRIPTOR_WORDS} int64 words")
    return words.cpu().view(-1, slots, DESCRIPTOR_WORDS)


def descriptor_bit85(workspace, slots: int) -> list:
    """Bit 85 of every TMA descriptor of a descriptor workspace (`_descriptor_table`): [[0 or 1 per slot] per
    row]."""
    word, bit = divmod(DESCRIPTOR_BIT, 64)
    return ((_descriptor_table(workspace, slots)[:, :, word] >> bit) & 1).tolist()


def descriptor_upper_bytes(workspace, slots: int) -> list:
    """Bytes 64-127 of every TMA descriptor of a descriptor workspace (`_descriptor_table`), each as 128 hex
    digits in memory order: [[one per slot] per row]."""
    import torch

    upper = _descriptor_table(workspace, slots)[:, :, DESCRIPTOR_UPPER_WORDS].contiguous()
    return [[bytes(descriptor.view(torch.uint8).tolist()).hex() for descriptor in row] for row in upper]


def upper_bytes_summary(upper: list, operands: list) -> dict:
    """Per operand, each distinct value of bytes 64-127 (`descriptor_upper_bytes`) over the written rows (None:
    never written) and how many rows hold it."""
    summary = {operand: {} for operand in operands}
    for row in upper:
        for operand, value in zip(operands, row or ()):
            summary[operand][value] = summary[operand].get(value, 0) + 1
    return summary


def descriptor_outcome(bits: list, operands: list, row_kind: str, upper: Optional[list] = None) -> dict:
    """job_descriptors' answer: the bits per row ("group" or "tile") and operand, None for a row never written
    (an empty group's); "fail" if any is set. With `upper` (`descriptor_upper_bytes`, the same rows None), the
    distinct values of bytes 64-127 per operand (`upper_bytes_summary`): reported, never a failure."""
    set_in = [f"{row_kind} {row} {operands[slot]}" for row, values in enumerate(bits) if values is not None
              for slot, value in enumerate(values) if value]
    outcome = dict(status="fail" if set_in else "ok", row_kind=row_kind, operands=list(operands), bit85=bits,
                   set_in=set_in)
    if upper is not None:
        outcome["upper_bytes"] = upper_bytes_summary(upper, operands)
    if set_in:
        written = sum(values is not None for values in bits)
        outcome["error"] = (f"bit 85 set in {len(set_in)} of {written * len(operands)} descriptors: "
                            + ", ".join(set_in[:6]) + (" ..." if len(set_in) > 6 else ""))
    return outcome


@_gives_back_gpu_memory
def job_descriptors(args: dict) -> dict:
    """B200: one call of the case, then every TMA descriptor its kernels used, read back from the launch's
    workspace (submission.launch_metadata, the call's own cache entry): bit 85 per group and operand (the
    seed: per tile, A, B, SFA, SFB), and the values bytes 64-127 take per operand."""
    import torch

    import submission
    from reference import generate_input

    start = time.perf_counter()
    data = generate_input(**_tuples(args))
    try:
        submission.custom_kernel(data)
        torch.cuda.synchronize()
        device = data[0][submission.first_launched_group(data[3])][0].device
        config = submission.kernel_config(data, device)
        workspace = submission.launch_metadata(data, device, config).workspace
        torch.cuda.synchronize()
    except Exception as err:
        return dict(status="error", error=first_line(err), cuda_ok=_cuda_usable(),
                    seconds=round(time.perf_counter() - start, 2))
    if isinstance(config, submission.Sm100PersistentConfig):
        operands, row_kind = [slot.name for slot in submission.Sm100TensorMapSlot], "group"
    else:
        operands, row_kind = [slot.name for slot in submission.TensorMapSlot], "tile"
    bits = descriptor_bit85(workspace, len(operands))
    upper = descriptor_upper_bytes(workspace, len(operands))
    if row_kind == "group":  # an empty group has no descriptors: its row was never written
        bits = [values if size[0] else None for values, size in zip(bits, data[3])]
        upper = [values if size[0] else None for values, size in zip(upper, data[3])]
    outcome = descriptor_outcome(bits, operands, row_kind, upper)
    return dict(outcome, seconds=round(time.perf_counter() - start, 2))


def _worker_main(conn, env: dict, log_path: Optional[str]) -> None:
    """A spawned worker: takes its variant from `env` before anything imports the submission, then answers
    (job "module:function", args) requests with ("ok", value) or ("error", first line) until told to stop."""
    if log_path:
        log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        print(f"== worker {os.getpid()} env {env}", flush=True)
    import faulthandler

    faulthandler.enable()
    harness._init_worker()
    os.environ.update(env)
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            return
        if request is None:
            return
        job, args = request
        try:
            module, function = job.split(":")
            reply = ("ok", getattr(importlib.import_module(module), function)(*args))
        except Exception as err:
            import traceback

            traceback.print_exc()
            reply = ("error", first_line(err))
        sys.stdout.flush()
        sys.stderr.flush()
        conn.send(reply)


def _exit_description(code: Optional[int]) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


def log_lines(path: Optional[str], offset: int = 0) -> list:
    """The non-empty lines of a worker log from byte `offset` on."""
    if not path:
        return []
    try:
        with open(path, "rb") as file:
            file.seek(offset)
            text = file.read().decode(errors="replace")
    except OSError:
        return []
    return [line for line in text.splitlines() if line.strip()]


_NOT_A_MESSAGE = ("== worker", "  File", "    ", "Current thread", "Thread 0x", "Extension modules", "Traceback")


def death_message(lines: list) -> str:
    """The line of a dead worker's output that says why: the fatal-error line of faulthandler, else the last
    line that is not part of a traceback."""
    fatal = [line for line in lines if line.startswith("Fatal Python error")]
    if fatal:
        return fatal[0]
    messages = [line for line in lines if not line.startswith(_NOT_A_MESSAGE)]
    return messages[-1] if messages else ""


class Worker:
    """One spawned worker process; every call has a timeout, and a dead or hung worker is reported, not
    waited for. call() returns ("ok", value), ("error", first line), ("crash", why) or ("timeout", why)."""

    def __init__(self, env: dict, log_path: Optional[str] = None):
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        self.log_path = log_path
        self.log_offset = os.path.getsize(log_path) if log_path and os.path.exists(log_path) else 0
        self.process = context.Process(target=_worker_main, args=(child, env, log_path), daemon=True)
        self.process.start()
        child.close()

    def call(self, job: str, args: tuple, timeout: float) -> tuple:
        try:
            self.conn.send((job, args))
        except (OSError, ValueError):
            return "crash", self._death()
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.kill()
                return "timeout", f"no answer within {timeout:.0f} s (worker killed)"
            try:
                if self.conn.poll(min(left, 0.5)):
                    return self.conn.recv()
            except (EOFError, OSError):
                return "crash", self._death()
            if not self.process.is_alive():
                try:
                    if self.conn.poll(0):
                        return self.conn.recv()
                except (EOFError, OSError):
                    pass
                return "crash", self._death()

    def _death(self) -> str:
        self.process.join(10)
        why = f"worker process died ({_exit_description(self.process.exitcode)})"
        message = death_message(self.log_tail(200))
        return why + (f": {message[:240]}" if message else "")

    def log_tail(self, lines: int = 20) -> list:
        """The last lines this worker wrote to its log."""
        return log_lines(self.log_path, self.log_offset)[-lines:]

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(10)

    def close(self) -> None:
        try:
            self.conn.send(None)
        except (OSError, ValueError):
            pass
        self.process.join(20)
        self.kill()
        self.conn.close()


# ---------------------------------------------------------------------------------------------------------
# bringup: building and running the variants
# ---------------------------------------------------------------------------------------------------------
MAX_WORKER_LOSSES = 3  # crashes, hangs or unusable CUDA contexts before a variant's remaining cases are skipped
MAX_JOBS = 32  # worker processes building and testing at once, at most (--jobs may ask for fewer)
# Host memory one worker may take while it builds (torch, the DSL, MLIR and ptxas); --jobs by default keeps
# the workers within the memory the machine has available.
WORKER_MEMORY_BYTES = 4 * 2**30
# NOTES: GPU memory one build and test worker may hold at once: its CUDA context with torch's and the DSL's
# modules (~1 GiB), and the runner's pattern on task.yml's largest benchmark (job_pattern: 15 input sets and
# their 15 expected copies, ~145 MB each for benchmark 1, 4.4 GB; tests/test_bringup.py checks the estimate
# against task.yml). Each job gives back what it left (_release_gpu_memory). --jobs by default keeps the
# workers within the GPU's free memory too, as their checks and patterns run at once: one per core would be
# 16 of them on an 80 GB card.
WORKER_GPU_MEMORY_BYTES = 6 * 2**30


@dataclasses.dataclass
class Limits:
    """Timeouts (s) of the calls into a worker and the benchmark stop rules (eval.py benchmark's by default)."""

    start_timeout: float = 300.0  # a fresh worker: import torch, cutlass and the submission, first CUDA call
    build_timeout: float = 900.0  # one build unit: every kernel one variant runs with one group count
    case_timeout: float = 300.0  # one correctness case (its compiles too, in a worker that replaced a lost one)
    bench_timeout: float = 900.0  # one benchmark: 15 inputs, their check, up to 2 minutes of repeats
    # eval.py benchmark's stop rules, --quick too: bringup's numbers are to be eval.py benchmark's
    max_repeats: int = harness.BENCHMARK_LIMITS[0]
    max_time_ns: float = harness.BENCHMARK_LIMITS[1]
    warmup_repeats: int = harness.WARMUP_LIMITS[0]  # 0: no warm-up run (each benchmark's untimed check compiles)
    max_losses: int = MAX_WORKER_LOSSES
    pattern_repeats: int = 3  # batches of the runner's pattern, every result checked (job_pattern)
    pattern_timeout: float = 900.0  # one benchmark's pattern: 15 inputs, their batches and checks


# Shorter timeouts and fewer pattern batches; the timing stays eval.py benchmark's (at most five repeats
# without the warm-up read 4-14 % above eval.py benchmark on an H100, sm90_auto).
QUICK_LIMITS = Limits(start_timeout=180.0, build_timeout=600.0, case_timeout=120.0, bench_timeout=300.0,
                      max_losses=2, pattern_repeats=2, pattern_timeout=300.0)


@dataclasses.dataclass
class Benchmark:
    label: str
    case: object  # harness.TestCase


def kernel_groups(args: dict) -> int:
    """The group count a problem's kernels are built for: its groups with M > 0 (custom_kernel drops the
    empty ones before it compiles; 0: nothing is built or launched)."""
    return sum(1 for m in args["m"] if m)


def build_units(cases: list, benchmarks: list, tile_n: Optional[int]) -> dict:
    """One variant's build units: kernel group count -> the problems (case args) its kernels are built for,
    from the cases the variant runs (not those `not_applicable` to it) and the benchmarks; in the order they
    first appear."""
    units = {}
    problems = [c["args"] for c in cases if not not_applicable(c["args"], tile_n)]
    problems += [_listed(b.case.args) for b in benchmarks]
    for args in problems:
        groups = kernel_groups(args)
        if groups:
            units.setdefault(groups, []).append(args)
    return units


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _available_memory() -> Optional[int]:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _free_gpu_memory() -> Optional[int]:
    """Free memory of the GPU the workers use (bytes), or None where there is none to ask."""
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.mem_get_info(0)[0]
    except Exception:
        pass
    return None


def default_jobs(units: int, cpus: Optional[int] = None, memory: Optional[int] = -1,
                 gpu_memory: Optional[int] = -1) -> int:
    """Worker processes at once: one per core, no more than there are build units, MAX_JOBS, the available
    host memory holds (WORKER_MEMORY_BYTES each) or the GPU's free memory holds (WORKER_GPU_MEMORY_BYTES
    each). `memory`, `gpu_memory`: bytes, None for unknown (no limit), -1 to ask this machine."""
    cpus = _cpu_count() if cpus is None else cpus
    memory = _available_memory() if memory == -1 else memory
    gpu_memory = _free_gpu_memory() if gpu_memory == -1 else gpu_memory
    by_memory = MAX_JOBS if memory is None else memory // WORKER_MEMORY_BYTES
    by_gpu_memory = MAX_JOBS if gpu_memory is None else gpu_memory // WORKER_GPU_MEMORY_BYTES
    return max(1, min(cpus, units, MAX_JOBS, by_memory, by_gpu_memory))


@dataclasses.dataclass(frozen=True)
class Shard:
    """Part of one variant's work, for one worker process: the build units (kernel group counts) it builds,
    then the cases with those group counts it checks (the first shard also those that build nothing), and
    the benchmarks with them it runs the runner's pattern on. (A variant's timing worker is one too: the
    benchmarks' group counts.)"""

    variant: str
    index: int
    groups: tuple


def plan_shards(units: dict, jobs: int) -> list:
    """Splits every variant's build units (name -> {group count: problems}) into shards: one per variant at
    least, jobs in all where the units allow (the variant with the most units per shard gets the next one);
    a variant's units go to its shards longest first (a unit's weight: one build plus its problems), each to
    the lightest. Returned in rounds (every variant's first shard, then the second shards, ...), the order
    they start in."""
    counts = {name: 1 for name in units}
    total = sum(len(u) for u in units.values())
    for _ in range(max(0, min(jobs, total) - len(units))):
        name = max((n for n in units if counts[n] < len(units[n])), key=lambda n: len(units[n]) / counts[n],
                   default=None)
        if name is None:
            break
        counts[name] += 1
    by_variant = {}
    for name, groups in units.items():
        loads = [[0.0, []] for _ in range(counts[name])]
        for groups_count in sorted(groups, key=lambda g: -(1 + 0.1 * len(groups[g]))):
            lightest = min(loads, key=lambda load: load[0])
            lightest[0] += 1 + 0.1 * len(groups[groups_count])
            lightest[1].append(groups_count)
        by_variant[name] = [Shard(name, i, tuple(sorted(load[1]))) for i, load in enumerate(loads)]
    rounds = max(counts.values(), default=0)
    return [by_variant[name][i] for i in range(rounds) for name in units if i < len(by_variant[name])]


class Progress:
    """Counts one phase's steps (build, test, bench) across threads: "[build 3/12, ~40 s left]", the time
    left extrapolated from the steps done since the phase's first step began."""

    def __init__(self, what: str, total: int, clock: Callable[[], float] = time.monotonic):
        self.what, self.total, self.clock = what, total, clock
        self.done, self.started = 0, None
        self.lock = threading.Lock()

    def begin(self) -> None:
        with self.lock:
            if self.started is None:
                self.started = self.clock()

    def tick(self) -> str:
        with self.lock:
            if self.started is None:
                self.started = self.clock()
            self.done += 1
            elapsed = self.clock() - self.started
            left = elapsed / self.done * max(0, self.total - self.done)
            return f"[{self.what} {self.done}/{self.total}, ~{left:.0f} s left]"


class VariantRun:
    """One variant's results, shared by its shards (each in a thread of its own), and its lost workers."""

    def __init__(self, plan: dict, limits: Limits, start_worker, log: Callable[[str], None]):
        self.plan, self.limits, self.start_worker, self.log = plan, limits, start_worker, log
        self.name = plan["name"]
        self.result = dict(variant=self.name, worker=None, builds={}, cases={}, pattern={}, benchmarks={},
                           losses=0, log=plan.get("log"))
        self.lock = threading.Lock()
        self.runners = {}  # shard index -> ShardRunner
        self.cancelled = threading.Event()  # set when the whole run stops (Ctrl-C): no further calls


class ShardRunner:
    """The worker process of one shard: started on first use, replaced after a loss (the variant is abandoned
    after limits.max_losses of them), every call with a timeout."""

    def __init__(self, run: VariantRun, shard: Shard, log_path: Optional[str]):
        self.run, self.shard, self.log_path = run, shard, log_path
        self.worker, self.tail = None, []

    def _lose(self, worker, why: str) -> str:
        with self.run.lock:
            self.run.result["losses"] += 1
        worker.kill()
        self.worker = None
        self.tail = worker.log_tail()
        return why

    def _worker_or_problem(self):
        """(worker, None), or (None, (status, why)) when a fresh worker does not come up."""
        if self.worker is not None:
            return self.worker, None
        run, limits = self.run, self.run.limits
        worker = run.start_worker(run.plan["env"], self.log_path)
        kind, payload = worker.call("bringup:job_hello", (), limits.start_timeout)
        if kind != "ok":
            return None, ("crash" if kind == "crash" else kind, self._lose(worker, f"worker start: {payload}"))
        key, value = run.plan["selected"]
        if payload.get(key) != value:
            worker.close()
            with run.lock:
                run.result["losses"] = limits.max_losses  # every fresh worker would do the same
            return None, ("error", f"the worker runs {key}={payload.get(key)!r}, not {value!r}")
        with run.lock:
            if run.result["worker"] is None:
                run.result["worker"] = payload
        self.worker = worker
        return worker, None

    def call(self, job: str, args: tuple, timeout: float) -> dict:
        """The status dict of one job, handling lost workers."""
        result = self.run.result
        if self.run.cancelled.is_set():
            return dict(status="not run", error="bringup was stopped")
        if result["losses"] >= self.run.limits.max_losses:
            return dict(status="not run", error=f"variant abandoned after {result['losses']} lost workers")
        worker, problem = self._worker_or_problem()
        if problem:
            return dict(status=problem[0], error=problem[1], log_tail=self.tail)
        kind, payload = worker.call(job, args, timeout)
        if kind == "ok":
            if payload.get("cuda_ok") is False:  # the context is gone: the next job needs a fresh worker
                self._lose(worker, "")
            return payload
        if kind == "error":
            return dict(status="error", error=payload)
        return dict(status=kind, error=self._lose(worker, payload), log_tail=self.tail)

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
            self.worker = None

    def kill(self) -> None:
        worker, self.worker = self.worker, None
        if worker is not None:
            worker.kill()


def _outcome_text(outcome: dict) -> str:
    return (f"{outcome['status']}" + (f" ({outcome['seconds']} s)" if "seconds" in outcome else "")
            + (f": {outcome['error']}" if outcome.get("error") else ""))


def _ordered(entries: dict, labels: list) -> dict:
    return {label: entries[label] for label in labels if label in entries}


def run_variants(plans: list, cases: list, benchmarks: list, limits: Limits, jobs: Optional[int] = None,
                 start_worker=Worker, log: Callable[[str], None] = harness.progress) -> dict:
    """Every variant of `plans`: name -> its results.

    1. Build and test, `jobs` worker processes at once (default_jobs): each variant's build units (its
       kernel group counts, `build_units`) are split into shards (`plan_shards`); a shard's worker builds its
       units' kernels (job_build: compiled, not launched), then checks the cases with those group counts.
       The DSL keeps compiled kernels per process only, so a case runs in the worker that built its kernels.
       After its cases the worker runs the runner's pattern, every result checked (job_pattern), on the
       benchmarks with its group counts (where the plan asks: "pattern"), and reads back the descriptors
       of one case (where the plan names it: "descriptors", B200); then it exits. A job that ran out of GPU
       memory (`out_of_memory`) beside the other workers runs again alone once they have all exited.
    2. Time, one variant at a time, each in a fresh worker of its own on an otherwise idle GPU
       (`time_variant`: eval.py benchmark's method and limits): the benchmarks of every variant that failed
       no case, pattern or descriptor check.

    plan: name, env (what selects the variant in a fresh interpreter), selected (the worker must report
    this as its variant: key, value), tile_n (the forced tile width, None when chosen per problem), log (the
    worker log; one per shard, numbered, where a variant has several), predicted (optional: benchmark label
    -> the tile model's µs, put beside each benchmark's result), pattern (optional: True to run job_pattern
    on every benchmark), descriptors (optional: the case, as build_cases makes it, whose descriptors
    job_descriptors reads back).
    benchmarks: Benchmark objects (harness.TestCase each), labelled bench1...
    """
    started = time.monotonic()
    log_lock, unlocked_log = threading.Lock(), log

    def log(line: str) -> None:  # one line at a time from the shards' threads
        with log_lock:
            unlocked_log(line)

    units = {plan["name"]: build_units(cases, benchmarks, plan.get("tile_n")) for plan in plans}
    jobs = jobs or default_jobs(sum(len(u) for u in units.values()))
    shards = plan_shards(units, jobs)
    runs = {plan["name"]: VariantRun(plan, limits, start_worker, log) for plan in plans}
    shard_counts = {name: sum(1 for s in shards if s.variant == name) for name in runs}
    for shard in shards:
        log_path = runs[shard.variant].plan.get("log")
        if log_path and shard_counts[shard.variant] > 1:
            log_path = str(Path(log_path).with_suffix(f".{shard.index + 1}.log"))
        runs[shard.variant].runners[shard.index] = ShardRunner(runs[shard.variant], shard, log_path)
    for plan in plans:  # what never runs, decided up front
        for case in cases:
            reason = not_applicable(case["args"], plan.get("tile_n"))
            if reason:
                runs[plan["name"]].result["cases"][case["label"]] = dict(status="n/a", error=reason)
    to_check = {name: [c for c in cases if c["label"] not in run.result["cases"]] for name, run in runs.items()}
    building = Progress("build", sum(len(u) for u in units.values()))
    testing = Progress("test", sum(len(v) for v in to_check.values()))
    patterning = Progress("pattern", len(benchmarks) * sum(1 for plan in plans if plan.get("pattern")))
    log(f"building and testing {len(runs)} variant{'s' if len(runs) != 1 else ''}: "
        f"{building.total} build units, {testing.total} cases, {len(shards)} shards, {min(jobs, len(shards))} "
        f"worker processes at once")

    retries = []  # (shard, what, job, args, timeout, store) of each job that ran out of memory (out_of_memory)
    retries_lock = threading.Lock()

    def attempt(shard: Shard, what: str, job: str, args: tuple, timeout: float, store: Callable) -> dict:
        """One job in the shard's worker, its outcome stored; one that ran out of memory beside the other
        workers is also put on `retries`, to be run again alone."""
        outcome = runs[shard.variant].runners[shard.index].call(job, args, timeout)
        store(outcome)
        if out_of_memory(outcome):
            with retries_lock:
                retries.append((shard, what, job, args, timeout, store))
        return outcome

    def work(shard: Shard) -> None:
        run = runs[shard.variant]
        result = run.result
        for groups in shard.groups:
            building.begin()
            outcome = attempt(shard, f"build g={groups}", "bringup:job_build", (units[shard.variant][groups],),
                              limits.build_timeout, functools.partial(result["builds"].__setitem__, f"g={groups}"))
            log(f"{building.tick()} [{run.name}] build g={groups}: {_outcome_text(outcome)}")
        for case in to_check[shard.variant]:
            groups = kernel_groups(case["args"])
            if groups not in shard.groups and not (groups == 0 and shard.index == 0):
                continue
            testing.begin()
            outcome = attempt(shard, case["label"], "bringup:job_check", (case["args"],), limits.case_timeout,
                              functools.partial(result["cases"].__setitem__, case["label"]))
            log(f"{testing.tick()} [{run.name}] {case['label']:<14} {_outcome_text(outcome)}")
        for bench in benchmarks if run.plan.get("pattern") else ():
            if kernel_groups(bench.case.args) not in shard.groups:
                continue
            patterning.begin()
            outcome = attempt(shard, f"pattern {bench.label}", "bringup:job_pattern",
                              (dict(bench.case.args), limits.pattern_repeats), limits.pattern_timeout,
                              functools.partial(result["pattern"].__setitem__, bench.label))
            log(f"{patterning.tick()} [{run.name}] {bench.label:<14} {_outcome_text(outcome)}")
        described = run.plan.get("descriptors")
        if described and kernel_groups(described["args"]) in shard.groups and not not_applicable(
                described["args"], run.plan.get("tile_n")):
            outcome = attempt(shard, f"descriptors of {described['label']}", "bringup:job_descriptors",
                              (described["args"],), limits.case_timeout,
                              lambda outcome: result.__setitem__("descriptors", dict(outcome, case=described["label"])))
            log(f"[{run.name}] descriptors of {described['label']}: {_outcome_text(outcome)}")
        run.runners[shard.index].close()  # timing starts a worker of its own, on a GPU left to it

    pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(jobs, len(shards))))
    try:
        for future in concurrent.futures.as_completed([pool.submit(work, shard) for shard in shards]):
            future.result()  # the first shard whose thread raised ends the run
    except BaseException:  # Ctrl-C, or a bug in a shard's thread: stop every worker, start no other
        for run in runs.values():
            run.cancelled.set()
            for runner in run.runners.values():
                runner.kill()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    # Every shard's worker has exited: each job that ran out of memory beside them runs again alone, in a
    # fresh worker of its shard (it compiles what it needs; closed before the next shard's), and that outcome
    # is the one that counts.
    order = list(runs)
    retries.sort(key=lambda entry: (order.index(entry[0].variant), entry[0].index))
    for number, (shard, what, job, args, timeout, store) in enumerate(retries):
        run = runs[shard.variant]
        runner = run.runners[shard.index]
        log(f"[{run.name}] {what}: out of memory beside other workers; again, alone...")
        outcome = runner.call(job, args, timeout)
        store(dict(outcome, alone=True))
        log(f"[{run.name}] {what}: {_outcome_text(outcome)} (alone)")
        if number + 1 == len(retries) or retries[number + 1][0] != shard:
            runner.close()
    labels = [c["label"] for c in cases]
    for run in runs.values():
        run.result["cases"] = _ordered(run.result["cases"], labels)
        run.result["pattern"] = _ordered(run.result["pattern"], [b.label for b in benchmarks])
        run.result["builds"] = _ordered(run.result["builds"], [f"g={g}" for g in sorted(units[run.name])])

    timed = [run for run in runs.values() if not _failed_cases(run.result)]
    timing = Progress("bench", len(timed) * len(benchmarks))
    for run in runs.values():
        failed = _failed_cases(run.result)
        if failed:
            why = f"not timed: failed {', '.join(failed[:3])}{' ...' if len(failed) > 3 else ''}"
            run.result["benchmarks"] = {b.label: dict(status="not run", error=why) for b in benchmarks}
            continue
        time_variant(run, benchmarks, limits, timing, log)
    for run in runs.values():
        for runner in run.runners.values():
            runner.close()
        run.result["seconds"] = round(time.monotonic() - started, 1)
    return {name: run.result for name, run in runs.items()}


_OUT_OF_MEMORY = re.compile(r"out[ _]of[ _]memory|OutOfMemory|cudaErrorMemoryAllocation", re.IGNORECASE)


def out_of_memory(outcome: dict) -> bool:
    """Whether a job went wrong because memory ran out, by its error line: the GPU's (torch's
    OutOfMemoryError, the CUDA driver's or runtime's out-of-memory error), or the host's (a worker killed by
    SIGKILL: the kernel's out-of-memory killer; bringup itself kills only after a timeout, reported as one).
    Beside other workers, that is of the tool's making."""
    status, error = outcome.get("status"), str(outcome.get("error") or "")
    if status == "crash" and "killed by SIGKILL" in error:
        return True
    return status not in ("ok", "pass", "n/a", "not run") and bool(_OUT_OF_MEMORY.search(error))


def time_variant(run: VariantRun, benchmarks: list, limits: Limits, timing: Progress,
                 log: Callable[[str], None]) -> None:
    """Times one variant's benchmarks as eval.py benchmark does, into run.result["benchmarks"]: in a fresh
    worker of its own (started when no other worker is left, closed before the next variant's starts, so
    that its inputs, its L2 flush tensor and its context are gone with it), which builds the benchmarks'
    kernels (job_build: no compile inside a benchmark's timeout), then runs harness._run_single_benchmark
    with eval.py benchmark's limits (Limits: harness.WARMUP_LIMITS on the first benchmark, untimed, then
    harness.BENCHMARK_LIMITS on each). A benchmark that ran out of memory runs once more in a fresh
    worker."""
    units = {}
    for bench in benchmarks:
        if kernel_groups(bench.case.args):
            units.setdefault(kernel_groups(bench.case.args), []).append(_listed(bench.case.args))
    log_path = run.plan.get("log") and str(Path(run.plan["log"]).with_suffix(".timing.log"))
    runner = run.runners["timing"] = ShardRunner(run, Shard(run.name, len(run.runners), tuple(sorted(units))),
                                                 log_path)
    try:
        for groups, problems in units.items():
            outcome = runner.call("bringup:job_build", (problems,), limits.build_timeout)
            log(f"[{run.name}] timing worker: build g={groups}: {_outcome_text(outcome)}")
        if benchmarks and limits.warmup_repeats:  # as eval.py benchmark and the runner: the first one, untimed
            log(f"[{run.name}] warm-up (first launch)...")
            run.result["warmup"] = runner.call("bringup:job_benchmark", (benchmarks[0].case, limits.warmup_repeats,
                                                                         harness.WARMUP_LIMITS[1]),
                                               limits.bench_timeout)
        for bench in benchmarks:
            timing.begin()
            args = (bench.case, limits.max_repeats, limits.max_time_ns)
            outcome = runner.call("bringup:job_benchmark", args, limits.bench_timeout)
            if out_of_memory(outcome):
                log(f"[{run.name}] {bench.label}: {outcome['status']}: {outcome['error']}; again, in a fresh worker...")
                runner.kill()
                outcome = dict(runner.call("bringup:job_benchmark", args, limits.bench_timeout), fresh_worker=True)
            predicted = (run.plan.get("predicted") or {}).get(bench.label)
            if predicted is not None:
                outcome["predicted_us"] = predicted
            run.result["benchmarks"][bench.label] = outcome
            shown = (f"{outcome['mean_us']:.2f} ± {outcome['err_us']:.2f} µs ({outcome['runs']} repeats)"
                     if outcome["status"] == "ok" else f"{outcome['status']}: {outcome.get('error', '')}")
            if predicted is not None:
                shown += f"; the tile model: {predicted:.2f} µs"
            log(f"{timing.tick()} [{run.name}] {bench.label:<14} {shown}")
    except BaseException:  # Ctrl-C: the worker goes at once
        runner.kill()
        raise
    runner.close()


def _failed_cases(result: dict) -> list:
    """The cases, patterns ("pattern bench1") and the descriptor check ("descriptors") a variant failed."""
    return [label for label, outcome in _checks(result) if outcome["status"] not in ("pass", "n/a", "ok")]


def _checks(result: dict) -> list:
    """(label, outcome) of every correctness check of a variant: its cases, its runs of the runner's pattern,
    its descriptor read-back."""
    checks = list(result["cases"].items())
    checks += [(f"pattern {label}", outcome) for label, outcome in result.get("pattern", {}).items()]
    if result.get("descriptors"):
        checks.append(("descriptors", result["descriptors"]))
    checks += [(f"memcheck {setting}", outcome) for setting, outcome in result.get("sanitizer", {}).items()]
    return checks


def run_variant(plan: dict, cases: list, benchmarks: list, limits: Limits, start_worker=Worker,
                log: Callable[[str], None] = harness.progress) -> dict:
    """One variant in one worker process at a time (run_variants with jobs=1): its builds, every case, then (if
    none failed) every benchmark."""
    return run_variants([plan], cases, benchmarks, limits, jobs=1, start_worker=start_worker, log=log)[plan["name"]]


# ---------------------------------------------------------------------------------------------------------
# bringup: verdicts, recommendation and report (pure functions of the results)
# ---------------------------------------------------------------------------------------------------------
def verdict(vres: dict) -> tuple:
    """("pass" | "partial" | "fail", why) of one variant's results. "fail": a case, a run of the runner's
    pattern (memcheck's too, where it ran), the descriptor read-back, or the check or run of a benchmark,
    went wrong. "partial": nothing failed, but some cases are not applicable to it (a forced tile width), so
    it cannot be the default. A failed build alone fails nothing (the cases compile again); next to a
    failure it is named first, as the likelier cause."""
    bad = [(label, c) for label, c in _checks(vres) if c["status"] not in ("pass", "n/a", "ok")]
    bad += [(label, b) for label, b in vres["benchmarks"].items() if b["status"] not in ("ok", "not run")]
    if bad:
        bad[:0] = [(f"build {label}", b) for label, b in vres.get("builds", {}).items() if b["status"] != "ok"]
        label, c = bad[0]
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        return "fail", f"{label}: {c['status']}" + (f": {c['error']}" if c.get("error") else "") + more
    na = [label for label, c in vres["cases"].items() if c["status"] == "n/a"]
    if na:
        return "partial", f"never runs {len(na)} case(s) ({', '.join(na[:4])}{', ...' if len(na) > 4 else ''})"
    if not vres["cases"]:
        return "fail", "no case ran"
    return "pass", ""


def benchmark_geomean(vres: dict, labels: list) -> Optional[float]:
    """Geometric mean of the benchmark means (µs), or None unless every benchmark has one."""
    times = [vres["benchmarks"].get(label, {}).get("mean_us") for label in labels]
    if not labels or any(t is None or t <= 0 for t in times):
        return None
    return harness.geomean(times)


def recommend(results: dict, bench_labels: list, kind: str, default_variant: str) -> dict:
    """The fastest variant (geometric mean over the benchmarks) among those that passed every case and
    every benchmark; ties go to the earlier variant. `kind`: "b200" or "sm90" (which default line)."""
    geos = {name: benchmark_geomean(vres, bench_labels) for name, vres in results.items()}
    candidates = [name for name, vres in results.items() if verdict(vres)[0] == "pass" and geos[name] is not None]
    rec = dict(kind=kind, default_variant=default_variant, default_geomean_us=geos.get(default_variant),
               default_verdict=verdict(results[default_variant])[0] if default_variant in results else None,
               geomeans_us=geos)
    if not candidates:
        return dict(rec, variant=None, reason="no variant passed every case and every benchmark")
    best = min(candidates, key=lambda name: geos[name])
    rec.update(variant=best, geomean_us=geos[best], is_default=best == default_variant,
               line_before=default_line(kind, default_variant), line_after=default_line(kind, best),
               export_command=None)
    if kind == "b200":
        rec["export_command"] = f"python eval.py export --variant {best} -o sub_{best}.py"
        rec["submit_command"] = (f"popcorn-cli submit --leaderboard nvfp4_group_gemm --gpu B200 --mode test "
                                 f"sub_{best}.py")
    return rec


def format_recommendation(rec: dict) -> str:
    if rec["variant"] is None:
        return f"recommendation: none ({rec['reason']}); submission.py's default stays {rec['default_variant']}"
    best = rec["variant"]
    default = rec["default_variant"]
    head = f"recommendation: {best} (passed every case; geometric mean {rec['geomean_us']:.2f} µs over the benchmarks"
    if rec["is_default"]:
        return head + f")\n  {best} is already submission.py's default: no change"
    if rec.get("default_geomean_us"):
        head += f"; the default {default}: {rec['default_geomean_us']:.2f} µs"
    elif rec.get("default_verdict"):
        head += f"; the default {default}: {rec['default_verdict'].upper()}"
    lines = [head + ")",
             f"  to make it the default, change this one line of {DEFAULT_LINE_FILES[rec['kind']]}:",
             f"    - {rec['line_before']}",
             f"    + {rec['line_after']}"]
    if rec["export_command"]:
        lines.append(f"  or write that copy: {rec['export_command']}")
    if rec["kind"] == "sm90":
        lines.append("  (a Hopper tile choice: the leaderboard file, submission.py, does not hold it)")
    return "\n".join(lines)


def _cell(entry: Optional[dict]) -> str:
    if not entry:
        return "-"
    status = entry["status"]
    if status == "pass":
        return "ok" if not entry.get("max_abs_err") else f"ok {entry['max_abs_err']:.0e}"
    if status == "fail":
        if entry.get("unwritten"):
            return f"FAIL {entry['unwritten']} NaN"
        err = entry.get("max_abs_err")
        return "FAIL" if err is None else f"FAIL {err:.1e}"
    return {"n/a": "n/a", "not run": "-"}.get(status, status.upper())


def format_environment(environment: dict) -> str:
    return "\n".join(["environment"] + [f"  {key:<20} {value}" for key, value in environment.items()])


def _bench_cell(entry: Optional[dict]) -> str:
    if entry and entry["status"] == "ok":
        cell = f"{entry['mean_us']:.2f}±{entry['err_us']:.2f}"
        return cell + (f" ({entry['predicted_us']:.1f})" if entry.get("predicted_us") is not None else "")
    return _cell(entry)


def format_descriptor_bits(name: str, outcome: dict) -> list:
    """Report lines of one variant's descriptor read-back (job_descriptors): bit 85 per group and operand, or
    for many rows (the seed's per-tile descriptors) the count and where it is set; then bytes 64-127 per
    operand (`format_upper_bytes`)."""
    if "bit85" not in outcome:
        return [f"  {name:<20} {_cell(outcome)}: {outcome.get('error', '')}"]
    rows, operands, kind = outcome["bit85"], outcome["operands"], outcome["row_kind"]
    if len(rows) > 8:
        where = f": {', '.join(outcome['set_in'][:6])}" if outcome["set_in"] else ""
        lines = [f"  {name:<20} {len(rows)} {kind}s x {', '.join(operands)}: set in {len(outcome['set_in'])}{where}"]
    else:
        lines = [f"  {name:<20} {kind} {row}: " + (" ".join(f"{op}={bit}" for op, bit in zip(operands, bits))
                                                     if bits is not None else "never written (empty)")
                 for row, bits in enumerate(rows)]
    return lines + format_upper_bytes(name, outcome)


def format_upper_bytes(name: str, outcome: dict) -> list:
    """Report lines of bytes 64-127 of a variant's descriptors (`upper_bytes_summary`), one per operand: "zero"
    or the 128 hex digits where every written row holds the same value, else how many values over how many
    rows and the three commonest with their counts."""
    upper = outcome.get("upper_bytes")
    if upper is None:
        return []
    lines = []
    for operand, values in upper.items():
        rows = sum(values.values())
        if len(values) == 1:
            value = next(iter(values))
            text = "zero" if not value.strip("0") else value
            lines.append(f"  {name:<20} bytes 64-127 of {operand} ({rows} {outcome['row_kind']}s): {text}")
        else:
            shown = sorted(values.items(), key=lambda item: -item[1])[:3]
            counts = ", ".join(f"{value} x{count}" for value, count in shown) + (" ..." if len(values) > 3 else "")
            lines.append(f"  {name:<20} bytes 64-127 of {operand}: {len(values)} values over {rows} "
                         f"{outcome['row_kind']}s: {counts}")
    return lines


def format_report(cases: list, benchmarks: list, results: dict, rec: dict, limits: Limits,
                  log_dir: Optional[str] = None, model: Optional[str] = None) -> str:
    """The tables bringup prints after the environment: correctness per case and variant, benchmark µs per
    variant (with the tile model's prediction in parentheses where `model` names it and the variant has one),
    a verdict per variant with its first failure, and the recommendation."""
    names = list(results)
    bench_cells = {(n, b.label): _bench_cell(results[n]["benchmarks"].get(b.label)) for n in names for b in benchmarks}
    width = max([12] + [len(n) + 1 for n in names])
    bench_width = max([width] + [len(c) + 1 for c in bench_cells.values()])
    out = ["correctness: each case called twice (fresh input, then the same objects again), outputs NaN-poisoned "
           "first, the runner's check (rtol = atol = 1e-3); a cell is the largest |error| or what went wrong",
           f"{'case':<15}" + "".join(f"{n:>{width}}" for n in names) + "   shape"]
    for case in cases:
        out.append(f"{case['label']:<15}" + "".join(f"{_cell(results[n]['cases'].get(case['label'])):>{width}}"
                                                     for n in names) + f"   {case['spec']}")
    if any(results[n].get("pattern") for n in names):
        out += ["", f"the runner's pattern: each benchmark's 15 input sets called back to back, "
                f"{limits.pattern_repeats} batches on the same inputs, outputs NaN-poisoned before each batch, every "
                "result checked",
                f"{'benchmark':<15}" + "".join(f"{n:>{width}}" for n in names)]
        out += [f"{bench.label:<15}" + "".join(f"{_cell(results[n].get('pattern', {}).get(bench.label)):>{width}}"
                                                 for n in names) for bench in benchmarks]
    described = [n for n in names if results[n].get("descriptors")]
    if described:
        case = results[described[0]]["descriptors"].get("case", "one case")
        out += ["", f"TMA descriptor bit 85 (the 128 KB out-of-bounds mode, cleared by the kernels: 0 expected) and "
                "bytes 64-127 (the host-made template's, staged whole: reported, not judged), read back from the "
                f"launch's workspace after one call of {case}"]
        for n in described:
            out += format_descriptor_bits(n, results[n]["descriptors"])
    sanitized = [n for n in names if results[n].get("sanitizer")]
    if sanitized:
        out += ["", f"compute-sanitizer memcheck: the runner's pattern again ({SANITIZER_REPEATS} batches per "
                "benchmark), programmatic dependent launch on and off"]
        out += [f"  {n:<20} {setting:<8} {_cell(outcome)}"
                + (f" ({outcome['errors']} memcheck errors)" if outcome.get("errors") is not None else "")
                for n in sanitized for setting, outcome in results[n]["sanitizer"].items()]
    repeats = (f"at most {limits.max_repeats} repeats" if limits.max_repeats < 100
               else "repeats until the error of the mean is under 0.1 % (at most 100 or 2 minutes)")
    predicted = model and any("predicted_us" in b for n in names for b in results[n]["benchmarks"].values())
    out += ["", f"benchmarks: µs per call, the runner's method (CUDA events around 15 calls on 15 inputs, L2 flushed "
            f"before each batch; {repeats})" + (f"; (x): the tile model's µs ({model})" if predicted else ""),
            f"{'benchmark':<15}" + "".join(f"{n:>{bench_width}}" for n in names) + "   shape"]
    labels = [b.label for b in benchmarks]
    for bench in benchmarks:
        out.append(f"{bench.label:<15}" + "".join(f"{bench_cells[n, bench.label]:>{bench_width}}" for n in names)
                   + f"   {_case_spec(bench.case.args)}")
    geos = [benchmark_geomean(results[n], labels) for n in names]
    out.append(f"{'geomean':<15}" + "".join(f"{(f'{g:.2f}' if g else '-'):>{bench_width}}" for g in geos))
    out += ["", "variants"]
    for n in names:
        state, why = verdict(results[n])
        path = (results[n].get("worker") or {}).get("launch_path") or "?"
        out.append(f"  {n:<20} {state.upper():<8} launch path {path:<10}" + (f" {why}" if why else ""))
    failures = [(n, f"build {label}", b) for n in names for label, b in results[n].get("builds", {}).items()
                if b["status"] != "ok"]
    failures += [(n, label, c) for n in names for label, c in _checks(results[n])
                 if c["status"] not in ("pass", "n/a", "not run", "ok")]
    failures += [(n, label, b) for n in names for label, b in results[n]["benchmarks"].items()
                 if b["status"] not in ("ok", "not run")]
    if failures:
        out += ["", "errors (first line of each)"]
        out += [f"  {n} {label}: {c['status']}: {c.get('error', '')}" for n, label, c in failures]
    if log_dir:
        out += ["", f"worker logs (each worker's stdout and stderr): {log_dir}"]
    out += ["", format_recommendation(rec)]
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------------------
# bringup --sanitizer: the runner's pattern again, under compute-sanitizer's memcheck, PDL on and off
# ---------------------------------------------------------------------------------------------------------
SANITIZER_REPEATS = 2  # batches of each benchmark's 15 inputs (memcheck slows every kernel many times over)
SANITIZER_TIMEOUT = 3600.0  # one variant with one PDL setting: its builds and every benchmark's pattern
# Device-side errors only: DSL 4.8's own driver probing returns invalid-value from cuGetProcAddress once per
# compile (tests/test_gpu_sanitizer.py), which is no error of the kernels.
MEMCHECK_ARGS = ("--tool", "memcheck", "--report-api-errors", "no", "--error-exitcode", "97")
PDL_SETTINGS = (("PDL on", "1"), ("PDL off", "0"))
_SANITIZED_SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import bringup
for label, args in json.loads(sys.argv[3]):
    try:
        outcome = bringup.job_pattern(args, int(sys.argv[2]))
    except Exception as err:
        outcome = dict(status="error", error=bringup.first_line(err))
    print("PATTERN " + json.dumps(dict(outcome, label=label)), flush=True)
"""


def sanitizer_command(sanitizer: str, selection: dict, pdl: str, cases: list, repeats: int) -> tuple:
    """(argv, env) of one run under memcheck: the variant selected through the environment (`selection`, as
    a worker's), NVFP4_PDL=`pdl`, job_pattern on every (label, case args) of `cases`."""
    argv = [sanitizer, *MEMCHECK_ARGS, sys.executable, "-c", _SANITIZED_SCRIPT, str(HERE), str(repeats),
            json.dumps(cases)]
    return argv, dict(os.environ, **selection, NVFP4_PDL=pdl, PYTHONWARNINGS="ignore")


def parse_sanitizer_run(output: str, returncode: Optional[int], labels: list) -> dict:
    """The outcome of one memcheck run from its output: "pass" when memcheck's summary says 0 errors and every
    pattern of `labels` passed; "fail" on a reported error or a failed pattern; "error" when the run ended
    without a summary (a crash or a kill) or a pattern is missing."""
    patterns = {}
    for line in output.splitlines():
        if line.startswith("PATTERN "):
            try:
                entry = json.loads(line[len("PATTERN "):])
                patterns[entry.pop("label")] = entry
            except (ValueError, KeyError):
                pass
    summary = re.search(r"ERROR SUMMARY: (\d+) errors?", output)
    errors = int(summary[1]) if summary else None
    reports = [line.strip("= ").strip() for line in output.splitlines()
               if line.startswith("========= ") and not re.match(r"=+\s+(ERROR SUMMARY|COMPUTE-SANITIZER|$)", line)
               and not line.startswith("=========     ")]
    wrong = [f"{label}: {p.get('error', p['status'])}" for label, p in patterns.items() if p.get("status") != "pass"]
    missing = [label for label in labels if label not in patterns]
    outcome = dict(errors=errors, patterns=patterns, returncode=returncode)
    if errors:
        first = reports[0] if reports else "?"
        return dict(outcome, status="fail", error=f"memcheck: {errors} error(s); first: {first}")
    if wrong:
        return dict(outcome, status="fail", error="; ".join(wrong[:3]))
    if errors is None or missing:
        tail = [line for line in output.splitlines() if line.strip()][-1:]
        return dict(outcome, status="error", error=f"no memcheck summary or missing patterns ({', '.join(missing)}); "
                                                   f"exit {returncode}: {tail[0][:200] if tail else ''}")
    return dict(outcome, status="pass")


def run_sanitizer(plans: list, benchmarks: list, sanitizer: str, repeats: int = SANITIZER_REPEATS,
                  timeout: float = SANITIZER_TIMEOUT, run: Callable = subprocess.run,
                  log: Callable[[str], None] = harness.progress) -> dict:
    """Every plan's variant (bringup's plans) through the runner's pattern on every benchmark it runs, under
    memcheck, once with PDL on and once off: name -> {"PDL on": outcome, "PDL off": outcome}."""
    results = {}
    for plan in plans:
        cases = [(b.label, dict(b.case.args)) for b in benchmarks
                 if not not_applicable(b.case.args, plan.get("tile_n"))]
        labels = [label for label, _ in cases]
        for setting, pdl in PDL_SETTINGS:
            argv, env = sanitizer_command(sanitizer, plan["env"], pdl, cases, repeats)
            log(f"[{plan['name']}] memcheck, {setting}: the runner's pattern on {', '.join(labels)}...")
            try:
                proc = run(argv, env=env, capture_output=True, text=True, timeout=timeout)
                outcome = parse_sanitizer_run((proc.stdout or "") + (proc.stderr or ""), proc.returncode, labels)
            except subprocess.TimeoutExpired:
                outcome = dict(status="timeout", error=f"no end within {timeout:.0f} s")
            results.setdefault(plan["name"], {})[setting] = outcome
            log(f"[{plan['name']}] memcheck, {setting}: {_outcome_text(outcome)}")
    return results


# ---------------------------------------------------------------------------------------------------------
# bringup: environment and main
# ---------------------------------------------------------------------------------------------------------
def _driver_version() -> str:
    try:
        proc = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20)
        found = proc.stdout.strip().splitlines()
        if proc.returncode == 0 and found:
            return found[0].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return "? (nvidia-smi not available)"


def _package_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def environment(submission, kind: str) -> dict:
    import torch

    props = torch.cuda.get_device_properties(0)
    major, minor = torch.cuda.get_device_capability(0)
    try:
        api = torch._C._cuda_getDriverVersion()
        driver_api = f"CUDA {api // 1000}.{api % 1000 // 10}"
    except Exception:
        driver_api = "CUDA ?"
    default_name = "DEFAULT_KERNEL_VARIANT" if kind == "b200" else "DEFAULT_SM90_VARIANT"
    return {
        "gpu": torch.cuda.get_device_name(0),
        "compute capability": f"{major}.{minor}",
        "SMs": props.multi_processor_count,
        "memory": f"{props.total_memory / 2**30:.1f} GiB",
        "driver": f"{_driver_version()} ({driver_api} driver API)",
        "nvidia-cutlass-dsl": submission.DSL_VERSION,
        "torch": f"{torch.__version__} (CUDA {torch.version.cuda})",
        "python": platform.python_version(),
        "apache-tvm-ffi": _package_version("apache-tvm-ffi"),
        "launch path": f"{submission.LAUNCH_PATH} (submission.LAUNCH_PATH at import)",
        "PDL": "on" if submission.USE_PDL else "off",
        "default variant": f"{getattr(submission, default_name, '?')} (submission.{default_name})",
        "cpu": _cpu_name(),
    }


def _finite(value):
    """`value` with every infinite or NaN float written as a string (strict JSON has neither)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {key: _finite(v) for key, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def predicted_us(submission, variant: str, sizes: list, num_sms: int) -> Optional[float]:
    """The B200 tile model's time (submission.sm100_predicted_us, µs) of `variant` on a problem of these
    sizes, with the tile it runs there (the tile table's choice for "persistent"); None for a kernel the
    model does not describe (not a persistent one)."""
    if variant in submission.TILE_TABLE_VARIANTS:
        config = submission.choose_sm100_config(sizes, num_sms)
    else:
        config = submission.VARIANT_CONFIGS.get(variant)
    if not isinstance(config, submission.Sm100PersistentConfig):
        return None
    return submission.sm100_predicted_us(sizes, config, num_sms)


def bringup_main(argv: list) -> int:
    prog = "eval.py bringup"
    parser = harness.OneLineArgumentParser(
        prog=prog, description="First run on a B200 (or a Hopper GPU): every variant built, checked and timed.")
    parser.add_argument("--quick", action="store_true",
                        help="shorter timeouts and fewer batches of the runner's pattern (the timing stays eval.py "
                             "benchmark's)")
    parser.add_argument("--json", metavar="PATH", help="also write every result as JSON (for a bug report)")
    parser.add_argument("--variants", "--variant", metavar="A,B",
                        help="only these variants (default: every one for this GPU); --variant is the same option")
    parser.add_argument("--timeout", type=float, metavar="S", help="timeout of one correctness case (s)")
    parser.add_argument("--jobs", type=int, metavar="N",
                        help=f"worker processes building and testing at once (default: one per core, at most "
                             f"{MAX_JOBS}, the build units and what the available host and GPU memory holds; "
                             "the timing runs one variant at a time, whatever N)")
    parser.add_argument("--sanitizer", action="store_true",
                        help="afterwards, run the runner's pattern on every benchmark again under compute-sanitizer "
                             "memcheck, with programmatic dependent launch on and off (slow; skipped, with a note, "
                             "where compute-sanitizer is not installed)")
    args, status = _parse(parser, argv)
    if args is None:
        return status
    if args.jobs is not None and args.jobs < 1:
        return harness.usage_error(prog, f"--jobs {args.jobs}: at least 1")
    # Everything that needs no GPU first: the submission, the variant names, the cases and their shapes.
    try:
        import reference
        import submission
        import submission_sm90
    except Exception as err:
        return harness.usage_error(prog, f"cannot import the submission: {first_line(err)}")
    arch_names = {"b200": tuple(submission.KERNEL_VARIANTS), "sm90": tuple(submission_sm90.SM90_VARIANTS)}
    chosen = None
    if args.variants is not None:
        chosen = [v for v in args.variants.split(",") if v]
        unknown = [v for v in chosen if v not in arch_names["b200"] + arch_names["sm90"]]
        if unknown or not chosen:
            return harness.usage_error(prog, f"--variants: {', '.join(map(repr, unknown)) or 'no variant named'}: "
                                             f"not a variant; B200: {', '.join(arch_names['b200'])}; Hopper: "
                                             f"{', '.join(arch_names['sm90'])}")
    try:
        tests = harness.load_cases(str(TASK_YML), "tests", submission.check_problem_sizes)
        bench_cases = harness.load_cases(str(TASK_YML), "benchmarks", submission.check_problem_sizes)
    except harness.CaseFileError as err:
        return harness.usage_error(prog, str(err))
    problem = harness.gpu_problem()
    if problem:
        return harness.usage_error(prog, f"cannot run: {problem}")
    import torch

    capability = torch.cuda.get_device_capability(0)
    kind = {(10, 0): "b200", (9, 0): "sm90"}.get(tuple(capability))
    if kind is None:
        return harness.usage_error(prog, f"cannot run: {torch.cuda.get_device_name(0)} has compute capability "
                                         f"{capability[0]}.{capability[1]}; the submission has kernels for 10.0 "
                                         "(B200) and 9.0 (Hopper) only")
    names = arch_names[kind]
    variable = "NVFP4_KERNEL_VARIANT" if kind == "b200" else "NVFP4_SM90_VARIANT"
    default = submission.DEFAULT_KERNEL_VARIANT if kind == "b200" else submission_sm90.DEFAULT_SM90_VARIANT
    if chosen is not None:
        other = [v for v in chosen if v not in names]
        if other:
            return harness.usage_error(prog, f"--variants: {', '.join(map(repr, other))}: not a variant for this GPU "
                                             f"({'B200' if kind == 'b200' else 'Hopper'}); choose from "
                                             f"{', '.join(names)}")
        names = tuple(chosen)
    limits = dataclasses.replace(QUICK_LIMITS if args.quick else Limits())
    if args.timeout:
        limits.case_timeout = args.timeout
    started = time.time()
    env = environment(submission, kind)
    print(format_environment(env), flush=True)
    cases = build_cases(tests, lambda a: m0_accepted(submission, reference, a))
    benchmarks = [Benchmark(f"bench{i + 1}", case) for i, case in enumerate(bench_cases)]
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    log_dir = tempfile.mkdtemp(prefix="nvfp4-bringup-")
    plans = []
    for name in names:
        if kind == "b200":
            config = submission.VARIANT_CONFIGS[name]
            tile_n = None if name in submission.TILE_TABLE_VARIANTS else config.tile_mn[1]
            selected = ("kernel_variant", name)
            predicted = {b.label: predicted_us(submission, name, harness.case_sizes(b.case.args), num_sms)
                         for b in benchmarks}
            predicted = {label: us for label, us in predicted.items() if us is not None}
        else:
            config = submission_sm90.SM90_VARIANT_CONFIGS.get(name)  # None: sm90_auto
            tile_n = config.tile_mn[1] if config else None
            selected, predicted = ("sm90_variant", name), {}
        described = next(c for c in cases if c["label"] == DESCRIPTOR_CASE) if kind == "b200" else None
        plans.append(dict(name=name, env={variable: name}, selected=selected, tile_n=tile_n, predicted=predicted,
                          pattern=True, descriptors=described,
                          log=str(Path(log_dir) / f"{name}.log")))
    jobs = args.jobs or default_jobs(sum(len(build_units(cases, benchmarks, plan["tile_n"])) for plan in plans))
    results = run_variants(plans, cases, benchmarks, limits, jobs=jobs, start_worker=Worker)
    sanitizer = None
    if args.sanitizer:
        sanitizer = harness.find_cuda_tool("compute-sanitizer")
        if sanitizer is None:
            harness.progress("--sanitizer: compute-sanitizer not found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin): "
                             "skipped")
        else:
            for name, runs in run_sanitizer(plans, benchmarks, sanitizer).items():
                results[name]["sanitizer"] = runs
    rec = recommend(results, [b.label for b in benchmarks], kind, default)
    harness.progress(f"bringup took {time.time() - started:.0f} s")
    model = f"submission.sm100_predicted_us on {num_sms} SMs" if kind == "b200" else None
    print("\n" + format_report(cases, benchmarks, results, rec, limits, log_dir, model=model))
    if args.json:
        document = dict(tool="eval.py bringup", quick=args.quick, arch="sm_100a" if kind == "b200" else "sm_90a",
                        seconds=round(time.time() - started, 1), environment=env, limits=dataclasses.asdict(limits),
                        jobs=jobs, model=model,
                        cases=cases, benchmarks=[dict(label=b.label, spec=_case_spec(b.case.args), sol_us=b.case.sol_us)
                                                 for b in benchmarks],
                        variants=results, recommendation=rec, worker_logs=log_dir,
                        sanitizer=dict(requested=args.sanitizer, tool=sanitizer))
        try:
            Path(args.json).write_text(json.dumps(_finite(document), indent=1, default=str))
        except OSError as err:
            return harness.usage_error(prog, f"cannot write {args.json}: {err.strerror or err}")
    return 0 if rec["variant"] else 1


# ---------------------------------------------------------------------------------------------------------
# The B200 tile rows the task's shapes and MoE layers pick (docs/B200_DESIGN.md, section 3, is these tables)
# ---------------------------------------------------------------------------------------------------------
# MoE layers the task's shapes come from, in decode (every expert of a layer gets a few tokens): name,
# routed experts, (N, K) of each of its GEMMs.
MOE_LAYERS = (("DeepSeek-V3", 256, ((4096, 7168), (7168, 2048))),
              ("Qwen3-30B-A3B", 128, ((1536, 2048), (2048, 768))))
MOE_TOKENS = (8, 40)  # tokens per expert, the same for every expert; and a mix drawn from 8..40 (seed 0)


def moe_cases() -> list:
    """(label, problem sizes) of each MoE GEMM of MOE_LAYERS with MOE_TOKENS tokens per expert, and with
    8-40 tokens per expert drawn uniformly (random.Random(0))."""
    import random

    cases = []
    for name, experts, shapes in MOE_LAYERS:
        for n, k in shapes:
            counts = [(str(t), [t] * experts) for t in MOE_TOKENS]
            draw = random.Random(0)
            counts.append(("8-40", [draw.randint(8, 40) for _ in range(experts)]))
            cases += [(f"{name} N {n} K {k}, M {label}", [(m, n, k, 1) for m in ms]) for label, ms in counts]
    return cases


def _tile_rows_table(cases: list, num_sms: int) -> str:
    """Markdown table: for each (label, problem sizes), its group count, the number of tiles and the model's
    time (sm100_predicted_us, µs) of every row of the tile table, and the row submission.choose_sm100_config
    picks on `num_sms` SMs (variant "persistent"). A row in parentheses is not a candidate (N = 256 needs every
    N to be a multiple of 256)."""
    import submission

    rows = submission.SM100_TILE_TABLE
    name = lambda row: f"{row.tile_mn[0]}×{row.tile_mn[1]}"  # noqa: E731
    lines = ["| case | G | " + " | ".join(f"{name(row)}: tiles, model µs" for row in rows) + " | chosen |",
             "| --- | --- | " + " | ".join("---" for _ in rows) + " | --- |"]
    for label, sizes in cases:
        cells = []
        for row in rows:
            cell = (f"{submission.num_output_tiles(sizes, row.tile_mn)}, "
                    f"{submission.sm100_predicted_us(sizes, row, num_sms):.2f}")
            candidate = all(n % row.tile_mn[1] == 0 for _, n, _, _ in sizes)
            cells.append(cell if candidate else f"({cell})")
        chosen = name(submission.choose_sm100_config(sizes, num_sms))
        lines.append(f"| {label} | {len(sizes)} | " + " | ".join(cells) + f" | {chosen} |")
    return "\n".join(lines)


def tile_choice_table(num_sms: int = 148) -> str:
    """_tile_rows_table of every task.yml test and benchmark ("test 1", ..., "bench 1", ...)."""
    cases = []
    for section, label in (("tests", "test"), ("benchmarks", "bench")):
        for i, case in enumerate(harness.load_cases(str(TASK_YML), section)):
            cases.append((f"{label} {i + 1}", harness.case_sizes(case.args)))
    return _tile_rows_table(cases, num_sms)


def moe_tile_choice_table(num_sms: int = 148) -> str:
    """_tile_rows_table of the MoE GEMMs of moe_cases()."""
    return _tile_rows_table(moe_cases(), num_sms)


if __name__ == "__main__":
    sys.exit(harness.not_a_command("bringup.py", "not a command of its own: run python eval.py bringup (first run on a "
                                                 "GPU) or python eval.py export (a copy with another default); "
                                                 "python eval.py bringup --help lists the options", sys.argv[1:]))
