"""Weight backends: where a matrix lives and how `linear(x)` runs on it.

A layer never asks where its weights are: it calls the object bound here. `CpuQuantLinear` keeps
the quantized bytes in the mmap'd file and runs the k-input matvec (one weight pass for all k
rows); on the trunk device (a GPU when there is one) `QuantLinear` holds the GGUF bytes and
dequantizes tile by tile, `DeviceLinear` holds float weights (F32/F16/BF16 tensors).
Moving a tensor between the two is a placement decision, not a change to model code.
"""
from __future__ import annotations

import os

import numba
import numpy as np
import torch

from cpu_kernels import gdn_block, int_blocks, kv_attention, layer_fused, moe_block
from cpu_kernels.dequant import RowGather, dequantize
from cpu_kernels.ffn import ACTIVATIONS, ffn_glu
from cpu_kernels.formats import format_of
from cpu_kernels.matvec import matvec, use_int
from gpu_kernels.attention import ROWWISE_MAX, attend
from gpu_kernels.linear import linear_rows
from gpu_kernels.norms import rms_norm
from gpu_kernels.pointwise import per_token
from gpu_kernels.qlinear import QuantLinear, TileScratch, tile_rows_of
from gpu_kernels.quant import QUANTIZED_TYPES
from gpu_kernels.triton_matvec import device_rows

from .executor import Executor, HostExperts, HostFFN, SplitFFN, TracedBackend
from .gguf_file import GGUFFile
from .kv_cache import Q8Rows


FUSED_DEFAULT = layer_fused.FUSED_DEFAULT


def _cpu_f32(x: torch.Tensor) -> torch.Tensor:
    return x.to(device="cpu", dtype=torch.float32).contiguous()


# Which matrices take the second int8 pass on their activations (quantize_act.with_residual_rows,
# matvec's `residual`): all but the FFN's gate / up and the output head. One int8 pass everywhere is
# llama.cpp's numerics, mean KL 1.9e-3 (SmolLM2) / 2.8e-3 (Gemma 3) from the float32 forward; the
# second pass on attention and FFN-down inputs takes that to 0.5-0.9e-3 (issue 11 item 4's <= 1e-3)
# for 2 activation rows per token on ~25-40 % of the weights. Gate / up (the widest matrices of a
# layer) and the output head add least per byte (BENCHMARKS "A second int8 pass").
RESIDUAL_SKIP_ROLES = ("ffn_gate", "ffn_up", "output.", "token_embd.")
RESIDUAL_DEFAULT = os.environ.get("HYBRIDRT_ACT_RESIDUAL", "1") not in ("", "0")


def residual_activations(name: str) -> bool:
    """Whether matrix `name` (a GGUF tensor name; "+"-joined for stacked q/k/v, "[...]"-suffixed
    for a slice or an expert) takes the second int8 pass."""
    role = name.split(".", 2)[-1] if name.startswith("blk.") else name
    return bool(name) and not role.startswith(RESIDUAL_SKIP_ROLES)


class CpuQuantLinear:
    """y = W x for k rows of x, W quantized in the mmap (ggml layout: one output row per row)."""

    def __init__(self, raw: np.ndarray, qtype: int, n_in: int, n_out: int, name: str = "",
                 exact: bool | None = None, residual: bool = False):
        format_of(qtype)    # fail at load time, naming the type, not at the first token
        self.raw, self.qtype, self.n_in, self.n_out, self.name = raw, qtype, n_in, n_out, name
        self.exact = exact  # float32 activations (True), int8 (False), the process default (None)
        self.residual = residual   # int8 activations take the second pass (residual_activations)
        self.nbytes = raw.nbytes

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        xc = _cpu_f32(x)
        if out is None or out.device.type != "cpu":
            y = torch.empty(xc.shape[0], self.n_out, dtype=torch.float32)
        else:
            y = out
        matvec(self.raw, self.qtype, xc.numpy(), y.numpy(), exact=self.exact, residual=self.residual)
        if out is not None and y is not out:
            out.copy_(y)
            return out
        return y.to(x.device) if x.device.type != "cpu" else y


class DeviceLinear:
    """A float W on the trunk device; small batches run row by row (bit-stable)."""

    def __init__(self, weight: torch.Tensor, name: str = ""):
        self.weight, self.name = weight, name
        self.n_out, self.n_in = weight.shape
        self.nbytes = weight.numel() * weight.element_size()

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        y = linear_rows(x, self.weight, rowwise=x.shape[0] <= ROWWISE_MAX)
        if out is not None:
            out.copy_(y)
            return out
        return y


class CpuGluFFN:
    """A whole FFN layer (gate, up, down) in the mmap: the fused k-row Numba path."""

    def __init__(self, gate: CpuQuantLinear, up: CpuQuantLinear, down: CpuQuantLinear, act: str):
        self.gate, self.up, self.down, self.act = gate, up, down, act
        self.nbytes = gate.nbytes + up.nbytes + down.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xc = _cpu_f32(x)
        y = ffn_glu(xc.numpy(), self.gate.raw, self.gate.qtype, self.up.raw, self.up.qtype,
                    self.down.raw, self.down.qtype, act=self.act, exact=self.gate.exact,
                    down_residual=self.down.residual)
        y = torch.from_numpy(y)
        return y.to(x.device) if x.device.type != "cpu" else y


class GluFFN:
    """An FFN layer with at least one matrix off the mmap: each matrix runs on its own backend.
    gate_up = (backend, [n_ff, n_ff]) as stacked_linear returns it: gate's and up's rows stacked in
    one backend (gate and up None), the first n_ff output columns gate's; every row is bitwise what
    its own matrix gives."""

    def __init__(self, gate: DeviceLinear | None, up: DeviceLinear | None, down: DeviceLinear, act: str,
                 gate_up: tuple | None = None):
        self.gate, self.up, self.down, self.act, self.gate_up = gate, up, down, act, gate_up
        self.nbytes = down.nbytes + (gate_up[0].nbytes if gate_up is not None else gate.nbytes + up.nbytes)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None:
            linear, n_ff = self.gate_up[0], self.gate_up[1][0]
            gu = linear(x)
            g, u = gu[:, :n_ff], gu[:, n_ff:]
        else:
            g, u = self.gate(x), None
        g = per_token(torch.nn.functional.silu, g) if self.act == "silu" else \
            per_token(lambda t: torch.nn.functional.gelu(t, approximate="tanh"), g)
        return self.down(g * (self.up(x) if u is None else u))


STAGING_ALIGN = 256     # byte alignment of each matrix in the op-offload staging buffer


def _staged(nbytes: int) -> int:
    """A matrix's room in the staging buffer: its bytes rounded up to STAGING_ALIGN."""
    return -(-nbytes // STAGING_ALIGN) * STAGING_ALIGN


def staged_bytes(ffn: CpuGluFFN) -> int:
    """The staging buffer a CPU FFN layer's three matrices take, each aligned."""
    return sum(_staged(m.raw.nbytes) for m in (ffn.gate, ffn.up, ffn.down))


class StreamedFFN:
    """A CPU FFN layer run on the device for one prompt batch (llama.cpp's op offload): its GGUF
    bytes copied from the mmap into the executor's staging buffer, then the device's quantized
    matmuls over them (QuantLinear's tile path: dequantize a tile, one GEMM). The copy is queued on
    the device stream like the kernels, so it waits for the previous layer's reads of the buffer."""

    def __init__(self, host: CpuGluFFN, executor: Executor, scratch: TileScratch, int8_activations: bool):
        self.host, self.executor, self.scratch, self.int8 = host, executor, scratch, int8_activations
        self.nbytes = staged_bytes(host)
        for m in (host.gate, host.up, host.down):      # the tile each takes, reserved while binding
            scratch.reserve(tile_rows_of(m.n_in, m.n_out) * m.n_in)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        buf = self.executor.staging(self.nbytes)
        linears, off = [], 0
        for m in (self.host.gate, self.host.up, self.host.down):
            view = buf[off:off + m.raw.nbytes].view(m.raw.shape)
            view.copy_(_read_only_tensor(m.raw), non_blocking=True)
            linears.append(QuantLinear(view, m.qtype, m.n_in, m.n_out, self.scratch.dtype, m.name, self.scratch,
                                       int8_activations=self.int8, residual=m.residual))
            off += _staged(m.raw.nbytes)
        return GluFFN(*linears, self.host.act)(x)


def _read_only_tensor(a: np.ndarray) -> torch.Tensor:
    """A CPU tensor over a read-only array (the mmap) without a copy; only ever read."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)     # "the given NumPy array is not writable"
        return torch.from_numpy(a)


class RoutedExperts:
    """A MoE layer's routed experts, each a gated FFN bound where the plan put its layer.

    `experts(x, top_e, weights)` is sum_j weights[:, j] * expert_{top_e[:, j]}(x). The batch's tokens
    are grouped by expert: each touched expert runs once over the rows routed to it (on the CPU one
    k-input fused FFN, its weights read once for all of them), and every token adds its experts in
    ascending id order from zero, so a token's output bits do not depend on which other tokens share
    the batch (the k-input kernels are bit-stable across k)."""

    def __init__(self, experts: list):
        self.experts = experts
        self.nbytes = sum(e.nbytes for e in experts)
        self.n_embd = experts[0].down.n_out

    def __call__(self, x: torch.Tensor, top_e: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(x.shape[0], self.n_embd, dtype=torch.float32, device=x.device)
        ids = top_e.cpu()       # which experts run is a host decision: one small copy, not one per expert
        picks = [(e, *(ids == e).nonzero(as_tuple=True)) for e in torch.unique(ids).tolist()]    # ascending
        if not picks:
            return out
        # every expert's (row, slot) pairs go back to x's device in one copy: on a GPU two small
        # pageable copies per expert were 16 host waits per layer between its kernel launches
        index = torch.cat([torch.stack((rows, slot)) for _, rows, slot in picks], dim=1).to(x.device)
        for (e, _, _), (rows, slot) in zip(picks, index.split([len(p[1]) for p in picks], dim=1)):
            out.index_add_(0, rows, self.experts[e](x[rows]) * weights[rows, slot, None])
        return out


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
                  first: int = 0) -> torch.Tensor:
    """gpu_kernels.attention.attend for a CPU trunk: kv_attention's kernel (the fused layers' own)
    on Numba's threads over an f32, f16 or q8_0 cache, for any batch, prompts included (torch's
    SDPA runs there on the trunk's single torch thread: 2x the time on Gemma 3's 512-token prompt,
    60a8fb1; docs/history.md, "Prompt attention on kv_attention"); torch's attend for a bf16 cache."""
    kc, vc = _fused_cache_view(k_cache), _fused_cache_view(v_cache)
    if kc is None or vc is None or q.device.type != "cpu":
        return attend(q, k_cache, v_cache, positions, scale, window, first)
    n, n_head, d = q.shape
    n_kv, d_v = k_cache.shape[1], v_cache.shape[2]
    o = np.empty((n, n_head * d_v), np.float32)
    kv_attention.attend(numba.get_num_threads(), _rows_f32(q.reshape(n, n_head * d)), kc, vc, o, positions[0],
                        n_head, n_kv, d, d_v, scale, window, first)
    return torch.from_numpy(o).view(n, n_head, d_v)


def _covering(kernel_types: tuple, operands: list) -> tuple:
    """kernel_types = (int_types, float_path) of layer_fused, checked to cover the operands."""
    int_types, float_path = kernel_types
    have = {qt for qt, flag in zip(sorted(int_blocks.SPECS), int_types) if flag is True}
    if any(op[3] and op[1] not in have for op in operands) or (not float_path and not all(op[3] for op in operands)):
        raise ValueError(f"fused kernels compiled for integer types {sorted(have)}, float path {bool(float_path)}"
                         f" do not cover {[(op[1], op[3]) for op in operands]} (type, integer)")
    return kernel_types


def _rows_f32(h: torch.Tensor) -> np.ndarray:
    """A CPU trunk's float32 hidden rows as a C-contiguous array (no copy when they already are)."""
    return np.ascontiguousarray(h.numpy() if h.dtype == torch.float32 else _cpu_f32(h).numpy())


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
        self.args = (*_covering(kernel_types, mats), block.norm.numpy(), mixer.spec.eps,
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
    WeightBinder.mtp_step, which returns None where any part runs otherwise."""

    def __init__(self, embedding: "Embedding", embed_scale: float, enorm, hnorm, eh_proj: CpuQuantLinear,
                 attn_half: FusedAttentionBlock, ffn_half: FusedFfnBlock, head_norm, output: CpuQuantLinear, eps: float):
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


class Embedding:
    """Token embedding rows gathered from the mmap (a step needs only k rows of it)."""

    def __init__(self, gguf: GGUFFile, name: str, device: torch.device):
        info = gguf.tensors[name]
        self.gather, self.device = RowGather(gguf.tensor_bytes(name), info.qtype, info.shape[0]), device

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        ids = tokens.to("cpu", torch.int64).numpy()
        return torch.from_numpy(self.gather(ids)).to(self.device)


def _ffn_units(raw: np.ndarray, qtype: int, n_cols: int, lo: int, hi: int) -> np.ndarray:
    """Columns [lo, hi) of every row of a quantized matrix (ffn_down's slice of intermediate units),
    as a contiguous copy; lo and hi fall on block boundaries."""
    elems, nbytes = format_of(qtype).block_elems, format_of(qtype).block_bytes
    if lo % elems or hi % elems or n_cols % elems:
        raise ValueError(f"split at units {lo}:{hi} is not on a {elems}-weight block boundary")
    return np.ascontiguousarray(raw[:, lo // elems * nbytes:hi // elems * nbytes])


class WeightBinder:
    """Binds each tensor of a GGUF to a backend, following a per-tensor device map.

    `tensor_devices` maps tensor names to "cpu" (quantized, mmap) or "device" (a copy on `device`:
    quantized types keep their GGUF bytes, float types become `device_dtype`); names absent from it
    go to `default`. With no GPU everything defaults to "cpu".

    With an `executor` (a plan is being executed), FFN layers left on the CPU are bound as
    `HostFFN` (their rows cross to the host and back; with `op_offload`, prompt batches copy their
    weights to the device and run there instead: `StreamedFFN`), a MoE layer's routed experts left on the CPU
    as `HostExperts` (likewise, with the routing), `split` = (layer, units) binds that layer's
    first `units` intermediate units on the device and the rest on the CPU, and with tracing on,
    device backends report their calls to the trace.

    Without an executor, on a CPU trunk, a layer's attention and FFN halves whose matrices are all
    in the mmap run as one fused Numba call each (`attention_block`, `ffn_block`).
    """

    def __init__(self, gguf: GGUFFile, device: torch.device, tensor_devices: dict[str, str] | None = None,
                 default: str = "cpu", device_dtype: torch.dtype = torch.float32,
                 executor: Executor | None = None, split: tuple[int, int] | None = None,
                 exact: bool | None = None, fused: bool | None = None, fused_qtypes: list[int] | None = None,
                 act_residual: bool | None = None, op_offload: bool = False):
        self.gguf, self.device = gguf, device
        self.op_offload = op_offload and executor is not None   # prompt batches run CPU layers on the device
        # the second int8 pass where residual_activations says (None: RESIDUAL_DEFAULT)
        self.act_residual = RESIDUAL_DEFAULT if act_residual is None else act_residual
        # False: the torch trunk ops even where the fused kernels could run (None: FUSED_DEFAULT)
        self.fused = FUSED_DEFAULT if fused is None else fused
        self.tensor_devices = tensor_devices or {}
        self.default, self.device_dtype = default, device_dtype
        self.executor, self.split, self.exact = executor, split, exact
        self.trace = executor.trace if executor is not None else None
        self.scratch = TileScratch(device, device_dtype)    # one dequantization tile for all QuantLinears
        self._kernel_types = None   # _fused_types, worked out at the first fused layer
        self._fused_qtypes = fused_qtypes   # the types those cover (None: layer_qtypes())

    def _cpu(self, raw: np.ndarray, qtype: int, n_in: int, n_out: int, name: str = "") -> CpuQuantLinear:
        return CpuQuantLinear(raw, qtype, n_in, n_out, name, exact=self.exact, residual=self._residual(name))

    def _residual(self, name: str) -> bool:
        """Whether matrix `name`, wherever it is bound, takes the second int8 pass."""
        return self.act_residual and residual_activations(name)

    def _exact(self) -> bool:
        from cpu_kernels.matvec import EXACT_DEFAULT

        return EXACT_DEFAULT if self.exact is None else self.exact

    def has(self, name: str) -> bool:
        return name in self.gguf.tensors

    def where(self, name: str) -> str:
        return self.tensor_devices.get(name, self.default)

    def dense(self, name: str) -> torch.Tensor:
        """A small tensor (norm weight, bias, conv kernel) as float32 on the trunk device,
        in numpy order (reversed ggml shape)."""
        info = self.gguf.tensors[name]
        values = dequantize(self.gguf.tensor_bytes(name), info.qtype, info.shape[0])
        return torch.from_numpy(values.reshape(tuple(reversed(info.shape)))).to(self.device)

    def linear(self, name: str):
        info = self.gguf.tensors[name]
        n_in, n_out = info.shape[0], info.n_rows
        if self.where(name) == "cpu":
            return self._cpu(self.gguf.tensor_bytes(name), info.qtype, n_in, n_out, name)
        return self._device_linear(self.gguf.tensor_bytes(name), info.qtype, n_in, n_out, name)

    def _device_linear(self, raw: np.ndarray, qtype: int, n_in: int, n_out: int, name: str):
        """A copy of raw (rows, row_bytes) on the device: GGUF blocks for quantized types, floats
        for the rest."""
        if qtype in QUANTIZED_TYPES:
            # a copy (the mmap is read-only), with the bytes the fused kernel reads past the last
            # row when the width is not a multiple of its 256-weight chunk
            on_device = device_rows(_read_only_tensor(np.ascontiguousarray(raw)), qtype, n_in, self.device)
            linear = QuantLinear(on_device, qtype, n_in, n_out, self.device_dtype, name, self.scratch,
                                 int8_activations=not self._exact(), residual=self._residual(name))
        else:
            weight = torch.from_numpy(dequantize(raw, qtype, n_in))
            linear = DeviceLinear(weight.to(self.device, self.device_dtype), name)
        return linear if self.trace is None else TracedBackend(linear, self.trace, name)

    def stacked_linear(self, names: list[str], device_only: bool = False):
        """One backend for several matrices that read the same input (q, k, v), their rows stacked
        into one copy, so a step makes one matvec call instead of three; or None when their
        placement, type or input width differ, or (device_only) when they stay in the mmap, where
        the copy would be anonymous memory beside the mapped file. Row r of the result is bitwise
        what the separate matrix gives (rows are independent in every kernel). Returns (linear,
        row counts)."""
        infos = [self.gguf.tensors[n] for n in names]
        if len({self.where(n) for n in names}) != 1 or len({(i.qtype, i.shape[0]) for i in infos}) != 1:
            return None
        if device_only and self.where(names[0]) == "cpu":
            return None
        raw = np.concatenate([self.gguf.tensor_bytes(n) for n in names])
        qtype, n_in, n_out = infos[0].qtype, infos[0].shape[0], raw.shape[0]
        name = "+".join(names)
        if self.where(names[0]) == "cpu":
            linear = self._cpu(raw, qtype, n_in, n_out, name)
        else:
            linear = self._device_linear(raw, qtype, n_in, n_out, name)
        return linear, [i.n_rows for i in infos]

    def glu_ffn(self, prefix: str, act: str, suffix: str = ""):
        """A gated FFN (ffn_gate/up/down{suffix}; "_shexp" is a MoE layer's shared expert)."""
        names = [f"{prefix}.ffn_{m}{suffix}.weight" for m in ("gate", "up", "down")]
        places = {self.where(n) for n in names}
        if self.split is not None and prefix == f"blk.{self.split[0]}" and places == {"cpu"} and not suffix:
            return self._split_ffn(prefix, names, act, self.split[1])
        if places == {"cpu"}:
            ffn = CpuGluFFN(*(self.linear(n) for n in names), act)
            return ffn if self.executor is None else HostFFN(ffn, self.executor, prefix, self._streamed(ffn))
        # gate and up read the same input: on the device, one stacked matrix (one activation
        # round trip and one matvec launch per layer instead of two of each)
        stacked = self.stacked_linear(names[:2], device_only=True)
        if stacked is not None:
            return GluFFN(None, None, self.linear(names[2]), act, gate_up=stacked)
        return GluFFN(*(self.linear(n) for n in names), act)

    def routed_experts(self, prefix: str):
        """A MoE layer's routed experts (ffn_{gate,up,down}_exps, {n_in, n_out, n_expert}): one gated
        FFN per expert, on the device or in the mmap as the plan says for the layer; with an executor,
        experts left in the mmap run on its worker (HostExperts)."""
        names = [f"{prefix}.ffn_{m}_exps.weight" for m in ("gate", "up", "down")]
        n_expert = self.gguf.tensors[names[0]].shape[2]
        experts = RoutedExperts([self._expert_glu(names, e) for e in range(n_expert)])
        if self.executor is not None and {self.where(n) for n in names} == {"cpu"}:
            return HostExperts(experts, self.executor, f"{prefix} experts")
        return experts

    def _expert_glu(self, names: list[str], expert: int):
        linears = []
        for name in names:
            info = self.gguf.tensors[name]
            n_in, n_out = info.shape[0], info.shape[1]
            raw = self.gguf.tensor_bytes(name)[expert * n_out:(expert + 1) * n_out]   # its rows are contiguous
            if self.where(name) == "cpu":
                linears.append(self._cpu(raw, info.qtype, n_in, n_out, f"{name}[{expert}]"))
            else:
                linears.append(self._device_linear(raw, info.qtype, n_in, n_out, f"{name}[{expert}]"))
        if all(isinstance(m, CpuQuantLinear) for m in linears):
            return CpuGluFFN(*linears, "silu")
        return GluFFN(*linears, "silu")

    def _split_ffn(self, prefix: str, names: list[str], act: str, units: int) -> SplitFFN:
        """Units [0, units) of the layer on the device, [units, n_ff) in host memory (gate and up
        rows are plain row slices of the mmap; ffn_down's column slices are copied)."""
        (g, u, d), raws = (self.gguf.tensors[n] for n in names), [self.gguf.tensor_bytes(n) for n in names]
        n_embd, n_ff = g.shape[0], g.n_rows
        dev = GluFFN(self._device_linear(raws[0][:units], g.qtype, n_embd, units, f"{names[0]}[:{units}]"),
                     self._device_linear(raws[1][:units], u.qtype, n_embd, units, f"{names[1]}[:{units}]"),
                     self._device_linear(_ffn_units(raws[2], d.qtype, n_ff, 0, units), d.qtype, units, n_embd,
                                         f"{names[2]}[:, :{units}]"), act)
        rest = n_ff - units
        host = CpuGluFFN(self._cpu(raws[0][units:], g.qtype, n_embd, rest, f"{names[0]}[{units}:]"),
                         self._cpu(raws[1][units:], u.qtype, n_embd, rest, f"{names[1]}[{units}:]"),
                         self._cpu(_ffn_units(raws[2], d.qtype, n_ff, units, n_ff), d.qtype, rest, n_embd,
                                        f"{names[2]}[:, {units}:]"), act)
        return SplitFFN(dev, HostFFN(host, self.executor, f"{prefix} [{units}:]", self._streamed(host)),
                        self.executor, prefix)

    def _streamed(self, ffn: CpuGluFFN) -> StreamedFFN | None:
        """The op-offload path of a CPU FFN layer, where the plan reserved its staging buffer."""
        if not self.op_offload:
            return None
        return StreamedFFN(ffn, self.executor, self.scratch, int8_activations=not self._exact())

    def _fusable(self) -> bool:
        """The fused layer kernels serve a plain CPU trunk: no plan executing (its trunk is
        "the device", even when a CPU stands in for it) and nothing traced."""
        return self.executor is None and self.device.type == "cpu" and self.fused

    def attention_kernel(self):
        """The attention over a KV cache the torch layers call (gpu_kernels.attention.attend's
        signature): on a plain CPU trunk kv_attention's (attend_on_cpu), else torch's."""
        return attend_on_cpu if self._fusable() else attend

    def norm_kernel(self):
        """The RMSNorm small per-token layers outside the fused halves call (rms_norm's
        signature): on a plain CPU trunk one compiled call, else torch's."""
        return rms_norm_on_cpu if self._fusable() else rms_norm

    def attention_block(self, block):
        """How a layer's attention half runs: `block` (models.common.AttentionBlock, torch ops
        around the bound matrices) or, on a CPU trunk with all its matrices in the mmap, the
        fused kernel wrapping it."""
        a = block.attn
        mats = [a.wqkv, a.wo] if a.wqkv is not None else [a.wq, a.wk, a.wv, a.wo]
        if self._fusable() and all(type(m) is CpuQuantLinear for m in mats):
            return FusedAttentionBlock(block, self._fused_types())
        return block

    def gdn_block(self, block):
        """How a Gated DeltaNet layer half runs: `block` (models.qwen35.GDNBlock, torch ops around
        the bound matrices) or, on a CPU trunk with all its matrices in the mmap, FusedGDNBlock."""
        m = block.mixer
        if self._fusable() and m.w_in is None and all(type(x) is CpuQuantLinear for x in [*m.w_rest, m.w_out]):
            return FusedGDNBlock(block, self._fused_types())
        return block

    def ffn_block(self, block):
        """How a layer's FFN half runs: `block` (models.common.FfnBlock) or the fused kernel."""
        if self._fusable() and type(block.ffn) is CpuGluFFN:
            return FusedFfnBlock(block, self._fused_types())
        experts = getattr(block.ffn, "experts", None)
        if (self._fusable() and block.post_norm is None and type(experts) is RoutedExperts
                and all(type(e) is CpuGluFFN for e in experts.experts) and type(block.ffn.shared) is CpuGluFFN
                and type(block.ffn.router) is CpuQuantLinear and type(block.ffn.shared_gate) is CpuQuantLinear):
            try:
                return FusedMoEBlock(block, self._fused_types(), self.gguf)
            except ValueError:      # kernel types or activation blocks the fused kernel does not cover
                return block
        return block

    def mtp_step(self, embedding, embed_scale: float, enorm, hnorm, eh_proj, attn_half, ffn_half, head_norm,
                 output, eps: float) -> FusedMTPStep | None:
        """A trained MTP head's step as one fused call (FusedMTPStep) where every part of it runs
        fused on this CPU trunk and the target's embedding is in the mmap; else None."""
        if not (self._fusable() and isinstance(embedding, Embedding) and embedding.device.type == "cpu"
                and type(attn_half) is FusedAttentionBlock and type(ffn_half) is FusedFfnBlock
                and type(eh_proj) is CpuQuantLinear and type(output) is CpuQuantLinear):
            return None
        try:
            return FusedMTPStep(embedding, embed_scale, enorm, hnorm, eh_proj, attn_half, ffn_half, head_norm,
                                output, eps)
        except ValueError:          # kernel types that do not cover the head's matrices
            return None

    def _fused_types(self) -> tuple:
        """(int_types, float_path) of the fused kernels (compile-time constants, see layer_fused):
        for all of the file's layer matrices, so every layer shares one compilation that holds
        only the code these types take (no float kernel when each has an integer one)."""
        if self._kernel_types is None:
            qtypes = self.layer_qtypes() if self._fused_qtypes is None else self._fused_qtypes
            self._kernel_types = layer_fused.kernel_types((q, use_int(q, self.exact)) for q in qtypes)
        return self._kernel_types

    def layer_qtypes(self) -> list[int]:
        """The quant types of the file's layer matrices."""
        return [info.qtype for name, info in self.gguf.tensors.items() if name.startswith("blk.") and len(info.shape) >= 2]

    def embedding(self, name: str) -> Embedding:
        return Embedding(self.gguf, name, self.device)
