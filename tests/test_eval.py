"""eval.py on the CPU: the case-file parser, the runner's protocol output, the tables, the no-GPU exit."""
import contextlib
import os
import subprocess
import sys
import types

import pytest
import torch

import eval as ev
import reference
from conftest import ROOT


# ---------------------------------------------------------------------------------------------------------
# Case files
# ---------------------------------------------------------------------------------------------------------
def test_parse_runner_line():
    case = ev.parse_case_line("m: [64, 72]; n: [128, 384]; k: [512, 512]; g: 2; seed: 1111")
    assert case.args == {"m": (64, 72), "n": (128, 384), "k": (512, 512), "g": 2, "seed": 1111}
    assert case.spec == "m: [64, 72]; n: [128, 384]; k: [512, 512]; g: 2; seed: 1111"


@pytest.mark.parametrize("line", [
    "m [64]; n: [128]; k: [256]; g: 1; seed: 1",  # no colon
    "m: [64]; n: [128]; k: [256]; g: 1; seed: 1.5",  # not an integer
    "m: [64]; n: [128]; k: [256]; g: 1; seed: 1;",  # empty trailing part
    "m: [64; n: [128]; k: [256]; g: 1; seed: 1",  # unclosed list
])
def test_malformed_line_names_the_line(tmp_path, line):
    path = tmp_path / "cases.txt"
    path.write_text("m: [64]; n: [128]; k: [256]; g: 1; seed: 1\n" + line + "\n")
    with pytest.raises(ev.CaseFileError, match=r"line 2: invalid test case"):
        ev.load_cases(str(path), "tests")


@pytest.mark.parametrize("line,match", [
    ("m: [64, 72]; n: [128]; k: [256, 256]; g: 2; seed: 1", "n must be a list of g=2"),
    ("m: [64, x]; n: [128, 128]; k: [256, 256]; g: 2; seed: 1", "m must be a list of g=2"),
    ("m: [64]; n: [128]; k: [256]; g: 1", "lacks seed"),
])
def test_inconsistent_case_is_rejected(tmp_path, line, match):
    path = tmp_path / "cases.txt"
    path.write_text(line + "\n")
    with pytest.raises(ev.CaseFileError, match=match):
        ev.load_cases(str(path), "tests")


def test_empty_and_missing_files(tmp_path):
    (tmp_path / "empty.txt").write_text("\n# only a comment\n")
    with pytest.raises(ev.CaseFileError, match="no cases"):
        ev.load_cases(str(tmp_path / "empty.txt"), "tests")
    with pytest.raises(ev.CaseFileError, match="cannot read"):
        ev.load_cases(str(tmp_path / "absent.txt"), "tests")


def test_task_yml_cases():
    tests = ev.load_cases(str(ROOT / "task.yml"), "tests")
    benchmarks = ev.load_cases(str(ROOT / "task.yml"), "benchmarks")
    assert len(tests) == 10 and len(benchmarks) == 4
    assert [b.sol_us for b in benchmarks] == [18.833, 10.667, 2.406, 1.525]
    assert "sol_us" not in benchmarks[0].args  # not a generator argument
    # The yml spec round-trips through the runner's text format.
    assert ev.parse_case_line(benchmarks[2].spec).args == benchmarks[2].args


def test_secret_seed_mix():
    cases = [ev.parse_case_line("m: [64]; n: [128]; k: [256]; g: 1; seed: 1111")]
    ev.apply_secret_seed(cases, 12345)
    assert cases[0].args["seed"] == 1111 + (1111 + 12345) * (1111 + 12345 + 1) // 2
    assert ev.calculate_stats([1.0, 2.0, 3.0]).mean == 2.0


def test_case_work_counts():
    flops, bytes_ = ev.case_work({"m": (128,), "n": (256,), "k": (512,)})
    assert flops == 2 * 128 * 256 * 512
    assert bytes_ == (128 + 256) * 512 / 2 + (128 + 256) * 512 / 16 + 2 * 128 * 256


# ---------------------------------------------------------------------------------------------------------
# The runner's protocol, run in-process with a stand-in submission (the reference itself, or a wrong one)
# ---------------------------------------------------------------------------------------------------------
class _InlinePool:
    def __init__(self, initializer=None, initargs=()):
        if initializer is not None:  # the worker's start (eval.py selects a --variants name there)
            initializer(*initargs)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def apply(self, fn, args=()):
        return fn(*args)


class _FakeEvent:
    clock_ms = 0.0

    def __init__(self, enable_timing=False):
        self.at = None

    def record(self):
        _FakeEvent.clock_ms += 0.5  # every call "takes" 0.5 ms
        self.at = _FakeEvent.clock_ms

    def elapsed_time(self, other):
        return other.at - self.at


@contextlib.contextmanager
def _cpu_runner(monkeypatch, kernel):
    fake = types.ModuleType("submission")
    fake.custom_kernel = kernel
    # what eval.py checks --variants against and selects them with, on a B200
    fake.KERNEL_VARIANTS, fake.SM90_VARIANTS = ("persistent", "seed"), ("sm90_auto",)
    fake.KERNEL_VARIANT = "persistent"
    fake._target_arch = lambda device: "sm_100a"
    fake.set_variant = lambda name: setattr(fake, "KERNEL_VARIANT", name)
    fake.check_problem_sizes = lambda sizes: (True, "")  # what eval.py checks the cases' shapes with
    monkeypatch.setitem(sys.modules, "submission", fake)
    # the Hopper names eval.py checks --variants against too (the real module imports from `submission`)
    hopper = types.ModuleType("submission_sm90")
    hopper.SM90_VARIANTS = fake.SM90_VARIANTS
    hopper.set_sm90_variant = lambda name: None
    monkeypatch.setitem(sys.modules, "submission_sm90", hopper)
    monkeypatch.setattr(ev, "make_pool", lambda *start: _InlinePool(*start))
    monkeypatch.setattr(ev, "gpu_problem", lambda: None)
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    import utils

    monkeypatch.setattr(utils, "clear_l2_cache_large", lambda: None)
    monkeypatch.delenv("POPCORN_SEED", raising=False)
    yield


def _run_protocol(tmp_path, mode, lines):
    cases = tmp_path / "cases.txt"
    cases.write_text("\n".join(lines) + "\n")
    read_fd, write_fd = os.pipe()
    rc = ev.popcorn_main(str(write_fd), [mode, str(cases)])
    with os.fdopen(read_fd) as reader:
        out = reader.read().splitlines()
    return rc, dict(line.split(": ", 1) for line in out), out


CASE_A = "m: [40, 72]; n: [128, 256]; k: [256, 256]; g: 2; seed: 1111"
CASE_B = "m: [8]; n: [128]; k: [512]; g: 1; seed: 5"


def test_protocol_test_mode_pass(tmp_path, monkeypatch):
    with _cpu_runner(monkeypatch, reference.ref_kernel):
        rc, kv, out = _run_protocol(tmp_path, "test", [CASE_A, CASE_B])
    assert rc == 0
    assert out[0] == "test-count: 2"
    assert kv["test.0.spec"] == CASE_A and kv["test.1.spec"] == CASE_B
    assert kv["test.0.status"] == kv["test.1.status"] == "pass" and kv["check"] == "pass"


def test_protocol_test_mode_fail(tmp_path, monkeypatch):
    def wrong_kernel(data):
        return [c.zero_() for _, _, c in data[0]]

    with _cpu_runner(monkeypatch, wrong_kernel):
        rc, kv, _ = _run_protocol(tmp_path, "test", [CASE_A])
    assert rc == 112
    assert kv["test.0.status"] == "fail" and "mismatch" in kv["test.0.error"] and kv["check"] == "fail"


def test_protocol_benchmark_mode(tmp_path, monkeypatch):
    with _cpu_runner(monkeypatch, reference.ref_kernel):
        rc, kv, _ = _run_protocol(tmp_path, "benchmark", [CASE_B])
    assert rc == 0 and kv["benchmark-count"] == "1" and kv["benchmark.0.spec"] == CASE_B
    assert set(kv) >= {f"benchmark.0.{f}" for f in ("runs", "mean", "std", "err", "best", "worst")}
    # 15 calls between two events each 0.5 ms apart in the fake clock: 0.5 ms / 15 per call.
    assert float(kv["benchmark.0.mean"]) == pytest.approx(0.5e6 / 15)
    assert int(kv["benchmark.0.runs"]) >= 3 and kv["check"] == "pass"


def test_protocol_benchmark_reports_wrong_result(tmp_path, monkeypatch):
    def wrong_kernel(data):
        out = reference.ref_kernel(data)
        out[0][0, 0, 0] += 1.0
        return out

    with _cpu_runner(monkeypatch, wrong_kernel):
        rc, kv, _ = _run_protocol(tmp_path, "benchmark", [CASE_B])
    assert rc == 112 and kv["benchmark.0.status"] == "fail" and "mismatch" in kv["benchmark.0.error"]


def test_protocol_leaderboard_rechecks_every_batch_against_the_reference_run_once(tmp_path, monkeypatch):
    # a kernel right on the first call of each input set (the obligatory check) and wrong on every later call of the
    # same input objects (the timed batches): benchmark mode never looks again, leaderboard mode's re-check fails it
    seen = []

    def late_wrong_kernel(data):
        out = reference.ref_kernel(data)
        if any(d is data for d in seen):
            out[0][3, 5, 0] += 1.0
        seen.append(data)
        return out

    with _cpu_runner(monkeypatch, late_wrong_kernel):
        rc, kv, _ = _run_protocol(tmp_path, "benchmark", [CASE_B])
        assert rc == 0 and kv["check"] == "pass"
        seen.clear()
        rc, kv, _ = _run_protocol(tmp_path, "leaderboard", [CASE_B])
    assert kv["benchmark.0.status"] == "fail" and "ERROR AT (3, 5, 0)" in kv["benchmark.0.error"]
    assert kv["check"] == "fail"
    # a right kernel passes, the reference run once per input set: 15 in the warm-up pass, 15 in the timed one
    calls = []
    real = reference.ref_kernel
    monkeypatch.setattr(reference, "ref_kernel", lambda data: calls.append(1) or real(data))
    with _cpu_runner(monkeypatch, real):
        rc, kv, _ = _run_protocol(tmp_path, "leaderboard", [CASE_B])
    assert kv["check"] == "pass" and int(kv["benchmark.0.runs"]) >= 3 and len(calls) == 2 * 15


def test_human_table_and_geomean():
    cases = ev.load_cases(str(ROOT / "task.yml"), "benchmarks")[2:]
    rows = [(cases[0], ev.Stats(5, 4000.0, 10.0, 5.0, 3990.0, 4010.0)),
            (cases[1], ev.Stats(5, 1000.0, 10.0, 5.0, 990.0, 1010.0))]
    table = ev.format_benchmark_table(rows)
    assert "4.00 ±   0.01" in table and "geometric mean" in table
    assert "2.00 µs" in table  # sqrt(4 * 1)
    assert f"{100 * 2.406 / 4.0:6.1f}" in table  # % of speed of light


# ---------------------------------------------------------------------------------------------------------
# Without a GPU
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a GPU")
@pytest.mark.parametrize("popcorn", [False, True])
def test_no_gpu_exits_with_one_line_reason(popcorn):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    env.pop("POPCORN_FD", None)
    if popcorn:
        env["POPCORN_FD"] = "1"
    proc = subprocess.run([sys.executable, str(ROOT / "eval.py"), "test", str(ROOT / "task.yml")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    lines = [x for x in proc.stderr.splitlines() if x.startswith("eval.py")]
    assert len(lines) == 1 and "no usable CUDA GPU" in lines[0]


def test_unsupported_gpu_is_said_once(monkeypatch, capsys):
    class UnsupportedDeviceError(RuntimeError):
        pass

    def no_kernel(data):
        raise UnsupportedDeviceError("Some GPU (cuda:0) has compute capability 7.5; no kernel for it")

    with _cpu_runner(monkeypatch, no_kernel):
        rc = ev.human_test(_InlinePool(), ev.load_cases(str(ROOT / "task.yml"), "tests"))
    err = capsys.readouterr().err
    assert rc == 2
    assert err.count("compute capability 7.5") == 1 and "eval.py: cannot run 'test'" in err


def test_variants_run_once_each(monkeypatch, capsys):
    seen = []

    def kernel(data):
        seen.append(sys.modules["submission"].KERNEL_VARIANT)  # what the worker's set_variant chose
        return reference.ref_kernel(data)

    with _cpu_runner(monkeypatch, kernel):
        rc = ev.main(["test", str(ROOT / "task.yml"), "--variants", "seed,persistent"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "== kernel variant persistent" in out and "== kernel variant seed" in out
    assert seen == ["seed"] * 10 + ["persistent"] * 10


def test_l2_flush_is_the_runners_where_it_fits_and_leaves_headroom_elsewhere():
    import utils

    gib = 1 << 30
    # an H200 / B200: the runner's 62.5 GiB
    assert utils.l2_flush_floats(139 * gib) == utils.L2_FLUSH_FLOATS == 16000 * 1024 * 1024
    # an 80 GB card: what leaves the headroom free
    floats = utils.l2_flush_floats(78 * gib)
    assert floats * 4 + utils.L2_FLUSH_HEADROOM == 78 * gib and floats < utils.L2_FLUSH_FLOATS


def test_l2_flush_is_sized_down_never_refused_when_memory_is_short(monkeypatch, capsys):
    # Regression: with 22.3 GiB free (an 80 GB card beside bring-up's other workers) the flush raised
    # "too little for a 1 GiB flush beside 24 GiB of headroom", and bring-up marked the variant ERROR.
    # Under twice the headroom free it takes half of what is free: still hundreds of times any L2.
    import utils

    gib = 1 << 30
    short = int(22.3 * gib)
    assert utils.l2_flush_floats(short) == short // 2 // 4
    assert utils.l2_flush_floats(utils.L2_FLUSH_HEADROOM + gib // 2) == (utils.L2_FLUSH_HEADROOM + gib // 2) // 2 // 4
    assert utils.l2_flush_floats(0) == 0
    frees = range(0, 200 * gib, gib // 4)
    sizes = [utils.l2_flush_floats(free) * 4 for free in frees]
    assert sizes == sorted(sizes)  # more free memory never gives a smaller flush
    assert all(size <= max(free // 2, free - utils.L2_FLUSH_HEADROOM) for free, size in zip(frees, sizes))
    # clear_l2_cache_large on such a card: allocates that size once, says so once on stderr, never raises
    allocated = []
    monkeypatch.setattr(utils, "_L2_FLUSH_BUFFER", [])
    monkeypatch.setattr(utils.torch.cuda, "mem_get_info", lambda: (short, 80 * gib))
    monkeypatch.setattr(utils.torch, "empty", lambda floats, device: allocated.append(floats) or torch.zeros(4))
    utils.clear_l2_cache_large()
    utils.clear_l2_cache_large()
    assert allocated == [short // 2 // 4]
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "11.1 GiB flush" in err[0] and "22.3 GiB free" in err[0], err


def test_l2_flush_cap_for_processes_sharing_a_card(monkeypatch, capsys):
    # NVFP4_L2_FLUSH_GIB caps the flush, so that many harness processes fit on one card at once; a bad value is
    # one clear error, not a silent default.
    import utils

    gib = 1 << 30
    allocated = []
    monkeypatch.setattr(utils.torch.cuda, "mem_get_info", lambda: (139 * gib, 141 * gib))
    monkeypatch.setattr(utils.torch, "empty", lambda floats, device: allocated.append(floats) or torch.zeros(4))
    monkeypatch.setenv("NVFP4_L2_FLUSH_GIB", "2")
    monkeypatch.setattr(utils, "_L2_FLUSH_BUFFER", [])
    utils.clear_l2_cache_large()
    assert allocated == [2 * gib // 4]
    assert "2.0 GiB flush (NVFP4_L2_FLUSH_GIB)" in capsys.readouterr().err
    monkeypatch.setenv("NVFP4_L2_FLUSH_GIB", "100")  # above the runner's size: the runner's size
    monkeypatch.setattr(utils, "_L2_FLUSH_BUFFER", [])
    utils.clear_l2_cache_large()
    assert allocated[-1] == utils.L2_FLUSH_FLOATS
    for bad in ("0", "-1", "lots"):
        monkeypatch.setenv("NVFP4_L2_FLUSH_GIB", bad)
        monkeypatch.setattr(utils, "_L2_FLUSH_BUFFER", [])
        with pytest.raises(ValueError, match="NVFP4_L2_FLUSH_GIB"):
            utils.clear_l2_cache_large()


def _sass(*lines: str) -> str:
    """cuobjdump-style SASS lines at consecutive addresses."""
    return "\n".join(f"        /*{16 * i:04x}*/                   {line} ;  /* 0x0 */" for i, line in enumerate(lines))


def test_early_releases_counts_arrivals_before_a_load_is_read():
    # r43c's shape: the stage's fp4 words and scale loaded, the arrival before anything reads them
    early = _sass("LDS.128 R16, [R6]", "LDS.U16 R9, [R7+0x10]", "SYNCS.ARRIVE.TRANS64.ART0 RZ, [R11+URZ], RZ",
                  "HMUL2 R20, R16.H0_H0, R9.H0_H0")
    assert ev.early_releases(early) == 1 and ev.count_sass(early)["EARLYREL"] == 1
    # the fix: each load's result read (one register of it suffices: one scoreboard per load) before the arrival
    late = _sass("LDS.128 R16, [R6]", "LDS.U16 R9, [R7+0x10]", "HMUL2 R20, R19.H0_H0, R9.H0_H0",
                 "@P0 SYNCS.ARRIVE.TRANS64.ART0 RZ, [R11+URZ], RZ")
    assert ev.early_releases(late) == 0
    # one load read and the other not is still early; a predicate-writing compare reads its registers; a later
    # write of the same register number is not a read
    partial = _sass("LDS.128 R16, [R6]", "LDS.128 R24, [R6+0x200]", "HMUL2 R20, R16.H0_H0, R16.H1_H1",
                    "MOV R24, 0x1", "SYNCS.ARRIVE.TRANS64.ART0 RZ, [R11+URZ], RZ",
                    "ISETP.GE.AND P0, PT, R25, 0x1, PT", "SYNCS.ARRIVE.TRANS64 RZ, [R12+URZ], RZ")
    assert ev.early_releases(partial) == 1
    # a store reads its data register; a scale word's narrower load is not followed (W4A16 reads its second ones
    # after the A ring's release, rightly)
    stored = _sass("LDS.128 R4, [R2]", "STS [R3], R6", "LDS R9, [R2+0x200]", "SYNCS.ARRIVE.TRANS64 RZ, [R12+URZ], RZ")
    assert ev.early_releases(stored) == 0
    # an unrelated HMUL2 no longer counts as the use (the rule before this one: any HMUL2 between)
    unrelated = _sass("LDS.128 R16, [R6]", "HMUL2 R30, R40.H0_H0, R41", "SYNCS.ARRIVE.TRANS64.ART0 RZ, [R11+URZ], RZ")
    assert ev.early_releases(unrelated) == 1
