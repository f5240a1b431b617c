"""`gemma3`: scaled embeddings, q/k norm, post-attention and post-FFN norms, GELU-tanh gated FFN,
and 5 sliding-window layers for every global one (its ArchSpec).

The local/global pattern and the local rope base are not in the GGUF metadata: llama.cpp hard-codes
them for this architecture (every 6th layer global: ArchSpec.swa_period; local layers rope base
10000, no scaling), and so do we, so that both read the same file the same way.
"""
from __future__ import annotations

import math

from ..runtime.backends import WeightBinder
from ..errors import UserError
from ..files.gguf_file import GGUFFile
from .arch_spec import ARCH_SPECS, ATTENTION
from .base import Model
from .common import AttentionSpec, Layer, RopeSpec, attention_block, ffn_block, rope_scale

LOCAL_ROPE_BASE = 10000.0


class Gemma3(Model):
    spec = ARCH_SPECS["gemma3"]

    def __init__(self, gguf: GGUFFile, binder: WeightBinder):
        super().__init__(gguf, binder)
        a = self.spec
        self.n_attention_layers = self.n_layer
        window = gguf.get("attention.sliding_window")
        if window is None:      # llama.cpp requires it too: without it every layer would run global
            raise UserError(f"{gguf.path}: gemma3.attention.sliding_window is missing")
        window = int(window)
        n_rot = int(gguf.get("rope.dimension_count", self.head_dim))
        global_rope = RopeSpec(n_rot, float(gguf.get("rope.freq_base", a.rope_base)), a.rope_neox, rope_scale(gguf))
        local_rope = RopeSpec(n_rot, LOCAL_ROPE_BASE, a.rope_neox, 1.0)
        self.layers = []
        for i in range(self.n_layer):
            is_local = window > 0 and a.sliding(i)
            spec = AttentionSpec(n_head=self.n_head, n_kv=self.n_kv, head_dim=self.head_dim,
                                 head_dim_v=self.head_dim_v, scale=1.0 / math.sqrt(self.head_dim),
                                 eps=self.eps, rope=local_rope if is_local else global_rope,
                                 window=window if is_local else 0, qk_norm=a.qk_norm)
            p = f"blk.{i}"
            self.layers.append(Layer(
                ATTENTION,
                attention_block(binder, p, spec, cache_index=i, post_norm=a.attn_post_norm),
                ffn_block(binder, p, a.act, self.eps, post_norm=a.ffn_post_norm, norm=a.ffn_norm),
            ))
