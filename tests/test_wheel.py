"""The library as an engine installs it (issue 55): the wheel built from this checkout, put into a fresh virtual
environment and imported from another folder. `import nvfp4_moe` registers the torch ops; a fake-tensor trace
(torch.compile with fullgraph, on meta tensors: shapes only) of the entry and of the layer reaches them; the wheel
holds the package and the two kernel files only, no generic top-level name. The same for `pip install -e`.

No GPU and no network: the wheel is built without build isolation (setuptools>=70.1, in the test extra), and the
fresh environment sees this one's packages (torch, the DSL) through a .pth file, appended after its own
site-packages, so that what was installed there is what imports.
"""
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import ROOT

pytestmark = pytest.mark.wheel

# The top-level names pip install puts in site-packages (pyproject.toml's [tool.setuptools])
TOP_LEVEL = {"nvfp4_moe", "submission", "submission_sm90"}
# The repository's tools: generic names, which in an engine's environment would collide with other packages'
GENERIC = ("utils", "task", "eval", "reference", "harness", "bench", "bench_moe", "bench_serving", "bringup", "moe")
# The ops `import nvfp4_moe` registers: the entry's and the layer's
OPS = ("mm", "mm_out", "layer", "layer_out")

# Run by the fresh environment's Python from the file system's root; prints one JSON line.
PROBE = r'''
import importlib.util, json, sys
import torch
import nvfp4_moe
import submission, submission_sm90

report = dict(files={m.__name__: m.__file__ for m in (nvfp4_moe, submission, submission_sm90)},
              on_import=[name for name in OPS if hasattr(torch.ops.nvfp4_moe, name)])
report["generic"] = {name: getattr(importlib.util.find_spec(name), "origin", None) for name in GENERIC}


def trace(fn, *args):
    """The graph's calls and the output's shape: torch.compile traces fn with fake tensors, then runs the graph on
    meta tensors (the ops' fake implementations)."""
    calls = []

    def backend(gm, example_inputs):
        calls.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    out = torch.compile(fn, fullgraph=True, backend=backend)(*args)
    return dict(calls=calls, shape=list(out.shape), dtype=str(out.dtype))


meta = dict(device="meta")
u8 = lambda *shape: torch.empty(*shape, dtype=torch.uint8, **meta)
e4m3 = lambda *shape: torch.empty(*shape, dtype=torch.float8_e4m3fn, **meta)
f32 = lambda *shape: torch.empty(*shape, dtype=torch.float32, **meta)
T, E, H, I, K = 16, 8, 256, 256, 2  # tokens, experts, hidden, intermediate, top-k
b, b_scale = nvfp4_moe.prepare_moe_weights(u8(E, 2 * I, H // 2), e4m3(E, 2 * I, H // 16))
offs = torch.empty(E, dtype=torch.int32, **meta)
report["entry"] = trace(nvfp4_moe.nvfp4_moe_mm, u8(T * K, H // 2), e4m3(T * K, H // 16), b, b_scale, offs, f32(E))
# vLLM's checkpoint tensors: w13_weight [E, 2I, H/2], w13_weight_scale [E, 2I, H/16], w2 likewise, alphas [E]
weights = nvfp4_moe.prepare_moe_layer(u8(E, 2 * I, H // 2), e4m3(E, 2 * I, H // 16), u8(E, H, I // 2),
                                      e4m3(E, H, I // 16), f32(E), f32(E))
x = torch.empty(T, H, dtype=torch.bfloat16, **meta)
topk_ids = torch.empty(T, K, dtype=torch.int32, **meta)
report["layer"] = trace(nvfp4_moe.nvfp4_moe_layer, x, topk_ids, f32(T, K), weights, f32(()), f32(()))
print(json.dumps(report))
'''


def _run(argv, **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(arg) for arg in argv], capture_output=True, text=True, timeout=600, **kwargs)
    assert proc.returncode == 0, f"{' '.join(map(str, argv))}: exit {proc.returncode}\n{proc.stdout[-3000:]}" \
                                 f"\n{proc.stderr[-3000:]}"
    return proc


def _clean_env() -> dict:
    return {k: v for k, v in os.environ.items()
            if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP") and not k.startswith(("NVFP4_", "POPCORN_"))}


def _needs_setuptools():
    try:
        version = importlib.metadata.version("setuptools")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("building the wheel without network needs setuptools>=70.1 (pip install -e '.[test]')")
    if tuple(int(x) for x in re.findall(r"\d+", version)[:2]) < (70, 1):
        pytest.skip(f"setuptools {version}: the wheel is built with setuptools>=70.1 (pip install -e '.[test]')")


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """What setuptools reads of the checkout (pyproject.toml, README.md, every top-level module and package), in a
    folder of its own: the build's files (build/, *.egg-info) stay out of the checkout."""
    _needs_setuptools()
    dest = tmp_path_factory.mktemp("source")
    for path in ROOT.iterdir():
        if path.is_file() and (path.suffix == ".py" or path.name in ("pyproject.toml", "README.md")):
            shutil.copy2(path, dest / path.name)
        elif path.is_dir() and (path / "__init__.py").is_file():
            shutil.copytree(path, dest / path.name, ignore=shutil.ignore_patterns("__pycache__"))
    return dest


@pytest.fixture(scope="module")
def wheel(source, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w", out,
          source], env=_clean_env())
    (built,) = out.glob("*.whl")
    return built


def wheel_top_level(path: Path) -> set:
    """The top-level names a wheel installs: its files' first path parts (a module's without .py), data and
    metadata folders left out."""
    with zipfile.ZipFile(path) as archive:
        firsts = {name.split("/")[0] for name in archive.namelist()}
    return {re.sub(r"\.py$", "", first) for first in firsts if not first.endswith((".dist-info", ".data"))}


def fresh_venv(path: Path) -> tuple:
    """(python, site-packages) of a new virtual environment without pip, which also sees this environment's
    packages (after its own): a .pth file lists this interpreter's sys.path entries that the new one lacks, the
    checkout itself left out."""
    _run([sys.executable, "-m", "venv", "--without-pip", path])
    python = path / "bin" / "python"
    query = "import json, sys, sysconfig; print(json.dumps([sys.path, sysconfig.get_paths()['purelib']]))"
    own, site_packages = json.loads(_run([python, "-I", "-c", query]).stdout)
    ours = json.loads(_run([sys.executable, "-I", "-c", query]).stdout)[0]
    parent = [p for p in ours if p and p not in own and Path(p).is_dir() and Path(p).resolve() != ROOT]
    (Path(site_packages) / "_test_parent_environment.pth").write_text("\n".join(parent) + "\n")
    return python, Path(site_packages)


def probe(python: Path) -> dict:
    """PROBE's report, run by `python` from the file system's root (no project file beside it)."""
    code = f"OPS = {OPS!r}\nGENERIC = {GENERIC!r}\n{PROBE}"
    proc = _run([python, "-c", code], cwd=Path(os.path.abspath(os.sep)), env=_clean_env())
    return json.loads(proc.stdout.strip().splitlines()[-1])


def check_report(report: dict, installed_in: Path):
    for module, file in report["files"].items():
        assert Path(file).resolve().is_relative_to(installed_in.resolve()), (module, file, installed_in)
    for name, origin in report["generic"].items():  # another package's module of that name is not ours
        assert origin is None or not Path(origin).resolve().is_relative_to(installed_in.resolve()), (name, origin)
    assert report["on_import"] == list(OPS), report["on_import"]
    entry = report["entry"]
    assert [call.split(".")[:2] for call in entry["calls"]] == [["nvfp4_moe", "mm"]], entry
    assert entry["shape"] == [32, 512] and entry["dtype"] == "torch.bfloat16", entry
    layer = report["layer"]
    assert [call.split(".")[:2] for call in layer["calls"]] == [["nvfp4_moe", "layer"]], layer
    assert layer["shape"] == [16, 256] and layer["dtype"] == "torch.bfloat16", layer


def test_the_wheel_holds_the_package_and_the_kernel_files_only(wheel):
    names = wheel_top_level(wheel)
    print(f"\n{wheel.name}: top-level names {sorted(names)}")
    assert not names & set(GENERIC), f"generic top-level modules in the wheel: {sorted(names & set(GENERIC))}"
    assert names == TOP_LEVEL, sorted(names)


def test_the_wheel_imports_from_a_fresh_environment(wheel, tmp_path):
    python, site_packages = fresh_venv(tmp_path / "venv")
    _run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target", site_packages, wheel],
         env=_clean_env())
    report = probe(python)
    print(f"\nfrom {os.path.abspath(os.sep)}: {json.dumps(report)}")
    check_report(report, site_packages)


def test_an_editable_install_imports_from_a_fresh_environment(source, tmp_path):
    python, _ = fresh_venv(tmp_path / "venv")
    _run([python, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", "--ignore-installed", "-q",
          "-e", source], env=_clean_env())
    report = probe(python)
    print(f"\nfrom {os.path.abspath(os.sep)}: {json.dumps(report)}")
    check_report(report, source)
