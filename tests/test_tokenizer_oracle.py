"""Tokenizer vs llama.cpp (llama-cpp-python, vocab only) on both real models.

Run: scripts/oracle_setup.sh && pytest -m oracle tests/test_tokenizer_oracle.py
llama.cpp runs in a subprocess under the oracle venv's interpreter, one process per model for all
strings, so this package never imports llama_cpp.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
from pathlib import Path

import gguf
import pytest

from hybridrt.files.gguf_file import GGUFFile
from hybridrt.files.tokenizer import Tokenizer
from tests.real_models import GEMMA3, SMOLLM2, require

pytestmark = pytest.mark.oracle

ORACLE_PYTHON = Path(os.environ.get("HYBRIDRT_CACHE", Path.home() / ".cache" / "hybridrt")) / "oracle-venv" / "bin" / "python"

# reads a JSON job on stdin, answers with llama.cpp's tokenize/detokenize results on stdout
_ORACLE_SCRIPT = r"""
import ctypes, json, sys
import llama_cpp
from llama_cpp import Llama
job = json.load(sys.stdin)
llm = Llama(model_path=job["model"], vocab_only=True, verbose=False)
vocab = llm._model.vocab
def detokenize(ids, remove_special, unparse_special):
    arr = (llama_cpp.llama_token * max(1, len(ids)))(*ids)
    size = 64 + 64 * len(ids)
    buf = ctypes.create_string_buffer(size)
    n = llama_cpp.llama_detokenize(vocab, arr, len(ids), buf, size, remove_special, unparse_special)
    assert n >= 0, n
    return buf.raw[:n].hex()
out = {
    "tokens": [llm.tokenize(t.encode(), add_bos=a, special=p) for t, a, p in job["tokenize"]],
    "text": [detokenize(ids, r, u) for ids, r, u in job["detokenize"]],
    "eog": [i for i in range(llama_cpp.llama_vocab_n_tokens(vocab)) if llama_cpp.llama_vocab_is_eog(vocab, i)],
    "bos": llama_cpp.llama_vocab_bos(vocab),
    "eos": llama_cpp.llama_vocab_eos(vocab),
}
json.dump(out, sys.stdout)
"""

TEXTS = [
    "",
    " ",
    "  ",
    "Hello world",
    " Hello world",
    "   three leading spaces",
    "trailing spaces   ",
    "hello  world   with    runs",
    "tabs\tand\t\tdouble tabs\t\t\tend",
    "line one\nline two\n\nparagraph\n\n\n\nfour newlines",
    "\r\nwindows line\r\nendings\r\n",
    "mixed \n \t \n\t whitespace",
    "digits 0 1 12 123 1234 12345 1234567890",
    "pi is 3.14159265358979323846264338327950288419716939937510",
    "phone +1 (555) 010-9999, price $1,234.56, 50% off",
    "def f(x):\n    return x ** 2  # square\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "<html><body><div class=\"x\">text</div></body></html>",
    "I'm sure you'll see it's what they've done, isn't it? We'd go. I'D SAY IT'S OK",
    "Emoji: 😀😃😄 👍🏽 👨‍👩‍👧‍👦 🇫🇷",
    "日本語のテキストです。中文文本。한국어 텍스트",
    "Café naïve résumé façade jalapeño Ångström",
    "Ελληνικά Русский текст עברית العربية हिन्दी",
    "combining: e\u0301 a\u0308 n\u0303",
    "zero\u200bwidth and nbsp\u00a0here and ideographic\u3000space",
    "math: ∑ ∫ √ ≤ ≥ ≠ ∞ → ← ⇒",
    "rare chars: 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𓀀 \U0010FFFD",
    "control chars \x01\x07\x1b[0m",
    "!!!???...,,,;;;:::---___===+++***",
    "a.b,c;d:e!f?g",
    "hello , world . what ? ok ! it ' s",
    "URL https://example.com/path?q=1&r=2#frag and email a.b@c.org",
    "UPPER lower MiXeD CamelCaseWords snake_case_words kebab-case-words",
    "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n",
    "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n",
    "<bos>text after bos<eos>",
    "<|endoftext|>after endoftext",
    "special <|im_end|> in the middle <end_of_turn> twice",
    "<unused0><unused12> and [multimodal] and <start_of_image>",
    "<0x41> looks like a byte token",
    "<table><tr><td>cell</td></tr></table>",
    "\u2581already\u2581has\u2581marks",
    "a" * 300,
    "ab " * 100,
    "The quick brown fox jumps over the lazy dog. " * 8,
    "\n",
    "\t",
    "x",
    "😀",
    "e\u0301",
]



def _fuzz_texts(n: int, seed: int) -> list[str]:
    """Random mixes of the character classes tokenizers treat differently."""
    rng = random.Random(seed)
    pools = [
        "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
        "0123456789",
        "     \t\n\r\u00a0\u3000",
        "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~",
        "日本語中文한국어テキスト",
        "😀👍🏽🇫🇷🤖",
        "éèêëàâäôöûüçñÅ\u0301\u0308",
        "ΑβγдЖשعह",
        "\u2581",
    ]
    words = ["<|im_start|>", "<|im_end|>", "<start_of_turn>", "<end_of_turn>", "<bos>", "<eos>", "'s", "'ll",
             "the", " the", "ing", "  ", "\n\n", "\t\t", "<td>", "1234", "    "]
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(1, 12)):
            if rng.random() < 0.25:
                parts.append(rng.choice(words))
            else:
                pool = rng.choice(pools)
                parts.append("".join(rng.choice(pool) for _ in range(rng.randint(1, 6))))
        out.append("".join(parts))
    return out


TEXTS += _fuzz_texts(150, seed=1234)

FLAGS = [(True, False), (False, False), (True, True), (False, True)]


def _run_oracle(model: Path, job: dict) -> dict:
    if not ORACLE_PYTHON.exists():
        pytest.skip(f"no llama.cpp oracle at {ORACLE_PYTHON} (run scripts/oracle_setup.sh)")
    job = dict(job, model=str(model))
    proc = subprocess.run([str(ORACLE_PYTHON), "-c", _ORACLE_SCRIPT], input=json.dumps(job),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


# SmolLM2's byte-level vocab and merges re-labelled with other pre-tokenizer names, so every regex
# set in BPE_PRE_TOKENIZERS that real models here do not use is still checked against llama.cpp
RELABELLED_PRES = ["gpt-2", "default", "qwen2", "qwen35", "llama-bpe", "starcoder", "gpt-4o"]


def _write_relabelled_vocab(src: Path, dst: Path, pre: str) -> Path:
    md = GGUFFile(src).metadata
    writer = gguf.GGUFWriter(str(dst), arch="llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(md["tokenizer.ggml.tokens"])
    writer.add_token_types([int(t) for t in md["tokenizer.ggml.token_type"]])
    writer.add_token_merges(md["tokenizer.ggml.merges"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)          # no add_bos flag: each pre-tokenizer's default applies
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


@pytest.fixture(scope="module", params=["smollm2", "gemma3"] + [f"smollm2-as-{p}" for p in RELABELLED_PRES])
def model_and_oracle(request, tmp_path_factory):
    if request.param.startswith("smollm2-as-"):
        pre = request.param.removeprefix("smollm2-as-")
        path = _write_relabelled_vocab(require(SMOLLM2), tmp_path_factory.mktemp("vocab") / f"{pre}.gguf", pre)
    else:
        path = require(SMOLLM2 if request.param == "smollm2" else GEMMA3)
    tok = Tokenizer.from_gguf(GGUFFile(path).metadata)
    cases = [(t, a, p) for t in TEXTS for a, p in FLAGS]
    ours = [tok.encode(t, add_special=a, parse_special=p) for t, a, p in cases]
    # detokenize what llama.cpp produced, plus byte-fallback and special-token id runs
    first = _run_oracle(path, {"tokenize": cases, "detokenize": []})
    id_lists = first["tokens"] + [[tok.bos_id] + ids for ids in first["tokens"][:40:4]]
    id_lists += [list(range(i, i + 50)) for i in range(0, min(tok.n_vocab, 1000), 50)]
    dcases = [(ids, r, u) for ids in id_lists for r, u in ((False, True), (True, False), (False, False))]
    second = _run_oracle(path, {"tokenize": [], "detokenize": dcases})
    assert len(first["tokens"]) == len(cases) and len(second["text"]) == len(dcases)
    return tok, cases, ours, first, dcases, second


def test_tokenize_matches_llamacpp(model_and_oracle):
    tok, cases, ours, oracle, _, _ = model_and_oracle
    bad = [(t, a, p, mine, theirs) for (t, a, p), mine, theirs in zip(cases, ours, oracle["tokens"]) if mine != theirs]
    detail = "\n".join(f"{t!r} add_special={a} parse_special={p}\n  ours  {m}\n  llama {o}" for t, a, p, m, o in bad[:10])
    assert not bad, f"{len(bad)}/{len(cases)} tokenizations differ:\n{detail}"


def test_detokenize_matches_llamacpp(model_and_oracle):
    tok, _, _, _, dcases, oracle = model_and_oracle
    bad = []
    for (ids, remove_special, unparse_special), theirs in zip(dcases, oracle["text"]):
        mine = tok.detokenize(ids, remove_special=remove_special, unparse_special=unparse_special)
        if mine != bytes.fromhex(theirs):
            bad.append((ids[:20], remove_special, unparse_special, mine, bytes.fromhex(theirs)))
    detail = "\n".join(f"{i} remove={r} unparse={u}\n  ours  {m!r}\n  llama {o!r}" for i, r, u, m, o in bad[:10])
    assert not bad, f"{len(bad)}/{len(dcases)} detokenizations differ:\n{detail}"


def test_special_ids_match_llamacpp(model_and_oracle):
    tok, _, _, oracle, _, _ = model_and_oracle
    assert tok.bos_id == oracle["bos"]
    assert tok.eos_id == oracle["eos"]
    assert sorted(tok.eog_ids) == oracle["eog"]


def test_decode_of_encode_round_trips(model_and_oracle):
    tok, cases, ours, _, _, _ = model_and_oracle
    for (text, add_special, parse_special), ids in zip(cases, ours):
        if add_special or parse_special or tok.clean_spaces or (tok.kind == "spm" and "\u2581" in text):
            continue
        assert tok.decode(ids) == text
