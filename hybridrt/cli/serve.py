"""`hybridrt serve`: an OpenAI-compatible HTTP server (see hybridrt/server), llama-server's flags."""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Optional

import typer

from .options import (CTX_SIZE, GROUP, MODEL, MTP_HEAD, PARALLEL, WARMUP, KVFlags, PlacementFlags, SpecFlags,
                      flag_groups)
from ..errors import UserError
INSTALL = "python3 -m pip install 'hybridrt[serve]'"
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")      # uvicorn's


def _server_stack():
    try:
        import starlette  # noqa: F401
        import uvicorn
    except ImportError:
        raise UserError(f"hybridrt serve needs Starlette and uvicorn: {INSTALL}") from None
    return uvicorn


def _check_listen(host: str, port: int) -> None:
    """Fail before loading anything if the address cannot be listened on (a port in use, a host that
    does not resolve), with uvicorn's socket options: its own error comes after the banner, as log
    lines and exit code 3."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise UserError(f"--host {host}: {e.strerror}") from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            raise UserError(f"cannot listen on {host}:{port}: {e.strerror}") from None


def _threadsafe_kernels(parallel: int) -> None:
    """Sessions run the parallel kernels from several threads at once, which Numba's fallback
    `workqueue` layer does not survive; pick a thread-safe layer (OpenMP or TBB) before the first
    parallel kernel runs, or refuse."""
    if parallel == 1:
        return
    import importlib

    import numba

    for layer in ("omppool", "tbbpool"):
        try:
            importlib.import_module(f"numba.np.ufunc.{layer}")
        except (ImportError, OSError):
            continue
        numba.config.THREADING_LAYER = "threadsafe"
        return
    raise UserError("--parallel > 1 needs a thread-safe Numba threading layer (OpenMP's libgomp, or "
                    "python3 -m pip install tbb); use --parallel 1")


@flag_groups
def serve(
    model: Optional[str] = MODEL,
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on."),
    port: int = typer.Option(8080, "--port", help="Port to listen on."),
    ctx_size: Optional[int] = CTX_SIZE,
    kv: KVFlags = GROUP,
    parallel: int = PARALLEL,
    max_queue: int = typer.Option(64, "--max-queue", help="Requests that may wait for a session; more get 503."),
    threads: Optional[int] = typer.Option(None, "-t", "--threads", show_default=False,
                                          help="CPU threads of the shared steps, and of each session's own work "
                                               "(default: all cores with continuous batching, else the cores shared "
                                               "out over --parallel)."),
    cont_batching: bool = typer.Option(True, "-cb/-nocb", "--cont-batching/--no-cont-batching",
                                       help="Run the sessions' decoding steps as one forward (each weight read once "
                                            "for all of them), as llama-server; a plan's sessions too."),
    batch_tokens: int = typer.Option(0, "--batch-tokens", help="Token rows one shared step may run: decode and verify "
                                     "rows, and a prompt chunk of up to 512 tokens while it fits; the request "
                                     "waiting longest always runs (0: no bound)."),
    drafts: SpecFlags = GROUP,
    # run's placement and numerics flags, but no --trace: a trace keeps every step in memory (and a
    # CUDA event pair per device span) until the end of a run writes it; a server has no such end
    # and would grow without bound. `run` and `bench` with the same flags trace the same steps.
    load: PlacementFlags = GROUP,
    log_level: str = typer.Option("info", "--log-level", help=f"uvicorn log level: {', '.join(LOG_LEVELS)} (warning: no access log)."),
    mtp_head: Optional[Path] = MTP_HEAD,
    warmup: bool = WARMUP,
):
    """Serve the model over HTTP with OpenAI's API (/v1/chat/completions, /v1/completions, ...)."""
    uvicorn = _server_stack()
    from .options import check_ctx_size, context_size
    from ..runtime.loader import load_draft_model
    from ..files.registry import KNOWN_MODELS, resolve_model
    from ..decoding.sampling import SamplerConfig
    from ..server import ServeConfig, SessionPool, create_app
    from ..server.pool import shares_steps
    from ..server.metrics import Metrics
    from ..server.schemas import ModelCard
    from ..decoding.speculative.sources import build_source
    from ..runtime.kernel_threads import on_own_thread
    from ..runtime.warmup import announce_and_compile, compile_notice, warm_up

    if parallel < 1 or max_queue < 0 or batch_tokens < 0:
        raise UserError("--parallel must be >= 1, --max-queue and --batch-tokens >= 0")
    if not 0 < port < 65536:
        raise UserError(f"--port {port} is not a TCP port")
    if log_level not in LOG_LEVELS:
        raise UserError(f"--log-level {log_level}: use one of {', '.join(LOG_LEVELS)}")
    _check_listen(host, port)
    drafts.check()
    check_ctx_size(ctx_size)
    device = load.check()
    cache_type = kv.cache_type
    _threadsafe_kernels(parallel)
    path = resolve_model(model)
    # a cold cache's compile runs the kernels: on a thread that exits, as the warm-up below, so the
    # main thread keeps no kernel pool beside the steps' (runtime/kernel_threads.py)
    on_own_thread(announce_and_compile, path)
    import numba

    # a fixed count (no thread governor): the sessions' worker threads share the model's executor,
    # and Numba's count is per launching thread. As `run` loads it, with a plan for all the sessions
    m = load.load(path, device, threads or numba.config.NUMBA_NUM_THREADS, ctx_size, kv, drafts.spec_type,
                  drafts.draft_n_max, drafts.model_draft, mtp_head, n_seq=parallel)
    shared = shares_steps(parallel, cont_batching)
    if threads is None:
        # shared steps run on one thread, which takes every core; sessions that decode at once
        # would oversubscribe with a pool of all cores each
        threads = numba.config.NUMBA_NUM_THREADS if shared else max(1, numba.config.NUMBA_NUM_THREADS // parallel)
    planned = m.plan.options if m.plan is not None else None
    n_ctx = context_size(ctx_size, m.n_ctx_train, planned.n_ctx if planned else None)
    spec_type = drafts.source_type(m, planned.spec_type if planned else None)
    spec = drafts.config(spec_type, shared_steps=shared)
    draft_model = load_draft_model(m, drafts.model_draft) if drafts.model_draft else None
    cfg = ServeConfig(n_ctx=n_ctx, cache_type=cache_type, spec_type=spec_type, spec=spec, ngram_n=drafts.ngram_n,
                      draft_vocab=drafts.draft_vocab,
                      n_parallel=parallel, max_queue=max_queue, threads=threads, cont_batching=cont_batching,
                      batch_tokens=batch_tokens)
    metrics = Metrics(parallel)
    policies = None
    if warmup:
        # the first request would otherwise pay each kernel's first call (its machine code loaded:
        # a trained head's quant types, each verify size); before the pool's sessions are made, as
        # `run`'s before its own (a plan's VRAM holds them). Also a bad speculation setup is a
        # start-up error here, not a failure of every request.
        # On a thread of its own that then exits: the steps launch their kernels from another thread,
        # and a second launching thread's kernel pool, left alive, would slow every step of theirs
        # (runtime/kernel_threads.py). At the steps' thread count, which its verify timings are for.
        def warm() -> dict | None:
            numba.set_num_threads(threads)
            return warm_up(m, spec_type, spec, SamplerConfig(temp=0.0), cache_type, draft_model, drafts.ngram_n,
                           draft_vocab=drafts.draft_vocab)
        with compile_notice():
            policies = on_own_thread(warm)
    pool = SessionPool(m, cfg, metrics, draft_model, policies=policies)
    if not warmup:
        on_own_thread(build_source, spec_type, pool.sessions[0], SamplerConfig(), spec, draft_model,
                      ngram_n_max=drafts.ngram_n, cache_type=cache_type, draft_vocab=drafts.draft_vocab)
    served = model if model in KNOWN_MODELS else Path(path).stem
    card = ModelCard(id=served, n_ctx=n_ctx, created=int(time.time()))
    print(f"hybridrt serve: {served} on http://{host}:{port}/v1 · {parallel} session(s) x {n_ctx} tokens, "
          f"KV {cache_type}, spec {spec_type}" + (f" (n_max {spec.n_max})" if spec_type != "none" else "")
          + (", continuous batching" if pool.batcher is not None else ""),
          file=sys.stderr, flush=True)
    uvicorn.run(create_app(m, pool, card, metrics), host=host, port=port, log_level=log_level)
