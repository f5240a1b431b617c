"""`hybridrt plan`: where every tensor of a model would go on this machine, and how fast it would run.

Parsing and printing only; the planning is `placement.plan`. torch is imported only when a GPU
driver is present and the budget or the GPU bandwidth must be read from the device.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional

import typer

from placement import (DEFAULT_GPU_BW, GiB, MiB, Plan, PlanError, PlanOptions, gpu_peak_bandwidth,
                       layer_ranges, measure_cpu_bandwidth)
from placement import plan as make_plan

from .options import (CPU_BW, CTX_SIZE, DRAFT_N_MAX, GROUP, JSON, MARGIN, MODEL, MODEL_ARG, MODEL_DRAFT,
                          NO_OP_OFFLOAD, PARALLEL, SPEC_TYPE, KVFlags, flag_groups)
from ..errors import UserError
from ..runtime.place import parse_size

DEFAULT_VRAM = 12 * GiB


@dataclass
class GPUInfo:
    name: str
    free_bytes: int
    total_bytes: int
    peak_bw: float | None


def _gpu_driver_present() -> bool:
    # cheap check first: importing torch costs a second or two, and plan must stay fast without a GPU
    return any(os.path.exists(p) for p in ("/proc/driver/nvidia/version", "/dev/nvidiactl", "/dev/kfd"))


def detect_gpu() -> GPUInfo | None:
    if not _gpu_driver_present():
        return None
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info(0)
    props = torch.cuda.get_device_properties(0)
    bw = gpu_peak_bandwidth(props.name, getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0))
    return GPUInfo(props.name, int(free), int(total), bw)


def _mib(n: float) -> str:
    return f"{n / MiB:,.1f}"


def _size(n: float) -> str:
    return f"{n / GiB:,.1f} GiB" if n >= GiB else f"{n / MiB:,.1f} MiB"


def _host_ram(cpu_bytes: int) -> dict:
    import psutil

    vm = psutil.virtual_memory()
    return {"cpu_side_bytes": cpu_bytes, "ram_available_bytes": int(vm.available),
            "ram_total_bytes": int(vm.total), "resident": cpu_bytes <= vm.available}


def _print_report(p: Plan, host: dict, sources: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False)
    o, s = p.options, p.speed
    spec = "none" if o.spec_type == "none" else f"{o.spec_type}, N = {o.n_draft}"
    console.print(f"[bold]{p.model}[/bold] ({p.arch})")
    sessions = f" · {o.n_seq} sessions" if o.n_seq > 1 else ""
    console.print(f"budget {_mib(o.vram_bytes)} MiB ({sources['vram']}) · context {o.n_ctx:,}{sessions} · "
                  f"KV {o.cache_type_k}/{o.cache_type_v} · spec {spec} · k_max {o.batch}")
    table = Table(title_justify="left", show_footer=True)
    table.add_column("#", footer="")
    table.add_column("reservation", footer="total")
    table.add_column("GPU MiB", justify="right", footer=_mib(p.gpu_bytes))
    table.add_column("CPU MiB", justify="right", footer=_mib(p.cpu_bytes))
    table.add_column("detail", footer=f"{_mib(p.free_bytes)} MiB of the budget left")
    for line in p.lines:
        if line.gpu_bytes == 0 and line.cpu_bytes == 0 and line.key not in ("gdn_snapshot_ring", "ffn"):
            continue
        table.add_row(str(line.stage), line.label, _mib(line.gpu_bytes) if line.gpu_bytes else "·",
                      _mib(line.cpu_bytes) if line.cpu_bytes else "·", line.detail)
    console.print(table)
    n_gpu, n_cpu = len(p.ffn_gpu_layers), len(p.ffn_cpu_layers)
    what = "routed experts" if p.line("ffn").label == "routed experts" else "FFN"
    console.print(f"{what} on GPU: {layer_ranges(p.ffn_gpu_layers) or 'none'} ({n_gpu} layers), "
                  f"CPU: {layer_ranges(p.ffn_cpu_layers) or 'none'} ({n_cpu} layers)"
                  + (f"; layer {p.ffn_split.layer} split, {p.ffn_split.gpu_units}/{p.ffn_split.n_ff} units "
                     f"({_mib(p.ffn_split.gpu_bytes)} MiB) on the GPU" if p.ffn_split else ""))
    for why in p.not_fitted:
        console.print(f"[yellow]did not fit:[/yellow] {why}")
    ram = (f"host RAM: {_size(host['cpu_side_bytes'])} of CPU-side weights (mmap'd) vs "
           f"{_size(host['ram_available_bytes'])} available of {_size(host['ram_total_bytes'])}")
    if host["resident"]:
        console.print(ram + " · stays resident")
    else:
        console.print(f"[red]{ram} · will NOT stay resident: pages are re-read from disk every step, "
                      "decoding will be far slower than predicted[/red]")
    console.print(f"predicted decode (bandwidth model, GPU {s.gpu_bw / 1e9:,.0f} GB/s {sources['gpu_bw']}, "
                  f"CPU {s.cpu_bw / 1e9:,.1f} GB/s {sources['cpu_bw']}):")
    console.print(f"  plain        {s.plain_tok_s:8.1f} tok/s  ({s.plain_step_s * 1e3:.2f} ms/step: "
                  f"{_mib(s.plain_gpu_bytes)} MiB GPU + {_mib(s.plain_cpu_bytes)} MiB CPU read)")
    if s.spec_tok_s is not None:
        console.print(f"  speculative  {s.spec_tok_s:8.1f} tok/s  ({s.tokens_per_step:.2f} tokens per "
                      f"{s.spec_step_s * 1e3:.2f} ms step: verify {s.verify_step_s * 1e3:.2f} ms + "
                      f"{o.n_draft} x {s.draft_step_s * 1e3:.2f} ms drafts)")
    for a in s.assumptions[1:]:
        console.print(f"  [dim]{a}[/dim]")
    for note in p.notes:
        console.print(f"[dim]note: {note}[/dim]")


@flag_groups
def plan(
    model: Optional[str] = MODEL_ARG,
    model_opt: Optional[str] = MODEL,
    vram: str = typer.Option("auto", "--vram", help="VRAM budget: auto (free memory of GPU 0; 12GiB without "
                             "a GPU) or a size: 12GiB, 12GB, 12000MiB, bytes"),
    ctx_size: Optional[int] = CTX_SIZE,
    spec_type: Optional[str] = SPEC_TYPE,
    spec_draft_n_max: int = DRAFT_N_MAX,
    model_draft: Optional[str] = MODEL_DRAFT,
    kv: KVFlags = GROUP,
    margin: str = MARGIN,
    accept_rate: float = typer.Option(0.8, "--accept-rate", help="assumed per-draft acceptance probability"),
    gpu_bw: Optional[float] = typer.Option(None, "--gpu-bw", help="GPU memory bandwidth in GB/s "
                                           "(default: the device's peak; 500 without a GPU)"),
    cpu_bw: Optional[float] = CPU_BW,
    k_max: Optional[int] = typer.Option(None, "--k-max", help="largest token batch evaluated at once "
                                        "(default: N + 1; prompts are processed in chunks of it)"),
    n_cpu_moe: int = typer.Option(0, "-ncmoe", "--n-cpu-moe", help="MoE: keep the routed experts of the "
                                  "first N layers on the CPU (as llama.cpp's flag); the rest are placed "
                                  "front first while they fit"),
    no_op_offload: bool = NO_OP_OFFLOAD,
    parallel: int = PARALLEL,
    as_json: bool = JSON,
):
    """Plan GPU/CPU placement for a model before loading it: memory per category, layers, speed."""
    from rich.console import Console

    from .options import check_spec_flags, context_size
    from ..files.gguf_file import GGUFError
    from ..files.model_profile import load_profile
    from ..files.registry import resolve_model
    from ..decoding.speculative.spec_types import model_spec_type

    try:
        profile = load_profile(resolve_model(model_opt or model))
        draft = load_profile(resolve_model(model_draft)) if model_draft else None
    except GGUFError as exc:
        raise UserError(str(exc)) from None
    check_spec_flags(spec_draft_n_max)
    n_ctx = context_size(ctx_size, profile.n_ctx_train)
    if spec_type is None:
        spec_type = "draft-simple" if draft else ("draft-mtp" if profile.has_mtp else "none")
    spec_type = model_spec_type(spec_type)      # a chain (ngram-simple,draft-mtp): its model source's VRAM
    if draft is not None and spec_type != "draft-simple":
        raise UserError(f"-md is a draft model for --spec-type draft-simple, not {spec_type}")

    margin_bytes = parse_size(margin, "--margin")
    gpu = detect_gpu() if (vram == "auto" or gpu_bw is None) else None
    no_gpu_note = None
    if vram == "auto":
        if gpu is None:
            no_gpu_note = f"no GPU found: planning for {DEFAULT_VRAM // GiB} GiB (choose with --vram)"
            budget, vram_source = DEFAULT_VRAM, "no GPU: default"
        else:
            budget, vram_source = gpu.free_bytes, f"free on {gpu.name}"
    else:
        budget, vram_source = parse_size(vram, "--vram"), "--vram"
    if gpu_bw is not None:
        gbw, gbw_source = gpu_bw * 1e9, "from --gpu-bw"
    elif gpu is not None and gpu.peak_bw:
        gbw, gbw_source = gpu.peak_bw, f"peak of {gpu.name}"
    else:
        gbw, gbw_source = DEFAULT_GPU_BW, f"assumed ({gpu.name}: unknown card)" if gpu else "assumed, no GPU to ask"
    if cpu_bw is not None:
        cbw, cbw_source = cpu_bw * 1e9, "from --cpu-bw"
    else:
        cbw, cbw_source = measure_cpu_bandwidth(), "measured"

    options = PlanOptions(vram_bytes=budget, margin_bytes=margin_bytes, n_ctx=n_ctx,
                          cache_type_k=kv.cache_type_k, cache_type_v=kv.cache_type_v, spec_type=spec_type,
                          spec_draft_n_max=spec_draft_n_max, draft=draft, accept_rate=accept_rate,
                          gpu_bw=gbw, cpu_bw=cbw, k_max=k_max, n_cpu_moe=n_cpu_moe,
                          op_offload=not no_op_offload, n_seq=parallel)
    try:
        p = make_plan(profile, options)
    except PlanError as exc:
        raise UserError(str(exc)) from None
    if no_gpu_note:             # after the plan, so that an error stays the only line on stderr
        Console(stderr=True, highlight=False).print(no_gpu_note)
    host = _host_ram(p.cpu_bytes)
    sources = {"vram": vram_source, "gpu_bw": gbw_source, "cpu_bw": cbw_source}
    if as_json:
        print(json.dumps({**p.to_dict(), "host": host, "sources": sources}, indent=1))
    else:
        _print_report(p, host, sources)
