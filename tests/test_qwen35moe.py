"""qwen35moe (Qwen3.5/3.6 MoE: qwen35's GDN hybrid trunk, a mixture-of-experts FFN in every block,
the MTP block's too): float64 reference parity, grouped-by-expert verify (a token's bits do not
depend on the batch; each touched expert runs once per batch), speculative greedy parity."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import make_model
from hybridrt.runtime.backends import FusedMoEBlock, RoutedExperts
from hybridrt.decoding.generate import generate
from hybridrt.files.gguf_file import GGUFFile
from hybridrt.runtime.loader import load_model
from hybridrt.files.model_info import read_model_info
from hybridrt.models.qwen35 import MoEFFN, Qwen35Moe
from hybridrt.decoding.sampling import SamplerConfig
from hybridrt.decoding.speculative.loop import SpecConfig
from hybridrt.decoding.speculative.sources import build_source
from tests.reference.common import rms_norm
from tests.reference.ref_qwen35 import RefQwen35

pytestmark = pytest.mark.usefixtures("single_thread")

TOKENS = [int(t) for t in np.random.default_rng(7).integers(3, 300, 40)]
GREEDY = SamplerConfig(temp=0.0)


def rel_err(got, ref) -> float:
    got, ref = np.asarray(got, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


@pytest.fixture
def exact_activations(monkeypatch):
    """The CPU kernels on float32 activations (not the default int8 rows): the float64 reference
    then checks the model's math to float32 rounding."""
    monkeypatch.setenv("HYBRIDRT_EXACT_ACTIVATIONS", "1")     # read by each load_model


def build(tmp_path, name, **kw):
    return make_model.write_model(tmp_path / f"{name}.gguf", "qwen35moe", **kw)


@pytest.fixture(scope="module")
def moe_mtp(tmp_path_factory):
    return make_model.write_model(tmp_path_factory.mktemp("moe") / "tiny-qwen35moe-mtp.gguf", "qwen35moe",
                                  mtp=True, mix="f32", seed=0)


@pytest.fixture(scope="module")
def moe_q4(tmp_path_factory):
    return make_model.write_model(tmp_path_factory.mktemp("moe") / "tiny-qwen35moe-q4.gguf", "qwen35moe",
                                  mtp=True, mix="q4_k_m", seed=2)


def test_tiny_file_layout(moe_mtp):
    g = GGUFFile(moe_mtp)
    assert g.arch == "qwen35moe"
    assert (int(g.get("expert_count")), int(g.get("expert_used_count"))) == (16, 4)
    assert (int(g.get("expert_feed_forward_length")), int(g.get("expert_shared_feed_forward_length"))) == (32, 64)
    assert g.tensors["blk.0.ffn_gate_exps.weight"].shape == (64, 32, 16)
    assert g.tensors["blk.0.ffn_down_exps.weight"].shape == (32, 64, 16)
    assert g.tensors["blk.0.ffn_gate_inp.weight"].shape == (64, 16)
    assert "blk.0.ssm_beta.weight" in g.tensors and "blk.0.ssm_ba.weight" not in g.tensors
    assert "blk.8.ffn_gate_inp.weight" in g.tensors and "blk.8.nextn.eh_proj.weight" in g.tensors
    assert not any(n.endswith(("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")) for n in g.tensors)
    info = read_model_info(g)
    assert info.layer_kinds == {"gated_delta_net": 6, "attention": 2} and info.nextn_layers == 1
    assert info.experts == {"count": 16, "used": 4, "ffn": 32, "shared_ffn": 64}


def test_q4_k_m_gives_ffn_down_exps_q6_k_by_block(moe_q4):
    """llama-quantize's MoE rule: ffn_down's use_more_bits index is the block number, so a layer's
    routed and shared down projections get the same type."""
    from gguf.constants import GGMLQuantizationType as QT

    g = GGUFFile(moe_q4)
    for i in range(9):
        exps, shexp = (g.tensors[f"blk.{i}.ffn_down_{s}.weight"].qtype for s in ("exps", "shexp"))
        assert exps == shexp == (QT.Q6_K if make_model._use_more_bits(i, 9) else QT.Q4_K)
    assert g.tensors["blk.0.ffn_gate_exps.weight"].qtype == QT.Q4_K
    assert g.tensors["blk.0.ffn_gate_inp.weight"].qtype == QT.F32


@pytest.mark.parametrize("case,kw", [
    ("gdn-layer", dict(dims={"n_layer": 1})),
    ("attention-layer", dict(dims={"n_layer": 1, "full_attention_interval": 1})),
    ("whole-model", dict(mtp=True)),
    ("whole-model-q8_0", dict(mtp=True, mix="q8_0", seed=3)),
])
def test_logits_match_float64_reference(tmp_path, case, kw, exact_activations):
    path = build(tmp_path, case, **kw)
    model = load_model(path)
    assert isinstance(model, Qwen35Moe) and all(isinstance(layer.ffn.ffn, MoEFFN) for layer in model.layers)
    got = model.session(128).eval(TOKENS).numpy()
    ref = RefQwen35(path).forward(TOKENS)
    assert rel_err(got, ref) <= 1e-4
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.99


def test_q4_k_m_logits_match_float64_reference(moe_q4, exact_activations):
    got = load_model(moe_q4).session(128).eval(TOKENS).numpy()
    assert rel_err(got, RefQwen35(moe_q4).forward(TOKENS)) <= 1e-4


@pytest.mark.parametrize("mix,seed", [("q8_0", 3), ("q4_k_m", 2)])
def test_default_int8_activations_stay_close_to_the_reference(tmp_path, mix, seed):
    """The default CPU path quantizes activation rows to int8 as llama.cpp does: within the
    issue's 5e-2 for quantized files, top-1 nearly always the reference's."""
    path = build(tmp_path, mix, mtp=True, mix=mix, seed=seed)
    got = load_model(path).session(128).eval(TOKENS).numpy()
    ref = RefQwen35(path).forward(TOKENS)
    assert rel_err(got, ref) <= 5e-2
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.9


@pytest.mark.parametrize("fixture", ["moe_mtp", "moe_q4"])
def test_moe_block_matches_float64_reference(fixture, request, exact_activations):
    path = request.getfixturevalue(fixture)
    model, ref = load_model(path), RefQwen35(path)
    x = np.random.default_rng(1).standard_normal((8, model.n_embd)).astype(np.float32)
    for layer in (0, 3):
        got = model.layers[layer].ffn.ffn(torch.from_numpy(x)).numpy()
        assert rel_err(got, ref._moe_ffn(f"blk.{layer}", x.astype(np.float64))) <= 1e-5


def test_mtp_head_is_moe_and_matches_reference(moe_mtp):
    model, ref = load_model(moe_mtp), RefQwen35(moe_mtp)
    assert isinstance(model.mtp.ffn_half.ffn, MoEFFN)
    s = model.session(128)
    s.eval(TOKENS, logits="none")
    logits, hidden = model.mtp.step(s.state, torch.tensor(TOKENS[1:]), s.hidden[:-1], start_pos=1)
    ref_logits, ref_hidden = ref.mtp_forward(TOKENS)
    assert rel_err(logits.numpy(), ref_logits) <= 1e-4
    assert rel_err(hidden.numpy(), ref_hidden) <= 1e-4


class CountingExperts:
    """Wraps a layer's experts: records the rows each expert call got."""

    def __init__(self, experts: RoutedExperts):
        self.calls: list[tuple[int, int]] = []
        for e, expert in enumerate(experts.experts):
            experts.experts[e] = self._wrap(e, expert)

    def _wrap(self, e, expert):
        def call(x):
            self.calls.append((e, x.shape[0]))
            return expert(x)
        call.nbytes, call.down = expert.nbytes, expert.down
        return call


@pytest.mark.parametrize("fixture", ["moe_mtp", "moe_q4"])
def test_token_bits_do_not_depend_on_the_batch(fixture, request):
    """k = 1..8: every token's MoE output, in a batch with random companions, is bitwise the output
    it gets alone (grouping by expert changes which rows share a kernel call, never the sums)."""
    model = load_model(request.getfixturevalue(fixture))
    rng = np.random.default_rng(5)
    x = torch.from_numpy(rng.standard_normal((24, model.n_embd)).astype(np.float32))
    for layer in (0, 3):
        ffn = model.layers[layer].ffn.ffn
        alone = torch.cat([ffn(x[i:i + 1]) for i in range(24)])
        for k in range(1, 9):
            for _ in range(3):
                idx = torch.from_numpy(rng.choice(24, k, replace=False))
                assert torch.equal(ffn(x[idx]), alone[idx]), (layer, k)


def test_verify_batch_is_bitwise_single_steps(moe_q4):
    model = load_model(moe_q4)
    a, b = model.session(128, k_max=8), model.session(128, k_max=8)
    a.eval(TOKENS[:12])
    b.eval(TOKENS[:12])
    together = a.eval(TOKENS[12:20])
    alone = torch.cat([b.eval([t]) for t in TOKENS[12:20]])
    assert torch.equal(together, alone)


def test_each_touched_expert_runs_once_per_batch(moe_q4):
    """A k-token batch calls each expert it touches once, over all its tokens: the expert bytes
    read per step are (touched experts) x (bytes per expert), below one token at a time's
    sum over tokens of n_used experts each."""
    model = load_model(moe_q4)
    ffn = model.layers[0].ffn.ffn
    counter = CountingExperts(ffn.experts)
    per_expert = ffn.experts.experts[0].nbytes
    x = torch.from_numpy(np.random.default_rng(9).standard_normal((8, model.n_embd)).astype(np.float32))
    for k in range(1, 9):
        counter.calls.clear()
        ffn(x[:k])
        experts = [e for e, _ in counter.calls]
        assert len(experts) == len(set(experts)) and sum(rows for _, rows in counter.calls) == k * ffn.n_used
        assert len(experts) * per_expert <= k * ffn.n_used * per_expert
    assert len(experts) < 8 * ffn.n_used       # 8 tokens x 4 of 16 experts: some are shared


@pytest.mark.parametrize("n_max", [1, 3])
def test_mtp_speculative_greedy_parity(moe_mtp, n_max):
    model = load_model(moe_mtp)
    for seed in (0, 1):
        ids = [int(t) for t in np.random.default_rng(seed).integers(3, 300, 10)]
        ref, _ = generate(model, model.session(256), ids, 32, GREEDY, stop_ids=set())
        spec = SpecConfig(n_max=n_max)
        session = model.session(256, k_max=spec.k_max)
        source = build_source("draft-mtp", session, GREEDY, spec)
        got, stats = generate(model, session, ids, 32, GREEDY, source, spec, stop_ids=set())
        assert got == ref and sum(stats.spec.drafted) > 0


def test_bench_moe_verify_runs(tmp_path, capsys):
    import bench_moe_verify

    out = tmp_path / "moe.json"
    bench_moe_verify.main(["--experts", "16", "--used", "4", "--n-embd", "256", "--ff", "256", "--trials", "2",
                           "--threads", "1", "--json", str(out)])
    import json

    rows = json.loads(out.read_text())["rows"]
    assert [r["k"] for r in rows] == list(range(1, 9))
    assert all(r["grouped_bytes"] <= r["separate_bytes"] for r in rows)
    assert rows[0]["grouped_bytes"] == rows[0]["separate_bytes"] and rows[-1]["grouped_bytes"] < rows[-1]["separate_bytes"]
    assert "experts read" in capsys.readouterr().out


# ------------------------------------------------------------------ the fused MoE FFN half

def _fused_halves(model):
    halves = [layer.ffn for layer in model.layers]
    assert all(isinstance(f, FusedMoEBlock) for f in halves)     # a plain CPU trunk fuses every MoE half
    return halves


@pytest.mark.parametrize("fixture", ["moe_mtp", "moe_q4"])
def test_fused_moe_half_matches_float64_reference(fixture, request, exact_activations):
    """cpu_kernels.moe_block (router and shared gate, the chosen experts grouped by expert, the shared
    expert, residual) against the float64 reference's block FFN half, k = 1 and a verify batch."""
    path = request.getfixturevalue(fixture)
    model, ref = load_model(path), RefQwen35(path)
    h = np.random.default_rng(3).standard_normal((8, model.n_embd)).astype(np.float32)
    for layer in (0, 3):
        half = _fused_halves(model)[layer]
        for rows in (h[:1], h):
            got = half(torch.from_numpy(rows)).numpy()
            x = rms_norm(rows.astype(np.float64), half.norm.astype(np.float64), half.block.eps)
            want = rows + ref._moe_ffn(f"blk.{layer}", x)
            assert rel_err(got - rows, want - rows) <= 1e-5, layer


@pytest.mark.parametrize("fixture", ["moe_mtp", "moe_q4"])
def test_fused_moe_half_is_the_torch_half(fixture, request):
    """On the default int8 activations the fused half runs the same kernels per (expert, token) as
    MoEFFN's separate calls: equal up to the routing weights' float32 rounding."""
    model = load_model(request.getfixturevalue(fixture))
    h = torch.from_numpy(np.random.default_rng(4).standard_normal((6, model.n_embd)).astype(np.float32))
    for layer in (0, 3):
        half = _fused_halves(model)[layer]
        fused, torch_half = half(h), half.block(h)
        assert rel_err((fused - h).numpy(), (torch_half - h).numpy()) <= 1e-5, layer


@pytest.mark.parametrize("threads", [1, 2])
def test_fused_moe_token_bits_do_not_depend_on_the_batch_or_threads(moe_q4, threads):
    """Every token's fused MoE half, in batches of 1..8 with random companions, on 1 or 2 threads,
    is bitwise its result alone on one thread."""
    import numba

    model = load_model(moe_q4)
    rng = np.random.default_rng(6)
    h = torch.from_numpy(rng.standard_normal((16, model.n_embd)).astype(np.float32))
    half = _fused_halves(model)[1]
    before = numba.get_num_threads()
    alone = torch.cat([half(h[i:i + 1]) for i in range(16)])
    numba.set_num_threads(threads)
    try:
        for k in range(1, 9):
            idx = torch.from_numpy(rng.choice(16, k, replace=False))
            assert torch.equal(half(h[idx]), alone[idx]), k
    finally:
        numba.set_num_threads(before)


def test_fused_moe_routes_as_the_router_says():
    """_route: the n_used largest logits (the lower id on a tie), ascending, weights the softmax
    renormalised over them."""
    from cpu_kernels.moe_block import _route

    logits = np.array([[0.5, 2.0, -1.0, 2.0, 1.0, 0.0], [3.0, 3.0, 3.0, 3.0, 3.0, 3.0]], np.float32)
    ids, wts = _route(logits, 5, 3)         # the sixth column (the shared gate's) is not an expert
    assert ids.tolist() == [[1, 3, 4], [0, 1, 2]]
    p = np.exp(np.array([2.0, 2.0, 1.0]) - 2.0)
    np.testing.assert_allclose(wts[0], p / p.sum(), rtol=1e-6)
    np.testing.assert_allclose(wts[1], [1 / 3] * 3, rtol=1e-6)
