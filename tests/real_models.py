"""Paths of the two real models (pulled by `hybridrt pull`); tests skip when they are absent."""
from __future__ import annotations

import pytest

from hybridrt.files.registry import model_path

SMOLLM2 = model_path("smollm2-135m")
GEMMA3 = model_path("gemma3-270m")


def require(path):
    if not path.exists():
        pytest.skip(f"{path.name} not pulled (run: hybridrt pull)")
    return path
