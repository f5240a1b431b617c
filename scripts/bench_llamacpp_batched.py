"""llama.cpp's batched decode of N sequences: the anchor of scripts/bench_serve.py.

Run with the oracle venv's Python (scripts/oracle_setup.sh builds it); bench_serve.py starts it:
    ~/.cache/hybridrt/oracle-venv/bin/python scripts/bench_llamacpp_batched.py MODEL.gguf -t 2 --n-seq-max 8 --n-ctx 512
It loads the model once through llama-cpp-python's low-level API, prints {"ready": ...} and then
answers one JSON request per stdin line, {"prompts": [N strings], "n_gen": T}, with one JSON line:

  * the N prompts (each tokenized as llama-server does a completion's: BOS added, no special
    parsing) are evaluated in one llama_decode, sequence i with seq id i, logits at each prompt's
    last token; each sequence's first token is its argmax (greedy), as a server's first token;
  * then T - 1 steps of one llama_decode for all N sequences together (one token each, at its own
    position), argmax of each row: llama-batched-bench's text generation, end-of-generation tokens
    not stopping anything (a server's ignore_eos);
  * the memory is cleared for the next request.

The answer: n_prompt (tokens per sequence), prompt_s (the prompt batch and the first argmaxes),
step_s (seconds of each decode step, argmaxes included), decode_tps = N (T - 1) / sum(step_s), and
the tokens of each sequence. The KV cache is f16 (llama.cpp's default) and per sequence (kv_unified
off: sequence i attends over its own n_ctx cells, as each of hybridrt's sessions does).
"""
import argparse
import ctypes
import json
import sys
import time

import numpy as np
import llama_cpp as llama


def quiet_logs():
    """llama.cpp logs every load to stderr; the bench's stderr is its progress."""
    @llama.llama_log_callback
    def drop(level, text, user_data):
        pass
    llama.llama_log_set(drop, ctypes.c_void_p(0))
    return drop      # keep the callback alive


class Batched:
    def __init__(self, path: str, threads: int, n_seq_max: int, n_ctx: int, n_batch: int):
        llama.llama_backend_init()
        self.model = llama.llama_model_load_from_file(path.encode(), llama.llama_model_default_params())
        if not self.model:
            raise SystemExit(f"error: llama.cpp could not load {path}")
        self.vocab = llama.llama_model_get_vocab(self.model)
        self.n_vocab = llama.llama_vocab_n_tokens(self.vocab)
        params = llama.llama_context_default_params()
        params.n_ctx, params.n_seq_max, params.kv_unified = n_ctx * n_seq_max, n_seq_max, False
        params.n_batch = params.n_ubatch = n_batch
        params.n_threads = params.n_threads_batch = threads
        self.ctx = llama.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise SystemExit("error: llama.cpp could not make a context")
        self.n_seq_max, self.n_batch = n_seq_max, n_batch
        self.batch = llama.llama_batch_init(n_batch, 0, 1)

    def tokenize(self, text: str) -> list[int]:
        data = text.encode()
        room = len(data) + 8
        ids = (llama.llama_token * room)()
        n = llama.llama_tokenize(self.vocab, data, len(data), ids, room, True, False)
        return list(ids[:n])

    def decode(self, rows: list[tuple[int, int, int, bool]]) -> list[int]:
        """One llama_decode of (token, position, sequence, wants logits) rows; the argmax of each
        row that wanted logits."""
        b = self.batch
        for j, (token, pos, seq, logits) in enumerate(rows):
            b.token[j], b.pos[j], b.n_seq_id[j], b.logits[j] = token, pos, 1, logits
            b.seq_id[j][0] = seq
        b.n_tokens = len(rows)
        if llama.llama_decode(self.ctx, b) != 0:
            raise RuntimeError(f"llama_decode of {len(rows)} tokens failed")
        return [int(np.ctypeslib.as_array(llama.llama_get_logits_ith(self.ctx, j), shape=(self.n_vocab,)).argmax())
                for j, row in enumerate(rows) if row[3]]

    def run(self, prompts: list[str], n_gen: int) -> dict:
        if not 1 <= len(prompts) <= self.n_seq_max:
            raise ValueError(f"{len(prompts)} prompts: 1 .. {self.n_seq_max}")
        ids = [self.tokenize(p) for p in prompts]
        rows = [(t, pos, seq, pos == len(p) - 1) for seq, p in enumerate(ids) for pos, t in enumerate(p)]
        if len(rows) > self.n_batch:
            raise ValueError(f"{len(rows)} prompt tokens exceed the batch of {self.n_batch}")
        llama.llama_memory_clear(llama.llama_get_memory(self.ctx), True)
        t0 = time.perf_counter()
        last = self.decode(rows)
        prompt_s = time.perf_counter() - t0
        out = [[t] for t in last]
        step_s = []
        for step in range(n_gen - 1):
            t0 = time.perf_counter()
            last = self.decode([(last[s], len(ids[s]) + step, s, True) for s in range(len(ids))])
            step_s.append(time.perf_counter() - t0)
            for s, t in enumerate(last):
                out[s].append(t)
        decoded = len(ids) * (n_gen - 1)
        return {"n_seq": len(ids), "n_gen": n_gen, "n_prompt": [len(p) for p in ids], "prompt_s": prompt_s,
                "step_s": step_s, "decode_tps": decoded / sum(step_s) if step_s else None, "tokens": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--n-seq-max", type=int, default=8, help="most sequences of a request")
    ap.add_argument("--n-ctx", type=int, default=512, help="context of each sequence")
    ap.add_argument("--n-batch", type=int, default=2048, help="most prompt tokens of a request, all sequences")
    args = ap.parse_args()
    keep = quiet_logs()
    t0 = time.perf_counter()
    engine = Batched(args.model, args.threads, args.n_seq_max, args.n_ctx, args.n_batch)
    print(json.dumps({"ready": True, "load_s": time.perf_counter() - t0, "llama_cpp": llama.__version__}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        try:
            answer = engine.run(req["prompts"], int(req["n_gen"]))
        except (ValueError, RuntimeError) as exc:
            answer = {"error": str(exc)}
        print(json.dumps(answer), flush=True)
    del keep


if __name__ == "__main__":
    main()
