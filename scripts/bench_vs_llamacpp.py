"""Decode speed of hybridrt next to llama.cpp on the same model, prompt, length and thread count.

    python scripts/bench_vs_llamacpp.py [MODEL ...] [-n 128] [-t 2] [--reps 3]
Runs llama.cpp (scripts/bench_llamacpp.py in the oracle venv built by scripts/oracle_setup.sh)
and hybridrt alternately, best of --reps each, and prints one JSON line per model with the ratio.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from hybridrt.generate import generate
from hybridrt.loader import load_model
from hybridrt.registry import cache_dir, resolve_model
from hybridrt.sampling import SamplerConfig

PROMPT = "The history of the city of Paris begins"


def hybridrt_tps(model, n_gen: int) -> float:
    ids = model.tokenize(PROMPT)
    _, stats = generate(model, model.session(len(ids) + n_gen + 8), ids, n_gen, SamplerConfig(temp=0.0),
                        stop_ids=set())
    return stats.decode_tps


def llamacpp_tps(path: Path, n_gen: int, threads: int) -> float:
    python = cache_dir() / "oracle-venv" / "bin" / "python"
    script = Path(__file__).with_name("bench_llamacpp.py")
    out = subprocess.run([str(python), str(script), str(path), "-p", PROMPT, "-n", str(n_gen),
                          "-t", str(threads), "-r", "1"], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["tg_tps"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="*", default=["smollm2-135m", "gemma3-270m"])
    ap.add_argument("-n", "--n-gen", type=int, default=128)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    for spec in args.models:
        path = resolve_model(spec)
        model = load_model(path, threads=args.threads)
        hybridrt_tps(model, 8)                      # warm-up: JIT cache load, page faults
        ours, theirs = [], []
        for _ in range(args.reps):                  # alternate so both see the same machine load
            theirs.append(llamacpp_tps(path, args.n_gen, args.threads))
            ours.append(hybridrt_tps(model, args.n_gen))
        row = {"model": path.name, "threads": args.threads, "n_gen": args.n_gen,
               "hybridrt_tps": round(max(ours), 1), "llamacpp_tps": round(max(theirs), 1),
               "ratio": round(max(ours) / max(theirs), 2), "torch_threads": torch.get_num_threads(),
               "when": time.strftime("%Y-%m-%d %H:%M")}
        print(json.dumps(row))
        sys.stdout.flush()


if __name__ == "__main__":
    main()
