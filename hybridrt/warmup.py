"""First run: compile the CPU (Numba) kernels ahead, and say so when it is about to happen.

Numba compiles a kernel at its first call and caches the machine code on disk (`cache=True`;
`__pycache__` beside the source, or NUMBA_CACHE_DIR). A cold cache costs tens of seconds before
the first token, silently. `kernels_cold()` tells cold from warm without compiling anything: it
reads the cache index of each top-level kernel a model calls (a small pickle that Numba itself
discards when the kernel's source changed). `announce_and_compile` prints one line on a cold cache
and compiles by running one token through the model: every kernel then gets exactly the
signatures (array types, read-only mmap views) that real decoding uses, and nothing more.
"""
from __future__ import annotations

import os
import sys
import time
from typing import TYPE_CHECKING, Optional

import typer

if TYPE_CHECKING:       # torch stays unimported for `info` and `plan`, which import the CLI
    from .models.base import Model

MESSAGE = "compiling CPU kernels (first run only) ..."


def _dispatchers() -> list:
    """The Numba kernels a model calls from Python (the rest are compiled into these): the
    k-input matvec, the fused gate/up FFN, the row decoder behind embedding gathers and
    load-time dequantization, and the fused layer halves of a CPU trunk."""
    from cpu_kernels import blocks, ffn, layer_fused, matvec, matvec_int

    fused = [layer_fused.attention_block, layer_fused.ffn_block] if layer_fused.FUSED_DEFAULT else []
    # the path quantized matrices take by default: integer kernels on int8 activations, or the float
    # ones with HYBRIDRT_EXACT_ACTIVATIONS (kernels the run never calls would read as cold forever)
    if matvec.EXACT_DEFAULT:
        return [matvec._matvec_kernel, ffn._gate_up_kernel, blocks.decode_rows] + fused
    # (with fused layer halves, batches of 1-3 tokens never reach ffn's row kernel: the FFN half
    # takes every batch up to ROWWISE_MAX tokens)
    gate_up = [] if fused else [ffn._gate_up_int_kernel]
    return [matvec_int._matvec_int_kernel, matvec_int._matvec_tiled_kernel, ffn._gate_up_tiled_kernel,
            blocks.decode_rows] + gate_up + fused


def kernels_cold() -> bool:
    """True when some kernel has no usable cached machine code (it will compile at first use)."""
    for dispatcher in _dispatchers():
        try:
            if not dispatcher._cache._cache_file._load_index():
                return True
        except (AttributeError, OSError, EOFError, ValueError):
            return True     # no cache we can read: assume the worst, which only costs a message
    return False


def compile_kernels(model: "Model") -> None:
    """Batches of 1, 4, 16 and 40 tokens: compiles (or loads) every kernel the model uses, for decode
    and verify (row kernels, or the fused layer halves of a CPU trunk, which take batches up to
    ROWWISE_MAX tokens) and prompts (cpu_kernels.matvec_int's tiled kernels on token groups and
    lanes; a batch past ROWWISE_MAX reaches them through the torch trunk), each for the model's
    quant types only."""
    session = model.session(n_ctx=64)
    token = model.tokenizer.bos_id if model.tokenizer.bos_id is not None else 0
    for k in (1, 4, 16, 40):
        session.eval([token] * k, logits="last")


def announce_and_compile(model: "Model | str | os.PathLike | None") -> bool:
    """On a cold kernel cache: print MESSAGE on stderr and compile what `model` needs (a loaded
    Model, or a path / known name: then it is loaded here, which compiles the load-time kernels
    after the message rather than before it). On a warm cache: nothing. Returns whether it
    compiled. Call it before `load_model` with the name, or after with the model."""
    if not kernels_cold():
        return False
    if model is None or isinstance(model, (str, os.PathLike)):
        from .gguf_file import GGUFFile
        from .registry import resolve_model

        GGUFFile(resolve_model(model))      # a bad path or file stays one error line, no message first
    print(MESSAGE, file=sys.stderr, flush=True)
    if model is None or isinstance(model, (str, os.PathLike)):
        from .loader import load_model

        model = load_model(model)
    compile_kernels(model)
    return True


def warmup(
    model: Optional[str] = typer.Option(None, "-m", "--model",
                                        help="GGUF path or a known name (gemma3-270m, smollm2-135m); default gemma3-270m"),
):
    """Compile the CPU kernels a model needs ahead of its first run (cached on disk)."""
    from .loader import load_model

    t0 = time.perf_counter()
    cold = kernels_cold()
    if cold:
        print(MESSAGE, file=sys.stderr, flush=True)
    m = load_model(model)
    compile_kernels(m)
    took = time.perf_counter() - t0
    where = os.environ.get("NUMBA_CACHE_DIR") or "__pycache__ beside the kernels"
    print(f"CPU kernels {'compiled' if cold else 'already compiled'} for {os.path.basename(m.gguf.path)} "
          f"in {took:.1f} s (cache: {where})", file=sys.stderr)
