"""Launch paths: how custom_kernel calls a compiled kernel ("tvm_ffi", "prepacked", "dsl").

On the CPU: choosing a path (set_launch_path, NVFP4_LAUNCH_PATH at import, the default), the compile key
and compile options that keep the two ABIs' kernels apart, kernel_args, and make_launcher driven through
fake kernel objects that record what is called. On a GPU (sm_100 or sm_90): custom_kernel on every usable
path, first call and repeated call (the prepared-call fast path), against the reference.
"""
import ctypes
import importlib
import json
import os
import re
import subprocess
import sys

import pytest
import torch

import cutlass
import reference
import submission
import submission_sm90
from conftest import ROOT, cuda_capability


def _tvm_ffi_imports() -> bool:
    try:
        importlib.import_module("tvm_ffi")
    except ImportError:
        return False
    return True


HAVE_TVM_FFI = _tvm_ffi_imports()
USABLE_PATHS = [p for p in submission.LAUNCH_PATHS if p != "tvm_ffi" or HAVE_TVM_FFI]
# Addresses kernel_args accepts: the tables 16-byte aligned, the descriptor workspace 128-byte aligned.
RAW = (0x7F0000001010, 0x7F0000002020, 0x7F0000003080, 5, 7)


@pytest.fixture
def launch_path(monkeypatch):
    """Sets submission.LAUNCH_PATH for one test; the original value comes back afterwards."""
    monkeypatch.setattr(submission, "LAUNCH_PATH", submission.LAUNCH_PATH)

    def set_path(name):
        monkeypatch.setattr(submission, "LAUNCH_PATH", name)

    return set_path


# ---------------------------------------------------------------------------------------------------------
# Choosing a path
# ---------------------------------------------------------------------------------------------------------
def test_launch_paths_are_the_documented_three():
    assert submission.LAUNCH_PATHS == ("tvm_ffi", "prepacked", "dsl")
    assert submission.LAUNCH_PATH in USABLE_PATHS


@pytest.mark.parametrize("name", ["bogus", "", "TVM_FFI", "ctypes"])
def test_set_launch_path_rejects_unknown_names(launch_path, name):
    before = submission.LAUNCH_PATH
    with pytest.raises(ValueError, match="choose one of"):
        submission.set_launch_path(name)
    assert submission.LAUNCH_PATH == before


@pytest.mark.parametrize("name", USABLE_PATHS)
def test_set_launch_path_accepts_each_usable_path(launch_path, name):
    for other in USABLE_PATHS:  # from every other path, so that a no-op setter cannot pass
        if other != name:
            submission.set_launch_path(other)
            submission.set_launch_path(name)
            assert submission.LAUNCH_PATH == name


def test_set_launch_path_refuses_tvm_ffi_without_the_package(launch_path, monkeypatch):
    submission.set_launch_path("prepacked")
    monkeypatch.setattr(submission, "_tvm_ffi_importable", lambda: False)
    with pytest.raises(ValueError, match="apache-tvm-ffi"):
        submission.set_launch_path("tvm_ffi")
    assert submission.LAUNCH_PATH == "prepacked"


# Importing submission costs seconds: the three fresh interpreters run side by side, once per module.
_IMPORT_PROBE = (
    "import importlib, json\n"
    "try:\n"
    "    importlib.import_module('tvm_ffi')\n"
    "    have = True\n"
    "except ImportError:\n"
    "    have = False\n"
    "import submission\n"
    "print(json.dumps({'launch_path': submission.LAUNCH_PATH, 'tvm_ffi_imports': have}))\n"
)


@pytest.fixture(scope="module")
def fresh_imports():
    """{setting: CompletedProcess-like (returncode, stdout, stderr)} for NVFP4_LAUNCH_PATH unset, "dsl",
    "bogus"."""
    procs = {}
    for setting in (None, "dsl", "bogus"):
        env = {k: v for k, v in os.environ.items() if k != "NVFP4_LAUNCH_PATH"}
        if setting is not None:
            env["NVFP4_LAUNCH_PATH"] = setting
        procs[setting] = subprocess.Popen([sys.executable, "-c", _IMPORT_PROBE], cwd=ROOT, env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    results = {}
    for setting, proc in procs.items():
        out, err = proc.communicate(timeout=600)
        results[setting] = (proc.returncode, out, err)
    return results


def _probe(result):
    returncode, out, err = result
    assert returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def test_import_rejects_an_unknown_launch_path(fresh_imports):
    returncode, _, err = fresh_imports["bogus"]
    assert returncode != 0
    message = err.strip().splitlines()[-1]
    assert message.startswith("ValueError") and "bogus" in message, err[-3000:]
    for name in submission.LAUNCH_PATHS:
        assert name in message, message


def test_import_takes_the_launch_path_from_the_environment(fresh_imports):
    assert _probe(fresh_imports["dsl"])["launch_path"] == "dsl"


def test_import_default_is_prepacked_whether_or_not_tvm_ffi_imports(fresh_imports):
    probe = _probe(fresh_imports[None])
    assert probe["launch_path"] == "prepacked"
    assert probe["tvm_ffi_imports"] == HAVE_TVM_FFI  # the same interpreter as this one


# ---------------------------------------------------------------------------------------------------------
# Compiled kernels of the two ABIs never mix
# ---------------------------------------------------------------------------------------------------------
ABI = {"tvm_ffi": "tvm_ffi", "prepacked": "ctypes", "dsl": "ctypes"}


@pytest.mark.parametrize("arch,part", [("sm_100a", "gemm"), ("sm_100a", "tensormaps"), ("sm_90a", "gemm")])
def test_compile_key_ends_with_the_abi_of_the_launch_path(launch_path, arch, part):
    keys = {}
    for name in submission.LAUNCH_PATHS:  # _launch_abi reads LAUNCH_PATH only: no package needed
        launch_path(name)
        keys[name] = submission.compile_key(2, arch, submission.SM100_TILE_N128, part)
        assert keys[name][-1] == ABI[name] == submission._launch_abi()
    assert keys["tvm_ffi"] != keys["prepacked"]
    assert keys["tvm_ffi"][:-1] == keys["prepacked"][:-1]  # only the ABI tells them apart
    assert keys["prepacked"] == keys["dsl"]  # both call the ctypes entry: one compiled kernel serves both


@pytest.mark.parametrize("abi", ["tvm_ffi", "ctypes"])
@pytest.mark.parametrize("arch,config,part", [
    ("sm_100a", submission.SM100_TILE_N128, "gemm"),
    ("sm_100a", submission.SM100_TILE_N128, "tensormaps"),
    ("sm_100a", submission.SM100_CONFIG, "gemm"),
    ("sm_90a", submission_sm90.choose_sm90_config([(72, 256, 512, 1)], 132), "gemm"),
], ids=["persistent", "tensormaps", "seed", "sm90"])
def test_compile_options_follow_the_key_not_the_current_path(launch_path, monkeypatch, abi, arch, config, part):
    calls = []
    monkeypatch.setattr(submission.cute, "compile", lambda *args, **kwargs: calls.append(kwargs) or "compiled")
    launch_path("prepacked" if abi == "tvm_ffi" else "tvm_ffi")  # the opposite ABI is current
    key = ("nvfp4_grouped_gemm", part, arch, submission.DSL_VERSION, config, 2, abi)
    assert submission._compile(key) == "compiled"
    assert calls == [{"options": "--enable-tvm-ffi"} if abi == "tvm_ffi" else {}]


# ---------------------------------------------------------------------------------------------------------
# kernel_args
# ---------------------------------------------------------------------------------------------------------
def _address(pointer) -> int:
    # The DSL's Pointer has no public host-side address accessor in both 4.3 and 4.8 (`toint` exists only
    # in 4.8, and only inside a traced function); its repr is "Ptr<0x...@gmem>" in both.
    match = re.search(r"0x([0-9a-fA-F]+)", repr(pointer))
    assert match, repr(pointer)
    return int(match[1], 16)


def test_kernel_args_makes_pointers_and_int32_counts():
    args = submission.kernel_args(RAW)
    assert len(args) == 5
    for pointer, address, dtype in zip(args[:3], RAW[:3], (cutlass.Int64, cutlass.Int32, cutlass.Int64)):
        assert isinstance(pointer, cutlass.cute.Pointer), type(pointer)
        assert _address(pointer) == address
        assert pointer.dtype == dtype
        assert "gmem" in str(pointer.memspace)
    for count, value in zip(args[3:], RAW[3:]):
        assert isinstance(count, cutlass.Int32) and count.value == value


def test_kernel_args_without_counts():
    args = submission.kernel_args(RAW[:3])
    assert len(args) == 3 and [_address(p) for p in args] == list(RAW[:3])


# ---------------------------------------------------------------------------------------------------------
# make_launcher, on fake kernels that record every call
# ---------------------------------------------------------------------------------------------------------
class FakeTvmFfiKernel:
    """A TVM-FFI compiled kernel as 4.3 gives it: called directly."""

    def __init__(self):
        self.calls = []

    def __call__(self, *args):
        self.calls.append(args)


class FakeWrappedTvmFfiKernel(FakeTvmFfiKernel):
    """As 4.8 gives it: a keyword-argument wrapper with the positional function underneath."""

    def __init__(self):
        super().__init__()
        self.inner_calls = []
        self._tvm_ffi_function = lambda *args: self.inner_calls.append(args)


class FakeExecutor:
    def __init__(self, packed):
        self.packed = packed
        self.pack_calls = []
        self.capi_calls = []
        self.cuda_result = ctypes.c_int(0)
        self.jit_module = type("JitModule", (), {})()
        self.jit_module.capi_func = self.capi_calls.append

    def _get_invoke_packed_args(self, exe_args):
        self.pack_calls.append(list(exe_args))
        return list(self.packed)


class FakeCtypesKernel:
    """A ctypes-ABI compiled kernel: records generate_execution_args, run_compiled_program and to()."""

    EXE_ARGS = [11, 22, 33, 44, 55]
    PACKED = [0x1000, 0x2000, 0x3000, 0x4000, 0x5000, 0x6000]

    def __init__(self):
        self.generate_calls = []
        self.run_calls = []
        self.to_calls = []
        self.executor = FakeExecutor(self.PACKED)

    def __call__(self, *args):
        raise AssertionError("the launcher must not call the kernel object itself")

    def generate_execution_args(self, *args):
        self.generate_calls.append(args)
        return list(self.EXE_ARGS), "adapted"

    def run_compiled_program(self, exe_args):
        self.run_calls.append((exe_args, list(exe_args)))  # the list given, and what it held then
        exe_args.append("scratch")  # 4.3 appends to the list it is given
        return 0

    def to(self, device):
        self.to_calls.append(device)
        return self.executor


@pytest.mark.parametrize("wrapped", [False, True], ids=["plain", "wrapped"])
def test_tvm_ffi_launcher_passes_the_raw_ints(launch_path, wrapped):
    launch_path("tvm_ffi")
    kernel = FakeWrappedTvmFfiKernel() if wrapped else FakeTvmFfiKernel()
    launch = submission.make_launcher(kernel, RAW)
    called = kernel.inner_calls if wrapped else kernel.calls
    assert called == []  # building the launcher launches nothing
    for n in range(1, 4):
        launch()
        assert called == [RAW] * n
        assert all(type(v) is int for v in called[-1])
    if wrapped:
        assert kernel.calls == []  # the keyword wrapper is bypassed


def _check_pointer_args(args):
    assert len(args) == len(RAW)
    assert [_address(p) for p in args[:3]] == list(RAW[:3])
    assert [c.value for c in args[3:]] == list(RAW[3:])


def test_dsl_launcher_converts_once_and_runs_per_call(launch_path):
    launch_path("dsl")
    kernel = FakeCtypesKernel()
    launch = submission.make_launcher(kernel, RAW)
    assert len(kernel.generate_calls) == 1 and kernel.run_calls == []
    _check_pointer_args(kernel.generate_calls[0])
    for n in range(1, 4):
        launch()
        assert len(kernel.run_calls) == n
    assert len(kernel.generate_calls) == 1
    # A fresh list each launch, equal to exe_args although every run appended to the one it was given.
    assert len({id(given) for given, _ in kernel.run_calls}) == 3
    assert all(held == FakeCtypesKernel.EXE_ARGS for _, held in kernel.run_calls)
    assert kernel.to_calls == [] and kernel.executor.capi_calls == []


def test_prepacked_launcher_packs_once_and_calls_the_c_entry(launch_path):
    launch_path("prepacked")
    kernel = FakeCtypesKernel()
    executor = kernel.executor
    launch = submission.make_launcher(kernel, RAW)
    assert len(kernel.generate_calls) == 1
    _check_pointer_args(kernel.generate_calls[0])
    assert kernel.to_calls == [None]
    assert executor.pack_calls == [FakeCtypesKernel.EXE_ARGS]
    assert executor.capi_calls == []
    for n in range(1, 4):
        launch()
        assert len(executor.capi_calls) == n
    packed = executor.capi_calls[0]
    assert all(p is packed for p in executor.capi_calls)  # one array, packed once
    assert isinstance(packed, ctypes.Array) and packed._type_ is ctypes.c_void_p
    assert list(packed) == FakeCtypesKernel.PACKED
    assert len(kernel.generate_calls) == 1 and kernel.to_calls == [None] and len(executor.pack_calls) == 1
    assert kernel.run_calls == []


def test_prepacked_launcher_raises_on_a_cuda_error(launch_path):
    launch_path("prepacked")
    kernel = FakeCtypesKernel()
    launch = submission.make_launcher(kernel, RAW)
    launch()
    kernel.executor.cuda_result.value = 700  # cudaErrorIllegalAddress
    with pytest.raises(RuntimeError, match="700"):
        launch()
    assert len(kernel.executor.capi_calls) == 2  # the launch was made, then its result read


# ---------------------------------------------------------------------------------------------------------
# On a GPU: custom_kernel through every usable path, first and repeated call
# ---------------------------------------------------------------------------------------------------------
CAPABILITY = cuda_capability()
GPU_ARGS = dict(m=(72, 200), n=(256, 384), k=(512, 256), g=2, seed=29)


def _poison(data):
    for _, _, c in data[0]:
        c.fill_(float("nan"))
    return data


def _check(expected, out):
    torch.cuda.synchronize()
    for c in out:
        assert not torch.isnan(c).any(), "an output element was never written"
    ok, msg = reference.check_implementation(expected, out)
    assert ok, msg


@pytest.mark.gpu
@pytest.mark.skipif(CAPABILITY not in ((9, 0), (10, 0)), reason="needs an sm_90 or sm_100 GPU")
@pytest.mark.parametrize("name", USABLE_PATHS)
def test_custom_kernel_on_each_launch_path(launch_path, name):
    submission.set_launch_path(name)
    data = _poison(reference.generate_input(**GPU_ARGS))
    expected = reference.generate_input(**GPU_ARGS)
    _check(expected, submission.custom_kernel(data))
    assert submission.LAUNCH_PATH == name  # the path chosen here was kept
    # The same input objects again: the prepared call of this path launches directly.
    _poison(data)
    assert submission._prepared_call(data) is not None
    _check(expected, submission.custom_kernel(data))


# ---------------------------------------------------------------------------------------------------------
# compiled_gemm: a failing TVM-FFI build falls back to the ctypes entry only when tvm_ffi was the default
# ---------------------------------------------------------------------------------------------------------
def _failing_tvm_ffi_compile(monkeypatch):
    built = []

    def fake_compiled_kernel(key):
        built.append(key[-1])
        if key[-1] == "tvm_ffi":
            raise RuntimeError("tvm_ffi ABI mismatch")
        return "ctypes kernel"

    monkeypatch.setattr(submission, "compiled_kernel", fake_compiled_kernel)
    monkeypatch.setattr(submission.torch.cuda, "is_available", lambda: True)
    return built


def test_a_failing_tvm_ffi_build_raises_and_keeps_the_path(launch_path, monkeypatch):
    built = _failing_tvm_ffi_compile(monkeypatch)
    monkeypatch.setattr(submission, "LAUNCH_PATH", "tvm_ffi")
    with pytest.raises(RuntimeError, match="ABI mismatch"):
        submission.compiled_gemm(2, "sm_90a", submission_sm90.SM90_VARIANT_CONFIGS["sm90_tile128"])
    assert built == ["tvm_ffi"] and submission.LAUNCH_PATH == "tvm_ffi"


def test_prepacked_launchers_of_one_kernel_share_its_executor(launch_path):
    # Binding an executor loads the kernel functions: once per kernel, not once per input set.
    launch_path("prepacked")
    kernel = FakeCtypesKernel()
    first = submission.make_launcher(kernel, RAW)
    second = submission.make_launcher(kernel, RAW)
    assert kernel.to_calls == [None]
    first()
    second()
    assert len(kernel.executor.capi_calls) == 2 and len(kernel.executor.pack_calls) == 2
    other = FakeCtypesKernel()
    submission.make_launcher(other, RAW)
    assert other.to_calls == [None]  # another kernel gets its own


# ---------------------------------------------------------------------------------------------------------
# The arch seam: what each B200 variant's prepared call launches with, through its backend
# ---------------------------------------------------------------------------------------------------------
B200_SIZES = [(40, 4096, 7168, 1), (200, 7168, 2048, 1), (1, 256, 256, 1)]


def _expected_b200_launch(config, num_sms: int = 148) -> tuple:
    """The ints a B200 GEMM launch takes after its three tables, from the sizes alone: the persistent kernel
    (tiles, CTAs = one per SM at most), the seed (tiles, one CTA each)."""
    tile_m, tile_n = config.tile_mn
    tiles = sum(-(-m // tile_m) * -(-n // tile_n) for m, n, _, _ in B200_SIZES)
    return (tiles, min(tiles, num_sms)) if isinstance(config, submission.Sm100PersistentConfig) else (tiles,)


@pytest.mark.parametrize("variant", submission.KERNEL_VARIANTS)
def test_b200_prepared_launch_packs_the_tables_then_the_variants_counts(launch_path, variant):
    launch_path("prepacked")
    config = submission.VARIANT_CONFIGS[variant]
    backend = submission.backend_for_arch("sm_100a")
    assert submission.backend_of(config) is backend
    schedule = backend.schedule(config, B200_SIZES, torch.device("cpu"), 148)
    counts = _expected_b200_launch(config)
    assert schedule.counts == counts and (schedule.num_tiles, schedule.num_ctas) == (counts[0], counts[-1])
    assert schedule.work_words is None and schedule.prepass_counts == ()
    # Descriptor workspace: five 128-byte descriptors per group up front, four per tile for the seed.
    rows = 5 * len(B200_SIZES) if len(counts) == 2 else 4 * counts[0]
    assert schedule.workspace_bytes >= rows * submission.TENSORMAP_BYTES
    metadata = submission.LaunchMetadata(None, None, schedule.num_tiles, schedule.num_ctas,
                                         (*RAW[:3], *schedule.counts), RAW[:3])
    kernel = FakeCtypesKernel()
    launch = submission.make_call_launcher(len(B200_SIZES), "sm_100a", config, kernel, metadata)
    (args,) = kernel.generate_calls
    assert [_address(p) for p in args[:3]] == list(RAW[:3])
    assert [type(c) for c in args[3:]] == [cutlass.Int32] * len(counts) and [c.value for c in args[3:]] == list(counts)
    launch()
    assert list(kernel.executor.capi_calls[0]) == FakeCtypesKernel.PACKED
