"""Shared steps for sessions decoding on their own threads (issue 57): each session's `eval` is
handed to one batcher thread, which runs the evals that are waiting together (`eval_batch`: every
weight read once for all of them) and hands each session its logits back.

Why threads that wait rather than a scheduler that owns every generation: a generation is a loop
with its own state (the sampler, the draft source and its adaptive length, the grammar, the stop
strings, the rollback after a verify), and `generate` already is that loop. Each session keeps
running it on its worker thread; only the forward is shared. A step starts when every session
inside a generation has an eval waiting, or when the first one has waited half a decode step's time
(`GATHER_FRACTION` of the last one, at least `GATHER_S`): a session busy sampling, drafting or
streaming its token does not hold the others up for long, and one that comes back late still joins
the step rather than running a step of its own after it, which would delay everyone's next one by
more than the wait. In `serve` with 8 SmolLM2 streams on 2 cores the workers' own work between steps
often took over 2 ms: a fixed 2 ms window ran ~45 % more steps than tokens asked for and decoded
~220 t/s, half a step's window ~3 % more steps and ~260-280 t/s (BENCHMARKS.md, "Serving:
concurrent streams").

Exactness: `eval_batch` gives each session the bits its own `eval` would (runtime/batch.py), and
evals reach it at the same sizes `eval` would run them: a prompt in the PROMPT_CHUNK chunks
`Session.eval` cuts it into. A prompt chunk runs alone (more than ROWWISE_MAX rows take the prompt
path), at most one per step, so a long prompt delays the others' decoding by one chunk at a time.

A model with device work (a plan, or a trunk off the CPU) keeps buffers once per model, not per
session: the executor's host buffers that a CPU FFN layer's activations cross in, the op-offload
staging, and the one dequantization tile every quantized device matrix writes before its matmul,
the output head's and an MTP head's included. A session's own work between its evals (its drafts,
an MTP head's catch-up) uses them too, so there the members and the steps take the device in turn
(`_Membership`): a member holds it except while its eval waits, and a step takes it. On a CPU
trunk the kernels keep nothing between calls and everything runs at once.
"""
from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import Literal

import torch

from gpu_kernels.attention import ROWWISE_MAX
from placement.constants import PROMPT_CHUNK

from .session import Session, eval_batch

GATHER_S = 0.002        # the shortest wait of the first waiting eval for the other sessions' evals
GATHER_FRACTION = 0.5   # ... and the usual one: this share of the last decode / verify step's time


@dataclass
class _Eval:
    """One session's eval waiting for a step: the tokens still to run, and what comes back."""
    session: Session
    tokens: torch.Tensor
    logits: Literal["all", "last", "none"]
    since: float
    done: threading.Event = field(default_factory=threading.Event)
    rows: list[torch.Tensor] = field(default_factory=list)       # logits of the chunks run so far
    error: BaseException | None = None

    def next_chunk(self) -> torch.Tensor:
        return self.tokens[:PROMPT_CHUNK]

    @property
    def prompt(self) -> bool:
        """Whether its next chunk takes the prompt path (more than ROWWISE_MAX rows: a forward of its own)."""
        return self.tokens.shape[0] > ROWWISE_MAX


class StepBatcher:
    """Runs the evals of several sessions of one model in shared steps, on its own thread.

    A session takes part while inside `member(session)`; its `Session.eval` calls come here
    (`Session.stepper`). `evals`, `steps` and `rows` count what came and what ran (metrics, tests):
    evals over steps is how many sessions a step served on average."""

    def __init__(self, model, threads: int | None = None, max_tokens: int = 0):
        """threads: the Numba threads the shared forwards run on (None: Numba's default). max_tokens:
        the token rows a step may run (serve's --batch-tokens; 0: every decode and verify eval
        waiting and one prompt chunk); the eval waiting longest always runs, whatever its size."""
        if max_tokens < 0:
            raise ValueError(f"max_tokens {max_tokens} < 0")
        self.model, self.threads, self.max_tokens = model, threads, max_tokens
        # the device, taken in turn by the steps and the members' own work (module docstring)
        self.device_turn = threading.Lock() if keeps_step_buffers(model) else None
        self._cond = threading.Condition()
        self._members: set[int] = set()                 # id(session) of sessions inside a generation
        self._waiting: dict[int, _Eval] = {}
        self._stopped = False
        self._step_s = 0.0                              # the last step's time without a prompt chunk
        self.evals = 0
        self.steps = 0
        self.rows = 0
        self._thread = threading.Thread(target=self._run, name="hybridrt-step-batcher", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ sessions' side
    def member(self, session: Session):
        return _Membership(self, session)

    def eval(self, session: Session, tok: torch.Tensor, logits: Literal["all", "last", "none"],
             out: torch.Tensor | None) -> torch.Tensor | None:
        """Session.eval's second half (the session already rewound: `tok` runs after its n_past),
        the forward shared with the other members' evals."""
        job = _Eval(session, tok, logits, time.perf_counter())
        with self._cond:
            if self._stopped:
                raise RuntimeError("the step batcher has stopped")
            self._waiting[id(session)] = job
            self.evals += 1
            self._cond.notify_all()
        if self.device_turn is not None:
            self.device_turn.release()      # the step, and the other members' own work, may run now
        job.done.wait()
        if self.device_turn is not None:
            self.device_turn.acquire()
        if job.error is not None:
            raise job.error
        if logits == "none":
            return None
        rows = torch.cat(job.rows) if len(job.rows) > 1 else job.rows[0]
        if logits == "last":
            rows = rows[-1:]
        return rows if out is None else out[:rows.shape[0]].copy_(rows)

    def others(self) -> int:
        """Members besides one: the sequences a member's steps are shared with (its verify length
        slows theirs: adaptive.DraftLengthPolicy.others)."""
        return max(0, len(self._members) - 1)

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._thread.join(5.0)

    # ------------------------------------------------------------------ the batcher's thread
    def _ready(self) -> bool:
        if not self._waiting:
            return False
        if len(self._waiting) >= len(self._members):
            return True
        oldest = min(j.since for j in self._waiting.values())
        return time.perf_counter() - oldest >= max(GATHER_S, GATHER_FRACTION * self._step_s)

    def _run(self) -> None:
        if self.threads:
            import numba

            numba.set_num_threads(self.threads)     # per launching thread: this one runs every forward
        while True:
            with self._cond:
                while not self._stopped and not self._ready():
                    self._cond.wait(GATHER_S / 2 if self._waiting else None)
                started = time.perf_counter()
                if self._stopped:
                    for job in self._waiting.values():
                        job.error = RuntimeError("the step batcher has stopped")
                        job.done.set()
                    return
                jobs = self._take()
            decode = not any(j.prompt for j in jobs)
            self._step(jobs)
            if decode:
                self._step_s = time.perf_counter() - started

    def _take(self) -> list[_Eval]:
        """The evals of this step, longest waiting first: decode and verify evals and at most one
        prompt chunk, while their rows fit in max_tokens (the first one always: a step makes
        progress). An eval that does not fit waits for the next step, where it is older."""
        taken, rows, chunk = [], 0, False
        for job in sorted(self._waiting.values(), key=lambda j: j.since):
            n = job.next_chunk().shape[0]
            if (job.prompt and chunk) or (taken and self.max_tokens and rows + n > self.max_tokens):
                continue
            taken.append(job)
            rows += n
            chunk |= job.prompt
        return taken

    @staticmethod
    def _mode(job: _Eval, chunk: torch.Tensor) -> str:
        """The logits this chunk's rows need: all of them for "all"; for "last", none before the last
        chunk, and of the last chunk all rows when it is a small one (it shares the verify steps'
        forward; its last row is taken), else the last."""
        if job.logits == "all":
            return "all"
        if job.logits == "none" or chunk.shape[0] < job.tokens.shape[0]:
            return "none"
        return "all" if chunk.shape[0] <= ROWWISE_MAX else "last"

    def _step(self, jobs: list[_Eval]) -> None:
        chunks = [j.next_chunk() for j in jobs]
        # one eval_batch per kind of logits asked (in practice one: decode and verify steps ask
        # "all"), and the prompt chunk in one of its own: the output head's rows take the path its
        # row count picks, so decode rows never share a head call with a prompt chunk's rows
        keys = [(self._mode(j, c), c.shape[0] > ROWWISE_MAX) for j, c in zip(jobs, chunks)]
        try:
            with self.device_turn if self.device_turn is not None else contextlib.nullcontext():
                for key in sorted(set(keys)):
                    group = [i for i, k in enumerate(keys) if k == key]
                    out = eval_batch([jobs[i].session for i in group], [chunks[i] for i in group], key[0])
                    for i, rows in zip(group, out):
                        if rows is not None:
                            jobs[i].rows.append(rows)
        except BaseException as e:      # noqa: BLE001 - every session of the step hears of it
            for j in jobs:
                j.error = e
            self._finish(jobs, all_done=True)
            return
        self.steps += 1
        self.rows += sum(c.shape[0] for c in chunks)
        for j, c in zip(jobs, chunks):
            j.tokens = j.tokens[c.shape[0]:]
        self._finish(jobs)

    def _finish(self, jobs: list[_Eval], all_done: bool = False) -> None:
        with self._cond:
            for j in jobs:
                if all_done or j.tokens.shape[0] == 0:
                    del self._waiting[id(j.session)]
                    j.done.set()
                else:
                    j.since = time.perf_counter()      # its next chunk waits its turn again


def keeps_step_buffers(model) -> bool:
    """Whether the model's device work writes buffers it has once (module docstring): a plan's
    crossings and staging, a device binder's dequantization tile."""
    return model.plan is not None or model.device.type != "cpu"


class _Membership:
    """A session inside a generation: its evals go to the batcher; where the model keeps step
    buffers it holds the device turn for its own work, from here to the end but for its evals' waits."""

    def __init__(self, batcher: StepBatcher, session: Session):
        self.batcher, self.session = batcher, session

    def __enter__(self):
        with self.batcher._cond:
            self.batcher._members.add(id(self.session))
        if self.batcher.device_turn is not None:
            self.batcher.device_turn.acquire()
        self.session.stepper = self.batcher
        return self.session

    def __exit__(self, *exc):
        self.session.stepper = None
        if self.batcher.device_turn is not None:
            self.batcher.device_turn.release()
        with self.batcher._cond:
            self.batcher._members.discard(id(self.session))
            self.batcher._cond.notify_all()
        return False
