"""Op offload (llama.cpp's name): with a plan executing, a prompt batch of OP_OFFLOAD_MIN_BATCH or
more tokens copies each CPU FFN layer's weights into one device staging buffer and runs the layer
there; decode and verify steps keep the CPU path. The planner reserves that buffer (the largest FFN
layer) before it places FFN layers, only when some layer stays on the CPU. Checked with the CPU
standing in for the device: which batches take it, and that the result is the all-mmap run's."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from hybridrt.runtime.backends import OP_OFFLOAD_MIN_BATCH, HostFFN, SplitFFN, StreamedFFN, staged_bytes
from hybridrt.decoding.generate import generate
from hybridrt.runtime.loader import load_model
from hybridrt.files.model_profile import load_profile
from hybridrt.runtime.place import PlacementRequest
from hybridrt.decoding.sampling import SamplerConfig
from hybridrt.runtime.trace import Tracer
from placement import PlanOptions, plan
from placement.plan import OP_OFFLOAD_MIN_BATCH as PLANNED_MIN_BATCH
from tests.real_models import SMOLLM2, require
from tests.test_placed_run import ffn_of, load_placed

pytestmark = pytest.mark.usefixtures("single_thread")

MiB = 1 << 20
TEXT = ("The capital of France is a city that has many famous museums, such as the Louvre, the Orsay and "
        "the Pompidou centre, and many parks where people walk on Sunday afternoons in the spring. Its "
        "river runs from east to west under thirty-seven bridges, the oldest of which is called the New "
        "Bridge; boats carry visitors past the cathedral, the town hall and the old royal palace.")


def test_the_runtime_and_the_planner_agree_on_the_batch():
    assert OP_OFFLOAD_MIN_BATCH == PLANNED_MIN_BATCH == 64
    from hybridrt.cli.run import MAX_DRAFTS

    assert OP_OFFLOAD_MIN_BATCH > MAX_DRAFTS + 1        # no verify batch takes it


def test_plan_reserves_the_largest_layer_only_when_a_layer_stays_on_the_cpu():
    profile = load_profile(str(require(SMOLLM2)))
    biggest = max(profile.ffn_layer_bytes().values())
    on = plan(profile, PlanOptions(vram_bytes=716 * MiB))
    off = plan(profile, PlanOptions(vram_bytes=716 * MiB, op_offload=False))
    assert on.line("op_offload").gpu_bytes == biggest and off.line("op_offload").gpu_bytes == 0
    # the staging takes one layer's room: one whole layer fewer on the GPU, the same split units
    assert len(on.ffn_gpu_layers) == len(off.ffn_gpu_layers) - 1 == 13
    assert on.gpu_bytes <= on.options.vram_bytes and "--no-op-offload" in on.line("op_offload").detail
    roomy = plan(profile, PlanOptions(vram_bytes=64 << 30))
    assert roomy.line("op_offload").gpu_bytes == 0 and not roomy.ffn_cpu_layers
    fixed = sum(line.gpu_bytes for line in roomy.lines if line.stage < 4)
    tight = plan(profile, PlanOptions(vram_bytes=fixed + biggest // 2))     # not even the staging fits
    assert tight.line("op_offload").gpu_bytes == 0 and "does not fit" in tight.line("op_offload").detail
    assert tight.ffn_gpu_layers == []


@pytest.fixture(scope="module")
def placed():
    """SmolLM2 placed with 10 FFN layers on the device, layer 10 split, 11-29 on the CPU; float32
    activations as the device backends take, an f32 cache; traced."""
    tracer = Tracer("cpu")
    req = PlacementRequest(n_ctx=1024, cache_type_k="f32", cache_type_v="f32")
    return load_placed(require(SMOLLM2), req, 10, 2.5, exact_activations=True, trace=tracer), tracer


def _offloads(tracer: Tracer) -> list[str]:
    return [e["name"] for e in tracer.events() if e["name"].startswith("op offload ")]


def test_every_cpu_layer_is_bound_with_its_streamed_path(placed):
    m, _ = placed
    for layer in m.plan.ffn_cpu_layers:
        ffn = ffn_of(m, layer)
        host = ffn.host_half if isinstance(ffn, SplitFFN) else ffn
        assert isinstance(host, HostFFN) and isinstance(host.streamed, StreamedFFN)
        assert host.streamed.nbytes == staged_bytes(host.ffn) <= m.plan.line("op_offload").gpu_bytes + 3 * 256


def test_prompt_batches_take_it_and_small_batches_do_not(placed):
    m, tracer = placed
    ids = m.tokenize(TEXT)
    assert len(ids) >= OP_OFFLOAD_MIN_BATCH + 4
    s = m.session(256)
    n0 = len(_offloads(tracer))
    s.eval(ids[:OP_OFFLOAD_MIN_BATCH - 1])          # 63 tokens: the CPU path
    assert len(_offloads(tracer)) == n0
    s.eval(ids[:OP_OFFLOAD_MIN_BATCH], start_pos=0)     # 64: every CPU layer, the split one's CPU half too
    names = _offloads(tracer)[n0:]
    split = m.plan.ffn_split.layer
    assert len(names) == len(m.plan.ffn_cpu_layers)
    assert f"op offload blk.{split} [{m.plan.ffn_split.gpu_units}:]" in names


def test_prompt_logits_and_greedy_tokens_are_the_mmap_runs(placed):
    m, _ = placed
    mmap = load_model(require(SMOLLM2), exact_activations=True)
    ids = m.tokenize(TEXT)
    ref = mmap.session(256, "f32").eval(ids, logits="all").double()
    got = m.session(256).eval(ids, logits="all").double()
    rel = ((got - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
    assert rel <= 1e-4, rel
    greedy = SamplerConfig(temp=0.0)
    want, _ = generate(mmap, mmap.session(256, "f32"), ids, 16, greedy)
    have, _ = generate(m, m.session(256), ids, 16, greedy)
    assert have == want


def test_no_op_offload_keeps_prompts_on_the_cpu():
    tracer = Tracer("cpu")
    req = PlacementRequest(vram_bytes=716 * MiB, n_ctx=4096, op_offload=False)
    m = load_model(require(SMOLLM2), placement=req, exact_activations=True, trace=tracer)
    assert len(m.plan.ffn_gpu_layers) == 14
    assert all(ffn_of(m, layer).streamed is None for layer in m.plan.ffn_cpu_layers if layer != m.plan.ffn_split.layer)
    m.session(256).eval(m.tokenize(TEXT))
    assert _offloads(tracer) == []


def test_streamed_layer_is_the_cpu_layer(placed):
    """One CPU layer alone: its streamed result against its CPU kernel's on a 67-row batch."""
    m, _ = placed
    host = ffn_of(m, m.plan.ffn_cpu_layers[-1])
    x = torch.randn(OP_OFFLOAD_MIN_BATCH + 3, host.n_embd, generator=torch.Generator().manual_seed(3))
    want = host.ffn(x).double()
    got = host.streamed(x).double()
    assert ((got - want).norm(dim=-1) / want.norm(dim=-1)).max().item() <= 1e-5
    # the buffer is the executor's one, reused layer after layer
    assert m.executor.staging(1).data_ptr() == m.executor.staging(host.streamed.nbytes).data_ptr()
    assert dataclasses.is_dataclass(m.plan.options) and m.plan.options.op_offload


@pytest.mark.cuda
def test_cuda_prompt_batches_stream_and_agree_with_the_cpu_path():
    """On a GPU (scripts/gpu_check.sh): a 64+ token prompt streams every CPU layer, and its logits
    pick the same top-1 as the same plan with prompts left on the CPU."""
    tracer = Tracer("cuda")
    req = PlacementRequest(vram_bytes=716 * MiB, n_ctx=4096)
    on = load_model(require(SMOLLM2), device="cuda", placement=req, trace=tracer)
    off = load_model(require(SMOLLM2), device="cuda", placement=dataclasses.replace(req, op_offload=False))
    ids = on.tokenize(TEXT * 2)
    got = on.session(512).eval(ids, logits="all").cpu()
    ref = off.session(512).eval(ids, logits="all").cpu()
    assert len(_offloads(tracer)) == len(on.plan.ffn_cpu_layers)
    agree = (got.argmax(-1) == ref.argmax(-1)).double().mean().item()
    assert agree >= 0.95, agree
