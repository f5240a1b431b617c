"""formats.QUANT_TYPES, the one table of quant types: every supported type has every entry and every
kernel its row asks for, and a type missing one (a test-only row) fails loudly where the kernels
are bound, naming the type and the function."""
from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T

from cpu_kernels import formats
from cpu_kernels.formats import (CHUNK_DECODER, ENCODER, FAMILIES, INT_DECODER, KERNEL_SLOTS, LANE_DECODER, QK_K,
                                 QK_LEGACY, QUANT_TYPES, ROW_DECODER, TORCH_DECODER, TRITON_DECODER, Amx, DeviceKernel,
                                 IntKernel, QuantType, UnsupportedQuantType)
from gpu_kernels.triton_support import have_triton

ROOT = Path(__file__).resolve().parents[1]

# where each slot's bound functions end up: (module, its qtype -> function table)
BOUND = {
    ROW_DECODER: ("cpu_kernels.blocks", "ROW_DECODERS"),
    CHUNK_DECODER: ("cpu_kernels.matvec", "CHUNK_DECODERS"),
    ENCODER: ("cpu_kernels.quantize", "ROW_ENCODERS"),
    INT_DECODER: ("cpu_kernels.int_blocks", "SPECS"),
    LANE_DECODER: ("cpu_kernels.matvec_rowlanes", "LANE_DECODERS"),
    TORCH_DECODER: ("gpu_kernels.quant", "_DECODERS"),
    TRITON_DECODER: ("gpu_kernels.triton_matvec", "_DECODERS"),
}

# A type the table does not have: a row with every entry set, no kernel written for it.
TEST_ONLY = QuantType(qtype=1000, name="Q7_TEST", block_elems=256, block_bytes=200, f16_fields=(0,),
                      integer=IntKernel("k", 32, row_lanes_min_k=1, lane_decoder=True, amx=Amx(0, True)),
                      device=DeviceKernel(triton=True))


def _skip_without_triton(slot):
    if slot is TRITON_DECODER and not have_triton():
        pytest.skip("triton is not installed: triton_matvec defines no decoders")


def _namespace(slot) -> dict:
    out = {}
    for module in slot.modules:
        out.update(vars(importlib.import_module(module)))
    return out


def test_every_slot_is_checked():
    assert set(BOUND) == set(KERNEL_SLOTS)


def test_rows_hold_gguf_sizes_and_consistent_entries():
    names = [t.name for t in QUANT_TYPES]
    assert len(set(names)) == len(names) and len({t.qtype for t in QUANT_TYPES}) == len(names)
    for t in QUANT_TYPES:
        assert T(t.qtype).name == t.name
        assert (t.block_elems, t.block_bytes) == GGML_QUANT_SIZES[T(t.qtype)]
        assert all(0 <= off <= t.block_bytes - 2 for off in t.f16_fields), t.name
        assert t.quantized == bool(t.f16_fields) == (t.device.dtype is None), t.name
        assert t.quantized or (t.integer is None and not t.device.triton), t.name
        i = t.integer
        if i is None:
            continue
        assert i.family in FAMILIES, t.name
        assert t.block_elems == (QK_K if i.family == "k" else QK_LEGACY) == i.act_block, t.name
        assert (i.sub_block in (16, 32)) if i.family == "k" else i.sub_block == 0, t.name
        # the AMX kernel takes 32-weight scale blocks only (the 16-weight K sub-blocks would need
        # twice the tile products per weight)
        assert i.amx is None or i.family == "pair" or i.sub_block == 32, t.name
        assert i.row_lanes_min_k is None or i.row_lanes_min_k >= 1, t.name


@pytest.mark.parametrize("slot", KERNEL_SLOTS, ids=lambda s: s.pattern + " " + s.modules[0])
def test_every_type_has_every_kernel(slot):
    """Each kernel module's table holds a function for exactly the rows that need one."""
    _skip_without_triton(slot)
    module, name = BOUND[slot]
    bound = getattr(importlib.import_module(module), name)
    assert set(bound) == {t.qtype for t in QUANT_TYPES if slot.needs(t)}


@pytest.mark.parametrize("slot", KERNEL_SLOTS, ids=lambda s: s.pattern + " " + s.modules[0])
def test_a_row_without_its_kernel_fails_loudly(slot):
    _skip_without_triton(slot)
    missing = slot.pattern.format("q7_test")
    with pytest.raises(UnsupportedQuantType, match=rf"^Q7_TEST: .* has no {re.escape(missing)} "):
        slot.bind(_namespace(slot), QUANT_TYPES + (TEST_ONLY,))


def test_kernel_modules_bind_the_table_at_import():
    """A row added to the table without its kernels stops the kernel modules' import, with the
    one message: the place the kernels are bound, before anything compiles or runs."""
    code = ("from cpu_kernels import formats\n"
            "from tests.test_quant_types import TEST_ONLY\n"
            "formats.QUANT_TYPES += (TEST_ONLY,)\n"
            "import cpu_kernels.blocks\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode != 0
    assert "UnsupportedQuantType: Q7_TEST: cpu_kernels.blocks has no decode_q7_test" in run.stderr


def test_types_outside_the_table_fail_loudly():
    from cpu_kernels.dequant import dequantize
    from cpu_kernels.matvec import matvec
    from cpu_kernels.matvec_int import act_block
    from cpu_kernels.quantize import quantize
    from gpu_kernels.quant import dequantize_torch

    w, x = np.zeros((4, 292), np.uint8), np.zeros((1, 256), np.float32)     # Q8_K: 292 bytes per 256
    for call in (lambda: matvec(w, T.Q8_K, x), lambda: dequantize(w, T.Q8_K, 256),
                 lambda: quantize(x, T.Q8_K), lambda: dequantize_torch(torch.from_numpy(w), T.Q8_K, 256),
                 lambda: formats.format_of(TEST_ONLY.qtype)):
        with pytest.raises(UnsupportedQuantType, match="unsupported tensor type (Q8_K|type 1000)"):
            call()
    with pytest.raises(UnsupportedQuantType, match="^F16 has no integer kernel"):
        act_block(T.F16)


def test_docs_checklist_names_every_kernel():
    """docs/kernels.md's "Adding a quant type" lists the row and every kernel a row may need."""
    text = (ROOT / "docs/kernels.md").read_text()
    section = text[text.index("## Adding a quant type"):]
    section = section[:section.find("\n## ", 3)]
    assert "QUANT_TYPES" in section
    for slot in KERNEL_SLOTS:
        assert slot.pattern.format("<kernel>") in section, slot.pattern
        assert all(m.split(".")[1] in section for m in slot.modules), slot.modules
