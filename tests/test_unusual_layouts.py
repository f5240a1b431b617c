"""Model files in layouts the other tests do not build: head dims of 80/96/128/256, no GQA and a
single KV head, an odd FFN width, untied heads, every weight type in the FFN and in attention,
per-layer head-count arrays, and metadata that disagrees with the tensor shapes (refused with one
clear error, not run out of bounds).

The forwards are checked against the float64 references of tests/reference, on the exact
(float32-activation) path, like test_models_tiny.py does for the default tiny dims.
"""
from __future__ import annotations

import gguf
import numpy as np
import pytest

import make_model
from hybridrt.errors import UserError
from hybridrt.runtime.loader import load_model
from reference import reference_for

MAX_REL = 1e-4


def rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref - ref.mean(-1, keepdims=True)))


LAYOUTS = {
    "llama-hd80-no-gqa-odd-ff": ("llama", dict(n_embd=160, n_head=2, n_head_kv=2, head_dim=80, n_rot=80,
                                               n_ff=97, tied=False)),
    "qwen3-hd96-no-gqa": ("qwen3", dict(n_embd=96, n_head=4, n_head_kv=4, head_dim=96, n_rot=96, n_layer=2)),
    "qwen3-hd128-one-kv-head-tied": ("qwen3", dict(n_embd=128, n_head=4, n_head_kv=1, head_dim=128,
                                                   n_rot=128, n_layer=2, tied=True)),
    "gemma3-hd256-3-local-layers": ("gemma3", dict(n_embd=128, n_head=2, n_head_kv=1, head_dim=256,
                                                   n_rot=256, n_layer=3, sliding_window=2)),
    "qwen35-hd256": ("qwen35", dict(head_dim=256, n_rot=64, n_head=2, n_head_kv=2, n_layer=4)),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_unusual_dims_match_the_reference(tmp_path, name):
    arch, dims = LAYOUTS[name]
    path = make_model.write_model(tmp_path / f"{name}.gguf", arch, dims=dims)
    model = load_model(path, exact_activations=True)
    tokens = [int(t) for t in np.random.default_rng(1).integers(0, model.n_vocab, 12)]
    ref = reference_for(path).forward(tokens)
    batch = model.session(32).eval(tokens).numpy()
    s = model.session(32)          # a prompt of 4, then decode steps of one token
    steps = np.concatenate([s.eval(tokens[:4]).numpy()] + [s.eval([t]).numpy() for t in tokens[4:]])
    assert rel_err(batch, ref) <= MAX_REL and rel_err(steps, ref) <= MAX_REL


def test_head_dims_that_disagree_with_the_matrices_are_refused(tmp_path):
    # a llama file without attention.key_length has heads of n_embd / n_head = 32, but these
    # matrices hold heads of 16: llama.cpp refuses the file; hybridrt ran it with its fused CPU
    # kernels reading attn_q out of bounds
    path = make_model.write_model(tmp_path / "m.gguf", "llama", dims=dict(n_embd=128, head_dim=16, n_rot=16))
    path = _rewrite(path, tmp_path / "bad.gguf", llama__attention__key_length=None,
                    llama__attention__value_length=None)
    with pytest.raises(UserError, match=r"blk\.0\.attn_q\.weight has shape \(128, 64\), expected \(128, 128\)"):
        load_model(path)


TYPES = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
         "IQ4_NL", "IQ4_XS"]


def _bf16(x: np.ndarray) -> np.ndarray:
    """float32 rows -> bf16 bytes, round to nearest even (make_model writes no BF16)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16).view(np.uint8).reshape(x.shape[0], -1)


@pytest.mark.parametrize("i", range(len(TYPES)))
def test_every_weight_type_in_the_ffn_and_in_attention(tmp_path, monkeypatch, i):
    """FFN matrices of type TYPES[i], attention matrices of another type, in one file."""
    qt = make_model.QT
    ffn_t, attn_t = qt[TYPES[i]], qt[TYPES[(i + 7) % len(TYPES)]]
    base_types, base_quantize = make_model.assign_types, make_model.quantize

    def types(specs, mix, d):
        return [ffn_t if ".ffn_" in s.name and len(s.ne) == 2 else
                attn_t if ".attn_" in s.name and len(s.ne) == 2 else t
                for s, t in zip(specs, base_types(specs, mix, d))]
    monkeypatch.setattr(make_model, "assign_types", types)
    monkeypatch.setattr(make_model, "quantize", lambda x, t: _bf16(x) if t == qt.BF16 else base_quantize(x, t))
    path = make_model.write_model(tmp_path / "m.gguf", "llama", dims=dict(n_embd=256, n_ff=512, n_layer=1,
                                                                           head_dim=64, n_rot=64, tied=False))
    model = load_model(path, exact_activations=True)
    tokens = [int(t) for t in np.random.default_rng(i).integers(0, model.n_vocab, 6)]
    assert rel_err(model.session(16).eval(tokens).numpy(), reference_for(path).forward(tokens)) <= MAX_REL


def _rewrite(src, dst, **keys):
    """A copy of src with metadata `keys` (dots written as "__") set: a list becomes an integer
    array, a str a string, a float a float32, None drops the key; through gguf-py's reader and writer."""
    keys = {k.replace("__", "."): v for k, v in keys.items()}
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(dst, r.fields["general.architecture"].contents())
    for name, f in r.fields.items():
        if not name.startswith("GGUF.") and name != "general.architecture" and name not in keys:
            w.add_key_value(name, f.contents(), f.types[0], sub_type=f.types[-1] if len(f.types) > 1 else None)
    for key, value in ((k, v) for k, v in keys.items() if v is not None):
        {list: w.add_array, str: w.add_string, float: w.add_float32}[type(value)](key, value)
    for t in r.tensors:         # the F32 file's tensors, in numpy order
        w.add_tensor(t.name, np.asarray(t.data).reshape(tuple(int(n) for n in reversed(t.shape))))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return dst


def test_per_layer_head_counts(tmp_path):
    """llama.cpp reads head_count_kv (and the other head keys) as one value or one per layer; an
    array of one value loads like the scalar (it raised a TypeError), differing ones are refused."""
    src = make_model.write_model(tmp_path / "m.gguf", "llama")
    same = load_model(_rewrite(src, tmp_path / "same.gguf", llama__attention__head_count_kv=[2, 2, 2, 2]),
                      exact_activations=True)
    assert same.n_kv == 2
    tokens = [5, 17, 42, 99]
    ref = load_model(src, exact_activations=True).session(16).eval(tokens).numpy()
    assert np.array_equal(same.session(16).eval(tokens).numpy(), ref)
    with pytest.raises(UserError, match="head_count_kv differs between layers"):
        load_model(_rewrite(src, tmp_path / "differ.gguf", llama__attention__head_count_kv=[2, 4, 2, 2]))


def test_rope_scaling_other_than_linear_is_refused(tmp_path):
    """llama.cpp applies YaRN's frequency ramp at every position: a yarn file run unscaled would give
    other logits without a word. Refused when its factor would act; linear scales, factor 1 is none."""
    src = make_model.write_model(tmp_path / "m.gguf", "llama")
    with pytest.raises(UserError, match="rope scaling 'yarn' \\(factor 4\\) is not supported"):
        load_model(_rewrite(src, tmp_path / "yarn.gguf", llama__rope__scaling__type="yarn",
                            llama__rope__scaling__factor=4.0))
    tokens = [5, 17, 42, 99]
    plain = load_model(src, exact_activations=True).session(16).eval(tokens).numpy()
    unit = load_model(_rewrite(src, tmp_path / "yarn1.gguf", llama__rope__scaling__type="yarn",
                               llama__rope__scaling__factor=1.0), exact_activations=True)
    assert np.array_equal(unit.session(16).eval(tokens).numpy(), plain)
    linear = load_model(_rewrite(src, tmp_path / "lin.gguf", llama__rope__scaling__type="linear",
                                 llama__rope__scaling__factor=4.0), exact_activations=True)
    assert not np.allclose(linear.session(16).eval(tokens).numpy(), plain, atol=1e-3)


def test_gemma3_without_its_sliding_window_is_refused(tmp_path):
    """llama.cpp requires gemma3.attention.sliding_window; without it hybridrt ran every layer as a
    global one (at the global rope base), other logits than the model's."""
    src = make_model.write_model(tmp_path / "g.gguf", "gemma3")
    with pytest.raises(UserError, match="sliding_window is missing"):
        load_model(_rewrite(src, tmp_path / "nowindow.gguf", gemma3__attention__sliding_window=None))
