"""Tokenizers rebuilt from GGUF metadata that tokenize and detokenize exactly like llama.cpp.

Two vocabulary kinds, both run by Hugging Face `tokenizers` (no network, nothing cached on disk):

- "bpe" (`tokenizer.ggml.model == "gpt2"`): byte-level BPE over the file's ranked merges; words come
  from the pre-tokenizer regexes llama.cpp uses for the file's `tokenizer.ggml.pre`.
- "spm" (`tokenizer.ggml.model == "llama"`): llama.cpp's SentencePiece-style merger starts from the
  characters of the whole fragment (spaces written as U+2581) and keeps joining the adjacent pair
  whose concatenation is the best-scoring vocab entry; characters outside the vocab become <0xNN>
  byte tokens. A BPE model whose merge list is every (left, right) split of every token, ranked by
  the score of the token formed, does exactly that, so HF's BPE runs it.

In front of both sits llama.cpp's special-token split: user-defined tokens are always matched as
whole tokens, control tokens only with `parse_special`, longest token text first.
"""
from __future__ import annotations

import codecs
import re
from dataclasses import dataclass
from functools import cached_property

import numpy as np
from tokenizers import Regex
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from .chat_template import CHATML_TEMPLATE, compile_chat_template, render_chat_template
from ..errors import UserError

# GGUF tokenizer.ggml.token_type values
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

SPACE_MARK = "\u2581"  # SentencePiece's visible space

# --- BPE pre-tokenizers: regexes applied in sequence, each splitting the pieces of the one before
# (matches and the text between them both become pieces), as llama.cpp does per `tokenizer.ggml.pre`.
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_RE_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_RE_LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_RE_QWEN2 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_RE_QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_RE_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
             r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
             r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
             r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
             r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclass(frozen=True)
class BpePreTokenizer:
    regexes: tuple[str, ...]
    clean_spaces: bool = True       # llama.cpp's detokenizer tidies " ," " 's" etc. for these
    ignore_merges: bool = False     # a word that is already a token is taken whole
    add_bos: bool = False           # default when the file has no add_bos_token flag


def _pre_table() -> dict[str, BpePreTokenizer]:
    table: dict[str, BpePreTokenizer] = {}

    def put(names: str, spec: BpePreTokenizer):
        for name in names.split():
            table[name] = spec

    put("default", BpePreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _RE_GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")))
    put("gpt-2 gpt2 phi-2 jina-es jina-de gigachat jina-v2-es jina-v2-de a.x-4.0 mellum modern-bert mpt olmo "
        "jais exaone4 roberta-bpe jina-v1-en jina-v2-code", BpePreTokenizer((_RE_GPT2,)))
    put("trillion granite-docling", BpePreTokenizer((_RE_GPT2,), clean_spaces=False))
    put("starcoder refact codeshell exaone minerva-7b mellum2", BpePreTokenizer((r"\p{N}", _RE_GPT2)))
    put("smollm command-r", BpePreTokenizer((r"\p{N}", _RE_GPT2), clean_spaces=False))
    put("llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano",
        BpePreTokenizer((_RE_LLAMA3,), ignore_merges=True, add_bos=True))
    put("dbrx smaug-bpe", BpePreTokenizer((_RE_LLAMA3,)))
    put("qwen2 deepseek-r1-qwen kormo f2llmv2 hunyuan solar-open", BpePreTokenizer((_RE_QWEN2,), clean_spaces=False))
    put("megrez stablelm2", BpePreTokenizer((_RE_QWEN2,)))
    put("qwen35", BpePreTokenizer((_RE_QWEN35,), clean_spaces=False))
    put("gpt-4o llama4 kanana2 talkie", BpePreTokenizer((_RE_GPT4O,), clean_spaces=False))
    return table


BPE_PRE_TOKENIZERS = _pre_table()

# --- special-token roles llama.cpp finds by token text when the file does not name them
_EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
              "<EOT>", "_<EOT>", "[EOT]", "<\uff5cend\u2581of\u2581sentence\uff5c>", "<end_of_utterance>")
_ROLE_TEXTS = {  # role -> (metadata keys, texts)
    "eot": (("eot_token_id",), _EOT_TEXTS),
    "eom": (("eom_token_id",), ("<|eom_id|>",)),
    "fim_pre": (("fim_pre_token_id", "prefix_token_id"),
                ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<\uff5cfim\u2581begin\uff5c>", "<PRE>",
                 "\u2581<PRE>", "<|code_prefix|>", "<|prefix|>")),
    "fim_suf": (("fim_suf_token_id", "suffix_token_id"),
                ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<\uff5cfim\u2581hole\uff5c>", "<SUF>",
                 "\u2581<SUF>", "<|code_suffix|>", "<|suffix|>")),
    "fim_mid": (("fim_mid_token_id", "middle_token_id"),
                ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<\uff5cfim\u2581end\uff5c>", "<MID>",
                 "\u2581<MID>", "<|code_middle|>", "<|middle|>")),
    "fim_pad": (("fim_pad_token_id",), ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]")),
    "fim_rep": (("fim_rep_token_id",), ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")),
    "fim_sep": (("fim_sep_token_id",), ("<|file_sep|>",)),
}
_EOG_TEXTS = frozenset(("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
                        "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
                        "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
                        "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~["))
_ALWAYS_RENDERED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")  # gpt-oss


def _gpt2_byte_chars() -> list[str]:
    """The printable character GPT-2 byte-level BPE writes for each byte value."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = [], 0
    for b in range(256):
        if b in keep:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


_BYTE_CHARS = _gpt2_byte_chars()
# translate table: byte char -> the byte as a latin-1 char; raw chars < 256 that are not byte chars
# go to U+FFFF so the latin-1 encode fails and the slow path renders them like llama.cpp
_BYTE_DECODE = {ord(c): chr(b) for b, c in enumerate(_BYTE_CHARS)}
for _b in range(256):
    _BYTE_DECODE.setdefault(_b, "\uffff")

_CLEAN_PUNCT = re.compile(rb" (?=[?!.,])")
_CLEAN_QUOTE = re.compile(rb" ' ")
_CLEAN_CONTRACTION = re.compile(rb" '(?=[sm]|re|ve)")


def _clean_spaces(text: bytes) -> bytes:
    """llama.cpp's detokenizer clean-up for BPE vocabularies that ask for it."""
    text = _CLEAN_PUNCT.sub(b"", text)
    text = _CLEAN_QUOTE.sub(b"'", text)
    return _CLEAN_CONTRACTION.sub(b"'", text)


def _decode_byte_level(text: str) -> bytes:
    try:
        return text.translate(_BYTE_DECODE).encode("latin-1")
    except UnicodeEncodeError:
        out = bytearray()
        for ch in text:
            b = _BYTE_DECODE.get(ord(ch))
            if b is not None and b != "\uffff":
                out.append(ord(b))
            else:
                out += b"[UNK_BYTE_0x" + ch.encode().hex().encode() + text.encode() + b"]"
        return bytes(out)


def _poly_hashes(codes: np.ndarray, mult: int) -> tuple[np.ndarray, np.ndarray]:
    """Prefix sums G and inverse powers for the substring hash (G[r] - G[l]) * mult**-l (mod 2**64)."""
    n = len(codes)
    with np.errstate(over="ignore"):
        pw = np.empty(n, dtype=np.uint64)
        pw[0] = 1
        pw[1:] = np.cumprod(np.full(n - 1, mult, dtype=np.uint64))
        ipw = np.empty(n + 1, dtype=np.uint64)
        ipw[0] = 1
        ipw[1:] = np.cumprod(np.full(n, pow(mult, -1, 1 << 64), dtype=np.uint64))
        g = np.zeros(n + 1, dtype=np.uint64)
        np.cumsum(codes * pw, out=g[1:])
    return g, ipw


class _HashIndex:
    """uint64 hash -> index of a key with that hash (any index when absent; callers verify).

    A direct-address table on the top hash bits answers most lookups with one memory access; only
    queries landing in slots shared by several keys fall back to binary search, which on its own
    costs ~0.2 s per million lookups from cache misses.
    """
    BITS = 22

    @staticmethod
    def _mix(h: np.ndarray) -> np.ndarray:
        # polynomial hashes of 1-char strings are tiny numbers; spread them over the top bits
        with np.errstate(over="ignore"):
            h = (h ^ (h >> np.uint64(31))) * np.uint64(0xBF58476D1CE4E5B9)
            return h ^ (h >> np.uint64(29))

    def __init__(self, keys: np.ndarray):
        keys = self._mix(keys)
        self.keys = keys
        slot = (keys >> np.uint64(64 - self.BITS)).astype(np.int64)
        self.table = np.zeros(1 << self.BITS, dtype=np.int64)
        self.table[slot] = np.arange(len(keys))
        self.shared = np.zeros(1 << self.BITS, dtype=bool)
        self.shared[slot[self.table[slot] != np.arange(len(keys))]] = True
        self.by_key = np.argsort(keys)
        self.sorted_keys = keys[self.by_key]

    def __call__(self, queries: np.ndarray) -> np.ndarray:
        queries = self._mix(queries)
        slot = (queries >> np.uint64(64 - self.BITS)).astype(np.int64)
        found = self.table[slot]
        redo = np.flatnonzero(self.shared[slot] & (self.keys[found] != queries))
        pos = np.minimum(np.searchsorted(self.sorted_keys, queries[redo]), len(self.keys) - 1)
        found[redo] = self.by_key[pos]
        return found


def spm_merges(tokens: list[str], scores: np.ndarray) -> list[tuple[str, str]]:
    """Every (left, right) split of every token where both halves are tokens too, best score first.

    A plain Python loop over the ~1.2M split points of a 262k vocabulary takes ~0.9 s, so prefixes
    and suffixes are matched to tokens by two independent 64-bit polynomial hashes in numpy.
    """
    n = len(tokens)
    lens = np.fromiter(map(len, tokens), dtype=np.int64, count=n)
    starts = np.zeros(n, dtype=np.int64)
    if n == 0 or lens.max() < 2:
        return []
    np.cumsum(lens[:-1], out=starts[1:])
    codes = np.frombuffer("".join(tokens).encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
    codes = codes.astype(np.uint64) + np.uint64(1)
    splits_per_token = np.maximum(lens - 1, 0)
    tok = np.repeat(np.arange(n), splits_per_token)
    first_split = np.cumsum(splits_per_token) - splits_per_token
    k = np.arange(len(tok)) - first_split[tok] + 1            # characters in the left half
    lo, mid, hi = starts[tok], starts[tok] + k, starts[tok] + lens[tok]

    # look halves up by the first hash, then confirm each hit with the second
    (g1, ipw1), (g2, ipw2) = (_poly_hashes(codes, m) for m in (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F))
    with np.errstate(over="ignore"):
        find = _HashIndex((g1[starts + lens] - g1[starts]) * ipw1[starts])
        tok_check = (g2[starts + lens] - g2[starts]) * ipw2[starts]
        ok = np.ones(len(tok), dtype=bool)
        ids = []
        for a, b in ((lo, mid), (mid, hi)):
            found = find((g1[b] - g1[a]) * ipw1[a])
            ok &= tok_check[found] == (g2[b] - g2[a]) * ipw2[a]
            ids.append(found)
    rank = np.empty(n, dtype=np.int64)
    rank[np.argsort(-scores.astype(np.float64), kind="stable")] = np.arange(n)
    sel = np.flatnonzero(ok)
    sel = sel[np.lexsort((k[sel], rank[tok[sel]]))]
    left = map(tokens.__getitem__, ids[0][sel].tolist())
    right = map(tokens.__getitem__, ids[1][sel].tolist())
    return list(zip(left, right))


def _bpe_merges(merges: list[str], vocab: dict[str, int]) -> list[tuple[str, str]]:
    out = []
    for m in merges:
        cut = m.find(" ", 1)       # a merge's left half may itself start with a space
        if cut < 0:
            continue
        a, b = m[:cut], m[cut + 1:]
        if a in vocab and b in vocab and a + b in vocab:
            out.append((a, b))
    return out


class Tokenizer:
    """Text <-> token ids for one GGUF vocabulary; build with `Tokenizer.from_gguf(metadata)`."""

    def __init__(self, *, kind: str, tokens: list[str], token_types: np.ndarray, hf: HFTokenizer,
                 bos_id: int | None, eos_id: int | None, eog_ids: frozenset[int], add_bos: bool, add_eos: bool,
                 add_space_prefix: bool, clean_spaces: bool, chat_template: str | None, pre: str):
        self.kind = kind                      # "bpe" or "spm"
        self.pre = pre
        self.tokens = tokens
        self.token_types = token_types        # after llama.cpp's by-text overrides
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.eog_ids = eog_ids
        self.add_bos = add_bos
        self.add_eos = add_eos
        self.add_space_prefix = add_space_prefix
        self.clean_spaces = clean_spaces
        self.chat_template = chat_template
        self._hf = hf
        self._compiled_template = None
        specials = [i for i in np.flatnonzero(np.isin(token_types, (CONTROL, USER_DEFINED, UNKNOWN))).tolist()
                    if tokens[i]]
        specials.sort(key=lambda i: -len(tokens[i]))   # llama.cpp matches the longest texts first
        self._split_always = [(tokens[i], i) for i in specials if token_types[i] == USER_DEFINED]
        self._split_parsed = [(tokens[i], i) for i in specials]

    @property
    def n_vocab(self) -> int:
        return len(self.tokens)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_gguf(cls, metadata: dict) -> "Tokenizer":
        model = metadata.get("tokenizer.ggml.model")
        tokens = metadata.get("tokenizer.ggml.tokens")
        if model is None or tokens is None:
            raise UserError("GGUF file has no tokenizer (tokenizer.ggml.model / tokenizer.ggml.tokens missing)")
        tokens = list(tokens)
        n = len(tokens)
        types = metadata.get("tokenizer.ggml.token_type")
        types = np.full(n, NORMAL, dtype=np.int32) if types is None else np.array(types, dtype=np.int32)
        vocab = dict(zip(tokens, range(n)))
        if len(vocab) != n:
            raise UserError("GGUF tokenizer has duplicate token texts")
        pre = str(metadata.get("tokenizer.ggml.pre", "default") or "default")

        if model == "llama":
            kind = "spm"
            scores = metadata.get("tokenizer.ggml.scores")
            scores = np.zeros(n, dtype=np.float32) if scores is None else np.asarray(scores)
            byte_fallback = all(f"<0x{b:02X}>" in vocab for b in range(256))
            unk = metadata.get("tokenizer.ggml.unknown_token_id", 0)
            unk_text = tokens[int(unk)] if 0 <= int(unk) < n else None
            hf = HFTokenizer(models.BPE(vocab, spm_merges(tokens, scores), byte_fallback=byte_fallback,
                                        unk_token=unk_text))
            defaults = dict(bos=1, eos=2, add_bos=True, add_space_prefix=True)
            clean_spaces = False
        elif model == "gpt2":
            kind = "bpe"
            spec = BPE_PRE_TOKENIZERS.get(pre)
            if spec is None:
                raise UserError(f"unsupported BPE pre-tokenizer {pre!r} (tokenizer.ggml.pre); "
                                f"known: {', '.join(sorted(BPE_PRE_TOKENIZERS))}")
            merges = metadata.get("tokenizer.ggml.merges")
            if merges is None:
                raise UserError("GGUF BPE tokenizer has no tokenizer.ggml.merges")
            hf = HFTokenizer(models.BPE(vocab, _bpe_merges(list(merges), vocab), ignore_merges=spec.ignore_merges))
            hf.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in spec.regexes]
                + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
            defaults = dict(bos=11, eos=11, add_bos=spec.add_bos, add_space_prefix=False)
            clean_spaces = spec.clean_spaces
        else:
            raise UserError(f"unsupported tokenizer model {model!r} (tokenizer.ggml.model); "
                            "supported: 'gpt2' (BPE) and 'llama' (SentencePiece)")

        def meta_id(key: str, default: int | None) -> int | None:
            value = metadata.get(f"tokenizer.ggml.{key}")
            if value is not None and 0 <= int(value) < n:
                return int(value)
            return default if default is not None and 0 <= default < n else None

        bos_id = meta_id("bos_token_id", defaults["bos"])
        eos_id = meta_id("eos_token_id", defaults["eos"])
        add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", defaults["add_bos"]))
        add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
        add_space_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", defaults["add_space_prefix"]))
        if add_bos and bos_id is None:
            raise UserError("GGUF tokenizer asks for a BOS token but names none")
        eog_ids = _find_eog(tokens, types, vocab, eos_id, meta_id)
        template = metadata.get("tokenizer.chat_template")
        return cls(kind=kind, tokens=tokens, token_types=types, hf=hf, bos_id=bos_id, eos_id=eos_id,
                   eog_ids=eog_ids, add_bos=add_bos, add_eos=add_eos, add_space_prefix=add_space_prefix,
                   clean_spaces=clean_spaces, chat_template=str(template) if template else None, pre=pre)

    # ------------------------------------------------------------------ encode
    def _split_special(self, text: str, parse_special: bool) -> list[str | int]:
        """Cut the text at special-token texts: returns raw-text pieces and token ids, in order."""
        pieces: list[str | int] = [text]
        for special, token_id in (self._split_parsed if parse_special else self._split_always):
            if special not in text:
                continue
            cut: list[str | int] = []
            for piece in pieces:
                if isinstance(piece, int):
                    cut.append(piece)
                    continue
                for j, part in enumerate(piece.split(special)):
                    if j:
                        cut.append(token_id)
                    if part:
                        cut.append(part)
            pieces = cut
        return pieces

    def encode(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids of `text`. add_special adds BOS/EOS as the file asks; parse_special turns control
        token texts (e.g. "<|im_start|>") into their ids instead of spelling them out."""
        out: list[int] = []
        if add_special and self.add_bos:
            out.append(self.bos_id)
        prev_special = True
        for piece in self._split_special(text, parse_special) if text else []:
            if isinstance(piece, int):
                out.append(piece)
                prev_special = True
                continue
            if self.kind == "spm":
                if self.add_space_prefix and prev_special:
                    piece = " " + piece
                piece = piece.replace(" ", SPACE_MARK)
            out.extend(self._hf.encode(piece, add_special_tokens=False).ids)
            prev_special = False
        if add_special and self.add_eos:
            out.append(self.eos_id)
        return out

    # ------------------------------------------------------------------ decode
    @cached_property
    def _pieces(self) -> list[bytes]:
        """Each token as llama.cpp renders it with special=True (control texts spelled out)."""
        pieces = []
        for text, kind in zip(self.tokens, self.token_types.tolist()):
            if kind in (CONTROL, USER_DEFINED, UNKNOWN):
                pieces.append(text.encode())
            elif kind == NORMAL:
                if self.kind == "spm":
                    pieces.append(text.replace(SPACE_MARK, " ").encode())
                else:
                    pieces.append(_decode_byte_level(text))
            elif kind == BYTE:
                pieces.append(bytes([int(text[3:5], 16)]))
            else:                                  # unused / undefined types render as nothing
                pieces.append(b"")
        return pieces

    @cached_property
    def _hidden_unless_special(self) -> np.ndarray:
        return np.isin(self.token_types, (CONTROL, UNKNOWN))

    def token_to_piece(self, token_id: int, special: bool = True) -> bytes:
        """The bytes one token stands for (may be part of a UTF-8 character); control tokens are
        empty unless `special`."""
        if not special and self._hidden_unless_special[token_id]:
            return b""
        return self._pieces[token_id]

    def detokenize(self, ids, remove_special: bool, unparse_special: bool) -> bytes:
        """llama.cpp's llama_detokenize: remove_special drops a leading BOS / trailing EOS the file
        adds itself; unparse_special spells control tokens out instead of dropping them."""
        ids = list(ids)
        strip_space = self.add_space_prefix   # the space SentencePiece put in front of the text
        if remove_special and self.add_bos and ids and ids[0] == self.bos_id:
            strip_space = False
            ids = ids[1:]
        if remove_special and self.add_eos and ids and ids[-1] == self.eos_id:
            ids = ids[:-1]
        parts = [self.token_to_piece(i, special=unparse_special) for i in ids]
        if strip_space and parts and parts[0].startswith(b" "):
            parts[0] = parts[0][1:]
        text = b"".join(parts)
        return _clean_spaces(text) if self.clean_spaces else text

    def decode_bytes(self, ids, skip_special: bool = False) -> bytes:
        return self.detokenize(ids, remove_special=skip_special, unparse_special=not skip_special)

    def decode(self, ids, skip_special: bool = False) -> str:
        return self.decode_bytes(ids, skip_special).decode("utf-8", errors="replace")

    def stream(self, skip_special: bool = True) -> "StreamDecoder":
        return StreamDecoder(self, skip_special)

    # ------------------------------------------------------------------ chat
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        """The GGUF's template rendered, or ChatML where the file has none (as llama.cpp does)."""
        if self._compiled_template is None:
            self._compiled_template = compile_chat_template(self.chat_template or CHATML_TEMPLATE)

        def text_of(token_id):
            return self.tokens[token_id] if token_id is not None else ""
        return render_chat_template(self._compiled_template, messages, add_generation_prompt,
                                    bos_token=text_of(self.bos_id), eos_token=text_of(self.eos_id), **extra)


class StreamDecoder:
    """Turns generated ids into text as they arrive, holding back bytes of an unfinished UTF-8
    character (a CJK character or emoji spread over <0xNN> byte tokens prints once it is whole)."""

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = True):
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self._utf8.decode(self.tokenizer.token_to_piece(token_id, special=not self.skip_special))

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character comes out as U+FFFD)."""
        return self._utf8.decode(b"", final=True)


def _find_eog(tokens: list[str], types: np.ndarray, vocab: dict[str, int], eos_id: int | None, meta_id) -> frozenset[int]:
    """The end-of-generation ids as llama.cpp decides them; marks by-text finds as control tokens
    (in place in `types`), as llama.cpp does, so they split and render as specials."""
    roles: dict[str, int | None] = {}
    for role, (keys, texts) in _ROLE_TEXTS.items():
        found = None
        for key in keys:
            found = meta_id(key, None)
            if found is not None:
                break
        if found is None:
            hits = [vocab[t] for t in texts if t in vocab]
            if hits:
                found = min(hits)
                types[found] = CONTROL
        roles[role] = found

    eog = {roles[r] for r in ("fim_pad", "fim_rep", "fim_sep") if roles[r] is not None}
    for text in _EOG_TEXTS:
        token_id = vocab.get(text)
        if token_id is not None:
            eog.add(token_id)
            types[token_id] = CONTROL
    for text in _ALWAYS_RENDERED:
        if text in vocab:
            types[vocab[text]] = USER_DEFINED
    eog |= {i for i in (eos_id, roles["eot"], roles["eom"]) if i is not None}

    def has(text):
        return text in vocab and vocab[text] in eog
    # harmony / solar-open: "<|end|>" ends a message, not the generation
    if has("<|end|>") and ((has("<|return|>") and has("<|call|>")) or (has("<|calls|>") and has("<|flush|>"))):
        eog.discard(vocab["<|end|>"])
        types[vocab["<|end|>"]] = USER_DEFINED
    # gemma4: "</s>" is an ordinary token there
    if has("<|tool_response>") and has("</s>"):
        eog.discard(vocab["</s>"])
        types[vocab["</s>"]] = NORMAL
    return frozenset(eog)
