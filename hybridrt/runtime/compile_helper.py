"""A second process that compiles CPU kernels while the first compiles its own: a cold start in parallel.

Why: Numba compiles on the thread that first calls a kernel, one kernel after another, so a cold
`run` of the 27B spent ~120 s of a ~130-150 s first token compiling on one core while the other
idled (BENCHMARKS.md, "Mission size", Start). The fused layer halves are separate entry points with
separate on-disk caches: the run compiles the halves of layer 0's kind first (the 27B's Gated
DeltaNet half: ~55 s) while this helper, started before the run loads the model, compiles the
halves of the other layer kinds (the attention half with the matrix code it carries, ~60 s), then
the output head, the MTP head's draft kernels and top-k, and writes them to the same cache. When the
run reaches them it loads their machine code instead of compiling (or, where it gets there first,
compiles them itself: the same cache entry, written atomically by either). The bits cannot differ:
the cache holds each kernel's code for one signature, whoever compiled it.

`serve` and `hybridrt warmup` compile everything ahead (warmup.compile_kernels: a pass per KV cache
type, f32 first); there the helper takes the later passes' attention halves (f16 and q8_0), the only
kernels a pass compiles anew, while the caller's f32 pass compiles the rest.

The helper runs its forwards on one thread, prints nothing, and is stopped when the caller is done
with compiling or exits. It starts on a cold cache with more than one core, for a CPU run without
a plan, and stops at once unless the model is a fused CPU trunk (for `run`: with a second layer
kind, as qwen35, qwen35moe and qwen3next have).
"""
from __future__ import annotations

import argparse
import atexit
import os
import subprocess
import sys
from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator, Sequence

if TYPE_CHECKING:
    from ..models.base import Model


def other_kind_layers(model: "Model") -> list:
    """The first layer of each kind other than layer 0's: what the first process reaches last."""
    first = model.layers[0].kind
    seen, layers = set(), []
    for layer in model.layers:
        if layer.kind != first and layer.kind not in seen:
            seen.add(layer.kind)
            layers.append(layer)
    return layers


def start(model: str | os.PathLike | None, cache_types: str | Sequence[str], exact: bool | None = None,
          act_residual: bool | None = None, ahead_of: str = "run") -> subprocess.Popen | None:
    """On a cold kernel cache (the fused attention half never compiled), a helper that loads `model`
    (a path or a known name, already pulled) on the CPU as the caller is about to, with the same
    numerics switches (None: the environment's, which it inherits), and compiles what the caller
    reaches late: ahead_of="run", compile_ahead for a run's sessions of `cache_types` (one type);
    "warmup", compile_cache_types for warmup.compile_kernels' later passes (its first, f32, is the
    caller's). Stopped at exit (stop). Started before the caller's own load, so that both load at
    once. None on one core or a warm cache (the helper itself stops early where the model is not
    a fused CPU trunk, or for a run, has one layer kind only)."""
    from cpu_kernels import layer_fused

    from ..files.registry import resolve_model
    from .warmup import kernels_cold

    # cold: the fused attention half has never compiled here (not warmup's whole list: a kernel that
    # only long prompts call would start a helper on every warm run until one came)
    if (os.cpu_count() or 1) < 2 or not kernels_cold([layer_fused.attention_block]):
        return None
    try:
        path = resolve_model(model, auto_pull=False)
    except Exception:       # the caller's own load reports a bad name or path
        return None
    if not path.is_file():
        return None
    types = [cache_types] if isinstance(cache_types, str) else list(cache_types)
    cmd = [sys.executable, "-m", "hybridrt.runtime.compile_helper", os.fspath(path), "--cache-type", ",".join(types),
           "--ahead-of", ahead_of]
    if exact is not None:
        cmd += ["--exact", str(int(exact))]
    if act_residual is not None:
        cmd += ["--act-residual", str(int(act_residual))]
    env = dict(os.environ, NUMBA_NUM_THREADS="1")
    try:
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    except OSError:
        return None             # no second process: the caller compiles everything, as before
    atexit.register(stop, proc)
    return proc


def stop(proc: subprocess.Popen) -> None:
    """End the helper (a short run can finish before it does)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()


@contextmanager
def alongside(model: str | os.PathLike | None, cache_types: str | Sequence[str], ahead_of: str = "run",
              **switches) -> Iterator[subprocess.Popen | None]:
    """start(...) for the duration of the block (the caller's compiling), stopped at its end."""
    proc = start(model, cache_types, ahead_of=ahead_of, **switches)
    try:
        yield proc
    finally:
        if proc is not None:
            stop(proc)


def compile_ahead(model: "Model", cache_type: str) -> None:
    """What a run compiles after its first layer kind, the kernels that need no layer matrix code
    first (the run reaches them late, and the layer halves' shared matrix code takes the helper as
    long as it takes the run): the output head on a verify-sized batch and a token, sampling's
    top-k; then one forward of each through the first layer of each other kind (its mixer half,
    then its FFN half) and the MTP head's drafts and catch-up (warmup.compile_head). Nothing unless
    `model` is a fused CPU trunk with a second layer kind (with one kind, the run's first layer
    compiles everything there is)."""
    import torch

    from ..decoding.sampling import top_k_rows
    from .config import Mode
    from .warmup import any_token, compile_head, trunk_view

    layers = other_kind_layers(model)
    if model.binder.config.mode is not Mode.CPU_FUSED or model.plan is not None or not layers:
        return
    token = any_token(model)

    def forwards(view: "Model") -> "Model":
        session = view.session(n_ctx=64, cache_type=cache_type, k_max=4)
        session.eval([token] * 4, logits="all")
        session.eval([token], logits="last")
        return view
    forwards(trunk_view(model, []))            # the output head alone
    top_k_rows(torch.zeros(2, 160), 40)
    compile_head(forwards(trunk_view(model, layers)), cache_type)


def compile_cache_types(model: "Model", cache_types: Sequence[str]) -> None:
    """warmup.compile_kernels' passes for `cache_types` over the layers whose attention half reads
    the KV cache (the first of each warmup.layer_signature): its kernels are compiled once per cache
    type, while the Gated DeltaNet and FFN halves, the prompt GEMMs and the output head are the
    same for every type and compile in the caller's first pass. Nothing unless `model` is a fused
    CPU trunk."""
    from .config import Mode
    from .warmup import compile_cache_type, signature_layers, trunk_view

    if model.binder.config.mode is not Mode.CPU_FUSED or model.plan is not None:
        return
    view = trunk_view(model, [layer for layer in signature_layers(model) if layer.attention is not None])
    for cache_type in cache_types:
        compile_cache_type(view, cache_type)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="compile a model's CPU kernels in parallel with a cold `hybridrt "
                                             "run`, `serve` or `warmup` (which start it; not meant to be called "
                                             "by hand)")
    ap.add_argument("model")
    ap.add_argument("--cache-type", default="f16", help="KV cache types, comma-separated (run: one)")
    ap.add_argument("--ahead-of", choices=("run", "warmup"), default="run")
    ap.add_argument("--exact", type=int, choices=(0, 1))
    ap.add_argument("--act-residual", type=int, choices=(0, 1))
    args = ap.parse_args(argv)
    from .loader import load_model

    model = load_model(args.model, threads=1,
                       exact_activations=None if args.exact is None else bool(args.exact),
                       act_residual=None if args.act_residual is None else bool(args.act_residual))
    cache_types = args.cache_type.split(",")
    if args.ahead_of == "run":
        compile_ahead(model, cache_types[0])
    else:
        compile_cache_types(model, cache_types)


if __name__ == "__main__":
    main()
