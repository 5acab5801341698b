"""Kept for one release: `import moe` from the repository root is `nvfp4_moe.gemm` (the MoE entry moved into the
package `nvfp4_moe`). New code imports `nvfp4_moe` (`from nvfp4_moe import nvfp4_moe_mm`)."""
import sys

if __name__ == "__main__":
    import harness

    sys.exit(harness.not_a_command("moe.py", "a library module (kept one release as an alias of nvfp4_moe.gemm): "
                                             "pip install ., then import nvfp4_moe and call nvfp4_moe.nvfp4_moe_mm "
                                             "(README.md, 'Use it from an engine'; docs/MOE_ENTRY.md)", sys.argv[1:]))

import nvfp4_moe.gemm as _gemm  # noqa: E402

sys.modules[__name__] = _gemm
