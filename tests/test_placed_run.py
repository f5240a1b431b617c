"""The plan executed, with the CPU standing in for the device (no GPU here): tensors the plan puts on
the GPU are bound to the device backends (QuantLinear / DeviceLinear on CPU tensors), the FFN layers
it leaves in the mmap run on the executor's worker thread (HostFFN), and the boundary layer runs
split (SplitFFN). The result must be the all-mmap run's: same greedy tokens, logits within 1e-4
relative, verify batches bitwise equal to single steps, speculative parity."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from hybridrt.runtime.backends import CpuGluFFN, DeviceLinear, GluFFN, HostFFN, SplitFFN
from hybridrt.decoding.generate import generate
from hybridrt.runtime.loader import load_model
from hybridrt.files.model_profile import load_profile
from hybridrt.runtime.place import PlacementRequest, plan_for, placement_line
from hybridrt.decoding.sampling import SamplerConfig
from hybridrt.decoding.speculative.loop import SpecConfig
from hybridrt.decoding.speculative.sources import build_source
from hybridrt.runtime.trace import Tracer
from gpu_kernels.qlinear import QuantLinear
from tests.real_models import SMOLLM2, require

pytestmark = pytest.mark.usefixtures("single_thread")

MiB = 1 << 20
GREEDY = SamplerConfig(temp=0.0)
PROMPT = "The capital of France is a city that has many famous museums, such as"


def budget_for(path, request: PlacementRequest, whole_layers: int, extra_granules: float) -> int:
    """A VRAM budget that fits stages 1-3, the prompt staging (the largest FFN layer, where the
    request keeps op offload), `whole_layers` FFN layers and part of the next one."""
    roomy = plan_for(str(path), dataclasses.replace(request, vram_bytes=1 << 40), "cpu")
    fixed = sum(line.gpu_bytes for line in roomy.lines if line.stage < 4)
    profile = load_profile(str(path))
    ffn = profile.ffn_layer_bytes()
    fixed += max(ffn.values()) if request.op_offload else 0
    granule = 256 if profile.n_ff % 256 == 0 else 32
    return int(fixed + sum(ffn[i] for i in range(whole_layers)) + extra_granules * ffn[whole_layers] * granule / profile.n_ff)


def load_placed(path, request: PlacementRequest, whole_layers: int, extra_granules: float, device: str = "cpu",
                **load):
    """path loaded under `request` at budget_for's VRAM: that many whole FFN layers on the device
    and part of the next (on "cpu": the CPU standing in for the device), the rest in the mmap;
    `load`: load_model's other arguments."""
    budget = budget_for(path, request, whole_layers, extra_granules)
    return load_model(path, device=device, placement=dataclasses.replace(request, vram_bytes=budget), **load)


def ffn_of(model, layer: int):
    """The bound FFN of a layer: every layer is (mixer half, FFN half)."""
    return model.layers[layer].ffn.ffn


@pytest.fixture(scope="module")
def smollm2_placed():
    """SmolLM2 at the issue's 700 MiB plus what a 512-token prompt chunk's activations take (16
    MiB): 13 of 30 FFN layers on the device (one layer's room is the prompt staging), layer 13
    split. Both this
    and the mmap model run the mmap'd matrices on float32 activations, as the device backends do:
    the default int8 activations would differ from the device layers by their quantization noise."""
    return load_model(require(SMOLLM2), placement=PlacementRequest(vram_bytes=716 * MiB, n_ctx=4096),
                      exact_activations=True)


@pytest.fixture(scope="module")
def smollm2_mmap():
    return load_model(require(SMOLLM2), exact_activations=True)


def test_smollm2_binds_exactly_what_the_plan_says(smollm2_placed):
    m, plan = smollm2_placed, smollm2_placed.plan
    assert plan.ffn_gpu_layers == list(range(13)) and plan.ffn_split.layer == 13
    for layer in range(30):
        ffn = ffn_of(m, layer)
        if layer in plan.ffn_gpu_layers:
            assert isinstance(ffn, GluFFN) and all(isinstance(w, QuantLinear) for w in (ffn.gate_up[0], ffn.down))
            assert ffn.gate is None and ffn.gate_up[1] == [1536, 1536]      # gate and up stacked
        elif layer == plan.ffn_split.layer:
            assert isinstance(ffn, SplitFFN)
            assert ffn.device_half.gate.n_out == plan.ffn_split.gpu_units
            assert ffn.host_half.ffn.gate.n_out == 1536 - plan.ffn_split.gpu_units
        else:
            assert isinstance(ffn, HostFFN) and isinstance(ffn.ffn, CpuGluFFN)
    attn = m.layers[0].attention
    assert isinstance(attn.wqkv, QuantLinear) and isinstance(m.output, QuantLinear)
    line = placement_line(plan, "cpu")
    assert "offloaded 13/30 FFN layers + 1024/1536 units of layer 13" in line


def test_smollm2_placed_greedy_tokens_equal_the_mmap_run(smollm2_placed, smollm2_mmap):
    ids = smollm2_mmap.tokenize(PROMPT)
    ref, _ = generate(smollm2_mmap, smollm2_mmap.session(512, "f16"), ids, 32, GREEDY)
    got, _ = generate(smollm2_placed, smollm2_placed.session(512), ids, 32, GREEDY)
    assert got == ref


def test_smollm2_placed_logits_within_1e4(smollm2_mmap):
    """With an f32 cache (an f16 cache rounds K/V, which turns 1e-7 matvec differences into
    1e-3 jumps of single elements), the placed logits are the mmap ones to float32 reordering."""
    req = PlacementRequest(vram_bytes=806 * MiB, n_ctx=4096, cache_type_k="f32", cache_type_v="f32")
    placed = load_model(require(SMOLLM2), placement=req, exact_activations=True)
    assert len(placed.plan.ffn_gpu_layers) >= 10 and placed.plan.ffn_cpu_layers
    ids = smollm2_mmap.tokenize(PROMPT)
    ref = smollm2_mmap.session(512, "f32").eval(ids).double()
    got = placed.session(512).eval(ids).double()
    rel = ((got - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
    assert rel <= 1e-4, rel


def test_placed_verify_batch_is_bitwise_single_steps(smollm2_placed):
    ids = smollm2_placed.tokenize(PROMPT)
    batch = smollm2_placed.session(512)
    batch.eval(ids[:-4])
    together = batch.eval(ids[-4:])
    single = smollm2_placed.session(512)
    single.eval(ids[:-4])
    alone = torch.cat([single.eval([t]) for t in ids[-4:]])
    assert torch.equal(together, alone)


def test_tiny_qwen35_mtp_placed_speculative_parity(tiny_qwen35_mtp):
    """A tiny qwen35 + MTP file placed with draft-mtp N = 3: some FFN layers on the device, one
    split, the rest on the worker; speculative greedy output equals the all-mmap plain run."""
    base = PlacementRequest(n_ctx=256, cache_type_k="f32", cache_type_v="f32", spec_type="draft-mtp",
                            spec_draft_n_max=3)
    placed = load_placed(tiny_qwen35_mtp, base, 3, 2.5)
    plan = placed.plan
    assert plan.ffn_gpu_layers == [0, 1, 2] and plan.ffn_split.layer == 3 and plan.ffn_split.gpu_units == 64
    assert isinstance(ffn_of(placed, 3), SplitFFN) and isinstance(ffn_of(placed, 5), HostFFN)
    assert isinstance(placed.mtp.eh_proj, DeviceLinear)          # draft weights are reserved first
    plain = load_model(tiny_qwen35_mtp)
    gdn = next(layer.mixer.mixer for layer in placed.layers if layer.kind == "gdn")
    assert len(gdn.in_rows) == 4 and not gdn.w_rest                # the device trunk's GDN inputs, stacked
    mmap_gdn = next(layer.mixer.mixer for layer in plain.layers if layer.kind == "gdn")
    assert mmap_gdn.w_in is None and len(mmap_gdn.w_rest) == 4     # in the mmap: no stacked copy
    mmap_attn = next(layer.mixer.attn for layer in plain.layers if layer.kind == "attention")
    assert mmap_attn.wqkv is None                                   # nor of q, k and v
    prompt = [1, 5, 9, 2, 7, 3, 8, 4]
    ref, _ = generate(plain, plain.session(256, "f32"), prompt, 24, GREEDY, stop_ids=set())
    spec = SpecConfig(n_max=3)
    session = placed.session(256)
    source = build_source("draft-mtp", session, GREEDY, spec, None)
    got, stats = generate(placed, session, prompt, 24, GREEDY, source, spec, stop_ids=set())
    assert got == ref and stats.spec.steps > 0


def test_trace_is_chrome_json_and_the_split_halves_overlap(tmp_path):
    """The split layer's CPU half (worker thread) and device half (queued by the main thread) run at
    the same time: in the trace their spans intersect. Op offload is off (a longer prompt batch would
    run the layer on the device alone)."""
    tracer = Tracer("cpu")
    m = load_model(require(SMOLLM2), placement=PlacementRequest(vram_bytes=716 * MiB, n_ctx=4096, op_offload=False),
                   trace=tracer)
    ids = m.tokenize(PROMPT * 4)       # a 60+ token batch: both halves take milliseconds
    s = m.session(512)
    for _ in range(3):
        s.eval(ids, start_pos=0, logits="last")
    path = tmp_path / "trace.json"
    tracer.write(path)
    doc = json.loads(path.read_text())
    events = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert {e["cat"] for e in events} >= {"step", "device", "cpu_ffn", "transfer"}
    assert all(isinstance(e["ts"], float) and e["dur"] >= 0 and e["pid"] == 1 for e in events)
    assert any(e["ph"] == "M" and e["name"] == "thread_name" for e in doc["traceEvents"])
    layer = m.plan.ffn_split.layer
    cpu = [e for e in events if e["cat"] == "cpu_ffn" and e["name"].startswith(f"cpu ffn blk.{layer} [")]
    dev = [e for e in events if e["cat"] == "device" and e["name"] == f"device ffn blk.{layer} (split half)"]
    assert len(cpu) == len(dev) == 3
    overlaps = [min(c["ts"] + c["dur"], d["ts"] + d["dur"]) - max(c["ts"], d["ts"]) for c, d in zip(cpu, dev)]
    assert max(overlaps) > 0, overlaps


# --- on a real GPU (scripts/gpu_check.sh runs these) ----------------------------------------------

@pytest.mark.cuda
def test_cuda_placed_smollm2_agrees_with_the_mmap_run(smollm2_mmap):
    """Device weights in float16 / fused kernels: teacher-forced top-1 agrees with the CPU run."""
    placed = load_model(require(SMOLLM2), device="cuda", placement=PlacementRequest(vram_bytes=716 * MiB, n_ctx=4096))
    assert placed.plan.ffn_split is not None
    ids = smollm2_mmap.tokenize(PROMPT * 8)
    ref = smollm2_mmap.session(1024, "f16").eval(ids)
    got = placed.session(1024).eval(ids).cpu()
    agree = (ref.argmax(-1) == got.argmax(-1)).double().mean().item()
    assert agree >= 0.95, agree


@pytest.mark.cuda
def test_cuda_placed_verify_batch_bitwise_and_speculative_parity(tiny_qwen35_mtp):
    base = PlacementRequest(n_ctx=256, cache_type_k="f32", cache_type_v="f32", spec_type="draft-mtp",
                            spec_draft_n_max=3)
    placed = load_placed(tiny_qwen35_mtp, base, 3, 2.5, device="cuda")
    prompt = [1, 5, 9, 2, 7, 3, 8, 4]
    a = placed.session(256)
    a.eval(prompt)
    together = a.eval([6, 2, 9, 4])
    b = placed.session(256)
    b.eval(prompt)
    alone = torch.cat([b.eval([t]) for t in (6, 2, 9, 4)])
    assert torch.equal(together, alone)
    ref, _ = generate(placed, placed.session(256), prompt, 24, GREEDY, stop_ids=set())
    spec = SpecConfig(n_max=3)
    session = placed.session(256)
    source = build_source("draft-mtp", session, GREEDY, spec, None)
    got, _ = generate(placed, session, prompt, 24, GREEDY, source, spec, stop_ids=set())
    assert got == ref


def test_python_api_vram_string_plans_like_the_cli():
    m = load_model(require(SMOLLM2), vram="716MiB")
    assert m.plan.options.vram_bytes == 716 * MiB and len(m.plan.ffn_gpu_layers) == 13
    s = m.session()
    assert (s.n_ctx, s.k_max) == (4096, 1)
    from hybridrt.errors import UserError

    with pytest.raises(UserError, match="more than the plan reserved"):
        m.session(8192)
    with pytest.raises(UserError, match="differs from the plan"):
        m.session(512, "f32")


def test_default_int8_activations_placed_equals_mmap():
    """By default the mmap'd layers run on int8 activations; device layers quantize theirs the same
    way (QuantLinear's int8 round trip), so the placed run keeps the all-mmap run's tokens."""
    mmap = load_model(require(SMOLLM2))
    placed = load_model(require(SMOLLM2), placement=PlacementRequest(vram_bytes=716 * MiB, n_ctx=4096))
    assert all(w.act_block for w in (ffn_of(placed, 0).gate_up[0], placed.output))
    ids = mmap.tokenize(PROMPT)
    ref, _ = generate(mmap, mmap.session(512, "f16"), ids, 32, GREEDY)
    got, _ = generate(placed, placed.session(512), ids, 32, GREEDY)
    assert got == ref
    batch = placed.session(512)
    batch.eval(ids[:-4])
    together = batch.eval(ids[-4:])
    single = placed.session(512)
    single.eval(ids[:-4])
    assert torch.equal(together, torch.cat([single.eval([t]) for t in ids[-4:]]))
