"""`hybridrt bench`: prompt-processing and decode speed, and the weight bandwidth decode achieves."""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from typing import Optional

import typer

MODEL_HELP = "GGUF path or a known name (gemma3-270m, smollm2-135m); default gemma3-270m"


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


def bench_plain(m, n_prompt: int, n_gen: int, reps: int, seed: int = 0) -> tuple[float, float]:
    """Best-of-reps prompt t/s and decode t/s (greedy, fixed pseudo-random prompt tokens)."""
    import torch

    from .generate import generate
    from .sampling import SamplerConfig

    gen = torch.Generator().manual_seed(seed)
    # avoid special tokens at the bottom of the vocabulary so the model does not stop early
    prompt = torch.randint(1000, m.n_vocab - 1000, (n_prompt,), generator=gen).tolist()
    best_pp = best_tg = 0.0
    for _ in range(reps):
        session = m.session(n_prompt + n_gen + 8)
        _, stats = generate(m, session, prompt, n_gen, SamplerConfig(temp=0.0), stop_ids=set())
        best_pp, best_tg = max(best_pp, stats.prompt_tps), max(best_tg, stats.decode_tps)
    return best_pp, best_tg


def bench(
    model: Optional[str] = typer.Option(None, "-m", "--model", help=MODEL_HELP),
    n_prompt: int = typer.Option(128, "-p", "--n-prompt", help="Prompt tokens to process."),
    n_gen: int = typer.Option(128, "-n", "--n-gen", help="Tokens to generate."),
    reps: int = typer.Option(2, "-r", "--repetitions", help="Repetitions (best is reported)."),
    threads: Optional[int] = typer.Option(None, "-t", "--threads", help="CPU threads."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
):
    """Prompt and decode tokens/s, plus achieved weight bandwidth (bytes per token x tokens/s)."""
    import torch

    from .loader import load_model

    m = load_model(model, threads=threads)
    # one short warm-up so JIT compilation and page faults are not timed
    warm = m.session(16)
    warm.eval([1, 2, 3, 4], logits="last")
    t0 = time.perf_counter()
    pp, tg = bench_plain(m, n_prompt, n_gen, reps)
    result = BenchResult(model=m.gguf.path, n_prompt=n_prompt, n_gen=n_gen, threads=torch.get_num_threads(),
                         pp_tps=pp, tg_tps=tg, weight_bytes_per_token=m.weight_bytes_per_token,
                         weight_gbps=m.weight_bytes_per_token * tg / 1e9)
    if as_json:
        print(json.dumps(asdict(result), indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table("model", "threads", "test", "t/s", "weights GB/s", title=f"hybridrt bench ({time.perf_counter() - t0:.0f} s)")
    name = m.gguf.path.rsplit("/", 1)[-1]
    table.add_row(name, str(result.threads), f"pp{n_prompt}", f"{pp:.1f}", "")
    table.add_row(name, str(result.threads), f"tg{n_gen}", f"{tg:.1f}", f"{result.weight_gbps:.1f}")
    Console().print(table)
