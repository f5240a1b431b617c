"""`qwen35` (Qwen3.5/3.6 dense), `qwen35moe` (Qwen3.5/3.6 MoE, e.g. 35B-A3B) and `qwen3next`:
Gated DeltaNet layers with a gated full-attention layer every `full_attention_interval` layers, and
an optional MTP (NextN) head after the trunk.

Layer i is full attention iff (i + 1) % interval == 0. The converter stored every RMSNorm weight
with +1 folded in (except ssm_norm) and `ssm_a` as -exp(A_log), so no offsets appear here.
qwen35moe is qwen35's trunk with a mixture-of-experts FFN in every layer, its MTP block included;
qwen3next has the same MoE FFN but packs beta/alpha in one `ssm_ba` and groups (not tiles) its
value heads. Both always carry experts (llama.cpp refuses them without).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gpu_kernels.delta_net import causal_conv_step, delta_rule
from gpu_kernels.norms import l2_norm, rms_norm
from gpu_kernels.pointwise import per_token

from ..runtime.backends import WeightBinder
from ..errors import UserError
from ..files.gguf_file import GGUFFile
from ..runtime.kv_cache import KVCache, cache_dtype, state_zeros
from ..runtime.snapshot_ring import SnapshotRing
from .arch_spec import ARCH_SPECS, ATTENTION
from .base import Model, MTPHead
from .common import AttentionSpec, Layer, ModelState, RopeSpec, attention_block, ffn_block, rope_scale


@dataclass
class HybridState(ModelState):
    conv_all: torch.Tensor = None          # [GDN layers, K-1, C]: one tensor, so a rollback is one copy
    S_all: torch.Tensor = None             # [GDN layers, Hv, d_k, d_v]
    conv: list[torch.Tensor] = None        # per GDN layer views of conv_all
    S: list[torch.Tensor] = None           # per GDN layer views of S_all
    ring: SnapshotRing = None
    mtp_kv: KVCache | None = None


@dataclass(frozen=True)
class GDNSpec:
    n_k_heads: int
    n_v_heads: int
    head_dim: int
    conv_kernel: int
    eps: float
    tiled_heads: bool          # qwen35: value head j uses key head j % Hk; qwen3next: j // (Hv/Hk)

    @property
    def key_dim(self) -> int:
        return self.n_k_heads * self.head_dim

    @property
    def value_dim(self) -> int:
        return self.n_v_heads * self.head_dim

    @property
    def conv_channels(self) -> int:
        return 2 * self.key_dim + self.value_dim


class GatedDeltaNet:
    def __init__(self, w: WeightBinder, prefix: str, spec: GDNSpec, index: int, split_ba: bool):
        self.spec, self.index = spec, index
        ba = [f"{prefix}.ssm_ba.weight"] if split_ba else [f"{prefix}.ssm_beta.weight", f"{prefix}.ssm_alpha.weight"]
        names = [f"{prefix}.attn_qkv.weight", f"{prefix}.attn_gate.weight", *ba]
        # the input projections all read x: on the device, their rows stacked into one backend
        # where type and width agree (all of them, else qkv and gate): one matvec call and one
        # activation quantization instead of up to four, bitwise the same rows
        stacked = w.stacked_linear(names) or w.stacked_linear(names[:2])
        self.w_in, self.in_rows = stacked if stacked is not None else (None, [])
        self.w_rest = [w.linear(n) for n in names[len(self.in_rows):]]      # the ones not stacked
        self.split_ba = split_ba
        self.conv_w = w.dense(f"{prefix}.ssm_conv1d.weight")        # [C, K]
        self.dt_bias = w.dense(f"{prefix}.ssm_dt.bias")
        self.ssm_a = w.dense(f"{prefix}.ssm_a")
        self.norm = w.dense(f"{prefix}.ssm_norm.weight")
        self.w_out = w.linear(f"{prefix}.ssm_out.weight")

    def _projections(self, x: torch.Tensor) -> list[torch.Tensor]:
        """[qkv, gate, beta, alpha] (or [qkv, gate, ba] for a split_ba file) of x."""
        stacked = list(torch.split(self.w_in(x), self.in_rows, dim=-1)) if self.w_in is not None else []
        return stacked + [linear(x) for linear in self.w_rest]

    def _beta_alpha(self, ba: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.split_ba:
            return ba[0], ba[1]
        # qwen3next packs [beta | alpha] per key-head group
        s, n = self.spec, ba[0].shape[0]
        packed = ba[0].reshape(n, s.n_k_heads, 2 * (s.n_v_heads // s.n_k_heads))
        r = s.n_v_heads // s.n_k_heads
        return packed[..., :r].reshape(n, s.n_v_heads), packed[..., r:].reshape(n, s.n_v_heads)

    def __call__(self, x: torch.Tensor, state: HybridState, capture: bool) -> torch.Tensor:
        qkv, z, beta, log_decay = self._inputs(x)
        return self._output(self._recurrence(qkv, beta, log_decay, state, capture), z)

    def batched(self, x: torch.Tensor, batch, captures: list[bool]) -> torch.Tensor:
        """__call__ over a batch of several sequences (runtime.batch.StepBatch; captures: begin_step's
        answer for each): the projections, gates, gated norm and output projection over all rows at
        once (each row's bits its own), the conv and the recurrence sequence by sequence on its state."""
        qkv, z, beta, log_decay = self._inputs(x)
        o = torch.cat([self._recurrence(qkv[r], beta[r], log_decay[r], seq.state, capture)
                       for seq, r, capture in zip(batch.seqs, batch.rows, captures)])
        return self._output(o, z)

    def _inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The pre-conv rows qkv [n, C], the gate z [n, Hv, d], beta and the log decay [n, Hv] of x's rows."""
        s, n = self.spec, x.shape[0]
        qkv, gate, *ba = self._projections(x)
        z = gate.reshape(n, s.n_v_heads, s.head_dim)
        b, a = self._beta_alpha(ba)
        beta = per_token(torch.sigmoid, b)
        log_decay = self.ssm_a * per_token(F.softplus, a + self.dt_bias)
        return qkv, z, beta, log_decay

    def _recurrence(self, qkv: torch.Tensor, beta: torch.Tensor, log_decay: torch.Tensor, state: HybridState,
                    capture: bool) -> torch.Tensor:
        """One sequence's rows through the conv, the L2 norms and the delta rule on its state ->
        o [n, Hv, d]."""
        s, n = self.spec, qkv.shape[0]
        # the conv advances its state and, in a verify batch, writes its input history into the
        # snapshot ring itself (one kernel on a GPU)
        conv_state = state.conv[self.index]
        history = state.ring.conv_hist[self.index, :conv_state.shape[0] + n] if capture else None
        mixed = causal_conv_step(qkv, conv_state, self.conv_w, history)
        q, k, v = torch.split(mixed, [s.key_dim, s.key_dim, s.value_dim], dim=-1)
        q = l2_norm(q.reshape(n, s.n_k_heads, s.head_dim), s.eps)
        k = l2_norm(k.reshape(n, s.n_k_heads, s.head_dim), s.eps)
        v = v.reshape(n, s.n_v_heads, s.head_dim)
        r = s.n_v_heads // s.n_k_heads
        if r > 1:
            q = q.repeat(1, r, 1) if s.tiled_heads else q.repeat_interleave(r, dim=1)
            k = k.repeat(1, r, 1) if s.tiled_heads else k.repeat_interleave(r, dim=1)
        q = q * (1.0 / math.sqrt(s.head_dim))

        snapshots = state.ring.S[self.index] if capture else None
        return delta_rule(q, k, v, log_decay, beta, state.S[self.index], snapshots)

    def _output(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        s = self.spec
        y = rms_norm(o, self.norm, s.eps) * per_token(F.silu, z)
        return self.w_out(y.reshape(o.shape[0], s.value_dim))


class GDNBlock:
    """A Gated DeltaNet layer half, h + GDN(RMSNorm(h; attn_norm)), in torch ops around the bound
    matrices. The binder may hand back a fused CPU kernel in its place (`WeightBinder.gdn_block`)."""

    def __init__(self, w: WeightBinder, prefix: str, spec: GDNSpec, index: int, split_ba: bool):
        self.eps = spec.eps
        self.norm = w.dense(f"{prefix}.attn_norm.weight")
        self.mixer = GatedDeltaNet(w, prefix, spec, index, split_ba)

    def __call__(self, h: torch.Tensor, state: HybridState, capture: bool) -> torch.Tensor:
        return h + self.mixer(rms_norm(h, self.norm, self.eps), state, capture)

    def batched(self, h: torch.Tensor, batch, captures: list[bool]) -> torch.Tensor:
        """__call__ over a batch of several sequences (GatedDeltaNet.batched)."""
        return h + self.mixer.batched(rms_norm(h, self.norm, self.eps), batch, captures)


class MoEFFN:
    """The qwen3next / qwen35moe FFN: p = softmax(router x); the n_used most probable SwiGLU experts,
    weighted by their p renormalised to sum 1 (no further scale); plus a shared SwiGLU expert scaled
    by sigmoid(shared_gate . x).

    The routed experts are one backend (`WeightBinder.routed_experts`): it groups the batch's tokens
    by expert, so each expert's weights are read once per batch, and a token's output does not
    depend on which other tokens share it."""

    def __init__(self, w: WeightBinder, prefix: str, n_used: int):
        self.n_used = n_used
        self.router = w.linear(f"{prefix}.ffn_gate_inp.weight")
        self.experts = w.routed_experts(prefix)
        self.shared = w.glu_ffn(prefix, act="silu", suffix="_shexp")
        self.shared_gate = w.linear(f"{prefix}.ffn_gate_inp_shexp.weight")     # one output row
        self.nbytes = self.experts.nbytes + self.shared.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        probs = per_token(lambda r: torch.softmax(r, dim=-1), self.router(x))
        top_p, top_e = torch.topk(probs, self.n_used, dim=-1)
        weights = top_p / top_p.sum(-1, keepdim=True)
        return self.experts(x, top_e, weights) + self.shared(x) * per_token(torch.sigmoid, self.shared_gate(x))


class Qwen35(Model):
    spec = ARCH_SPECS["qwen35"]

    def __init__(self, gguf: GGUFFile, binder: WeightBinder):
        super().__init__(gguf, binder)
        g, a = gguf.get, self.spec
        self.n_nextn = int(g("nextn_predict_layers", 0) or 0)
        rope = RopeSpec(n_rot=int(g("rope.dimension_count", self.head_dim)),
                        base=float(g("rope.freq_base", a.rope_base)), neox=a.rope_neox, scale=rope_scale(gguf))
        self.attn_spec = AttentionSpec(n_head=self.n_head, n_kv=self.n_kv, head_dim=self.head_dim,
                                       head_dim_v=self.head_dim_v, scale=1.0 / math.sqrt(self.head_dim),
                                       eps=self.eps, rope=rope, qk_norm=a.qk_norm, gated=a.gated_attention)
        d_state = int(g("ssm.state_size"))
        self.gdn_spec = GDNSpec(n_k_heads=int(g("ssm.group_count")), n_v_heads=int(g("ssm.time_step_rank")),
                                head_dim=d_state, conv_kernel=int(g("ssm.conv_kernel")), eps=self.eps,
                                tiled_heads=a.gdn_tiled_heads)
        split_ba = binder.has("blk.0.ssm_ba.weight")
        self.n_expert_used = int(g("expert_used_count", 0) or 0)
        # the mixer half is an attention block or a Gated DeltaNet block, as the layer pattern says;
        # each kind indexes its own caches (KV rows, recurrent states)
        self.layers, n_attn, n_gdn = [], 0, 0
        for i, kind in enumerate(a.mixer_kinds(self.n_layer, g)):
            p = f"blk.{i}"
            if kind == ATTENTION:
                mixer, n_attn = attention_block(binder, p, self.attn_spec, cache_index=n_attn), n_attn + 1
            else:
                mixer = binder.gdn_block(GDNBlock(binder, p, self.gdn_spec, n_gdn, split_ba))
                n_gdn += 1
            self.layers.append(Layer(kind, mixer, self.ffn_half(binder, p)))
        self.n_attention_layers, self.n_gdn_layers = n_attn, n_gdn
        self.mtp = NextNHead(binder, self) if self.n_nextn else None

    def ffn_half(self, w: WeightBinder, prefix: str):
        """A block's FFN half, h + FFN(RMSNorm(h; post_attention_norm))."""
        moe = MoEFFN(w, prefix, self.n_expert_used) if w.has(f"{prefix}.ffn_gate_inp.weight") else None
        return ffn_block(w, prefix, self.spec.act, self.eps, norm=self.spec.ffn_norm, ffn=moe)

    # --- state ----------------------------------------------------------------------------------
    def new_state(self, n_ctx: int, cache_type: str = "f32", k_max: int = 4) -> HybridState:
        s, dev = self.gdn_spec, self.device
        kv = KVCache(self.n_attention_layers, n_ctx, self.n_kv, self.head_dim, self.head_dim_v,
                     cache_dtype(cache_type), dev)
        rows = s.conv_kernel - 1
        conv_all = state_zeros(self.n_gdn_layers, rows, s.conv_channels, device=dev)
        S_all = state_zeros(self.n_gdn_layers, s.n_v_heads, s.head_dim, s.head_dim, device=dev)
        state = HybridState(
            n_ctx=n_ctx, kv=kv, conv_all=conv_all, S_all=S_all,
            conv=list(conv_all.unbind(0)), S=list(S_all.unbind(0)),
            ring=SnapshotRing(self.n_gdn_layers, k_max, rows, s.conv_channels,
                              (s.n_v_heads, s.head_dim, s.head_dim), dev),
        )
        if self.mtp is not None:
            state.mtp_kv = KVCache(1, n_ctx, self.n_kv, self.head_dim, self.head_dim_v, cache_dtype(cache_type), dev)
        return state

    def truncate_state(self, state: HybridState, n: int) -> None:
        if n == 0:
            state.conv_all.zero_()
            state.S_all.zero_()
            state.ring.batch_start = None
            return
        if not state.ring.can_restore(n):
            raise UserError(f"{self.arch}: cannot roll the recurrent state back to {n} tokens: only positions "
                            f"after the first token of the last verify batch (up to k_max = "
                            f"{state.ring.k_max} tokens) are kept")
        state.ring.restore(n, state.conv_all, state.S_all)

    # --- compute --------------------------------------------------------------------------------
    def begin_step(self, state: HybridState, start_pos: int, n: int) -> bool:
        """The snapshot ring's batch; whether it keeps this one's per-token states."""
        return state.ring.begin(start_pos, n)

    def batched_layers(self, batch, h: torch.Tensor) -> torch.Tensor:
        """The layers over several sequences' rows, as forward() runs one's: each sequence's ring
        decides its own capture (begin_step), attention halves read their caches and Gated DeltaNet
        halves advance their states sequence by sequence (the halves' `batched`)."""
        captures = [self.begin_step(seq.state, seq.start, seq.n) for seq in batch.seqs]
        for layer in self.layers:
            if layer.kind == ATTENTION:
                h = layer.mixer.batched(h, batch)
            else:
                h = layer.mixer.batched(h, batch, captures)
            h = layer.ffn(h)
        return h

    def forward(self, state: HybridState, tokens: torch.Tensor, start_pos: int) -> torch.Tensor:
        n = tokens.shape[0]
        pos_list = list(range(start_pos, start_pos + n))
        capture = self.begin_step(state, start_pos, n)
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer.mixer(h, state, pos_list if layer.kind == ATTENTION else capture)
            h = layer.ffn(h)
        return self.final_norm(h)


class Qwen35Moe(Qwen35):
    spec = ARCH_SPECS["qwen35moe"]


class Qwen3Next(Qwen35):
    spec = ARCH_SPECS["qwen3next"]


class NextNHead(MTPHead):
    """The NextN block at index n_layer: drafts the token after next from (token, trunk hidden).

    e = RMSNorm(embed(t); enorm), hn = RMSNorm(h; hnorm), x = eh_proj [e ; hn]; then a gated
    full-attention block with its own KV cache and FFN (MoE for qwen35moe); logits = head(RMSNorm(x; shared_head_norm)).
    """

    def __init__(self, w: WeightBinder, model: Qwen35):
        p = f"blk.{model.n_layer}"
        self.model, self.eps = model, model.eps
        self.eh_proj = w.linear(f"{p}.nextn.eh_proj.weight")
        self.enorm = w.dense(f"{p}.nextn.enorm.weight")
        self.hnorm = w.dense(f"{p}.nextn.hnorm.weight")
        # the block's halves as the binder runs them (on a CPU trunk: one fused call each). The MTP
        # block's first input pairs token 1 with the trunk hidden of position 0, so its cache
        # starts at position 1; qwen35moe's FFN is the same MoE FFN as the trunk's
        self.attn_half = attention_block(w, p, dataclasses.replace(model.attn_spec, first_pos=1), cache_index=0)
        self.ffn_half = model.ffn_half(w, p)
        self.head_norm = w.dense(f"{p}.nextn.shared_head_norm.weight") \
            if w.has(f"{p}.nextn.shared_head_norm.weight") else model.output_norm
        self.head = w.linear(f"{p}.nextn.shared_head_head.weight") \
            if w.has(f"{p}.nextn.shared_head_head.weight") else model.output
        self.embed = w.embedding(f"{p}.nextn.embed_tokens.weight") \
            if w.has(f"{p}.nextn.embed_tokens.weight") else model.tok_embd
        self.n_out = self.max_out = model.n_vocab      # the full vocabulary (no draft vocabulary)

    def step(self, state: HybridState, tokens: torch.Tensor, hidden: torch.Tensor, start_pos: int,
             logits: bool = True, out: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor]:
        """tokens [n] at positions [start_pos, +n) with the trunk's (or the previous MTP step's)
        final hidden of the position before each. Writes the MTP KV at those positions.
        Returns (logits [n, V] or None, the MTP output hidden [n, n_embd] for chaining)."""
        pos_list = list(range(start_pos, start_pos + tokens.shape[0]))
        x = self.attn_half(self._input(tokens, hidden), self._state(state), pos_list)
        x = self.ffn_half(x)
        normed = rms_norm(x, self.head_norm, self.eps)
        return (self.head(normed, out=out) if logits else None), normed

    def draft(self, state: HybridState, tokens: torch.Tensor, hidden: torch.Tensor, start_pos: int,
              out: torch.Tensor) -> torch.Tensor:
        """step() for the tokens, the last one's logits into out [1, V]; returns its MTP output
        hidden [1, n_embd] (as a trained head's draft())."""
        _, h = self.step(state, tokens, hidden, start_pos, logits=False)
        self.head(h[-1:], out=out)
        return h[-1:]

    def write_kv(self, state: HybridState, tokens: torch.Tensor, hidden: torch.Tensor, start_pos: int) -> None:
        """Only the MTP KV that step() writes for these tokens (the same values): what catching up
        on committed tokens needs, without their attention, FFN (an MoE for qwen35moe) or outputs."""
        pos_list = list(range(start_pos, start_pos + tokens.shape[0]))
        self.attn_half.write_kv(self._input(tokens, hidden), self._state(state), pos_list)

    def _input(self, tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        e = rms_norm(self.embed(tokens), self.enorm, self.eps)
        hn = rms_norm(hidden, self.hnorm, self.eps)
        return self.eh_proj(torch.cat((e, hn), dim=-1))

    @staticmethod
    def _state(state: HybridState) -> ModelState:
        """The MTP block's view of a session: its own KV cache, the trunk's rotary tables; kept in
        the session, so that a fused half finds its cache views there from one step to the next."""
        mtp_state = state.extra.get("mtp_state")
        if mtp_state is None:
            mtp_state = state.extra["mtp_state"] = ModelState(n_ctx=state.n_ctx, kv=state.mtp_kv, rope=state.rope,
                                                              rope_rows=state.rope_rows)
        return mtp_state
