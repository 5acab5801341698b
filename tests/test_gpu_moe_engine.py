"""The MoE entry as a serving engine runs it, on a GPU (Hopper; the B200 path has never run): a call beside a
one-block kernel spinning on another queue (no wait on every CTA being resident), CUDA graphs of one shape
replayed at the same time on separate queues, a first call inside a capture with no warm-up, four threads on one
queue and on four queues, and the memory held after rising and falling sizes. Both A types (NVFP4 and, Hopper,
W4A16 bf16). Each result is compared bit for bit with the same call made alone (eager, on the default queue),
which tests/test_gpu_moe.py checks against a float64 decode. Timings print with -s."""
import pytest
import torch

from conftest import cuda_capability, have_dsl
from engine_patterns import beside_a_spin, capture, in_threads, replay_at_once

CAPABILITY = cuda_capability()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not (have_dsl() and CAPABILITY == (9, 0)),
                                                  reason="needs an sm_90 GPU and the DSL")]
A_KINDS = ["fp4", "bf16"]


class Case:
    """One layer's weights (both layouts) and calls of it: random full-range codes, random routings."""

    def __init__(self, e=64, n=2048, k=1024, seed=1):
        try:
            import nvfp4_moe.gemm as moe
        except ImportError:  # a checkout from before the package (these tests run there too, to show the fixes)
            import moe

        self.moe = moe
        self.e, self.n, self.k = e, n, k
        self.gen = torch.Generator(device="cuda").manual_seed(seed)
        codes = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, device="cuda", generator=self.gen)
        scales = (torch.randint(0x30, 0x40, (e, n, k // 16), dtype=torch.uint8, device="cuda", generator=self.gen)
                  .view(torch.float8_e4m3fn))
        self.b, self.b_scale = moe.prepare_moe_weights(codes, scales)
        self.b16 = moe.prepare_moe_weights(codes, scales, w4a16=True)[0]

    def call_args(self, t, a_kind, pad=0):
        """(a, a_scale, b, offs, out) for t routed rows plus `pad` rows no expert covers, out NaN-poisoned."""
        counts = torch.multinomial(torch.ones(self.e, device="cuda"), t, replacement=True, generator=self.gen)
        offs = torch.cumsum(torch.bincount(counts, minlength=self.e), 0).to(torch.int32)
        rows = t + pad
        if a_kind == "fp4":
            a = torch.randint(0, 256, (rows, self.k // 2), dtype=torch.uint8, device="cuda", generator=self.gen)
            a_scale = (torch.randint(0x30, 0x40, (rows, self.k // 16), dtype=torch.uint8, device="cuda",
                                     generator=self.gen).view(torch.float8_e4m3fn))
            b = self.b
        else:
            a = torch.randn((rows, self.k), device="cuda", generator=self.gen).to(torch.bfloat16)
            a_scale, b = None, self.b16
        out = torch.full((rows, self.n), float("nan"), dtype=torch.bfloat16, device="cuda")
        return a, a_scale, b, offs, out

    def run(self, args):
        a, a_scale, b, offs, out = args
        self.moe.nvfp4_moe_mm(a, a_scale, b, self.b_scale, offs, None, out=out)
        return out

    def expected(self, args):
        """The same call alone on the default queue, synchronised: the reference for bitwise equality."""
        a, a_scale, b, offs, out = args
        ref = torch.empty_like(out)
        self.moe.nvfp4_moe_mm(a, a_scale, b, self.b_scale, offs, None, out=ref)
        torch.cuda.synchronize()
        assert not torch.isnan(ref).any()
        return ref


@pytest.mark.parametrize("a_kind", A_KINDS)
def test_a_call_completes_beside_a_kernel_spinning_on_another_queue(a_kind):
    """A one-block kernel spins about 1 s on a side queue (it holds one SM's registers, so one GEMM CTA cannot be
    resident until it ends); the entry's call on the main queue must not wait for it: it finishes within 2x its
    time alone plus a millisecond of launch latency, and exactly as alone."""
    case = Case(seed=3)
    args = case.call_args(512, a_kind)
    ref = case.expected(args)
    alone, beside, spin_running = beside_a_spin(lambda: case.run(args))
    print(f"\n{a_kind}: alone {alone:.3f} ms, beside the spin {beside:.3f} ms ({beside / alone:.2f}x), "
          f"spin still running when it finished: {spin_running}")
    assert spin_running, "the spin ended first: the test shows nothing"
    assert beside <= 2 * alone + 1.0, f"{beside:.1f} ms beside a spin on another queue, {alone:.3f} ms alone"
    assert torch.equal(args[-1], ref)


@pytest.mark.parametrize("graphs", [2, 4])
@pytest.mark.parametrize("a_kind", A_KINDS)
def test_graphs_of_one_shape_replayed_at_once_stay_exact(a_kind, graphs):
    """`graphs` CUDA graphs of one shape, each with its own inputs, captured on torch's capture queue, then
    replayed at the same time on separate queues for 300 rounds: every output bitwise equal to its call alone,
    every round (each graph owns its buffers)."""
    case = Case(seed=5 + graphs)
    calls = [case.call_args(384, a_kind, pad=16) for _ in range(graphs)]
    refs = [case.expected(args) for args in calls]
    captured = [capture(lambda args=args: case.run(args)) for args in calls]
    wrong = replay_at_once(captured, lambda: [args[-1].fill_(float("nan")) for args in calls],
                           lambda: sum(int((args[-1] != ref).sum()) for args, ref in zip(calls, refs)), 300)
    assert wrong == 0, f"{wrong} wrong elements over 300 rounds of {graphs} graphs replayed at once"


def test_a_first_call_inside_a_capture_needs_no_warm_up():
    """A shape never called before, first called while a CUDA graph is being captured (its kernels compile and
    load there), replays exactly."""
    case = Case(e=24, n=384, k=768, seed=9)
    case.moe.clear_caches()
    args = case.call_args(100, "fp4", pad=3)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        case.run(args)
    args[-1].fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(args[-1], case.expected(args))


@pytest.mark.parametrize("queues", [1, 4], ids=["one_queue", "four_queues"])
@pytest.mark.parametrize("a_kind", A_KINDS)
def test_four_threads_stay_exact(a_kind, queues):
    """Four threads, each its own inputs, 50 calls each, on one queue or each on its own: every output bitwise
    equal to its call alone."""
    case = Case(seed=11)
    calls = [case.call_args(256 + 64 * i, a_kind) for i in range(4)]
    refs = [case.expected(args) for args in calls]

    def one_call(args, ref):
        def call(queue):
            args[-1].fill_(float("nan"))
            case.run(args)
            queue.synchronize()
            return int((args[-1] != ref).sum())
        return call

    wrong, errors = in_threads([one_call(args, ref) for args, ref in zip(calls, refs)], queues, 50)
    assert not errors and sum(wrong) == 0, (errors, wrong)


def test_memory_stays_bounded_over_rising_and_falling_sizes():
    """20 calls of rising and falling T: the entry's arena ends at most 1.25 x what the largest call alone needs,
    and so does the device memory allocated over the same calls' own tensors."""
    case = Case(e=64, n=1024, k=2048, seed=13)
    sizes = [64, 256, 1024, 4096, 8192, 2048, 512, 128, 8192, 16384, 4096, 64, 16384, 1024, 300, 9000, 16000, 50,
             12000, 2]
    largest = max(sizes)
    calls = {t: case.call_args(t, "fp4") for t in set(sizes)}
    case.moe.clear_caches()
    torch.cuda.synchronize()
    case.run(calls[largest])
    torch.cuda.synchronize()
    alone = case.moe.cache_info()["arena_bytes"]
    case.moe.clear_caches()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    for t in sizes:
        case.run(calls[t])
    torch.cuda.synchronize()
    held = case.moe.cache_info()["arena_bytes"]
    grown = torch.cuda.memory_allocated() - base
    print(f"\narena after 20 calls {held / 2**20:.1f} MiB, the largest call alone {alone / 2**20:.1f} MiB "
          f"({held / alone:.3f}x); allocated meanwhile {grown / 2**20:.1f} MiB")
    assert held <= 1.25 * alone and grown <= 1.25 * alone
