"""The blocked (tcgen05 / cuBLAS) scale layout: to_blocked and the generator's reordered tensors."""
import pytest
import torch

import reference
from conftest import load_task_yml


def _blocked_offset(row: int, col: int, rest_k: int) -> int:
    # cuBLAS "1D block scaling factors layout": 128x4 blocks of 512 bytes, row-block major; inside a block
    # byte (row % 32) * 16 + ((row // 32) % 4) * 4 + col % 4.
    return ((row // 128) * rest_k + col // 4) * 512 + (row % 32) * 16 + ((row // 32) % 4) * 4 + col % 4


def _all_shapes():
    task = load_task_yml()
    shapes = set()
    for case in task["tests"] + task["benchmarks"]:
        for m, n, k in zip(case["m"], case["n"], case["k"]):
            shapes.add((m, k))
            shapes.add((n, k))
    return sorted(shapes)


def _random_scales(rows, cols, seed):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(1, 0x7F, (rows, cols), generator=gen, dtype=torch.uint8)
    return codes.view(torch.float8_e4m3fn)


@pytest.mark.parametrize("rows,cols", [(128, 4), (40, 16), (129, 32), (1, 4), (300, 448)])
def test_to_blocked_matches_offset_formula(rows, cols):
    scales = _random_scales(rows, cols, rows * 1000 + cols)
    blocked = reference.to_blocked(scales).view(torch.uint8)
    rest_k = (cols + 3) // 4
    assert blocked.numel() == ((rows + 127) // 128) * 128 * rest_k * 4
    codes = scales.view(torch.uint8)
    expected = torch.zeros_like(blocked)
    for r in range(rows):
        for c in range(cols):
            expected[_blocked_offset(r, c, rest_k)] = codes[r, c]
    assert torch.equal(blocked, expected)  # padding is zero


@pytest.mark.parametrize("mn,k", _all_shapes())
def test_reordered_equals_blocked_plain_scales(mn, k):
    # Every row/col count of task.yml, M not a multiple of 128 included. Padding rows of the reordered
    # tensor hold random scales as in the runner's generator, so only real rows are compared.
    sf = _random_scales(mn, k // 16, mn + k).unsqueeze(-1)
    reordered = reference.create_reordered_scale_factor_tensor(1, mn, k, sf)
    rest_mn, rest_k = (mn + 127) // 128, k // 64
    assert reordered.shape == (32, 4, rest_mn, 4, rest_k, 1)
    # Storage order (l, rest_mn, rest_k, 32, 4, 4) is to_blocked's flat order.
    flat = reordered.permute(5, 2, 4, 0, 1, 3).contiguous().view(torch.uint8).flatten().cpu()
    blocked = reference.to_blocked(sf[:, :, 0]).view(torch.uint8)
    real = torch.zeros(rest_mn * 128, dtype=torch.bool)
    real[:mn] = True
    real_bytes = real.view(rest_mn, 4, 32).permute(0, 2, 1)[:, None, :, :, None].expand(
        rest_mn, rest_k, 32, 4, 4).flatten()
    assert torch.equal(flat[real_bytes], blocked[real_bytes])
    assert set(flat[~real_bytes].unique().tolist()) <= {0x38, 0x40}  # padding: scales 1.0 / 2.0


def test_reordered_indexing_matches_plain():
    # Element (r, j) of the plain scales sits at [r % 32, (r // 32) % 4, r // 128, j % 4, j // 4, 0].
    m, k = 200, 512
    sf = _random_scales(m, k // 16, 5).unsqueeze(-1)
    reordered = reference.create_reordered_scale_factor_tensor(1, m, k, sf).cpu().view(torch.uint8)
    plain = sf.view(torch.uint8)
    for r in (0, 31, 32, 127, 128, 199):
        for j in range(k // 16):
            assert reordered[r % 32, (r // 32) % 4, r // 128, j % 4, j // 4, 0] == plain[r, j, 0]
