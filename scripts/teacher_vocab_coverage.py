#!/usr/bin/env python3
"""How much of the later training text a restricted train-mtp teacher covers.

Reads a train-mtp text cache (HEAD.gguf.data.pt) written over the full vocabulary
(`--full-teacher-vocab`, or a cache from before TEXT_VERSION 11), takes R = every id ranked in a
top-40 at the first S steps of the first teacher batch's continuations (TorchTeacher.restrict_output's
set), and reports, over random positions of the later batches, how often the full argmax lies in R
and how much of the softmax probability does (the cached teacher hiddens times the output matrix,
bfloat16 as the teacher computes it).

    python3 scripts/teacher_vocab_coverage.py -m gemma3-270m --data ~/.cache/hybridrt/heads/gemma3-270m.v4.mtp.gguf.data.pt --steps 64 256
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybridrt.runtime.loader import load_model  # noqa: E402
from hybridrt.train_mtp.torch_model import read_f32  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", default="gemma3-270m")
    ap.add_argument("--data", required=True, help="a train-mtp text cache (HEAD.gguf.data.pt)")
    ap.add_argument("--steps", type=int, nargs="+", default=[64, 256], help="teacher steps R is taken from")
    ap.add_argument("--batch", type=int, default=256, help="sequences in the teacher's first batch")
    ap.add_argument("--positions", type=int, default=8000, help="random later positions to check")
    ap.add_argument("-t", "--threads", type=int, default=2)
    args = ap.parse_args()

    m = load_model(args.model, threads=args.threads)
    torch.set_num_threads(args.threads)
    g = m.gguf
    w = read_f32(g, "output.weight" if "output.weight" in g.tensors else "token_embd.weight").to(torch.bfloat16)
    train = torch.load(args.data, weights_only=False)["train"]
    first, rest = train[:args.batch], train[args.batch:]
    kept = {}
    for steps in args.steps:
        kept[steps] = torch.zeros(w.shape[0], dtype=torch.bool)
        hidden = torch.cat([s.hidden[s.n_prompt - 1:s.n_prompt - 1 + steps] for s in first]).to(torch.bfloat16)
        for lo in range(0, hidden.shape[0], 4096):
            kept[steps][(hidden[lo:lo + 4096] @ w.T).topk(40, dim=-1).indices.flatten()] = True
    # the hidden before each generated token predicts it
    later = torch.cat([s.hidden[s.n_prompt - 1:-1] for s in rest])
    later = later[torch.randperm(later.shape[0], generator=torch.Generator().manual_seed(0))[:args.positions]]
    hits = {steps: 0 for steps in args.steps}
    mass = {steps: 0.0 for steps in args.steps}
    for lo in range(0, later.shape[0], 1024):       # [1024 x vocabulary] logits at a time
        logits = later[lo:lo + 1024].to(torch.bfloat16) @ w.T
        argmax, probs = logits.argmax(-1), torch.softmax(logits.float(), -1)
        for steps, k in kept.items():
            hits[steps] += int(k[argmax].sum())
            mass[steps] += float((probs * k).sum())
    n = later.shape[0]
    for steps, k in kept.items():
        print(f"first {steps} steps: {int(k.sum())} ids kept of {w.shape[0]}; later positions whose argmax is "
              f"kept {hits[steps] / n:.2%}, probability kept {mass[steps] / n:.2%}", flush=True)

if __name__ == "__main__":
    main()
