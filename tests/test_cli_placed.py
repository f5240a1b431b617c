"""`hybridrt run` executing a plan, with the CPU standing in for the device (issue 10's acceptance):
the placement line, the same tokens as the all-mmap run, and one-line errors."""
from __future__ import annotations

import dataclasses
import json

import pytest

from hybridrt.runtime.place import PlacementRequest
from tests.real_models import SMOLLM2, require
from tests.test_cli_errors import assert_one_line_error, run_cli
from tests.test_placed_run import budget_for

PROMPT = "The capital of France is"


def test_smollm2_716mib_plan_prints_placement_and_same_tokens():
    model = str(require(SMOLLM2))
    common = ["run", "-m", model, "-c", "4096", "-p", PROMPT, "--temp", "0", "-n", "24", "--exact-activations"]
    placed = run_cli(*common, "--vram", "716MiB", "--device", "cpu")
    plain = run_cli(*common, "--device", "cpu")
    assert placed.returncode == 0 and plain.returncode == 0, placed.stderr + plain.stderr
    assert "placement: offloaded 13/30 FFN layers + 1024/1536 units of layer 13 to cpu" in placed.stderr
    assert "placement:" not in plain.stderr
    assert placed.stdout == plain.stdout and len(placed.stdout) > len(PROMPT) + 10


def test_tiny_qwen35_mtp_plan_with_three_drafts_same_tokens(tiny_qwen35_mtp, tmp_path):
    base = PlacementRequest(n_ctx=256, spec_type="draft-mtp", spec_draft_n_max=3)
    vram = budget_for(tiny_qwen35_mtp, base, 3, 2.5)
    common = ["run", "-m", str(tiny_qwen35_mtp), "-c", "256", "-p", "hello world", "--temp", "0", "-n", "20"]
    trace = tmp_path / "t.json"
    placed = run_cli(*common, "--vram", str(vram), "--spec-draft-n-max", "3", "--trace", str(trace))
    plain = run_cli(*common, "--spec-type", "none")
    assert placed.returncode == 0 and plain.returncode == 0, placed.stderr + plain.stderr
    assert "placement: offloaded 3/8 FFN layers + 64/128 units of layer 3" in placed.stderr
    assert "draft-mtp" in placed.stderr                     # the speculative statistics line
    assert placed.stdout == plain.stdout
    cats = {e.get("cat") for e in json.loads(trace.read_text())["traceEvents"]}
    assert {"spec", "device", "cpu_ffn", "transfer", "step"} <= cats


def test_a_plan_that_cannot_fit_is_one_line():
    r = run_cli("run", "-m", str(require(SMOLLM2)), "-p", PROMPT, "--vram", "300MiB")
    assert_one_line_error(r, "does not fit", "needs at least")


def test_device_cuda_without_a_gpu_is_one_line():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    r = run_cli("run", "-m", str(require(SMOLLM2)), "-p", PROMPT, "--device", "cuda")
    assert_one_line_error(r, "no CUDA device")


@pytest.mark.parametrize("args, fragment", [
    (["-p", ""], "empty prompt"),
    (["-p", "hi", "--spec-draft-n-max", "1000"], "--spec-draft-n-max must be within 1..31"),
    (["-p", "hi", "--vram", "lots"], "bad --vram"),
    (["-p", "hi", "-ctk", "q4_0"], "q4_0"),
])
def test_bad_run_flags_are_one_line(args, fragment):
    assert_one_line_error(run_cli("run", "-m", str(require(SMOLLM2)), *args), fragment)


def test_triton_missing_is_one_line(monkeypatch, capsys):
    """When a kernel needs Triton and it is not installed, main() prints how to install it."""
    import gpu_kernels.triton_support as ts
    from hybridrt.cli import commands as cli

    monkeypatch.setattr(ts, "have_triton", lambda: False)

    def needs_triton(*a, **k):
        ts.require_triton("the fused quantized matvec")

    monkeypatch.setattr(cli, "app", needs_triton)
    with pytest.raises(SystemExit) as exc:
        cli.main()
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "pip install 'hybridrt[gpu]'" in err[0]


def test_bench_json_has_predicted_and_measured_speed():
    r = run_cli("bench", "-m", str(require(SMOLLM2)), "--vram", "716MiB", "-p", "8", "-n", "4", "-r", "1",
                "--json", "--cpu-bw", "20")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["measured_tps"] == d["tg_tps"] > 0 and d["predicted_tps"] > 0
    assert d["prediction"].startswith("plan:") and d["placement"]["ffn_split"]["gpu_units"] == 1024
    assert "placement: offloaded 13/30" in r.stderr
    plain = json.loads(run_cli("bench", "-m", str(require(SMOLLM2)), "-p", "8", "-n", "4", "-r", "1", "--json",
                               "--cpu-bw", "20").stdout)
    assert plain["placement"] is None and plain["predicted_tps"] == pytest.approx(20e9 / plain["weight_bytes_per_token"])
    assert plain["cpu_kernels"].startswith("int8 activations, ") and "AMX tiles" in plain["cpu_kernels"]


def test_bench_spec_type_none_is_the_plain_bench(tiny_qwen35_mtp):
    """--spec-type none plans and times plain decoding, as `run --spec-type none` decodes (it used
    to start a speculative comparison and fail on the verify batches the plan did not reserve)."""
    base = PlacementRequest(n_ctx=256, spec_type="none")
    r = run_cli("bench", "-m", str(tiny_qwen35_mtp), "--vram", str(budget_for(tiny_qwen35_mtp, base, 3, 2.5)),
                "-c", "256", "-p", "8", "-n", "4", "-r", "1", "--json", "--cpu-bw", "20", "--spec-type", "none")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["tg_tps"] > 0 and "plain_tps" not in d and d["placement"]["spec_type"] == "none"


def test_bench_decodes_on_the_cache_run_uses(tiny_qwen3, monkeypatch):
    """`bench` times the KV cache `run` decodes on (-ctk / -ctv, f16 by default as llama.cpp), not
    the Python API's f32 default; a bad type is one error line."""
    from hybridrt.cli.bench import bench_plain
    from hybridrt.runtime.loader import load_model

    m = load_model(tiny_qwen3)
    made = []
    session = m.session
    monkeypatch.setattr(m, "session", lambda *a, **k: made.append(session(*a, **k)) or made[-1])
    bench_plain(m, 4, 4, 1, cache_type="q8_0")
    assert made and all(s.state.kv.types.k == "q8_0" for s in made)
    assert_one_line_error(run_cli("bench", "-m", str(tiny_qwen3), "-ctk", "q4_9"), "unsupported KV cache type 'q4_9'")
