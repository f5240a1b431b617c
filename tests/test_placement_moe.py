"""The planner on MoE models: the full-size Qwen3.6-35B-A3B (qwen35moe) Q4_K_M header from
scripts/make_model.py (sparse: real tensor table and 248k vocabulary, no data) and --n-cpu-moe."""
from __future__ import annotations

import json
import resource
import subprocess
import sys
from dataclasses import replace

import pytest

import make_model
from hybridrt.files.model_profile import load_profile
from placement import GiB, MiB, PlanError, PlanOptions, plan
from tests.test_placement import synthetic_profile
from tests.test_placement_27b import _cli

OPT = PlanOptions(vram_bytes=12 * GiB, n_ctx=32768, spec_type="draft-mtp", spec_draft_n_max=3,
                  gpu_bw=504e9, cpu_bw=60e9)


@pytest.fixture(scope="module")
def a3b_path(tmp_path_factory):
    return make_model.write_sparse_preset(tmp_path_factory.mktemp("a3b") / "qwen3.6-35b-a3b-q4_k_m.gguf",
                                          "qwen3.6-35b-a3b")


@pytest.fixture(scope="module")
def a3b(a3b_path):
    return load_profile(a3b_path)


def test_profile_of_the_35b_a3b(a3b):
    assert (a3b.arch, a3b.n_layer, a3b.n_gdn_layers, a3b.n_attention_layers, len(a3b.mtp_layers)) == \
        ("qwen35moe", 40, 30, 10, 1)
    assert (a3b.n_expert, a3b.n_expert_used, a3b.n_vocab, a3b.output_tied) == (256, 8, 248320, False)
    assert a3b.n_ff == 8 * 512 + 512
    roles = {t.name: (t.role, t.expert) for t in a3b.tensors}
    for m in ("gate", "up", "down"):
        assert roles[f"blk.7.ffn_{m}_exps.weight"] == ("ffn", True)
        assert roles[f"blk.7.ffn_{m}_shexp.weight"] == ("moe_shared", False)
        assert roles[f"blk.40.ffn_{m}_exps.weight"] == ("mtp", True)      # the MTP block's experts
    assert roles["blk.7.ffn_gate_inp.weight"] == roles["blk.7.ffn_gate_inp_shexp.weight"] == ("moe_shared", False)
    # an FFN layer, as the planner moves it, is the layer's routed experts only
    ffn = a3b.ffn_layer_bytes()
    experts = {i: sum(t.nbytes for t in a3b.tensors if t.expert and t.layer == i) for i in range(40)}
    assert ffn == experts
    assert 400 * MiB < min(ffn.values()) < max(ffn.values()) < 520 * MiB     # Q6_K ffn_down_exps on some


def test_12gib_32k_three_drafts_places_expert_layers_front_first(a3b):
    p = plan(a3b, OPT)
    assert p.gpu_bytes <= OPT.vram_bytes
    keys = [line.key for line in p.lines]
    assert keys.index("gdn_weights") < keys.index("moe_shared") < keys.index("kv_cache") < keys.index("ffn")
    shared = sum(t.nbytes for t in a3b.tensors if t.role == "moe_shared")
    assert p.line("moe_shared").gpu_bytes == shared and p.line("moe_shared").stage == 3
    assert "40 MoE layers" in p.line("moe_shared").detail
    assert p.line("ffn").label == "routed experts"
    n_gpu = len(p.ffn_gpu_layers)
    assert p.ffn_gpu_layers[:5] == [0, 1, 2, 3, 4] and 10 <= n_gpu <= 30 and p.ffn_split is None
    for t in a3b.tensors:
        if t.role == "ffn":
            assert p.tensor_device[t.name] == ("gpu" if t.layer in p.ffn_gpu_layers else "cpu")
        elif t.role == "moe_shared":
            assert p.tensor_device[t.name] == "gpu"
    assert any("routed experts of layers" in why for why in p.not_fitted)
    # CPU experts are read in the routed share: 8 of 256 per token, 1 - (1 - 1/32)^4 for a verify of 4
    cpu_experts = p.line("ffn").cpu_bytes
    embd = a3b.role_bytes("embedding") / a3b.n_vocab
    assert p.speed.plain_cpu_bytes == int(cpu_experts / 32 + embd)
    assert p.speed.verify_cpu_bytes == int(cpu_experts * (1 - (31 / 32) ** 4) + 4 * embd)
    # a draft reads the MTP block's experts in one token's share, not whole
    mtp = [t for t in a3b.tensors if a3b.in_mtp(t) and t.role == "mtp"]
    whole = sum(t.nbytes for t in mtp)
    routed = sum(t.nbytes / 32 if t.expert else t.nbytes for t in mtp)
    kv = OPT.depth * a3b.mtp_kv_bytes_per_token("f16", "f16")
    head = a3b.role_bytes("output")
    expected = (routed + head + kv) / OPT.gpu_bw + OPT.layer_overhead_s + OPT.handoff_overhead_s
    assert p.speed.draft_step_s == pytest.approx(expected)
    assert routed < whole / 4


def test_n_cpu_moe_keeps_the_first_layers_experts_on_the_cpu(a3b):
    base = plan(a3b, OPT)
    p = plan(a3b, replace(OPT, n_cpu_moe=5))
    assert not set(range(5)) & set(p.ffn_gpu_layers)
    assert p.ffn_cpu_layers[:5] == [0, 1, 2, 3, 4]
    assert p.ffn_gpu_layers[0] == 5 and abs(len(p.ffn_gpu_layers) - len(base.ffn_gpu_layers)) <= 1
    assert any("--n-cpu-moe 5" in why for why in p.not_fitted)
    everything = plan(a3b, replace(OPT, n_cpu_moe=999))              # llama.cpp accepts N > layers
    assert everything.ffn_gpu_layers == [] and everything.line("ffn").gpu_bytes == 0
    assert everything.line("moe_shared").gpu_bytes == base.line("moe_shared").gpu_bytes
    with pytest.raises(PlanError, match="--n-cpu-moe"):
        plan(a3b, replace(OPT, n_cpu_moe=-1))


def test_n_cpu_moe_does_nothing_on_a_dense_model():
    prof = synthetic_profile()
    opt = PlanOptions(vram_bytes=1 << 40, n_ctx=1024)
    assert plan(prof, replace(opt, n_cpu_moe=4)).ffn_gpu_layers == plan(prof, opt).ffn_gpu_layers
    assert plan(prof, opt).line("moe_shared").gpu_bytes == 0


def _cpu_seconds(cmd):
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    r = subprocess.run(cmd, capture_output=True, text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def test_cli_info_and_plan_on_the_35b_a3b(a3b_path):
    r, cpu = _cpu_seconds(_cli() + ["plan", "-m", str(a3b_path), "--vram", "12GiB", "-c", "32768",
                                    "--spec-draft-n-max", "3", "--cpu-bw", "60"])
    assert r.returncode == 0, r.stderr
    assert "routed experts on GPU: 0-" in r.stdout and "shared experts, routers" in r.stdout
    assert cpu < 3.0, f"hybridrt plan used {cpu:.2f} CPU s"      # CPU seconds: the machine is shared
    d = json.loads(subprocess.run(_cli() + ["plan", "-m", str(a3b_path), "--vram", "12GiB", "-c", "32768",
                                            "--cpu-bw", "60", "--n-cpu-moe", "3", "--json"],
                                  capture_output=True, text=True).stdout)
    assert d["options"]["n_cpu_moe"] == 3 and d["ffn_cpu_layers"][:3] == [0, 1, 2]
    assert {line["key"] for line in d["lines"]} >= {"moe_shared", "ffn"}
    info = [sys.executable, "-c", "from hybridrt.cli.commands import main; main()", "info", str(a3b_path), "--json"]
    r, cpu = _cpu_seconds(info)
    assert r.returncode == 0, r.stderr
    facts = json.loads(r.stdout)
    assert facts["architecture"] == "qwen35moe" and facts["experts"] == {"count": 256, "used": 8, "ffn": 512,
                                                                          "shared_ffn": 512}
    assert facts["layer_kinds"] == {"gated_delta_net": 30, "attention": 10} and facts["nextn_layers"] == 1
    assert cpu < 3.0, f"hybridrt info used {cpu:.2f} CPU s"
