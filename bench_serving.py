"""`python bench.py --moe --serving`: `nvfp4_moe.nvfp4_moe_mm` as a serving loop calls it, one MoE layer's expert
GEMM per decode step with a new routing every step, made on the GPU, and nothing on the host waiting for the GPU.

A case is one layer: E experts' NVFP4 weights (random bytes, so every e2m1 code; e4m3 scales of both signs,
zero and subnormals up to 1.875), made once and prepared once (`nvfp4_moe.prepare_moe_weights`). A step draws a
routing on the GPU: each of T tokens picks top-k distinct experts by Gumbel top-k over log(rank^-s) (a seeded
shuffle of the experts, s per case as in bench_moe: skewed popularity, some experts empty); the routed rows are
sorted by expert, offs[e] = rows of experts <= e (a searchsorted over the sorted ids: no host sync, so it
can be captured; torch.bincount reads the ids' min and max on the host), and the tokens' new activations
(random NVFP4 bytes, e4m3 scales up to 7.5) are gathered into A [T top-k, K/2] and its scales; then the GEMM
writes bf16 out [T top-k, N].

Rows per case (each mode's loop of `--serving-steps` steps after 3 warm-up steps, which also compile):
- eager: the loop as written; wall µs per step = CUDA events around the whole loop / steps; host µs: the median
  time.perf_counter() around the nvfp4_moe_mm call alone. Then a second loop that waits for the GPU each step,
  L2 flushed (256 MiB written) and the GPU held busy ~1 ms before it (so the step is queued before it runs):
  kernel µs and routing µs (A and its scales included), CUDA events around each part, medians. The peers in
  the same two ways, on the same kind of routing: torch._grouped_mm on bf16 weights dequantized beforehand (not
  timed) with bf16 activations, and humming's W4A16 GEMM (fp16 activations, NVFP4 weights through humming's own
  transform, not timed) where humming imports, in both its forms: grouped-contiguous (rows gathered by expert)
  and indexed as vLLM runs it (`humming_indexed_peer`: sorted pair ids from moe_align_block_size, built in torch
  and counted as routing); a peer's wall µs includes its own routing and activations. humming's outputs are
  checked as ours are (its own `--serving-check-steps` draws), the worst ratio in its own column.
- graph, routing + GEMM: one step captured once in a CUDA graph (on a side queue, after warm-up there),
  replayed `steps` times; the random draws are in the graph, so every replay routes anew. Host µs: per replay.
- graph, GEMM alone: a graph of the GEMM on one fixed routing, replayed.
Weight floor: B + SFB bytes of the experts that receive tokens (mean over 8 routings drawn outside the loops) at
the DRAM read rate measured in the same run (x.sum() over 4 GiB), shown against kernel µs (wall for graphs).
Check: `--serving-check-steps` eager steps and one more replay of the routing + GEMM graph (out NaN-poisoned
before each), every routed row against a float64 decode: |out - exact| <= 1e-2 + 1e-2 |exact| + 2^-24 sqrt(K)
sum|a b| (bf16 rounding is at most 2^-8 relative; the last term bounds fp32 accumulation on near-cancelling
sums); the worst ratio, above 1 fails (exit 1). Progress on stderr; the markdown table and its notes on stdout.
W4A16 columns: the same layer's weights prepared for 16-bit A (`prepare_moe_weights(..., w4a16=True)`) and bf16
activations drawn as the peers' are, timed as the peers, checked on their own steps. On Hopper a last table times
W4A16 on task.yml's four benchmark shapes (`benchmark_w4a16_lines`: bf16 and fp16 A, humming, grouped_mm, floor).
`--serving-schedule` adds a second table (`schedule_lines`): the entry's kernel, its schedule made on the GPU,
beside custom_kernel's, planned on the host, on the same routing and inputs.
"""
import dataclasses
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch

import bench_moe
import harness
from bench_moe import MoeCase
from utils import clear_l2_cache

_MOE = {case.name: case for case in bench_moe.MOE_CASES}
# bench_moe's layers (shapes, Zipf exponents, seeds), DeepSeek-V3 down at 64 tokens, and Mixtral-8x7B's gate/up
# (8 experts of N 2 x 14336, top-2: few big experts)
SERVING_CASES = (_MOE["dsv3-up-64"], _MOE["dsv3-up-256"],
                 MoeCase("dsv3-down-64", "DeepSeek-V3 down", 7168, 2048, 256, 64), _MOE["qwen3-up-512"],
                 _MOE["qwen3-down-512"], MoeCase("mixtral-up-64", "Mixtral-8x7B gate/up", 28672, 4096, 8, 64,
                                                 top_k=2, zipf=0.5), _MOE["prefill-dsv3-up-4096"])
WARMUP = 3
ACTIVE_DRAWS = 8  # routings drawn to estimate the experts that receive tokens
DRAM_PROBE_BYTES = 4 << 30
SPIN_CYCLES = 2_000_000  # ~1 ms at 1.98 GHz: longer than a step's launches take on the host
CHECK_TOL = dict(rtol=1e-2, atol=1e-2, sum_rel=2.0 ** -24)
# bench.py's options that --serving does not take, by their argparse names
OTHER_OPTIONS = (("cases", "a case file"), ("repeats", "--repeats"), ("plot", "--plot"), ("skip_slow", "--skip-slow"),
                 ("launch_paths", "--launch-paths"), ("pdl_ab", "--pdl-ab"), ("ab", "--ab"),
                 ("moe_cases", "--moe-cases"), ("moe_calls", "--moe-calls"), ("moe_patterns", "--moe-patterns"),
                 ("moe_profile", "--moe-profile"), ("moe_shared_weights", "--moe-shared-weights"))
OWN_OPTIONS = (("serving_cases", "--serving-cases"), ("serving_steps", "--serving-steps"),
               ("serving_check_steps", "--serving-check-steps"), ("serving_schedule", "--serving-schedule"))


def select_cases(names: Optional[str]) -> list:
    """The cases named in a comma-separated list (all when None); ValueError naming an unknown one."""
    return harness.pick_by_name(names, SERVING_CASES, SERVING_CASES, "--serving-cases")


def options_problem(args, defaults: dict) -> Optional[str]:
    """What is wrong with bench.py's serving options (one line), or None; fills in the defaults of
    --serving-steps (20) and --serving-check-steps (3) when --serving is given."""
    given = [flag for dest, flag in OWN_OPTIONS if getattr(args, dest) is not None]
    if not args.serving:
        return f"{given[0]} needs --serving" if given else None
    if not args.moe:
        return "--serving needs --moe"
    other = bench_moe.foreign_option(args, defaults, OTHER_OPTIONS)
    if other:
        return f"{other} does not apply to --moe --serving (its options: --serving-cases, --serving-steps, " \
               "--serving-check-steps, --serving-schedule, --no-humming)"
    try:
        select_cases(args.serving_cases)
    except ValueError as err:
        return str(err)
    args.serving_steps = args.serving_steps or 20
    args.serving_check_steps = 3 if args.serving_check_steps is None else args.serving_check_steps
    return None


# ---------------------------------------------------------------------------------------------------------
# Weights, routing, check, floor
# ---------------------------------------------------------------------------------------------------------
def scale_pool(exp_max: int, device) -> torch.Tensor:
    """bench_moe's e4m3 codes up to exponent field `exp_max` (both signs, zero, subnormals), uint8 on `device`."""
    return torch.tensor(bench_moe.scale_codes(exp_max), dtype=torch.uint8, device=device)


def make_weights(case: MoeCase, device) -> tuple:
    """b uint8 [E, N, K/2] (random bytes) and b_scale e4m3 [E, N, K/16], seeded by the case."""
    gen = torch.Generator(device).manual_seed(case.seed)
    b = torch.randint(0, 256, (case.experts, case.n, case.k // 2), generator=gen, dtype=torch.uint8, device=device)
    pool = scale_pool(bench_moe.B_SCALE_EXP_MAX, device)
    scales = torch.empty((case.experts, case.n, case.k // 16), dtype=torch.uint8, device=device)
    for e in range(case.experts):  # one expert at a time: the int64 indices stay small
        scales[e] = pool[torch.randint(0, len(pool), (case.n, case.k // 16), generator=gen, device=device)]
    return b, scales.view(torch.float8_e4m3fn)


def offsets(sorted_ids: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """int32 offs[e] = ids <= e, i.e. cumsum(bincount(ids, minlength=E)), from the sorted expert ids and
    arange(E), with no host sync (bincount on a GPU reads the ids' min and max on the host)."""
    return torch.searchsorted(sorted_ids, experts, right=True, out_int32=True)


class Router:
    """A step's routing and activations drawn on `device` with torch's default generator of that device (graph
    safe), never read on the host."""

    def __init__(self, case: MoeCase, device):
        gen = torch.Generator().manual_seed(case.seed)
        rank = torch.randperm(case.experts, generator=gen).double() + 1
        self.log_weight = (-case.zipf * rank.log()).float().to(device)
        self.experts = torch.arange(case.experts, device=device)
        self.pool = scale_pool(bench_moe.A_SCALE_EXP_MAX, device)  # made here: a copy from the host would wait
        self.case, self.device = case, device

    def pick(self) -> torch.Tensor:
        """Each routed pair's expert, int64 [T top-k] in pair order (pair p is token p // top-k). Gumbel top-k:
        top-k distinct experts per token, drawn without replacement with probability proportional to rank^-s."""
        c = self.case
        gumbel = -(-torch.rand((c.tokens, c.experts), device=self.device).log()).log()
        return (self.log_weight + gumbel).topk(c.top_k, dim=1).indices.flatten()

    def route(self) -> tuple:
        """(token of each routed row, int64 [T top-k], sorted by expert; offs int32 [E])."""
        ids, order = torch.sort(self.pick(), stable=True)
        return order // self.case.top_k, offsets(ids, self.experts)

    def nvfp4(self) -> tuple:
        """(A uint8 [T top-k, K/2], its scales e4m3 [T top-k, K/16], offs): each token's new NVFP4 activations,
        gathered in routed order."""
        token, offs = self.route()
        t, k = self.case.tokens, self.case.k
        codes = torch.randint(0, 256, (t, k // 2), dtype=torch.uint8, device=self.device)
        scales = self.pool[torch.randint(0, len(self.pool), (t, k // 16), device=self.device)]
        return codes[token], scales[token].view(torch.float8_e4m3fn), offs

    def dense(self, dtype) -> tuple:
        """(A `dtype` [T top-k, K] random normal, offs), for the peers."""
        token, offs = self.route()
        return torch.randn((self.case.tokens, self.case.k), dtype=dtype, device=self.device)[token], offs

    def indexed(self, dtype) -> tuple:
        """(A `dtype` random normal, each pair's expert int64 [T top-k] in pair order), for the indexed peer: A is
        [T, K] (a token's row serves its top-k pairs) for a gate/up case, [T top-k, K] (a row per pair, as the
        second GEMM of a layer reads it) for a down case (`pair_rows`)."""
        rows = self.case.tokens * (self.case.top_k if pair_rows(self.case) else 1)
        return torch.randn((rows, self.case.k), dtype=dtype, device=self.device), self.pick()


def pair_rows(case: MoeCase) -> bool:
    """Whether the case is a layer's second GEMM, whose A holds one row per routed pair (`Router.indexed`)."""
    return "down" in case.layer


def worst_error_ratio(a, a_scale, b, b_scale, offs, out) -> float:
    """Largest |out - exact| / tolerance (CHECK_TOL) over every row the routing covers, exact = the float64
    decode of A [rows, K/2] with its scales (a_scale None: A's 16-bit values, W4A16) times each expert's B
    [N, K/2] with b_scale [N, K/16]; inf for a non-finite element, a wrong shape or offs not ending at the row
    count."""
    ends, rows, n = offs.tolist(), a.shape[0], b.shape[1]
    if tuple(out.shape) != (rows, n) or not ends or ends[-1] != rows:
        return math.inf
    worst, start = 0.0, 0
    for e, end in enumerate(ends):
        if end > start:
            a64 = (a[start:end].to(torch.float64) if a_scale is None
                   else bench_moe.dequantize(a[start:end], a_scale[start:end]))
            b64 = bench_moe.dequantize(b[e], b_scale[e])
            worst = max(worst, bench_moe.block_error_ratio(a64, b64, out[start:end], CHECK_TOL))
        start = max(start, end)
    return worst


def active_experts(offs: torch.Tensor) -> int:
    """Experts with at least one row."""
    return int((torch.diff(offs.long(), prepend=offs.new_zeros(1)) > 0).sum())


def weight_floor(n: int, k: int, active: float, bytes_per_s: float) -> tuple:
    """(bytes, µs) of B + SFB of `active` experts, read at `bytes_per_s`."""
    total = active * (n * k // 2 + n * k // 16)
    return total, total / bytes_per_s * 1e6


# ---------------------------------------------------------------------------------------------------------
# Timing (CUDA GPU only)
# ---------------------------------------------------------------------------------------------------------
def dram_read_rate(repeats: int = 5) -> float:
    """Bytes per second of x.sum() over 4 GiB of float32, the median of `repeats` after one untimed."""
    x = torch.zeros(DRAM_PROBE_BYTES // 4, dtype=torch.float32, device="cuda")
    x.sum()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        x.sum()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) * 1e-3)
    del x
    torch.cuda.empty_cache()
    return DRAM_PROBE_BYTES / statistics.median(samples)


def time_steps(make: Callable[[], tuple], call: Callable, steps: int) -> tuple:
    """(wall µs per step, median host µs of call): `steps` steps of call(*make()) back to back, nothing waiting
    for the GPU, CUDA events around the whole loop, after WARMUP steps; perf_counter around call alone."""
    host = []

    def step():
        inputs = make()
        start = time.perf_counter()
        call(*inputs)
        host.append(time.perf_counter() - start)

    for _ in range(WARMUP):
        step()
    torch.cuda.synchronize()
    host.clear()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / steps, statistics.median(host) * 1e6


def time_parts(make: Callable[[], tuple], call: Callable, steps: int) -> tuple:
    """(median GPU µs of make(), of call(*inputs)): CUDA events around each, a wait for the GPU after every step,
    L2 flushed before it, then ~1 ms of spinning on the GPU so that both parts are queued before the first event
    runs (the events time the GPU's work, not the host's launches)."""
    made, called = [], []
    for _ in range(steps):
        clear_l2_cache()
        torch.cuda._sleep(SPIN_CYCLES)
        events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        events[0].record()
        inputs = make()
        events[1].record()
        call(*inputs)
        events[2].record()
        torch.cuda.synchronize()
        made.append(events[0].elapsed_time(events[1]) * 1e3)
        called.append(events[1].elapsed_time(events[2]) * 1e3)
    return statistics.median(made), statistics.median(called)


def capture(fn: Callable, side) -> tuple:
    """(graph, what fn returned while captured): fn run WARMUP times on queue `side` (moe keeps its buffers per
    queue: the captured launches find them made), then captured once there."""
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(WARMUP):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        result = fn()
    return graph, result


@dataclasses.dataclass
class Row:
    case: MoeCase
    mode: str
    wall: Optional[float] = None  # µs per step
    host: Optional[float] = None  # µs per call (or replay)
    kernel: Optional[float] = None
    routing: Optional[float] = None
    peers: dict = dataclasses.field(default_factory=dict)  # name -> (wall µs per step, kernel µs)
    peer_worst: dict = dataclasses.field(default_factory=dict)  # a checked peer's name -> worst err/tol
    floor: Optional[float] = None  # weight floor µs
    worst: Optional[float] = None
    worst16: Optional[float] = None  # the W4A16 steps' check
    error: Optional[str] = None


def humming_gemm(bench, n: int, k: int, ms: list, codes, scales):
    """humming's W4A16 grouped GEMM for groups of `ms` rows (its tile is chosen by the group count and the row
    count only; bench.py's helpers compile it), the codes uint8 [g, n, k/2] and e4m3 scales [g, n, k/16] through
    its transform here (not timed): call(a fp16 [rows, k], out fp16 [rows, n], layout int32 [g + 1])."""
    from humming.transform import transform_humming_tensors

    layer, _, kernel = bench._with_compiler_fallback(lambda: bench._humming_kernel(n, k, ms))
    w = transform_humming_tensors(layer, bench.humming_weight_of_codes(codes, scales))
    locks = torch.zeros(1 << 16, dtype=torch.int32, device=codes.device)
    return lambda a, out, layout: bench.humming_launch(kernel, w, a, out, layout, locks)


def humming_peer(bench, case: MoeCase, b, b_scale, router: Router) -> tuple:
    """(make, call, check) of humming's W4A16 grouped GEMM for the case (`humming_gemm`); make gives fp16
    activations and humming's expert layout; check(inputs) runs it and gives the worst err/tol of its output
    against the float64 decode (`worst_error_ratio`)."""
    rows, device = case.tokens * case.top_k, b.device
    gemm = humming_gemm(bench, case.n, case.k, [rows] + [0] * (case.experts - 1), b, b_scale)
    zero = torch.zeros(1, dtype=torch.int32, device=device)
    out = torch.empty((rows, case.n), dtype=torch.float16, device=device)

    def make():
        a, offs = router.dense(torch.float16)
        return a, torch.cat([zero, offs])

    def check(a, layout):
        out.fill_(math.nan)
        gemm(a, out, layout)
        return worst_error_ratio(a, None, b, b_scale, layout[1:], out)

    return make, lambda a, layout: gemm(a, out, layout), check


def humming_indexed_peer(bench, case: MoeCase, b, b_scale, router: Router) -> tuple:
    """(make, call, check) of humming's W4A16 indexed GEMM as vLLM runs it (`bench.humming_indexed_gemm`): make
    draws fp16 activations and a routing (`Router.indexed`) and aligns it (`bench.align_block_size`, in torch
    here, on the GPU without a host read; vLLM's moe_align_block_size is a CUDA op, so it counts as routing, not
    as the GEMM's time); out row p is pair p. check as `humming_peer`'s, the output put in expert order first."""
    rows, top_k = case.tokens * case.top_k, 1 if pair_rows(case) else case.top_k
    gemm, block = bench.humming_indexed_gemm(case.n, case.k, case.experts, rows, b, b_scale)
    out = torch.empty((rows, case.n), dtype=torch.float16, device=b.device)
    experts = torch.arange(case.experts, device=b.device)

    def make():
        a, flat = router.indexed(torch.float16)
        return (a, flat, *bench.align_block_size(flat, case.experts, block))

    def call(a, flat, sorted_ids, expert_ids, padded):
        gemm(a, out, sorted_ids, expert_ids, padded, top_k)

    def check(a, flat, *aligned):
        out.fill_(math.nan)
        call(a, flat, *aligned)
        ids, order = torch.sort(flat, stable=True)
        return worst_error_ratio(a[order // top_k], None, b, b_scale, offsets(ids, experts), out[order])

    return make, call, check


def run_case(case: MoeCase, steps: int, check_steps: int, rate: float, bench, humming: bool, rows: list,
             notes: list, device) -> None:
    """The case's three rows, appended to `rows` as they are measured."""
    import nvfp4_moe.gemm as moe

    say = lambda what: harness.progress(f"[{case.name}] {what}")  # noqa: E731
    b, b_scale = make_weights(case, device)
    wb, ws = moe.prepare_moe_weights(b, b_scale)
    wb16 = moe.prepare_moe_weights(b, b_scale, w4a16=True)[0]  # W4A16's order of the codes (same scales)
    router = Router(case, device)
    out = torch.empty((case.tokens * case.top_k, case.n), dtype=torch.bfloat16, device=device)

    def gemm(a, a_scale, offs):
        moe.nvfp4_moe_mm(a, a_scale, wb, ws, offs, out=out)

    def gemm16(a, offs):  # W4A16: the same weights in its order, bf16 activations as they are
        moe.nvfp4_moe_mm(a, None, wb16, ws, offs, out=out)

    active = statistics.fmean(active_experts(router.route()[1]) for _ in range(ACTIVE_DRAWS))
    floor = weight_floor(case.n, case.k, active, rate)[1]
    eager = Row(case, "eager", floor=floor, worst=0.0 if check_steps else None,
                worst16=0.0 if check_steps else None)
    rows.append(eager)
    say(f"{active:.1f} of {case.experts} experts active on average; {check_steps} checked steps (compiles first)")
    for _ in range(check_steps):
        inputs = router.nvfp4()
        out.fill_(math.nan)
        gemm(*inputs)
        eager.worst = max(eager.worst, worst_error_ratio(inputs[0], inputs[1], b, b_scale, inputs[2], out))
        a16, offs16 = router.dense(torch.bfloat16)
        out.fill_(math.nan)
        gemm16(a16, offs16)
        eager.worst16 = max(eager.worst16, worst_error_ratio(a16, None, b, b_scale, offs16, out))
    say(f"eager: {steps} steps, then {steps} steps one at a time")
    eager.wall, eager.host = time_steps(router.nvfp4, gemm, steps)
    eager.routing, eager.kernel = time_parts(router.nvfp4, gemm, steps)
    say("CUDA graphs: routing + GEMM, GEMM alone")
    try:
        graph_modes(case, router, gemm, steps, floor, (b, b_scale, out), rows, notes)
    except Exception as err:  # the eager row stays; the run goes on to the peers
        harness.progress(f"[{case.name}] CUDA graphs failed: {one_line(err)}")
        rows.append(Row(case, "graph", error=one_line(err, 120)))
    peers = [("w4a16", lambda: (lambda: router.dense(torch.bfloat16), gemm16)),
             ("grouped_mm", lambda: grouped_mm_peer(case, b, b_scale, router, device))]
    peers += [("humming", lambda: humming_peer(bench, case, b, b_scale, router)),
              ("humming indexed", lambda: humming_indexed_peer(bench, case, b, b_scale, router))] if humming else []
    for name, build in peers:
        say(f"{name}: its weights made (not timed; humming compiles its kernels on a first run: minutes), eager steps")
        try:
            make, call, *check = build()
            if check and check_steps:  # a peer's own accuracy, on its own draws
                eager.peer_worst[name] = max(check[0](*make()) for _ in range(check_steps))
            eager.peers[name] = (time_steps(make, call, steps)[0], time_parts(make, call, steps)[1])
        except Exception as err:  # a peer that cannot run costs its cells, not the run
            notes.append(f"{name} on {case.name}: failed, {one_line(err)}")
        make = call = check = None  # their weights go before the next peer's are made


def graph_modes(case: MoeCase, router: Router, gemm: Callable, steps: int, floor: float, check: tuple, rows: list,
                notes: list) -> None:
    """The two graph rows, appended to `rows`; check = (b, b_scale, out) for the routing + GEMM graph's check."""
    b, b_scale, out = check
    side = torch.cuda.Stream()

    def step():
        inputs = router.nvfp4()
        gemm(*inputs)
        return inputs

    full, static = capture(step, side)
    fixed = router.nvfp4()
    alone, _ = capture(lambda: gemm(*fixed), side)
    graph_rows = [Row(case, "graph: routing + GEMM", floor=floor), Row(case, "graph: GEMM alone", floor=floor)]
    for graph, row in zip((full, alone), graph_rows):
        row.wall, row.host = time_steps(lambda: (), graph.replay, steps)
        rows.append(row)
    before = static[2].clone()
    out.fill_(math.nan)
    full.replay()
    graph_rows[0].worst = worst_error_ratio(static[0], static[1], b, b_scale, static[2], out)
    if torch.equal(before, static[2]):
        notes.append(f"{case.name}: two replays of the routing + GEMM graph gave the same offs (routing not redrawn?)")


def grouped_mm_peer(case: MoeCase, b, b_scale, router: Router, device) -> tuple:
    """(make, call) of torch._grouped_mm on the weights dequantized to bf16 here (not timed), bf16 activations."""
    w16 = torch.empty((case.experts, case.n, case.k), dtype=torch.bfloat16, device=device)
    for e in range(case.experts):
        w16[e] = bench_moe.dequantize(b[e], b_scale[e], torch.float32)
    weights = w16.transpose(1, 2)  # [E, K, N]
    return (lambda: router.dense(torch.bfloat16)), (lambda a, offs: torch._grouped_mm(a, weights, offs=offs))


def one_line(err: BaseException, limit: int = 200) -> str:
    return f"{type(err).__name__}: {' '.join(str(err).split())}"[:limit]


# ---------------------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------------------
HEADER = ("case", "T × top-k", "mode", "wall µs/step", "host µs/call", "kernel µs", "routing µs",
          "W4A16 wall µs/step", "W4A16 kernel µs (/floor)", "grouped_mm wall µs/step", "grouped_mm kernel µs",
          "humming wall µs/step", "humming kernel µs", "humming indexed wall µs/step", "humming indexed kernel µs",
          "weight floor µs (time/floor)", "humming check err/tol (grouped; indexed)", "W4A16 check err/tol",
          "check err/tol")


def row_cells(row: Row) -> list:
    us = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    cells = [f"{row.case.layer} ({row.case.name})", f"{row.case.tokens} × {row.case.top_k}", row.mode,
             us(row.wall), us(row.host), us(row.kernel), us(row.routing)]
    for peer in ("w4a16", "grouped_mm", "humming", "humming indexed"):
        wall, kernel = row.peers.get(peer, (None, None))
        cells += [us(wall), us(kernel) + (f" ({kernel / row.floor:.2f}×)" if peer == "w4a16" and kernel and row.floor
                                          else "")]
    against = row.kernel if row.kernel is not None else row.wall
    cells.append("-" if row.floor is None else f"{row.floor:.1f}"
                 + ("" if against is None else f" ({against / row.floor:.2f}×)"))
    ratio = lambda worst: "-" if worst is None else f"{worst:.3f}" + ("" if worst <= 1 else " FAIL")  # noqa: E731
    cells.append("; ".join(ratio(row.peer_worst.get(peer)) for peer in ("humming", "humming indexed"))
                 if row.peer_worst else "-")
    if row.error:
        cells += ["-", f"ERROR: {row.error}"]
    else:
        cells += [ratio(worst) for worst in (row.worst16, row.worst)]
    return cells


def table_lines(rows: list) -> list:
    return ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)] + [
        "| " + " | ".join(row_cells(row)) + " |" for row in rows]


def notes_lines(gpu: str, rate: float, steps: int, check_steps: int, humming_note: Optional[str]) -> list:
    return [
        f"{gpu}; nvfp4_moe_mm with bf16 out; {steps} steps per loop after {WARMUP} warm-up steps, a new GPU routing "
        "per step (graph rows: per replay of the routing + GEMM graph). wall: CUDA events around the whole loop / "
        "steps, nothing waiting for the GPU; host: median perf_counter around the call (graphs: the replay); "
        "kernel and routing: medians of a loop waiting for the GPU every step, L2 flushed and ~1 ms of GPU "
        "spin queued before each (the GPU's time, not the launches'), events around each part (routing = experts "
        "drawn, sorted, offs, activations drawn and gathered).",
        "W4A16: nvfp4_moe_mm on bf16 activations as they are (a_scale None), the same prepared weights, timed as the "
        "peers. Peers on the eager row, on bf16 (grouped_mm) or fp16 (humming) activations drawn the same way, their "
        "weights dequantized or transformed beforehand (not timed); a peer's wall includes its routing.",
        f"Weight floor: B + SFB bytes of the experts that receive tokens (mean of {ACTIVE_DRAWS} routings) at "
        f"{rate / 1e12:.2f} TB/s, the DRAM read rate measured here (x.sum() over 4 GiB; bench_moe's constant: "
        f"{bench_moe.DRAM_READ_BYTES_PER_S / 1e12} TB/s); time/floor uses kernel µs, wall for graph rows.",
        f"Check: {check_steps} eager steps (NVFP4 A, then W4A16) and one replay of the routing + GEMM graph, out "
        "NaN-poisoned, every routed row against a float64 decode: |out - exact| <= 1e-2 + 1e-2 |exact| + 2^-24 sqrt(K) "
        "sum|a b|; above 1 fails.",
    ] + ([f"{humming_note}: the humming cells stay empty."] if humming_note else
         ["humming: W4A16 (fp16 A x NVFP4 B, fp16 out) in its two forms: grouped-contiguous (rows gathered by expert, "
          "its expert layout) and indexed as vLLM runs it (tokens' rows through moe_align_block_size's sorted pair "
          "ids, built in torch on the GPU and counted as routing); its check: the same steps and tolerance as ours, "
          "a FAIL marks its output past them, not a failed run."])


def schedule_lines(cases: list, calls: int = 10) -> list:
    """`--serving-schedule`: per case, bench_moe's routing and inputs (its seed), the kernel µs of custom_kernel
    (the host planner's schedule, `plan_sm90_work`) and of nvfp4_moe_mm with fp16 out (the schedule made on the
    GPU), bench_moe's timing (median of `calls`, each alone, L2 flushed), both outputs checked (bench_moe's
    tolerance, float64 decode)."""
    import nvfp4_moe.gemm as moe
    import submission

    lines = ["| case | custom_kernel µs (host plan) | nvfp4_moe_mm µs (GPU plan) | GPU / host "
             "| worst err/tol (host, GPU) |",
             "|---|---|---|---|---|"]
    for case in cases:
        harness.progress(f"[schedule] {case.name}")
        ms = bench_moe.route(case, case.seed)
        weights = bench_moe.make_weights(case, "cuda")
        data = bench_moe.make_input(case, ms, weights, case.seed, "cuda")
        host_worst = bench_moe.worst_error_ratio(data, submission.custom_kernel(data))
        host_us = bench_moe.median_us(lambda: submission.custom_kernel(data), calls)
        abc, sfs, _, _ = data
        a = torch.cat([x[0][:, :, 0].view(torch.uint8) for x in abc])
        a_scale = torch.cat([s[0][:, :, 0].to("cuda") for s in sfs])
        b, b_scale = moe.prepare_moe_weights(torch.stack([w[0][:, :, 0].view(torch.uint8) for w in weights]),
                                             torch.stack([w[1][:, :, 0].to("cuda") for w in weights]))
        offs = torch.cumsum(torch.tensor(ms), 0).to(torch.int32).cuda()
        out = torch.full((sum(ms), case.n), math.nan, dtype=torch.float16, device="cuda")
        call = lambda: moe.nvfp4_moe_mm(a, a_scale, b, b_scale, offs, None, out=out)  # noqa: E731
        call()
        ends = torch.cumsum(torch.tensor(ms), 0).tolist()
        gpu_worst = bench_moe.worst_error_ratio(data, [out[e - m:e].unsqueeze(-1) for m, e in zip(ms, ends)])
        gpu_us = bench_moe.median_us(call, calls)
        lines.append(f"| {case.name} | {host_us:.1f} | {gpu_us:.1f} | {gpu_us / host_us:.3f} | "
                     f"{host_worst:.3f}, {gpu_worst:.3f} |")
        del data, weights, a, a_scale, b, b_scale, out
        torch.cuda.empty_cache()
    return lines


def benchmark_w4a16_lines(bench, humming: bool, rate: float, calls: int = 10, cases: Optional[list] = None,
                          device: str = "cuda") -> list:
    """W4A16 on task.yml's four benchmark shapes (each group an expert of the entry, its rows fixed): per shape one
    set of weights (random codes, bench_moe's B scales) and activations (normal, bf16; fp16 the same values
    rounded); kernel µs of nvfp4_moe_mm with bf16 and with fp16 A, of humming (fp16 A, its weights transformed
    beforehand) and of torch._grouped_mm (bf16, dequantized beforehand), bench_moe's timing (median of `calls`,
    each alone, L2 flushed); the floor: B, SFB, A (2 bytes) and C (2 bytes) at the measured DRAM rate. Every
    output checked against the float64 product (CHECK_TOL). cases: (M list, N, K) each; task.yml's by default."""
    import nvfp4_moe.gemm as moe

    lines = ["| benchmark (G × M, N, K) | W4A16 bf16 A µs | W4A16 fp16 A µs | humming fp16 A µs | humming / ours (fp16 A) "
             "| grouped_mm bf16 µs | floor µs (ours bf16 / floor) | worst err/tol (bf16, fp16; humming) |",
             "|---|---|---|---|---|---|---|---|"]
    if cases is None:
        cases = [(list(c.args["m"]), c.args["n"][0], c.args["k"][0])
                 for c in harness.load_cases(str(Path(__file__).resolve().parent / "task.yml"), "benchmarks")]
    for index, (ms, n, k) in enumerate(cases):
        g, rows = len(ms), sum(ms)
        harness.progress(f"[W4A16 benchmark {index}] G={g} M={ms} N={n} K={k}")
        gen = torch.Generator(device).manual_seed(1111 + index)
        codes = torch.randint(0, 256, (g, n, k // 2), generator=gen, dtype=torch.uint8, device=device)
        pool = scale_pool(bench_moe.B_SCALE_EXP_MAX, device)
        scales = pool[torch.randint(0, len(pool), (g, n, k // 16), generator=gen, device=device)].view(
            torch.float8_e4m3fn)
        wb, ws = moe.prepare_moe_weights(codes, scales, w4a16=True)
        offs = torch.tensor(ms, device=device).cumsum(0).to(torch.int32)
        a = torch.randn((rows, k), generator=gen, device=device).to(torch.bfloat16)
        times, worst = {}, {}
        for name, a_in in (("bf16", a), ("fp16", a.to(torch.float16))):
            out = torch.full((rows, n), math.nan, dtype=a_in.dtype, device=device)
            times[name] = bench_moe.median_us(lambda: moe.nvfp4_moe_mm(a_in, None, wb, ws, offs, out=out), calls)
            worst[name] = worst_error_ratio(a_in, None, codes, scales, offs, out)
        w16 = torch.stack([bench_moe.dequantize(codes[e], scales[e], torch.float32) for e in range(g)]).to(
            torch.bfloat16).transpose(1, 2)
        times["grouped_mm"] = bench_moe.median_us(lambda: torch._grouped_mm(a, w16, offs=offs), calls)
        del w16
        if humming:
            try:
                times["humming"], worst["humming"] = humming_dense(bench, ms, n, k, codes, scales, a, calls)
            except Exception as err:
                harness.progress(f"[W4A16 benchmark {index}] humming failed: {one_line(err)}")
        floor = (g * (n * k // 2 + n * k // 16) + rows * k * 2 + rows * n * 2) / rate * 1e6
        us = lambda name: f"{times[name]:.1f}" if name in times else "-"  # noqa: E731
        ratio = f"{times['humming'] / times['fp16']:.2f}" if "humming" in times else "-"
        lines.append(f"| {index}: {g} × {ms}, {n}, {k} | {us('bf16')} | {us('fp16')} | {us('humming')} | {ratio} | "
                     f"{us('grouped_mm')} | {floor:.1f} ({times['bf16'] / floor:.2f}×) | {worst['bf16']:.3f}, "
                     f"{worst['fp16']:.3f}; " + (f"{worst['humming']:.3f}" if "humming" in worst else "-") + " |")
        del codes, scales, wb, ws, a
        torch.cuda.empty_cache()
    return lines


def humming_dense(bench, ms: list, n: int, k: int, codes, scales, a, calls: int) -> tuple:
    """(median µs, worst err/tol) of humming's grouped W4A16 GEMM (`humming_gemm`) on fixed groups `ms`, fp16 A
    (a's values)."""
    gemm = humming_gemm(bench, n, k, ms, codes, scales)
    layout = torch.tensor(bench.humming_expert_layout(ms), dtype=torch.int32, device=codes.device)
    a16 = a.to(torch.float16)
    out = torch.full((a.shape[0], n), math.nan, dtype=torch.float16, device=codes.device)
    took = bench_moe.median_us(lambda: gemm(a16, out, layout), calls)
    return took, worst_error_ratio(a16, None, codes, scales, torch.tensor(ms, device=codes.device).cumsum(0), out)


def main(args, bench, device="cuda") -> int:
    """bench.py --moe --serving after bench.py parsed its options (bench: that module, for humming's helpers)."""
    cases = select_cases(args.serving_cases)
    steps, check_steps = args.serving_steps, args.serving_check_steps
    humming_note = bench.humming_note(args.no_humming)
    harness.progress("measuring the DRAM read rate (x.sum() over 4 GiB)")
    rate = dram_read_rate()
    rows, notes = [], []
    print("\n".join(table_lines([])), flush=True)  # the header; each case's rows as soon as they are measured
    for idx, case in enumerate(cases):
        harness.progress(f"[{idx + 1}/{len(cases)}] {case.name}: {case.layer}, N {case.n} K {case.k}, "
                         f"{case.experts} experts, {case.tokens} tokens x top-{case.top_k}")
        done = len(rows)
        try:
            run_case(case, steps, check_steps, rate, bench, humming_note is None, rows, notes, torch.device(device))
        except Exception as err:  # one case's failure is its row, and the run goes on
            harness.progress(f"[{case.name}] failed: {one_line(err)}")
            rows.append(Row(case, "-", error=one_line(err, 120)))
        print("\n".join(table_lines(rows[done:])[2:]), flush=True)
        torch.cuda.empty_cache()
    print("\n".join([""] + notes_lines(torch.cuda.get_device_name(), rate, steps, check_steps, humming_note) + notes),
          flush=True)
    failed = any(row.error or (row.worst or 0) > 1 or (row.worst16 or 0) > 1 for row in rows)
    if torch.device(device).type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9:  # W4A16: Hopper's
        lines = benchmark_w4a16_lines(bench, humming_note is None, rate)
        print("\n".join(["", "W4A16 on the four benchmark shapes (kernel µs, each call alone, L2 flushed):"] + lines),
              flush=True)
        failed = failed or any(float(x) > 1 for line in lines[2:] for x in line.split("|")[8].replace(";", ",")
                               .split(",")[:2])
    if getattr(args, "serving_schedule", None):
        lines = schedule_lines(cases)
        print("\n".join(["", "Schedule: bench_moe's routing and inputs; kernel µs as bench.py --moe times them."]
                        + lines))
        failed = failed or any(float(line.split("|")[5].split(",")[1]) > 1 for line in lines[2:])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(harness.not_a_command("bench_serving.py", "not a command of its own: python bench.py --moe --serving "
                                                       "runs it (python bench.py --help lists the options)",
                                   sys.argv[1:]))
