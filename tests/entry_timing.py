"""Kernel and host time of the MoE entry on MoE cases, for a side-by-side run of two checkouts on one GPU.

`python tests/entry_timing.py ROOT [--cases a,b] [--json FILE]`: imports the entry (`moe`) from the checkout at
ROOT, and per case (E experts, N, K, routed rows over a Zipf-skewed popularity, seeded) and A type (NVFP4, W4A16
bf16) prints the median GPU time of 10 calls, each alone with L2 flushed (a 512 MiB fill) and CUDA events around
it, and the host time per call of 50 calls queued without a sync. Same seeds in every checkout, so two runs time
the same inputs."""
import argparse
import json
import statistics
import sys
import time

import torch

CASES = {  # name: (E, N, K, rows)
    "dsv3-up-32x8": (256, 4096, 7168, 256),
    "dsv3-down-128x8": (256, 7168, 2048, 1024),
    "qwen3-up-256x8": (128, 1536, 2048, 2048),
    "qwen3-down-1024x8": (128, 2048, 768, 8192),
    "mixtral-up-64x2": (8, 28672, 4096, 128),
    "prefill-2048x6": (64, 2048, 4096, 12288),
}


def routed_offs(e: int, rows: int, gen: torch.Generator) -> torch.Tensor:
    popularity = 1.0 / torch.arange(1, e + 1, dtype=torch.float64) ** 1.1
    popularity = popularity[torch.randperm(e, generator=gen)]
    picks = torch.multinomial(popularity, rows, replacement=True, generator=gen)
    return torch.cumsum(torch.bincount(picks, minlength=e), 0).to(torch.int32).cuda()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--json")
    args = parser.parse_args()
    sys.path.insert(0, args.root)
    try:
        import nvfp4_moe.gemm as moe
    except ImportError:  # a checkout from before the package
        import moe

    flush = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
    rows_out = []
    for name in args.cases.split(","):
        e, n, k, rows = CASES[name]
        gen = torch.Generator().manual_seed(hash(name) % 1000)
        codes = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, generator=gen).cuda()
        scales = torch.randint(0x30, 0x40, (e, n, k // 16), dtype=torch.uint8, generator=gen).cuda()
        b, b_scale = moe.prepare_moe_weights(codes, scales.view(torch.float8_e4m3fn))
        b16 = moe.prepare_moe_weights(codes, scales.view(torch.float8_e4m3fn), w4a16=True)[0]
        del codes
        offs = routed_offs(e, rows, gen)
        for kind in ("fp4", "bf16"):
            if kind == "fp4":
                a = torch.randint(0, 256, (rows, k // 2), dtype=torch.uint8, generator=gen).cuda()
                a_scale = torch.randint(0x30, 0x40, (rows, k // 16), dtype=torch.uint8, generator=gen).cuda().view(
                    torch.float8_e4m3fn)
                weights = b
            else:
                a, a_scale, weights = torch.randn(rows, k, generator=gen).cuda().to(torch.bfloat16), None, b16
            out = torch.empty(rows, n, dtype=torch.bfloat16, device="cuda")

            def call():
                moe.nvfp4_moe_mm(a, a_scale, weights, b_scale, offs, None, out=out)

            call()
            torch.cuda.synchronize()
            times = []
            for _ in range(10):
                flush.fill_(1)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                call()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e3)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(50):
                call()
            host = (time.perf_counter() - t0) / 50 * 1e6
            torch.cuda.synchronize()
            row = dict(root=args.root, case=name, a=kind, us=statistics.median(times), host_us=host)
            rows_out.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows_out, f)


if __name__ == "__main__":
    main()
