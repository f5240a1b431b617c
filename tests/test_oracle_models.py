"""hybridrt's teacher-forced logits against llama.cpp (marker ``oracle``).

* The two real models (SmolLM2-135M Q4_1, Gemma 3 270M Q4_K_M) over 700+ positions of varied text:
  top-1 agreement >= 94 % and mean KL(llama.cpp || hybridrt) <= 0.01. What separates the two there
  is llama.cpp quantizing activations to 8 bits for its quantized matmuls; hybridrt keeps float32.
* Tiny qwen35 files (trunk; with and without the MTP block): F32 within 1e-3 of llama.cpp with
  top-1 >= 99 %; q8_0, q4_k_m and iq4_xs mixes within 5e-2. The other tiny archs (llama, qwen3, gemma3,
  qwen3next) are held to the same F32 bound.
* The float64 references of gemma3 and qwen3next (tests/reference) against llama.cpp, F32 1e-3,
  so that test_models_tiny.py's 1e-4 comparisons stand on a checked reference.

Run: ``pytest -m oracle tests/test_oracle_models.py -s`` (needs scripts/oracle_setup.sh); each
test prints its numbers.
"""
from __future__ import annotations

import numpy as np
import pytest

import make_model
from hybridrt.runtime.loader import load_model
from oracle_llamacpp import llamacpp_logits
from real_models import GEMMA3, SMOLLM2, require
from reference import reference_for

pytestmark = pytest.mark.oracle

# Prose, dialogue, code, numbers, a list and a little French and German: 300+ tokens for either
# tokenizer, so the comparison is not one register of text.
TEXT = """The lighthouse keeper wrote in his log every evening, even when nothing happened. On the
night of the storm he noted the wind at forty knots, the barometer falling, and a ship's lights
far to the south that vanished an hour later.

"Do you think they made it to harbour?" his daughter asked.
"I think they turned back," he said. "Sensible captains do."

def moving_average(values, window=3):
    out = []
    for i in range(len(values) - window + 1):
        out.append(sum(values[i:i + window]) / window)
    return out

print(moving_average([1, 4, 9, 16, 25, 36]))   # [4.67, 9.67, 16.67, 25.67]

Shopping list: 2 kg flour, 12 eggs, 500 g butter, 1 litre milk, 3 lemons (unwaxed).
Le petit déjeuner est servi de sept heures à dix heures. Der Zug nach Berlin fährt um 14:35 ab.
In 1969, Apollo 11 landed on the Moon; the mission lasted 8 days, 3 hours and 18 minutes.
Photosynthesis converts light energy into chemical energy stored in glucose, releasing oxygen.
SELECT name, COUNT(*) AS n FROM orders WHERE total > 100 GROUP BY name ORDER BY n DESC;
The recipe says to fold the egg whites gently, so the air stays in and the cake rises evenly.
"""

# The text twice: past Gemma 3's 512-position sliding window and hybridrt's 512-token prompt chunk
MIN_POSITIONS = 600


def softmax_rows(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    e = np.exp(x)
    return e / e.sum(-1, keepdims=True)


def kl_rows(p_logits: np.ndarray, q_logits: np.ndarray, chunk: int = 32) -> np.ndarray:
    """KL(softmax(p) || softmax(q)) per row, float64, a few rows at a time (262k-entry vocab)."""
    out = []
    for lo in range(0, p_logits.shape[0], chunk):
        p = np.asarray(p_logits[lo:lo + chunk], np.float64)
        q = np.asarray(q_logits[lo:lo + chunk], np.float64)
        logp = p - p.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        logq = q - q.max(-1, keepdims=True)
        logq -= np.log(np.exp(logq).sum(-1, keepdims=True))
        out.append((np.exp(logp) * (logp - logq)).sum(-1))
    return np.concatenate(out)


def rel_err(ours: np.ndarray, theirs: np.ndarray) -> float:
    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    return float(np.linalg.norm(ours - theirs) / np.linalg.norm(theirs - theirs.mean(-1, keepdims=True)))


def top1(ours: np.ndarray, theirs: np.ndarray) -> float:
    return float(np.mean(ours.argmax(-1) == theirs.argmax(-1)))


# ------------------------------------------------------------------ real models

@pytest.mark.parametrize("path", [SMOLLM2, GEMMA3], ids=["smollm2-q4_1", "gemma3-q4_k_m"])
def test_real_model_logits_match_llamacpp(path):
    model = load_model(require(path))
    tokens = model.tokenize(TEXT + "\n" + TEXT)
    assert len(tokens) >= MIN_POSITIONS, len(tokens)
    ours = model.session(len(tokens) + 8).eval(tokens).numpy()
    theirs = llamacpp_logits(path, tokens)
    assert ours.shape == theirs.shape
    kl = kl_rows(theirs, ours)
    agree = top1(ours, theirs)
    print(f"\n{path.name}: {len(tokens)} positions, top-1 agreement {agree:.4f}, "
          f"mean KL(llama.cpp || hybridrt) {kl.mean():.3g} (max {kl.max():.3g})")
    assert agree >= 0.94
    assert kl.mean() <= 0.01


# ------------------------------------------------------------------ tiny models

N_TINY = 160


def _tiny_vs_llamacpp(path, seed: int) -> tuple[float, float]:
    model = load_model(path)
    tokens = np.random.default_rng(seed).integers(0, model.n_vocab, N_TINY).tolist()
    ours = model.session(N_TINY + 8).eval(tokens).numpy()
    theirs = llamacpp_logits(path, tokens)
    return rel_err(ours, theirs), top1(ours, theirs)


@pytest.mark.parametrize("arch,mtp", [("qwen35", False), ("qwen35", True), ("llama", False),
                                      ("qwen3", False), ("gemma3", False), ("qwen3next", False)])
def test_tiny_f32_logits_match_llamacpp(tmp_path, arch, mtp):
    path = make_model.write_model(tmp_path / f"{arch}.gguf", arch, mtp=mtp, mix="f32", seed=4)
    rel, agree = _tiny_vs_llamacpp(path, seed=13)
    print(f"\ntiny {arch}{' +MTP' if mtp else ''} f32: rel {rel:.3g}, top-1 {agree:.4f}")
    assert rel <= 1e-3 and agree >= 0.99, (rel, agree)


@pytest.mark.parametrize("mix", ["q8_0", "q4_k_m", "iq4_xs"])
@pytest.mark.parametrize("mtp", [False, True])
def test_tiny_qwen35_quantized_logits_match_llamacpp(tmp_path, mix, mtp):
    path = make_model.write_model(tmp_path / f"qwen35-{mix}.gguf", "qwen35", mtp=mtp, mix=mix, seed=3)
    rel, agree = _tiny_vs_llamacpp(path, seed=12)
    print(f"\ntiny qwen35{' +MTP' if mtp else ''} {mix}: rel {rel:.3g}, top-1 {agree:.4f}")
    assert rel <= 5e-2, (rel, agree)


# ------------------------------------------------------------------ the references themselves

@pytest.mark.parametrize("arch", ["gemma3", "qwen3next"])
def test_new_references_match_llamacpp(tmp_path, arch):
    path = make_model.write_model(tmp_path / f"{arch}.gguf", arch, mix="f32", seed=0)
    ref = reference_for(path)
    tokens = np.random.default_rng(11).integers(0, ref.W("token_embd.weight").shape[0], N_TINY).tolist()
    ours, theirs = ref.forward(tokens), llamacpp_logits(path, tokens)
    rel, agree = rel_err(ours, theirs), top1(ours, theirs)
    print(f"\nreference {arch} f32 vs llama.cpp: rel {rel:.3g}, top-1 {agree:.4f}")
    assert rel <= 1e-3 and agree >= 0.99, (rel, agree)


def test_reference_check_sees_grouped_vs_tiled_heads(tmp_path):
    """Negative control: reading qwen3next's value heads in qwen35's tiled order is caught."""
    path = make_model.write_model(tmp_path / "qwen3next.gguf", "qwen3next", mix="f32", seed=0)
    ref = reference_for(path)
    ref.grouped_heads = False
    tokens = np.random.default_rng(11).integers(0, ref.W("token_embd.weight").shape[0], 64).tolist()
    assert rel_err(ref.forward(tokens), llamacpp_logits(path, tokens)) > 1e-2
