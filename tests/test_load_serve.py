"""scripts/load_serve.py: its figures and checks on made-up counts, bad input, and one short run
end to end (SmolLM2, skipped when not pulled: 8 clients for 10 s) whose every check holds."""
from __future__ import annotations

import json
from collections import Counter
from types import SimpleNamespace

import pytest

import load_serve  # scripts/ is on sys.path (conftest)
from real_models import SMOLLM2, require
from test_bench_mission import script_error

CHAT, TEXT = load_serve.CHAT, load_serve.TEXT


def error_exit(capsys, argv: list[str]) -> str:
    return script_error(capsys, load_serve.main, argv)


def test_bad_input_exits_2(capsys, tmp_path):
    assert "--clients 0" in error_exit(capsys, ["--clients", "0"])
    assert "--duration 1" in error_exit(capsys, ["--duration", "1"])
    assert "--warmup 1" in error_exit(capsys, ["--warmup", "1"])
    assert "-t 0" in error_exit(capsys, ["-t", "0"])
    assert "--duration" in error_exit(capsys, ["--duration", "x"])
    assert "sets these itself" in error_exit(capsys, ["--serve-args", "--port 9"])
    assert "--max-queue" in error_exit(capsys, ["--serve-args", "--max-queue 3"])
    assert "--serve-args" in error_exit(capsys, ["--serve-args", "'unclosed"])
    assert "not found" in error_exit(capsys, [str(tmp_path / "missing.gguf")])


def test_metrics_text_parses():
    text = ('# HELP hybridrt_requests_total HTTP requests by endpoint and status\n'
            'hybridrt_requests_total{endpoint="/v1/completions",status="200"} 7\n'
            'hybridrt_requests_total{endpoint="/v1/completions",status="499"} 2\n'
            '# TYPE hybridrt_sessions_in_use gauge\nhybridrt_sessions_in_use 0\n'
            'hybridrt_decode_tokens_per_second 12.5\n')
    values, requests = load_serve.parse_metrics(text)
    assert values == {"hybridrt_sessions_in_use": 0.0, "hybridrt_decode_tokens_per_second": 12.5}
    assert requests == Counter({(TEXT, 200): 7, (TEXT, 499): 2})


def test_figures():
    mib = 2**20
    rss = load_serve.rss_figures([(0.0, 500 * mib), (1.0, 600 * mib), (2.0, 610 * mib), (3.0, 640 * mib),
                                  (4.0, 620 * mib)], warm_s=2.0)
    assert (rss["start"], rss["first_after_warmup"], rss["max_after_warmup"], rss["growth"], rss["end"]) == \
        (500, 610, 640, 30, 620)
    assert load_serve.rss_figures([(0.0, mib)], warm_s=2.0) is None
    # 2 requests held beyond those in flight on average, 10 clients leaving a second: 0.2 s each
    assert load_serve.held_figures([1, 3, 2], n_left=100, duration=10.0)["let_go_s"] == pytest.approx(0.2)
    assert load_serve.held_figures([0, 1], n_left=0, duration=10.0)["let_go_s"] is None


def _ctx(seen: dict, unseen: dict) -> load_serve.Ctx:
    return load_serve.Ctx("", 0, 1024, None, None, seen=Counter(seen), unseen=Counter(unseen))


def test_requests_check_allows_only_unseen_requests_as_200_or_499():
    ctx = _ctx({(CHAT, 200): 5, (CHAT, 400): 2, (TEXT, 200): 3}, {TEXT: 2})
    server = {(CHAT, 200): 5, (CHAT, 400): 2, (TEXT, 200): 4, (TEXT, 499): 1}
    assert load_serve.check_requests(ctx, Counter(server))[0]
    for wrong in ({**server, (TEXT, 499): 2},             # one more than the clients sent
                  {**server, (TEXT, 499): 0},             # one fewer
                  {**server, (CHAT, 400): 1, (CHAT, 404): 1},   # a status the clients did not see
                  {**server, (TEXT, 499): 0, (TEXT, 500): 1}):  # an unseen request's 500
        assert not load_serve.check_requests(ctx, Counter(wrong))[0], wrong


def test_checks_fail_on_a_leaked_session_and_on_rss_growth():
    ctx = _ctx({(TEXT, 200): 1}, {})
    ctx.kinds = {k: load_serve.KindTally() for k in load_serve.KINDS}
    ctx.usage_tokens = 4
    args = SimpleNamespace(rss_growth_mib=64.0)
    values = {"hybridrt_sessions_in_use": 0.0, "hybridrt_requests_waiting": 0.0,
              "hybridrt_tokens_predicted_total": 4.0, "hybridrt_requests_cancelled_total": 0.0}
    health = {"http_status": 200, "status": "ok"}
    rss = {"growth": 10.0, "first_after_warmup": 600.0, "max_after_warmup": 610.0}
    held = {"mean": 0.1, "max": 1, "let_go_s": 0.05}

    def failed(**change) -> set[str]:
        kw = dict(values=values, requests=Counter({(TEXT, 200): 1}), health=health, rss=rss, held=held,
                  server_alive=True, log_lines=[], stuck=0) | change
        return {c["name"] for c in load_serve.checks(ctx, args, **kw) if not c["ok"]}

    assert failed() == set()
    assert failed(values={**values, "hybridrt_sessions_in_use": 1.0}) == {"sessions"}
    assert failed(rss={**rss, "growth": 65.0}) == {"rss"}
    assert failed(held={**held, "let_go_s": 4.8}) == {"let go"}
    assert failed(values={**values, "hybridrt_tokens_predicted_total": 5.0}) == {"tokens"}
    assert failed(requests=Counter({(TEXT, 200): 1, (CHAT, 503): 1})) == {"no 5xx", "requests"}
    assert failed(log_lines=["Traceback (most recent call last):"]) == {"server"}


def test_a_short_run_passes_every_check(capsys):
    path = require(SMOLLM2)
    argv = [str(path), "-t", "1", "--parallel", "2", "-c", "512", "--clients", "8", "--duration", "8",
            "--warmup", "0.5", "--rss-growth-mib", "256", "--json"]
    code = load_serve.main(argv)
    out, err = capsys.readouterr()
    result = json.loads(out)
    assert code == 0, [c for c in result["checks"] if not c["ok"]]
    assert all(c["ok"] for c in result["checks"]) and result["ok"]
    kinds = result["kinds"]
    assert sum(k["requests"] for k in kinds.values()) == result["requests"] > 20
    assert all(sum(k["statuses"].values()) == k["requests"] for k in kinds.values())
    groups = Counter()
    for name, k in kinds.items():
        groups[load_serve.KINDS[name][0]] += k["requests"]
    assert min(groups.values()) > 0 and set(groups) == {"normal", "cancel", "malformed"}
    assert result["completed"] > 0 and result["n_problems"] == 0
    assert result["metrics"]["hybridrt_tokens_predicted_total"] >= result["completion_tokens_read"] > 0
    assert set(kinds["malformed"]["statuses"]) <= {"400", "404", "405"}
    assert result["rss_mib"]["series"] and result["settings"]["clients"] == 8
    assert "error" not in err
