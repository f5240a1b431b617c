"""`hybridrt serve`: an OpenAI-compatible HTTP server (see hybridrt/server), llama-server's flags."""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Optional

import typer

from .errors import UserError

MODEL_HELP = "GGUF path or a known name (gemma3-270m, smollm2-135m); default gemma3-270m"
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


def serve(
    model: Optional[str] = typer.Option(None, "-m", "--model", help=MODEL_HELP),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on."),
    port: int = typer.Option(8080, "--port", help="Port to listen on."),
    ctx_size: Optional[int] = typer.Option(None, "-c", "--ctx-size", show_default=False,
                                           help="Context per session (default: 4096 or the model's, if smaller; 0: the model's)."),
    cache_type_k: str = typer.Option("f16", "-ctk", "--cache-type-k", help="KV cache type for K: f16, f32, bf16, q8_0."),
    cache_type_v: str = typer.Option("f16", "-ctv", "--cache-type-v", help="KV cache type for V: f16, f32, bf16, q8_0."),
    parallel: int = typer.Option(1, "-np", "--parallel", help="Sessions decoding at once (each has its own KV)."),
    max_queue: int = typer.Option(64, "--max-queue", help="Requests that may wait for a session; more get 503."),
    threads: Optional[int] = typer.Option(None, "-t", "--threads", show_default=False,
                                          help="CPU threads per session (default: the cores shared out over --parallel)."),
    spec_type: Optional[str] = typer.Option(None, "--spec-type", help="Speculative drafts: none, draft-mtp, draft-simple, ngram-simple, or a lookup and a model source together (ngram-simple,draft-mtp: the lookup drafts where the text repeats, the model elsewhere) (default: draft-mtp when the model has an MTP head, else none)."),
    model_draft: Optional[str] = typer.Option(None, "-md", "--model-draft", help="Draft model for --spec-type draft-simple (same vocabulary)."),
    draft_n_max: int = typer.Option(3, "--spec-draft-n-max", "--draft-max", help="Most draft tokens per step."),
    draft_n_min: int = typer.Option(0, "--spec-draft-n-min", "--draft-min", help="Drop proposals shorter than this."),
    draft_p_min: float = typer.Option(0.0, "--spec-draft-p-min", "--draft-p-min", help="Stop model drafting below this top-1 probability."),
    ngram_n: int = typer.Option(4, "--spec-ngram-size-n", help="ngram-simple: longest n-gram to match (tried down to 2)."),
    adaptive: Optional[bool] = typer.Option(None, "--adaptive/--no-adaptive", help="Choose each step's draft count within --spec-draft-n-max (default: on for draft-mtp and draft-simple, as run)."),
    log_level: str = typer.Option("info", "--log-level", help=f"uvicorn log level: {', '.join(LOG_LEVELS)} (warning: no access log)."),
    mtp_head: Optional[Path] = typer.Option(None, "--mtp-head", help="MTP head from `hybridrt train-mtp` for --spec-type draft-mtp (replaces a built-in head)."),
    warmup: bool = typer.Option(True, "--warmup/--no-warmup", help="Before listening, run a few tokens through the steps requests take (kernels loaded, verify sizes timed for adaptive length), as llama-server."),
):
    """Serve the model over HTTP with OpenAI's API (/v1/chat/completions, /v1/completions, ...)."""
    uvicorn = _server_stack()
    from .cli_run import adaptive_default, check_ctx_size, check_spec_flags, context_size
    from .kv_cache import kv_cache_type
    from .loader import load_model
    from .registry import KNOWN_MODELS, resolve_model
    from .sampling import SamplerConfig
    from .server import ServeConfig, SessionPool, create_app
    from .server.metrics import Metrics
    from .server.schemas import ModelCard
    from .speculative.loop import SpecConfig
    from .speculative.sources import build_source, default_spec_type
    from .warmup import announce_and_compile, compile_notice, warm_up

    if parallel < 1 or max_queue < 0:
        raise UserError("--parallel must be >= 1 and --max-queue >= 0")
    if not 0 < port < 65536:
        raise UserError(f"--port {port} is not a TCP port")
    if log_level not in LOG_LEVELS:
        raise UserError(f"--log-level {log_level}: use one of {', '.join(LOG_LEVELS)}")
    _check_listen(host, port)
    check_spec_flags(draft_n_max, ngram_n)
    check_ctx_size(ctx_size)
    cache_type = kv_cache_type(cache_type_k, cache_type_v)
    _threadsafe_kernels(parallel)
    path = resolve_model(model)
    announce_and_compile(path)
    import numba

    if threads is None:     # sessions decode at once: one pool of all cores each would oversubscribe
        threads = max(1, numba.config.NUMBA_NUM_THREADS // parallel)
    # a fixed count (no thread governor): the sessions' worker threads share the model's executor,
    # and Numba's count is per launching thread
    m = load_model(path, threads=threads, mtp_head=mtp_head)
    n_ctx = context_size(ctx_size, m.n_ctx_train)
    spec_type = spec_type or ("draft-simple" if model_draft else default_spec_type(m))
    spec = SpecConfig(n_max=draft_n_max, n_min=draft_n_min, p_min=draft_p_min,
                      adaptive=adaptive_default(spec_type) if adaptive is None else adaptive)
    draft_model = load_model(model_draft, threads=threads) if model_draft else None
    cfg = ServeConfig(n_ctx=n_ctx, cache_type=cache_type, spec_type=spec_type, spec=spec, ngram_n=ngram_n,
                      n_parallel=parallel, max_queue=max_queue, threads=threads)
    metrics = Metrics(parallel)
    policies = None
    if warmup:
        # the first request would otherwise pay each kernel's first call (its machine code loaded:
        # a trained head's quant types, each verify size); before the pool's sessions are made, as
        # `run`'s before its own (a plan's VRAM holds them). Also a bad speculation setup is a
        # start-up error here, not a failure of every request.
        with compile_notice():
            policies = warm_up(m, spec_type, spec, SamplerConfig(temp=0.0), cache_type, draft_model, ngram_n)
    pool = SessionPool(m, cfg, metrics, draft_model, policies=policies)
    if not warmup:
        build_source(spec_type, pool.sessions[0], SamplerConfig(), spec, draft_model, ngram_n_max=ngram_n,
                     cache_type=cache_type)
    served = model if model in KNOWN_MODELS else Path(path).stem
    card = ModelCard(id=served, n_ctx=n_ctx, created=int(time.time()))
    print(f"hybridrt serve: {served} on http://{host}:{port}/v1 · {parallel} session(s) x {n_ctx} tokens, "
          f"KV {cache_type}, spec {spec_type}" + (f" (n_max {spec.n_max})" if spec_type != "none" else ""),
          file=sys.stderr, flush=True)
    uvicorn.run(create_app(m, pool, card, metrics), host=host, port=port, log_level=log_level)
