"""nvfp4_moe: the MoE library of this project, NVFP4 expert GEMMs (and, on Hopper, W4A16) with the routing on the GPU.

Modules, in a MoE layer's stage order:
- `gemm`: the routed-expert GEMM `nvfp4_moe_mm` (torch._grouped_mm's convention; the op `torch.ops.nvfp4_moe.mm`),
  `prepare_moe_weights`, and the entry's caches (`cache_info`, `clear_caches`).

Importing the package registers its torch ops. The kernels come from the leaderboard files `submission.py` (B200, and
the host path both arches share) and `submission_sm90.py` (Hopper), which never need this package.
"""
from .gemm import nvfp4_moe_mm, prepare_moe_weights  # noqa: F401  (registers torch.ops.nvfp4_moe.*)
