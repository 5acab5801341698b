"""The M-exact Hopper kernel's host plan (`plan_sm90_work`): every output element is covered by exactly one
tile and every 128-k chunk of a tile by exactly one part, widths are ones the kernel was built for, split
tiles' parts agree on their counter and slots, the work list's words decode back to the plan, and the
balance is what longest-processing-time scheduling (whole tiles) or split-K promises. CPU only."""
import dataclasses
import random

import pytest

from conftest import SM90_CHANGED_CONFIGS, load_task_yml, sm90_changed_config

submission = pytest.importorskip("submission")
submission_sm90 = pytest.importorskip("submission_sm90")


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


def _moe_shapes(seed):
    """Many experts, most with a few rows, some empty, one or two hot: the narrow build's regime."""
    rng = random.Random(seed)
    shapes = []
    for g, n, k in ((256, 4096, 7168), (128, 1536, 2048), (64, 7168, 2048)):
        ms = [rng.choice([0, 0, 1, 3, 8, 9, 15, 16, 17, 24, 33, 40, 64, 65]) for _ in range(g)]
        ms[rng.randrange(g)] = rng.randint(150, 400)
        shapes.append(tuple((m, n, k, 1) for m in ms))
    return shapes


SHAPES = _task_shapes() + _random_shapes(40, 5) + _moe_shapes(6)
# The M-exact builds, each planned over its own widths; WIDE: the widest build's (`sm90_a16_mexact`).
M_EXACT_BUILDS = ["sm90_a16_mexact", "sm90_a16_mexact128", "sm90_a16_narrow"]
WIDE = submission_sm90.SM90_DEFAULT_WIDTHS


def _decode(words, grid):
    """The kernel's reading of the work list (`tile_range`, `tile_at`): the partials' offset, and per CTA its
    parts of SM90_PART_WORDS words each."""
    row = submission_sm90.SM90_PART_WORDS
    header = (grid + 2 + row - 1) // row * row
    parts = [list(words[header + row * i: header + row * (i + 1)]) for i in range(words[grid + 1])]
    return words[0], [parts[words[1 + b]:words[2 + b]] for b in range(grid)]


@pytest.mark.parametrize("split_k", [True, False], ids=["split_k", "whole"])
@pytest.mark.parametrize("build", M_EXACT_BUILDS)
@pytest.mark.parametrize("num_sms", [132, 8, 1])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"s{i}" for i in range(len(SHAPES))])
def test_plan_covers_every_output_once(shape, num_sms, build, split_k):
    widths = submission_sm90.SM90_VARIANT_CONFIGS[build].widths
    plan = submission_sm90.plan_sm90_work(shape, num_sms, widths, split_k)
    assert plan.widths == widths
    grid = len(plan.cta_tiles)
    assert 1 <= grid <= num_sms and all(plan.cta_tiles)
    tiles = {}  # (group, first row, width index, N tile) -> its parts
    for b, parts in enumerate(plan.cta_tiles):
        for g, m0, wi, nt, k0, chunks, split, slot in parts:
            m, n, k, _ = shape[g]
            assert 0 <= wi < len(widths) and 0 <= nt < n // 128 and 0 <= m0 < m
            assert 0 <= k0 and chunks >= 1 and k0 + chunks <= k // 128
            tiles.setdefault((g, m0, wi, nt), []).append((k0, chunks, split, slot, b))
    covered = {}
    for (g, m0, wi, nt), parts in tiles.items():
        m, _, k, _ = shape[g]
        for row in range(m0, min(m, m0 + widths[wi])):
            key = (g, row, nt)
            assert key not in covered, f"row {row} of group {g}, N tile {nt}, in two tiles"
            covered[key] = True
        # K: every chunk in exactly one part
        chunks = sorted(c for k0, count, _, _, _ in parts for c in range(k0, k0 + count))
        assert chunks == list(range(k // 128)), (g, m0, nt, parts)
    assert len(covered) == sum(m * (n // 128) for m, n, _, _ in shape)
    _check_splits(plan, tiles)
    if not split_k:
        assert plan.num_split_tiles == 0 and all(len(p) == 1 for p in tiles.values())
    # one of the build's widths per group (the narrowest that its splits need), and its splits cannot be fewer
    for g, ((m, _, _, _), (splits, width)) in enumerate(zip(shape, plan.splits)):
        if m == 0:
            continue
        assert width in widths and width * splits >= m and width * (splits - 1) < m
        assert width == widths[0] or widths[widths.index(width) - 1] * splits < m


def _check_splits(plan, tiles):
    """A split tile's parts: one counter index, parts 0 .. S - 1 in S consecutive slots of their own, each at
    least SM90_MIN_PART_CHUNKS chunks, on different CTAs; a whole tile is one part with index -1."""
    counters, slots = set(), set()
    for parts in tiles.values():
        if len(parts) == 1:
            assert parts[0][2] == -1 and parts[0][3] == 0
            continue
        split = {s for _, _, s, _, _ in parts}
        assert len(split) == 1 and 0 <= min(split) < plan.num_split_tiles and not split & counters
        counters |= split
        assert sorted(slot & 0xFF for _, _, _, slot, _ in parts) == list(range(len(parts)))
        assert {(slot >> 8) & 0xFF for _, _, _, slot, _ in parts} == {len(parts)}
        first = {slot >> 16 for _, _, _, slot, _ in parts}
        assert len(first) == 1
        mine = set(range(min(first), min(first) + len(parts)))
        assert not mine & slots and max(mine) < plan.num_slots
        slots |= mine
        assert all(count >= submission_sm90.SM90_MIN_PART_CHUNKS for _, count, _, _, _ in parts)
        assert len(parts) <= submission_sm90.SM90_MAX_PARTS
        assert len({b for _, _, _, _, b in parts}) == len(parts)  # a CTA holds one part of a tile
    assert len(counters) == plan.num_split_tiles <= submission_sm90.SM90_MAX_SPLIT_TILES
    assert len(slots) == plan.num_slots


def test_the_128_row_build_runs_the_same_plan_where_no_tile_is_wider():
    # bench2 / bench3 plan only tiles of 96-128 rows, so `sm90_a16_mexact128` (four fp16 A buffers) runs the
    # very plan of `sm90_a16_mexact` there; bench0 / bench1 need 160- and 192-row tiles.
    for shape in _task_shapes()[-4:]:
        full = submission_sm90.plan_sm90_work(shape, 132)
        narrow = submission_sm90.plan_sm90_work(shape, 132, submission_sm90.sm90_widths(128))
        if max(w for _, w in full.splits) <= 128:
            # the same plan; its width indices are the same too (64-128 lead both builds' widths)
            assert dataclasses.replace(narrow, widths=full.widths) == full
        else:
            assert max(w for _, w in narrow.splits) <= 128 < max(w for _, w in full.splits)


@pytest.mark.parametrize("shape", SHAPES[:20], ids=[f"s{i}" for i in range(20)])
def test_work_list_words_decode_to_the_plan(shape):
    plan = submission_sm90.plan_sm90_work(shape, 132)
    words = plan.words(12345)
    assert all(-1 <= w < 2 ** 31 for w in words)
    flag = submission_sm90.SM90_SPLIT_FLAG  # a split part's flag in its chunks word
    expect = [[[*t[:5], t[5] | (flag if t[6] >= 0 else 0), *t[6:]] for t in tiles] for tiles in plan.cta_tiles]
    assert _decode(words, len(plan.cta_tiles)) == (12345, expect)


@pytest.mark.parametrize("build", M_EXACT_BUILDS)
@pytest.mark.parametrize("shape", _moe_shapes(6), ids=["g256", "g128", "g64"])
def test_bulk_plan_words_decode_to_the_plan(shape, build):
    # MoE shapes (tiles many per CTA) take the vectorised plan: its words, as the kernel reads them, are its
    # tiles; its makespan is its busiest CTA's load, within one tile of the mean load.
    widths = submission_sm90.SM90_VARIANT_CONFIGS[build].widths
    plan = submission_sm90.plan_sm90_work(shape, 132, widths)
    assert isinstance(plan, submission_sm90.Sm90BulkPlan)
    words = plan.words(0)
    assert _decode(words, plan.num_ctas) == (0, [[list(t) for t in tiles] for tiles in plan.cta_tiles])
    cost = lambda t: submission_sm90.sm90_tile_cost(widths[t[2]], t[5] * 128)  # noqa: E731
    loads = [sum(cost(t) for t in tiles) for tiles in plan.cta_tiles]
    assert plan.makespan == max(loads)
    assert max(loads) - sum(loads) / len(loads) <= max(cost(t) for tiles in plan.cta_tiles for t in tiles)


@pytest.mark.parametrize("build", M_EXACT_BUILDS)
def test_bulk_plan_balances_as_well_as_longest_first(build):
    # The vectorised plan's assignment against the longest-first one (`_sm90_assign`) of the same splits, on
    # re-routed decode steps of the bench.py --moe shapes: at most 2.5 % longer. Measured worst over 8
    # re-routings of each: 1.020, Qwen3 gate/up with exactly 12 tiles per CTA, which the longest-first plan
    # balances exactly by giving some CTAs a tile fewer; the laps give every CTA one tile each.
    import bench_moe

    widths = submission_sm90.SM90_VARIANT_CONFIGS[build].widths
    for case in bench_moe.MOE_CASES[:5]:
        for seed in range(3):
            shape = tuple((m, case.n, case.k, 1) for m in bench_moe.route(case, case.seed + 100 + seed))
            plan = submission_sm90.plan_sm90_work(shape, 132, widths)
            assert isinstance(plan, submission_sm90.Sm90BulkPlan), case.name
            longest_first = submission_sm90._sm90_assign(shape, [s for s, _ in plan.splits], 132, widths)[0]
            assert plan.makespan <= 1.025 * longest_first, (case.name, seed, plan.makespan / longest_first)


def test_split_k_splits_where_whole_tiles_leave_sms_idle():
    # bench2 (120 tiles of 32 chunks on 132 SMs) gets split tiles and a shorter predicted makespan; bench0 /
    # bench1 (more tiles than SMs) and bench3 (nothing to gain) keep their whole-tile plans; a single tile of
    # long K is spread over several SMs.
    shapes = _task_shapes()[-4:]
    for shape, expect_split in zip(shapes, (False, False, True, False)):
        whole = submission_sm90.plan_sm90_work(shape, 132, WIDE, False)
        plan = submission_sm90.plan_sm90_work(shape, 132, WIDE, True)
        assert (plan.num_split_tiles > 0) == expect_split, (shape, plan.num_split_tiles)
        assert plan.makespan <= whole.makespan
        if expect_split:
            assert plan.makespan < submission_sm90.SM90_SPLIT_K_GAIN * whole.makespan
    one = submission_sm90.plan_sm90_work(((200, 128, 7168, 1),), 132, WIDE, True)
    alone = submission_sm90.plan_sm90_work(((200, 128, 7168, 1),), 132, WIDE, False)
    assert one.num_split_tiles >= 1 and len(one.cta_tiles) > len(alone.cta_tiles)
    assert one.makespan < alone.makespan / 2


@pytest.mark.parametrize("shape", SHAPES, ids=[f"s{i}" for i in range(len(SHAPES))])
def test_split_k_plan_is_balanced(shape):
    num_sms = 132
    plan = submission_sm90.plan_sm90_work(shape, num_sms)
    loads = [sum(submission_sm90.sm90_part_cost(plan.widths[wi], chunks, split >= 0)
                 for _, _, wi, _, _, chunks, split, _ in parts) for parts in plan.cta_tiles]
    assert max(loads) == pytest.approx(plan.makespan)
    assert plan.makespan <= submission_sm90.plan_sm90_work(shape, num_sms, WIDE, False).makespan


@pytest.mark.parametrize("shape", SHAPES, ids=[f"s{i}" for i in range(len(SHAPES))])
def test_plan_is_balanced(shape):
    num_sms = 132
    plan = submission_sm90.plan_sm90_work(shape, num_sms, WIDE, False)
    costs = [[submission_sm90.sm90_tile_cost(plan.widths[part[2]], shape[part[0]][2]) for part in tiles]
             for tiles in plan.cta_tiles]
    loads = [sum(c) for c in costs]
    assert max(loads) == pytest.approx(plan.makespan)
    # LPT: no CTA ends later than the average load plus one tile
    biggest = max(c for cta in costs for c in cta)
    assert max(loads) <= sum(loads) / len(loads) + biggest + 1e-6
    # and the plan is never worse than 128-row tiles dealt round-robin (what the other variants do)
    tiles128 = [submission_sm90.sm90_tile_cost(128, k) for m, n, k, _ in shape for _ in range(-(-m // 128) * (n // 128))]
    rounds = [0.0] * min(num_sms, len(tiles128))
    for i, cost in enumerate(tiles128):
        rounds[i % len(rounds)] += cost
    assert plan.makespan <= max(rounds) * 1.0001


def test_benchmark_plans_pad_less_than_128_row_tiles():
    # The point of M-exact tiles: the benchmarks' computed rows (incl. padding) drop well below 128-row tiles'.
    for shape in _task_shapes()[-4:-2]:  # benchmarks 0 and 1 (g = 8)
        plan = submission_sm90.plan_sm90_work(shape, 132, WIDE, False)
        rows = sum(s * w for s, w in plan.splits)
        rows128 = sum(-(-m // 128) * 128 for m, _, _, _ in shape)
        assert rows <= 0.9 * rows128, (plan.splits, rows, rows128)


def test_plan_of_a_large_moe_layer_is_quick():
    # Planned once per shape on the first call: 128 groups of up to 3000 rows must not cost seconds.
    import time
    rng = random.Random(3)
    shape = tuple((rng.randint(1, 3000), 8192, 2048, 1) for _ in range(128))
    start = time.perf_counter()
    plan = submission_sm90.plan_sm90_work(shape, 132)
    assert time.perf_counter() - start < 2.0  # ~0.1 s on a 2-core CI box
    assert plan.num_tiles == sum(s * 64 for s, _ in plan.splits)


def test_auto_takes_the_128_row_build_where_its_plan_is_predicted_no_longer():
    # sm90_auto: `sm90_a16_mexact128` (a deeper fp16 A ring) wherever its plan's makespan is no longer than
    # the widest build's: bench3 (the very same plan, measured 2 % faster) and bench0 (a different plan of the
    # same makespan, measured 6 % faster); bench1 and bench2 are predicted 19 % longer at 128 (measured 16 %
    # and 11 % slower).
    chosen = [submission_sm90.choose_sm90_config(list(shape), 132).max_width for shape in _task_shapes()[-4:]]
    assert chosen == [128, 192, 192, 128]
    for shape in _task_shapes():
        config = submission_sm90.choose_sm90_config(list(shape), 132)
        if config is submission_sm90.SM90_VARIANT_CONFIGS["sm90_a16_narrow"]:
            continue  # its plan is shorter than both (the next test)
        narrow = submission_sm90.plan_sm90_work(shape, 132, submission_sm90.sm90_widths(128)).makespan
        wide = submission_sm90.plan_sm90_work(shape, 132, WIDE).makespan
        assert (config.max_width == 128) == (narrow <= wide)
    assert submission_sm90.choose_sm90_config((), 132) is submission_sm90.SM90_VARIANT_CONFIGS["sm90_a16_mexact"]


def test_auto_keeps_its_build_for_a_weight_shape_whatever_the_m():
    # The first call of a weight shape (G, each N and K) picks the build; other M later (MoE routing, other
    # experts empty) keep it, since switching builds compiles. Another weight shape chooses afresh.
    backend = submission_sm90.Sm90Backend()
    narrow_first = [(128, 4096, 1536, 1), (384, 4096, 1536, 1)]  # bench3: the 128 build
    assert backend.config(narrow_first, 132).max_width == 128
    wide_alone = [(192, 4096, 1536, 1), (320, 4096, 1536, 1)]
    assert submission_sm90.choose_sm90_config(wide_alone, 132).max_width == 192  # its own choice differs ...
    assert backend.config(wide_alone, 132).max_width == 128  # ... but the weight shape's build stays
    assert backend.config([(0, 4096, 1536, 1), (8, 4096, 1536, 1)], 132).max_width == 128
    other = [(192, 3072, 4096, 1), (320, 3072, 4096, 1)]  # bench2's weights: chosen afresh
    assert backend.config(other, 132).max_width == 192


@pytest.mark.parametrize("split_k", [False, True])
def test_empty_groups_change_nothing_but_the_group_numbers(split_k):
    # Empty groups stay in the tables (one compile per group count): the plan must be the one of the
    # non-empty groups alone, with each tile's group renumbered to its place among all groups.
    full = ((0, 4096, 7168, 1), (40, 4096, 7168, 1), (0, 4096, 7168, 1), (200, 4096, 7168, 1),
            (8, 4096, 7168, 1), (0, 4096, 7168, 1))
    kept = [g for g, size in enumerate(full) if size[0]]
    dense = tuple(full[g] for g in kept)
    for build in M_EXACT_BUILDS:
        widths = submission_sm90.SM90_VARIANT_CONFIGS[build].widths
        with_empty = submission_sm90.plan_sm90_work(full, 132, widths, split_k)
        without = submission_sm90.plan_sm90_work(dense, 132, widths, split_k)
        renumbered = tuple(tuple((kept[t[0]], *t[1:]) for t in tiles) for tiles in without.cta_tiles)
        assert with_empty.cta_tiles == renumbered
        assert with_empty.makespan == without.makespan
        assert [with_empty.splits[g] for g in kept] == list(without.splits)
        assert all(with_empty.splits[g][0] == 0 for g in range(len(full)) if g not in kept)


def test_narrow_build_fits_tiles_to_experts_with_few_rows():
    # sm90_a16_narrow: widths 16-128, so an expert of a few rows runs a tile as wide as its rows rounded up to
    # 16, 32 or 64 instead of 64; a hot expert splits into wider tiles. Its plan streams less padding and
    # predicts a shorter makespan on DeepSeek-V3 decode (most experts at 1-16 rows); on the benchmarks
    # (groups of 40-384 rows) it is no shorter than the wide builds' (equal on bench0 and bench3).
    narrow = submission_sm90.SM90_VARIANT_CONFIGS["sm90_a16_narrow"]
    assert narrow.widths == (16, 32, 64, 96, 128)
    decode = tuple((m, 4096, 7168, 1) for m in [0, 1, 8, 9, 16, 17, 33, 200] + [3] * 120)
    plan = submission_sm90.plan_sm90_work(decode, 132, narrow.widths)
    assert [w for s, w in plan.splits[1:7]] == [16, 16, 16, 16, 32, 64] and plan.splits[7] == (2, 128)
    assert plan.splits[0][0] == 0  # an empty expert: no tile
    wide = submission_sm90.plan_sm90_work(decode, 132, WIDE)
    assert plan.makespan < 0.7 * wide.makespan
    for shape in _task_shapes()[-4:]:
        assert (submission_sm90.plan_sm90_work(shape, 132, narrow.widths).makespan
                >= submission_sm90.plan_sm90_work(shape, 132, WIDE).makespan)


def test_auto_takes_the_narrow_build_where_its_plan_is_predicted_shorter():
    # sm90_auto, above SM90_NARROW_MEAN_ROWS rows per expert: `sm90_a16_narrow` (widths 16-128) where its plan's
    # makespan is shorter than both wide builds' (Qwen3-30B-A3B decode, 32 rows per expert: measured 4.5 % and
    # 7.8 % faster), a wide build where it only ties (the benchmarks) or is longer (a prefill step)
    narrow = submission_sm90.SM90_VARIANT_CONFIGS["sm90_a16_narrow"]
    qwen3_up = [(8 * (1 + e % 8), 1536, 2048, 1) for e in range(128)]  # 8-64 rows, 36 on average
    assert submission_sm90.choose_sm90_config(qwen3_up, 132) is narrow
    for shape in _task_shapes()[-4:]:
        assert submission_sm90.choose_sm90_config(list(shape), 132) is not narrow, shape
    prefill = [(700 + 37 * e, 4096, 7168, 1) for e in range(32)]
    assert submission_sm90.choose_sm90_config(prefill, 132) is not narrow
    for shape in _task_shapes():
        sizes = tuple(size for size in shape if size[0])
        spans = [submission_sm90.plan_sm90_work(sizes, 132, config.widths, config.split_k).makespan
                 for config in (submission_sm90.SM90_VARIANT_CONFIGS[name] for name in
                                ("sm90_a16_narrow", "sm90_a16_mexact128", "sm90_a16_mexact"))]
        assert (submission_sm90.choose_sm90_config(list(shape), 132) is narrow) == (spans[0] < min(spans[1:]))


def test_auto_takes_the_consumer_pairs_build_for_experts_with_a_few_rows_each():
    # sm90_auto: the consumer-pairs build (widths 16-32) where the non-empty groups average at most
    # SM90_NARROW_MEAN_ROWS rows (measured 6-8 % faster than the narrow build, itself 17-19 % faster than the
    # wide builds, on the DeepSeek-V3 decode cases, 3-9 rows per active expert); the one-pair builds elsewhere:
    # the benchmarks, the task.yml tests, and a decode step of 32 rows per expert (Qwen3). Empty groups do not
    # count.
    limit = submission_sm90.SM90_NARROW_MEAN_ROWS
    few_rows = submission_sm90.SM90_VARIANT_CONFIGS["sm90_a16_pairs"]
    decode = [(m, 4096, 7168, 1) for m in [0, 1, 8, 9, 16, 17, 33, 200] + [3] * 120]
    assert submission_sm90.choose_sm90_config(decode, 132) is few_rows
    at_limit = [(limit, 1536, 2048, 1)] * 127 + [(0, 1536, 2048, 1)]
    assert submission_sm90.choose_sm90_config(at_limit, 132) is few_rows
    above = [(limit, 1536, 2048, 1)] * 127 + [(limit + 1, 1536, 2048, 1)]
    assert submission_sm90.choose_sm90_config(above, 132).consumer_pairs == 1
    for shape in _task_shapes():
        assert submission_sm90.choose_sm90_config(list(shape), 132).consumer_pairs == 1, shape


@pytest.mark.parametrize("fields, message", [
    (dict(min_width=8), "min_width=8: one of"),
    (dict(max_width=24), "max_width=24: one of"),
    (dict(min_width=16, max_width=160), "give 6 mainloops; a build takes 1 to 5"),
    (dict(min_width=128, max_width=64), "give 0 mainloops"),
    (dict(consumer_pairs=3), "consumer_pairs=3: 1, or 2 with m_exact and max_width <= 32"),
    (dict(consumer_pairs=2, max_width=64), "consumer_pairs=2: 1, or 2 with m_exact and max_width <= 32"),
])
def test_config_refuses_widths_no_build_can_take(fields, message):
    with pytest.raises(ValueError, match=message):
        submission_sm90.Sm90GemmConfig(a16_prepass=True, m_exact=True, **fields)
    with pytest.raises(ValueError, match="only with m_exact"):
        submission_sm90.Sm90GemmConfig(min_width=16)


def test_no_switch_brings_back_the_early_stage_release():
    # r43b / r43c: the transform warpgroup and the consumers release a stage only after its loaded words are used;
    # the switch that kept the transform's early release (`late_stage_release`) is gone, and the build tests count
    # early arrivals (EARLYREL) in every build's SASS
    with pytest.raises(TypeError, match="late_stage_release"):
        submission_sm90.Sm90GemmConfig(late_stage_release=False)
    assert not [f.name for f in dataclasses.fields(submission_sm90.Sm90GemmConfig) if "release" in f.name]


@pytest.mark.parametrize("name", sorted(SM90_CHANGED_CONFIGS))
def test_changed_configs_are_configs(name):
    # the GPU tests' and the sanitizer's "variant with one field changed" configs name a variant, a field and a
    # value that make a valid config other than the variant's own
    variant, field, value = SM90_CHANGED_CONFIGS[name]
    base = submission_sm90.SM90_VARIANT_CONFIGS[variant]
    changed = sm90_changed_config(name)
    assert getattr(base, field) != value and getattr(changed, field) == value
    assert name not in submission_sm90.SM90_VARIANT_CONFIGS


# ptxas launches a CTA of T threads at 65536 / T registers each (in steps of 8): the CTA's whole allocation.
# `setmaxnreg` only moves registers within it, so a warpgroup that asks for more than the others gave back
# waits forever at its `setmaxnreg.inc`.
@pytest.mark.parametrize("variant", sorted(submission_sm90.SM90_VARIANT_CONFIGS))
def test_sm90_register_and_shared_memory_budgets(variant):
    config = submission_sm90.SM90_VARIANT_CONFIGS[variant]
    kernel = submission_sm90.Sm90BlockScaledGroupedGemmKernel(4, config)
    launch_regs = 65536 // kernel.threads // 8 * 8
    groups = kernel.threads // 128
    transform = groups - 1 - 2 * kernel.pairs  # 1, or 0 where consumer pairs leave it out
    asked = 128 * (kernel.producer_regs + transform * kernel.transform_regs + 2 * kernel.pairs * kernel.consumer_regs)
    assert transform in (0, 1) and asked <= kernel.threads * launch_regs, (variant, asked, kernel.threads * launch_regs)
    for regs in (kernel.producer_regs, kernel.transform_regs, kernel.consumer_regs):
        assert 24 <= regs <= 256 and regs % 8 == 0
    # an epilogue slab per consumer warpgroup
    assert kernel.c_slabs == 2 * kernel.pairs
    smem = (kernel.num_stages * kernel.stage_bytes + kernel.num_a16 * kernel.a16_bytes
            + kernel.c_slabs * kernel.C_BYTES + kernel.SMEM_SLACK)
    assert smem <= submission.DYNAMIC_SMEM_BUDGET, (variant, smem)
    # a chunk releases the fp16 A buffer of the one before it: the ring needs at least two buffers, one per pair
    assert kernel.num_a16 >= max(2, kernel.pairs)


@pytest.mark.parametrize("seed", range(4))
def test_segments_number_each_element_by_segment_and_place(seed):
    # The bulk plan's expansion of split counts into rows and of rows into N tiles, against a Python loop;
    # empty segments first, last and in runs among them.
    import torch

    rng = random.Random(seed)
    counts = [rng.choice([0, 0, 1, 2, 5, 17]) for _ in range(rng.randint(1, 300))]
    counts[0], counts[-1] = 0, 0
    segment, index = submission_sm90._segments(torch.tensor(counts, dtype=torch.int64))
    expect = [(i, j) for i, c in enumerate(counts) for j in range(c)]
    assert list(zip(segment.tolist(), index.tolist())) == expect
    empty, _ = submission_sm90._segments(torch.zeros(3, dtype=torch.int64))
    assert empty.numel() == 0
