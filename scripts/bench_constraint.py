"""Time per constraint mask on the real vocabularies (SmolLM2's 49,152 tokens, Gemma 3's 262,144)
under a JSON schema, along a valid document: what a constrained step adds to decoding.

Each position of the document's tokens is one state. For each: the mask (llguidance's bits, computed
fresh, turned into a logits bias: Constraint.bias), masking a logits row with it (Constraint.apply),
and consuming the token. A plain step pays one of each; a speculative step with k drafts pays k + 1
masks in a row (the drafts' during drafting, the last row's after the verify), one after the other,
so `k+1 masks` below is what a verify of k drafts adds to the step.

    python scripts/bench_constraint.py [--models smollm2-135m gemma3-270m] [--repeat 3]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from hybridrt.decoding.constraint import Constraint, Grammar, ll_tokenizer
from hybridrt.files.gguf_file import GGUFFile
from hybridrt.files.registry import model_path
from hybridrt.files.tokenizer import Tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z0-9]+\\.[a-z]{2,4}$"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 8},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city"], "additionalProperties": False},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "tags", "address", "active"],
    "additionalProperties": False,
}
DOCUMENT = {"name": "Ada Lovelace", "age": 36, "email": "ada.lovelace@analytical.org",
            "tags": ["mathematics", "poetry", "engines", "notes"],
            "address": {"city": "London", "zip": "W1"}, "active": True}


def bench(name: str, repeat: int) -> dict:
    tok = Tokenizer.from_gguf(GGUFFile(model_path(name)).metadata)
    t0 = time.perf_counter()
    ll_tokenizer(tok, tok.n_vocab)
    build_s = time.perf_counter() - t0
    grammar = Grammar("json_schema", json.dumps(SCHEMA))
    ids = tok.encode(json.dumps(DOCUMENT), add_special=False)
    row = torch.randn(tok.n_vocab)
    mask_us, apply_us, consume_us = [], [], []
    for _ in range(repeat):
        c = Constraint(grammar, tok, tok.n_vocab)
        for t in ids:
            logits = row.clone()
            t0 = time.perf_counter()
            c.bias()
            t1 = time.perf_counter()
            c.apply(logits)
            t2 = time.perf_counter()
            c.advance(t)
            t3 = time.perf_counter()
            mask_us.append((t1 - t0) * 1e6)
            apply_us.append((t2 - t1) * 1e6)
            consume_us.append((t3 - t2) * 1e6)
        assert c.finished(c.depth), "the document should complete the schema"
    per_token = statistics.mean(mask_us) + statistics.mean(apply_us) + statistics.mean(consume_us)
    return {"model": name, "n_vocab": tok.n_vocab, "tokens": len(ids), "tokenizer_build_s": round(build_s, 3),
            "mask_us_median": round(statistics.median(mask_us)), "mask_us_mean": round(statistics.mean(mask_us)),
            "mask_us_p90": round(sorted(mask_us)[int(0.9 * len(mask_us))]),
            "apply_us_mean": round(statistics.mean(apply_us)), "consume_us_mean": round(statistics.mean(consume_us)),
            "per_token_us": round(per_token), "verify_k3_us": round(4 * per_token)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    for name in args.models:
        r = bench(name, args.repeat)
        print(f"{r['model']:14s} vocab {r['n_vocab']:7d}  {r['tokens']} tokens  trie build {r['tokenizer_build_s']} s  "
              f"mask {r['mask_us_median']} us median / {r['mask_us_mean']} mean / {r['mask_us_p90']} p90  "
              f"apply {r['apply_us_mean']} us  consume {r['consume_us_mean']} us  "
              f"=> {r['per_token_us']} us a token, {r['verify_k3_us']} us for a verify of 3 drafts")
        print(json.dumps(r))


if __name__ == "__main__":
    main()
