"""The host path on a GPU (sm_90 or sm_100, through custom_kernel): which queue the kernels run on, the
staging ring's guard against reusing a piece whose upload is still queued, and groups with M = 0.

Each check compares every output with reference.check_implementation (rtol = atol = 1e-3), the outputs
poisoned with NaN first, as tests/test_gpu.py does.
"""
import time
from collections import OrderedDict

import pytest
import torch

import reference
import submission
from conftest import cuda_capability

CAPABILITY = cuda_capability()

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(CAPABILITY not in ((9, 0), (10, 0)), reason="needs an sm_90 or sm_100 GPU")]

# torch.cuda._sleep spins one thread for this many clock cycles: about a second at 1.8-2 GHz, far longer than
# the host takes for what each test does while the queue is stalled.
SPIN_CYCLES = 2_000_000_000
ARGS = dict(m=(72, 200), n=(256, 384), k=(512, 256), g=2)


def _poison(data):
    for _, _, c in data[0]:
        c.fill_(float("nan"))
    return data


def _check(expected, out):
    for c in out:
        assert not torch.isnan(c).any(), "an output element was never written"
    ok, msg = reference.check_implementation(expected, out)
    assert ok, msg


@pytest.fixture
def default_queue():
    """The test runs on torch's default queue (the kernels' queue), with nothing queued before or after it."""
    assert torch.cuda.current_stream() == torch.cuda.default_stream(), "a test left another queue current"
    torch.cuda.synchronize()
    yield
    torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------------------
# The queue the kernels run on
# ---------------------------------------------------------------------------------------------------------
def test_kernels_run_behind_the_work_of_torchs_default_queue(default_queue):
    # The GEMM is launched behind a spin on torch's default queue; a side queue (torch's pool queues are
    # non-blocking: no implicit ordering with the default one) copies C out while the spin still runs, after
    # the host has waited long enough for any GEMM on an unordered queue to finish: C must still be poison.
    data = reference.generate_input(**ARGS, seed=31)
    expected = reference.generate_input(**ARGS, seed=31)
    submission.custom_kernel(data)  # compile, bind, launch metadata, prepared call
    _poison(data)
    side = torch.cuda.Stream()
    snapshots = [torch.empty(c.shape, dtype=c.dtype, pin_memory=True) for _, _, c in data[0]]
    torch.cuda.synchronize()
    assert submission._prepared_call(data) is not None  # the call below is the launch alone

    torch.cuda._sleep(SPIN_CYCLES)
    spin_done = torch.cuda.Event()
    spin_done.record()
    out = submission.custom_kernel(data)
    time.sleep(0.05)  # a GEMM not ordered behind the spin would be done by now
    with torch.cuda.stream(side):
        for snapshot, c in zip(snapshots, out):
            snapshot.copy_(c, non_blocking=True)
    side.synchronize()
    assert not spin_done.query(), "the spin ended before the side queue looked: raise SPIN_CYCLES"
    assert all(torch.isnan(s.float()).all() for s in snapshots), "the GEMM ran before the spin ahead of it ended"

    torch.cuda.synchronize()
    _check(expected, out)


# ---------------------------------------------------------------------------------------------------------
# The staging ring never hands out a piece whose upload may still be pending
# ---------------------------------------------------------------------------------------------------------
class CountingEvent(submission.KernelQueueEvent):
    waits = 0  # synchronize() calls of every instance

    def synchronize(self):
        CountingEvent.waits += 1
        super().synchronize()


def test_ring_waits_for_uploads_queued_behind_a_stall(default_queue, monkeypatch):
    pieces = 3
    # One input set's piece: its tables and, on Hopper, the GEMM's work list after them. A first call into a
    # roomy ring measures it (same sizes throughout, so every piece below is this long).
    probe = submission.PinnedTableRing(1 << 16, new_event=CountingEvent)
    monkeypatch.setattr(submission, "_table_ring", probe)
    monkeypatch.setattr(submission, "_launch_metadata", OrderedDict())
    monkeypatch.setattr(submission, "_prepared_calls", {})
    submission.custom_kernel(reference.generate_input(**ARGS, seed=40))
    words = probe.next
    assert words >= submission.table_words(len(ARGS["m"]))[1] and len(probe.pending) == 1
    ring = submission.PinnedTableRing(pieces * words, new_event=CountingEvent)  # holds `pieces` of them
    monkeypatch.setattr(submission, "_table_ring", ring)
    monkeypatch.setattr(submission, "_launch_metadata", OrderedDict())  # every input set below is a miss
    monkeypatch.setattr(submission, "_prepared_calls", {})
    monkeypatch.setattr(CountingEvent, "waits", 0)

    # Same sizes throughout: one config, compiled, bound and its kernels loaded here, before the stall; the
    # ring's pinned buffer is allocated here too (its first piece's upload completes before the stall).
    submission.custom_kernel(reference.generate_input(**ARGS, seed=40))
    inputs = [_poison(reference.generate_input(**ARGS, seed=41 + i)) for i in range(2 * pieces + 1)]
    expected = [reference.generate_input(**ARGS, seed=41 + i) for i in range(2 * pieces + 1)]
    torch.cuda.synchronize()
    assert len(ring.pending) == 1 and CountingEvent.waits == 0

    torch.cuda._sleep(SPIN_CYCLES)
    spin_done = torch.cuda.Event()
    spin_done.record()
    outs = []
    for i, data in enumerate(inputs):
        if i == pieces:
            # Pieces 1 and 2 went to inputs 0 and 1, piece 0 (the warm-up's, done) to input 2; input 3 gets
            # piece 1 again, whose upload is still queued behind the spin.
            assert CountingEvent.waits == 0
            assert not spin_done.query(), ("the spin ended before the ring wrapped (too short, or something on "
                                           "the miss path made the host wait for the queue)")
        outs.append(submission.custom_kernel(data))
    assert CountingEvent.waits >= 1, "no take() had to wait: the stall did not reach the reused pieces"
    assert len(submission._launch_metadata) == len(inputs) + 1  # every input set was a miss

    torch.cuda.synchronize()
    for want, out in zip(expected, outs):
        _check(want, out)


# ---------------------------------------------------------------------------------------------------------
# Groups with M = 0
# ---------------------------------------------------------------------------------------------------------
EMPTY_CASES = {
    "first_empty": dict(m=(0, 72, 200), n=(128, 256, 384), k=(256, 512, 256)),
    "middle_and_last_empty": dict(m=(129, 0, 40, 0), n=(256, 384, 128, 512), k=(512, 256, 768, 256)),
    "one_left": dict(m=(0, 0, 1000, 0), n=(128, 256, 512, 128), k=(256, 256, 512, 256)),
}


@pytest.mark.parametrize("name", list(EMPTY_CASES))
def test_empty_groups_mixed_with_non_empty_ones(default_queue, name):
    args = dict(EMPTY_CASES[name], g=len(EMPTY_CASES[name]["m"]))
    for seed in (50, 51):  # fresh inputs, same shapes: the compile and nothing else may be reused
        data = _poison(reference.generate_input(**args, seed=seed))
        expected = reference.generate_input(**args, seed=seed)
        cs = [c for _, _, c in data[0]]
        out = submission.custom_kernel(data)
        assert len(out) == len(cs) and all(o is c for o, c in zip(out, cs))  # every C, in place, in order
        assert [tuple(c.shape) for c in out] == [(m, n, 1) for m, n in zip(args["m"], args["n"])]
        torch.cuda.synchronize()
        _check(expected, out)
        # The same input objects again: the prepared call.
        _poison(data)
        assert submission._prepared_call(data) is not None
        again = submission.custom_kernel(data)
        assert all(o is c for o, c in zip(again, cs))
        torch.cuda.synchronize()
        _check(expected, again)


def test_all_groups_empty_launches_nothing(default_queue, monkeypatch):
    for name in ("compiled_gemm", "launch_metadata", "make_launcher"):
        monkeypatch.setattr(submission, name, lambda *args, _name=name, **kwargs: pytest.fail(f"{_name} called"))
    data = reference.generate_input(m=(0, 0), n=(128, 256), k=(256, 512), g=2, seed=52)
    cs = [c for _, _, c in data[0]]
    assert all(c.is_cuda and c.numel() == 0 for c in cs)
    assert submission.can_implement(data) == (True, "")
    for _ in range(2):  # the full path, then the prepared call
        out = submission.custom_kernel(data)
        assert len(out) == 2 and all(o is c for o, c in zip(out, cs))
    ok, msg = reference.check_implementation(reference.generate_input(m=(0, 0), n=(128, 256), k=(256, 512), g=2,
                                                                      seed=52), out)
    assert ok, msg
