"""The MoE layer (nvfp4_moe.layer) as a serving engine runs it, on a GPU (Hopper; the B200 path has never run): a call
beside a one-block kernel spinning on another queue (no stage waits on every CTA being resident), CUDA graphs of one
shape replayed at the same time on separate queues, a first call of a new shape inside a capture, four threads on one
queue and on four queues, and the memory held after rising and falling T. The fp4-A and W4A16 paths on
tests/test_gpu_layer.py's shapes (E 16, H 1024, I 512, top-8; padding tokens and slots). Each result is compared bit
for bit with the same call made alone (eager, on the default queue, synchronised), which tests/test_gpu_layer.py
checks against the float64 reference. Timings print with -s."""
import pytest
import torch

from conftest import cuda_capability, have_dsl
from engine_patterns import beside_a_spin, capture, in_threads, replay_at_once

CAPABILITY = cuda_capability()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not (have_dsl() and CAPABILITY == (9, 0)),
                                                  reason="needs an sm_90 GPU and the DSL")]

from test_layer import Case  # noqa: E402

SHAPES = dict(top_k=8, experts=16, hidden=1024, intermediate=512)
PATHS = ["fp4", "w4a16"]
_WEIGHTS: dict = {}


def weights(path: str, shapes: dict = SHAPES):
    """The layer's prepared weights for `path` (one set per path and shape, seed 0), kept across the tests."""
    key = (path, tuple(sorted(shapes.items())))
    if key not in _WEIGHTS:
        _WEIGHTS[key] = Case(4, seed=0, device="cuda", **shapes).weights(path == "w4a16")
    return _WEIGHTS[key]


class Step:
    """One layer call: `tokens` tokens of seed `seed` (test_layer's Case: a padding token and slot past T = 2) on
    the GPU, over `path`'s weights, into an out buffer the caller poisons."""

    def __init__(self, tokens: int, seed: int, path: str, shapes: dict = SHAPES):
        import nvfp4_moe.layer as layer

        self.layer, self.weights = layer, weights(path, shapes)
        self.x, self.ids, self.tw, self.kwargs = Case(tokens, seed=seed, device="cuda", **shapes).inputs(path)
        self.out = torch.full((tokens, shapes["hidden"]), float("nan"), dtype=torch.bfloat16, device="cuda")

    def run(self) -> torch.Tensor:
        self.layer.nvfp4_moe_layer(self.x, self.ids, self.tw, self.weights, out=self.out, **self.kwargs)
        return self.out

    def expected(self) -> torch.Tensor:
        """The same call alone on the default queue, synchronised: the reference for bitwise equality."""
        ref = torch.full_like(self.out, float("nan"))
        self.layer.nvfp4_moe_layer(self.x, self.ids, self.tw, self.weights, out=ref, **self.kwargs)
        torch.cuda.synchronize()
        assert not torch.isnan(ref).any()
        return ref


@pytest.mark.parametrize("path", PATHS)
def test_layer_completes_beside_a_kernel_spinning_on_another_queue(path):
    """A one-block kernel spins about 1 s on a side queue; the layer's eight launches on the main queue must not wait
    for it: done within 2x their time alone plus a millisecond, and exactly as alone."""
    step = Step(128, seed=3, path=path)
    ref = step.expected()
    alone, beside, spin_running = beside_a_spin(step.run)
    print(f"\n{path}: alone {alone:.3f} ms, beside the spin {beside:.3f} ms, spin still running: {spin_running}")
    assert spin_running, "the spin ended first: the test shows nothing"
    assert beside <= 2 * alone + 1.0, f"{beside:.1f} ms beside a spin on another queue, {alone:.3f} ms alone"
    assert torch.equal(step.out, ref)


@pytest.mark.parametrize("graphs", [2, 4])
@pytest.mark.parametrize("path", PATHS)
def test_layer_graphs_replayed_at_once_stay_exact(path, graphs):
    """`graphs` CUDA graphs of one shape (T = 96), each with its own tokens and routing, replayed at the same time on
    separate queues for 200 rounds: every output bitwise equal to its call alone, every round (each capture owns
    its buffers)."""
    steps = [Step(96, seed=20 + i, path=path) for i in range(graphs)]
    refs = [step.expected() for step in steps]
    captured = [capture(step.run) for step in steps]
    wrong = replay_at_once(captured, lambda: [step.out.fill_(float("nan")) for step in steps],
                           lambda: sum(int((step.out != ref).sum()) for step, ref in zip(steps, refs)), 200)
    assert wrong == 0, f"{wrong} wrong elements over 200 rounds of {graphs} graphs replayed at once"


def test_layer_first_call_inside_a_capture():
    """A layer shape never called before (E 12, H 512, I 256: new stage kernels and GEMMs), first called while a
    CUDA graph is being captured (everything compiles and loads there), replays exactly."""
    shapes = dict(top_k=4, experts=12, hidden=512, intermediate=256)
    step = Step(40, seed=31, path="fp4", shapes=shapes)
    graph = capture(step.run)
    step.out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(step.out, step.expected())


@pytest.mark.parametrize("queues", [1, 4], ids=["one_queue", "four_queues"])
@pytest.mark.parametrize("path", PATHS)
def test_layer_four_threads_stay_exact(path, queues):
    """Four threads, each its own tokens (T = 40, 56, 72, 88), 30 calls each, on one queue or each on its own: every
    output bitwise equal to its call alone."""
    steps = [Step(40 + 16 * i, seed=40 + i, path=path) for i in range(4)]
    refs = [step.expected() for step in steps]

    def one_call(step, ref):
        def call(queue):
            step.out.fill_(float("nan"))
            step.run()
            queue.synchronize()
            return int((step.out != ref).sum())
        return call

    wrong, errors = in_threads([one_call(step, ref) for step, ref in zip(steps, refs)], queues, 30)
    assert not errors and sum(wrong) == 0, (errors, wrong)


def test_layer_memory_stays_bounded_over_rising_and_falling_tokens():
    """14 calls of rising and falling T: the entry's arena (the layer's buffers and both GEMMs') ends at most 1.25 x
    what the largest call alone needs, and so does the device memory allocated over the same calls' own tensors."""
    import nvfp4_moe.gemm as gemm

    sizes = [8, 64, 512, 1024, 128, 1, 1024, 300, 16, 700, 33, 1024, 2, 256]
    largest = max(sizes)
    steps = {t: Step(t, seed=50 + t % 7, path="fp4") for t in set(sizes)}
    gemm.clear_caches()
    torch.cuda.synchronize()
    steps[largest].run()
    torch.cuda.synchronize()
    alone = gemm.cache_info()["arena_bytes"]
    gemm.clear_caches()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    for t in sizes:
        steps[t].run()
    torch.cuda.synchronize()
    held = gemm.cache_info()["arena_bytes"]
    grown = torch.cuda.memory_allocated() - base
    print(f"\narena after {len(sizes)} calls {held / 2**20:.1f} MiB, the largest call alone {alone / 2**20:.1f} MiB "
          f"({held / alone:.3f}x); allocated meanwhile {grown / 2**20:.1f} MiB")
    assert held <= 1.25 * alone and grown <= 1.25 * alone
