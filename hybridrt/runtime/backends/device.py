"""The trunk device's side (a GPU, or the CPU standing in for one in a plan): float matrices
(`DeviceLinear`) and gated FFN layers with at least one matrix there (`GluFFN`). Quantized matrices
on the device are gpu_kernels.qlinear.QuantLinear (GGUF bytes; Triton's fused dequantize-and-dot,
or tile by tile).
"""
from __future__ import annotations

import warnings

import numpy as np
import torch

from gpu_kernels.attention import ROWWISE_MAX
from gpu_kernels.linear import linear_rows
from gpu_kernels.pointwise import per_token

from .protocols import Placement


def mmap_tensor(a: np.ndarray) -> torch.Tensor:
    """A CPU tensor over a read-only array (the mmap) without a copy; only ever read (copied to the
    device from)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)     # "the given NumPy array is not writable"
        return torch.from_numpy(a)


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


class GluFFN:
    """An FFN layer with at least one matrix off the mmap: each matrix runs on its own backend.
    gate_up = (backend, [n_ff, n_ff]) as stacked_linear returns it: gate's and up's rows stacked in
    one backend (gate and up None), the first n_ff output columns gate's; every row is bitwise what
    its own matrix gives."""
    placement = Placement.DEVICE    # some of its matrices may be CpuQuantLinears, called in place

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
