"""compute-sanitizer's racecheck, synccheck and memcheck on the Hopper kernel, multi-group inputs, every kept
Hopper variant, the two-launch form and the MoE entry's builds and preparation kernel (tests/sanitize_case.py is the workload; each tool runs it on
each variant in a process of its own).

Fails on any reported hazard or error, or on a wrong result. Skipped without an sm_90 GPU, the DSL, or
compute-sanitizer. memcheck does not count host API errors (`--report-api-errors no`): DSL 4.8's own driver
probing returns invalid-value from cuGetProcAddress once per compile; device-side errors are what it is for.
"""
import re
import subprocess
import sys
from pathlib import Path

import pytest

import eval as ev
from conftest import cuda_capability

ROOT = Path(__file__).resolve().parent.parent
try:
    import cutlass  # noqa: F401
    HAVE_DSL = True
except ImportError:
    HAVE_DSL = False


SANITIZER = ev.find_cuda_tool("compute-sanitizer")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not (cuda_capability() == (9, 0) and HAVE_DSL),
                                 reason="needs an sm_90 GPU and the DSL"),
              pytest.mark.skipif(SANITIZER is None, reason="compute-sanitizer not found")]

TOOLS = {
    "racecheck": ["--tool", "racecheck", "--racecheck-report", "hazard"],
    "synccheck": ["--tool", "synccheck"],
    "memcheck": ["--tool", "memcheck", "--report-api-errors", "no"],
}


def _variants():
    if not HAVE_DSL:
        return []
    import submission_sm90

    # with the configs that change one field of a variant, but not "whole_tiles" (the kernel is sm90_a16_mexact's)
    # moe, moe16: the MoE entry (moe.py) with NVFP4 A and with bf16 A (W4A16); layer, layer16: the MoE layer's
    # stage kernels and GEMMs, fp4-A paths and W4A16
    return [*submission_sm90.SM90_VARIANT_CONFIGS, "two_launch", "moe", "moe16", "layer", "layer16"]


# One tool on one variant per test, so that a run can spread them over processes (`pytest -n`, or shards).
@pytest.mark.parametrize("variant", _variants())
@pytest.mark.parametrize("tool", list(TOOLS))
def test_sanitizer_clean(tool, variant):
    cmd = [SANITIZER, *TOOLS[tool], "--error-exitcode", "97", sys.executable,
           str(ROOT / "tests" / "sanitize_case.py"), variant]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    log = proc.stdout + proc.stderr
    tail = "\n".join(log.splitlines()[-40:])
    assert "WRONG" not in log, tail
    # racecheck ends with "RACECHECK SUMMARY: N hazards displayed (E errors, W warnings)", the others with
    # "ERROR SUMMARY: N errors"
    pattern = r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) error" if tool == "racecheck" else \
        r"ERROR SUMMARY: (\d+) error"
    summary = re.search(pattern, log)
    assert summary is not None, f"no sanitizer summary (rc {proc.returncode}):\n{tail}"
    # the summary line, for the report (`pytest -rA` or `-s` shows it)
    print(f"{tool} on {variant}: " + next(line.strip() for line in log.splitlines() if summary.group(0) in line))
    assert all(int(n) == 0 for n in summary.groups()), tail
    assert proc.returncode == 0, tail
