"""The table of GGUF tensor types hybridrt runs: one row per type (`QUANT_TYPES`) with every
per-type fact a kernel reads, and the list of the kernels each row needs (`KERNEL_SLOTS`).

A row holds the block size and bytes (from gguf-py's own table, so they can never drift from the
files we read), the byte offsets of the block's float16 fields, the integer path (`IntKernel`:
step family and activation block, K sub-block, row lanes, AMX, the per-CPU row-group tunings) and
the device path (`DeviceKernel`). A type's functions are named after its row (`QuantType.kernel`,
the lowercase type name: `blocks.decode_q4_k`, `int_blocks._q4_k`, ...); each kernel module binds
its functions to the rows once at import (`KernelSlot.bind`), so a row whose kernel is missing fails
there, naming the type and the function, and nothing per token looks anything up. Types outside the
table fail in `format_of` with `UnsupportedQuantType`. Adding a type: docs/kernels.md, "Adding a
quant type". The module imports nothing but gguf-py (no torch, no kernels): gpu_kernels reads it too.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T


class UnsupportedQuantType(ValueError):
    """A tensor type that hybridrt has no kernels for (the message names it)."""


QK_K = 256          # a K-quant super-block; its activations are quantized in blocks of as many (Q8_K)
QK_LEGACY = 32      # a Q4_0 .. Q8_0 block; its activations are quantized in blocks of as many (Q8_0)
FAMILIES = ("k", "pair")


@dataclass(frozen=True)
class Amx:
    """matvec_amx's facts of a type with a tile kernel: what the integer decoder adds to every weight
    byte it makes (taken off again with the activation block sums) and whether blocks carry a min.
    The 16-weight sub-block K types (Q6_K, Q3_K, Q2_K) would need twice the tile products per weight
    and have none."""
    offset: int
    has_min: bool


@dataclass(frozen=True)
class IntKernel:
    """The type's integer path on int8 activations (int_blocks, matvec_int, matvec_tiled,
    matvec_rowlanes, matvec_amx). Its step decoder is `int_blocks._<kernel>`.

    family: "k", a step is one 256-weight super-block and activations are quantized in 256-value
    blocks; "pair", a step is two 32-weight blocks, activations in 32-value blocks.
    sub_block: K family: the weights sharing one scale (32 or 16).
    row_lanes_min_k: the fewest tokens from which its matrices run in row lanes on AVX-512 VNNI
    (matvec_rowlanes: measured on AMD Zen, at least NON_ZEN_MIN_K elsewhere); None: never.
    ymm_row_lanes_min_k: the same on the avx2 lowering (matvec_rowlanes.row_lanes_table: measured on
    AMD Zen 3); None: never.
    lane_decoder: row lanes decode its raw bytes in the lanes (`matvec_rowlanes._<kernel>_lanes`)
    instead of transposing the row decoder's output.
    amx: its AMX tile kernel's facts (matvec_amx), None: no tile kernel.
    single_row_max_k, two_phase_max_k: on AMD Zen, the most tokens for which short rows are read one
    at a time / in two-phase groups (matvec_int.SINGLE_ROW_MAX_K, TWO_PHASE_MAX_K: the measurements
    are there); 0: never.
    weight_max: the largest unsigned byte its row lanes multiply (a quant before its offset), which
    lets the avx2 lowering sum several vpmaddubsw outputs in int16 (matvec_rowlanes.i16_sum_dwords);
    None: not bounded there, each dword's sum goes to int32."""
    family: str
    sub_block: int = 0
    row_lanes_min_k: int | None = None
    ymm_row_lanes_min_k: int | None = None
    lane_decoder: bool = False
    amx: Amx | None = None
    single_row_max_k: int = 0
    two_phase_max_k: int = 0
    weight_max: int | None = None

    @property
    def act_block(self) -> int:
        """The activation block its kernels read (quantize_act.quantize_rows' `block`)."""
        return QK_K if self.family == "k" else QK_LEGACY


@dataclass(frozen=True)
class DeviceKernel:
    """The type on the trunk device (gpu_kernels). dtype: a float type's torch dtype (its rows are
    that tensor's bytes); a quantized type has none and is decoded by `gpu_kernels.quant._<kernel>`.
    triton: triton_matvec has a fused dequantize-and-dot for it (`triton_matvec._<kernel>`).
    rows_first: its fused kernel's pieces are [BLOCK_N, G, L] (matvec_table.ROWS_FIRST_TYPES)."""
    dtype: str | None = None
    triton: bool = False
    rows_first: bool = False


@dataclass(frozen=True)
class QuantType:
    qtype: int              # ggml type id (gguf.constants.GGMLQuantizationType value)
    name: str               # "Q4_K", "F16", ...
    block_elems: int        # weights per block
    block_bytes: int        # bytes per block
    f16_fields: tuple[int, ...]     # byte offsets of the block's float16 fields (scales, mins): test data
    integer: IntKernel | None       # None: matvec runs the float kernel only
    device: DeviceKernel

    @property
    def quantized(self) -> bool:
        """Blocks of scaled integers: every type but F32, F16 and BF16 (one value per "block")."""
        return self.block_elems > 1

    @property
    def kernel(self) -> str:
        """The name the type's functions carry in every kernel module (KERNEL_SLOTS)."""
        return self.name.lower()

    def row_bytes(self, n_cols: int) -> int:
        if n_cols % self.block_elems:
            raise ValueError(f"{self.name}: row of {n_cols} is not a multiple of {self.block_elems}")
        return n_cols // self.block_elems * self.block_bytes


def _row(t: T, f16_fields: tuple[int, ...], integer: IntKernel | None, device: DeviceKernel) -> QuantType:
    return QuantType(int(t), t.name, *GGML_QUANT_SIZES[t], f16_fields, integer, device)


_FUSED = DeviceKernel(triton=True)
_FUSED_ROWS_FIRST = DeviceKernel(triton=True, rows_first=True)

QUANT_TYPES: tuple[QuantType, ...] = (
    _row(T.F32, (), None, DeviceKernel("float32")),
    _row(T.F16, (), None, DeviceKernel("float16")),
    _row(T.BF16, (), None, DeviceKernel("bfloat16")),
    _row(T.Q4_0, (0,), IntKernel("pair", row_lanes_min_k=1, ymm_row_lanes_min_k=4, lane_decoder=True,
                                   amx=Amx(-8, False), weight_max=15), _FUSED),
    _row(T.Q4_1, (0, 2), IntKernel("pair", row_lanes_min_k=3, ymm_row_lanes_min_k=4, amx=Amx(0, True),
                                   weight_max=15), _FUSED_ROWS_FIRST),
    _row(T.Q5_0, (0,), IntKernel("pair", row_lanes_min_k=1, amx=Amx(-16, False)), _FUSED),
    _row(T.Q5_1, (0, 2), IntKernel("pair", row_lanes_min_k=3, amx=Amx(0, True)), _FUSED_ROWS_FIRST),
    _row(T.Q8_0, (0,), IntKernel("pair", row_lanes_min_k=1, amx=Amx(-128, False), single_row_max_k=1,
                                 two_phase_max_k=2), _FUSED),
    _row(T.Q2_K, (80, 82), IntKernel("k", 16, row_lanes_min_k=4, ymm_row_lanes_min_k=4), _FUSED),
    _row(T.Q3_K, (108,), IntKernel("k", 16, row_lanes_min_k=1, ymm_row_lanes_min_k=4), _FUSED),
    _row(T.Q4_K, (0, 2), IntKernel("k", 32, row_lanes_min_k=1, ymm_row_lanes_min_k=4, lane_decoder=True,
                                   amx=Amx(0, True), single_row_max_k=1, weight_max=15), _FUSED_ROWS_FIRST),
    _row(T.Q5_K, (0, 2), IntKernel("k", 32, row_lanes_min_k=1, ymm_row_lanes_min_k=4, lane_decoder=True,
                                   amx=Amx(0, True), single_row_max_k=1, weight_max=31), _FUSED_ROWS_FIRST),
    _row(T.Q6_K, (208,), IntKernel("k", 16, row_lanes_min_k=3, ymm_row_lanes_min_k=4, lane_decoder=True,
                                   single_row_max_k=2, weight_max=63), _FUSED),
    _row(T.IQ4_NL, (0,), IntKernel("pair", row_lanes_min_k=2, ymm_row_lanes_min_k=4, amx=Amx(-128, False)), _FUSED),
    _row(T.IQ4_XS, (0,), IntKernel("k", 32, row_lanes_min_k=1, ymm_row_lanes_min_k=4, amx=Amx(-128, False)),
         _FUSED_ROWS_FIRST),
)

FORMATS: dict[int, QuantType] = {t.qtype: t for t in QUANT_TYPES}
SUPPORTED_TYPES = tuple(FORMATS)


def type_name(qtype: int) -> str:
    try:
        return T(int(qtype)).name
    except ValueError:
        return f"type {int(qtype)}"


def format_of(qtype: int) -> QuantType:
    fmt = FORMATS.get(int(qtype))
    if fmt is None:
        supported = ", ".join(f.name for f in FORMATS.values())
        raise UnsupportedQuantType(f"unsupported tensor type {type_name(qtype)} (supported: {supported})")
    return fmt


def int_kernel_of(qtype: int) -> IntKernel:
    """The type's integer path; UnsupportedQuantType when it has none (the float kernel's types)."""
    fmt = format_of(qtype)
    if fmt.integer is None:
        raise UnsupportedQuantType(f"{fmt.name} has no integer kernel (matvec runs it on float activations)")
    return fmt.integer


def type_tag(qtype: int) -> tuple:
    """The quant type as a compile-time constant: a tuple of that many zeros, whose Numba type
    (UniTuple(int64, qtype)) differs per type. The kernels take it where a plain int would make
    one compilation build every type's decoders: with the tag a model compiles (and caches) only
    the types its files hold, and nothing is retyped at run time (numba.literally would retype
    every kernel from scratch in every process before finding the cached one)."""
    return (0,) * int(qtype)


# --------------------------------------------------------------------------- the kernels of a row

@dataclass(frozen=True)
class KernelSlot:
    """A per-type function that kernel modules define for the rows that `needs` it, named
    pattern.format(row.kernel): the module binds them to the table once, at import."""
    modules: tuple[str, ...]                # where the functions live
    pattern: str                            # their names, "{}" the row's kernel name
    needs: Callable[[QuantType], bool]      # which rows have one
    what: str                               # what it does, for the error message

    def bind(self, namespace: Mapping[str, object], rows: Iterable[QuantType] | None = None) -> dict[int, object]:
        """{qtype: its function in namespace} for the rows (default: QUANT_TYPES as it is now) that
        need one; a missing function raises UnsupportedQuantType naming the type and the function."""
        out = {}
        for row in QUANT_TYPES if rows is None else rows:
            if not self.needs(row):
                continue
            name = self.pattern.format(row.kernel)
            fn = namespace.get(name)
            if fn is None:
                raise UnsupportedQuantType(
                    f"{row.name}: {' / '.join(self.modules)} has no {name} ({self.what}); every formats.QUANT_TYPES "
                    "row needs its kernels (docs/kernels.md, 'Adding a quant type')")
            out[row.qtype] = fn
        return out


ROW_DECODER = KernelSlot(("cpu_kernels.blocks",), "decode_{}", lambda t: True,
                         "the block decoder: load-time dequantization, embedding rows")
CHUNK_DECODER = KernelSlot(("cpu_kernels.matvec_float", "cpu_kernels.matvec_legacy", "cpu_kernels.matvec_kquants"),
                           "decode_chunk_{}", lambda t: True, "the float matvec's chunk decoder")
ENCODER = KernelSlot(("cpu_kernels.quantize",), "encode_{}", lambda t: True, "the block quantizer")
INT_DECODER = KernelSlot(("cpu_kernels.int_blocks",), "_{}", lambda t: t.integer is not None,
                         "the integer step decoder (LLVM IR)")
LANE_DECODER = KernelSlot(("cpu_kernels.matvec_rowlanes",), "_{}_lanes",
                          lambda t: t.integer is not None and t.integer.lane_decoder, "the row lanes' decoder")
TORCH_DECODER = KernelSlot(("gpu_kernels.quant",), "_{}", lambda t: t.quantized, "the torch dequantizer")
TRITON_DECODER = KernelSlot(("gpu_kernels.triton_matvec",), "_{}", lambda t: t.device.triton,
                            "the fused Triton matvec's decoder")
KERNEL_SLOTS = (ROW_DECODER, CHUNK_DECODER, ENCODER, INT_DECODER, LANE_DECODER, TORCH_DECODER, TRITON_DECODER)
