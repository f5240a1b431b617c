"""WeightBinder: binds every weight of a GGUF to a backend, and `RULES`, the one table that says
which: (role, placement, mode) -> what builds it.

A role is what the models ask the binder for (a matrix, a gated FFN, a layer half...); the placement
is where that part's matrices are by the plan's map (`Placement`, from `where`); the mode is the
loaded model's execution mode (`RuntimeConfig.mode`). Adding a backend is a row here and the method
that builds it; a (role, placement, mode) with no row is an error naming it, at load.
"""
from __future__ import annotations

import enum
from types import MappingProxyType
from typing import Callable, Mapping

import numpy as np
import torch

from cpu_kernels import layer_fused
from cpu_kernels.dequant import dequantize
from cpu_kernels.formats import format_of
from cpu_kernels.matvec import use_int
from gpu_kernels.attention import attend
from gpu_kernels.norms import rms_norm
from gpu_kernels.qlinear import QuantLinear, TileScratch
from gpu_kernels.quant import QUANTIZED_TYPES
from gpu_kernels.triton_matvec import device_rows

from ..executor import Executor
from ...files.gguf_file import GGUFFile
from ..config import Mode, RuntimeConfig, resolve_config
from .cpu import CpuGluFFN, CpuQuantLinear, Embedding, RoutedExperts
from .crossing import HostExperts, HostFFN, SplitFFN, StreamedFFN, TracedBackend
from .device import DeviceLinear, GluFFN, mmap_tensor
from .fused import (FusedAttentionBlock, FusedFfnBlock, FusedGDNBlock, FusedMoEBlock, FusedMTPStep, attend_on_cpu,
                    rms_norm_on_cpu)
from .protocols import Placement


class Role(enum.Enum):
    """What the models ask the binder for."""
    MATRIX = "a matrix, or several stacked that read the same input"
    GLU_FFN = "a layer's gated FFN, or a MoE layer's shared expert"
    EXPERT_FFN = "one routed expert's gated FFN"
    ROUTED_EXPERTS = "a MoE layer's routed experts"
    ATTENTION_HALF = "a layer's attention half"
    GDN_HALF = "a Gated DeltaNet layer half"
    FFN_HALF = "a layer's FFN half around a gated FFN"
    MOE_HALF = "a layer's FFN half around a mixture of experts"
    MTP_STEP = "a trained MTP head's whole draft step"


# The placements each role meets. A matrix is in one place; SPLIT is the plan's boundary layer
# (its gated FFN, and the FFN half around it), met only while a plan executes.
ROLE_PLACEMENTS = {
    Role.MATRIX: (Placement.MMAP, Placement.DEVICE),
    Role.GLU_FFN: (Placement.MMAP, Placement.DEVICE, Placement.MIXED, Placement.SPLIT),
    Role.EXPERT_FFN: (Placement.MMAP, Placement.DEVICE, Placement.MIXED),
    Role.ROUTED_EXPERTS: (Placement.MMAP, Placement.DEVICE, Placement.MIXED),
    Role.ATTENTION_HALF: (Placement.MMAP, Placement.DEVICE, Placement.MIXED),
    Role.GDN_HALF: (Placement.MMAP, Placement.DEVICE, Placement.MIXED),
    Role.FFN_HALF: (Placement.MMAP, Placement.DEVICE, Placement.MIXED, Placement.SPLIT),
    Role.MOE_HALF: (Placement.MMAP, Placement.DEVICE, Placement.MIXED),
    Role.MTP_STEP: (Placement.MMAP, Placement.DEVICE, Placement.MIXED),
}


def can_meet(role: Role, placement: Placement, mode: Mode) -> bool:
    """Whether the binder can be asked for `role` at `placement` in `mode`."""
    return placement in ROLE_PLACEMENTS[role] and (placement is not Placement.SPLIT or mode.planned)


def rule_for(rules: Mapping, role: Role, placement: Placement, mode: Mode) -> Callable:
    """The rule of (role, placement, mode) in `rules`; a missing one is an error naming it."""
    rule = rules.get((role, placement, mode))
    if rule is None:
        raise LookupError(f"no backend rule for {role.name} with its matrices {placement.name} ({placement.value}) "
                          f"in mode {mode.name} ({mode.value}): add a row to hybridrt/backends/binder.py RULES")
    return rule


# Which matrices take the second int8 pass on their activations (quantize_act.with_residual_rows,
# matvec's `residual`): all but the FFN's gate / up and the output head. One int8 pass everywhere is
# llama.cpp's numerics, mean KL 1.9e-3 (SmolLM2) / 2.8e-3 (Gemma 3) from the float32 forward; the
# second pass on attention and FFN-down inputs takes that to 0.5-0.9e-3 (issue 11 item 4's <= 1e-3)
# for 2 activation rows per token on ~25-40 % of the weights. Gate / up (the widest matrices of a
# layer) and the output head add least per byte (BENCHMARKS "A second int8 pass").
RESIDUAL_SKIP_ROLES = ("ffn_gate", "ffn_up", "output.", "token_embd.")


def residual_activations(name: str) -> bool:
    """Whether matrix `name` (a GGUF tensor name; "+"-joined for stacked q/k/v, "[...]"-suffixed
    for a slice or an expert) takes the second int8 pass."""
    role = name.split(".", 2)[-1] if name.startswith("blk.") else name
    return bool(name) and not role.startswith(RESIDUAL_SKIP_ROLES)


def tensor_names(name: str) -> list[str]:
    """The GGUF tensors behind a bound matrix's name ("+" joins stacked ones, "[...]" marks a slice
    or an expert's rows)."""
    return [part.split("[", 1)[0] for part in name.split("+")]


def _ffn_units(raw: np.ndarray, qtype: int, n_cols: int, lo: int, hi: int) -> np.ndarray:
    """Columns [lo, hi) of every row of a quantized matrix (ffn_down's slice of intermediate units),
    as a contiguous copy; lo and hi fall on block boundaries."""
    elems, nbytes = format_of(qtype).block_elems, format_of(qtype).block_bytes
    if lo % elems or hi % elems or n_cols % elems:
        raise ValueError(f"split at units {lo}:{hi} is not on a {elems}-weight block boundary")
    return np.ascontiguousarray(raw[:, lo // elems * nbytes:hi // elems * nbytes])


class WeightBinder:
    """Binds each tensor of a GGUF to a backend, following a per-tensor device map and `RULES`.

    `tensor_devices` maps tensor names to "cpu" (quantized, mmap) or "device" (a copy on `device`:
    quantized types keep their GGUF bytes, float types become `device_dtype`); names absent from it
    go to `default`. With no GPU everything defaults to "cpu".

    `config` (a RuntimeConfig; None: this device's unplanned mode, switches from the environment)
    holds the mode and the numerics. In a plan's modes an `executor` is required: FFN layers left
    on the CPU are bound as `HostFFN` (their rows cross to the host and back; with `op_offload`,
    prompt batches copy their weights to the device and run there instead: `StreamedFFN`), a MoE
    layer's routed experts left on the CPU as `HostExperts` (likewise, with the routing), `split` =
    (layer, units) binds that layer's first `units` intermediate units on the device and the rest
    on the CPU, and with tracing on, device backends report their calls to the trace.

    In Mode.CPU_FUSED, a layer's halves whose matrices are all in the mmap run as one fused Numba
    call each (`attention_block`, `gdn_block`, `ffn_block`, `mtp_step`).
    """

    def __init__(self, gguf: GGUFFile, device: torch.device, tensor_devices: dict[str, str] | None = None,
                 default: str = "cpu", device_dtype: torch.dtype = torch.float32,
                 executor: Executor | None = None, split: tuple[int, int] | None = None,
                 config: RuntimeConfig | None = None, fused_qtypes: list[int] | None = None,
                 op_offload: bool = False):
        self.gguf, self.device = gguf, device
        self.config = config if config is not None else resolve_config(device.type, planned=False)
        if self.config.mode.planned != (executor is not None):
            raise ValueError(f"mode {self.config.mode.name}: an executor is bound exactly when a plan executes")
        self.op_offload = op_offload and self.config.mode.planned   # prompt batches run CPU layers on the device
        self.tensor_devices = tensor_devices or {}
        self.default, self.device_dtype = default, device_dtype
        self.executor, self.split = executor, split
        self.trace = executor.trace if executor is not None else None
        self.scratch = TileScratch(device, device_dtype)    # one dequantization tile for all QuantLinears
        self._kernel_types = None   # _fused_types, worked out at the first fused layer
        self._fused_qtypes = fused_qtypes   # the types those cover (None: layer_qtypes())

    # --- where things are --------------------------------------------------------------------------
    def has(self, name: str) -> bool:
        return name in self.gguf.tensors

    def where(self, name: str) -> str:
        return self.tensor_devices.get(name, self.default)

    def placement(self, names) -> Placement:
        """Where the tensors `names` are together, by the plan's map."""
        return Placement.of(Placement.MMAP if self.where(n) == "cpu" else Placement.DEVICE for n in names)

    def _bound_placement(self, linears=(), composites=()) -> Placement:
        """Where bound parts are: matrices by their tensors in the plan's map, FFN and experts
        backends by their own `placement`."""
        parts = [self.placement(n for m in linears for n in tensor_names(m.name))] if linears else []
        return Placement.of(parts + [c.placement for c in composites])

    def _rule(self, role: Role, placement: Placement) -> Callable:
        return rule_for(RULES, role, placement, self.config.mode)

    # --- matrices ----------------------------------------------------------------------------------
    def dense(self, name: str) -> torch.Tensor:
        """A small tensor (norm weight, bias, conv kernel) as float32 on the trunk device,
        in numpy order (reversed ggml shape)."""
        info = self.gguf.tensors[name]
        values = dequantize(self.gguf.tensor_bytes(name), info.qtype, info.shape[0])
        return torch.from_numpy(values.reshape(tuple(reversed(info.shape)))).to(self.device)

    def embedding(self, name: str) -> Embedding:
        return Embedding(self.gguf, name, self.device, self.executor)

    def linear(self, name: str):
        info = self.gguf.tensors[name]
        return self._matrix(self.gguf.tensor_bytes(name), info.qtype, info.shape[0], info.n_rows, name)

    def _matrix(self, raw: np.ndarray, qtype: int, n_in: int, n_out: int, name: str):
        """Rows `raw` of tensor `name` (or of the "+"-joined tensors, stacked), bound where the plan put it."""
        return self._rule(Role.MATRIX, self.placement(tensor_names(name)))(self, raw, qtype, n_in, n_out, name)

    def _cpu_linear(self, raw: np.ndarray, qtype: int, n_in: int, n_out: int, name: str = "") -> CpuQuantLinear:
        return CpuQuantLinear(raw, qtype, n_in, n_out, name, exact=self.config.exact, residual=self._residual(name))

    def _residual(self, name: str) -> bool:
        """Whether matrix `name`, wherever it is bound, takes the second int8 pass."""
        return self.config.act_residual and residual_activations(name)

    def _device_linear(self, raw: np.ndarray, qtype: int, n_in: int, n_out: int, name: str):
        """A copy of raw (rows, row_bytes) on the device: GGUF blocks for quantized types, floats
        for the rest."""
        if qtype in QUANTIZED_TYPES:
            # a copy (the mmap is read-only), with the bytes the fused kernel reads past the last
            # row when the width is not a multiple of its 256-weight chunk
            on_device = device_rows(mmap_tensor(np.ascontiguousarray(raw)), qtype, n_in, self.device)
            linear = QuantLinear(on_device, qtype, n_in, n_out, self.device_dtype, name, self.scratch,
                                 int8_activations=not self.config.exact, residual=self._residual(name))
        else:
            weight = torch.from_numpy(dequantize(raw, qtype, n_in))
            linear = DeviceLinear(weight.to(self.device, self.device_dtype), name)
        return linear if self.trace is None else TracedBackend(linear, self.trace, name)

    def stacked_linear(self, names: list[str]):
        """One device backend for several matrices that read the same input (q, k, v), their rows
        stacked into one copy, so a step makes one matvec call instead of three; or None when their
        placement, type or input width differ, or when they stay in the mmap: there the copy would be
        anonymous memory beside the mapped file (the 27B: 360 MiB of peak RSS and ~1 s of its load),
        and the fused CPU layers read each matrix as its own operand in one call anyway. Row r of
        the result is bitwise what the separate matrix gives (rows are independent in every kernel).
        Returns (linear, row counts)."""
        infos = [self.gguf.tensors[n] for n in names]
        if len({self.where(n) for n in names}) != 1 or len({(i.qtype, i.shape[0]) for i in infos}) != 1:
            return None
        if self.where(names[0]) == "cpu":
            return None
        raw = np.concatenate([self.gguf.tensor_bytes(n) for n in names])
        linear = self._matrix(raw, infos[0].qtype, infos[0].shape[0], raw.shape[0], "+".join(names))
        return linear, [i.n_rows for i in infos]

    # --- FFN layers ------------------------------------------------------------------------------------
    def glu_ffn(self, prefix: str, act: str, suffix: str = ""):
        """A gated FFN (ffn_gate/up/down{suffix}; "_shexp" is a MoE layer's shared expert)."""
        names = [f"{prefix}.ffn_{m}{suffix}.weight" for m in ("gate", "up", "down")]
        placement = self.placement(names)
        if placement is Placement.MMAP and self.split is not None and prefix == f"blk.{self.split[0]}" and not suffix:
            placement = Placement.SPLIT
        return self._rule(Role.GLU_FFN, placement)(self, prefix, names, act)

    def _cpu_glu_ffn(self, prefix: str, names: list[str], act: str) -> CpuGluFFN:
        return CpuGluFFN(*(self.linear(n) for n in names), act)

    def _host_ffn(self, prefix: str, names: list[str], act: str) -> HostFFN:
        ffn = self._cpu_glu_ffn(prefix, names, act)
        return HostFFN(ffn, self.executor, prefix, self._streamed(ffn))

    def _device_glu_ffn(self, prefix: str, names: list[str], act: str) -> GluFFN:
        # gate and up read the same input: on the device, one stacked matrix (one activation
        # round trip and one matvec launch per layer instead of two of each)
        stacked = self.stacked_linear(names[:2])
        if stacked is not None:
            return GluFFN(None, None, self.linear(names[2]), act, gate_up=stacked)
        return GluFFN(*(self.linear(n) for n in names), act)

    def _split_ffn(self, prefix: str, names: list[str], act: str) -> SplitFFN:
        """Units [0, units) of the layer on the device, [units, n_ff) in host memory (gate and up
        rows are plain row slices of the mmap; ffn_down's column slices are copied)."""
        units = self.split[1]
        (g, u, d), raws = (self.gguf.tensors[n] for n in names), [self.gguf.tensor_bytes(n) for n in names]
        n_embd, n_ff = g.shape[0], g.n_rows
        dev = GluFFN(self._device_linear(raws[0][:units], g.qtype, n_embd, units, f"{names[0]}[:{units}]"),
                     self._device_linear(raws[1][:units], u.qtype, n_embd, units, f"{names[1]}[:{units}]"),
                     self._device_linear(_ffn_units(raws[2], d.qtype, n_ff, 0, units), d.qtype, units, n_embd,
                                         f"{names[2]}[:, :{units}]"), act)
        rest = n_ff - units
        host = CpuGluFFN(self._cpu_linear(raws[0][units:], g.qtype, n_embd, rest, f"{names[0]}[{units}:]"),
                         self._cpu_linear(raws[1][units:], u.qtype, n_embd, rest, f"{names[1]}[{units}:]"),
                         self._cpu_linear(_ffn_units(raws[2], d.qtype, n_ff, units, n_ff), d.qtype, rest, n_embd,
                                          f"{names[2]}[:, {units}:]"), act)
        return SplitFFN(dev, HostFFN(host, self.executor, f"{prefix} [{units}:]", self._streamed(host)),
                        self.executor, prefix)

    def _streamed(self, ffn: CpuGluFFN) -> StreamedFFN | None:
        """The op-offload path of a CPU FFN layer, where the plan reserved its staging buffer."""
        if not self.op_offload:
            return None
        return StreamedFFN(ffn, self.executor, self.scratch, int8_activations=not self.config.exact)

    def routed_experts(self, prefix: str):
        """A MoE layer's routed experts (ffn_{gate,up,down}_exps, {n_in, n_out, n_expert}): one gated
        FFN per expert, on the device or in the mmap as the plan says for the layer; while a plan
        executes, experts left in the mmap run on its worker (HostExperts)."""
        names = [f"{prefix}.ffn_{m}_exps.weight" for m in ("gate", "up", "down")]
        n_expert = self.gguf.tensors[names[0]].shape[2]
        experts = RoutedExperts([self._expert_glu(names, e) for e in range(n_expert)])
        return self._rule(Role.ROUTED_EXPERTS, self.placement(names))(self, prefix, experts)

    def _experts_in_place(self, prefix: str, experts: RoutedExperts) -> RoutedExperts:
        return experts

    def _host_experts(self, prefix: str, experts: RoutedExperts) -> HostExperts:
        return HostExperts(experts, self.executor, f"{prefix} experts")

    def _expert_glu(self, names: list[str], expert: int):
        linears = []
        for name in names:
            info = self.gguf.tensors[name]
            n_in, n_out = info.shape[0], info.shape[1]
            raw = self.gguf.tensor_bytes(name)[expert * n_out:(expert + 1) * n_out]   # its rows are contiguous
            linears.append(self._matrix(raw, info.qtype, n_in, n_out, f"{name}[{expert}]"))
        return self._rule(Role.EXPERT_FFN, self.placement(names))(self, linears)

    def _cpu_expert(self, linears: list) -> CpuGluFFN:
        return CpuGluFFN(*linears, "silu")

    def _device_expert(self, linears: list) -> GluFFN:
        return GluFFN(*linears, "silu")

    # --- layer halves ----------------------------------------------------------------------------------
    def attention_kernel(self):
        """The attention over a KV cache the torch layers call (gpu_kernels.attention.attend's
        signature): on a fused CPU trunk kv_attention's (attend_on_cpu), else torch's."""
        return attend_on_cpu if self.config.mode.fused else attend

    def norm_kernel(self):
        """The RMSNorm small per-token layers outside the fused halves call (rms_norm's
        signature): on a fused CPU trunk one compiled call, else torch's."""
        return rms_norm_on_cpu if self.config.mode.fused else rms_norm

    def attention_block(self, block):
        """How a layer's attention half runs: `block` (models.common.AttentionBlock, torch ops
        around the bound matrices) or, as RULES say, the fused kernel wrapping it."""
        a = block.attn
        mats = [a.wqkv, a.wo] if a.wqkv is not None else [a.wq, a.wk, a.wv, a.wo]
        return self._rule(Role.ATTENTION_HALF, self._bound_placement(mats))(self, block)

    def gdn_block(self, block):
        """How a Gated DeltaNet layer half runs: `block` (models.qwen35.GDNBlock, torch ops around
        the bound matrices) or FusedGDNBlock."""
        m = block.mixer
        mats = [*([m.w_in] if m.w_in is not None else []), *m.w_rest, m.w_out]
        return self._rule(Role.GDN_HALF, self._bound_placement(mats))(self, block)

    def ffn_block(self, block):
        """How a layer's FFN half runs: `block` (models.common.FfnBlock around a gated FFN or a
        mixture of experts, models.qwen35.MoEFFN) or the fused kernel."""
        ffn = block.ffn
        if getattr(ffn, "experts", None) is None:
            return self._rule(Role.FFN_HALF, ffn.placement)(self, block)
        placement = self._bound_placement([ffn.router, ffn.shared_gate], [ffn.experts, ffn.shared])
        return self._rule(Role.MOE_HALF, placement)(self, block)

    def _torch_block(self, block):
        return block

    def _fused_attention(self, block) -> FusedAttentionBlock:
        return FusedAttentionBlock(block, self._fused_types())

    def _fused_gdn(self, block) -> FusedGDNBlock:
        return FusedGDNBlock(block, self._fused_types())

    def _fused_ffn(self, block) -> FusedFfnBlock:
        return FusedFfnBlock(block, self._fused_types())

    def _fused_moe(self, block):
        try:
            return FusedMoEBlock(block, self._fused_types(), self.gguf)
        except ValueError:      # kernel types, activation blocks or a norm the fused kernel does not cover
            return block

    def mtp_step(self, embedding, embed_scale: float, enorm, hnorm, eh_proj, attn_half, ffn_half, head_norm,
                 output, eps: float) -> FusedMTPStep | None:
        """A trained MTP head's step as one fused call (FusedMTPStep) where RULES say so for its own
        matrices and both its halves run fused; else None (the head's separate calls)."""
        return self._rule(Role.MTP_STEP, self._bound_placement([eh_proj, output]))(
            self, embedding, embed_scale, enorm, hnorm, eh_proj, attn_half, ffn_half, head_norm, output, eps)

    def _fused_mtp_step(self, *parts) -> FusedMTPStep | None:
        try:
            return FusedMTPStep(*parts)
        except ValueError:          # a half not fused, or kernel types that do not cover the head's matrices
            return None

    def _separate_calls(self, *parts) -> None:
        return None

    def _fused_types(self) -> tuple:
        """(int_types, float_path) of the fused kernels (compile-time constants, see layer_fused):
        for all of the file's layer matrices, so every layer shares one compilation that holds
        only the code these types take (no float kernel when each has an integer one)."""
        if self._kernel_types is None:
            qtypes = self.layer_qtypes() if self._fused_qtypes is None else self._fused_qtypes
            self._kernel_types = layer_fused.kernel_types((q, use_int(q, self.config.exact)) for q in qtypes)
        return self._kernel_types

    def layer_qtypes(self) -> list[int]:
        """The quant types of the file's layer matrices."""
        return [info.qtype for name, info in self.gguf.tensors.items() if name.startswith("blk.") and len(info.shape) >= 2]


# ------------------------------------------------------------------------------------------ the rules
_ALL = frozenset(Mode)
_PLANNED = frozenset(m for m in Mode if m.planned)
_UNPLANNED = _ALL - _PLANNED
_FUSED = frozenset(m for m in Mode if m.fused)
_NOT_FUSED = _ALL - _FUSED
_MMAP, _DEVICE, _MIXED, _SPLIT = Placement.MMAP, Placement.DEVICE, Placement.MIXED, Placement.SPLIT

# Each row: for every placement and mode given, the role is built by that WeightBinder method (called
# with the role's arguments); the comment names what it returns.
RULE_ROWS = [
    # role               placements         modes        built by
    (Role.MATRIX,         {_MMAP},           _ALL,       WeightBinder._cpu_linear),        # CpuQuantLinear
    (Role.MATRIX,         {_DEVICE},         _ALL,       WeightBinder._device_linear),     # QuantLinear / DeviceLinear, traced
    (Role.GLU_FFN,        {_MMAP},           _UNPLANNED, WeightBinder._cpu_glu_ffn),       # CpuGluFFN
    (Role.GLU_FFN,        {_MMAP},           _PLANNED,   WeightBinder._host_ffn),          # HostFFN (StreamedFFN: op offload)
    (Role.GLU_FFN,        {_SPLIT},          _PLANNED,   WeightBinder._split_ffn),         # SplitFFN
    (Role.GLU_FFN,        {_DEVICE, _MIXED}, _ALL,       WeightBinder._device_glu_ffn),    # GluFFN
    (Role.EXPERT_FFN,     {_MMAP},           _ALL,       WeightBinder._cpu_expert),        # CpuGluFFN
    (Role.EXPERT_FFN,     {_DEVICE, _MIXED}, _ALL,       WeightBinder._device_expert),     # GluFFN
    (Role.ROUTED_EXPERTS, {_MMAP},           _UNPLANNED, WeightBinder._experts_in_place),  # RoutedExperts
    (Role.ROUTED_EXPERTS, {_MMAP},           _PLANNED,   WeightBinder._host_experts),      # HostExperts
    (Role.ROUTED_EXPERTS, {_DEVICE, _MIXED}, _ALL,       WeightBinder._experts_in_place),
    (Role.ATTENTION_HALF, {_MMAP},           _FUSED,     WeightBinder._fused_attention),   # FusedAttentionBlock
    (Role.ATTENTION_HALF, {_MMAP},           _NOT_FUSED, WeightBinder._torch_block),       # models.common.AttentionBlock
    (Role.ATTENTION_HALF, {_DEVICE, _MIXED}, _ALL,       WeightBinder._torch_block),
    (Role.GDN_HALF,       {_MMAP},           _FUSED,     WeightBinder._fused_gdn),         # FusedGDNBlock
    (Role.GDN_HALF,       {_MMAP},           _NOT_FUSED, WeightBinder._torch_block),       # models.qwen35.GDNBlock
    (Role.GDN_HALF,       {_DEVICE, _MIXED}, _ALL,       WeightBinder._torch_block),
    (Role.FFN_HALF,       {_MMAP},           _FUSED,     WeightBinder._fused_ffn),         # FusedFfnBlock
    (Role.FFN_HALF,       {_MMAP},           _NOT_FUSED, WeightBinder._torch_block),       # models.common.FfnBlock
    (Role.FFN_HALF,       {_DEVICE, _MIXED}, _ALL,       WeightBinder._torch_block),
    (Role.FFN_HALF,       {_SPLIT},          _PLANNED,   WeightBinder._torch_block),
    (Role.MOE_HALF,       {_MMAP},           _FUSED,     WeightBinder._fused_moe),         # FusedMoEBlock if its kernel covers
    (Role.MOE_HALF,       {_MMAP},           _NOT_FUSED, WeightBinder._torch_block),       # FfnBlock around a MoEFFN
    (Role.MOE_HALF,       {_DEVICE, _MIXED}, _ALL,       WeightBinder._torch_block),
    (Role.MTP_STEP,       {_MMAP},           _FUSED,     WeightBinder._fused_mtp_step),    # FusedMTPStep if both halves fused
    (Role.MTP_STEP,       {_MMAP},           _NOT_FUSED, WeightBinder._separate_calls),    # None: separate calls
    (Role.MTP_STEP,       {_DEVICE, _MIXED}, _ALL,       WeightBinder._separate_calls),
]


def rule_table(rows) -> Mapping:
    """rows expanded to a read-only {(role, placement, mode): builder}; a key given twice is an error."""
    table = {}
    for role, placements, modes, build in rows:
        for key in ((role, p, m) for p in placements for m in modes):
            if key in table:
                raise ValueError(f"two backend rules for {key}")
            table[key] = build
    return MappingProxyType(table)


RULES = rule_table(RULE_ROWS)
