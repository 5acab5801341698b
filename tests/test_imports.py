"""The repository's modules import one another without a circle: harness.py holds what eval.py, bringup.py and
bench.py share, so that bringup never needs eval (issue 17)."""
import ast
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT

# The repository's top-level modules (installed or not: pyproject.toml installs only the kernel files and nvfp4_moe)
LOCAL = tuple(sorted(path.stem for path in ROOT.glob("*.py")))


def imports_in(source: str) -> set:
    """The modules `source` imports anywhere (top level or inside a function), by statement or by
    importlib.import_module / __import__ of a literal name."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and getattr(node.func, "attr", getattr(node.func, "id", None)) in ("import_module", "__import__")):
            found.add(node.args[0].value.split(".")[0])
    return found


def imports_of(module: str) -> set:
    """The local modules `module` imports anywhere in its file."""
    return imports_in((ROOT / f"{module}.py").read_text()) & set(LOCAL) - {module}


def find_cycle(graph: dict):
    """A list of modules that import one another in a circle, or None."""
    state = {}

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt, path + [nxt])
                if cycle:
                    return cycle
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state:
            cycle = visit(start, [start])
            if cycle:
                return cycle
    return None


def test_the_module_list_is_the_repository_s():
    assert {"harness", "eval", "bringup", "bench", "submission", "reference"} <= set(LOCAL)
    assert all((ROOT / f"{m}.py").exists() for m in LOCAL)


def test_no_import_circle_among_the_modules():
    graph = {module: imports_of(module) for module in LOCAL}
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))
    assert "eval" not in graph["bringup"] and "eval" not in graph["harness"] and "bringup" not in graph["harness"]
    assert "eval" not in graph["bench"]


def test_an_import_by_name_counts():
    # Regression: bringup.py reached eval.py through importlib.import_module("eval").find_cuda_tool(...), which
    # this test's import statements alone did not see: eval and bringup imported each other.
    assert imports_in('import importlib\ndef f():\n    return importlib.import_module("eval").x') >= {"eval"}
    assert imports_in('from importlib import import_module\nimport_module("bringup.sub")') >= {"bringup"}
    assert imports_in('__import__("harness")') >= {"harness"}
    assert imports_in("import importlib\nimportlib.import_module(name)") == {"importlib"}  # not a literal


def test_find_cycle_sees_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("module", ["harness", "bringup", "eval", "bench", "bench_moe"])
def test_each_module_imports_alone_in_a_fresh_interpreter(module):
    # What importing it pulls in of the others, at import time (function-level imports come later, if ever).
    probe = (f"import sys, json; sys.path.insert(0, {str(ROOT)!r}); import {module}; "
             f"print(json.dumps(sorted(m for m in sys.modules if m in {list(LOCAL)!r})))")
    env = {k: v for k, v in os.environ.items() if not k.startswith("NVFP4_")}
    proc = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = set(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert module in loaded
    if module != "eval":
        assert "eval" not in loaded, loaded
    if module in ("harness", "bench", "bench_moe"):
        assert "bringup" not in loaded, loaded


# pyproject.toml installs these (tests/test_wheel.py builds the wheel); the package's own modules are under nvfp4_moe/
INSTALLED = ("submission", "submission_sm90")


def test_what_is_installed_imports_nothing_that_is_not():
    # In an engine's environment the repository's tools (utils, task, reference, ...) are absent: an import of one
    # fails there. submission.py's `from task import ...` is guarded (its names fall back to plain TypeVars).
    files = [ROOT / f"{module}.py" for module in INSTALLED] + sorted((ROOT / "nvfp4_moe").glob("*.py"))
    for path in files:
        allowed = set(INSTALLED) | ({"task"} if path.stem == "submission" else set())
        outside = (imports_in(path.read_text()) & set(LOCAL)) - allowed
        assert not outside, f"{path.relative_to(ROOT)} imports {sorted(outside)}, which pip install does not install"


@pytest.mark.parametrize("module", ["submission", "submission_sm90", "task", "reference", "utils", "harness", "eval",
                                    "bringup"])
def test_the_leaderboard_files_never_need_the_package(module):
    assert not imports_in((ROOT / f"{module}.py").read_text()) & {"nvfp4_moe", "moe"}
