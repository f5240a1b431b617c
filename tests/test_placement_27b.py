"""The planner on a full-size Qwen3.6-27B-MTP Q4_K_M header (a sparse file from scripts/make_model.py:
the real tensor table and 248k vocabulary, no data)."""
from __future__ import annotations

import importlib.util
import json
import resource
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from hybridrt.files.gguf_file import GGUFFile
from hybridrt.files.model_profile import load_profile
from placement import GiB, MiB, PlanOptions, plan

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "make_model.py"
OPT = PlanOptions(vram_bytes=12 * GiB, n_ctx=32768, spec_type="draft-mtp", spec_draft_n_max=3,
                  gpu_bw=500e9, cpu_bw=40e9)


@pytest.fixture(scope="session")
def q36_path(tmp_path_factory):
    if not SCRIPT.exists():
        pytest.skip("scripts/make_model.py is not there")
    make_model = sys.modules.get("make_model")      # tests/conftest.py may have imported it already
    if make_model is None:
        spec = importlib.util.spec_from_file_location("make_model", SCRIPT)
        make_model = sys.modules["make_model"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(make_model)
    return make_model.write_sparse_preset(tmp_path_factory.mktemp("q36") / "qwen3.6-27b-mtp-q4_k_m.gguf")


@pytest.fixture(scope="session")
def q36(q36_path):
    return load_profile(q36_path)


def fixed_gpu(p):
    return sum(line.gpu_bytes for line in p.lines if line.stage < 4)


def test_profile_of_the_27b(q36, q36_path):
    assert (q36.n_layer, q36.n_gdn_layers, q36.n_attention_layers, len(q36.mtp_layers)) == (64, 48, 16, 1)
    assert q36.n_vocab == 248320 and not q36.output_tied
    assert q36.kv_bytes_per_token("f16", "f16") == 64 * 1024
    assert 145 * MiB < q36.recurrent_state_bytes < 155 * MiB
    assert q36.total_bytes == sum(t.nbytes for t in GGUFFile(q36_path).tensors.values())
    assert len(q36.ffn_layer_bytes()) == 64
    assert {t.role for t in q36.tensors} == {"embedding", "attention", "gdn", "norm", "output", "ffn", "mtp"}


def test_12gib_32k_three_drafts(q36):
    p = plan(q36, OPT)
    # categories add up exactly: every tensor byte is in one line, the lines make the totals
    by_device = {"gpu": 0, "cpu": 0, "unused": 0}
    for t in q36.tensors:
        by_device[p.tensor_device[t.name]] += t.nbytes
    assert sum(by_device.values()) == q36.total_bytes and by_device["unused"] == 0
    weight_keys = {"draft_weights", "attention_weights", "gdn_weights", "norms", "output_head", "other_weights", "ffn"}
    split_gpu = p.ffn_split.gpu_bytes if p.ffn_split else 0      # its tensors are "cpu" (the mmap half)
    assert sum(line.gpu_bytes for line in p.lines if line.key in weight_keys) == by_device["gpu"] + split_gpu
    assert p.cpu_bytes == by_device["cpu"] - split_gpu == sum(line.cpu_bytes for line in p.lines)
    assert p.gpu_bytes == sum(line.gpu_bytes for line in p.lines)
    # within the budget, the margin kept free
    assert p.gpu_bytes - OPT.margin_bytes <= OPT.vram_bytes - OPT.margin_bytes
    # the ring and the draft KV come before any FFN layer
    keys = [line.key for line in p.lines]
    assert keys.index("gdn_snapshot_ring") < keys.index("draft_kv") < keys.index("kv_cache") < keys.index("ffn")
    assert p.line("gdn_snapshot_ring").gpu_bytes == 3 * q36.recurrent_state_bytes
    assert p.line("draft_kv").gpu_bytes == 32768 * 4096          # one MTP layer, 4 KiB per token in f16
    assert p.line("kv_cache").gpu_bytes == 2 * GiB
    assert p.tensor_device["token_embd.weight"] == "cpu"
    # a split with a front run of GPU layers
    assert p.ffn_gpu_layers[:5] == [0, 1, 2, 3, 4] and 20 <= len(p.ffn_cpu_layers) <= 60
    assert p.speed.spec_tok_s > p.speed.plain_tok_s


def test_one_more_draft_costs_ffn_layers_worth_a_ring_slot(q36):
    """N -> N + 1 reserves one more ring slot (+ one more token of scratch) before the FFN stage,
    so the FFN on the GPU shrinks by at least that, less what was left over at N. When that amount
    exceeds the leftover, at least one layer moves to the CPU."""
    slot = q36.recurrent_state_bytes
    crossed = 0
    for n in range(1, 8):
        a, b = plan(q36, replace(OPT, spec_draft_n_max=n)), plan(q36, replace(OPT, spec_draft_n_max=n + 1))
        grow = fixed_gpu(b) - fixed_gpu(a)
        assert slot <= grow <= slot + 8 * MiB                        # the slot, plus one token of scratch
        assert a.line("ffn").gpu_bytes - b.line("ffn").gpu_bytes >= grow - a.free_bytes
        if grow > a.free_bytes:
            assert len(b.ffn_gpu_layers) < len(a.ffn_gpu_layers)
            crossed += 1
    assert crossed >= 3        # ~150 MiB slots against ~150-170 MiB layers: most steps cross a layer


def test_q8_0_cache_fits_more_ffn_layers(q36):
    f16 = plan(q36, OPT)
    q8 = plan(q36, replace(OPT, cache_type_k="q8_0", cache_type_v="q8_0"))
    assert q8.line("kv_cache").gpu_bytes == 32768 * 16 * 2 * 4 * 8 * 34     # 8 blocks per 256-wide head
    assert len(q8.ffn_gpu_layers) > len(f16.ffn_gpu_layers)


def test_24gib_puts_more_layers_on_the_gpu(q36):
    assert len(plan(q36, replace(OPT, vram_bytes=24 * GiB)).ffn_gpu_layers) > len(plan(q36, OPT).ffn_gpu_layers)


def _cli():
    """The real `hybridrt` entry when it has `plan`, else an app built from the command function."""
    code = ("import sys, typer\n"
            "from hybridrt.errors import UserError\n"
            "from hybridrt.cli.plan import plan\n"
            "app = typer.Typer(); app.command('plan')(plan); app.command('noop')(lambda: None)\n"
            "try:\n    app()\nexcept UserError as e:\n    print('error:', e, file=sys.stderr); sys.exit(2)\n")
    real = subprocess.run([sys.executable, "-c", "from hybridrt.cli.commands import main; main()", "plan", "--help"],
                          capture_output=True, text=True)
    if real.returncode == 0:
        return [sys.executable, "-c", "from hybridrt.cli.commands import main; main()"]
    return [sys.executable, "-c", code]


def test_cli_plan_on_the_27b_is_fast(q36_path):
    cmd = _cli() + ["plan", "-m", str(q36_path), "--vram", "12GiB", "-c", "32768", "--spec-draft-n-max", "3"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert r.returncode == 0, r.stderr
    assert "FFN on GPU: 0-" in r.stdout and "GDN snapshot ring" in r.stdout and "speculative" in r.stdout
    # CPU seconds, not wall: the test machine is shared, and the command's own work is what must be
    # small (the bandwidth probe's threads count in full)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert cpu < 3.0, f"hybridrt plan used {cpu:.2f} CPU s ({wall:.2f} s wall)"
    d = json.loads(subprocess.run(cmd + ["--json", "--cpu-bw", "40"], capture_output=True, text=True).stdout)
    assert d["options"]["spec_type"] == "draft-mtp"          # the default with an MTP head


def test_cli_trunk_too_big_for_8gib(q36_path):
    r = subprocess.run(_cli() + ["plan", "-m", str(q36_path), "--vram", "8GiB", "-c", "131072", "--cpu-bw", "40"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")
    assert "needs at least" in lines[0] and "-c " in lines[0] and "q8_0" in lines[0]
