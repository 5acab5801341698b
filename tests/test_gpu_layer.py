"""The MoE layer (nvfp4_moe.layer) on a GPU, with the real GEMM entry, against test_layer's float64 reference and its
interval bound (one rounding per stored stage; the GEMMs' fp32 accumulation bound K 2^-24 sum |a w|).

DeepSeek-V3-like small shapes: E 16, H 1024, I 512, top-8, T in {1, 8, 33, 128}; every e2m1 code, e4m3 block
scales over 2^-6 .. 2 with zeros and subnormals, experts 2 and 5 empty, a padding token and a padding slot. On
every path (fp4-A with a scalar or per-expert a1_gscale, prequantized x; W4A16 on Hopper): the results, expert
parallelism (2 and 4 simulated ranks summing to the layer), bitwise determinism over 10 calls, a batch-invariance
report (printed, not asserted: whether a token's output changes when other tokens join it),
torch.compile(fullgraph=True), a CUDA graph captured at T = 128 and replayed after new routing (with padding
tokens) is written into its inputs, exact against eager calls, and an eager call under
torch.cuda.set_sync_debug_mode("error") (no host sync).

Skipped without an sm_90 or sm_100 GPU and nvidia-cutlass-dsl (on a B200 the W4A16 cases skip: Hopper only)."""
import copy

import pytest
import torch

from conftest import cuda_capability, have_dsl

CAPABILITY = cuda_capability()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not (have_dsl() and CAPABILITY in ((9, 0), (10, 0))),
                                                  reason="needs an sm_90 or sm_100 GPU and the DSL")]

from test_layer import PATHS, Case, assert_within, check_expert_parallel, run_path  # noqa: E402

SHAPES = dict(top_k=8, experts=16, hidden=1024, intermediate=512)
MAX_TOKENS = 128


def gpu_case(tokens: int, seed: int = 0) -> Case:
    return Case(tokens, seed=seed, device="cuda", **SHAPES)


def need_path(path: str):
    if path == "w4a16" and CAPABILITY != (9, 0):
        pytest.skip("W4A16 runs on Hopper only")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("tokens", [1, 8, 33, MAX_TOKENS])
def test_layer_against_reference(path, tokens):
    need_path(path)
    case = gpu_case(tokens, seed=tokens)
    out, ref = run_path(case, path)
    assert out.shape == (tokens, case.hidden) and out.dtype == torch.bfloat16
    assert_within(out, ref, f"{path}, T = {tokens}")
    if tokens > 2:
        assert out[1].eq(0).all() and not out[1].signbit().any(), "a padding token's output is +0"


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("path", ["fp4", "fp4 per-expert gs", "w4a16"])
def test_expert_parallel_ranks_sum_to_layer(ranks, path):
    need_path(path)
    check_expert_parallel(gpu_case(33, seed=4), path, ranks)


@pytest.mark.parametrize("path", PATHS)
def test_bitwise_deterministic(path):
    need_path(path)
    case = gpu_case(MAX_TOKENS, seed=5)
    weights = case.weights(path == "w4a16", case.gs1_per_expert if path == "fp4 per-expert gs" else None)
    first = case.call(path, weights)
    for _ in range(10):
        assert torch.equal(case.call(path, weights).view(torch.int16), first.view(torch.int16))


@pytest.mark.parametrize("path", ["fp4", "w4a16"])
def test_batch_invariance_report(path, capsys):
    """Whether the first 8 tokens' outputs are bitwise the same alone and beside 120 others (the GEMM's tile
    widths follow T / E): printed, not asserted (the issue asks for the report)."""
    need_path(path)
    case = gpu_case(MAX_TOKENS, seed=6)
    weights = case.weights(path == "w4a16")
    together = case.call(path, weights)[:8]
    alone = copy.copy(case)
    alone.x, alone.topk_ids, alone.topk_weights = case.x[:8], case.topk_ids[:8], case.topk_weights[:8]
    by_itself = alone.call(path, weights)
    same = (together.view(torch.int16) == by_itself.view(torch.int16)).all(dim=1)
    with capsys.disabled():
        print(f"\nbatch invariance, {path}: {int(same.sum())} of 8 tokens bitwise equal alone and in T = "
              f"{MAX_TOKENS}; largest |difference| {(together.float() - by_itself.float()).abs().max().item():g}")


@pytest.mark.parametrize("path", ["fp4", "w4a16"])
def test_compile_fullgraph(path):
    need_path(path)
    import nvfp4_moe.layer as layer

    case = gpu_case(33, seed=7)
    weights = case.weights(path == "w4a16")
    *inputs, kwargs = case.inputs(path)

    def step(x, ids, tw):
        return layer.nvfp4_moe_layer(x, ids, tw, weights, **kwargs)

    compiled = torch.compile(step, fullgraph=True)
    assert torch.equal(compiled(*inputs), step(*inputs))


@pytest.mark.parametrize("path", ["fp4", "w4a16"])
def test_cuda_graph_replays_new_routing(path):
    """One layer step captured at T = 128; new activations, routing and weights written into the captured tensors
    (the last 28 tokens padding: -1), replayed: bitwise equal to an eager call on the same inputs, padding rows
    zero."""
    need_path(path)
    import nvfp4_moe.layer as layer

    case = gpu_case(MAX_TOKENS, seed=8)
    weights = case.weights(path == "w4a16")
    x, ids, tw, kwargs = case.inputs(path)

    def step():
        return layer.nvfp4_moe_layer(x, ids, tw, weights, **kwargs)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for seed in (9, 10, 11):
        new = Case(MAX_TOKENS, seed=seed, **SHAPES)  # its inputs only; the layer's weights stay
        new_ids = new.topk_ids.clone()
        new_ids[100:] = -1
        x.copy_(new.x)
        ids.copy_(new_ids)
        tw.copy_(new.topk_weights)
        graph.replay()
        eager = step()
        torch.cuda.synchronize()
        assert torch.equal(captured, eager), f"replay after routing {seed} differs from the eager call"
        assert captured[100:].eq(0).all()


@pytest.mark.parametrize("path", ["fp4", "fp4 per-expert gs", "fp4 prequantized", "w4a16"])
def test_no_host_sync(path):
    """An eager call (after a first one, which compiles) with every input on the GPU already: torch raises at any
    synchronizing operation under set_sync_debug_mode("error")."""
    need_path(path)
    import nvfp4_moe.layer as layer

    case = gpu_case(33, seed=12)
    weights = case.weights(path == "w4a16", case.gs1_per_expert if path == "fp4 per-expert gs" else None)
    x, ids, tw, kwargs = case.inputs(path)
    layer.nvfp4_moe_layer(x, ids, tw, weights, **kwargs)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        layer.nvfp4_moe_layer(x, ids, tw, weights, **kwargs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
