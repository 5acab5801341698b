"""Times the whole MoE layer (`nvfp4_moe.layer.nvfp4_moe_layer`) against what a user would run instead, in one run.

    python bench_layer.py [--cases dsv3,qwen3,mixtral] [--tokens 1,8,32,128,256,2048] [--repeats N] [--quick]
                          [--no-humming] [--seed S]

Cases (LAYER_CASES): DeepSeek-V3 (E 256, H 7168, I 2048, top-8), Qwen3-30B-A3B (E 128, H 2048, I 768, top-8),
Mixtral-8x7B (E 8, H 4096, I 14336, top-2); decode T = 1, 8, 32, 128, 256 and one prefill T = 2048. Weights: random
e2m1 bytes (every code), positive e4m3 block scales up to 1.875, per-expert global scales, made on the GPU (seeded).
Routing: each token picks top-k distinct experts by Gumbel top-k over log(rank^-s) of a seeded shuffle of the
experts (Zipf-skewed popularity, s per case), router weights normalized over the k; x bf16 normal.

Columns, each on the same inputs:
- fp4 / W4A16: the layer on NVFP4 activations (a1_gscale, a2_gscale) and, on Hopper, on bf16 activations (W4A16);
- entry + torch glue: the naive layer a user writes around two `nvfp4_moe_mm` calls (`glue_layer`: argsort,
  bincount, index_select, NVFP4 quantization in plain torch, SiLU x up in bf16, index_add_);
- torch bf16: sort, index_select, torch._grouped_mm, F.silu x up, torch._grouped_mm, index_add_ on the weights
  dequantized to bf16 beforehand (`bf16_layer`);
- humming: humming-kernels' W4A16 layer as vLLM runs it, where `import humming` works (`humming_layer`: the
  alignment built in torch, two indexed GEMMs on fp16 activations, SiLU x up, the weighted sum over k);
- floor: the active experts' w13 + w2 bytes (codes and scales) plus x and out (bf16), at the DRAM rate of a
  4 GiB device-to-device copy measured in the same run ((read + write) / time);
- non-GEMM: the fp4 layer with both GEMMs replaced by an empty output (routing, gather + quantization, SiLU +
  requantization, combine), and its share of the full layer;
- host: median perf_counter µs of one eager fp4 layer call, nothing waiting for the GPU; graph replay: the fp4 layer
  captured in a CUDA graph, replayed back to back, wall µs per replay;
- rel. err: ||ours - bf16 layer|| / ||bf16 layer|| over the output (fp4; W4A16), a sanity check of the results.
Timing: CUDA events around one call, L2 flushed before it (256 MiB written), median of --repeats (10). Progress on
stderr; a markdown table and its notes on stdout.
"""
import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_moe  # noqa: E402  (its timing: bench_moe.median_us, and its exact dequantization)
import harness  # noqa: E402


@dataclasses.dataclass(frozen=True)
class LayerCase:
    name: str  # what --cases selects
    model: str
    experts: int
    hidden: int
    intermediate: int
    top_k: int
    zipf: float = 1.0  # popularity exponent s: expert of rank r is picked with weight r^-s
    seed: int = 1


LAYER_CASES = (
    LayerCase("dsv3", "DeepSeek-V3", 256, 7168, 2048, 8),
    LayerCase("qwen3", "Qwen3-30B-A3B", 128, 2048, 768, 8, zipf=1.2),
    LayerCase("mixtral", "Mixtral-8x7B", 8, 4096, 14336, 2, zipf=0.5),
)
DECODE_TOKENS = (1, 8, 32, 128, 256)
PREFILL_TOKENS = 2048
QUICK_TOKENS = (1, 32)
QUICK_REPEATS = 3
COPY_PROBE_BYTES = 4 << 30
GRAPH_REPLAYS = 20
HOST_CALLS = 30
E4M3_SCALE_CODES = tuple(range(0x08, 0x3F))  # positive normal e4m3 up to 1.875 (exponent field <= 7)
WEIGHT_BYTES_PER_VALUE = 1 / 2 + 1 / 16  # an e2m1 code and its share of an e4m3 scale per 16


# ---------------------------------------------------------------------------------------------------------
# Options, cases, floors (plain Python: tests/test_bench_layer.py runs them on the CPU)
# ---------------------------------------------------------------------------------------------------------
def _positive_ints(text: str) -> tuple:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, comma-separated; got {text!r}")
    return values


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer; got {text!r}")
    return int(text)


def parse_args(argv=None) -> argparse.Namespace:
    parser = harness.OneLineArgumentParser(prog="bench_layer.py", description=__doc__,
                                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", metavar="A,B", help="only these cases, comma-separated: "
                        + ", ".join(c.name for c in LAYER_CASES))
    parser.add_argument("--tokens", type=_positive_ints, metavar="T,U",
                        help=f"token counts (default {','.join(map(str, DECODE_TOKENS + (PREFILL_TOKENS,)))}; "
                             f"--quick: {','.join(map(str, QUICK_TOKENS))})")
    parser.add_argument("--repeats", type=_positive_int, metavar="N", help="timed calls per column (median; 10, "
                        f"--quick: {QUICK_REPEATS})")
    parser.add_argument("--quick", action="store_true", help="a short run: fewer token counts and repeats")
    parser.add_argument("--no-humming", action="store_true", help="leave out the humming column")
    parser.add_argument("--seed", type=int, default=1, help="routing and activations' seed (1)")
    args = parser.parse_args(argv)
    try:
        args.cases = select_cases(args.cases)
    except ValueError as err:
        parser.error(str(err))
    args.tokens = args.tokens or (QUICK_TOKENS if args.quick else DECODE_TOKENS + (PREFILL_TOKENS,))
    args.repeats = args.repeats or (QUICK_REPEATS if args.quick else 10)
    return args


def select_cases(names: Optional[str]) -> list:
    """The cases named in a comma-separated list (all when None); ValueError naming an unknown one."""
    return harness.pick_by_name(names, LAYER_CASES, LAYER_CASES, "--cases")


def expert_weight_bytes(case: LayerCase) -> int:
    """One expert's w13 [2I, H] and w2 [H, I] in NVFP4: codes and block scales."""
    return int(3 * case.intermediate * case.hidden * WEIGHT_BYTES_PER_VALUE)


def floor_bytes(case: LayerCase, active: int, tokens: int) -> int:
    """The layer's weight floor: the active experts' weights, x and out in bf16."""
    return active * expert_weight_bytes(case) + 2 * tokens * case.hidden * 2


def floor_us(case: LayerCase, active: int, tokens: int, bytes_per_s: float) -> float:
    return floor_bytes(case, active, tokens) / bytes_per_s * 1e6


def zipf_routing(case: LayerCase, tokens: int, seed: int, device="cpu") -> tuple:
    """(topk_ids int32 [T, k], topk_weights fp32 [T, k] summing to 1 per token): top-k distinct experts per token,
    drawn without replacement with probability proportional to rank^-s over a seeded shuffle of the experts."""
    gen = torch.Generator().manual_seed(seed * 7919 + case.seed)
    rank = torch.randperm(case.experts, generator=gen).double() + 1
    gumbel = -(-torch.rand((tokens, case.experts), generator=gen, dtype=torch.float64).log()).log()
    ids = (-case.zipf * rank.log() + gumbel).topk(case.top_k, dim=1).indices
    weights = torch.rand((tokens, case.top_k), generator=gen) + 0.05
    return ids.to(torch.int32).to(device), (weights / weights.sum(1, keepdim=True)).to(device)


def active_experts(topk_ids: torch.Tensor, num_experts: int) -> int:
    """Experts with at least one routed pair (a host read, outside any timing)."""
    return int((torch.bincount(topk_ids.flatten().long().cpu(), minlength=num_experts) > 0).sum())


# ---------------------------------------------------------------------------------------------------------
# The baselines
# ---------------------------------------------------------------------------------------------------------
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def naive_nvfp4_quant(x: torch.Tensor, global_scale: torch.Tensor) -> tuple:
    """NVFP4 as a user writes it in torch: SF = e4m3(amax gs / 6), q = the e2m1 bucket of x gs / SF (midpoints
    rounded up, not to even), two codes per byte; (codes uint8 [rows, K/2], scales e4m3 [rows, K/16])."""
    rows, k = x.shape
    blocks = x.float().view(rows, k // 16, 16)
    sf = (blocks.abs().amax(-1, keepdim=True) * global_scale / 6).clamp(max=448).to(torch.float8_e4m3fn)
    scaled = torch.nan_to_num(blocks * global_scale / sf.float())
    midpoints = torch.tensor(_E2M1_MIDPOINTS, device=x.device)
    codes = torch.bucketize(scaled.abs(), midpoints, right=True).to(torch.uint8) | ((scaled < 0).to(torch.uint8) << 3)
    codes = codes.view(rows, k)
    return codes[:, 0::2] | (codes[:, 1::2] << 4), sf.view(rows, k // 16)


def glue_layer(x, topk_ids, topk_weights, weights, a1_gscale, a2_gscale) -> torch.Tensor:
    """Two entry calls with the torch glue a user writes (module docstring); every token routed (no padding)."""
    from nvfp4_moe.gemm import nvfp4_moe_mm

    num_tokens, top_k = topk_ids.shape
    flat = topk_ids.flatten().long()
    order = torch.argsort(flat)
    offs = torch.bincount(flat, minlength=weights.num_experts).cumsum(0).to(torch.int32)
    token = order // top_k
    a, a_scale = naive_nvfp4_quant(x.index_select(0, token), a1_gscale)
    gate, up = nvfp4_moe_mm(a, a_scale, weights.w13, weights.w13_scale, offs, weights.g1_alphas).chunk(2, dim=-1)
    a2, a2_scale = naive_nvfp4_quant(F.silu(gate) * up, a2_gscale)
    y = nvfp4_moe_mm(a2, a2_scale, weights.w2, weights.w2_scale, offs, weights.g2_alphas)
    y = y * topk_weights.flatten()[order].unsqueeze(1).to(y.dtype)
    return torch.zeros_like(x).index_add_(0, token, y)


def bf16_layer(x, topk_ids, topk_weights, w13_t, w2_t) -> torch.Tensor:
    """The torch bf16 layer: w13_t [E, H, 2I] and w2_t [E, I, H] bf16 (column-major views of the dequantized
    weights), the routing sorted on the GPU without a host read."""
    num_tokens, top_k = topk_ids.shape
    ids, order = torch.sort(topk_ids.flatten())
    offs = torch.searchsorted(ids, torch.arange(w13_t.shape[0], device=ids.device, dtype=ids.dtype), right=True,
                              out_int32=True)
    token = order // top_k
    gate, up = torch._grouped_mm(x.index_select(0, token), w13_t, offs=offs).chunk(2, dim=-1)
    y = torch._grouped_mm(F.silu(gate) * up, w2_t, offs=offs)
    y = y * topk_weights.flatten()[order].unsqueeze(1).to(y.dtype)
    return torch.zeros_like(x).index_add_(0, token, y)


def humming_layer(case: LayerCase, checkpoint: dict, tokens: int) -> Callable:
    """humming's W4A16 layer as vLLM runs it (module docstring): call(x16 [T, H] fp16, topk_ids, topk_weights) ->
    [T, H] fp16. Compiles humming's kernels (minutes the first time); raises where humming cannot."""
    import bench

    gemms = [bench.humming_indexed_gemm(n, k, case.experts, tokens * case.top_k, checkpoint[name],
                                        checkpoint[name + "_scale"], checkpoint[name + "_scale_2"])
             for name, n, k in (("w13", 2 * case.intermediate, case.hidden), ("w2", case.hidden, case.intermediate))]

    def gemm(which, a, out, flat_ids, top_k):
        launch, block = gemms[which]
        return launch(a, out, *bench.align_block_size(flat_ids, case.experts, block), top_k)

    def call(x16, topk_ids, topk_weights):
        flat = topk_ids.flatten().long()
        pairs = flat.numel()
        h = gemm(0, x16, x16.new_empty(pairs, 2 * case.intermediate), flat, case.top_k)
        gate, up = h.chunk(2, dim=-1)
        y = gemm(1, (F.silu(gate) * up).contiguous(), x16.new_empty(pairs, case.hidden), flat, 1)
        return (y.view(-1, case.top_k, case.hidden) * topk_weights.unsqueeze(-1).to(y.dtype)).sum(1)

    return call


# ---------------------------------------------------------------------------------------------------------
# Timing (CUDA GPU only)
# ---------------------------------------------------------------------------------------------------------
def copy_rate() -> float:
    """Bytes per second (read + write) of a 4 GiB device-to-device copy, the median of 5 after one untimed."""
    src = torch.empty(COPY_PROBE_BYTES, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    samples = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) * 1e-3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * COPY_PROBE_BYTES / statistics.median(samples)


def host_us(fn: Callable, calls: int = HOST_CALLS) -> float:
    """Median perf_counter µs of one fn() call, nothing waiting for the GPU between calls."""
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return statistics.median(samples) * 1e6


def graph_us(fn: Callable) -> float:
    """Wall µs per replay of fn captured in a CUDA graph (warmed up on the capture's queue), GRAPH_REPLAYS back to
    back between CUDA events."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(GRAPH_REPLAYS):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / GRAPH_REPLAYS


def gemms_removed():
    """The layer without its two GEMMs' launches: its non-GEMM work alone (`nvfp4_moe.layer.gemms_removed`)."""
    import nvfp4_moe.layer as layer

    return layer.gemms_removed()


# ---------------------------------------------------------------------------------------------------------
# One case
# ---------------------------------------------------------------------------------------------------------
def make_checkpoint(case: LayerCase, device="cuda") -> dict:
    """ModelOpt's tensors of the case (module docstring): w13, w13_scale, w2, w2_scale, w13_scale_2, w2_scale_2."""
    gen = torch.Generator(device).manual_seed(case.seed)
    pool = torch.tensor(E4M3_SCALE_CODES, dtype=torch.uint8, device=device)
    e, h, i = case.experts, case.hidden, case.intermediate
    ckpt = {}
    for name, (n, k) in (("w13", (2 * i, h)), ("w2", (h, i))):
        ckpt[name] = torch.randint(0, 256, (e, n, k // 2), generator=gen, dtype=torch.uint8, device=device)
        scales = torch.empty((e, n, k // 16), dtype=torch.uint8, device=device)
        for expert in range(e):  # one expert at a time: the int64 indices stay small
            scales[expert] = pool[torch.randint(0, len(pool), (n, k // 16), generator=gen, device=device)]
        ckpt[name + "_scale"] = scales.view(torch.float8_e4m3fn)
        ckpt[name + "_scale_2"] = torch.rand(e, generator=gen, device=device) * 0.5 + 0.25
    return ckpt


def dequantized_t(codes: torch.Tensor, scales: torch.Tensor, scale_2: torch.Tensor) -> torch.Tensor:
    """bf16 [E, K, N] (a column-major view of [E, N, K]) of the weights times their global scales."""
    out = torch.empty((codes.shape[0], codes.shape[1], codes.shape[2] * 2), dtype=torch.bfloat16, device=codes.device)
    for e in range(codes.shape[0]):
        out[e] = (bench_moe.dequantize(codes[e], scales[e], torch.float32) * scale_2[e]).to(torch.bfloat16)
    return out.transpose(1, 2)


@dataclasses.dataclass
class LayerRow:
    case: LayerCase
    tokens: int
    active: int
    floor: float  # µs
    times: dict = dataclasses.field(default_factory=dict)  # column -> µs
    errors: dict = dataclasses.field(default_factory=dict)  # "fp4" / "w4a16" -> rel. err vs the bf16 layer


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-30))


def run_case(case: LayerCase, args, rate: float, humming: bool, rows: list, notes: list) -> None:
    """The case's rows (one per token count), appended to `rows` and printed as they are measured."""
    from nvfp4_moe.layer import nvfp4_moe_layer, prepare_moe_layer

    say = lambda what: harness.progress(f"[{case.name}] {what}")  # noqa: E731
    say("weights: made, prepared (NVFP4 A and W4A16), dequantized to bf16")
    ckpt = make_checkpoint(case)
    # a1_gscale: x ~ N(0, 1) has |x| up to about 5; a2_gscale from 64 tokens' activations through expert 0
    a1_gscale = torch.tensor(448.0 * 6 / 5, device="cuda")
    g1 = (ckpt["w13_scale_2"] / a1_gscale).float()
    raw = (ckpt["w13"], ckpt["w13_scale"], ckpt["w2"], ckpt["w2_scale"])
    hopper = torch.cuda.get_device_capability()[0] == 9
    w13_t, w2_t = (dequantized_t(ckpt[n], ckpt[n + "_scale"], ckpt[n + "_scale_2"]) for n in ("w13", "w2"))
    probe_x = torch.randn((64, case.hidden), device="cuda", dtype=torch.bfloat16)
    gate, up = torch.bmm(probe_x.unsqueeze(0), w13_t[:1]).squeeze(0).chunk(2, dim=-1)
    a2_gscale = torch.tensor(448.0 * 6, device="cuda") / (F.silu(gate.float()) * up.float()).abs().amax()
    fp4 = prepare_moe_layer(*raw, g1, (ckpt["w2_scale_2"] / a2_gscale).float())
    w16 = prepare_moe_layer(*raw, ckpt["w13_scale_2"], ckpt["w2_scale_2"], w4a16=True) if hopper else None
    peer = None
    if humming:
        try:
            say("humming: its kernels built (minutes on a first run) and its weights transformed")
            peer = humming_layer(case, ckpt, max(args.tokens))
        except Exception as err:  # a peer that cannot run costs its column, not the run
            notes.append(f"humming on {case.name}: failed, {one_line(err)}")
    for tokens in args.tokens:
        ids, tw = zipf_routing(case, tokens, args.seed, "cuda")
        x = torch.randn((tokens, case.hidden), device="cuda", dtype=torch.bfloat16,
                        generator=torch.Generator("cuda").manual_seed(args.seed + tokens))
        active = active_experts(ids, case.experts)
        row = LayerRow(case, tokens, active, floor_us(case, active, tokens, rate))
        say(f"T = {tokens}: {active} of {case.experts} experts active")
        columns = {"fp4": lambda: nvfp4_moe_layer(x, ids, tw, fp4, a1_gscale, a2_gscale),
                   "glue": lambda: glue_layer(x, ids, tw, fp4, a1_gscale, a2_gscale),
                   "bf16": lambda: bf16_layer(x, ids, tw, w13_t, w2_t)}
        if w16 is not None:
            columns["w4a16"] = lambda: nvfp4_moe_layer(x, ids, tw, w16)
        if peer is not None:
            x16 = x.half()
            columns["humming"] = lambda: peer(x16, ids, tw)
        for name, fn in columns.items():
            try:
                row.times[name] = bench_moe.median_us(fn, args.repeats)
            except Exception as err:
                notes.append(f"{name} on {case.name} T = {tokens}: failed, {one_line(err)}")
        reference = columns["bf16"]()
        row.errors["fp4"] = rel_err(columns["fp4"](), reference)
        if "w4a16" in columns:
            row.errors["w4a16"] = rel_err(columns["w4a16"](), reference)
        row.times["host"] = host_us(columns["fp4"])
        try:
            row.times["graph"] = graph_us(columns["fp4"])
        except Exception as err:
            notes.append(f"graph replay on {case.name} T = {tokens}: failed, {one_line(err)}")
        with gemms_removed():
            row.times["non-GEMM"] = bench_moe.median_us(columns["fp4"], args.repeats)
            try:  # replayed, the stages' GPU time without the eight launches' host time
                row.times["non-GEMM graph"] = graph_us(columns["fp4"])
            except Exception as err:
                notes.append(f"non-GEMM graph replay on {case.name} T = {tokens}: failed, {one_line(err)}")
        rows.append(row)
        print(table_lines([row])[2], flush=True)
    ckpt = w13_t = w2_t = fp4 = w16 = peer = None  # the case's tensors go before the next case's are made
    torch.cuda.empty_cache()


def one_line(err: BaseException, limit: int = 200) -> str:
    return f"{type(err).__name__}: {' '.join(str(err).split())}"[:limit]


# ---------------------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------------------
HEADER = ("case", "T", "active experts", "fp4 µs (/floor)", "W4A16 µs (/floor)", "entry + torch glue µs",
          "torch bf16 µs", "humming µs", "floor µs", "non-GEMM µs (share)", "host µs", "graph replay µs",
          "non-GEMM replay µs (share)",
          "rel. err vs bf16 (fp4; W4A16)")


def row_cells(row: LayerRow) -> list:
    t = row.times
    us = lambda name: f"{t[name]:.1f}" if name in t else "-"  # noqa: E731
    against = lambda name: f"{us(name)} ({t[name] / row.floor:.2f}×)" if name in t and row.floor else us(name)  # noqa: E731
    share = lambda part, whole: (f"{us(part)} ({t[part] / t[whole]:.0%})" if part in t and t.get(whole)  # noqa: E731
                                 else us(part))
    errors = "; ".join(f"{row.errors[k]:.3g}" if k in row.errors else "-" for k in ("fp4", "w4a16"))
    return [f"{row.case.model} ({row.case.experts} × top-{row.case.top_k})", str(row.tokens),
            f"{row.active} of {row.case.experts}", against("fp4"), against("w4a16"), us("glue"), us("bf16"),
            us("humming"), f"{row.floor:.1f}", share("non-GEMM", "fp4"), us("host"), us("graph"),
            share("non-GEMM graph", "graph"), errors]


def table_lines(rows: list) -> list:
    return ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)] + [
        "| " + " | ".join(row_cells(row)) + " |" for row in rows]


def notes_lines(gpu: str, rate: float, repeats: int, humming_note: Optional[str]) -> list:
    return [
        f"{gpu}; µs: median of {repeats} calls, each alone after an L2 flush, CUDA events; floor: active experts' "
        f"w13 + w2 NVFP4 bytes + x + out (bf16) at {rate / 1e12:.2f} TB/s (a 4 GiB copy, read + write, this run).",
        "non-GEMM: the fp4 layer with both GEMMs replaced by an empty output, eager (share of the eager fp4 layer: "
        "host-bound at small T) and replayed (share of the replayed layer); host: median perf_counter of one eager "
        f"fp4 call; graph replay: the fp4 layer in a CUDA graph, {GRAPH_REPLAYS} replays back to back, wall per "
        "replay (L2 warm).",
        "W4A16: Hopper only. entry + torch glue: argsort, bincount (a host sync), plain-torch NVFP4, bf16 SiLU x up, "
        "index_add_ (not deterministic). torch bf16: weights dequantized beforehand (not timed).",
    ] + [humming_note or "humming: W4A16 on fp16 activations, indexed GEMMs with the alignment built in torch, "
                         "its weights transformed beforehand (not timed)."]


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_layer.py: needs a CUDA GPU (Hopper or B200)", file=sys.stderr)
        return 2
    humming_note = None
    if args.no_humming:
        humming_note = "humming column left out (--no-humming)"
    else:
        import bench

        humming_note = bench.humming_note(False)
    harness.progress("measuring the DRAM rate (a 4 GiB device-to-device copy)")
    rate = copy_rate()
    rows, notes = [], []
    print("\n".join(table_lines([])), flush=True)
    for index, case in enumerate(args.cases):
        harness.progress(f"[{index + 1}/{len(args.cases)}] {case.model}: E {case.experts}, H {case.hidden}, "
                         f"I {case.intermediate}, top-{case.top_k}")
        try:
            run_case(case, args, rate, humming_note is None, rows, notes)
        except Exception as err:  # one case's failure is a note, and the run goes on
            harness.progress(f"[{case.name}] failed: {one_line(err)}")
            notes.append(f"{case.name}: failed, {one_line(err)}")
        torch.cuda.empty_cache()
    print("\n".join([""] + notes_lines(torch.cuda.get_device_name(), rate, args.repeats, humming_note) + notes),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
