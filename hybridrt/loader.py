"""`load_model`: open a GGUF (path or known name), pick the architecture, bind every weight."""
from __future__ import annotations

import os

import torch

from .backends import WeightBinder
from .gguf_file import GGUFFile
from .models import check_arch, model_class
from .models.base import Model
from .registry import resolve_model


def set_threads(n: int | None) -> None:
    """CPU threads for both torch (trunk math) and Numba (quantized matvecs)."""
    if not n:
        return
    import numba

    torch.set_num_threads(n)
    numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))


def load_model(model: str | os.PathLike | None = None, device: str = "cpu",
               tensor_devices: dict[str, str] | None = None, threads: int | None = None) -> Model:
    """Load a GGUF model. `tensor_devices` maps tensor names to "cpu" (quantized, mmap) or
    "device" (dequantized onto `device`), as a placement plan decides; by default every matrix
    stays quantized on the CPU and the trunk math runs on `device`."""
    set_threads(threads)
    gguf = GGUFFile(resolve_model(model))
    check_arch(gguf.arch, gguf.path)
    dev = torch.device(device)
    dtype = torch.float32 if dev.type == "cpu" else torch.float16
    binder = WeightBinder(gguf, dev, tensor_devices, device_dtype=dtype)
    return model_class(gguf.arch)(gguf, binder)
