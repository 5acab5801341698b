"""The whole MoE layer in one call: `nvfp4_moe_layer`, the torch ops `torch.ops.nvfp4_moe.layer` / `layer_out`, and
`prepare_moe_layer` (once per layer, from a ModelOpt NVFP4 checkpoint's tensors).

    out[t] = sum over token t's valid pairs j of  w[t, j] * W2[e] @ (SiLU(W13_gate[e] @ x[t]) * (W13_up[e] @ x[t]))

Stages, in engine order (each one function, so that a kernel can replace it without changing this signature):
1. `routing.route`: topk_ids [T, k] (and expert_map) -> counts, offs, the pairs' permutation and its inverse;
2. gather x's rows into expert order, and on the fp4-A path quantize them to NVFP4 (`quantize.gather_quantize_nvfp4`,
   vLLM's scaled_fp4_quant rule with a1_gscale);
3. GEMM1, `gemm.nvfp4_moe_mm` on w13: [T k, 2 I] bf16, times g1_alphas per expert;
4. `activation.silu_and_mul`: SiLU(gate) * up in fp32, rounded to bf16 (fp4-A path: then NVFP4 with a2_gscale);
5. GEMM2 on w2: [T k, H] bf16, times g2_alphas;
6. `combine.combine`: each token's k rows times its router weights, summed in a fixed order in fp32, bf16 out.
Today stages 1, 2, 4 and 6 are torch operations and 3, 5 the entry's kernels: every stage runs on the GPU on
torch's current queue with fixed shapes (T k rows), none reads the routing on the host, so the call can be
captured in a CUDA graph at a maximum T and replayed after new routing is written into the captured tensors.

Paths, by the arguments:
- fp4-A (both arches): x bf16 [T, H] with a1_gscale (and a2_gscale), or x already quantized, uint8 [T, H/2] with
  x_scale e4m3 [T, H/16] row-major (then a2_gscale only); weights from `prepare_moe_layer(...)`.
- W4A16 (Hopper): x bf16 [T, H], no a1_gscale / a2_gscale: bf16 rows into both GEMMs; weights from
  `prepare_moe_layer(..., w4a16=True)`.

Alphas: g1_alphas / g2_alphas fp32 [E] are what each GEMM's fp32 result is multiplied by. On the fp4-A path they
are ModelOpt's (vLLM modelopt.py): g1_alphas = w13_weight_scale_2 * w13_input_scale, and a1_gscale =
1 / w13_input_scale (fp32 [] or [E]), so that alpha undoes the quantization's global scale (the codes times
their block scales are x * a1_gscale) and applies the weights' global scale; likewise g2_alphas = w2_weight_scale_2
* w2_input_scale with a2_gscale = 1 / w2_input_scale. On the W4A16 path x is not scaled, so the alphas are the
weights' global scales alone (w13_weight_scale_2, w2_weight_scale_2), what vLLM's Marlin path applies.

Padding tokens and expert parallelism: a pair whose id is -1, or whose expert maps to -1 in expert_map (int32
[E_global]: the local id or -1), is never computed (it sorts past the last offset, where no GEMM row goes) and adds
exactly 0 in the combine; a token with no valid pair gets zeros, so an engine's padded batch costs no GEMM rows
for its padding, and the ranks' outputs sum to the whole layer.

Determinism: the sort is stable, the GEMMs have no split-K, the combine sums in a fixed order: repeated calls give
bitwise equal outputs.

The GEMM is called through the module-level `_expert_gemm` (`gemm.nvfp4_moe_mm`): on tensors of the CPU it raises
the entry's error (the layer runs on Hopper and B200 GPUs); the CPU tests put an exact torch GEMM in its place.
"""
import contextlib
import ctypes
import dataclasses
import math
from typing import Optional

import torch

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute

from . import gemm
from .activation import ACTIVATIONS, SiluMulKernel, silu_and_mul, silu_and_mul_nvfp4
from .combine import CombineKernel, combine
from .quantize import GatherQuantizeKernel, gather_quantize_nvfp4
from .routing import RouteKernel, route

_expert_gemm = gemm.nvfp4_moe_mm

WEIGHT_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}  # the kernels' names
K_MULTIPLE = 256  # the GEMM's K rule (check_moe_args): H for GEMM1, the (padded) I for GEMM2
SCALE_BLOCK = 16
_FP4_DTYPES = gemm._FP4_DTYPES  # uint8, and torch.float4_e2m1fn_x2 where torch has it


@dataclasses.dataclass(frozen=True)
class MoeLayerWeights:
    """One layer's weights in the kernels' layouts (`prepare_moe_layer`): E experts, H hidden, I' the intermediate
    size after padding to a multiple of 256 (`intermediate` the checkpoint's I)."""

    w13: torch.Tensor  # uint8 [E, 2 I', H/2] (gate rows, then up rows), or W4A16's int8 [E, 2 I', H/128, 64]
    w13_scale: torch.Tensor  # e4m3 [E, 2 I'/128, H/64, 512], blocked
    w2: torch.Tensor  # uint8 [E, H, I'/2], or int8 [E, H, I'/128, 64]
    w2_scale: torch.Tensor  # e4m3 [E, H/128, I'/64, 512]
    g1_alphas: torch.Tensor  # fp32 [E]
    g2_alphas: torch.Tensor  # fp32 [E]
    intermediate: int
    w4a16: bool

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def hidden(self) -> int:
        return self.w2.shape[1]

    @property
    def padded_intermediate(self) -> int:
        return self.w13.shape[1] // 2


def padded_intermediate(intermediate: int) -> int:
    """I' = I rounded up to the GEMM's K multiple (256): 384 -> 512, 768 and 2048 as they are."""
    return math.ceil(intermediate / K_MULTIPLE) * K_MULTIPLE


def _zero_pad(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """t's bytes with zeros appended along `dim` up to `size` (e2m1 code 0 and e4m3 scale 0 are both +0)."""
    raw = t.contiguous().view(torch.uint8)
    if raw.shape[dim] == size:
        return raw
    shape = list(raw.shape)
    shape[dim] = size - raw.shape[dim]
    return torch.cat([raw, raw.new_zeros(shape)], dim=dim)


def prepare_moe_layer(w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
                      g1_alphas: torch.Tensor, g2_alphas: torch.Tensor, w4a16: bool = False) -> MoeLayerWeights:
    """Once per layer, from vLLM's ModelOpt layout: w13 uint8 [E, 2I, H/2] (gate rows first, then up), w13_scale
    e4m3 [E, 2I, H/16], w2 uint8 [E, H, I/2], w2_scale e4m3 [E, H, I/16], g1_alphas / g2_alphas fp32 [E] (the
    module docstring says which alphas each path takes). w4a16: the weights for bf16 activations (Hopper),
    `prepare_moe_weights(..., w4a16=True)`'s order; else for NVFP4 activations.

    Rules: H % 256 == 0 (GEMM1's K, and GEMM2's N % 128); I % 16 == 0 (a scale block). An I that is not a multiple
    of 256 (GEMM2's K) is padded up to one with zero codes and zero scales: the padded gate and up rows give exact
    zeros, SiLU(0) * 0 = 0, and w2's padded K columns multiply them by zero weights. That costs (I' - I) / I more
    weight bytes, read by both GEMMs (Qwen3-30B-A3B at TP 2, I = 384: I' = 512, a third more)."""
    if w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"prepare_moe_layer: w13 [E, 2I, H/2] and w2 [E, H, I/2]; got {tuple(w13.shape)} and "
                         f"{tuple(w2.shape)}")
    num_experts, two_i, half_h = w13.shape
    hidden, intermediate = 2 * half_h, two_i // 2
    shapes = {"w13": (w13, (num_experts, 2 * intermediate, hidden // 2)),
              "w13_scale": (w13_scale, (num_experts, 2 * intermediate, hidden // 16)),
              "w2": (w2, (num_experts, hidden, intermediate // 2)),
              "w2_scale": (w2_scale, (num_experts, hidden, intermediate // 16)),
              "g1_alphas": (g1_alphas, (num_experts,)), "g2_alphas": (g2_alphas, (num_experts,))}
    for name, (t, shape) in shapes.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"prepare_moe_layer: {name} must be {list(shape)} for w13 {tuple(w13.shape)}; got "
                             f"{tuple(t.shape)}")
    if hidden % K_MULTIPLE or intermediate % SCALE_BLOCK or intermediate == 0:
        raise ValueError(f"prepare_moe_layer: H = {hidden} must be a multiple of {K_MULTIPLE} and I = {intermediate} a "
                         f"positive multiple of {SCALE_BLOCK} (I is padded to a multiple of {K_MULTIPLE} here; H "
                         "cannot be)")
    if w13.dtype not in _FP4_DTYPES or w2.dtype not in _FP4_DTYPES:
        raise ValueError(f"prepare_moe_layer: w13 and w2 must be uint8 (or float4_e2m1fn_x2) e2m1 pairs; got "
                         f"{w13.dtype} and {w2.dtype}")
    if w13_scale.dtype != torch.float8_e4m3fn or w2_scale.dtype != torch.float8_e4m3fn:
        raise ValueError(f"prepare_moe_layer: w13_scale and w2_scale must be float8_e4m3fn; got {w13_scale.dtype} "
                         f"and {w2_scale.dtype}")
    if g1_alphas.dtype != torch.float32 or g2_alphas.dtype != torch.float32:
        raise ValueError(f"prepare_moe_layer: g1_alphas and g2_alphas must be float32; got {g1_alphas.dtype} and "
                         f"{g2_alphas.dtype}")
    padded = padded_intermediate(intermediate)
    # gate and up padded each: [E, 2, I, ...] -> [E, 2, I', ...]
    codes13 = _zero_pad(w13.reshape(num_experts, 2, intermediate, half_h), 2, padded)
    scales13 = _zero_pad(w13_scale.reshape(num_experts, 2, intermediate, hidden // 16), 2, padded)
    b13, s13 = gemm.prepare_moe_weights(codes13.view(num_experts, 2 * padded, half_h),
                                        scales13.view(torch.float8_e4m3fn).view(num_experts, 2 * padded, -1), w4a16)
    b2, s2 = gemm.prepare_moe_weights(_zero_pad(w2, 2, padded // 2),
                                      _zero_pad(w2_scale, 2, padded // 16).view(torch.float8_e4m3fn), w4a16)
    return MoeLayerWeights(b13, s13, b2, s2, g1_alphas.contiguous(), g2_alphas.contiguous(), intermediate, w4a16)


# ---------------------------------------------------------------------------------------------------------
# Checks and the call
# ---------------------------------------------------------------------------------------------------------


def check_layer_args(x, x_scale, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, g1_alphas, g2_alphas,
                     a1_gscale, a2_gscale, expert_map, activation, apply_router_weight_on_input, out=None) -> tuple:
    """(T, k, E, H, path: "fp4", "fp4 prequantized" or "w4a16") from the tensors' metadata alone; ValueError
    naming the first argument that does not fit. The GEMM entry checks its own operands (layouts, devices)."""
    def need(ok: bool, message: str):
        if not ok:
            raise ValueError(f"nvfp4_moe_layer: {message}")

    w4a16 = w13.dtype == torch.int8
    need(w13.dim() == (4 if w4a16 else 3) and w2.dim() == w13.dim() and w2.shape[0] == w13.shape[0],
         f"w13 and w2 must come from prepare_moe_layer; got {tuple(w13.shape)} {w13.dtype} and {tuple(w2.shape)} "
         f"{w2.dtype}")
    num_experts, hidden = w13.shape[0], w2.shape[1]
    need(w13_scale.shape[0] == w2_scale.shape[0] == num_experts,
         f"w13_scale and w2_scale must have E = {num_experts} experts; got {tuple(w13_scale.shape)} and "
         f"{tuple(w2_scale.shape)}")
    for name, alpha in (("g1_alphas", g1_alphas), ("g2_alphas", g2_alphas)):
        need(tuple(alpha.shape) == (num_experts,) and alpha.dtype == torch.float32,
             f"{name} must be float32 [E] = [{num_experts}]; got {tuple(alpha.shape)} {alpha.dtype}")
    need(topk_ids.dim() == 2 and topk_ids.dtype in (torch.int32, torch.int64),
         f"topk_ids must be [T, k] int32 or int64; got {tuple(topk_ids.shape)} {topk_ids.dtype}")
    num_tokens, top_k = topk_ids.shape
    need(tuple(topk_weights.shape) == (num_tokens, top_k) and topk_weights.dtype in WEIGHT_DTYPES,
         f"topk_weights must be [T, k] = [{num_tokens}, {top_k}] float32, bfloat16 or float16; got "
         f"{tuple(topk_weights.shape)} {topk_weights.dtype}")
    if x_scale is None:
        need(tuple(x.shape) == (num_tokens, hidden) and x.dtype == torch.bfloat16,
             f"x must be bfloat16 [T, H] = [{num_tokens}, {hidden}] (or NVFP4 [T, H/2] uint8 with x_scale); got "
             f"{tuple(x.shape)} {x.dtype}")
        path = "w4a16" if a1_gscale is None else "fp4"
    else:
        need(tuple(x.shape) == (num_tokens, hidden // 2) and x.dtype in _FP4_DTYPES
             and tuple(x_scale.shape) == (num_tokens, hidden // 16) and x_scale.dtype == torch.float8_e4m3fn,
             f"a quantized x must be uint8 [T, H/2] = [{num_tokens}, {hidden // 2}] with x_scale float8_e4m3fn "
             f"[T, H/16] = [{num_tokens}, {hidden // 16}]; got {tuple(x.shape)} {x.dtype} and {tuple(x_scale.shape)} "
             f"{x_scale.dtype}")
        need(a1_gscale is None, "a1_gscale must be None with a quantized x (its scales are given)")
        need(not apply_router_weight_on_input,
             "apply_router_weight_on_input takes a bf16 x (the weight multiplies x before quantization)")
        path = "fp4 prequantized"
    if path == "w4a16":
        need(w4a16, "bf16 x without a1_gscale is the W4A16 path: its weights come from prepare_moe_layer(..., "
             "w4a16=True); give a1_gscale and a2_gscale for NVFP4 activations")
        need(a2_gscale is None, "a2_gscale is for NVFP4 activations: with it give a1_gscale too (W4A16 takes none)")
    else:
        need(not w4a16, "NVFP4 activations take weights from prepare_moe_layer(..., w4a16=False)")
        need(a2_gscale is not None, "the fp4-A path needs a2_gscale (GEMM2's activations are quantized too)")
    for name, scale in (("a1_gscale", a1_gscale), ("a2_gscale", a2_gscale)):
        if scale is not None:
            need(scale.dtype == torch.float32 and scale.dim() <= 1 and scale.numel() in (1, num_experts),
                 f"{name} must be float32 [] / [1] or per expert [E] = [{num_experts}]; got {tuple(scale.shape)} "
                 f"{scale.dtype}")
    if expert_map is not None:
        need(expert_map.dim() == 1 and expert_map.dtype == torch.int32,
             f"expert_map must be int32 [E_global]; got {tuple(expert_map.shape)} {expert_map.dtype}")
    need(activation in ACTIVATIONS, f"activation {activation!r} is not one of {', '.join(ACTIVATIONS)}")
    need(not apply_router_weight_on_input or top_k == 1,
         f"apply_router_weight_on_input needs top-k 1 (vLLM's rule: the weight scales x's row, which a token's k "
         f"experts share); got k = {top_k}")
    if out is not None:
        need(tuple(out.shape) == (num_tokens, hidden) and out.dtype == torch.bfloat16,
             f"out must be bfloat16 [T, H] = [{num_tokens}, {hidden}]; got {tuple(out.shape)} {out.dtype}")
    return num_tokens, top_k, num_experts, hidden, path


def layer_stages(x, x_scale, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, g1_alphas, g2_alphas, a1_gscale,
                 a2_gscale, expert_map, activation, apply_router_weight_on_input, out) -> torch.Tensor:
    """The layer as its torch statements (stages 1, 2, 4, 6 in torch, the GEMMs through `_expert_gemm`): the CPU
    path (the tests put an exact GEMM in place of the entry), and on a GPU the "two entry calls with torch glue"
    that bench_layer compares with; the kernels of `_gpu_layer` compute the same stages."""
    path = check_layer_args(x, x_scale, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, g1_alphas, g2_alphas,
                            a1_gscale, a2_gscale, expert_map, activation, apply_router_weight_on_input, out)[-1]
    routing = route(topk_ids, w13.shape[0], expert_map)
    if apply_router_weight_on_input:  # k == 1: x's row times its one weight, rounded to x's dtype (vLLM's)
        x = x * topk_weights.to(x.dtype)
    if path == "w4a16":
        h = _expert_gemm(x[routing.row_token], None, w13, w13_scale, routing.offs, g1_alphas)
        y = _expert_gemm(silu_and_mul(h), None, w2, w2_scale, routing.offs, g2_alphas)
    else:
        if path == "fp4":
            a, a_scale = gather_quantize_nvfp4(x, routing, a1_gscale)
        else:
            a, a_scale = x.view(torch.uint8)[routing.row_token], x_scale[routing.row_token]
        h = _expert_gemm(a, a_scale, w13, w13_scale, routing.offs, g1_alphas)
        y = _expert_gemm(*silu_and_mul_nvfp4(h, routing, a2_gscale), w2, w2_scale, routing.offs, g2_alphas)
    return combine(y, routing, None if apply_router_weight_on_input else topk_weights, out=out)


def _layer_into(x, x_scale, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, g1_alphas, g2_alphas, a1_gscale,
                a2_gscale, expert_map, activation, apply_router_weight_on_input, out) -> torch.Tensor:
    """One layer call (module docstring): on a GPU the stage kernels (`_gpu_layer`), else the torch statements
    (whose GEMM is the entry's: it refuses CPU tensors unless a test replaced it)."""
    args = (x, x_scale, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, g1_alphas, g2_alphas, a1_gscale,
            a2_gscale, expert_map, activation, apply_router_weight_on_input, out)
    if x.is_cuda:
        return _gpu_layer(*args)
    return layer_stages(*args)


# ---------------------------------------------------------------------------------------------------------
# The GPU path: six stages in eight launches on torch's current queue, their buffers in one arena
# ---------------------------------------------------------------------------------------------------------
def _launcher(kernel, types: str, device_index: int) -> gemm.CellLauncher:
    """A stage kernel compiled once per (class, its parameters, device) and wrapped for ~1 µs launches: `types`
    gives its arguments ('q' an address or Int64, 'i' an Int32), the CUDA queue last."""
    key = (type(kernel).__name__, tuple(sorted(vars(kernel).items())), device_index)
    launcher = _stage_launchers.get(key)
    if launcher is None:
        with gemm._COMPILE_LOCK:
            launcher = _stage_launchers.get(key)  # another thread's, compiled while this one waited
            if launcher is None:
                dsl_args = (tuple(cutlass.Int64(0) if c == "q" else cutlass.Int32(1) for c in types)
                            + (cuda.CUstream(0),))
                with torch.cuda.device(device_index), gemm._relaxed_capture():
                    compiled = cute.compile(kernel, *dsl_args)
                    cells = tuple(ctypes.c_int64 if c == "q" else ctypes.c_int32 for c in types) + (ctypes.c_void_p,)
                    launcher = _stage_launchers[key] = gemm.CellLauncher(compiled, dsl_args, cells, device_index)
    return launcher


_WITH_GEMMS = True  # `gemms_removed` (a measurement of the other stages) turns it off


@contextlib.contextmanager
def gemms_removed():
    """The GPU path without its two GEMMs' launches (the stages around them read whatever the buffers hold): for
    measuring the non-GEMM stages' time alone (bench_layer). The outputs are meaningless meanwhile."""
    global _WITH_GEMMS
    _WITH_GEMMS = False
    try:
        yield
    finally:
        _WITH_GEMMS = True


_stage_launchers: dict = {}  # (kernel class, parameters, device) -> CellLauncher
_layer_plans: dict = {}  # `_layer_signature` -> _LayerPlan


@dataclasses.dataclass(frozen=True)
class _LayerPlan:
    """What a checked layer signature's calls reuse: the four stage launchers, the two GEMM plans, and the
    offsets of the call's buffers in its arena (the GEMMs' tables and workspace first, shared: the launches run
    in queue order, each GEMM's preparation after everything before it)."""

    route: gemm.CellLauncher
    gather: gemm.CellLauncher
    activation: gemm.CellLauncher
    combine: gemm.CellLauncher
    gemm1: gemm._Plan
    gemm2: gemm._Plan
    at: dict  # buffer name -> offset
    nbytes: int
    tokens: int
    rows: int
    hidden: int
    fp4: bool  # NVFP4 A for both GEMMs (every path but W4A16): their a_scale buffers are passed


def _layer_signature(args: tuple) -> tuple:
    """What the checks read of `_gpu_layer`'s arguments (`gemm.signature_of` of its tensors, then its two flags,
    activation and apply_router_weight_on_input) and the queue: (metadata, queue)."""
    meta, queue = gemm.signature_of(args[:13] + args[15:], args[0].get_device())
    return (meta, args[13], args[14]), queue


def _make_layer_plan(x, x_scale, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, g1_alphas, g2_alphas,
                     a1_gscale, a2_gscale, expert_map, activation, apply_router_weight_on_input, out) -> _LayerPlan:
    num_tokens, top_k, num_experts, hidden, path = check_layer_args(
        x, x_scale, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, g1_alphas, g2_alphas, a1_gscale, a2_gscale,
        expert_map, activation, apply_router_weight_on_input, out)
    device = x.device
    tensors = [("x", x), ("x_scale", x_scale), ("topk_ids", topk_ids), ("topk_weights", topk_weights),
               ("w13", w13), ("w13_scale", w13_scale), ("w2", w2), ("w2_scale", w2_scale), ("g1_alphas", g1_alphas),
               ("g2_alphas", g2_alphas), ("a1_gscale", a1_gscale), ("a2_gscale", a2_gscale),
               ("expert_map", expert_map), ("out", out)]
    for name, t in tensors:
        if t is not None and (t.device != device or not t.is_contiguous()):
            raise ValueError(f"nvfp4_moe_layer: {name} must be contiguous and on {device} (x's device); got "
                             f"{t.device}{'' if t.is_contiguous() else ', not contiguous'}")
    padded = w13.shape[1] // 2
    rows = num_tokens * top_k
    fp4 = path != "w4a16"
    index = device.index
    weight_dtype = WEIGHT_DTYPES[topk_weights.dtype]
    route_k = _launcher(RouteKernel(num_experts, top_k, topk_ids.dtype == torch.int64, expert_map is not None),
                        "qqiqqqi", index)
    mode = "codes" if path == "fp4 prequantized" else ("fp4" if fp4 else "bf16")
    gather_k = _launcher(GatherQuantizeKernel(hidden, top_k, mode, a1_gscale is not None and a1_gscale.numel() != 1,
                                              apply_router_weight_on_input, weight_dtype), "qqqqqqqqi", index)
    act_k = _launcher(SiluMulKernel(num_experts, padded, fp4, a2_gscale is not None and a2_gscale.numel() != 1),
                      "qqqqqqi", index)
    combine_k = _launcher(CombineKernel(hidden, top_k, None if apply_router_weight_on_input else weight_dtype),
                          "qqqqi", index)
    a_input = "fp4" if fp4 else "bf16"
    plan1 = gemm.plan(device, rows, num_experts, 2 * padded, hidden, torch.bfloat16, a_input, zero_tail=False)
    plan2 = gemm.plan(device, rows, num_experts, hidden, padded, torch.bfloat16, a_input, zero_tail=False)
    sizes = {"offs": 4 * num_experts, "inverse": 4 * rows, "row_expert": 4 * rows,
             "a": rows * (hidden // 2 if fp4 else 2 * hidden), "a_scale": rows * hidden // 16 if fp4 else 0,
             "h": rows * 4 * padded, "act": rows * (padded // 2 if fp4 else 2 * padded),
             "act_scale": rows * padded // 16 if fp4 else 0, "y": rows * 2 * hidden}
    at, cursor = {}, gemm.ceil_div(max(plan1.nbytes, plan2.nbytes), 1024) * 1024
    for name, size in sizes.items():
        at[name] = cursor
        cursor += gemm.ceil_div(max(size, 1), 1024) * 1024
    return _LayerPlan(route_k, gather_k, act_k, combine_k, plan1, plan2, at, cursor, num_tokens, rows, hidden, fp4)


def _address(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.data_ptr()


def _gpu_layer(x, x_scale, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, g1_alphas, g2_alphas, a1_gscale,
               a2_gscale, expert_map, activation, apply_router_weight_on_input, out) -> torch.Tensor:
    """The layer's stage kernels: the checks once per signature, then RouteKernel, GatherQuantizeKernel, GEMM1's
    two launches, SiluMulKernel, GEMM2's two, CombineKernel, with this call's addresses."""
    args = (x, x_scale, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, g1_alphas, g2_alphas, a1_gscale,
            a2_gscale, expert_map, activation, apply_router_weight_on_input, out)
    signature = _layer_signature(args)
    plan = _layer_plans.get(signature)
    if plan is None:
        plan = _make_layer_plan(*args)
        if len(_layer_plans) >= gemm.MAX_SIGNATURES:
            _layer_plans.clear()
        _layer_plans[signature] = plan
    if out is None:
        out = torch.empty((plan.tokens, plan.hidden), dtype=torch.bfloat16, device=x.device)
    if plan.tokens == 0:
        return out
    px, po = x.data_ptr(), out.data_ptr()
    if (px | po) & 15:
        raise ValueError("nvfp4_moe_layer: x and out must be 16-byte aligned")
    queue = signature[1]
    at = plan.at
    with gemm._on_device(x.device):
        capturing = torch.cuda.is_current_stream_capturing()
        with gemm._LOCK:
            base = gemm._arena(x.device, queue, capturing).reserve(plan.nbytes)
            offs, inverse, row_expert = base + at["offs"], base + at["inverse"], base + at["row_expert"]
            a, a_scale, h = base + at["a"], base + at["a_scale"], base + at["h"]
            act, act_scale, y = base + at["act"], base + at["act_scale"], base + at["y"]
            weights = topk_weights.data_ptr()
            plan.route((topk_ids.data_ptr(), _address(expert_map), 0 if expert_map is None else expert_map.shape[0],
                        offs, inverse, row_expert, plan.tokens, queue))
            plan.gather((px, _address(x_scale), inverse, row_expert, _address(a1_gscale), weights, a, a_scale,
                         plan.tokens, queue))
            if _WITH_GEMMS:
                gemm.launch(plan.gemm1, base, offs, a, a_scale if plan.fp4 else 0, w13.data_ptr(),
                            w13_scale.data_ptr(), h, g1_alphas.data_ptr(), plan.rows, queue)
            plan.activation((h, offs, row_expert, _address(a2_gscale), act, act_scale, plan.rows, queue))
            if _WITH_GEMMS:
                gemm.launch(plan.gemm2, base, offs, act, act_scale if plan.fp4 else 0, w2.data_ptr(),
                            w2_scale.data_ptr(), y, g2_alphas.data_ptr(), plan.rows, queue)
            plan.combine((y, inverse, weights, po, plan.tokens, queue))
    return out


# ---------------------------------------------------------------------------------------------------------
# The torch ops (plain tensors: the wrapper unpacks MoeLayerWeights)
# ---------------------------------------------------------------------------------------------------------
@torch.library.custom_op("nvfp4_moe::layer", mutates_args=())
def _layer_op(x: torch.Tensor, x_scale: Optional[torch.Tensor], topk_ids: torch.Tensor, topk_weights: torch.Tensor,
              w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
              g1_alphas: torch.Tensor, g2_alphas: torch.Tensor, a1_gscale: Optional[torch.Tensor],
              a2_gscale: Optional[torch.Tensor], expert_map: Optional[torch.Tensor], activation: str,
              apply_router_weight_on_input: bool) -> torch.Tensor:
    return _layer_into(x, x_scale, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, g1_alphas, g2_alphas,
                       a1_gscale, a2_gscale, expert_map, activation, apply_router_weight_on_input, None)


@_layer_op.register_fake
def _layer_fake(x, x_scale, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, g1_alphas, g2_alphas, a1_gscale,
                a2_gscale, expert_map, activation, apply_router_weight_on_input):
    num_tokens, _, _, hidden, _ = check_layer_args(x, x_scale, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale,
                                                   g1_alphas, g2_alphas, a1_gscale, a2_gscale, expert_map, activation,
                                                   apply_router_weight_on_input)
    return x.new_empty((num_tokens, hidden), dtype=torch.bfloat16)


@torch.library.custom_op("nvfp4_moe::layer_out", mutates_args=("out",))
def _layer_out_op(x: torch.Tensor, x_scale: Optional[torch.Tensor], topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
                  g1_alphas: torch.Tensor, g2_alphas: torch.Tensor, a1_gscale: Optional[torch.Tensor],
                  a2_gscale: Optional[torch.Tensor], expert_map: Optional[torch.Tensor], activation: str,
                  apply_router_weight_on_input: bool, out: torch.Tensor) -> None:
    _layer_into(x, x_scale, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, g1_alphas, g2_alphas, a1_gscale,
                a2_gscale, expert_map, activation, apply_router_weight_on_input, out)


@_layer_out_op.register_fake
def _layer_out_fake(x, x_scale, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, g1_alphas, g2_alphas, a1_gscale,
                    a2_gscale, expert_map, activation, apply_router_weight_on_input, out):
    check_layer_args(x, x_scale, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, g1_alphas, g2_alphas, a1_gscale,
                     a2_gscale, expert_map, activation, apply_router_weight_on_input, out)


def nvfp4_moe_layer(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, weights: MoeLayerWeights,
                    a1_gscale: Optional[torch.Tensor] = None, a2_gscale: Optional[torch.Tensor] = None,
                    expert_map: Optional[torch.Tensor] = None, activation: str = "silu",
                    apply_router_weight_on_input: bool = False, out: Optional[torch.Tensor] = None,
                    x_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The MoE layer (module docstring): x bf16 [T, H] (or NVFP4 uint8 [T, H/2] with x_scale e4m3 [T, H/16]),
    topk_ids [T, k] int32 / int64 (-1: no expert), topk_weights [T, k], `weights` from `prepare_moe_layer` ->
    bf16 [T, H] (into `out` when given). Eagerly it runs the stages directly (the torch dispatcher's Python op costs
    host time); under torch.compile, the registered op."""
    args = (x, x_scale, topk_ids, topk_weights, weights.w13, weights.w13_scale, weights.w2, weights.w2_scale,
            weights.g1_alphas, weights.g2_alphas, a1_gscale, a2_gscale, expert_map, activation,
            apply_router_weight_on_input)
    if torch.compiler.is_compiling():
        if out is None:
            return torch.ops.nvfp4_moe.layer(*args)
        torch.ops.nvfp4_moe.layer_out(*args, out)
        return out
    return _layer_into(*args, out)
