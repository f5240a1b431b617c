"""Decode speed of llama.cpp (llama-cpp-python) on a GGUF: the baseline hybridrt is compared with.

Run with the oracle venv's Python (scripts/oracle_setup.sh builds it):
    ~/.cache/hybridrt/oracle-venv/bin/python scripts/bench_llamacpp.py MODEL.gguf [-n 128] [-t 2]
Prints one JSON line: prompt and decode tokens/s, greedy, best of --reps.
--pp N: instead time prompt processing of an N-token prompt (the prompt's tokens repeated, BOS
first) in one llama_eval call (n_batch = n_ubatch = N), best of --reps; -n 0 then skips decode.
--depth D: decode after a D-token prompt (the prompt's tokens repeated, as llama-bench's -d), so
tg_tps is the speed at that context depth; the prompt's evaluation is not timed as decode.
--batches 1,2,...,8: instead, after the prompt (or the --depth one), time one llama_decode of a
k-token batch (logits for every token, as a verify step needs) for each k, --reps rounds, then roll
it back to its first token as a verify whose drafts are all rejected: llama_memory_seq_rm. A
recurrent model (qwen35's GDN layers) rolls back only to a snapshot: the context keeps k_max - 1 of
them (n_rs_seq, as llama.cpp's server does for draft-mtp); where seq_rm still refuses (a build
without them), the prompt is evaluated again, untimed, and the batch re-timed at the same position.
batch_s: {k: [seconds per round]}; rollback: seq_rm or reprompt.
Every run also reports load_s (the Llama() construction) and, when it decoded, first_token_s: from
the script's start (started_at, epoch seconds) to the first sampled token.
"""
import argparse
import json
import time

STARTED = time.time()       # before llama_cpp's import: first_token_s counts from here

import llama_cpp.llama_cpp as llama_lib  # noqa: E402
from llama_cpp import Llama  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("model")
parser.add_argument("-p", "--prompt", default="The history of the city of Paris begins")
parser.add_argument("-n", "--n-gen", type=int, default=128)
parser.add_argument("-t", "--threads", type=int, default=2)
parser.add_argument("-r", "--reps", type=int, default=3)
parser.add_argument("--pp", type=int, default=0, help="prompt length in tokens (the prompt repeated)")
parser.add_argument("--depth", type=int, default=0, help="decode after a prompt of this many tokens")
parser.add_argument("--batches", default="", help="comma-separated k: time a k-token batch after the prompt")
args = parser.parse_args()
if args.pp and args.depth:
    parser.error("--pp and --depth are separate runs")
batch_ks = [int(k) for k in args.batches.split(",") if k.strip()]
if batch_ks and (args.pp or min(batch_ks) < 1):
    parser.error("--batches takes k >= 1, and not with --pp")
n_rs_seq = max(batch_ks, default=1) - 1
if n_rs_seq:
    default_params = llama_lib.llama_context_default_params

    def with_snapshots():
        params = default_params()
        if hasattr(params, "n_rs_seq"):     # recurrent-state snapshots for rollback (Llama() takes no such argument)
            params.n_rs_seq = n_rs_seq
        return params
    llama_lib.llama_context_default_params = with_snapshots

n_prompt = args.pp or args.depth
n_batch = max(512, min(n_prompt, 2048))
t_load = time.perf_counter()
llm = Llama(args.model, n_ctx=max(1024, n_prompt + args.n_gen + 8 + (args.reps + 2) * sum(batch_ks)),
            n_batch=n_batch, n_ubatch=n_batch, n_threads=args.threads, n_threads_batch=args.threads, verbose=False)
load_s = time.perf_counter() - t_load
tokens = llm.tokenize(args.prompt.encode(), add_bos=True)
if n_prompt:
    body = llm.tokenize((" " + args.prompt).encode(), add_bos=False)
    tokens = (tokens + body * (n_prompt // len(body) + 1))[:n_prompt]


def time_batch(k: int, token: int) -> tuple[float, bool]:
    """Seconds of one llama_decode of k tokens at the context's end, then rolled back to its first
    token; False where the rollback was refused (the context then holds the prompt again)."""
    pos = llm.n_tokens
    llm._batch.set_batch([token] * k, n_past=pos, logits_all=True)
    t0 = time.perf_counter()
    llm._ctx.decode(llm._batch)
    took = time.perf_counter() - t0
    if llm._ctx.kv_cache_seq_rm(0, pos + 1, -1):
        llm.input_ids[pos] = token
        llm.n_tokens = pos + 1
        return took, True
    llm.reset()
    llm.eval(tokens)
    return took, False


if batch_ks:
    token = min(1000, llm.n_vocab() // 4)       # the token hybridrt's warmup.verify_costs repeats
    llm.reset()
    llm.eval(tokens)
    rolled = time_batch(max(batch_ks), token)[1]        # warm-up: the largest batch's first decode
    batch_s: dict[int, list[float]] = {k: [] for k in batch_ks}
    for _ in range(args.reps):      # rounds of every k, so that all see the same load
        for k in batch_ks:
            took, ok = time_batch(k, token)
            batch_s[k].append(took)
            rolled &= ok
    print(json.dumps({"engine": "llama.cpp", "model": args.model, "threads": args.threads, "n_prompt": len(tokens),
                      "batch_s": batch_s, "rollback": "seq_rm" if rolled else "reprompt",
                      "n_rs_seq": llama_lib.llama_n_rs_seq(llm._ctx.ctx) if hasattr(llama_lib, "llama_n_rs_seq") else 0,
                      "load_s": load_s, "started_at": STARTED}))
    raise SystemExit(0)
best_pp = best_tg = 0.0
first_token_s = None
for _ in range(args.reps):
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(tokens)
    t1 = time.perf_counter()
    n = 0
    while n < args.n_gen:
        tok = llm.sample(temp=0.0)
        if first_token_s is None:
            first_token_s = time.time() - STARTED
        llm.eval([tok])
        n += 1
    t2 = time.perf_counter()
    best_pp = max(best_pp, len(tokens) / (t1 - t0))
    best_tg = max(best_tg, n / (t2 - t1))
print(json.dumps({"engine": "llama.cpp", "model": args.model, "threads": args.threads,
                  "n_prompt": len(tokens), "n_gen": args.n_gen, "pp_tps": best_pp, "tg_tps": best_tg,
                  "load_s": load_s, "first_token_s": first_token_s, "started_at": STARTED}))
