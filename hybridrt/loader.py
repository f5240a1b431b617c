"""`load_model`: open a GGUF (path or known name), pick the architecture, bind every weight."""
from __future__ import annotations

import os

import torch

from .backends import WeightBinder
from .gguf_file import GGUFFile
from .models import check_arch, model_class
from .models.base import Model
from .registry import resolve_model


def set_threads(n: int | None, trunk_on_cpu: bool = True) -> None:
    """Numba runs the quantized matvecs on n threads (default: all cores).

    torch and Numba each bring an OpenMP pool; two pools whose idle threads spin on the same few
    cores stall each other for whole scheduler slices (measured here: 10 ms per op, 40x slower
    decoding). A CPU trunk's torch ops are small (one token's norms, rotary, attention rows), so
    torch gets a single thread and no pool when the trunk is on the CPU."""
    import numba

    if n:
        numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
    if trunk_on_cpu:
        torch.set_num_threads(1)
    elif n:
        torch.set_num_threads(n)


def load_model(model: str | os.PathLike | None = None, device: str = "cpu",
               tensor_devices: dict[str, str] | None = None, threads: int | None = None) -> Model:
    """Load a GGUF model. `tensor_devices` maps tensor names to "cpu" (quantized, mmap) or
    "device" (dequantized onto `device`), as a placement plan decides; by default every matrix
    stays quantized on the CPU and the trunk math runs on `device`."""
    dev = torch.device(device)
    set_threads(threads, trunk_on_cpu=dev.type == "cpu")
    gguf = GGUFFile(resolve_model(model))
    check_arch(gguf.arch, gguf.path)
    dtype = torch.float32 if dev.type == "cpu" else torch.float16
    binder = WeightBinder(gguf, dev, tensor_devices, device_dtype=dtype)
    return model_class(gguf.arch)(gguf, binder)
