"""One file per architecture, and the table of what each is (`arch_spec.ARCH_SPECS`, torch-free).
Classes load lazily, by the table's "module:Class", so that `hybridrt info` and `hybridrt plan`
never import torch."""
from __future__ import annotations

from .arch_spec import ARCH_SPECS, ArchSpec, arch_spec


def check_arch(arch: str, path: str = "") -> ArchSpec:
    """The architecture's ArchSpec; a UserError naming the supported ones if it has none."""
    return arch_spec(arch, path)


def model_class(arch: str):
    import importlib

    module, cls = arch_spec(arch).model.split(":")
    return getattr(importlib.import_module(module), cls)


__all__ = ["ARCH_SPECS", "ArchSpec", "arch_spec", "check_arch", "model_class"]
