"""bench.py's pure logic, on the CPU: the humming-kernels column (what it hands humming, how its check is
scored, the one note that replaces it where humming does not import) and the table it prints."""
import math
import os
import subprocess
import sys
import types

import pytest
import torch

import bench
import eval as ev
import harness
import reference
import submission
from conftest import ROOT, TOL, dequant_f64, e2m1_value, e4m3_value


def test_expert_layout_is_the_row_offsets_then_the_total():
    assert bench.humming_expert_layout([80, 176, 128, 72]) == [0, 80, 256, 384, 456]
    assert bench.humming_expert_layout([192]) == [0, 192]
    assert bench.humming_expert_layout([40, 0, 24]) == [0, 40, 40, 64]  # an empty group starts where the next does


def test_humming_weight_holds_b_and_its_scales_unchanged():
    data = reference.generate_input(m=(40, 24), n=(128, 128), k=(256, 256), g=2, seed=5)
    weight = bench.humming_weight(data)
    words, scales, global_scale = weight["weight"], weight["weight_scale"], weight["weight_scale_2"]
    assert words.dtype == torch.int32 and words.shape == (2, 128, 256 // 8)
    assert scales.dtype == torch.float8_e4m3fn and scales.shape == (2, 128, 256 // 16)
    assert global_scale.dtype == torch.float32 and global_scale.tolist() == [1.0, 1.0]
    # decoded the way humming reads it (element i of a word in bits 4i..4i+3), with the independent decoder
    e2m1 = torch.tensor([e2m1_value(c) for c in range(16)], dtype=torch.float64)
    e4m3 = torch.tensor([e4m3_value(c) for c in range(256)], dtype=torch.float64)
    codes = torch.stack([(words.cpu() >> (4 * i)) & 15 for i in range(8)], dim=-1).flatten(-2)
    values = e2m1[codes.long()] * e4m3[scales.cpu().view(torch.uint8).long()].repeat_interleave(16, dim=-1)
    for g, ((_, b, _), (_, sfb)) in enumerate(zip(data[0], data[1])):
        assert torch.equal(values[g], dequant_f64(b[:, :, 0], sfb[:, :, 0])), g


def test_worst_ratio_scores_against_the_leaderboard_tolerance():
    assert bench.HUMMING_TOL == TOL["check"]
    ref = [torch.tensor([[1.0, -2.0]], dtype=torch.float16), torch.zeros((0, 2), dtype=torch.float16)]
    assert bench.worst_ratio([r.clone() for r in ref], ref, **TOL["check"]) == 0.0
    off = ref[0].clone()
    off[0, 1] = -2.0 + 2 * (1e-3 + 2e-3)  # twice the tolerance of -2 (fp16 rounds it, so approximately)
    assert bench.worst_ratio([off, ref[1]], ref, **TOL["check"]) == pytest.approx(2.0, rel=0.05)
    nan = ref[0].clone()
    nan[0, 0] = math.nan
    assert bench.worst_ratio([nan, ref[1]], ref, **TOL["check"]) == math.inf


def test_without_humming_one_note_replaces_the_column(monkeypatch):
    monkeypatch.setitem(sys.modules, "humming", None)  # `import humming` fails, whether or not it is installed
    monkeypatch.delenv("HUMMING_DISABLE_PARALLEL_BUILD", raising=False)
    note = bench.humming_note(skip=False)
    assert note.startswith("humming-kernels not importable: ") and "humming" in note[32:], note
    assert "\n" not in note
    # humming's environment is set before the import is tried (it reads it when imported)
    assert os.environ["HUMMING_DISABLE_PARALLEL_BUILD"] == "1"


def test_no_humming_is_a_note_without_importing_it(monkeypatch):
    monkeypatch.setattr(bench, "humming_problem", lambda: pytest.fail("--no-humming must not import humming"))
    assert bench.humming_note(skip=True) == "humming column left out (--no-humming)"


def test_one_line_errors_are_one_line_and_short():
    err = RuntimeError("Compiler failed:\n  line 1\n  line 2 " + "x" * 1000)
    text = bench._one_line(err)
    assert text.startswith("RuntimeError: Compiler failed: line 1 line 2 ") and "\n" not in text
    assert len(text) == 300 and text.endswith("…")


def _fake_toolkit(tmp_path, wrapper: bool):
    home = tmp_path / "cuda-13.0"
    (home / "bin").mkdir(parents=True)
    (home / "include").mkdir()
    real = home / "bin" / "nvcc"
    real.write_text("#!/bin/sh\necho fake nvcc\n")
    real.chmod(0o755)
    if not wrapper:
        return home, home / "bin"
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "nvcc").write_text(f'#!/bin/sh\nexec {real} "$@"\n')
    (shim / "nvcc").chmod(0o755)
    return home, shim


@pytest.mark.parametrize("wrapper", [False, True])
def test_cuda_home_comes_from_the_nvcc_on_path(tmp_path, monkeypatch, wrapper):
    home, on_path = _fake_toolkit(tmp_path, wrapper)
    monkeypatch.setenv("PATH", str(on_path))
    assert bench._nvcc_home() == str(home)
    # humming_problem sets it only where humming's own search has no toolkit
    monkeypatch.setattr(bench.glob, "glob", lambda pattern: [])
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setitem(sys.modules, "humming", None)
    bench.humming_problem()
    assert os.environ["CUDA_HOME"] == str(home)
    monkeypatch.setenv("CUDA_HOME", "/somewhere/else")
    bench.humming_problem()
    assert os.environ["CUDA_HOME"] == "/somewhere/else"


def test_no_nvcc_no_cuda_home(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert bench._nvcc_home() is None


def _row(times):
    case = ev.TestCase(args=dict(m=(64, 72), n=(128, 128), k=(256, 256), g=2, seed=1), spec="")
    return case, times, {"bf16 floor": 1.0, "fp4-bytes floor": 0.5}, 7.5, 1e9, 1e6


def _cells(line: str, names) -> list:
    """The method cells of a table line: 16 characters each after the 52 of the case."""
    return [line[52 + 16 * i:68 + 16 * i].strip() for i in range(len(names))]


def test_table_shows_humming_with_its_ratio_and_a_to_fp16_without():
    names = ["kernel", "grouped_mm", "cuBLAS loop", "dequant+mm", "humming", "A→fp16"]
    rows = [_row({"kernel": 20.0, "cuBLAS loop": 40.0, "humming": 30.0, "A→fp16": 5.0}),
            _row({"kernel": 10.0, "cuBLAS loop": 40.0})]  # humming failed on this case
    head, first, second, geo = bench.table_lines(rows, names)
    assert _cells(head, names) == [n + " µs" for n in names]
    assert _cells(first, names) == ["20.0", "-", "40.0 (2.0×)", "-", "30.0 (1.5×)", "5.0"]
    assert _cells(second, names) == ["10.0", "-", "40.0 (4.0×)", "-", "-", "-"]
    assert _cells(geo, names) == [f"{math.sqrt(200):.1f}", "-", "40.0", "-", "-", "-"]


def test_table_without_humming_has_no_such_column():
    names = ["kernel", "grouped_mm", "cuBLAS loop", "dequant+mm"]
    lines = bench.table_lines([_row({"kernel": 20.0, "grouped_mm": 25.0})], names)
    assert "humming" not in "\n".join(lines) and "A→fp16" not in "\n".join(lines)
    assert "25.0 (1.2×)" in lines[1]


def test_help_names_no_humming(capsys):
    with pytest.raises(SystemExit) as stop:
        bench.main(["--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert "--no-humming" in out and "A→fp16" in out


def test_a_to_fp16_kernel_is_exact_in_triton_interpreter():
    """The Triton kernel of the A→fp16 column, run by Triton's CPU interpreter on every e2m1 code and many e4m3
    scales (skipped where Triton is not installed; the GPU run checks it against reference.dequantize too)."""
    pytest.importorskip("triton")
    script = """
import torch, bench, reference
torch.manual_seed(0)
ms, k = [40, 8, 24], 512
a = [torch.randint(0, 256, (m, k // 2), dtype=torch.uint8) for m in ms]
s = [torch.randint(0, 0x7e, (m, k // 16), dtype=torch.uint8) for m in ms]  # finite e4m3, both signs below
s = [x | (torch.rand(x.shape) < 0.5).to(torch.uint8) * 0x80 for x in s]
item = dict(a=a, sfa=torch.cat(s), a16=torch.full((sum(ms), k), float("nan"), dtype=torch.float16))
bench._a_to_fp16(item)
exact = torch.cat([reference.dequantize(q.view(torch.float4_e2m1fn_x2), x.view(torch.float8_e4m3fn))
                   for q, x in zip(a, s)])
assert torch.equal(item["a16"].float(), exact), (item["a16"].float() - exact).abs().max()
print("exact")
"""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(ROOT), *sys.path]))
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip() == "exact", proc.stderr[-3000:]


# ---------------------------------------------------------------------------------------------------------
# humming_case end to end on the CPU, with a stand-in humming: the wiring, the check and the notes
# ---------------------------------------------------------------------------------------------------------
def _stand_in_launch(error: float = 0.0, fail: bool = False):
    """humming's launch_kernel as the grouped call means it: C rows of expert e = A rows of expert e (from
    expert_layout) x (e2m1 codes of weight[e], element i of a word in bits 4i.. x e4m3 scales x global)^T."""
    e2m1 = torch.tensor(reference._E2M1_VALUES, dtype=torch.float32)

    def launch_kernel(*, configs, inputs, weight, weight_scale, weight_scale_2, outputs, expert_layout, locks):
        if fail:
            raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore")
        bounds = expert_layout.tolist()
        for e, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
            codes = torch.stack([(weight[e] >> (4 * i)) & 15 for i in range(8)], dim=-1).flatten(-2)
            b = e2m1[codes.long()] * weight_scale[e].float().repeat_interleave(16, -1) * weight_scale_2[e]
            outputs[lo:hi] = (inputs[lo:hi].float() @ b.T + error).half()
    return launch_kernel


@pytest.fixture
def stand_in(monkeypatch):
    def install(**launch):
        ops = types.SimpleNamespace(launch_kernel=_stand_in_launch(**launch))
        runtime = types.SimpleNamespace(KernelRuntime=type("KR", (), {"_get_compiler": staticmethod(
            lambda: type("NVRTCCompiler", (), {}))}))
        for name, module in {"humming": types.SimpleNamespace(ops=ops), "humming.ops": ops,
                             "humming.jit": types.SimpleNamespace(runtime=runtime),
                             "humming.jit.runtime": runtime}.items():
            monkeypatch.setitem(sys.modules, name, module)
        monkeypatch.setattr(bench, "_humming_kernel", lambda n, k, ms: ("layer", {"block_shape": [64, 128, 64]},
                                                                      torch.zeros(4, dtype=torch.int64)))
        monkeypatch.setattr(bench, "_humming_weight_of", lambda layer, data: bench.humming_weight(data))

        def a_to_fp16(item):  # the Triton kernel's job, in torch (Triton may be absent here)
            packed = torch.cat(item["a"]).view(torch.float4_e2m1fn_x2)
            item["a16"].copy_(reference.dequantize(packed, item["sfa"].view(torch.float8_e4m3fn)).half())

        monkeypatch.setattr(bench, "_a_to_fp16", a_to_fp16)
        monkeypatch.setattr(bench, "_time_per_call", lambda fn, sets, repeats: [fn(s) for s in sets] and 12.5)
    return install


CASE = ev.TestCase(args=dict(m=(40, 0, 24), n=(128, 128, 128), k=(256, 256, 256), g=3, seed=7), spec="")


def _inputs(case=CASE, count=3):
    return [reference.generate_input(**dict(case.args, seed=case.args["seed"] + i)) for i in range(count)]


def test_humming_case_times_both_columns_and_notes_a_pass(stand_in):
    stand_in()
    times = {}
    note = bench.humming_case(CASE, _inputs(), 5, times)
    assert times == {"A→fp16": 12.5, "humming": 12.5}
    assert note == (f"humming {ev._short(CASE)}: passes rtol = atol = 1e-3 on all 3 inputs, worst |err|/tol 0.000 "
                    "(tile [64, 128, 64], compiled with NVRTC)")


def test_humming_case_reports_a_miss_and_its_ratio(stand_in):
    stand_in(error=0.004)  # 4x the tolerance where a result is near 0, less on larger ones
    times = {}
    note = bench.humming_case(CASE, _inputs(), 5, times)
    assert ": FAILS rtol = atol = 1e-3 on all 3 inputs, worst |err|/tol " in note and "humming" in times
    assert 3.5 < float(note.split("worst |err|/tol ")[1].split()[0]) < 4.5


def test_humming_case_failure_is_one_note_and_no_column(stand_in):
    stand_in(fail=True)
    times = {"kernel": 10.0}
    note = bench.humming_case(CASE, _inputs(), 5, times)
    assert note == f"humming {ev._short(CASE)}: failed, RuntimeError: CUDA error: an illegal memory access was " \
                   "encountered more"
    assert times == {"kernel": 10.0}


def test_humming_case_needs_one_n_and_k():
    case = ev.TestCase(args=dict(m=(40, 24), n=(128, 256), k=(256, 256), g=2, seed=7), spec="")
    times = {}
    assert "not run (one grouped call needs the same n and k" in bench.humming_case(case, [], 5, times)
    assert times == {}


# ---------------------------------------------------------------------------------------------------------
# main on the CPU: torch's GPU calls, the submission and the timing stood in for; what it prints
# ---------------------------------------------------------------------------------------------------------
@pytest.fixture
def cpu_main(monkeypatch, tmp_path):
    fake_submission = types.SimpleNamespace(LAUNCH_PATH="prepacked", LAUNCH_PATHS=("prepacked",),
                                            set_launch_path=lambda name: None, custom_kernel=reference.ref_kernel)
    monkeypatch.setitem(sys.modules, "submission", fake_submission)
    inputs = _inputs(CASE, 2)  # drawn on the CPU before torch is told a GPU is there
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Stand-in GPU")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(bench, "case_inputs", lambda case: inputs)
    monkeypatch.setattr(bench, "host_us_per_call", lambda *a, **k: 7.0)
    cases = tmp_path / "cases.txt"
    cases.write_text("m: [40, 0, 24]; n: [128, 128, 128]; k: [256, 256, 256]; g: 3; seed: 7\n")  # CASE

    def run(capsys, *args):
        monkeypatch.setattr(bench, "_time_per_call", lambda fn, sets, repeats: 12.5)  # nothing timed on a CPU
        assert bench.main([str(cases), "--skip-slow", *args]) == 0
        return capsys.readouterr().out.strip().splitlines()
    return run


def test_main_without_humming_prints_one_note_and_no_column(cpu_main, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "humming", None)
    lines = cpu_main(capsys)
    assert not any("humming µs" in line or "A→fp16" in line for line in lines)
    assert lines[-2].startswith("geometric mean")
    assert lines[-1] == "humming-kernels not importable: ModuleNotFoundError: import of humming halted; None in sys.modules"


def test_main_with_humming_shows_both_columns_and_its_notes(cpu_main, capsys, stand_in):
    stand_in()
    sys.modules["humming"].__version__ = "0.1.19"
    lines = cpu_main(capsys)
    head = next(line for line in lines if line.startswith("case"))
    names = ["kernel", "grouped_mm", "cuBLAS loop", "dequant+mm", "humming", "A→fp16"]
    assert _cells(head, names) == [n + " µs" for n in names]
    assert _cells(lines[lines.index(head) + 1], names)[4:] == ["12.5 (1.0×)", "12.5"]
    assert lines[-2].startswith("humming = humming-kernels 0.1.19, grouped W4A16: A given in fp16")
    assert lines[-1].startswith("humming g=3 m=[40, 0, 24] n=[128, 128, 128] k=[256, 256, 256]: passes ")


def test_main_no_humming_leaves_it_out(cpu_main, capsys, monkeypatch):
    monkeypatch.setattr(bench, "humming_problem", lambda: pytest.fail("--no-humming must not import humming"))
    lines = cpu_main(capsys, "--no-humming")
    assert lines[-1] == "humming column left out (--no-humming)"
    assert not any("humming µs" in line for line in lines)


def test_timing_loop_is_the_runners(monkeypatch):
    # Per repeat, as the runner's harness (eval.py's loop): wait for the GPU, flush L2, record the start
    # event with no wait in between (the calls queue behind the flush), the calls, the end event, wait.
    log = []

    class FakeEvent:
        def __init__(self, enable_timing=False):
            log.append("new")

        def record(self):
            log.append("record")

        def elapsed_time(self, other):
            return 1.0

    monkeypatch.setattr(bench.torch.cuda, "synchronize", lambda: log.append("sync"))
    monkeypatch.setattr(bench.torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(bench, "clear_l2_cache_large", lambda: log.append("flush"))
    us = bench._time_per_call(lambda data: log.append(f"call{data}"), [0, 1], repeats=2)
    assert us == pytest.approx(500.0)  # 1 ms over 2 calls
    warm = ["call0", "call1", "sync"]
    one = ["sync", "new", "new", "flush", "record", "call0", "call1", "record", "sync"]
    assert log == warm + one + one


# ---------------------------------------------------------------------------------------------------------
# --ab: two or more kernel settings, in turn
# ---------------------------------------------------------------------------------------------------------
NAMES = (("persistent", "seed", "sm90_auto", "sm90_a16_pairs"), {"split_k": bool, "num_stages": int})


def test_ab_settings_parse_every_form():
    assert bench.parse_setting("default", *NAMES) == bench.KernelSetting("default")
    text = "variant=sm90_a16_pairs, sm90.split_k=on,sm90.num_stages=12, pdl=off"
    assert bench.parse_setting(text, *NAMES) == bench.KernelSetting(
        text, "sm90_a16_pairs", (("split_k", True), ("num_stages", 12)), False)
    assert bench.parse_setting("variant=seed,pdl=on,sm90.split_k=off", *NAMES) == bench.KernelSetting(
        "variant=seed,pdl=on,sm90.split_k=off", "seed", (("split_k", False),), True)


@pytest.mark.parametrize("text,piece", [
    (" , ", "empty setting"), ("variant=bogus", "'variant=bogus' in setting 'variant=bogus': expected one of persistent"),
    ("lever=x", "expected variant=NAME"), ("pdl=1", "expected on or off, once"),
    ("variant=seed,variant=persistent", "'variant=persistent'"), ("sm90.split_k=off,sm90.split_k=on", "once"),
    ("sm90.bogus=1", "expected a field of split_k, num_stages, once"),
    ("sm90.num_stages=x", "expected a non-negative integer"), ("sm90.split_k=1", "expected on or off"),
    ("speed=2", "expected variant=NAME, sm90.FIELD=VALUE, pdl=on|off, or default"),
])
def test_ab_settings_name_the_wrong_item(text, piece):
    with pytest.raises(ValueError) as raised:
        bench.parse_setting(text, *NAMES)
    assert str(raised.value).startswith("--ab: ") and piece in str(raised.value), str(raised.value)


def test_ab_rounds_of_three_settings_turn_forwards_then_backwards():
    log = []
    times = bench.ab_rounds(("A", "B", "C"), 2, lambda i: log.append(i), lambda i: True, lambda: float(len(log)))
    assert log == [0, 1, 2, 2, 1, 0]
    assert times == ([1.0, 6.0], [2.0, 5.0], [3.0, 4.0])
    line = bench.ab_summary("case", tuple(bench.KernelSetting(t) for t in "ABC"), ([10.0, 10.0], [9.0, 11.0],
                                                                                    [20.0, 20.0]))
    assert line.endswith("A     10.00  B     10.00 (B/A 1.000, rounds 0.900 to 1.100)  C     20.00 (C/A 2.000, "
                         "rounds 2.000 to 2.000)"), line


def test_ab_rounds_alternate_and_check_each_setting_first():
    log = []
    times = bench.ab_rounds(("A", "B"), 3, lambda i: log.append(f"apply {i}"),
                            lambda i: log.append(f"check {i}") or True, lambda: float(len(log)))
    assert log == ["apply 0", "check 0", "apply 1", "check 1", "apply 1", "apply 0", "apply 0", "apply 1"]
    assert times == ([2.0, 6.0, 7.0], [4.0, 5.0, 8.0])  # the log's length when each was timed
    log.clear()
    assert bench.ab_rounds(("A", "B"), 3, lambda i: log.append(f"apply {i}"), lambda i: i == 0, lambda: 1.0) is None
    assert log == ["apply 0", "apply 1"]  # B's wrong output stops the run before anything more is timed


@pytest.fixture
def hopper_settings(monkeypatch):
    """The real modules' settings, restored after the test (bench.ab sets them through their setters)."""
    sm90 = bench.hopper_module()
    monkeypatch.setattr(submission, "KERNEL_VARIANT", submission.KERNEL_VARIANT)
    monkeypatch.setattr(submission, "USE_PDL", True)
    monkeypatch.setattr(submission, "_prepared_calls", {})
    monkeypatch.setattr(sm90, "SM90_VARIANT", sm90.SM90_VARIANT)
    monkeypatch.setattr(sm90, "SM90_OVERRIDES", sm90.SM90_OVERRIDES)
    return sm90


def test_ab_times_each_setting_as_selected_and_restores_the_defaults(monkeypatch, capsys, hopper_settings):
    sm90 = hopper_settings
    state = lambda: (submission.KERNEL_VARIANT, sm90.SM90_VARIANT, tuple(sorted(sm90.SM90_OVERRIDES.items())),  # noqa: E731
                     submission.USE_PDL)
    checked, timed = [], []
    monkeypatch.setattr(bench, "case_inputs", lambda case: ["input"])
    monkeypatch.setattr(bench, "wrong", lambda fn, case, inputs, what: checked.append((what, state())) and False)
    # B (8 stages) takes 0.9 of A's time
    monkeypatch.setattr(bench, "_time_per_call", lambda fn, inputs, repeats: timed.append(state()) or (
        9.0 if sm90.SM90_OVERRIDES.get("num_stages") == 8 else 10.0))
    settings = (bench.parse_setting("variant=sm90_a16_pairs,pdl=off", *NAMES),
                bench.parse_setting("variant=sm90_a16_pairs,pdl=off,sm90.num_stages=8", *NAMES))
    cases = harness.load_cases(str(ROOT / "task.yml"), "benchmarks")[:2]
    assert bench.ab(submission, cases, settings, 2, 3) == 0
    a = (submission.DEFAULT_KERNEL_VARIANT, "sm90_a16_pairs", (), False)
    b = (submission.DEFAULT_KERNEL_VARIANT, "sm90_a16_pairs", (("num_stages", 8),), False)
    assert checked == [("setting " + settings[0].text, a), ("setting " + settings[1].text, b)] * 2
    assert timed == [a, b, b, a] * 2
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 3 and lines[0].startswith("--ab: A = variant=sm90_a16_pairs,pdl=off, B = variant=")
    assert lines[1].endswith(" A     10.00  B      9.00 (B/A 0.900, rounds 0.900 to 0.900)")
    assert state() == (submission.DEFAULT_KERNEL_VARIANT, sm90.DEFAULT_SM90_VARIANT, (), True)  # defaults again
