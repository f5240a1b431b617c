"""From a GGUF file and the user's flags to the plan the runtime executes.

The planner (`placement.plan`) decides every tensor's place from the GGUF header alone; this module
only asks it and translates its answer for the weight binder. There is no second copy of the rules
here: a tensor goes to the device exactly when the plan says "gpu", and the boundary layer is split
exactly at the plan's unit count.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from placement import GiB, Plan, PlanError, PlanOptions, layer_ranges
from placement import plan as make_plan

from ..errors import UserError

MiB = 1 << 20
_UNITS = {"": 1, "b": 1, "k": 1024, "kib": 1024, "m": MiB, "mib": MiB, "g": GiB, "gib": GiB, "t": 1 << 40,
          "tib": 1 << 40, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str, what: str = "size") -> int:
    """'12GiB', '12GB' (10^9), '12000MiB', '300MiB', '1073741824' -> bytes."""
    m = _SIZE.match(text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise UserError(f"bad {what} '{text}': use a number of bytes or a size like 12GiB, 12GB, 300MiB")
    if _UNITS[unit] == 1 and "." in m.group(1):     # '0.5' meant as GiB would silently be 0 bytes
        raise UserError(f"bad {what} '{text}': a number without a unit counts bytes; add one (e.g. {m.group(1)}GiB)")
    return int(float(m.group(1)) * _UNITS[unit])


@dataclass(frozen=True)
class PlacementRequest:
    """The plan flags of `run`, `bench`, `serve` and `load_model` (llama.cpp's names in the CLI)."""
    vram_bytes: int | None = None      # None: the free memory of the GPU (12 GiB on a CPU device)
    n_ctx: int | None = None           # None: 4096 or the model's training context, if smaller
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    spec_type: str | None = None       # None: draft-simple with a draft, draft-mtp with an MTP head, else none
    spec_draft_n_max: int = 3
    draft_path: str | None = None
    margin_bytes: int = 512 * MiB
    gpu_bw: float | None = None        # bytes/s, for the predicted speed only
    cpu_bw: float | None = None
    op_offload: bool = True            # prompt batches run CPU FFN layers on the device (--no-op-offload)
    n_seq: int = 1                     # sessions held at once, each with its own KV (serve's --parallel)


def plan_for(path: str, request: PlacementRequest, device, n_ctx_train: int = 4096) -> Plan:
    """The plan for this file on this device; a configuration that cannot fit is one UserError line."""
    import torch

    from ..files.model_profile import load_profile

    profile = load_profile(path)
    draft = load_profile(request.draft_path) if request.draft_path else None
    spec_type = request.spec_type or ("draft-simple" if draft else "draft-mtp" if profile.has_mtp else "none")
    n_ctx = request.n_ctx or min(4096, n_ctx_train)
    dev = torch.device(device)
    budget = request.vram_bytes
    gpu_bw = request.gpu_bw
    if dev.type == "cuda" and (budget is None or gpu_bw is None):
        from placement import gpu_peak_bandwidth

        free, _ = torch.cuda.mem_get_info(dev)
        props = torch.cuda.get_device_properties(dev)
        budget = free if budget is None else budget
        gpu_bw = gpu_bw or gpu_peak_bandwidth(props.name, getattr(props, "memory_clock_rate", 0),
                                              getattr(props, "memory_bus_width", 0))
    if budget is None:
        budget = 12 * GiB
    cpu_bw = request.cpu_bw
    if dev.type == "cpu":       # the CPU stands in for the device: both sides read the same memory
        gpu_bw = gpu_bw or cpu_bw
    options = PlanOptions(vram_bytes=budget, margin_bytes=request.margin_bytes, n_ctx=n_ctx,
                          cache_type_k=request.cache_type_k, cache_type_v=request.cache_type_v,
                          spec_type=spec_type, spec_draft_n_max=request.spec_draft_n_max, draft=draft,
                          op_offload=request.op_offload, n_seq=request.n_seq,
                          **({"gpu_bw": gpu_bw} if gpu_bw else {}), **({"cpu_bw": cpu_bw} if cpu_bw else {}))
    try:
        return make_plan(profile, options)
    except PlanError as exc:
        raise UserError(str(exc)) from None


def tensor_devices(plan: Plan) -> dict[str, str]:
    """The binder's map: "device" for what the plan puts on the GPU, "cpu" for the rest (the
    mmap; "unused" MTP tensors are never read)."""
    return {name: "device" if where == "gpu" else "cpu" for name, where in plan.tensor_device.items()}


def draft_devices(plan: Plan | None, draft_path: str) -> dict[str, str] | None:
    """A draft-simple model is planned whole on the device (its weights, KV and scratch are stage 2
    reservations), so every one of its tensors goes there."""
    if plan is None or plan.options.spec_type != "draft-simple":
        return None
    from ..files.gguf_file import GGUFFile

    return {name: "device" for name in GGUFFile(draft_path).tensors}


def split_of(plan: Plan) -> tuple[int, int] | None:
    s = plan.ffn_split
    return (s.layer, s.gpu_units) if s is not None else None


def placement_line(plan: Plan, device) -> str:
    """One line at start, as llama.cpp prints "offloaded 40/65 layers to GPU"."""
    n_ffn = len(plan.ffn_gpu_layers) + len(plan.ffn_cpu_layers)
    where = f"{device}" + (" standing in for the GPU" if str(device) == "cpu" else "")
    s = plan.ffn_split
    split = f" + {s.gpu_units}/{s.n_ff} units of layer {s.layer}" if s else ""
    cpu = plan.line("ffn").cpu_bytes
    cpu_layers = layer_ranges(plan.ffn_cpu_layers) or "none"
    n_seq = plan.options.n_seq
    kv = f"the KV caches of {n_seq} sessions" if n_seq > 1 else "KV cache"
    return (f"placement: offloaded {len(plan.ffn_gpu_layers)}/{n_ffn} FFN layers{split} to {where}; trunk, "
            f"output head and {kv} on it: {plan.gpu_bytes / MiB:,.1f} of {plan.options.vram_bytes / MiB:,.1f} "
            f"MiB; FFN layers {cpu_layers} ({cpu / MiB:,.1f} MiB) run from the mmap on the CPU")
