"""Weight backends: where a matrix lives and how a layer's call runs on it.

A layer never asks where its weights are: it calls the object the binder bound, through one of the
interfaces in `protocols.py` (a linear, a gated FFN, routed experts, a layer half). What lives where:

- `protocols.py`: those interfaces, and `Placement` (in the mmap, on the device, mixed, split);
- `cpu.py`: matrices and FFN layers quantized in the mmap'd file, run by the k-input Numba kernels
  (`CpuQuantLinear`, `CpuGluFFN`), routed experts grouped by expert (`RoutedExperts`), embedding
  rows gathered from the mmap (`Embedding`);
- `device.py`: the trunk device's float matrices (`DeviceLinear`) and FFN layers with a matrix there
  (`GluFFN`); its quantized matrices are gpu_kernels.qlinear.QuantLinear;
- `fused.py`: the fused CPU trunk, each layer half one Numba call (`FusedAttentionBlock`,
  `FusedFfnBlock`, `FusedGDNBlock`, `FusedMoEBlock`, `FusedMTPStep`), and the attention and norm
  kernels the rest of that trunk calls (`attend_on_cpu`, `rms_norm_on_cpu`);
- `crossing.py`: what crosses between the device and the CPU while a plan executes (`HostFFN`,
  `SplitFFN`, `HostExperts`, op offload's `StreamedFFN`, `TracedBackend`);
- `binder.py`: `WeightBinder`, which binds each weight, and `RULES`, the table of (role, placement,
  execution mode) -> the backend it binds.

The execution mode and numerics come from one RuntimeConfig (hybridrt/runtime/config.py).
"""
from .binder import RULES, Role, WeightBinder, residual_activations
from .cpu import CpuGluFFN, CpuQuantLinear, Embedding, RoutedExperts
from .crossing import OP_OFFLOAD_MIN_BATCH, HostExperts, HostFFN, SplitFFN, StreamedFFN, TracedBackend, staged_bytes
from .device import DeviceLinear, GluFFN
from .fused import (FusedAttentionBlock, FusedFfnBlock, FusedGDNBlock, FusedMoEBlock, FusedMTPStep, attend_on_cpu,
                    rms_norm_on_cpu)
from .protocols import AttentionHalf, ExpertsBackend, FfnHalf, FFNBackend, GDNHalf, LinearBackend, Placement

__all__ = ["RULES", "Role", "WeightBinder", "residual_activations", "CpuGluFFN", "CpuQuantLinear", "Embedding",
           "RoutedExperts", "OP_OFFLOAD_MIN_BATCH", "HostExperts", "HostFFN", "SplitFFN", "StreamedFFN",
           "TracedBackend", "staged_bytes", "DeviceLinear", "GluFFN", "FusedAttentionBlock", "FusedFfnBlock",
           "FusedGDNBlock", "FusedMoEBlock", "FusedMTPStep", "attend_on_cpu", "rms_norm_on_cpu", "AttentionHalf",
           "ExpertsBackend", "FfnHalf", "FFNBackend", "GDNHalf", "LinearBackend", "Placement"]
