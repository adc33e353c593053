"""carpool's C++ kernels: paged attention, RoPE, residual + RMSNorm, SiLU * up.

The sources are the ``.cpp``/``.h`` files in this folder; ``build.Kernels`` compiles them once
per machine (cached under ``$CARPOOL_CACHE_DIR/kernels``) and is owned by the model runner.
"""

from .build import SUPPORTED_HEAD_DIMS, Kernels

__all__ = ["SUPPORTED_HEAD_DIMS", "Kernels"]
