"""The binder's rule table (hybridrt/backends/binder.py RULES): every (role, placement, mode) the binder
can meet has exactly one rule, a missing one is an error naming it, and the backends it binds play
the roles the models call them in (hybridrt/backends/protocols.py)."""
from __future__ import annotations

import itertools

import pytest
import torch

from hybridrt.runtime.backends import binder as binder_module
from hybridrt.runtime.backends import (AttentionHalf, CpuGluFFN, CpuQuantLinear, FfnHalf, FFNBackend, FusedAttentionBlock,
                               FusedFfnBlock, LinearBackend, Placement, Role, WeightBinder)
from hybridrt.runtime.backends.binder import RULE_ROWS, RULES, can_meet, rule_for, rule_table
from hybridrt.files.gguf_file import GGUFFile
from hybridrt.runtime.config import Mode, resolve_config


def test_every_case_the_binder_meets_has_a_rule():
    missing = [(r.name, p.name, m.name) for r, p, m in itertools.product(Role, Placement, Mode)
               if can_meet(r, p, m) and (r, p, m) not in RULES]
    assert not missing, f"no rule for {missing}"


def test_no_rule_for_a_case_the_binder_never_meets():
    assert all(can_meet(*key) for key in RULES), [key for key in RULES if not can_meet(*key)]


def test_a_missing_rule_fails_naming_it():
    rules = {k: v for k, v in RULES.items() if k != (Role.FFN_HALF, Placement.MMAP, Mode.CPU_FUSED)}
    with pytest.raises(LookupError, match="FFN_HALF.*MMAP.*CPU_FUSED.*RULES"):
        rule_for(rules, Role.FFN_HALF, Placement.MMAP, Mode.CPU_FUSED)


def test_two_rules_for_one_case_are_refused():
    with pytest.raises(ValueError, match="two backend rules"):
        rule_table(RULE_ROWS + [(Role.MATRIX, {Placement.MMAP}, {Mode.PLAN_ON_CUDA}, WeightBinder._device_linear)])


def test_the_binder_reads_the_table(tiny_llama, monkeypatch):
    """Binding goes through RULES: without the row for an mmap'd matrix on a CPU trunk, binding one
    fails naming the case (nothing picks a backend beside the table)."""
    gguf = GGUFFile(tiny_llama)
    binder = WeightBinder(gguf, torch.device("cpu"), config=resolve_config("cpu", False, fused_layers=True))
    assert isinstance(binder.linear("blk.0.attn_output.weight"), CpuQuantLinear)
    rules = {k: v for k, v in RULES.items() if k != (Role.MATRIX, Placement.MMAP, Mode.CPU_FUSED)}
    monkeypatch.setattr(binder_module, "RULES", rules)
    with pytest.raises(LookupError, match="MATRIX.*MMAP.*CPU_FUSED"):
        binder.linear("blk.0.attn_output.weight")


def test_a_binder_has_an_executor_exactly_in_a_plans_modes(tiny_llama):
    gguf = GGUFFile(tiny_llama)
    with pytest.raises(ValueError, match="PLAN_ON_CPU"):
        WeightBinder(gguf, torch.device("cpu"), config=resolve_config("cpu", planned=True))


@pytest.mark.parametrize("fused", [True, False])
def test_bound_parts_play_their_roles(tiny_llama, fused):
    """What a CPU trunk binds, by the table, fused or on the torch trunk, conforms to the protocols."""
    from hybridrt.runtime.loader import load_model

    m = load_model(tiny_llama, fused_layers=fused)
    assert m.binder.config.mode is (Mode.CPU_FUSED if fused else Mode.CPU_TORCH)
    assert isinstance(m.output, LinearBackend)
    for layer in m.layers:
        attn, ffn = (layer.mixer, layer.ffn) if hasattr(layer, "mixer") else layer     # a Layer, or a pair
        assert isinstance(attn, AttentionHalf) and isinstance(ffn, FfnHalf)
        assert isinstance(attn, FusedAttentionBlock) == isinstance(ffn, FusedFfnBlock) == fused
        inner = ffn.block.ffn if fused else ffn.ffn
        assert isinstance(inner, CpuGluFFN) and isinstance(inner, FFNBackend) and inner.placement is Placement.MMAP
