"""Kept for one release: `import moe` from the repository root is `nvfp4_moe.gemm` (the MoE entry moved into the
package `nvfp4_moe`). New code imports `nvfp4_moe` (`from nvfp4_moe import nvfp4_moe_mm`)."""
import sys

import nvfp4_moe.gemm as _gemm

sys.modules[__name__] = _gemm
