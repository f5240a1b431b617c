"""The architecture table (hybridrt/models/arch_spec.py): every architecture has one whole entry
that its model class points at and every reader reads; an architecture without one is refused by
each reader with one error line; and a test-only architecture runs, plans and takes an MTP head
from one table entry plus its model class (the checklist of docs/architecture.md)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import make_model
from hybridrt.errors import UserError
from hybridrt.files.gguf_file import GGUFFile
from hybridrt.files.model_info import read_model_info
from hybridrt.files.model_profile import load_profile
from hybridrt.models import ARCH_SPECS, ArchSpec, model_class
from hybridrt.models.llama import Llama
from hybridrt.models.mtp_head import head_target

pytestmark = pytest.mark.usefixtures("single_thread")

# a test-only architecture: qwen3 under another name, its entry and its model class (this module,
# under the name pytest imported it by, so the loader finds this very class)
TOY = dataclasses.replace(ARCH_SPECS["qwen3"], name="toyq3", model=f"{__name__}:ToyQwen3")


class ToyQwen3(Llama):
    spec = TOY


def relabelled(src: Path, dst: Path, arch: str) -> Path:
    """A copy of a tiny model file whose architecture is `arch` (its metadata keys and
    general.architecture renamed in place: same length, so every offset holds)."""
    old = GGUFFile(src).arch
    assert len(arch) == len(old)
    data = src.read_bytes()
    data = data.replace(f"{old}.".encode(), f"{arch}.".encode())
    data = data.replace(len(old).to_bytes(8, "little") + old.encode(), len(arch).to_bytes(8, "little") + arch.encode())
    dst.write_bytes(data)
    assert GGUFFile(dst).arch == arch
    return dst


@pytest.fixture(scope="module")
def toy_file(tmp_path_factory, tiny_qwen3):
    return relabelled(Path(tiny_qwen3), tmp_path_factory.mktemp("toy") / "toy.gguf", "toyq3")


def test_every_architecture_has_one_whole_entry_its_class_points_at():
    for name, spec in ARCH_SPECS.items():
        assert spec.name == name
        cls = model_class(name)
        assert cls.spec is spec, f"{cls.__name__}.spec is not ARCH_SPECS[{name!r}]"
        assert cls.__module__ + ":" + cls.__name__ == spec.model


def test_a_bad_entry_fails_when_the_table_is_built():
    with pytest.raises(ValueError, match="unknown activation"):
        ArchSpec("x", "m:C", act="relu")
    with pytest.raises(ValueError, match="needs its own period"):
        ArchSpec("x", "m:C", pattern="hybrid")
    with pytest.raises(ValueError, match="unknown layer pattern"):
        ArchSpec("x", "m:C", pattern="mamba")


@pytest.mark.parametrize("arch", make_model.ARCHS)
def test_every_reader_reads_every_architecture(tmp_path, arch):
    """The tiny files of every architecture in the table: the planner's profile and `info` take the
    layer kinds from the table's pattern, as the model builds them."""
    assert set(make_model.ARCHS) == set(ARCH_SPECS)     # test files for every entry
    path = make_model.write_model(tmp_path / f"{arch}.gguf", arch)
    spec, prof, info = ARCH_SPECS[arch], load_profile(path), read_model_info(GGUFFile(path))
    kinds = spec.mixer_kinds(prof.n_layer, GGUFFile(path).get)
    assert [layer.kind for layer in prof.layers] == kinds
    assert info.layer_kinds["attention"] == kinds.count("attention")
    assert ("sliding-window" in " ".join(prof.notes)) == (spec.pattern == "sliding_window")
    if spec.mtp_target:
        assert head_target(arch) is spec
    else:
        with pytest.raises(UserError, match=f"{arch} targets are not supported"):
            head_target(arch)


def test_an_architecture_missing_from_the_table_fails_loudly(toy_file):
    from hybridrt.runtime.loader import load_model

    supported = ", ".join(ARCH_SPECS)
    for read in (load_model, lambda p: read_model_info(GGUFFile(p))):
        with pytest.raises(UserError) as err:
            read(toy_file)
        assert f"unsupported architecture 'toyq3' (supported: {supported})" in str(err.value)
    with pytest.raises(UserError, match="cannot plan architecture 'toyq3' \\(supported: llama, "):
        load_profile(toy_file)
    with pytest.raises(UserError, match="toyq3 targets are not supported \\(one of: llama, "):
        head_target("toyq3")


def test_a_test_only_architecture_is_one_entry_and_its_model_class(monkeypatch, toy_file, tiny_qwen3):
    """With TOY in the table (and ToyQwen3 above), the relabelled file loads, decodes qwen3's greedy
    tokens, plans, and is a train-mtp target."""
    from hybridrt.decoding.generate import generate
    from hybridrt.runtime.loader import load_model
    from hybridrt.decoding.sampling import SamplerConfig

    monkeypatch.setitem(ARCH_SPECS, "toyq3", TOY)
    toy, qwen3 = load_model(toy_file), load_model(tiny_qwen3)
    assert type(toy) is ToyQwen3 and toy.arch == "toyq3"
    greedy, ids = SamplerConfig(temp=0.0), [5, 9, 11, 40, 7]
    runs = [generate(m, m.session(64), ids, 8, greedy, stop_ids=set())[0] for m in (toy, qwen3)]
    assert runs[0] == runs[1]
    assert load_profile(toy_file).n_layer == toy.n_layer
    assert head_target("toyq3") is TOY
