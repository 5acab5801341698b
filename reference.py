"""Reference for the NVFP4 block-scaled grouped GEMM, with the GPU MODE runner's public names.

C_g = (A_g * SFA_g) @ (B_g * SFB_g)^T for every group g, where A_g [m, k] and B_g [n, k] hold e2m1 (fp4)
values packed two per byte, SFA_g [m, k/16] and SFB_g [n, k/16] hold one e4m3 scale per 16 consecutive
k-elements, and C_g [m, n] is fp16.

Unlike the runner's reference (cuBLAS fp4 through `torch._scaled_mm`, Blackwell only), `ref_kernel` decodes
the e2m1 values and e4m3 scales exactly on whatever device the data is on (CPU or any CUDA GPU), multiplies
in fp32 with fp32 accumulation (TF32 off), and rounds to fp16. Every product of an e2m1 value and an e4m3
scale, and every product of two such values, is exact in fp32, so only the summation order differs from a
tensor-core result. `ref_kernel_scaled_mm` is the cuBLAS path for Blackwell GPUs.

The generator reproduces the runner's data: fp4 nibbles restricted to sign + 2 low bits (0, ±0.5, ±1, ±1.5),
scales drawn from {1, 2}, the plain scales on the CPU, everything else on the GPU (CPU when there is none).
"""
import functools
from typing import Callable

import torch

from task import input_t, output_t
from utils import make_match_reference, match_outputs

sf_vec_size = 16  # k-elements that share one scale

# e2m1 code -> value; bit 3 is the sign, bits 2..1 the exponent (bias 1), bit 0 the mantissa.
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def ceil_div(a: int, b: int) -> int:
    return (a + b - 1) // b


def _device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def to_blocked(input_matrix: torch.Tensor) -> torch.Tensor:
    """Flattened cuBLAS/tcgen05 blocked layout of a [rows, cols] scale matrix.

    Rows are padded with zeros to a multiple of 128 and columns to a multiple of 4; each 128x4 block is
    stored as 32 rows of 16 bytes, row r of the 32 holding rows r, r+32, r+64, r+96 of the block, 4 each.
    """
    rows, cols = input_matrix.shape
    row_blocks, col_blocks = ceil_div(rows, 128), ceil_div(cols, 4)
    padded = torch.zeros((row_blocks * 128, col_blocks * 4), dtype=input_matrix.dtype,
                         device=input_matrix.device)
    padded[:rows, :cols] = input_matrix
    # (row_block, 4 [r // 32], 32 [r % 32], col_block, 4 [c % 4])
    blocks = padded.view(row_blocks, 4, 32, col_blocks, 4)
    # -> (row_block, col_block, 32, 4, 4)
    return blocks.permute(0, 3, 2, 1, 4).flatten()


def create_reordered_scale_factor_tensor(l: int, mn: int, k: int, ref_f8_tensor: torch.Tensor) -> torch.Tensor:
    """The scales [mn, k/16, l] in the blocked layout, as a [32, 4, rest_mn, 4, rest_k, l] view.

    The storage is (l, rest_mn, rest_k, 32, 4, 4), contiguous, so one 128-row x 4-scale block is 512
    contiguous bytes. Padding entries (rows past mn) hold random scales from {1, 2} as in the runner's
    generator: a kernel must not depend on them.
    """
    device = _device()
    sf_k = ceil_div(k, sf_vec_size)
    rest_mn, rest_k = ceil_div(mn, 128), ceil_div(sf_k, 4)
    storage = torch.randint(1, 3, (l, rest_mn, rest_k, 32, 4, 4), dtype=torch.int8, device=device)
    storage = storage.to(torch.float8_e4m3fn)
    src = ref_f8_tensor.to(device)  # [mn, sf_k, l]
    padded = torch.empty((rest_mn * 128, rest_k * 4, l), dtype=torch.float8_e4m3fn, device=device)
    padded.view(torch.uint8).zero_()
    padded[:mn, :sf_k] = src
    # padded[(mb, i4, i32), (kb, j4), b] -> storage[b, mb, kb, i32, i4, j4]
    blocked = padded.view(rest_mn, 4, 32, rest_k, 4, l).permute(5, 0, 3, 2, 1, 4)
    valid_rows = torch.zeros((rest_mn * 128,), dtype=torch.bool, device=device)
    valid_rows[:mn] = True
    # (mb, i4, i32) -> (1, mb, 1, i32, i4, 1), broadcast like `blocked`
    valid = valid_rows.view(rest_mn, 4, 32).permute(0, 2, 1)[None, :, None, :, :, None].expand_as(blocked)
    storage.view(torch.uint8)[valid] = blocked.contiguous().view(torch.uint8)[valid]
    return storage.permute(3, 4, 1, 5, 2, 0)


def _create_fp4_tensors(l: int, mn: int, k: int) -> torch.Tensor:
    # Random bytes (0..254 as the runner draws them), each nibble masked to its sign and 2 low bits.
    raw = torch.randint(255, size=(l, mn, k // 2), dtype=torch.uint8, device=_device())
    raw = raw & 0b1011_1011
    return raw.permute(1, 2, 0).view(torch.float4_e2m1fn_x2)


def generate_input(m: tuple, n: tuple, k: tuple, g: int, seed: int) -> input_t:
    """The runner's input for g groups of sizes (m[i], n[i], k[i], 1).

    Returns (abc_tensors, sfasfb_tensors, sfasfb_reordered_tensors, problem_sizes):
      a [m, k/2, 1] and b [n, k/2, 1] float4_e2m1fn_x2, c [m, n, 1] float16 (random: kernels overwrite it),
      sfa [m, k/16, 1] and sfb [n, k/16, 1] float8_e4m3fn on the CPU,
      sfa/sfb reordered [32, 4, ceil(mn/128), 4, ceil(k/64), 1] float8_e4m3fn, problem_sizes (m, n, k, 1).
    ValueError when m, n and k are not g sizes each.
    """
    lengths = {"m": len(m), "n": len(n), "k": len(k)}
    if set(lengths.values()) != {g}:
        raise ValueError(f"m, n and k must each hold g={g} sizes, one per group; got "
                         + ", ".join(f"len({name})={length}" for name, length in lengths.items()))
    torch.manual_seed(seed)
    device = _device()
    abc_tensors, sfasfb_tensors, sfasfb_reordered_tensors, problem_sizes = [], [], [], []
    l = 1
    for group_idx in range(g):
        mi, ni, ki = m[group_idx], n[group_idx], k[group_idx]
        a = _create_fp4_tensors(l, mi, ki)
        b = _create_fp4_tensors(l, ni, ki)
        c = torch.randn((l, mi, ni), dtype=torch.float16, device=device).permute(1, 2, 0)
        sf_k = ceil_div(ki, sf_vec_size)
        sfa = torch.randint(1, 3, (l, mi, sf_k), dtype=torch.int8).to(torch.float8_e4m3fn).permute(1, 2, 0)
        sfb = torch.randint(1, 3, (l, ni, sf_k), dtype=torch.int8).to(torch.float8_e4m3fn).permute(1, 2, 0)
        sfa_reordered = create_reordered_scale_factor_tensor(l, mi, ki, sfa)
        sfb_reordered = create_reordered_scale_factor_tensor(l, ni, ki, sfb)
        abc_tensors.append((a, b, c))
        sfasfb_tensors.append((sfa, sfb))
        sfasfb_reordered_tensors.append((sfa_reordered, sfb_reordered))
        problem_sizes.append((mi, ni, ki, l))
    return abc_tensors, sfasfb_tensors, sfasfb_reordered_tensors, problem_sizes


def decode_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """[rows, k/2] float4_e2m1fn_x2 (element 2j in the low nibble of byte j) -> [rows, k] float32."""
    codes = packed.view(torch.uint8)
    lut = torch.tensor(_E2M1_VALUES, dtype=torch.float32, device=codes.device)
    low, high = (codes & 0xF).long(), (codes >> 4).long()
    return torch.stack((lut[low], lut[high]), dim=-1).flatten(-2)


def dequantize(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[rows, k/2] fp4x2 values and [rows, k/16] e4m3 scales -> [rows, k] float32, exactly."""
    values = decode_e2m1(packed)
    scale = scales.to(device=values.device).to(torch.float32)
    return values * scale.repeat_interleave(sf_vec_size, dim=1)[:, : values.shape[1]]


def _matmul_fp32(a: torch.Tensor, b_t: torch.Tensor) -> torch.Tensor:
    if a.is_cuda:
        saved = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        try:
            return a @ b_t
        finally:
            torch.backends.cuda.matmul.allow_tf32 = saved
    return a @ b_t


@torch.no_grad()
def ref_kernel(data: input_t) -> output_t:
    """Exact-decode reference: writes each group's result into its c and returns the list of c."""
    abc_tensors, sfasfb_tensors, _, problem_sizes = data
    results = []
    for (a, b, c), (sfa, sfb), (m, n, k, l) in zip(abc_tensors, sfasfb_tensors, problem_sizes):
        for l_idx in range(l):
            a_f32 = dequantize(a[:, :, l_idx], sfa[:, :, l_idx])
            b_f32 = dequantize(b[:, :, l_idx], sfb[:, :, l_idx].to(b.device))
            c[:, :, l_idx] = _matmul_fp32(a_f32.to(c.device), b_f32.to(c.device).t()).to(torch.float16)
        results.append(c)
    return results


@torch.no_grad()
def ref_kernel_scaled_mm(data: input_t) -> output_t:
    """The runner's reference: cuBLAS block-scaled fp4 through torch._scaled_mm (Blackwell GPUs only)."""
    abc_tensors, sfasfb_tensors, _, problem_sizes = data
    results = []
    for (a, b, c), (sfa, sfb), (m, n, k, l) in zip(abc_tensors, sfasfb_tensors, problem_sizes):
        for l_idx in range(l):
            scale_a = to_blocked(sfa[:, :, l_idx]).to(c.device)
            scale_b = to_blocked(sfb[:, :, l_idx]).to(c.device)
            c[:, :, l_idx] = torch._scaled_mm(
                a[:, :, l_idx].view(torch.float4_e2m1fn_x2),
                b[:, :, l_idx].transpose(0, 1).view(torch.float4_e2m1fn_x2),
                scale_a, scale_b, bias=None, out_dtype=torch.float16)
        results.append(c)
    return results


CHECK_TOLERANCE = dict(rtol=1e-03, atol=1e-03)
check_implementation = make_match_reference(ref_kernel, **CHECK_TOLERANCE)


def reference_check(data: input_t) -> Callable[[output_t], tuple]:
    """check_implementation for one input set with the reference run once, now: the returned function compares
    an output with that result (the same comparison and tolerance). For checking many outputs of the same,
    unchanged inputs (the runner's leaderboard mode re-checks every result after every timing batch): the
    runner's own loop recomputes the reference each time, which gives the same result at many times the GPU
    time. `data` becomes the reference's (its C tensors hold the result): pass a copy the kernel never sees."""
    expected = [c.clone() for c in ref_kernel(data)]
    return functools.partial(match_outputs, expected, **CHECK_TOLERANCE)
