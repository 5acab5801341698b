"""The MoE entry (nvfp4_moe/gemm.py) on a Hopper GPU: results against a float64 decode on full-range codes with
`out` NaN-poisoned (rows no expert covers must come back as zeros), empty experts, all tokens on one expert, bad `offs`,
widths next to every tile width, fp16 and bf16 out, with and without alpha; the preparation kernel's tables and
work list against `plan_reference`; calls back to back on one queue with new routings and no sync between them
(they share one set of buffers); a CUDA graph replayed after new routing is written into the captured tensors;
and torch.compile(fullgraph=True) of a function that calls the entry. W4A16 (16-bit A, Hopper): bf16 and fp16 A of
magnitudes over 2^-10 .. 2^4 against the same float64 decode of B, every build and tile width, empty experts, alpha,
15 calls back to back; a B200 refuses it.

Skipped without an sm_90 or sm_100 GPU and nvidia-cutlass-dsl (on a B200 they have never run: no B200 here)."""
import pytest
import torch

from conftest import cuda_capability, dequant_f64, have_dsl

CAPABILITY = cuda_capability()
# B200: the entry's path there is built and SASS-checked but has never run; these tests are its first check
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not (have_dsl() and CAPABILITY in ((9, 0), (10, 0))),
                                                  reason="needs an sm_90 or sm_100 GPU and the DSL")]

def _scale_codes():
    """e4m3 scale codes of both signs, zero and subnormals included, up to exponent field 8 (bench_moe's)."""
    import bench_moe

    return torch.tensor(bench_moe.scale_codes(8), dtype=torch.uint8)


def _decode(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[rows, K/2] uint8 and [rows, K/16] e4m3 -> [rows, K] float64 on their device (conftest's decoder)."""
    return dequant_f64(codes, scales).to(codes.device)


class Layer:
    def __init__(self, e, n, k, seed):
        import nvfp4_moe.gemm as moe

        gen = torch.Generator(device="cuda").manual_seed(seed)
        self.e, self.n, self.k = e, n, k
        self.codes = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, device="cuda", generator=gen)
        picks = _scale_codes().cuda()
        self.scales = picks[torch.randint(0, len(picks), (e, n, k // 16), device="cuda", generator=gen)].view(
            torch.float8_e4m3fn)
        self.b, self.b_scale = moe.prepare_moe_weights(self.codes, self.scales)
        self.b16 = moe.prepare_moe_weights(self.codes, self.scales, w4a16=True)[0]  # W4A16's layout of the codes
        self.alpha = torch.rand(e, device="cuda", generator=gen, dtype=torch.float32) + 0.25
        self.gen = gen

    def tokens(self, t):
        picks = _scale_codes().cuda()
        a = torch.randint(0, 256, (t, self.k // 2), dtype=torch.uint8, device="cuda", generator=self.gen)
        a_scale = picks[torch.randint(0, len(picks), (t, self.k // 16), device="cuda", generator=self.gen)].view(
            torch.float8_e4m3fn)
        return a, a_scale

    def tokens16(self, t, dtype):
        """W4A16 activations [t, K] in `dtype`: normal values times 2^-10 .. 2^4 per row and column block (the
        outputs within fp16's range: with 2^8 a K = 1024 row reached 71026, which fp16 out rightly made inf)."""
        a = torch.randn((t, self.k), device="cuda", generator=self.gen)
        mag = torch.randint(-10, 5, (t, self.k // 16), device="cuda", generator=self.gen).repeat_interleave(16, 1)
        return (a * torch.exp2(mag.float())).to(dtype), None

    def expected(self, a, a_scale, offs, alpha):
        """float64 decode with moe's clamping of offs; rows no expert covers are zeros (the entry writes them so).
        a_scale None: A's values (W4A16)."""
        t = a.shape[0]
        out = torch.zeros((t, self.n), dtype=torch.float64, device="cuda")
        bound = torch.zeros_like(out)
        a64 = a.to(torch.float64) if a_scale is None else _decode(a, a_scale)
        prev = 0
        for e, end in enumerate(offs.tolist()):
            end = min(max(end, prev, 0), t)
            if end > prev:
                w = _decode(self.codes[e], self.scales[e])
                scale = 1.0 if alpha is None else float(alpha[e])
                out[prev:end] = scale * (a64[prev:end] @ w.t())
                # fp32 accumulation: at most K x 2^-24 of the sum of |products| (conftest's TOL)
                bound[prev:end] = abs(scale) * (a64[prev:end].abs() @ w.abs().t()) * self.k * 2.0 ** -24
            prev = end
        return out, bound


def _check(got, expected, bound, out_dtype):
    """Within half an ulp of the output type (relative) plus `bound` (fp32 accumulation's) everywhere: exactly 0 in
    the rows no expert covers (zeros in `expected` with a zero bound), and no element left unwritten (NaN)."""
    got = got.to(torch.float64)
    assert not torch.isnan(got).any(), f"{int(torch.isnan(got).sum())} elements never written (NaN)"
    exact_zero = (expected == 0) & (bound == 0)
    assert (got[exact_zero] == 0).all(), "a row no expert covers is not zero"
    ulp = 2.0 ** -8 if out_dtype == torch.bfloat16 else 2.0 ** -11
    tol = ulp * expected.abs() + bound + 1e-6
    err = (got - expected).abs()
    bad = err > tol
    assert not bad.any(), (f"{int(bad.sum())} elements off, first at {bad.nonzero()[0].tolist()}: got "
                           f"{got[bad][0].item()}, expected {expected[bad][0].item()}")


def _counts(e, pattern, gen):
    if pattern == "random":
        choices = torch.tensor([0, 0, 1, 3, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 191, 192, 193])
        return choices[torch.randint(0, len(choices), (e,), generator=gen)].tolist()
    if pattern == "one_expert":
        return [0] * (e - 1) + [300]
    if pattern == "decode":
        return torch.randint(0, 4, (e,), generator=gen).tolist()
    raise ValueError(pattern)


def _offs(counts):
    return torch.cumsum(torch.tensor(counts), 0).to(torch.int32).cuda()


CASES = [  # (E, N, K, pattern): the three builds (pairs: few rows per expert; narrow; wide)
    (64, 256, 512, "decode"),
    (16, 384, 1024, "random"),
    (8, 256, 512, "one_expert"),
]


# (A, out): NVFP4 A with either out; W4A16 (Hopper) with 16-bit A as it is, out in A's type
KINDS = [(None, torch.bfloat16), (None, torch.float16), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16)]


@pytest.mark.parametrize("kind", KINDS, ids=["bf16", "fp16", "w4a16-bf16", "w4a16-fp16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"E{c[0]}-N{c[1]}-K{c[2]}-{c[3]}")
def test_results_and_schedule(case, kind):
    """Within half an ulp of out plus the fp32 accumulation bound of the float64 product, every build and tile
    width, with and without alpha; W4A16: B converted exactly to A's type."""
    import nvfp4_moe.gemm as moe

    a_dtype, out_dtype = kind
    if a_dtype is not None and CAPABILITY != (9, 0):
        pytest.skip("W4A16 is the Hopper path")
    e, n, k, pattern = case
    w4a16 = a_dtype is not None
    layer = Layer(e, n, k, seed=e + n + w4a16)
    gen = torch.Generator().manual_seed(k + w4a16)
    for with_alpha in (True, False):
        counts = _counts(e, pattern, gen)
        t = sum(counts) + 5  # five rows after the last expert's end: no expert covers them
        a, a_scale = layer.tokens16(t, a_dtype) if w4a16 else layer.tokens(t)
        offs = _offs(counts)
        alpha = layer.alpha if with_alpha else None
        out = torch.full((t, n), float("nan"), dtype=out_dtype, device="cuda")
        moe.nvfp4_moe_mm(a, a_scale, layer.b16 if w4a16 else layer.b, layer.b_scale, offs, alpha, out=out)
        torch.cuda.synchronize()
        expected, bound = layer.expected(a, a_scale, offs, alpha)
        _check(out, expected, bound, out_dtype)
        _check_schedule(moe, layer, offs, t, out_dtype, moe.A16_INPUTS[a_dtype] if w4a16 else "fp4")


@pytest.mark.skipif(CAPABILITY != (10, 0), reason="the B200's refusal")
def test_w4a16_refused_on_b200():
    import nvfp4_moe.gemm as moe

    layer = Layer(8, 256, 512, seed=3)
    a, _ = layer.tokens16(16, torch.bfloat16)
    with pytest.raises(ValueError, match="runs on Hopper only"):
        moe.nvfp4_moe_mm(a, None, layer.b16, layer.b_scale, _offs([2] * 8), None)


def _check_schedule(moe, layer, offs, t, out_dtype, a_input="fp4"):
    """The preparation kernel's size rows and work list are `plan_reference`'s (B200: its size rows, and the tile
    count the persistent kernel reads)."""
    b200 = CAPABILITY == (10, 0)
    build = "b200" if b200 else moe.choose_build(t, layer.e)
    tables, workspace, work = _buffers(moe, t, layer.e, layer.n, layer.k, out_dtype, a_input)
    widths = moe.moe_builds()["narrow" if b200 else build].widths
    grid = torch.cuda.get_device_properties(0).multi_processor_count
    plan = moe.plan_reference(offs, t, layer.n, layer.k, widths, grid)
    ptr_words, words = moe.table_words(layer.e)
    sizes = tables[ptr_words:words].view(torch.int32).view(layer.e, 4).cpu()
    assert sizes[:, 0].tolist() == plan["m"].tolist()
    if b200:
        count = workspace.view(torch.int32)[moe.MoeSm100Gemm.tensormap_workspace_bytes(layer.e) // 4].item()
        assert count == sum((m + 127) // 128 for m in plan["m"].tolist()) * (layer.n // 128)
        return
    work = work.view(torch.int32).cpu()
    header = moe.header_words(grid)
    assert work[0].item() == 0 and work[1:grid + 2].tolist() == plan["offsets"]
    parts = plan["parts"]
    assert torch.equal(work[header:header + 8 * len(parts)].view(-1, 8), parts)


def _buffers(moe, t, e, n, k, out_dtype, a_input):
    """(tables int64, workspace, work list) of the last call of this shape on the current queue, as uint8 views of
    its arena at the plan's offsets (`moe.buffer_bytes`)."""
    arena = moe._arenas[(torch.cuda.current_device(), torch.cuda.current_stream().cuda_stream)]
    hopper = CAPABILITY == (9, 0)
    widths = moe.moe_builds()[moe.choose_build(t, e)].widths if hopper else ()
    grid = torch.cuda.get_device_properties(0).multi_processor_count
    nbytes, workspace, tables, work = moe.buffer_bytes(hopper, t, e, n, k, a_input, widths, grid)
    raw = arena.buffer.view(torch.uint8)
    return (raw[tables:tables + 8 * moe.table_words(e)[1]].view(torch.int64), raw[workspace:tables],
            raw[work:nbytes])


def test_bad_offsets_stay_in_bounds():
    import nvfp4_moe.gemm as moe

    layer = Layer(8, 256, 512, seed=7)
    t = 100
    a, a_scale = layer.tokens(t)
    for values in ([10, 5, 30, -3, 200, 40, 60, 90], [-5, -1, 0, 0, 0, 0, 0, 0], [300] * 8, [50, 0, 0, 0, 0, 0, 0, 99]):
        offs = torch.tensor(values, dtype=torch.int32, device="cuda")
        out = torch.full((t, 256), float("nan"), dtype=torch.bfloat16, device="cuda")
        moe.nvfp4_moe_mm(a, a_scale, layer.b, layer.b_scale, offs, None, out=out)
        torch.cuda.synchronize()
        expected, bound = layer.expected(a, a_scale, offs, None)
        _check(out, expected, bound, torch.bfloat16)


@pytest.mark.parametrize("mixed", [False, True], ids=["nvfp4", "with_w4a16"])
def test_back_to_back_routings_share_buffers(mixed):
    """15 calls queued with no sync, each a new routing and new tokens (the runner's pattern, for the entry);
    mixed (Hopper): two calls in three W4A16 (bf16 A, the weights in its order) between NVFP4 calls of one layer."""
    import nvfp4_moe.gemm as moe

    if mixed and CAPABILITY != (9, 0):
        pytest.skip("W4A16 is the Hopper path")
    layer = Layer(32, 256, 1024, seed=23 if mixed else 11)
    gen = torch.Generator().manual_seed(9 if mixed else 5)
    calls = []
    for i in range(15):
        counts = _counts(32, "random", gen)
        t = sum(counts)
        a, a_scale = layer.tokens16(t, torch.bfloat16) if mixed and i % 3 else layer.tokens(t)
        out = torch.full((t, 256), float("nan"), dtype=torch.bfloat16, device="cuda")
        calls.append((a, a_scale, _offs(counts), out))
    torch.cuda.synchronize()
    for a, a_scale, offs, out in calls:
        b = layer.b if a_scale is not None else layer.b16
        moe.nvfp4_moe_mm(a, a_scale, b, layer.b_scale, offs, layer.alpha, out=out)
    torch.cuda.synchronize()
    for a, a_scale, offs, out in calls:
        expected, bound = layer.expected(a, a_scale, offs, layer.alpha)
        _check(out, expected, bound, torch.bfloat16)


def test_cuda_graph_replays_new_routing():
    import nvfp4_moe.gemm as moe

    layer, gen, a, a_scale, offs = _routed(64, 512, 1024, 256, seed=13)
    t = 256
    out = torch.empty((t, 512), dtype=torch.bfloat16, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        moe.nvfp4_moe_mm(a, a_scale, layer.b, layer.b_scale, offs, layer.alpha, out=out)  # warm-up: compiles, loads
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        moe.nvfp4_moe_mm(a, a_scale, layer.b, layer.b_scale, offs, layer.alpha, out=out)
    for _ in range(3):
        new_a, new_scale = layer.tokens(t)
        a.copy_(new_a)
        a_scale.copy_(new_scale)
        offs.copy_(_offs(_counts_to(64, t, gen)))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        expected, bound = layer.expected(a, a_scale, offs, layer.alpha)
        _check(out, expected, bound, torch.bfloat16)


def _routed(e, n, k, t, seed):
    """A layer, a routing generator, and t tokens routed over its e experts (`_counts_to`)."""
    layer = Layer(e, n, k, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    a, a_scale = layer.tokens(t)
    return layer, gen, a, a_scale, _offs(_counts_to(e, t, gen))


def _counts_to(e, t, gen):
    """A routing of exactly t rows over e experts, some empty."""
    weights = torch.rand(e, generator=gen) ** 4
    counts = torch.floor(weights / weights.sum() * t).long()
    counts[int(torch.argmax(weights))] += t - int(counts.sum())
    return counts.tolist()


def test_torch_compile_fullgraph():
    import nvfp4_moe.gemm as moe

    layer, _, a, a_scale, offs = _routed(16, 256, 512, 96, seed=17)

    def moe_layer(a, a_scale, offs):
        y = moe.nvfp4_moe_mm(a, a_scale, layer.b, layer.b_scale, offs, layer.alpha, out_dtype=torch.bfloat16)
        return y.float().relu()

    compiled = torch.compile(moe_layer, fullgraph=True)
    got = compiled(a, a_scale, offs)
    torch.cuda.synchronize()
    expected, bound = layer.expected(a, a_scale, offs, layer.alpha)
    _check(got.to(torch.bfloat16), expected.relu(), bound, torch.bfloat16)
