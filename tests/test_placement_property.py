"""Property test: for random models, budgets and options the plan never exceeds the budget, keeps
the reservation order, and only leaves an FFN layer on the CPU when it could not fit."""
from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from placement import MiB, PlanError, PlanOptions, TensorEntry, plan, split_granule
from tests.test_placement import synthetic_profile

STAGE_OF = {"overhead": 1, "gdn_snapshot_ring": 2, "draft_kv": 2, "draft_weights": 2, "draft_state": 2,
            "embedding": 3, "attention_weights": 3, "gdn_weights": 3, "moe_shared": 3, "norms": 3, "output_head": 3,
            "other_weights": 3, "kv_cache": 3, "recurrent_state": 3, "scratch": 3, "op_offload": 4, "ffn": 4}


def as_moe(prof):
    """The profile with MoE layers: each FFN tensor becomes routed experts (64, 4 used), and each
    layer gains a 1 MiB router + shared expert (trunk-side)."""
    tensors = [replace(t, expert=True) if t.role == "ffn" else t for t in prof.tensors]
    tensors += [TensorEntry(f"blk.{i}.ffn_up_shexp.weight", "moe_shared", MiB, i) for i in range(prof.n_layer)]
    return replace(prof, tensors=tuple(tensors), n_expert=64, n_expert_used=4)


@st.composite
def cases(draw):
    ffn = draw(st.lists(st.integers(1, 64).map(lambda m: m * MiB), min_size=1, max_size=24))
    mtp = draw(st.booleans())
    prof = synthetic_profile(ffn_sizes=tuple(ffn), interval=draw(st.integers(1, 5)), mtp=mtp,
                             tied=draw(st.booleans()))
    if draw(st.booleans()):
        prof = as_moe(prof)
    spec = draw(st.sampled_from(["none", "ngram-simple"] + (["draft-mtp"] if mtp else [])))
    opt = PlanOptions(
        vram_bytes=draw(st.integers(1, 3000)) * MiB,
        margin_bytes=draw(st.integers(0, 600)) * MiB,
        n_ctx=draw(st.integers(1, 200_000)),
        cache_type_k=draw(st.sampled_from(["f16", "q8_0", "f32"])),
        cache_type_v=draw(st.sampled_from(["f16", "q8_0", "f32"])),
        spec_type=spec,
        spec_draft_n_max=draw(st.integers(1, 8)),
        accept_rate=draw(st.floats(0, 1)),
        n_cpu_moe=draw(st.integers(0, 30)),
        op_offload=draw(st.booleans()),
    )
    return prof, opt


@settings(max_examples=300, deadline=None)
@given(cases())
def test_plan_respects_budget_and_order(case):
    prof, opt = case
    roomy = plan(prof, replace(opt, vram_bytes=1 << 40))
    fixed = sum(line.gpu_bytes for line in roomy.lines if line.stage < 4)
    try:
        p = plan(prof, opt)
    except PlanError as exc:
        assert exc.min_vram_bytes == fixed > opt.vram_bytes
        return
    assert p.gpu_bytes <= opt.vram_bytes
    assert p.gpu_bytes - opt.margin_bytes <= opt.vram_bytes - opt.margin_bytes
    assert [STAGE_OF[line.key] for line in p.lines] == [line.stage for line in p.lines]
    assert [line.stage for line in p.lines] == sorted(line.stage for line in p.lines)
    assert p.lines[0].key == "overhead" and p.lines[-1].key == "ffn"
    # stages 1-3 do not depend on the budget: speculation state is reserved before any FFN layer
    assert [line for line in p.lines if line.stage < 4] == [line for line in roomy.lines if line.stage < 4]
    ffn = prof.ffn_layer_bytes()
    assert sorted(p.ffn_gpu_layers + p.ffn_cpu_layers) == list(ffn)
    split = p.ffn_split
    split_gpu = split.gpu_bytes if split else 0
    assert p.line("ffn").gpu_bytes == sum(ffn[i] for i in p.ffn_gpu_layers) + split_gpu
    assert p.line("ffn").cpu_bytes == sum(ffn[i] for i in p.ffn_cpu_layers) - split_gpu
    kept = [i for i in ffn if i < opt.n_cpu_moe] if prof.n_expert else []     # --n-cpu-moe's layers
    assert not set(kept) & set(p.ffn_gpu_layers)
    unfit = [i for i in p.ffn_cpu_layers if i not in kept]
    if unfit:                                     # otherwise a layer is on the CPU only because it did not fit
        assert p.free_bytes < min(ffn[i] for i in unfit)
    assert p.line("moe_shared").gpu_bytes == prof.role_bytes("moe_shared")
    staging = p.line("op_offload").gpu_bytes      # op offload: the largest layer, only where one stays on the CPU
    assert staging in (0, max(ffn.values()))
    if staging:
        assert opt.op_offload and not prof.n_expert and p.ffn_cpu_layers
    elif opt.op_offload and not prof.n_expert and p.ffn_cpu_layers:   # it did not fit before any FFN layer
        assert max(ffn.values()) > p.line("ffn").gpu_bytes + p.free_bytes
    if split:                                     # the boundary layer takes what is left, in whole granules
        granule = split_granule(split.n_ff)
        assert split.layer == p.ffn_cpu_layers[0] and not prof.n_expert
        assert 0 < split.gpu_units < split.n_ff and split.gpu_units % granule == 0
        assert split.gpu_bytes + split.cpu_bytes == ffn[split.layer]
        assert p.free_bytes < ffn[split.layer] * granule / split.n_ff
    assert p.speed.plain_tok_s > 0
    if opt.spec_type != "none":
        assert p.speed.spec_tok_s > 0
