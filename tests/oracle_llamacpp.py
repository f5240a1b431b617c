"""Run llama.cpp (the llama-cpp-python build in the oracle venv) in a subprocess.

The oracle venv has its own numpy and libllama; a subprocess keeps them out of the test process.
Every helper calls ``pytest.skip`` when the venv is missing, so oracle tests skip cleanly.

    from oracle_llamacpp import llamacpp_logits, llamacpp_tokenize   # tests/ is on sys.path

``llamacpp_logits`` evaluates the tokens teacher-forced in one ``eval`` (logits for every
position); ``llamacpp_tokenize`` is llama.cpp's tokenizer on the file's vocabulary.

A broken oracle fails with one line, not a crash dump: before the first logits request on a model,
a 2-token batch runs in its own subprocess (a llama-cpp-python built with ggml's AMX path dies
there with SIGSEGV on AMX Xeons); if it dies, every oracle test on that model fails saying so and
how to rebuild. A failing request reports its signal or exit code and the last stderr line.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest

ORACLE_PYTHON = Path(os.environ.get("HYBRIDRT_ORACLE_PYTHON",
                                    "/root/.cache/hybridrt/oracle-venv/bin/python"))

_LOGITS_SCRIPT = """
import json, sys
import numpy as np
from llama_cpp import Llama
req = json.load(open(sys.argv[1]))
tokens = req["tokens"]
llm = Llama(model_path=req["model"], logits_all=True, n_ctx=max(64, len(tokens) + 8),
            n_batch=max(64, len(tokens)), n_ubatch=max(64, len(tokens)),
            n_threads=req["threads"], verbose=False)
llm.eval(tokens)
np.save(req["out"], np.asarray(llm.scores[: len(tokens)], dtype=np.float32))
"""

_TOKENIZE_SCRIPT = """
import json, sys
from llama_cpp import Llama
req = json.load(open(sys.argv[1]))
llm = Llama(model_path=req["model"], vocab_only=True, verbose=False)
ids = llm.tokenize(req["text"].encode("utf-8"), add_bos=req["add_special"],
                   special=req["parse_special"])
json.dump([int(i) for i in ids], open(req["out"], "w"))
"""


REBUILD_HINT = "rebuild it: bash scripts/oracle_setup.sh (GGML_NATIVE=OFF, AMX off, SIMD flags from /proc/cpuinfo)"

_health: dict[str, str | None] = {}      # model path -> None (a 2-token batch ran) or why not


def oracle_available() -> bool:
    return ORACLE_PYTHON.exists()


def _how_it_ended(proc: subprocess.CompletedProcess) -> str:
    if proc.returncode < 0:
        try:
            how = f"died with {signal.Signals(-proc.returncode).name}"
        except ValueError:
            how = f"died with signal {-proc.returncode}"
    else:
        how = f"exited with code {proc.returncode}"
    last = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    return how + (f" ({last[-1].strip()[:300]})" if last else "")


def _run(script: str, request: dict, timeout: float) -> None:
    if not oracle_available():
        pytest.skip(f"llama.cpp oracle venv missing ({ORACLE_PYTHON})")
    with tempfile.TemporaryDirectory() as tmp:
        req_path = Path(tmp) / "request.json"
        req_path.write_text(json.dumps(request))
        env = dict(os.environ, OMP_NUM_THREADS="2")
        proc = subprocess.run([str(ORACLE_PYTHON), "-c", script, str(req_path)],
                              capture_output=True, text=True, timeout=timeout, env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"llama.cpp oracle {_how_it_ended(proc)} on {request['model']}")


def oracle_health(model_path: str | Path, timeout: float = 300) -> str | None:
    """None when llama.cpp evaluates a 2-token batch of `model_path`, else one line saying why not
    (checked once per model per process)."""
    key = str(model_path)
    if key not in _health:
        with tempfile.TemporaryDirectory() as tmp:
            try:
                _run(_LOGITS_SCRIPT, {"model": key, "tokens": [1, 2], "threads": 2,
                                      "out": str(Path(tmp) / "probe.npy")}, timeout)
                _health[key] = None
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                _health[key] = f"{e}".splitlines()[0] if not isinstance(e, subprocess.TimeoutExpired) \
                    else f"llama.cpp oracle hung on a 2-token batch of {key} (> {timeout:.0f} s)"
    return _health[key]


def require_healthy_oracle(model_path: str | Path) -> None:
    """Fail the calling test with one line when the oracle cannot run a 2-token batch."""
    why = oracle_health(model_path)
    if why is not None:
        pytest.fail(f"llama.cpp oracle is broken: a 2-token batch {why.removeprefix('llama.cpp oracle ')}; "
                    f"{REBUILD_HINT}", pytrace=False)


def llamacpp_logits(model_path: str | Path, tokens, threads: int = 2,
                    timeout: float = 600) -> np.ndarray:
    """Teacher-forced logits [len(tokens), n_vocab] (float32) from llama.cpp."""
    tokens = [int(t) for t in tokens]
    require_healthy_oracle(model_path)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "logits.npy"
        _run(_LOGITS_SCRIPT, {"model": str(model_path), "tokens": tokens, "threads": threads,
                              "out": str(out)}, timeout)
        return np.load(out)


def llamacpp_tokenize(model_path: str | Path, text: str, add_special: bool = False,
                      parse_special: bool = False, timeout: float = 300) -> list[int]:
    """llama.cpp's token ids for ``text`` (``add_special`` adds BOS where the vocab asks for it)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ids.json"
        _run(_TOKENIZE_SCRIPT, {"model": str(model_path), "text": text,
                                "add_special": add_special, "parse_special": parse_special,
                                "out": str(out)}, timeout)
        return json.loads(out.read_text())
