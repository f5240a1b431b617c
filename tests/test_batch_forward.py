"""One forward over several sequences (runtime/batch.py, Model.forward_batch, session.eval_batch):
every session's logits and final hiddens bitwise equal to what its own Session.eval gives, for
decode rows, verify-like batches, a prompt chunk sharing a step with decode rows, batches past
ROWWISE_MAX rows (several forwards), prompts past it (a forward of their own), rollbacks between
steps, every KV cache type, the fused and the torch trunk; on the tiny llama / qwen3 / gemma3 files
and (slow) on SmolLM2 and Gemma 3. The recurrent trunks (tiny qwen35 / qwen35moe / qwen3next):
each sequence's Gated DeltaNet state and snapshot ring advance in its own rows, verify-sized rows
are captured or not as each session's ring decides, and a rollback inside a shared verify step
restores each session as it would alone. A placed model (a plan, the CPU standing in for the
device; on a GPU too, marked cuda) batches alike. A step is a dict session index -> tokens (the others sit it
out); `rollback` drops sessions' last tokens before a step (Session.truncate), in both runs alike.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import make_model
from gpu_kernels.attention import ROWWISE_MAX
from hybridrt.errors import UserError
from hybridrt.runtime.backends import FusedAttentionBlock, FusedGDNBlock, GluFFN, HostFFN, SplitFFN
from hybridrt.runtime.batch import BatchSeq, StepBatch, pack_rows
from hybridrt.runtime.loader import load_model
from hybridrt.runtime.place import PlacementRequest
from hybridrt.runtime.session import eval_batch
from tests.real_models import GEMMA3, SMOLLM2, require
from tests.test_placed_run import load_placed

ARCHS = ("llama", "qwen3", "gemma3")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    built: dict = {}
    root = tmp_path_factory.mktemp("batch-models")

    def get(arch: str, mix: str = "q4_k_m", **load):
        key = (arch, mix, tuple(sorted(load.items())))
        if key not in built:
            path = root / f"{arch}-{mix}.gguf"
            if not path.exists():
                make_model.write_model(path, arch, mix=mix, seed=3)
            built[key] = load_model(path, **load)
        return built[key]
    return get


def rand_tokens(model, n: int, rng) -> list[int]:
    return [int(t) for t in rng.integers(0, model.n_vocab, n)]


@dataclasses.dataclass
class Script:
    prompts: list[list[int]]
    steps: list[dict[int, list[int]]]
    rollback: dict[int, dict[int, int]] = dataclasses.field(default_factory=dict)   # step -> session -> tokens dropped
    n_ctx: int = 128


def run_alone(model, script: Script, cache: str, logits: str):
    """Each session by itself (Session.eval): [step][session] -> (logits, hidden)."""
    out = [dict() for _ in script.steps]
    for i, prompt in enumerate(script.prompts):
        s = model.session(script.n_ctx, cache, k_max=8)
        s.eval(prompt, logits="none")
        for j, step in enumerate(script.steps):
            if i in script.rollback.get(j, {}):
                s.truncate(s.n_past - script.rollback[j][i])
            if i in step:
                out[j][i] = (s.eval(step[i], logits=logits), s.hidden.clone())
    return out


def run_batched(model, script: Script, cache: str, logits: str):
    """The same sessions sharing steps (eval_batch), their prompts too."""
    sessions = [model.session(script.n_ctx, cache, k_max=8) for _ in script.prompts]
    eval_batch(sessions, script.prompts, logits="none")
    out = []
    for j, step in enumerate(script.steps):
        for i, r in script.rollback.get(j, {}).items():
            sessions[i].truncate(sessions[i].n_past - r)
        ids = sorted(step)
        got = eval_batch([sessions[i] for i in ids], [step[i] for i in ids], logits=logits)
        out.append({i: (g, sessions[i].hidden.clone()) for i, g in zip(ids, got)})
    for i, s in enumerate(sessions):
        assert s.n_past == len(script.prompts[i]) + sum(len(step.get(i, [])) - script.rollback.get(j, {}).get(i, 0)
                                                        for j, step in enumerate(script.steps))
    return out


def assert_batched_equals_alone(model, script: Script, cache: str = "f32", logits: str = "all"):
    alone, batched = run_alone(model, script, cache, logits), run_batched(model, script, cache, logits)
    for j, (a, b) in enumerate(zip(alone, batched)):
        assert a.keys() == b.keys()
        for i in a:
            assert torch.equal(a[i][0], b[i][0]), f"step {j}, session {i}: logits differ from the session alone"
            assert torch.equal(a[i][1], b[i][1]), f"step {j}, session {i}: hiddens differ from the session alone"


def mixed_script(model, seed: int) -> Script:
    """Four sessions at different positions: decode rows, a verify-like step, a prompt chunk among
    decode rows, rollbacks, sessions sitting steps out, a step of more than ROWWISE_MAX rows, and
    steps where a session runs alone between shared ones (its own forward reads what the shared
    ones wrote to its cache, and the other way round)."""
    rng = np.random.default_rng(seed)
    t = lambda n: rand_tokens(model, n, rng)  # noqa: E731
    prompts = [t(n) for n in (5, 17, 2, 40)]        # the last one alone: past ROWWISE_MAX
    steps = [
        {0: t(1), 1: t(1), 2: t(1), 3: t(1)},               # decode rows
        {0: t(4), 1: t(4), 2: t(4), 3: t(4)},               # verify-like, 16 rows
        {1: t(33)},                                         # 1 alone past ROWWISE_MAX: the prompt path
        {0: t(2)},                                          # 0 alone: forward()
        {0: t(1), 1: t(12), 3: t(1)},                       # a prompt chunk with decode rows; 2 sits out
        {0: t(5), 1: t(5), 2: t(9), 3: t(8), },             # 27 rows
        {0: t(8), 1: t(8), 2: t(8), 3: t(8), },             # 32: the most one forward takes
        {0: t(9), 1: t(9), 2: t(9), 3: t(9)},               # 36: two forwards
        {0: t(1), 1: t(3), 2: t(1), 3: t(2)},               # after rollbacks of 0 and 3
    ]
    return Script(prompts, steps, rollback={8: {0: 3, 3: 5}})


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mix", ["q4_k_m", "q8_0", "f32"])
def test_batched_steps_equal_each_session_alone(tiny, single_thread, arch, mix):
    model = tiny(arch, mix)
    assert isinstance(model.layers[0].mixer, FusedAttentionBlock)
    # gemma3's local layers see fewer keys than the sessions hold (its window: 8)
    assert arch != "gemma3" or 0 < max(layer.attention.spec.window for layer in model.layers) < 40
    assert_batched_equals_alone(model, mixed_script(model, seed=ARCHS.index(arch)))


@pytest.mark.parametrize("cache", ["f16", "q8_0", "bf16"])
@pytest.mark.parametrize("arch", ARCHS)
def test_every_cache_type(tiny, single_thread, arch, cache):
    """f16 and q8_0 caches through the fused kernels, bf16 through the torch block they wrap."""
    model = tiny(arch, "q8_0")
    if cache == "q8_0" and model.head_dim % 32:
        pytest.skip(f"{arch}'s tiny file has a head size q8_0 blocks do not divide")
    assert_batched_equals_alone(model, mixed_script(model, seed=7), cache)


@pytest.mark.parametrize("arch", ARCHS)
def test_torch_trunk(tiny, single_thread, arch):
    model = tiny(arch, "q4_k_m", fused_layers=False)
    assert not isinstance(model.layers[0].mixer, FusedAttentionBlock)
    assert_batched_equals_alone(model, mixed_script(model, seed=11), "f16")


def test_last_logits(tiny, single_thread):
    model = tiny("gemma3")
    assert_batched_equals_alone(model, mixed_script(model, seed=12), "f16", logits="last")


def test_a_row_reads_its_own_sequence(tiny, single_thread):
    """Negative control: the same rows with the two sequences' states swapped give other logits
    (the equality above is not blind to which cache a row reads)."""
    model = tiny("llama")
    rng = np.random.default_rng(5)
    a, b = (model.session(64, "f32") for _ in range(2))
    a.eval(rand_tokens(model, 9, rng), logits="none")
    b.eval(rand_tokens(model, 9, rng), logits="none")
    tokens = torch.tensor(rand_tokens(model, 2, rng))
    right = StepBatch((BatchSeq(a.state, 9, 1), BatchSeq(b.state, 9, 1)))
    swapped = StepBatch((BatchSeq(b.state, 9, 1), BatchSeq(a.state, 9, 1)))
    h_right = model.forward_batch(right, tokens)
    h_swapped = model.forward_batch(swapped, tokens)
    assert not torch.equal(h_right, h_swapped)


def test_pack_rows():
    assert pack_rows([1, 1, 1]) == [[0, 1, 2]]
    assert pack_rows([20, 20, 10, 2]) == [[0, 2, 3], [1]]
    assert pack_rows([33, 1, 32]) == [[0], [1], [2]]
    assert pack_rows([ROWWISE_MAX]) == [[0]]
    groups = pack_rows([5, 9, 30, 1, 40, 17, 8], 32)
    assert sorted(i for g in groups for i in g) == list(range(7))


def test_batch_description():
    with pytest.raises(ValueError):
        StepBatch(())
    state = object()
    with pytest.raises(ValueError):
        StepBatch((BatchSeq(state, 0, 1), BatchSeq(state, 1, 1)))
    batch = StepBatch((BatchSeq(object(), 3, 2), BatchSeq(object(), 0, 5)))
    assert batch.rows == (slice(0, 2), slice(2, 7)) and batch.n_rows == 7
    assert batch.seqs[0].positions == [3, 4]


RECURRENT = ("qwen35", "qwen35moe", "qwen3next")


def recurrent_script(model, seed: int) -> Script:
    """Four sessions of a recurrent trunk (k_max 8, run_alone's) at different positions: decode
    rows, verify-sized steps (captured by each session's ring), a prompt chunk among decode rows,
    steps mixing sessions whose rings capture with one whose rows exceed k_max, rollbacks inside
    the last shared verify step (a recurrent state rolls back no further: Qwen35.truncate_state),
    a step past ROWWISE_MAX rows (two forwards) and sessions running alone between shared steps."""
    rng = np.random.default_rng(seed)
    t = lambda n: rand_tokens(model, n, rng)  # noqa: E731
    prompts = [t(n) for n in (5, 17, 2, 40)]        # the last one alone: past ROWWISE_MAX
    steps = [
        {0: t(1), 1: t(1), 2: t(1), 3: t(1)},               # decode rows
        {0: t(4), 1: t(4), 2: t(4), 3: t(4)},               # verify-sized, every ring captures
        {0: t(1), 1: t(1), 2: t(1), 3: t(1)},               # after rollbacks of 0 and 2
        {1: t(33)},                                         # 1 alone past ROWWISE_MAX: the prompt path
        {0: t(2)},                                          # 0 alone: forward()
        {0: t(1), 1: t(12), 3: t(1)},                       # a chunk past k_max with decode rows; 2 sits out
        {0: t(8), 1: t(8), 2: t(8), 3: t(8)},               # 32 rows, each a k_max verify
        {0: t(5), 1: t(5), 2: t(9), 3: t(8)},               # after rollbacks of 0, 1, 3; 2's 9 rows not captured
        {0: t(9), 1: t(9), 2: t(9), 3: t(9)},               # after rollbacks of 0 and 3; two forwards
        {0: t(1), 1: t(3), 2: t(1), 3: t(2)},
        {0: t(1), 1: t(1), 2: t(1), 3: t(1)},               # after rollbacks of 1 and 3
    ]
    rollback = {2: {0: 2, 2: 3}, 7: {0: 7, 1: 1, 3: 4}, 8: {0: 4, 3: 7}, 10: {1: 2, 3: 1}}
    return Script(prompts, steps, rollback)


@pytest.mark.parametrize("arch", RECURRENT)
@pytest.mark.parametrize("mix", ["q4_k_m", "f32"])
def test_recurrent_steps_equal_each_session_alone(tiny, single_thread, arch, mix):
    model = tiny(arch, mix)
    assert any(isinstance(layer.mixer, FusedGDNBlock) for layer in model.layers)
    assert any(isinstance(layer.mixer, FusedAttentionBlock) for layer in model.layers)
    assert_batched_equals_alone(model, recurrent_script(model, seed=20 + RECURRENT.index(arch)))


@pytest.mark.parametrize("cache", ["f16", "bf16"])
def test_recurrent_cache_types(tiny, single_thread, cache):
    """f16 through the fused attention, bf16 through the torch attention block beside fused GDN halves."""
    model = tiny("qwen35", "q8_0")
    assert_batched_equals_alone(model, recurrent_script(model, seed=30), cache)


def test_recurrent_torch_trunk(tiny, single_thread):
    """models.qwen35.GatedDeltaNet.batched: the torch layers, conv and delta rule included."""
    model = tiny("qwen35", "q4_k_m", fused_layers=False)
    assert not any(isinstance(layer.mixer, FusedGDNBlock) for layer in model.layers)
    assert_batched_equals_alone(model, recurrent_script(model, seed=31), "f16")


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "torch"])
def test_recurrent_states_and_rings_after_a_shared_verify(tiny, single_thread, fused):
    """Each session's Gated DeltaNet state (conv rows, S) and snapshot ring after a shared verify
    step are bitwise the ones its own eval leaves, and so is each state after a rollback of its own
    length inside that step (what a speculative loop does after verifying its drafts)."""
    model = tiny("qwen35", "q8_0", fused_layers=fused)
    rng = np.random.default_rng(6)
    prompts = [rand_tokens(model, n, rng) for n in (9, 3, 14)]
    verify = [rand_tokens(model, n, rng) for n in (4, 1, 3)]
    kept = (2, 1, 3)            # tokens of the verify step each keeps

    def recurrent(s):
        ring = s.state.ring
        return [t.clone() for t in (s.state.conv_all, s.state.S_all, ring.S, ring.conv_hist)]

    alone, batched = [model.session(64, k_max=4) for _ in prompts], [model.session(64, k_max=4) for _ in prompts]
    for s, p, v in zip(alone, prompts, verify):
        s.eval(p, logits="none")
        s.eval(v, logits="none")
    eval_batch(batched, prompts, logits="none")
    eval_batch(batched, verify, logits="none")
    for i, (x, y) in enumerate(zip(alone, batched)):
        assert all(torch.equal(u, w) for u, w in zip(recurrent(x), recurrent(y))), f"session {i} after the verify"
    for group in (alone, batched):
        for s, p, k in zip(group, prompts, kept):
            s.truncate(len(p) + k)
    for i, (x, y) in enumerate(zip(alone, batched)):
        assert all(torch.equal(u, w) for u, w in zip(recurrent(x), recurrent(y))), f"session {i} after its rollback"


def test_refusals(tiny):
    model = tiny("llama")
    s = model.session(64)
    with pytest.raises(ValueError, match="twice"):
        eval_batch([s, s], [[1], [2]])
    with pytest.raises(UserError, match="do not fit"):
        eval_batch([s, model.session(64)], [[1] * 65, [2]])
    big = StepBatch(tuple(BatchSeq(model.new_state(64), 0, 17) for _ in range(2)))
    with pytest.raises(ValueError, match="at most"):
        model.forward_batch(big, torch.zeros(34, dtype=torch.int64))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen35_q4"])
def test_placed_steps_equal_each_session_alone(fixture, device, request, single_thread):
    """A plan (on the CPU: the CPU standing in for the device, tests/test_placed_run.py): device
    matrices, FFN layers in the mmap crossing to the executor's worker (HostFFN) and the split layer
    (SplitFFN) over several sequences' rows, each session's logits and hiddens bitwise its own
    eval's, the recurrent trunk's states and rings included. The step of 36 rows runs two forwards
    and the output head once for each: one device head call over all 36 would be a prompt GEMM."""
    path = request.getfixturevalue(fixture)
    req = PlacementRequest(n_ctx=128, cache_type_k="f32", cache_type_v="f32", spec_draft_n_max=7,
                           spec_type="draft-mtp" if "qwen35" in fixture else "ngram-simple")
    model = load_placed(path, req, 2, 1.0, device)
    kinds = {type(layer.ffn.ffn) for layer in model.layers}
    assert {GluFFN, SplitFFN, HostFFN} <= kinds, kinds
    recurrent = model.arch == "qwen35"
    assert_batched_equals_alone(model, recurrent_script(model, 4) if recurrent else mixed_script(model, 4))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_real_models(name):
    """SmolLM2 (Q4_1) and Gemma 3 (Q4_K / Q6_K) at their default f16 cache on 2 threads: the
    parallel projections, row lanes and token lanes of 2..32 rows; Gemma 3's sliding window is 512,
    so its local layers are crossed by a 600-token prompt."""
    import numba

    model = load_model(require(SMOLLM2 if name == "smollm2" else GEMMA3))
    before = numba.get_num_threads()
    numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
    try:
        script = mixed_script(model, seed=1)
        script.prompts[3] = rand_tokens(model, 600, np.random.default_rng(2))
        assert_batched_equals_alone(model, dataclasses.replace(script, n_ctx=1024), "f16")
    finally:
        numba.set_num_threads(before)
