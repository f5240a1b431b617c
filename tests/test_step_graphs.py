"""Placed steps as captured segments (hybridrt/runtime/step_graphs.py), with the CPU standing in for
the device: the executor's recorder captures each segment's torch operators and replays them, as a
CUDA graph replays its launches. What must hold, and what a CUDA run checks again on a GPU
(tests/test_placed_run.py's cuda tests with graphs on):
- replayed steps give bit for bit the tokens and hidden states of the same steps run eagerly from
  the static buffers ("buffers"), at positions other than the captured one, through rollbacks;
- greedy output equals the plain all-mmap run's;
- the pieces follow the plan: one host job per crossing (the embedding gather, every FFN layer left
  in the mmap), the split layer's device half between its job and its wait;
- a step's value read on the host inside a segment fails the capture; a Python int of the step
  that reaches a device operator is caught by the replay check.
"""
from __future__ import annotations

import dataclasses
import gc

import pytest
import torch

import make_model
from hybridrt.decoding.generate import generate
from hybridrt.decoding.sampling import SamplerConfig
from hybridrt.decoding.speculative.loop import SpecConfig
from hybridrt.decoding.speculative.sources import build_source
from hybridrt.files.model_profile import load_profile
from hybridrt.models.common import ModelState
from hybridrt.runtime.backends import HostExperts, HostFFN, SplitFFN
from hybridrt.runtime.loader import load_model
from hybridrt.runtime.place import PlacementRequest, plan_for
from hybridrt.runtime.step_graphs import CaptureError, HostJob, Wait
from tests.test_placed_run import load_placed

pytestmark = pytest.mark.usefixtures("single_thread")

GREEDY = SamplerConfig(temp=0.0)
PROMPT = [1, 5, 9, 2, 7, 3, 8, 4, 6, 2, 9, 1, 5, 3, 7, 8, 2, 4]      # 18 tokens: longer than a graph step
BASE = PlacementRequest(n_ctx=128, cache_type_k="f32", cache_type_v="f32", spec_type="draft-mtp",
                        spec_draft_n_max=3)


@pytest.fixture(scope="module")
def placed(tiny_qwen35_mtp):
    m = load_placed(tiny_qwen35_mtp, BASE, 3, 2.5)
    assert m.plan.ffn_gpu_layers == [0, 1, 2] and m.plan.ffn_split.layer == 3
    assert m.executor.graphs is None            # the CPU standing in: no graphs unless asked (below)
    return m


def spec_run(m, graphs: str | None, n: int = 20, draft: str = "draft-mtp"):
    """Greedy speculative decoding (verify batches of up to 4 tokens, rollbacks) with the executor's
    graphs set; returns (tokens, the hidden rows of every step, graph segments per step size)."""
    m.executor.graphs = graphs
    hidden = []
    session = m.session(128)
    forward = m.executor.forward

    def keep(model, state, tokens, start_pos):
        h = forward(model, state, tokens, start_pos)
        hidden.append(h.clone())
        return h

    m.executor.forward = keep
    try:
        spec = SpecConfig(n_max=3)
        source = build_source(draft, session, GREEDY, spec, None)
        out, stats = generate(m, session, PROMPT, n, GREEDY, source, spec, stop_ids=set())
    finally:
        del m.executor.forward
        m.executor.graphs = None
    assert stats.spec.steps > 0
    return out, hidden, m.executor.graph_counts(session.state)


def test_replays_equal_the_buffered_steps_bit_for_bit(placed, tiny_qwen35_mtp):
    want, want_hidden, _ = spec_run(placed, "buffers")
    got, got_hidden, counts = spec_run(placed, "record")
    assert got == want
    assert len(got_hidden) == len(want_hidden)
    assert all(torch.equal(a, b) for a, b in zip(got_hidden, want_hidden))
    assert any(c > 0 for c in counts.values()), counts        # steps were captured and replayed
    plain = load_model(tiny_qwen35_mtp)
    ref, _ = generate(plain, plain.session(128, "f32"), PROMPT, 20, GREEDY, stop_ids=set())
    assert got == ref


def test_the_pieces_follow_the_plan(placed):
    placed.executor.graphs = "record"
    try:
        s = placed.session(128)
        for t in PROMPT[:3]:        # eager, captured, replayed
            s.eval([t])
        graph = placed.executor._step_graphs[id(s.state)][1]
    finally:
        placed.executor.graphs = None
    ffns = [layer.ffn.ffn for layer in placed.layers]
    n_host = sum(isinstance(f, HostFFN) for f in ffns)
    assert n_host == placed.n_layer - 4 and sum(isinstance(f, SplitFFN) for f in ffns) == 1
    jobs = [p for p in graph.pieces if isinstance(p, HostJob)]
    waits = [p for p in graph.pieces if isinstance(p, Wait)]
    assert len(jobs) == len(waits) == 1 + n_host + 1         # the embedding gather, each host layer, the split's half
    assert [w.job for w in waits] == jobs                      # each job waited once, in order
    # the split layer's device half is captured between its host job and the wait
    split = ffns[placed.plan.ffn_split.layer]
    split_job = next(i for i, p in enumerate(graph.pieces) if isinstance(p, HostJob) and p.fn.__self__ is split.host_half)
    assert isinstance(graph.pieces[split_job + 2], Wait) and graph.pieces[split_job + 1].ops
    assert graph.pieces[-1].ops                                # the last segment ends at the final norm


def test_a_step_value_baked_into_a_segment_is_caught(placed, monkeypatch):
    """The negative control of the bit-for-bit check: rotary rows taken at the captured step's
    start (a Python int) replay stale at the next position."""
    want, _, _ = spec_run(placed, "buffers")
    real = ModelState.rotary_at

    def baked(self, spec, start, n, device):
        positions, self.positions = self.positions, None
        try:
            return real(self, spec, start, n, device)
        finally:
            self.positions = positions

    monkeypatch.setattr(ModelState, "rotary_at", baked)
    got, _, _ = spec_run(placed, "record")
    assert got != want


def test_a_host_read_inside_a_segment_fails_the_capture(placed, monkeypatch):
    import gpu_kernels.norms as norms

    real = norms.rms_norm

    def reads_back(x, w, eps):
        float(x.abs().max())        # a sync a CUDA capture cannot take
        return real(x, w, eps)

    monkeypatch.setattr("hybridrt.models.qwen35.rms_norm", reads_back)
    placed.executor.graphs = "record"
    try:
        s = placed.session(128)
        s.eval([1])
        with pytest.raises(CaptureError, match="host"):
            s.eval([2])
    finally:
        placed.executor.graphs = None


def test_graphs_are_per_session_and_go_with_it(placed):
    placed.executor.graphs = "record"
    try:
        a, b = placed.session(128), placed.session(128)
        for t in PROMPT[:3]:
            a.eval([t])
        b.eval([PROMPT[0]])
        assert placed.executor.graph_counts(a.state)[1] > 0 and placed.executor.graph_counts(b.state) == {1: 0}
        key = id(a.state)
        del a
        gc.collect()
        assert key not in placed.executor._step_graphs
    finally:
        placed.executor.graphs = None


def test_moe_routed_experts_cross_inside_captured_steps(tmp_path):
    """Routed experts in the mmap cross like FFN layers (rows, weights and ids in one copy). Routed
    experts on the device are not capturable: which experts run is decided on the host (RoutedExperts
    groups the batch by expert), so such a step fails its capture (on CUDA: eager, one warning)."""
    path = make_model.write_model(tmp_path / "moe.gguf", "qwen35moe", mtp=True, mix="f32", seed=4)
    roomy = plan_for(str(path), dataclasses.replace(BASE, vram_bytes=1 << 40), "cpu")
    fixed = sum(line.gpu_bytes for line in roomy.lines if line.stage < 4)
    m = load_model(path, placement=dataclasses.replace(BASE, vram_bytes=fixed + (1 << 16)), exact_activations=True)
    assert m.plan.ffn_gpu_layers == [] and all(isinstance(layer.ffn.ffn.experts, HostExperts) for layer in m.layers)
    want, want_hidden, _ = spec_run(m, "buffers", n=12)
    got, got_hidden, counts = spec_run(m, "record", n=12)
    assert got == want and all(torch.equal(a, b) for a, b in zip(got_hidden, want_hidden))
    assert any(c > 0 for c in counts.values())

    ffn = load_profile(str(path)).ffn_layer_bytes()
    m = load_model(path, placement=dataclasses.replace(BASE, vram_bytes=fixed + ffn[0] + ffn[1] // 2),
                   exact_activations=True)
    assert m.plan.ffn_gpu_layers == [0]
    m.executor.graphs = "record"
    s = m.session(128)
    s.eval([1])
    with pytest.raises(CaptureError, match="nonzero|_local_scalar_dense"):
        s.eval([2])


# --- on a real GPU (scripts/gpu_check.sh runs these) ----------------------------------------------

@pytest.mark.cuda
def test_cuda_graph_replays_equal_the_eager_steps(tiny_qwen35_mtp):
    """CUDA graphs: every step's hidden rows bit for bit the eager path's (the fused attention reads
    its first position from memory, the same bits as an int), speculative greedy output the plain
    run's, and the steps were really replayed."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    m = load_placed(tiny_qwen35_mtp, BASE, 3, 2.5, device="cuda")
    assert m.executor.graphs == "cuda"
    want, want_hidden, _ = spec_run(m, None)
    got, got_hidden, counts = spec_run(m, "cuda")
    assert got == want and any(c > 0 for c in counts.values()), counts
    assert all(torch.equal(a, b) for a, b in zip(got_hidden, want_hidden))
    plain = load_placed(tiny_qwen35_mtp, BASE, 3, 2.5, device="cuda", cuda_graphs=False)
    assert plain.executor.graphs is None


@pytest.mark.parametrize("flag,want", [(True, False), (False, None)])
def test_no_cuda_graphs_flag_reaches_the_loader(monkeypatch, flag, want):
    """`--no-cuda-graphs` loads with cuda_graphs=False; left off, the environment decides (None)."""
    from types import SimpleNamespace

    from hybridrt.cli.options import KVFlags, LoadFlags

    seen = {}
    monkeypatch.setattr("hybridrt.runtime.loader.load_model", lambda *a, **k: seen.update(k) or SimpleNamespace(plan=None))
    flags = LoadFlags(device="cpu", vram=None, gpu_layers=None, margin="512MiB", no_op_offload=False,
                      no_cuda_graphs=flag, trace=None, exact_activations=False, act_residual=None)
    flags.load("m.gguf", "cpu", None, None, KVFlags(cache_type_k="f16", cache_type_v="f16"), None, 3, None, None)
    assert seen["cuda_graphs"] is want
