"""Blocks shared by the architectures: the attention layer, a trunk layer (`Layer`), hyper-parameters
read from GGUF, and the per-session state every model keeps (KV cache, rotary tables)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gpu_kernels.norms import rms_norm
from gpu_kernels.pointwise import per_token
from gpu_kernels.rotary import RotaryRows, RotaryTable, apply_rotary, rotary_rows, rotary_rows_at, rotary_table

from ..runtime.backends import WeightBinder
from ..errors import UserError
from ..files.gguf_file import GGUFFile
from ..runtime.kv_cache import KVCache
from .arch_spec import ATTENTION


@dataclass(frozen=True)
class RopeSpec:
    n_rot: int
    base: float
    neox: bool
    scale: float = 1.0          # position multiplier (1 / linear scaling factor)


@dataclass(frozen=True)
class AttentionSpec:
    n_head: int
    n_kv: int
    head_dim: int
    head_dim_v: int
    scale: float
    eps: float
    rope: RopeSpec
    window: int = 0             # sliding window (0: full causal)
    qk_norm: bool = False       # RMSNorm of q and k per head (qwen3, gemma3, qwen35)
    gated: bool = False         # qwen35: attn_q holds [q_h | gate_h] per head; out *= sigmoid(gate)
    first_pos: int = 0          # the cache holds no keys before this position (MTP: 1)


def rope_scale(f: GGUFFile) -> float:
    """Positions' frequency scale from rope.scaling.*: linear divides by the factor. Other kinds
    (yarn, longrope) change every position's angles in llama.cpp, even in a short context; running
    them unscaled would be silently different logits, so a factor that would act is refused."""
    kind = f.get("rope.scaling.type") or "none"
    factor = float(f.get("rope.scaling.factor", 1.0) or 1.0)
    if kind == "linear":
        return 1.0 / factor
    if kind != "none" and factor != 1.0:
        raise UserError(f"{f.path}: rope scaling '{kind}' (factor {factor:g}) is not supported "
                        f"(supported: linear, or none)")
    return 1.0


@dataclass
class ModelState:
    """Everything a session mutates while decoding: caches and the rotary tables for its context."""
    n_ctx: int
    kv: KVCache
    rope: dict[RopeSpec, RotaryTable] = field(default_factory=dict)
    rope_rows: dict[RopeSpec, tuple[int, int, RotaryRows]] = field(default_factory=dict)   # last run per spec
    extra: dict = field(default_factory=dict)    # architecture-specific state (recurrent, MTP)
    # the step's positions as a tensor on the trunk's device, set by the executor while it runs steps
    # from static buffers (runtime/step_graphs.py: a replayed CUDA graph sees no Python ints), None
    # otherwise; rotary rows, KV writes and attention read it where set
    positions: torch.Tensor | None = None

    def rotary(self, spec: RopeSpec, device) -> RotaryTable:
        table = self.rope.get(spec)
        if table is None:
            table = rotary_table(self.n_ctx, spec.n_rot, spec.base, spec.neox, spec.scale, device)
            self.rope[spec] = table
        return table

    def rotary_at(self, spec: RopeSpec, start: int, n: int, device) -> RotaryRows:
        """cos/sin rows of positions [start, start + n), reused by every layer of one forward
        (gathered at `positions` when the executor set them: a graph replays the gather)."""
        if self.positions is not None:
            return rotary_rows_at(self.rotary(spec, device), self.positions)
        last = self.rope_rows.get(spec)
        if last is None or last[:2] != (start, n):
            last = (start, n, rotary_rows(self.rotary(spec, device), start, n))
            self.rope_rows[spec] = last
        return last[2]


def check_attention_shapes(f: GGUFFile, prefix: str, spec: AttentionSpec) -> None:
    """Refuse a layer whose q/k/v/output matrices disagree with the head metadata (as llama.cpp's
    loader does): e.g. a llama file with head_dim != n_embd / n_head but no attention.key_length.
    Unchecked, the fused CPU kernels read such matrices out of bounds and print garbage."""
    q_rows = spec.n_head * spec.head_dim * (2 if spec.gated else 1)
    want = {"attn_q": (None, q_rows), "attn_k": (None, spec.n_kv * spec.head_dim),
            "attn_v": (None, spec.n_kv * spec.head_dim_v), "attn_output": (spec.n_head * spec.head_dim_v, None)}
    for short, (n_in, n_out) in want.items():
        name = f"{prefix}.{short}.weight"
        info = f.tensors.get(name)
        if info is None:
            raise UserError(f"{name} is missing from the file")
        if (n_in is not None and info.shape[0] != n_in) or (n_out is not None and info.n_rows != n_out):
            expected = (n_in or info.shape[0], n_out or info.n_rows)
            raise UserError(f"{name} has shape {tuple(info.shape)}, expected {expected} from the metadata "
                            f"({spec.n_head} heads, {spec.n_kv} KV heads, head dim {spec.head_dim}/"
                            f"{spec.head_dim_v}; a missing attention.key_length means n_embd / n_head)")


class Attention:
    """One attention layer: projections, optional q/k norm, rotary, KV write, attend, output."""

    def __init__(self, w: WeightBinder, prefix: str, spec: AttentionSpec, cache_index: int):
        self.spec, self.cache_index = spec, cache_index
        names = [f"{prefix}.attn_q.weight", f"{prefix}.attn_k.weight", f"{prefix}.attn_v.weight"]
        check_attention_shapes(w.gguf, prefix, spec)
        stacked = w.stacked_linear(names)
        if stacked is not None:
            self.wqkv, self.qkv_rows = stacked
        else:
            self.wqkv = None
            self.wq, self.wk, self.wv = (w.linear(n) for n in names)
        self.wo = w.linear(f"{prefix}.attn_output.weight")
        self.attend = w.attention_kernel()      # over the KV cache, wherever the binder keeps it
        if spec.qk_norm:
            self.q_norm = w.dense(f"{prefix}.attn_q_norm.weight")
            self.k_norm = w.dense(f"{prefix}.attn_k_norm.weight")

    def __call__(self, x: torch.Tensor, state: ModelState, pos_list: list[int]) -> torch.Tensor:
        q, k, v, gate = self._heads(x)
        return self._output(self._attend(q, k, v, state, pos_list), gate)

    def batched(self, x: torch.Tensor, batch) -> torch.Tensor:
        """__call__ over a batch of several sequences (runtime.batch.StepBatch): the projections
        over all rows at once, rotary, KV writes and attention sequence by sequence on its cache."""
        q, k, v, gate = self._heads(x)
        o = torch.cat([self._attend(q[r], k[r], v[r], seq.state, seq.positions)
                       for seq, r in zip(batch.seqs, batch.rows)])
        return self._output(o, gate)

    def _heads(self, x: torch.Tensor):
        """q [n, n_head, d] (q-normed), k [n, n_kv, d], v [n, n_kv, dv] and the gate rows (None
        unless gated) of x's rows."""
        s, n = self.spec, x.shape[0]
        q, k, v = self._project(x)
        gate = None
        if s.gated:
            q = q.reshape(n, s.n_head, 2 * s.head_dim)
            q, gate = q[..., :s.head_dim], q[..., s.head_dim:].reshape(n, s.n_head * s.head_dim)
        else:
            q = q.reshape(n, s.n_head, s.head_dim)
        k = k.reshape(n, s.n_kv, s.head_dim)
        v = v.reshape(n, s.n_kv, s.head_dim_v)
        if s.qk_norm:
            q = rms_norm(q, self.q_norm, s.eps)
        return q, k, v, gate

    def _attend(self, q, k, v, state: ModelState, pos_list: list[int]) -> torch.Tensor:
        """One sequence's rows: rotary, the KV write, attention over its cache -> [n, n_head dv]."""
        s, n = self.spec, q.shape[0]
        rows = state.rotary_at(s.rope, pos_list[0], n, q.device)
        q = apply_rotary(q, rows)
        self._store(k, v, state, pos_list, rows)
        return self.attend(q, state.kv.k[self.cache_index], state.kv.v[self.cache_index], pos_list,
                           s.scale, s.window, s.first_pos, at=state.positions).reshape(n, s.n_head * s.head_dim_v)

    def _output(self, o: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        if gate is not None:
            o = o * per_token(torch.sigmoid, gate)
        return self.wo(o)

    def write_kv(self, x: torch.Tensor, state: ModelState, pos_list: list[int]) -> None:
        """Only the KV rows __call__ writes for x (the same values): an MTP head catching up on
        committed tokens, whose outputs nobody reads."""
        s, n = self.spec, x.shape[0]
        if self.wqkv is not None:       # the stacked matrix: q comes with k and v
            _, k, v = self._project(x)
        else:
            k, v = self.wk(x), self.wv(x)
        self._store(k.reshape(n, s.n_kv, s.head_dim), v.reshape(n, s.n_kv, s.head_dim_v), state, pos_list,
                    state.rotary_at(s.rope, pos_list[0], n, x.device))

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.wqkv is not None:
            return torch.split(self.wqkv(x), self.qkv_rows, dim=-1)
        return self.wq(x), self.wk(x), self.wv(x)

    def _store(self, k: torch.Tensor, v: torch.Tensor, state: ModelState, pos_list: list[int], rows) -> None:
        """k [n, n_kv, d] (before its norm and rotary), v [n, n_kv, dv] into the cache."""
        if self.spec.qk_norm:
            k = rms_norm(k, self.k_norm, self.spec.eps)
        state.kv.write(self.cache_index, pos_list[0], apply_rotary(k, rows), v, at=state.positions)


@dataclass(frozen=True)
class Layer:
    """One trunk layer as the binder runs it: its mixer half and its FFN half, each
    h + [post_norm](f(norm(h))) with its norm and residual inside. `kind` (arch_spec.ATTENTION or
    GDN) says what the mixer is: an attention half (AttentionBlock, or the binder's fused stand-in,
    either holding `.attn`) called with the batch's positions, or a Gated DeltaNet half
    (models.qwen35.GDNBlock or its stand-in) called with whether to capture snapshots."""
    kind: str
    mixer: object
    ffn: object

    @property
    def attention(self) -> Attention | None:
        """The mixer's Attention (its spec: window, rotary, heads), None for a Gated DeltaNet layer."""
        return self.mixer.attn if self.kind == ATTENTION else None


class AttentionBlock:
    """A layer's attention half, h + [post_norm](attn(rms_norm(h))), in torch ops around the bound
    matrices. The binder may hand back a fused CPU kernel in its place (`WeightBinder.attention_block`)."""

    def __init__(self, w: WeightBinder, prefix: str, spec: AttentionSpec, cache_index: int,
                 post_norm: str | None = None):
        self.eps = spec.eps
        self.norm = w.dense(f"{prefix}.attn_norm.weight")
        self.attn = Attention(w, prefix, spec, cache_index)
        self.post_norm = w.dense(f"{prefix}.{post_norm}.weight") if post_norm else None

    def __call__(self, h: torch.Tensor, state: ModelState, pos_list: list[int]) -> torch.Tensor:
        a = self.attn(rms_norm(h, self.norm, self.eps), state, pos_list)
        return h + (a if self.post_norm is None else rms_norm(a, self.post_norm, self.eps))

    def batched(self, h: torch.Tensor, batch) -> torch.Tensor:
        """__call__ over a batch of several sequences (runtime.batch.StepBatch)."""
        a = self.attn.batched(rms_norm(h, self.norm, self.eps), batch)
        return h + (a if self.post_norm is None else rms_norm(a, self.post_norm, self.eps))

    def write_kv(self, h: torch.Tensor, state: ModelState, pos_list: list[int]) -> None:
        self.attn.write_kv(rms_norm(h, self.norm, self.eps), state, pos_list)


class FfnBlock:
    """A layer's FFN half, h + [post_norm](ffn(rms_norm(h; norm))), around the bound gated FFN (or
    the `ffn` given, e.g. a mixture of experts)."""

    def __init__(self, w: WeightBinder, prefix: str, act: str, eps: float, post_norm: str | None = None,
                 norm: str = "ffn_norm", ffn=None):
        self.eps = eps
        self.norm = w.dense(f"{prefix}.{norm}.weight")
        self.ffn = w.glu_ffn(prefix, act=act) if ffn is None else ffn
        self.post_norm = w.dense(f"{prefix}.{post_norm}.weight") if post_norm else None

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        f = self.ffn(rms_norm(h, self.norm, self.eps))
        return h + (f if self.post_norm is None else rms_norm(f, self.post_norm, self.eps))


def attention_block(w: WeightBinder, prefix: str, spec: AttentionSpec, cache_index: int,
                    post_norm: str | None = None):
    """The attention half of layer `prefix` as the binder runs it (torch ops or one fused call)."""
    return w.attention_block(AttentionBlock(w, prefix, spec, cache_index, post_norm))


def ffn_block(w: WeightBinder, prefix: str, act: str, eps: float, post_norm: str | None = None,
              norm: str = "ffn_norm", ffn=None):
    """The FFN half of layer `prefix` as the binder runs it."""
    return w.ffn_block(FfnBlock(w, prefix, act, eps, post_norm, norm, ffn))
