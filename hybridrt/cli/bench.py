"""`hybridrt bench`: prompt-processing and decode speed, and the weight bandwidth decode achieves."""
from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import typer

from .options import (ADAPTIVE, CPU_BW, DRAFT_N_MAX, DRAFT_VOCAB, GROUP, JSON, MODEL, MODEL_DRAFT, MTP_HEAD,
                          THREADS, KVFlags, LoadFlags, flag_groups)
from ..errors import UserError


@dataclass
class BenchResult:
    model: str
    n_prompt: int
    n_gen: int
    threads: int
    pp_tps: float
    tg_tps: float
    weight_bytes_per_token: int
    weight_gbps: float
    measured_tps: float          # = tg_tps
    predicted_tps: float         # the plan's bandwidth model (all-mmap: CPU bytes per token / bandwidth)
    prediction: str              # where predicted_tps comes from
    placement: dict | None       # the executed plan's summary (None: everything in the mmap)
    cpu_kernels: str             # the CPU matvec path: activations, integer lowering, AMX tiles


def bench_plain(m, n_prompt: int, n_gen: int, reps: int, seed: int = 0,
                cache_type: str | None = None) -> tuple[float, float]:
    """Best-of-reps prompt t/s and decode t/s (greedy, fixed pseudo-random prompt tokens)."""
    import torch

    from ..decoding.generate import generate
    from ..decoding.sampling import SamplerConfig

    gen = torch.Generator().manual_seed(seed)
    # avoid special tokens at the bottom of the vocabulary so the model does not stop early (a small
    # vocabulary: its middle half)
    lo = min(1000, m.n_vocab // 4)
    prompt = torch.randint(lo, m.n_vocab - lo, (n_prompt,), generator=gen).tolist()
    best_pp = best_tg = 0.0
    for _ in range(reps):
        session = m.session(None if m.plan is not None else n_prompt + n_gen + 8, cache_type)
        _, stats = generate(m, session, prompt, n_gen, SamplerConfig(temp=0.0), stop_ids=set())
        best_pp, best_tg = max(best_pp, stats.prompt_tps), max(best_tg, stats.decode_tps)
    return best_pp, best_tg


@dataclass
class SpecBenchResult:
    model: str
    spec_type: str
    n_max: int
    prompt: str
    force: str
    n_prompt: int
    n_gen: int
    plain_tps: float
    spec_tps: float
    speedup: float
    identical: bool           # greedy: the speculative tokens equal the plain ones
    spec: dict
    draft_vocab: int = 0         # draft-mtp's draft vocabulary (0: the whole head)
    measured_tps: float = 0.0    # = spec_tps
    predicted_tps: float | None = None
    prediction: str = ""
    placement: dict | None = None


def predicted_speed(m, cpu_bw: float, speculative: bool = False) -> tuple[float | None, str]:
    """The speed the planner predicts for what is loaded: the executed plan's model, or for an
    all-mmap model every weight byte of a step read at the CPU's bandwidth."""
    if m.plan is not None:
        s = m.plan.speed
        tps = s.spec_tok_s if speculative else s.plain_tok_s
        return tps, f"plan: GPU {s.gpu_bw / 1e9:.0f} GB/s, CPU {s.cpu_bw / 1e9:.1f} GB/s" + (
            f", acceptance {s.accept_rate:g}" if speculative else "")
    if speculative:
        return None, "no plan: speculative speed depends on acceptance"
    return cpu_bw / m.weight_bytes_per_token, f"all weights from the mmap at {cpu_bw / 1e9:.1f} GB/s"


def placement_summary(plan) -> dict | None:
    if plan is None:
        return None
    return {"ffn_gpu_layers": plan.ffn_gpu_layers, "ffn_cpu_layers": plan.ffn_cpu_layers,
            "ffn_split": dataclasses.asdict(plan.ffn_split) if plan.ffn_split else None,
            "gpu_bytes": plan.gpu_bytes, "budget_bytes": plan.options.vram_bytes,
            "spec_type": plan.options.spec_type, "n_draft": plan.options.n_draft}


def bench_speculative(m, prompt_ids: list[int], n_gen: int, reps: int, spec_type: str, n_max: int,
                      draft_model=None, force: str = "none", prompt_name: str = "",
                      adaptive: bool = False, cache_type: str | None = None, draft_vocab: int = 0) -> SpecBenchResult:
    """Plain greedy decoding and speculative decoding of the same prompt, best of reps each.
    draft_vocab: draft-mtp's reduced draft vocabulary (build_source; 0: the whole head)."""
    from ..decoding.generate import generate
    from ..decoding.sampling import SamplerConfig
    from ..decoding.speculative.draft_forced import ForcedSource
    from ..decoding.speculative.loop import SpecConfig
    from ..decoding.speculative.sources import build_source

    greedy = SamplerConfig(temp=0.0)
    spec = SpecConfig(n_max=n_max, adaptive=adaptive)
    n_ctx = None if m.plan is not None else len(prompt_ids) + n_gen + n_max + 8
    best_plain = best_spec = 0.0
    ref: list[int] = []
    spec_stats = None
    for _ in range(reps):
        ref, stats = generate(m, m.session(n_ctx, cache_type, k_max=spec.k_max), prompt_ids, n_gen, greedy,
                              stop_ids=set())
        best_plain = max(best_plain, stats.decode_tps)
    identical = True
    for _ in range(reps):
        session = m.session(n_ctx, cache_type, k_max=spec.k_max)
        source = build_source(spec_type, session, greedy, spec, draft_model, cache_type=cache_type or "f32",
                              draft_vocab=draft_vocab)
        if force != "none":
            source = ForcedSource(source, ref, len(prompt_ids), m.n_vocab, corrupt=1.0 if force == "reject" else 0.0)
        out, stats = generate(m, session, prompt_ids, n_gen, greedy, source, spec, stop_ids=set(),
                              trace=m.executor.trace)
        identical &= out == ref
        if stats.decode_tps > best_spec:
            best_spec, spec_stats = stats.decode_tps, stats.spec
    return SpecBenchResult(model=m.gguf.path, spec_type=spec_type, n_max=n_max, prompt=prompt_name, force=force,
                           n_prompt=len(prompt_ids), n_gen=n_gen, plain_tps=best_plain, spec_tps=best_spec,
                           speedup=best_spec / best_plain if best_plain else 0.0, identical=identical,
                           spec=spec_stats.to_dict(), draft_vocab=draft_vocab)


@flag_groups
def bench(
    model: Optional[str] = MODEL,
    n_prompt: int = typer.Option(128, "-p", "--n-prompt", help="Prompt tokens to process."),
    n_gen: int = typer.Option(128, "-n", "--n-gen", help="Tokens to generate."),
    reps: int = typer.Option(2, "-r", "--repetitions", help="Repetitions (best is reported)."),
    threads: Optional[int] = THREADS,
    as_json: bool = JSON,
    spec_type: Optional[str] = typer.Option(None, "--spec-type", help="Compare plain and speculative decoding: draft-mtp, draft-simple, ngram-simple, or a chain such as ngram-simple,draft-mtp (none: the plain bench)."),
    draft_n_max: int = DRAFT_N_MAX,
    draft_vocab: int = DRAFT_VOCAB,
    model_draft: Optional[str] = MODEL_DRAFT,
    prompt_file: Optional[Path] = typer.Option(None, "-f", "--file", help="Speculative bench: prompt text file."),
    spec_prompt: str = typer.Option("echo", "--spec-prompt", help="Speculative bench built-in prompt: echo (lookup pays) or adversarial (it cannot); 'random' uses -p random tokens."),
    spec_force: str = typer.Option("none", "--spec-force", help="Replace drafts by the target's own continuation (accept) or wrong tokens (reject) to measure step cost vs k."),
    ctx_size: Optional[int] = typer.Option(None, "-c", "--ctx-size", help="Context the plan reserves (default 4096 or the model's)."),
    load: LoadFlags = GROUP,
    kv: KVFlags = GROUP,
    cpu_bw: Optional[float] = CPU_BW,
    adaptive: Optional[bool] = ADAPTIVE,
    mtp_head: Optional[Path] = MTP_HEAD,
):
    """Prompt and decode tokens/s, plus achieved weight bandwidth (bytes per token x tokens/s) and the
    planner's predicted speed. With --spec-type: plain and speculative decoding of the same prompt,
    and their speed ratio. With --vram or --device cuda the plan is executed."""
    import numba

    from placement import measure_cpu_bandwidth

    from .options import check_ctx_size, check_draft_vocab_flag, check_spec_flags

    for flag, value in (("-p", n_prompt), ("-n", n_gen), ("-r", reps)):
        if value < 1:
            raise UserError(f"{flag} {value}: must be >= 1")
    device = load.check()
    check_spec_flags(draft_n_max)
    check_draft_vocab_flag(draft_vocab)
    check_ctx_size(ctx_size)
    cbw = cpu_bw * 1e9 if cpu_bw else measure_cpu_bandwidth()
    cache_type = kv.cache_type      # what `run` decodes on
    # a benchmark runs at one thread count, the one it reports (no thread governor: loader.py)
    m = load.load(model, device, threads or numba.config.NUMBA_NUM_THREADS, ctx_size, kv, spec_type or "none",
                  draft_n_max, model_draft, mtp_head, cpu_bw=cbw)
    try:
        if spec_type not in (None, "none"):        # none: the plain bench, as `run --spec-type none` decodes
            _bench_spec(m, spec_type, draft_n_max, model_draft, prompt_file, spec_prompt, spec_force, n_prompt,
                        n_gen, reps, as_json, cbw, adaptive, cache_type, draft_vocab)
        else:
            _bench_plain(m, n_prompt, n_gen, reps, as_json, cbw, numba.get_num_threads(), cache_type)
    finally:
        load.write_trace(m)


def _bench_plain(m, n_prompt: int, n_gen: int, reps: int, as_json: bool, cpu_bw: float, threads: int,
                 cache_type: str) -> None:
    # a warm-up run of the same shapes, as llama-bench makes one: a prompt batch and a decode step,
    # so first-use costs (JIT compilation, kernels loaded, page faults) are not timed. A 4-token
    # warm-up (a decode-sized batch) left the prompt path's first use in the timed pp.
    warm = m.session(None if m.plan is not None else n_prompt + 8, cache_type)
    lo = min(1000, m.n_vocab // 4)
    warm.eval([lo + i % (m.n_vocab - 2 * lo) for i in range(n_prompt)], logits="last")
    warm.eval([lo], logits="last")
    t0 = time.perf_counter()
    pp, tg = bench_plain(m, n_prompt, n_gen, reps, cache_type=cache_type)
    predicted, source = predicted_speed(m, cpu_bw)
    from cpu_kernels.matvec import kernel_summary

    result = BenchResult(model=m.gguf.path, n_prompt=n_prompt, n_gen=n_gen, threads=threads,
                         pp_tps=pp, tg_tps=tg, weight_bytes_per_token=m.weight_bytes_per_token,
                         weight_gbps=m.weight_bytes_per_token * tg / 1e9, measured_tps=tg,
                         predicted_tps=predicted, prediction=source, placement=placement_summary(m.plan),
                         cpu_kernels=kernel_summary(m.binder.config.exact, m.binder.config.act_residual))
    if as_json:
        print(json.dumps(asdict(result), indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table("model", "threads", "test", "t/s", "weights GB/s", "predicted t/s",
                  title=f"hybridrt bench ({time.perf_counter() - t0:.0f} s)")
    name = m.gguf.path.rsplit("/", 1)[-1]
    table.add_row(name, str(result.threads), f"pp{n_prompt}", f"{pp:.1f}", "", "")
    table.add_row(name, str(result.threads), f"tg{n_gen}", f"{tg:.1f}", f"{result.weight_gbps:.1f}", f"{predicted:.1f}")
    Console().print(table)
    print(f"prediction: {source}")
    print(f"CPU kernels: {result.cpu_kernels}")


def _bench_spec(m, spec_type, n_max, model_draft, prompt_file, spec_prompt, force, n_prompt, n_gen, reps, as_json,
                cpu_bw, adaptive, cache_type, draft_vocab=0):
    import torch

    from .options import adaptive_default
    from .run import read_prompt
    from ..runtime.loader import load_draft_model
    from ..decoding.speculative.bench_prompts import BUILTIN_PROMPTS
    from ..decoding.speculative.spec_types import spec_type_parts
    from ..runtime.warmup import compile_head

    if force not in ("none", "accept", "reject"):
        raise UserError(f"--spec-force must be none, accept or reject, not {force}")
    if prompt_file is not None:
        name, ids = prompt_file.name, m.tokenize(read_prompt(None, prompt_file))
    elif spec_prompt == "random":
        gen = torch.Generator().manual_seed(0)
        name, ids = "random", torch.randint(1000 % m.n_vocab, m.n_vocab - 1, (n_prompt,), generator=gen).tolist()
    elif spec_prompt in BUILTIN_PROMPTS:
        name, ids = spec_prompt, m.tokenize(BUILTIN_PROMPTS[spec_prompt])
    else:
        raise UserError(f"--spec-prompt must be one of {', '.join([*BUILTIN_PROMPTS, 'random'])}")
    # as `run` loads it (a CPU draft beside a GPU target would time another setup than the planned one)
    draft = load_draft_model(m, model_draft) if model_draft else None
    warm = m.session(16, cache_type, k_max=n_max + 1)
    warm.eval([1, 2], logits="last")
    warm.eval(list(range(3, 3 + n_max + 1)), logits="all")
    if "draft-mtp" in spec_type_parts(spec_type):
        # a trained head's Q8_0 kernels compile on its first draft: inside the timed run, `-r 1` measured
        # a SmolLM2 head at 0.75x plain (27 % of the time drafting) where it decodes at ~1.1x
        compile_head(m, cache_type)
    r = bench_speculative(m, ids, n_gen, reps, spec_type, n_max, draft, force, name,
                          adaptive=adaptive_default(spec_type) if adaptive is None else adaptive, cache_type=cache_type,
                          draft_vocab=draft_vocab)
    r.measured_tps = r.spec_tps
    r.predicted_tps, r.prediction = predicted_speed(m, cpu_bw, speculative=True)
    r.placement = placement_summary(m.plan)
    if as_json:
        print(json.dumps(asdict(r), indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    s = r.spec
    table = Table("model", "spec", "N", "prompt", "force", "plain t/s", "spec t/s", "speedup", "accept",
                  "tok/step", "same output", title="hybridrt bench: speculative vs plain (greedy)")
    table.add_row(m.gguf.path.rsplit("/", 1)[-1], r.spec_type, str(n_max), r.prompt, r.force, f"{r.plain_tps:.1f}",
                  f"{r.spec_tps:.1f}", f"{r.speedup:.2f}x", f"{100 * s['acceptance_rate']:.0f}%",
                  f"{s['tokens_per_step']:.2f}", "yes" if r.identical else "NO")
    Console().print(table)
    total = s["draft_s"] + s["verify_s"] + s["other_s"]
    if total:
        print(f"time split: draft {100 * s['draft_s'] / total:.0f}% / verify {100 * s['verify_s'] / total:.0f}% / "
              f"other {100 * s['other_s'] / total:.0f}%; verify ms/step {1e3 * s['verify_s'] / max(1, s['steps']):.1f}; "
              f"accepted-per-step histogram {s['histogram']}")
