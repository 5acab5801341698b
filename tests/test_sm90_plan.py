"""The M-exact Hopper kernel's host plan (`plan_sm90_work`): every output element is covered by exactly one
tile, widths are ones the kernel was built for, the work list's words decode back to the plan, and the
balance is what longest-processing-time scheduling promises. CPU only."""
import random

import pytest

from conftest import load_task_yml

submission = pytest.importorskip("submission")


def _task_shapes():
    task = load_task_yml()
    return [tuple((m, n, k, 1) for m, n, k in zip(c["m"], c["n"], c["k"])) for c in task["tests"] + task["benchmarks"]]


def _random_shapes(count, seed):
    rng = random.Random(seed)
    shapes = []
    for _ in range(count):
        g = rng.randint(1, 16)
        shapes.append(tuple((rng.choice([1, 7, 32, 33, 64, 100, 191, 192, 193, rng.randint(1, 1500)]),
                             128 * rng.randint(1, 40), 256 * rng.randint(1, 28), 1) for _ in range(g)))
    return shapes


SHAPES = _task_shapes() + _random_shapes(40, 5)


def _decode(words, grid):
    """The kernel's reading of the work list: per CTA, its (group, first row, width index, N tile) tiles."""
    header = (grid + 4) // 4 * 4
    tiles = [tuple(words[header + 4 * i: header + 4 * i + 4]) for i in range(words[grid])]
    return [tiles[words[b]:words[b + 1]] for b in range(grid)]


@pytest.mark.parametrize("max_width", [192, 128])
@pytest.mark.parametrize("num_sms", [132, 8, 1])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"s{i}" for i in range(len(SHAPES))])
def test_plan_covers_every_output_once(shape, num_sms, max_width):
    plan = submission.plan_sm90_work(shape, num_sms, max_width)
    widths = submission.SM90_WIDTHS
    grid = len(plan.cta_tiles)
    assert 1 <= grid <= num_sms and all(plan.cta_tiles)
    covered = {}
    for tiles in plan.cta_tiles:
        for g, m0, wi, nt in tiles:
            m, n, _, _ = shape[g]
            assert 0 <= wi < len(widths) and 0 <= nt < n // 128 and 0 <= m0 < m
            for row in range(m0, min(m, m0 + widths[wi])):
                key = (g, row, nt)
                assert key not in covered, f"row {row} of group {g}, N tile {nt}, in two tiles"
                covered[key] = True
    assert len(covered) == sum(m * (n // 128) for m, n, _, _ in shape)
    # one width per group, none wider than the kernel's widest, and its splits cannot be fewer
    for g, ((m, _, _, _), (splits, width)) in enumerate(zip(shape, plan.splits)):
        assert width in widths and width <= max_width and width * splits >= m and width * (splits - 1) < m
    assert all(widths[wi] <= max_width for tiles in plan.cta_tiles for _, _, wi, _ in tiles)


def test_the_128_row_build_runs_the_same_plan_where_no_tile_is_wider():
    # bench2 / bench3 plan only tiles of 96-128 rows, so `sm90_a16_mexact128` (four fp16 A buffers) runs the
    # very plan of `sm90_a16_mexact` there; bench0 / bench1 need 160- and 192-row tiles.
    for shape in _task_shapes()[-4:]:
        full = submission.plan_sm90_work(shape, 132)
        narrow = submission.plan_sm90_work(shape, 132, 128)
        if max(w for _, w in full.splits) <= 128:
            assert narrow == full
        else:
            assert max(w for _, w in narrow.splits) <= 128 < max(w for _, w in full.splits)


@pytest.mark.parametrize("shape", SHAPES[:20], ids=[f"s{i}" for i in range(20)])
def test_work_list_words_decode_to_the_plan(shape):
    plan = submission.plan_sm90_work(shape, 132)
    words = plan.words()
    assert all(0 <= w < 2 ** 31 for w in words)
    assert _decode(words, len(plan.cta_tiles)) == [list(t) for t in plan.cta_tiles]


@pytest.mark.parametrize("shape", SHAPES, ids=[f"s{i}" for i in range(len(SHAPES))])
def test_plan_is_balanced(shape):
    num_sms = 132
    plan = submission.plan_sm90_work(shape, num_sms)
    costs = [[submission.sm90_tile_cost(submission.SM90_WIDTHS[wi], shape[g][2]) for g, _, wi, _ in tiles]
             for tiles in plan.cta_tiles]
    loads = [sum(c) for c in costs]
    assert max(loads) == pytest.approx(plan.makespan)
    # LPT: no CTA ends later than the average load plus one tile
    biggest = max(c for cta in costs for c in cta)
    assert max(loads) <= sum(loads) / len(loads) + biggest + 1e-6
    # and the plan is never worse than 128-row tiles dealt round-robin (what the other variants do)
    tiles128 = [submission.sm90_tile_cost(128, k) for m, n, k, _ in shape for _ in range(-(-m // 128) * (n // 128))]
    rounds = [0.0] * min(num_sms, len(tiles128))
    for i, cost in enumerate(tiles128):
        rounds[i % len(rounds)] += cost
    assert plan.makespan <= max(rounds) * 1.0001


def test_benchmark_plans_pad_less_than_128_row_tiles():
    # The point of M-exact tiles: the benchmarks' computed rows (incl. padding) drop well below 128-row tiles'.
    for shape in _task_shapes()[-4:-2]:  # benchmarks 0 and 1 (g = 8)
        plan = submission.plan_sm90_work(shape, 132)
        rows = sum(s * w for s, w in plan.splits)
        rows128 = sum(-(-m // 128) * 128 for m, _, _, _ in shape)
        assert rows <= 0.9 * rows128, (plan.splits, rows, rows128)


def test_plan_of_a_large_moe_layer_is_quick():
    # Planned once per shape on the first call: 128 groups of up to 3000 rows must not cost seconds.
    import time
    rng = random.Random(3)
    shape = tuple((rng.randint(1, 3000), 8192, 2048, 1) for _ in range(128))
    start = time.perf_counter()
    plan = submission.plan_sm90_work(shape, 132)
    assert time.perf_counter() - start < 2.0  # ~0.1 s on a 2-core CI box
    assert plan.num_tiles == sum(s * 64 for s, _ in plan.splits)
