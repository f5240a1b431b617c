"""`hybridrt plan`: the command function on its own typer app, and the installed console script."""
from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import typer
from typer.testing import CliRunner

from hybridrt.cli.plan import parse_size, plan
from hybridrt.errors import UserError
from tests.real_models import GEMMA3, SMOLLM2, require

app = typer.Typer()
app.command("plan")(plan)
app.command("noop")(lambda: None)          # a second command keeps `plan` a named subcommand
runner = CliRunner()
FIXED_BW = ["--gpu-bw", "400", "--cpu-bw", "20"]


def invoke(*args):
    return runner.invoke(app, ["plan", *map(str, args)])


@pytest.mark.parametrize("text, nbytes", [("12GiB", 12 << 30), ("12GB", 12 * 10**9), ("12000MiB", 12000 << 20),
                                          ("300MiB", 300 << 20), ("1073741824", 1 << 30), ("1.5 GiB", 3 << 29),
                                          ("512mib", 512 << 20)])
def test_parse_size(text, nbytes):
    assert parse_size(text) == nbytes


@pytest.mark.parametrize("text", ["12 parsecs", "GiB", "-1GiB", "", "1e9", "0.05", "12.5b"])
def test_parse_size_rejects(text):
    with pytest.raises(UserError, match="bad size"):
        parse_size(text)


def test_report_of_a_split_gemma3():
    r = invoke("-m", require(GEMMA3), "--vram", "345MiB", "--margin", "64MiB", "-c", "2048", *FIXED_BW)
    assert r.exit_code == 0, r.output
    out = r.stdout
    # one layer's room is the prompt staging (op offload); --no-op-offload gives it to layer 1
    assert "FFN on GPU: 0 (1 layers), CPU: 1-17 (17 layers)" in out
    off = invoke("-m", require(GEMMA3), "--vram", "345MiB", "--margin", "64MiB", "-c", "2048", "--no-op-offload", *FIXED_BW)
    assert "FFN on GPU: 0-1 (2 layers), CPU: 2-17 (16 layers)" in off.stdout and "prompt staging" not in off.stdout
    for fragment in ("fixed overhead", "prompt staging", "output head", "KV cache", "activations and logits", "host RAM",
                     "plain", "tok/s", "GPU 400 GB/s from --gpu-bw", "did not fit"):
        assert fragment in out, fragment


def test_json_schema_and_totals():
    r = invoke("-m", require(SMOLLM2), "--vram", "200MiB", "--margin", "64MiB", "-c", "2048",
               "--spec-type", "ngram-simple", "--spec-draft-n-max", "4", "-ctk", "q8_0", "--json", *FIXED_BW)
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["arch"] == "llama" and d["budget_bytes"] == 200 << 20
    assert d["gpu_bytes"] == sum(line["gpu_bytes"] for line in d["lines"]) <= d["budget_bytes"]
    assert d["cpu_bytes"] == sum(line["cpu_bytes"] for line in d["lines"])
    assert d["free_bytes"] == d["budget_bytes"] - d["gpu_bytes"]
    assert d["ffn_gpu_layers"] and d["ffn_cpu_layers"]
    assert d["options"]["cache_type_k"] == "q8_0" and d["options"]["k_max"] == 5
    assert d["speed"]["tokens_per_step"] == pytest.approx(sum(0.8 ** i for i in range(5)))
    assert d["sources"] == {"vram": "--vram", "gpu_bw": "from --gpu-bw", "cpu_bw": "from --cpu-bw"}
    assert set(d["host"]) == {"cpu_side_bytes", "ram_available_bytes", "ram_total_bytes", "resident"}
    assert set(d["tensor_device"].values()) == {"gpu", "cpu"}
    assert [line["stage"] for line in d["lines"]] == sorted(line["stage"] for line in d["lines"])


def test_auto_without_a_gpu_plans_for_12_gib(monkeypatch):
    monkeypatch.setattr("hybridrt.cli.plan.detect_gpu", lambda: None)
    r = invoke("-m", require(SMOLLM2), "--json", *FIXED_BW)
    assert r.exit_code == 0, r.output
    assert "no GPU found: planning for 12 GiB" in r.stderr
    assert json.loads(r.stdout)["budget_bytes"] == 12 << 30


def test_an_error_is_the_only_line_even_without_a_gpu(monkeypatch):
    monkeypatch.setattr("hybridrt.cli.plan.detect_gpu", lambda: None)
    r = invoke("-m", require(SMOLLM2), "--spec-type", "ngram-simple", "--spec-draft-n-max", "0", *FIXED_BW)
    assert isinstance(r.exception, UserError) and r.stderr == ""


def test_cpu_bandwidth_is_measured_when_not_given():
    r = invoke("-m", require(SMOLLM2), "--vram", "1GiB", "--gpu-bw", "400", "--json")
    d = json.loads(r.stdout)
    assert d["sources"]["cpu_bw"] == "measured" and d["speed"]["cpu_bw"] > 1e8


@pytest.mark.parametrize("args, fragment", [
    (["--vram", "300MiB", "-c", "4096"], "needs at least"),
    (["--vram", "twelve"], "bad --vram"),
    (["--spec-type", "draft-mtp"], "no MTP head"),
    (["--spec-type", "ngram-simple,draft-mtp"], "no MTP head"),       # a chain plans its model source
    (["-ctk", "q4_0"], "unknown --cache-type-k"),
    (["--spec-type", "none", "-md", "smollm2-135m"], "-md is a draft model"),
])
def test_bad_input_raises_user_error(args, fragment):
    r = invoke("-m", require(SMOLLM2), "--vram", "1GiB", *FIXED_BW, *args)
    assert isinstance(r.exception, UserError), r.output
    assert fragment in str(r.exception)


def test_corrupt_file_is_a_user_error(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 40)
    r = invoke("-m", bad, "--vram", "1GiB", *FIXED_BW)
    assert isinstance(r.exception, UserError) and "bad.gguf" in str(r.exception)


def _console_script_has_plan() -> bool:
    exe = shutil.which("hybridrt")
    return exe is not None and " plan " in subprocess.run([exe, "--help"], capture_output=True, text=True).stdout


@pytest.mark.skipif(not _console_script_has_plan(), reason="the hybridrt console script has no plan command yet")
def test_console_script():
    ok = subprocess.run(["hybridrt", "plan", "-m", str(require(GEMMA3)), "--vram", "345MiB", "--margin", "64MiB",
                         "-c", "2048", *FIXED_BW], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert "FFN on GPU: 0 (1 layers)" in ok.stdout
    bad = subprocess.run(["hybridrt", "plan", "-m", str(require(GEMMA3)), "--vram", "100MiB", *FIXED_BW],
                         capture_output=True, text=True)
    assert bad.returncode == 2
    assert bad.stderr.startswith("error: ") and "needs at least" in bad.stderr and "Traceback" not in bad.stderr


def test_warns_when_cpu_side_weights_will_not_stay_resident(monkeypatch):
    import psutil

    real = psutil.virtual_memory()
    monkeypatch.setattr(psutil, "virtual_memory", lambda: real._replace(available=1 << 20))
    r = invoke("-m", require(GEMMA3), "--vram", "345MiB", "--margin", "64MiB", "-c", "2048", *FIXED_BW)
    assert r.exit_code == 0, r.output
    assert "will NOT stay resident" in r.stdout


def test_draft_model_with_md():
    r = invoke("-m", require(GEMMA3), "-md", require(SMOLLM2), "--vram", "1GiB", "--margin", "64MiB", "-c", "2048",
               "--spec-draft-n-max", "2", "--json", *FIXED_BW)
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    lines = {line["key"]: line for line in d["lines"]}
    assert d["options"]["spec_type"] == "draft-simple" and d["options"]["draft"] == SMOLLM2.name
    from hybridrt.files.gguf_file import GGUFFile

    assert lines["draft_weights"]["gpu_bytes"] == sum(t.nbytes for t in GGUFFile(SMOLLM2).tensors.values())
    assert lines["draft_kv"]["gpu_bytes"] == 2048 * 30 * 3 * 64 * 2 * 2
    assert d["speed"]["draft_step_s"] > 0


def test_auto_with_a_gpu_uses_its_free_memory_and_bandwidth(monkeypatch):
    from hybridrt.cli.plan import GPUInfo

    monkeypatch.setattr("hybridrt.cli.plan.detect_gpu", lambda: GPUInfo("Fake GPU", 200 << 20, 1 << 30, 300e9))
    r = invoke("-m", require(SMOLLM2), "--margin", "64MiB", "-c", "1024", "--cpu-bw", "20", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["budget_bytes"] == 200 << 20 and d["speed"]["gpu_bw"] == 300e9
    assert d["sources"]["vram"] == "free on Fake GPU" and d["sources"]["gpu_bw"] == "peak of Fake GPU"
