#!/usr/bin/env python3
"""Variants of `train-mtp`'s training steps on a text it already wrote: held-out acceptance per variant.

Reads the text and hiddens a `train-mtp` run cached next to its head (HEAD.gguf.data.pt), builds the
head as train-mtp does (hybridrt.train_mtp.train), and trains it for --steps with one thing changed:
the loss (KL to the target's logits over the draft vocabulary, or cross-entropy to their argmax),
an EAGLE-style regression of the target's next final-normed hidden added to it (--reg, smooth L1),
the draft vocabulary's size, the head's FFN width (--head-ffn-layers), the learning rate or the
batch. Prints the held-out acceptance (per position, and as a run at --spec-draft-n-max 1 meets it)
every --eval steps, and how much of the held-out argmax tokens the draft vocabulary covers.
Evaluations do not stop the run early, and the batches are train-mtp's own at --seed 0
(train.step_batch) for every variant, so variants differ only in what was changed.

    python3 scripts/ablate_mtp_head.py -m smollm2-135m --data ~/.cache/hybridrt/heads/smollm2-135m.v4.mtp.gguf.data.pt \\
        --steps 600 --loss argmax
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybridrt.loader import load_model  # noqa: E402
from hybridrt.train_mtp import train as T  # noqa: E402
from hybridrt.train_mtp.config import LOSSES, TrainConfig  # noqa: E402


def coverage(heldout, ids: torch.Tensor | None, n_vocab: int) -> float:
    """Share of the held-out positions whose target argmax is in the draft vocabulary."""
    if ids is None:
        return 1.0
    inside = torch.zeros(n_vocab, dtype=torch.bool)
    inside[ids] = True
    hits = sum(int(inside[s.argmax[s.n_prompt:]].sum()) for s in heldout)
    return hits / max(1, sum(len(s.tokens) - s.n_prompt for s in heldout))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--data", required=True, help="a train-mtp text cache (HEAD.gguf.data.pt)")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--loss", choices=LOSSES, default="kl")
    ap.add_argument("--reg", type=float, default=0.0, help="weight of the next-hidden regression (0: none)")
    ap.add_argument("--draft-vocab", type=int, default=TrainConfig.draft_vocab)
    ap.add_argument("--lr", type=float, default=TrainConfig.lr)
    ap.add_argument("--batch", type=int, default=TrainConfig.batch)
    ap.add_argument("--head-ffn-layers", type=int, default=TrainConfig.head_ffn_layers,
                    help="the head's FFN as the target's last N layers' FFNs side by side")
    ap.add_argument("--eval", type=int, default=100, help="steps between held-out evaluations")
    ap.add_argument("-t", "--threads", type=int, default=2)
    args = ap.parse_args()

    m = load_model(args.model, threads=args.threads)
    torch.set_num_threads(args.threads)         # after loading, which leaves torch one thread beside Numba's
    data = torch.load(args.data, weights_only=False)
    train, heldout = data["train"], data["heldout"]
    cfg = TrainConfig(steps=args.steps, draft_vocab=args.draft_vocab, loss=args.loss, lr=args.lr, batch=args.batch,
                      head_ffn_layers=args.head_ffn_layers)
    torch.manual_seed(cfg.seed)
    head, ids, w_draft, _ = T.new_head(m, train, cfg)
    print(json.dumps({"variant": vars(args), "train_tokens": sum(len(s.tokens) - s.n_prompt for s in train),
                      "heldout_coverage": round(coverage(heldout, ids, m.n_vocab), 4)}), flush=True)
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=0.0)
    t0 = time.perf_counter()
    for step in range(cfg.steps):
        for group in opt.param_groups:
            group["lr"] = T.lr_at(step, cfg)
        batch = T.step_batch(m, train, cfg, step)
        features, logits, target = T.head_outputs(head, w_draft, batch, T.BF16)
        valid, h_tgt = batch[-1], batch[2]
        loss = T.distill_loss(logits, target, cfg.loss).mean()      # at the real entries only
        if args.reg:
            loss = loss + args.reg * F.smooth_l1_loss(features.float()[valid], h_tgt[valid])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if (step + 1) % args.eval == 0 or step + 1 == cfg.steps:
            acc = T.heldout_acceptance(m, head, heldout, ids)
            print(json.dumps({"step": step + 1, "loss": round(float(loss.detach()), 4),
                              "acceptance": round(acc.per_position, 4), "acceptance_n_max_1": round(acc.n_max_1, 4),
                              "s": round(time.perf_counter() - t0)}), flush=True)


if __name__ == "__main__":
    main()
