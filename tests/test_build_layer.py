"""The MoE layer's stage kernels (nvfp4_moe routing, quantize, activation, combine) build without a GPU for sm_90a
and sm_100a on every DSL version CI installs, and their SASS is what their docstrings claim: no local memory; the
quantizer's and the combine's fp32 operations never contracted into FMAs (no fma in their PTX) (the stages' torch statements round each
product and sum: `simt.mul_rn` / `add_rn`); the routing counts with shared-memory atomics and never waits on another
CTA (no acquiring load); the 128-bit loads and stores where rows are copied. The Hopper GPU tests run these
kernels (tests/test_gpu_layer_stages.py); on sm_100a they are built and read here only (no B200 here)."""
import os
import subprocess
import sys

import pytest

import eval as ev
from conftest import ROOT, build_test_marks

pytestmark = build_test_marks()

_SCRIPT = r"""
import sys
sys.path.insert(0, sys.argv[1])
import cutlass, cutlass.cute as cute
import cuda.bindings.driver as cuda
from nvfp4_moe.routing import RouteKernel
from nvfp4_moe.quantize import GatherQuantizeKernel
from nvfp4_moe.activation import SiluMulKernel
from nvfp4_moe.combine import CombineKernel
kernels = {
    "route": (RouteKernel(256, 8, True, True), "qqiqqqi"),
    "gather_fp4": (GatherQuantizeKernel(7168, 8, "fp4", True, False, "f32"), "qqqqqqqqi"),
    "gather_bf16": (GatherQuantizeKernel(2048, 1, "bf16", False, True, "bf16"), "qqqqqqqqi"),
    "silu_fp4": (SiluMulKernel(128, 768, True, False), "qqqqqqi"),
    "combine": (CombineKernel(4096, 8, "bf16"), "qqqqi"),
}
kernel, types = kernels[sys.argv[2]]
args = tuple(cutlass.Int64(0) if c == "q" else cutlass.Int32(1) for c in types) + (cuda.CUstream(0),)
try:
    cute.compile(kernel, *args)
except Exception as err:  # 4.3.x without a driver: the cubin is written, then loading it fails
    if "CudaDriverDependencyError" not in repr(err) and "CUDA Driver Dependency" not in str(err):
        raise
print("STAGE_BUILT")
"""

KERNELS = ("route", "gather_fp4", "gather_bf16", "silu_fp4", "combine")


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_stage_kernels_build(tmp_path, arch):
    found = {}
    for name in KERNELS:  # one process each: after 4.3.x fails to load one without a driver, it loads no other
        dump = tmp_path / name
        dump.mkdir()
        env = dict(os.environ, CUTE_DSL_ARCH=arch, CUTE_DSL_DUMP_DIR=str(dump), CUTE_DSL_KEEP="cubin,ptx",
                   CUTE_DSL_KEEP_CUBIN="1", CUTE_DSL_KEEP_PTX="1", CUTE_DSL_DISABLE_FILE_CACHING="1")
        print(f"building the layer's {name} kernel for {arch}", flush=True)
        proc = subprocess.run([sys.executable, "-c", _SCRIPT, str(ROOT), name], env=env, capture_output=True,
                              text=True, timeout=900)
        assert "STAGE_BUILT" in proc.stdout, proc.stderr[-3000:]
        cubins, ptx = sorted(dump.rglob("*.cubin")), sorted(dump.rglob("*.ptx"))
        assert cubins and ptx, list(dump.rglob("*"))
        sass = subprocess.run([ev.find_cuobjdump(), "-sass", str(cubins[-1])], capture_output=True, text=True).stdout
        found[name] = (sass, ptx[-1].read_text())
    for name, (sass, ptx) in found.items():
        assert "LDL" not in sass and "STL" not in sass, f"{name} spills to local memory"
        assert "ld.acquire" not in ptx, f"{name} waits on another CTA"
    # the quantizer's (gather) and the combine's arithmetic: every product and sum rounded on its own (the PTX has
    # no fma; in SASS the IEEE division's own sequence uses FFMAs, so SASS is checked where there is none)
    for name in ("gather_fp4", "combine"):
        assert "fma." not in found[name][1], f"{name}: an fp32 product and sum were contracted into an FMA"
    assert "FFMA" not in found["combine"][0]
    assert "ATOMS.ADD" in found["route"][0] or "ATOMS.POPC.INC" in found["route"][0], "routing counts without atomics"
    assert "cvt.rn.satfinite.e4m3x2.f32" in found["gather_fp4"][1] and "cvt.rn.satfinite.e4m3x2.f32" in found["silu_fp4"][1]
    assert "ex2.approx" in found["silu_fp4"][1]
    assert "STG.E.128" in found["gather_bf16"][0] and "LDG.E.128" in found["combine"][0]
