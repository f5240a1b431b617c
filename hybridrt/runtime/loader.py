"""`load_model`: open a GGUF (path or known name), pick the architecture, bind every weight."""
from __future__ import annotations

import os

import torch

from ..errors import UserError

from .backends import WeightBinder
from .executor import Executor
from ..files.gguf_file import GGUFFile
from ..models import check_arch, model_class
from ..models.base import Model
from .place import PlacementRequest, draft_devices, parse_size, plan_for, split_of, tensor_devices as plan_devices
from ..files.registry import resolve_model
from .config import Mode, resolve_config
from .thread_governor import ThreadGovernor, busy_elsewhere
from .trace import Tracer


def set_threads(n: int | None, trunk_on_cpu: bool = True) -> None:
    """Numba runs the quantized matvecs on n threads (default: all cores).

    torch and Numba each bring an OpenMP pool; two pools whose idle threads spin on the same few
    cores stall each other for whole scheduler slices (measured here: 10 ms per op, 40x slower
    decoding). A CPU trunk's torch ops are small (one token's norms, rotary, attention rows), so
    torch gets a single thread and no pool when the trunk is on the CPU."""
    import numba

    if n is not None and n < 0:
        raise UserError(f"-t {n}: the thread count must be >= 1 (0 or none: all cores)")
    if n:
        numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
    if trunk_on_cpu:
        torch.set_num_threads(1)
    elif n:
        torch.set_num_threads(n)


def _governor(threads: int | None, mode: Mode) -> ThreadGovernor | None:
    """A CPU trunk without -t adapts its thread count to what other processes leave free
    (thread_governor.py); a placed model's CPU work runs on the executor's worker thread, whose
    count stays as set."""
    import numba

    n = numba.get_num_threads()
    if threads or mode not in (Mode.CPU_FUSED, Mode.CPU_TORCH) or n < 2:
        return None
    return ThreadGovernor(n, busy=busy_elsewhere)


def use_cuda_device(dev: torch.device) -> None:
    """Make `dev` (cuda:N) the current CUDA device. Triton launches its kernels on the current
    device's stream, and CUDA events record and synchronize there too: with the weights on cuda:1
    and device 0 current, the fused kernels would run on the wrong GPU and the executor's copy
    events would not order the copies they guard. "cuda" (no index) is the current device already."""
    if dev.index is None:
        return
    count = torch.cuda.device_count()
    if dev.index >= count:
        raise UserError(f"--device {dev}: this machine has {count} CUDA device(s), cuda:0 .. cuda:{count - 1}")
    torch.cuda.set_device(dev)


def load_model(model: str | os.PathLike | None = None, device: str = "cpu",
               tensor_devices: dict[str, str] | None = None, threads: int | None = None,
               placement: PlacementRequest | None = None, vram: int | str | None = None,
               trace: Tracer | bool | None = None, exact_activations: bool | None = None,
               mtp_head: str | os.PathLike | None = None, act_residual: bool | None = None,
               fused_layers: bool | None = None, cuda_graphs: bool | None = None) -> Model:
    """Load a GGUF model.

    With `placement` (or just `vram`: a byte count or a size like "12GiB"), the planner decides
    where every tensor goes and the model is bound exactly as planned: the trunk, output head and
    the FFN layers it fits on `device`, the boundary layer split, the rest left in the mmap and run
    by the executor's CPU worker (prompt batches of 64+ tokens copy those layers to the device and
    run them there when the plan reserved its staging buffer: op offload, `PlacementRequest.op_offload`).
    `model.plan` holds the plan. A device of "cpu" stands in for a GPU
    (device backends on CPU tensors), which is how the placed path is tested without one.
    Without either, `tensor_devices` maps tensor names to "cpu" / "device" by hand, and by default
    every matrix stays quantized in the mmap and the trunk math runs on `device`.
    `trace`: a Tracer (or True for a new one) that records device work, CPU FFN layers and transfers.
    `exact_activations`: True runs the mmap'd matrices on float32 activations (the exact path the
    float64 reference tests use), False on int8 activations with integer dot products (llama.cpp's
    numerics, several times faster); None: as HYBRIDRT_EXACT_ACTIVATIONS says (off).
    `act_residual`: on int8 activations, whether the attention and FFN-down matrices also take a
    second int8 pass on the first one's rounding (backends.residual_activations; near-float32
    accuracy for ~2 activation rows per token on those matrices); None: as HYBRIDRT_ACT_RESIDUAL
    says (on). False is llama.cpp's numerics exactly.
    `fused_layers`: on a CPU trunk without a plan, each layer half as one fused Numba call where
    its matrices are all in the mmap (True), or the torch trunk ops (False); None: as
    HYBRIDRT_FUSED_LAYERS says (on).
    `cuda_graphs`: a plan on CUDA replays each decode / verify step size as captured device segments
    between its CPU crossings (runtime/step_graphs.py), or runs every step eagerly (False); None:
    as HYBRIDRT_CUDA_GRAPHS says (on). No graphs while tracing.
    These, the execution mode (from `device` and whether a plan executes) and the process-wide
    switches are resolved here once into `model.binder.config` (runtime/config.py: RuntimeConfig).
    `mtp_head`: a head file from `hybridrt train-mtp`, bound as `model.mtp` (replacing a built-in
    one) for `--spec-type draft-mtp`; a head trained for another target is a UserError."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device is available (use --device cpu)")
    if dev.type == "cuda":
        use_cuda_device(dev)
    config = resolve_config(dev.type, planned=placement is not None or vram is not None, exact=exact_activations,
                            act_residual=act_residual, fused_layers=fused_layers, cuda_graphs=cuda_graphs)
    set_threads(threads, trunk_on_cpu=config.mode.trunk_on_cpu)
    path = resolve_model(model)
    gguf = GGUFFile(path)
    check_arch(gguf.arch, gguf.path)
    if vram is not None and placement is None:
        placement = PlacementRequest(vram_bytes=_size(vram))
    tracer = Tracer(dev) if trace is True else (trace or None)
    plan = split = None
    if placement is not None:
        plan = plan_for(str(path), placement, dev, int(gguf.get("context_length", 4096)))
        tensor_devices, split = plan_devices(plan), split_of(plan)
    executor = Executor(dev, tracer, governor=_governor(threads, config.mode),
                        graphs=config.step_graphs(tracing=tracer is not None))
    dtype = torch.float32 if config.mode.trunk_on_cpu else torch.float16
    binder = WeightBinder(gguf, dev, tensor_devices, device_dtype=dtype,
                          executor=executor if config.mode.planned else None, split=split, config=config,
                          op_offload=plan is not None and plan.line("op_offload").gpu_bytes > 0)
    m = model_class(gguf.arch)(gguf, binder)
    m.executor, m.plan = executor, plan
    if mtp_head is not None:
        from ..models.mtp_head import load_mtp_head

        m.mtp = load_mtp_head(m, mtp_head, tensor_devices)
    return m


def load_draft_model(target: Model, draft: str | os.PathLike) -> Model:
    """A draft model (`-md`) as `run` and `bench` decode with it: on the target's device, its tensors
    where the target's plan reserved them, on the target's activation numerics, and at the thread
    count the target's governor last set (one thread launches both models' steps: two governors
    would each reset the count before their own steps and time each other's choices)."""
    numerics = target.binder.config
    d = load_model(draft, device=target.device,
                   tensor_devices=draft_devices(target.plan, str(resolve_model(draft))),
                   exact_activations=numerics.exact, act_residual=numerics.act_residual,
                   fused_layers=numerics.fused_layers, cuda_graphs=numerics.cuda_graphs)
    d.executor.governor = None
    return d


def _size(vram: int | str) -> int:
    return vram if isinstance(vram, int) else parse_size(vram, "vram")
