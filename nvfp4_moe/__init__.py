"""nvfp4_moe: the MoE library of this project, NVFP4 expert GEMMs (and, on Hopper, W4A16) with the routing on the GPU.

Modules, in a MoE layer's stage order:
- `routing`: topk_ids (and an expert-parallel `expert_map`) to per-expert counts, `offs`, the permutation;
- `quantize`: the rows gathered into expert order and quantized to NVFP4 (vLLM's scaled_fp4_quant rule);
- `gemm`: the routed-expert GEMM `nvfp4_moe_mm` (torch._grouped_mm's convention; the op `torch.ops.nvfp4_moe.mm`),
  `prepare_moe_weights`, and the entry's caches (`cache_info`, `clear_caches`);
- `activation`: SiLU(gate) x up, in bf16 or requantized to NVFP4 for the second GEMM;
- `combine`: each token's k rows weighted and summed, deterministically;
- `layer`: the whole layer in one call, `nvfp4_moe_layer` (the op `torch.ops.nvfp4_moe.layer`), and
  `prepare_moe_layer` (vLLM's ModelOpt checkpoint layout, once per layer).

Importing the package registers its torch ops. The kernels come from the leaderboard files `submission.py` (B200, and
the host path both arches share) and `submission_sm90.py` (Hopper), which never need this package.
"""
from .gemm import cache_info, clear_caches, nvfp4_moe_mm, prepare_moe_weights  # noqa: F401  (registers the ops)
from .layer import MoeLayerWeights, nvfp4_moe_layer, prepare_moe_layer  # noqa: F401
