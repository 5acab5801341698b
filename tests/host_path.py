"""Host time of a re-routed MoE call, measured on the CPU (no GPU needed).

`python tests/host_path.py [--cases dsv3-up-256,...] [--calls 25] [--arch sm_90a|sm_100a] [--sms N]`

In a serving loop every decode step routes its tokens anew over the same expert weights, so every
`custom_kernel` call takes the full host path: the constraint check (`can_implement`), the kernel config, the
plan and work list (Hopper), the launch-metadata key and the tables staged for upload. This runs that path
for `bench.py --moe`'s cases (`bench_moe.MOE_CASES`, `bench_moe.route`) on CPU tensors, with only what needs
a GPU stood in for (`stubbed_driver`): no compile (a key stands in for each kernel), no launch packing or
launch, the tables' upload done by a host memcpy, the upload's queue event a no-op, the device workspace one
preallocated buffer (torch's caching allocator hands out device memory without a system call). So it times
the Python host path alone: each call's CPU time, the median over `--calls` routings after enough warm-up
routings to fill the launch-metadata cache (a serving loop's steady state, each new entry dropping the
oldest). On the GPU, `bench.py --moe` reports the same call's time with the driver included ("re-routed
call host ms").

tests/test_host_path.py runs custom_kernel through `stubbed_driver` on both arches and checks what it staged
against the inputs.
"""
import argparse
import contextlib
import ctypes
import statistics
import sys
import time
from collections import OrderedDict
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import bench_moe  # noqa: E402
import submission  # noqa: E402


class _NoEvent:
    """The staging ring's queue event: nothing is queued here, so every upload has completed."""

    def record(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


def _launcher(kernel, raw_args, to_dsl=None):
    """`make_launcher`'s stand-in: the table upload (its key's part "upload") copies the staged words, as
    `TableUploadKernel` does on the device; every other kernel launches nothing."""
    if kernel[1] == "upload":
        staging, tables, words = raw_args
        return lambda: ctypes.memmove(tables, staging, words * 8)
    return lambda: None


# The SM count each arch's host path plans for by default: an H100 SXM / H200, a B200.
SMS = {"sm_90a": 132, "sm_100a": 148}


@contextlib.contextmanager
def stubbed_driver(arch: str = "sm_90a", num_sms: Optional[int] = None):
    """custom_kernel on CPU tensors as on a GPU of `arch` with `num_sms` SMs (default: `SMS`), the driver's
    part stood in for (module docstring). Yields the set of compile keys asked for (each would be a compile on a GPU). The
    module's caches and the arch backend's remembered choices start empty and are restored afterwards."""
    num_sms = num_sms or SMS[arch]
    ring = submission.PinnedTableRing(submission.TABLE_RING_WORDS, new_event=_NoEvent)
    ring.buffer = torch.empty(ring.words, dtype=torch.int64)  # not pinned: no CUDA here
    workspace = torch.empty(1 << 16, dtype=torch.int64)
    compiled = set()

    def compiled_kernel(key):
        compiled.add(key)
        return key

    stubs = dict(
        KERNEL_DEVICE_TYPE="cpu",
        _check_device=lambda device: None,
        _target_arch=lambda device: arch,
        _device_sm_count=lambda index: num_sms,
        compiled_kernel=compiled_kernel,
        compiled_gemm=lambda num_groups, arch_, config: compiled_kernel(submission.compile_key(num_groups, arch_,
                                                                                               config)),
        make_launcher=_launcher,
        aligned_device_buffer=lambda num_bytes, align, device: workspace[:16],
        _table_ring=ring,
        _prepared_calls={},
        _launch_metadata=OrderedDict(),
    )
    backend = submission.backend_for_arch(arch)
    # the names in submission, and in the backend's module where it imported them (submission_sm90)
    modules = {submission, sys.modules[type(backend).__module__]}
    saved = [(module, name, getattr(module, name)) for module in modules for name in stubs if hasattr(module, name)]
    choices = backend._weight_shape_choices
    try:
        for module, name, _ in saved:
            setattr(module, name, stubs[name])
        backend._weight_shape_choices = OrderedDict()
        yield compiled
    finally:
        for module, name, value in saved:
            setattr(module, name, value)
        backend._weight_shape_choices = choices


def expert_weights(case: bench_moe.MoeCase) -> list:
    """(b, sfb, sfb_reordered) per expert: distinct tensors of the task's layouts, views of one storage (the
    host path reads their metadata and addresses, never their values)."""
    storage = torch.empty(case.n * case.k // 2, dtype=torch.uint8)
    _, spec = submission._group_spec((1, case.n, case.k, 1))
    return [tuple(_view(storage, *spec[i]) for i in (1, 4, 6)) for _ in range(case.experts)]


def _strides(shape: tuple, strides) -> tuple:
    """`_group_spec`'s strides, or a contiguous tensor's where it gives none (the plain scales)."""
    return strides or torch.empty(shape, device="meta").stride()


def _view(storage: torch.Tensor, dtype, shape: tuple, strides) -> torch.Tensor:
    return torch.as_strided(storage.view(dtype), shape, _strides(shape, strides))


def routed_input(case: bench_moe.MoeCase, weights: list, seed: int):
    """The task's input tuple for one routing of the case's tokens (`bench_moe.route`)."""
    return expert_input(case, weights, bench_moe.route(case, seed))


def expert_input(case: bench_moe.MoeCase, weights: list, ms: list):
    """The task's input tuple for `ms` rows per expert: per expert a new A, C and scales of its rows (CPU
    tensors, uninitialised), the expert's weights."""
    abc, sfs, sfs_reordered, sizes = [], [], [], []
    for m, (b, sfb, sfb_r) in zip(ms, weights):
        _, spec = submission._group_spec((m, case.n, case.k, 1))
        a, c, sfa, sfa_r = (torch.empty_strided(shape, _strides(shape, strides), dtype=dtype)
                            for dtype, shape, strides in (spec[0], spec[2], spec[3], spec[5]))
        abc.append((a, b, c))
        sfs.append((sfa, sfb))
        sfs_reordered.append((sfa_r, sfb_r))
        sizes.append((m, case.n, case.k, 1))
    return tuple(abc), tuple(sfs), tuple(sfs_reordered), tuple(sizes)


def time_case(case: bench_moe.MoeCase, calls: int, seed: int = 1000) -> tuple:
    """(median ms, min ms, the last call's input and launch metadata) of `calls` re-routed calls, after as
    many warm-up routings as the launch-metadata cache holds (a serving loop's steady state: the cache full,
    each new entry dropping the oldest); call inside `stubbed_driver`."""
    weights = expert_weights(case)
    warm_up = submission.LAUNCH_METADATA_CACHE_SIZE
    for warm in range(warm_up):
        submission.custom_kernel(routed_input(case, weights, seed + warm))
    times = []
    for i in range(calls):
        data = routed_input(case, weights, seed + warm_up + i)
        start = time.perf_counter()
        submission.custom_kernel(data)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), min(times), data, next(reversed(submission._launch_metadata.values()))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="dsv3-up-256,dsv3-up-64,dsv3-down-256,qwen3-up-512,qwen3-down-512")
    parser.add_argument("--calls", type=int, default=25)
    parser.add_argument("--arch", default="sm_90a", choices=tuple(SMS))
    parser.add_argument("--sms", type=int, default=None, help="SM count (default: 132 on sm_90a, 148 on sm_100a)")
    args = parser.parse_args(argv)
    num_sms = args.sms or SMS[args.arch]
    print("| case | experts (empty, last call) | host ms per re-routed call, median | min |")
    print("|---|---|---|---|")
    with stubbed_driver(args.arch, num_sms) as compiled:
        for case in bench_moe.select_cases(args.cases):
            median, least, data, _ = time_case(case, args.calls)
            empty = sum(1 for size in data[3] if size[0] == 0)
            print(f"| {case.name} | {case.experts} ({empty}) | {median:.2f} | {least:.2f} |", flush=True)
        kernels = len(compiled)
    print(f"\n{args.arch} path, {num_sms} SMs; median of {args.calls} calls, each on a new routing; "
          f"torch {torch.__version__}, Python {sys.version.split()[0]}; driver parts stubbed (module docstring); "
          f"{kernels} kernels asked for in all.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
