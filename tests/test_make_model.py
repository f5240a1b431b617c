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
