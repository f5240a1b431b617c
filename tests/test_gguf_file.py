"""The fast GGUF reader must agree with gguf-py's reader on every key and tensor."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType

from hybridrt.files.gguf_file import GGUFFile
from tests.real_models import GEMMA3, SMOLLM2, require


def _reference_value(field):
    types = field.types
    if types[0] == GGUFValueType.ARRAY:
        if types[-1] == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        return np.concatenate([field.parts[i] for i in field.data])
    if types[0] == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
    return field.parts[field.data[0]][0]


@pytest.mark.parametrize("path", [
    SMOLLM2,
    pytest.param(GEMMA3, marks=pytest.mark.slow),   # gguf-py takes ~20 s on its vocabulary
])
def test_agrees_with_gguf_reader(path):
    require(path)
    ours, ref = GGUFFile(path), GGUFReader(path)
    ref_fields = {k: v for k, v in ref.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.metadata) == list(ref_fields)
    for key, field in ref_fields.items():
        expected, got = _reference_value(field), ours.metadata[key]
        if isinstance(expected, np.ndarray):
            np.testing.assert_array_equal(np.asarray(got), expected, err_msg=key)
        elif isinstance(expected, np.generic):
            assert got == expected.item(), key
        else:
            assert got == expected, key
    assert list(ours.tensors) == [t.name for t in ref.tensors]
    for t in ref.tensors:
        info = ours.tensors[t.name]
        assert info.shape == tuple(int(x) for x in t.shape), t.name
        assert info.qtype == int(t.tensor_type), t.name
        assert info.nbytes == int(t.n_bytes), t.name
        assert info.offset == int(t.data_offset), t.name
        view = ours.tensor_bytes(t.name)
        assert view.shape[0] * view.shape[1] == t.n_bytes
        # spot-check the bytes themselves (first and last row)
        raw = np.asarray(t.data).view(np.uint8).reshape(-1)
        np.testing.assert_array_equal(view.reshape(-1)[:64], raw[:64])
        np.testing.assert_array_equal(view.reshape(-1)[-64:], raw[-64:])


def test_opens_fast_and_reads_vocabulary():
    require(GEMMA3)
    f = GGUFFile(GEMMA3)
    assert f.arch == "gemma3"
    assert len(f.metadata["tokenizer.ggml.tokens"]) == 262144
    assert f.get("embedding_length") == 640
    assert f.tensor_bytes("token_embd.weight").shape == (262144, 640 // 32 * 34)
