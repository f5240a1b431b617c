"""Float64 numpy reference forwards, independent of hybridrt's reader and kernels.

Written only from the reference notes (/work/shared/reference/qwen35-architecture.md) and facts from
llama.cpp; weights are read with ``gguf.GGUFReader`` and ``gguf.quants.dequantize``. Slow and
simple on purpose: the GDN recurrence runs token by token, everything is float64.

    from reference import RefLlama, RefQwen35      # tests/ is on sys.path under pytest

``RefLlama`` covers the ``llama`` and ``qwen3`` archs; ``RefQwen35`` covers ``qwen35`` including
the MTP (NextN) draft step.
"""
from .ref_llama import RefLlama
from .ref_qwen35 import RefQwen35

__all__ = ["RefLlama", "RefQwen35"]
