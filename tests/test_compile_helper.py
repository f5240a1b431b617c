"""The cold-start compile helper (hybridrt/runtime/compile_helper.py): when it starts, with what,
and what it runs through."""
from __future__ import annotations

import subprocess
import sys

import pytest

from hybridrt.runtime import compile_helper, warmup
from hybridrt.runtime.loader import load_model


def test_other_kind_layers(tiny_qwen35, tiny_llama):
    m = load_model(tiny_qwen35)
    kinds = [layer.kind for layer in m.layers]
    picked = compile_helper.other_kind_layers(m)
    assert len({*kinds}) == 2 and [layer.kind for layer in picked] == [k for k in dict.fromkeys(kinds) if k != kinds[0]]
    assert picked[0] is m.layers[kinds.index(picked[0].kind)]          # the first layer of that kind
    assert compile_helper.other_kind_layers(load_model(tiny_llama)) == []


class _Spawned:
    def __init__(self):
        self.calls, self.popen = [], subprocess.Popen

    def __call__(self, cmd, **kw):
        self.calls.append((cmd, kw))
        return self.popen([sys.executable, "-c", "pass"])


@pytest.fixture
def spawned(monkeypatch):
    spy = _Spawned()
    monkeypatch.setattr(subprocess, "Popen", spy)
    return spy


def test_starts_only_on_a_cold_cache_and_several_cores(monkeypatch, spawned, tiny_qwen35):
    monkeypatch.setattr(warmup, "kernels_cold", lambda ds=None: False)
    assert compile_helper.start(tiny_qwen35, "f16") is None
    monkeypatch.setattr(warmup, "kernels_cold", lambda ds=None: True)
    monkeypatch.setattr(compile_helper.os, "cpu_count", lambda: 1)
    assert compile_helper.start(tiny_qwen35, "f16") is None
    assert spawned.calls == []
    monkeypatch.setattr(compile_helper.os, "cpu_count", lambda: 2)
    assert compile_helper.start("/no/such/file.gguf", "f16") is None       # the run's own load says why
    proc = compile_helper.start(tiny_qwen35, "q8_0", act_residual=False)
    assert proc is not None
    compile_helper.stop(proc)
    (cmd, kw), = spawned.calls
    assert cmd[1:] == ["-m", "hybridrt.runtime.compile_helper", str(tiny_qwen35), "--cache-type", "q8_0",
                       "--ahead-of", "run", "--act-residual", "0"]
    assert kw["env"]["NUMBA_NUM_THREADS"] == "1" and kw["stdout"] is subprocess.DEVNULL


def test_compile_ahead_runs_the_other_kinds_and_the_heads(monkeypatch, tiny_qwen35_mtp, tiny_llama):
    """The output head alone first, then the other kind's layers, then the MTP head: never the run's
    own first kind (which the run compiles itself), and nothing for a model of one kind."""
    m = load_model(tiny_qwen35_mtp)
    seen = []
    session = type(m).session

    def spy(self, *a, **kw):
        seen.append([layer.kind for layer in self.layers])
        return session(self, *a, **kw)
    monkeypatch.setattr(type(m), "session", spy)
    drafts = []
    monkeypatch.setattr(type(m.mtp), "draft", lambda self, *a, **kw: drafts.append(a[1].shape[0]))
    monkeypatch.setattr(type(m.mtp), "write_kv", lambda self, *a, **kw: None)
    compile_helper.compile_ahead(m, "f16")
    other = [layer.kind for layer in compile_helper.other_kind_layers(m)]
    assert seen == [[], other, other] and m.layers[0].kind not in other
    assert drafts == [1, 2, 4]
    seen.clear()
    compile_helper.compile_ahead(load_model(tiny_llama), "f16")
    assert seen == []


def test_compile_cache_types_runs_the_attention_layers_per_type(monkeypatch, tiny_qwen35, tiny_llama):
    """Only the layers that read a KV cache (one of each signature), once per cache type asked."""
    passes = []
    monkeypatch.setattr(warmup, "compile_cache_type",
                        lambda view, ct: passes.append((ct, [layer.kind for layer in view.layers])))
    compile_helper.compile_cache_types(load_model(tiny_qwen35), ["f16", "q8_0"])
    assert passes == [("f16", ["attention"]), ("q8_0", ["attention"])]
    passes.clear()
    llama = load_model(tiny_llama)
    compile_helper.compile_cache_types(llama, ["f16"])
    assert passes == [("f16", ["attention"] * len(passes[0][1]))] and 1 <= len(passes[0][1]) < len(llama.layers)


def test_warmup_starts_a_helper_for_the_later_cache_types(monkeypatch, spawned, tiny_llama):
    monkeypatch.setattr(warmup, "kernels_cold", lambda ds=None: True)
    monkeypatch.setattr(compile_helper.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(warmup, "compile_kernels", lambda m: None)
    warmup.announce_and_compile(tiny_llama)
    (cmd, _), = spawned.calls
    assert cmd[cmd.index("--cache-type") + 1] == ",".join(warmup.CACHE_TYPES[1:]) == "f16,q8_0"
    assert cmd[cmd.index("--ahead-of") + 1] == "warmup"


def test_the_helper_command_line(monkeypatch, tiny_qwen35):
    got = {}
    monkeypatch.setattr(compile_helper, "compile_ahead", lambda m, ct: got.update(model=m, cache_type=ct))
    monkeypatch.setattr(compile_helper, "compile_cache_types", lambda m, cts: got.update(cache_types=cts))
    compile_helper.main([str(tiny_qwen35), "--cache-type", "f32", "--act-residual", "0"])
    assert got["cache_type"] == "f32" and got["model"].binder.config.act_residual is False
    assert got["model"].binder.config.exact is False and "cache_types" not in got
    compile_helper.main([str(tiny_qwen35), "--cache-type", "f16,q8_0", "--ahead-of", "warmup"])
    assert got["cache_types"] == ["f16", "q8_0"]
    with pytest.raises(SystemExit):
        compile_helper.main([str(tiny_qwen35), "--exact", "2"])
