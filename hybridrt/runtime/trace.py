"""A Chrome / Perfetto trace of where a step's time goes: device work, CPU FFN layers, transfers,
drafts and verifies, each a complete ("X") event on its own track.

Host work is timed with perf_counter. Device work on a GPU runs asynchronously to the host that
launched it, so its spans are CUDA event pairs, turned into times only when the trace is written
(one synchronize then, never during decoding), against a reference event recorded at start.
The file opens in ui.perfetto.dev or chrome://tracing.
"""
from __future__ import annotations

import json
import os
import threading
import time
from contextlib import contextmanager

# one track per kind of work, in the order Perfetto shows them
TRACKS = {"step": 1, "device": 2, "cpu_ffn": 3, "transfer": 4, "spec": 5}
TRACK_NAMES = {1: "steps (host)", 2: "device work", 3: "CPU FFN (worker thread)", 4: "transfers",
               5: "speculation: draft / verify"}


class Tracer:
    def __init__(self, device=None):
        import torch

        self._t0 = time.perf_counter()
        self._events: list[dict] = []
        self._pending: list[tuple[str, str, object, object]] = []     # CUDA event pairs
        self._lock = threading.Lock()           # the CPU worker thread records spans too
        self._cuda = device is not None and torch.device(device).type == "cuda"
        if self._cuda:
            self._ref = torch.cuda.Event(enable_timing=True)
            self._ref.record()
            torch.cuda.synchronize()
            self._ref_us = self._now_us()

    def clear(self) -> None:
        """Drop what was recorded so far (a warm-up's steps)."""
        with self._lock:
            self._events.clear()
            self._pending.clear()

    def _now_us(self) -> float:
        return (time.perf_counter() - self._t0) * 1e6

    def add(self, name: str, cat: str, start_us: float, end_us: float, **args) -> None:
        event = {"name": name, "cat": cat, "ph": "X", "ts": start_us, "dur": max(end_us - start_us, 0.0),
                 "pid": 1, "tid": TRACKS[cat]}
        if args:
            event["args"] = args
        with self._lock:
            self._events.append(event)

    @contextmanager
    def span(self, name: str, cat: str, **args):
        """Host-timed work (CPU FFN in the worker, a draft or verify step, anything on a CPU device)."""
        start = self._now_us()
        try:
            yield
        finally:
            self.add(name, cat, start, self._now_us(), **args)

    @contextmanager
    def device_span(self, name: str, cat: str = "device"):
        """Work queued on the device: CUDA event pairs on a GPU, host time on a CPU device."""
        if not self._cuda:
            with self.span(name, cat):
                yield
            return
        import torch

        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        try:
            yield
        finally:
            end.record()
            with self._lock:
                self._pending.append((name, cat, start, end))

    def events(self) -> list[dict]:
        """Every span so far, device spans resolved (synchronizes a GPU once)."""
        if self._pending:
            import torch

            torch.cuda.synchronize()
            with self._lock:
                pending, self._pending = self._pending, []
            for name, cat, start, end in pending:
                ts = self._ref_us + self._ref.elapsed_time(start) * 1e3
                self.add(name, cat, ts, ts + start.elapsed_time(end) * 1e3)
        with self._lock:
            return sorted(self._events, key=lambda e: e["ts"])

    def write(self, path: str | os.PathLike) -> None:
        meta = [{"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "hybridrt"}}]
        meta += [{"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": label}}
                 for tid, label in TRACK_NAMES.items()]
        meta += [{"name": "thread_sort_index", "ph": "M", "pid": 1, "tid": tid, "args": {"sort_index": tid}}
                 for tid in TRACK_NAMES]
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"traceEvents": meta + self.events(), "displayTimeUnit": "ms"}, f)


@contextmanager
def maybe_span(tracer: Tracer | None, name: str, cat: str, **args):
    """A host span when tracing, nothing otherwise (decoding loops call this unconditionally)."""
    if tracer is None:
        yield
    else:
        with tracer.span(name, cat, **args):
            yield
