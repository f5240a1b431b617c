"""hybridrt against Hugging Face transformers on the same dequantized weights (marker ``oracle``).

transformers 5.x loads a GGUF through gguf-py's dequantize (``from_pretrained(dir, gguf_file=...)``,
undoing the converter's q/k permutation for llama and the +1 of Gemma's norms) into its own torch
LlamaForCausalLM / Gemma3ForCausalLM. Run in float32, that is an independent implementation of
both architectures on exactly the weights hybridrt multiplies by, so the two must agree far more
closely than either does with llama.cpp (8-bit activations): mean KL <= 1e-4 and top-1 >= 99.5 %
over 700+ positions (past Gemma 3's 512-position sliding window) on the exact float32-activation
path. Prompt batches on the default int8-activation path carry the activation rounding llama.cpp
carries, so they are held to llama.cpp's own distance from transformers on the same tokens (within
25 % in KL, 1 point in top-1; ~2e-3 and ~3e-3 mean KL for these two models, BENCHMARKS.md); decode
and verify steps, which take a second int8 pass on attention and FFN-down inputs, to mean KL <= 1e-3.

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

from hybridrt.runtime.loader import load_model
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
    """The exact path (float32 activations) is transformers' float32 forward up to rounding order.
    The default path in decode / verify batches (the second int8 pass on attention and FFN-down
    inputs) is within issue 11's mean KL <= 1e-3 of it, and agrees with it on top-1 at least as
    often as llama.cpp does; as one prompt batch (one int8 pass, llama.cpp's numerics) it is as far
    from it as llama.cpp itself is (same activation scales, issue 11 item 4). All measured on the
    same tokens in the same run."""
    tokens = load_model(require(path)).tokenize(TEXT + "\n" + TEXT)
    assert len(tokens) >= MIN_POSITIONS
    theirs = transformers_logits(path, tokens)

    def compare(how: str, exact: bool, steps: int = 0, prompt: int = 0) -> tuple[float, float]:
        """steps: evaluate in batches of this many tokens (0: one batch) after a prompt batch of
        `prompt` tokens; KL and top-1 over the positions past the prompt."""
        session = load_model(path, exact_activations=exact).session(len(tokens) + 8)
        parts = [session.eval(tokens[:prompt]).numpy()] if prompt else []
        step = steps or len(tokens)
        parts += [session.eval(tokens[i:i + step]).numpy() for i in range(prompt, len(tokens), step)]
        ours = np.concatenate(parts)[prompt:]
        assert theirs[prompt:].shape == ours.shape
        kl = kl_rows(theirs[prompt:], ours)
        print(f"\n{path.name} ({how}): {len(ours)} positions, top-1 agreement {top1(ours, theirs[prompt:]):.4f}, "
              f"mean KL(transformers || hybridrt) {kl.mean():.3g} (max {kl.max():.3g}), "
              f"max |logit diff| {np.abs(ours - theirs[prompt:]).max():.3g}")
        return float(kl.mean()), top1(ours, theirs[prompt:])

    kl_exact, agree_exact = compare("float32 activations", True)
    assert kl_exact <= 1e-4 and agree_exact >= 0.995
    kl_steps, agree_steps = compare("int8 + residual pass, 8-token steps", False, steps=8)
    assert kl_steps <= 1e-3
    # generated tokens after a long prompt: the prompt's cache rows come from one pass
    compare("a 384-token prompt, then 8-token steps", False, steps=8, prompt=384)
    kl_int8, agree_int8 = compare("int8, one prompt batch", False)
    from oracle_llamacpp import llamacpp_logits, oracle_available
    if not oracle_available():
        pytest.skip("llama.cpp oracle missing: the int8 path has no yardstick (bash scripts/oracle_setup.sh)")
    lc = llamacpp_logits(path, tokens)
    kl_lc, agree_lc = float(kl_rows(theirs, lc).mean()), top1(lc, theirs)
    print(f"{path.name} (llama.cpp): top-1 agreement {agree_lc:.4f}, mean KL(transformers || llama.cpp) {kl_lc:.3g}")
    assert kl_int8 <= 1.25 * kl_lc and agree_int8 >= agree_lc - 0.01
    assert agree_steps >= agree_lc
