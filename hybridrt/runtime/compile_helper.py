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

The helper runs its forwards on one thread, prints nothing, and is stopped when the run exits. It
starts on a cold cache with more than one core, for a CPU run without a plan, and stops at once
unless the model is a fused CPU trunk with a second layer kind (qwen35, qwen35moe, qwen3next).
"""
from __future__ import annotations

import argparse
import atexit
import copy
import os
import subprocess
import sys
from typing import TYPE_CHECKING

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


def start(model: str | os.PathLike | None, cache_type: str, exact: bool | None = None,
          act_residual: bool | None = None) -> subprocess.Popen | None:
    """On a cold kernel cache (the fused attention half never compiled), a helper that loads `model`
    (a path or a known name, already pulled) on the CPU as the caller is about to, with the same
    numerics switches (None: the environment's, which it inherits), and compiles what compile_ahead
    lists for sessions of `cache_type`; stopped at exit. Started before the caller's own load, so
    that both load at once. None on one core or a warm cache (the helper itself stops early where
    the model is not a fused CPU trunk with two layer kinds)."""
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
    cmd = [sys.executable, "-m", "hybridrt.runtime.compile_helper", os.fspath(path), "--cache-type", cache_type]
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
    from .warmup import compile_head

    layers = other_kind_layers(model)
    if model.binder.config.mode is not Mode.CPU_FUSED or model.plan is not None or not layers:
        return
    token = model.tokenizer.bos_id if model.tokenizer.bos_id is not None else 0
    view = copy.copy(model)
    for view.layers in ([], layers):
        session = view.session(n_ctx=64, cache_type=cache_type, k_max=4)
        session.eval([token] * 4, logits="all")
        session.eval([token], logits="last")
        if not view.layers:
            top_k_rows(torch.zeros(2, 160), 40)
    compile_head(view, cache_type)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="compile a model's CPU kernels in parallel with a cold `hybridrt "
                                             "run` (which starts it; not meant to be called by hand)")
    ap.add_argument("model")
    ap.add_argument("--cache-type", default="f16")
    ap.add_argument("--exact", type=int, choices=(0, 1))
    ap.add_argument("--act-residual", type=int, choices=(0, 1))
    args = ap.parse_args(argv)
    from .loader import load_model

    model = load_model(args.model, threads=1,
                       exact_activations=None if args.exact is None else bool(args.exact),
                       act_residual=None if args.act_residual is None else bool(args.act_residual))
    compile_ahead(model, args.cache_type)


if __name__ == "__main__":
    main()
