"""Float64 reference forward for ``gemma3``.

From llama.cpp's gemma3 graph and hparams loader (facts only):
* h = token_embd[t] * sqrt(n_embd); the head is tied to token_embd when output.weight is absent;
* per layer: a = Attention(RMSNorm(h; attn_norm)); h += RMSNorm(a; post_attention_norm);
  f = FFN(RMSNorm(h; ffn_norm)); h += RMSNorm(f; post_ffw_norm); then output_norm and the head;
* attention: per-head RMSNorm of q and k (attn_q_norm, attn_k_norm), NeoX rotary over the whole
  head (key_length), scale 1/sqrt(key_length), GQA;
* layer i is global iff i % 6 == 5 (rope.freq_base, full causal); the others are local: rope base
  10000 and each query at p sees keys at p - sliding_window < p0 <= p;
* FFN = down(gelu_tanh(gate x) * up x);
* every norm weight already carries the converter's +1.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from .common import GGUFWeights, output_head, rms_norm, rope

SWA_PATTERN = 6
LOCAL_ROPE_BASE = 10000.0


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))


def windowed_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, positions: np.ndarray,
                       window: int) -> np.ndarray:
    """Teacher-forced GQA attention over the same T positions; q [T, H, d], k/v [T, Hkv, d].
    window 0 is plain causal; otherwise key p0 is visible from query p iff p - window < p0 <= p."""
    n_head, n_kv, d = q.shape[1], k.shape[1], q.shape[2]
    group = n_head // n_kv
    dist = positions[:, None] - positions[None, :]          # query minus key position
    visible = dist >= 0
    if window:
        visible &= dist < window
    out = np.empty_like(q)
    for h in range(n_head):
        scores = q[:, h, :] @ k[:, h // group, :].T / np.sqrt(d)
        scores = np.where(visible, scores, -np.inf)
        scores -= scores.max(axis=1, keepdims=True)
        p = np.exp(scores)
        p /= p.sum(axis=1, keepdims=True)
        out[:, h, :] = p @ v[:, h // group, :]
    return out


class RefGemma3:
    def __init__(self, path: str | Path):
        W = self.W = GGUFWeights(path)
        if W.arch != "gemma3":
            raise ValueError(f"RefGemma3 handles gemma3, not {W.arch}")
        self.n_embd = W.arch_meta("embedding_length")
        self.n_layer = W.arch_meta("block_count")
        self.n_head = W.arch_meta("attention.head_count")
        self.n_head_kv = W.arch_meta("attention.head_count_kv", self.n_head)
        self.head_dim = W.arch_meta("attention.key_length", self.n_embd // self.n_head)
        self.n_rot = W.arch_meta("rope.dimension_count", self.head_dim)
        self.rope_base = W.arch_meta("rope.freq_base", 1e6)
        self.eps = W.arch_meta("attention.layer_norm_rms_epsilon")
        self.window = W.arch_meta("attention.sliding_window", 0)

    def is_local(self, il: int) -> bool:
        return bool(self.window) and il % SWA_PATTERN != SWA_PATTERN - 1

    def _attention(self, il: int, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        W, p, T, d = self.W, f"blk.{il}", x.shape[0], self.head_dim
        q = (x @ W(f"{p}.attn_q.weight").T).reshape(T, self.n_head, d)
        k = (x @ W(f"{p}.attn_k.weight").T).reshape(T, self.n_head_kv, d)
        v = (x @ W(f"{p}.attn_v.weight").T).reshape(T, self.n_head_kv, d)
        q = rms_norm(q, W(f"{p}.attn_q_norm.weight"), self.eps)
        k = rms_norm(k, W(f"{p}.attn_k_norm.weight"), self.eps)
        local = self.is_local(il)
        base = LOCAL_ROPE_BASE if local else self.rope_base
        q = rope(q, positions, self.n_rot, base, neox=True)
        k = rope(k, positions, self.n_rot, base, neox=True)
        o = windowed_attention(q, k, v, positions, self.window if local else 0)
        return o.reshape(T, self.n_head * d) @ W(f"{p}.attn_output.weight").T

    def _ffn(self, il: int, x: np.ndarray) -> np.ndarray:
        W, p = self.W, f"blk.{il}"
        g = gelu_tanh(x @ W(f"{p}.ffn_gate.weight").T)
        return (g * (x @ W(f"{p}.ffn_up.weight").T)) @ W(f"{p}.ffn_down.weight").T

    def hidden(self, tokens) -> np.ndarray:
        """Post-output_norm hidden states [T, n_embd]."""
        W, eps = self.W, self.eps
        tokens = np.asarray(tokens, dtype=np.int64)
        positions = np.arange(len(tokens))
        h = W("token_embd.weight")[tokens] * np.sqrt(self.n_embd)
        for il in range(self.n_layer):
            p = f"blk.{il}"
            a = self._attention(il, rms_norm(h, W(f"{p}.attn_norm.weight"), eps), positions)
            h = h + rms_norm(a, W(f"{p}.post_attention_norm.weight"), eps)
            f = self._ffn(il, rms_norm(h, W(f"{p}.ffn_norm.weight"), eps))
            h = h + rms_norm(f, W(f"{p}.post_ffw_norm.weight"), eps)
        return rms_norm(h, W("output_norm.weight"), eps)

    def forward(self, tokens) -> np.ndarray:
        """Teacher-forced logits [T, n_vocab], float64."""
        return self.hidden(tokens) @ output_head(self.W).T
