"""custom_kernel's Hopper (sm_90a) kernel on an H100/H200: every task.yml case and the edge cases through
reference.check_implementation, outputs poisoned with NaN first, in each tile variant.

Skipped unless a CUDA GPU of capability (9, 0) and nvidia-cutlass-dsl are present.
"""
import collections
import time

import pytest
import torch

import harness
import reference

try:
    import submission_sm90
except ImportError:  # no nvidia-cutlass-dsl: every test here is skipped
    submission_sm90 = None
from conftest import SM90_CHANGED_CONFIGS, cuda_capability, load_task_yml, sm90_changed_config

HOPPER = cuda_capability() == (9, 0)
try:
    import cutlass  # noqa: F401
    HAVE_DSL = True
except ImportError:
    HAVE_DSL = False

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not (HOPPER and HAVE_DSL), reason="needs an sm_90 GPU and nvidia-cutlass-dsl")]

# "auto": the tile custom_kernel picks by itself; the others force one entry of SM90_VARIANT_CONFIGS (the
# sm90_a16_* ones convert A to fp16 once per call, as the GEMM launch's first phase); "two_launch":
# sm90_a16_mexact with that conversion as a launch of its own (Sm90GemmConfig.a16_fused=False); "whole_tiles":
# sm90_a16_mexact planned without split-K (Sm90GemmConfig.split_k=False: no tile's K split across CTAs).
CONFIGS = ["auto", "sm90_tile128", "sm90_a16_mexact", "sm90_a16_mexact128", "sm90_a16_narrow", "sm90_a16_pairs",
           "two_launch", "whole_tiles"]


def _task_cases(section):
    return [{k: case[k] for k in ("m", "n", "k", "g", "seed")} for case in load_task_yml()[section]]


EDGE_CASES = {
    "m_odd": dict(m=[1, 8, 33, 127, 129, 1000], n=[128, 256, 128, 384, 128, 256], k=[256, 512, 256, 768, 256, 512],
                  g=6, seed=7),
    "m_odd_n256": dict(m=[1, 8, 33, 127, 129, 1000], n=[256, 512, 256, 768, 256, 512],
                       k=[256, 512, 256, 768, 256, 512], g=6, seed=12),
    "g1": dict(m=[200], n=[512], k=[1024], g=1, seed=8),
    "g16": dict(m=[1 + (37 * i) % 300 for i in range(16)], n=[256 * (1 + i % 3) for i in range(16)],
                k=[256 * (1 + (5 * i) % 7) for i in range(16)], g=16, seed=9),
    "k7168": dict(m=[72, 129], n=[256, 512], k=[7168, 7168], g=2, seed=10),
    # sm90_a16_mexact: every width (64 ... 192; M <= 64 pads to 64) and splits of larger M; more tiles than SMs,
    # so CTAs run tiles of different widths back to back through the same fp16 A buffers
    "widths": dict(m=[1, 32, 33, 64, 97, 128, 150, 192, 193, 400, 1000], n=[4096, 256, 512, 128, 3072, 256, 1024,
                                                                         128, 2048, 512, 1024],
                   k=[256, 512, 256, 768, 256, 512, 256, 256, 512, 256, 256], g=11, seed=13),
    # sm90_a16_narrow: M next to every narrow width (16, 32, 64, 96, 128) and above the widest, so tiles of
    # every width run back to back on a CTA and the last split of a group is partly past its M
    "narrow_widths": dict(m=[1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 95, 96, 97, 127, 128, 129, 130, 300],
                          n=[128 * (1 + i % 5) for i in range(21)], k=[256 * (1 + i % 3) for i in range(21)], g=21,
                          seed=16),
    # empty groups (M = 0) first, last and between, beside every width: they stay in the tables, no tile
    "empty_groups": dict(m=[0, 40, 0, 200, 1, 0], n=[256, 512, 128, 256, 384, 128], k=[512, 256, 768, 512, 256, 256],
                         g=6, seed=15),
    # narrow experts of long K, two to three parts per CTA: each part many more 128-k chunks than any ring has
    # stages (the consumer pairs' turns at the rings)
    "long_parts": dict(m=[8, 16, 24, 32, 5, 12, 20, 30, 1, 17], n=[4096] * 10, k=[2048] * 8 + [7168] * 2, g=10,
                       seed=17),
    # split-K: few tiles of long K, so the plan splits them across up to SM90_MAX_PARTS CTAs each
    "split_k": dict(m=[1, 192, 65, 300], n=[128, 128, 256, 128], k=[7168, 4096, 2048, 6144], g=4, seed=14),
}


@pytest.fixture
def sm90(request, monkeypatch):
    """The submission, with the Hopper tile variant forced where the test asks for one."""
    import submission
    import submission_sm90

    config = getattr(request, "param", "auto")
    # sm90_auto keeps the build it chose per weight shape: each test chooses afresh, so that a forced choice
    # below is the one that runs (an earlier test's choice for the same shape would win otherwise).
    monkeypatch.setattr(submission_sm90.BACKEND, "_weight_shape_choices", collections.OrderedDict())
    if config in SM90_CHANGED_CONFIGS:
        forced = sm90_changed_config(config)
        monkeypatch.setattr(submission_sm90, "choose_sm90_config", lambda sizes, num_sms: forced)
    elif config != "auto":
        forced = submission_sm90.SM90_VARIANT_CONFIGS[config]
        monkeypatch.setattr(submission_sm90, "choose_sm90_config", lambda sizes, num_sms: forced)
    monkeypatch.setattr(submission_sm90, "SM90_OVERRIDES", {})  # whatever an earlier test left
    return submission


def _run(sm90, config, data):
    return sm90.custom_kernel(data)


def _clone(data):
    abc, sfs, sfs_r, sizes = data
    return ([tuple(t.clone() for t in x) for x in abc], [tuple(t.clone() for t in x) for x in sfs],
            [tuple(t.clone() for t in x) for x in sfs_r], list(sizes))


# A launch that has not finished after this long is taken as hung (the slowest case here runs in milliseconds).
HANG_SECONDS = 120


def _finish_or_stop(config):
    """Waits for the launches so far, polling: a kernel that hangs (a pipeline deadlock) stops the whole run with
    a message naming the config, rather than blocking it for good (every later test would wait on the GPU too)."""
    done = torch.cuda.Event()
    done.record()
    deadline = time.monotonic() + HANG_SECONDS
    while not done.query():
        if time.monotonic() > deadline:
            pytest.exit(f"config {config}: a launch did not finish in {HANG_SECONDS} s (hung); the run stops here, "
                        "as the GPU stays busy", returncode=3)
        time.sleep(0.001)


def _check(sm90, config, data):
    expect = _clone(data)
    for _, _, c in data[0]:
        c.fill_(float("nan"))
    out = _run(sm90, config, data)
    _finish_or_stop(config)
    for c in out:
        assert not torch.isnan(c).any(), "an output element was never written"
    ok, msg = reference.check_implementation(expect, out)
    assert ok, msg


def _full_range(data, seed, a_exp_max, b_exp_max):
    """Every e2m1 code in A and B; scales from all finite e4m3 codes (both signs, subnormals) whose exponent
    field is at most a_exp_max / b_exp_max (keeps the fp16 result finite)."""
    gen = torch.Generator().manual_seed(seed)
    abc, sfs, _, sizes = data
    sfs_r = []
    for (a, b, _), (sfa, sfb), (m, n, k, l) in zip(abc, sfs, sizes):
        a.view(torch.uint8).copy_(torch.randint(0, 256, a.shape, generator=gen, dtype=torch.uint8))
        b.view(torch.uint8).copy_(torch.randint(0, 256, b.shape, generator=gen, dtype=torch.uint8))
        for sf, emax in ((sfa, a_exp_max), (sfb, b_exp_max)):
            pool = torch.tensor([c for c in range(256) if ((c >> 3) & 0xF) <= emax and (c & 0x7F) != 0x7F],
                                dtype=torch.uint8)
            sf.view(torch.uint8).copy_(pool[torch.randint(0, len(pool), sf.shape, generator=gen)])
        sfs_r.append((reference.create_reordered_scale_factor_tensor(l, m, k, sfa),
                      reference.create_reordered_scale_factor_tensor(l, n, k, sfb)))
    return abc, sfs, sfs_r, sizes


@pytest.mark.parametrize("args", [pytest.param(a, id=f"test{i}") for i, a in enumerate(_task_cases("tests"))]
                         + [pytest.param(a, id=f"bench{i}") for i, a in enumerate(_task_cases("benchmarks"))])
@pytest.mark.parametrize("sm90", CONFIGS, indirect=True)
def test_task_cases(sm90, args, request):
    config = request.node.callspec.params["sm90"]
    _check(sm90, config, reference.generate_input(**args))
    # fresh inputs, same shapes: only the compile and per-pointer launch metadata may be reused
    _check(sm90, config, reference.generate_input(**dict(args, seed=args["seed"] + 17)))


@pytest.mark.parametrize("name", list(EDGE_CASES))
@pytest.mark.parametrize("sm90", CONFIGS, indirect=True)
def test_edge_cases(sm90, name, request):
    config = request.node.callspec.params["sm90"]
    args = EDGE_CASES[name]
    _check(sm90, config, reference.generate_input(**args))


@pytest.mark.parametrize("sm90", CONFIGS, indirect=True)
@pytest.mark.parametrize("scales", [(9, 9), (15, 2)], ids=["small_scales", "all_a_scales"])
def test_full_range_codes(sm90, scales, request):
    config = request.node.callspec.params["sm90"]
    # The generator only draws e2m1 codes {0, ±0.5, ±1, ±1.5} and scales {1, 2}: the bit-trick dequantizer
    # must be exact for every code, subnormal and negative scales included.
    args = dict(m=[40, 200, 129], n=[256, 512, 256], k=[256, 512, 256], g=3, seed=11)
    _check(sm90, config, _full_range(reference.generate_input(**args), 1, *scales))


def test_same_buffers_new_sizes(sm90):
    # Regression for the launch-metadata cache (keyed by pointers and sizes): same pointers, smaller M must
    # not reuse the stale size table.
    data = reference.generate_input(m=(128, 128), n=(256, 128), k=(512, 256), g=2, seed=3)
    sm90.custom_kernel(data)
    abc, sfs, sfs_r, sizes = data
    small = [(a[:64], b, c[:64]) for a, b, c in abc]
    small_sfs = [(sfa[:64], sfb) for sfa, sfb in sfs]
    _check(sm90, "auto", (small, small_sfs, sfs_r, [(64, n, k, l) for _, n, k, l in sizes]))


@pytest.mark.parametrize("name", ["split_k", "k7168"])
def test_split_k_is_used_and_deterministic(sm90, name):
    # The default plan splits these tiles' K (checked on the host plan), and two calls on the same inputs give
    # the same bits: the last part sums the partials in slot order, whichever part finished last.
    args = EDGE_CASES[name]
    shape = tuple(harness.case_sizes(args))
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert submission_sm90.plan_sm90_work(shape, num_sms).num_split_tiles > 0
    data = reference.generate_input(**args)
    first = [c.clone() for c in sm90.custom_kernel(data)]
    for _ in range(3):
        for _, _, c in data[0]:
            c.fill_(float("nan"))
        again = sm90.custom_kernel(data)
        torch.cuda.synchronize()
        assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(first, again))
    ok, msg = reference.check_implementation(_clone(data), first)
    assert ok, msg


MOE_EXPERTS = 64


def _moe_pattern(tokens: list, seed: int):
    """MoE-like input: one group per expert, `tokens[e]` rows each (0: an empty expert)."""
    return reference.generate_input(m=tokens, n=[256] * MOE_EXPERTS, k=[512] * MOE_EXPERTS, g=MOE_EXPERTS, seed=seed)


@pytest.mark.parametrize("sm90", ["auto", "sm90_tile128"], indirect=True)
def test_a_new_pattern_of_empty_experts_compiles_nothing(sm90, monkeypatch):
    # A decode loop: the set of empty experts changes every step, the expert count does not. After one
    # warm-up call no pattern compiles anything, and every output is written and right.
    warm = [1 + (7 * e) % 40 if e % 3 else 0 for e in range(MOE_EXPERTS)]
    _check(sm90, None, _moe_pattern(warm, 1))
    compiles = []
    real_compile = sm90._compile
    monkeypatch.setattr(sm90, "_compile", lambda key: compiles.append(key) or real_compile(key))
    only_one = [0] * MOE_EXPERTS
    only_one[MOE_EXPERTS // 2] = 5
    first_last_empty = [0] + [8 + e % 24 for e in range(1, MOE_EXPERTS - 1)] + [0]
    gen = torch.Generator().manual_seed(5)
    skewed = [int(x) for x in (torch.randint(0, 3, (MOE_EXPERTS,), generator=gen) * torch.randint(
        0, 60, (MOE_EXPERTS,), generator=gen))]
    for seed, tokens in enumerate((only_one, first_last_empty, skewed), start=2):
        _check(sm90, None, _moe_pattern(tokens, seed))
    assert compiles == [], [key[1] for key in compiles]
