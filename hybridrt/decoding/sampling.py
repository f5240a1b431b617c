"""Turning logits into tokens: llama.cpp's sampler chain (top-k, top-p, min-p, then temperature).

`filtered_probs` is the single definition of "the distribution we sample from", so plain sampling
and speculative acceptance (which must transform the target and the draft identically) share it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from cpu_kernels.top_k import top_k_bits

from ..errors import UserError

if TYPE_CHECKING:
    from .constraint import Constraint

TOP_K_KERNEL_MAX = 256      # cpu_kernels.top_k keeps its k best sorted by insertion: for small k


@dataclass(frozen=True)
class SamplerConfig:
    temp: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int = -1

    def __post_init__(self):
        # `not (a <= x <= b)` rather than `x < a or x > b`: NaN fails every comparison. A negative
        # temperature is greedy, as in llama.cpp
        if not -math.inf < self.temp < math.inf:
            raise UserError(f"--temp must be a finite number, got {self.temp}")
        if not 0.0 < self.top_p <= 1.0:
            raise UserError(f"--top-p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise UserError(f"--min-p must be in [0, 1], got {self.min_p}")
        if self.top_k < 0:
            raise UserError(f"--top-k must be >= 0 (0: off), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temp <= 0.0


def make_generator(seed: int) -> torch.Generator:
    gen = torch.Generator()
    gen.manual_seed(seed if seed >= 0 else torch.seed() & 0x7FFFFFFF)
    return gen


def top_k_rows(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, ids) of the k largest of each row of logits [n, V], largest first, as
    torch.topk(sorted=True). CPU float32 / bfloat16 rows with a small k go through
    cpu_kernels.top_k (equal values: lower id first): one pass a row, 81 us against torch.topk's
    434 us for Gemma 3's 262,144-token row on one thread (3 % of a sampled decode step); on the
    train-mtp teacher's 256 such rows a step (bfloat16, 2 threads) a fifth of torch.topk's time."""
    if (logits.device.type != "cpu" or logits.dtype not in (torch.float32, torch.bfloat16) or logits.dim() != 2
            or k > TOP_K_KERNEL_MAX or logits.shape[1] < 4 * k):
        return torch.topk(logits, k, dim=-1, sorted=True)
    logits = logits.contiguous()
    ids = np.empty((logits.shape[0], k), np.int64)
    if logits.dtype == torch.bfloat16:
        top_k_bits(logits.view(torch.int16).numpy().view(np.uint16), 15, ids)
    else:
        top_k_bits(logits.view(torch.int32).numpy().view(np.uint32), 31, ids)
    ids = torch.from_numpy(ids)
    return logits.gather(1, ids), ids


def filtered_probs(logits: torch.Tensor, cfg: SamplerConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """For each row of logits [k, V]: candidate ids [k, m] and their probabilities [k, m] after
    top-k, top-p and min-p (on the untempered distribution, as llama.cpp orders its chain) and
    then temperature. Entries cut by top-p/min-p have probability exactly 0."""
    logits = logits.float()
    k = cfg.top_k if 0 < cfg.top_k < logits.shape[-1] else logits.shape[-1]
    top_logits, ids = top_k_rows(logits, k)
    keep = torch.ones_like(top_logits, dtype=torch.bool)
    if cfg.top_p < 1.0 or cfg.min_p > 0.0:
        p = torch.softmax(top_logits, dim=-1)
        if cfg.top_p < 1.0:
            # keep the smallest prefix whose mass reaches top_p (always at least one token)
            before = torch.cumsum(p, dim=-1) - p
            keep &= before < cfg.top_p
        if cfg.min_p > 0.0:
            keep &= p >= cfg.min_p * p[..., :1]
        keep[..., 0] = True
    scaled = top_logits / cfg.temp
    scaled = scaled.masked_fill(~keep, float("-inf"))
    return ids, torch.softmax(scaled, dim=-1)


def dense_probs(logits: torch.Tensor, cfg: SamplerConfig) -> torch.Tensor:
    """filtered_probs scattered back to full-vocabulary rows [k, V]."""
    ids, probs = filtered_probs(logits, cfg)
    out = torch.zeros(logits.shape, dtype=torch.float32)
    return out.scatter_(-1, ids, probs)


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """The first index of the maximum of each row of logits [k, V] (the last dimension).
    numpy's argmax on CPU float32 rows: torch.argmax over Gemma 3's 262,144-token row took ~360 us
    on one thread here, numpy's ~13 us (2.7 % of a decode step). Ties and NaNs as torch: the first."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return np.argmax(logits.detach().numpy(), axis=-1).reshape(-1).tolist()
    return torch.argmax(logits, dim=-1).reshape(-1).tolist()


def sample_token(logits_row: torch.Tensor, cfg: SamplerConfig, gen: torch.Generator,
                 constraint: "Constraint | None" = None) -> int:
    """A token from logits_row [V]: its argmax at temp 0, else a draw from filtered_probs. Under a
    constraint the row's forbidden tokens are set to -inf first (in place): greedy is the argmax over
    the allowed tokens, a draw comes from the distribution renormalized over them (the chain runs on
    the masked row, as llama.cpp applies a grammar before its other samplers)."""
    if constraint is not None:
        constraint.apply(logits_row)
    if cfg.greedy:
        return argmax_rows(logits_row)[0]
    ids, probs = filtered_probs(logits_row.unsqueeze(0), cfg)
    choice = torch.multinomial(probs[0], 1, generator=gen)
    return int(ids[0, choice])
