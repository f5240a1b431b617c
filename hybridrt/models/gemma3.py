"""`gemma3`: scaled embeddings, q/k norm, post-attention and post-FFN norms, GELU-tanh gated FFN,
and 5 sliding-window layers for every global one.

The local/global pattern and the local rope base are not in the GGUF metadata: llama.cpp hard-codes
them for this architecture (every 6th layer global; local layers rope base 10000, no scaling), and
so do we, so that both read the same file the same way.
"""
from __future__ import annotations

import math

import torch

from ..backends import WeightBinder
from ..errors import UserError
from ..gguf_file import GGUFFile
from .base import Model
from .common import AttentionSpec, RopeSpec, attention_block, ffn_block, rope_scale

SWA_PATTERN = 6            # layer i is global iff i % 6 == 5
LOCAL_ROPE_BASE = 10000.0


class Gemma3(Model):
    arch = "gemma3"

    def __init__(self, gguf: GGUFFile, binder: WeightBinder):
        super().__init__(gguf, binder)
        self.n_attention_layers = self.n_layer
        window = gguf.get("attention.sliding_window")
        if window is None:      # llama.cpp requires it too: without it every layer would run global
            raise UserError(f"{gguf.path}: gemma3.attention.sliding_window is missing")
        window = int(window)
        n_rot = int(gguf.get("rope.dimension_count", self.head_dim))
        global_rope = RopeSpec(n_rot, float(gguf.get("rope.freq_base", 1e6)), True, rope_scale(gguf))
        local_rope = RopeSpec(n_rot, LOCAL_ROPE_BASE, True, 1.0)
        self.embed_scale = math.sqrt(self.n_embd)
        self.layers = []
        for i in range(self.n_layer):
            is_local = window > 0 and i % SWA_PATTERN < SWA_PATTERN - 1
            spec = AttentionSpec(n_head=self.n_head, n_kv=self.n_kv, head_dim=self.head_dim,
                                 head_dim_v=self.head_dim_v, scale=1.0 / math.sqrt(self.head_dim),
                                 eps=self.eps, rope=local_rope if is_local else global_rope,
                                 window=window if is_local else 0, qk_norm=True)
            p = f"blk.{i}"
            self.layers.append((
                attention_block(binder, p, spec, cache_index=i, post_norm="post_attention_norm"),
                ffn_block(binder, p, "gelu_tanh", self.eps, post_norm="post_ffw_norm"),
            ))

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.tok_embd(tokens) * self.embed_scale

    def forward(self, state, tokens: torch.Tensor, start_pos: int) -> torch.Tensor:
        pos_list = list(range(start_pos, start_pos + tokens.shape[0]))
        h = self.embed(tokens)
        for attn, ffn in self.layers:        # h + rms_norm(f(rms_norm(h)), post norm), each half
            h = ffn(attn(h, state, pos_list))
        return self.final_norm(h)
