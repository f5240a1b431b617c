"""How a loaded model executes and on what numerics: one frozen `RuntimeConfig`, resolved once by
`loader.load_model` from its arguments (the CLI's flags), the environment filling in what they leave
unsaid, and handed to the weight binder, which picks every backend from it.

The environment is read here and nowhere else (`ENV_VARIABLES`, `read_env`). Three of its switches
are process-wide, because the CPU kernels compile them in or are imported before any load (the
integer lowering, AMX tiles, Triton's direct launch): `ENV` is their one reading, when this module
is first imported; the kernel modules take them from it, and a config reports them. The other three
are per load (float32 activations, the second int8 pass, the fused layer halves): a flag or an API
argument sets them, else the environment as it is at the load. Imports nothing beyond the standard
library (no torch), so the kernel modules can read it at import.
"""
from __future__ import annotations

import dataclasses
import enum
import os
from dataclasses import dataclass
from typing import Callable, Mapping


class Mode(enum.Enum):
    """Who runs the trunk, and whether a plan's executor moves rows between the device and the CPU."""
    CPU_FUSED = "CPU trunk, fused layer halves"     # no plan; each layer half one Numba call where it can
    CPU_TORCH = "CPU trunk, torch ops"              # no plan; HYBRIDRT_FUSED_LAYERS=0's torch trunk
    DEVICE_TRUNK = "CUDA trunk, no plan"            # no plan; the API's or a draft model's trunk on a GPU
    PLAN_ON_CPU = "plan, the CPU standing in"       # a plan executed with device backends on CPU tensors
    PLAN_ON_CUDA = "plan on CUDA"                   # a plan executed on a GPU

    @property
    def planned(self) -> bool:
        """A plan executes: layers left in the mmap cross to the CPU through the executor."""
        return self in (Mode.PLAN_ON_CPU, Mode.PLAN_ON_CUDA)

    @property
    def trunk_on_cpu(self) -> bool:
        return self in (Mode.CPU_FUSED, Mode.CPU_TORCH, Mode.PLAN_ON_CPU)

    @property
    def fused(self) -> bool:
        """The fused CPU layer halves (and their attention and norm kernels) serve this trunk."""
        return self is Mode.CPU_FUSED


def execution_mode(device_type: str, planned: bool, fused_layers: bool) -> Mode:
    """The mode of a trunk on `device_type` ("cpu" or "cuda"), with or without a plan executing."""
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"no execution mode for a trunk on {device_type!r} (cpu or cuda)")
    if planned:
        return Mode.PLAN_ON_CUDA if device_type == "cuda" else Mode.PLAN_ON_CPU
    if device_type == "cuda":
        return Mode.DEVICE_TRUNK
    return Mode.CPU_FUSED if fused_layers else Mode.CPU_TORCH


@dataclass(frozen=True)
class Switches:
    """The numerics switches: per load (exact, act_residual, fused_layers) and per process (the rest)."""
    exact: bool = False             # float32 activations for the mmap'd matrices, not int8 (--exact-activations)
    act_residual: bool = True       # on int8, the second pass on attention / FFN-down inputs (--act-residual)
    fused_layers: bool = True       # a CPU trunk's fused layer halves (no flag; False: CPU_TORCH)
    cuda_graphs: bool = True        # a plan on CUDA replays captured step graphs (--no-cuda-graphs: eager)
    int_isa: str = ""               # a forced integer lowering ("": the host's best; tests force others)
    amx: bool = True                # AMX tiles for verify batches where the CPU has them
    direct_launch: bool = True      # Triton kernels through their compiled launcher once it checked out


def _on_unless_empty_or_0(value: str) -> bool:
    return value not in ("", "0")


def _on_unless_0(value: str) -> bool:
    return value.strip() != "0"


# Switches field -> (variable, how its value reads). Unset, a field keeps its Switches default; the
# readings are the variables' documented ones (docs/kernels.md, "Environment switches").
ENV_VARIABLES: dict[str, tuple[str, Callable[[str], object]]] = {
    "exact": ("HYBRIDRT_EXACT_ACTIVATIONS", _on_unless_empty_or_0),
    "act_residual": ("HYBRIDRT_ACT_RESIDUAL", _on_unless_empty_or_0),
    "fused_layers": ("HYBRIDRT_FUSED_LAYERS", _on_unless_empty_or_0),
    "cuda_graphs": ("HYBRIDRT_CUDA_GRAPHS", _on_unless_0),
    "int_isa": ("HYBRIDRT_INT_ISA", str),
    "amx": ("HYBRIDRT_AMX", _on_unless_empty_or_0),
    "direct_launch": ("HYBRIDRT_DIRECT_LAUNCH", _on_unless_0),
}


def read_env(environ: Mapping[str, str]) -> Switches:
    """The switches an environment sets (each variable unset: its default)."""
    return Switches(**{field: read(environ[var]) for field, (var, read) in ENV_VARIABLES.items() if var in environ})


ENV = read_env(os.environ)      # the reading the kernels compile with (and direct kernel calls default to)


@dataclass(frozen=True, kw_only=True)
class RuntimeConfig(Switches):
    """A loaded model's execution mode and numerics (`model.binder.config`)."""
    mode: Mode

    def step_graphs(self, tracing: bool) -> str | None:
        """How the executor captures steps: CUDA graphs for a plan on CUDA unless switched off or
        traced (a trace times each device call, which a replayed graph does not make), else none."""
        return "cuda" if self.mode is Mode.PLAN_ON_CUDA and self.cuda_graphs and not tracing else None

    def without_plan(self) -> "RuntimeConfig":
        """The same trunk and numerics with no plan executing: a trained MTP head binds outside the
        plan (its matrices stay in the mmap, called in place, never through the executor)."""
        device = "cpu" if self.mode.trunk_on_cpu else "cuda"
        return dataclasses.replace(self, mode=execution_mode(device, False, self.fused_layers))


def resolve_config(device_type: str, planned: bool, *, exact: bool | None = None, act_residual: bool | None = None,
                   fused_layers: bool | None = None, cuda_graphs: bool | None = None, environ: Mapping[str, str] = os.environ) -> RuntimeConfig:
    """The config of one load: each per-load switch as given (None: not given: a flag left off, an
    API argument left out), else as `environ` says now; the per-process ones as ENV read them (the
    kernels compiled them in already)."""
    now = read_env(environ)
    given = {"exact": exact, "act_residual": act_residual, "fused_layers": fused_layers, "cuda_graphs": cuda_graphs}
    per_load = {k: getattr(now, k) if v is None else v for k, v in given.items()}
    per_process = {f.name: getattr(ENV, f.name) for f in dataclasses.fields(Switches) if f.name not in given}
    return RuntimeConfig(mode=execution_mode(device_type, planned, per_load["fused_layers"]), **per_load, **per_process)
