"""Weight backends: where a matrix lives and how `linear(x)` runs on it.

A layer never asks where its weights are: it calls the object bound here. `CpuQuantLinear` keeps
the quantized bytes in the mmap'd file and runs the k-input matvec (one weight pass for all k
rows); on the trunk device (a GPU when there is one) `QuantLinear` holds the GGUF bytes and
dequantizes tile by tile, `DeviceLinear` holds float weights (F32/F16/BF16 tensors).
Moving a tensor between the two is a placement decision, not a change to model code.
"""
from __future__ import annotations

import numpy as np
import torch

from cpu_kernels.dequant import dequantize, gather_rows
from cpu_kernels.ffn import ffn_glu
from cpu_kernels.formats import format_of
from cpu_kernels.matvec import matvec
from gpu_kernels.attention import ROWWISE_MAX
from gpu_kernels.linear import linear_rows
from gpu_kernels.qlinear import QuantLinear, TileScratch
from gpu_kernels.quant import QUANTIZED_TYPES

from .gguf_file import GGUFFile


def _cpu_f32(x: torch.Tensor) -> torch.Tensor:
    return x.to(device="cpu", dtype=torch.float32).contiguous()


class CpuQuantLinear:
    """y = W x for k rows of x, W quantized in the mmap (ggml layout: one output row per row)."""

    def __init__(self, raw: np.ndarray, qtype: int, n_in: int, n_out: int, name: str = ""):
        format_of(qtype)    # fail at load time, naming the type, not at the first token
        self.raw, self.qtype, self.n_in, self.n_out, self.name = raw, qtype, n_in, n_out, name
        self.nbytes = raw.nbytes

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        xc = _cpu_f32(x)
        if out is None or out.device.type != "cpu":
            y = torch.empty(xc.shape[0], self.n_out, dtype=torch.float32)
        else:
            y = out
        matvec(self.raw, self.qtype, xc.numpy(), y.numpy())
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
                    self.down.raw, self.down.qtype, act=self.act)
        y = torch.from_numpy(y)
        return y.to(x.device) if x.device.type != "cpu" else y


class GluFFN:
    """An FFN layer with at least one matrix off the mmap: each matrix runs on its own backend."""

    def __init__(self, gate: DeviceLinear, up: DeviceLinear, down: DeviceLinear, act: str):
        self.gate, self.up, self.down, self.act = gate, up, down, act
        self.nbytes = gate.nbytes + up.nbytes + down.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        g = self.gate(x)
        g = torch.nn.functional.silu(g) if self.act == "silu" else \
            torch.nn.functional.gelu(g, approximate="tanh")
        return self.down(g * self.up(x))


class Embedding:
    """Token embedding rows gathered from the mmap (a step needs only k rows of it)."""

    def __init__(self, gguf: GGUFFile, name: str, device: torch.device):
        info = gguf.tensors[name]
        format_of(info.qtype)
        self.raw, self.qtype, self.n_embd, self.device = gguf.tensor_bytes(name), info.qtype, info.shape[0], device

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        ids = tokens.to("cpu", torch.int64).numpy()
        rows = torch.from_numpy(gather_rows(self.raw, self.qtype, self.n_embd, ids))
        return rows.to(self.device)


class WeightBinder:
    """Binds each tensor of a GGUF to a backend, following a per-tensor device map.

    `tensor_devices` maps tensor names to "cpu" (quantized, mmap) or "device" (a copy on `device`:
    quantized types keep their GGUF bytes, float types become `device_dtype`); names absent from it
    go to `default`. With no GPU everything defaults to "cpu".
    """

    def __init__(self, gguf: GGUFFile, device: torch.device, tensor_devices: dict[str, str] | None = None,
                 default: str = "cpu", device_dtype: torch.dtype = torch.float32):
        self.gguf, self.device = gguf, device
        self.tensor_devices = tensor_devices or {}
        self.default, self.device_dtype = default, device_dtype
        self.scratch = TileScratch(device, device_dtype)    # one dequantization tile for all QuantLinears

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
            return CpuQuantLinear(self.gguf.tensor_bytes(name), info.qtype, n_in, n_out, name)
        raw = self.gguf.tensor_bytes(name)
        if info.qtype in QUANTIZED_TYPES:
            on_device = torch.from_numpy(raw.copy()).to(self.device)
            return QuantLinear(on_device, info.qtype, n_in, n_out, self.device_dtype, name, self.scratch)
        weight = torch.from_numpy(dequantize(raw, info.qtype, n_in))
        return DeviceLinear(weight.to(self.device, self.device_dtype), name)

    def stacked_linear(self, names: list[str]):
        """One backend for several matrices that read the same input (q, k, v), their rows stacked
        into one copy, so a step makes one matvec call instead of three; or None when their
        placement, type or input width differ. Row r of the result is bitwise what the separate
        matrix gives (rows are independent in every kernel). Returns (linear, row counts)."""
        infos = [self.gguf.tensors[n] for n in names]
        if len({self.where(n) for n in names}) != 1 or len({(i.qtype, i.shape[0]) for i in infos}) != 1:
            return None
        raw = np.concatenate([self.gguf.tensor_bytes(n) for n in names])
        qtype, n_in, n_out = infos[0].qtype, infos[0].shape[0], raw.shape[0]
        name = "+".join(names)
        if self.where(names[0]) == "cpu":
            linear = CpuQuantLinear(raw, qtype, n_in, n_out, name)
        elif qtype in QUANTIZED_TYPES:
            linear = QuantLinear(torch.from_numpy(raw).to(self.device), qtype, n_in, n_out,
                                 self.device_dtype, name, self.scratch)
        else:
            weight = torch.from_numpy(dequantize(raw, qtype, n_in))
            linear = DeviceLinear(weight.to(self.device, self.device_dtype), name)
        return linear, [i.n_rows for i in infos]

    def glu_ffn(self, prefix: str, act: str):
        names = [f"{prefix}.ffn_gate.weight", f"{prefix}.ffn_up.weight", f"{prefix}.ffn_down.weight"]
        places = {self.where(n) for n in names}
        gate, up, down = (self.linear(n) for n in names)
        if places == {"cpu"}:
            return CpuGluFFN(gate, up, down, act)
        return GluFFN(gate, up, down, act)

    def embedding(self, name: str) -> Embedding:
        return Embedding(self.gguf, name, self.device)
