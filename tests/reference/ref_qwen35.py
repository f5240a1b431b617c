"""Float64 reference forward for ``qwen35`` (Gated DeltaNet hybrid, gated attention, MTP),
``qwen35moe`` (qwen35 with an MoE FFN in every block, the MTP block's too) and ``qwen3next`` (the
same trunk with grouped value heads, a packed ``ssm_ba`` and an MoE FFN).

Straight from the reference notes:
* layer i is Gated DeltaNet iff (i + 1) % full_attention_interval != 0, for i < n_layer;
* GDN: qkv/z/beta/alpha projections, causal depthwise conv with K-1 inputs of state, SiLU,
  per-head L2 norm x / sqrt(sum x^2 + eps), value head j reads key head j % Hk (tiled order),
  q *= 1/sqrt(d), g = ssm_a * softplus(alpha + dt_bias), beta = sigmoid(b), and per token
  S = exp(g) S; u = beta (v - S^T k); S += k u^T; o = S^T q; then RMSNorm(o; ssm_norm) * silu(z);
* full attention: attn_q rows hold [q_h | gate_h] per head; RMSNorm on q and k per head; NeoX
  rotary on the first rope.dimension_count dims; GQA; output * sigmoid(gate); attn_output;
* blocks: h += mixer(attn_norm h); h += FFN(post_attention_norm h); output_norm; output (tied if
  output.weight is absent);
* qwen3next (llama.cpp's qwen3next graph): b and a come from one ``ssm_ba`` projection whose
  outputs are, per key head g, [b of value heads g*r .. g*r+r-1 | a of them] (r = Hv/Hk); value
  head j reads key head j // r; the FFN is a mixture of experts: p = softmax(ffn_gate_inp x), the
  expert_used_count largest p renormalised to sum 1, each expert a SwiGLU (ffn_{gate,up,down}_exps),
  plus the shared SwiGLU expert (ffn_*_shexp) times sigmoid(ffn_gate_inp_shexp . x);
* qwen35moe (llama.cpp's qwen35moe graph): qwen35's GDN and attention with that MoE FFN, in the
  MTP block as well;
* MTP step: x = eh_proj [enorm(embed t) ; hnorm(h_prev)], one full-attention block with its own
  KV cache and FFN, hidden = RMSNorm(x; shared_head_norm, else output_norm), logits = head(hidden).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .common import (GGUFWeights, KVCache, attend, output_head, rms_norm, rope, sigmoid, silu,
                     softplus, swiglu_ffn)


@dataclass
class GDNState:
    conv: np.ndarray          # [K-1, conv_dim]: the last K-1 pre-conv qkv inputs
    S: np.ndarray             # [Hv, d_k, d_v]


@dataclass
class MTPCache:
    """The MTP block's own attention KV, by position."""
    kv: KVCache = field(default_factory=KVCache)


class RefQwen35:
    def __init__(self, path: str | Path):
        W = self.W = GGUFWeights(path)
        if W.arch not in ("qwen35", "qwen35moe", "qwen3next"):
            raise ValueError(f"RefQwen35 handles qwen35, qwen35moe and qwen3next, not {W.arch}")
        self.n_embd = W.arch_meta("embedding_length")
        self.n_mtp = W.arch_meta("nextn_predict_layers", 0)
        self.n_layer = W.arch_meta("block_count") - self.n_mtp
        self.n_head = W.arch_meta("attention.head_count")
        self.n_head_kv = W.arch_meta("attention.head_count_kv")
        self.head_dim = W.arch_meta("attention.key_length")
        self.n_rot = W.arch_meta("rope.dimension_count")
        self.rope_base = W.arch_meta("rope.freq_base")
        self.eps = W.arch_meta("attention.layer_norm_rms_epsilon")
        self.interval = W.arch_meta("full_attention_interval", 4)
        self.d_conv = W.arch_meta("ssm.conv_kernel")
        self.d = W.arch_meta("ssm.state_size")
        self.hk = W.arch_meta("ssm.group_count")
        self.hv = W.arch_meta("ssm.time_step_rank")
        assert W.arch_meta("ssm.inner_size") == self.hv * self.d
        self.grouped_heads = W.arch == "qwen3next"
        self.n_expert_used = W.arch_meta("expert_used_count", 0)

    def is_recurrent(self, il: int) -> bool:
        return il < self.n_layer and (il + 1) % self.interval != 0

    # ------------------------------------------------------------ mixers

    def _gdn(self, il: int, x: np.ndarray, st: GDNState) -> np.ndarray:
        """x [T, n_embd] (already attn_norm'ed), state updated in place; returns [T, n_embd]."""
        W, p, T = self.W, f"blk.{il}", x.shape[0]
        d, hk, hv = self.d, self.hk, self.hv
        key_dim = hk * d
        qkv = x @ W(f"{p}.attn_qkv.weight").T                       # [T, conv_dim]
        z = (x @ W(f"{p}.attn_gate.weight").T).reshape(T, hv, d)
        if W.has(f"{p}.ssm_ba.weight"):
            r = hv // hk
            ba = (x @ W(f"{p}.ssm_ba.weight").T).reshape(T, hk, 2 * r)
            b, alpha = ba[..., :r].reshape(T, hv), ba[..., r:].reshape(T, hv)
        else:
            b, alpha = x @ W(f"{p}.ssm_beta.weight").T, x @ W(f"{p}.ssm_alpha.weight").T
        beta = sigmoid(b)                                            # [T, hv]
        g = W(f"{p}.ssm_a") * softplus(alpha + W(f"{p}.ssm_dt.bias"))   # [T, hv], <= 0
        conv_w = W(f"{p}.ssm_conv1d.weight")                         # [conv_dim, K]
        # qwen35: tiled V-head order; qwen3next: grouped
        key_head = np.arange(hv) // (hv // hk) if self.grouped_heads else np.arange(hv) % hk
        out = np.empty((T, hv, d))
        for t in range(T):
            window = np.concatenate([st.conv, qkv[t:t + 1]], axis=0)  # [K, conv_dim]
            st.conv = window[1:]
            c = silu(np.einsum("kc,ck->c", window, conv_w))
            q = c[:key_dim].reshape(hk, d)
            k = c[key_dim:2 * key_dim].reshape(hk, d)
            v = c[2 * key_dim:].reshape(hv, d)
            q = q / np.sqrt(np.sum(q * q, axis=-1, keepdims=True) + self.eps)
            k = k / np.sqrt(np.sum(k * k, axis=-1, keepdims=True) + self.eps)
            q = q[key_head] / np.sqrt(d)
            k = k[key_head]
            for h in range(hv):
                S = st.S[h] * np.exp(g[t, h])
                u = beta[t, h] * (v[h] - S.T @ k[h])
                S = S + np.outer(k[h], u)
                st.S[h] = S
                out[t, h] = S.T @ q[h]
        y = rms_norm(out, W(f"{p}.ssm_norm.weight"), self.eps) * silu(z)
        return y.reshape(T, hv * d) @ W(f"{p}.ssm_out.weight").T

    def _attention(self, il: int, x: np.ndarray, positions: np.ndarray, cache: KVCache):
        W, p, T, hd = self.W, f"blk.{il}", x.shape[0], self.head_dim
        qg = (x @ W(f"{p}.attn_q.weight").T).reshape(T, self.n_head, 2 * hd)
        q, gate = qg[..., :hd], qg[..., hd:]
        k = (x @ W(f"{p}.attn_k.weight").T).reshape(T, self.n_head_kv, hd)
        v = (x @ W(f"{p}.attn_v.weight").T).reshape(T, self.n_head_kv, hd)
        q = rms_norm(q, W(f"{p}.attn_q_norm.weight"), self.eps)
        k = rms_norm(k, W(f"{p}.attn_k_norm.weight"), self.eps)
        q = rope(q, positions, self.n_rot, self.rope_base, neox=True)
        k = rope(k, positions, self.n_rot, self.rope_base, neox=True)
        o = attend(q, k, v, positions, cache) * sigmoid(gate)
        return o.reshape(T, self.n_head * hd) @ W(f"{p}.attn_output.weight").T

    def _moe_ffn(self, p: str, x: np.ndarray) -> np.ndarray:
        W, k = self.W, self.n_expert_used
        logits = x @ W(f"{p}.ffn_gate_inp.weight").T                 # [T, n_expert]
        probs = np.exp(logits - logits.max(axis=1, keepdims=True))
        probs /= probs.sum(axis=1, keepdims=True)
        gate, up, down = (W(f"{p}.ffn_{n}_exps.weight") for n in ("gate", "up", "down"))
        out = np.zeros_like(x)
        for t in range(x.shape[0]):
            chosen = np.argsort(-probs[t], kind="stable")[:k]
            weights = probs[t, chosen] / probs[t, chosen].sum()
            for e, wt in zip(chosen, weights):
                out[t] += wt * (down[e] @ (silu(gate[e] @ x[t]) * (up[e] @ x[t])))
        shared = (silu(x @ W(f"{p}.ffn_gate_shexp.weight").T) * (x @ W(f"{p}.ffn_up_shexp.weight").T)
                  ) @ W(f"{p}.ffn_down_shexp.weight").T
        return out + shared * sigmoid(x @ W(f"{p}.ffn_gate_inp_shexp.weight"))[:, None]

    def _block(self, il: int, h: np.ndarray, mixer) -> np.ndarray:
        W, p = self.W, f"blk.{il}"
        h = h + mixer(rms_norm(h, W(f"{p}.attn_norm.weight"), self.eps))
        x = rms_norm(h, W(f"{p}.post_attention_norm.weight"), self.eps)
        return h + (self._moe_ffn(p, x) if W.has(f"{p}.ffn_gate_inp.weight") else swiglu_ffn(W, p, x))

    # ------------------------------------------------------------ trunk

    def new_gdn_state(self) -> GDNState:
        conv_dim = 2 * self.hk * self.d + self.hv * self.d
        return GDNState(conv=np.zeros((self.d_conv - 1, conv_dim)),
                        S=np.zeros((self.hv, self.d, self.d)))

    def hidden(self, tokens) -> np.ndarray:
        """Post-output_norm hidden states [T, n_embd] of the trunk (the MTP block is not run)."""
        W = self.W
        tokens = np.asarray(tokens, dtype=np.int64)
        positions = np.arange(len(tokens))
        h = W("token_embd.weight")[tokens]
        for il in range(self.n_layer):
            if self.is_recurrent(il):
                st = self.new_gdn_state()
                h = self._block(il, h, lambda x, il=il, st=st: self._gdn(il, x, st))
            else:
                cache = KVCache()
                h = self._block(il, h, lambda x, il=il, c=cache: self._attention(il, x, positions, c))
        return rms_norm(h, W("output_norm.weight"), self.eps)

    def forward(self, tokens) -> np.ndarray:
        """Teacher-forced logits [T, n_vocab], float64."""
        return self.hidden(tokens) @ output_head(self.W).T

    # ------------------------------------------------------------ MTP

    def new_mtp_cache(self) -> MTPCache:
        return MTPCache()

    def mtp_step(self, token: int, h_prev: np.ndarray, pos: int, cache: MTPCache):
        """One NextN draft step: ``token`` at position ``pos`` with ``h_prev``, the trunk's
        post-output_norm hidden at position pos - 1 (or, when chaining drafts, the previous MTP
        step's returned hidden). Appends to the MTP KV cache.

        Returns (logits [n_vocab], hidden [n_embd]) where hidden is RMSNorm(x; shared_head_norm)
        — the state a chained step feeds back in place of the trunk hidden.
        """
        if not self.n_mtp:
            raise ValueError("this file has no MTP block (nextn_predict_layers)")
        W, il = self.W, self.n_layer
        p = f"blk.{il}"
        emb = self.W(f"{p}.nextn.embed_tokens.weight") if W.has(f"{p}.nextn.embed_tokens.weight") \
            else W("token_embd.weight")
        e = rms_norm(emb[int(token)], W(f"{p}.nextn.enorm.weight"), self.eps)
        hn = rms_norm(np.asarray(h_prev, dtype=np.float64), W(f"{p}.nextn.hnorm.weight"), self.eps)
        x = (W(f"{p}.nextn.eh_proj.weight") @ np.concatenate([e, hn]))[None, :]
        positions = np.array([pos])
        x = self._block(il, x, lambda y: self._attention(il, y, positions, cache.kv))
        norm_name = f"{p}.nextn.shared_head_norm.weight"
        hidden = rms_norm(x[0], W(norm_name if W.has(norm_name) else "output_norm.weight"), self.eps)
        head = W(f"{p}.nextn.shared_head_head.weight") if W.has(f"{p}.nextn.shared_head_head.weight") \
            else output_head(W)
        return head @ hidden, hidden

    def mtp_forward(self, tokens, trunk_hidden: np.ndarray | None = None):
        """Teacher-forced MTP over a sequence: step p (1 <= p < T) feeds tokens[p] with the trunk
        hidden of position p - 1, so row p - 1 of the result predicts tokens[p + 1].

        Returns (logits [T-1, n_vocab], hidden [T-1, n_embd]).
        """
        tokens = [int(t) for t in tokens]
        if trunk_hidden is None:
            trunk_hidden = self.hidden(tokens)
        cache = self.new_mtp_cache()
        steps = [self.mtp_step(tokens[p], trunk_hidden[p - 1], p, cache)
                 for p in range(1, len(tokens))]
        return np.stack([s[0] for s in steps]), np.stack([s[1] for s in steps])
