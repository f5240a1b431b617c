"""scripts/make_model.py: synthetic GGUF files in llama.cpp's exact layout."""
from __future__ import annotations

import os
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import gguf
from gguf.constants import GGMLQuantizationType as QT

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import make_model  # noqa: E402

N_27B_TENSORS = 3 + 48 * 14 + 16 * 11 + 15   # globals, GDN layers, attention layers, MTP block


@pytest.fixture(scope="module")
def sparse_27b(tmp_path_factory) -> Path:
    return make_model.write_sparse_preset(tmp_path_factory.mktemp("sparse") / "q36.gguf",
                                          "qwen3.6-27b-mtp")


def test_sparse_preset_size_and_holes(sparse_27b):
    st = os.stat(sparse_27b)
    assert 16.0e9 < st.st_size < 17.5e9
    assert st.st_blocks * 512 < 64 << 20          # the data region is a hole


def test_sparse_preset_table_matches_q4_k_m_mix():
    d, mix = make_model.PRESETS["qwen3.6-27b-mtp"]
    specs = make_model.tensor_table(d)
    types = make_model.assign_types(specs, mix, d)
    assert len(specs) == N_27B_TENSORS
    by_name = dict(zip((s.name for s in specs), types))
    assert by_name["output.weight"] == QT.Q6_K
    assert by_name["token_embd.weight"] == QT.Q4_K
    assert by_name["blk.0.ssm_conv1d.weight"] == QT.F32
    assert by_name["blk.0.ssm_a"] == QT.F32 and by_name["blk.0.ssm_dt.bias"] == QT.F32
    downs = [t for s, t in zip(specs, types) if s.name.endswith("ffn_down.weight")]
    attn_v_like = [t for s, t in zip(specs, types)
                   if s.name.endswith(("attn_v.weight", "attn_qkv.weight"))]
    assert len(downs) == 65 and len(attn_v_like) == 48 + 17
    # llama-quantize's use_more_bits picks about half of them for Q6_K
    assert 25 <= sum(t == QT.Q6_K for t in downs) <= 40
    assert 25 <= sum(t == QT.Q6_K for t in attn_v_like) <= 40
    assert set(types) == {QT.F32, QT.Q4_K, QT.Q6_K}


@pytest.mark.slow
def test_sparse_preset_opens_with_gguf_reader(sparse_27b):
    r = gguf.GGUFReader(sparse_27b)
    assert len(r.tensors) == N_27B_TENSORS
    kv = {k: f.contents() for k, f in r.fields.items()
          if not k.startswith("tokenizer.ggml.") and not k.startswith("GGUF.")}
    expected = {
        "general.architecture": "qwen35", "qwen35.block_count": 65,
        "qwen35.nextn_predict_layers": 1, "qwen35.embedding_length": 5120,
        "qwen35.feed_forward_length": 17408, "qwen35.attention.head_count": 24,
        "qwen35.attention.head_count_kv": 4, "qwen35.attention.key_length": 256,
        "qwen35.attention.value_length": 256, "qwen35.rope.dimension_count": 64,
        "qwen35.rope.dimension_sections": [11, 11, 10, 0], "qwen35.ssm.conv_kernel": 4,
        "qwen35.ssm.state_size": 128, "qwen35.ssm.group_count": 16,
        "qwen35.ssm.time_step_rank": 48, "qwen35.ssm.inner_size": 6144,
        "qwen35.full_attention_interval": 4, "qwen35.context_length": 262144,
        "general.file_type": 15,
    }
    for key, value in expected.items():
        assert kv[key] == value, key
    assert kv["qwen35.rope.freq_base"] == pytest.approx(1e7)
    assert kv["qwen35.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-6)
    assert len(r.fields["tokenizer.ggml.tokens"].data) == 248320
    t = {x.name: x for x in r.tensors}
    assert t["token_embd.weight"].shape.tolist() == [5120, 248320]
    assert t["blk.0.attn_qkv.weight"].shape.tolist() == [5120, 2 * 16 * 128 + 48 * 128]
    assert t["blk.0.ssm_conv1d.weight"].shape.tolist() == [4, 10240]
    assert t["blk.3.attn_q.weight"].shape.tolist() == [5120, 2 * 24 * 256]
    assert t["blk.64.nextn.eh_proj.weight"].shape.tolist() == [10240, 5120]
    assert "blk.64.nextn.shared_head_norm.weight" in t and "blk.64.attn_qkv.weight" not in t
    # the tensor data region ends exactly at the end of the file
    end = max(int(x.data_offset) + int(x.n_bytes) for x in r.tensors)
    assert 0 <= os.path.getsize(sparse_27b) - end < 32
    assert Counter(x.tensor_type for x in r.tensors)[QT.Q6_K] >= 60


# ---------------------------------------------------------------- tiny models

def _reader_kv(path):
    r = gguf.GGUFReader(path)
    kv = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    return r, kv, {t.name: t for t in r.tensors}


def test_tiny_qwen35_mtp_layout(tiny_qwen35_mtp):
    r, kv, t = _reader_kv(tiny_qwen35_mtp)
    d = make_model.TINY_DEFAULTS["qwen35"]
    assert kv["general.architecture"] == "qwen35"
    assert kv["qwen35.block_count"] == d.n_layer + 1 and kv["qwen35.nextn_predict_layers"] == 1
    assert kv["tokenizer.ggml.model"] == "gpt2" and kv["tokenizer.ggml.pre"] == "qwen35"
    assert kv["tokenizer.ggml.add_bos_token"] is False
    n_vocab = len(kv["tokenizer.ggml.tokens"])
    assert 300 <= n_vocab <= 600
    assert t["token_embd.weight"].shape.tolist() == [d.n_embd, n_vocab]
    gdn = [i for i in range(d.n_layer) if f"blk.{i}.attn_qkv.weight" in t]
    attn = [i for i in range(d.n_layer + 1) if f"blk.{i}.attn_q.weight" in t]
    assert gdn == [0, 1, 2, 4, 5, 6] and attn == [3, 7, 8]
    key_dim, value_dim = d.ssm_k_heads * d.ssm_head_dim, d.ssm_v_heads * d.ssm_head_dim
    assert t["blk.0.attn_qkv.weight"].shape.tolist() == [d.n_embd, 2 * key_dim + value_dim]
    assert t["blk.0.ssm_conv1d.weight"].shape.tolist() == [d.ssm_conv, 2 * key_dim + value_dim]
    assert t["blk.3.attn_q.weight"].shape.tolist() == [d.n_embd, 2 * d.n_head * d.head_dim]
    assert t["blk.8.nextn.eh_proj.weight"].shape.tolist() == [2 * d.n_embd, d.n_embd]
    assert {x.tensor_type for x in r.tensors} == {QT.F32}
    assert np.all(np.asarray(t["blk.0.ssm_a"].data) < 0)          # -exp(A_log)
    assert [x.name for x in r.tensors] == sorted(x.name for x in r.tensors)


def test_tiny_llama_and_qwen3_layouts(tiny_llama, tiny_qwen3):
    _, kv, t = _reader_kv(tiny_llama)
    assert kv["general.architecture"] == "llama" and "output.weight" not in t   # tied
    assert "blk.0.ffn_norm.weight" in t and "blk.0.attn_q_norm.weight" not in t
    assert kv["tokenizer.ggml.add_bos_token"] is True
    _, kv, t = _reader_kv(tiny_qwen3)
    assert kv["general.architecture"] == "qwen3" and "output.weight" in t
    hd = kv["qwen3.attention.key_length"]
    assert t["blk.0.attn_q_norm.weight"].shape.tolist() == [hd]
    assert t["blk.0.attn_q.weight"].shape.tolist() == [kv["qwen3.embedding_length"],
                                                       kv["qwen3.attention.head_count"] * hd]


def test_tokenizer_merges_are_consistent():
    tok = make_model.tiny_tokenizer("qwen35")
    vocab = set(tok.tokens)
    assert len(vocab) == len(tok.tokens)
    for m in tok.merges:
        a, b = m.split(" ")
        assert a in vocab and b in vocab and a + b in vocab
    assert tok.tokens[tok.eos_id] == "<|im_end|>" and tok.token_types[tok.eos_id] == 3


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path):
    a = make_model.write_model(tmp_path / "a.gguf", "qwen35", seed=7, dims={"n_layer": 4})
    b = make_model.write_model(tmp_path / "b.gguf", "qwen35", seed=7, dims={"n_layer": 4})
    c = make_model.write_model(tmp_path / "c.gguf", "qwen35", seed=8, dims={"n_layer": 4})
    assert a.read_bytes() == b.read_bytes()
    ta = {x.name: np.asarray(x.data) for x in gguf.GGUFReader(a).tensors}
    tc = {x.name: np.asarray(x.data) for x in gguf.GGUFReader(c).tensors}
    assert ta.keys() == tc.keys()
    assert not np.array_equal(ta["blk.0.attn_qkv.weight"], tc["blk.0.attn_qkv.weight"])


def test_q8_0_mix_quantizes_matrices_only(tmp_path):
    p = make_model.write_model(tmp_path / "q8.gguf", "qwen35", mtp=True, mix="q8_0")
    r, kv, t = _reader_kv(p)
    assert kv["general.file_type"] == 7
    for name, x in t.items():
        matrix = len(x.shape) == 2 and "_norm" not in name and "ssm_conv1d" not in name
        assert x.tensor_type == (QT.Q8_0 if matrix else QT.F32), name


def test_q4_k_m_mix_follows_llama_quantize(tmp_path):
    pytest.importorskip("cpu_kernels.quantize")
    p = make_model.write_model(tmp_path / "q4.gguf", "qwen35", mtp=True, mix="q4_k_m")
    r, kv, t = _reader_kv(p)
    assert kv["general.file_type"] == 15 and kv["qwen35.embedding_length"] == 256
    assert t["output.weight"].tensor_type == QT.Q6_K
    assert t["blk.0.ffn_gate.weight"].tensor_type == QT.Q4_K
    assert t["blk.0.ffn_down.weight"].tensor_type == QT.Q6_K            # use_more_bits(0, 9)
    # rows of 64 (value_dim, n_head * head_dim) fall back like llama-quantize: Q4_K -> Q5_0
    assert t["blk.0.ssm_out.weight"].tensor_type == QT.Q5_0
    assert t["blk.3.attn_output.weight"].tensor_type == QT.Q5_0
    # the stored blocks decode to weights close to a fresh draw with the same seed
    import make_model as mm
    d = mm.tiny_dims("qwen35", True, "q4_k_m")
    d = mm.dataclasses.replace(d, n_vocab=len(kv["tokenizer.ggml.tokens"]))
    rng = np.random.default_rng(0)
    for s in mm.tensor_table(d):
        w = mm.draw_tensor(s, rng, d)
        if s.name == "blk.0.ffn_gate.weight":
            x = t[s.name]
            got = gguf.quants.dequantize(np.asarray(x.data), x.tensor_type).reshape(w.shape)
            assert np.linalg.norm(got - w) / np.linalg.norm(w) < 0.1
            break


def test_cli_writes_a_tiny_model(tmp_path, capsys):
    make_model.main(["--arch", "llama", "--seed", "1", "--dims", "n_layer=2,tied=0",
                     "--out", str(tmp_path / "l.gguf")])
    _, kv, t = _reader_kv(tmp_path / "l.gguf")
    assert kv["llama.block_count"] == 2 and "output.weight" in t


def test_sparse_35b_a3b_table_matches_q4_k_m_mix():
    """qwen35moe preset: 40 trunk blocks (30 GDN + 10 attention) + the MTP block, every block's FFN
    a MoE (256 experts, 8 used); llama-quantize's MoE rule gives ffn_down_exps and ffn_down_shexp
    of a block the same type, Q6_K where use_more_bits(block, block_count)."""
    d, mix = make_model.PRESETS["qwen3.6-35b-a3b"]
    specs = make_model.tensor_table(d)
    types = dict(zip((s.name for s in specs), make_model.assign_types(specs, mix, d)))
    assert d.arch == "qwen35moe" and d.block_count == 41
    assert sum(1 for s in specs if s.name.endswith("ffn_gate_inp.weight")) == 41
    assert not any(s.name.endswith("ffn_up.weight") for s in specs)
    spec = {s.name: s for s in specs}
    assert spec["blk.0.ffn_gate_exps.weight"].ne == (2048, 512, 256)
    assert spec["blk.0.ffn_down_exps.weight"].ne == (512, 2048, 256)
    assert spec["blk.40.ffn_up_shexp.weight"].ne == (2048, 512)
    for i in range(41):
        want = QT.Q6_K if make_model._use_more_bits(i, 41) else QT.Q4_K
        assert types[f"blk.{i}.ffn_down_exps.weight"] == types[f"blk.{i}.ffn_down_shexp.weight"] == want
    assert types["blk.0.ffn_gate_inp.weight"] == types["blk.0.ffn_gate_inp_shexp.weight"] == QT.F32
    assert set(types.values()) == {QT.F32, QT.Q4_K, QT.Q6_K}
    total = sum(make_model.tensor_nbytes(s.ne, types[s.name]) for s in specs)
    assert 21.0e9 < total < 22.5e9


def test_existing_archs_keep_their_bytes(tmp_path):
    """Adding qwen35moe changed no other arch's output: digests of seed-1 f32 files (tensor table,
    metadata, tokenizer and weights; f32 so that quantizer changes do not move them)."""
    import hashlib

    want = {("qwen35", "f32"): "94d8ce8c90a3e237", ("qwen3next", "f32"): "67589ad5cafb031b",
            ("gemma3", "f32"): "0677a3416dcc5b91", ("llama", "f32"): "839a00df96c70c60"}
    for (arch, mix), digest in want.items():
        path = make_model.write_model(tmp_path / f"{arch}-{mix}.gguf", arch, mix=mix, seed=1)
        assert hashlib.sha256(path.read_bytes()).hexdigest()[:16] == digest, (arch, mix)


# ---------------------------------------------------------------- full-size preset files

def _reduced(preset: str, n_layer: int = 4):
    """A preset's layout at a width and vocabulary a test writes and runs in a second; every row
    length stays a multiple of 256, so the Q4_K_M mix keeps its K-quants."""
    import dataclasses

    d, mix = make_model.PRESETS[preset]
    small = dict(n_embd=256, n_ff=512, n_head=2, n_head_kv=1, n_vocab=1024, n_layer=n_layer,
                 ssm_k_heads=2, ssm_v_heads=2 * d.ssm_v_heads // d.ssm_k_heads)
    if d.n_expert:
        small.update(n_expert=16, n_expert_used=4, n_ff_exp=256, n_ff_shexp=256)
    return dataclasses.replace(d, **small), mix


def _layout(d, mix):
    """(spec, type, offset in the data region, nbytes) per tensor, and the data region's size."""
    specs = make_model.tensor_table(d)
    out, off = [], 0
    for s, t in zip(specs, make_model.assign_types(specs, mix, d)):
        n = make_model.tensor_nbytes(s.ne, t)
        out.append((s, t, off, n))
        off += gguf.GGUFWriter.ggml_pad(n, 32)
    return out, off


def _check_magnitudes(path, d, mix, rows: int = 4, names=None):
    """The first rows of each quantized tensor dequantize to finite values whose rms is within a
    factor 2 of weight_std; F32 tensors are finite."""
    layout, data_size = _layout(d, mix)
    start = os.path.getsize(path) - data_size
    raw = np.memmap(path, np.uint8, "r")
    n_checked = 0
    for s, t, off, n in layout:
        if names is not None and s.name not in names:
            continue
        row_bytes = make_model.tensor_nbytes((s.ne[0],), t)
        k = min(rows, n // row_bytes)
        x = gguf.quants.dequantize(np.array(raw[start + off:start + off + k * row_bytes]).reshape(k, -1), t)
        assert x.shape == (k, s.ne[0]) and np.all(np.isfinite(x)), s.name
        if t != QT.F32:
            rms = np.sqrt(np.mean(np.square(x, dtype=np.float64), axis=1))
            target = make_model.weight_std(s, d)
            assert np.all((rms > target / 2) & (rms < target * 2)), (s.name, t.name, rms, target)
            n_checked += 1
    return n_checked


@pytest.mark.parametrize("preset", sorted(make_model.PRESETS))
def test_preset_data_is_deterministic_and_matches_the_sparse_table(tmp_path, preset):
    d, mix = _reduced(preset)
    a = make_model.write_preset_dims(tmp_path / "a.gguf", d, mix, seed=5)
    b = make_model.write_preset_dims(tmp_path / "b.gguf", d, mix, seed=5)
    c = make_model.write_preset_dims(tmp_path / "c.gguf", d, mix, seed=6)
    s = make_model.write_preset_dims(tmp_path / "s.gguf", d, mix, sparse=True)
    assert a.read_bytes() == b.read_bytes()
    r, rs = gguf.GGUFReader(a), gguf.GGUFReader(s)
    assert os.path.getsize(a) == os.path.getsize(s) == os.path.getsize(c)
    assert r.data_offset == rs.data_offset
    assert a.read_bytes()[:r.data_offset] == s.read_bytes()[:r.data_offset]    # same header and table
    assert [(x.name, x.tensor_type, int(x.data_offset)) for x in r.tensors] == \
        [(x.name, x.tensor_type, int(x.data_offset)) for x in rs.tensors]
    assert not np.any(np.memmap(s, np.uint8, "r")[r.data_offset:])              # sparse: a hole
    tc = {x.name: np.asarray(x.data) for x in gguf.GGUFReader(c).tensors}
    for x in r.tensors:         # another seed, other data in every tensor
        assert not np.array_equal(np.asarray(x.data), tc[x.name]), x.name
    kv = {k: f.contents() for k, f in r.fields.items() if k.endswith(".block_count")}
    assert list(kv.values()) == [d.n_layer + 1]
    # the offsets _layout computes are the file's, so the slow test can read the 27B without a reader
    layout, _ = _layout(d, mix)
    assert [r.data_offset + off for _, _, off, _ in layout] == \
        [int(x.data_offset) for x in r.tensors]


@pytest.mark.parametrize("preset", sorted(make_model.PRESETS))
def test_preset_weights_have_valid_scales(tmp_path, preset):
    d, mix = _reduced(preset)
    path = make_model.write_preset_dims(tmp_path / "m.gguf", d, mix, seed=1)
    assert _check_magnitudes(path, d, mix) >= 20
    t = {x.name: np.asarray(x.data) for x in gguf.GGUFReader(path).tensors}
    assert np.all(t["blk.0.ssm_a"] < 0) and np.all(np.abs(t["blk.0.ssm_dt.bias"]) <= 1)
    assert abs(float(np.mean(t["output_norm.weight"])) - 1) < 0.1


def test_block_pools_cover_the_fallback_types():
    """Every type the pools know dequantizes to finite values of the asked rms, centred on zero."""
    pools = make_model.BlockPools(seed=0, pool_bytes=1 << 16)
    for qtype in make_model._SCALE_FIELDS:
        x = gguf.quants.dequantize(pools.blocks(qtype, 0.01), qtype)
        rms = float(np.sqrt(np.mean(np.square(x, dtype=np.float64))))
        assert np.all(np.isfinite(x)) and 0.009 < rms < 0.011, (qtype.name, rms)
        assert abs(float(np.mean(x))) < 0.25 * rms, qtype.name


@pytest.mark.parametrize("preset", sorted(make_model.PRESETS))
def test_reduced_preset_loads_and_runs(tmp_path, preset, single_thread):
    from hybridrt.runtime.loader import load_model

    d, mix = _reduced(preset)
    model = load_model(make_model.write_preset_dims(tmp_path / "m.gguf", d, mix, seed=2))
    logits = model.session(16).eval([1, 2, 3]).numpy()
    assert logits.shape == (3, d.n_vocab) and np.all(np.isfinite(logits))
    assert 0.1 < float(logits.std()) < 100


def test_layers_keeps_the_pattern_and_the_mtp_block():
    d, mix = make_model.preset_dims("qwen3.6-27b-mtp", layers=4)
    assert d.block_count == 5 and d.n_embd == 5120 and d.n_ff == 17408
    names = {s.name for s in make_model.tensor_table(d)}
    assert [i for i in range(4) if f"blk.{i}.attn_qkv.weight" in names] == [0, 1, 2]
    assert [i for i in range(5) if f"blk.{i}.attn_q.weight" in names] == [3, 4]
    assert "blk.4.nextn.eh_proj.weight" in names and "blk.5.attn_norm.weight" not in names
    d, _ = make_model.preset_dims("qwen3.6-35b-a3b", layers=2)
    assert d.block_count == 3 and "blk.2.ffn_down_exps.weight" in {s.name for s in make_model.tensor_table(d)}
    for bad in (0, -1, 65):
        with pytest.raises(ValueError):
            make_model.preset_dims("qwen3.6-27b-mtp", layers=bad)


@pytest.mark.parametrize("argv, message", [
    (["--preset", "qwen3.6-27b-mtp", "--layers", "0"], "--layers 0"),
    (["--sparse"], "--sparse needs --preset"),
    (["--layers", "2", "--arch", "qwen35"], "--layers needs --preset"),
    (["--preset", "qwen3.6-27b-mtp", "--arch", "qwen35"], "not both"),
    (["--preset", "qwen3.6-27b-mtp", "--mix", "q8_0"], "a preset fixes them"),
    (["--preset", "nope"], "invalid choice"),
    (["--arch", "llama", "--dims", "bogus=1"], "unknown dim"),
    ([], "pass --preset"),
])
def test_cli_errors_are_one_line(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        make_model.main(argv + ["--out", str(tmp_path / "x.gguf")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err


@pytest.mark.slow
def test_cli_full_preset_one_layer(tmp_path, capsys):
    """The real 27B at --layers 1 (~2.2 GB): the sparse file's header and table, real data behind
    it with the target magnitudes in the embedding, the Q6_K head and the depth-scaled ffn_down."""
    full, sparse = tmp_path / "full.gguf", tmp_path / "sparse.gguf"
    make_model.main(["--preset", "qwen3.6-27b-mtp", "--layers", "1", "--seed", "3", "--out", str(full)])
    out, err = capsys.readouterr()
    assert out.strip() == str(full) and "GB/s" in err
    make_model.main(["--preset", "qwen3.6-27b-mtp", "--layers", "1", "--sparse", "--out", str(sparse)])
    d, mix = make_model.preset_dims("qwen3.6-27b-mtp", layers=1)
    _, data_size = _layout(d, mix)
    size = os.path.getsize(full)
    assert size == os.path.getsize(sparse) and 2.0e9 < size < 2.5e9
    start = size - data_size
    with open(full, "rb") as f, open(sparse, "rb") as g:
        assert f.read(start) == g.read(start)
    assert os.stat(full).st_blocks * 512 >= data_size
    assert _check_magnitudes(full, d, mix, rows=8, names={
        "token_embd.weight", "output.weight", "blk.0.ffn_down.weight", "blk.0.attn_qkv.weight",
        "blk.1.nextn.eh_proj.weight", "blk.1.attn_output.weight"}) == 6
