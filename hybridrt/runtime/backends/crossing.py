"""Backends that cross between the trunk device and the CPU while a plan executes, through the
executor (hybridrt/executor.py: its worker thread, pinned host buffers, stream-ordered copies).

A plan puts the trunk (attention / GDN, norms, output head, KV) and some FFN layers on the device
and leaves the other FFN layers quantized in the mmap. The model files do not know that: each layer
calls the FFN backend it was bound to. Those that cross to the CPU are `HostFFN` (a whole layer in
the mmap), `SplitFFN` (the boundary layer, part on each side) and `HostExperts` (a MoE layer's
routed experts in the mmap, its router and shared expert on the device). `TracedBackend` records a
device call in the trace.

What overlaps (see docs/placement.md, "What runs at the same time, and what bounds it"):
  1. the split layer: its device half is queued while the worker computes its CPU half; the layer
     costs max(device half, CPU half) + one round trip of k x n_embd floats;
  2. transfers are queued on the device stream behind the work that produces their input; the host
     waits on that copy's event only (earlier device work keeps running), and the copy back is queued
     ahead of the next layer's kernels without waiting for it: the host launches layer i + 1 while the
     device is still copying layer i's FFN output in.
Everything else is a chain (layer i + 1 needs layer i's output), so it does not overlap.

Prompt batches (op offload, llama.cpp's name): a batch of OP_OFFLOAD_MIN_BATCH or more tokens
copies each CPU FFN layer's weights into one device staging buffer (the plan reserves the largest
layer) and runs the layer there (`StreamedFFN`): a layer's bytes over PCIe cost less than the CPU's
matmuls of a whole prompt batch. The copies are stream-ordered, so a layer's copy waits for the
previous layer's kernels to finish reading the buffer. Decode and verify steps keep the CPU path.
"""
from __future__ import annotations

from concurrent.futures import Future

import torch

from gpu_kernels.qlinear import QuantLinear, TileScratch, tile_rows_of
from placement.constants import OP_OFFLOAD_MIN_BATCH

from ..executor import Executor
from ..trace import Tracer, maybe_span
from .cpu import CpuGluFFN, RoutedExperts
from .device import GluFFN, mmap_tensor
from .protocols import Placement

STAGING_ALIGN = 256     # byte alignment of each matrix in the op-offload staging buffer


def _staged(nbytes: int) -> int:
    """A matrix's room in the staging buffer: its bytes rounded up to STAGING_ALIGN."""
    return -(-nbytes // STAGING_ALIGN) * STAGING_ALIGN


def staged_bytes(ffn: CpuGluFFN) -> int:
    """The staging buffer a CPU FFN layer's three matrices take, each aligned."""
    return sum(_staged(m.raw.nbytes) for m in (ffn.gate, ffn.up, ffn.down))


class StreamedFFN:
    """A CPU FFN layer run on the device for one prompt batch (llama.cpp's op offload): its GGUF
    bytes copied from the mmap into the executor's staging buffer, then the device's quantized
    matmuls over them (QuantLinear's tile path: dequantize a tile, one GEMM). The copy is queued on
    the device stream like the kernels, so it waits for the previous layer's reads of the buffer."""
    placement = Placement.MMAP      # the weights' home; each prompt batch copies them up

    def __init__(self, host: CpuGluFFN, executor: Executor, scratch: TileScratch, int8_activations: bool):
        self.host, self.executor, self.scratch, self.int8 = host, executor, scratch, int8_activations
        self.nbytes = staged_bytes(host)
        for m in (host.gate, host.up, host.down):      # the tile each takes, reserved while binding
            scratch.reserve(tile_rows_of(m.n_in, m.n_out) * m.n_in)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        buf = self.executor.staging(self.nbytes)
        linears, off = [], 0
        for m in (self.host.gate, self.host.up, self.host.down):
            view = buf[off:off + m.raw.nbytes].view(m.raw.shape)
            view.copy_(mmap_tensor(m.raw), non_blocking=True)
            linears.append(QuantLinear(view, m.qtype, m.n_in, m.n_out, self.scratch.dtype, m.name, self.scratch,
                                       int8_activations=self.int8, residual=m.residual))
            off += _staged(m.raw.nbytes)
        return GluFFN(*linears, self.host.act)(x)



class HostFFN:
    """A whole FFN layer left in the mmap, called from a trunk on the device: the k x n_embd rows
    go to a pinned host buffer, the fused k-input Numba FFN runs on the worker thread (each weight
    block read once for all k rows), and the result is queued back to the device. With `streamed`
    (op offload), batches of OP_OFFLOAD_MIN_BATCH+ rows run on the device instead, the layer's
    weights copied up for the call."""
    placement = Placement.MMAP

    def __init__(self, ffn: CpuGluFFN, executor: Executor, name: str, streamed: StreamedFFN | None = None):
        self.ffn, self.executor, self.name, self.streamed = ffn, executor, name, streamed
        self.nbytes = ffn.nbytes
        self.n_embd = ffn.down.n_out

    def on_device(self, x: torch.Tensor) -> bool:
        """Whether this batch takes the op-offload path."""
        return self.streamed is not None and x.shape[0] >= OP_OFFLOAD_MIN_BATCH

    def start(self, x: torch.Tensor) -> Future:
        host_in, ready = self.executor.to_host(x, f"{self.name} in")
        host_out = self.executor.host_buffer(f"{self.name} out", host_in.shape[0], self.n_embd)
        return self.executor.submit(self._run, host_in, host_out, ready, out=host_out)

    def _run(self, host_in: torch.Tensor, host_out: torch.Tensor, ready) -> torch.Tensor:
        if ready is not None:
            ready.synchronize()     # this copy only: the device keeps working on what follows it
        with maybe_span(self.executor.trace, f"cpu ffn {self.name}", "cpu_ffn", rows=host_in.shape[0]):
            host_out.copy_(self.ffn(host_in))
        return host_out

    def finish(self, pending: Future) -> torch.Tensor:
        return self.executor.to_device(pending.result(), f"{self.name} out")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.on_device(x):
            trace = self.executor.trace
            if trace is None:
                return self.streamed(x)
            with trace.device_span(f"op offload {self.name}", "transfer"):    # the copy, then the layer
                return self.streamed(x)
        return self.finish(self.start(x))


class HostExperts:
    """A MoE layer's routed experts left in the mmap, called from a trunk on the device (the router
    and the shared expert stay there). The k x n_embd rows, each token's expert weights and its
    expert ids cross in ONE copy to a host buffer ([x | weights | ids] as float32; ids < 2^24 are
    exact); on the worker each touched expert's k-input FFN runs once over the tokens routed to it
    (`RoutedExperts`), and the weighted sum is queued back. Nothing overlaps it: the shared expert
    it could run beside is microseconds on the device."""
    placement = Placement.MMAP

    def __init__(self, experts: RoutedExperts, executor: Executor, name: str):
        self.experts, self.executor, self.name = experts, executor, name
        self.nbytes = experts.nbytes

    def __call__(self, x: torch.Tensor, top_e: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        packed = torch.cat((x.float(), weights.float(), top_e.float()), dim=1)
        host_in, ready = self.executor.to_host(packed, f"{self.name} in")
        host_out = self.executor.host_buffer(f"{self.name} out", host_in.shape[0], self.experts.n_embd)
        pending = self.executor.submit(self._run, host_in, host_out, ready, x.shape[1], out=host_out)
        return self.executor.to_device(pending.result(), f"{self.name} out")

    def _run(self, host_in: torch.Tensor, host_out: torch.Tensor, ready, n_embd: int) -> torch.Tensor:
        if ready is not None:
            ready.synchronize()     # this copy only
        n_used = (host_in.shape[1] - n_embd) // 2
        x, weights = host_in[:, :n_embd], host_in[:, n_embd:n_embd + n_used]
        top_e = host_in[:, n_embd + n_used:].long()
        with maybe_span(self.executor.trace, f"cpu experts {self.name}", "cpu_ffn", rows=host_in.shape[0]):
            host_out.copy_(self.experts(x, top_e, weights))
        return host_out


class SplitFFN:
    """The boundary FFN layer: units [0, u) on the device, [u, n_ff) in the mmap. Each half is a
    complete gated FFN over its own units, so the layer is their sum. The CPU half starts first;
    the device half is queued while it runs; y = device half + CPU half, in that order for every
    batch, so a token's result does not depend on the batch size."""
    placement = Placement.SPLIT

    def __init__(self, device_half: GluFFN, host_half: HostFFN, executor: Executor, name: str):
        self.device_half, self.host_half, self.executor, self.name = device_half, host_half, executor, name
        self.nbytes = device_half.nbytes + host_half.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.host_half.on_device(x):         # a prompt batch: both halves on the device, in order
            return self.device_half(x) + self.host_half(x)
        pending = self.host_half.start(x)
        trace = self.executor.trace
        if trace is None:
            y = self.device_half(x)
        else:
            with trace.device_span(f"device ffn {self.name} (split half)"):
                y = self.device_half(x)
        return y + self.host_half.finish(pending)


class TracedBackend:
    """A device backend whose calls appear in the trace (bound only when tracing)."""

    def __init__(self, inner, trace: Tracer, name: str):
        self.inner, self.trace, self.name = inner, trace, name
        self.nbytes = inner.nbytes
        self.n_out = getattr(inner, "n_out", None)
        self.n_in = getattr(inner, "n_in", None)

    def __call__(self, *args, **kwargs):
        with self.trace.device_span(self.name):
            return self.inner(*args, **kwargs)
