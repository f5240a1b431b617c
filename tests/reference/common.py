"""Shared pieces of the float64 references: weights from gguf-py, norms, rotary, attention."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import gguf
from gguf.quants import dequantize


class GGUFWeights:
    """Metadata and float64 weights of one GGUF file, read with gguf-py only."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.reader = gguf.GGUFReader(self.path)
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.arch = self.meta("general.architecture")
        self._cache: dict[str, np.ndarray] = {}

    def meta(self, key: str, default=None):
        f = self.reader.fields.get(key)
        return default if f is None else f.contents()

    def arch_meta(self, key: str, default=None):
        return self.meta(f"{self.arch}.{key}", default)

    def has(self, name: str) -> bool:
        return name in self.tensors

    def __call__(self, name: str) -> np.ndarray:
        """float64 array in numpy order: [rows, row length] for matrices, [n] for vectors."""
        if name not in self._cache:
            t = self.tensors[name]
            x = dequantize(np.asarray(t.data), t.tensor_type)
            shape = tuple(int(n) for n in reversed(t.shape.tolist()))
            self._cache[name] = np.asarray(x, dtype=np.float64).reshape(shape)
        return self._cache[name]


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def softplus(x: np.ndarray) -> np.ndarray:
    return np.logaddexp(0.0, x)


def rope(x: np.ndarray, positions: np.ndarray, n_rot: int, base: float, neox: bool) -> np.ndarray:
    """Rotary embedding on the first ``n_rot`` dims of each head; x is [T, heads, head_dim].

    NeoX pairs dim i with i + n_rot/2 (qwen3, qwen35: M-RoPE with equal positions reduces to it);
    ggml's "norm" mode (llama) pairs dims 2i and 2i+1. theta_i = pos * base^(-2i/n_rot).
    """
    half = n_rot // 2
    inv_freq = base ** (-np.arange(half, dtype=np.float64) * 2.0 / n_rot)
    ang = positions.astype(np.float64)[:, None] * inv_freq[None, :]       # [T, half]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    out = x.copy()
    if neox:
        a, b = x[..., :half], x[..., half:n_rot]
        out[..., :half] = a * cos - b * sin
        out[..., half:n_rot] = a * sin + b * cos
    else:
        a, b = x[..., 0:n_rot:2], x[..., 1:n_rot:2]
        out[..., 0:n_rot:2] = a * cos - b * sin
        out[..., 1:n_rot:2] = a * sin + b * cos
    return out


@dataclass
class KVCache:
    """Keys and values by absolute position for one attention layer ([heads_kv, head_dim] each)."""
    k: dict[int, np.ndarray] = field(default_factory=dict)
    v: dict[int, np.ndarray] = field(default_factory=dict)


def attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, positions: np.ndarray,
           cache: KVCache) -> np.ndarray:
    """Causal GQA attention. q [T, H, d], k/v [T, Hkv, d] for ``positions``; the cache is updated
    and each query sees every cached position <= its own. Returns [T, H, d]."""
    for i, p in enumerate(positions):
        cache.k[int(p)], cache.v[int(p)] = k[i], v[i]
    keys = sorted(cache.k)
    K = np.stack([cache.k[p] for p in keys])      # [S, Hkv, d]
    V = np.stack([cache.v[p] for p in keys])
    kpos = np.array(keys)
    n_head, n_kv, d = q.shape[1], K.shape[1], q.shape[2]
    group = n_head // n_kv
    out = np.empty_like(q)
    for h in range(n_head):
        kh = h // group
        scores = q[:, h, :] @ K[:, kh, :].T / np.sqrt(d)                 # [T, S]
        scores = np.where(kpos[None, :] <= positions[:, None], scores, -np.inf)
        scores -= scores.max(axis=1, keepdims=True)
        p = np.exp(scores)
        p /= p.sum(axis=1, keepdims=True)
        out[:, h, :] = p @ V[:, kh, :]
    return out


def swiglu_ffn(W: GGUFWeights, prefix: str, x: np.ndarray) -> np.ndarray:
    gate = x @ W(f"{prefix}.ffn_gate.weight").T
    up = x @ W(f"{prefix}.ffn_up.weight").T
    return (silu(gate) * up) @ W(f"{prefix}.ffn_down.weight").T


def output_head(W: GGUFWeights) -> np.ndarray:
    """[n_vocab, n_embd]; tied to the token embeddings when output.weight is absent."""
    return W("output.weight") if W.has("output.weight") else W("token_embd.weight")
