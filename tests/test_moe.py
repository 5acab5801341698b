"""The MoE entry (nvfp4_moe/gemm.py) on the CPU: the schedule's rule (`plan_reference`, what the preparation
kernel computes on the GPU) against the host planner's and against what a work list must be (every output tile
exactly once, contiguous CTA runs balanced within a tile), the weights' blocked scales against
reference.to_blocked, the metadata checks, the torch ops' fake implementations (what torch.compile traces), and
the root's `moe` alias. The GPU half is tests/test_gpu_moe.py."""
import random

import pytest
import torch

import reference

moe = pytest.importorskip("nvfp4_moe.gemm")
submission_sm90 = pytest.importorskip("submission_sm90")

WIDTH_SETS = [config.widths for config in moe.moe_builds().values()]


def _offs(counts) -> torch.Tensor:
    return torch.cumsum(torch.tensor(counts, dtype=torch.int64), 0).to(torch.int32)


def _routings(seed: int):
    rng = random.Random(seed)
    cases = []
    for e, n, k in ((256, 4096, 7168), (128, 1536, 2048), (8, 256, 512), (33, 384, 1024)):
        counts = [rng.choice([0, 0, 1, 3, 8, 15, 16, 17, 31, 32, 33, 64, 65, 127, 128, 129]) for _ in range(e)]
        counts[rng.randrange(e)] = rng.randint(150, 700)
        cases.append((counts, n, k))
    cases.append(([0] * 7 + [300], 256, 512))  # all tokens on the last expert
    cases.append(([0] * 16, 256, 512))  # no token at all
    return cases


@pytest.mark.parametrize("widths", WIDTH_SETS, ids=lambda w: f"w{w[0]}-{w[-1]}")
@pytest.mark.parametrize("seed", [1, 2])
def test_plan_covers_every_tile_once(widths, seed):
    grid = 132
    for counts, n, k in _routings(seed):
        t = sum(counts)
        plan = moe.plan_reference(_offs(counts), t, n, k, widths, grid)
        assert plan["m"].tolist() == counts
        covered = {}
        for e, m0, wi, nt, k0, chunks, split, info in plan["parts"].tolist():
            width = widths[wi]
            assert (k0, chunks, split, info) == (0, k // 128, -1, 0)
            assert 0 <= m0 < counts[e] and nt < n // 128
            for row in range(m0, min(m0 + width, counts[e])):
                key = (e, row, nt)
                assert key not in covered, f"row {row} of expert {e}, N tile {nt}, twice"
                covered[key] = True
        assert len(covered) == t * (n // 128)
        assert len(plan["parts"]) <= moe.max_parts(t, len(counts), n, widths)
        offsets = plan["offsets"]
        assert offsets[0] == 0 and offsets[-1] == len(plan["parts"])
        assert all(a <= b for a, b in zip(offsets, offsets[1:]))
        # balance: every CTA's cost within one tile of the mean
        if len(plan["parts"]):
            cost = [submission_sm90.sm90_tile_cost(widths[wi], k) for _, _, wi, *_ in plan["parts"].tolist()]
            total = sum(cost)
            loads = [sum(cost[a:b]) for a, b in zip(offsets, offsets[1:])]
            assert max(loads) <= total / grid + max(cost)


@pytest.mark.parametrize("seed", [3, 4])
def test_plan_widths_are_the_host_planners(seed):
    """Where the host planner plans in bulk (many tiles per CTA), it picks the same splits and widths per expert."""
    widths = moe.moe_builds()["narrow"].widths
    for counts, n, k in _routings(seed)[:2]:
        sizes = tuple((m, n, k, 1) for m in counts)
        bulk = submission_sm90._sm90_bulk_plan(sizes, 132, widths)
        assert bulk is not None
        plan = moe.plan_reference(_offs(counts), sum(counts), n, k, widths, 132)
        ours = [(int(s), widths[int(w)]) for s, w in zip(plan["splits"], plan["width_index"])]
        assert [(s, w) for s, w in ours if s] == [(s, w) for s, w in bulk.splits if s]


def test_plan_clamps_bad_offsets():
    """Decreasing entries make their expert empty, ends past T are cut at T, negative ones count as 0."""
    offs = torch.tensor([5, 3, 9, -4, 40, 12, 60], dtype=torch.int32)
    plan = moe.plan_reference(offs, 50, 256, 512, WIDTH_SETS[0], 132)
    assert plan["starts"].tolist() == [0, 5, 5, 9, 9, 40, 40]
    assert plan["m"].tolist() == [5, 0, 4, 0, 31, 0, 10]


def test_weight_scales_are_blocked_as_the_kernels_read_them():
    e, n, k = 3, 256, 512
    b = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8)
    scales = torch.randint(0, 127, (e, n, k // 16), dtype=torch.uint8).view(torch.float8_e4m3fn)
    codes, blocked = moe.prepare_moe_weights(b, scales)
    assert torch.equal(codes, b) and blocked.shape == (e, n // 128, k // 64, 512)
    for i in range(e):
        expected = reference.to_blocked(scales[i].view(torch.uint8))
        assert torch.equal(blocked[i].reshape(-1).view(torch.uint8), expected)


def test_w4a16_weights_are_a_permutation_within_each_chunk():
    """prepare_moe_weights(w4a16=True): the same scales, the codes as int8 in w4a16_codes' order: byte 16 q + 4 t + j
    of a 128-k chunk holds nibbles n = 2 j, 2 j + 1 of consumer column q's word t, n < 4 at k = 32 t + 8 n + 2 q and
    n >= 4 at k = 32 t + 8 (n - 4) + 2 q + 1 (checked here element by element, for every position)."""
    e, n, k = 2, 128, 512
    b = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8)
    scales = torch.randint(0, 127, (e, n, k // 16), dtype=torch.uint8).view(torch.float8_e4m3fn)
    plain, blocked = moe.prepare_moe_weights(b, scales)
    codes, blocked16 = moe.prepare_moe_weights(b, scales, w4a16=True)
    assert codes.dtype == torch.int8 and torch.equal(blocked16, blocked) and codes.shape == (e, n, k // 128, 64)
    natural = torch.stack((b & 15, b >> 4), -1).reshape(e, n, k)
    got = codes.view(torch.uint8).reshape(e, n, k // 2)
    for chunk in range(k // 128):
        for q in range(4):
            for t in range(4):
                for j in range(4):
                    byte = got[:, :, chunk * 64 + 16 * q + 4 * t + j]
                    for h, nibble in ((0, byte & 15), (1, byte >> 4)):
                        m = 2 * j + h
                        kk = chunk * 128 + 32 * t + 8 * (m % 4) + 2 * q + m // 4
                        assert torch.equal(nibble, natural[:, :, kk]), (chunk, q, t, j, h)


def _meta_args(t=64, e=8, n=256, k=512, device="meta"):
    return dict(a=torch.empty(t, k // 2, dtype=torch.uint8, device=device),
                a_scale=torch.empty(t, k // 16, dtype=torch.float8_e4m3fn, device=device),
                b=torch.empty(e, n, k // 2, dtype=torch.uint8, device=device),
                b_scale=torch.empty(e, n // 128, k // 64, 512, dtype=torch.float8_e4m3fn, device=device),
                offs=torch.empty(e, dtype=torch.int32, device=device),
                alpha=torch.empty(e, dtype=torch.float32, device=device))


def test_fake_implementations_give_the_output_shape():
    args = _meta_args()
    out = torch.ops.nvfp4_moe.mm(*args.values(), torch.bfloat16)
    assert out.shape == (64, 256) and out.dtype == torch.bfloat16 and out.device.type == "meta"
    target = torch.empty(64, 256, dtype=torch.float16, device="meta")
    torch.ops.nvfp4_moe.mm_out(*args.values(), target)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sixteen_bit_a_is_w4a16(dtype):
    """16-bit A [T, K] with no a_scale: the same T, E, N, K, and A's kind for the GEMM's `a_input`; the fakes
    give the output's shape."""
    args = _meta_args(device="cpu")
    args.update(a=torch.empty(64, 512, dtype=dtype), a_scale=None, b=args["b"].view(torch.int8).view(8, 256, 4, 64))
    with pytest.raises(ValueError, match="CUDA GPU"):  # every check but the device's passed
        moe.check_moe_args(*args.values(), None, torch.float16)
    meta = _meta_args()
    meta.update(a=torch.empty(64, 512, dtype=dtype, device="meta"), a_scale=None,
                b=meta["b"].view(torch.int8).view(8, 256, 4, 64))
    assert moe.check_moe_args(*meta.values(), None, torch.float16, storage=False) == (
        64, 8, 256, 512, torch.float16, moe.A16_INPUTS[dtype])
    out = torch.ops.nvfp4_moe.mm(*meta.values(), torch.bfloat16)
    assert out.shape == (64, 256) and out.dtype == torch.bfloat16


@pytest.mark.parametrize("change, message", [
    (dict(a=torch.empty(64, 512, dtype=torch.bfloat16), b=torch.empty(8, 256, 4, 64, dtype=torch.int8)),
     "a_scale must be None with torch.bfloat16 a"),
    (dict(a=torch.empty(64, 256, dtype=torch.float16), a_scale=None, b=torch.empty(8, 256, 4, 64, dtype=torch.int8)),
     "b must be .* K/128 = 2"),
    (dict(a=torch.empty(64, 512, dtype=torch.bfloat16), a_scale=None),
     "b must be prepare_moe_weights\\(..., w4a16=True\\)'s \\[E, N, K/128, 64\\] int8 .* got \\(8, 256, 256\\) torch.uint8"),
    # a raw int8 view of unpermuted codes: refused by its shape, with the fix named
    (dict(a=torch.empty(64, 512, dtype=torch.bfloat16), a_scale=None, b=torch.empty(8, 256, 256, dtype=torch.int8)),
     "raw \\[E, N, K/2\\] codes go through prepare_moe_weights\\(b, b_scale, w4a16=True\\)"),
    (dict(b=torch.empty(8, 256, 256, dtype=torch.int8)), "b must be prepare_moe_weights' \\[E, N, K/2\\] uint8"),
    (dict(a_scale=None), "a_scale must be .* with NVFP4 a; got None"),
    (dict(a=torch.empty(64, 256, dtype=torch.float32)), "or \\[T, K\\] bfloat16 or float16"),
    (dict(a_scale=torch.empty(64, 16, dtype=torch.uint8)), "a_scale must be"),
    (dict(b_scale=torch.empty(8, 256, 32, dtype=torch.float8_e4m3fn)), "prepare_moe_weights"),
    (dict(offs=torch.empty(8, dtype=torch.int64)), "offs must be int32"),
    (dict(offs=torch.empty(7, dtype=torch.int32)), "offs must be int32 \\[E\\] = \\[8\\]"),
    (dict(alpha=torch.empty(8, dtype=torch.float16)), "alpha must be float32"),
    (dict(a=torch.empty(64, 200, dtype=torch.uint8)), "b must be"),
    (dict(b=torch.empty(8, 200, 256, dtype=torch.uint8)), "N = 200"),
])
def test_checks_name_the_argument(change, message):
    args = {name: t.to("cpu") for name, t in _meta_args(device="cpu").items()}
    args.update(change)
    with pytest.raises(ValueError, match=message):
        moe.check_moe_args(*args.values(), None, torch.bfloat16)


def test_checks_refuse_cpu_tensors_and_bad_out():
    args = _meta_args(device="cpu")
    with pytest.raises(ValueError, match="CUDA GPU"):
        moe.check_moe_args(*args.values(), None, torch.bfloat16)
    with pytest.raises(ValueError, match="out must be"):
        moe.check_moe_args(*args.values(), torch.empty(64, 256, dtype=torch.float32), None)
    with pytest.raises(ValueError, match="out_dtype"):
        moe.check_moe_args(*args.values(), None, torch.float32)


def test_builds_follow_rows_per_expert():
    assert moe.choose_build(64 * 8, 256) == "pairs"
    assert moe.choose_build(512 * 8, 128) == "narrow"
    assert moe.choose_build(4096 * 8, 128) == "wide"
    for config in moe.moe_builds().values():
        # no fused A conversion (its grid-wide barrier): the preparation launch converts NVFP4 A
        assert not config.a16_fused and config.group_alpha and not config.split_k


def test_another_gpu_is_refused_in_one_line(monkeypatch):
    """Hopper and B200 have kernels; any other GPU is told so before anything is built or allocated."""
    import submission

    monkeypatch.setattr(submission, "_device_capability", lambda index: (8, 0))
    with pytest.raises(submission.UnsupportedDeviceError, match="Hopper .sm_90. and B200 .sm_100. GPUs; this GPU is sm_8x"):
        moe._kernels_for(torch.device("cuda", 0), 64, 8, 256, 512, torch.bfloat16, "fp4")
    assert not moe._kernels


def test_b200_refuses_sixteen_bit_a_in_one_line(monkeypatch):
    """W4A16 is a Hopper path: a B200 names what it takes instead, before anything is built or allocated."""
    import submission

    monkeypatch.setattr(submission, "_device_capability", lambda index: (10, 0))
    with pytest.raises(ValueError, match="16-bit a .W4A16. runs on Hopper only; on a B200 give NVFP4 a") as info:
        moe._kernels_for(torch.device("cuda", 0), 64, 8, 256, 512, torch.bfloat16, "bf16")
    assert "\n" not in str(info.value) and not moe._kernels


@pytest.mark.parametrize("rows, k", [(1, 256), (127, 512), (128, 256), (129, 1024), (300, 768)])
def test_b200_scale_relayout_is_the_blocked_layout(rows, k):
    """The B200 preparation kernel's copy of A's scales (`blocked_scale_word`, the kernel's own arithmetic) puts
    every 32-bit word where reference.to_blocked puts its four bytes (its padding rows are zeros, as `got`'s)."""
    scales = torch.randint(0, 256, (rows, k // 16), dtype=torch.uint8)
    words = k // 64
    expected = reference.to_blocked(scales).view(torch.int32)
    got = torch.zeros_like(expected)
    source = scales.view(torch.int32)  # [rows, K / 64]: word w = k-blocks 4 w .. 4 w + 3 of its row
    for r in range(rows):
        for w in range(words):
            got[moe.blocked_scale_word(r, w, words)] = source[r, w]
    assert torch.equal(got, expected)


def test_import_moe_is_the_package_s_entry_for_one_release():
    # The entry moved from moe.py into nvfp4_moe/gemm.py; the root's moe.py stays one release as its alias.
    import moe as alias

    assert alias is moe and moe.__name__ == "nvfp4_moe.gemm"
