"""The roles a bound weight plays, as the models call them, and where its weights are (`Placement`).

A model never asks where a weight lives: it calls what the binder returned, through one of these
interfaces. Each is a `typing.Protocol`, so a backend conforms by its members alone (gpu_kernels'
QuantLinear is a `LinearBackend` without knowing of this module).
"""
from __future__ import annotations

import enum
from typing import Protocol, runtime_checkable

import torch


class Placement(enum.Enum):
    """Where a bound part's matrices are, by the plan's map (WeightBinder.where)."""
    MMAP = "quantized in the mmap, run by the CPU kernels"
    DEVICE = "copied to the trunk device"
    MIXED = "some in the mmap, some on the device"
    SPLIT = "the plan's boundary layer: its first units on the device, the rest in the mmap"

    @staticmethod
    def of(parts) -> "Placement":
        """The placement of several parts together (each a Placement)."""
        parts = set(parts)
        return parts.pop() if len(parts) == 1 else Placement.MIXED


@runtime_checkable
class LinearBackend(Protocol):
    """y = W x for a batch of rows: CpuQuantLinear, DeviceLinear, gpu_kernels.qlinear.QuantLinear,
    TracedBackend. `name` is the GGUF tensor's ("+" joins stacked matrices, "[...]" marks a slice
    or an expert's rows)."""
    name: str
    n_in: int
    n_out: int
    nbytes: int

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor: ...


@runtime_checkable
class FFNBackend(Protocol):
    """A gated FFN layer, y = down(act(gate x) * up x): CpuGluFFN, GluFFN, HostFFN, SplitFFN,
    StreamedFFN."""
    placement: Placement
    nbytes: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class ExpertsBackend(Protocol):
    """A MoE layer's routed experts, sum_j weights[:, j] * expert_{top_e[:, j]}(x): RoutedExperts,
    HostExperts."""
    placement: Placement
    nbytes: int
    n_embd: int

    def __call__(self, x: torch.Tensor, top_e: torch.Tensor, weights: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class AttentionHalf(Protocol):
    """A layer's attention half, h + [post_norm](attn(norm(h))): models.common.AttentionBlock or
    FusedAttentionBlock. `attn` is its models.common.Attention (spec, cache index)."""
    attn: object

    def __call__(self, h: torch.Tensor, state, pos_list: list[int]) -> torch.Tensor: ...

    def batched(self, h: torch.Tensor, batch) -> torch.Tensor:
        """__call__ over several sequences' rows (runtime.batch.StepBatch), each on its own cache."""

    def write_kv(self, h: torch.Tensor, state, pos_list: list[int]) -> None: ...


@runtime_checkable
class GDNHalf(Protocol):
    """A Gated DeltaNet layer half: models.qwen35.GDNBlock or FusedGDNBlock; `capture` keeps each
    token's recurrent state in the snapshot ring."""
    mixer: object

    def __call__(self, h: torch.Tensor, state, capture: bool) -> torch.Tensor: ...


@runtime_checkable
class FfnHalf(Protocol):
    """A layer's FFN half, h + [post_norm](ffn(norm(h))): models.common.FfnBlock (around an
    FFNBackend or a MoE FFN), FusedFfnBlock or FusedMoEBlock."""

    def __call__(self, h: torch.Tensor) -> torch.Tensor: ...
