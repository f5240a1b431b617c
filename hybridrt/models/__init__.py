"""One file per architecture. `ARCHITECTURES` names what hybridrt runs; classes load lazily so that
`hybridrt info` and `hybridrt plan` never import torch."""
from __future__ import annotations

from ..errors import UserError

# arch name (general.architecture) -> "module:Class"
ARCHITECTURES: dict[str, str] = {
    "llama": "hybridrt.models.llama:Llama",
    "qwen3": "hybridrt.models.llama:Qwen3",
    "gemma3": "hybridrt.models.gemma3:Gemma3",
    "qwen35": "hybridrt.models.qwen35:Qwen35",
    "qwen35moe": "hybridrt.models.qwen35:Qwen35Moe",
    "qwen3next": "hybridrt.models.qwen35:Qwen3Next",
}


def check_arch(arch: str, path: str = "") -> None:
    if arch not in ARCHITECTURES:
        where = f"{path}: " if path else ""
        raise UserError(f"{where}unsupported architecture '{arch or '(none)'}' "
                        f"(supported: {', '.join(ARCHITECTURES)})")


def model_class(arch: str):
    import importlib

    check_arch(arch)
    module, cls = ARCHITECTURES[arch].split(":")
    return getattr(importlib.import_module(module), cls)
