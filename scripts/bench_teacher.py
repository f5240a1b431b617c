"""How fast `hybridrt train-mtp`'s torch teacher writes training text: full batches of the built-in
training prompts (cycled, with train-mtp's plan of temperatures), a few new tokens each, timed per
generate() call, with torch on the threads train-mtp gives it.

    python scripts/bench_teacher.py -m gemma3-270m [-n 24] [--calls 3] [-t 2]

To compare two trees, run it under each: `PYTHONPATH=/tmp/old python scripts/bench_teacher.py ...`
(it prints which torch_model it imported). A call's time is its prefill (the batch's prompts) plus
n decode steps of the batch (continuations end at the model's end-of-generation tokens, as in
train-mtp, and leave the batch); train-mtp's default text is 1536 continuations of 256 tokens.
"""
from __future__ import annotations

import argparse
import time

import torch

from hybridrt.runtime.loader import load_model
from hybridrt.models.mtp_head import head_target
from hybridrt.train_mtp import torch_model
from hybridrt.train_mtp.prompts import TRAIN_PROMPTS
from hybridrt.train_mtp.train import BF16, MAX_SEQ, prompt_ids, text_plan


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", default="smollm2-135m")
    ap.add_argument("-n", "--n-new", type=int, default=24, help="new tokens per continuation")
    ap.add_argument("--calls", type=int, default=3, help="generate() calls (batches)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--no-stop", action="store_true",
                    help="continuations never end early (train-mtp's end at the model's end-of-generation tokens)")
    args = ap.parse_args()
    m = load_model(args.model, threads=args.threads)
    torch.set_num_threads(args.threads)         # as train-mtp's CLI does after loading
    teacher = torch_model.TorchTeacher(m, head_target(m.arch), MAX_SEQ,
                                       dtype=torch.bfloat16 if BF16 else torch.float32)
    b = teacher.batch_size()
    n = b * args.calls
    ids = [prompt_ids(m, TRAIN_PROMPTS[i % len(TRAIN_PROMPTS)]) for i in range(n)]
    temps, greedy_after = text_plan(n, len(TRAIN_PROMPTS), 256, 0)
    gen = torch.Generator().manual_seed(0)
    print(f"{args.model}: {torch_model.__file__}, batches of {b}, {args.n_new} new tokens, "
          f"{'bfloat16' if BF16 else 'float32'} matrices, {args.threads} threads")
    stop = set() if args.no_stop else set(m.tokenizer.eog_ids)
    total, written = 0.0, 0
    for lo in range(0, n, b):
        t0 = time.perf_counter()
        out = teacher.generate(ids[lo:lo + b], args.n_new, temps[lo:lo + b], gen, stop, greedy_after[lo:lo + b])
        dt = time.perf_counter() - t0
        total += dt
        written += sum(len(c) for c, _ in out)
        print(f"  call {lo // b}: {dt:.1f} s, {sum(len(c) for c, _ in out)} tokens")
    print(f"  total {total:.1f} s, {written} tokens written ({written / (n * args.n_new):.0%} of the slots), "
          f"{written / total:.0f} tokens/s")


if __name__ == "__main__":
    main()
