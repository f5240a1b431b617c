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
