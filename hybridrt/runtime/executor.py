"""The executor: owns a loaded model's step (`forward`: prefill chunk, decode step or verify batch),
and what backends crossing between the device and the CPU share (hybridrt/backends/crossing.py):
one CPU worker thread for the Numba kernels, the pinned host buffers activations cross in,
stream-ordered copies with events instead of device-wide synchronizes, the op-offload staging
buffer, and the trace. On a plain CPU trunk without -t it also adapts the thread count
(thread_governor.py) between decode steps.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

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
