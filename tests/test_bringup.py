"""eval.py bringup and export on the CPU: the file rules, export of every variant (file rules, one line
changed, the copy imports with that default), the Hopper variant choice in submission.py, bringup's
worker processes (answers, errors, crashes, hangs), its case runner and benchmark runner on stand-in
kernels, its per-variant driver on fake workers, its recommendation and report on fabricated results, the
no-GPU exit, and the tile table of docs/B200_DESIGN.md against the model."""
import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
import types

import pytest
import torch

import bringup
import eval as ev
import harness
import reference
import submission
import submission_sm90
from conftest import ROOT

SUBMISSION_TEXT = (ROOT / "submission.py").read_text()
# What export writes: the leaderboard file, so B200 variants only.
EXPORT_VARIANTS = list(submission.KERNEL_VARIANTS)


def _clean_env():
    env = {k: v for k, v in os.environ.items() if k not in ("NVFP4_KERNEL_VARIANT", "NVFP4_SM90_VARIANT")}
    env["PYTHONWARNINGS"] = "ignore"
    return env


# ---------------------------------------------------------------------------------------------------------
# File rules (tests/test_submission.py applies them to submission.py)
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rule,broken", [
    ("header", lambda t: t.replace("#!POPCORN gpu B200\n", "#!POPCORN gpu H100\n", 1)),
    ("header", lambda t: "\n" + t),
    ("forbidden_word", lambda t: t + "\n# a CUDA S" + "TREAM comment\n"),
    ("forbidden_word", lambda t: t.replace("import ctypes\n", "import ctypes\nmy_s" + "tream = None\n", 1)),
    ("size", lambda t: t + "#" * bringup.SIZE_LIMIT_BYTES + "\n"),
    ("self_contained", lambda t: t.replace("import ctypes\n", "import ctypes\nfrom reference import ref_kernel\n", 1)),
    ("self_contained", lambda t: t.replace("import ctypes\n", "import ctypes\n    import utils\n", 1)),
])
def test_each_file_rule_catches_its_break(rule, broken):
    assert bringup.file_rule_problems(SUBMISSION_TEXT) == []
    text = broken(SUBMISSION_TEXT)
    assert text != SUBMISSION_TEXT
    problems = bringup.file_rule_problems(text)
    assert len(problems) == 1 and problems[0].startswith(rule + ": "), problems


# ---------------------------------------------------------------------------------------------------------
# export
# ---------------------------------------------------------------------------------------------------------
def _export(tmp_path, name):
    out = tmp_path / f"sub_{name}.py"
    assert bringup.export_main(["--variant", name, "-o", str(out)]) == 0
    return out


@pytest.mark.parametrize("name", EXPORT_VARIANTS)
def test_export_changes_exactly_the_default_line(tmp_path, capsys, name):
    text = _export(tmp_path, name).read_text()
    assert bringup.file_rule_problems(text) == []
    assert text.splitlines()[:2] == list(bringup.HEADER_LINES)
    before, after = SUBMISSION_TEXT.split("\n"), text.split("\n")
    assert len(before) == len(after)
    changed = [i for i, (a, b) in enumerate(zip(before, after)) if a != b]
    default = submission.DEFAULT_KERNEL_VARIANT
    if name == default:
        assert changed == []
    else:
        assert len(changed) == 1
        assert before[changed[0]] == bringup.default_line("b200", default)
        assert after[changed[0]] == bringup.default_line("b200", name)
    assert "wrote" in capsys.readouterr().out


def test_exported_copies_import_with_their_default(tmp_path):
    # Each copy imported as a module of its own from a temporary directory, the project on sys.path, no
    # NVFP4_* variant in the environment.
    for name in EXPORT_VARIANTS:
        _export(tmp_path, name)
    probe = textwrap.dedent(f"""
        import importlib, json, sys
        sys.path[:0] = [{str(tmp_path)!r}, {str(ROOT)!r}]
        found = {{}}
        for name in {EXPORT_VARIANTS!r}:
            module = importlib.import_module("sub_" + name)
            found[name] = [module.KERNEL_VARIANT, module.__file__]
        print(json.dumps(found))
    """)
    proc = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=_clean_env(), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    for name in EXPORT_VARIANTS:
        kernel_variant, path = found[name]
        assert path.startswith(str(tmp_path)) and kernel_variant == name


@pytest.mark.parametrize("name", ["sm90_auto", "sm90_tile128"])
def test_export_refuses_a_hopper_variant_naming_its_file(tmp_path, capsys, name):
    # The leaderboard file holds the B200 kernels only: a Hopper default cannot be exported into it.
    assert name in submission_sm90.SM90_VARIANTS
    out = tmp_path / "sub.py"
    assert bringup.export_main(["--variant", name, "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Hopper variant" in err[0] and "submission_sm90.py" in err[0]
    assert not out.exists()


def test_export_cli_rejects_an_unknown_variant_in_one_line(tmp_path):
    out = tmp_path / "sub.py"
    proc = subprocess.run([sys.executable, str(ROOT / "eval.py"), "export", "--variant", "persistent_n512",
                           "-o", str(out)], cwd=ROOT, env=_clean_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "unknown variant 'persistent_n512'" in lines[0] and "persistent_n128" in lines[0]
    assert "sm90_auto" not in lines[0]  # the leaderboard file's variants only
    assert not out.exists()


def test_export_usage_mistake_is_one_line(capsys):
    assert bringup.export_main(["--variant", "seed"]) == 2  # no -o
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("eval.py export:")


@pytest.mark.parametrize("damage,match", [
    (lambda t, line: t.replace(line + "\n", ""), "found 0 assigning it"),
    (lambda t, line: t.replace(line, line + "\n" + line), "found 2 assigning it, 2 of that form"),
    (lambda t, line: t.replace(line, line.replace("rewrites this line", "rewrites it")), "found 1 assigning it, 0 of"),
    (lambda t, line: t.replace(line, line + "\nDEFAULT_KERNEL_VARIANT = 'seed'"), "found 2 assigning it, 1 of"),
])
def test_export_needs_the_marked_line_exactly_once(damage, match):
    line = bringup.default_line("b200", submission.DEFAULT_KERNEL_VARIANT)
    assert SUBMISSION_TEXT.count(line) == 1
    text = damage(SUBMISSION_TEXT, line)
    with pytest.raises(bringup.ExportError, match=match):
        bringup.export_text(text, "seed", submission.KERNEL_VARIANTS, submission_sm90.SM90_VARIANTS)


def test_export_refuses_a_copy_that_breaks_the_file_rules():
    text = SUBMISSION_TEXT + "\n# S" + "tream\n"
    with pytest.raises(bringup.ExportError, match="file rules: forbidden_word"):
        bringup.export_text(text, "seed", submission.KERNEL_VARIANTS, submission_sm90.SM90_VARIANTS)


# ---------------------------------------------------------------------------------------------------------
# The Hopper variant choice in submission.py
# ---------------------------------------------------------------------------------------------------------
def test_sm90_variant_forces_the_hopper_tile(monkeypatch):
    monkeypatch.setattr(submission, "_target_arch", lambda device: "sm_90a")
    monkeypatch.setattr(submission, "_device_sm_count", lambda index: 132)
    monkeypatch.setattr(submission_sm90, "SM90_VARIANT", submission_sm90.SM90_VARIANT)  # restored after the test
    device = torch.device("cuda", 0)
    data = (None, None, None, [(128, 4096, 1536, 1)])
    assert submission_sm90.SM90_VARIANTS == ("sm90_auto", *submission_sm90.SM90_VARIANT_CONFIGS)
    assert {"sm90_tile128", "sm90_a16_mexact"} <= set(submission_sm90.SM90_VARIANTS)
    submission_sm90.set_sm90_variant("sm90_auto")
    auto = submission.kernel_config(data, device)
    assert auto.tile_mn == submission_sm90.choose_sm90_config(data[3], 132).tile_mn
    for name, config in submission_sm90.SM90_VARIANT_CONFIGS.items():
        submission_sm90.set_sm90_variant(name)
        assert submission.kernel_config(data, device).tile_mn == config.tile_mn
    # The B200 choice is unaffected.
    monkeypatch.setattr(submission, "_target_arch", lambda device: "sm_100a")
    monkeypatch.setattr(submission, "KERNEL_VARIANT", "persistent_n256")
    assert submission.kernel_config(data, device) is submission.SM100_TILE_N256


def test_set_sm90_variant_rejects_bad_names(monkeypatch):
    monkeypatch.setattr(submission_sm90, "SM90_VARIANT", submission_sm90.SM90_VARIANT)
    with pytest.raises(ValueError, match="sm90_tile512"):
        submission_sm90.set_sm90_variant("sm90_tile512")
    with pytest.raises(TypeError):
        submission_sm90.set_sm90_variant(128)
    with pytest.raises(ValueError):
        submission_sm90.set_sm90_variant("persistent")  # a B200 variant is not a Hopper one


def test_sm90_variant_from_the_environment_at_import():
    probe = "import submission, submission_sm90; print(submission_sm90.SM90_VARIANT, submission.KERNEL_VARIANT)"
    procs = {}
    for value in ("sm90_tile128", "bogus"):
        env = dict(_clean_env(), NVFP4_SM90_VARIANT=value)
        procs[value] = subprocess.Popen([sys.executable, "-c", probe], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True)
    results = {value: (proc.wait(timeout=600), *proc.communicate()) for value, proc in procs.items()}
    code, out, err = results["sm90_tile128"]
    assert code == 0, err[-3000:]
    assert out.split() == ["sm90_tile128", submission.DEFAULT_KERNEL_VARIANT]
    code, out, err = results["bogus"]
    assert code != 0 and "NVFP4_SM90_VARIANT='bogus'" in err


def test_set_sm90_variant_forgets_the_prepared_calls(monkeypatch):
    # The prepared-call key holds the B200 settings only: set_sm90_variant drops every prepared call, so a
    # call prepared under one Hopper variant is never reused under another (its config differs).
    monkeypatch.setattr(submission_sm90, "SM90_VARIANT", "sm90_auto")
    monkeypatch.setattr(submission, "_prepared_calls", {})
    monkeypatch.setattr(submission, "_check_input", lambda data: ("", None))
    monkeypatch.setattr(submission, "_check_device", lambda device: None)
    monkeypatch.setattr(submission, "_target_arch", lambda device: "sm_90a")
    monkeypatch.setattr(submission, "kernel_config", lambda data, device: submission_sm90.SM90_VARIANT)
    monkeypatch.setattr(submission, "compiled_gemm", lambda groups, arch, config: ("kernel", config))
    monkeypatch.setattr(submission, "launch_metadata", lambda data, device, config, pointers: None)
    launches = []
    monkeypatch.setattr(submission, "make_call_launcher",
                        lambda groups, arch, config, kernel, metadata: lambda: launches.append(kernel[1]))
    data = tuple(reference.generate_input(m=(64,), n=(128,), k=(256,), g=1, seed=1))
    data = (tuple(data[0]), tuple(data[1]), tuple(data[2]), tuple(data[3]))
    submission.custom_kernel(data)
    assert submission._prepared_call(data) is not None
    submission_sm90.set_sm90_variant("sm90_tile128")
    assert submission._prepared_call(data) is None
    submission.custom_kernel(data)
    submission_sm90.set_sm90_variant("sm90_auto")
    assert submission._prepared_call(data) is None
    submission.custom_kernel(data)
    assert launches == ["sm90_auto", "sm90_tile128", "sm90_auto"]
    assert len(submission._prepared_calls) == 1


def test_sm90_overrides_reach_every_hopper_build_and_key(monkeypatch):
    monkeypatch.setattr(submission, "_target_arch", lambda device: "sm_90a")
    monkeypatch.setattr(submission, "_device_sm_count", lambda index: 132)
    monkeypatch.setattr(submission_sm90, "SM90_VARIANT", "sm90_auto")
    monkeypatch.setattr(submission_sm90, "SM90_OVERRIDES", {})
    device = torch.device("cuda", 0)
    data = (None, None, None, [(128, 4096, 1536, 1)])
    off = submission.kernel_config(data, device)
    for fields in [dict(num_stages=8), dict(a16_buffers=2), dict(num_stages=8, a16_buffers=2)]:
        submission_sm90.set_sm90_overrides(**fields)
        on = submission.kernel_config(data, device)
        assert on == dataclasses.replace(off, **fields)
        assert submission_sm90.BACKEND.compile_config("sm90_a16_pairs") == dataclasses.replace(
            submission_sm90.SM90_VARIANT_CONFIGS["sm90_a16_pairs"], **fields)
        # its own compiled kernel: the fields are part of the compile key
        assert submission.compile_key(8, "sm_90a", on) != submission.compile_key(8, "sm_90a", off)
    submission_sm90.set_sm90_overrides()
    assert submission.kernel_config(data, device) == off
    # a combination the chosen build cannot take is Sm90GemmConfig's own error, when that build is chosen
    submission_sm90.set_sm90_overrides(consumer_pairs=2)
    with pytest.raises(ValueError, match="consumer_pairs=2"):
        submission.kernel_config(data, device)


def test_set_sm90_overrides_rejects_bad_fields_and_forgets_the_prepared_calls(monkeypatch):
    monkeypatch.setattr(submission_sm90, "SM90_OVERRIDES", {})
    monkeypatch.setattr(submission, "_prepared_calls", {"stand-in": None})
    with pytest.raises(ValueError, match="'bogus' is not a field it sets"):
        submission_sm90.set_sm90_overrides(bogus=True)
    with pytest.raises(ValueError, match="'use_pdl' is not a field it sets"):  # set_pdl's
        submission_sm90.set_sm90_overrides(use_pdl=False)
    with pytest.raises(TypeError, match="split_k takes a bool, not 1"):
        submission_sm90.set_sm90_overrides(split_k=1)
    with pytest.raises(TypeError, match="num_stages takes a int, not True"):
        submission_sm90.set_sm90_overrides(num_stages=True)
    assert submission_sm90.SM90_OVERRIDES == {} and submission._prepared_calls  # nothing changed
    submission_sm90.set_sm90_overrides(split_k=False)
    assert submission_sm90.SM90_OVERRIDES == {"split_k": False}
    assert submission._prepared_calls == {}  # a prepared call holds the launch of the previous setting


# ---------------------------------------------------------------------------------------------------------
# bringup: cases
# ---------------------------------------------------------------------------------------------------------
def _tests():
    return ev.load_cases(str(ROOT / "task.yml"), "tests")


def test_cases_are_task_tests_then_edge_cases_then_accepted_m0():
    cases = bringup.build_cases(_tests(), lambda args: False)
    labels = [c["label"] for c in cases]
    assert labels == [f"test{i}" for i in range(1, 11)] + list(bringup.EDGE_CASES)
    with_m0 = bringup.build_cases(_tests(), lambda args: args["m"] != (0, 0))
    assert [c["label"] for c in with_m0][len(labels):] == ["m0_some", "m0_first_last"]
    assert all(c["kind"] == "m0" for c in with_m0[len(labels):])
    json.dumps(with_m0)  # plain data, for the JSON report


def test_edge_cases_cover_what_the_brief_asks_and_are_valid_inputs():
    ms = [m for args in bringup.EDGE_CASES.values() for m in args["m"]]
    assert 1 in ms and any(m % 8 for m in ms) and any(m > 256 for m in ms)
    assert any(set(args["k"]) == {256} for args in bringup.EDGE_CASES.values())
    assert any(args["g"] >= 16 for args in bringup.EDGE_CASES.values())
    assert any(set(args["n"]) == {128} for args in bringup.EDGE_CASES.values())
    for name, args in bringup.EDGE_CASES.items():
        assert all(len(args[key]) == args["g"] for key in ("m", "n", "k")), name
        # Every layout and size check passes on the CPU; only "not a CUDA device" is left.
        ok, reason = submission.can_implement(bringup.cpu_input(reference, args))
        assert not ok and "group" not in reason and "cuda" in reason.lower(), (name, reason)
    # The forced 256-wide tiles still get most of them.
    runnable = [n for n, a in bringup.EDGE_CASES.items() if bringup.not_applicable(a, 256) is None]
    assert len(runnable) >= 6 and {"m1", "m_odd_n256", "m_many_tiles", "g16"} <= set(runnable)


def test_m0_groups_are_detected_through_can_implement():
    device_reason = "the tensors are on cpu: the kernel needs every tensor it reads on one CUDA device"

    def fake(accepts):
        def can_implement(data):
            for i, size in enumerate(data[3]):
                if size[0] == 0 and not accepts:
                    return False, f"group {i} (m, n, k, l) = {tuple(size)}: M must be at least 1"
            return False, device_reason
        return types.SimpleNamespace(can_implement=can_implement)

    for args in bringup.M0_CASES.values():
        assert bringup.m0_accepted(fake(True), reference, args) is True
        assert bringup.m0_accepted(fake(False), reference, args) is False
        # The real submission answers either way without raising (another change may add M = 0).
        assert bringup.m0_accepted(submission, reference, args) in (True, False)
    ok_sub = types.SimpleNamespace(can_implement=lambda data: (True, ""))
    assert bringup.m0_accepted(ok_sub, reference, bringup.M0_CASES["m0_some"])


def test_forced_tiles_skip_what_they_never_run():
    assert bringup.not_applicable({"n": (256, 512)}, 256) is None
    assert "N % 256" in bringup.not_applicable({"n": (256, 128)}, 256)
    assert bringup.not_applicable({"n": (128,)}, None) is None


# ---------------------------------------------------------------------------------------------------------
# bringup: worker processes
# ---------------------------------------------------------------------------------------------------------
def test_worker_answers_errors_crashes_and_hangs(tmp_path):
    log = str(tmp_path / "worker.log")
    worker = bringup.Worker({"NVFP4_BRINGUP_PROBE": "yes"}, log)
    try:
        assert worker.call("operator:add", (2, 3), 120) == ("ok", 5)
        assert worker.call("os:getenv", ("NVFP4_BRINGUP_PROBE",), 30) == ("ok", "yes")  # env set in the worker
        kind, message = worker.call("builtins:int", ("x",), 30)
        assert kind == "error" and message.startswith("ValueError: invalid literal")
        assert worker.call("operator:mul", (3, 4), 30) == ("ok", 12)  # still alive after an error
        kind, message = worker.call("time:sleep", (60,), 1)
        assert kind == "timeout" and "1 s" in message and not worker.process.is_alive()
    finally:
        worker.kill()
    crashed = bringup.Worker({}, log)
    kind, message = crashed.call("os:abort", (), 120)
    assert kind == "crash" and "SIGABRT" in message and "Fatal Python error" in message
    assert "ValueError" not in message  # only this worker's part of the shared log
    exited = bringup.Worker({}, log)
    kind, message = exited.call("os:_exit", (3,), 120)
    assert kind == "crash" and "exit status 3" in message
    done = bringup.Worker({}, None)
    assert done.call("operator:neg", (1,), 120) == ("ok", -1)
    done.close()
    assert done.process.exitcode == 0


def test_workers_start_and_answer_from_several_threads_at_once(tmp_path):
    # run_variants starts and calls its shards' workers from a thread each
    import concurrent.futures

    def one(i):
        worker = bringup.Worker({"NVFP4_BRINGUP_PROBE": str(i)}, str(tmp_path / f"w{i}.log"))
        try:
            return worker.call("os:getenv", ("NVFP4_BRINGUP_PROBE",), 120), worker.call("operator:mul", (i, 3), 60)
        finally:
            worker.close()

    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        answers = list(pool.map(one, range(4)))
    assert answers == [(("ok", str(i)), ("ok", 3 * i)) for i in range(4)]


# ---------------------------------------------------------------------------------------------------------
# bringup: the jobs, in this process on stand-in kernels (the CPU reference, wrong ones)
# ---------------------------------------------------------------------------------------------------------
class _FakeEvent:
    clock_ms = 0.0

    def __init__(self, enable_timing=False):
        self.at = None

    def record(self):
        _FakeEvent.clock_ms += 0.3
        self.at = _FakeEvent.clock_ms

    def elapsed_time(self, other):
        return other.at - self.at


@pytest.fixture
def stand_in(monkeypatch):
    """Installs a stand-in `submission` module whose custom_kernel is the given function; no CUDA calls."""
    import utils

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(utils, "clear_l2_cache_large", lambda: None)

    def install(kernel):
        monkeypatch.setitem(sys.modules, "submission", types.SimpleNamespace(custom_kernel=kernel))

    return install


ARGS = dict(m=[40, 129], n=[128, 256], k=[256, 512], g=2, seed=5)


def _poison_checking_reference(calls: list):
    """A stand-in kernel: records each input's id in `calls`, requires every output poisoned (NaN) before the
    call, and answers with the reference."""
    def kernel(data):
        calls.append(id(data))
        assert all(torch.isnan(c).all() for _, _, c in data[0])
        return reference.ref_kernel(data)

    return kernel


def test_job_check_passes_the_reference(stand_in):
    calls = []
    stand_in(_poison_checking_reference(calls))  # poisoned before each call
    result = bringup.job_check(ARGS)
    assert result["status"] == "pass" and result["max_abs_err"] == 0.0 and result["unwritten"] == 0
    assert len(calls) == 2 and calls[0] == calls[1]  # the second call gets the very same input object


def test_job_check_sees_unwritten_and_wrong_elements(stand_in):
    def skips_a_row(data):
        out = reference.ref_kernel(data)
        out[1][5].fill_(float("nan"))  # as if row 5 of group 1 were never written
        return out

    stand_in(skips_a_row)
    result = bringup.job_check(ARGS)
    assert result["status"] == "fail" and result["unwritten"] == 256 and result["max_abs_err"] == math.inf
    assert result["error"].startswith("first call: mismatch")

    def off_once(data, calls=[]):
        out = reference.ref_kernel(data)
        calls.append(1)
        if len(calls) == 2:
            out[0][0, 0] += 1.0
        return out

    stand_in(off_once)
    result = bringup.job_check(ARGS)
    assert result["status"] == "fail" and result["error"].startswith("repeated call") and result["max_abs_err"] >= 0.5

    def raises(data):
        raise ValueError("group 1 (m, n, k, l) = (129, 256, 512, 1): no\nsecond line")

    stand_in(raises)
    result = bringup.job_check(ARGS)
    assert result["status"] == "error" and result["error"] == "first call: ValueError: group 1 (m, n, k, l) = " \
                                                               "(129, 256, 512, 1): no"
    assert "cuda_ok" in result


def test_job_benchmark_uses_the_runners_method(stand_in):
    stand_in(reference.ref_kernel)
    case = ev.TestCase(args=dict(m=(64,), n=(128,), k=(256,), g=1, seed=3), spec="x")
    result = bringup.job_benchmark(case, 4, 10e9)
    assert result["status"] == "ok" and result["runs"] in (3, 4)  # the runner's stop rule may end it at 3
    assert result["mean_us"] == pytest.approx(300.0 / 15)  # 0.3 ms between the fake events, 15 calls

    def wrong(data):
        return [c.zero_() for _, _, c in data[0]]

    stand_in(wrong)
    result = bringup.job_benchmark(case, 4, 10e9)
    assert result["status"] == "fail" and "mismatch" in result["error"]


def test_gpu_jobs_give_back_their_gpu_memory(stand_in, monkeypatch):
    # Regression: torch's cache and the submission's prepared calls (each keeps its input set alive) kept a
    # job's memory in its worker while the other workers ran (H200 and 80 GB bring-up). Each GPU job gives it
    # back, pass or fail.
    released = []
    monkeypatch.setattr(bringup, "_release_gpu_memory", lambda: released.append(True))
    stand_in(reference.ref_kernel)
    case = ev.TestCase(args=dict(m=(64,), n=(128,), k=(256,), g=1, seed=3), spec="x")
    bringup.job_benchmark(case, 4, 10e9)
    bringup.job_check(ARGS)
    bringup.job_pattern(ARGS, 1)
    monkeypatch.setattr(bringup.harness, "_run_single_benchmark", lambda *a: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        bringup.job_benchmark(case, 4, 10e9)
    assert released == [True] * 4


def test_release_gpu_memory_drops_the_prepared_calls(monkeypatch):
    forgotten = []
    stand_in = types.SimpleNamespace(forget_prepared_calls=lambda: forgotten.append(1))
    monkeypatch.setitem(sys.modules, "submission", stand_in)
    bringup._release_gpu_memory()
    assert forgotten == [1]


def test_a_flush_beside_too_little_free_memory_is_sized_down_not_an_error(monkeypatch):
    # Regression: on an 80 GB card with 22.3 GiB free, clear_l2_cache_large raised "too little for a 1 GiB
    # flush beside 24 GiB of headroom" inside job_benchmark, and bring-up marked the variant ERROR.
    # (stand_in without its flush stand-in: the real flush, on a fake card.)
    import utils

    real_empty = torch.empty
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setitem(sys.modules, "submission", types.SimpleNamespace(custom_kernel=reference.ref_kernel))
    allocated = []

    def empty(*args, device=None, **kwargs):
        if device == "cuda":  # the flush tensor: its size noted, a small CPU tensor in its place
            allocated.append(args[0])
            return real_empty(4)
        return real_empty(*args, device=device, **kwargs)

    monkeypatch.setattr(utils, "_L2_FLUSH_BUFFER", [])
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *device: (int(22.3 * 2**30), 80 * 2**30))
    monkeypatch.setattr(torch, "empty", empty)
    case = ev.TestCase(args=dict(m=(64,), n=(128,), k=(256,), g=1, seed=3), spec="x")
    result = bringup.job_benchmark(case, 4, 10e9)
    assert result["status"] == "ok" and allocated == [int(22.3 * 2**30) // 2 // 4]


# ---------------------------------------------------------------------------------------------------------
# bringup: one variant's driver, on fake workers
# ---------------------------------------------------------------------------------------------------------
class FakeWorker:
    """Answers by script: outcome per case seed ("pass", "fail", "crash", "timeout", "cuda_gone"), benchmark
    means per label."""

    def __init__(self, script, variant):
        self.script, self.variant, self.alive = script, variant, True
        self.built = []  # the kernel group counts of each job_build's problems
        self.jobs = []  # (job, args) of every call, in order

    def call(self, job, args, timeout):
        assert self.alive
        self.jobs.append((job, args))
        if job == "bringup:job_hello":
            return "ok", dict(kernel_variant=self.variant, launch_path="tvm_ffi")
        if job == "bringup:job_build":
            self.built.append(tuple(bringup.kernel_groups(args) for args in args[0]))
            return "ok", dict(status="ok", kernels=2, seconds=0.1)
        if job == "bringup:job_check":
            what = self.script.get(args[0]["seed"], "pass")
            if what in ("crash", "timeout"):
                self.alive = False
                return what, f"worker {what}"
            if what == "cuda_gone":
                return "ok", dict(status="error", error="first call: CUDA error: an illegal memory access",
                                  cuda_ok=False)
            return "ok", dict(status=what, max_abs_err=0.0 if what == "pass" else 3.0, seconds=0.1)
        if job == "bringup:job_benchmark":
            case, repeats, _ = args
            return "ok", dict(status="ok", mean_us=float(case.args["seed"]), err_us=0.1, runs=repeats)
        raise AssertionError(job)

    def kill(self):
        self.alive = False

    def close(self):
        self.alive = False

    def log_tail(self, lines=20):
        return ["last words"]


def _plan(name="persistent", tile_n=None):
    return dict(name=name, env={"NVFP4_KERNEL_VARIANT": name}, selected=("kernel_variant", name), tile_n=tile_n)


def _fake_cases(count):
    """Cases c0, c1, ...: the odd ones have N = 128 (never run by a forced 256-wide tile)."""
    return [dict(label=f"c{i}", kind="edge", args=dict(m=[64], n=[128 if i % 2 else 256], k=[256], g=1, seed=i),
                 spec="") for i in range(count)]


def _fake_benchmarks(means=(20.0, 10.0)):
    return [bringup.Benchmark(f"bench{i + 1}", ev.TestCase(args=dict(m=(64,), n=(128,), k=(256,), g=1, seed=m),
                                                         spec="")) for i, m in enumerate(means)]


def _driver(script, name="persistent", **plan):
    workers = []

    def start(env, log):
        workers.append(FakeWorker(script, name))
        return workers[-1]

    lines = []
    result = bringup.run_variant(_plan(name, **plan), _fake_cases(6), _fake_benchmarks(),
                                 bringup.Limits(max_repeats=7), start_worker=start, log=lines.append)
    return result, workers, lines


def test_driver_all_pass_then_benchmarks_in_a_fresh_worker():
    result, workers, lines = _driver({})
    # one worker builds and tests; after it has exited, a fresh one builds the benchmarks' kernels and times
    assert len(workers) == 2 and not any(w.alive for w in workers)
    tested, timed = ([job for job, _ in w.jobs] for w in workers)
    assert "bringup:job_benchmark" not in tested and "bringup:job_check" not in timed
    assert timed == ["bringup:job_hello", "bringup:job_build"] + ["bringup:job_benchmark"] * 3  # warm-up, 2
    assert [c["status"] for c in result["cases"].values()] == ["pass"] * 6
    assert {k: b["mean_us"] for k, b in result["benchmarks"].items()} == {"bench1": 20.0, "bench2": 10.0}
    assert result["benchmarks"]["bench1"]["runs"] == 7
    assert result["worker"]["launch_path"] == "tvm_ffi"
    assert bringup.verdict(result) == ("pass", "")
    assert any("c3" in line for line in lines)


def test_driver_replaces_lost_workers_and_skips_timing_after_a_failure():
    result, workers, _ = _driver({1: "crash", 3: "cuda_gone", 4: "fail"})
    statuses = [c["status"] for c in result["cases"].values()]
    assert statuses == ["pass", "crash", "pass", "error", "fail", "pass"]
    assert len(workers) == 3 and result["losses"] == 2  # a fresh worker after the crash and after the lost context
    assert result["cases"]["c1"]["log_tail"] == ["last words"]
    assert all(b["status"] == "not run" for b in result["benchmarks"].values())
    state, why = bringup.verdict(result)
    assert state == "fail" and why.startswith("c1: crash: worker crash") and "2 more" in why


def test_driver_abandons_a_variant_after_too_many_lost_workers():
    result, workers, _ = _driver({0: "timeout", 1: "crash", 2: "timeout"})
    assert [c["status"] for c in result["cases"].values()] == ["timeout", "crash", "timeout"] + ["not run"] * 3
    assert len(workers) == 3


def test_driver_marks_cases_a_forced_tile_never_runs():
    result, workers, _ = _driver({}, name="persistent_n256", tile_n=256)
    statuses = {k: c["status"] for k, c in result["cases"].items()}
    assert statuses == {"c0": "pass", "c1": "n/a", "c2": "pass", "c3": "n/a", "c4": "pass", "c5": "n/a"}
    assert result["benchmarks"]["bench2"]["status"] == "ok"  # still timed, for the table
    assert bringup.verdict(result)[0] == "partial"


def test_driver_refuses_a_worker_on_another_variant():
    def start(env, log):
        return FakeWorker({}, "seed")

    result = bringup.run_variant(_plan("persistent"), _fake_cases(3), _fake_benchmarks(), bringup.Limits(),
                                 start_worker=start, log=lambda line: None)
    # found at the first call into a worker, the build: nothing else is run
    assert result["builds"]["g=1"]["status"] == "error"
    assert "kernel_variant='seed', not 'persistent'" in result["builds"]["g=1"]["error"]
    assert [c["status"] for c in result["cases"].values()] == ["not run"] * 3
    state, why = bringup.verdict(result)
    assert state == "fail" and why.startswith("build g=1: error: the worker runs kernel_variant='seed'"), why


# ---------------------------------------------------------------------------------------------------------
# bringup: building first, in parallel worker processes, then testing and timing
# ---------------------------------------------------------------------------------------------------------
def test_build_units_are_the_kernel_group_counts_of_what_a_variant_runs():
    cases = [dict(label="a", args=dict(m=[0, 64], n=[128, 256], k=[256, 256], g=2, seed=1)),  # one group built
             dict(label="b", args=dict(m=[8, 8], n=[128, 128], k=[256, 256], g=2, seed=2)),
             dict(label="c", args=dict(m=[0, 0], n=[256, 256], k=[256, 256], g=2, seed=3)),  # nothing built
             dict(label="d", args=dict(m=[8], n=[256], k=[256], g=1, seed=4))]
    benchmarks = _fake_benchmarks((5.0,))
    units = bringup.build_units(cases, benchmarks, None)
    assert list(units) == [1, 2] and [a["seed"] for a in units[1]] == [1, 4, 5] and len(units[2]) == 1
    # a forced 256-wide tile never runs a or b (an N of 128): nothing is built for them
    assert bringup.build_units(cases, [], 256) == {1: [cases[3]["args"]]}


def test_default_jobs_is_one_per_core_within_the_units_and_memory():
    gib = 2**30
    assert bringup.default_jobs(40, cpus=16, memory=None) == 16
    assert bringup.default_jobs(5, cpus=16, memory=None) == 5
    assert bringup.default_jobs(500, cpus=256, memory=None) == bringup.MAX_JOBS
    assert bringup.default_jobs(40, cpus=16, memory=3 * bringup.WORKER_MEMORY_BYTES + gib) == 3
    assert bringup.default_jobs(40, cpus=16, memory=0) == 1
    assert 1 <= bringup.default_jobs(40) <= os.cpu_count()


def test_default_jobs_is_capped_by_the_gpus_free_memory(monkeypatch):
    # Regression: one worker per core (16) checked and ran the pattern at once on an 80 GB card.
    gib = 2**30
    per_worker = bringup.WORKER_GPU_MEMORY_BYTES
    assert bringup.default_jobs(40, cpus=16, memory=None, gpu_memory=None) == 16
    assert bringup.default_jobs(40, cpus=16, memory=None, gpu_memory=3 * per_worker + gib) == 3
    assert bringup.default_jobs(40, cpus=16, memory=None, gpu_memory=79 * gib) == 79 * gib // per_worker < 16
    assert bringup.default_jobs(40, cpus=16, memory=None, gpu_memory=0) == 1
    # by default, the GPU's free memory as torch reports it
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *device: (2 * per_worker + gib, 80 * gib))
    assert bringup.default_jobs(40, cpus=16, memory=None) == 2


def test_worker_gpu_budget_holds_the_pattern_of_the_largest_benchmark():
    # WORKER_GPU_MEMORY_BYTES's NOTES: a context (~1 GiB) and job_pattern's 15 input sets with their 15 expected
    # copies of task.yml's largest benchmark. harness.case_work's bytes are an input set's GPU tensors (A, B,
    # C, the reordered scales; the plain scales stay on the CPU), checked here on the smallest benchmark.
    benchmarks = ev.load_cases(str(ROOT / "task.yml"), "benchmarks")
    smallest = min(benchmarks, key=lambda case: harness.case_work(case.args)[1])
    data = bringup.cpu_input(reference, smallest.args)
    on_gpu = sum(x.nbytes for group in data[0] + data[2] for x in group)
    assert on_gpu == pytest.approx(harness.case_work(smallest.args)[1], rel=0.01)
    largest = max(harness.case_work(case.args)[1] for case in benchmarks)
    assert 2**30 + 2 * harness.NUM_ITERATIONS_PER_BENCHMARK * largest * 1.15 <= bringup.WORKER_GPU_MEMORY_BYTES


def test_shards_split_the_units_over_the_jobs():
    units = {"a": {g: [{}] * 3 for g in (1, 2, 3, 4, 6, 8, 16)}, "b": {1: [{}], 2: [{}]}, "c": {4: [{}]}}
    shards = bringup.plan_shards(units, 8)
    assert len(shards) == 8
    per_variant = {name: [s for s in shards if s.variant == name] for name in units}
    assert [len(v) for v in per_variant.values()] == [5, 2, 1]  # the most units per shard gets the next one
    for name, mine in per_variant.items():  # every unit in exactly one shard of its variant
        assert sorted(g for s in mine for g in s.groups) == sorted(units[name])
        assert [s.index for s in mine] == list(range(len(mine)))
    assert [s.variant for s in shards[:3]] == ["a", "b", "c"]  # in rounds: every variant starts early
    # fewer jobs than variants: one shard each, run a few at a time; more jobs than units: one unit each
    assert [len(s.groups) for s in bringup.plan_shards(units, 1)] == [7, 2, 1]
    assert len(bringup.plan_shards(units, 64)) == 10 and all(len(s.groups) == 1 for s in bringup.plan_shards(units, 64))


def test_progress_counts_and_estimates_the_time_left():
    now = [100.0]
    progress = bringup.Progress("build", 12, clock=lambda: now[0])
    progress.begin()
    now[0] += 30.0
    assert progress.tick() == "[build 1/12, ~330 s left]"
    now[0] += 10.0
    assert progress.tick() == "[build 2/12, ~200 s left]"
    for _ in range(9):
        progress.tick()
    assert progress.tick() == "[build 12/12, ~0 s left]"


class ConcurrentWorker(FakeWorker):
    """A FakeWorker whose builds take a moment, counting how many workers build at once."""

    active = 0
    most = 0
    lock = threading.Lock()

    def call(self, job, args, timeout):
        if job != "bringup:job_build":
            return super().call(job, args, timeout)
        with ConcurrentWorker.lock:
            ConcurrentWorker.active += 1
            ConcurrentWorker.most = max(ConcurrentWorker.most, ConcurrentWorker.active)
        time.sleep(0.05)
        with ConcurrentWorker.lock:
            ConcurrentWorker.active -= 1
        return super().call(job, args, timeout)


def test_variants_build_in_parallel_workers_and_a_crash_costs_one_case():
    # 3 variants, cases with 1..4 groups; jobs=4: at most 4 workers build at once, more than one does
    cases = [dict(label=f"c{i}", kind="edge", args=dict(m=[64] * (1 + i % 4), n=[128 if i == 5 else 256] * (1 + i % 4),
                                                        k=[256] * (1 + i % 4), g=1 + i % 4, seed=i), spec="")
             for i in range(8)]
    workers = []
    lock = threading.Lock()

    def start(env, log):
        with lock:
            workers.append(ConcurrentWorker({3: "crash"} if env["NVFP4_KERNEL_VARIANT"] == "seed" else {},
                                            env["NVFP4_KERNEL_VARIANT"]))
            return workers[-1]

    plans = [_plan("persistent"), _plan("seed"), _plan("persistent_n256", tile_n=256)]
    ConcurrentWorker.most = 0
    lines = []
    results = bringup.run_variants(plans, cases, _fake_benchmarks(), bringup.Limits(max_repeats=7), jobs=4,
                                   start_worker=start, log=lines.append)
    assert 1 < ConcurrentWorker.most <= 4
    assert [c["status"] for c in results["persistent"]["cases"].values()] == ["pass"] * 8
    seed = results["seed"]
    assert [c["status"] for c in seed["cases"].values()] == ["pass"] * 3 + ["crash"] + ["pass"] * 4
    assert seed["losses"] == 1 and all(b["status"] == "not run" for b in seed["benchmarks"].values())
    assert results["persistent_n256"]["cases"]["c5"]["status"] == "n/a"
    assert list(results["persistent"]["cases"]) == [f"c{i}" for i in range(8)]  # in case order, not finish order
    assert {k: b["mean_us"] for k, b in results["persistent"]["benchmarks"].items()} == {"bench1": 20.0,
                                                                                         "bench2": 10.0}
    # every worker built before it checked anything; builds of each variant cover its group counts
    for worker in workers:
        assert all(len(set(groups)) == 1 for groups in worker.built)
    testers = [w for w in workers if any(job == "bringup:job_check" for job, _ in w.jobs)]
    built = {name: sorted(g for w in testers if w.variant == name for groups in w.built for g in set(groups))
             for name in ("persistent", "seed")}
    assert built == {"persistent": [1, 2, 3, 4], "seed": [1, 2, 3, 4]}
    # the timing workers, one per variant timed, built the benchmarks' group count only
    timers = [w for w in workers if w not in testers]
    assert sorted(w.variant for w in timers) == ["persistent", "persistent_n256"]
    assert all(w.built == [(1, 1)] for w in timers)
    assert sum(1 for line in lines if line.startswith("[build ")) == sum(len(r["builds"]) for r in results.values())
    assert any(re.match(r"\[test 12/\d+, ~\d+ s left\] \[", line) for line in lines)
    assert sum(1 for line in lines if line.startswith("[bench ")) == 4  # two variants timed, two benchmarks each


def test_a_stopped_run_stops_every_worker():
    # an exception in one shard's thread (a bug; Ctrl-C in the main thread alike) ends the run: every worker
    # killed, no further call into any
    workers, checks = [], []
    lock = threading.Lock()

    class Buggy(FakeWorker):
        def call(self, job, args, timeout):
            if job == "bringup:job_check" and self.variant == "seed":
                raise RuntimeError("a bug in the harness")
            if job == "bringup:job_check":
                checks.append(self.variant)
                time.sleep(0.02)
            return super().call(job, args, timeout)

    def start(env, log):
        with lock:
            workers.append(Buggy({}, env["NVFP4_KERNEL_VARIANT"]))
            return workers[-1]

    with pytest.raises(RuntimeError, match="a bug in the harness"):
        bringup.run_variants([_plan("persistent"), _plan("seed")], _fake_cases(40), _fake_benchmarks(),
                             bringup.Limits(), jobs=2, start_worker=start, log=lambda line: None)
    assert workers and not any(w.alive for w in workers)
    assert checks.count("persistent") < 40  # the other variant's cases stopped too


class LedgerWorker(FakeWorker):
    """A FakeWorker that keeps, in a ledger shared by all, the workers alive (started, not yet closed or
    killed), how many were alive beside it at each benchmark and at each call of a job in `oom`, and the
    variant of each benchmark. `oom`: (variant, case or benchmark seed) -> how many of its calls run out of
    GPU memory first."""

    def __init__(self, script, variant, ledger, oom=None):
        super().__init__(script, variant)
        self.ledger, self.oom = ledger, oom if oom is not None else {}
        with ledger["lock"]:
            ledger["alive"].add(self)

    def _beside(self) -> int:
        with self.ledger["lock"]:
            return len(self.ledger["alive"] - {self})

    def call(self, job, args, timeout):
        key = (args[0]["seed"] if job == "bringup:job_check" else
               args[0].args["seed"] if job == "bringup:job_benchmark" else None)
        if job == "bringup:job_benchmark":
            self.ledger["benchmarks"].append((self.variant, self._beside()))
        slot = (self.variant, key)
        if slot in self.oom:
            self.ledger["oom"].append((slot, self._beside()))
            if self.oom[slot]:
                self.oom[slot] -= 1
                self.jobs.append((job, args))
                status = "error" if job == "bringup:job_check" else "fail"
                return "ok", dict(status=status, error="OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 "
                                                       "GiB. GPU 0 has a total capacity of 79.19 GiB")
        return super().call(job, args, timeout)

    def close(self):
        super().close()
        with self.ledger["lock"]:
            self.ledger["alive"].discard(self)

    kill = close


def _ledger_run(plans, limits=None, oom=None, jobs=4):
    """run_variants on LedgerWorkers (cases with 1 and 2 groups, two benchmarks): (results, ledger, workers)."""
    ledger = dict(lock=threading.Lock(), alive=set(), benchmarks=[], oom=[])
    workers = []

    def start(env, log):
        with ledger["lock"]:
            workers.append(None)
        worker = LedgerWorker({}, env["NVFP4_KERNEL_VARIANT"], ledger, oom)
        with ledger["lock"]:
            workers[workers.index(None)] = worker
        return worker

    cases = [dict(label=f"c{i}", kind="edge", args=dict(m=[64] * (1 + i % 2), n=[256] * (1 + i % 2),
                                                        k=[256] * (1 + i % 2), g=1 + i % 2, seed=i), spec="")
             for i in range(6)]
    results = bringup.run_variants(plans, cases, _fake_benchmarks(), limits or bringup.Limits(), jobs=jobs,
                                   start_worker=start, log=lambda line: None)
    return results, ledger, workers


def test_timing_runs_alone_one_variant_at_a_time():
    # Regression: the workers that built a variant's benchmark kernels stayed alive, with their inputs,
    # caches and L2 flush tensors, while every later variant was timed on the same GPU (an 80 GB card ran
    # out of memory for the flush, and the timings were not eval.py benchmark's).
    plans = [_plan("persistent"), _plan("seed"), _plan("persistent_n128")]
    results, ledger, _ = _ledger_run(plans)
    assert [variant for variant, _ in ledger["benchmarks"]] == [p["name"] for p in plans for _ in range(3)]
    assert [beside for _, beside in ledger["benchmarks"]] == [0] * 9  # no other worker alive while timing
    assert not ledger["alive"] and all(r["benchmarks"]["bench2"]["status"] == "ok" for r in results.values())


def test_bringup_times_with_eval_benchmarks_method_and_limits(monkeypatch):
    # Regression: --quick timed at most 5 repeats without the warm-up, 4-14 % above eval.py benchmark on an
    # H100. Now bring-up's timing worker, --quick or not, runs harness._run_single_benchmark with exactly the
    # arguments eval.py benchmark's worker gets.
    class Pool:
        def __init__(self):
            self.calls = []

        def apply(self, function, args):
            self.calls.append((function, args[1:]))
            return harness.Stats(runs=3, mean=1e3, std=0.0, err=0.0, best=1e3, worst=1e3)

    pool, tests = Pool(), [bench.case for bench in _fake_benchmarks()]
    assert ev.human_benchmark(pool, tests, recheck=False) == 0
    assert all(function is harness._run_single_benchmark for function, _ in pool.calls)
    for limits in (bringup.Limits(), bringup.QUICK_LIMITS):
        _, _, workers = _ledger_run([_plan("persistent")], limits=limits)
        timed = [args for worker in workers for job, args in worker.jobs if job == "bringup:job_benchmark"]
        assert [case.spec for case, _, _ in timed] == [tests[0].spec] + [case.spec for case in tests]
        passed = []
        monkeypatch.setattr(harness, "_run_single_benchmark", lambda *args: passed.append(args[1:]) or "stop")
        for args in timed:
            bringup.job_benchmark(*args)
        assert passed == [args for _, args in pool.calls]


@pytest.mark.parametrize("times", [1, 9])
def test_a_check_out_of_gpu_memory_beside_other_workers_runs_again_alone(times):
    # A job that ran out of GPU memory while other workers ran is no verdict on the variant: it runs again
    # once they have all exited, and that outcome counts (still out of memory alone: then it is one).
    plans = [_plan("persistent"), _plan("seed")]
    results, ledger, _ = _ledger_run(plans, oom={("persistent", 3): times, ("seed", 3): times})
    for name in ("persistent", "seed"):
        case = results[name]["cases"]["c3"]
        tries = [beside for slot, beside in ledger["oom"] if slot == (name, 3)]
        assert case["alone"] is True and len(tries) == 2 and tries[-1] == 0  # the second: no other worker alive
        if times == 1:
            assert case["status"] == "pass" and bringup.verdict(results[name]) == ("pass", "")
            assert results[name]["benchmarks"]["bench1"]["status"] == "ok"
        else:
            assert case["status"] == "error" and "out of memory" in case["error"]
            assert bringup.verdict(results[name])[0] == "fail"


def test_a_benchmark_out_of_gpu_memory_runs_again_in_a_fresh_worker():
    # bench1 (seed 20) runs out of memory twice: as the warm-up, then as itself; in a fresh worker it runs
    results, _, workers = _ledger_run([_plan("persistent")], oom={("persistent", 20): 2})
    bench = results["persistent"]["benchmarks"]["bench1"]
    assert bench["status"] == "ok" and bench["fresh_worker"] is True
    timers = [w for w in workers if not any(job == "bringup:job_check" for job, _ in w.jobs)]
    assert len(timers) == 2  # the timing worker, and a fresh one after it ran out of memory
    assert results["persistent"]["benchmarks"]["bench2"]["status"] == "ok"
    assert bringup.verdict(results["persistent"]) == ("pass", "")


def test_out_of_memory_is_read_from_the_error_line():
    for error in ("first call: OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
                  "Encountered OutOfMemoryError: CUDA out of memory.", "batch 1: CUDA_ERROR_OUT_OF_MEMORY",
                  "RuntimeError: CUDA error: out of memory", "cudaErrorMemoryAllocation"):
        assert bringup.out_of_memory(dict(status="error", error=error)), error
    assert bringup.out_of_memory(dict(status="crash", error="worker process died (killed by SIGKILL)"))
    assert not bringup.out_of_memory(dict(status="crash", error="worker process died (killed by SIGSEGV)"))
    assert not bringup.out_of_memory(dict(status="fail", error="mismatch found! ..."))
    assert not bringup.out_of_memory(dict(status="pass", error="out of memory"))


def test_job_build_builds_each_problem_through_the_submission(monkeypatch):
    calls = []

    def build_kernels(sizes):
        calls.append(sizes)
        if sizes[0][1] == 999:
            raise RuntimeError("ptxas said no\nmore")
        return [("key", len(sizes))]

    monkeypatch.setattr(bringup, "build_kernels", build_kernels)
    problems = [dict(m=[0, 64], n=[128, 256], k=[256, 512], g=2, seed=1), dict(m=[8], n=[128], k=[256], g=1, seed=2)]
    result = bringup.job_build(problems)
    assert result["status"] == "ok" and result["kernels"] == 2
    assert calls == [[(0, 128, 256, 1), (64, 256, 512, 1)], [(8, 128, 256, 1)]]
    result = bringup.job_build([dict(m=[8], n=[999], k=[256], g=1, seed=3)])
    assert result["status"] == "error" and result["error"] == "g=1 m=[8] n=[999] k=[256]: RuntimeError: ptxas said no"


@pytest.mark.parametrize("arch,variant,module,attribute", [("sm_100a", "persistent", submission, "KERNEL_VARIANT"),
                                                           ("sm_100a", "seed", submission, "KERNEL_VARIANT"),
                                                           ("sm_90a", "sm90_auto", submission_sm90, "SM90_VARIANT")])
def test_build_kernels_compiles_what_custom_kernel_launches(monkeypatch, arch, variant, module, attribute):
    compiled = []
    monkeypatch.setattr(module, attribute, variant)
    monkeypatch.setattr(submission, "_compiled_kernels", {})
    monkeypatch.setattr(submission, "_compile", lambda key: compiled.append(key) or (lambda *args: None))
    monkeypatch.setattr(submission, "_check_device", lambda device: None)
    monkeypatch.setattr(submission, "_target_arch", lambda device: arch)
    monkeypatch.setattr(submission, "_device_sm_count", lambda index: 148 if arch == "sm_100a" else 132)
    sizes = [(0, 256, 256, 1), (200, 256, 1024, 1), (64, 4096, 7168, 1)]
    device = torch.device("cuda", 0)
    keys = bringup.build_kernels(sizes, device)
    config = submission.kernel_config((None, None, None, sizes), device)  # empty groups kept, as custom_kernel does
    expected = [submission.compile_key(3, arch, config, part) for part in submission.kernel_parts(config)]
    expected.append(submission.compile_key(3, arch, submission.TABLE_UPLOAD_CONFIG, "upload"))
    assert keys == expected and sorted(map(repr, compiled)) == sorted(map(repr, expected))
    assert bringup.build_kernels([(0, 256, 256, 1)], device) == []


# ---------------------------------------------------------------------------------------------------------
# bringup: recommendation and report on fabricated results
# ---------------------------------------------------------------------------------------------------------
def _result(statuses, means):
    return dict(cases={f"c{i}": dict(status=s, max_abs_err=0.0 if s == "pass" else 2.5,
                                     error=None if s == "pass" else "boom") for i, s in enumerate(statuses)},
                benchmarks={f"bench{i + 1}": (dict(status="ok", mean_us=m, err_us=0.05) if m else
                                              dict(status="not run", error="failed"))
                            for i, m in enumerate(means)},
                worker=dict(launch_path="tvm_ffi"))


LABELS = ["bench1", "bench2"]
FABRICATED = {
    "persistent": _result(["pass", "pass", "fail"], [None, None]),  # fastest on paper, but wrong
    "persistent_n64": _result(["pass", "pass", "pass"], [16.0, 9.0]),  # geomean 12
    "persistent_n128": _result(["pass", "pass", "pass"], [20.0, 5.0]),  # geomean 10: the recommendation
    "persistent_n256": _result(["pass", "n/a", "pass"], [8.0, 2.0]),  # faster still, but never runs c1
    "seed": _result(["pass", "crash", "not run"], [None, None]),
}


def test_recommendation_is_the_fastest_variant_that_passed_everything():
    rec = bringup.recommend(FABRICATED, LABELS, "b200", "persistent")
    assert rec["variant"] == "persistent_n128" and rec["geomean_us"] == pytest.approx(10.0)
    assert not rec["is_default"] and rec["default_verdict"] == "fail"
    assert rec["line_before"] == bringup.default_line("b200", "persistent")
    assert rec["line_after"] == ('DEFAULT_KERNEL_VARIANT = "persistent_n128"  '
                                 '# eval.py export --variant NAME rewrites this line')
    assert rec["export_command"] == "python eval.py export --variant persistent_n128 -o sub_persistent_n128.py"
    assert rec["submit_command"].endswith("--mode test sub_persistent_n128.py")
    # The line is the one export writes, and the one submission.py has for its default.
    exported = bringup.export_text(SUBMISSION_TEXT, "persistent_n128", submission.KERNEL_VARIANTS,
                                   submission_sm90.SM90_VARIANTS)
    assert rec["line_after"] in exported.split("\n")
    assert bringup.default_line("b200", submission.DEFAULT_KERNEL_VARIANT) in SUBMISSION_TEXT.split("\n")
    text = bringup.format_recommendation(rec)
    assert "recommendation: persistent_n128" in text and "10.00 µs" in text and "FAIL" in text
    assert f"- {rec['line_before']}" in text and f"+ {rec['line_after']}" in text and rec["export_command"] in text


def test_recommendation_when_the_default_wins_or_nothing_passes():
    rec = bringup.recommend({"persistent": _result(["pass"], [5.0, 5.0]), "seed": _result(["pass"], [9.0, 9.0])},
                            LABELS, "b200", "persistent")
    assert rec["variant"] == "persistent" and rec["is_default"]
    assert "already submission.py's default: no change" in bringup.format_recommendation(rec)
    rec = bringup.recommend({"persistent": _result(["fail"], [None, None])}, LABELS, "b200", "persistent")
    assert rec["variant"] is None and "no variant passed" in bringup.format_recommendation(rec)
    # A variant that passed every case but lost a benchmark is not recommended either.
    broken = _result(["pass"], [5.0, None])
    assert bringup.recommend({"persistent": broken}, LABELS, "b200", "persistent")["variant"] is None
    broken["benchmarks"]["bench2"] = dict(status="fail", error="mismatch found! ...")
    assert bringup.verdict(broken) == ("fail", "bench2: fail: mismatch found! ...")
    # Hopper: the Hopper default line.
    rec = bringup.recommend({"sm90_auto": _result(["pass"], [9.0, 9.0]), "sm90_tile128": _result(["pass"], [8.0, 9.0])},
                            LABELS, "sm90", "sm90_auto")
    assert rec["line_after"] == bringup.default_line("sm90", "sm90_tile128") and "submit_command" not in rec
    assert "Hopper tile choice" in bringup.format_recommendation(rec)


def test_report_tables():
    cases = [dict(label=f"c{i}", spec=f"g=1 m=[{i}]") for i in range(3)]
    benchmarks = [bringup.Benchmark(label, ev.TestCase(args=dict(m=(1,), n=(128,), k=(256,), g=1, seed=1), spec=""))
                  for label in LABELS]
    rec = bringup.recommend(FABRICATED, LABELS, "b200", "persistent")
    report = bringup.format_report(cases, benchmarks, FABRICATED, rec, bringup.Limits(max_repeats=5), "/tmp/logs")
    lines = report.splitlines()
    header = next(line for line in lines if line.startswith("case "))
    assert all(name in header for name in FABRICATED)
    row_c2 = next(line for line in lines if line.startswith("c2 "))
    assert row_c2.split()[1:7] == ["FAIL", "2.5e+00", "ok", "ok", "ok", "-"]
    row_c1 = next(line for line in lines if line.startswith("c1 "))
    assert "n/a" in row_c1 and "CRASH" in row_c1
    assert "5.00±0.05" in next(line for line in lines if line.startswith("bench2 "))
    geo = next(line for line in lines if line.startswith("geomean "))
    assert "10.00" in geo and "12.00" in geo and "4.00" in geo
    assert "at most 5 repeats" in report and "/tmp/logs" in report
    assert "seed " in report and "c1: crash: boom" in report
    assert lines[-1].startswith("  or write that copy: python eval.py export --variant persistent_n128")
    env = bringup.format_environment({"gpu": "NVIDIA B200", "PDL": "on"})
    assert env.splitlines() == ["environment", f"  {'gpu':<20} NVIDIA B200", f"  {'PDL':<20} on"]


def test_json_report_is_strict_json():
    document = bringup._finite({"a": [math.inf, 1.0, {"b": math.nan}], "c": (1, -math.inf)})
    assert json.loads(json.dumps(document, allow_nan=False)) == {"a": ["inf", 1.0, {"b": "nan"}], "c": [1, "-inf"]}


# ---------------------------------------------------------------------------------------------------------
# bringup without a GPU
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a GPU")
@pytest.mark.parametrize("args", [["--quick"], ["--json", "out.json"]])
def test_bringup_without_a_gpu_exits_2_with_one_line(tmp_path, args):
    proc = subprocess.run([sys.executable, str(ROOT / "eval.py"), "bringup", *args], cwd=tmp_path, env=_clean_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("eval.py bringup: cannot run:") and "GPU" in lines[0]
    assert proc.stdout == "" and not (tmp_path / "out.json").exists()


def _fake_gpu(monkeypatch, capability, name, sms):
    monkeypatch.setattr(harness, "gpu_problem", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=0: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: name)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index=0: types.SimpleNamespace(multi_processor_count=sms, total_memory=141 * 2**30))


class FakeGpuWorkers:
    """Stands in for bringup.Worker on a fake GPU: every build and case passes, a benchmark takes the variant's
    speed; every call is recorded (worker, job, group counts) in order, from all threads."""

    def __init__(self, variable, speed):
        self.variable, self.speed, self.events, self.envs = variable, speed, [], []
        self.lock = threading.Lock()
        outer = self

        class Fake:
            def __init__(self, env, log):
                with outer.lock:
                    outer.envs.append(dict(env))
                    self.number = len(outer.envs)
                self.variant = env[outer.variable]

            def call(self, job, args, timeout):
                groups = ([bringup.kernel_groups(a) for a in args[0]] if job == "bringup:job_build" else
                          bringup.kernel_groups(args[0]) if job in ("bringup:job_check", "bringup:job_pattern",
                                                                    "bringup:job_descriptors") else
                          bringup.kernel_groups(args[0].args) if job == "bringup:job_benchmark" else None)
                with outer.lock:
                    outer.events.append((self.number, self.variant, job, groups))
                if job == "bringup:job_hello":
                    key = "kernel_variant" if outer.variable == "NVFP4_KERNEL_VARIANT" else "sm90_variant"
                    return "ok", {key: self.variant, "launch_path": "tvm_ffi"}
                if job == "bringup:job_build":
                    return "ok", dict(status="ok", kernels=1, seconds=0.0)
                if job == "bringup:job_check":
                    return "ok", dict(status="pass", max_abs_err=0.0, seconds=0.0)
                if job == "bringup:job_benchmark":
                    return "ok", dict(status="ok", mean_us=outer.speed[self.variant], err_us=0.01, runs=args[1])
                if job == "bringup:job_pattern":
                    return "ok", dict(status="pass", batches=args[1], inputs=15, seconds=0.0)
                if job == "bringup:job_descriptors":
                    return "ok", bringup.descriptor_outcome([[0] * 5] * 4, ["A", "B", "SFA", "SFB", "C"], "group")
                raise AssertionError(job)

            def close(self):
                pass

            kill = close

        self.Worker = Fake

    def check_order(self):
        """Per worker: hello, then its builds, then cases of the group counts it built; benchmarks only after
        every case of every variant, each in a worker that built its group count."""
        built = {}
        for number, variant, job, groups in self.events:
            if job == "bringup:job_build":
                built.setdefault(number, set()).update(groups)
            elif job in ("bringup:job_check", "bringup:job_benchmark", "bringup:job_pattern",
                         "bringup:job_descriptors") and groups:
                assert groups in built.get(number, set()), (number, variant, job, groups)
        jobs = [job for _, _, job, _ in self.events]
        last_check = max(i for i, job in enumerate(jobs) if job == "bringup:job_check")
        assert all(i > last_check for i, job in enumerate(jobs) if job == "bringup:job_benchmark")
        for number in {n for n, _, _, _ in self.events}:
            mine = [job for n, _, job, _ in self.events if n == number]
            assert mine[0] == "bringup:job_hello"
            first_check = next((i for i, job in enumerate(mine) if job == "bringup:job_check"), len(mine))
            assert "bringup:job_build" not in mine[first_check:], mine


def test_bringup_end_to_end_on_a_fake_hopper(monkeypatch, tmp_path, capsys):
    # The whole command on fake workers and a fake GPU: environment, cases, plans, report, JSON.
    _fake_gpu(monkeypatch, (9, 0), "NVIDIA H200", 132)
    configs = submission_sm90.SM90_VARIANT_CONFIGS
    best = next(name for name, config in configs.items() if config.tile_mn[1] == 128)
    wide = [name for name, config in configs.items() if config.tile_mn[1] == 256]
    # the 256-wide tiles, if any, are fastest but never run the N % 256 != 0 tests; then `best`, then sm90_auto
    speed = dict({name: 20.0 for name in submission_sm90.SM90_VARIANTS}, sm90_auto=10.0, **{best: 9.0},
                 **{name: 5.0 for name in wide})
    fakes = FakeGpuWorkers("NVFP4_SM90_VARIANT", speed)
    monkeypatch.setattr(bringup, "Worker", fakes.Worker)
    out = tmp_path / "bringup.json"
    assert bringup.bringup_main(["--quick", "--jobs", "3", "--json", str(out)]) == 0
    captured = capsys.readouterr()
    report = captured.out
    # every variant's workers, one variant each, selected through the environment
    assert sorted({tuple(env.items()) for env in fakes.envs}) == sorted(
        {(("NVFP4_SM90_VARIANT", name),) for name in submission_sm90.SM90_VARIANTS})
    fakes.check_order()
    assert report.startswith("environment\n") and "NVIDIA H200" in report and "compute capability" in report
    assert f"recommendation: {best}" in report
    assert f"+ {bringup.default_line('sm90', best)}" in report
    assert "tile model" not in report  # a B200 model only
    document = json.loads(out.read_text())
    assert document["arch"] == "sm_90a" and document["quick"] is True and document["jobs"] == 3
    assert document["recommendation"]["variant"] == best
    for name in wide:
        assert document["variants"][name]["cases"]["test1"]["status"] == "n/a"
    # --quick times as eval.py benchmark does: its warm-up, then its stop rules
    assert document["variants"]["sm90_auto"]["warmup"]["runs"] == harness.WARMUP_LIMITS[0]
    assert document["variants"]["sm90_auto"]["benchmarks"]["bench1"]["runs"] == harness.BENCHMARK_LIMITS[0]
    assert "predicted_us" not in document["variants"]["sm90_auto"]["benchmarks"]["bench1"]
    assert [c["label"] for c in document["cases"]][:2] == ["test1", "test2"]
    assert document["environment"]["PDL"] in ("on", "off")
    # progress with an estimate of the time left, per phase
    assert re.search(r"^\[build 1/\d+, ~\d+ s left\] \[", captured.err, re.M), captured.err[:2000]
    assert re.search(r"^\[test \d+/\d+, ~\d+ s left\] \[", captured.err, re.M)
    assert re.search(r"^\[bench \d+/\d+, ~\d+ s left\] \[", captured.err, re.M)


def test_bringup_on_a_fake_b200_puts_the_tile_model_beside_each_benchmark(monkeypatch, tmp_path, capsys):
    _fake_gpu(monkeypatch, (10, 0), "NVIDIA B200", 148)
    speed = {name: 10.0 + i for i, name in enumerate(submission.KERNEL_VARIANTS)}
    fakes = FakeGpuWorkers("NVFP4_KERNEL_VARIANT", speed)
    monkeypatch.setattr(bringup, "Worker", fakes.Worker)
    out = tmp_path / "bringup.json"
    assert bringup.bringup_main(["--quick", "--json", str(out)]) == 0
    fakes.check_order()
    report = capsys.readouterr().out
    document = json.loads(out.read_text())
    assert document["arch"] == "sm_100a" and "sm100_predicted_us on 148 SMs" in document["model"]
    bench_sizes = {b["label"]: b for b in document["benchmarks"]}
    tasks = ev.load_cases(str(ROOT / "task.yml"), "benchmarks")
    modelled = 0
    for name in submission.KERNEL_VARIANTS:
        config = submission.VARIANT_CONFIGS[name]
        for i, case in enumerate(tasks):
            entry = document["variants"][name]["benchmarks"][f"bench{i + 1}"]
            assert entry["status"] == "ok" and f"bench{i + 1}" in bench_sizes
            sizes = harness.case_sizes(case.args)
            if not isinstance(config, submission.Sm100PersistentConfig):
                assert "predicted_us" not in entry  # the model is the persistent kernel's
                continue
            if name in submission.TILE_TABLE_VARIANTS:
                config = submission.choose_sm100_config(sizes, 148)
            assert entry["predicted_us"] == pytest.approx(submission.sm100_predicted_us(sizes, config, 148))
            modelled += 1
    assert modelled >= len(tasks)
    assert "(x): the tile model's µs (submission.sm100_predicted_us on 148 SMs)" in report
    line = next(line for line in report.splitlines() if line.startswith("bench1 ") and "±" in line)
    first = document["variants"][submission.KERNEL_VARIANTS[0]]["benchmarks"]["bench1"]
    assert f"{first['mean_us']:.2f}±{first['err_us']:.2f} ({first['predicted_us']:.1f})" in line


@pytest.mark.parametrize("tool", [None, "/opt/cuda/bin/compute-sanitizer"])
def test_bringup_on_a_fake_b200_runs_the_pattern_descriptor_check_and_memcheck(monkeypatch, tmp_path, capsys, tool):
    _fake_gpu(monkeypatch, (10, 0), "NVIDIA B200", 148)
    fakes = FakeGpuWorkers("NVFP4_KERNEL_VARIANT", {name: 10.0 for name in submission.KERNEL_VARIANTS})
    monkeypatch.setattr(bringup, "Worker", fakes.Worker)
    monkeypatch.setattr(harness, "find_cuda_tool", lambda name: tool if name == "compute-sanitizer" else None)
    sanitized = []

    def run_sanitizer(plans, benchmarks, sanitizer):
        sanitized.append((sanitizer, [plan["name"] for plan in plans]))
        return {plan["name"]: {"PDL on": dict(status="pass", errors=0), "PDL off": dict(status="pass", errors=0)}
                for plan in plans}

    monkeypatch.setattr(bringup, "run_sanitizer", run_sanitizer)
    out = tmp_path / "bringup.json"
    assert bringup.bringup_main(["--quick", "--sanitizer", "--variants", "persistent,seed", "--json", str(out)]) == 0
    fakes.check_order()
    captured = capsys.readouterr()
    document = json.loads(out.read_text())
    for name in ("persistent", "seed"):
        variant = document["variants"][name]
        assert list(variant["pattern"]) == ["bench1", "bench2", "bench3", "bench4"]
        assert variant["descriptors"]["case"] == "skewed" and variant["descriptors"]["status"] == "ok"
        assert ("sanitizer" in variant) == (tool is not None)
    jobs = [job for _, _, job, _ in fakes.events]
    assert jobs.count("bringup:job_pattern") == 8 and jobs.count("bringup:job_descriptors") == 2
    assert document["sanitizer"] == dict(requested=True, tool=tool)
    if tool is None:
        assert sanitized == [] and "compute-sanitizer not found" in captured.err
    else:
        assert sanitized == [(tool, ["persistent", "seed"])] and "PDL off" in captured.out
    assert "the runner's pattern" in captured.out and "after one call of skewed" in captured.out


def test_bringup_names_an_unknown_variant_before_the_gpu_check(monkeypatch, capsys):
    def no_gpu_check():
        raise AssertionError("the GPU is looked at after the variant names")

    monkeypatch.setattr(harness, "gpu_problem", no_gpu_check)
    assert bringup.bringup_main(["--variants", "persistent,nope"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("eval.py bringup: --variants: 'nope': not a variant"), err
    assert all(name in err[0] for name in (*submission.KERNEL_VARIANTS, *submission_sm90.SM90_VARIANTS))
    proc = subprocess.run([sys.executable, str(ROOT / "eval.py"), "bringup", "--variants", "nope"], cwd=ROOT,
                          env=_clean_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "'nope'" in proc.stderr
    assert "GPU" not in proc.stderr


def test_bringup_names_a_variant_of_the_other_gpu(monkeypatch, capsys):
    _fake_gpu(monkeypatch, (9, 0), "NVIDIA H200", 132)
    monkeypatch.setattr(bringup, "Worker", None)  # nothing may start
    assert bringup.bringup_main(["--variants", "persistent"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "'persistent': not a variant for this GPU (Hopper)" in err[0], err


def test_bringup_usage_mistake_is_one_line(capsys):
    assert bringup.bringup_main(["--quick", "--bogus"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--bogus" in err[0]


# ---------------------------------------------------------------------------------------------------------
# bringup: the skewed case, the runner's pattern, descriptor bit 85, memcheck (cases and checks on the CPU)
# ---------------------------------------------------------------------------------------------------------
def test_skewed_case_is_what_the_field_reports_ask_for():
    # NVIDIA/cutlass #3165 faulted on skewed groups: M = 8 beside M = 8192 at K = 7168, very different N
    args = bringup.EDGE_CASES["skewed"]
    assert {8, 8192} <= set(args["m"]) and set(args["k"]) == {7168}
    assert max(args["n"]) >= 16 * min(args["n"])
    assert submission.check_problem_sizes(harness.case_sizes(args)) == (True, "")
    assert bringup.not_applicable(args, 256) is None  # every forced tile runs it
    assert bringup.DESCRIPTOR_CASE == "skewed"
    labels = [c["label"] for c in bringup.build_cases(_tests(), lambda a: False)]
    assert "skewed" in labels


def test_pattern_inputs_are_the_runners():
    # The seeds the runner's harness itself draws for a benchmark's 15 inputs (recorded from
    # harness._run_single_benchmark, stopped at its first call) are the pattern's.
    args = dict(m=(40, 129), n=(128, 256), k=(256, 512), g=2, seed=1111)
    sets = bringup.pattern_case_args(args)
    assert len(sets) == harness.NUM_ITERATIONS_PER_BENCHMARK == 15 and args["seed"] == 1111
    assert [one["seed"] for one in sets] == list(range(1111 + 42, 1111 + 42 * 16, 42))
    assert all({k: v for k, v in one.items() if k != "seed"} == dict(m=(40, 129), n=(128, 256), k=(256, 512), g=2)
               for one in sets)
    seen = []

    def record(**kwargs):
        seen.append(kwargs["seed"])
        raise RuntimeError("enough")

    import reference as ref
    original = ref.generate_input
    ref.generate_input = record
    try:
        test = ev.TestCase(args=dict(args), spec="")
        for _ in range(15):
            with pytest.raises(RuntimeError):
                harness._run_single_benchmark(test, False, 1, 1e9)
    finally:
        ref.generate_input = original
    assert seen == [one["seed"] for one in sets]


def test_job_pattern_checks_every_result_of_every_batch(stand_in):
    calls = []
    stand_in(_poison_checking_reference(calls))  # poisoned before the batch
    result = bringup.job_pattern(ARGS, 3)
    assert result["status"] == "pass" and result["batches"] == 3 and result["inputs"] == 15
    assert len(calls) == 45 and calls[:15] == calls[15:30] == calls[30:]  # the same 15 inputs in every batch
    assert len(set(calls[:15])) == 15

    def wrong_once(data, count=[]):
        count.append(1)
        out = reference.ref_kernel(data)
        if len(count) == 15 + 8:  # batch 2, input 8
            out[1][3, 7] += 1.0
        return out

    stand_in(wrong_once)
    result = bringup.job_pattern(ARGS, 3)
    assert result["status"] == "fail" and result["batch"] == 2 and result["wrong"] == 1
    assert result["error"].startswith("batch 2, input 8 of 15: mismatch")

    def stops_writing(data, count=[]):
        count.append(1)
        if len(count) > 15:  # from batch 2 on, the outputs are left as they are (poisoned)
            return [c for _, _, c in data[0]]
        return reference.ref_kernel(data)

    stand_in(stops_writing)
    result = bringup.job_pattern(ARGS, 2)
    assert result["status"] == "fail" and result["batch"] == 2 and result["wrong"] == 15

    def raises(data):
        raise RuntimeError("illegal memory access\nmore")

    stand_in(raises)
    result = bringup.job_pattern(ARGS, 2)
    assert result["status"] == "error" and result["error"] == "batch 1: RuntimeError: illegal memory access"


def _descriptor_bytes(rows: int, slots: int, set_bits: dict) -> torch.Tensor:
    """A descriptor workspace built byte by byte: `set_bits` maps (row, slot) to the descriptor bit numbers to
    set (little-endian: bit b is bit b % 8 of byte b // 8)."""
    raw = bytearray(rows * slots * 128)
    for (row, slot), bits in set_bits.items():
        for bit in bits:
            raw[(row * slots + slot) * 128 + bit // 8] |= 1 << (bit % 8)
    return torch.frombuffer(raw, dtype=torch.int64).clone()


def test_descriptor_bit85_reads_bit_85_of_each_descriptor():
    workspace = _descriptor_bytes(3, 5, {(1, 2): [85], (0, 0): [84, 86, 21, 149], (2, 1): [127, 85 - 64],
                                         (2, 4): [85, 0, 127]})
    assert bringup.descriptor_bit85(workspace, 5) == [[0] * 5, [0, 0, 1, 0, 0], [0, 0, 0, 0, 1]]
    assert bringup.descriptor_bit85(workspace.view(3, 5, 16), 5) == bringup.descriptor_bit85(workspace, 5)
    assert bringup.descriptor_bit85(_descriptor_bytes(4, 4, {}), 4) == [[0] * 4] * 4
    with pytest.raises(ValueError):
        bringup.descriptor_bit85(workspace[:-16], 5)  # not whole rows
    with pytest.raises(ValueError):
        bringup.descriptor_bit85(workspace.view(torch.int32), 5)
    operands = ["A", "B", "SFA", "SFB", "C"]
    outcome = bringup.descriptor_outcome(bringup.descriptor_bit85(workspace, 5), operands, "group")
    assert outcome["status"] == "fail" and outcome["set_in"] == ["group 1 SFA", "group 2 C"]
    assert outcome["error"].startswith("bit 85 set in 2 of 15 descriptors: group 1 SFA, group 2 C")
    lines = bringup.format_descriptor_bits("persistent", outcome)
    assert lines[1].split() == ["persistent", "group", "1:", "A=0", "B=0", "SFA=1", "SFB=0", "C=0"]
    clear = bringup.descriptor_outcome([[0] * 4] * 240, operands[:4], "tile")
    assert clear["status"] == "ok" and "error" not in clear
    assert bringup.format_descriptor_bits("seed", clear) == [f"  {'seed':<20} 240 tiles x A, B, SFA, SFB: set in 0"]


def test_descriptor_upper_bytes_reads_bytes_64_to_127_of_each_descriptor():
    # Bytes 64-127 were what DSL 4.5.2 and 4.8.1 left unstaged; byte 63 and byte 128 (the next descriptor's
    # first) are outside them.
    workspace = _descriptor_bytes(2, 5, {(0, 0): [64 * 8], (0, 1): [63 * 8, 128 * 8], (1, 2): [127 * 8 + 7]})
    upper = bringup.descriptor_upper_bytes(workspace, 5)
    zero = "00" * 64
    assert upper[0][0] == "01" + "00" * 63 and upper[1][2] == "00" * 63 + "80"
    assert upper[0][1] == zero and upper[0][2] == zero and len(upper) == 2 and all(len(row) == 5 for row in upper)
    assert bringup.descriptor_upper_bytes(workspace.view(2, 5, 16), 5) == upper
    operands = ["A", "B", "SFA", "SFB", "C"]
    outcome = bringup.descriptor_outcome([[0] * 5, None], operands, "group", [upper[0], None])  # group 1 empty
    assert outcome["status"] == "ok" and outcome["upper_bytes"]["A"] == {"01" + "00" * 63: 1}
    assert outcome["upper_bytes"]["SFA"] == {zero: 1}
    lines = bringup.format_descriptor_bits("persistent", outcome)
    assert f"  {'persistent':<20} group 1: never written (empty)" in lines
    assert f"  {'persistent':<20} bytes 64-127 of B (1 groups): zero" in lines
    assert f"  {'persistent':<20} bytes 64-127 of A (1 groups): {'01' + '00' * 63}" in lines
    both = bringup.descriptor_outcome([[0] * 5] * 2, operands, "group", upper)
    assert bringup.format_upper_bytes("persistent", both)[2] == (
        f"  {'persistent':<20} bytes 64-127 of SFA: 2 values over 2 groups: {zero} x1, {'00' * 63 + '80'} x1")
    assert bringup.format_upper_bytes("persistent", bringup.descriptor_outcome([[0] * 5], operands, "group")) == []


def _descriptor_stand_in(monkeypatch, launch_metadata):
    """A stand-in submission for job_descriptors: the persistent kernel's config, `launch_metadata` given."""
    fake = types.SimpleNamespace(
        custom_kernel=reference.ref_kernel, first_launched_group=submission.first_launched_group,
        kernel_config=lambda data, device: submission.SM100_TILE_N128, launch_metadata=launch_metadata,
        Sm100PersistentConfig=submission.Sm100PersistentConfig, Sm100TensorMapSlot=submission.Sm100TensorMapSlot,
        TensorMapSlot=submission.TensorMapSlot)
    monkeypatch.setitem(sys.modules, "submission", fake)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    return fake


def test_job_descriptors_reads_the_calls_own_workspace(stand_in, monkeypatch):
    # A stand-in submission whose launch metadata holds a workspace with bit 85 set in group 1's B.
    workspace = _descriptor_bytes(2, 5, {(1, 1): [85]})
    asked = []

    def launch_metadata(data, device, config):
        asked.append((len(data[3]), config))
        return types.SimpleNamespace(workspace=workspace)

    fake = _descriptor_stand_in(monkeypatch, launch_metadata)
    result = bringup.job_descriptors(ARGS)
    assert asked == [(2, submission.SM100_TILE_N128)]
    assert result["status"] == "fail" and result["bit85"] == [[0] * 5, [0, 1, 0, 0, 0]]
    assert result["operands"] == ["A", "B", "SFA", "SFB", "C"] and result["set_in"] == ["group 1 B"]
    fake.kernel_config = lambda data, device: submission.SM100_CONFIG  # the seed: rows are tiles, 4 operands
    fake.launch_metadata = lambda data, device, config: types.SimpleNamespace(workspace=_descriptor_bytes(3, 4, {}))
    result = bringup.job_descriptors(ARGS)
    assert result["status"] == "ok" and result["row_kind"] == "tile" and len(result["bit85"]) == 3


def test_job_descriptors_skips_the_rows_of_empty_groups(stand_in, monkeypatch):
    # An empty group's row is never written (no descriptor for an empty tensor): whatever it holds, even bit
    # 85, is not reported; the written rows still are.
    workspace = _descriptor_bytes(3, 5, {(0, 2): [85, 64 * 8], (2, 0): [85, 100 * 8]})
    _descriptor_stand_in(monkeypatch, lambda data, device, config: types.SimpleNamespace(workspace=workspace))
    result = bringup.job_descriptors(dict(m=[0, 64, 40], n=[128, 256, 128], k=[256, 256, 512], g=3, seed=4))
    assert result["bit85"][0] is None and result["set_in"] == ["group 2 A"] and result["status"] == "fail"
    assert "1 of 10 descriptors" in result["error"]
    # bytes 64-127 of the written rows only (group 0's SFA is not counted)
    zero = "00" * 64
    assert result["upper_bytes"]["SFA"] == {zero: 2}
    assert result["upper_bytes"]["A"] == {zero: 1, "00" * 36 + "01" + "00" * 27: 1}


def _pattern_worker(script):
    """FakeWorker that also answers job_pattern (by benchmark seed in `script`) and job_descriptors."""
    class Worker(FakeWorker):
        def call(self, job, args, timeout):
            if job == "bringup:job_pattern":
                return "ok", dict(status=script.get(("pattern", args[0]["seed"]), "pass"), batches=args[1])
            if job == "bringup:job_descriptors":
                bits = [[0] * 5, [0, int(script.get("bit85", False)), 0, 0, 0]]
                return "ok", bringup.descriptor_outcome(bits, ["A", "B", "SFA", "SFB", "C"], "group")
            return super().call(job, args, timeout)
    return Worker


@pytest.mark.parametrize("script, state", [({}, "pass"), ({("pattern", 10.0): "fail"}, "fail"),
                                           ({"bit85": True}, "fail")])
def test_driver_runs_the_pattern_and_the_descriptor_check(script, state):
    cases = _fake_cases(4)
    plan = dict(_plan(), pattern=True, descriptors=cases[0])
    workers = []

    def start(env, log):
        workers.append(_pattern_worker(script)(script, "persistent"))
        return workers[-1]

    result = bringup.run_variant(plan, cases, _fake_benchmarks(), bringup.Limits(pattern_repeats=4),
                                 start_worker=start, log=lambda line: None)
    assert list(result["pattern"]) == ["bench1", "bench2"] and result["pattern"]["bench1"]["batches"] == 4
    assert result["descriptors"]["case"] == "c0"
    assert bringup.verdict(result)[0] == state
    timed = all(b["status"] == "ok" for b in result["benchmarks"].values())
    assert timed == (state == "pass")  # a failed pattern or descriptor check is not timed
    if script.get("bit85"):
        assert "descriptors: fail: bit 85 set in 1 of 10 descriptors: group 1 B" in bringup.verdict(result)[1]


MEMCHECK_CLEAN = "========= COMPUTE-SANITIZER\nPATTERN {\"status\": \"pass\", \"label\": \"bench1\"}\n" \
                 "========= ERROR SUMMARY: 0 errors\n"
MEMCHECK_ERRORS = ("========= COMPUTE-SANITIZER\n========= Invalid __global__ read of size 16 bytes\n"
                   "=========     at kernel_cutlass_kernel+0x1a0\n"
                   "PATTERN {\"status\": \"pass\", \"label\": \"bench1\"}\n"
                   "========= ERROR SUMMARY: 3 errors\n")


def test_memcheck_output_is_read():
    assert bringup.parse_sanitizer_run(MEMCHECK_CLEAN, 0, ["bench1"])["status"] == "pass"
    bad = bringup.parse_sanitizer_run(MEMCHECK_ERRORS, 97, ["bench1"])
    assert bad["status"] == "fail" and bad["errors"] == 3
    assert bad["error"] == "memcheck: 3 error(s); first: Invalid __global__ read of size 16 bytes"
    wrong = MEMCHECK_CLEAN.replace('"pass"', '"fail", "error": "batch 2, input 3 of 15: mismatch"')
    assert bringup.parse_sanitizer_run(wrong, 0, ["bench1"])["error"] == "bench1: batch 2, input 3 of 15: mismatch"
    crashed = bringup.parse_sanitizer_run("========= COMPUTE-SANITIZER\nSegmentation fault\n", -11, ["bench1"])
    assert crashed["status"] == "error" and "Segmentation fault" in crashed["error"]
    assert bringup.parse_sanitizer_run(MEMCHECK_CLEAN, 0, ["bench1", "bench2"])["status"] == "error"  # one missing


def test_memcheck_runs_each_variant_with_pdl_on_and_off():
    runs = []

    def run(argv, env, capture_output, text, timeout):
        runs.append((argv, env))
        if env["NVFP4_KERNEL_VARIANT"] == "seed" and env["NVFP4_PDL"] == "0":
            raise subprocess.TimeoutExpired(argv, timeout)
        labels = json.loads(argv[-1])
        out = "".join(f"PATTERN {json.dumps(dict(status='pass', label=label))}\n" for label, _ in labels)
        return types.SimpleNamespace(stdout=out, stderr="========= ERROR SUMMARY: 0 errors\n", returncode=0)

    plans = [_plan("persistent"), _plan("persistent_n256", tile_n=256), _plan("seed")]
    benchmarks = _fake_benchmarks() + [bringup.Benchmark("bench3", ev.TestCase(
        args=dict(m=(64,), n=(512,), k=(256,), g=1, seed=3), spec=""))]
    results = bringup.run_sanitizer(plans, benchmarks, "/opt/cs", run=run, log=lambda line: None)
    assert [(env["NVFP4_KERNEL_VARIANT"], env["NVFP4_PDL"]) for _, env in runs] == [
        ("persistent", "1"), ("persistent", "0"), ("persistent_n256", "1"), ("persistent_n256", "0"),
        ("seed", "1"), ("seed", "0")]
    argv = runs[0][0]
    assert argv[:7] == ["/opt/cs", "--tool", "memcheck", "--report-api-errors", "no", "--error-exitcode", "97"]
    assert argv[7] == sys.executable and argv[-2] == str(bringup.SANITIZER_REPEATS)
    assert [label for label, _ in json.loads(runs[0][0][-1])] == ["bench1", "bench2", "bench3"]
    assert [label for label, _ in json.loads(runs[2][0][-1])] == ["bench3"]  # N = 128 never runs 256-wide tiles
    assert list(results["persistent"]) == ["PDL on", "PDL off"]
    assert results["persistent"]["PDL on"]["status"] == "pass" and results["seed"]["PDL off"]["status"] == "timeout"
    vres = dict(_result(["pass"], [5.0, 5.0]), sanitizer=results["seed"])
    assert bringup.verdict(vres) == ("fail", f"memcheck PDL off: timeout: no end within "
                                             f"{bringup.SANITIZER_TIMEOUT:.0f} s")


def test_memcheck_script_runs_the_pattern_in_a_fresh_process(tmp_path):
    # compute-sanitizer stood in for by a script that drops memcheck's arguments and runs the rest: the
    # pattern runs in the fresh process through the real submission and torch, which on a CPU-only machine
    # fail at the first batch (no GPU); that answer comes back through the PATTERN lines.
    fake = tmp_path / "compute-sanitizer"
    fake.write_text(f"#!/bin/sh\nshift {len(bringup.MEMCHECK_ARGS)}\n\"$@\"\n"
                    "echo '========= ERROR SUMMARY: 0 errors'\n")
    fake.chmod(0o755)
    case = ev.TestCase(args=dict(m=(64,), n=(128,), k=(256,), g=1, seed=3), spec="")
    results = bringup.run_sanitizer([_plan("persistent")], [bringup.Benchmark("bench1", case)], str(fake),
                                    repeats=1, timeout=600, log=lambda line: None)
    outcome = results["persistent"]["PDL off"]
    assert outcome["errors"] == 0 and list(outcome["patterns"]) == ["bench1"]
    if torch.cuda.is_available():
        return
    assert outcome["status"] == "fail" and outcome["error"].startswith("bench1: batch 1: ")
    # A CPU build of torch says "CUDA"; a CUDA build on a machine without a GPU says "no NVIDIA driver".
    assert "CUDA" in outcome["error"] or "NVIDIA driver" in outcome["error"]


def test_report_shows_the_pattern_descriptors_and_memcheck():
    results = {"persistent": dict(_result(["pass"], [5.0, 5.0]), pattern={"bench1": dict(status="pass"),
                                                                        "bench2": dict(status="fail", error="x")},
                                  descriptors=dict(bringup.descriptor_outcome([[0] * 5] * 2, list("ABCDE"), "group"),
                                                   case="skewed"),
                                  sanitizer={"PDL on": dict(status="pass", errors=0),
                                             "PDL off": dict(status="fail", errors=2, error="memcheck: 2")})}
    cases = [dict(label="c0", spec="")]
    benchmarks = [bringup.Benchmark(label, ev.TestCase(args=dict(m=(1,), n=(128,), k=(256,), g=1, seed=1), spec=""))
                  for label in LABELS]
    rec = bringup.recommend(results, LABELS, "b200", "persistent")
    report = bringup.format_report(cases, benchmarks, results, rec, bringup.QUICK_LIMITS)
    lines = report.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("the runner's pattern"))
    assert lines[start + 2].split() == ["bench1", "ok"] and lines[start + 3].split() == ["bench2", "FAIL"]
    assert "after one call of skewed" in report and f"  {'persistent':<20} group 1: A=0 B=0 C=0 D=0 E=0" in lines
    assert f"  {'persistent':<20} PDL off  FAIL (2 memcheck errors)" in lines
    assert "persistent pattern bench2: fail: x" in report and "persistent memcheck PDL off: fail: memcheck: 2" in report
    assert rec["variant"] is None


# ---------------------------------------------------------------------------------------------------------
# docs/B200_DESIGN.md's table of the tile rows the task's shapes pick is the model's own answer
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("function", ["tile_choice_table", "moe_tile_choice_table"])
def test_design_doc_tile_table_is_computed(function):
    doc = (ROOT / "docs" / "B200_DESIGN.md").read_text()
    table = getattr(bringup, function)(148)
    missing = [line for line in table.splitlines() if line not in doc.splitlines()]
    assert not missing, (f"docs/B200_DESIGN.md, section 3, is out of date; regenerate the table with "
                         f"python -c \"import bringup; print(bringup.{function}(148))\"; missing: "
                         + "; ".join(missing[:3]))
    # With the measured model (5.9 TB/s, 4.5 us per call) every task.yml shape and every MoE shape keeps the
    # default row; tests 7 and 10 took 128x64 with the model of 7.7 TB/s and 1.5 us.
    chosen = [line.rsplit("|", 2)[1].strip() for line in table.splitlines()[2:]]
    assert set(chosen) == {"128×128"}


def test_moe_cases_are_the_layers_in_decode():
    cases = bringup.moe_cases()
    assert len(cases) == 4 * 3
    shapes = {(sizes[0][1], sizes[0][2], len(sizes)) for _, sizes in cases}
    assert shapes == {(4096, 7168, 256), (7168, 2048, 256), (1536, 2048, 128), (2048, 768, 128)}
    for label, sizes in cases:
        ms = [m for m, _, _, _ in sizes]
        assert 8 <= min(ms) <= max(ms) <= 40 and len({(n, k) for _, n, k, _ in sizes}) == 1, label
        assert submission.check_problem_sizes(sizes) == (True, ""), label
    assert cases == bringup.moe_cases()  # the same draw every time
