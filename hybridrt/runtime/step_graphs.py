"""A placed step as captured device segments: CUDA graphs between the CPU crossings.

Why: a decode step on the device launches a few kernels per matrix and ~19 per layer, each costing
the host ~25 us (BENCHMARKS.md, "GPU check"), so the device waits on the host. A CUDA graph replays
a captured sequence of launches for one host call. A placed step cannot be one graph: it crosses to
the CPU for every FFN layer left in the mmap. So a step of k tokens is captured as pieces, in the
order the eager step runs them:

    Segment (device work) | HostJob (a CPU function, on the executor's worker) | Wait (its result)

A crossing layer's copy to the host ends a segment; its CPU FFN is a HostJob; the copy back starts
the segment after its Wait. Between a HostJob and its Wait the device keeps working (the split
layer's device half is such a segment). The embedding rows are gathered on the host too: a HostJob
that reads the step's tokens from a static host buffer, before the first segment.

What changes from step to step lives in static buffers the host fills before a replay: the token
ids (host), the positions (device: rotary rows, KV writes and attention read them through
`ModelState.positions`). Everything else a segment touches is the session's state (KV cache,
recurrent state, snapshot ring: updated in place), the pinned host buffers the crossings copy
through, or the graph's own memory pool. So one capture per (session state, k) serves every later
step of k tokens at any position. Host bookkeeping a forward does besides launching kernels
(`Model.begin_step`: the snapshot ring's batch) runs before every replay.

The CPU standing in for the device (tests) records the segments' torch operators and replays them
(`RecordedSegment`): a Python int of the step that reached a kernel would replay stale, and a value
read back on the host inside a segment fails the capture, as it would under CUDA.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode

GRAPH_MAX_TOKENS = 16       # steps of up to this many tokens replay graphs (decode, verify); prompts stay eager


class CaptureError(RuntimeError):
    """The step cannot be captured (a host read inside a segment, an unsupported operation)."""


class Segment(Protocol):
    """Device work between two host pieces, captured once and replayed."""
    runs_on_capture: bool       # whether capturing also computes (the recorder) or only records (CUDA)

    def begin(self) -> None: ...
    def end(self) -> None: ...
    def replay(self) -> None: ...


class CudaSegment:
    """One CUDA graph. Every segment of a step shares one memory pool and is replayed in the order
    captured, which is what sharing a pool requires."""
    runs_on_capture = False

    def __init__(self, pool):
        self.graph, self.pool, self.empty = torch.cuda.CUDAGraph(), pool, False

    def begin(self) -> None:
        # thread-local: the CPU worker's own CUDA calls (none expected) do not invalidate this capture
        self.graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")

    def end(self) -> None:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self.graph.capture_end()
        # a crossing right after another leaves nothing between them: torch warns the graph is empty
        self.empty = any("empty" in str(w.message) for w in caught)

    def replay(self) -> None:
        if not self.empty:
            self.graph.replay()


# operators that read a tensor's value on the host (a CUDA capture fails on them) or whose output
# shape depends on values
_HOST_READS = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "item")
_NO_DATA = ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided")


class _Recorder(TorchDispatchMode):
    def __init__(self, ops: list[Callable[[], None]]):
        super().__init__()
        self.ops = ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name.split("::")[-1]
        if name in _HOST_READS:
            raise CaptureError(f"{func._schema.name} reads a device value on the host inside a captured segment")
        out = func(*args, **kwargs)
        schema = func._schema
        if any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
            self.ops.append(lambda: func(*args, **kwargs))              # in place: run it again
        elif name in _NO_DATA or all(r.alias_info is not None for r in schema.returns):
            pass                                                        # a view, or no values to recompute
        else:
            self.ops.append(lambda: _copy_into(out, func(*args, **kwargs)))
        return out


def _copy_into(dst, src) -> None:
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
    elif isinstance(dst, (tuple, list)):
        for d, s in zip(dst, src):
            _copy_into(d, s)


class RecordedSegment:
    """The CPU standing in for a CUDA graph: the segment's torch operators, computed while capturing
    and recorded with the tensors they read and wrote; a replay runs them again into the same tensors
    (a Python scalar among their arguments replays as it was captured, as in a CUDA graph)."""
    runs_on_capture = True

    def __init__(self):
        self.ops: list[Callable[[], None]] = []
        self._mode: _Recorder | None = None

    def begin(self) -> None:
        self._mode = _Recorder(self.ops)
        self._mode.__enter__()

    def end(self) -> None:
        self._mode.__exit__(None, None, None)
        self._mode = None

    def replay(self) -> None:
        for op in self.ops:
            op()


@dataclass
class HostJob:
    """fn(*args) on the CPU worker, filling `out` (a host buffer the next segments copy from)."""
    fn: Callable
    args: tuple
    out: torch.Tensor


@dataclass
class Wait:
    job: HostJob


Piece = Segment | HostJob | Wait


@dataclass
class StepGraph:
    """One captured step of k tokens for one session state."""
    k: int
    tokens: torch.Tensor            # int64 [k] on the host: the embedding's HostJob reads the step's ids here
    positions: torch.Tensor         # int64 [k] on the trunk device
    pieces: list = field(default_factory=list)
    hidden: torch.Tensor | None = None      # the step's output, written by the last segment

    @property
    def n_segments(self) -> int:
        return sum(1 for p in self.pieces if not isinstance(p, (HostJob, Wait)))
