"""A qwen35moe plan executed with the CPU standing in for the device (no GPU here): the trunk, the
routers and shared experts on the "device", the routed experts of the front layers too, the other
layers' routed experts in the mmap, run on the executor's worker (HostExperts) with their rows and
routing crossing through its host buffers. The greedy tokens must be the all-mmap run's, a verify
batch bitwise a sequence of single steps, and draft-mtp speculative output the plain output.

Both runs use exact float32 activations: on the default int8 path the device's expert FFNs compute
silu(gate) * up with torch's exp and the CPU's fused kernel with its own, so an intermediate that
lands on an int8 rounding boundary can round the other way (one quantum, ~5e-4 of an expert's
output); on these random tiny files that flips near-tied greedy picks. Float32 activations agree to
~5e-7 (tests/test_placed_run.py holds SmolLM2's default int8 placed run to the mmap run's tokens)."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import make_model
from hybridrt.runtime.backends import DeviceLinear, GluFFN, HostExperts, RoutedExperts
from hybridrt.decoding.generate import generate
from hybridrt.runtime.loader import load_model
from hybridrt.files.model_profile import load_profile
from hybridrt.runtime.place import PlacementRequest, plan_for
from hybridrt.decoding.sampling import SamplerConfig
from hybridrt.decoding.speculative.loop import SpecConfig
from hybridrt.decoding.speculative.sources import build_source
from hybridrt.runtime.trace import Tracer
from gpu_kernels.qlinear import QuantLinear

pytestmark = pytest.mark.usefixtures("single_thread")

GREEDY = SamplerConfig(temp=0.0)
PROMPT = [1, 5, 9, 2, 7, 3, 8, 4]
BASE = PlacementRequest(n_ctx=256, cache_type_k="f32", cache_type_v="f32", spec_type="draft-mtp", spec_draft_n_max=3)


def budget_for(path, whole_layers: int) -> int:
    """Stages 1-3 and the routed experts of the first `whole_layers` layers, with a little slack."""
    roomy = plan_for(str(path), dataclasses.replace(BASE, vram_bytes=1 << 40), "cpu")
    fixed = sum(line.gpu_bytes for line in roomy.lines if line.stage < 4)
    ffn = load_profile(str(path)).ffn_layer_bytes()
    return fixed + sum(ffn[i] for i in range(whole_layers)) + ffn[whole_layers] // 2


@pytest.fixture(scope="module", params=["f32", "q4_k_m"])
def files(request, tmp_path_factory):
    path = make_model.write_model(tmp_path_factory.mktemp("moe") / f"moe-{request.param}.gguf", "qwen35moe",
                                  mtp=True, mix=request.param, seed=4)
    placed = load_model(path, placement=dataclasses.replace(BASE, vram_bytes=budget_for(path, 3)),
                        exact_activations=True)
    return path, placed, load_model(path, exact_activations=True)


def test_binds_exactly_what_the_plan_says(files):
    _, m, _ = files
    assert m.plan.ffn_gpu_layers == [0, 1, 2] and m.plan.ffn_split is None
    device_types = (DeviceLinear, QuantLinear)
    for layer in range(8):
        ffn = m.layers[layer].ffn.ffn
        assert isinstance(ffn.router, device_types) and isinstance(ffn.shared_gate, device_types)
        assert isinstance(ffn.shared, GluFFN)
        if layer < 3:
            assert isinstance(ffn.experts, RoutedExperts)
            assert all(isinstance(e, GluFFN) and isinstance(e.down, device_types) for e in ffn.experts.experts)
        else:
            assert isinstance(ffn.experts, HostExperts) and isinstance(ffn.experts.experts, RoutedExperts)
    assert isinstance(m.mtp.ffn_half.ffn.experts, RoutedExperts)          # draft weights are reserved whole, first


def test_greedy_tokens_equal_the_mmap_run(files):
    _, placed, plain = files
    ref, _ = generate(plain, plain.session(256, "f32"), PROMPT, 24, GREEDY, stop_ids=set())
    got, _ = generate(placed, placed.session(256), PROMPT, 24, GREEDY, stop_ids=set())
    assert got == ref


def test_verify_batch_is_bitwise_single_steps(files):
    _, placed, _ = files
    a, b = placed.session(256), placed.session(256)
    a.eval(PROMPT)
    b.eval(PROMPT)
    together = a.eval([6, 2, 9, 4])
    alone = torch.cat([b.eval([t]) for t in (6, 2, 9, 4)])
    assert torch.equal(together, alone)


def test_speculative_greedy_parity(files):
    _, placed, plain = files
    ref, _ = generate(plain, plain.session(256, "f32"), PROMPT, 24, GREEDY, stop_ids=set())
    spec = SpecConfig(n_max=3)
    session = placed.session(256)
    source = build_source("draft-mtp", session, GREEDY, spec, None)
    got, stats = generate(placed, session, PROMPT, 24, GREEDY, source, spec, stop_ids=set())
    assert got == ref and stats.spec.steps > 0


def test_cpu_experts_appear_on_the_worker_in_the_trace(files, tmp_path):
    path, _, _ = files
    tracer = Tracer("cpu")
    m = load_model(path, placement=dataclasses.replace(BASE, vram_bytes=budget_for(path, 3)), trace=tracer)
    m.session(256).eval(PROMPT)
    tracer.write(tmp_path / "trace.json")
    events = [e for e in json.loads((tmp_path / "trace.json").read_text())["traceEvents"] if e["ph"] == "X"]
    names = {e["name"] for e in events if e["cat"] == "cpu_ffn"}
    assert names == {f"cpu experts blk.{i} experts" for i in range(3, 8)}
    assert {f"to host blk.{i} experts in" for i in range(3, 8)} <= {e["name"] for e in events if e["cat"] == "transfer"}
