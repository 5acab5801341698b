"""Harness helpers with the names and behaviour of the GPU MODE runner's utils.py.

Comparison (`verbose_allclose`, `match_reference`, `match_outputs`) runs on any device; the L2 flush helpers need CUDA.
"""
import os
import random
import sys
from typing import Optional

import torch


def set_seed(seed: int = 42) -> None:
    random.seed(seed)
    try:
        import numpy as np  # optional: the project does not depend on numpy
    except ImportError:
        np = None
    if np is not None:
        np.random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def get_device(use_cuda: bool = True) -> torch.device:
    """The CUDA device when there is one (and it is wanted), else the CPU."""
    if use_cuda and torch.cuda.is_available():
        return torch.device("cuda")
    return torch.device("cpu")


def _mismatch_report(received: torch.Tensor, expected: torch.Tensor, mismatched: torch.Tensor,
                     max_print: int) -> list[str]:
    count = int(mismatched.count_nonzero().item())
    if count == 0:
        return []
    lines = [f"Number of mismatched elements: {count}"]
    for index in torch.nonzero(mismatched)[:max_print]:
        i = tuple(index.tolist())
        lines.append(f"ERROR AT {i}: {received[i]} {expected[i]}")
    if count > max_print:
        lines.append(f"... and {count - max_print} more mismatched elements.")
    return lines


@torch.no_grad()
def verbose_allclose(received: torch.Tensor, expected: torch.Tensor, rtol=1e-05, atol=1e-08,
                     max_print=5) -> list[str]:
    """Mismatches of |received - expected| > atol + rtol * |expected| (NaN and ±inf must match exactly).

    Returns an empty list when everything matches, else human-readable lines.
    """
    if received.shape != expected.shape:
        return ["SIZE MISMATCH"]
    diff = torch.abs(received - expected)
    mismatched = diff > atol + rtol * torch.abs(expected)
    mismatched |= torch.isnan(received) ^ torch.isnan(expected)
    mismatched |= torch.isposinf(received) ^ torch.isposinf(expected)
    mismatched |= torch.isneginf(received) ^ torch.isneginf(expected)
    return _mismatch_report(received, expected, mismatched, max_print)


@torch.no_grad()
def verbose_allequal(received: torch.Tensor, expected: torch.Tensor, max_print: int = 5) -> list[str]:
    """Mismatches of received != expected, as human-readable lines (empty when equal)."""
    return _mismatch_report(received, expected, torch.not_equal(received, expected), max_print)


def match_reference(data, output, reference, rtol=1e-05, atol=1e-08) -> tuple[bool, str]:
    """Runs `reference(data)` and compares each output tensor with it."""
    return match_outputs(reference(data), output, rtol=rtol, atol=atol)


def match_outputs(expected, output, rtol=1e-05, atol=1e-08) -> tuple[bool, str]:
    """Compares each output tensor with the reference's `expected` one (match_reference's comparison)."""
    if len(output) != len(expected):
        return False, f"output length mismatch: got {len(output)}, expected {len(expected)}"
    for i, (output_i, expected_i) in enumerate(zip(output, expected)):
        if output_i.device != expected_i.device:
            output_i = output_i.to(expected_i.device)
        reasons = verbose_allclose(output_i, expected_i, rtol=rtol, atol=atol)
        if reasons:
            return False, f"mismatch found! custom implementation doesn't match reference: {i} {reasons}"
    return True, ""


def make_match_reference(reference, **kwargs):
    def wrapped(data, output):
        return match_reference(data, output, reference=reference, **kwargs)

    return wrapped


class DeterministicContext:
    """Deterministic torch algorithms and no TF32 inside the block; restores the settings after."""

    def __enter__(self):
        self._cublas = os.environ.get("CUBLAS_WORKSPACE_CONFIG", "")
        self._allow_tf32 = torch.backends.cudnn.allow_tf32
        self._deterministic = torch.backends.cudnn.deterministic
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cudnn.deterministic = True
        torch.use_deterministic_algorithms(True)
        return self

    def __exit__(self, exc_type, exc_value, traceback):
        torch.backends.cudnn.allow_tf32 = self._allow_tf32
        torch.backends.cudnn.deterministic = self._deterministic
        torch.use_deterministic_algorithms(False)
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = self._cublas


def clear_l2_cache() -> None:
    """Evicts the L2 by writing 256 MiB (several times any current L2)."""
    dummy = torch.empty((32, 1024, 1024), dtype=torch.int64, device="cuda")
    dummy.fill_(42)
    del dummy


_L2_FLUSH_BUFFER: list = []
L2_FLUSH_FLOATS = 16000 * 1024 * 1024  # the runner's 64 GB of float32
L2_FLUSH_HEADROOM = 24 << 30  # left free for the benchmark's inputs and peers when the card is smaller


def l2_flush_gib_cap() -> Optional[float]:
    """NVFP4_L2_FLUSH_GIB: the most GiB `clear_l2_cache_large` may take, for several harness processes sharing
    one card (e.g. the leaderboard mode's result checks of many variants at once, whose timings are then not
    the runner's anyway). Unset: no cap. Not a positive number: a ValueError naming the variable."""
    text = os.environ.get("NVFP4_L2_FLUSH_GIB", "").strip()
    if not text:
        return None
    try:
        cap = float(text)
    except ValueError:
        cap = 0.0
    if not cap > 0:
        raise ValueError(f"NVFP4_L2_FLUSH_GIB={text!r}: give a positive number of GiB, or leave it unset")
    return cap


def l2_flush_floats(free_bytes: int) -> int:
    """The float32 count of `clear_l2_cache_large`'s tensor on a card with `free_bytes` free: the runner's
    64 GB, or what leaves L2_FLUSH_HEADROOM free, or half of what is free where that is more (a card with
    less than twice the headroom free). Never more than half of a small card's free memory, so that the flush
    itself never fails for want of memory: on an 80 GB card beside other processes, 22 GiB free gives an
    11 GiB flush, still hundreds of times any L2."""
    return min(L2_FLUSH_FLOATS, max(free_bytes - L2_FLUSH_HEADROOM, free_bytes // 2, 0) // 4)


def clear_l2_cache_large() -> None:
    """The runner's flush for the grouped-GEMM benchmark: fills a 64 GB tensor with random numbers.

    The tensor is allocated once and refilled in place: the same work on the device as the runner's fresh
    `torch.randn` (whose memory its caching allocator hands back on every call anyway), without later
    allocations splitting the cached block. On a card without 64 GB to spare beside 24 GB of headroom (an 80 GB
    one) the tensor is smaller (`l2_flush_floats`), said once on stderr: any flush of a few GB still evicts the
    L2 many times over and takes milliseconds, so the timed calls still queue behind it as they do on the runner.
    The tensor lives as long as the process (eval.py benchmark's worker; each variant's timing worker in
    bringup).
    """
    if not _L2_FLUSH_BUFFER:
        free = torch.cuda.mem_get_info()[0]
        floats = l2_flush_floats(free)
        cap = l2_flush_gib_cap()
        if cap is not None and floats * 4 > cap * 2**30:
            floats = int(cap * 2**30) // 4
            print(f"clear_l2_cache_large: {floats * 4 / 2**30:.1f} GiB flush (NVFP4_L2_FLUSH_GIB)", file=sys.stderr)
        elif floats < L2_FLUSH_FLOATS:
            print(f"clear_l2_cache_large: {floats * 4 / 2**30:.1f} GiB flush (the runner's 62.5 GiB does not fit "
                  f"beside {L2_FLUSH_HEADROOM >> 30} GiB of headroom in the {free / 2**30:.1f} GiB free on this "
                  "card)", file=sys.stderr)
        _L2_FLUSH_BUFFER.append(torch.empty(floats, device="cuda"))
    _L2_FLUSH_BUFFER[0].normal_()
