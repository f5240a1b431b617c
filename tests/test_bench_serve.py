"""scripts/bench_serve.py: its figures' definitions, bad input, and one cheap run end to end.

The end-to-end run serves SmolLM2 (skipped when not pulled) to 1 and 2 concurrent streams of a
few tokens, with and without n-gram speculation, and llama.cpp's batched decode beside it when the
oracle venv is there.
"""
from __future__ import annotations

import json

import pytest

import bench_serve  # scripts/ is on sys.path (conftest)
from real_models import SMOLLM2, require
from test_bench_mission import script_error


def stream(sent: float, chunks: list[float], n: int) -> bench_serve.Stream:
    return bench_serve.Stream(sent, chunks, prompt_tokens=5, completion_tokens=n)


def test_decode_tps_counts_tokens_after_the_first_over_the_decode_window():
    a = stream(0.0, [0.10, 0.20, 0.30], 3)
    b = stream(0.0, [0.15, 0.25, 0.35, 0.45], 4)
    # (2 + 3) tokens after the firsts, from 0.10 (a's first) to 0.45 (b's last)
    assert bench_serve.decode_tps([a, b]) == pytest.approx(5 / 0.35)
    assert bench_serve.e2e_tps([a, b]) == pytest.approx(7 / 0.45)
    row = bench_serve.hybridrt_row([[a, b]])
    assert row["ttft_ms"] == {"p50": 100.0, "p95": 150.0}
    assert row["token_ms"] == {"p50": 100.0, "p95": 100.0}
    assert row["completion_tokens"] == [3, 4] and row["prompt_tokens"] == [5, 5]
    assert "draft_accept" not in row


def test_percentile_is_nearest_rank():
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert [bench_serve.percentile(values, p) for p in (0, 20, 21, 50, 95, 100)] == [1.0, 1.0, 2.0, 3.0, 5.0, 5.0]


def test_ratios():
    rows = [{"engine": e, "n": n, "decode_tps": tps} for e, n, tps in
            [("llama.cpp", 1, 50.0), ("llama.cpp", 4, 100.0), ("hybridrt", 1, 80.0), ("hybridrt", 4, 200.0),
             ("hybridrt spec", 1, 40.0), ("hybridrt spec", 4, 300.0)]]
    bench_serve.add_ratios(rows)
    got = {(r["engine"], r["n"]): {k: r.get(k) for k in ("speedup", "vs_llamacpp", "vs_plain")} for r in rows}
    assert got["llama.cpp", 4] == {"speedup": 2.0, "vs_llamacpp": None, "vs_plain": None}
    assert got["hybridrt", 4] == {"speedup": 2.5, "vs_llamacpp": 2.0, "vs_plain": None}
    assert got["hybridrt spec", 1] == {"speedup": 1.0, "vs_llamacpp": 0.8, "vs_plain": 0.5}
    assert got["hybridrt spec", 4] == {"speedup": 7.5, "vs_llamacpp": 3.0, "vs_plain": 1.5}


def test_prompts_are_distinct():
    texts = bench_serve.prompts(20)
    assert len(set(texts)) == 20 and texts[:8] == list(bench_serve.PROMPTS)


def error_exit(capsys, argv: list[str]) -> str:
    """main(argv) exits 2, nothing on stdout, its last stderr line an `error: ...` line; that line."""
    return script_error(capsys, bench_serve.main, argv, alone=False)


def test_bad_input_exits_2(capsys, tmp_path):
    assert "-npl" in error_exit(capsys, ["--no-llamacpp", "-npl", "1,0"])
    assert "-npl" in error_exit(capsys, ["--no-llamacpp", "-npl", "2,x"])
    assert "-n 1" in error_exit(capsys, ["--no-llamacpp", "-n", "1"])
    assert "--spec" in error_exit(capsys, ["--no-llamacpp", "--spec", ""])
    assert "sets these itself" in error_exit(capsys, ["--no-llamacpp", "--serve-args", "--port 9"])
    assert "not found" in error_exit(capsys, ["--no-llamacpp", str(tmp_path / "missing.gguf")])
    text = tmp_path / "text.gguf"
    text.write_text("not a model")
    assert "not a GGUF" in error_exit(capsys, ["--no-llamacpp", str(text)])
    assert "--reps" in error_exit(capsys, ["--reps", "x"])


def test_missing_oracle_is_bad_input(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("HYBRIDRT_CACHE", str(tmp_path))       # no oracle-venv there
    assert "--no-llamacpp" in error_exit(capsys, [str(tmp_path / "m.gguf")])


@pytest.mark.slow
def test_end_to_end_json(capsys):
    path = require(SMOLLM2)
    with_llamacpp = bench_serve.oracle_python().exists()
    argv = [str(path), "-npl", "1,2", "-n", "5", "-t", "1", "--spec", "--json"]
    assert bench_serve.main(argv + ([] if with_llamacpp else ["--no-llamacpp"])) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["settings"]["n"] == [1, 2] and out["settings"]["spec_flags"] == ["--spec-type", "ngram-simple"]
    engines = ["hybridrt", "hybridrt spec"] + (["llama.cpp"] if with_llamacpp else [])
    rows = {(r["engine"], r["n"]): r for r in out["rows"]}
    assert sorted(rows) == sorted((e, n) for e in engines for n in (1, 2))
    for (engine, n), r in rows.items():
        assert r["completion_tokens"] == [5] * n, (engine, n)
        assert len(r["prompt_tokens"]) == n and r["decode_tps"] > 0
        assert r["ttft_ms"]["p50"] > 0 and r["token_ms"]["p95"] >= r["token_ms"]["p50"] > 0
        assert r["speedup"] == (1.0 if n == 1 else pytest.approx(r["decode_tps"] / rows[engine, 1]["decode_tps"], abs=0.01))
    assert rows["hybridrt spec", 2]["spec_flags"] == ["--spec-type", "ngram-simple"]
    if with_llamacpp:       # the same prompts, tokenized alike by both engines
        assert rows["llama.cpp", 2]["prompt_tokens"] == rows["hybridrt", 2]["prompt_tokens"]
        assert "vs_llamacpp" in rows["hybridrt", 2]
