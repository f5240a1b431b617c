"""The trainable MTP head and the batched teacher, in plain torch (float32, autograd, CPU).

One `TorchBlock` implements a transformer block of the target's kind (its ArchSpec; llama / qwen3 / gemma3 /
qwen35's gated attention) over a batch of sequences: it is the head's block while training, and
every layer of `TorchTeacher`, the target run on many sequences at once to write the training text
(hybridrt's own decoding runs one sequence at a time, ~10x slower per token for this). The same
rms_norm / rotary functions as the runtime are used, so the exported head computes what was trained.
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from cpu_kernels.attention_batch import attend_decode
from cpu_kernels.dequant import dequantize, gather_rows
from gpu_kernels.norms import rms_norm
from gpu_kernels.rotary import RotaryRows, apply_rotary, rotary_table

from ..models.common import AttentionSpec
from ..models.arch_spec import ArchSpec
from ..models.mtp_head import head_attention_spec
from ..decoding.sampling import top_k_rows

ATTN = ("attn_q", "attn_k", "attn_v", "attn_output")
# the teacher's KV cache: float16, as `hybridrt run`'s (the values the runtime's attention reads); a
# decode step of 256 sequences is bound by the cache's bytes, half float32's (fd140c0;
# docs/history.md, "The train-mtp teacher's decode attention")
KV_DTYPE = torch.float16
FFN = ("ffn_gate", "ffn_up", "ffn_down")


def read_f32(gguf, name: str) -> torch.Tensor:
    """A tensor of the target, dequantized to float32 in numpy order."""
    info = gguf.tensors[name]
    values = dequantize(gguf.tensor_bytes(name), info.qtype, info.shape[0])
    return torch.from_numpy(values.reshape(tuple(reversed(info.shape))).copy())


def block_tensor_names(kind: ArchSpec, spec: AttentionSpec) -> dict[str, str]:
    """The head's block tensor (its own name) -> the target layer's tensor suffix it starts from."""
    names = {n: n for n in ATTN + FFN + ("attn_norm",)}
    names["ffn_norm"] = kind.ffn_norm
    if spec.qk_norm:
        names.update(attn_q_norm="attn_q_norm", attn_k_norm="attn_k_norm")
    if kind.post_norms:
        names.update({kind.attn_post_norm: kind.attn_post_norm, kind.ffn_post_norm: kind.ffn_post_norm})
    return names


class Rotary:
    """cos/sin tables of one rope spec, gathered for [batch, tokens] positions."""

    def __init__(self, spec: AttentionSpec, n_ctx: int):
        self.table = rotary_table(n_ctx, spec.rope.n_rot, spec.rope.base, spec.rope.neox, spec.rope.scale)

    def rows(self, pos: torch.Tensor) -> RotaryRows:
        t = self.table
        return RotaryRows(t.cos[pos].unsqueeze(-2), t.sin[pos].unsqueeze(-2), t.n_rot, t.neox)


def _mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T computed in w's dtype (the teacher keeps its matrices in bfloat16: AMX / AVX-512 BF16
    matmuls run ~5x faster than float32 on this CPU), the result back in x's dtype (the residual
    stream and the norms stay float32)."""
    return (x.to(w.dtype) @ w.T).to(x.dtype)


class TorchBlock(nn.Module):
    def __init__(self, weights: dict[str, torch.Tensor], spec: AttentionSpec, kind: ArchSpec, eps: float):
        super().__init__()
        self.spec, self.kind, self.eps = spec, kind, eps
        self.w = nn.ParameterDict({k: nn.Parameter(v.clone()) for k, v in weights.items()})

    def attention(self, x: torch.Tensor, rot: RotaryRows, mask: torch.Tensor, cache: dict | None) -> torch.Tensor:
        s, w = self.spec, self.w
        b, t, _ = x.shape
        q = _mm(x, w["attn_q"])
        k = _mm(x, w["attn_k"]).view(b, t, s.n_kv, s.head_dim)
        v = _mm(x, w["attn_v"]).view(b, t, s.n_kv, s.head_dim_v)
        gate = None
        if s.gated:
            q = q.view(b, t, s.n_head, 2 * s.head_dim)
            q, gate = q[..., :s.head_dim], q[..., s.head_dim:].reshape(b, t, s.n_head * s.head_dim)
        else:
            q = q.view(b, t, s.n_head, s.head_dim)
        if s.qk_norm:
            q = rms_norm(q, w["attn_q_norm"], s.eps)
            k = rms_norm(k, w["attn_k_norm"], s.eps)
        q, k = apply_rotary(q, rot), apply_rotary(k, rot)
        k, v = k.transpose(1, 2), v.transpose(1, 2)          # [b, n_kv, t, d]
        if cache is not None:       # preallocated by TorchTeacher.new_caches: [b, n_kv, n_ctx, d]
            n = cache["n"]
            cache["k"][:, :, n:n + t], cache["v"][:, :, n:n + t] = k, v
            cache["n"] = n + t
        if cache is not None and t == 1:        # a decode step: cpu_kernels' batched decode attention
            o = _attend_cached(q, cache, mask[:, 0, 0], s.scale)
        else:
            if cache is not None:   # a prefill (once per generate call): torch's attention, in float32
                k, v = cache["k"][:, :, :n + t].float(), cache["v"][:, :, :n + t].float()
            # enable_gqa: head h reads kv head h // group (as gpu_kernels.attention.attend), without
            # materializing the repeated keys
            o = F.scaled_dot_product_attention(q.transpose(1, 2).to(k.dtype), k, v, attn_mask=mask, scale=s.scale,
                                               enable_gqa=s.n_head != s.n_kv).transpose(1, 2)
        o = o.reshape(b, t, s.n_head * s.head_dim_v).to(x.dtype)
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return _mm(o, w["attn_output"])

    def forward(self, x: torch.Tensor, rot: RotaryRows, mask: torch.Tensor, cache: dict | None = None) -> torch.Tensor:
        w, eps, kind = self.w, self.eps, self.kind
        a = self.attention(rms_norm(x, w["attn_norm"], eps), rot, mask, cache)
        x = x + (rms_norm(a, w[kind.attn_post_norm], eps) if kind.post_norms else a)
        h = rms_norm(x, w["ffn_norm"], eps)
        g = _mm(h, w["ffn_gate"])
        g = F.silu(g) if kind.act == "silu" else F.gelu(g, approximate="tanh")
        f = _mm(g * _mm(h, w["ffn_up"]), w["ffn_down"])
        return x + (rms_norm(f, w[kind.ffn_post_norm], eps) if kind.post_norms else f)


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, k_valid: torch.Tensor, window: int) -> torch.Tensor:
    """Attention mask [b, 1, tq, tk]: causal over positions, padding keys hidden, sliding window."""
    m = (k_pos[:, None, :] <= q_pos[:, :, None]) & k_valid[:, None, :]
    if window > 0:
        m &= q_pos[:, :, None] - k_pos[:, None, :] < window
    # a padding query that sees nothing would give NaN rows (and NaN keys for later queries to
    # multiply by zero): let it see the first slot
    m[..., 0] |= ~m.any(-1)
    return m[:, None]


def _left_padded(prompts: list[list[int]], width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prompts left-padded to `width` slots: tokens (pad 0), positions (each prompt from 0; pads
    at 0) and which slots hold prompt tokens, each [len(prompts), width]."""
    pad = torch.tensor([width - len(p) for p in prompts])
    tokens = torch.zeros(len(prompts), width, dtype=torch.int64)
    for i, p in enumerate(prompts):
        tokens[i, int(pad[i]):] = torch.tensor(p, dtype=torch.int64)
    slots = torch.arange(width)[None, :].expand(len(prompts), -1)
    return tokens, (slots - pad[:, None]).clamp(min=0), slots >= pad[:, None]


class MTPHeadModule(nn.Module):
    """The head being trained: enorm, hnorm, eh_proj, one block, head_norm, head over the draft
    vocabulary. `forward(emb, hidden, pos, k_valid)`: emb = the target's embedding of token j,
    hidden = the target's final hidden of j - 1; returns draft logits [b, t, V]."""

    def __init__(self, tensors: dict[str, torch.Tensor], spec: AttentionSpec, kind: ArchSpec, eps: float, n_ctx: int):
        super().__init__()
        self.eps = eps
        self.enorm = nn.Parameter(tensors["enorm"].clone())
        self.hnorm = nn.Parameter(tensors["hnorm"].clone())
        self.eh_proj = nn.Parameter(tensors["eh_proj"].clone())
        self.block = TorchBlock({k: v for k, v in tensors.items() if k in block_tensor_names(kind, spec)},
                                spec, kind, eps)
        self.head_norm = nn.Parameter(tensors["head_norm"].clone())
        self.head = nn.Parameter(tensors["head"].clone())
        self.rotary = Rotary(spec, n_ctx)

    def features(self, emb: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor, k_valid: torch.Tensor) -> torch.Tensor:
        e = rms_norm(emb, self.enorm, self.eps)
        hn = rms_norm(hidden, self.hnorm, self.eps)
        x = torch.cat((e, hn), dim=-1) @ self.eh_proj.T
        x = self.block(x, self.rotary.rows(pos), visible(pos, pos, k_valid, 0))
        return rms_norm(x, self.head_norm, self.eps)

    def forward(self, emb, hidden, pos, k_valid) -> torch.Tensor:
        return self.features(emb, hidden, pos, k_valid) @ self.head.T

    def export(self) -> dict[str, np.ndarray]:
        """Tensors under the head file's names (mtp.*.weight)."""
        out = {"enorm": self.enorm, "hnorm": self.hnorm, "eh_proj": self.eh_proj,
               "head_norm": self.head_norm, "head": self.head, **dict(self.block.w.items())}
        return {f"mtp.{k}.weight": v.detach().float().numpy() for k, v in out.items()}


def initial_head_tensors(model, draft_ids: torch.Tensor, kind: ArchSpec, scale: float = 1.0,
                         ffn_layers: int = 1, layer: int | None = None) -> dict[str, torch.Tensor]:
    """Start from the target: the block from its last full-attention layer, the head norm from its
    output norm, the head from its output rows of the draft vocabulary, enorm = hnorm = 1 and
    eh_proj = [I | I] * scale / sqrt(2): the sum of the normed embedding and the normed hidden at
    `scale`, the RMS of the residual stream the copied layer reads in the target (its attention and
    FFN outputs are sized for that residual; a unit-RMS input would be drowned by them).
    ffn_layers > 1: the block's FFN is that many of the target's FFNs side by side (the copied
    layer's and those of the layers before it), each one's pre-FFN norm folded into its gate and up
    rows, so a pre-norm block's starts as their sum (gemma3's sandwich norm applies to the sum).
    SmolLM2's head learned faster that way (600 steps: +2.6 points held-out) but ended level
    after train-mtp's default steps (docs/history.md, "What did not raise a small head's
    acceptance"). `layer`: another target layer to copy (of the same attention shape;
    scripts/ablate_mtp_head.py's --init-layer)."""
    last, spec = head_attention_spec(model)
    layer = last if layer is None else layer
    g, d = model.gguf, model.n_embd
    t = {mine: read_f32(g, f"blk.{layer}.{theirs}.weight") for mine, theirs in block_tensor_names(kind, spec).items()}
    norm = t["ffn_norm"]
    for prev in range(layer - 1, max(layer - ffn_layers, -1), -1):
        if f"blk.{prev}.ffn_gate.weight" not in g.tensors:        # no dense FFN there (an MoE layer)
            break
        ratio = read_f32(g, f"blk.{prev}.{kind.ffn_norm}.weight") / torch.where(norm.abs() > 1e-6, norm, torch.inf)
        t["ffn_gate"] = torch.cat((t["ffn_gate"], read_f32(g, f"blk.{prev}.ffn_gate.weight") * ratio), 0)
        t["ffn_up"] = torch.cat((t["ffn_up"], read_f32(g, f"blk.{prev}.ffn_up.weight") * ratio), 0)
        t["ffn_down"] = torch.cat((t["ffn_down"], read_f32(g, f"blk.{prev}.ffn_down.weight")), 1)
    t["enorm"], t["hnorm"] = torch.ones(d), torch.ones(d)
    t["eh_proj"] = torch.cat((torch.eye(d), torch.eye(d)), dim=1) * (scale / math.sqrt(2))
    t["head_norm"] = read_f32(g, "output_norm.weight")
    t["head"] = output_rows(model, draft_ids)
    return t


def output_rows(model, ids: torch.Tensor | None) -> torch.Tensor:
    """The target's output matrix (rows `ids`, or all) as float32 [rows, n_embd]."""
    name = "output.weight" if "output.weight" in model.gguf.tensors else "token_embd.weight"
    info = model.gguf.tensors[name]
    rows = ids.numpy() if ids is not None else np.arange(info.n_rows, dtype=np.int64)
    return torch.from_numpy(gather_rows(model.gguf.tensor_bytes(name), info.qtype, info.shape[0], rows))


def _attend_cached(q: torch.Tensor, cache: dict, visible: torch.Tensor, scale: float) -> torch.Tensor:
    """A decode step's attention over the cache's first cache["n"] rows (q [b, 1, n_head, d] float32,
    visible [b, n]) -> [b, 1, n_head, dv]. torch's CPU attention reads a cache of 256 sequences at
    ~10 GB/s, about half of a late teacher step (b705ee1; docs/history.md, "The train-mtp teacher's
    decode attention"); attend_decode streams each sequence's keys and values once for all the heads
    that share them. It takes the whole buffers: a view cut to n rows would be a non-contiguous
    array, whose rows Numba does not vectorize."""
    assert cache["k"].is_contiguous() and cache["v"].is_contiguous()
    b, _, n_head, _ = q.shape
    out = np.empty((b, n_head, cache["v"].shape[-1]), np.float32)
    k, v = (c.view(torch.int16).numpy().view(np.uint16) if c.dtype == torch.float16 else c.numpy()
            for c in (cache["k"], cache["v"]))
    attend_decode(np.ascontiguousarray(q[:, 0].float().numpy()), k, v, cache["n"],
                  np.ascontiguousarray(visible.numpy()), np.float32(scale), out)
    return torch.from_numpy(out)[:, None]


class TorchTeacher:
    """The target (an architecture whose ArchSpec.torch_teacher is set: llama / qwen3 / gemma3) in torch, decoding a batch of prompts at once with a
    preallocated KV cache; prompts are left-padded, each sequence keeping its own positions.
    `dtype`: the matrices' storage and matmul dtype; bfloat16 writes training text ~5x faster than
    float32 on the AMX Xeon. The residual stream and the norms stay float32 either way, the KV cache
    is float16 (KV_DTYPE; a bfloat16 cache moved the hiddens the head learns from further from
    hybridrt's: 3-4 points less held-out acceptance for Gemma 3's head, 8d98cb3; docs/history.md, 2026-11-25)."""

    def __init__(self, model, kind: ArchSpec, n_ctx: int, dtype: torch.dtype = torch.float32):
        g = model.gguf
        self.model, self.n_ctx, self.dtype = model, n_ctx, dtype
        self._kv: list[tuple[torch.Tensor, torch.Tensor]] = []     # new_caches' buffers, kept across calls
        self.embed_rows = read_f32(g, "token_embd.weight")
        self.output = (read_f32(g, "output.weight") if "output.weight" in g.tensors else self.embed_rows).to(dtype)
        # the output rows a step computes (restrict_output) and the ids they stand for; None: all
        self.rows: torch.Tensor | None = None
        self.step_output = self.output
        # every id ranked in a step's top-k since the teacher was made (restrict_output's default)
        self.ranked = torch.zeros(self.output.shape[0], dtype=torch.bool)
        self._logits = torch.empty(0, self.output.shape[0], dtype=dtype)   # generate's logits buffer, likewise
        self.embed_scale = float(model.embed_scale)
        self.output_norm = read_f32(g, "output_norm.weight")
        self.blocks, self.rotary = [], {}
        for i, layer in enumerate(model.layers):
            spec = layer.attention.spec
            names = block_tensor_names(kind, spec)
            weights = {m: read_f32(g, f"blk.{i}.{t}.weight") for m, t in names.items()}
            weights = {m: w.to(dtype) if w.ndim == 2 else w for m, w in weights.items()}
            self.blocks.append(TorchBlock(weights, spec, kind, model.eps).requires_grad_(False))
            if spec.rope not in self.rotary:
                self.rotary[spec.rope] = Rotary(spec, n_ctx)

    def restrict_output(self, keep: torch.Tensor | None = None) -> int:
        """Later steps compute the logits of the `keep` ids only (a bool mask over the vocabulary;
        default: every id a step's top-k ranked so far), greedy and top-k picks among them. Gemma 3's
        262k-row product was over half of a teacher step; the 21,588 ids the first 64 steps of its
        first batch (256 continuations) ranked in a top-40 hold the full argmax at 99.25 % of the
        later text's positions and 98.7 % of its probability (scripts/teacher_vocab_coverage.py;
        docs/history.md, "The teacher over the ids it ranks"). Returns the rows kept."""
        keep = self.ranked if keep is None else keep
        self.rows = keep.nonzero()[:, 0]          # ascending: equal logits still pick the lower id
        self.step_output = self.output[self.rows].contiguous()
        # as many rows as before: a generate() call restricting midway keeps the batch it sized for
        self._logits = torch.empty(self._logits.shape[0], len(self.rows), dtype=self.dtype)
        return len(self.rows)

    def batch_size(self, most: int = 256, kv_budget: int = 4 << 30) -> int:
        """Sequences per generate() call: as many as `most` whose KV cache fits `kv_budget` bytes.
        Wide batches pay where the output matrix is large: Gemma 3's text (262k rows) came at 462 t/s
        in batches of 256 against 403 t/s in batches of 128 (one core, bfloat16); SmolLM2's (49k rows)
        came at the same speed either way."""
        per_seq = sum(b.spec.n_kv * self.n_ctx * (b.spec.head_dim + b.spec.head_dim_v) for b in self.blocks)
        # counted at the matrices' dtype (a float32 teacher's float16 cache takes half the budget),
        # so a seed's batches (and its sampled streams) stay those of earlier versions
        per_seq *= torch.finfo(self.dtype).bits // 8
        return max(1, min(most, kv_budget // per_seq))

    def new_caches(self, batch: int) -> list[dict]:
        """Empty KV caches for `batch` sequences: views of buffers the teacher keeps across calls. A
        fresh zeroed cache per generate() call (1-6 GB) cost ~10 s of page faults each on Zen 4;
        no zeroing is needed, as a step only reads the slots its call has written (the prefill
        writes every slot of its padded rows)."""
        if not self._kv or self._kv[0][0].shape[0] < batch:
            self._kv = []           # the old buffers go before the new ones are touched
            self._kv = [(torch.empty(batch, b.spec.n_kv, self.n_ctx, b.spec.head_dim, dtype=KV_DTYPE),
                         torch.empty(batch, b.spec.n_kv, self.n_ctx, b.spec.head_dim_v, dtype=KV_DTYPE))
                        for b in self.blocks]
        return [{"n": 0, "k": k[:batch], "v": v[:batch]} for k, v in self._kv]

    @torch.no_grad()
    def residual_rms(self, tokens: list[int], layer: int) -> float:
        """Median RMS of the residual stream entering `layer` over `tokens` (position 0 excluded:
        the first token's residual is an outlier in most models)."""
        ids = torch.tensor([tokens])
        pos, valid = torch.arange(len(tokens))[None], torch.ones(1, len(tokens), dtype=torch.bool)
        h = F.embedding(ids, self.embed_rows) * self.embed_scale
        for block in self.blocks[:layer]:
            h = block(h, self.rotary[block.spec.rope].rows(pos), visible(pos, pos, valid, block.spec.window))
        return float(h[0, 1:].pow(2).mean(-1).sqrt().median())

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, pos: torch.Tensor, k_pos: torch.Tensor, k_valid: torch.Tensor,
             caches: list[dict], out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens/pos [b, t]; k_pos/k_valid [b, cached + t]. Returns the last position's logits
        [b, V] (in the matmul dtype: widening bfloat16 to float32 is exact, and widening all of a
        262k vocabulary each step cost as much as the top-k that only needs the best 40; written
        into `out` if given) and the final-normed hidden of every position [b, t, n_embd]."""
        h = F.embedding(tokens, self.embed_rows) * self.embed_scale
        rows = {spec: r.rows(pos) for spec, r in self.rotary.items()}
        masks = {}
        for block, cache in zip(self.blocks, caches):
            w = block.spec.window
            if w not in masks:
                masks[w] = visible(pos, k_pos, k_valid, w)
            h = block(h, rows[block.spec.rope], masks[w], cache)
        normed = rms_norm(h, self.output_norm, self.model.eps)
        return torch.matmul(normed[:, -1].to(self.dtype), self.step_output.T, out=out), normed

    def generate(self, prompts: list[list[int]], n_new: int, temps: list[float], gen: torch.Generator,
                 stop_ids: set[int], greedy_after: list[int] | None = None, top_k: int = 40,
                 compact_at: int | None = None,
                 restrict_after: int | None = None) -> list[tuple[list[int], torch.Tensor]]:
        """Each prompt continued by up to n_new tokens: top-k sampling at temps[i] for the first
        greedy_after[i] tokens (default: all of them), greedy after that (temperature 0: greedy
        throughout); a stop token ends (and is included in) its continuation. Returns, per prompt,
        (continuation, the final-normed hidden [len(prompt) + len(continuation), n_embd] at every
        position), the hidden the head is fed and trained against. Finished sequences leave the
        batch once compact_at of them (default: 1/16 of the batch) have gathered. restrict_after:
        after this many steps, restrict_output() to what the steps so far ranked."""
        b, longest = len(prompts), max(len(p) for p in prompts)
        if longest + n_new > self.n_ctx:
            raise ValueError(f"teacher: {longest} + {n_new} tokens exceed its context of {self.n_ctx}")
        caches = self.new_caches(b)
        # the training prompts repeat within a batch (53 prompts, 256 continuations): each distinct
        # prompt is prefilled once and its cache rows copied to its repeats (a full-batch prefill
        # was ~1/8 of SmolLM2's text time)
        first: dict[tuple, int] = {}
        inverse = torch.tensor([first.setdefault(tuple(p), len(first)) for p in prompts])
        u = len(first)
        u_tokens, u_pos, u_valid = _left_padded([list(p) for p in first], longest)
        u_caches = [{"n": 0, "k": c["k"][:u], "v": c["v"][:u]} for c in caches]
        logits, normed = self.step(u_tokens, u_pos, u_pos, u_valid, u_caches)
        logit_ids = self.rows          # the ids `logits`' columns stand for (None: every id)
        if u < b:
            for c in caches:
                c["k"][:, :, :longest] = c["k"][inverse, :, :longest]
                c["v"][:, :, :longest] = c["v"][inverse, :, :longest]
            logits, normed = logits[inverse], normed[inverse]
        for c in caches:
            c["n"] = longest
        pos, k_valid = u_pos[inverse], u_valid[inverse]      # a repeat's padded row is its prompt's
        k_pos = pos
        if self._logits.shape[0] < b:
            self._logits = torch.empty(b, self.step_output.shape[0], dtype=self.dtype)
        hidden = torch.empty(b, longest + n_new, normed.shape[-1])
        hidden[:, :longest] = normed
        temp = torch.tensor(temps, dtype=torch.float32)
        switch = torch.tensor(greedy_after if greedy_after is not None else [n_new] * b)
        new = torch.zeros(b, n_new, dtype=torch.int64)
        stop = torch.tensor(sorted(stop_ids), dtype=torch.int64)
        seq = torch.arange(b)       # the sequence decoding in each slot of the batch
        done = torch.zeros(b, dtype=torch.bool)
        ends = torch.full((b,), n_new)
        compact_at = max(1, b // 16) if compact_at is None else compact_at
        for s in range(n_new):
            top, ids = top_k_rows(logits, top_k)
            if logit_ids is None:
                self.ranked[ids.flatten()] = True
            else:
                ids = logit_ids[ids]
            probs = torch.softmax(top.float() / temp[:, None].clamp(min=1e-6), dim=-1)
            # one uniform draw per sequence and step, by inverse CDF: a sequence's stream does not
            # depend on which others are still in the batch
            draw = torch.rand(b, generator=gen)[seq]
            cdf = probs.cumsum(-1)
            pick = (cdf < draw[:, None] * cdf[:, -1:]).sum(-1, keepdim=True).clamp(max=top_k - 1)
            sampled = ids.gather(1, pick)[:, 0]
            nxt = torch.where((temp > 0) & (s < switch), sampled, ids[:, 0])
            if int(done.sum()) >= compact_at:
                # sequences that ended at an earlier step (their last hidden is written) leave the
                # batch: SmolLM2's continuations often end early, and its finished slots had been
                # a quarter of the teacher's work. A finished slot below the new size takes a live
                # one from above it, so only that many cache rows move.
                keep = int((~done).sum())
                order = torch.arange(done.shape[0])
                order[done[:keep].nonzero()[:, 0]] = (~done[keep:]).nonzero()[:, 0] + keep
                order = order[:keep]
                for c in caches:
                    for part in ("k", "v"):
                        c[part][:keep, :, :c["n"]] = c[part][order, :, :c["n"]]
                        c[part] = c[part][:keep]
                nxt, seq, k_pos, k_valid, temp, switch = (x[order] for x in (nxt, seq, k_pos, k_valid, temp, switch))
                done = done[order]
            new[seq, s] = nxt
            stopped = torch.isin(nxt, stop) & ~done
            ends[seq[stopped]] = s + 1
            done |= stopped
            pos = k_pos[:, -1:] + 1
            k_pos = torch.cat((k_pos, pos), dim=1)
            k_valid = torch.cat((k_valid, torch.ones(len(seq), 1, dtype=torch.bool)), dim=1)
            if restrict_after is not None and s + 1 == restrict_after and self.rows is None:
                self.restrict_output()
            # the step's logits (134 MB for Gemma 3's batch) go into a buffer kept across steps and
            # calls: fresh ones page-faulted
            logits, normed = self.step(nxt[:, None], pos, k_pos, k_valid, caches, out=self._logits[:len(seq)])
            logit_ids = self.rows
            hidden[seq, longest + s] = normed[:, 0]
            if bool(done.all()):
                break
        out = []
        for i, p in enumerate(prompts):
            n = int(ends[i])
            out.append((new[i, :n].tolist(), hidden[i, longest - len(p):longest + n].clone()))
        return out
