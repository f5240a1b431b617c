"""Float64 numpy reference forwards, independent of hybridrt's reader and kernels.

Written only from the reference notes (/work/shared/reference/qwen35-architecture.md) and facts from
llama.cpp; weights are read with ``gguf.GGUFReader`` and ``gguf.quants.dequantize``. Slow and
simple on purpose: the GDN recurrence runs token by token, everything is float64.

    from reference import RefLlama, RefQwen35      # tests/ is on sys.path under pytest

``RefLlama`` covers the ``llama`` and ``qwen3`` archs; ``RefQwen35`` covers ``qwen35`` including
the MTP (NextN) draft step, and ``qwen3next``; ``RefGemma3`` covers ``gemma3``. ``reference_for``
picks the class for a file's architecture.
"""
from .common import GGUFWeights
from .ref_gemma3 import RefGemma3
from .ref_llama import RefLlama
from .ref_qwen35 import RefQwen35

REFERENCES = {"llama": RefLlama, "qwen3": RefLlama, "gemma3": RefGemma3, "qwen35": RefQwen35,
              "qwen3next": RefQwen35}


def reference_for(path):
    """The float64 reference model for a GGUF file, chosen by general.architecture."""
    arch = GGUFWeights(path).arch
    if arch not in REFERENCES:
        raise ValueError(f"no float64 reference for architecture {arch!r}")
    return REFERENCES[arch](path)


__all__ = ["RefGemma3", "RefLlama", "RefQwen35", "REFERENCES", "reference_for"]
