"""Whether Triton is importable, whether it runs interpreted, and one clean error when it is missing.

Triton is an optional dependency (the `gpu` extra): gpu_kernels must import without it, so nothing
here imports it at module level, and callers that need it ask `require_triton` first.
"""
from __future__ import annotations

import functools
import importlib.util
import os

INSTALL_HINT = "pip install 'hybridrt[gpu]' (or pip install triton)"


class TritonMissing(RuntimeError):
    """Triton is needed for a fused kernel but is not installed."""


@functools.cache
def have_triton() -> bool:
    # cached: dispatch asks on every kernel call, and a find_spec walks sys.path
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """TRITON_INTERPRET=1: kernels run as numpy on CPU tensors (tests without a GPU). Triton reads
    the variable when a kernel is decorated, so it must be set before the kernel module is imported."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def require_triton(what: str) -> None:
    """Raise TritonMissing, with a one-line message naming `what` and how to install Triton."""
    if not have_triton():
        raise TritonMissing(f"{what} needs Triton, which is not installed: {INSTALL_HINT}")


def pow2_at_least(n: int) -> int:
    """The smallest power of two >= n (n >= 1), for block sizes. triton.next_power_of_2 is the same
    number, but newer Tritons wrap it as a constexpr function that costs ~3 us a call on the host,
    and the wrappers of a decode step's kernels call it a dozen times per layer."""
    return 1 << (n - 1).bit_length()
