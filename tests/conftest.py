"""Shared fixtures: tiny synthetic GGUF models built once per test session.

The files come from scripts/make_model.py (imported by putting scripts/ on sys.path). Each fixture
is an F32 file with seed 0; build other mixes/seeds in a test with ``make_model.write_model``.

    def test_x(tiny_qwen35_mtp): ...     # a pathlib.Path to the .gguf
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# Triton kernels run interpreted on CPU tensors when there is no GPU. Triton reads this when a
# kernel is decorated, so it must be set before any gpu_kernels module is imported.
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
if str(SCRIPTS) not in sys.path:
    sys.path.insert(0, str(SCRIPTS))

import make_model  # noqa: E402


def _build(tmp_path_factory, name: str, arch: str, mtp: bool = False, mix: str = "f32") -> Path:
    return make_model.write_model(tmp_path_factory.mktemp("models") / f"{name}.gguf", arch,
                                  mtp=mtp, mix=mix, seed=0)


@pytest.fixture(scope="session")
def tiny_qwen35(tmp_path_factory) -> Path:
    return _build(tmp_path_factory, "tiny-qwen35", "qwen35")


@pytest.fixture(scope="session")
def tiny_qwen35_mtp(tmp_path_factory) -> Path:
    return _build(tmp_path_factory, "tiny-qwen35-mtp", "qwen35", mtp=True)


@pytest.fixture(scope="session")
def tiny_qwen35_q4(tmp_path_factory) -> Path:
    """The tiny qwen35 layout with the q4_k_m mix: K-quant matrices whose types differ by layer."""
    return _build(tmp_path_factory, "tiny-qwen35-q4", "qwen35", mtp=True, mix="q4_k_m")


@pytest.fixture(scope="session")
def tiny_qwen35_q4_plain(tmp_path_factory) -> Path:
    return _build(tmp_path_factory, "tiny-qwen35-q4-plain", "qwen35", mix="q4_k_m")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return _build(tmp_path_factory, "tiny-llama", "llama")


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> Path:
    return _build(tmp_path_factory, "tiny-qwen3", "qwen3")


@pytest.fixture(scope="module")
def single_thread():
    """Pin torch and Numba to one thread for a module, then restore them. Tiny models gain nothing
    from parallel kernels, and on the shared 2-core machine two spinning pools stall each other."""
    import numba
    import torch

    before = torch.get_num_threads(), numba.get_num_threads()
    torch.set_num_threads(1)
    numba.set_num_threads(1)
    yield
    torch.set_num_threads(before[0])
    numba.set_num_threads(before[1])


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` need a real GPU: skipped here, run by scripts/gpu_check.sh on one."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
