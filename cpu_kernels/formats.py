"""The table of GGUF tensor types hybridrt can read: block size and bytes per block.

Sizes come from gguf-py's own table so they can never drift from the files we read.
"""
from __future__ import annotations

from dataclasses import dataclass

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T


class UnsupportedQuantType(ValueError):
    """A tensor type that hybridrt has no kernels for (the message names it)."""


@dataclass(frozen=True)
class QuantFormat:
    qtype: int          # ggml type id (gguf.constants.GGMLQuantizationType value)
    name: str           # "Q4_K", "F16", ...
    block_elems: int    # weights per block
    block_bytes: int    # bytes per block

    def row_bytes(self, n_cols: int) -> int:
        if n_cols % self.block_elems:
            raise ValueError(f"{self.name}: row of {n_cols} is not a multiple of {self.block_elems}")
        return n_cols // self.block_elems * self.block_bytes


SUPPORTED_TYPES = (
    T.F32, T.F16, T.BF16,
    T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0,
    T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K,
    T.IQ4_NL, T.IQ4_XS,
)

FORMATS: dict[int, QuantFormat] = {
    int(t): QuantFormat(int(t), t.name, *GGML_QUANT_SIZES[t]) for t in SUPPORTED_TYPES
}


def type_name(qtype: int) -> str:
    try:
        return T(int(qtype)).name
    except ValueError:
        return f"type {int(qtype)}"


def format_of(qtype: int) -> QuantFormat:
    fmt = FORMATS.get(int(qtype))
    if fmt is None:
        supported = ", ".join(f.name for f in FORMATS.values())
        raise UnsupportedQuantType(f"unsupported tensor type {type_name(qtype)} (supported: {supported})")
    return fmt


def type_tag(qtype: int) -> tuple:
    """The quant type as a compile-time constant: a tuple of that many zeros, whose Numba type
    (UniTuple(int64, qtype)) differs per type. The kernels take it where a plain int would make
    one compilation build every type's decoders: with the tag a model compiles (and caches) only
    the types its files hold, and nothing is retyped at run time (numba.literally would retype
    every kernel from scratch in every process before finding the cached one)."""
    return (0,) * int(qtype)
