"""Constrained decoding: a grammar (a JSON schema, a regex, a Lark or llama.cpp GBNF grammar) as a
mask on every token the loop draws, computed by llguidance (Rust; an optional dependency:
`pip install 'hybridrt[grammar]'`).

A `Constraint` follows one sequence: the tokens it has consumed (the emitted ones and, inside a
speculative step, the drafts after them), the allowed-token mask of each state it was asked for
(kept until a rollback goes below it), and whether the grammar was complete after each token. The
loop masks every row a token is drawn from with the mask of the state before that token: the
certain token's row (sampling.sample_token), each model draft's row (draft.DraftPicker), each
verify row (speculative/loop.py), and rolls back to the kept tokens after acceptance. The masked
rows are the distributions plain constrained decoding draws from, so the acceptance rule keeps
its guarantee: greedy output token for token, sampled output in distribution.

The vocabulary llguidance needs is the GGUF tokenizer's own (files/tokenizer.py): each token's
bytes as llama.cpp renders it, control tokens marked special (llguidance never lets grammar text
match them), and the end-of-generation ids as its EOS set, allowed exactly where the grammar is
complete.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field

import numpy as np
import torch

from ..errors import UserError
from ..files.tokenizer import CONTROL, UNKNOWN, USER_DEFINED, Tokenizer

INSTALL_HINT = "pip install 'hybridrt[grammar]' (or: pip install llguidance)"
# masks kept below the current state: a verify reads at most MAX_DRAFTS + 1 (32) of them, from the
# certain token's state on, so older ones are dropped as new ones are computed (Gemma 3: 1 MiB each)
KEEP_DEPTHS = 34
# float32 -inf's bits as an int32: (bit - 1) & NEG_INF_BITS is 0.0 for an allowed token, -inf else
NEG_INF_BITS = int(np.array([-np.inf], np.float32).view(np.int32)[0])
# JSON whitespace between tokens as llama.cpp's schema grammars allow it (`space ::= | " " |
# "\n"{1,2} [ \t]{0,20}`): llguidance's default allows any run of it, and a small model can spend the
# whole -n on newlines inside an object. A schema's own "x-guidance" options override it.
JSON_OPTIONS = {"whitespace_pattern": r"( |\n{1,2}[ \t]{0,20})?"}
MAX_DIGITS_INTEGER = 10**16 - 1     # generation_schema: an unbounded integer's largest value
# grammar flags as `run` names them, for messages
KINDS = {"json_schema": "--json-schema", "regex": "--regex", "grammar": "--grammar"}


def llguidance():
    """The llguidance module, or a UserError naming the pip command."""
    try:
        import llguidance as ll
    except ImportError:
        raise UserError(f"constrained decoding needs llguidance: {INSTALL_HINT}") from None
    return ll


@dataclass(frozen=True)
class Grammar:
    """What a constraint accepts: kind "json_schema" (a schema's JSON text), "regex" (Rust regex
    syntax, matched against the whole output) or "grammar" (Lark as llguidance reads it, or
    llama.cpp's GBNF, which llguidance converts). `source`: what errors name it by (run's flag by
    default; the server's request field)."""
    kind: str
    text: str
    source: str = field(default="", compare=False)

    @property
    def label(self) -> str:
        return self.source or KINDS[self.kind]

    @functools.cached_property
    def compiled(self) -> str:
        """llguidance's grammar; a UserError naming its source when it is not valid."""
        ll = llguidance()
        flag = self.label
        try:
            if self.kind == "json_schema":
                grammar = ll.LLMatcher.grammar_from_json_schema(self.text, defaults=JSON_OPTIONS)
            else:
                grammar = ll.grammar_from(self.kind, self.text)
        except ValueError as e:         # a schema that is not a JSON object, GBNF that does not convert
            raise UserError(f"{flag}: {one_line(str(e))}") from None
        error = ll.LLMatcher.validate_grammar(grammar)
        if error:
            raise UserError(f"{flag}: {one_line(error)}")
        return grammar


def one_line(message: str) -> str:
    return " ".join(message.split())


def compile_grammar(kind: str, text: str, source: str = "") -> Grammar:
    """A Grammar of `kind` (a key of KINDS) checked and compiled: a UserError naming `source` (by
    default run's flag) for a schema that is not a JSON object, a regex or grammar that does not
    parse, an unsatisfiable schema."""
    label = source or KINDS[kind]
    if kind == "json_schema":
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as e:
            raise UserError(f"{label}: not JSON ({e})") from None
        if not isinstance(schema, dict):
            raise UserError(f"{label}: a schema is a JSON object, got {type(schema).__name__}")
        text = json.dumps(generation_schema(schema), ensure_ascii=False)
    grammar = Grammar(kind, text, source)
    grammar.compiled
    return grammar


def generation_schema(schema):
    """The schema as generation reads it, with llama.cpp's two defaults for what it leaves open: an
    object that lists its properties gets no others (no `additionalProperties` of its own: a small
    model asked for a tool's arguments went on inventing keys until max_tokens), and an integer
    without bounds of its own at most 16 digits (a small model can repeat a digit until -n runs out;
    JSON parsers lose integers past 2**53 anyway). Whatever this allows, the schema allows: every
    output still validates against the schema as given."""
    if isinstance(schema, list):
        return [generation_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: generation_schema(v) if k not in ("enum", "const", "default", "examples") else v
           for k, v in schema.items()}
    if out.get("type") == "integer":
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = MAX_DIGITS_INTEGER
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = -MAX_DIGITS_INTEGER
    if isinstance(out.get("properties"), dict) and out["properties"] and not (
            {"additionalProperties", "patternProperties", "unevaluatedProperties"} & out.keys()):
        out["additionalProperties"] = False
    return out


def _special(piece: bytes, kind: int) -> bool:
    """Whether llguidance sees a token as special: control and unknown tokens, and a user-defined
    one where it reads as a tag (<start_of_image>, <tool_call>), as llama.cpp's own llguidance
    binding marks them. Grammar text never matches a special token; a Lark rule names it."""
    return kind in (CONTROL, UNKNOWN) or (kind == USER_DEFINED and piece.startswith(b"<") and piece.endswith(b">"))


def lark_literal(tokenizer: Tokenizer, text: str) -> str:
    """Lark for `text` in a grammar: a reference to the special token that spells it where the
    vocabulary has one (Qwen's <tool_call>), else the quoted text."""
    ids = tokenizer.encode(text, add_special=False, parse_special=True)
    if len(ids) == 1 and _special(tokenizer.token_to_piece(ids[0]), int(tokenizer.token_types[ids[0]])):
        return f"<[{ids[0]}]>"
    return json.dumps(text)


class _Vocabulary:
    """The tokenizer as llguidance.TokenizerWrapper reads it: token bytes (special ones behind the
    0xFF marker), EOS and BOS ids, and a text -> ids function (strings only: it raises on bytes,
    which tells the wrapper so)."""

    def __init__(self, tokenizer: Tokenizer, n_vocab: int):
        types = tokenizer.token_types
        self.tokens = [tokenizer.token_to_piece(i) for i in range(tokenizer.n_vocab)]
        # rows past the tokenizer's (a padded output matrix) are never allowed: no bytes
        self.tokens += [b""] * (n_vocab - len(self.tokens))
        self.special_token_ids = [i for i, (t, kind) in enumerate(zip(self.tokens, types.tolist()))
                                  if _special(t, kind)]
        self.eos_token_id = tokenizer.eos_id if tokenizer.eos_id is not None else min(tokenizer.eog_ids)
        self.bos_token_id = tokenizer.bos_id
        self._tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError("text only")
        return self._tokenizer.encode(text, add_special=False)


@functools.lru_cache(maxsize=4)
def ll_tokenizer(tokenizer: Tokenizer, n_vocab: int):
    """llguidance's tokenizer for a model (its token trie: ~0.5 s for a 262k vocabulary, so built
    once per tokenizer). Its EOS set is the end-of-generation ids: any of them ends a complete
    grammar, as any of them ends generation."""
    ll = llguidance()
    eos = sorted(tokenizer.eog_ids) or [_Vocabulary(tokenizer, n_vocab).eos_token_id]
    return ll.LLTokenizer(ll.TokenizerWrapper(_Vocabulary(tokenizer, n_vocab)), eos_token=eos)


class Constraint:
    """One sequence's grammar state: consume tokens, the allowed-token mask of the current state,
    roll back. Depth n is the state after the first n consumed tokens."""

    def __init__(self, grammar: Grammar, tokenizer: Tokenizer, n_vocab: int):
        ll = llguidance()
        self.n_vocab = n_vocab
        self.matcher = ll.LLMatcher(ll_tokenizer(tokenizer, n_vocab), grammar.compiled, log_level=0,
                                    limits=ll.LLParserLimits(verbose_errors=False))
        if self.matcher.is_error():
            raise UserError(f"{grammar.label}: {one_line(self.matcher.get_error())}")
        self.tokens: list[int] = []         # consumed, in order
        self.complete: list[bool] = []      # complete[j]: only EOS may follow tokens[:j + 1]
        # depth -> the mask as a logits bias [n_vocab] (float32: 0 allowed, -inf forbidden). Added
        # to a row, not masked_fill'ed: that branches on every token, 1.3 ms on Gemma 3's 262,144
        # (half allowed: mispredicted), the add 44 us whatever the mask (scripts/bench_constraint.py)
        self.masks: dict[int, torch.Tensor] = {}
        self._bits = np.zeros((n_vocab + 31) // 32, np.int32)

    @property
    def depth(self) -> int:
        return len(self.tokens)

    def finished(self, n: int) -> bool:
        """Whether the grammar is complete after the first n tokens: nothing but an end-of-generation
        token may follow, so generation ends there as at one."""
        return n > 0 and self.complete[n - 1]

    def bias(self, depth: int | None = None) -> torch.Tensor:
        """The mask at `depth` (default: the current state) as a logits bias [n_vocab]: 0 for an
        allowed token, -inf for a forbidden one; computed at the current state or kept from when
        the constraint was there."""
        depth = self.depth if depth is None else depth
        bias = self.masks.get(depth)
        if bias is None:
            if depth != self.depth:
                raise ValueError(f"no mask kept for depth {depth} (the constraint is at {self.depth})")
            self.matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
            self._check()
            bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[:self.n_vocab].astype(np.int32)
            bits -= 1
            bits &= NEG_INF_BITS
            bias = self.masks[depth] = torch.from_numpy(bits.view(np.float32))
            for old in [d for d in self.masks if d < depth - KEEP_DEPTHS]:
                del self.masks[old]
        return bias

    def allowed(self, depth: int | None = None) -> torch.Tensor:
        """The allowed-token mask [n_vocab] (bool) at `depth`, as `bias`."""
        return self.bias(depth) == 0

    def apply(self, logits_row: torch.Tensor, ids: torch.Tensor | None = None, depth: int | None = None) -> bool:
        """Set the logits of forbidden tokens to -inf, in place: a row over the vocabulary, or over
        the tokens `ids` (a draft head's rows). False when it allows none of them."""
        bias = self.bias(depth)
        if bias.device != logits_row.device:        # a placed model's output head on the device
            bias = bias.to(logits_row.device, non_blocking=True)
        if ids is None:
            logits_row.add_(bias)
            return True
        bias = bias[ids.to(bias.device)]
        logits_row.add_(bias)
        return bool((bias == 0).any())

    def advance(self, token: int) -> None:
        """Consume `token` (drawn from a row this constraint masked)."""
        if not self.matcher.consume_token(token):
            raise UserError(f"the grammar refused token {token}: {one_line(self.matcher.get_error())}")
        self.tokens.append(token)
        self.complete.append(self.matcher.is_stopped())

    def rollback_to(self, depth: int) -> None:
        """Undo the tokens past the first `depth`, with the masks kept for their states."""
        n = self.depth - depth
        if n < 0:
            raise ValueError(f"cannot roll back to depth {depth}: the constraint is at {self.depth}")
        if n:
            if not self.matcher.rollback(n):
                self._check()
            del self.tokens[depth:], self.complete[depth:]
            for d in [d for d in self.masks if d > depth]:
                del self.masks[d]

    def follow(self, depth: int, tokens: list[int]) -> int:
        """Make the state the one after the first `depth` tokens and the longest allowed prefix of
        `tokens`; returns that prefix's length. What a draft source already consumed (a model
        source drafts under the masks) is kept; a lookup's drafts are checked one by one."""
        same = 0
        while same < len(tokens) and depth + same < self.depth and self.tokens[depth + same] == tokens[same]:
            same += 1
        self.rollback_to(depth + same)
        for i in range(same, len(tokens)):
            if self.finished(self.depth) or self.bias()[tokens[i]] != 0:
                return i
            self.advance(tokens[i])
        return len(tokens)

    def mask_rows(self, logits: torch.Tensor, depth: int, n: int) -> None:
        """Mask rows 0..n-1 of `logits` with the states at depth .. depth + n - 1 (a verify: row i
        follows the certain token and the drafts before it)."""
        for i in range(n):
            self.apply(logits[i], depth=depth + i)

    def _check(self) -> None:
        if self.matcher.is_error():
            raise UserError(f"grammar: {one_line(self.matcher.get_error())}")
