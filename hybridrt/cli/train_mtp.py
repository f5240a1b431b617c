"""`hybridrt train-mtp`: train an MTP draft head for a target that has none (hybridrt/train_mtp)."""
from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import typer

from .options import JSON
from ..errors import UserError
from ..train_mtp.config import TrainConfig

# the option defaults are TrainConfig's (its fields' defaults: an instance would validate, and that
# imports torch)
DEFAULTS = SimpleNamespace(**{f.name: f.default for f in fields(TrainConfig)})

MODEL_HELP = "GGUF path or a known name (gemma3-270m, smollm2-135m) of the target"


def _reuse_freed_memory() -> None:
    """Keep freed memory in this process for reuse (glibc only; elsewhere a no-op). Training makes
    and drops tens-of-megabyte tensors every step (the loss's [batch, tokens, draft vocabulary]
    terms, the teacher's bfloat16 logits), which glibc serves from fresh mmaps: every page of every
    one faulted in anew (68 M minor faults in one Gemma 3 run). Served from the heap instead, a
    training step took 0.53 s instead of 0.66 s and the teacher wrote 491 instead of 468 t/s. The
    cost, a resident size that stays at its peak, suits a command that ends when training does."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_max = -1, -4
        libc.mallopt(m_mmap_max, 0)                      # no mmap for large blocks
        libc.mallopt(m_trim_threshold, 1 << 62)          # never give the heap's top back
    except (OSError, AttributeError):                    # not glibc (musl has no mallopt)
        pass


def train_mtp(
    model: str = typer.Option(..., "-m", "--model", help=MODEL_HELP),
    out: Path = typer.Option(..., "-o", "--out", help="The head GGUF to write (HEAD.gguf.data.pt and HEAD.gguf.ckpt are kept beside it so a run resumes)."),
    tokens: int = typer.Option(DEFAULTS.tokens, "--tokens", help="Training tokens the target generates for itself."),
    steps: int = typer.Option(DEFAULTS.steps, "--steps", help="Optimizer steps (early stopping by held-out acceptance may end sooner)."),
    draft_vocab: int = typer.Option(DEFAULTS.draft_vocab, "--draft-vocab", help="Output rows of the head: the most frequent tokens of the target's own text (0: the full vocabulary)."),
    seed: int = typer.Option(DEFAULTS.seed, "--seed", help="Every random choice (text sampling, batches) follows it."),
    threads: Optional[int] = typer.Option(None, "-t", "--threads", help="CPU threads (default: all cores)."),
    loss: str = typer.Option(DEFAULTS.loss, "--loss", help="kl: KL to the target's logits over the draft vocabulary; argmax: cross-entropy to their argmax."),
    lr: float = typer.Option(DEFAULTS.lr, "--lr", help="Peak learning rate (AdamW, warm-up then cosine)."),
    batch: int = typer.Option(DEFAULTS.batch, "--batch", help="Sequences per step."),
    gen_len: int = typer.Option(DEFAULTS.gen_len, "--gen-len", help="Tokens per training continuation."),
    eval_every: int = typer.Option(DEFAULTS.eval_every, "--eval-every", help="Steps between held-out evaluations."),
    clip: float = typer.Option(DEFAULTS.clip, "--clip", help="Clip the gradient's norm to this (0: no clipping)."),
    patience: int = typer.Option(DEFAULTS.patience, "--patience", help="Stop after this many evaluations without a better acceptance."),
    head_type: str = typer.Option(DEFAULTS.head_type, "--head-type", help="Storage of the head's matrices: q8_0, q4_1 (half the bytes, a cheaper draft), f16, f32."),
    head_ffn_layers: int = typer.Option(DEFAULTS.head_ffn_layers, "--head-ffn-layers", help="The head block's FFN starts as the target's last N layers' FFNs side by side (N times as wide, a costlier draft): learns faster early, no better after the default steps."),
    full_teacher_vocab: bool = typer.Option(DEFAULTS.full_teacher_vocab, "--full-teacher-vocab", help="The teacher writes all its text over the whole vocabulary (default: after its first 64 steps, only over the ids those steps ranked in a top-40; Gemma 3's text ~1.6x faster)."),
    for_lookup: bool = typer.Option(DEFAULTS.for_lookup, "--for-lookup", help="A head to draft behind prompt lookup (--spec-type ngram-simple,draft-mtp): it learns only at positions where the lookup has no match, and is chosen by its acceptance behind the lookup."),
    as_json: bool = JSON,
):
    """Train an MTP (NextN) draft head by self-distillation: the target writes its own text, the head
    learns the target's token after next; use it with --spec-type draft-mtp --mtp-head HEAD.gguf."""
    import torch

    from ..runtime.loader import load_model
    from ..models.mtp_head import head_target
    from ..train_mtp.train import train_mtp as run_training

    cfg = TrainConfig(tokens=tokens, steps=steps, draft_vocab=draft_vocab, seed=seed, loss=loss, lr=lr,
                      batch=batch, gen_len=gen_len, eval_every=eval_every, clip=clip, patience=patience,
                      head_type=head_type, head_ffn_layers=head_ffn_layers, full_teacher_vocab=full_teacher_vocab,
                      for_lookup=for_lookup)
    if not out.parent.exists():
        raise UserError(f"-o {out}: directory {out.parent} does not exist")
    _reuse_freed_memory()
    m = load_model(model, threads=threads)
    torch.set_num_threads(threads or torch.get_num_threads() or 1)
    head_target(m.arch)      # an unsupported target is one error line before any work
    r = run_training(m, out, cfg)         # progress on stderr either way: --json's object is stdout's
    summary = {"head": str(r.path), "heldout_acceptance": r.acceptance, "heldout_acceptance_n_max_1": r.acceptance_n_max_1,
               "heldout_acceptance_lookup_first": r.acceptance_lookup_first,
               "steps": r.steps, "draft_vocab": r.draft_vocab,
               "train_tokens": r.n_train_tokens, "wall_s": round(r.wall_s, 1), "cpu_s": round(r.cpu_s, 1),
               "history": r.history}
    if as_json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"wrote {r.path}: held-out greedy acceptance {r.acceptance:.1%} per position, "
              f"{r.acceptance_n_max_1:.1%} of drafts at --spec-draft-n-max 1, {r.acceptance_lookup_first:.1%} per "
              f"position behind prompt lookup (--spec-type ngram-simple,draft-mtp), after {r.steps} steps, "
              f"draft vocabulary {r.draft_vocab}, {r.n_train_tokens} training tokens, "
              f"{r.wall_s:.0f} s wall / {r.cpu_s:.0f} s CPU")
