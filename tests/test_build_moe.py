"""The MoE entry's kernels (nvfp4_moe/gemm.py) build without a GPU, on every DSL version CI installs, and their SASS is sane.
sm_90a: the per-call preparation kernel and the GEMM of each build the entry picks, with the MoE switches
(alpha, bf16 out; 16-bit A, W4A16, in bf16 and fp16): the GEMM's wgmma waits pipelined and no local memory in either,
neither waits on another CTA (no acquiring load: no grid-wide barrier); the preparation kernel converts NVFP4 A
(the row-major scales), writes its work-list parts with 128-bit stores and makes no wgmma. sm_100a (never run: no
B200 here): the preparation kernel (tables, blocked A scales, descriptors, the tile count) and the persistent
kernel with the MoE switches: block-scaled tcgen05 MMAs, TMA loads and stores, alpha's multiplies, bf16
conversions where C is bf16, no local memory."""
import json
import os
import subprocess
import sys

import pytest

import eval as ev
from conftest import ROOT, build_test_marks

pytestmark = build_test_marks()

_SCRIPT = r"""
import dataclasses, json, sys
sys.path.insert(0, sys.argv[1])
import nvfp4_moe.gemm as moe
import torch
experts, n, k, build, bf16 = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6] == "1"
a_input = sys.argv[8]
if build == "b200":
    config = moe.b200_config(torch.bfloat16 if bf16 else torch.float16)
else:
    config = moe._hopper_config(build, torch.bfloat16 if bf16 else torch.float16, a_input)
try:
    moe._compile(sys.argv[7], experts, n, k, config, 132)
except Exception as err:  # 4.3.x without a driver: the cubin is written, then loading it fails
    if "CudaDriverDependencyError" not in repr(err) and "CUDA Driver Dependency" not in str(err):
        raise
print("MOE_BUILT " + json.dumps(getattr(config, "widths", ())))
"""


@pytest.mark.parametrize("experts, n, k, build, bf16, a_input", [
    (256, 512, 1024, "pairs", True, "fp4"), (128, 384, 768, "narrow", False, "fp4"), (32, 256, 512, "wide", True, "fp4"),
    (256, 512, 1024, "pairs", True, "bf16"), (32, 256, 512, "wide", False, "f16")])
def test_moe_kernels_build_for_sm90a(tmp_path, experts, n, k, build, bf16, a_input):
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_DUMP_DIR=str(tmp_path), CUTE_DSL_KEEP="cubin,ptx",
               CUTE_DSL_KEEP_CUBIN="1", CUTE_DSL_KEEP_PTX="1", CUTE_DSL_DISABLE_FILE_CACHING="1")
    print(f"building the MoE entry's {build} build for sm_90a: E={experts} N={n} K={k}, A {a_input}", flush=True)
    # one process per kernel: after 4.3.x fails to load one without a driver, its JIT session loads no other
    for kind in ("prepare", "gemm"):
        proc = subprocess.run([sys.executable, "-c", _SCRIPT, str(ROOT), str(experts), str(n), str(k), build,
                               "1" if bf16 else "0", kind, a_input], env=env, capture_output=True, text=True,
                              timeout=1800)
        assert "MOE_BUILT" in proc.stdout, proc.stderr[-3000:]
    widths = json.loads(proc.stdout.split("MOE_BUILT ")[1])

    def sass_of(name):
        cubins = sorted(tmp_path.rglob(f"*{name}*.cubin"))
        assert cubins, list(tmp_path.rglob("*"))
        return subprocess.run([ev.find_cuobjdump(), "-sass", str(cubins[-1])], capture_output=True, text=True).stdout

    prepare, gemm = sass_of("MoePrepareKernel"), sass_of("on_stream")
    # No wait on another CTA in either launch (a call completes beside other queues' kernels): no acquiring load,
    # the spin of a grid-wide barrier (the split-K arrival is an atomic add that never waits)
    for name in ("MoePrepareKernel", "on_stream"):
        ptx = sorted(tmp_path.rglob(f"*{name}*.ptx"))
        assert ptx and b"ld.acquire" not in ptx[-1].read_bytes(), f"{name} waits on another CTA"
    # NVFP4 A: the preparation's row blocks convert it (the GEMM's fp16 A); 16-bit A is used as it is
    assert ("HMUL2" in prepare) == (a_input == "fp4")
    counts = ev.count_sass(gemm)
    assert counts["WGDEP1"] > 0, "the GEMM's wgmma waits are not pipelined"
    assert counts["LDL"] == 0 and counts["STL"] == 0, "the GEMM spills to local memory"
    assert counts["EARLYREL"] == 0, "a stage is released before its loaded words are used"
    assert "HGMMA" in gemm and "HGMMA" not in prepare
    assert "STG.E.128" in prepare and "LDL" not in prepare and "STL" not in prepare
    # one mainloop per tile width (the GEMM's `consume_tile` per width of the build)
    assert len(widths) >= 1 and ("F2FP.BF16" in gemm) == (bf16 or a_input == "bf16")
    # W4A16: the wgmmas in A's type, B converted to it (bf16: HMUL2.BF16_V2); NVFP4 A: fp16 wgmmas
    assert ("F32.BF16" in gemm) == (a_input == "bf16") and ("HMUL2.BF16" in gemm) == (a_input == "bf16")


@pytest.mark.parametrize("bf16", [True, False], ids=["bf16", "fp16"])
def test_moe_kernels_build_for_sm100a(tmp_path, bf16):
    env = dict(os.environ, CUTE_DSL_ARCH="sm_100a", CUTE_DSL_DUMP_DIR=str(tmp_path), CUTE_DSL_KEEP="cubin",
               CUTE_DSL_KEEP_CUBIN="1", CUTE_DSL_DISABLE_FILE_CACHING="1")
    print("building the MoE entry's B200 kernels for sm_100a: E=256 N=512 K=1024", flush=True)
    for kind in ("prepare", "gemm"):
        proc = subprocess.run([sys.executable, "-c", _SCRIPT, str(ROOT), "256", "512", "1024", "b200",
                               "1" if bf16 else "0", kind, "fp4"], env=env, capture_output=True, text=True, timeout=1800)
        assert "MOE_BUILT" in proc.stdout, proc.stderr[-3000:]

    def sass_of(name):
        cubins = sorted(tmp_path.rglob(f"*{name}*.cubin"))
        assert cubins, list(tmp_path.rglob("*"))
        return subprocess.run([ev.find_cuobjdump(), "-sass", str(cubins[-1])], capture_output=True, text=True).stdout

    prepare, gemm = sass_of("MoeSm100PrepareKernel"), sass_of("MoeSm100Gemm")
    counts, prep = ev.count_sass(gemm), ev.count_sass(prepare)
    assert counts["UTCOMMA"] + counts["UTCQMMA"] > 0 and counts["UTMALDG"] > 0 and counts["UTMASTG"] > 0
    assert counts["LDL"] == 0 and counts["STL"] == 0 and prep["LDL"] == 0 and prep["STL"] == 0
    assert "FMUL" in gemm  # alpha
    assert ("F2FP.BF16" in gemm) == bf16
    # the preparation kernel: its table rows (64-bit stores), the scale words, no MMA
    assert "STG.E.64" in prepare and "LDG.E" in prepare and "UTCOMMA" not in prepare
