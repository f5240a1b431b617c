"""Decode speed of hybridrt next to llama.cpp on the same model, prompt, length and thread count.

    python scripts/bench_vs_llamacpp.py [MODEL ...] [-n 128] [-t 2] [--reps 3] [--pp 512] [--depth 4096] [-ctk f16]
Runs llama.cpp (scripts/bench_llamacpp.py in the oracle venv built by scripts/oracle_setup.sh)
and hybridrt alternately, best of --reps each, and prints one JSON line per model with the ratio.
--pp N adds prompt processing: an N-token prompt (the prompt text's tokens repeated, BOS first)
evaluated in one call by each engine (hybridrt: session.eval, 512-token chunks; llama.cpp: one
llama_eval with n_batch = n_ubatch = N), best of --reps: pp_hybridrt_tps, pp_llamacpp_tps, pp_ratio.
-n 0 skips decode. --depth D decodes after a D-token prompt (the same repeated text; llama-bench's
-d): the decode speed at that context depth, where attention over the cache weighs in. hybridrt's
KV cache is f16 as llama.cpp's (and `hybridrt run`'s) by default; -ctk f32 takes the Python API's.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from hybridrt.decoding.generate import generate, prefill
from hybridrt.runtime.loader import load_model
from hybridrt.files.registry import cache_dir, resolve_model
from hybridrt.decoding.sampling import SamplerConfig

PROMPT = "The history of the city of Paris begins"


def hybridrt_tps(model, n_gen: int, cache_type: str = "f16", depth: int = 0) -> float:
    ids = prompt_ids(model, depth) if depth else model.tokenize(PROMPT)
    _, stats = generate(model, model.session(len(ids) + n_gen + 8, cache_type), ids, n_gen,
                        SamplerConfig(temp=0.0), stop_ids=set())
    return stats.decode_tps


def prompt_ids(model, n: int) -> list[int]:
    """n tokens: the prompt's, then its text's tokens repeated (as bench_llamacpp.py --pp)."""
    first = model.tokenize(PROMPT)
    body = model.tokenize(" " + PROMPT, add_special=False)
    return (first + body * (n // len(body) + 1))[:n]


def hybridrt_pp_tps(model, ids: list[int], cache_type: str = "f16") -> float:
    session = model.session(len(ids) + 8, cache_type)
    t0 = time.perf_counter()
    prefill(session, ids)
    return len(ids) / (time.perf_counter() - t0)


def llamacpp_run(path: Path, n_gen: int, threads: int, pp: int = 0, depth: int = 0) -> dict:
    python = cache_dir() / "oracle-venv" / "bin" / "python"
    script = Path(__file__).with_name("bench_llamacpp.py")
    out = subprocess.run([str(python), str(script), str(path), "-p", PROMPT, "-n", str(n_gen),
                          "-t", str(threads), "-r", "1", "--pp", str(pp), "--depth", str(depth)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="*", default=["smollm2-135m", "gemma3-270m"])
    ap.add_argument("-n", "--n-gen", type=int, default=128)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--pp", type=int, default=0, help="also time an N-token prompt (e.g. 512)")
    ap.add_argument("-ctk", "--cache-type", default="f16",
                    help="hybridrt's KV cache (f16: llama.cpp's default and hybridrt run's; f32: the Python API's)")
    ap.add_argument("--depth", type=int, default=0, help="decode after a prompt of this many tokens (e.g. 4096)")
    args = ap.parse_args()
    for spec in args.models:
        path = resolve_model(spec)
        model = load_model(path, threads=args.threads)
        hybridrt_tps(model, 8, args.cache_type)      # warm-up: JIT cache load, page faults
        row = {"model": path.name, "threads": args.threads, "n_gen": args.n_gen, "cache_type": args.cache_type}
        if args.depth:
            row["depth"] = args.depth
        if args.n_gen:
            ours, theirs = [], []
            for _ in range(args.reps):              # alternate so both see the same machine load
                theirs.append(llamacpp_run(path, args.n_gen, args.threads, depth=args.depth)["tg_tps"])
                ours.append(hybridrt_tps(model, args.n_gen, args.cache_type, args.depth))
            row.update(hybridrt_tps=round(max(ours), 1), llamacpp_tps=round(max(theirs), 1),
                       ratio=round(max(ours) / max(theirs), 2))
        if args.pp:
            ids = prompt_ids(model, args.pp)
            hybridrt_pp_tps(model, ids[:64], args.cache_type)     # warm-up of the batch kernels
            ours, theirs = [], []
            for _ in range(args.reps):
                theirs.append(llamacpp_run(path, 0, args.threads, args.pp)["pp_tps"])
                ours.append(hybridrt_pp_tps(model, ids, args.cache_type))
            row.update(pp=args.pp, pp_hybridrt_tps=round(max(ours), 1), pp_llamacpp_tps=round(max(theirs), 1),
                       pp_ratio=round(max(ours) / max(theirs), 2))
        row.update(torch_threads=torch.get_num_threads(), when=time.strftime("%Y-%m-%d %H:%M"))
        print(json.dumps(row))
        sys.stdout.flush()


if __name__ == "__main__":
    main()
