"""The decoding sessions behind the server, and the queue that shares them out.

`--parallel N` sessions are made once, at start-up, each with its own KV cache (and recurrent
state, snapshot ring); the weights are one loaded model that all of them read. Each session has
one worker thread that takes requests from a single bounded FIFO queue, so requests are served in
arrival order by whichever session frees up first, and no more than N ever decode at once. The
decoding runs in those threads (the quantized kernels and torch release the GIL), so the event
loop only moves text.

Continuous batching (the default): the sessions' evals go to one `StepBatcher` thread, which runs
those waiting as one forward (every weight read once for all of them) and hands each its logits;
each session still runs its own generation loop (sampler, drafts, grammar, stop strings) on its
worker thread. A placed model (--vram, --device cuda) batches too; its steps and the sessions' own
device work take the device in turn (step_batcher.py). With --no-cont-batching the sessions of a
CPU trunk decode side by side, each its own forwards, and those of a placed model take turns, one
decoding step at a time (`Turns`).

A request's tokens go back to its handler through `Job`: the worker pushes events onto an asyncio
queue via `loop.call_soon_threadsafe`. A client that goes away sets `Job.cancelled`: a queued job
leaves the queue at once, and a decoding one's `on_token` answers "stop" at the next token, which
ends `generate` there and frees the session for the next request.
"""
from __future__ import annotations

import asyncio
import contextlib
import copy
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from ..errors import UserError
from ..decoding.constraint import Constraint
from ..decoding.generate import GenerationStats, generate, prefill
from ..models.base import Model
from ..runtime.session import Session
from ..runtime.step_batcher import StepBatcher, keeps_step_buffers
from ..decoding.speculative.loop import SpecConfig
from ..decoding.speculative.sources import build_source
from .errors import bad_request, internal, queue_full
from .metrics import Metrics
from .logprobs import LogprobTrack, TokenLogprob, token_logprob
from .schemas import GenRequest, GenResult
from .stops import StopScanner
from .tools import ReplySplitter


@dataclass(frozen=True)
class ServeConfig:
    n_ctx: int
    cache_type: str = "f32"
    spec_type: str = "none"
    spec: SpecConfig = field(default_factory=SpecConfig)
    ngram_n: int = 4
    draft_vocab: int = 0         # draft-mtp's reduced vocabulary (build_source; 0: the whole)
    n_parallel: int = 1
    max_queue: int = 64          # requests waiting for a session; one more is answered 503
    threads: int | None = None   # Numba threads of the shared steps, or of each session decoding alone (None: Numba's
                                 # default); with shared steps a session's own kernels get threads // n_parallel
    cont_batching: bool = True   # sessions' steps run as one forward (runtime/step_batcher.py) where the model can
    batch_tokens: int = 0        # token rows of one shared step (0: every decode / verify eval and one prompt chunk)


def shares_steps(n_parallel: int, cont_batching: bool = True) -> bool:
    """Whether a pool's sessions run their steps as shared forwards (continuous batching): asked
    for, and more than one session."""
    return cont_batching and n_parallel > 1


class Turns:
    """The sessions of a placed model decode one step at a time, first come first served (without
    continuous batching: with it, the step batcher's device turn plays this role).

    A plan's steps write buffers that exist once per model, not per session: the executor's host
    buffers (one pair per crossing layer: the activations that go to the CPU FFN worker and come
    back) and op-offload staging, and the binder's one dequantization tile, which every device
    QuantLinear writes before its matmul, the output head's and the MTP head's included. Two
    sessions stepping at once from their worker threads would write over each other's activations.
    A lock around the executor's forward alone would not do: the logits and the MTP head's drafts
    run outside it, on the same tile. So a session holds the turn from the start of its request
    to the end, and hands it on between two decoding steps (generate's `between_steps`, outside the
    adaptive length's timed window); a long prompt is one turn. Tickets, not a plain Lock: a
    released Lock usually goes straight back to the thread that released it, and the others would
    starve. Without a plan the sessions decode at once: the CPU trunk's layers keep no buffers
    between calls."""

    def __init__(self):
        self._cond = threading.Condition()
        self._issued = 0        # tickets given out
        self._serving = 0       # the ticket whose holder may step

    def _take(self) -> None:
        with self._cond:
            ticket = self._issued
            self._issued += 1
            self._cond.wait_for(lambda: self._serving == ticket)

    def _give(self) -> None:
        with self._cond:
            self._serving += 1
            self._cond.notify_all()

    @contextlib.contextmanager
    def turn(self):
        self._take()
        try:
            yield
        finally:
            self._give()

    def hand_on(self) -> None:
        """Between two steps: every session already waiting takes a step first."""
        self._give()
        self._take()


class Job:
    """One request on its way through the pool. Events: ("text", (str, logprob entries)),
    ("tool_calls", [ToolCall]) (streaming: the parsed calls, before "done"), ("done", GenResult),
    ("error", APIError)."""

    def __init__(self, request: GenRequest, loop: asyncio.AbstractEventLoop):
        self.request = request
        self.cancelled = threading.Event()
        self._loop = loop
        self._events: asyncio.Queue = asyncio.Queue()
        self.on_cancel: Callable[[], None] | None = None      # the pool's, while the job is queued

    def cancel(self) -> None:
        self.cancelled.set()
        if self.on_cancel is not None:
            self.on_cancel()

    def put(self, kind: str, payload) -> None:
        """From the worker thread."""
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, (kind, payload))
        except RuntimeError:      # the event loop is gone (server shutting down)
            pass

    async def get(self) -> tuple[str, object]:
        return await self._events.get()


class SessionPool:
    def __init__(self, model: Model, cfg: ServeConfig, metrics: Metrics, draft_model: Model | None = None,
                 policies: dict | None = None):
        self.model, self.cfg, self.metrics, self.draft_model = model, cfg, metrics, draft_model
        if model.plan is not None and cfg.n_parallel > model.plan.options.n_seq:
            raise UserError(f"{cfg.n_parallel} sessions need more than the plan reserved "
                            f"({model.plan.options.n_seq}): plan with --parallel {cfg.n_parallel}")
        # continuous batching: the sessions' evals share forwards, every weight read once for all of
        # them; without it a placed model's sessions take turns (Turns)
        self.batcher = StepBatcher(model, cfg.threads, cfg.batch_tokens) if shares_steps(cfg.n_parallel, cfg.cont_batching) else None
        self.turns = Turns() if self.batcher is None and keeps_step_buffers(model) else None
        k_max = cfg.spec.k_max if cfg.spec_type != "none" else 1     # as `run`: no ring without drafts
        self.sessions = [model.session(cfg.n_ctx, cfg.cache_type, k_max=k_max) for _ in range(cfg.n_parallel)]
        # the jobs waiting for a session (oldest first) and those decoding (one per busy session),
        # both under one lock, so that requests arriving together are judged alike against
        # max_queue. A job whose client leaves while it waits is taken out at once (Job.cancel):
        # left in until a worker reached it, such jobs counted against max_queue, and under load
        # (scripts/load_serve.py: 64 clients, some leaving) the queue filled with requests nobody
        # waited for and live clients got 503s
        self._queue: deque[Job] = deque()
        self._running: set[Job] = set()
        self._cond = threading.Condition()
        self._stopping = False
        self._threads: list[threading.Thread] = []
        # adaptive length's policies, kept between the requests of a session (one worker thread
        # each): what they learned of the verify costs and the head's calibration is the machine's
        # and the head's, not the request's. Greedy and sampled requests learn apart (a sampled
        # draft's acceptance is another quantity).
        self._policies: dict[tuple[int, bool], dict] = {}
        # `policies` (serve's warm-up, warmup.warm_up): adaptive length's policies that start from
        # the verify costs it timed, a copy for each session and kind of request to continue
        for session in self.sessions if policies else ():
            for greedy in (True, False):
                self._policies[(id(session), greedy)] = copy.deepcopy(policies)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._threads = [threading.Thread(target=self._work, args=(s,), name=f"hybridrt-session-{i}", daemon=True)
                         for i, s in enumerate(self.sessions)]
        for t in self._threads:
            t.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Cancel what is queued and running, then end the workers."""
        with self._cond:
            jobs = [*self._queue, *self._running]
            self._queue.clear()
            self._stopping = True
            self._cond.notify_all()
        for job in jobs:
            job.cancel()
        for t in self._threads:
            t.join(timeout)
        if self.batcher is not None:
            self.batcher.stop()

    # ------------------------------------------------------------------ state
    @property
    def in_use(self) -> int:
        with self._cond:
            return len(self._running)

    @property
    def waiting(self) -> int:
        with self._cond:
            return len(self._queue)

    def submit(self, job: Job) -> None:
        """Queue a job, or raise a 503 APIError when max_queue jobs already wait."""
        with self._cond:
            if len(self._queue) + len(self._running) >= len(self.sessions) + self.cfg.max_queue:
                raise queue_full(len(self._queue))
            self._queue.append(job)
            job.on_cancel = lambda: self._withdraw(job)
            self._cond.notify()

    def _withdraw(self, job: Job) -> None:
        """Its client left: out of the queue if it still waits (a decoding job stops at its next token)."""
        with self._cond:
            if job in self._queue:
                self._queue.remove(job)

    # ------------------------------------------------------------------ workers
    def _work(self, session: Session) -> None:
        threads = self.cfg.threads
        if threads and self.batcher is not None:
            # the steps run on the batcher's thread at all `threads`; a worker's own kernels (a trained
            # head's drafts) run beside the other workers', and a pool of every core per worker would
            # stop libgomp's spinning for all of them (runtime/kernel_threads.py)
            threads = max(1, threads // self.cfg.n_parallel)
        if threads:
            import numba

            numba.set_num_threads(threads)     # thread-local: the loader set only the main thread's
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._stopping)
                if self._stopping:
                    return
                job = self._queue.popleft()
                if job.cancelled.is_set():      # its client left just now, before _withdraw took the lock
                    continue
                self._running.add(job)
            event: tuple[str, object]
            try:
                with self.turns.turn() if self.turns is not None else \
                        self.batcher.member(session) if self.batcher is not None else contextlib.nullcontext():
                    event = ("done", self._run(session, job))
            except UserError as e:
                event = ("error", bad_request(str(e)))
            except Exception as e:      # noqa: BLE001 - one bad request must not end the worker
                print(f"hybridrt serve: request failed: {type(e).__name__}: {e}", file=sys.stderr)
                event = ("error", internal(e))
            # free the session before the client hears "done", so a client that saw its answer
            # never sees its session still counted in use
            with self._cond:
                self._running.discard(job)
            job.put(*event)

    def _run(self, session: Session, job: Job) -> GenResult:
        req, model = job.request, self.model
        decoder = model.tokenizer.stream()
        scanner = StopScanner(req.stop)
        pieces: list[str] = []
        shown = 0                   # characters of text shown so far (the echoed prompt included)
        want_logprobs = req.n_logprobs is not None
        track: LogprobTrack | None = None      # the generated tokens' entries (made after the echo)
        released: list = []         # the logprob entries shown, for a non-streaming answer

        def emit(text: str, entries: list | None = None) -> None:
            nonlocal shown
            shown += len(text)
            if track is not None and entries is None:
                entries = track.shown(shown)
            if entries:
                released.extend(entries)
            if text or entries:
                pieces.append(text)
                if req.stream:
                    job.put("text", (text, entries or None))

        t0 = time.perf_counter()
        on_prompt_row = None    # scores the echoed prompt inside the decoder's own prefill
        if req.echo:
            # the prompt as its tokens decode (offsets of its logprobs index this text)
            prompt_text, offsets = _decoded_offsets(model.tokenizer, req.prompt_ids)
            scored = [TokenLogprob(req.prompt_ids[0], None, ())]      # the first token has no score
            if want_logprobs and len(req.prompt_ids) > 1:

                def on_prompt_row(i: int, row) -> None:
                    scored.append(token_logprob(row, req.prompt_ids[i], req.n_logprobs))
                    if i == len(req.prompt_ids) - 1:        # scored: shown before any generated text
                        emit(prompt_text, list(zip(scored, offsets)))
            else:
                emit(prompt_text, list(zip(scored, offsets)) if want_logprobs else [])
        if want_logprobs:
            # generated text's offsets follow the echoed prompt's
            track = LogprobTrack(start=len(prompt_text) if req.echo else 0)
        pending: list[TokenLogprob] = []

        def on_logits(token: int, row) -> None:
            pending.append(token_logprob(row, token, req.n_logprobs))

        # tool calls: the reply's text goes through the splitter, which passes plain content on and
        # holds what may be a call until the end (then parsed into GenResult.tool_calls)
        splitter = ReplySplitter(req.tools) if req.tools is not None else None

        def show(text: str) -> None:
            emit(splitter.push(text) if splitter is not None else text)

        def on_token(token: int) -> bool:
            if job.cancelled.is_set():
                return True
            text = decoder.push(token)
            if track is not None:
                track.add(pending.pop(), len(text))
            show(scanner.push(text))
            return scanner.stopped

        if req.max_tokens == 0:         # echo alone: the prompt is scored (or just shown), nothing generated
            if on_prompt_row is not None:
                prefill(session, req.prompt_ids, visit=on_prompt_row)
            out, stats = [], GenerationStats(n_prompt=len(req.prompt_ids), prompt_s=time.perf_counter() - t0,
                                             stopped_by="n_predict")
        else:
            out, stats = self._generate(session, req, on_token, on_logits if want_logprobs else None, on_prompt_row)
        if not scanner.stopped:
            show(scanner.push(decoder.flush()))
            show(scanner.flush())
        calls = None
        if splitter is not None:
            rest, calls = splitter.finish()
            emit(rest)
            if calls and req.stream:
                job.put("tool_calls", calls)
        if track is not None:
            # tokens that showed no text of their own (a stop string's, or bytes of a character
            # never completed) go out with the end: all of them unless a stop string cut the text
            rest = track.rest(scanner.stopped, shown)
            if rest:
                emit("", rest)
        cancelled = job.cancelled.is_set()
        self.metrics.generation(stats, len(out), cancelled)
        # a complete grammar ends the reply as an end-of-generation token would
        finish = "stop" if scanner.stopped or stats.stopped_by in ("eog", "grammar") else "length"
        if calls:
            finish = "tool_calls"
        return GenResult("".join(pieces), finish, stats, len(out), released if want_logprobs else None, calls or None)

    def _generate(self, session: Session, req: GenRequest, on_token, on_logits, on_prompt_row):
        cfg, model = self.cfg, self.model
        # a fresh draft source per request: it follows one sequence (MTP and n-gram sources
        # allocate nothing; a draft model's source makes its own draft session)
        source = build_source(cfg.spec_type, session, req.sampler, cfg.spec, self.draft_model,
                              ngram_n_max=cfg.ngram_n, cache_type=cfg.cache_type, draft_vocab=cfg.draft_vocab)
        stop_ids = set() if req.ignore_eos else None        # None: the tokenizer's end-of-generation ids
        constraint = Constraint(req.grammar, model.tokenizer, model.n_vocab) if req.grammar is not None else None
        return generate(model, session, list(req.prompt_ids), req.max_tokens, req.sampler, source, cfg.spec,
                        on_token=on_token, stop_ids=stop_ids, on_logits=on_logits, on_prompt_row=on_prompt_row,
                        policies=self._policies.setdefault((id(session), req.sampler.greedy), {}),
                        between_steps=self.turns.hand_on if self.turns is not None else None,
                        constraint=constraint)


def _decoded_offsets(tokenizer, ids: list[int]) -> tuple[str, list[int]]:
    """The text `ids` decode to, and where each token's text starts in it."""
    decoder = tokenizer.stream()
    parts, offsets, n = [], [], 0
    for t in ids:
        offsets.append(n)
        piece = decoder.push(t)
        parts.append(piece)
        n += len(piece)
    parts.append(decoder.flush())
    return "".join(parts), offsets
