"""The VRAM planner on hand-made profiles and on the two real small models."""
from __future__ import annotations

import re

import numpy as np
import pytest
from gguf import GGUFWriter

from hybridrt.files.model_profile import load_profile
from placement import (AttentionShape, GDNShape, LayerProfile, MiB, ModelProfile, PlanError, PlanOptions,
                       TensorEntry, cache_row_bytes, expected_tokens_per_step, layer_ranges, plan, scratch_bytes)
from tests.real_models import GEMMA3, SMOLLM2, require

ATTN = AttentionShape(n_head=8, n_head_kv=2, head_dim_k=64, head_dim_v=64)
GDN = GDNShape(n_v_heads=4, head_dim=32, conv_channels=3 * 128, conv_kernel=4)


def synthetic_profile(ffn_sizes=(10 * MiB,) * 8, interval=4, mtp=True, tied=False, embd_bytes=40 * MiB,
                      head_bytes=30 * MiB, mixer_bytes=4 * MiB) -> ModelProfile:
    """A qwen35-like profile: layer i is attention iff (i + 1) % interval == 0, else GDN."""
    n_layer = len(ffn_sizes)
    layers, tensors = [], []
    for i, ffn in enumerate(ffn_sizes):
        kind = "attention" if (i + 1) % interval == 0 else "gdn"
        layers.append(LayerProfile(kind, attention=ATTN) if kind == "attention" else LayerProfile(kind, gdn=GDN))
        tensors += [TensorEntry(f"blk.{i}.mixer.weight", kind, mixer_bytes, i),
                    TensorEntry(f"blk.{i}.attn_norm.weight", "norm", 1024, i),
                    TensorEntry(f"blk.{i}.ffn_up.weight", "ffn", ffn // 2, i),
                    TensorEntry(f"blk.{i}.ffn_down.weight", "ffn", ffn - ffn // 2, i)]
    tensors.append(TensorEntry("token_embd.weight", "output" if tied else "embedding", embd_bytes))
    if not tied:
        tensors.append(TensorEntry("output.weight", "output", head_bytes))
    tensors.append(TensorEntry("output_norm.weight", "norm", 1024))
    mtp_layers = ()
    if mtp:
        tensors += [TensorEntry(f"blk.{n_layer}.attn_q.weight", "mtp", 3 * MiB, n_layer),
                    TensorEntry(f"blk.{n_layer}.ffn_up.weight", "mtp", 8 * MiB, n_layer)]
        mtp_layers = (LayerProfile("attention", attention=ATTN),)
    return ModelProfile(name="synthetic", arch="qwen35", n_embd=256, n_vocab=4096, n_ff=1024, mixer_width=768,
                        layers=tuple(layers), tensors=tuple(tensors), mtp_layers=mtp_layers, output_tied=tied)


def fixed_gpu(p):
    return sum(line.gpu_bytes for line in p.lines if line.stage < 4)


# ---- sizes ---------------------------------------------------------------------------------------

def test_cache_row_bytes():
    assert cache_row_bytes("f16", 128) == 256
    assert cache_row_bytes("f32", 128) == 512
    assert cache_row_bytes("q8_0", 128) == 4 * 34
    with pytest.raises(ValueError, match="multiples of 32"):
        cache_row_bytes("q8_0", 48)
    with pytest.raises(ValueError, match="unknown cache type"):
        cache_row_bytes("q4_0", 128)


def test_gdn_state_of_the_27b_is_about_150_mib():
    layer = GDNShape(n_v_heads=48, head_dim=128, conv_channels=2 * 16 * 128 + 6144, conv_kernel=4)
    assert layer.state_bytes == 4 * (48 * 128 * 128 + 3 * 10240)
    assert 145 * MiB < 48 * layer.state_bytes < 155 * MiB


def test_kv_bytes_per_token():
    prof = synthetic_profile()
    per_layer_f16 = 2 * 2 * 64 * 2          # n_kv x (k + v) x head_dim x 2 B
    assert prof.kv_bytes_per_token("f16", "f16") == 2 * per_layer_f16
    assert prof.kv_bytes_per_token("q8_0", "f16") == 2 * (2 * 2 * 34 + 2 * 64 * 2)
    assert prof.mtp_kv_bytes_per_token("f16", "f16") == per_layer_f16


def test_layer_ranges():
    assert layer_ranges([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8"
    assert layer_ranges([]) == ""
    assert layer_ranges([4]) == "4"


# ---- the reservations --------------------------------------------------------------------------------

def test_lines_add_up_and_follow_the_reservation_order():
    prof = synthetic_profile()
    opt = PlanOptions(vram_bytes=1024 * MiB, margin_bytes=64 * MiB, n_ctx=8192, spec_type="draft-mtp",
                      spec_draft_n_max=3)
    p = plan(prof, opt)
    assert [line.stage for line in p.lines] == sorted(line.stage for line in p.lines)
    assert p.lines[0].key == "overhead" and p.lines[0].gpu_bytes == 64 * MiB
    assert p.lines[-1].key == "ffn"
    assert p.gpu_bytes <= opt.vram_bytes
    # every tensor byte is on exactly one device, and the weight lines hold exactly those bytes
    by_device = {"gpu": 0, "cpu": 0, "unused": 0}
    for t in prof.tensors:
        by_device[p.tensor_device[t.name]] += t.nbytes
    assert sum(by_device.values()) == prof.total_bytes and by_device["unused"] == 0
    state_keys = {"overhead", "gdn_snapshot_ring", "draft_kv", "kv_cache", "recurrent_state", "scratch", "draft_state"}
    assert sum(line.gpu_bytes for line in p.lines if line.key not in state_keys) == by_device["gpu"]
    assert p.cpu_bytes == by_device["cpu"]
    # the pieces: ring N x state, MTP KV for the context, live state, KV, embedding on the CPU
    assert p.line("gdn_snapshot_ring").gpu_bytes == 3 * 6 * GDN.state_bytes
    assert p.line("recurrent_state").gpu_bytes == 6 * GDN.state_bytes
    assert p.line("draft_kv").gpu_bytes == 8192 * prof.mtp_kv_bytes_per_token("f16", "f16")
    assert p.line("draft_weights").gpu_bytes == 11 * MiB
    assert p.line("kv_cache").gpu_bytes == 8192 * prof.kv_bytes_per_token("f16", "f16")
    assert p.line("scratch").gpu_bytes == scratch_bytes(prof, 4, 8192)
    assert p.line("embedding").cpu_bytes == 40 * MiB and p.tensor_device["token_embd.weight"] == "cpu"
    assert p.tensor_device["output.weight"] == "gpu"


def test_tied_embedding_is_the_output_head_on_the_gpu():
    prof = synthetic_profile(tied=True)
    p = plan(prof, PlanOptions(vram_bytes=1024 * MiB, margin_bytes=64 * MiB, n_ctx=1024))
    assert p.tensor_device["token_embd.weight"] == "gpu"
    assert p.line("output_head").gpu_bytes == 40 * MiB and p.line("embedding").cpu_bytes == 0


def test_plain_decoding_has_no_ring_and_leaves_mtp_unused():
    prof = synthetic_profile()
    p = plan(prof, PlanOptions(vram_bytes=1024 * MiB, margin_bytes=64 * MiB, n_ctx=1024, spec_type="none"))
    assert p.line("gdn_snapshot_ring").gpu_bytes == 0 and p.line("draft_weights").gpu_bytes == 0
    assert p.tensor_device[f"blk.{prof.n_layer}.attn_q.weight"] == "unused"
    assert p.speed.spec_tok_s is None
    assert p.line("scratch").gpu_bytes == scratch_bytes(prof, 1, 1024)


def test_ffn_front_first_then_fills_the_remainder():
    sizes = [20 * MiB, 20 * MiB, 30 * MiB, 20 * MiB, 30 * MiB, 20 * MiB, 20 * MiB, 20 * MiB]
    prof = synthetic_profile(ffn_sizes=sizes)
    opt = PlanOptions(vram_bytes=1024 * MiB, margin_bytes=64 * MiB, n_ctx=1024, op_offload=False)   # the FFN rule alone
    fixed = fixed_gpu(plan(prof, opt))
    # room for layers 0, 1 (40 MiB) plus 25 MiB: layer 2 (30) does not fit, layer 3 (20) does
    p = plan(prof, PlanOptions(vram_bytes=fixed + 65 * MiB, margin_bytes=64 * MiB, n_ctx=1024, op_offload=False))
    assert p.ffn_gpu_layers == [0, 1, 3]
    assert p.ffn_cpu_layers == [2, 4, 5, 6, 7]
    assert p.line("ffn").gpu_bytes == 60 * MiB and p.free_bytes == 5 * MiB
    assert "0-1, 3 (3 layers)" in p.line("ffn").detail
    assert re.search(r"5\.0 MiB of VRAM was left and the smallest of them needs 20\.0 MiB", p.not_fitted[0])


def test_moe_experts_are_ffn_and_read_in_their_routed_share():
    base = synthetic_profile(mtp=False)
    tensors = [t for t in base.tensors if t.role != "ffn"] + [
        TensorEntry(f"blk.{i}.ffn_up_exps.weight", "ffn", 64 * MiB, i, expert=True) for i in range(base.n_layer)]
    prof = ModelProfile(**{**base.__dict__, "tensors": tuple(tensors), "n_expert": 64, "n_expert_used": 4})
    p = plan(prof, PlanOptions(vram_bytes=512 * MiB, margin_bytes=64 * MiB, n_ctx=1024, spec_type="ngram-simple",
                               spec_draft_n_max=2, cpu_bw=10e9, gpu_bw=100e9))
    cpu_experts = 64 * MiB * len(p.ffn_cpu_layers)
    assert p.ffn_cpu_layers
    embd_row = 40 * MiB / prof.n_vocab
    assert p.speed.plain_cpu_bytes == int(cpu_experts * 4 / 64 + embd_row)
    assert p.speed.verify_cpu_bytes == int(cpu_experts * (1 - (60 / 64) ** 3) + 3 * embd_row)


# ---- speed -------------------------------------------------------------------------------------------

def test_tokens_per_step():
    assert expected_tokens_per_step(0.8, 3) == pytest.approx(1 + 0.8 + 0.64 + 0.512)
    assert expected_tokens_per_step(0.0, 5) == 1
    assert expected_tokens_per_step(1.0, 4) == 5


def test_speed_reads_cpu_ffn_once_per_verify_step():
    prof = synthetic_profile()
    opt = PlanOptions(vram_bytes=1024 * MiB, margin_bytes=64 * MiB, n_ctx=4096, spec_type="draft-mtp",
                      spec_draft_n_max=3, gpu_bw=400e9, cpu_bw=20e9, layer_overhead_s=0, handoff_overhead_s=0,
                      split_ffn=False, op_offload=False)
    fixed = fixed_gpu(plan(prof, opt))
    p = plan(prof, PlanOptions(**{**opt.__dict__, "vram_bytes": fixed + 25 * MiB}))
    s = p.speed
    assert p.ffn_cpu_layers == [2, 3, 4, 5, 6, 7]
    embd_row = 40 * MiB / prof.n_vocab
    assert s.plain_cpu_bytes == int(60 * MiB + embd_row)
    assert s.verify_cpu_bytes == int(60 * MiB + 4 * embd_row)      # the FFN once, not four times
    gpu_weights = sum(line.gpu_bytes for line in p.lines if line.key in (
        "attention_weights", "gdn_weights", "norms", "output_head", "ffn"))
    kv_tok, state = prof.kv_bytes_per_token("f16", "f16"), prof.recurrent_state_bytes
    assert s.plain_gpu_bytes == int(gpu_weights + 2048 * kv_tok + 2 * state)
    assert s.plain_step_s == pytest.approx(s.plain_gpu_bytes / 400e9 + s.plain_cpu_bytes / 20e9)
    assert s.verify_gpu_bytes == int(gpu_weights + 4 * 2048 * kv_tok + (2 + 3) * state)
    assert s.spec_tok_s == pytest.approx(s.tokens_per_step / s.spec_step_s)
    assert s.spec_step_s > s.verify_step_s + 3 * s.draft_step_s        # plus the MTP KV rewrite pass
    # with nothing accepted speculation only costs time
    none_ok = plan(prof, PlanOptions(**{**p.options.__dict__, "accept_rate": 0.0})).speed
    assert none_ok.spec_tok_s < none_ok.plain_tok_s


# ---- when it does not fit, and bad options -----------------------------------------------------------

def test_trunk_that_does_not_fit_says_the_minimum_and_what_fits():
    prof = synthetic_profile()
    opt = PlanOptions(vram_bytes=400 * MiB, margin_bytes=64 * MiB, n_ctx=262144, spec_type="draft-mtp",
                      spec_draft_n_max=4)
    need = fixed_gpu(plan(prof, PlanOptions(**{**opt.__dict__, "vram_bytes": 64 << 30})))
    with pytest.raises(PlanError) as err:
        plan(prof, opt)
    assert err.value.min_vram_bytes == need > opt.vram_bytes
    msg = str(err.value)
    assert f"at least {need / MiB:,.1f} MiB" in msg and "it fits with" in msg
    ctx = int(re.search(r"-c (\d+)", msg).group(1))
    p = plan(prof, PlanOptions(**{**opt.__dict__, "n_ctx": ctx}))           # the suggestion holds
    assert fixed_gpu(p) <= opt.vram_bytes
    with pytest.raises(PlanError):
        plan(prof, PlanOptions(**{**opt.__dict__, "n_ctx": ctx + 256}))    # and is the largest


def test_nothing_fits_asks_for_more_vram():
    with pytest.raises(PlanError, match="a larger --vram is needed") as err:
        plan(synthetic_profile(), PlanOptions(vram_bytes=100 * MiB, margin_bytes=512 * MiB))
    assert err.value.min_vram_bytes > 512 * MiB


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(spec_type="draft-mtp"), "no MTP head"),
    (dict(spec_type="draft-simple"), "needs a draft model"),
    (dict(spec_type="draft-mtp", spec_draft_n_max=0), "at least 1"),
    (dict(cache_type_k="q4_0"), "unknown --cache-type-k"),
    (dict(spec_type="eagle"), "unknown --spec-type"),
    (dict(accept_rate=1.5), "--accept-rate"),
    (dict(n_ctx=0), "context size"),
    (dict(spec_type="ngram-simple", spec_draft_n_max=4, k_max=3), "k_max"),
])
def test_bad_options(kwargs, fragment):
    with pytest.raises(PlanError, match=re.escape(fragment)):
        plan(synthetic_profile(mtp=False), PlanOptions(**kwargs))


def test_draft_model_is_reserved_before_the_trunk():
    target, draft = synthetic_profile(mtp=False), synthetic_profile(mtp=False, ffn_sizes=(1 * MiB,) * 2, interval=1)
    p = plan(target, PlanOptions(vram_bytes=2048 * MiB, margin_bytes=64 * MiB, n_ctx=2048, spec_type="draft-simple",
                                 spec_draft_n_max=2, draft=draft))
    assert p.line("draft_weights").gpu_bytes == draft.total_bytes
    assert p.line("draft_kv").gpu_bytes == 2048 * draft.kv_bytes_per_token("f16", "f16")
    assert p.line("draft_state").gpu_bytes == scratch_bytes(draft, 1, 2048)       # attention-only draft
    assert p.speed.draft_step_s > 0


# ---- real files --------------------------------------------------------------------------------------

@pytest.mark.parametrize("path, n_layer, kv_per_token", [(SMOLLM2, 30, 30 * 3 * 64 * 2 * 2),
                                                          (GEMMA3, 18, 18 * 1 * 256 * 2 * 2)])
def test_real_profiles(path, n_layer, kv_per_token):
    prof = load_profile(require(path))
    assert prof.n_layer == n_layer and not prof.has_mtp and prof.output_tied
    assert prof.kv_bytes_per_token("f16", "f16") == kv_per_token
    assert sorted(prof.ffn_layer_bytes()) == list(range(n_layer))
    roles = {t.name: t.role for t in prof.tensors}
    assert roles["token_embd.weight"] == "output" and roles["blk.0.ffn_up.weight"] == "ffn"
    assert roles["blk.0.ffn_norm.weight"] == "norm" and roles["blk.0.attn_q.weight"] == "attention"
    assert "other" not in roles.values()


@pytest.mark.parametrize("path", [SMOLLM2, GEMMA3])
def test_real_models_split_under_a_small_budget(path):
    prof = load_profile(require(path))
    opt = PlanOptions(margin_bytes=64 * MiB, n_ctx=2048, vram_bytes=64 << 30)
    whole = plan(prof, opt)
    assert whole.ffn_cpu_layers == []
    budget = fixed_gpu(whole) + whole.line("ffn").gpu_bytes // 2
    p = plan(prof, PlanOptions(**{**opt.__dict__, "vram_bytes": budget}))
    assert p.ffn_gpu_layers and p.ffn_cpu_layers
    assert p.ffn_gpu_layers[0] == 0 and p.gpu_bytes <= budget
    assert p.line("ffn").gpu_bytes + p.line("ffn").cpu_bytes == prof.role_bytes("ffn")


def test_qwen35moe_tensor_table(tmp_path):
    """A tiny qwen35moe-shaped header: routed experts are FFN (flagged expert), router and shared
    expert are trunk-side (moe_shared); GDN layers found."""
    path = tmp_path / "moe.gguf"
    w = GGUFWriter(str(path), "qwen35moe")
    n_embd, n_exp, n_used, ff_exp, ff_sh = 64, 8, 2, 32, 48
    w.add_block_count(4)
    w.add_uint32("qwen35moe.full_attention_interval", 4)
    w.add_uint32("qwen35moe.attention.head_count", 2)
    w.add_uint32("qwen35moe.attention.head_count_kv", 1)
    w.add_uint32("qwen35moe.attention.key_length", 32)
    w.add_uint32("qwen35moe.attention.value_length", 32)
    w.add_uint32("qwen35moe.ssm.state_size", 16)
    w.add_uint32("qwen35moe.ssm.time_step_rank", 4)
    w.add_uint32("qwen35moe.expert_count", n_exp)
    w.add_uint32("qwen35moe.expert_used_count", n_used)
    rng = np.random.default_rng(0)

    def add(name, *shape):          # numpy order: reversed ggml shape
        w.add_tensor(name, rng.standard_normal(shape[::-1]).astype(np.float32))

    add("token_embd.weight", n_embd, 100)
    add("output.weight", n_embd, 100)
    add("output_norm.weight", n_embd)
    for i in range(4):
        add(f"blk.{i}.attn_norm.weight", n_embd)
        if i == 3:
            add(f"blk.{i}.attn_q.weight", n_embd, 128)
            add(f"blk.{i}.attn_k.weight", n_embd, 32)
        else:
            add(f"blk.{i}.attn_qkv.weight", n_embd, 128)
            add(f"blk.{i}.ssm_conv1d.weight", 4, 128)
            add(f"blk.{i}.ssm_a", 4)
            add(f"blk.{i}.ssm_norm.weight", 16)
        add(f"blk.{i}.ffn_gate_inp.weight", n_embd, n_exp)
        add(f"blk.{i}.ffn_up_exps.weight", n_embd, ff_exp, n_exp)
        add(f"blk.{i}.ffn_down_exps.weight", ff_exp, n_embd, n_exp)
        add(f"blk.{i}.ffn_up_shexp.weight", n_embd, ff_sh)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    prof = load_profile(path)
    assert [layer.kind for layer in prof.layers] == ["gdn", "gdn", "gdn", "attention"]
    assert prof.layers[0].gdn == GDNShape(n_v_heads=4, head_dim=16, conv_channels=128, conv_kernel=4)
    roles = {t.name: (t.role, t.expert) for t in prof.tensors}
    assert roles["blk.0.ffn_up_exps.weight"] == ("ffn", True)
    assert roles["blk.0.ffn_gate_inp.weight"] == ("moe_shared", False)
    assert roles["blk.0.ffn_up_shexp.weight"] == ("moe_shared", False)
    assert roles["blk.0.ssm_norm.weight"] == ("gdn", False)
    assert roles["token_embd.weight"] == ("embedding", False)
    assert prof.n_ff == n_used * ff_exp + ff_sh and (prof.n_expert, prof.n_expert_used) == (n_exp, n_used)
    assert prof.recurrent_state_bytes == 3 * 4 * (4 * 16 * 16 + 3 * 128)


def test_gpu_peak_bandwidth():
    from placement import gpu_peak_bandwidth

    # H100 SXM: HBM3 at 2619 MHz on a 5120-bit bus, double data rate
    assert gpu_peak_bandwidth("NVIDIA H100 80GB HBM3", 2_619_000, 5120) == pytest.approx(3.352e12, rel=1e-3)
    assert gpu_peak_bandwidth("NVIDIA GeForce RTX 4070") == 504e9
    assert gpu_peak_bandwidth("NVIDIA H100 PCIe") == 2000e9
    assert gpu_peak_bandwidth("Some Future Card") is None


def test_cpu_bandwidth_probe_is_quick():
    import time

    from placement import measure_cpu_bandwidth

    t0 = time.process_time()
    bw = measure_cpu_bandwidth()
    assert 1e8 < bw < 1e13
    # CPU seconds (robust on a shared machine): the work is fixed, 256 MiB filled (~0.6 s of page
    # faults on the dev VM) and 8 x 256 MiB read
    assert time.process_time() - t0 < 2.0


def test_the_planner_and_the_runtime_share_one_statement_of_their_constants():
    """placement.constants is the one place: the runtime's names are the same objects, not copies."""
    import importlib

    from placement import constants

    # (import_module: `placement.plan` and `hybridrt.decoding.generate` are also the names of functions)
    cli_options, crossing, generate, kv_cache, session, spec_types, plan = (
        importlib.import_module(m) for m in ("hybridrt.cli.options", "hybridrt.runtime.backends.crossing", "hybridrt.decoding.generate",
                                             "hybridrt.runtime.kv_cache", "hybridrt.runtime.session", "hybridrt.decoding.speculative.spec_types",
                                             "placement.plan"))

    assert session.PROMPT_CHUNK is generate.PROMPT_CHUNK is plan.PROMPT_CHUNK is constants.PROMPT_CHUNK
    assert crossing.OP_OFFLOAD_MIN_BATCH is plan.OP_OFFLOAD_MIN_BATCH is constants.OP_OFFLOAD_MIN_BATCH
    assert spec_types.SPEC_TYPES is plan.SPEC_TYPES is constants.SPEC_TYPES
    assert kv_cache.CACHE_TYPES is plan.CACHE_TYPES is constants.CACHE_TYPES
    assert set(kv_cache.CACHE_DTYPES) | {"q8_0"} == set(constants.CACHE_TYPES)
    assert cli_options.KV_TYPES == "f16, f32, bf16, q8_0"       # -ctk's help: the default first
    # the device kernels' too (torch-importing modules, where triton may be absent: only constants read)
    from gpu_kernels import attention, qlinear

    assert qlinear.TILE_ELEMS is plan.DEQUANT_TILE_ELEMS is constants.DEQUANT_TILE_ELEMS
    assert (attention.Q8_0_BLOCK, attention.Q8_0_BYTES) == constants.CACHE_TYPES["q8_0"]


def test_scratch_holds_a_prompt_chunk_of_activations():
    """A verify batch's logits, a prompt chunk's per-token activations: the larger batch counts."""
    prof = synthetic_profile()
    per_token = 4 * (4 * prof.n_embd + 2 * prof.mixer_width + 3 * prof.n_ff)
    grow = scratch_bytes(prof, 4, 1024) - scratch_bytes(prof, 1, 1024)
    assert grow == 3 * 4 * prof.n_vocab + 3 * 1024 * 4 * max(s.n_head for s in prof.attention_shapes)
    assert scratch_bytes(prof, 600, 1024) - scratch_bytes(prof, 512, 1024) > 88 * per_token


def test_leftover_vram_splits_the_boundary_layer_by_units():
    """What is left after whole FFN layers buys the first CPU layer's leading units, in granules of
    ffn_down's quant block; the speed model credits the two halves running at the same time."""
    prof = synthetic_profile()
    opt = PlanOptions(vram_bytes=1024 * MiB, margin_bytes=64 * MiB, n_ctx=4096, gpu_bw=400e9, cpu_bw=20e9,
                      op_offload=False)
    fixed = fixed_gpu(plan(prof, opt))
    layer = prof.ffn_layer_bytes()[2]
    granule_bytes = layer * 256 // prof.n_ff
    budget = fixed + 20 * MiB + 2 * granule_bytes + granule_bytes // 2      # two layers, 2.5 granules
    p = plan(prof, PlanOptions(**{**opt.__dict__, "vram_bytes": budget}))
    whole = plan(prof, PlanOptions(**{**opt.__dict__, "vram_bytes": budget, "split_ffn": False}))
    assert p.ffn_gpu_layers == whole.ffn_gpu_layers == [0, 1]
    s = p.ffn_split
    assert (s.layer, s.n_ff, s.gpu_units) == (2, prof.n_ff, 512)
    assert s.gpu_bytes == layer // 2 and s.cpu_bytes == layer - layer // 2
    assert p.line("ffn").gpu_bytes == whole.line("ffn").gpu_bytes + s.gpu_bytes
    assert p.free_bytes == whole.free_bytes - s.gpu_bytes < granule_bytes
    assert whole.ffn_split is None and p.to_dict()["ffn_split"]["gpu_units"] == 512
    overlap = min(s.gpu_bytes / 400e9, s.cpu_bytes / 20e9)
    moved = s.gpu_bytes / 20e9 - s.gpu_bytes / 400e9
    assert p.speed.plain_step_s == pytest.approx(whole.speed.plain_step_s - moved - overlap)
    # never the whole layer (it would have been placed whole), never an expert layer
    assert plan(prof, PlanOptions(**{**opt.__dict__, "vram_bytes": fixed + 20 * MiB + 10})).ffn_split is None
