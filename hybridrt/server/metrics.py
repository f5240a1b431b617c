"""Server counters and their Prometheus text exposition (GET /metrics).

Written by the worker threads and the event loop, read by /metrics: one lock around plain
numbers. Rates are totals over totals (tokens / seconds since start), which stay meaningful when
scraped at any interval; llama-server's names are kept where one exists.
"""
from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field

from ..decoding.generate import GenerationStats


@dataclass
class Metrics:
    n_sessions: int
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    requests: Counter = field(default_factory=Counter)        # (endpoint, status) -> count
    prompt_tokens: int = 0
    prompt_s: float = 0.0
    completion_tokens: int = 0
    decode_tokens: int = 0       # tokens after the first of each request (what decode t/s counts)
    decode_s: float = 0.0
    spec_steps: int = 0
    spec_drafted: int = 0
    spec_accepted: int = 0
    cancelled: int = 0

    def request(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.requests[(endpoint, status)] += 1

    def generation(self, stats: GenerationStats, n_completion: int, cancelled: bool) -> None:
        with self._lock:
            self.prompt_tokens += stats.n_prompt
            self.prompt_s += stats.prompt_s
            self.completion_tokens += n_completion
            self.decode_tokens += stats.n_decode
            self.decode_s += stats.decode_s
            self.cancelled += cancelled
            if stats.spec is not None and stats.spec.source != "none":
                self.spec_steps += stats.spec.steps
                self.spec_drafted += sum(stats.spec.drafted)
                self.spec_accepted += sum(stats.spec.accepted)

    def render(self, in_use: int, waiting: int, batch: tuple[int, int, int] | None = None) -> str:
        """batch: the step batcher's (evals, steps, rows) with continuous batching, else None."""
        with self._lock:
            rows = [
                ("hybridrt_sessions", "gauge", "decoding sessions (--parallel)", self.n_sessions),
                ("hybridrt_sessions_in_use", "gauge", "sessions decoding a request now", in_use),
                ("hybridrt_requests_waiting", "gauge", "requests queued for a free session", waiting),
                ("hybridrt_prompt_tokens_total", "counter", "prompt tokens evaluated", self.prompt_tokens),
                ("hybridrt_prompt_seconds_total", "counter", "time spent evaluating prompts", self.prompt_s),
                ("hybridrt_tokens_predicted_total", "counter", "completion tokens generated", self.completion_tokens),
                ("hybridrt_decode_seconds_total", "counter", "time spent decoding after the first token",
                 self.decode_s),
                ("hybridrt_prompt_tokens_per_second", "gauge", "prompt tokens / prompt seconds since start",
                 self.prompt_tokens / self.prompt_s if self.prompt_s else 0.0),
                ("hybridrt_decode_tokens_per_second", "gauge", "decode tokens / decode seconds since start",
                 self.decode_tokens / self.decode_s if self.decode_s else 0.0),
                ("hybridrt_requests_cancelled_total", "counter", "generations stopped because the client left",
                 self.cancelled),
                ("hybridrt_spec_steps_total", "counter", "speculative verify steps", self.spec_steps),
                ("hybridrt_spec_draft_tokens_total", "counter", "draft tokens proposed", self.spec_drafted),
                ("hybridrt_spec_draft_tokens_accepted_total", "counter", "draft tokens accepted", self.spec_accepted),
                ("hybridrt_spec_acceptance_rate", "gauge", "accepted / proposed draft tokens since start",
                 self.spec_accepted / self.spec_drafted if self.spec_drafted else 0.0),
                ("hybridrt_spec_tokens_per_step", "gauge", "tokens produced per verify step since start",
                 (self.spec_accepted + self.spec_steps) / self.spec_steps if self.spec_steps else 0.0),
            ]
            if batch is not None:
                evals, steps, n_rows = batch
                rows += [("hybridrt_batch_evals_total", "counter", "sessions' forward calls handed to shared steps", evals),
                         ("hybridrt_batch_steps_total", "counter", "shared steps run", steps),
                         ("hybridrt_batch_rows_total", "counter", "token rows the shared steps ran", n_rows)]
            requests = sorted(self.requests.items())
        lines = ["# HELP hybridrt_requests_total HTTP requests by endpoint and status",
                 "# TYPE hybridrt_requests_total counter"]
        lines += [f'hybridrt_requests_total{{endpoint="{ep}",status="{st}"}} {n}' for (ep, st), n in requests]
        for name, kind, text, value in rows:
            lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}", f"{name} {value:g}" if isinstance(value, float)
                      else f"{name} {value}"]
        return "\n".join(lines) + "\n"
