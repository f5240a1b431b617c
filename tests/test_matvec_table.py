"""gpu_kernels.matvec_table: the fused matvec's launch table, the kernel variants it can pick, and the
sweep (scripts/bench_gpu_kernels.py --sweep) that fills it.

Interpreted (TRITON_INTERPRET=1, conftest) on tiny shapes: every plan a table can give keeps a
token's bits independent of k, split-K and the tl.dot modes are exact, tables round-trip through
JSON and an unknown card takes the default rows, and the sweep's dry run writes a table that loads.
The `cuda` tests repeat the variants and any committed table's plans on a real GPU.
"""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType as T

from gpu_kernels import triton_matvec
from gpu_kernels.matvec_table import (DEFAULT, K_CLASS_NAMES, K_MAX, SHAPE_CLASSES, MatvecParams, MatvecTable,
                                      committed_tables, k_class, select_table, shape_class, table_for_device)
from gpu_kernels.triton_matvec import MatvecLaunch, device_rows, matvec_triton
from tests.test_triton_matvec import assert_close_to_gguf, tokens, weights

CUDA = pytest.mark.cuda
# with k = 16 itself, one k of every class
CHECK_KS = (1, 3, 6)

pytestmark = pytest.mark.usefixtures("single_thread")


def run(launch: MatvecLaunch, x: torch.Tensor) -> torch.Tensor:
    y = torch.empty(x.shape[0], launch.n_out, device=x.device)
    launch(x.contiguous(), y)
    return y


def assert_plan_keeps_bits(raw: torch.Tensor, qtype, plan, x: torch.Tensor, what: str):
    """Through one launch object with the plan: every checked k's rows bitwise the first rows of
    k = 16, and tokens alone bitwise their rows there."""
    launch = MatvecLaunch(raw, qtype, x.shape[1], plan=plan)
    full = run(launch, x)
    for k in CHECK_KS:
        assert torch.equal(run(launch, x[:k]), full[:k]), f"{what}: k={k} differs from k={K_MAX}"
    for t in (0, K_MAX - 1):
        assert torch.equal(run(launch, x[t:t + 1])[0], full[t]), f"{what}: token {t} alone differs"
    return full


def by_class(**choices) -> tuple[MatvecParams, ...]:
    """A plan from one launch per k class: by_class(k1=..., k2_4=..., k5_8=..., k9_16=...)."""
    launches = [choices["k1"], choices["k2_4"], choices["k5_8"], choices["k9_16"]]
    return tuple(launches[K_CLASS_NAMES.index(k_class(k))] for k in range(1, K_MAX + 1))


# plans whose k classes differ only in what leaves a row's float operations alone (rows per program,
# warps, stages, chunks a step), with the BITS_FIELDS fixed: the loop with and without split-K, a dot mode
MIXED_PLANS = {
    "loop": by_class(k1=MatvecParams(8, 1, False, num_stages=1), k2_4=MatvecParams(16, 2, False, unroll=2),
                     k5_8=MatvecParams(4, 4, False, num_stages=2, unroll=2), k9_16=MatvecParams(16, 4, False)),
    "loop split 2": by_class(k1=MatvecParams(8, 1, False, split_k=2), k2_4=MatvecParams(16, 2, False, split_k=2, unroll=2),
                             k5_8=MatvecParams(4, 2, False, split_k=2), k9_16=MatvecParams(16, 4, False, split_k=2, unroll=2)),
    "tf32x3 rows mid": by_class(k1=MatvecParams(16, 4, True, dot="tf32x3"),
                                k2_4=MatvecParams(32, 4, True, dot="tf32x3", unroll=2),
                                k5_8=MatvecParams(16, 2, True, dot="tf32x3", num_stages=1),
                                k9_16=MatvecParams(32, 8, True, dot="tf32x3")),
}


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_every_table_plan_keeps_bits_independent_of_k(qtype):
    """Every plan the default table and the committed ones give (any shape class), and plans that
    mix launches across k classes, at a tiny shape: bits independent of k, values exact."""
    n_in = 512
    raw_np = weights(qtype, 16, n_in, seed=11)
    raw, x = torch.from_numpy(raw_np), tokens(K_MAX, n_in, seed=12)
    plans = {table.plan_for(qtype, shape) for table in (DEFAULT, *committed_tables()) for shape in SHAPE_CLASSES}
    plans |= set(MIXED_PLANS.values())
    for plan in plans:
        what = f"{qtype.name} {'/'.join(sorted({p.label() for p in plan}))}"
        full = assert_plan_keeps_bits(raw, qtype, plan, x, what)
        assert_close_to_gguf(full, raw_np, qtype, x, what)


def test_bits_fields_must_not_vary_with_k():
    """Split-K regroups a row's sum and the tile order reorders its reduction: different bits (so
    a plan may not vary them with k, and a table that does will not load)."""
    raw_np = weights(T.Q4_K, 8, 1024, seed=2)
    raw, x = torch.from_numpy(raw_np), tokens(2, 1024, seed=3)
    base = MatvecParams(8, 2, False)
    y = matvec_triton(raw, T.Q4_K, 1024, x, params=base)
    for change in ({"split_k": 2}, {"rows_mid": True}, {"block_n": 16, "dot": "tf32x3"}):
        other = dataclasses.replace(base, **change)
        assert not torch.equal(matvec_triton(raw, T.Q4_K, 1024, x, params=other), y), change
        mixed = (base,) + (other,) * (K_MAX - 1)
        with pytest.raises(ValueError, match="a token's bits would depend on k"):
            MatvecLaunch(raw, T.Q4_K, 1024, plan=mixed)


SPLIT_CASES = [(T.Q4_K, 1024, MatvecParams(8, 2, False, split_k=2)),
               (T.Q4_K, 1280, MatvecParams(8, 2, False, split_k=3, unroll=2)),      # runs of 2, 2, 1 chunks
               (T.Q6_K, 1024, MatvecParams(16, 2, True, split_k=4)),               # one chunk a run
               (T.Q6_K, 512, MatvecParams(16, 4, True, split_k=3, dot="tf32x3")),  # the last run empty
               (T.Q8_0, 1088, MatvecParams(8, 2, True, split_k=2, unroll=2)),      # the tail in the last run
               (T.Q8_0, 576, MatvecParams(16, 4, False, split_k=4, dot="ieee"))]   # runs 1, 1, 0, 0 + tail


@pytest.mark.parametrize("qtype,n_in,params", SPLIT_CASES, ids=lambda v: getattr(v, "name", None) or
                         (v.label() if isinstance(v, MatvecParams) else str(v)))
def test_split_k_matches_the_float64_reference(qtype, n_in, params):
    """Split-K's runs (uneven, empty, with a partial last chunk) add up to the float64 product of
    the gguf-py weights within the kernel's tolerance, every k's rows are bitwise those of k = 16,
    and the block counts are back to zero for the next launch."""
    raw_np = weights(qtype, 12, n_in, seed=n_in)
    raw = device_rows(torch.from_numpy(raw_np), qtype, n_in, "cpu")
    x = tokens(K_MAX, n_in, seed=n_in + 1)
    full = assert_plan_keeps_bits(raw, qtype, params, x, params.label())
    assert_close_to_gguf(full, raw_np, qtype, x, params.label())
    launch = MatvecLaunch(raw, qtype, n_in, plan=params)
    assert not launch.by_k[1].scratch[1].any()


def table_for_test(card="NVIDIA H100 80GB HBM3", match="NVIDIA H100*", capability=(9, 0)) -> MatvecTable:
    rows = {("Q4_K", "long", k): MatvecParams(8, 2, False, split_k=4, unroll=2 if k == "1" else 1) for k in K_CLASS_NAMES}
    rows |= {("Q6_K", "tall", k): MatvecParams(32, 8 if k == "9-16" else 4, True) for k in K_CLASS_NAMES}
    measured = {("Q4_K", "long", "1"): {"k": 1, "ms": 0.05, "bandwidth_share": 0.71}}
    return MatvecTable(card, rows, match, capability, measured)


def test_table_json_round_trip(tmp_path):
    table = table_for_test()
    table.save(tmp_path / "h100.json")
    loaded = MatvecTable.load(tmp_path / "h100.json")
    assert loaded == table
    assert loaded.plan(T.Q4_K, 5120, 17408)[0] == MatvecParams(8, 2, False, split_k=4, unroll=2)
    assert loaded.plan(T.Q4_K, 5120, 17408)[1] == MatvecParams(8, 2, False, split_k=4)
    assert loaded.plan(T.Q6_K, 17408, 5120)[15].num_warps == 8
    # what the table has no rows for: the default's
    assert loaded.plan(T.Q4_K, 17408, 5120) == DEFAULT.plan(T.Q4_K, 17408, 5120) == (MatvecParams(16, 4, False),) * K_MAX
    assert loaded.plan(T.Q8_0, 5120, 17408) == (MatvecParams(16, 2, True),) * K_MAX


def test_unknown_card_falls_back_to_the_default_rows():
    h100 = table_for_test()
    assert select_table([h100], "NVIDIA H100 80GB HBM3", (9, 0)) is h100
    assert select_table([h100], "NVIDIA H200", (9, 0)) is h100                 # by capability
    assert select_table([h100], "NVIDIA GeForce RTX 4090", (8, 9)) is DEFAULT
    assert select_table([], "NVIDIA H100 80GB HBM3", (9, 0)) is DEFAULT
    named = dataclasses.replace(h100, card="NVIDIA L4", match="NVIDIA L4", capability=None)
    assert select_table([named, h100], "NVIDIA L4", (8, 9)) is named
    assert table_for_device("cpu") is DEFAULT
    for table in committed_tables():        # none yet; each committed one must load and validate
        assert table.rows and table.match


@pytest.mark.parametrize("obj,message", [
    ({"card": "c", "rows": [{"type": "Q4_K", "shape": "tall", "k": "1", "launch": {"block_n": 16, "num_warps": 4,
                                                                                   "rows_mid": False}}]},
     r"Q4_K tall has no row for k in \['2-4', '5-8', '9-16'\]"),
    ({"card": "c", "rows": [{"type": "Q4_K", "shape": "tall", "k": k,
                             "launch": {"block_n": 16, "num_warps": 4, "rows_mid": False, "split_k": 1 + (k == "1")}}
                            for k in K_CLASS_NAMES]}, "a token's bits would depend on k"),
    ({"card": "c", "rows": [{"type": "F16", "shape": "tall", "k": "1", "launch": {}}]}, "missing"),
    ({"card": "c", "rows": [{"type": "Q4_K", "shape": "wide", "k": "1",
                             "launch": {"block_n": 16, "num_warps": 4, "rows_mid": False}}]}, "shape class 'wide'"),
    ({"card": "c", "rows": [{"type": "Q4_K", "shape": "tall", "k": "1",
                             "launch": {"block_n": 16, "num_warps": 4, "rows_mid": False, "warps": 4}}]}, "warps"),
    ({"card": "c", "rows": [{"type": "Q4_K", "shape": "tall", "k": "1",
                             "launch": {"block_n": 8, "num_warps": 4, "rows_mid": False, "dot": "tf32x3"}}]},
     "needs block_n >= 16"),
    ({"rows": []}, "card"),
])
def test_bad_tables_are_named(tmp_path, obj, message):
    (tmp_path / "bad.json").write_text(json.dumps(obj))
    with pytest.raises(ValueError, match=message):
        MatvecTable.load(tmp_path / "bad.json")


def test_classes():
    assert [shape_class(*s) for s in ((17408, 5120), (5120, 17408), (5120, 6144), (248320, 5120), (1024, 5120))] \
        == ["tall", "long", "small", "tall", "small"]
    assert [k_class(k) for k in (1, 2, 4, 5, 8, 9, 16)] == ["1", "2-4", "2-4", "5-8", "5-8", "9-16", "9-16"]
    with pytest.raises(ValueError):
        k_class(17)
    with pytest.raises(ValueError, match="block_n 12"):
        MatvecParams(12, 4, False)


# ---------------------------------------------------------------- the sweep

def test_choose_plan_takes_the_best_bits_group_and_the_fastest_launch_per_k_class():
    import bench_gpu_kernels as bench

    a, a2, b = MatvecParams(8, 2, False), MatvecParams(16, 4, False), MatvecParams(16, 4, False, split_k=2)
    ms = {a: {1: 1.0, 4: 2.0, 16: 8.0}, a2: {1: 1.2, 4: 1.5, 16: 6.0}, b: {1: 0.9, 4: 3.0, 16: 9.0}}
    outputs = {p: {"ms": t} for p, t in ms.items()}
    plan = bench.choose_plan([([b], outputs), ([a, a2], outputs)], [1, 4, 16])
    # group {a, a2}: 1.0/0.9 + 1.5/1.5 + 6/6 = 3.11 against b's 1 + 2 + 1.5 = 4.5
    assert [plan[k] for k in (1, 2, 4, 5, 8, 9, 16)] == [a, a2, a2, a2, a2, a2, a2]
    assert bench.choose_plan([], [1]) is None
    # a class without a measured k takes the nearest measured one's choice (5-8: k = 4)
    plan = bench.choose_plan([([a, a2], outputs)], [1, 16])
    assert plan[5] == plan[1] == a and plan[9] == a2


def test_dry_sweep_writes_a_table_that_loads(tmp_path, capsys):
    import bench_gpu_kernels as bench

    path = tmp_path / "dry.json"
    assert bench.main(["--dry-run", "--sweep", "--ks", "1,4", "--write-table", str(path), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert [s["status"] for s in result["summaries"]] == ["ok", "ok"] and not result["skipped"]
    assert all(r["status"] == "ok" and r["max_error"] <= 1e-5 for r in result["rows"]), result["rows"]
    assert {r["launch"] for r in result["rows"]} >= {"16x4", "16x4-k2", "16x4-u2", "16x4-tf32x3", "16x2m-tf32x3"}
    table = MatvecTable.load(path)
    assert table.card == result["device"] and table.rows == MatvecTable.from_json(result["table"]).rows
    assert {(t, s) for t, s, _ in table.rows} == {("Q4_K", "tall"), ("Q6_K", "long")}
    assert {k for (_, _, k), m in table.measured.items()} == {"1", "2-4"}
    # a time bound already passed: no matrix is measured and the table is empty
    assert bench.main(["--dry-run", "--sweep", "--ks", "1", "--max-seconds", "0", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["summaries"] == [] and len(result["skipped"]) == 2 and result["table"]["rows"] == []


@pytest.mark.parametrize("argv,message", [(["--ks", "0,4"], "--ks"), (["--ks", "x"], "--ks"),
                                          (["--write-table", "t.json"], "needs --sweep"),
                                          (["--sweep", "--types", "Q2_K"], "--types")])
def test_bad_arguments_are_one_error_line(capsys, argv, message):
    import bench_gpu_kernels as bench

    assert bench.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0]


# ---------------------------------------------------------------- on a real GPU

@pytest.fixture(scope="module")
def down_27b():
    """Qwen3.6-27B's ffn_down on the GPU (5120 x 17408, Q4_K, random payload with finite scales), 16
    tokens, their float64 product with the gguf-py weights and its error scale sum |x||w|."""
    from gpu_kernels.quant import dequantize_torch
    from tests.test_gpu_quant import random_bytes

    raw = torch.from_numpy(random_bytes(np.random.default_rng(4), T.Q4_K, 5120, 17408)).cuda()
    x = tokens(K_MAX, 17408, device="cuda")
    w = dequantize_torch(raw, T.Q4_K, 17408).double()
    return raw, x, x.double() @ w.t(), x.double().abs() @ w.abs().t()


@CUDA
@pytest.mark.parametrize("params", [MatvecParams(8, 2, False, split_k=4), MatvecParams(8, 2, False, split_k=3, unroll=2),
                                    MatvecParams(16, 4, False, dot="tf32x3"), MatvecParams(16, 4, False, dot="ieee"),
                                    MatvecParams(16, 4, False, split_k=4, dot="tf32x3")], ids=lambda p: p.label())
def test_cuda_variants_at_the_27b_down_shape(down_27b, params):
    """Split-K's count and fix-up (atomics, .cg loads) and the tl.dot modes compiled for the card, at
    Qwen3.6-27B's ffn_down: exact, every k bitwise the first rows of k = 16."""
    raw, x, ref, bound = down_27b
    launch = MatvecLaunch(raw, T.Q4_K, 17408, plan=params)
    full = run(launch, x)
    assert ((full.double() - ref).abs() / bound.clamp_min(1e-300)).max().item() <= 1e-5
    for k in range(1, K_MAX + 1):
        for _ in range(2):          # twice: the counts must be back at zero
            assert torch.equal(run(launch, x[:k]), full[:k]), k


@CUDA
def test_cuda_this_cards_table_keeps_bits_independent_of_k():
    """The plans of the card's committed table (if it has one), each at a Qwen3.6-27B shape of its
    class: exact, and a token's bits the same for every k across the table's launches."""
    from gpu_kernels.quant import dequantize_torch
    from tests.test_gpu_quant import random_bytes

    table = table_for_device("cuda")
    if table is DEFAULT:
        pytest.skip("no matvec table is committed for this card")
    shapes = {"tall": (17408, 5120), "long": (5120, 17408), "small": (5120, 6144)}
    for tname, shape in sorted({(t, s) for t, s, _ in table.rows}):
        qtype, (n_out, n_in) = T[tname], shapes[shape]
        raw = torch.from_numpy(random_bytes(np.random.default_rng(int(qtype)), qtype, n_out, n_in)).cuda()
        x = tokens(K_MAX, n_in, device="cuda")
        w = dequantize_torch(raw, qtype, n_in).double()
        ref, bound = x.double() @ w.t(), x.double().abs() @ w.abs().t()
        launch = MatvecLaunch(raw, qtype, n_in, plan=table.plan_for(qtype, shape))
        full = run(launch, x)
        assert ((full.double() - ref).abs() / bound.clamp_min(1e-300)).max().item() <= 1e-5, (tname, shape)
        assert all(torch.equal(run(launch, x[:k]), full[:k]) for k in range(1, K_MAX + 1)), (tname, shape)
        assert all(torch.equal(run(launch, x[t:t + 1])[0], full[t]) for t in range(K_MAX)), (tname, shape)


def test_triton_matvec_reads_the_table(monkeypatch):
    """matvec_triton's launch is the device table's plan for the matrix (here a table that gives a
    tiny Q4_K matrix, class small, split-K): its bits, not the default's."""
    rows = {("Q4_K", "small", k): MatvecParams(8, 2, False, split_k=2) for k in K_CLASS_NAMES}
    monkeypatch.setattr(triton_matvec, "table_for_device", lambda device: MatvecTable("test", rows))
    raw_np = weights(T.Q4_K, 8, 1024, seed=5)
    raw, x = torch.from_numpy(raw_np), tokens(2, 1024, seed=6)
    y = matvec_triton(raw, T.Q4_K, 1024, x)
    assert torch.equal(y, matvec_triton(raw, T.Q4_K, 1024, x, params=MatvecParams(8, 2, False, split_k=2)))
    assert not torch.equal(y, matvec_triton(raw, T.Q4_K, 1024, x, params=MatvecParams(8, 2, False)))
