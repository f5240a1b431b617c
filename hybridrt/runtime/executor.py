"""The executor: owns a loaded model's step (`forward`: prefill chunk, decode step or verify batch),
and what backends crossing between the device and the CPU share (hybridrt/backends/crossing.py):
one CPU worker thread for the Numba kernels, the pinned host buffers activations cross in,
stream-ordered copies with events instead of device-wide synchronizes, the op-offload staging
buffer, and the trace. On a plain CPU trunk without -t it also adapts the thread count
(thread_governor.py) between decode steps. With `graphs` set, a placed step of up to
GRAPH_MAX_TOKENS tokens runs as captured device segments between its CPU pieces
(runtime/step_graphs.py): the first step of each size eagerly from the static buffers, the second
captured, every later one replayed.
"""
from __future__ import annotations

import sys
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .step_graphs import (GRAPH_MAX_TOKENS, CaptureError, CudaSegment, HostJob, RecordedSegment, StepGraph,
                          Wait)
from .thread_governor import GOVERNED_MAX_TOKENS, ThreadGovernor
from .trace import Tracer, maybe_span

# CUDA graphs; the CPU standing in for them (tests); every step eagerly from the static buffers, none
# captured (what replays must equal bit for bit)
GRAPH_KINDS = ("cuda", "record", "buffers")


class Executor:
    def __init__(self, device: torch.device | str, trace: Tracer | None = None,
                 governor: ThreadGovernor | None = None, graphs: str | None = None):
        if graphs is not None and graphs not in GRAPH_KINDS:
            raise ValueError(f"graphs must be one of {GRAPH_KINDS} or None, got {graphs!r}")
        self.device = torch.device(device)
        self.trace = trace
        self.governor = governor        # a CPU trunk's thread count, when -t did not fix it
        self.cuda = self.device.type == "cuda"
        self.graphs = graphs            # how placed steps are captured (None: every step eager)
        self._step_graphs: dict[int, dict[int, StepGraph]] = {}     # id(state) -> k -> its graph
        self._capture: _Capture | None = None       # the step being captured, while it is
        self._graphs_off: set[int] = set()          # step sizes whose capture failed: eager from then on
        self._worker: ThreadPoolExecutor | None = None
        self._host: dict[str, torch.Tensor] = {}     # one pair per crossing layer: no reuse hazards
        self._staging: torch.Tensor | None = None    # op offload: one CPU layer's weights at a time

    # --- the step --------------------------------------------------------------------------------
    def forward(self, model, state, tokens: torch.Tensor, start_pos: int) -> torch.Tensor:
        """One forward of `tokens` at `start_pos`: prefill chunk, decode step or verify batch."""
        with maybe_span(self.trace, f"forward {tokens.shape[0]} @ {start_pos}", "step"):
            k = tokens.shape[0]
            if self.graphs is not None and k <= GRAPH_MAX_TOKENS and k not in self._graphs_off:
                return self._graph_step(model, state, tokens, start_pos)
            return self._governed(k, lambda: model.forward(state, tokens, start_pos))

    def forward_batch(self, model, batch, tokens: torch.Tensor) -> torch.Tensor:
        """One forward of several sequences' rows (runtime.batch.StepBatch; model.forward_batch):
        decode steps, verify batches and short prompt chunks of different sessions sharing one read
        of the weights. Steps of several sequences run eagerly, never captured: a graph is one
        sequence's step of one size (a replay gives the bits of the eager step)."""
        seqs = ", ".join(f"{s.n} @ {s.start}" for s in batch.seqs)
        with maybe_span(self.trace, f"forward batch [{seqs}]", "step"):
            return self._governed(tokens.shape[0], lambda: model.forward_batch(batch, tokens))

    def _governed(self, k: int, step):
        """step() on the governor's thread count, timed for it (a decode or verify sized step)."""
        if self.governor is None or k > GOVERNED_MAX_TOKENS:
            return step()
        import numba     # the kernels' pool; this thread launches them on a CPU trunk

        n = self.governor.threads()
        if n != numba.get_num_threads():
            numba.set_num_threads(n)
        start = time.perf_counter()
        out = step()
        self.governor.record(k, time.perf_counter() - start)
        return out

    # --- captured steps (runtime/step_graphs.py) ------------------------------------------------------
    def _graph_step(self, model, state, tokens: torch.Tensor, start_pos: int) -> torch.Tensor:
        graphs = self._step_graphs.get(id(state))
        if graphs is None:
            graphs = self._step_graphs[id(state)] = {}
            weakref.finalize(state, self._step_graphs.pop, id(state), None)
        k = tokens.shape[0]
        graph = graphs.get(k)
        if graph is None or self.graphs == "buffers":
            # the first step of this size: eager, from the buffers a capture will read, so that its
            # kernels are compiled and the crossings' host buffers sized before anything is captured
            graph = graph or StepGraph(k, torch.zeros(k, dtype=torch.int64),
                                          torch.zeros(k, dtype=torch.int64, device=self.device))
            graphs[k] = graph
            self._fill(graph, tokens, start_pos)
            return self._forward_at(model, state, graph, start_pos)
        if not graph.pieces:
            return self._capture_step(model, state, graph, tokens, start_pos)
        return self._replay(model, state, graph, tokens, start_pos)

    def _fill(self, graph: StepGraph, tokens: torch.Tensor, start_pos: int) -> None:
        """The step's values into the graph's static buffers."""
        graph.tokens.copy_(tokens)
        graph.positions.copy_(torch.arange(start_pos, start_pos + graph.k, dtype=torch.int64))

    def _forward_at(self, model, state, graph: StepGraph, start_pos: int) -> torch.Tensor:
        state.positions = graph.positions
        try:
            return model.forward(state, graph.tokens, start_pos)
        finally:
            state.positions = None

    def _capture_step(self, model, state, graph: StepGraph, tokens: torch.Tensor, start_pos: int) -> torch.Tensor:
        self._fill(graph, tokens, start_pos)
        if self.graphs == "record":         # the stand-in computes while it records: this step is done
            self._capture = _Capture(graph, RecordedSegment)
            try:
                graph.hidden = self._capture.run(lambda: self._forward_at(model, state, graph, start_pos))
            except BaseException:
                # part of the step ran: nothing to fall back to (the stand-in serves tests)
                self._capture.abandon()
                self._step_graphs[id(state)].pop(graph.k, None)
                raise
            finally:
                self._capture = None
            return graph.hidden.clone()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        self._capture = _Capture(graph, lambda: CudaSegment(pool))
        try:
            with torch.cuda.stream(stream):
                graph.hidden = self._capture.run(lambda: self._forward_at(model, state, graph, start_pos))
        except (CaptureError, RuntimeError) as e:
            # nothing of the step ran (a CUDA capture records, it does not compute): run it eagerly
            self._capture.abandon()
            self._step_graphs[id(state)].pop(graph.k, None)
            self._graphs_off.add(graph.k)
            print(f"warning: CUDA graph capture of a {graph.k}-token step failed ({str(e).splitlines()[0]}); "
                  f"steps of {graph.k} tokens run eagerly", file=sys.stderr)
            return model.forward(state, tokens, start_pos)
        finally:
            self._capture = None
        torch.cuda.current_stream(self.device).wait_stream(stream)
        return self._replay(model, state, graph, tokens, start_pos, filled=True)

    def _replay(self, model, state, graph: StepGraph, tokens: torch.Tensor, start_pos: int,
                filled: bool = False) -> torch.Tensor:
        """The step from its pieces: the host's work is filling the buffers, the model's bookkeeping,
        one replay per segment and the CPU jobs between them."""
        if not filled:
            self._fill(graph, tokens, start_pos)
        model.begin_step(state, start_pos, graph.k)
        pieces, pending = graph.pieces, {}
        for i, piece in enumerate(pieces):
            if isinstance(piece, HostJob):
                ready = self._ready_event()
                if i + 1 < len(pieces) and isinstance(pieces[i + 1], Wait):
                    self._host_job(piece, ready)        # nothing to overlap: run it here
                    pending[id(piece)] = None
                else:
                    pending[id(piece)] = self.submit(self._host_job, piece, ready)
            elif isinstance(piece, Wait):
                job = pending.pop(id(piece.job))
                if job is not None:
                    job.result()
            else:
                piece.replay()
        return graph.hidden.clone()

    def _ready_event(self):
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    @staticmethod
    def _host_job(job: HostJob, ready) -> None:
        if ready is not None:
            ready.synchronize()         # the segment's copies to the host, not later device work
        job.fn(*job.args)

    @property
    def capturing(self) -> bool:
        """Whether a step is being captured now (its host work must become host jobs)."""
        return self._capture is not None

    def graph_counts(self, state) -> dict[int, int]:
        """k -> segments captured for that step size of this state (0: not captured yet)."""
        return {k: g.n_segments for k, g in self._step_graphs.get(id(state), {}).items()}

    # --- the CPU side --------------------------------------------------------------------------------
    def submit(self, fn, *args, out: torch.Tensor | None = None):
        """Run fn on the CPU worker thread (Numba kernels release the GIL, so the main thread keeps
        launching device work meanwhile); `.result()` of what it returns waits. Inside a captured
        step fn must fill `out`, which the result is: the job runs between the segments at every
        replay."""
        if self._capture is not None:
            return self._capture.host_job(fn, args, out)
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="hybridrt-cpu")
        return self._worker.submit(fn, *args)

    def on_host(self, fn, *args, out: torch.Tensor) -> torch.Tensor:
        """fn(*args) filling the host buffer `out`, on this thread; returns out (inside a captured
        step: a job that runs there at every replay)."""
        if self._capture is not None:
            return self._capture.host_job(fn, args, out).result()
        fn(*args)
        return out

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
        if self._capture is not None and self.cuda:
            host.copy_(x, non_blocking=True)        # a node of the segment; the replay's event follows it
            return host, None
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


class _Capture:
    """A step being captured: the current segment, cut at every host piece."""

    def __init__(self, graph: StepGraph, new_segment):
        self.graph, self.new_segment = graph, new_segment
        self.segment = None
        self.computes = False       # whether capturing computes too (the segments' runs_on_capture)

    def run(self, forward) -> torch.Tensor:
        self._begin()
        self.computes = self.segment.runs_on_capture
        out = forward()
        self._end()
        return out

    def _begin(self) -> None:
        self.segment = self.new_segment()
        self.segment.begin()

    def _end(self) -> None:
        segment, self.segment = self.segment, None
        segment.end()
        self.graph.pieces.append(segment)

    def abandon(self) -> None:
        if self.segment is not None:
            try:
                self.segment.end()
            except Exception:       # noqa: BLE001 -- the capture failed already; its end may fail too
                pass
            self.segment = None
        self.graph.pieces.clear()

    def host_job(self, fn, args: tuple, out: torch.Tensor | None) -> "_CapturedJob":
        if out is None:
            raise CaptureError(f"{getattr(fn, '__qualname__', fn)}: a host job inside a captured step must name "
                               f"the buffer it fills")
        self._end()
        job = HostJob(fn, args, out)
        self.graph.pieces.append(job)
        if self.computes:
            fn(*args)       # the stand-in computes the step as it captures it
        self._begin()
        return _CapturedJob(self, job)

    def wait(self, job: HostJob) -> torch.Tensor:
        self._end()
        self.graph.pieces.append(Wait(job))
        self._begin()
        return job.out


class _CapturedJob:
    def __init__(self, capture: _Capture, job: HostJob):
        self.capture, self.job = capture, job

    def result(self) -> torch.Tensor:
        return self.capture.wait(self.job)
