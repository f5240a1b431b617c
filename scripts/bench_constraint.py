"""Time per constraint mask on the real vocabularies (SmolLM2's 49,152 tokens, Gemma 3's 262,144)
under a JSON schema, along a valid document: what a constrained step adds to decoding.

Each position of the document's tokens is one state. For each: the mask (llguidance's bits, computed
fresh, turned into a logits bias: Constraint.bias), masking a logits row with it (Constraint.apply),
and consuming the token. A plain step pays one of each; a speculative step with k drafts pays k + 1
masks in a row (the drafts' during drafting, the last row's after the verify), one after the other,
so `k+1 masks` below is what a verify of k drafts adds to the step.

With --decode, whole generations instead (issue 58's speed targets): a prompt the models continue
with JSON records, decoded greedily to the same number of tokens four ways, alternating: plain and
speculative (n-gram lookup drafts), each free and held to a grammar of such records. The four give
the same tokens (`same_tokens`), so the ways differ only by the constraint's work. Reported:
constrained decode t/s over free, and each one's speculative speedup over its plain decoding (the
target: the constrained speedup within 10 % of the free one).

    python scripts/bench_constraint.py [--models smollm2-135m gemma3-270m] [--repeat 3]
    python scripts/bench_constraint.py --decode [-n 160] [-t 2] [--repeat 3]
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


# --decode: a raw prompt both models continue with JSON records, and a grammar of exactly such a
# continuation; greedy free and constrained decoding then give the same tokens (checked), so the
# two ways do the same steps and differ only by the constraint's work
DECODE_PROMPT = ('Famous scientists as JSON: [{"name": "Ada Lovelace", "year": 1815, "field": "mathematics"}, '
                 '{"name": "Alan Turing", "year": 1912, "field": "computing"},')
RECORD = {"type": "object", "properties": {"name": {"type": "string"}, "year": {"type": "integer"},
                                          "field": {"type": "string"}},
          "required": ["name", "year", "field"], "additionalProperties": False}
DECODE_GRAMMAR = f'start: item+\nitem: " " %json {json.dumps(RECORD)} ","\n'


def bench_decode(name: str, n: int, repeat: int, n_max: int) -> dict:
    """decode t/s of the four ways (free / constrained, plain / n-gram speculation), medians over
    `repeat` alternating rounds, and the ratios the targets are about."""
    from hybridrt.decoding.generate import generate
    from hybridrt.decoding.sampling import SamplerConfig
    from hybridrt.decoding.speculative.loop import SpecConfig
    from hybridrt.decoding.speculative.sources import build_source
    from hybridrt.runtime.loader import load_model

    model = load_model(model_path(name))
    ids = model.tokenize(DECODE_PROMPT, add_special=True)
    grammar = Grammar("grammar", DECODE_GRAMMAR)
    sampler, spec = SamplerConfig(temp=0.0), SpecConfig(n_max=n_max)
    ways = {(c, s): [] for s in ("plain", "ngram") for c in ("free", "constrained")}
    tokens_per_step, outputs = {}, {}
    for _ in range(repeat + 1):                     # the first round warms the kernels and the tries
        for (c, s), runs in ways.items():
            session = model.session(len(ids) + n + 8, k_max=spec.k_max)
            source = build_source("ngram-simple", session, sampler, spec) if s == "ngram" else None
            constraint = Constraint(grammar, model.tokenizer, model.n_vocab) if c == "constrained" else None
            out, stats = generate(model, session, ids, n, sampler, source, spec if source else None,
                                  stop_ids=set(), constraint=constraint)
            outputs[c, s] = out
            runs.append(stats.decode_tps)
            if stats.spec is not None:
                tokens_per_step[c] = round(stats.spec.tokens_per_step, 2)
    tps = {f"{c}_{s}": round(statistics.median(r[1:]), 2) for (c, s), r in ways.items()}
    free_speedup = tps["free_ngram"] / tps["free_plain"]
    constrained_speedup = tps["constrained_ngram"] / tps["constrained_plain"]
    same = len({tuple(o) for o in outputs.values()}) == 1 and len(outputs["free", "plain"]) == n
    return {"model": name, "tokens": n, "n_max": n_max, "same_tokens": same, "tps": tps,
            "tokens_per_step": tokens_per_step,
            "constrained_over_free": round(tps["constrained_plain"] / tps["free_plain"], 3),
            "free_speedup": round(free_speedup, 3), "constrained_speedup": round(constrained_speedup, 3),
            "speedup_ratio": round(constrained_speedup / free_speedup, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--decode", action="store_true", help="time whole generations, free against constrained")
    ap.add_argument("-n", type=int, default=160, help="--decode: tokens per generation")
    ap.add_argument("-t", "--threads", type=int, default=2, help="--decode: CPU threads")
    ap.add_argument("--spec-draft-n-max", type=int, default=4, help="--decode: most n-gram drafts a step")
    args = ap.parse_args()
    if args.decode:
        import numba

        numba.set_num_threads(args.threads)
        torch.set_num_threads(args.threads)
        for name in args.models:
            r = bench_decode(name, args.n, args.repeat, args.spec_draft_n_max)
            t = r["tps"]
            print(f"{name:14s} t/s free {t['free_plain']} / constrained {t['constrained_plain']} "
                  f"(x{r['constrained_over_free']}); n-gram speedup free x{r['free_speedup']}, "
                  f"constrained x{r['constrained_speedup']} (ratio {r['speedup_ratio']}); "
                  f"tokens a step {r['tokens_per_step']}; same tokens: {r['same_tokens']}")
            print(json.dumps(r))
        return
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
