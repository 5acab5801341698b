"""Shared test setup: the project root on sys.path, one place for tolerances, an independent float64 decoder.

The decoder here is written from the bit definitions of e2m1 and e4m3 (OCP Microscaling spec), not from
reference.py, so that the reference is checked against something it does not share code with.
"""
import contextlib
import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# The one place for tolerances. CHECK is the leaderboard's (rtol = atol = 1e-3).
TOL = {
    "check": dict(rtol=1e-3, atol=1e-3),
    # fp16 rounding of the result is at most half an ulp: 2^-11 relative (2^-25 absolute near zero).
    "fp16_rel": 2.0 ** -11,
    "fp16_abs": 2.0 ** -25,
    # fp32 accumulation of k exact products: at most k * 2^-24 of the sum of |products| (generous bound).
    "fp32_sum_rel": 2.0 ** -24,
}


# Hopper test configs that are a variant with one Sm90GemmConfig field changed: name -> (variant, field, value).
# "two_launch": the A conversion as a launch of its own; "whole_tiles": planned without split-K.
SM90_CHANGED_CONFIGS = {"two_launch": ("sm90_a16_mexact", "a16_fused", False),
                        "whole_tiles": ("sm90_a16_mexact", "split_k", False)}


def sm90_changed_config(name: str):
    """The Sm90GemmConfig of SM90_CHANGED_CONFIGS entry `name` (imports the Hopper module: the DSL is needed)."""
    import dataclasses

    import submission_sm90

    variant, field, value = SM90_CHANGED_CONFIGS[name]
    return dataclasses.replace(submission_sm90.SM90_VARIANT_CONFIGS[variant], **{field: value})


def e2m1_value(code: int) -> float:
    """4-bit e2m1: bit 3 sign, bits 2..1 exponent (bias 1), bit 0 mantissa; exponent 0 is subnormal."""
    sign = -1.0 if code & 0b1000 else 1.0
    exponent = (code >> 1) & 0b11
    mantissa = code & 0b1
    if exponent == 0:
        return sign * (mantissa / 2.0)  # 2^(1 - bias) * 0.m
    return sign * math.ldexp(1.0 + mantissa / 2.0, exponent - 1)


def e4m3_value(code: int) -> float:
    """8-bit e4m3fn: bit 7 sign, bits 6..3 exponent (bias 7), bits 2..0 mantissa; S.1111.111 is NaN, no inf."""
    sign = -1.0 if code & 0x80 else 1.0
    exponent = (code >> 3) & 0xF
    mantissa = code & 0x7
    if exponent == 0xF and mantissa == 0x7:
        return math.nan
    if exponent == 0:
        return sign * math.ldexp(mantissa / 8.0, -6)
    return sign * math.ldexp(1.0 + mantissa / 8.0, exponent - 7)


_E2M1_F64 = torch.tensor([e2m1_value(c) for c in range(16)], dtype=torch.float64)
_E4M3_F64 = torch.tensor([e4m3_value(c) for c in range(256)], dtype=torch.float64)


def dequant_f64(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[rows, k/2] fp4x2 bytes (element 2j in the low nibble) and [rows, k/16] e4m3 -> [rows, k] float64."""
    codes = packed.cpu().contiguous().view(torch.uint8).long()
    rows, half_k = codes.shape
    values = torch.empty((rows, 2 * half_k), dtype=torch.float64)
    values[:, 0::2] = _E2M1_F64[codes & 0xF]
    values[:, 1::2] = _E2M1_F64[codes >> 4]
    scale = _E4M3_F64[scales.cpu().contiguous().view(torch.uint8).long()]
    return values * scale.repeat_interleave(16, dim=1)


def grouped_gemm_f64(data) -> list[torch.Tensor]:
    """Exact float64 result [m, n] of every group (scales from the plain sfa/sfb)."""
    abc, sfs, _, sizes = data
    out = []
    for (a, b, _), (sfa, sfb), (m, n, k, l) in zip(abc, sfs, sizes):
        out.append(dequant_f64(a[:, :, 0], sfa[:, :, 0]) @ dequant_f64(b[:, :, 0], sfb[:, :, 0]).T)
    return out


def sum_abs_products_f64(data) -> list[torch.Tensor]:
    abc, sfs, _, _ = data
    return [dequant_f64(a[:, :, 0], sfa[:, :, 0]).abs() @ dequant_f64(b[:, :, 0], sfb[:, :, 0]).abs().T
            for (a, b, _), (sfa, sfb) in zip(abc, sfs)]


def check_table_rows(table_buffer: torch.Tensor, data) -> None:
    """`table_buffer` (int64 words: the staging piece or the device tables) starts with every group's pointers
    (a, b, c and the blocked scales, read from the tensors), then, after the pointer table's padding, its
    (m, n, k, l) as int32."""
    import submission

    groups = len(data[3])
    ptr_words, table_words = submission.table_words(groups)
    pointers = [[t.data_ptr() for t in (*abc, *sfs_r)] for abc, sfs_r in zip(data[0], data[2])]
    assert table_buffer[:groups * len(submission.PtrColumn)].view(groups, -1).tolist() == pointers
    sizes = table_buffer[ptr_words:table_words].view(torch.int32).view(groups, -1).tolist()
    assert sizes == [list(size) for size in data[3]]


def _dsl_version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("nvidia-cutlass-dsl")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


@pytest.fixture(autouse=True)
def announce_build(request):
    """A test marked `build` spends up to minutes in kernel builds, with nothing but a dot (-q, or none) to show:
    one line on the terminal first names it (its arch and variant are in its name and parameters) and the DSL.
    With -v pytest names each test as it starts already."""
    plugins = request.config.pluginmanager
    reporter, capture = plugins.get_plugin("terminalreporter"), plugins.get_plugin("capturemanager")
    if (request.node.get_closest_marker("build") is not None and reporter is not None
            and request.config.getoption("verbose") <= 0):
        # past the output capture, as capsys.disabled() is; on a line of its own after the dots
        with capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext():
            reporter.ensure_newline()
            if getattr(getattr(reporter, "_tw", None), "width_of_current_line", 0):
                reporter.write("\n")
            reporter.write_line(f"building: {request.node.nodeid} (nvidia-cutlass-dsl {_dsl_version()})")
    yield


def load_task_yml() -> dict:
    import yaml

    return yaml.safe_load((ROOT / "task.yml").read_text())


def cuda_capability():
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability()


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def have_dsl() -> bool:
    """nvidia-cutlass-dsl is importable (without importing it)."""
    import importlib.util

    return importlib.util.find_spec("cutlass") is not None


def build_test_marks() -> list:
    """A module of kernel builds' `pytestmark`: marked `build`, skipped without nvidia-cutlass-dsl or cuobjdump."""
    import eval as ev

    return [pytest.mark.build,
            pytest.mark.skipif(not have_dsl(), reason="needs nvidia-cutlass-dsl"),
            pytest.mark.skipif(ev.find_cuobjdump() is None, reason="needs cuobjdump (nvidia-cuda-cuobjdump)")]


def bench_usage_error(capsys, monkeypatch, args: list, stopped) -> str:
    """bench.py's main on `args`, which must end in one line on stderr and exit status 2 before any GPU check
    (and before `stopped`, a module whose main must not run); returns that line."""
    import bench

    monkeypatch.setattr(torch.cuda, "is_available", lambda: pytest.fail("looked for a GPU"))
    monkeypatch.setattr(stopped, "main", lambda *a, **k: pytest.fail("ran"))
    try:
        code = bench.main(args)
    except SystemExit as stop:  # argparse's own checks
        code = stop.code
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and err.startswith("bench.py: "), err
    return err
