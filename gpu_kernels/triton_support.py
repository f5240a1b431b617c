"""Whether Triton is importable, whether it runs interpreted, and one clean error when it is missing.

Triton is an optional dependency (the `gpu` extra): gpu_kernels must import without it, so nothing
here imports it at module level, and callers that need it ask `require_triton` first.
"""
from __future__ import annotations

import functools
import importlib.util
import os

from hybridrt.runtime.config import ENV

# HYBRIDRT_DIRECT_LAUNCH=0 keeps every launch on Triton's JIT path (for an A/B of checked_runner)
DIRECT_LAUNCH = ENV.direct_launch

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


def _capturing() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def checked_runner(compiled, grid: tuple, args: tuple, constexpr_values: tuple, out_index: int):
    """Triton's launcher of an already compiled kernel (`compiled[grid]`, the CompiledKernel that a
    JIT launch returns), or None.

    Why: a JIT launch binds and specializes every argument, builds a cache key and looks the
    kernel up before it launches: about 15 of the ~25 us of host time each Triton launch cost on
    the H100's host (BENCHMARKS, "GPU check"), and a decode step makes ~15 per layer. The compiled
    kernel is valid for every call whose arguments specialize the same way, which the caller keys
    (pointer alignments; the other arguments are fixed or not specialized). The runner is taken
    only if, on `args` (a JIT launch that just wrote args[out_index]), it reproduces that output
    bit for bit into a fresh buffer; anything else (no compiled kernel, as under the interpreter,
    another Triton's API, an error, other bits) gives None and the caller keeps the JIT path."""
    import torch

    if not DIRECT_LAUNCH or compiled is None or not hasattr(compiled, "run"):
        return None
    try:
        runner = compiled[tuple(grid) + (1,) * (3 - len(grid))]
        trial = list(args)
        trial[out_index] = torch.empty_like(args[out_index])
        runner(*trial, *constexpr_values)
        if torch.equal(trial[out_index], args[out_index]):
            return runner
    except Exception:        # noqa: BLE001 -- any failure means: stay on the JIT path
        pass
    return None


class Launches:
    """One owner's launches of one Triton kernel (a matrix's matvec, a linear's round trip): the
    JIT launch, then, per specialization key the caller computes, the compiled kernel's own
    launcher once checked_runner has checked it. `direct` maps each key seen to its runner (None:
    that key stays on the JIT path)."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.direct: dict[tuple, object] = {}

    def __call__(self, key: tuple, grid: tuple, args: tuple, constexprs: dict, options: dict, out_index: int,
                 try_direct: bool = True) -> None:
        """Launch kernel[grid](*args, **constexprs, **options); args[out_index] is its output.
        try_direct=False: a JIT launch that does not check (or remember) a runner for the key."""
        runner = self.direct.get(key)
        if runner is not None:
            runner(*args, *constexprs.values())       # constexprs in the kernel's signature order
            return
        compiled = self.kernel[grid](*args, **constexprs, **options)
        # checking a runner reads its output back on the host, which a CUDA graph capture cannot
        # take: a key first met inside a capture is checked at its next launch outside one
        if try_direct and key not in self.direct and not _capturing():
            self.direct[key] = checked_runner(compiled, grid, args, tuple(constexprs.values()), out_index)
