"""Tokenizer unit tests: synthetic GGUF vocabularies (always run) and the real models (skip if absent).

Bit-exactness against llama.cpp itself is in test_tokenizer_oracle.py (marker `oracle`); here the
SentencePiece path is checked against a direct restatement of llama.cpp's merge rule, and the BPE
path against the pieces each pre-tokenizer must produce.
"""
from __future__ import annotations

import random
import time
import zlib

import numpy as np
import pytest

from hybridrt.files.chat_template import ChatTemplateError
from hybridrt.files.gguf_file import GGUFFile
from hybridrt.files.tokenizer import (BPE_PRE_TOKENIZERS, BYTE, CONTROL, NORMAL, USER_DEFINED, Tokenizer, _clean_spaces,
                                _gpt2_byte_chars, spm_merges)
from tests.real_models import GEMMA3, SMOLLM2, require

BYTE_CHARS = _gpt2_byte_chars()


def _bl(text: str) -> str:
    """Text as a byte-level BPE vocab spells it."""
    return "".join(BYTE_CHARS[b] for b in text.encode())


BPE_MERGES = [(" ", "t"), ("h", "e"), (" t", "he"), ("i", "n"), ("in", "g"), ("1", "2"), ("12", "3"),
              ("4", "5"), (" ", "w"), ("o", "r"), (" w", "or"), ("l", "d"), (" wor", "ld"), (" ", " "),
              ("'", "s"), ("\n", "\n")]


def bpe_metadata(pre: str = "gpt2", add_bos: bool | None = None, template: str | None = None) -> dict:
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool>"]
    tokens = specials + list(BYTE_CHARS)
    merges = []
    for a, b in BPE_MERGES:
        a, b = _bl(a), _bl(b)
        merges.append(f"{a} {b}")
        if a + b not in tokens:
            tokens.append(a + b)
    types = [CONTROL, CONTROL, CONTROL, USER_DEFINED] + [NORMAL] * (len(tokens) - 4)
    md = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
          "tokenizer.ggml.token_type": np.array(types, dtype=np.int32), "tokenizer.ggml.merges": merges,
          "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 0}
    if add_bos is not None:
        md["tokenizer.ggml.add_bos_token"] = add_bos
    if template is not None:
        md["tokenizer.chat_template"] = template
    return md


def spm_metadata(seed: int = 0, add_space_prefix: bool = False) -> dict:
    """A small SentencePiece-style vocab: controls, 256 byte tokens, letters, random merged pieces
    with distinct scores. 'é' and emoji are left out so they go through byte fallback."""
    rng = random.Random(seed)
    alphabet = list("abcde\u2581") + ["日"]
    tokens = ["<unk>", "<s>", "</s>", "<start_of_turn>", "<end_of_turn>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, CONTROL, CONTROL, CONTROL, CONTROL] + [BYTE] * 256
    pieces = set()
    while len(pieces) < 150:
        pieces.add("".join(rng.choice(alphabet) for _ in range(rng.randint(2, 5))))
    normal = alphabet + sorted(pieces)
    tokens += normal + ["\n\n", "  "]
    types += [NORMAL] * len(normal) + [USER_DEFINED, USER_DEFINED]
    scores = np.zeros(len(tokens), dtype=np.float32)
    scores[:5] = -1000.0
    first = 5 + 256
    scores[first:first + len(normal)] = -np.array(rng.sample(range(1, 10 * len(normal)), len(normal)), dtype=np.float32)
    scores[-2:] = -1000.0
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.pre": "default", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": np.array(types, dtype=np.int32), "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.add_space_prefix": add_space_prefix}


def reference_spm(text: str, tokens: list[str], scores: np.ndarray) -> list[int]:
    """llama.cpp's SPM rule, restated naively: join the adjacent pair whose concatenation is the
    best-scoring token (leftmost on ties) until none is a token; non-tokens fall back to bytes."""
    vocab = {t: i for i, t in enumerate(tokens)}
    syms = list(text)
    while True:
        best = None
        for i in range(len(syms) - 1):
            token_id = vocab.get(syms[i] + syms[i + 1])
            if token_id is not None and (best is None or scores[token_id] > best[0]):
                best = (scores[token_id], i)
        if best is None:
            break
        i = best[1]
        syms[i:i + 2] = [syms[i] + syms[i + 1]]
    out = []
    for s in syms:
        out.extend([vocab[s]] if s in vocab else [vocab[f"<0x{b:02X}>"] for b in s.encode()])
    return out


def random_text(rng: random.Random, alphabet: str, n: int) -> str:
    return "".join(rng.choice(alphabet) for _ in range(n))


# ------------------------------------------------------------------ SentencePiece path
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_spm_matches_reference_merge_rule(seed):
    md = spm_metadata(seed)
    tok = Tokenizer.from_gguf(md)
    rng = random.Random(100 + seed)
    for _ in range(200):
        text = random_text(rng, "abcde abcde日é😀", rng.randint(0, 40))
        got = tok.encode(text, add_special=False)
        want = []   # "  " is a user-defined token: llama.cpp cuts it out before merging
        for j, part in enumerate(text.split("  ")):
            want += [tok.tokens.index("  ")] if j else []
            want += reference_spm(part.replace(" ", "\u2581"), md["tokenizer.ggml.tokens"], md["tokenizer.ggml.scores"])
        assert got == want, text


def test_spm_merges_equal_plain_enumeration():
    rng = np.random.default_rng(7)
    chars = list("ab▁日😀é")
    tokens = sorted({"".join(rng.choice(chars, size=int(rng.integers(1, 6)))) for _ in range(3000)})
    scores = rng.permutation(len(tokens)).astype(np.float32)
    vocab = set(tokens)
    by_score = [tokens[i] for i in np.argsort(-scores, kind="stable")]
    want = [(t[:k], t[k:]) for t in by_score for k in range(1, len(t)) if t[:k] in vocab and t[k:] in vocab]
    assert spm_merges(tokens, scores) == want


def test_spm_bos_space_prefix_and_special_split():
    tok = Tokenizer.from_gguf(spm_metadata(add_space_prefix=False))
    assert tok.kind == "spm" and tok.add_bos and tok.bos_id == 1
    ids = tok.encode("abc")
    assert ids[0] == 1 and tok.encode("abc", add_special=False) == ids[1:]
    assert tok.encode("", add_special=True) == [1] and tok.encode("", add_special=False) == []
    # user-defined tokens always split out, control tokens only with parse_special
    uid = tok.tokens.index("\n\n")
    assert uid in tok.encode("a\n\nb", add_special=False)
    sot = tok.tokens.index("<start_of_turn>")
    assert sot not in tok.encode("<start_of_turn>a", add_special=False)
    assert tok.encode("<start_of_turn>a", add_special=False, parse_special=True)[0] == sot
    md = spm_metadata(add_space_prefix=True)
    with_prefix = Tokenizer.from_gguf(md)
    # the dummy space goes in front of the text and after every special token
    want = reference_spm("\u2581ab", md["tokenizer.ggml.tokens"], md["tokenizer.ggml.scores"])
    assert with_prefix.encode("ab", add_special=False) == want
    assert with_prefix.encode("<start_of_turn>ab", add_special=False, parse_special=True) == [sot] + want
    assert with_prefix.decode(want) == "ab" and with_prefix.decode([1] + want) == "<s> ab"


def test_spm_round_trip_and_streaming_through_byte_fallback():
    tok = Tokenizer.from_gguf(spm_metadata())
    text = "ab 😀 é 日本 cde\n\n  x"
    ids = tok.encode(text, add_special=False)
    assert tok.decode(ids) == text
    emoji = tok.encode("😀", add_special=False)
    assert len(emoji) == 4 and all(tok.token_types[i] == BYTE for i in emoji)
    stream = tok.stream()
    emitted = [stream.push(i) for i in ids]
    assert "".join(emitted) + stream.flush() == text
    # the emoji's first three bytes print nothing, the fourth prints the whole character
    pos = emitted.index("😀")
    assert emitted[pos - 3:pos] == ["", "", ""]
    # an unfinished character is not lost silently
    stream = tok.stream()
    assert stream.push(emoji[0]) == "" and stream.flush() == "\ufffd"


def test_spm_detokenize_special_flags():
    tok = Tokenizer.from_gguf(spm_metadata())
    ids = tok.encode("<start_of_turn>ab", parse_special=True)
    assert ids[:2] == [1, tok.tokens.index("<start_of_turn>")]
    assert tok.decode(ids) == "<s><start_of_turn>ab"
    assert tok.decode(ids, skip_special=True) == "ab"
    assert tok.token_to_piece(ids[1], special=False) == b""


# ------------------------------------------------------------------ BPE path
def _pieces(tok: Tokenizer, text: str) -> list[str]:
    return [tok.token_to_piece(i).decode("utf-8", "replace") for i in tok.encode(text, add_special=False)]


def test_bpe_pre_tokenizer_digit_rules():
    assert _pieces(Tokenizer.from_gguf(bpe_metadata("smollm")), "12345") == ["1", "2", "3", "4", "5"]
    assert _pieces(Tokenizer.from_gguf(bpe_metadata("qwen2")), "12345") == ["1", "2", "3", "4", "5"]
    assert _pieces(Tokenizer.from_gguf(bpe_metadata("llama-bpe")), "12345") == ["123", "45"]
    assert _pieces(Tokenizer.from_gguf(bpe_metadata("gpt2")), "12345") == ["123", "45"]


def test_bpe_words_spaces_and_contractions():
    tok = Tokenizer.from_gguf(bpe_metadata("gpt2"))
    assert _pieces(tok, " the world") == [" the", " world"]
    # a whitespace run keeps its last space for the next word
    assert _pieces(tok, "a    the") == ["a", "  ", " ", " the"]
    assert _pieces(tok, "it's") == ["i", "t", "'s"]
    assert len(tok.encode("日本")) == 6 and tok.decode(tok.encode("日本")) == "日本"   # bytes, no merges


@pytest.mark.parametrize("pre", ["gpt2", "default", "smollm", "qwen2", "qwen35", "llama-bpe"])
def test_bpe_round_trip_random_unicode(pre):
    tok = Tokenizer.from_gguf(bpe_metadata(pre))
    rng = random.Random(zlib.crc32(pre.encode()))
    alphabet = "the world ing 12345 '\t\n\r  日本語😀é\u0301ß!?.,<>|"
    for _ in range(200):
        text = random_text(rng, alphabet, rng.randint(0, 30))
        ids = tok.encode(text, add_special=False)
        if tok.clean_spaces:   # llama.cpp tidies " ," and " 's" on output for these vocabularies
            assert tok.decode_bytes(ids) == _clean_spaces(text.encode())
        else:
            assert tok.decode(ids) == text


def test_bpe_special_tokens_bos_and_eog():
    tok = Tokenizer.from_gguf(bpe_metadata("smollm"))
    assert tok.kind == "bpe" and not tok.add_bos
    assert tok.encode("") == []
    text = "<|im_start|>user\nhi<|im_end|>"
    parsed = tok.encode(text, parse_special=True)
    assert parsed[0] == 1 and parsed[-1] == 2
    assert 1 not in tok.encode(text) and tok.decode(tok.encode(text)) == text
    assert tok.decode(parsed) == text and tok.decode(parsed, skip_special=True) == "user\nhi"
    assert tok.encode("a<tool>b")[1] == 3          # user-defined: split even without parse_special
    assert tok.eog_ids == {0, 2}                   # eos <|endoftext|> and <|im_end|> by text
    with_bos = Tokenizer.from_gguf(bpe_metadata("smollm", add_bos=True))
    assert with_bos.encode("hi")[0] == 1 and with_bos.encode("hi", add_special=False)[0] != 1
    assert Tokenizer.from_gguf(bpe_metadata("llama-bpe")).add_bos     # llama3 adds BOS by default


def test_unknown_pre_tokenizer_is_a_clear_error():
    with pytest.raises(Exception, match="pre-tokenizer 'no-such-pre'"):
        Tokenizer.from_gguf(bpe_metadata("no-such-pre"))
    assert "qwen35" in BPE_PRE_TOKENIZERS and "llama-bpe" in BPE_PRE_TOKENIZERS


def test_chat_template_and_the_chatml_fallback():
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok = Tokenizer.from_gguf(bpe_metadata(template=template))
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == "<|im_start|>user\nhi<|im_end|>\n"
    # no template in the file: llama.cpp's fallback, ChatML
    assert Tokenizer.from_gguf(bpe_metadata()).apply_chat_template(msgs) == tok.apply_chat_template(msgs)
    raising = Tokenizer.from_gguf(bpe_metadata(template="{{ raise_exception('only user turns') }}"))
    with pytest.raises(ChatTemplateError, match="only user turns"):
        raising.apply_chat_template(msgs)
    sandboxed = Tokenizer.from_gguf(bpe_metadata(template="{{ messages.__class__.__mro__ }}"))
    with pytest.raises(ChatTemplateError):
        sandboxed.apply_chat_template(msgs)


# ------------------------------------------------------------------ real models
@pytest.fixture(scope="module")
def smollm2():
    return Tokenizer.from_gguf(GGUFFile(require(SMOLLM2)).metadata)


@pytest.fixture(scope="module")
def gemma3():
    return Tokenizer.from_gguf(GGUFFile(require(GEMMA3)).metadata)


def test_smollm2_chat_template(smollm2):
    prompt = smollm2.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    assert prompt == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                      "<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    ids = smollm2.encode(prompt, parse_special=True)
    assert ids[0] == smollm2.tokens.index("<|im_start|>") and ids.count(smollm2.tokens.index("<|im_end|>")) == 2
    assert smollm2.decode(ids) == prompt
    assert {smollm2.tokens.index("<|im_end|>"), smollm2.tokens.index("<|endoftext|>")} <= smollm2.eog_ids


def test_smollm2_basics(smollm2):
    assert smollm2.kind == "bpe" and smollm2.n_vocab == 49152 and not smollm2.add_bos
    assert smollm2.encode("") == []
    for text in ["  two  spaces  ", "\t\ttabs\n\n\nnewlines", "数字 12345 😀 café", "a" * 50]:
        assert smollm2.decode(smollm2.encode(text)) == text


def test_gemma3_basics_and_streaming(gemma3):
    assert gemma3.kind == "spm" and gemma3.n_vocab == 262144 and gemma3.add_bos and not gemma3.add_space_prefix
    assert gemma3.encode("") == [gemma3.bos_id]
    ids = gemma3.encode("Hello world", add_special=False)
    assert gemma3.tokens[ids[0]] == "Hello"        # no dummy-prefix space
    assert {gemma3.tokens.index("<end_of_turn>"), gemma3.eos_id} <= gemma3.eog_ids
    sot = gemma3.tokens.index("<start_of_turn>")
    assert gemma3.encode("<start_of_turn>user", parse_special=True)[1] == sot
    assert sot not in gemma3.encode("<start_of_turn>user")
    text = "Egyptian 𓀀𓀁 and 日本語 and 😀, spaces   runs\n\n\n"
    ids = gemma3.encode(text, add_special=False)
    assert any(gemma3.token_types[i] == BYTE for i in ids)      # the hieroglyphs need byte fallback
    stream = gemma3.stream()
    out = [stream.push(i) for i in ids]
    assert "".join(out) + stream.flush() == text == gemma3.decode(ids)
    assert all("\ufffd" not in piece for piece in out)
    # this GGUF carries no chat template: llama.cpp's ChatML fallback
    assert gemma3.chat_template is None
    assert gemma3.apply_chat_template([{"role": "user", "content": "hi"}]) == \
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_gemma3_builds_fast():
    meta = GGUFFile(require(GEMMA3)).metadata
    start = time.perf_counter()
    Tokenizer.from_gguf(meta)
    assert time.perf_counter() - start < 4.0    # ~1.1 s here; a per-split Python loop would be ~2.5 s
