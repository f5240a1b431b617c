"""scripts/bench_mission.py: argument checks, and the sections on a tiny qwen35 file.

Without the llama.cpp oracle: parsing, bad input (one error line, exit 2), and hybridrt's t(k)
(timings positive, the session afterwards as if it had decoded the kept tokens). The oracle tests
run both engines through the script on the same tiny file.
"""
from __future__ import annotations

import json

import pytest
import torch

import bench_mission  # scripts/ is on sys.path (conftest)
from hybridrt.runtime.loader import load_model


def test_defaults():
    args = bench_mission.parse_args(["model.gguf"])
    assert args.section_list == ["decode", "tk", "pp", "start"]
    assert (args.threads, args.n_gen, args.k_max, args.pp, args.depth) == (2, 16, 8, 512, 0)
    assert not args.cold and not args.no_llamacpp
    args = bench_mission.parse_args(["m.gguf", "--sections", "tk, spec", "-t", "1", "--spec-n", "1,4"])
    assert args.section_list == ["tk", "spec"] and args.threads == 1 and args.spec_n == "1,4"


def script_error(capsys, main, argv: list[str], alone: bool = True) -> str:
    """A bench script's main(argv) exits 2 with nothing on stdout and an `error: ...` line as the
    last line on stderr (alone: the only one); that line."""
    try:
        code = main(argv)
    except SystemExit as exc:       # argparse's usage errors
        code = exc.code
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert (len(lines) == 1 or not alone) and lines[-1].startswith("error: "), err
    return lines[-1]


def error_exit(capsys, argv: list[str]) -> str:
    return script_error(capsys, bench_mission.main, argv)


def test_bad_input_exits_2(capsys, tmp_path, tiny_qwen35_mtp):
    assert "not found" in error_exit(capsys, [str(tmp_path / "missing.gguf"), "--no-llamacpp"])
    text = tmp_path / "text.gguf"
    text.write_text("not a model")
    assert "not a GGUF" in error_exit(capsys, [str(text), "--no-llamacpp"])
    model = str(tiny_qwen35_mtp)
    assert "--sections" in error_exit(capsys, [model, "--sections", "decode,bogus", "--no-llamacpp"])
    assert "--spec-n" in error_exit(capsys, [model, "--spec-n", "0", "--no-llamacpp"])
    assert "--spec-accept" in error_exit(capsys, [model, "--spec-accept", "1.5", "--no-llamacpp"])
    assert "-t" in error_exit(capsys, [model, "-t", "0", "--no-llamacpp"])
    assert "--reps" in error_exit(capsys, [model, "--reps", "x"])


def test_missing_oracle_is_bad_input(capsys, monkeypatch, tmp_path, tiny_qwen35_mtp):
    monkeypatch.setenv("HYBRIDRT_CACHE", str(tmp_path))       # no oracle-venv there
    assert "--no-llamacpp" in error_exit(capsys, [str(tiny_qwen35_mtp), "--sections", "tk"])


@pytest.fixture(scope="module")
def tiny_model(tiny_qwen35_mtp, single_thread):
    return load_model(tiny_qwen35_mtp, threads=1)


def test_tk_times_every_k_and_keeps_the_session_consistent(tiny_model):
    m, k_max = tiny_model, 5
    ids = m.tokenize(bench_mission.vs.PROMPT)
    session = bench_mission.tk_session(m, ids, k_max, rounds=1, cache_type="f32")
    times = bench_mission.tk_round(m, session, k_max)
    assert sorted(times) == list(range(1, k_max + 1))
    assert all(t > 0 for t in times.values())
    # the warm-up round and the timed one each kept every batch's first token, nothing else
    kept = session.n_past - len(ids)
    assert kept == 2 * k_max
    token = bench_mission.tk_token(m.n_vocab)
    nxt = [token + 1]
    got = session.eval(nxt, logits="last")
    fresh = m.session(session.n_ctx, "f32", k_max=k_max)
    fresh.eval(ids + [token] * kept, logits="none")
    want = fresh.eval(nxt, logits="last")
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_hybridrt_sections_without_the_oracle(capsys, tiny_qwen35_mtp):
    """tk, pp and spec through main, hybridrt only: one JSON line per section after the machine's."""
    code = bench_mission.main([str(tiny_qwen35_mtp), "--no-llamacpp", "-t", "1", "--sections", "tk,pp,spec",
                               "--reps", "1", "-n", "6", "--k-max", "3", "--pp", "16", "--spec-n", "2",
                               "--spec-accept", "0,1"])
    out = capsys.readouterr().out
    rows = [json.loads(line) for line in out.strip().splitlines()]
    assert code == 0 and [r["section"] for r in rows] == ["machine", "tk", "pp", "spec"]
    assert rows[0]["cores"] >= 1 and rows[0]["file_bytes"] > 0 and rows[0]["cpu"]
    tk = rows[1]
    assert tk["k"] == [1, 2, 3] and len(tk["hybridrt_ms"]) == 3 and tk["hybridrt_rel"][0] == 1.0
    assert "llamacpp_ms" not in tk
    assert rows[2]["pp"] == 16 and rows[2]["hybridrt_tps"] > 0
    never, always = rows[3]["rows"]        # forced drafts: every one wrong, every one right
    assert (never["alpha"], never["accept_rate"], never["tokens_per_step"]) == (0.0, 0.0, 1.0)
    assert (always["alpha"], always["accept_rate"], always["tokens_per_step"]) == (1.0, 1.0, 3.0)
    assert never["identical"] and always["identical"] and "vs_llamacpp_plain" not in always


@pytest.mark.oracle
def test_both_engines(capsys, tiny_qwen35_mtp):
    from oracle_llamacpp import oracle_available

    if not oracle_available():
        pytest.skip("llama.cpp oracle venv missing")
    code = bench_mission.main([str(tiny_qwen35_mtp), "-t", "1", "-n", "4", "--reps", "1", "--k-max", "4",
                               "--pp", "16", "--sections", "decode,tk,pp,start,spec", "--spec-n", "2",
                               "--spec-accept", "1"])
    rows = {r["section"]: r for r in map(json.loads, capsys.readouterr().out.strip().splitlines())}
    assert code == 0
    assert rows["decode"]["llamacpp_tps"] > 0 and rows["decode"]["ratio"] > 0
    tk = rows["tk"]
    assert len(tk["llamacpp_ms"]) == 4 and min(tk["llamacpp_ms"]) > 0
    # this llama.cpp rolls a qwen35 batch back with n_rs_seq = k_max - 1 snapshots
    assert (tk["llamacpp_rollback"], tk["llamacpp_n_rs_seq"]) == ("seq_rm", 3)
    assert rows["pp"]["llamacpp_tps"] > 0
    start = rows["start"]
    assert [r["run"] for r in start["hybridrt"]] == ["first", "warm"]
    assert all(r["load_s"] and r["exit_s"] >= r["load_s"] and r["peak_rss_mib"] > 0 for r in start["hybridrt"])
    assert start["llamacpp"]["first_token_s"] >= start["llamacpp"]["load_s"] > 0
    spec = rows["spec"]["rows"]
    assert spec[0]["accept_rate"] == 1.0 and spec[0]["identical"] and spec[0]["vs_llamacpp_plain"] > 0
