"""First run: say so when CPU (Numba) kernels compile, and compile them ahead on request.

Numba compiles a kernel at its first call and caches the machine code on disk (`cache=True`;
`__pycache__` beside the source, or NUMBA_CACHE_DIR). A cold cache costs seconds to tens of
seconds before the first token. `run` compiles lazily, only what its steps call (a short greedy
prompt: the fused layer halves and the k = 1 output matvec; the prompt GEMM only when a batch
reaches it, the verify kernels only when speculation verifies): `compile_notice` prints one line
on stderr when the first compilation starts, wherever in the run that is. `hybridrt warmup`
compiles everything a model can call ahead (`compile_kernels`: batches of every kernel family,
each kernel with the signatures real decoding uses). `kernels_cold()` tells a cold cache without
compiling anything: it reads the cache index of each top-level kernel (a small pickle that Numba
itself discards when the kernel's source changed).
"""
from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator, Optional, TextIO

import typer

if TYPE_CHECKING:       # torch stays unimported for `info` and `plan`, which import the CLI
    from ..models.base import Model

MESSAGE = "compiling CPU kernels (first run only) ..."


def _dispatchers() -> list:
    """The Numba kernels a model calls from Python (the rest are compiled into these): the
    k-input matvec, the fused gate/up FFN, the row decoder behind embedding gathers and
    load-time dequantization, the fused layer halves of a CPU trunk, and sampling's top-k."""
    from cpu_kernels import blocks, ffn, layer_fused, matvec, matvec_int, matvec_tiled, top_k

    from .config import ENV

    fused = [layer_fused.attention_block, layer_fused.ffn_block] if ENV.fused_layers else []
    sampling = [top_k.top_k_bits]
    # the path quantized matrices take by default: integer kernels on int8 activations, or the float
    # ones with HYBRIDRT_EXACT_ACTIVATIONS (kernels the run never calls would read as cold forever)
    if ENV.exact:
        return [matvec._matvec_kernel, ffn._gate_up_kernel, blocks.decode_rows] + fused + sampling
    # (with fused layer halves, batches of 1-3 tokens never reach ffn's row kernel: the FFN half
    # takes every batch up to ROWWISE_MAX tokens)
    gate_up = [] if fused else [ffn._gate_up_int_kernel]
    return [matvec_int._matvec_int_kernel, matvec_tiled._matvec_tiled_kernel, ffn._gate_up_tiled_kernel,
            blocks.decode_rows] + gate_up + fused + sampling


def kernels_cold(dispatchers: list | None = None) -> bool:
    """True when some kernel (of `dispatchers`, default: every one a model calls from Python) has no
    usable cached machine code (it will compile at first use)."""
    for dispatcher in _dispatchers() if dispatchers is None else dispatchers:
        try:
            if not dispatcher._cache._cache_file._load_index():
                return True
        except (AttributeError, OSError, EOFError, ValueError):
            return True     # no cache we can read: assume the worst, which only costs a message
    return False


@contextmanager
def compile_notice(stream: TextIO | None = None) -> Iterator:
    """While inside (or, as a decorator, during the call): the first kernel compilation (a cold
    cache, or a kernel this cache has not seen yet) prints MESSAGE on `stream` (stderr), once,
    before it starts; loading cached machine code prints nothing. The yielded listener's
    `.compiled` says afterwards whether anything compiled; a caller that has left a line open on
    stdout (run's echoed prompt) sets its `.partial_line`, and the message starts a line of its own."""
    from numba.core import event      # not at import: `info` and `plan` import the CLI

    class Notice(event.Listener):
        compiled = False        # (a caller may reset it: compiled since)
        announced = False
        partial_line = False

        def on_start(self, ev) -> None:
            self.compiled = True
            if not self.announced:
                self.announced = True
                if self.partial_line:
                    sys.stdout.flush()
                print(("\n" if self.partial_line else "") + MESSAGE, file=stream or sys.stderr, flush=True)

        def on_end(self, ev) -> None:
            pass

    notice = Notice()
    with event.install_listener("numba:compile", notice):
        yield notice


# A warm-up forward reads every weight once: nothing next to SmolLM2's step, but a second on the
# 27B, whose warm-up of eleven forwards was 19.6 s of a 20.9 s warm start (BENCHMARKS.md, "Mission
# size"). Kernels compile and load per signature (types, not sizes or layers), so past this many
# bytes a step, a CPU trunk warms up on one layer of each kind and tensor-type mix (sampled_trunk):
# the same kernels get their first call at a few percent of the cost. Below it the warm-up runs the
# whole model, as the run will, and times its verify sizes for adaptive length (verify_costs).
SAMPLED_WARMUP_BYTES = 1 << 30


def layer_signature(model: "Model", i: int) -> tuple:
    """What decides which kernels layer i calls: its kind, its halves' backends, the attention
    spec (a sliding window or another rotary base is another specialization) and the type of each
    of its tensors (a Q4_K_M file mixes Q4_K and Q6_K from layer to layer)."""
    layer = model.layers[i]
    attention = layer.attention
    prefix = f"blk.{i}."
    types = sorted((name[len(prefix):], t.qtype) for name, t in model.gguf.tensors.items()
                   if name.startswith(prefix))
    return (layer.kind, type(layer.mixer).__name__, type(layer.ffn).__name__,
            repr(attention.spec) if attention is not None else None, tuple(types))


def signature_layers(model: "Model") -> list:
    """The first layer of each signature (layer_signature) in `model`'s trunk: together they call
    every kernel the whole trunk calls."""
    seen, layers = set(), []
    for i, layer in enumerate(model.layers):
        sig = layer_signature(model, i)
        if sig not in seen:
            seen.add(sig)
            layers.append(layer)
    return layers


def trunk_view(model: "Model", layers: list) -> "Model":
    """`model` with only `layers` in its trunk: a shallow copy sharing every weight, backend, head
    and the executor, whose sessions are the whole model's (each layer keeps its own KV / recurrent
    state slot). For compiling and warming up: its outputs mean nothing; only the calls count."""
    import copy

    view = copy.copy(model)
    view.layers = layers
    return view


def any_token(model: "Model") -> int:
    """A token id every model has, for forwards whose outputs do not matter: BOS, else 0."""
    return model.tokenizer.bos_id if model.tokenizer.bos_id is not None else 0


def sampled_trunk(model: "Model") -> "Model":
    """`model`'s trunk_view of its signature_layers, for a warm-up: its forwards call every kernel
    the whole trunk calls. The model itself when it is small (SAMPLED_WARMUP_BYTES) or follows a
    plan (device layers specialize on their split sizes, and a plan's executor schedules whole
    layer lists)."""
    if model.plan is not None or model.weight_bytes_per_token < SAMPLED_WARMUP_BYTES:
        return model
    return trunk_view(model, signature_layers(model))


def compile_kernels(model: "Model") -> None:
    """Batches of 1, 4, 8, 16 and 40 tokens: compiles (or loads) every kernel the model uses, for
    decode and verify (register groups, or the fused layer halves of a CPU trunk, which take
    batches up to ROWWISE_MAX tokens; the output matrix on 4, 8 and 16 tokens as verify steps read
    it: register groups, token quads, and token lanes) and prompts
    (cpu_kernels.matvec_int's tiled kernels on token quads and lanes; a batch past ROWWISE_MAX
    reaches them through the torch trunk), each for the model's quant types only, and sampling's
    top-k (cpu_kernels.top_k, float32 rows). Once per KV cache
    type the fused attention half reads (it compiles once for each): f32 (the Python API's
    default), f16 (`run`'s and `serve`'s) and q8_0 (-ctk / -ctv q8_0) where the head size allows."""
    model = sampled_trunk(model)
    for cache_type in CACHE_TYPES:
        compile_cache_type(model, cache_type)
    import torch

    from ..decoding.sampling import top_k_rows

    top_k_rows(torch.zeros(2, 4 * 40), 40)      # sampled runs' top-k (float32 rows; any vocabulary)


CACHE_TYPES = ("f32", "f16", "q8_0")    # compile_kernels' passes, in order


def compile_cache_type(model: "Model", cache_type: str) -> None:
    """compile_kernels' pass for one KV cache type over `model`'s layers: batches of 1, 4, 8, 16
    and 40 tokens, then the MTP head (a built-in head's KV is of the session's type). Nothing for
    a type the model's head size rules out (q8_0 on a size its blocks do not divide)."""
    from ..errors import UserError

    token = any_token(model)
    try:
        session = model.session(n_ctx=128, cache_type=cache_type)
    except UserError:
        return
    for k in (1, 4, 8, 16, 40):
        session.eval([token] * k, logits="all" if k in (4, 8, 16) else "last")
    compile_head(model, cache_type)


def compile_head(model: "Model", cache_type: str | None) -> None:
    """The model's MTP head (built in, or a trained one from `--mtp-head`), as drafting calls it:
    one, two and four tokens (a proposal after a verify) with their logits rows, and a catch-up's
    KV rows, on a session of the run's KV cache type (None: Model.session's default). A trained head
    stores its matrices as Q8_0, which a target of other quant types has never compiled: without
    this, a server's first draft stalled for seconds. Nothing without a head. Why the cache type:
    the fused attention half compiles once per cache type, and a session of another type (this
    took Model.session's f32 while `run` decodes on f16) cost the 27B's first run ~40 s of
    compiling kernels it never called (docs/history.md, "A cold start's f32 attention")."""
    import torch

    mtp = model.mtp
    if mtp is None:
        return
    token = any_token(model)
    session = model.session(n_ctx=64, cache_type=cache_type, k_max=4)
    session.eval([token] * 5, logits="none")
    hidden = session.hidden
    row = torch.empty(1, mtp.n_out)
    for k in (1, 2, 4):     # as MTPSource drafts: draft() (a trained head's one fused call)
        mtp.draft(session.state, torch.full((k,), token, dtype=torch.int64), hidden[:k], 1, out=row)
    mtp.write_kv(session.state, torch.full((4,), token, dtype=torch.int64), hidden[:4], 1)     # a catch-up


def announce_and_compile(model: "Model | str | os.PathLike | None") -> bool:
    """On a cold kernel cache: compile everything `model` needs ahead (compile_kernels; a server
    would otherwise stall its first requests), MESSAGE on stderr when compiling starts. `model`: a
    loaded Model, or a path / known name (loaded here, after a check of the file). On a warm cache:
    nothing. Returns whether it compiled. Call it before `load_model` with the name, or after with
    the model."""
    if not kernels_cold():
        return False
    if model is None or isinstance(model, (str, os.PathLike)):
        from ..files.gguf_file import GGUFFile
        from ..files.registry import resolve_model

        GGUFFile(resolve_model(model))      # a bad path or file stays one error line, no message first
    from . import compile_helper

    path = model if model is None or isinstance(model, (str, os.PathLike)) else model.gguf.path
    with compile_helper.alongside(path, CACHE_TYPES[1:], ahead_of="warmup"), compile_notice() as notice:
        if model is None or isinstance(model, (str, os.PathLike)):
            from .loader import load_model

            model = load_model(model)
        compile_kernels(model)
    return notice.compiled


def warmup(
    model: Optional[str] = typer.Option(None, "-m", "--model",
                                        help="GGUF path or a known name (gemma3-270m, smollm2-135m); default gemma3-270m"),
    mtp_head: Optional[str] = typer.Option(None, "--mtp-head", help="also the kernels of this MTP head (from `hybridrt train-mtp`)"),
):
    """Compile the CPU kernels a model needs ahead of its first run (cached on disk)."""
    from . import compile_helper
    from .loader import load_model

    t0 = time.perf_counter()
    with compile_helper.alongside(model, CACHE_TYPES[1:], ahead_of="warmup"), compile_notice() as notice:
        m = load_model(model, mtp_head=mtp_head)
        compile_kernels(m)
    took = time.perf_counter() - t0
    where = os.environ.get("NUMBA_CACHE_DIR") or "__pycache__ beside the kernels"
    print(f"CPU kernels {'compiled' if notice.compiled else 'already compiled'} for "
          f"{os.path.basename(m.gguf.path)} in {took:.1f} s (cache: {where})", file=sys.stderr)


WARMUP_TOKENS = 4       # tokens a warm-up generates: its first step verifies a full batch of drafts
COST_REPS = 3           # timings per verify size it hands an adaptive run (RECENT_TIMES' median)
# the timing's start-up cost: a round of every size is timed again only while the rounds so far
# took less than this. A small model's rounds take milliseconds (three each); one round of a
# 27B's 1..4-token verifies at ~6 t/s would take about a second, and three would add ~2 s to
# every `run` for a ~3 % gain measured on SmolLM2 (cc3b39d; docs/history.md, 2026-11-27): one round there.
COST_BUDGET_S = 0.5


def warm_up(model: "Model", spec_type: str, spec, sampler, cache_type: str, draft_model: "Model | None" = None,
            ngram_n_max: int = 4, draft_vocab: int = 0) -> dict | None:
    """llama.cpp's warm-up before the timed run (`run --no-warmup` skips it): a few tokens through
    the same steps the run takes, on a scratch session freed before the run's own is made (a plan's
    VRAM holds one KV cache). In a fresh process each kernel's first call loads its machine code:
    untimed here, a `run` of SmolLM2 with its trained head paid ~155 ms in decoding and ~80 ms in
    the prompt for it (64 tokens: 395 ms against 240 ms warm), more than drafting gained, and its
    adaptive policy read the loading as the drafts' cost. A speculative warm-up drafts at fixed
    --spec-draft-n-max, so its first step verifies the largest batch the run can. For an adaptive
    run it then times each verify size (verify_costs) and returns length policies that start from
    those timings (`generate(policies=...)`), rather than from a prior. draft_vocab: the
    run's (build_source): a reduced-vocabulary view of the MTP head is built here, not in the run.
    A big CPU trunk warms up on sampled_trunk's layers and times nothing."""
    import dataclasses

    from ..decoding.generate import generate
    from ..decoding.speculative.loop import length_policies
    from ..decoding.speculative.sources import build_source
    from ..decoding.speculative.spec_types import spec_type_parts

    full = model
    model = sampled_trunk(model)
    lo = min(1000, model.n_vocab // 4)
    prompt = [lo, lo + 1]
    room = len(prompt) + WARMUP_TOKENS + spec.k_max + COST_REPS * spec.k_max + 2
    n_ctx = None if model.plan is not None else min(room, model.n_ctx_train)
    sampler = dataclasses.replace(sampler, seed=0)      # its own draws: the run's stream is the run's
    if spec_type == "none":
        session = model.session(n_ctx, cache_type, k_max=1)
        generate(model, session, prompt, WARMUP_TOKENS, sampler, stop_ids=set())
        return None
    fixed = dataclasses.replace(spec, adaptive=False, n_min=0, p_min=0.0)
    session = model.session(n_ctx, cache_type, k_max=fixed.k_max)
    source = build_source(spec_type, session, sampler, fixed, draft_model, ngram_n_max=ngram_n_max,
                          cache_type=cache_type, draft_vocab=draft_vocab)
    if "draft-mtp" in spec_type_parts(spec_type):
        compile_head(model, cache_type)         # the head's other batch sizes and a catch-up's KV rows
    generate(model, session, prompt, WARMUP_TOKENS, sampler, source, fixed, stop_ids=set())
    if not spec.adaptive or session.n_past + (COST_REPS + 1) * spec.k_max > session.n_ctx:
        return None
    if model is not full:
        # a sample's verify times are not the run's: its policies learn them from its own steps
        # (their first timing of each size is skipped as a kernel's first call)
        return None
    times = verify_costs(model, session, spec.k_max, lo)
    policies: dict = {}
    length_policies(source, spec, policies)       # the run's policies, one per source that drafts
    for policy in policies.values():
        policy.seed_verify_costs(times)
    return policies


def verify_costs(model: "Model", session, k_max: int, token: int,
                 budget_s: float = COST_BUDGET_S) -> dict[int, list[float]]:
    """Seconds of a verify of k = 1 .. k_max tokens at the session's end, each rolled back to its
    first token as a rejected one is (a recurrent state keeps no earlier point), in rounds of every
    size (alternating, so that all see the same load): COST_REPS rounds, or fewer where the rounds
    so far took `budget_s` or more (at least one)."""
    import torch

    out = torch.empty(k_max, model.n_vocab)
    times: dict[int, list[float]] = {k: [] for k in range(1, k_max + 1)}
    for _ in range(COST_REPS):
        if times[1] and sum(map(sum, times.values())) >= budget_s:
            break
        for k in times:
            pos = session.n_past
            t0 = time.perf_counter()
            session.eval([token] * k, start_pos=pos, logits="all", out=out)
            session.truncate(pos + 1)
            times[k].append(time.perf_counter() - t0)
    return times
