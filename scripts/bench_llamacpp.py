"""Decode speed of llama.cpp (llama-cpp-python) on a GGUF: the baseline hybridrt is compared with.

Run with the oracle venv's Python (scripts/oracle_setup.sh builds it):
    ~/.cache/hybridrt/oracle-venv/bin/python scripts/bench_llamacpp.py MODEL.gguf [-n 128] [-t 2]
Prints one JSON line: prompt and decode tokens/s, greedy, best of --reps.
--pp N: instead time prompt processing of an N-token prompt (the prompt's tokens repeated, BOS
first) in one llama_eval call (n_batch = n_ubatch = N), best of --reps; -n 0 then skips decode.
--depth D: decode after a D-token prompt (the prompt's tokens repeated, as llama-bench's -d), so
tg_tps is the speed at that context depth; the prompt's evaluation is not timed as decode.
"""
import argparse
import json
import time

from llama_cpp import Llama

parser = argparse.ArgumentParser()
parser.add_argument("model")
parser.add_argument("-p", "--prompt", default="The history of the city of Paris begins")
parser.add_argument("-n", "--n-gen", type=int, default=128)
parser.add_argument("-t", "--threads", type=int, default=2)
parser.add_argument("-r", "--reps", type=int, default=3)
parser.add_argument("--pp", type=int, default=0, help="prompt length in tokens (the prompt repeated)")
parser.add_argument("--depth", type=int, default=0, help="decode after a prompt of this many tokens")
args = parser.parse_args()
if args.pp and args.depth:
    parser.error("--pp and --depth are separate runs")

n_prompt = args.pp or args.depth
n_batch = max(512, min(n_prompt, 2048))
llm = Llama(args.model, n_ctx=max(1024, n_prompt + args.n_gen + 8), n_batch=n_batch, n_ubatch=n_batch,
            n_threads=args.threads, n_threads_batch=args.threads, verbose=False)
tokens = llm.tokenize(args.prompt.encode(), add_bos=True)
if n_prompt:
    body = llm.tokenize((" " + args.prompt).encode(), add_bos=False)
    tokens = (tokens + body * (n_prompt // len(body) + 1))[:n_prompt]
best_pp = best_tg = 0.0
for _ in range(args.reps):
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(tokens)
    t1 = time.perf_counter()
    n = 0
    while n < args.n_gen:
        tok = llm.sample(temp=0.0)
        llm.eval([tok])
        n += 1
    t2 = time.perf_counter()
    best_pp = max(best_pp, len(tokens) / (t1 - t0))
    best_tg = max(best_tg, n / (t2 - t1))
print(json.dumps({"engine": "llama.cpp", "model": args.model, "threads": args.threads,
                  "n_prompt": len(tokens), "n_gen": args.n_gen, "pp_tps": best_pp, "tg_tps": best_tg}))
