"""Rotary position embeddings, precomputed once per session for every position of the context.

Two pairings exist in GGUF models: "normal" rotates adjacent pairs (x[2i], x[2i+1]) — llama.cpp's
LLAMA_ROPE_TYPE_NORM, used by `llama` because its converter permutes q/k — and "neox" rotates
(x[i], x[i + n_rot/2]) — qwen3, gemma3, qwen35. Only the first n_rot dims of a head rotate.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .triton_rotary import fits as triton_rotary_fits
from .triton_rotary import rotary_triton


@dataclass
class RotaryTable:
    cos: torch.Tensor   # [n_ctx, n_rot/2] float32
    sin: torch.Tensor
    n_rot: int
    neox: bool


def rotary_table(n_ctx: int, n_rot: int, base: float, neox: bool, scale: float = 1.0,
                 device: torch.device | str = "cpu") -> RotaryTable:
    # the angle is formed in float64 and rounded once, so long positions keep their precision
    inv_freq = base ** (-torch.arange(0, n_rot, 2, dtype=torch.float64) / n_rot)
    pos = torch.arange(n_ctx, dtype=torch.float64) * scale
    angles = torch.outer(pos, inv_freq)
    return RotaryTable(angles.cos().float().to(device), angles.sin().float().to(device), n_rot, neox)


@dataclass
class RotaryRows:
    """cos/sin of a run of positions, gathered once per forward and shared by every layer."""
    cos: torch.Tensor   # [tokens, 1, n_rot/2]
    sin: torch.Tensor
    n_rot: int
    neox: bool


def rotary_rows(table: RotaryTable, start: int, n: int) -> RotaryRows:
    return RotaryRows(table.cos[start:start + n].unsqueeze(1), table.sin[start:start + n].unsqueeze(1),
                      table.n_rot, table.neox)


def rotary_rows_at(table: RotaryTable, positions: torch.Tensor) -> RotaryRows:
    """The rows of `positions` (an int64 tensor on the table's device): the same values as
    rotary_rows, gathered by the device, so a captured graph reads each step's positions."""
    return RotaryRows(table.cos.index_select(0, positions).unsqueeze(1),
                      table.sin.index_select(0, positions).unsqueeze(1), table.n_rot, table.neox)


def apply_rotary(x: torch.Tensor, rows: RotaryRows) -> torch.Tensor:
    """x: [tokens, heads, head_dim] at the positions `rows` was gathered for. Returns a new tensor."""
    if x.is_cuda and triton_rotary_fits(x, rows):         # one launch instead of about ten
        return rotary_triton(x, rows.cos, rows.sin, rows.n_rot, rows.neox)
    n_rot, half, cos, sin = rows.n_rot, rows.n_rot // 2, rows.cos, rows.sin
    rot, rest = x[..., :n_rot], x[..., n_rot:]
    if rows.neox:
        a, b = rot[..., :half], rot[..., half:]
        out = torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)
    else:
        a, b = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2)
    return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out
