"""The fused CPU trunk (Mode.CPU_FUSED): each layer half as one Numba call (cpu_kernels/layer_fused.py,
gdn_block.py, moe_block.py) over the mmap'd matrices of a half that is all in the mmap, a trained MTP
head's whole draft step as one call, and the attention and RMSNorm kernels the rest of that trunk's
torch layers call. Each fused half wraps the torch block it replaces, which still runs prompt
batches (over ROWWISE_MAX tokens) and caches the fused kernels cannot read (bf16).
"""
from __future__ import annotations

import numba
import numpy as np
import torch

from cpu_kernels import gdn_block, int_blocks, kv_attention, layer_fused, moe_block
from cpu_kernels.ffn import ACTIVATIONS
from cpu_kernels.matvec import CHUNK_DECODERS, use_int
from gpu_kernels.attention import ROWWISE_MAX, attend

from ...files.gguf_file import GGUFFile
from ..kv_cache import Q8Rows
from .cpu import CpuQuantLinear, Embedding, cpu_f32


def _fused_operands(linear: CpuQuantLinear, rows: slice = slice(None)) -> tuple:
    return layer_fused.matrix_operands(linear.raw[rows], linear.qtype, use_int(linear.qtype, linear.exact),
                                       linear.residual)


def _fused_cache_view(rows) -> np.ndarray | None:
    """A CPU cache as the fused attention kernel takes it (the same memory): float32 as is,
    float16 as its uint16 bits, q8_0 as its uint8 blocks; None for bf16."""
    if isinstance(rows, Q8Rows):
        return rows.blocks.numpy() if rows.blocks.device.type == "cpu" else None
    if not isinstance(rows, torch.Tensor) or rows.device.type != "cpu":
        return None
    if rows.dtype == torch.float32:
        return rows.numpy()
    if rows.dtype == torch.float16:
        return rows.view(torch.int16).numpy().view(np.uint16)
    return None


def _fused_state(state, index: int, spec) -> tuple | None:
    """(K cache, V cache, rotary cos, rotary sin) of a session's layer as numpy views, or None when
    the cache is bf16 or not on the CPU. Kept in the session's state: a decode step would
    otherwise rebuild them for every layer."""
    views = state.extra.setdefault("fused_layer_views", {})
    key = (index, spec.rope)
    found = views.get(key)
    if found is None:
        k, v = _fused_cache_view(state.kv.k[index]), _fused_cache_view(state.kv.v[index])
        if k is None or v is None:
            found = ()
        else:
            table = state.rotary(spec.rope, torch.device("cpu"))
            found = (k, v, table.cos.numpy(), table.sin.numpy())
        views[key] = found
    return found or None


def attend_on_cpu(q: torch.Tensor, k_cache, v_cache, positions: list[int], scale: float, window: int = 0,
                  first: int = 0, at: torch.Tensor | None = None) -> torch.Tensor:
    """gpu_kernels.attention.attend for a CPU trunk: kv_attention's kernel (the fused layers' own)
    on Numba's threads over an f32, f16 or q8_0 cache, for any batch, prompts included (torch's
    SDPA runs there on the trunk's single torch thread: 2x the time on Gemma 3's 512-token prompt,
    60a8fb1; docs/history.md, "Prompt attention on kv_attention"); torch's attend for a bf16 cache."""
    kc, vc = _fused_cache_view(k_cache), _fused_cache_view(v_cache)
    if kc is None or vc is None or q.device.type != "cpu" or at is not None:
        return attend(q, k_cache, v_cache, positions, scale, window, first, at=at)
    n, n_head, d = q.shape
    n_kv, d_v = k_cache.shape[1], v_cache.shape[2]
    o = np.empty((n, n_head * d_v), np.float32)
    kv_attention.attend(numba.get_num_threads(), _rows_f32(q.reshape(n, n_head * d)), kc, vc, o, positions[0],
                        n_head, n_kv, d, d_v, scale, window, first)
    return torch.from_numpy(o).view(n, n_head, d_v)


def _covering(kernel_types: tuple, operands: list) -> tuple:
    """kernel_types = (int_types, float_path) of layer_fused, checked to cover the operands."""
    int_types, float_path = kernel_types
    have_int = {qt for qt, flag in zip(sorted(int_blocks.SPECS), int_types) if flag is True}
    have_float = {qt for qt, flag in zip(sorted(CHUNK_DECODERS), float_path) if flag is True}
    if any(op[1] not in (have_int if op[3] else have_float) for op in operands):
        raise ValueError(f"fused kernels compiled for integer types {sorted(have_int)}, float types"
                         f" {sorted(have_float)} do not cover {[(op[1], op[3]) for op in operands]} (type, integer)")
    return kernel_types


def _rows_f32(h: torch.Tensor) -> np.ndarray:
    """A CPU trunk's float32 hidden rows as a C-contiguous array (no copy when they already are)."""
    return np.ascontiguousarray(h.numpy() if h.dtype == torch.float32 else cpu_f32(h).numpy())


def rms_norm_on_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """gpu_kernels.norms.rms_norm's result as one compiled call: its seven torch ops cost ~25 us on
    a few rows right after a decode step streamed the weights out of every cache, this ~5 us."""
    return torch.from_numpy(layer_fused.rms_norm_rows(_rows_f32(x), weight.numpy(), eps))


class FusedAttentionBlock:
    """A layer's attention half (norm, q/k/v, q/k norm, rotary, KV write, attention, output
    projection, post-norm, residual) as one layer_fused call, for a CPU trunk whose attention
    matrices are all in the mmap. Decode and verify batches (<= ROWWISE_MAX tokens) on an f32, f16 or
    q8_0 cache take it; prompt batches and other cache types run `block`, the torch path it wraps."""

    def __init__(self, block, kernel_types: tuple):
        self.block, self.attn = block, block.attn     # .attn.spec is read at every call
        a = block.attn
        if a.wqkv is not None:
            nq, nk, _ = a.qkv_rows
            parts = (slice(0, nq), slice(nq, nq + nk), slice(nq + nk, None))
            self.qkv = [_fused_operands(a.wqkv, p) for p in parts]
        else:
            self.qkv = [_fused_operands(m) for m in (a.wq, a.wk, a.wv)]
        self.wo = _fused_operands(a.wo)
        self.norm = block.norm.numpy()
        self.post_norm = block.post_norm.numpy() if block.post_norm is not None else self.norm
        spec = a.spec
        self.q_norm = a.q_norm.numpy() if spec.qk_norm else self.norm
        self.k_norm = a.k_norm.numpy() if spec.qk_norm else self.norm
        self.nbytes = a.wo.nbytes + (a.wqkv.nbytes if a.wqkv is not None else a.wq.nbytes + a.wk.nbytes + a.wv.nbytes)
        self.weights = (*self.qkv[0], *self.qkv[1], *self.qkv[2], *self.wo)
        self.kernel_types = _covering(kernel_types, [*self.qkv, self.wo])

    def _views(self, state, n: int) -> tuple | None:
        """The fused kernels' cache and rotary views, or None where the torch path runs (a bf16
        cache, a prompt batch): __call__ and write_kv route alike, so their KV rows are the same."""
        return _fused_state(state, self.attn.cache_index, self.attn.spec) if n <= ROWWISE_MAX else None

    def __call__(self, h: torch.Tensor, state, pos_list: list[int]) -> torch.Tensor:
        views = self._views(state, len(pos_list))
        if views is None:
            return self.block(h, state, pos_list)
        out = layer_fused.attention_block(_rows_f32(h), numba.get_num_threads(), *self.kernel_types,
                                          *self.kernel_args(views, pos_list[0]))
        return torch.from_numpy(out)

    def batched(self, h: torch.Tensor, batch) -> torch.Tensor:
        """__call__ over a batch of several sequences (runtime.batch.StepBatch, at most ROWWISE_MAX
        rows): attention_block's own three steps, the projections (q, k, v; the output) once over all
        rows and the rest sequence by sequence on its cache. Each step is the same code the one call
        runs, and the projections' bits do not depend on the other rows, so every row comes out as
        it would alone. Sequences whose caches the kernels cannot read (bf16) take `block`'s batched
        path, as they would alone; a batch mixing both is refused (it would need both paths)."""
        views = [self._views(seq.state, seq.n) for seq in batch.seqs]
        if all(v is None for v in views):
            return self.block.batched(h, batch)
        if any(v is None for v in views):
            raise ValueError("a batch mixes KV caches the fused attention reads with ones it does not (bf16)")
        s, n_threads, x = self.attn.spec, numba.get_num_threads(), _rows_f32(h)
        qkv = layer_fused.attention_qkv(x, n_threads, *self.kernel_types, self.norm, s.eps, *self.weights[:12],
                                        s.n_head, s.n_kv, s.head_dim, s.head_dim_v, s.gated)
        q = np.empty((x.shape[0], s.n_head * s.head_dim), np.float32)
        o = np.empty((x.shape[0], s.n_head * s.head_dim_v), np.float32)
        for seq, rows, (k_cache, v_cache, cos, sin) in zip(batch.seqs, batch.rows, views):
            layer_fused.attention_rows(n_threads, qkv[rows], q[rows], o[rows], self.q_norm, self.k_norm, s.qk_norm,
                                       s.gated, s.eps, cos, sin, s.rope.n_rot, s.rope.neox, k_cache, v_cache, seq.start,
                                       s.n_head, s.n_kv, s.head_dim, s.head_dim_v, s.scale, s.window, s.first_pos)
        out = layer_fused.attention_out(x, qkv, o, n_threads, *self.kernel_types, self.post_norm,
                                        self.block.post_norm is not None, s.eps, *self.wo, s.gated, s.n_head,
                                        s.head_dim, s.head_dim_v)
        return torch.from_numpy(out)

    def kernel_args(self, views: tuple, start: int) -> tuple:
        """layer_fused.attention_block's arguments after float_path, for tokens from `start` on."""
        s = self.attn.spec
        k_cache, v_cache, cos, sin = views
        return (self.norm, self.post_norm, self.block.post_norm is not None, s.eps, *self.weights, self.q_norm,
                self.k_norm, s.qk_norm, s.gated, cos, sin, s.rope.n_rot, s.rope.neox, k_cache, v_cache, start, s.n_head,
                s.n_kv, s.head_dim, s.head_dim_v, s.scale, s.window, s.first_pos)

    def write_kv(self, h: torch.Tensor, state, pos_list: list[int]) -> None:
        """Only the KV rows __call__ would write for h (an MTP head catching up), bit for bit."""
        s = self.attn.spec
        views = self._views(state, len(pos_list))
        if views is None:
            return self.block.write_kv(h, state, pos_list)
        k_cache, v_cache, cos, sin = views
        layer_fused.attention_kv(
            _rows_f32(h), numba.get_num_threads(), *self.kernel_types, self.norm, s.eps, *self.qkv[1], *self.qkv[2],
            self.k_norm, s.qk_norm, cos, sin, s.rope.n_rot, s.rope.neox, k_cache, v_cache, pos_list[0], s.n_kv,
            s.head_dim, s.head_dim_v)


class FusedFfnBlock:
    """A layer's FFN half (norm, gate/up, activation, down, post-norm, residual) as one
    layer_fused call, for a CPU trunk whose FFN matrices are all in the mmap; prompt batches run
    `block`, the path it wraps (whose FFN is the same CpuGluFFN kernels)."""

    def __init__(self, block, kernel_types: tuple):
        self.block, ffn = block, block.ffn
        self.gate, self.up, self.down = (_fused_operands(m) for m in (ffn.gate, ffn.up, ffn.down))
        self.act = ACTIVATIONS[ffn.act]
        self.norm = block.norm.numpy()
        self.post_norm = block.post_norm.numpy() if block.post_norm is not None else self.norm
        self.nbytes = ffn.nbytes
        self.tile_tokens = layer_fused.ffn_tile_tokens(self.gate, self.up)
        self.args = (*_covering(kernel_types, [self.gate, self.up, self.down]), self.norm, self.post_norm,
                     block.post_norm is not None, block.eps, *self.gate, *self.up, *self.down, self.act)

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        if h.shape[0] > ROWWISE_MAX:
            return self.block(h)
        if h.shape[0] in self.tile_tokens:      # a wide model's verify batch: gate and up on AMX tiles
            return torch.from_numpy(layer_fused.ffn_block_tiles(
                _rows_f32(h), self.norm, self.post_norm, self.block.post_norm is not None, self.block.eps,
                self.gate, self.up, self.down, self.block.ffn.act))
        return torch.from_numpy(layer_fused.ffn_block(_rows_f32(h), numba.get_num_threads(), *self.args))


class FusedMoEBlock:
    """A MoE layer's FFN half (norm, router, the chosen routed experts, the shared expert and its
    gate, residual) as one moe_block call, for a CPU trunk whose expert matrices are all in the
    mmap; prompt batches run `block` (models.qwen35.MoEFFN through RoutedExperts). The experts'
    matrices go in whole ([n_expert * rows] of the file's tensor): the kernel picks each expert's
    rows."""

    def __init__(self, block, kernel_types: tuple, gguf: GGUFFile):
        moe, self.block = block.ffn, block
        if block.post_norm is not None:
            raise ValueError("the fused MoE half has no post-norm")
        self.ffn = moe          # the MoE FFN the prompt path runs (models.qwen35.MoEFFN)
        first, shared = moe.experts.experts[0], moe.shared

        def whole(linear: CpuQuantLinear) -> tuple:     # the tensor an expert's "name[e]" matrix is a part of
            name = linear.name.rsplit("[", 1)[0]
            return layer_fused.matrix_operands(gguf.tensor_bytes(name), linear.qtype,
                                               use_int(linear.qtype, linear.exact), linear.residual)
        mats = [_fused_operands(moe.router), _fused_operands(moe.shared_gate),
                whole(first.gate), whole(first.up), whole(first.down),
                *(_fused_operands(m) for m in (shared.gate, shared.up, shared.down))]
        (_, _, eg, ig), (_, _, eu, iu), (_, _, esg, isg), (_, _, esu, isu) = mats[2], mats[3], mats[5], mats[6]
        if (eg, ig) != (eu, iu) or (esg, isg) != (esu, isu):
            # gate and up share one quantization of their activations in the kernel
            raise ValueError("gate and up of an expert take different activation blocks")
        self.norm = block.norm.numpy()
        self.nbytes = moe.nbytes
        self.args = (*_covering(kernel_types, mats), self.norm, block.eps, *mats,
                     first.gate.n_out, shared.gate.n_out, moe.n_used)

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        if h.shape[0] > ROWWISE_MAX:
            return self.block(h)
        return torch.from_numpy(moe_block.moe_block(_rows_f32(h), numba.get_num_threads(), *self.args))


class FusedGDNBlock:
    """A Gated DeltaNet layer half (norm, input projections, conv, L2 norms, gates, the delta-rule
    recurrence with its snapshot-ring writes, gated norm, output projection, residual) as one
    gdn_block call, for a CPU trunk whose GDN matrices are all in the mmap. Decode and verify
    batches (<= ROWWISE_MAX tokens) take it; prompt batches run the block's own projections (the
    prompt GEMMs) around gdn_core, the same kernel's conv, gates and recurrence, on the same state."""

    def __init__(self, block, kernel_types: tuple):
        self.block = block
        self.mixer = mixer = block.mixer      # .spec and .index are read by the model's users
        qkv, z, *ba = mixer.w_rest
        self.qkv, self.z = _fused_operands(qkv), _fused_operands(z)
        self.b = _fused_operands(ba[0])
        self.a = _fused_operands(ba[1]) if len(ba) > 1 else self.b
        self.out = _fused_operands(mixer.w_out)
        mats = [self.qkv, self.z, self.b, self.a, self.out]
        # what gdn_core reads beside the projections: conv kernel, dt bias, A, ssm_norm
        self.core_weights = (mixer.conv_w.numpy(), mixer.dt_bias.numpy(), mixer.ssm_a.numpy(), mixer.norm.numpy())
        self.kernel_types = _covering(kernel_types, mats)
        self.norm = block.norm.numpy()
        self.args = (*self.kernel_types, self.norm, mixer.spec.eps,
                     *self.qkv, *self.z, *self.b, *self.a, *self.out, *self.core_weights)
        self.index, self.spec, self.ba_packed = mixer.index, mixer.spec, mixer.split_ba
        self.nbytes = sum(m.nbytes for m in mixer.w_rest) + mixer.w_out.nbytes

    def _views(self, state) -> tuple:
        """(conv state, S, ring conv history, ring S) of this layer as numpy views, kept in the state."""
        views = state.extra.setdefault("fused_gdn_views", {})
        found = views.get(self.index)
        if found is None:
            ring = state.ring
            found = views[self.index] = tuple(t.numpy() for t in (
                state.conv[self.index], state.S[self.index], ring.conv_hist[self.index], ring.S[self.index]))
        return found

    def __call__(self, h: torch.Tensor, state, capture: bool) -> torch.Tensor:
        if h.shape[0] > ROWWISE_MAX:
            return self._prompt(h, state, capture)
        out = gdn_block.gdn_block(_rows_f32(h), numba.get_num_threads(), *self.args, *self._views(state), capture,
                                  self.spec.n_k_heads, self.spec.tiled_heads, self.ba_packed)
        return torch.from_numpy(out)

    def batched(self, h: torch.Tensor, batch, captures: list[bool]) -> torch.Tensor:
        """__call__ over a batch of several sequences (runtime.batch.StepBatch, at most ROWWISE_MAX
        rows; captures: begin_step's answer for each): gdn_block's own steps, the input projections,
        the gated norm and the output projection once over all rows, the conv, norms, gates and
        recurrence (with its ring writes) sequence by sequence on its own state. Each step is the
        code the one call runs, and a row's projections and norms do not depend on the other rows,
        so every row and every sequence's state come out as they would alone."""
        s, n_threads, x = self.spec, numba.get_num_threads(), _rows_f32(h)
        conv_w, dt_bias, ssm_a, ssm_norm = self.core_weights
        qkv, z, b, a = gdn_block.gdn_in(x, n_threads, *self.kernel_types, self.norm, s.eps, *self.qkv, *self.z,
                                        *self.b, *self.a, s.conv_channels, s.n_v_heads, s.head_dim, s.n_k_heads,
                                        self.ba_packed)
        core = np.empty((x.shape[0], s.value_dim), np.float32)
        for seq, rows, capture in zip(batch.seqs, batch.rows, captures):
            gdn_block.gdn_recurrence(n_threads, qkv[rows], b[rows], a[rows], conv_w, dt_bias, ssm_a, s.eps,
                                     *self._views(seq.state), capture, s.n_k_heads, s.tiled_heads, core[rows])
        y = gdn_block.gated_norm(n_threads, core, z, ssm_norm, s.eps, s.conv_channels)
        return torch.from_numpy(gdn_block.gdn_out(x, y, n_threads, *self.kernel_types, self.norm, s.eps, *self.out))

    def _prompt(self, h: torch.Tensor, state, capture: bool) -> torch.Tensor:
        m = self.mixer
        x = rms_norm_on_cpu(h, self.block.norm, m.spec.eps)
        qkv, z, *ba = m._projections(x)
        b, a = m._beta_alpha(ba)
        y = gdn_block.gdn_core(numba.get_num_threads(), _rows_f32(qkv), _rows_f32(z), _rows_f32(b), _rows_f32(a),
                               *self.core_weights, m.spec.eps, *self._views(state), capture,
                               self.spec.n_k_heads, self.spec.tiled_heads)
        return h + m.w_out(torch.from_numpy(y))


class FusedMTPStep:
    """A trained MTP head's whole step (embedding rows, its norms, eh_proj, the fused attention and
    FFN halves, the head norm and the output rows of the last token) as one layer_fused call, for
    a head whose every part runs fused on a CPU trunk. A draft comes right after a verify, which
    streamed the weights through every cache: each of the head's ~20 separate calls then paid for
    its own code and data (SmolLM2: a draft 0.42 ms against 0.17 ms warm). Built by
    WeightBinder.mtp_step, which returns None where any part runs otherwise (this raises ValueError
    where a half is not fused or the kernel types do not cover the head's matrices)."""

    def __init__(self, embedding: Embedding, embed_scale: float, enorm, hnorm, eh_proj: CpuQuantLinear,
                 attn_half: FusedAttentionBlock, ffn_half: FusedFfnBlock, head_norm, output: CpuQuantLinear, eps: float):
        if not (isinstance(attn_half, FusedAttentionBlock) and isinstance(ffn_half, FusedFfnBlock)
                and embedding.device.type == "cpu"):
            raise ValueError("a fused MTP step needs both halves fused and the embedding gathered on the CPU")
        g = self.gather = embedding.gather
        self.embed = (g.flat, g.row_bytes, g.tag, g.n_cols)
        self.embed_scale, self.eps = float(embed_scale), float(eps)
        self.enorm, self.hnorm, self.head_norm = enorm.numpy(), hnorm.numpy(), head_norm.numpy()
        self.eh, self.head = _fused_operands(eh_proj), _fused_operands(output)
        self.attn_half, self.ffn_half = attn_half, ffn_half
        self.kernel_types = _covering(attn_half.kernel_types, [self.eh, self.head, attn_half.wo,
                                                                ffn_half.gate, ffn_half.up, ffn_half.down])
        self.ffn_args = ffn_half.args[2:]

    def __call__(self, state, tokens: torch.Tensor, hidden: torch.Tensor, start_pos: int,
                 out: torch.Tensor) -> torch.Tensor | None:
        """The head's output hidden of every token [k, n_embd], the last one's logits written into
        out [1, n_out]; None where this batch takes the separate calls (a prompt-sized batch, an
        AMX tile batch, a cache the fused attention cannot read)."""
        k = tokens.shape[0]
        views = self.attn_half._views(state, k)         # None past ROWWISE_MAX tokens, too
        if views is None or k in self.ffn_half.tile_tokens:
            return None
        ids = tokens.tolist()
        self.gather.check_range(min(ids), max(ids))
        normed = layer_fused.mtp_head_step(self.embed, tokens.numpy(), self.embed_scale, _rows_f32(hidden),
                                           numba.get_num_threads(), *self.kernel_types, self.eps, self.enorm, self.hnorm,
                                           self.eh, self.attn_half.kernel_args(views, start_pos), self.ffn_args,
                                           self.head_norm, self.head, out.numpy())
        return torch.from_numpy(normed)
