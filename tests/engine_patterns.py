"""How a serving engine runs a call, as test patterns (tests/test_gpu_moe_engine.py for the MoE entry,
tests/test_gpu_layer_engine.py for the layer): beside a kernel spinning on another queue, CUDA graphs replayed at
the same time on separate queues, several threads. Each takes plain callables, so that a test compares whatever
its call writes with the same call made alone."""
import threading
import time

import torch

SPIN_CYCLES = 2_000_000_000  # about 1 s at Hopper's 1.98 GHz


def median_ms(fn, reps: int = 5) -> float:
    """Median wall ms of fn() from an idle GPU to its work done."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def beside_a_spin(run) -> tuple:
    """(ms of run() alone, ms of run() while a one-block kernel spins about 1 s on a side queue, whether the spin
    was still running when run()'s work finished). The spin holds one SM's registers, so a call that waited for
    every CTA to be resident would wait for it."""
    alone = median_ms(run)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(SPIN_CYCLES)
    time.sleep(0.02)  # the spin is resident
    done = torch.cuda.Event()
    start = time.perf_counter()
    run()
    done.record()
    done.synchronize()
    beside = (time.perf_counter() - start) * 1e3
    spin_running = not side.query()
    side.synchronize()
    return alone, beside, spin_running


def capture(run) -> torch.cuda.CUDAGraph:
    """run() captured in a CUDA graph on torch's capture queue."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph


def replay_at_once(graphs: list, poison, wrong, rounds: int) -> int:
    """`rounds` times: poison() the outputs, replay every graph at the same time (each on its own queue), and add
    up wrong() (the elements differing from the calls alone)."""
    queues = [torch.cuda.Stream() for _ in graphs]
    torch.cuda.synchronize()
    total = 0
    for _ in range(rounds):
        poison()
        torch.cuda.synchronize()
        for graph, queue in zip(graphs, queues):
            with torch.cuda.stream(queue):
                graph.replay()
        torch.cuda.synchronize()
        total += wrong()
    return total


def in_threads(calls: list, queues: int, repeats: int) -> tuple:
    """Each of `calls` (a callable returning its wrong elements after one call, which it synchronises) in its own
    thread, `repeats` times, all on torch's current queue (queues == 1) or each on its own: (wrong elements per
    thread, the exceptions raised)."""
    streams = [torch.cuda.current_stream()] * len(calls) if queues == 1 else [torch.cuda.Stream() for _ in calls]
    wrong, errors = [0] * len(calls), []

    def worker(i):
        try:
            with torch.cuda.stream(streams[i]):
                for _ in range(repeats):
                    wrong[i] += calls[i](streams[i])
        except Exception as err:  # noqa: BLE001  (reported to the test)
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return wrong, errors
