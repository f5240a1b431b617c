"""`hybridrt train-mtp` and trained MTP heads on tiny files: the torch teacher and head against
hybridrt's own forward, the head GGUF round trip, target mismatch errors, determinism and resume,
greedy parity with a trained head (llama, and qwen35 replacing its built-in head), and exact
sampled acceptance with a reduced draft vocabulary (q zero off it), with a negative control."""
from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

import make_model
from cpu_kernels.dequant import dequantize
from gpu_kernels.norms import rms_norm
from hybridrt.errors import UserError
from hybridrt.decoding.generate import generate
from hybridrt.files.gguf_file import GGUFFile
from hybridrt.runtime.loader import load_model
from hybridrt.models.mtp_head import TrainedMTPHead, head_attention_spec, head_target, write_head
from hybridrt.models.qwen35 import NextNHead
from hybridrt.decoding.sampling import SamplerConfig, dense_probs
from hybridrt.decoding.speculative.acceptance import SampledAcceptor
from hybridrt.decoding.speculative.loop import SpecConfig
from hybridrt.decoding.speculative.sources import build_source
from hybridrt.train_mtp import train as train_module
from hybridrt.train_mtp.config import TrainConfig
from hybridrt.train_mtp.train import train_mtp
from hybridrt.train_mtp.torch_model import MTPHeadModule, TorchTeacher, initial_head_tensors, read_f32

pytestmark = pytest.mark.usefixtures("single_thread")

TINY = TrainConfig(tokens=96, steps=4, draft_vocab=48, seed=3, batch=4, gen_len=16, heldout_len=12,
                   eval_every=2, patience=10)
GREEDY = SamplerConfig(temp=0.0)


def _train(model_path, out, cfg=TINY, **load):
    m = load_model(model_path, exact_activations=True, **load)
    return train_mtp(m, out, cfg, quiet=True)


@pytest.fixture(scope="module")
def llama_head(tiny_llama, tmp_path_factory):
    return _train(tiny_llama, tmp_path_factory.mktemp("heads") / "llama.mtp.gguf").path


@pytest.fixture(scope="module")
def qwen35_head(tiny_qwen35_mtp, tmp_path_factory):
    return _train(tiny_qwen35_mtp, tmp_path_factory.mktemp("heads") / "qwen35.mtp.gguf").path


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen3"])
def test_torch_teacher_matches_hybridrt(arch, tmp_path):
    """The batched torch teacher (left-padded prompts, incremental KV) gives hybridrt's logits (on
    hybridrt's float16 cache, `run`'s default: the teacher keeps its cache in float16), within 5e-4:
    the two forwards' float32 differences now and then round a stored value to the next float16
    (against hybridrt's float32 cache the gap is 2e-3)."""
    path = make_model.write_model(tmp_path / f"{arch}.gguf", arch, seed=1)
    m = load_model(path, exact_activations=True)
    teacher = TorchTeacher(m, head_target(arch), 64)
    g = torch.Generator().manual_seed(0)
    a, b = torch.randint(3, 200, (9,), generator=g).tolist(), torch.randint(3, 200, (5,), generator=g).tolist()
    ref = {}
    for ids in (a, b):
        ref[len(ids)] = m.session(64, "f16", k_max=1).eval(ids, logits="last")[0]
    # prefill both, left-padded, then one token each: compare against hybridrt at both steps
    pad = torch.tensor([0, 4])
    tokens = torch.tensor([a, [0] * 4 + b])
    slots = torch.arange(9)[None].expand(2, -1)
    pos, valid = (slots - pad[:, None]).clamp(min=0), slots >= pad[:, None]
    caches = teacher.new_caches(2)
    out, _ = teacher.step(tokens, pos, pos, valid, caches)
    assert torch.allclose(out[0], ref[9], atol=5e-4) and torch.allclose(out[1], ref[5], atol=5e-4)
    nxt = torch.tensor([[7], [11]])
    k_pos = torch.cat((pos, pos[:, -1:] + 1), 1)
    out, _ = teacher.step(nxt, k_pos[:, -1:], k_pos, torch.cat((valid, torch.ones(2, 1, dtype=torch.bool)), 1), caches)
    for row, ids in zip(out, (a + [7], b + [11])):
        assert torch.allclose(row, m.session(64, "f16", k_max=1).eval(ids, logits="last")[0], atol=5e-4)


def test_bfloat16_teacher_decodes_near_hybridrt(tiny_llama):
    """The teacher train-mtp runs where the CPU has bfloat16 (bfloat16 matrices, a float16 KV cache,
    decode attention in cpu_kernels.attention_batch): its continuation's hiddens stay within
    bfloat16 rounding of hybridrt's float32 forward over the same tokens."""
    m = load_model(tiny_llama, exact_activations=True)
    teacher = TorchTeacher(m, head_target("llama"), 64, dtype=torch.bfloat16)
    assert teacher.new_caches(1)[0]["k"].dtype == torch.float16
    prompt = [5, 9, 17, 33, 2]
    (cont, hidden), = teacher.generate([prompt], 12, [1.0], torch.Generator().manual_seed(3), set())
    session = m.session(64, k_max=1)
    session.eval(prompt + cont, logits="none")
    cos = torch.nn.functional.cosine_similarity(hidden, session.hidden, dim=-1)
    assert cos.min() > 0.995, cos


def test_teacher_generate_returns_hybridrt_hiddens_and_turns_greedy(tiny_llama):
    """generate's hiddens are hybridrt's final-normed hiddens of prompt + continuation, and after
    greedy_after sampled tokens every token is the target's argmax."""
    m = load_model(tiny_llama, exact_activations=True)
    teacher = TorchTeacher(m, head_target("llama"), 64)
    prompts = [[5, 9, 17, 33, 2], [40, 41]]
    out = teacher.generate(prompts, 10, [1.0, 0.0], torch.Generator().manual_seed(2), set(), greedy_after=[4, 0])
    for (ids, switch), (cont, hidden) in zip(zip(prompts, [4, 0]), out):
        assert len(cont) == 10 and hidden.shape == (len(ids) + 10, m.n_embd)
        session = m.session(64, "f16", k_max=1)
        logits = session.eval(ids + cont, logits="all")
        assert torch.allclose(hidden, session.hidden, atol=1e-4)
        greedy = logits.argmax(-1)[len(ids) - 1:-1]           # the argmax before each continuation token
        assert greedy[switch:].tolist() == cont[switch:]


def test_teacher_prefills_repeated_prompts_once_and_reuses_its_buffers(tiny_llama):
    """A batch repeating a prompt (prefilled once, its cache rows copied) continues every copy as a
    batch of distinct prompts would, and a teacher whose KV / logits buffers held an earlier,
    larger batch writes what a fresh teacher writes."""
    m = load_model(tiny_llama, exact_activations=True)
    a, b = [5, 9, 17, 33, 2], [40, 41]
    used = TorchTeacher(m, head_target("llama"), 64)
    used.generate([[7, 8, 9, 10, 11, 12, 13], a, b, [3, 4]], 12, [1.0] * 4, torch.Generator().manual_seed(5), set())
    repeated = used.generate([a, b, a, b, a], 10, [0.0] * 5, torch.Generator().manual_seed(2), set())
    fresh = TorchTeacher(m, head_target("llama"), 64).generate([a, b], 10, [0.0] * 2, torch.Generator().manual_seed(2), set())
    for i, (cont, hidden) in enumerate(repeated):
        want_cont, want_hidden = fresh[i % 2]
        assert cont == want_cont
        assert torch.allclose(hidden, want_hidden, atol=1e-5)


def test_teacher_drops_finished_sequences_from_its_batch(tiny_llama):
    """Sequences that end early leave the batch (their slots refilled from the live ones above the
    new size): every continuation and hidden stays what a batch keeping them writes."""
    m = load_model(tiny_llama, exact_activations=True)
    teacher = TorchTeacher(m, head_target("llama"), 64)
    prompts = [[5, 9, 17], [40, 41], [7, 8, 9, 10], [3, 4], [60, 2, 9], [11], [5, 9, 17], [40, 41]]
    # hot temperatures: the tiny random model, sampled at 1, mostly repeats its last token
    temps, switch = [8.0, 8.0, 0.0, 8.0, 6.0, 8.0, 8.0, 6.0], [14, 6, 0, 14, 3, 14, 14, 9]

    def run(stop, compact_at):
        return teacher.generate(prompts, 14, temps, torch.Generator().manual_seed(1), stop, switch, compact_at=compact_at)

    free = run(set(), None)
    # stop tokens met at different steps, the rest of the sequences running to the end: each one
    # taken adds a new end step and leaves at least half the sequences running
    stop: set[int] = set()

    def ends_with(stops):
        return [next((j + 1 for j, t in enumerate(c) if t in stops), 14) for c, _ in free]

    for c, _ in free:
        for t in c[1:12]:
            e, now = ends_with(stop | {t}), ends_with(stop)
            if len(set(e)) > len(set(now)) and e.count(14) >= len(prompts) // 2:
                stop.add(t)
                break
    ends = ends_with(stop)
    assert min(ends) < 14 and max(ends) == 14 and len(set(ends)) >= 3, ends
    kept, dropped = run(stop, 10**6), run(stop, 1)
    for (c_kept, h_kept), (c_drop, h_drop), (c_free, _), n in zip(kept, dropped, free, ends):
        assert c_kept == c_drop == c_free[:n]
        assert torch.allclose(h_kept, h_drop, atol=1e-5)


def test_teacher_restricted_output_picks_among_the_kept_ids(tiny_llama):
    """restrict_output: later steps pick greedy tokens as the argmax over the kept ids (of the target's
    own logits), sampled ones among them; keeping every id writes what the unrestricted teacher
    writes; by default it keeps what earlier steps ranked in their top-k."""
    m = load_model(tiny_llama, exact_activations=True)
    prompts = [[5, 9, 17, 33, 2], [40, 41], [7, 8, 9]]
    gen = lambda: torch.Generator().manual_seed(3)      # noqa: E731
    teacher = TorchTeacher(m, head_target("llama"), 64)
    full = teacher.generate(prompts, 12, [0.0, 1.5, 0.0], gen(), set(), greedy_after=[0, 12, 0], top_k=8)
    ranked = teacher.ranked.clone()
    assert 8 <= int(ranked.sum()) < m.n_vocab
    assert all(ranked[c].all() for c, _ in full)        # a step picks among its top-k
    assert teacher.restrict_output(torch.ones(m.n_vocab, dtype=torch.bool)) == m.n_vocab
    same = teacher.generate(prompts, 12, [0.0, 1.5, 0.0], gen(), set(), greedy_after=[0, 12, 0], top_k=8)
    assert [c for c, _ in same] == [c for c, _ in full]
    assert teacher.restrict_output() == int(ranked.sum())
    keep = torch.zeros(m.n_vocab, dtype=torch.bool)
    keep[torch.randperm(m.n_vocab, generator=gen())[:m.n_vocab // 4]] = True
    teacher.restrict_output(keep)
    out = teacher.generate(prompts, 12, [0.0, 1.5, 0.0], gen(), set(), greedy_after=[0, 12, 0], top_k=8)
    for ids, (cont, _) in zip(prompts, out):
        assert keep[cont].all()
        logits = m.session(64, "f16", k_max=1).eval(ids + cont, logits="all")[len(ids) - 1:-1]
        masked = logits.masked_fill(~keep, float("-inf"))
        if ids != [40, 41]:                              # the greedy ones
            assert masked.argmax(-1).tolist() == cont
    assert [c for c, _ in out] != [c for c, _ in full]
    # restrict_after: the first steps over every id, the rest over what those ranked
    fresh = TorchTeacher(m, head_target("llama"), 64)
    first = fresh.generate(prompts, 4, [0.0, 1.5, 0.0], gen(), set(), greedy_after=[0, 12, 0], top_k=8)
    ranked4 = fresh.ranked.clone()
    later = TorchTeacher(m, head_target("llama"), 64)
    both = later.generate(prompts, 12, [0.0, 1.5, 0.0], gen(), set(), greedy_after=[0, 12, 0], top_k=8,
                          restrict_after=4)
    assert torch.equal(later.rows, ranked4.nonzero()[:, 0])
    for (c4, _), (c12, _) in zip(first, both):
        assert c12[:4] == c4 and ranked4[c12[4:]].all()


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_wide_head_ffn_starts_as_the_sum_of_the_target_layers_ffns(arch, tmp_path):
    """--head-ffn-layers 2: the block's FFN is the last two layers' FFNs side by side, each one's own
    pre-FFN norm folded in, so on any input it computes their sum (before gemma3's post-FFN norm)."""
    m = load_model(make_model.write_model(tmp_path / f"{arch}.gguf", arch, mix="f32", seed=2), exact_activations=True)
    kind = head_target(arch)
    layer, _ = head_attention_spec(m)
    assert layer >= 1
    x = torch.randn(5, m.n_embd, generator=torch.Generator().manual_seed(0)) * 3
    act = F.silu if kind.act == "silu" else (lambda v: F.gelu(v, approximate="tanh"))

    def ffn(gate, up, down, norm):
        h = rms_norm(x, norm, m.eps)
        return (act(h @ gate.T) * (h @ up.T)) @ down.T

    def target_ffn(i):
        return ffn(*(read_f32(m.gguf, f"blk.{i}.{n}.weight") for n in ("ffn_gate", "ffn_up", "ffn_down", kind.ffn_norm)))

    wide, one = (initial_head_tensors(m, None, kind, 1.0, ffn_layers=n) for n in (2, 1))
    assert wide["ffn_gate"].shape[0] == wide["ffn_down"].shape[1] == 2 * one["ffn_gate"].shape[0]
    want = target_ffn(layer) + target_ffn(layer - 1)
    got = ffn(wide["ffn_gate"], wide["ffn_up"], wide["ffn_down"], wide["ffn_norm"])
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
    assert torch.allclose(ffn(one["ffn_gate"], one["ffn_up"], one["ffn_down"], one["ffn_norm"]), target_ffn(layer), atol=1e-5)
    assert not torch.allclose(target_ffn(layer), want, atol=1e-2)


def test_head_round_trip_and_runtime_matches_torch(tiny_llama, tmp_path):
    """The runtime head (bound from the GGUF) computes what the torch module computed (f32 file)."""
    cfg = dataclasses.replace(TINY, head_type="f32", head_ffn_layers=2)       # a wider FFN than the target's
    m = load_model(tiny_llama, exact_activations=True)
    train_mtp(m, tmp_path / "h.gguf", cfg, quiet=True)
    m = load_model(tiny_llama, exact_activations=True, mtp_head=tmp_path / "h.gguf")
    head = m.mtp
    assert isinstance(head, TrainedMTPHead) and len(head.draft_ids) == TINY.draft_vocab
    n_ff = m.gguf.tensors["blk.0.ffn_gate.weight"].shape[1]
    assert GGUFFile(tmp_path / "h.gguf").tensors["mtp.ffn_gate.weight"].shape[1] == 2 * n_ff
    # on a CPU trunk the head's block runs as the target's layers do: one fused call per half
    from hybridrt.runtime.backends import FusedAttentionBlock, FusedFfnBlock
    fused_trunk = m.binder.config.mode.fused
    assert isinstance(head.attn_half, FusedAttentionBlock) == isinstance(head.ffn_half, FusedFfnBlock) == fused_trunk
    # the torch module rebuilt from the file's tensors
    f = GGUFFile(tmp_path / "h.gguf")
    tensors = {n[len("mtp."):-len(".weight")]: torch.from_numpy(np.array(f.tensor_f32(n))) for n in f.tensors}
    _, spec = head_attention_spec(m)
    module = MTPHeadModule(tensors, spec, head_target("llama"), m.eps, 64)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(3, 200, (6,), generator=g)
    hidden = torch.randn(6, m.n_embd, generator=g)
    session = m.session(64)
    logits, _ = head.step(session.state, tokens, hidden, 1)
    ref = module(m.embed(tokens)[None], hidden[None], torch.arange(1, 7)[None], torch.ones(1, 6, dtype=torch.bool))[0]
    assert logits.shape == (6, TINY.draft_vocab)
    assert torch.allclose(logits, ref.detach(), atol=1e-4, rtol=1e-4)


def test_a_q4_1_head_drafts_what_its_own_weights_give(llama_head, tiny_llama, tmp_path):
    """--head-type q4_1: the writer quantizes the head's matrices to Q4_1 (gguf-py's rounding), the
    runtime computes that head (as the torch module over the file's dequantized tensors does)."""
    def as_f32(f: GGUFFile, name: str) -> np.ndarray:
        info = f.tensors[name]
        return dequantize(f.tensor_bytes(name), info.qtype, info.shape[0]).reshape(list(reversed(info.shape)))

    f = GGUFFile(llama_head)
    tensors = {n: as_f32(f, n) for n in f.tensors}
    m = load_model(tiny_llama, exact_activations=True)
    ids = np.asarray(f.metadata["mtp_head.draft_vocab"])
    write_head(tmp_path / "q41.gguf", tensors, m.gguf, m.n_vocab, ids, "q4_1")
    q = GGUFFile(tmp_path / "q41.gguf")
    assert {q.tensors[n].qtype for n in q.tensors if len(q.tensors[n].shape) >= 2} == {int(GGMLQuantizationType.Q4_1)}
    assert q.tensors["mtp.eh_proj.weight"].nbytes < 0.6 * f.tensors["mtp.eh_proj.weight"].nbytes
    m = load_model(tiny_llama, exact_activations=True, mtp_head=tmp_path / "q41.gguf")
    deq = {n[len("mtp."):-len(".weight")]: torch.from_numpy(as_f32(q, n)) for n in q.tensors}
    _, spec = head_attention_spec(m)
    module = MTPHeadModule(deq, spec, head_target("llama"), m.eps, 64)
    g = torch.Generator().manual_seed(2)
    tokens, hidden = torch.randint(3, 200, (5,), generator=g), torch.randn(5, m.n_embd, generator=g)
    logits, _ = m.mtp.step(m.session(64).state, tokens, hidden, 1)
    ref = module(m.embed(tokens)[None], hidden[None], torch.arange(1, 6)[None], torch.ones(1, 5, dtype=torch.bool))[0]
    assert torch.allclose(logits, ref.detach(), atol=1e-4, rtol=1e-4)
    with pytest.raises(UserError, match="--head-type must be one of f32, f16, q8_0, q4_1"):
        dataclasses.replace(TINY, head_type="q3_k")


def test_a_trained_heads_activations_take_one_int8_pass(llama_head, tiny_llama):
    """A trained head's matrices take one int8 pass on their activations even where the target's
    take two (act_residual): a draft's rounding never reaches the committed tokens, and the second
    pass was ~20 % of a draft. The target keeps its own numerics."""
    m = load_model(tiny_llama, act_residual=True, mtp_head=llama_head)
    head = m.mtp
    assert m.binder.config.act_residual
    assert not head.eh_proj.residual and not head.output.residual
    if m.binder.config.mode.fused:       # the fused halves' operands: path 1 (one pass) for every matrix
        paths = [w[3] for w in head.attn_half.qkv] + [head.attn_half.wo[3], head.ffn_half.down[3]]
        assert paths == [1] * 5
    # a head bound with the target's own setting would have taken the second pass on those
    assert m.binder._residual("mtp.eh_proj.weight") and m.binder._residual("mtp.ffn_down.weight")


def test_mismatched_target_is_refused(llama_head, tiny_llama, tmp_path):
    other = make_model.write_model(tmp_path / "other.gguf", "llama", seed=5)      # same shapes, other weights
    with pytest.raises(UserError, match="trained for another target: its fingerprint"):
        load_model(other, mtp_head=llama_head)
    gemma = make_model.write_model(tmp_path / "g.gguf", "gemma3", seed=0)
    r = subprocess.run([sys.executable, "-c", "from hybridrt.cli.commands import main; main()", "run", "-m", str(gemma),
                        "--mtp-head", str(llama_head), "-p", "hi", "-n", "2"], capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --mtp-head") and "architecture is llama" in lines[0]
    with pytest.raises(UserError, match="not an MTP head file"):
        load_model(tiny_llama, mtp_head=tiny_llama)


def test_training_is_deterministic_and_resumes(tiny_llama, tmp_path, monkeypatch):
    a = _train(tiny_llama, tmp_path / "a.gguf").path.read_bytes()
    assert _train(tiny_llama, tmp_path / "b.gguf").path.read_bytes() == a
    assert _train(tiny_llama, tmp_path / "s.gguf", dataclasses.replace(TINY, seed=4)).path.read_bytes() != a
    # interrupted after the step-2 checkpoint, then run again: the same file as straight through
    real_loss, calls = train_module.loss_of, []

    def interrupted(*args):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_loss(*args)

    monkeypatch.setattr(train_module, "loss_of", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _train(tiny_llama, tmp_path / "r.gguf")
    assert (tmp_path / "r.gguf.ckpt").exists() and not (tmp_path / "r.gguf").exists()
    monkeypatch.setattr(train_module, "loss_of", real_loss)
    calls.clear()
    assert _train(tiny_llama, tmp_path / "r.gguf").path.read_bytes() == a


def test_gradient_clipping_binds_and_is_recorded(tiny_llama, tmp_path):
    """--clip bounds the gradient's norm (a tight bound trains another head than none; the history
    records each interval's largest norm before clipping); a negative bound is one error line."""
    free = _train(tiny_llama, tmp_path / "free.gguf", dataclasses.replace(TINY, clip=0.0))
    tight = _train(tiny_llama, tmp_path / "tight.gguf", dataclasses.replace(TINY, clip=1e-3))
    norms = [h["grad_norm_max"] for h in free.history[1:]]
    assert len(norms) == 2 and min(norms) > 1e-3
    assert [h["grad_norm_max"] for h in tight.history[1:]] != norms
    # the heads after the last step (the checkpoint's; Adam undoes a constant scale, not a per-step one)
    last = [torch.load(f"{r.path}.ckpt", weights_only=False)["head"] for r in (free, tight)]
    assert any(not torch.equal(a, last[1][k]) for k, a in last[0].items())
    with pytest.raises(UserError, match="--clip must be >= 0"):
        dataclasses.replace(TINY, clip=-1.0)


def test_a_checkpoint_made_on_other_text_is_not_resumed(tiny_llama, tmp_path, monkeypatch):
    """The held-out set changed (as the text version or the prompts do): the checkpoint beside the
    output was judged on the old one, so training starts afresh rather than resuming it."""
    _train(tiny_llama, tmp_path / "r.gguf")
    assert (tmp_path / "r.gguf.ckpt").exists()
    monkeypatch.setattr(train_module, "HELDOUT_PROMPTS", train_module.HELDOUT_PROMPTS[:4])
    fresh = _train(tiny_llama, tmp_path / "f.gguf").path.read_bytes()
    assert _train(tiny_llama, tmp_path / "r.gguf").path.read_bytes() == fresh


def test_kl_loss_and_its_gradient_match_float64():
    """distill_loss's hand-written KL backward against autograd of the formula in float64."""
    g = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 31)))
    logits = (3 * torch.randn(37, 300, generator=g)).requires_grad_(True)
    target = 3 * torch.randn(37, 300, generator=g)
    weights = torch.rand(37, generator=g)           # a per-row upstream gradient
    (train_module.distill_loss(logits, target, "kl") * weights).sum().backward()
    x = logits.detach().double().requires_grad_(True)
    logp, logq = torch.log_softmax(target.double(), -1), torch.log_softmax(x, -1)
    want = (logp.exp() * (logp - logq)).sum(-1)
    (want * weights.double()).sum().backward()
    got = train_module.distill_loss(logits.detach(), target, "kl")
    assert torch.allclose(got.double(), want.detach(), rtol=1e-5, atol=1e-6)
    assert torch.allclose(logits.grad.double(), x.grad, rtol=1e-4, atol=1e-7)


def test_n_max_1_walk_skips_the_position_after_a_hit():
    # position 0 comes from the prompt's logits; a hit at p commits p and the bonus token p + 1
    assert train_module.n_max_1_walk([True, True, True, False, True, False, False]) == (2, 4)
    assert train_module.n_max_1_walk([False] * 5) == (0, 4)
    assert train_module.n_max_1_walk([True] * 6) == (3, 3)
    assert train_module.n_max_1_walk([True]) == (0, 0)


def test_heldout_text_is_hybridrts_own_greedy_decoding(tiny_llama, tmp_path):
    """The held-out continuations drafts are judged on are what a run of the target writes (not
    the bfloat16 teacher's text), and both acceptances are written into the head."""
    r = _train(tiny_llama, tmp_path / "h.gguf")
    saved = torch.load(tmp_path / "h.gguf.data.pt", weights_only=False)
    m = load_model(tiny_llama, exact_activations=True)
    for s in saved["heldout"]:
        prompt = s.tokens[:s.n_prompt].tolist()
        ref, _ = generate(m, m.session(256), prompt, TINY.heldout_len, GREEDY, stop_ids=set())
        assert s.tokens[s.n_prompt:].tolist() == ref[:len(s.tokens) - s.n_prompt]
        assert torch.equal(s.argmax[s.n_prompt:len(s.tokens) - 1], s.tokens[s.n_prompt + 1:])
    meta = GGUFFile(r.path).metadata
    assert meta["mtp_head.train.heldout_acceptance"] == pytest.approx(r.acceptance)
    assert meta["mtp_head.train.heldout_acceptance_n_max_1"] == pytest.approx(r.acceptance_n_max_1)
    assert meta["mtp_head.train.heldout_acceptance_lookup_first"] == pytest.approx(r.acceptance_lookup_first)
    assert 0.0 <= r.acceptance_n_max_1 <= 1.0 and set(r.history[-1]) >= {"acceptance", "acceptance_n_max_1",
                                                                          "acceptance_lookup_first"}


def test_lookup_proposals_are_what_ngram_simple_drafts():
    """train-mtp's view of prompt lookup is the run's: the same proposal at every position."""
    from hybridrt.decoding.speculative.draft_ngram import NgramSource

    tokens = [5, 6, 7, 5, 6, 8, 5, 6, 7, 9, 6, 7, 5]
    proposals = train_module.lookup_proposals(tokens, 2)
    source = NgramSource()
    source.observe(0, tokens[:2], None)
    for j in range(2, len(tokens)):
        want = source.propose(tokens[j], j, 1).tokens
        assert proposals[j - 2] == (want[0] if want else None), j
        source.observe(j, [tokens[j]], None)
    assert proposals[:4] == [None, None, 7, None] and proposals[-1] == 6      # (5, 6) -> 7; (7, 5) -> 6


def test_for_lookup_leaves_matched_entries_out_of_the_loss(tiny_llama):
    """--for-lookup: a step's batch marks invalid exactly the entries where the lookup has a match
    (the head drafts behind it only where it has none); everything else is the same batch."""
    m = load_model(tiny_llama, exact_activations=True)
    h = torch.zeros(16, m.n_embd)
    train = [train_module.Sequence(torch.tensor(t), h[:len(t)], 2) for t in
             ([5, 6, 7, 5, 6, 8, 5, 6, 7, 9, 6, 7, 5], [3, 4, 3, 4, 3, 4, 3, 4], [9, 10, 11, 12, 13])]
    cfg = dataclasses.replace(TINY, batch=3)
    plain = train_module.step_batch(m, train, cfg, 0)
    masked = train_module.step_batch(m, train, dataclasses.replace(cfg, for_lookup=True), 0)
    for a, b in zip(plain[:4], masked[:4]):
        assert torch.equal(a, b)
    dropped = plain[4] & ~masked[4]
    assert not (masked[4] & ~plain[4]).any() and dropped.any()
    for row in range(3):
        # which sequence this row is (the batch draws them in its own order): by its embeddings
        seq = next(s for s in train if torch.equal(m.embed(s.tokens[1:]), plain[0][row, :len(s.tokens) - 1]))
        matched = [p is not None for p in train_module.lookup_proposals(seq.tokens.tolist(), 1)]
        assert dropped[row, :len(matched)].tolist() == matched
        assert not dropped[row, len(matched):].any()


@pytest.mark.parametrize("n_max", [1, 2, 3])
@pytest.mark.parametrize("which", ["llama", "qwen35"])
def test_greedy_parity_with_a_trained_head(which, n_max, request, tiny_llama, tiny_qwen35_mtp):
    path, head = (tiny_llama, request.getfixturevalue("llama_head")) if which == "llama" else \
        (tiny_qwen35_mtp, request.getfixturevalue("qwen35_head"))
    m = load_model(path, mtp_head=head)
    assert isinstance(m.mtp, TrainedMTPHead)
    ids = m.tokenize("The history of the small village begins")
    ref, _ = generate(m, m.session(128), ids, 40, GREEDY, stop_ids=set())
    spec = SpecConfig(n_max=n_max)
    session = m.session(128, k_max=spec.k_max)
    source = build_source("draft-mtp", session, GREEDY, spec)
    out, stats = generate(m, session, ids, 40, GREEDY, source, spec, stop_ids=set())
    assert out == ref
    assert sum(stats.spec.drafted) > 0 and len(source.draft_ids) == TINY.draft_vocab


def test_qwen35_keeps_its_own_head_unless_given_one(tiny_qwen35_mtp, qwen35_head):
    assert isinstance(load_model(tiny_qwen35_mtp).mtp, NextNHead)
    assert isinstance(load_model(tiny_qwen35_mtp, mtp_head=qwen35_head).mtp, TrainedMTPHead)


def test_reduced_vocab_sampling_is_exact(tiny_llama, llama_head):
    check_reduced_vocab_exact(load_model(tiny_llama, mtp_head=llama_head), flatten=True)


@pytest.mark.slow
def test_reduced_vocab_sampling_is_exact_smollm2():
    """The same check on SmolLM2 with its trained head (scripts/bench_mtp.py trains and caches it)."""
    from tests.real_models import SMOLLM2, require

    head = Path.home() / ".cache/hybridrt/heads/smollm2-135m.v4.mtp.gguf"     # bench_mtp.py's
    if not head.exists():
        pytest.skip(f"no trained head at {head}: python3 scripts/bench_mtp.py -m smollm2-135m")
    check_reduced_vocab_exact(load_model(require(SMOLLM2), mtp_head=head), flatten=False)


def check_reduced_vocab_exact(m, flatten: bool, draft_vocab: int = 0):
    """temp 0.7: drafts drawn from a head's reduced-vocabulary q (zero off its draft tokens: a
    trained head's, or the built-in head's view of `draft_vocab` rows), verified by exact
    speculative sampling, emit the target's distribution p (TV bound); resampling rejections from
    p instead of the residual fails the same bound (negative control)."""
    cfg = SamplerConfig(temp=0.7, top_k=40, top_p=0.95, min_p=0.0, seed=0)
    ids = m.tokenize("Once upon a time, in a small village")
    if not flatten:     # a real model is confident after plain text: random tokens spread p
        ids = torch.randint(1000, m.n_vocab - 1000, (32,), generator=torch.Generator().manual_seed(0)).tolist()
    session = m.session(64, k_max=2)
    source = build_source("draft-mtp", session, cfg, SpecConfig(n_max=1), draft_vocab=draft_vocab)
    logits = session.eval(ids, logits="all")
    source.observe(0, ids, session.hidden)
    certain = int(torch.argmax(logits[-1]))
    # a random tiny model is nearly one-hot at temp 0.7: its logits are flattened (target and head
    # alike) so that p and q have many candidates and p has mass off the draft vocabulary
    target = session.eval([certain, 0], start_pos=len(ids), logits="all").clone() * (0.05 if flatten else 1.0)
    # the head's entries for the prompt (pending in the source) and the certain token, as propose writes them
    hiddens = torch.cat(source.prev_hidden + [source.last_hidden])
    _, h = source.mtp.step(session.state, torch.tensor(source.tokens + [certain]), hiddens, source.synced)
    h = h[-1:]
    q_row = source.mtp.head(h)[0] * (0.2 if flatten else 1.0)
    p = dense_probs(target[:1], cfg)[0].double().numpy()
    in_vocab = np.zeros_like(p, dtype=bool)
    in_vocab[source.draft_ids.numpy()] = True
    off_mass = float(p[~in_vocab].sum())
    assert off_mass > 0.05, "the check needs target mass outside the draft vocabulary"
    # a real model's p spreads over many tokens, and the bound with it (a sum of their standard
    # errors): more trials keep it under the biased acceptor's error, which is about the mass off
    # the draft vocabulary (SmolLM2: 0.11 against a bound of 0.12 at 8000 trials)
    trials, gen = 8000 if flatten else 32000, torch.Generator().manual_seed(2)

    def emitted_counts(acceptor):
        counts = np.zeros_like(p)
        for _ in range(trials):
            draft = source.picker.start()
            source.add(draft, q_row)
            assert in_vocab[draft.tokens[0]] and in_vocab[draft.q_ids[0].numpy()].all()
            v = acceptor(target, draft)
            counts[draft.tokens[0] if v.n_accepted else v.next_token] += 1
        return counts

    bound = 5 * 0.5 * float(np.sqrt(p * (1 - p) / trials).sum()) + 1e-3
    exact = emitted_counts(SampledAcceptor(m.n_vocab, cfg, gen))
    assert 0.5 * np.abs(exact / trials - p).sum() <= bound
    assert exact[~in_vocab].sum() > 0          # off-vocabulary tokens still come, from the residual

    class ResidualInDraftVocab(SampledAcceptor):
        """The bug a reduced vocabulary invites: a residual taken over q's rows only."""
        def _sample_residual(self, p_ids, p_probs, draft, i, x):
            keep = torch.from_numpy(in_vocab)[p_ids] & (p_ids != x)
            return self._sample(p_ids, p_probs * keep if bool(keep.any()) else p_probs)

    biased = emitted_counts(ResidualInDraftVocab(m.n_vocab, cfg, gen))
    print(f"off-vocabulary mass {off_mass:.3f}; TV exact {0.5 * np.abs(exact / trials - p).sum():.4f}, "
          f"biased {0.5 * np.abs(biased / trials - p).sum():.4f}, bound {bound:.4f}")
    assert 0.5 * np.abs(biased / trials - p).sum() > bound


def test_train_mtp_cli(tiny_llama, tmp_path):
    r = subprocess.run([sys.executable, "-c", "from hybridrt.cli.commands import main; main()", "train-mtp", "-m", str(tiny_llama),
                        "-o", str(tmp_path / "c.gguf"), "--tokens", "48", "--steps", "2", "--gen-len", "8",
                        "--draft-vocab", "32", "--eval-every", "1", "-t", "1", "--json"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "c.gguf").exists()
    assert json.loads(r.stdout)["steps"] >= 1        # stdout: the JSON object alone
    assert "training text" in r.stderr and "held-out acceptance" in r.stderr    # progress: on stderr
    r = subprocess.run([sys.executable, "-c", "from hybridrt.cli.commands import main; main()", "train-mtp", "-m", str(tiny_llama),
                        "-o", str(tmp_path / "c.gguf"), "--loss", "mse"], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == ["error: train-mtp: --loss must be one of kl, argmax"]


def test_ablation_script_reads_a_cached_text(tiny_llama, llama_head):
    """scripts/ablate_mtp_head.py trains on the text train-mtp cached beside a head: the draft
    vocabulary's coverage of the held-out argmax tokens (all of them at --draft-vocab 0), and a
    held-out evaluation per --eval steps."""
    data = Path(f"{llama_head}.data.pt")
    saved = torch.load(data, weights_only=False)
    ids = train_module.pick_draft_vocab(saved["train"], load_model(tiny_llama).n_vocab, 24)
    inside = set(ids.tolist())
    want = np.mean([int(t) in inside for s in saved["heldout"] for t in s.argmax[s.n_prompt:]])
    script = Path(__file__).resolve().parents[1] / "scripts" / "ablate_mtp_head.py"
    for vocab, loss, reg, cover in ((24, "argmax", "0.5", want), (0, "kl", "0", 1.0)):
        r = subprocess.run([sys.executable, str(script), "-m", str(tiny_llama), "--data", str(data), "--steps", "2",
                            "--eval", "1", "--loss", loss, "--reg", reg, "--draft-vocab", str(vocab), "-t", "1"],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        lines = [json.loads(x) for x in r.stdout.splitlines()]
        assert lines[0]["heldout_coverage"] == pytest.approx(cover, abs=1e-4)
        assert [x["step"] for x in lines[1:]] == [1, 2]
        assert all(0.0 <= x["acceptance"] <= 1.0 and math.isfinite(x["loss"]) for x in lines[1:])


def test_ablation_script_starts_and_freezes_the_head_as_asked(tiny_llama, llama_head):
    """ablate_mtp_head.py's --init-layer copies that target layer into the block (at its residual
    scale) and --freeze leaves the named parameters out of the optimizer; a run with both and
    --anchor trains and evaluates."""
    import importlib.util

    script = Path(__file__).resolve().parents[1] / "scripts" / "ablate_mtp_head.py"
    spec = importlib.util.spec_from_file_location("ablate_mtp_head", script)
    ablate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ablate)
    m = load_model(tiny_llama)
    saved = torch.load(f"{llama_head}.data.pt", weights_only=False)
    head, ids, *_ = train_module.new_head(m, saved["train"], TrainConfig(draft_vocab=24))
    last = head_attention_spec(m)[0]
    assert last != 0 and not torch.equal(head.block.w["attn_q"], read_f32(m.gguf, "blk.0.attn_q.weight"))
    ablate.start_block(m, head, 0, saved["train"][0].tokens.tolist(), ids)
    for name in ("attn_q", "attn_k", "ffn_down", "attn_norm"):
        assert torch.equal(head.block.w[name].detach(), read_f32(m.gguf, f"blk.0.{name}.weight"))
    ablate.freeze(head, ["ffn", "head"])
    frozen = {n.rsplit(".", 1)[-1] for n, p in head.named_parameters() if not p.requires_grad}
    assert frozen == {"ffn_gate", "ffn_up", "ffn_down", "head"}
    r = subprocess.run([sys.executable, str(script), "-m", str(tiny_llama), "--data", f"{llama_head}.data.pt",
                        "--steps", "2", "--eval", "2", "--draft-vocab", "24", "--init-layer", "0",
                        "--freeze", "ffn,norms", "--anchor", "0.01", "-t", "1"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert lines[0]["variant"]["init_layer"] == 0 and [x["step"] for x in lines[1:]] == [2]
    assert math.isfinite(lines[1]["loss"])
    for bad, line in ((["--data", f"{llama_head}.data.pt", "--init-layer", "99"], "error: --init-layer must be a layer"),
                      (["--data", str(Path(llama_head).parent / "none.pt")], "error: no train-mtp text cache at")):
        r = subprocess.run([sys.executable, str(script), "-m", str(tiny_llama), *bad, "-t", "1"],
                           capture_output=True, text=True)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith(line)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_real_model_greedy_parity_with_trained_head(name):
    """Greedy draft-mtp with the cached trained head (scripts/bench_mtp.py trains it) equals plain
    decoding, at fixed N and adaptive, alone and behind prompt lookup (ngram-simple,draft-mtp)."""
    head = Path.home() / f".cache/hybridrt/heads/{name}.v4.mtp.gguf"
    if not head.exists():
        pytest.skip(f"no trained head at {head}: python3 scripts/bench_mtp.py -m {name}")
    m = load_model(name, mtp_head=head)
    ids = m.tokenize("Question: Why do leaves change color in autumn?\nAnswer:")
    ref, _ = generate(m, m.session(256), ids, 32, GREEDY, stop_ids=set())
    for spec_type in ("draft-mtp", "ngram-simple,draft-mtp"):
        for n_max, adaptive in ((1, False), (3, False), (3, True)):
            spec = SpecConfig(n_max=n_max, adaptive=adaptive)
            session = m.session(256, k_max=spec.k_max)
            out, stats = generate(m, session, ids, 32, GREEDY, build_source(spec_type, session, GREEDY, spec),
                                              spec, stop_ids=set())
            assert out == ref
            if not adaptive:
                assert sum(stats.spec.accepted) > 0


def test_cli_defaults_are_train_config_and_cost_no_torch():
    """`hybridrt train-mtp`'s option defaults come from TrainConfig (one place to change them), and
    the CLI still imports no torch before a command runs."""
    code = ("import sys, inspect; import hybridrt.cli.commands; from hybridrt.cli import train_mtp as c\n"
            "assert 'torch' not in sys.modules\n"
            "print({p.name: p.default.default for p in inspect.signature(c.train_mtp).parameters.values()})")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    options = eval(r.stdout)
    cfg = dataclasses.asdict(TrainConfig())
    shared = set(options) & set(cfg)
    assert shared >= set(cfg) - {"heldout_len"}     # every knob but the held-out length is an option
    assert {k: options[k] for k in shared} == {k: cfg[k] for k in shared}



def test_lookup_vs_head_script(tiny_llama, llama_head):
    """scripts/lookup_vs_head.py reads a train-mtp run's checkpoint and text and compares prompt
    lookup with the head on the held-out positions."""
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, str(root / "scripts/lookup_vs_head.py"), "-m", str(tiny_llama), "--head",
                        str(llama_head), "--draft-vocab", str(TINY.draft_vocab), "--ngram", "4,2", "3,3", "-t", "1"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert "held-out positions; the head alone right at" in lines[0]
    assert lines[1].startswith("lookup n 4..2: a match at") and lines[2].startswith("lookup n 3..3")


def test_bench_mtp_starts_new_adaptive_policies_as_run_does(tiny_llama, llama_head, monkeypatch):
    """scripts/bench_mtp.py's adaptive runs start their new length policies from a warm-up's verify
    timings (warmup.warm_up), as `run` and `serve` do; policies kept from an earlier prompt
    continue without one, and fixed N takes none. Every output is plain decoding's."""
    import importlib.util

    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_mtp.py"
    spec = importlib.util.spec_from_file_location("bench_mtp", script)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    made, real = [], bench.warm_up
    monkeypatch.setattr(bench, "warm_up", lambda *a, **kw: made.append(real(*a, **kw)) or made[-1])
    m = load_model(tiny_llama, mtp_head=llama_head)
    ids = [5, 9, 31, 7]
    plain, *_ = bench.run_mode(m, ids, 10, None, False)
    assert bench.run_mode(m, ids, 10, 2, True)[0] == plain and len(made) == 1
    kept = {}
    assert bench.run_mode(m, ids, 10, 2, True, policies=kept)[0] == plain and len(made) == 2
    assert kept["draft-mtp"] is made[1]["draft-mtp"] and sorted(made[1]["draft-mtp"].timed_k) == [1, 2, 3]
    assert bench.run_mode(m, ids, 10, 2, True, policies=kept)[0] == plain and len(made) == 2
    assert bench.run_mode(m, ids, 10, 2, False)[0] == plain and len(made) == 2


def test_run_process_bench_script(tiny_llama, llama_head):
    """scripts/bench_run_process.py times `hybridrt run` processes per mode on the held-out prompts
    and sums them; a mode it does not know is one error line."""
    root = Path(__file__).resolve().parents[1]
    script = [sys.executable, str(root / "scripts/bench_run_process.py"), "-m", str(tiny_llama), "--head", str(llama_head)]
    r = subprocess.run(script + ["--modes", "plain", "n1", "ad", "--limit", "1", "--reps", "1", "-n", "8", "-t", "1"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines[0].endswith("1 prompts, best of 1, one process per run:")
    assert lines[1].startswith("  plain: ") and lines[1].endswith("(1.00x plain)")
    assert lines[2].startswith("  n1: ") and lines[3].startswith("  ad: ")
    assert lines[4].startswith("  adaptive / best fixed (n1): ")
    r = subprocess.run(script + ["--modes", "n2x"], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.strip() == "error: mode n2x: use plain, nK or ad"
    r = subprocess.run([sys.executable, str(root / "scripts/bench_run_process.py"), "-m", "/no/such.gguf",
                        "--head", str(llama_head)], capture_output=True, text=True)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("error: ")


@pytest.mark.parametrize("n", [1, 3, 40])     # 40: past the fused kernels' batches, the torch path
def test_a_catch_up_writes_the_kv_a_step_writes(llama_head, tiny_llama, n):
    """write_kv (a catch-up on committed tokens) leaves the head's KV cache bit for bit as step()
    does, without the rest of the block."""
    from hybridrt.models.mtp_head import HEAD_STATE_KEY
    m = load_model(tiny_llama, mtp_head=llama_head)
    g = torch.Generator().manual_seed(n)
    tokens = torch.randint(3, 200, (n,), generator=g)
    hidden = torch.randn(n, m.n_embd, generator=g)
    caches = []
    for write in (lambda s: m.mtp.step(s.state, tokens, hidden, 5, logits=False),
                  lambda s: m.mtp.write_kv(s.state, tokens, hidden, 5)):
        s = m.session(64)
        write(s)
        kv = s.state.extra[HEAD_STATE_KEY].kv
        caches.append((kv.k[0].clone(), kv.v[0].clone()))
    assert caches[0][0][5:5 + n].abs().sum() > 0
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_fused_draft_is_the_heads_own_calls_bit_for_bit(arch, request, tmp_path):
    """draft() runs a trained head's whole step as one compiled call on a CPU trunk (FusedMTPStep:
    after a verify, each of ~20 separate calls paid for its code and data leaving the caches): the
    logits row, the output hidden and the KV it writes are step()'s and head()'s, bit for bit, for a
    draft (1 token), a proposal after plain steps (3) and a prompt-sized batch (40: the separate calls).
    gemma3: its scaled embedding rows, sandwich norms and GELU."""
    from hybridrt.models.mtp_head import HEAD_STATE_KEY
    if arch == "llama":
        path, head = request.getfixturevalue("tiny_llama"), request.getfixturevalue("llama_head")
    else:
        path = make_model.write_model(tmp_path / "gemma3.gguf", "gemma3", seed=2)
        head = _train(path, tmp_path / "gemma3.mtp.gguf").path
    m = load_model(path, mtp_head=head)
    fused_trunk = m.binder.config.mode.fused
    assert (m.mtp.fused is not None) == fused_trunk
    g = torch.Generator().manual_seed(7)
    for n in (1, 3, 40):
        tokens = torch.randint(3, 200, (n,), generator=g)
        hidden = torch.randn(n, m.n_embd, generator=g)
        ref, new = m.session(64), m.session(64)
        logits, h = m.mtp.step(ref.state, tokens, hidden, 5)
        out = torch.full((1, m.mtp.n_out), float("nan"))
        if fused_trunk:
            ran = m.mtp.fused(m.mtp._head_state(new.state), tokens, hidden, 5, out) is not None
            assert ran == (n <= 3)
            new = m.session(64)
        last = m.mtp.draft(new.state, tokens, hidden, 5, out=out)
        assert torch.equal(out, logits[-1:]) and torch.equal(last, h[-1:])
        kv_ref, kv_new = (s.state.extra[HEAD_STATE_KEY].kv for s in (ref, new))
        assert torch.equal(kv_ref.k[0], kv_new.k[0]) and torch.equal(kv_ref.v[0], kv_new.v[0])
