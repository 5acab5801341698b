"""The workload of tests/test_gpu_sanitizer.py, run under compute-sanitizer in its own process.

`python tests/sanitize_case.py VARIANT [VARIANT ...]`: "moe", "moe16": the MoE entry's builds with NVFP4 or bf16 A
(`moe_entry`); "layer", "layer16": the MoE layer's fp4-A paths and its W4A16 path (`moe_layer`); for each
Hopper variant (or a variant with one config field changed, `SM90_CHANGED_CONFIGS` of tests/conftest.py: "two_launch"), three multi-group inputs
(the case that first showed a racecheck hazard, one whose rings wrap many times with group changes in every
CTA, and a MoE-like one of 256 groups, most of them empty), and for the consumer-pairs builds a fourth (several
parts per CTA, each more chunks than the rings have stages: the pairs' turns); outputs poisoned with NaN,
checked against the reference after the run. Exits 1 on a wrong result.
"""
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]
import reference  # noqa: E402
import submission  # noqa: E402
import submission_sm90  # noqa: E402
from conftest import SM90_CHANGED_CONFIGS, sm90_changed_config  # noqa: E402

MOE_GROUPS = 256

CASES = (
    # the hazard's reproducer: three groups, the 768-k one wraps the stage ring
    dict(m=(1, 129, 200), n=(384, 256, 128), k=(512, 256, 768), g=3, seed=8),
    # more groups than fit one tile per CTA, long K: every ring wraps, tiles change group inside a CTA
    dict(m=(40, 72, 200, 7, 130, 64), n=(256, 512, 128, 384, 256, 128), k=(2048, 1024, 768, 512, 1536, 256),
         g=6, seed=21),
    # MoE: 256 experts, about two in three empty (first and last among them), the rest 1-40 rows
    dict(m=tuple(0 if e % 3 != 1 else 1 + (13 * e) % 40 for e in range(MOE_GROUPS)), n=(128,) * MOE_GROUPS,
         k=(256,) * MOE_GROUPS, g=MOE_GROUPS, seed=23),
)
# consumer pairs only: narrow experts of 12 chunks (more than the 8 stages), 160 parts, one or two per CTA
PAIRS_CASE = dict(m=(8, 16, 24, 3, 30), n=(4096,) * 5, k=(1536,) * 5, g=5, seed=24)


def moe_entry(a_dtype=None) -> int:
    """The MoE entry (nvfp4_moe.gemm): its three builds, each a preparation launch and a GEMM, on routings with
    empty experts and rows no expert covers; checked as tests/test_gpu_moe.py checks them. a_dtype
    (torch.bfloat16): W4A16, 16-bit A and the weights in its order ("moe16")."""
    import nvfp4_moe.gemm as moe
    from test_gpu_moe import Layer, _check, _counts, _offs

    bad = 0
    gen = torch.Generator().manual_seed(2)
    for e, n, k, pattern in ((64, 256, 512, "decode"), (16, 384, 1024, "random"), (8, 256, 512, "one_expert")):
        layer = Layer(e, n, k, seed=e)
        counts = _counts(e, pattern, gen)
        t = sum(counts) + 3
        a, a_scale = layer.tokens(t) if a_dtype is None else layer.tokens16(t, a_dtype)
        offs = _offs(counts)
        out = torch.full((t, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        b = layer.b if a_dtype is None else layer.b16
        moe.nvfp4_moe_mm(a, a_scale, b, layer.b_scale, offs, layer.alpha, out=out)
        torch.cuda.synchronize()
        expected, bound = layer.expected(a, a_scale, offs, layer.alpha)
        try:
            _check(out, expected, bound, torch.bfloat16)
            print(f"moe E={e} N={n} K={k} {pattern}: ok", flush=True)
        except AssertionError as error:
            print(f"moe E={e} N={n} K={k} {pattern}: WRONG {error}", flush=True)
            bad += 1
    return bad


def moe_layer(paths: tuple) -> int:
    """The MoE layer (nvfp4_moe.layer: its four stage kernels and both GEMMs) on tests/test_gpu_layer.py's shapes,
    T = 33 with a padding token and slot, checked against test_layer's reference bound."""
    from test_layer import Case, assert_within, run_path

    bad = 0
    for path in paths:
        case = Case(33, seed=3, device="cuda", top_k=8, experts=16, hidden=1024, intermediate=512)
        out, ref = run_path(case, path)
        try:
            assert_within(out, ref, path)
            print(f"layer {path}: ok", flush=True)
        except AssertionError as error:
            print(f"layer {path}: WRONG {error}", flush=True)
            bad += 1
    return bad


def main(variants) -> int:
    bad = 0
    for variant in variants:
        if variant in ("moe", "moe16"):
            bad += moe_entry(None if variant == "moe" else torch.bfloat16)
            continue
        if variant in ("layer", "layer16"):
            bad += moe_layer(("fp4", "fp4 per-expert gs", "fp4 prequantized") if variant == "layer" else ("w4a16",))
            continue
        if variant in SM90_CHANGED_CONFIGS:  # a variant with one config field changed
            submission_sm90.SM90_VARIANT_CONFIGS[variant] = sm90_changed_config(variant)
            submission_sm90.SM90_VARIANTS = (*submission_sm90.SM90_VARIANTS, variant)
        submission_sm90.set_sm90_variant(variant)
        pairs = submission_sm90.SM90_VARIANT_CONFIGS[variant].consumer_pairs == 2
        for case in CASES + ((PAIRS_CASE,) if pairs else ()):
            data = reference.generate_input(**case)
            abc, sfs, sfs_r, sizes = data
            expect = ([tuple(t.clone() for t in x) for x in abc], sfs, sfs_r, list(sizes))
            for _, _, c in abc:
                c.fill_(float("nan"))
            out = submission.custom_kernel(data)
            torch.cuda.synchronize()
            ok, message = reference.check_implementation(expect, out)
            print(f"{variant} g={case['g']} m={case['m'][:8]}: {'ok' if ok else 'WRONG ' + message}", flush=True)
            bad += not ok
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
