#!/usr/bin/env python3
"""Prompt lookup against a trained MTP head on train-mtp's held-out text, per position.

At each generated held-out position j (the target's own greedy text, as `train-mtp` evaluates on
it) the head drafts t_(j+1) from t_j and h_(j-1), and prompt lookup (`ngram-simple`: the longest
n-gram, n_max down to n_min, ending at t_j that occurred before, proposing what followed it) may
propose one too. Prints how often the lookup has a match, how often it is right there, how often the
head is right at the same positions, and the per-position acceptance of lookup first, head
elsewhere (`--spec-type ngram-simple,draft-mtp`) next to the head alone.

    python3 scripts/lookup_vs_head.py -m smollm2-135m --head HEAD.gguf [--first 64] [--ngram 4,2 4,3]

The head is read from train-mtp's checkpoint beside it (HEAD.gguf.ckpt, its best evaluation) and
the text from HEAD.gguf.data.pt.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybridrt.runtime.loader import load_model  # noqa: E402
from hybridrt.train_mtp import train as T  # noqa: E402
from hybridrt.train_mtp.config import TrainConfig  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--head", required=True, help="a train-mtp output (HEAD.gguf; its .ckpt and .data.pt are read)")
    ap.add_argument("--first", type=int, default=0, help="only the first N generated positions of each prompt (0: all)")
    ap.add_argument("--ngram", nargs="+", default=["4,2"], help="n_max,n_min of each lookup to compare")
    ap.add_argument("--draft-vocab", type=int, default=TrainConfig.draft_vocab, help="as the head was trained")
    ap.add_argument("-t", "--threads", type=int, default=2)
    args = ap.parse_args()

    m = load_model(args.model, threads=args.threads)
    torch.set_num_threads(args.threads)
    data = torch.load(f"{args.head}.data.pt", weights_only=False)
    head, ids, _, _ = T.new_head(m, data["train"], TrainConfig(draft_vocab=args.draft_vocab))
    head.load_state_dict(torch.load(f"{args.head}.ckpt", weights_only=False)["best"])
    sizes = [tuple(int(x) for x in s.split(",")) for s in args.ngram]
    head_hits, lookups = [], {s: [] for s in sizes}       # per position: head right; (proposes, right)
    with torch.no_grad():
        for s in data["heldout"]:
            emb, h_in, _, pos, valid = T.batch_inputs(m, [s])
            draft = head(emb, h_in, pos, valid)[0].argmax(-1)
            draft = ids[draft] if ids is not None else draft
            toks = s.tokens.tolist()
            first = max(s.n_prompt, 1)
            last = len(toks) if not args.first else min(len(toks), s.n_prompt + args.first)
            targets = s.argmax[first:last].tolist()
            head_hits += (draft[first - 1:last - 1] == s.argmax[first:last]).tolist()
            for n in sizes:
                proposals = T.lookup_proposals(toks[:last], first, *n)
                lookups[n] += [(p is not None, p == t) for p, t in zip(proposals, targets)]
    total = len(head_hits)
    print(f"{Path(args.model).stem}: {total} held-out positions; the head alone right at {sum(head_hits) / total:.1%}")
    for n, rows in lookups.items():
        where = [i for i, (has, _) in enumerate(rows) if has]
        right = sum(rows[i][1] for i in where)
        head_there = sum(head_hits[i] for i in where)
        first = sum(rows[i][1] if rows[i][0] else head_hits[i] for i in range(total))
        print(f"lookup n {n[0]}..{n[1]}: a match at {len(where) / total:.1%} of positions, right at "
              f"{right / max(1, len(where)):.1%} of those (the head: {head_there / max(1, len(where)):.1%}); "
              f"lookup first, head elsewhere: {first / total:.1%}")


if __name__ == "__main__":
    main()
