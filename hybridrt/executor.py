"""The executor: runs a placed model step by step, and coordinates the device with the CPU.

A plan puts the trunk (attention / GDN, norms, output head, KV) and some FFN layers on the device
and leaves the other FFN layers quantized in the mmap. The model files do not know that: each layer
calls the FFN backend it was bound to. Those that cross to the CPU are `HostFFN` (a whole layer in
the mmap), `SplitFFN` (the boundary layer, part on each side) and `HostExperts` (a MoE layer's
routed experts in the mmap, its router and shared expert on the device). This module owns what crossing
needs: one CPU worker thread for the Numba kernels, the pinned host buffers activations cross in,
stream-ordered copies with events instead of device-wide synchronizes, and the trace.

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
layer) and runs the layer there: a layer's bytes over PCIe cost less than the CPU's matmuls of a
whole prompt batch. The copies are stream-ordered, so a layer's copy waits for the previous layer's
kernels to finish reading the buffer. Decode and verify steps keep the CPU path.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from placement.constants import OP_OFFLOAD_MIN_BATCH

from .thread_governor import GOVERNED_MAX_TOKENS, ThreadGovernor
from .trace import Tracer, maybe_span



class Executor:
    def __init__(self, device: torch.device | str, trace: Tracer | None = None,
                 governor: ThreadGovernor | None = None):
        self.device = torch.device(device)
        self.trace = trace
        self.governor = governor        # a CPU trunk's thread count, when -t did not fix it
        self.cuda = self.device.type == "cuda"
        self._worker: ThreadPoolExecutor | None = None
        self._host: dict[str, torch.Tensor] = {}     # one pair per crossing layer: no reuse hazards
        self._staging: torch.Tensor | None = None    # op offload: one CPU layer's weights at a time

    # --- the step --------------------------------------------------------------------------------
    def forward(self, model, state, tokens: torch.Tensor, start_pos: int) -> torch.Tensor:
        """One forward of `tokens` at `start_pos`: prefill chunk, decode step or verify batch."""
        with maybe_span(self.trace, f"forward {tokens.shape[0]} @ {start_pos}", "step"):
            if self.governor is None or tokens.shape[0] > GOVERNED_MAX_TOKENS:
                return model.forward(state, tokens, start_pos)
            import numba     # the kernels' pool; this thread launches them on a CPU trunk

            n = self.governor.threads()
            if n != numba.get_num_threads():
                numba.set_num_threads(n)
            start = time.perf_counter()
            out = model.forward(state, tokens, start_pos)
            self.governor.record(tokens.shape[0], time.perf_counter() - start)
            return out

    # --- the CPU side --------------------------------------------------------------------------------
    def submit(self, fn, *args) -> Future:
        """Run fn on the CPU worker thread (Numba kernels release the GIL, so the main thread keeps
        launching device work meanwhile)."""
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="hybridrt-cpu")
        return self._worker.submit(fn, *args)

    def host_buffer(self, key: str, rows: int, cols: int) -> torch.Tensor:
        """A [rows, cols] float32 host buffer (pinned when the device is a GPU, so copies are DMA and
        asynchronous), kept per key and grown on demand: decode and verify reuse the same memory."""
        buf = self._host.get(key)
        if buf is None or buf.shape[0] < rows or buf.shape[1] != cols:
            buf = torch.empty(max(rows, 16), cols, dtype=torch.float32, pin_memory=self.cuda)
            self._host[key] = buf
        return buf[:rows]

    def to_host(self, x: torch.Tensor, key: str):
        """Queue the copy of device rows x into a host buffer; returns (buffer, event to wait on)."""
        host = self.host_buffer(key, x.shape[0], x.shape[1])
        if not self.cuda:
            with maybe_span(self.trace, f"to host {key}", "transfer"):
                host.copy_(x)
            return host, None
        event = torch.cuda.Event()
        if self.trace is None:
            host.copy_(x, non_blocking=True)
        else:
            with self.trace.device_span(f"to host {key}", "transfer"):
                host.copy_(x, non_blocking=True)
        # on the stream the copy went to (x's device's), not whichever device is current
        event.record(torch.cuda.current_stream(x.device))
        return host, event

    def to_device(self, host: torch.Tensor, key: str) -> torch.Tensor:
        """Queue the copy of host rows to the device (stream-ordered before the next kernels)."""
        if not self.cuda:
            with maybe_span(self.trace, f"to device {key}", "transfer"):
                return host.clone()
        if self.trace is None:
            return host.to(self.device, non_blocking=True)
        with self.trace.device_span(f"to device {key}", "transfer"):
            return host.to(self.device, non_blocking=True)

    def staging(self, nbytes: int) -> torch.Tensor:
        """The device buffer prompt batches copy a CPU FFN layer's weights into (uint8, at least
        nbytes), shared by every layer: the plan reserved the largest layer's bytes."""
        if self._staging is None or self._staging.numel() < nbytes:
            self._staging = None        # the old buffer goes before the larger one is taken
            self._staging = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self._staging

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None


class HostFFN:
    """A whole FFN layer left in the mmap, called from a trunk on the device: the k x n_embd rows
    go to a pinned host buffer, the fused k-input Numba FFN runs on the worker thread (each weight
    block read once for all k rows), and the result is queued back to the device. With `streamed`
    (op offload), batches of OP_OFFLOAD_MIN_BATCH+ rows run on the device instead, the layer's
    weights copied up for the call."""

    def __init__(self, ffn, executor: Executor, name: str, streamed=None):
        self.ffn, self.executor, self.name, self.streamed = ffn, executor, name, streamed
        self.nbytes = ffn.nbytes
        self.n_embd = ffn.down.n_out

    def on_device(self, x: torch.Tensor) -> bool:
        """Whether this batch takes the op-offload path."""
        return self.streamed is not None and x.shape[0] >= OP_OFFLOAD_MIN_BATCH

    def start(self, x: torch.Tensor) -> Future:
        host_in, ready = self.executor.to_host(x, f"{self.name} in")
        return self.executor.submit(self._run, host_in, ready)

    def _run(self, host_in: torch.Tensor, ready) -> torch.Tensor:
        if ready is not None:
            ready.synchronize()     # this copy only: the device keeps working on what follows it
        host_out = self.executor.host_buffer(f"{self.name} out", host_in.shape[0], self.n_embd)
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

    def __init__(self, experts, executor: Executor, name: str):
        self.experts, self.executor, self.name = experts, executor, name
        self.nbytes = experts.nbytes

    def __call__(self, x: torch.Tensor, top_e: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        packed = torch.cat((x.float(), weights.float(), top_e.float()), dim=1)
        host_in, ready = self.executor.to_host(packed, f"{self.name} in")
        pending = self.executor.submit(self._run, host_in, ready, x.shape[1])
        return self.executor.to_device(pending.result(), f"{self.name} out")

    def _run(self, host_in: torch.Tensor, ready, n_embd: int) -> torch.Tensor:
        if ready is not None:
            ready.synchronize()     # this copy only
        n_used = (host_in.shape[1] - n_embd) // 2
        x, weights = host_in[:, :n_embd], host_in[:, n_embd:n_embd + n_used]
        top_e = host_in[:, n_embd + n_used:].long()
        host_out = self.executor.host_buffer(f"{self.name} out", host_in.shape[0], self.experts.n_embd)
        with maybe_span(self.executor.trace, f"cpu experts {self.name}", "cpu_ffn", rows=host_in.shape[0]):
            host_out.copy_(self.experts(x, top_e, weights))
        return host_out


class SplitFFN:
    """The boundary FFN layer: units [0, u) on the device, [u, n_ff) in the mmap. Each half is a
    complete gated FFN over its own units, so the layer is their sum. The CPU half starts first;
    the device half is queued while it runs; y = device half + CPU half, in that order for every
    batch, so a token's result does not depend on the batch size."""

    def __init__(self, device_half, host_half: HostFFN, executor: Executor, name: str):
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
