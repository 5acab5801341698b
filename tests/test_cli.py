"""The command line as a new user meets it: every mistake in eval.py and bench.py ends in one line on stderr
that names the culprit and a non-zero exit, never a traceback; the setters take only what they document;
`eval.py compile` builds the kernels the cases would run, one row each."""
import contextlib
import dataclasses
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import eval as ev
import reference
import submission
import submission_sm90
from conftest import ROOT, load_task_yml

HOPPER = ev.hopper_module()  # every Hopper name (SM90_VARIANTS, set_sm90_variant, ...) through eval.py's accessor
TRUNCATED_YAML = 'tests:\n  - {"m": [96, 128], "n": [128'


def run(script: str, *args, env: dict | None = None, python_args=()) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k != "POPCORN_FD" and not k.startswith("NVFP4_")}
    full_env.update(env or {})
    return subprocess.run([sys.executable, *python_args, str(ROOT / script), *map(str, args)], cwd=ROOT,
                          env=full_env, capture_output=True, text=True, timeout=600)


def one_line(proc: subprocess.CompletedProcess, returncode: int) -> str:
    """The single stderr line of a process that had to stop on a mistake."""
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert proc.returncode == returncode, (proc.returncode, proc.stderr)
    return lines[0]


def in_process_line(capsys, rc: int, returncode: int) -> str:
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert rc == returncode, (rc, captured.err)
    return lines[0]


# ---------------------------------------------------------------------------------------------------------
# Case files: one line naming file, line and culprit
# ---------------------------------------------------------------------------------------------------------
GOOD_LINE = "m: [64]; n: [128]; k: [256]; g: 1; seed: 1"
GOOD_ENTRY = '  - {"m": [64], "n": [128], "k": [256], "g": 1, "seed": 1}'

# (file name, content, pieces the message must contain)
BAD_CASE_FILES = [
    ("trunc.yml", TRUNCATED_YAML, ["trunc.yml, line 2", "not valid YAML"]),
    ("list.yml", "- 1\n- 2\n", ["list.yml", "a list at the top level", "'tests'"]),
    ("entry.yml", f"tests:\n{GOOD_ENTRY}\n  - 5\n", ["entry.yml, line 3", "tests[1]", "mapping", "5 (int)"]),
    ("key.yml", f'tests:\n{GOOD_ENTRY}\n  - {{"m": [64], "n": [128], "k": [256], "g": 1, "seed": 1, "foo": 3}}\n',
     ["key.yml, line 3", "tests[1]", "unknown key 'foo'"]),
    ("sol.yml", 'tests:\n  - {"m": [64], "n": [128], "k": [256], "g": 1, "seed": 1, "sol_us": "fast"}\n',
     ["sol.yml, line 2", "sol_us", "'fast'"]),
    ("value.yml", 'tests:\n  - {"m": [64, "x"], "n": [128, 128], "k": [256, 256], "g": 2, "seed": 1}\n',
     ["value.yml, line 2", "m must be a list of g=2 non-negative integers", "'x'"]),
    ("key.txt", f"{GOOD_LINE}\n{GOOD_LINE}; foo: 3\n", ["key.txt, line 2", "unknown key 'foo'"]),
    ("semi.txt", f"{GOOD_LINE};\n", ["semi.txt, line 1", "nothing after the last ';'"]),
    ("twice.txt", f"{GOOD_LINE}; g: 1\n", ["twice.txt, line 1", "key 'g' given twice"]),
    ("zero.txt", "m: []; n: []; k: []; g: 0; seed: 1\n", ["zero.txt, line 1", "g must be a positive integer, not 0"]),
    ("seed.txt", "m: [64]; n: [128]; k: [256]; g: 1; seed: abc\n", ["seed.txt, line 1", "seed must be an integer"]),
    ("negative.txt", "m: [-64]; n: [128]; k: [256]; g: 1; seed: 1\n", ["negative.txt, line 1", "m must be", "[-64]"]),
    ("zero_n.txt", "m: [0]; n: [0]; k: [256]; g: 1; seed: 1\n",
     ["zero_n.txt, line 1", "n must be a list of g=1 positive"]),
]


@pytest.mark.parametrize("name,content,pieces", BAD_CASE_FILES, ids=[c[0] for c in BAD_CASE_FILES])
def test_bad_case_file_is_one_line_in_every_run_mode(tmp_path, capsys, monkeypatch, name, content, pieces):
    path = tmp_path / name
    path.write_text(content)
    # Checked before the GPU: with a GPU stand-in that refuses, the case file must still be what is reported.
    monkeypatch.setattr(ev, "gpu_problem", lambda: "no GPU in this test")
    for mode in ("test", "benchmark") if name.endswith(".txt") else ("test",):
        line = in_process_line(capsys, ev.main([mode, str(path)]), 2)
        assert line.startswith("eval.py: ") and all(piece in line for piece in pieces), line


# Shapes the kernel refuses (submission.can_implement), each with a piece of the rule it breaks
REFUSED_SHAPES = [
    ("n", "m: [64, 64]; n: [128, 100]; k: [256, 256]; g: 2; seed: 1", "N must be a positive multiple of 128"),
    ("k", "m: [64]; n: [128]; k: [128]; g: 1; seed: 1", "K must be a positive multiple of 256"),
    ("k_odd", "m: [64]; n: [128]; k: [640]; g: 1; seed: 1", "K must be a positive multiple of 256"),
    ("elements", "m: [65536]; n: [128]; k: [32768]; g: 1; seed: 1", "2**31 or more elements"),
]


def _refuse_gpu():
    raise AssertionError("the GPU may not be looked at after a refused case")


@pytest.mark.parametrize("name,line,rule", REFUSED_SHAPES, ids=[s[0] for s in REFUSED_SHAPES])
def test_a_shape_the_kernel_refuses_is_one_line_before_any_gpu_or_build_work(tmp_path, capsys, monkeypatch, name,
                                                                              line, rule):
    import bringup
    import harness

    monkeypatch.setattr(ev, "gpu_problem", _refuse_gpu)
    monkeypatch.setattr(harness, "gpu_problem", _refuse_gpu)
    monkeypatch.setattr(ev, "build_one", _refuse_build)
    monkeypatch.setattr(ev, "find_cuobjdump", lambda: "cuobjdump")
    text = tmp_path / "cases.txt"
    text.write_text(f"{GOOD_LINE}\n{line}\n")
    args = {"m": None}
    for part in line.split(";"):
        key, value = part.split(":")
        args[key.strip()] = value.strip()
    yml = tmp_path / "task.yml"
    yml.write_text(f"tests:\n{GOOD_ENTRY}\nbenchmarks:\n{GOOD_ENTRY}\n  - {{\"m\": {args['m']}, \"n\": {args['n']}, "
                   f"\"k\": {args['k']}, \"g\": {args['g']}, \"seed\": 1}}\n")
    # the case file named, with the line, the case and the rule
    runs = [(mode, lambda mode=mode: ev.main([mode, str(text)]), "eval.py: ", f"{text}, line 2")
            for mode in ev.RUN_MODES]
    runs += [("yml", lambda: ev.main(["benchmark", str(yml)]), "eval.py: ", f"{yml}, line 5 (benchmarks[1])"),
             ("compile", lambda: ev.compile_main([str(text)]), "eval.py compile: ", f"{text}, line 2"),
             ("compile90", lambda: ev.compile_main(["--arch", "sm_90a", str(yml)]), "eval.py compile: ",
              f"{yml}, line 5"),
             ("bringup", lambda: bringup.bringup_main(["--quick"]), "eval.py bringup: ", f"{yml}, line 5")]
    monkeypatch.setattr(bringup, "TASK_YML", yml)
    for mode, run_it, prefix, where in runs:
        got = in_process_line(capsys, run_it(), 2)
        assert got.startswith(prefix) and where in got and rule in got, (mode, got)
        assert "refuses" in got and "k=[" in got and "can_implement" in got, (mode, got)


def test_the_size_rule_is_can_implement_s(monkeypatch):
    # One statement: can_implement asks check_problem_sizes, and the case files ask can_implement's rule.
    calls = []
    rule = submission.check_problem_sizes
    monkeypatch.setattr(submission, "check_problem_sizes", lambda sizes: calls.append(sizes) or rule(sizes))
    for _, line, piece in REFUSED_SHAPES[:3]:
        case = ev.parse_case_line(line)
        sizes = [(m, n, k, 1) for m, n, k in zip(case.args["m"], case.args["n"], case.args["k"])]
        data = reference.generate_input(**case.args)
        ok, reason = submission.can_implement(data)
        assert not ok and piece in reason and calls[-1] == sizes
        assert submission.check_problem_sizes(sizes) == (False, reason)
    assert submission.check_problem_sizes([(64, 128, 256, 1)]) == (True, "")
    assert submission.check_problem_sizes([]) == (False, "no groups: problem_sizes is empty")
    assert "4-tuple" in submission.check_problem_sizes([(64, 128, 256)])[1]


def test_missing_case_file_is_named(tmp_path, capsys):
    line = in_process_line(capsys, ev.main(["test", str(tmp_path / "absent.yml")]), 2)
    assert "cannot read case file" in line and "absent.yml" in line


def test_unknown_keys_are_rejected_at_parse_time(tmp_path):
    path = tmp_path / "cases.txt"
    path.write_text(f"{GOOD_LINE}; foo: 3\n")
    with pytest.raises(ev.CaseFileError, match="unknown key 'foo'; a case has m, n, k, g, seed"):
        ev.load_cases(str(path), "tests")
    # sol_us belongs to task.yml entries only; the runner's text format has no such key
    path.write_text(f"{GOOD_LINE}; sol_us: 3\n")
    with pytest.raises(ev.CaseFileError, match="unknown key 'sol_us'"):
        ev.load_cases(str(path), "tests")


def test_an_empty_group_is_a_valid_case(tmp_path):
    path = tmp_path / "cases.txt"
    path.write_text("m: [0, 64]; n: [128, 256]; k: [256, 512]; g: 2; seed: 3\n")
    (case,) = ev.load_cases(str(path), "tests")
    assert case.args == {"m": (0, 64), "n": (128, 256), "k": (256, 512), "g": 2, "seed": 3}


def test_truncated_yaml_in_a_subprocess(tmp_path):
    path = tmp_path / "cases.yml"
    path.write_text(TRUNCATED_YAML)
    line = one_line(run("eval.py", "test", path), 2)
    assert f"{path}, line 2: not valid YAML" in line
    # the runner's code for an unreadable case file where POPCORN_FD is set
    line = one_line(run("eval.py", "test", path, env={"POPCORN_FD": "1"}), 113)
    assert f"{path}, line 2" in line
    line = one_line(run("eval.py", "compile", path), 2)
    assert line.startswith("eval.py compile: ") and f"{path}, line 2" in line


# ---------------------------------------------------------------------------------------------------------
# Modes, options and help
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("popcorn", [False, True])
def test_unknown_mode_is_named_before_the_gpu_check(popcorn):
    proc = run("eval.py", "tset", ROOT / "task.yml", env={"POPCORN_FD": "1"} if popcorn else {})
    line = one_line(proc, 2)
    assert "'tset'" in line and all(mode in line for mode in ev.RUN_MODES + ("compile",)), line
    assert "CUDA" not in line and proc.stdout == ""  # the mode, not the GPU; no docstring dump


def test_popcorn_without_arguments_says_what_it_needs():
    line = one_line(run("eval.py", env={"POPCORN_FD": "1"}), 2)
    assert "POPCORN_FD" in line and "MODE FILE" in line


def test_popcorn_fd_that_is_not_a_descriptor():
    line = one_line(run("eval.py", "test", ROOT / "task.yml", env={"POPCORN_FD": "three"}), 2)
    assert "POPCORN_FD='three'" in line


def test_help_goes_to_stdout_with_status_0():
    proc = run("eval.py", "--help")
    assert proc.returncode == 0 and proc.stderr == ""
    assert "POPCORN_FD" in proc.stdout and "python eval.py compile" in proc.stdout


def test_unknown_option_is_one_line(capsys):
    line = in_process_line(capsys, _exit_code(ev.main, ["test", "--bogus"]), 2)
    assert "--bogus" in line


def _exit_code(fn, argv) -> int:
    try:
        return fn(argv)
    except SystemExit as stop:  # argparse stops this way, after printing its one line
        return stop.code


def test_unknown_kernel_variant_is_named(capsys, monkeypatch):
    monkeypatch.setattr(ev, "gpu_problem", lambda: "no GPU in this test")
    line = in_process_line(capsys, ev.main(["test", "--variants", "persistent,nonsense"]), 2)
    assert "'nonsense'" in line and all(name in line for name in submission.KERNEL_VARIANTS), line


@pytest.mark.parametrize("argv", [["benchmark", "--variants", "nonsense", "task.yml"],
                                  ["--variants", "nonsense", "benchmark", "task.yml"],
                                  ["benchmark", "task.yml", "--variants", "nonsense"]])
def test_options_may_come_anywhere_among_mode_and_file(capsys, monkeypatch, argv):
    # the file after an option is still the file (the variant is what is wrong here, not the order)
    monkeypatch.setattr(ev, "gpu_problem", lambda: "no GPU in this test")
    line = in_process_line(capsys, ev.main(argv), 2)
    assert "'nonsense'" in line and "unrecognized" not in line, line


def test_bad_environment_variable_is_named_before_the_gpu_check():
    line = one_line(run("eval.py", "test", env={"NVFP4_KERNEL_VARIANT": "bogus"}), 2)
    assert "NVFP4_KERNEL_VARIANT='bogus'" in line


# ---------------------------------------------------------------------------------------------------------
# The setters take their documented types and values only
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["0", "1", 0, 1, None, "off"])
def test_set_pdl_takes_a_bool_only(monkeypatch, value):
    monkeypatch.setattr(submission, "USE_PDL", False)
    with pytest.raises(TypeError, match=re.escape(f"set_pdl() takes True or False, not {value!r}")):
        submission.set_pdl(value)
    assert submission.USE_PDL is False  # unchanged by the refused call ("0" used to turn it on)


def test_set_pdl_switches_with_a_bool(monkeypatch):
    monkeypatch.setattr(submission, "USE_PDL", submission.USE_PDL)
    for on in (True, False, True):
        submission.set_pdl(on)
        assert submission.USE_PDL is on


@pytest.mark.parametrize("setter,names,attribute", [
    ("set_variant", "KERNEL_VARIANTS", "KERNEL_VARIANT"),
    ("set_launch_path", "LAUNCH_PATHS", "LAUNCH_PATH"),
])
def test_name_setters_take_one_of_their_names(monkeypatch, setter, names, attribute):
    monkeypatch.setattr(submission, attribute, getattr(submission, attribute))
    set_ = getattr(submission, setter)
    for wrong_type in (1, None, ("persistent",), b"prepacked"):
        with pytest.raises(TypeError, match=re.escape(f"{setter}() takes a")):
            set_(wrong_type)
    with pytest.raises(ValueError, match="'no_such_name'"):
        set_("no_such_name")
    name = "seed" if setter == "set_variant" else "prepacked"
    assert name in getattr(submission, names)
    set_(name)
    assert getattr(submission, attribute) == name


@pytest.mark.parametrize("setter,name,other", [("submission_sm90.set_sm90_variant", "persistent", "submission.set_variant"),
                                               ("submission.set_variant", "sm90_auto", "submission_sm90.set_sm90_variant")])
def test_a_variant_of_the_other_arch_names_its_setter(monkeypatch, setter, name, other):
    monkeypatch.setattr(submission, "KERNEL_VARIANT", "seed")
    monkeypatch.setattr(submission_sm90, "SM90_VARIANT", submission_sm90.SM90_VARIANTS[-1])
    module, function = setter.split(".")
    with pytest.raises(ValueError, match=re.escape(f"use {other}({name!r})")) as raised:
        getattr(sys.modules[module], function)(name)
    assert "('" not in str(raised.value).split(")", 1)[1]  # the choices as a plain list, not a Python tuple
    assert (submission.KERNEL_VARIANT, submission_sm90.SM90_VARIANT) == ("seed", submission_sm90.SM90_VARIANTS[-1])


def test_setter_choices_are_listed_plainly():
    with pytest.raises(ValueError) as raised:
        submission.set_launch_path("bogus")
    assert str(raised.value) == f"unknown launch path 'bogus'; choose one of {', '.join(submission.LAUNCH_PATHS)}"


# ---------------------------------------------------------------------------------------------------------
# bench.py
# ---------------------------------------------------------------------------------------------------------
def test_bench_help_shows_its_docstring(capsys):
    import bench

    assert _exit_code(bench.main, ["--help"]) == 0
    out = capsys.readouterr().out
    # the docstring's own layout survives (RawDescriptionHelpFormatter), not just its first line
    assert "\n    python bench.py [FILE] --pdl-ab ROUNDS\n" in out
    assert "\n  cuBLAS loop    torch.mm per group" in out


@pytest.mark.parametrize("args,pieces", [
    (["{bad}"], ["{bad}, line 2: not valid YAML"]),
    (["--launch-paths", "prepacked,bogus"], ["--launch-paths", "'bogus'", "choose from tvm_ffi, prepacked, dsl"]),
    (["--launch-paths", ","], ["--launch-paths", "tvm_ffi"]),
    (["--repeats", "0"], ["--repeats", "'0'"]),
    (["--pdl-ab", "x"], ["--pdl-ab", "'x'"]),
    (["--ab", "variant=bogus", "default"], ["--ab: 'variant=bogus' in setting 'variant=bogus'"]),
    (["--ab-rounds", "3"], ["--ab-rounds needs --ab"]),
    (["--ab", "default"], ["--ab takes 2 to 8 settings, got 1"]),
    (["--ab", "default", "pdl=off", "--pdl-ab", "2"], ["--ab and --pdl-ab: give one of them"]),
    (["--ab", "default", "pdl=off", "--launch-paths", "dsl"], ["--launch-paths does not apply to --ab"]),
    (["--moe", "--ab", "default", "pdl=off", "--moe-patterns", "1"], ["--moe-patterns does not apply to --ab"]),
])
def test_bench_mistakes_are_one_line_before_the_gpu_check(tmp_path, capsys, monkeypatch, args, pieces):
    import bench

    bad = tmp_path / "cases.yml"
    bad.write_text(TRUNCATED_YAML)
    # a GPU that would be found: the mistake must still be what stops it, before any timing
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench, "case_inputs", _refuse_build)
    args = [a.format(bad=bad) for a in args]
    line = in_process_line(capsys, _exit_code(bench.main, args), 2)
    assert line.startswith("bench.py: ") and all(p.format(bad=bad) in line for p in pieces), line


def test_bench_help_lists_the_launch_paths_plainly(capsys):
    import bench

    assert _exit_code(bench.main, ["--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"comma-separated: {', '.join(submission.LAUNCH_PATHS)}" in out and "('tvm_ffi'" not in out


def test_bench_plot_without_matplotlib_stops_before_anything_else(tmp_path):
    # matplotlib made unimportable, whether or not it is installed here
    block = ("import runpy, sys; sys.modules['matplotlib'] = None; sys.argv = sys.argv[1:]; "
             "runpy.run_path(sys.argv[0], run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", block, str(ROOT / "bench.py"), "--plot", str(tmp_path / "r.png")],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={k: v for k, v in os.environ.items() if not k.startswith("NVFP4_")})
    line = one_line(proc, 2)
    assert "--plot needs matplotlib" in line and ".[plot]" in line


def test_plot_extra_names_matplotlib():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["plot"] == ["matplotlib"]


def test_bench_plot_path_is_checked_up_front(tmp_path, monkeypatch):
    import types

    import bench

    # a stand-in matplotlib, so that this runs whether or not the plot extra is installed
    fake = types.ModuleType("matplotlib")
    fake.use = lambda backend: None
    backend_bases = types.ModuleType("matplotlib.backend_bases")
    backend_bases.FigureCanvasBase = type("FigureCanvasBase", (), {
        "get_supported_filetypes": staticmethod(lambda: {"png": "Portable Network Graphics", "pdf": "PDF"})})
    monkeypatch.setitem(sys.modules, "matplotlib", fake)
    monkeypatch.setitem(sys.modules, "matplotlib.backend_bases", backend_bases)
    assert bench.plot_problem(str(tmp_path / "r.png")) is None
    assert "does not exist" in bench.plot_problem(str(tmp_path / "absent" / "r.png"))
    assert "cannot write .nope; use one of .pdf, .png" in bench.plot_problem(str(tmp_path / "r.nope"))


# ---------------------------------------------------------------------------------------------------------
# eval.py compile: arguments, and one row per kernel it builds
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("args,pieces", [
    (["--groups", "0"], ["--groups 0", "at least 1"]),
    (["--groups", "2", "-3"], ["--groups -3", "at least 1"]),
    (["--groups", "2,x"], ["--groups", "'x'", "not a group count"]),
    (["--groups", "x"], ["--groups", "'x'", "not a group count"]),  # not taken for a case file
    (["--groups", "2", "nothere.yml"], ["cannot read case file nothere.yml"]),  # a file's name: the case file
    (["--arch", "sm_80"], ["'sm_80'", "sm_100a", "sm_90a"]),
    (["--variant", "sm90_tile128"], ["'sm90_tile128'", "not an sm_100a kernel", "--arch sm_90a", "persistent"]),
    (["--arch", "sm_90a", "--variant", "fast"], ["'fast'", "sm90_tile128", "sm90_a16_mexact"]),
])
def test_compile_mistakes_are_one_line(capsys, monkeypatch, args, pieces):
    monkeypatch.setattr(ev, "build_one", _refuse_build)
    line = in_process_line(capsys, _exit_code(ev.compile_main, args), 2)
    assert line.startswith("eval.py compile: ") and all(piece in line for piece in pieces), line


def _refuse_build(*args, **kwargs):
    raise AssertionError("nothing may be built after a mistake")


def test_compile_help_lists_the_variants_of_each_arch(capsys):
    assert _exit_code(ev.compile_main, ["--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps the help text
    for name in (*submission.KERNEL_VARIANTS, *submission_sm90.SM90_VARIANTS):
        assert name in out


class FakeBuilds:
    """Stands in for build_one: records what would be built, reports success."""

    def __init__(self):
        self.calls = []

    def __call__(self, num_groups, arch, cuobjdump, variant=None):
        self.calls.append((num_groups, arch, variant))
        return {"ok": True, "error": "", "seconds": 0.1, "resources": {"REG": 40, "SHARED": 1024},
                "sass": dict.fromkeys(ev.SASS_OPS, 0), "info": {}}


@pytest.fixture
def fake_builds(monkeypatch):
    builds = FakeBuilds()
    monkeypatch.setattr(ev, "build_one", builds)
    monkeypatch.setattr(ev, "find_cuobjdump", lambda: "cuobjdump")
    return builds


def _kernel_shape(config) -> tuple:
    """What tells two of the tested builds apart: the tile, and a Hopper M-exact build's widths."""
    return tuple(config.tile_mn), getattr(config, "widths", None)


def _runtime_tile(monkeypatch, arch: str, num_sms: int, sizes) -> tuple:
    """The tile (`_kernel_shape`) custom_kernel itself would run (submission.kernel_config) on a GPU of `arch`
    with num_sms SMs."""
    with monkeypatch.context() as patch:
        patch.setattr(submission, "_target_arch", lambda device: arch)
        patch.setattr(submission, "_device_sm_count", lambda index: num_sms)
        return _kernel_shape(submission.kernel_config((None, None, None, sizes), torch.device("cuda", 0)))


@pytest.mark.parametrize("arch,num_sms", [("sm_100a", 148), ("sm_90a", 132)])
def test_compile_builds_each_kernel_the_cases_run_once(tmp_path, capsys, monkeypatch, fake_builds, arch, num_sms):
    # the submission's own defaults: each picks its tile per problem
    monkeypatch.setattr(submission, "KERNEL_VARIANT", "persistent")
    monkeypatch.setattr(submission_sm90, "SM90_VARIANT", "sm90_auto")
    # task.yml's cases and two more whose tiles the B200 model picks otherwise (128x64: 32 tiles of 128x128 on
    # 148 SMs; 128x256: two full rounds of 128x128 at long K): every task.yml shape picks 128x128.
    import yaml
    task = load_task_yml()
    task["tests"] += [dict(m=[128], n=[4096], k=[4096], g=1, seed=1),
                      dict(m=[4736], n=[1024], k=[32768], g=1, seed=2)]
    cases_file = tmp_path / "cases.yml"
    cases_file.write_text(yaml.safe_dump(task))
    report = tmp_path / "report.json"
    rc = ev.compile_main(["--arch", arch, str(cases_file), "--json", str(report)])
    out = capsys.readouterr().out
    assert rc == 0
    cases = ev.load_cases(str(cases_file), "tests") + ev.load_cases(str(cases_file), "benchmarks")
    expected = []  # (groups, tile) per case, from the submission's own run-time choice
    for case in cases:
        sizes = [(m, n, k, 1) for m, n, k in zip(case.args["m"], case.args["n"], case.args["k"])]
        expected.append((case.args["g"], _runtime_tile(monkeypatch, arch, num_sms, sizes)))
    # on sm_100a more than one tile is in play, or this test would not tell a per-case choice from the
    # default (on sm_90a one kernel, M-exact, serves every problem: one build per group count)
    if arch == "sm_100a":
        assert len({tile for _, tile in expected}) >= 2
    built = [(g, variant) for g, build_arch, variant in fake_builds.calls]
    assert all(build_arch == arch for _, build_arch, _ in fake_builds.calls)
    assert len(built) == len(set(built)) == len(set(expected))  # each distinct kernel once
    configs = submission_sm90.SM90_VARIANT_CONFIGS if arch == "sm_90a" else submission.VARIANT_CONFIGS
    assert {(g, _kernel_shape(configs[variant])) for g, variant in built} == set(expected)

    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("kernel") and "status" in line)
    kernel_rows = lines[head + 1:head + 1 + len(built)]
    assert all(" OK " in row for row in kernel_rows) and lines[head + 1 + len(built)] == ""
    case_rows = lines[head + 1 + len(built) + 2:]  # after the blank line and the "kernel case" heading
    assert len(case_rows) == len(cases)
    for case, (g, (tile, widths)), row in zip(cases, expected, case_rows):
        a = case.args
        full_label = f"g={g} m={list(a['m'])} n={list(a['n'])} k={list(a['k'])}"
        assert row.endswith(full_label), row  # never cut mid-number
        # the tile's rows of A: fixed on sm_100a; on sm_90a (sm90_auto takes M-exact tiles for every problem) the
        # build's range of widths
        rows = f"{widths[0]}-{widths[-1]}" if arch == "sm_90a" else tile[0]
        assert f" {rows}x{tile[1]} g={g} " in row, row

    entries = json.loads(report.read_text())
    assert [(e["groups"], tuple(e["tile_mn"])) for e in entries] == [(g, tile) for g, (tile, _) in expected]

    # Regression: the default `persistent` variant's 128x64 builds were labelled `persistent_n64` (and
    # sm90_auto's by the forced variant compile_for builds them as). Every row is the default's; the JSON
    # keeps what each was built as.
    default = "sm90_auto" if arch == "sm_90a" else "persistent"
    assert all(row.startswith(default + " ") for row in kernel_rows + case_rows), kernel_rows
    assert {e["variant"] for e in entries} == {default}
    assert {e["built_as"] for e in entries} == {variant for _, variant in built}
    if arch == "sm_100a":  # the 128x64 row is in play and built as the variant that forces it
        assert "persistent_n64" in {e["built_as"] for e in entries}
        assert not any("persistent_n64" in row for row in kernel_rows + case_rows)


@pytest.mark.parametrize("present", [("tests",), ("benchmarks",), ("tests", "benchmarks")])
def test_compile_reads_the_lists_a_task_file_has(tmp_path, capsys, fake_builds, present):
    entries = {"tests": '  - {"m": [64], "n": [128], "k": [256], "g": 1, "seed": 1}',
               "benchmarks": '  - {"m": [64, 8], "n": [256, 128], "k": [512, 256], "g": 2, "seed": 1}'}
    path = tmp_path / "cases.yml"
    path.write_text("".join(f"{section}:\n{entries[section]}\n" for section in present))
    assert ev.compile_main(["--variant", "seed", str(path)]) == 0
    assert sorted(g for g, _, _ in fake_builds.calls) == sorted({"tests": 1, "benchmarks": 2}[s] for s in present)
    capsys.readouterr()
    path.write_text("other:\n  - 1\n")
    line = in_process_line(capsys, ev.compile_main([str(path)]), 2)
    assert "no 'tests' or 'benchmarks' list" in line, line


@pytest.mark.parametrize("arch", ["sm_100a", "sm_90a"])
def test_compile_takes_a_case_whose_groups_are_all_empty(tmp_path, capsys, fake_builds, arch):
    # custom_kernel launches nothing for it; the B200 tile model had no tile to weigh and raised ValueError
    path = tmp_path / "cases.yml"
    path.write_text('tests:\n  - {"m": [0, 0], "n": [128, 256], "k": [256, 512], "g": 2, "seed": 1}\n')
    assert ev.compile_main(["--arch", arch, str(path)]) == 0, capsys.readouterr()


@pytest.mark.parametrize("mode", ev.RUN_MODES)
def test_mode_help_is_the_mode_s_usage_and_options(mode):
    proc = run("eval.py", mode, "--help")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert proc.stdout.startswith(f"usage: eval.py {mode} [--variants A,B] [-h] [FILE]\n"), proc.stdout[:300]
    assert "--variants" in proc.stdout and "FILE" in proc.stdout and "check_problem_sizes" in proc.stdout
    assert ev.__doc__.splitlines()[0] not in proc.stdout  # not the module docstring
    assert ("'tests' list" if mode == "test" else "'benchmarks' list") in proc.stdout
    # options first, the file later, or the help flag before the mode: the same help
    assert run("eval.py", "--help", mode).stdout.startswith(ev.__doc__.splitlines()[0])  # eval.py --help: all
    assert run("eval.py", "-h", mode).returncode == 0
    assert run("eval.py", mode, "task.yml", "-h").stdout == proc.stdout


@pytest.mark.parametrize("arch", ["sm_100a", "sm_90a"])
def test_compile_table_explains_its_columns_and_shows_only_the_arch_s_own(capsys, monkeypatch, fake_builds, arch):
    # the builds report what a 4.8.x build of either arch reports: the GEMM's SharedStorage as built, and on
    # sm_100a the kernel's own plan besides (the DSL's launch record is 0 there)
    def build(num_groups, build_arch, cuobjdump, variant=None):
        fake_builds(num_groups, build_arch, cuobjdump, variant)
        info = {"shared_storage_bytes": 202752}
        if build_arch == "sm_100a":
            info = {"shared_storage_bytes": 226304, "planned_smem_bytes": 226304, "planned_smem_is_min": False,
                    "tmem_cols": "288/512"}
        return {"ok": True, "error": "", "seconds": 3.25, "resources": {"REG": 40, "SHARED": 1024},
                "sass": dict.fromkeys(ev.SASS_OPS, 1), "info": info}

    monkeypatch.setattr(ev, "build_one", build)
    assert ev.compile_main(["--arch", arch, "--groups", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("kernel") and "status" in line)
    header, row = lines[head].split(), lines[head + 1]
    cells = dict(zip(header[1:], row.split()[-(len(header) - 1):]))  # the label has spaces
    legend = {line.split()[0]: line for line in lines[:head] if line.startswith("  ")}
    for column in header[1:]:  # every column but the kernel's name is explained
        assert column in legend, (column, legend)
    assert "seconds the build took" in legend["s"]
    blackwell_only = {"tmem", "UTCOMMA", "UTCQMMA", "UTCCP"}
    hopper_only = {"HGMMA", "WGDEP1", "PR2UR"}
    assert "kernel" in legend and "the default's name" in legend["kernel"]
    assert "static" in legend["static[B]"] and "SharedStorage" in legend["dynamic[B]"]
    assert "static + dynamic" in legend["smem[B]"]
    if arch == "sm_90a":
        assert not blackwell_only & set(header) and hopper_only <= set(header)
        assert " - " not in row and "?" not in row, row
        # Regression: Hopper rows showed `smem 1024`, the DSL's static part alone (read as 1 KB in all)
        assert (cells["static[B]"], cells["dynamic[B]"], cells["smem[B]"]) == ("1024", "202752", "203776"), row
    else:
        assert blackwell_only <= set(header) and not hopper_only & set(header)
        assert (cells["static[B]"], cells["dynamic[B]"], cells["smem[B]"]) == ("1024", "226304", "227328"), row
        assert cells["tmem"] == "288/512", row


def test_sass_counts_see_a_lane_predicated_r2ur_and_nothing_else():
    # hand-written SASS lines: the plain R2UR under a lane predicate counts (illegal on sm_90a), an
    # unpredicated one, one under the always-true or a uniform predicate, and Blackwell's broadcast form do not
    lines = ["        /*2c10*/              @!P0 R2UR UR18, R2 ;",
             "        /*2cd0*/               @P2 R2UR UR10, R2 ;",
             "        /*26e0*/                   R2UR UR14, R13 ;",
             "        /*26f0*/               @PT R2UR UR15, R13 ;",
             "        /*2700*/              @!UP0 R2UR UR16, R13 ;",
             "        /*0c50*/              @!P1 R2UR.BROADCAST UR4, R15 ;",
             "        /*0c60*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;",
             "        /*0c70*/              @!P1 HGMMA.64x16x16.F32 R24, gdesc[UR8], R24 ;"]
    counts = ev.count_sass("\n".join(lines))
    assert (counts["PR2UR"], counts["WGDEP1"], counts["HGMMA"]) == (2, 1, 1)


def test_sass_counts_see_the_hopper_prefetches_and_scale_pairs():
    # cuobjdump lines of the sm_90a GEMM: the producer's prefetches, a consumer's 16-bit scale loads and the
    # HMUL2s that take their high half (a .reuse flag between register and half), beside lookalikes that
    # do not count: a plain CCTL, a 32-bit LDS, a low half
    lines = ["        /*0ab0*/                   CCTL.E.PF1 [R4] ;",
             "        /*0ac0*/              @P0 CCTL.E.PF1 [R4+0x8] ;",
             "        /*0ad0*/                   CCTL.IVALL ;",
             "        /*0ae0*/                   UTMACCTL.PF [UR8] ;",
             "        /*0af0*/                   LDS.U16 R72, [R21] ;",
             "        /*0b00*/                   LDS R73, [R21+0x80] ;",
             "        /*0b10*/                   HMUL2 R198, R13, R8.H1_H1 ;",
             "        /*0b20*/                   HMUL2 R194, R9, R8.reuse.H1_H1 ;",
             "        /*0b30*/                   HMUL2 R196, R9, R8.H0_H0 ;"]
    counts = ev.count_sass("\n".join(lines))
    assert (counts["PFL1"], counts["TMAPF"], counts["LDS16"], counts["HBCAST1"]) == (2, 1, 1, 2)


# (what a build reports, the static, dynamic and total cells): the kernel's SharedStorage as built comes
# first, then the DSL's launch record (4.3.x), then the kernel's own plan, marked where it is a lower bound
SMEM_REPORTS = [
    ({"shared_storage_bytes": 202752}, ("1024", "202752", "203776")),
    ({"shared_storage_bytes": 202752, "dynamic_smem_bytes": 5, "planned_smem_bytes": 7}, ("1024", "202752", "203776")),
    ({"dynamic_smem_bytes": 37888, "planned_smem_bytes": 37376, "planned_smem_is_min": True},
     ("1024", "37888", "38912")),
    ({"planned_smem_bytes": 37376, "planned_smem_is_min": True}, ("1024", ">=37376", ">=38400")),
    ({"planned_smem_bytes": 226304, "planned_smem_is_min": False}, ("1024", "226304", "227328")),
    ({}, ("1024", "?", "?")),
]


@pytest.mark.parametrize("info,cells", SMEM_REPORTS)
def test_compile_shared_memory_cells(info, cells):
    assert ev.smem_cells({"resources": {"SHARED": 1024}, "info": info}) == cells
    assert ev.smem_cells({"info": info})[::2] == ("?", "?")  # no cubin read: neither static nor the sum


def test_the_build_script_reports_the_kernel_s_shared_storage(tmp_path):
    # build_one's script run against a stand-in DSL and submission: the GEMM's SharedStorage (the kernel
    # object compiled first that has one) is what it reports, as built
    fake = tmp_path / "fake"
    (fake / "cutlass").mkdir(parents=True)
    (fake / "cutlass" / "__init__.py").write_text("")
    (fake / "cutlass" / "cute.py").write_text("def compile(kernel, *args, **kwargs):\n    return kernel\n")
    (fake / "submission.py").write_text(textwrap.dedent("""
        import cutlass.cute as cute
        class Storage:
            @staticmethod
            def size_in_bytes():
                return 202752
        class Gemm:
            shared_storage = Storage
        class Tensormaps:
            pass
        def compile_for(num_groups, arch, *variant):
            cute.compile(Gemm())
            cute.compile(Tensormaps())
            return None
    """))
    proc = subprocess.run([sys.executable, "-c", ev._BUILD_SCRIPT, str(fake), "2", "sm_90a"], capture_output=True,
                          text=True, timeout=600, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    line = next(x for x in proc.stdout.splitlines() if x.startswith("BUILD_RESULT "))
    result = json.loads(line[len("BUILD_RESULT "):])
    assert result["ok"] and result["info"]["shared_storage_bytes"] == 202752, result


def test_compile_groups_leave_the_case_file_alone(tmp_path, capsys, fake_builds):
    cases = tmp_path / "cases.txt"
    cases.write_text("m: [128, 128, 128]; n: [256, 256, 256]; k: [768, 768, 768]; g: 3; seed: 7\n")
    rc = ev.compile_main(["--groups", "1", "16", str(cases)])
    out = capsys.readouterr().out
    assert rc == 0
    assert sorted(g for g, _, _ in fake_builds.calls) == [1, 3, 16]  # the case file's g=3 was read
    assert "g=3 m=[128, 128, 128] n=[256, 256, 256] k=[768, 768, 768]" in out and "g=16 (--groups)" in out
    fake_builds.calls.clear()
    assert ev.compile_main(["--groups", "2,4", str(cases)]) == 0
    assert sorted(g for g, _, _ in fake_builds.calls) == [2, 3, 4]


@pytest.mark.parametrize("arch,variant,setter", [("sm_100a", "seed", "set_variant"),
                                                  ("sm_90a", "sm90_tile128", "set_sm90_variant")])
def test_a_forced_variant_is_built_for_every_case(capsys, fake_builds, arch, variant, setter):
    assert ev.compile_main(["--arch", arch, "--variant", variant, str(ROOT / "task.yml")]) == 0
    groups = {c.args["g"] for s in ("tests", "benchmarks") for c in ev.load_cases(str(ROOT / "task.yml"), s)}
    assert sorted(fake_builds.calls) == [(g, arch, variant) for g in sorted(groups)]
    assert f"{setter}({variant!r})" in capsys.readouterr().out


def test_the_build_tests_build_every_variant_with_expectations():
    import dataclasses
    import types

    import test_build

    assert test_build.SM100_BUILD_VARIANTS == tuple(submission.VARIANT_CONFIGS) == submission.KERNEL_VARIANTS
    assert test_build.SM90_BUILD_VARIANTS == submission_sm90.SM90_VARIANTS and "sm90_auto" in submission_sm90.SM90_VARIANTS
    # a variant added to the submission is built too, without a list to edit
    new_sm100 = dataclasses.replace(submission.SM100_TILE_N128, num_acc_stages=1)
    fake = types.SimpleNamespace(VARIANT_CONFIGS=dict(submission.VARIANT_CONFIGS, persistent_new=new_sm100))
    fake90 = types.SimpleNamespace(SM90_VARIANTS=(*submission_sm90.SM90_VARIANTS, "sm90_new"))
    sm100, sm90 = test_build.build_variants(fake, fake90)
    assert sm100[-1] == "persistent_new" and sm90[-1] == "sm90_new" and sm90[0] == "sm90_auto"
    # every variant has its SASS expectations, from its config's kind; an unknown kind is an error
    for name in submission.KERNEL_VARIANTS:
        expect = test_build.sm100_expectations(submission, name)
        assert expect["tma_store"] == (name != "seed"), (name, expect)
    other = types.SimpleNamespace(VARIANT_CONFIGS={"odd": object()}, Sm100PersistentConfig=type("P", (), {}),
                                  Sm100GemmConfig=type("G", (), {}))
    with pytest.raises(AssertionError, match="odd: no SASS expectations"):
        test_build.sm100_expectations(other, "odd")
    for name, config in submission_sm90.SM90_VARIANT_CONFIGS.items():
        assert test_build.sm90_expectations(config) == dict(pipelined=True, no_spills=True), name
    assert test_build.sm90_expectations(submission_sm90.choose_sm90_config((), 132)) == dict(pipelined=True, no_spills=True)


@pytest.mark.parametrize("width", range(4, 60))
def test_fit_label_never_cuts_inside_a_number(width):
    text = "g=8 m=[80, 176, 128, 72, 64, 248, 96, 160] n=[4096, 4096, 4096, 4096]"
    fitted = ev.fit_label(text, width)
    assert len(fitted) <= width
    if fitted != text:
        kept = fitted.removesuffix("…")
        assert fitted.endswith("…") and text.startswith(kept)
        # the next character of the original is not a digit continuing the last kept one
        assert not (kept[-1:].isdigit() and text[len(kept)].isdigit()), fitted


# ---------------------------------------------------------------------------------------------------------
# Bare eval.py, --variants of either arch
# ---------------------------------------------------------------------------------------------------------
def test_bare_eval_prints_the_modes_and_runs_nothing(capsys, monkeypatch):
    # Regression: bare `python eval.py` ran `test` (on a CPU machine: exit 2 on the GPU check, no word of
    # what to run instead).
    monkeypatch.setattr(ev, "gpu_problem", _refuse_gpu)
    monkeypatch.setattr(ev, "make_pool", _refuse_build)
    assert ev.main([]) == 2  # argparse's status for a missing argument
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert captured.out == "" and lines[0].startswith("usage: python eval.py MODE [FILE]"), captured.err
    listed = [line.split()[0] for line in lines[2:-1]]
    assert listed == [*ev.RUN_MODES, *ev.TOOL_MODES] and lines[1] == "modes:", lines
    assert lines[-1].startswith("eval.py: no mode given") and "python eval.py compile" in lines[-1]
    assert ev.main(["--variants", "seed"]) == 2 and "no mode given" in capsys.readouterr().err  # options alone


def test_bare_eval_in_a_subprocess():
    proc = run("eval.py")
    assert proc.returncode == 2 and proc.stdout == "" and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("usage: python eval.py MODE") and "CUDA" not in proc.stderr, proc.stderr


class InlineRuns(list):
    """Stands in for the spawned workers: the worker's start runs in this process, and each run records the
    variants custom_kernel would then run on, (KERNEL_VARIANT, SM90_VARIANT)."""

    def make_pool(self, initializer, initargs):
        initializer(*initargs)
        return contextlib.nullcontext(None)

    def run(self, pool, tests, *rest, **options):
        self.append((submission.KERNEL_VARIANT, HOPPER.SM90_VARIANT))
        return 0


@pytest.fixture
def inline_runs(monkeypatch):
    runs = InlineRuns()
    monkeypatch.setattr(submission, "KERNEL_VARIANT", "persistent")
    monkeypatch.setattr(HOPPER, "SM90_VARIANT", "sm90_auto")
    monkeypatch.setattr(ev, "gpu_problem", lambda: None)
    monkeypatch.setattr(ev, "make_pool", runs.make_pool)
    for mode in ("human_test", "human_benchmark", "human_profile"):
        monkeypatch.setattr(ev, mode, runs.run)
    return runs


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_variants_take_the_gpu_s_own_arch_s_names_through_its_setter(capsys, monkeypatch, inline_runs, arch):
    # Regression: --variants took B200 names only; comparing Hopper variants needed NVFP4_SM90_VARIANT.
    monkeypatch.setattr(submission, "_target_arch", lambda device: arch)
    names = [name for name in ev.arch_variants(arch) if name not in ("persistent", "sm90_auto")][:2]
    assert len(names) == 2
    assert ev.main(["benchmark", "--variants", ",".join(names)]) == 0
    if arch == "sm_90a":
        assert inline_runs == [("persistent", name) for name in names]
    else:
        assert inline_runs == [(name, "sm90_auto") for name in names]
    out = capsys.readouterr().out
    assert all(f"== kernel variant {name}" in out for name in names)
    assert not any(key.startswith("NVFP4_") for key in os.environ)  # the setters, not the environment


@pytest.mark.parametrize("gpu,name,owner", [("sm_100a", "sm90_a16_mexact", "Hopper (sm_90a)"),
                                            ("sm_90a", "persistent_n64", "B200 (sm_100a)"),
                                            ("sm_80a", "sm90_auto", "Hopper (sm_90a)")])
def test_a_variant_of_the_other_arch_says_which_arch_it_belongs_to(capsys, monkeypatch, inline_runs, gpu, name,
                                                                    owner):
    monkeypatch.setattr(submission, "_target_arch", lambda device: gpu)
    line = in_process_line(capsys, ev.main(["test", "--variants", f"{name}"]), 2)
    assert line.startswith("eval.py: --variants: ") and f"{name!r} is a {owner} kernel variant" in line, line
    assert f"this GPU is {gpu}" in line, line
    if gpu != "sm_80a":  # the names this GPU takes
        assert all(own in line for own in ev.arch_variants(gpu)), line
    assert inline_runs == []


def test_variants_of_both_arches_are_refused_before_the_gpu(capsys, monkeypatch, inline_runs):
    monkeypatch.setattr(ev, "gpu_problem", _refuse_gpu)
    line = in_process_line(capsys, ev.main(["test", "--variants", "seed,sm90_tile128,persistent"]), 2)
    assert "'seed' is a B200 (sm_100a) variant and 'sm90_tile128' a Hopper (sm_90a) one" in line, line
    line = in_process_line(capsys, ev.main(["test", "--variants", "sm90_tile129"]), 2)
    assert "unknown kernel variant 'sm90_tile129'" in line and "sm90_tile128" in line and "seed" in line, line


def test_mode_help_lists_the_variants_of_both_arches(capsys):
    assert ev.main(["test", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert all(name in out for name in (*submission.KERNEL_VARIANTS, *HOPPER.SM90_VARIANTS))
    assert "set_sm90_variant" in out and "GPU's own arch" in out


# ---------------------------------------------------------------------------------------------------------
# export over an existing file
# ---------------------------------------------------------------------------------------------------------
def test_export_refuses_to_overwrite_the_tracked_source(tmp_path):
    # Regression: `eval.py export --variant seed -o submission.py` silently rewrote the tracked source, exit 0.
    # Run in a copy of the project (a git repository where git exists), so that a regression cannot damage
    # this checkout's submission.py.
    for name in ("eval.py", "harness.py", "bringup.py", "submission.py", "task.py"):
        shutil.copy(ROOT / name, tmp_path / name)
    git = shutil.which("git")
    if git:
        subprocess.run([git, "init", "-q", "."], cwd=tmp_path, check=True, timeout=60)
        subprocess.run([git, "add", "submission.py"], cwd=tmp_path, check=True, timeout=60)
    before = (tmp_path / "submission.py").read_bytes()
    proc = subprocess.run([sys.executable, "eval.py", "export", "--variant", "seed", "-o", "submission.py"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={k: v for k, v in os.environ.items() if not k.startswith("NVFP4_")})
    line = one_line(proc, 2)
    assert line.startswith("eval.py export: submission.py exists") and "pass --force" in line, line
    assert ("tracked by git" in line) == bool(git), line
    assert (tmp_path / "submission.py").read_bytes() == before and proc.stdout == ""


def test_export_writes_a_new_file_and_overwrites_only_with_force(tmp_path, capsys):
    import bringup

    out = tmp_path / "sub.py"
    out.write_text("mine\n")
    line = in_process_line(capsys, bringup.export_main(["--variant", "seed", "-o", str(out)]), 2)
    assert f"{out} exists; pass --force" in line and "tracked" not in line, line
    assert out.read_text() == "mine\n"
    assert bringup.export_main(["--variant", "seed", "-o", str(out), "--force"]) == 0
    assert bringup.default_line("b200", "seed") in out.read_text()
    capsys.readouterr()
    line = in_process_line(capsys, bringup.export_main(["--variant", "seed", "-o", str(tmp_path), "--force"]), 2)
    assert "is a directory" in line, line


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_export_names_a_file_git_tracks(tmp_path):
    import bringup

    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True, timeout=60)
    tracked, untracked = tmp_path / "tracked.py", tmp_path / "untracked.py"
    tracked.write_text("")
    untracked.write_text("")
    subprocess.run(["git", "add", "tracked.py"], cwd=tmp_path, check=True, timeout=60)
    assert bringup.overwrite_refusal(tracked) == f"{tracked} exists and is tracked by git"
    assert bringup.overwrite_refusal(untracked) == f"{untracked} exists"
    assert bringup.overwrite_refusal(tmp_path / "new.py") is None


# ---------------------------------------------------------------------------------------------------------
# The derived B200 stage counts
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("field", ["num_ab_stages", "num_c_stages"])
def test_the_derived_b200_stage_counts_cannot_be_passed(field):
    # Regression: Sm100PersistentConfig(num_ab_stages=...) was a bare "unexpected keyword argument"; the
    # counts are properties derived from the shared-memory budget.
    config = submission.SM100_TILE_N64
    with pytest.raises(TypeError, match=re.escape(f"Sm100PersistentConfig({field}=...): the stage counts are derived "
                                                  "from the shared-memory budget")) as raised:
        submission.Sm100PersistentConfig(mma_tiler_mnk=(128, 64, 256), **{field: 3})
    assert all(name in str(raised.value) for name in ("mma_tiler_mnk", "epi_tile_n", "min_c_stages"))
    with pytest.raises(TypeError, match="derived from the shared-memory budget"):
        dataclasses.replace(config, **{field: 3})
    # what sets them still does, and the derivation fills the budget
    assert dataclasses.replace(config, min_c_stages=4).num_c_stages >= 4
    used = config.smem_header_bytes + config.num_ab_stages * config.ab_stage_bytes
    assert used + config.num_c_stages * config.c_stage_bytes <= submission.DYNAMIC_SMEM_BUDGET
    assert submission.DYNAMIC_SMEM_BUDGET - used - config.num_c_stages * config.c_stage_bytes < config.c_stage_bytes


def test_the_tile_table_says_its_stage_counts_are_derived():
    source = (ROOT / "submission.py").read_text()
    table = source[:source.index("SM100_TILE_TABLE = (")]
    comment = table[table.rindex("# Blackwell tile table"):]
    for text in (" ".join(line.lstrip("# ") for line in comment.splitlines()),
                 " ".join(submission.Sm100PersistentConfig.__doc__.split())):
        assert "derived" in text and "from the shared-memory budget" in text, text


# ---------------------------------------------------------------------------------------------------------
# export's output path: where the user said, or one line saying why not
# ---------------------------------------------------------------------------------------------------------
def _exported(variant: str) -> str:
    import bringup

    return bringup.export_text((ROOT / "submission.py").read_text(), variant, submission.KERNEL_VARIANTS,
                               submission_sm90.SM90_VARIANTS)


def test_export_to_dash_writes_the_copy_to_stdout(tmp_path, capsys, monkeypatch):
    # Regression: `-o -` wrote a 160 KB file named '-' and exited 0.
    import bringup

    monkeypatch.chdir(tmp_path)
    assert bringup.export_main(["--variant", "seed", "-o", "-"]) == 0
    captured = capsys.readouterr()
    assert captured.out == _exported("seed") and list(tmp_path.iterdir()) == []
    (line,) = captured.err.splitlines()
    assert line.startswith("eval.py export: wrote submission.py") and line.endswith("to stdout"), line


def test_export_to_dash_in_a_subprocess(tmp_path):
    proc = run("eval.py", "export", "--variant", "seed", "-o", "-")
    assert proc.returncode == 0 and proc.stdout == _exported("seed"), proc.stderr
    assert len(proc.stderr.splitlines()) == 1 and not (ROOT / "-").exists()


@pytest.mark.parametrize("output,pieces", [
    ("", ["-o is empty", "name the file to write", "- for stdout"]),  # was: "-o  is a directory"
    ("newdir/", ["-o newdir/", "no such directory", "ending in '/'"]),  # was: a file named newdir, exit 0
    ("newdir/sub.py", ["-o newdir/sub.py", "directory newdir does not exist"]),
    ("here/", ["-o here/ is a directory"]),  # an existing directory: never written into
    ("here", ["-o here is a directory"]),
    ("sub.py/", ["-o sub.py/", "ending in '/'"]),  # a file's name with a '/': not that file
])
def test_export_refuses_an_output_that_is_no_file_s_name(tmp_path, capsys, monkeypatch, output, pieces):
    import bringup

    monkeypatch.chdir(tmp_path)
    (tmp_path / "here").mkdir()
    (tmp_path / "sub.py").write_text("mine\n")
    for force in ([], ["--force"]):
        line = in_process_line(capsys, bringup.export_main(["--variant", "seed", "-o", output, *force]), 2)
        assert line.startswith("eval.py export: ") and all(piece in line for piece in pieces), line
    assert sorted(path.name for path in tmp_path.iterdir()) == ["here", "sub.py"]  # nothing written
    assert list((tmp_path / "here").iterdir()) == [] and (tmp_path / "sub.py").read_text() == "mine\n"


def test_export_writes_exactly_where_it_is_told(tmp_path, capsys, monkeypatch):
    import bringup

    monkeypatch.chdir(tmp_path)
    (tmp_path / "a" / "b").mkdir(parents=True)
    assert bringup.export_main(["--variant", "seed", "-o", "a/b/copy.py"]) == 0
    assert (tmp_path / "a" / "b" / "copy.py").read_text() == _exported("seed")
    assert [str(path.relative_to(tmp_path)) for path in sorted(tmp_path.rglob("*"))] == ["a", "a/b", "a/b/copy.py"]
    assert capsys.readouterr().out.startswith("wrote a/b/copy.py: ")


def test_export_to_a_name_not_ending_in_py_needs_force(tmp_path, capsys, monkeypatch):
    # Regression: `eval.py export --variant seed -o out/sub.txt` wrote a submission to a .txt file without a word.
    import bringup

    monkeypatch.chdir(tmp_path)
    for name in ("sub.txt", "sub", "sub.py.bak"):
        line = in_process_line(capsys, bringup.export_main(["--variant", "seed", "-o", name]), 2)
        assert line == (f"eval.py export: -o {name} does not end in .py, as a file for the leaderboard must; name a "
                        ".py file, or pass --force to write it anyway"), line
    assert list(tmp_path.iterdir()) == []
    assert bringup.export_main(["--variant", "seed", "-o", "sub.txt", "--force"]) == 0
    assert (tmp_path / "sub.txt").read_text() == _exported("seed")


def test_export_to_a_name_not_ending_in_py_in_a_subprocess(tmp_path):
    line = one_line(run("eval.py", "export", "--variant", "seed", "-o", tmp_path / "sub.txt"), 2)
    assert "does not end in .py" in line and "--force" in line and list(tmp_path.iterdir()) == []


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs git and a checkout")
def test_the_readme_s_export_examples_write_git_ignored_files():
    # Regression: the README's `eval.py export --variant seed -o sub_seed.py` left sub_seed.py untracked in
    # the repository root.
    outputs = re.findall(r"eval\.py export --variant \w+ -o (\S+)", (ROOT / "README.md").read_text())
    assert outputs
    for output in outputs:
        proc = subprocess.run(["git", "check-ignore", "-q", output], cwd=ROOT, timeout=60)
        assert proc.returncode == 0, f"{output} is not git-ignored"


# ---------------------------------------------------------------------------------------------------------
# Flag spellings: --variant (compile, export) and --variants (the run modes, bringup)
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv,right", [
    (["compile", "--variants", "seed"], "--variant"),
    (["export", "--variants", "seed", "-o", "x.py"], "--variant"),  # not argparse's "--variant is required"
    (["export", "--variants=seed", "-o", "x.py"], "--variant"),
    (["compile", "--grups", "2"], "--groups"),
])
def test_a_near_miss_flag_names_the_right_one(tmp_path, capsys, monkeypatch, argv, right):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(ev, "build_one", _refuse_build)
    line = in_process_line(capsys, _exit_code(ev.main, argv), 2)
    wrong = argv[1].split("=")[0]
    assert line == f"eval.py {argv[0]}: unrecognized option {wrong}: did you mean {right}? (--help for usage)", line
    assert list(tmp_path.iterdir()) == []


def test_a_near_miss_flag_in_a_subprocess():
    line = one_line(run("eval.py", "compile", "--variants", "persistent_n64"), 2)
    assert "did you mean --variant?" in line


@pytest.mark.parametrize("spelling", ["--variants", "--variant"])
def test_the_run_modes_and_bringup_take_both_spellings(capsys, monkeypatch, spelling):
    import bringup

    monkeypatch.setattr(ev, "gpu_problem", _refuse_gpu)
    line = in_process_line(capsys, ev.main(["test", spelling, "nonsense"]), 2)
    assert "--variants: unknown kernel variant 'nonsense'" in line, line
    line = in_process_line(capsys, bringup.bringup_main([spelling, "nonsense"]), 2)
    assert "--variants: 'nonsense': not a variant" in line, line


def test_the_run_modes_document_the_other_spelling(capsys):
    assert ev.main(["benchmark", "--help"]) == 0
    assert "--variant is the same option" in " ".join(capsys.readouterr().out.split())


# ---------------------------------------------------------------------------------------------------------
# compile: a forced tile that does not divide a case's N; the stage counts
# ---------------------------------------------------------------------------------------------------------
def test_compile_marks_the_cases_a_forced_tile_cannot_run(tmp_path, capsys, fake_builds):
    # Regression: `compile --variant persistent_n256` listed the N = 128 and N = 384 cases as run by 128x256
    # tiles (partial N tiles are never built; bringup calls them not applicable) and built for them.
    report = tmp_path / "report.json"
    assert ev.compile_main(["--variant", "persistent_n256", str(ROOT / "task.yml"), "--json", str(report)]) == 0
    cases = ev.load_cases(str(ROOT / "task.yml"), ("tests", "benchmarks"))
    runs = [c for c in cases if all(n % 256 == 0 for n in c.args["n"])]
    assert 0 < len(runs) < len(cases)
    assert sorted({g for g, _, _ in fake_builds.calls}) == sorted({c.args["g"] for c in runs})
    out = capsys.readouterr().out
    assert f"{len(cases) - len(runs)} cases not applicable: persistent_n256 forces 256-wide tiles" in out
    case_rows = out.split("\nkernel", 2)[2].splitlines()[1:]
    assert len(case_rows) == len(cases)
    for case, row in zip(cases, case_rows):
        if case in runs:
            assert row.startswith("persistent_n256 128x256 ") and row.endswith(ev._short(case)), row
        else:
            assert row.startswith("n/a ") and "not applicable: persistent_n256 forces 256-wide tiles" in row, row
    entries = json.loads(report.read_text())
    assert [e["case"] for e in entries] == [ev._short(c) for c in cases]
    for case, entry in zip(cases, entries):
        assert ("not_applicable" in entry) == (case not in runs), entry
        assert entry["groups"] == case.args["g"]


def test_compile_builds_nothing_where_no_case_fits_the_forced_tile(tmp_path, capsys, fake_builds):
    cases = tmp_path / "cases.txt"
    cases.write_text("m: [64]; n: [128]; k: [256]; g: 1; seed: 1\n")
    assert ev.compile_main(["--variant", "persistent_n256", str(cases)]) == 0
    assert fake_builds.calls == []
    assert "1 case not applicable" in capsys.readouterr().out


@pytest.mark.parametrize("arch,variant", [("sm_100a", None), ("sm_100a", "persistent_n64"), ("sm_100a", "seed"),
                                          ("sm_90a", None), ("sm_90a", "sm90_a16_pairs")])
def test_compile_shows_each_kernel_s_stage_counts(tmp_path, capsys, fake_builds, arch, variant):
    # Regression: the B200 stage counts (5 A/B and 5 C stages at 128x128) showed only through
    # ev.kernel_resources(), which only docs/B200_DESIGN.md named.
    report = tmp_path / "report.json"
    argv = ["--arch", arch, "--groups", "2", str(ROOT / "task.yml"), "--json", str(report)]
    assert ev.compile_main(argv + (["--variant", variant] if variant else [])) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert any(line.startswith("  stages ") for line in lines)
    head = next(i for i, line in enumerate(lines) if line.startswith("kernel") and "status" in line)
    column = lines[head].split().index("stages") - len(lines[head].split())  # from the right: labels have spaces
    for entry in json.loads(report.read_text()):
        if arch == "sm_100a":
            planned = ev.kernel_resources(entry["built_as"])
            expected = {"ab_stages": planned["ab_stages"], "c_stages": planned.get("c_stages")}
        else:
            config = submission_sm90.SM90_VARIANT_CONFIGS[entry["built_as"]]
            gemm = submission_sm90.Sm90BlockScaledGroupedGemmKernel(entry["groups"], config)
            expected = {"ring_stages": gemm.num_stages, "a16_buffers": gemm.num_a16}
        assert entry["stages"] == expected, entry
        (row,) = [line for line in lines[head + 1:] if line.startswith(entry["kernel"] + " ") and " OK " in line]
        assert row.split()[column] == "/".join("-" if v is None else str(v) for v in expected.values()), row
    if arch == "sm_100a" and variant is None:  # the figures the design document quotes for 128x128
        assert entry["stages"] == {"ab_stages": 5, "c_stages": 5}
    if variant == "seed":
        assert entry["stages"] == {"ab_stages": 1, "c_stages": None}


# ---------------------------------------------------------------------------------------------------------
# The modules that are no command of their own, run by themselves; a variable of the other arch
# ---------------------------------------------------------------------------------------------------------
def test_bringup_py_run_by_itself_points_to_eval_py():
    # Regression: `python bringup.py` printed nothing and exited 0.
    proc = run("bringup.py", "--quick")
    line = one_line(proc, 2)
    assert line.startswith("bringup.py: ") and "python eval.py bringup" in line and "eval.py export" in line
    assert proc.stdout == ""


# The other modules that are no command of their own, and what each names to run instead. Regression (issue 55):
# bench_moe.py, bench_serving.py and moe.py, with or without --help, printed nothing and exited 0.
NOT_COMMANDS = {"bringup.py": "python eval.py bringup", "bench_moe.py": "python bench.py --moe",
                "bench_serving.py": "python bench.py --moe --serving", "moe.py": "import nvfp4_moe"}


@pytest.mark.parametrize("script", NOT_COMMANDS)
def test_a_module_run_by_itself_says_where_to_start(script):
    proc = run(script)
    line = one_line(proc, 2)
    assert line.startswith(f"{script}: ") and NOT_COMMANDS[script] in line and proc.stdout == "", line
    helped = run(script, "--help")
    assert (helped.returncode, helped.stdout, helped.stderr) == (0, line + "\n", "")


@pytest.mark.parametrize("variable,value,other", [("NVFP4_KERNEL_VARIANT", "sm90_auto", "NVFP4_SM90_VARIANT"),
                                                  ("NVFP4_KERNEL_VARIANT", "sm90_x", "NVFP4_SM90_VARIANT"),
                                                  ("NVFP4_SM90_VARIANT", "persistent", "NVFP4_KERNEL_VARIANT")])
def test_a_variant_in_the_other_arch_s_variable_names_the_right_one(variable, value, other):
    # Regression: NVFP4_KERNEL_VARIANT=sm90_auto failed the import with the B200 names only, no word of
    # NVFP4_SM90_VARIANT.
    own = submission.KERNEL_VARIANTS if variable == "NVFP4_KERNEL_VARIANT" else submission_sm90.SM90_VARIANTS
    line = one_line(run("eval.py", "test", env={variable: value}), 2)
    assert f"{variable}={value!r}" in line and f"set with {other}, not {variable}" in line, line
    assert all(name in line for name in own), line
    # importing the module itself: a traceback, whose last line says the same
    module = "submission" if variable == "NVFP4_KERNEL_VARIANT" else "submission_sm90"
    env = {k: v for k, v in os.environ.items() if not k.startswith("NVFP4_")}
    proc = subprocess.run([sys.executable, "-c", f"import {module}"], cwd=ROOT, env=dict(env, **{variable: value}),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0 and f"set with {other}, not {variable}" in proc.stderr.splitlines()[-1], proc.stderr


def test_a_name_of_neither_arch_lists_the_variable_s_own_names(monkeypatch):
    other = ("NVFP4_SM90_VARIANT", "Hopper (sm90_*)", lambda name: name.startswith("sm90_"))
    monkeypatch.setenv("NVFP4_KERNEL_VARIANT", "bogus")
    with pytest.raises(ValueError) as raised:
        submission._choice_from_env("NVFP4_KERNEL_VARIANT", "x", ("x", "y"), other)
    assert str(raised.value) == "NVFP4_KERNEL_VARIANT='bogus': choose one of x, y"
    monkeypatch.setenv("NVFP4_KERNEL_VARIANT", "y")
    assert submission._choice_from_env("NVFP4_KERNEL_VARIANT", "x", ("x", "y"), other) == "y"


# ---------------------------------------------------------------------------------------------------------
# pytest -m build says what it builds
# ---------------------------------------------------------------------------------------------------------
def test_a_build_test_names_itself_on_the_terminal_under_q(tmp_path):
    # Regression: `pytest -m build` printed only dots for minutes.
    (tmp_path / "test_probe.py").write_text(textwrap.dedent("""
        import pytest

        def test_plain():
            pass

        @pytest.mark.build
        @pytest.mark.parametrize("variant", ["persistent_n64"])
        def test_sm100a_probe(variant):
            pass
    """))
    env = {k: v for k, v in os.environ.items() if not k.startswith("NVFP4_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests"), str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider",
                           "-W", "ignore::pytest.PytestUnknownMarkWarning", "test_probe.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    announced = [line for line in proc.stdout.splitlines() if "building: " in line]
    assert len(announced) == 1 and announced[0].startswith("building: "), proc.stdout  # a line of its own
    assert "test_probe.py::test_sm100a_probe[persistent_n64]" in announced[0] and "nvidia-cutlass-dsl" in announced[0]


# ---------------------------------------------------------------------------------------------------------
# A real build (minutes on a small CPU; marked build)
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.build
@pytest.mark.skipif(importlib.util.find_spec("cutlass") is None, reason="needs nvidia-cutlass-dsl")
@pytest.mark.skipif(ev.find_cuobjdump() is None, reason="needs cuobjdump (nvidia-cuda-cuobjdump)")
def test_compile_builds_the_case_kernel_and_the_extra_group_count(tmp_path, monkeypatch):
    cases = tmp_path / "cases.txt"
    cases.write_text("m: [128]; n: [256]; k: [768]; g: 1; seed: 7\n")
    tile, _ = _runtime_tile(monkeypatch, "sm_100a", 148, [(128, 256, 768, 1)])
    report = tmp_path / "report.json"
    proc = run("eval.py", "compile", cases, "--groups", "2", "--json", report)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stdout[-3000:] + proc.stderr[-3000:]
    entries = json.loads(report.read_text())
    assert [(e["groups"], tuple(e["tile_mn"])) for e in entries] == [(1, tile), (2, (128, 128))]
    for entry in entries:
        assert entry["ok"] and entry["sass"]["UTCOMMA"] > 0 and entry["sass"]["LDL"] == 0, entry
    rows = [line for line in proc.stdout.splitlines() if " OK " in line]
    assert len(rows) == 2 and rows[0].startswith(entries[0]["kernel"]) and rows[1].startswith(entries[1]["kernel"])
    for entry in entries:  # the kernel's SharedStorage as built is its own plan, beside the DSL's static part
        planned = ev.kernel_resources(entry["built_as"])["smem_bytes"]
        assert entry["info"]["shared_storage_bytes"] == planned, entry["info"]
        static = entry["resources"]["SHARED"]
        assert entry["smem"] == dict(static=str(static), dynamic=str(planned), total=str(static + planned))


@pytest.mark.build
@pytest.mark.skipif(importlib.util.find_spec("cutlass") is None, reason="needs nvidia-cutlass-dsl")
@pytest.mark.skipif(ev.find_cuobjdump() is None, reason="needs cuobjdump (nvidia-cuda-cuobjdump)")
def test_compile_shows_the_hopper_kernel_s_dynamic_shared_memory(tmp_path):
    # Regression: Hopper rows showed `smem 1024`, the DSL's static part only.
    cases = tmp_path / "cases.txt"
    cases.write_text("m: [128]; n: [256]; k: [768]; g: 1; seed: 7\n")
    report = tmp_path / "report.json"
    proc = run("eval.py", "compile", "--arch", "sm_90a", cases, "--json", report)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stdout[-3000:] + proc.stderr[-3000:]
    (entry,) = json.loads(report.read_text())
    assert entry["ok"] and entry["variant"] == "sm90_auto", entry
    # the stage ring, the fp16 A buffers and two 16 KB epilogue slabs: far more than 1 KiB, within the budget
    dynamic, static = entry["info"]["shared_storage_bytes"], entry["resources"]["SHARED"]
    assert 128 * 1024 < dynamic <= submission.DYNAMIC_SMEM_BUDGET, entry["info"]
    assert entry["smem"] == dict(static=str(static), dynamic=str(dynamic), total=str(static + dynamic))
    (row,) = [line for line in proc.stdout.splitlines() if " OK " in line]
    assert row.startswith("sm90_auto ") and f" {static} {dynamic} {static + dynamic} " in " ".join(row.split()) + " "
