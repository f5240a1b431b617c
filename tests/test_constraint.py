"""Constrained decoding (hybridrt/decoding/constraint.py): the vocabulary llguidance sees, masks and
rollback, outputs that validate against random JSON schemas and fullmatch regexes, greedy parity of
constrained speculation with constrained plain decoding for every draft source, the masked target
distribution under sampled speculation (with a negative control), and the run command's flags."""
from __future__ import annotations

import json
import random
import re
import subprocess
import sys

import jsonschema
import numpy as np
import pytest
import torch

import make_model
from hybridrt.cli.options import GrammarFlags
from hybridrt.decoding.constraint import MAX_DIGITS_INTEGER, Constraint, Grammar, generation_schema, ll_tokenizer
from hybridrt.decoding.generate import generate
from hybridrt.decoding.sampling import SamplerConfig, dense_probs
from hybridrt.decoding.speculative.acceptance import SampledAcceptor
from hybridrt.decoding.speculative.draft import DraftPicker
from hybridrt.decoding.speculative.draft_forced import ForcedSource
from hybridrt.decoding.speculative.loop import SpecConfig
from hybridrt.decoding.speculative.sources import build_source
from hybridrt.errors import UserError
from hybridrt.files.gguf_file import GGUFFile
from hybridrt.files.tokenizer import Tokenizer
from hybridrt.runtime.loader import load_model
from tests.real_models import GEMMA3, SMOLLM2, require
from tests.test_cli_errors import run_cli
from tests.test_spec_acceptance import tv, tv_bound

GREEDY = SamplerConfig(temp=0.0)
SAMPLED = SamplerConfig(temp=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=0)

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def qwen3(tiny_qwen3):
    return load_model(tiny_qwen3)


@pytest.fixture(scope="module")
def qwen35(tiny_qwen35_mtp):
    return load_model(tiny_qwen35_mtp)


def text_of(model, tokens) -> str:
    """The output's bytes as the grammar saw them (each token's piece, nothing stripped)."""
    return b"".join(model.tokenizer.token_to_piece(t) for t in tokens).decode("utf-8")


def constrained(model, grammar: Grammar, ids, n=300, sampler=GREEDY, spec_type="none", n_max=3, source_of=None,
                **kw):
    """(tokens, stats) of one constrained generation, plain or with a draft source."""
    spec = SpecConfig(n_max=n_max)
    session = model.session(512, k_max=spec.k_max if spec_type != "none" or source_of else 1)
    source = source_of(session, spec) if source_of else build_source(spec_type, session, sampler, spec, **kw)
    constraint = Constraint(grammar, model.tokenizer, model.n_vocab)
    return generate(model, session, ids, n, sampler, source, spec, constraint=constraint)


def prompt(model, text="Answer in JSON:"):
    return model.tokenize(text, add_special=True)


# ------------------------------------------------------------------------------ the vocabulary
@pytest.mark.parametrize("which", ["tiny", "smollm2", "gemma3"])
def test_llguidance_sees_the_gguf_vocabulary(which, tiny_qwen35_mtp):
    """Token bytes as llama.cpp renders them (byte-level BPE, SentencePiece with byte tokens), control
    tokens special, the end-of-generation ids as EOS."""
    path = tiny_qwen35_mtp if which == "tiny" else require(SMOLLM2 if which == "smollm2" else GEMMA3)
    tok = Tokenizer.from_gguf(GGUFFile(path).metadata)
    ll = ll_tokenizer(tok, tok.n_vocab)
    assert ll.vocab_size == tok.n_vocab
    assert set(ll.eos_tokens) == set(tok.eog_ids)
    rng = np.random.default_rng(0)
    for t in rng.integers(0, tok.n_vocab, 300).tolist() + sorted(tok.eog_ids):
        if ll.is_special_token(t):
            # control, unknown, user-defined tags; and a lone 0xFF byte, llguidance's marker byte (never
            # in UTF-8 text, so never allowed by a grammar over text)
            assert tok.token_types[t] in (3, 2, 4) or tok.token_to_piece(t).startswith(b"\xff"), t
        else:
            assert ll.decode_bytes([t]) == tok.token_to_piece(t), t
    for t in tok.eog_ids:
        assert ll.is_special_token(t)
    text = "Hello, world! {\"a\": [1, 2]} \u00e9\u4e2d"
    assert ll.decode_bytes(ll.tokenize_str(text)) == text.encode()


# ------------------------------------------------------------------------------ masks, rollback
def test_masks_advance_and_roll_back(qwen3):
    tok = qwen3.tokenizer
    c = Constraint(Grammar("regex", r"(cat|dog) [0-9]{2}"), tok, qwen3.n_vocab)
    first = c.allowed().clone()
    assert not first[tok.encode("x", add_special=False)[0]]
    for word in ("cat", "dog"):
        assert all(first[t] for t in tok.encode(word, add_special=False)[:1])
    tokens = tok.encode("dog 42", add_special=False)
    for i, t in enumerate(tokens):
        assert c.allowed()[t] and not c.finished(c.depth)
        c.advance(t)
    assert c.finished(c.depth)
    after = c.allowed().clone()
    assert set(torch.nonzero(after).flatten().tolist()) <= set(tok.eog_ids)
    c.rollback_to(1)
    assert c.depth == 1 and c.tokens == tokens[:1] and not c.finished(1)
    c.rollback_to(0)
    assert torch.equal(c.allowed(), first)
    # follow(): a proposal is kept up to its first forbidden token, a consumed prefix reused
    bad = tok.encode("dog x", add_special=False)
    assert c.follow(0, bad) == len(tok.encode("dog ", add_special=False))
    assert c.follow(0, tokens) == len(tokens) and c.finished(c.depth)
    with pytest.raises(UserError, match="refused"):
        c.rollback_to(0)
        c.advance(tok.encode("x", add_special=False)[0])


def flags(grammar=None, json_schema=None, regex=None):
    return GrammarFlags(grammar, json_schema, regex).check()


def test_generation_schema_closes_listed_objects_and_bounds_integers():
    """llama.cpp's defaults, only where the schema leaves things open: what generation reads still
    accepts nothing the schema refuses (the outputs stay valid against the schema as given)."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "m": {"type": "integer", "maximum": 3},
                                               "any": {"type": "object"},
                                               "open": {"type": "object", "properties": {"a": {}},
                                                        "additionalProperties": True}},
              "$defs": {"x": {"type": "integer", "enum": [1]}}}
    out = generation_schema(schema)
    assert out["additionalProperties"] is False
    assert out["properties"]["n"] == {"type": "integer", "maximum": MAX_DIGITS_INTEGER, "minimum": -MAX_DIGITS_INTEGER}
    assert out["properties"]["m"]["maximum"] == 3 and out["properties"]["m"]["minimum"] == -MAX_DIGITS_INTEGER
    assert out["properties"]["any"] == {"type": "object"} and out["properties"]["open"]["additionalProperties"] is True
    assert out["$defs"]["x"]["enum"] == [1] and schema["properties"]["n"] == {"type": "integer"}     # a copy
    assert flags(json_schema='{"type": "object", "properties": {"a": {}}}').text == \
        '{"type": "object", "properties": {"a": {}}, "additionalProperties": false}'


def test_bad_grammars_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="--regex"):
        flags(regex="(unclosed")
    with pytest.raises(UserError, match="--json-schema: not JSON"):
        flags(json_schema="{not json")
    (tmp_path / "list.json").write_text("[1]")
    with pytest.raises(UserError, match="--json-schema: a schema is a JSON object"):
        flags(json_schema=str(tmp_path / "list.json"))
    with pytest.raises(UserError, match="--json-schema"):
        flags(json_schema='{"type": "integer", "minimum": 5, "maximum": 1}')
    bad = tmp_path / "g.lark"
    bad.write_text("start: foo\n")          # an undefined rule
    with pytest.raises(UserError, match="--grammar"):
        flags(grammar=bad)
    with pytest.raises(UserError, match="no such file"):
        flags(grammar=tmp_path / "missing.lark")
    with pytest.raises(UserError, match="not several"):
        flags(json_schema='{"type": "object"}', regex="a+")
    schema = tmp_path / "s.json"
    schema.write_text('{"type": "boolean"}')
    assert flags(json_schema=str(schema)).text == '{"type": "boolean"}'
    gbnf = tmp_path / "g.gbnf"               # llama.cpp's grammar syntax is converted
    gbnf.write_text('root ::= "yes" | "no"\n')
    assert flags(grammar=gbnf).kind == "grammar"
    assert flags() is None


# ------------------------------------------------------------------------------ outputs are valid
def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A JSON schema whose every instance is bounded (so a random model's output ends): bounded
    integers and strings, enums, consts, short arrays, closed objects, anyOf."""
    kinds = ["integer", "boolean", "enum", "string", "pattern", "null", "const"]
    if depth < 2:
        kinds += ["array", "object", "object", "anyOf"]
    kind = rng.choice(kinds)
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 500)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "null":
        return {"type": "null"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", 1, 2, None, True, "a b", "\u00e9t\u00e9"], rng.randint(1, 4))}
    if kind == "const":
        return {"const": rng.choice(["yes", 7, False])}
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(2, 8)}
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice([r"^[a-z]{1,6}$", r"^[0-9]{3}-[0-9]{2}$", r"^(ab|cd)+x?$"]),
                "maxLength": 12}
    if kind == "array":
        lo = rng.randint(0, 2)
        return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": lo, "maxItems": lo + rng.randint(0, 2)}
    if kind == "anyOf":
        return {"anyOf": [random_schema(rng, depth + 1) for _ in range(rng.randint(2, 3))]}
    names = rng.sample(["id", "name", "tags", "ok", "score", "kind", "data"], rng.randint(1, 4))
    props = {n: random_schema(rng, depth + 1) for n in names}
    return {"type": "object", "properties": props, "required": rng.sample(names, rng.randint(0, len(names))),
            "additionalProperties": False}


@pytest.mark.parametrize("seed", range(16))
def test_outputs_validate_against_random_schemas(qwen3, seed):
    """A random model (the tiny one, sampled at temp 1 over the whole vocabulary: it wants any token)
    under a random schema: every output parses and validates, and ends where the schema is complete."""
    schema = random_schema(random.Random(seed))
    grammar = flags(json_schema=json.dumps(schema))
    sampler = SamplerConfig(temp=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed)
    out, stats = constrained(qwen3, grammar, prompt(qwen3), n=600, sampler=sampler)
    assert stats.stopped_by in ("grammar", "eog"), (schema, stats.stopped_by, text_of(qwen3, out))
    jsonschema.validate(json.loads(text_of(qwen3, out)), schema)


def real_schema_outputs(model, n_cases: int, first_seed: int = 1000):
    """(schema, output text, stopped_by) of greedy chat generations on a real model, one random schema each."""
    for seed in range(first_seed, first_seed + n_cases):
        schema = random_schema(random.Random(seed))
        text = model.tokenizer.apply_chat_template([{"role": "user", "content": (
            f"Reply with JSON that matches this schema: {json.dumps(schema)}")}], add_generation_prompt=True)
        out, stats = constrained(model, flags(json_schema=json.dumps(schema)),
                                 model.tokenize(text, add_special=True, parse_special=True), n=400)
        yield schema, text_of(model, out), stats.stopped_by


@pytest.mark.slow
@pytest.mark.parametrize("path", [SMOLLM2, GEMMA3], ids=["smollm2", "gemma3"])
def test_real_models_validate_200_random_schemas(path):
    """Issue 58's target: every constrained output valid over 200 random schemas, on both real models."""
    model = load_model(require(path))
    for schema, text, stopped_by in real_schema_outputs(model, 200):
        assert stopped_by in ("grammar", "eog"), (schema, text)
        jsonschema.validate(json.loads(text), schema)


REGEXES = [r"[a-z]{3,8}@[a-z]{2,5}\.(com|org)", r"[0-9]{3}-[0-9]{4}", r"(yes|no|maybe)",
           r"[A-Z][a-z]{0,6}( [A-Z][a-z]{0,6}){0,3}\.", r"\((-?[0-9]{1,3}, ){2}-?[0-9]{1,3}\)"]


@pytest.mark.parametrize("pattern", REGEXES)
def test_outputs_fullmatch_the_regex(qwen35, pattern):
    for sampler in (GREEDY, SAMPLED):
        out, stats = constrained(qwen35, flags(regex=pattern), prompt(qwen35), n=200,
                                 sampler=sampler)
        assert stats.stopped_by in ("grammar", "eog")
        assert re.fullmatch(pattern, text_of(qwen35, out)), (pattern, text_of(qwen35, out))


def test_a_complete_grammar_stops_generation_without_eos(qwen3):
    """With no stop tokens at all (--ignore-eos), the output still ends where the grammar does."""
    spec = SpecConfig()
    constraint = Constraint(Grammar("regex", "(ab){3}"), qwen3.tokenizer, qwen3.n_vocab)
    out, stats = generate(qwen3, qwen3.session(128), prompt(qwen3), 50, GREEDY, None, spec, stop_ids=set(),
                          constraint=constraint)
    assert text_of(qwen3, out) == "ababab" and stats.stopped_by == "grammar"


# ------------------------------------------------------------------------------ exact under speculation
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "tags": {"type": "array", "items": {"enum": ["ab", "cd", "ef"]},
                                                    "maxItems": 6},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "tags", "n"], "additionalProperties": False}
REPEAT = r"(ab|cd)(, (ab|cd)){12,20}\."     # repetitive, so prompt lookup drafts


def parity(model, grammar, ids, source_of, n_max_list=(1, 3, 6), sampler=GREEDY):
    ref, _ = constrained(model, grammar, ids, sampler=sampler)
    assert ref
    for n_max in n_max_list:
        out, stats = constrained(model, grammar, ids, n_max=n_max, sampler=sampler, source_of=source_of)
        assert out == ref, (n_max, text_of(model, out), text_of(model, ref))
    return ref, stats


def test_parity_draft_mtp(qwen35):
    grammar = Grammar("json_schema", json.dumps(SCHEMA))
    ids = prompt(qwen35)
    _, stats = parity(qwen35, grammar, ids, lambda s, spec: build_source("draft-mtp", s, GREEDY, spec))
    assert sum(stats.spec.drafted) > 0


def test_parity_ngram(qwen3):
    grammar = Grammar("regex", REPEAT)
    ids = prompt(qwen3, "ab, cd, ab, cd, ab, cd, ab, cd, ab, cd, ab, cd")
    _, stats = parity(qwen3, grammar, ids, lambda s, spec: build_source("ngram-simple", s, GREEDY, spec))
    assert sum(stats.spec.drafted) > 0


def test_parity_draft_simple(qwen3, tmp_path):
    draft = load_model(make_model.write_model(tmp_path / "draft.gguf", "qwen3", seed=1))
    grammar = Grammar("json_schema", json.dumps(SCHEMA))
    parity(qwen3, grammar, prompt(qwen3),
           lambda s, spec: build_source("draft-simple", s, GREEDY, spec, draft_model=draft))


def test_parity_with_drafts_the_grammar_forbids(qwen3):
    """Forced drafts: the constrained output itself with tokens corrupted at random, so proposals are
    cut at forbidden tokens, rejected where allowed but wrong, and rolled back."""
    grammar = Grammar("json_schema", json.dumps(SCHEMA))
    ids = prompt(qwen3)
    ref, _ = constrained(qwen3, grammar, ids)
    for corrupt in (0.0, 0.3, 1.0):
        out, stats = constrained(qwen3, grammar, ids, n_max=4, source_of=lambda s, spec: ForcedSource(
            None, ref, len(ids), qwen3.n_vocab, corrupt, seed=3))
        assert out == ref, corrupt
        if corrupt == 0.0:
            assert stats.spec.acceptance_rate == 1.0


def test_sampled_speculation_keeps_outputs_valid(qwen35):
    """Sampled drafts from the masked head, sampled acceptance on masked rows: every output valid."""
    for seed in range(4):
        sampler = SamplerConfig(temp=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed)
        out, stats = constrained(qwen35, Grammar("json_schema", json.dumps(SCHEMA)), prompt(qwen35), n=400,
                                 sampler=sampler, spec_type="draft-mtp", n_max=4)
        assert sum(stats.spec.drafted) > 0
        jsonschema.validate(json.loads(text_of(qwen35, out)), SCHEMA)


# ------------------------------------------------------------------------------ the masked distribution
CFG = SamplerConfig(temp=0.8, top_k=0, top_p=1.0, min_p=0.0)
TRIALS = 6000


def speculative_counts(tok, n_vocab, stale_rows=False):
    """One sampled speculative step under a grammar, TRIALS times: two drafts from a draft model's
    rows masked as the loop masks them (DraftPicker), the verify rows masked with the state after the
    drafts before each (Constraint.mask_rows), SampledAcceptor; rolled back after each step.
    Returns the counts of the first emitted token, of the second given each first, and the target
    rows. `stale_rows`: every verify row masked with the step's first state (a loop that forgets to
    advance the constraint through the drafts): the negative control."""
    g = torch.Generator().manual_seed(7)
    # flat rows: the grammar's few allowed tokens each get a fair share, so every first token is
    # followed often enough to test the second's distribution
    target = torch.randn(3, n_vocab, generator=g) * 0.5
    draft_logits = target[:2] + torch.randn(2, n_vocab, generator=g) * 0.5
    constraint = Constraint(Grammar("regex", r"(a[bc]|b[ac]|c[ab])[a-c]"), tok, n_vocab)
    picker = DraftPicker(CFG, torch.Generator().manual_seed(1))
    picker.constraint = constraint
    acceptor = SampledAcceptor(n_vocab, CFG, torch.Generator().manual_seed(2))
    first = np.zeros(n_vocab)
    second: dict[int, np.ndarray] = {}
    for _ in range(TRIALS):
        draft = picker.start()
        for i in range(2):
            if not picker.add(draft, draft_logits[i].clone()) or not picker.wants(i + 1):
                break
        rows = target.clone()
        if stale_rows:
            for i in range(len(draft) + 1):
                constraint.apply(rows[i], depth=0)
        else:
            constraint.mask_rows(rows, 0, len(draft) + 1)
        verdict = acceptor(rows, draft)
        out = draft.tokens[:verdict.n_accepted] + [verdict.next_token]
        first[out[0]] += 1
        if len(out) > 1:
            second.setdefault(out[0], np.zeros(n_vocab))[out[1]] += 1
        constraint.rollback_to(0)
    return first, second, target, constraint


def masked_p(row: torch.Tensor, constraint: Constraint, prefix: list[int]) -> np.ndarray:
    constraint.rollback_to(0)
    for t in prefix:
        constraint.advance(t)
    row = row.clone()
    constraint.apply(row)
    constraint.rollback_to(0)
    return dense_probs(row.unsqueeze(0), CFG)[0].numpy().astype(np.float64)


def test_sampled_speculation_keeps_the_masked_distribution(qwen3):
    first, second, target, c = speculative_counts(qwen3.tokenizer, qwen3.n_vocab)
    p0 = masked_p(target[0], c, [])
    assert tv(first, p0) <= tv_bound(p0, TRIALS)
    checked = 0
    for t, counts in second.items():
        if counts.sum() >= 500:             # the second token after a kept first draft ~ p[1] masked after it
            p1 = masked_p(target[1], c, [t])
            assert tv(counts, p1) <= tv_bound(p1, int(counts.sum())), t
            checked += 1
    assert checked >= 2


def test_stale_verify_masks_are_caught(qwen3):
    """Negative control: verify rows masked with the step's first state put mass on tokens the
    grammar forbids after the first one, and the TV bound fails."""
    _, second, target, c = speculative_counts(qwen3.tokenizer, qwen3.n_vocab, stale_rows=True)
    worst = 0.0
    for t, counts in second.items():
        if counts.sum() >= 500:
            p1 = masked_p(target[1], c, [t])
            worst = max(worst, tv(counts, p1) / tv_bound(p1, int(counts.sum())))
    assert worst > 1.0


# ------------------------------------------------------------------------------ real models, the CLI
def test_smollm2_json_schema_with_speculation():
    """SmolLM2 (gpt2-style BPE): a JSON schema, greedy, plain and with prompt lookup, same output."""
    model = load_model(require(SMOLLM2))
    ids = model.tokenize("A person record as JSON: ", add_special=True)
    grammar = Grammar("json_schema", json.dumps(SCHEMA))
    ref, _ = constrained(model, grammar, ids, n=80)
    jsonschema.validate(json.loads(text_of(model, ref)), SCHEMA)
    out, _ = constrained(model, grammar, ids, n=80, spec_type="ngram-simple")
    assert out == ref


def test_run_flags(tiny_qwen3, tmp_path):
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps(SCHEMA))
    ok = run_cli("run", "-m", str(tiny_qwen3), "-p", "x", "--temp", "0", "-n", "200", "--no-warmup",
                 "--no-display-prompt", "--json-schema", str(schema))
    assert ok.returncode == 0, ok.stderr
    jsonschema.validate(json.loads(ok.stdout), SCHEMA)
    ok = run_cli("run", "-m", str(tiny_qwen3), "-p", "x", "--temp", "0", "-n", "50", "--no-warmup",
                 "--no-display-prompt", "--regex", "[0-9]{4}")
    assert ok.returncode == 0 and re.fullmatch("[0-9]{4}\n", ok.stdout), ok.stdout
    # bad flags fail before the model loads (the rest of them: test_bad_grammars_are_user_errors)
    r = run_cli("run", "-m", str(tiny_qwen3), "-p", "x", "--regex", "(")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stderr.startswith("error: --regex")


def test_missing_llguidance_is_one_error_line(tiny_qwen3):
    code = ("import sys; sys.modules['llguidance'] = None; from hybridrt.cli.commands import main; "
            "sys.argv = ['hybridrt', 'run', '-m', sys.argv[1], '-p', 'x', '--regex', 'a']; main()")
    r = subprocess.run([sys.executable, "-c", code, str(tiny_qwen3)], capture_output=True, text=True)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "pip install" in r.stderr and r.stderr.startswith("error: ")
