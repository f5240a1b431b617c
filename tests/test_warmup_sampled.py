"""The warm-up of a big CPU trunk runs one layer of each signature (warmup.sampled_trunk): it must
give every kernel the whole model's warm-up calls its first call, and change nothing a run prints."""
from __future__ import annotations

import sys

import pytest

from hybridrt.decoding.generate import generate
from hybridrt.decoding.sampling import SamplerConfig
from hybridrt.decoding.speculative.loop import SpecConfig
from hybridrt.decoding.speculative.sources import build_source
from hybridrt.models.arch_spec import ATTENTION, GDN
from hybridrt.runtime import warmup
from hybridrt.runtime.loader import load_model


def _loaded_signatures() -> set:
    """Every (kernel, signature) this process has compiled or loaded from the cache."""
    from numba.core.registry import CPUDispatcher

    out = set()
    for name, module in list(sys.modules.items()):
        if name.startswith("cpu_kernels") and module is not None:
            for obj in vars(module).values():
                if isinstance(obj, CPUDispatcher):
                    out.update((obj.py_func.__module__, obj.py_func.__qualname__, sig) for sig in obj.overloads)
    return out


def test_small_or_planned_models_warm_up_whole(tiny_qwen35_q4):
    m = load_model(str(tiny_qwen35_q4), threads=1)
    assert m.weight_bytes_per_token < warmup.SAMPLED_WARMUP_BYTES
    assert warmup.sampled_trunk(m) is m


def test_the_sample_keeps_one_layer_per_signature(tiny_qwen35_q4, monkeypatch):
    monkeypatch.setattr(warmup, "SAMPLED_WARMUP_BYTES", 0)
    m = load_model(str(tiny_qwen35_q4), threads=1)
    view = warmup.sampled_trunk(m)
    signatures = [warmup.layer_signature(m, i) for i in range(len(m.layers))]
    assert len(view.layers) == len(set(signatures)) < len(m.layers)
    assert {layer.kind for layer in view.layers} == {ATTENTION, GDN}
    assert all(any(v is layer for layer in m.layers) for v in view.layers)      # shared, not copied
    assert len(m.layers) == m.n_layer and view.mtp is m.mtp


@pytest.mark.parametrize("spec_type", ["none", "draft-mtp"])
def test_a_sampled_warm_up_calls_every_kernel_the_whole_one_does(tiny_qwen35_q4, tiny_qwen35_q4_plain,
                                                                  spec_type, monkeypatch):
    """After the sample's warm-up, the whole model's warm-up and a run load no kernel signature the
    sample did not: the run's first calls were all made untimed. Plain decoding on a file without a
    head (the head's block would call the attention and FFN kernels whatever the sample held)."""
    path = tiny_qwen35_q4 if spec_type == "draft-mtp" else tiny_qwen35_q4_plain
    greedy, spec = SamplerConfig(temp=0.0), SpecConfig(n_max=3, adaptive=True)
    m = load_model(str(path), threads=1)
    monkeypatch.setattr(warmup, "SAMPLED_WARMUP_BYTES", 0)
    assert warmup.warm_up(m, spec_type, spec, greedy, "f16") is None      # a sample times nothing
    after_sample = _loaded_signatures()
    monkeypatch.setattr(warmup, "SAMPLED_WARMUP_BYTES", 1 << 62)
    warmup.warm_up(m, spec_type, spec, greedy, "f16")
    session = m.session(64, "f16", k_max=spec.k_max)
    source = build_source(spec_type, session, greedy, spec, cache_type="f16")
    generate(m, session, [5, 6], 8, greedy, source, spec if source else None, stop_ids=set())
    assert _loaded_signatures() == after_sample


def test_a_sampled_warm_up_leaves_the_run_unchanged(tiny_qwen35_q4, monkeypatch):
    greedy, spec = SamplerConfig(temp=0.0), SpecConfig(n_max=3)
    m = load_model(str(tiny_qwen35_q4), threads=1)

    def run() -> list[int]:
        session = m.session(64, "f16", k_max=spec.k_max)
        source = build_source("draft-mtp", session, greedy, spec, cache_type="f16")
        return generate(m, session, [7, 8, 9], 12, greedy, source, spec, stop_ids=set())[0]

    before = run()
    monkeypatch.setattr(warmup, "SAMPLED_WARMUP_BYTES", 0)
    warmup.warm_up(m, "draft-mtp", spec, greedy, "f16")
    warmup.compile_kernels(m)
    assert run() == before
