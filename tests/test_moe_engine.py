"""The MoE entry as a serving engine uses it, on the CPU: its buffers (one growing arena per queue, one per CUDA-graph
capture), its launches (one caller at a time, under the tensors' device), its caches (bounded, visible, freeable)
and its build key (PDL). The GPU side of the same promises (a spin on another queue, concurrent graph replays,
threads, memory after rising and falling sizes) is tests/test_gpu_moe.py."""
import contextlib
import threading
import time

import pytest
import torch

import nvfp4_moe.gemm as moe
import submission


@pytest.fixture
def clean_caches():
    """Each test starts and ends with the entry holding nothing."""
    moe.clear_caches(compiled=True)
    yield
    moe.clear_caches(compiled=True)


def test_an_arena_grows_to_at_most_a_quarter_over_the_largest_need(clean_caches):
    """Rising and falling needs: the arena never shrinks, is always enough, stays within 1.25 x the largest need
    so far (plus 4 KB rounding), and moves only when it grows."""
    arena = moe._Arena(torch.device("cpu"))
    largest, bases = 0, set()
    for need in (1000, 5000, 5001, 300, 80_000, 81_000, 100_001, 50, 100_000, 99_999, 1 << 20, 12, (1 << 20) + 1):
        before = arena.nbytes
        base = arena.reserve(need)
        largest = max(largest, need)
        assert arena.nbytes >= need and base % 1024 == 0 and arena.nbytes >= before
        assert arena.nbytes <= 1.25 * largest + 4096
        if arena.nbytes == before:
            assert base in bases  # no growth: the same memory
        bases.add(base)


@pytest.mark.parametrize("hopper", [True, False], ids=["sm90", "sm100"])
@pytest.mark.parametrize("a_input", ["fp4", "bf16"])
def test_buffer_offsets_are_aligned_and_disjoint_and_hold_what_the_kernels_write(hopper, a_input):
    if not hopper and a_input != "fp4":
        pytest.skip("a B200 takes NVFP4 A only")
    widths = moe.moe_builds()["narrow"].widths
    for t, e, n, k in ((1, 8, 256, 256), (333, 128, 1536, 2048), (4096, 256, 4096, 7168)):
        nbytes, workspace, tables, work = moe.buffer_bytes(hopper, t, e, n, k, a_input, widths, 132)
        assert workspace == 0 and tables % 1024 == 0 and work % 1024 == 0 and nbytes % 1024 == 0
        if hopper:
            # descriptors and counters, then (NVFP4 A) T rows of fp16 A: K x 2 bytes each
            assert tables >= moe.MoeSm90Gemm.a16_offset(e) + (t * k * 2 if a_input == "fp4" else 0)
            parts = moe.max_parts(t, e, n, widths)
            assert nbytes - work >= 4 * (moe.header_words(132) + 8 * parts)
        else:
            assert tables >= moe.MoeSm100Gemm.tensormap_workspace_bytes(e)
            assert nbytes - work >= (t + 127 * e) * (k // 16)
        assert work - tables >= 8 * submission.table_words(e)[1]


class _Recorder:
    """Stands in for a CellLauncher: records (name, thread, values), sleeping a little so that threads interleave
    wherever nothing stops them."""

    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def __call__(self, values):
        assert moe._LOCK.locked(), "a launch outside the entry's lock"
        self.log.append((self.name, threading.get_ident(), values))
        time.sleep(0.001)


def _fake_call(monkeypatch, hopper: bool = True, t: int = 16, capture=lambda queue: None):
    """CPU tensors of a T = t call whose signature is planned already with recording launchers, the device and
    capture queries stood in for; returns (arguments, log)."""
    log = []
    monkeypatch.setattr(moe, "_on_device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capture(None) is not None)
    monkeypatch.setattr(moe, "_capture_id", capture)
    e, n, k = 8, 256, 512
    args = (torch.zeros(t, k // 2, dtype=torch.uint8), torch.zeros(t, k // 16, dtype=torch.float8_e4m3fn),
            torch.zeros(e, n, k // 2, dtype=torch.uint8), torch.zeros(e, n // 128, k // 64, 512, dtype=torch.float8_e4m3fn),
            torch.zeros(e, dtype=torch.int32), None, torch.zeros(t, n, dtype=torch.bfloat16))
    kernels = moe._MoeKernels(_Recorder("prepare", log), _Recorder("gemm", log), hopper, 132,
                              submission.table_words(e)[0])
    sizes = moe.buffer_bytes(hopper, t, e, n, k, "fp4", moe.moe_builds()["pairs"].widths, 132)
    moe._signatures[moe._signature(*args)] = moe._Plan(kernels, *sizes)
    return args, log


def test_four_threads_on_one_queue_launch_in_pairs(monkeypatch, clean_caches):
    """Four threads calling at once: every preparation launch is followed by its own call's GEMM (the buffers of a
    queue are shared, so another call's preparation in between would overwrite the tables the GEMM reads), and
    each launch carries its own call's pointers."""
    args, log = _fake_call(monkeypatch)
    outs = [torch.zeros_like(args[-1]) for _ in range(4)]

    def caller(out):
        for _ in range(5):
            moe._moe_mm_into(*args[:-1], out)

    threads = [threading.Thread(target=caller, args=(out,)) for out in outs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(log) == 4 * 5 * 2
    for (first, owner, values), (second, owner2, _) in zip(log[::2], log[1::2]):
        assert (first, second) == ("prepare", "gemm") and owner == owner2
        assert values[5] in {out.data_ptr() for out in outs}  # out's address: one of the callers' own
    assert len(moe._arenas) == 1  # one queue, one arena


def test_each_capture_gets_its_own_arena_and_lets_go_when_it_ends(monkeypatch, clean_caches):
    """Two captures on the same queue (torch.cuda.graph captures every graph on one queue) get distinct buffers,
    and neither shares the eager calls'; a capture's arena goes once the capture has ended."""
    current = {"id": None}
    args, log = _fake_call(monkeypatch, capture=lambda queue: current["id"])
    moe._moe_mm_into(*args)
    eager_tables = log[-1][2][0]
    current["id"] = 7
    moe._moe_mm_into(*args)
    moe._moe_mm_into(*args)  # a second call of the same capture: the same buffers
    first = log[-1][2][0]
    assert log[-3][2][0] == first != eager_tables and len(moe._capture_arenas) == 1
    held = moe._capture_arenas[(None, 7)][0].buffer  # noqa: F841  (a graph's pool keeps it; here this does)
    current["id"] = 8
    moe._moe_mm_into(*args)
    second = log[-1][2][0]
    assert second not in (first, eager_tables)
    assert list(moe._capture_arenas) == [(None, 8)]  # capture 7 is over: its arena went
    current["id"] = None
    moe._moe_mm_into(*args)
    assert log[-1][2][0] == eager_tables and not moe._capture_arenas
    info = moe.cache_info()
    assert info["signatures"] == 1 and len(info["arenas"]) == 1 and info["arena_bytes"] > 0


def test_an_empty_call_is_checked_once_and_launches_nothing(monkeypatch, clean_caches):
    calls = []
    real = moe.check_moe_args

    def counting(*args, **kwargs):
        calls.append(1)
        return (0,) + real(*args, storage=False, **kwargs)[1:]

    monkeypatch.setattr(moe, "check_moe_args", counting)
    a = torch.zeros(0, 256, dtype=torch.uint8, device="meta")
    args = (a, torch.zeros(0, 32, dtype=torch.float8_e4m3fn, device="meta"),
            torch.zeros(8, 256, 256, dtype=torch.uint8, device="meta"),
            torch.zeros(8, 2, 8, 512, dtype=torch.float8_e4m3fn, device="meta"),
            torch.zeros(8, dtype=torch.int32, device="meta"), None, torch.zeros(0, 256, dtype=torch.bfloat16, device="meta"))
    for _ in range(3):
        moe._moe_mm_into(*args)
    assert len(calls) == 1 and list(moe._signatures.values()) == [None] and not moe._arenas


def test_the_launches_run_under_the_tensors_device(monkeypatch):
    """The DSL launches on the current device's context: a call whose tensors are on another device than the
    current one switches to theirs for the launches (one GPU cannot show it; the current device is stubbed)."""
    entered = []

    class Guard:
        def __init__(self, device):
            self.device = device

        def __enter__(self):
            entered.append(self.device)

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(torch.cuda, "device", Guard)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    with moe._on_device(torch.device("cuda", 0)):
        pass
    assert entered == [torch.device("cuda", 0)]
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert isinstance(moe._on_device(torch.device("cuda", 0)), contextlib.nullcontext)


def test_pdl_is_part_of_the_build(monkeypatch):
    """set_pdl governs the MoE builds: the config (and so the compile and kernel keys) follows it."""
    monkeypatch.setattr(submission, "USE_PDL", False)
    off = moe._hopper_config("pairs", torch.bfloat16, "fp4")
    monkeypatch.setattr(submission, "USE_PDL", True)
    on = moe._hopper_config("pairs", torch.bfloat16, "fp4")
    assert not off.use_pdl and on.use_pdl and off != on


def test_clear_caches_lets_go_of_everything(monkeypatch, clean_caches):
    args, _ = _fake_call(monkeypatch)
    moe._moe_mm_into(*args)
    assert moe.cache_info()["arena_bytes"] > 0
    moe.clear_caches()
    info = moe.cache_info()
    assert info["arena_bytes"] == 0 and info["signatures"] == 0 and not info["arenas"]
