"""The shared host path end to end on the CPU: custom_kernel on CPU tensors with the driver stood in for
(tests/host_path.py): the real constraint check, config choice, plan, launch-metadata cache and staged
tables, on both arches' host paths."""
import bench_moe
import pytest
import submission
import submission_sm90
import torch

import host_path
from conftest import check_table_rows

# Two routings of one weight shape (G = 2) whose own best configs differ: on sm_100a the tile table's 128x256
# row for 2 x 1000 rows, 128x128 for 0 + 8 rows; on sm_90a the wide M-exact build, then the narrow one
# (under SM90_NARROW_MEAN_ROWS rows per non-empty expert).
CASE = bench_moe.MoeCase("test", "test", n=4096, k=7168, experts=2, tokens=1)
ROUTINGS = ([1000, 1000], [0, 8], [8, 0], [3, 5])


def _own_choice(arch: str, sizes: list):
    choose = submission.choose_sm100_config if arch == "sm_100a" else submission_sm90.choose_sm90_config
    return choose(sizes, host_path.SMS[arch])


def _check_staged(data, metadata, config, arch):
    """The launch's tables (copied from the staging ring by the upload's stand-in) hold every group's
    pointers and sizes; on Hopper the work list after them is the plan's."""
    check_table_rows(metadata.tables, data)
    if arch == "sm_90a":
        words = submission_sm90.sm90_work_words(tuple(data[3]), host_path.SMS["sm_90a"], config.widths,
                                                config.split_k)
        assert torch.equal(metadata.work_list, words)
        _, table_words = submission.table_words(len(data[3]))
        assert metadata.work_list.data_ptr() == metadata.tables.data_ptr() + 8 * table_words


@pytest.mark.parametrize("arch", ["sm_100a", "sm_90a"])
def test_a_new_routing_keeps_the_weight_shapes_kernel_and_stages_its_tables(arch):
    # The first call of a weight shape chooses its config; routings after it (other experts empty, other
    # token counts) keep that config even where their own choice differs, so they compile nothing: in a
    # serving loop a new choice would compile for seconds. Each call's tables and work list are its own.
    own = [_own_choice(arch, [(m, CASE.n, CASE.k, 1) for m in ms]) for ms in ROUTINGS]
    assert own[1] != own[0]  # the test's premise: the second routing alone would choose another kernel
    with host_path.stubbed_driver(arch) as compiled:
        weights = host_path.expert_weights(CASE)
        for i, ms in enumerate(ROUTINGS):
            data = host_path.expert_input(CASE, weights, ms)
            outputs = submission.custom_kernel(data)
            assert len(outputs) == 2 and all(out is c for out, (_, _, c) in zip(outputs, data[0]))
            if i == 0:
                first = set(compiled)
                assert any(key[4] == own[0] for key in first)  # the GEMM of the first routing's own choice
            assert compiled == first, f"routing {ms} asked for another kernel"
            metadata = next(reversed(submission._launch_metadata.values()))
            config = submission.kernel_config(data, torch.device("cpu"))
            assert submission.backend_of(config).key_config(config) == submission.backend_of(own[0]).key_config(own[0])
            _check_staged(data, metadata, config, arch)


def test_the_host_path_timing_runs(capsys):
    assert host_path.main(["--cases", "qwen3-down-512", "--calls", "2", "--arch", "sm_90a"]) == 0
    out = capsys.readouterr().out
    assert "| qwen3-down-512 | 128 (" in out and "3 kernels asked for in all" in out


def test_prepared_calls_hold_a_bounded_number_of_bytes(monkeypatch):
    # In a serving loop no input is seen twice, so the prepared calls (kept for the benchmark's repeated
    # inputs) would keep the last 16 steps' tensors alive: past PREPARED_CALL_CACHE_BYTES of A, SFA and C
    # the oldest go, and their tensors with them; the newest stays whatever its size. A repeated input still
    # takes the prepared call.
    import gc
    import weakref

    case = bench_moe.MoeCase("small", "test", n=256, k=512, experts=4, tokens=1)
    ms = [8, 8, 0, 16]
    step = sum(m * (case.k // 2 + case.k // 16 + 2 * case.n) for m in ms)
    monkeypatch.setattr(submission, "PREPARED_CALL_CACHE_BYTES", int(2.5 * step))
    with host_path.stubbed_driver("sm_90a"):
        weights = host_path.expert_weights(case)
        first = host_path.expert_input(case, weights, ms)
        submission.custom_kernel(first)
        first_c = weakref.ref(first[0][0][2])
        assert submission._prepared_call(first) is not None
        kept = []
        for _ in range(4):
            kept.append(host_path.expert_input(case, weights, ms))
            submission.custom_kernel(kept[-1])
        assert len(submission._prepared_calls) == 2
        assert [e.lists[0] for e in submission._prepared_calls.values()] == [kept[-2][0], kept[-1][0]]
        assert submission._prepared_call(kept[-1]) is not None and submission._prepared_call(kept[0]) is None
        del first
        gc.collect()
        assert first_c() is None  # its entry is gone, and with it the last reference to its C
        monkeypatch.setattr(submission, "PREPARED_CALL_CACHE_BYTES", step // 2)
        submission.custom_kernel(kept[0])
        assert len(submission._prepared_calls) == 1  # over the bound on its own: the newest stays


@pytest.mark.parametrize("arch", ["sm_100a", "sm_90a"])
def test_random_routings_stage_their_own_tables_and_compile_once_per_weight_shape(arch):
    # Seeded random inputs through the whole host path: 1-256 groups, several weight shapes, routings with
    # every group empty, one group alone, the first and last empty, skewed sizes near every tile width; the
    # task's lists as well as tuples. Each call returns its C tensors and stages its own pointers, sizes and
    # (Hopper) work list; after a weight shape's first call, no routing of it asks for another kernel.
    import random

    rng = random.Random(7)
    shapes = [(128, 256), (256, 512), (4096, 7168), (7168, 2048), (1536, 2048), (2048, 768), (384, 1024)]
    rows = [0, 0, 1, 7, 16, 17, 63, 64, 65, 128, 129, 192, 193]
    with host_path.stubbed_driver(arch) as compiled:
        for _ in range(20):
            groups = rng.choice([1, 2, 3, 8, 64, 256])
            n, k = rng.choice(shapes[:2] if groups > 64 else shapes)
            case = bench_moe.MoeCase("random", "test", n=n, k=k, experts=groups, tokens=1)
            weights = host_path.expert_weights(case)
            first = None
            for _ in range(3):
                ms = [rng.choice(rows) for _ in range(groups)]
                pattern = rng.choice(["random", "one", "ends_empty", "all_empty", "large"])
                if pattern == "one":
                    ms = [0] * groups
                    ms[rng.randrange(groups)] = rng.choice([1, 40, 300])
                elif pattern == "ends_empty":
                    ms[0] = ms[-1] = 0
                elif pattern == "all_empty":
                    ms = [0] * groups
                elif pattern == "large" and groups <= 8:
                    ms = [rng.choice([500, 1000, 2000]) for _ in range(groups)]
                data = host_path.expert_input(case, weights, ms)
                if rng.random() < 0.3:
                    data = tuple(list(part) for part in data)
                outputs = submission.custom_kernel(data)
                assert len(outputs) == groups and all(out is c for out, (_, _, c) in zip(outputs, data[0]))
                if not any(ms):
                    continue  # nothing launched, nothing staged
                metadata = next(reversed(submission._launch_metadata.values()))
                _check_staged(data, metadata, submission.kernel_config(data, torch.device("cpu")), arch)
                first = set(compiled) if first is None else first
                assert compiled == first, (groups, n, k, ms)
