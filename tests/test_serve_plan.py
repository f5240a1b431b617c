"""`hybridrt serve` executing a plan as `run` does (issue 59 item 4), with the CPU standing in for the
device: the same flags and placement line, the same greedy tokens, a plan that reserves each of the
--parallel sessions' own state, and sessions that share the placed model's steps (or take turns
at them without continuous batching).

The server runs in this process: `uvicorn.run` is replaced by a Starlette TestClient over the app
`serve` built, so nothing listens on a port and the CLI's whole path (flags, load, pool) is what
answers."""
from __future__ import annotations

import dataclasses
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from hybridrt.runtime.place import PlacementRequest
from placement import MiB, PlanError, PlanOptions, plan
from tests.test_cli_errors import assert_one_line_error, run_cli
from tests.test_placed_run import budget_for
from tests.test_placement import fixed_gpu, synthetic_profile
from tests.test_server import _free_port

pytestmark = pytest.mark.usefixtures("single_thread")

REQUEST = PlacementRequest(n_ctx=256, spec_type="draft-mtp", spec_draft_n_max=3)
PER_SESSION = ("gdn_snapshot_ring", "draft_kv", "kv_cache", "recurrent_state")


# ----------------------------------------------------------------------------- the planner
def test_sessions_multiply_what_each_holds_and_nothing_else():
    prof = synthetic_profile()
    one = PlanOptions(vram_bytes=1024 * MiB, margin_bytes=64 * MiB, n_ctx=2048, spec_type="draft-mtp",
                      spec_draft_n_max=3)
    p1, p3 = plan(prof, one), plan(prof, dataclasses.replace(one, n_seq=3))
    for key in PER_SESSION:
        assert p3.line(key).gpu_bytes == 3 * p1.line(key).gpu_bytes > 0, key
        assert p3.line(key).detail.endswith("for each of 3 sessions"), key
    for line in p1.lines:
        if line.key not in PER_SESSION and line.stage < 4:      # weights, scratch, overhead: once
            assert p3.line(line.key).gpu_bytes == line.gpu_bytes, line.key
    assert fixed_gpu(p3) - fixed_gpu(p1) == 2 * sum(p1.line(k).gpu_bytes for k in PER_SESSION)


def test_a_recurrent_draft_models_state_is_per_session_and_its_scratch_once():
    target = synthetic_profile(mtp=False)
    draft = synthetic_profile(mtp=False, ffn_sizes=(1 * MiB,) * 4, interval=2)       # GDN layers: a live state
    opt = PlanOptions(vram_bytes=2048 * MiB, margin_bytes=64 * MiB, n_ctx=1024, spec_type="draft-simple",
                      spec_draft_n_max=2, draft=draft)
    one, two = plan(target, opt).line("draft_state"), plan(target, dataclasses.replace(opt, n_seq=2)).line("draft_state")
    assert two.gpu_bytes - one.gpu_bytes == (2 + 1) * draft.recurrent_state_bytes > 0


def test_too_many_sessions_say_how_many_fit():
    prof = synthetic_profile()
    opt = PlanOptions(vram_bytes=1024 * MiB, margin_bytes=64 * MiB, n_ctx=65536, spec_type="draft-mtp",
                      spec_draft_n_max=3, n_seq=4)
    need = [fixed_gpu(plan(prof, dataclasses.replace(opt, vram_bytes=1 << 40, n_seq=n))) for n in (1, 2, 3, 4)]
    budget = (need[1] + need[2]) // 2                                   # two sessions fit, three do not
    with pytest.raises(PlanError) as err:
        plan(prof, dataclasses.replace(opt, vram_bytes=budget))
    assert "it fits with" in str(err.value) and "--parallel 2" in str(err.value).split("not enough alone")[0]
    assert err.value.min_vram_bytes == need[3]
    with pytest.raises(PlanError, match="--parallel must be at least 1"):
        plan(prof, dataclasses.replace(opt, n_seq=0))


def test_plan_shows_the_servers_plan(tiny_qwen35_mtp):
    common = ["plan", str(tiny_qwen35_mtp), "--vram", "600MiB", "-c", "256", "--cpu-bw", "20", "--json"]
    one, two = (run_cli(*common, *extra) for extra in ([], ["--parallel", "2"]))
    assert one.returncode == 0 and two.returncode == 0, one.stderr + two.stderr
    p1, p2 = json.loads(one.stdout), json.loads(two.stdout)
    assert (p1["options"]["n_seq"], p2["options"]["n_seq"]) == (1, 2)
    kv = [{line["key"]: line["gpu_bytes"] for line in p["lines"]}["kv_cache"] for p in (p1, p2)]
    assert kv[1] == 2 * kv[0] > 0
    assert_one_line_error(run_cli(*common, "-np", "0"), "--parallel must be at least 1")


# ----------------------------------------------------------------------------- turns
def test_hand_on_lets_a_waiting_session_step_first():
    """A session handing on its turn lets the one waiting go first (a plain Lock would usually be
    taken straight back by the thread that released it), then gets it back."""
    from hybridrt.server.pool import Turns

    turns, order = Turns(), []

    def other():
        with turns.turn():
            order.append("other")

    with turns.turn():
        t = threading.Thread(target=other)
        t.start()
        while turns._issued < 2:        # the other session holds a ticket: it waits
            time.sleep(0.001)
        order.append("first step")
        turns.hand_on()
        order.append("second step")
    t.join(5)
    assert order == ["first step", "other", "second step"]


def test_a_pool_refuses_more_sessions_than_the_plan_holds(tiny_qwen35_mtp):
    from hybridrt.errors import UserError
    from hybridrt.runtime.loader import load_model
    from hybridrt.server.metrics import Metrics
    from hybridrt.server.pool import ServeConfig, SessionPool

    m = load_model(tiny_qwen35_mtp, placement=dataclasses.replace(REQUEST, vram_bytes=600 * MiB))
    with pytest.raises(UserError, match="plan with --parallel 2"):
        SessionPool(m, ServeConfig(n_ctx=256, cache_type="f16", n_parallel=2), Metrics(2))


# ----------------------------------------------------------------------------- serve, in process
def serve(monkeypatch, args: list[str], talk) -> object:
    """`hybridrt serve ARGS` in this process, the app answered by a TestClient instead of uvicorn;
    returns what `talk(client)` returns."""
    import numba
    import uvicorn
    from starlette.testclient import TestClient

    from hybridrt.cli.commands import app

    said = []

    def run_app(asgi, host, port, log_level):
        with TestClient(asgi) as client:
            said.append(talk(client))

    monkeypatch.setattr(uvicorn, "run", run_app)
    monkeypatch.setattr(numba.config, "THREADING_LAYER", numba.config.THREADING_LAYER)     # --parallel sets it
    app(["serve", *args, "--port", str(_free_port()), "-t", "1"], standalone_mode=False)
    return said[0]


def chat(client, content: str, n: int) -> str:
    r = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": content}], "max_tokens": n, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def placement_of(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("placement:")]
    assert len(lines) == 1, stderr
    return lines[0]


def test_serve_runs_the_plan_run_runs(tiny_qwen35_mtp, monkeypatch, capsys):
    vram = str(budget_for(tiny_qwen35_mtp, REQUEST, 3, 2.5))
    flags = ["-m", str(tiny_qwen35_mtp), "-c", "256", "--vram", vram, "--device", "cpu", "--spec-draft-n-max", "3"]
    content = serve(monkeypatch, flags, lambda client: chat(client, "hello world", 20))
    served = capsys.readouterr().err
    ran = run_cli("run", *flags, "-t", "1", "--chat", "-p", "hello world", "--temp", "0", "-n", "20", "--ignore-eos")
    assert ran.returncode == 0, ran.stderr
    assert placement_of(served) == placement_of(ran.stderr)
    assert "offloaded 3/8 FFN layers + 64/128 units of layer 3 to cpu standing in for the GPU" in served
    assert content == ran.stdout.removesuffix("\n") and len(content) > 10


def test_serve_bad_vram_is_one_line(tiny_qwen35_mtp):
    r = run_cli("serve", "-m", str(tiny_qwen35_mtp), "--vram", "lots", "--port", str(_free_port()))
    assert_one_line_error(r, "bad --vram 'lots'")


@pytest.mark.parametrize("batching", ["--cont-batching", "--no-cont-batching"])
def test_parallel_sessions_on_a_plan(tiny_qwen35_q4, batching, monkeypatch, capsys):
    """Two requests decoding at once on a placed model each get what they get alone. The sessions
    share the executor's host buffers and the dequantization tile (quantized matrices on the device:
    the trunk's, and the output head's and MTP head's outside the executor's forward): with
    continuous batching their evals share steps and the rest of their device work takes turns with
    them; without it they take turns a whole step at a time."""
    alone, together, shared = alone_and_together(tiny_qwen35_q4, "cpu", monkeypatch, batching)
    assert "and the KV caches of 2 sessions on it" in placement_of(capsys.readouterr().err)
    assert alone[0] != alone[1] and together == alone
    assert (shared is not None and shared[1] < shared[0]) if batching == "--cont-batching" else shared is None


@pytest.mark.cuda
def test_parallel_sessions_on_a_gpu_plan(tiny_qwen35_q4, monkeypatch, capsys):
    """On a GPU: real streams, and steps replayed from CUDA graphs captured per session."""
    alone, together, shared = alone_and_together(tiny_qwen35_q4, "cuda", monkeypatch)
    assert "to cuda; trunk, output head and the KV caches of 2 sessions" in placement_of(capsys.readouterr().err)
    assert alone[0] != alone[1] and together == alone and shared[1] < shared[0]


def batch_counts(client) -> tuple[int, int] | None:
    """/metrics' (evals handed to shared steps, steps run); None without continuous batching."""
    values = {}
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(("hybridrt_batch_evals_total ", "hybridrt_batch_steps_total ")):
            name, value = line.split()
            values[name] = int(float(value))
    return (values["hybridrt_batch_evals_total"], values["hybridrt_batch_steps_total"]) if values else None


def alone_and_together(path, device: str, monkeypatch, batching: str = "--cont-batching"):
    """Two prompts' greedy answers from a placed -np 2 server: one after the other, then at once;
    and /metrics' batch counts after them."""
    vram = str(budget_for(path, dataclasses.replace(REQUEST, n_seq=2), 3, 2.5))
    prompts = ["hello world", "the quick brown fox jumps over"]

    def talk(client):
        alone = [chat(client, p, 24) for p in prompts]
        with ThreadPoolExecutor(2) as pool:
            together = list(pool.map(lambda p: chat(client, p, 24), prompts))
        return alone, together, batch_counts(client)

    return serve(monkeypatch, ["-m", str(path), "-c", "256", "--vram", vram, "--device", device, "-np", "2",
                               "--no-warmup", batching], talk)
