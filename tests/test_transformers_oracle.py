"""hybridrt against Hugging Face transformers on the same dequantized weights (marker ``oracle``).

transformers 5.x loads a GGUF through gguf-py's dequantize (``from_pretrained(dir, gguf_file=...)``,
undoing the converter's q/k permutation for llama and the +1 of Gemma's norms) into its own torch
LlamaForCausalLM / Gemma3ForCausalLM. Run in float32, that is an independent implementation of
both architectures on exactly the weights hybridrt multiplies by, so the two must agree far more
closely than either does with llama.cpp (8-bit activations): mean KL <= 1e-4 and top-1 >= 99.5 %
over 700+ positions (past Gemma 3's 512-position sliding window).

transformers lives in its own venv (scripts/transformers_oracle_setup.sh) and runs in a
subprocess; the tests skip without it. Run: ``pytest -m oracle tests/test_transformers_oracle.py -s``.
"""
from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest

from hybridrt.loader import load_model
from real_models import GEMMA3, SMOLLM2, require
from test_oracle_models import MIN_POSITIONS, TEXT, kl_rows, top1

pytestmark = pytest.mark.oracle

TRANSFORMERS_PYTHON = Path(os.environ.get(
    "HYBRIDRT_TRANSFORMERS_PYTHON",
    Path(os.environ.get("HYBRIDRT_CACHE", Path.home() / ".cache/hybridrt")) / "transformers-venv/bin/python"))

_SCRIPT = """
import json, os, sys
import numpy as np
import torch
from transformers import AutoModelForCausalLM
req = json.load(open(sys.argv[1]))
torch.set_num_threads(req["threads"])
path = req["model"]
model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                             dtype=torch.float32, attn_implementation="eager")
model.eval()
with torch.no_grad():
    logits = model(torch.tensor([req["tokens"]])).logits[0]
np.save(req["out"], logits.float().numpy())
"""


def transformers_logits(model_path: Path, tokens: list[int], threads: int = 2,
                        timeout: float = 1200) -> np.ndarray:
    """Teacher-forced float32 logits [len(tokens), n_vocab] from transformers."""
    if not TRANSFORMERS_PYTHON.exists():
        pytest.skip(f"transformers oracle venv missing ({TRANSFORMERS_PYTHON}); "
                    f"run scripts/transformers_oracle_setup.sh")
    with tempfile.TemporaryDirectory() as tmp:
        req, out = Path(tmp) / "request.json", Path(tmp) / "logits.npy"
        req.write_text(json.dumps({"model": str(model_path), "tokens": [int(t) for t in tokens],
                                   "threads": threads, "out": str(out)}))
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1")
        proc = subprocess.run([str(TRANSFORMERS_PYTHON), "-c", _SCRIPT, str(req)],
                              capture_output=True, text=True, timeout=timeout, env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"transformers failed on {model_path}:\n{proc.stderr[-4000:]}")
        return np.load(out)


@pytest.mark.parametrize("path", [SMOLLM2, GEMMA3], ids=["smollm2-q4_1", "gemma3-q4_k_m"])
def test_real_model_logits_match_transformers_fp32(path):
    model = load_model(require(path))
    tokens = model.tokenize(TEXT + "\n" + TEXT)
    assert len(tokens) >= MIN_POSITIONS
    ours = model.session(len(tokens) + 8).eval(tokens).numpy()
    theirs = transformers_logits(path, tokens)
    assert theirs.shape == ours.shape
    kl = kl_rows(theirs, ours)
    agree = top1(ours, theirs)
    print(f"\n{path.name}: {len(tokens)} positions, top-1 agreement {agree:.4f}, "
          f"mean KL(transformers || hybridrt) {kl.mean():.3g} (max {kl.max():.3g}), "
          f"max |logit diff| {np.abs(ours - theirs).max():.3g}")
    assert kl.mean() <= 1e-4
    assert agree >= 0.995
