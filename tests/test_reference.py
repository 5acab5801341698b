"""reference.py against an independent float64 decoder, on the CPU (and on any CUDA GPU where present)."""
import re

import pytest
import torch

import reference
from harness import _clone_data as _clone
from conftest import (TOL, dequant_f64, e2m1_value, e4m3_value, grouped_gemm_f64, load_task_yml,
                      requires_cuda, sum_abs_products_f64)


def _full_range_input(sizes, seed, scale_codes, device="cpu"):
    """Data in the runner's layout, but with every e2m1 code and the given e4m3 scale codes."""
    gen = torch.Generator().manual_seed(seed)
    abc, sfs, sfs_reordered, problem_sizes = [], [], [], []
    for m, n, k in sizes:
        def fp4(rows):
            raw = torch.randint(0, 256, (1, rows, k // 2), generator=gen, dtype=torch.uint8)
            return raw.permute(1, 2, 0).view(torch.float4_e2m1fn_x2).to(device)

        def scales(rows):
            pick = torch.randint(0, len(scale_codes), (1, rows, k // 16), generator=gen)
            codes = torch.tensor(scale_codes, dtype=torch.uint8)[pick]
            return codes.view(torch.float8_e4m3fn).permute(1, 2, 0)

        a, b = fp4(m), fp4(n)
        c = torch.full((1, m, n), float("nan"), dtype=torch.float16).permute(1, 2, 0).to(device)
        sfa, sfb = scales(m), scales(n)
        abc.append((a, b, c))
        sfs.append((sfa, sfb))
        sfs_reordered.append((reference.create_reordered_scale_factor_tensor(1, m, k, sfa),
                              reference.create_reordered_scale_factor_tensor(1, n, k, sfb)))
        problem_sizes.append((m, n, k, 1))
    return abc, sfs, sfs_reordered, problem_sizes


def _assert_within_fp32_accumulation(out, data):
    """|out - exact| <= fp16 rounding + fp32 summation error bound, element by element."""
    for i, (got, exact, mag) in enumerate(zip(out, grouped_gemm_f64(data), sum_abs_products_f64(data))):
        k = data[3][i][2]
        got = got[:, :, 0].cpu().double()
        bound = TOL["fp16_rel"] * exact.abs() + TOL["fp16_abs"] + k * TOL["fp32_sum_rel"] * mag
        excess = (got - exact).abs() - bound
        assert torch.isfinite(got).all(), f"group {i}: non-finite output"
        assert (excess <= 0).all(), f"group {i}: worst excess over the bound {excess.max().item():.3g}"


def test_decoder_definitions_spot_values():
    # Values from the OCP MX spec tables, so that the test decoder itself is pinned.
    assert [e2m1_value(c) for c in range(8)] == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert e2m1_value(0b1111) == -6.0 and e2m1_value(0b1001) == -0.5
    assert e4m3_value(0x38) == 1.0 and e4m3_value(0x40) == 2.0 and e4m3_value(0x7E) == 448.0
    assert e4m3_value(0x01) == 2.0 ** -9 and e4m3_value(0x08) == 2.0 ** -6


def test_e2m1_all_16_codes():
    codes = torch.arange(256, dtype=torch.uint8).view(256, 1)  # every (low, high) nibble pair
    got = reference.decode_e2m1(codes.view(torch.float4_e2m1fn_x2)).double()
    expected = torch.tensor([[e2m1_value(b & 0xF), e2m1_value(b >> 4)] for b in range(256)], dtype=torch.float64)
    assert torch.equal(got, expected)


def test_e4m3_every_positive_finite_scale():
    # All 126 positive finite codes (0x01 .. 0x7E): subnormals up to 448.
    codes = torch.arange(1, 0x7F, dtype=torch.uint8)
    packed = torch.full((codes.numel(), 8), 0x22, dtype=torch.uint8)  # every element 1.0
    scales = codes.view(-1, 1).view(torch.float8_e4m3fn)
    got = reference.dequantize(packed.view(torch.float4_e2m1fn_x2), scales).double()
    expected = dequant_f64(packed.view(torch.float4_e2m1fn_x2), scales)
    assert torch.equal(got, expected)
    assert torch.equal(got[:, 0], torch.tensor([e4m3_value(int(c)) for c in codes], dtype=torch.float64))


@pytest.mark.parametrize("seed", [1, 2])
def test_ref_kernel_full_range_values(seed):
    # Every e2m1 code; scales from 2^-9 (subnormal) to 2^3, so that results stay inside fp16's range.
    scale_codes = [0x01, 0x05, 0x0C, 0x1A, 0x30, 0x38, 0x3B, 0x40, 0x46, 0x50]
    sizes = [(33, 128, 256), (128, 256, 512), (1, 128, 768)]
    data = _full_range_input(sizes, seed, scale_codes)
    _assert_within_fp32_accumulation(reference.ref_kernel(data), data)


def test_ref_kernel_generator_data_and_check_can_fail():
    data = reference.generate_input(m=(40, 129), n=(128, 256), k=(256, 512), g=2, seed=7)
    out = reference.ref_kernel(data)
    _assert_within_fp32_accumulation(out, data)
    exact = grouped_gemm_f64(data)
    ok, msg = reference.check_implementation(data, [e.half().unsqueeze(-1) for e in exact])
    assert ok, msg
    wrong = [e.half().unsqueeze(-1).clone() for e in exact]
    wrong[1][5, 7, 0] += 0.25 + abs(float(wrong[1][5, 7, 0])) * 0.01
    ok, msg = reference.check_implementation(data, wrong)
    assert not ok and "mismatch" in msg
    nan_out = [torch.full_like(e.half().unsqueeze(-1), float("nan")) for e in exact]
    assert not reference.check_implementation(data, nan_out)[0]


def test_generator_matches_runner_layout():
    m, n, k = (72, 256), (128, 384), (512, 256)
    data = reference.generate_input(m=m, n=n, k=k, g=2, seed=1111)
    abc, sfs, sfs_r, sizes = data
    assert sizes == [(72, 128, 512, 1), (256, 384, 256, 1)]
    for (a, b, c), (sfa, sfb), (sfa_r, sfb_r), (mi, ni, ki, _) in zip(abc, sfs, sfs_r, sizes):
        assert a.dtype == b.dtype == torch.float4_e2m1fn_x2 and c.dtype == torch.float16
        assert sfa.dtype == sfb.dtype == sfa_r.dtype == sfb_r.dtype == torch.float8_e4m3fn
        assert a.shape == (mi, ki // 2, 1) and a.stride() == (ki // 2, 1, mi * ki // 2)
        assert b.shape == (ni, ki // 2, 1) and b.stride() == (ki // 2, 1, ni * ki // 2)
        assert c.shape == (mi, ni, 1) and c.stride() == (ni, 1, mi * ni)
        assert sfa.shape == (mi, ki // 16, 1) and sfa.stride() == (ki // 16, 1, mi * ki // 16)
        assert sfa.device.type == "cpu" and sfb.device.type == "cpu"  # as the runner's generator keeps them
        rest_m, rest_k = (mi + 127) // 128, ki // 64
        assert sfa_r.shape == (32, 4, rest_m, 4, rest_k, 1)
        assert sfa_r.stride() == (16, 4, rest_k * 512, 1, 512, rest_m * rest_k * 512)
        # The runner's distribution: nibbles limited to sign + 2 low bits, scales in {1, 2}.
        assert ((a.view(torch.uint8) & 0b0100_0100) == 0).all()
        assert set(sfa.view(torch.uint8).unique().tolist()) <= {0x38, 0x40}


def test_task_yml_has_runner_cases():
    task = load_task_yml()
    assert len(task["tests"]) == 10 and len(task["benchmarks"]) == 4
    assert [b["sol_us"] for b in task["benchmarks"]] == [18.833, 10.667, 2.406, 1.525]
    for case in task["tests"] + task["benchmarks"]:
        assert len(case["m"]) == len(case["n"]) == len(case["k"]) == case["g"]
        assert all(k % 256 == 0 for k in case["k"])


@requires_cuda
@pytest.mark.gpu
def test_ref_kernel_gpu_matches_cpu():
    # Any CUDA GPU: the reference on the device agrees with the exact result (TF32 must be off).
    scale_codes = [0x01, 0x0C, 0x30, 0x38, 0x40, 0x50]
    data = _full_range_input([(96, 256, 512), (200, 384, 1024)], 3, scale_codes, device="cuda")
    _assert_within_fp32_accumulation(reference.ref_kernel(data), data)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 10,
                    reason="torch._scaled_mm on fp4 needs a Blackwell (sm_100) GPU")
def test_exact_reference_matches_scaled_mm_on_blackwell():
    for case in load_task_yml()["tests"]:
        data = reference.generate_input(**{k: case[k] for k in ("m", "n", "k", "g", "seed")})
        ok, msg = reference.check_implementation(data, reference.ref_kernel_scaled_mm(data))
        assert ok, msg


@pytest.mark.parametrize("sizes,named", [
    (dict(m=(64, 64), n=(128,), k=(256, 256), g=2), "len(m)=2, len(n)=1, len(k)=2"),
    (dict(m=(64,), n=(128,), k=(256,), g=2), "g=2"),
    (dict(m=(64, 64, 64), n=(128, 128, 128), k=(256, 256, 256), g=2), "len(m)=3, len(n)=3, len(k)=3"),
])
def test_generate_input_names_sizes_of_another_length(sizes, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        reference.generate_input(**sizes, seed=1)


def test_reference_check_is_check_implementation_with_the_reference_run_once(monkeypatch):
    data = reference.generate_input(m=[40, 0, 72], n=[128, 128, 128], k=[256, 256, 256], g=3, seed=11)
    right = reference.ref_kernel(_clone(data))
    wrong = [c.clone() for c in right]
    wrong[2][5, 7] += 1.0
    calls = []
    real = reference.ref_kernel
    monkeypatch.setattr(reference, "ref_kernel", lambda d: calls.append(1) or real(d))
    copy = _clone(data)
    check = reference.reference_check(copy)
    for c in copy[0]:
        c[2].fill_(float("nan"))  # the copy's C tensors held the result; the check keeps its own
    for _ in range(3):
        assert check(right) == reference.check_implementation(_clone(data), right) == (True, "")
        ok, message = check(wrong)
        assert not ok and message == reference.check_implementation(_clone(data), wrong)[1]
        assert "ERROR AT (5, 7, 0)" in message
    assert len(calls) == 1  # reference_check's one run (check_implementation holds the unpatched function)
