"""GGUF reader: mmap the file, parse metadata and the tensor table, hand out zero-copy views.

gguf-py's GGUFReader builds a numpy object per array element, which takes ~20 s on a 262k-token
vocabulary. Here every numeric array is one `np.frombuffer` view and string arrays are split in a
single pass, so opening is bounded by the header size, not by Python-object churn.
"""
from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32


class GGUFError(ValueError):
    """A file that is not a readable GGUF; the message is one line meant for the user."""


# scalar GGUF value types -> (struct format, numpy dtype)
_SCALARS = {
    GGUFValueType.UINT8: ("<B", np.uint8),
    GGUFValueType.INT8: ("<b", np.int8),
    GGUFValueType.UINT16: ("<H", np.uint16),
    GGUFValueType.INT16: ("<h", np.int16),
    GGUFValueType.UINT32: ("<I", np.uint32),
    GGUFValueType.INT32: ("<i", np.int32),
    GGUFValueType.FLOAT32: ("<f", np.float32),
    GGUFValueType.UINT64: ("<Q", np.uint64),
    GGUFValueType.INT64: ("<q", np.int64),
    GGUFValueType.FLOAT64: ("<d", np.float64),
    GGUFValueType.BOOL: ("<?", np.bool_),
}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]   # ggml order: shape[0] is the row length (input features)
    qtype: int               # GGMLQuantizationType value
    offset: int              # absolute byte offset in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        return GGMLQuantizationType(self.qtype).name

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def n_rows(self) -> int:
        return self.n_elements // self.shape[0]

    @property
    def row_bytes(self) -> int:
        return self.nbytes // self.n_rows


class _Cursor:
    """Sequential little-endian reads over the mapped header with EOF checks."""

    def __init__(self, buf: memoryview, path: str):
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, n: int) -> memoryview:
        end = self.pos + n
        if n < 0 or end > len(self.buf):
            raise GGUFError(f"{self.path}: truncated GGUF file (header runs past the end of the file)")
        view = self.buf[self.pos:end]
        self.pos = end
        return view

    def unpack(self, fmt: str):
        size = struct.calcsize(fmt)
        return struct.unpack(fmt, self.take(size))[0]

    def u32(self) -> int:
        return self.unpack("<I")

    def u64(self) -> int:
        return self.unpack("<Q")

    def string(self) -> str:
        return bytes(self.take(self.u64())).decode("utf-8", errors="replace")

    def string_array(self, count: int) -> list[str]:
        buf, pos, out = self.buf, self.pos, []
        end_of_file = len(buf)
        raw = buf.obj if isinstance(buf.obj, (bytes, bytearray, mmap.mmap)) else bytes(buf)
        for _ in range(count):
            if pos + 8 > end_of_file:
                raise GGUFError(f"{self.path}: truncated GGUF file (string array runs past the end)")
            n = int.from_bytes(raw[pos:pos + 8], "little")
            pos += 8
            if pos + n > end_of_file:
                raise GGUFError(f"{self.path}: truncated GGUF file (string array runs past the end)")
            out.append(raw[pos:pos + n].decode("utf-8", errors="replace"))
            pos += n
        self.pos = pos
        return out

    def value(self, vtype: int):
        try:
            vtype = GGUFValueType(vtype)
        except ValueError:
            raise GGUFError(f"{self.path}: corrupt GGUF metadata (unknown value type {vtype})") from None
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            etype, count = self.u32(), self.u64()
            if etype == GGUFValueType.STRING:
                return self.string_array(count)
            if etype == GGUFValueType.ARRAY:
                return [self.value(GGUFValueType.ARRAY) for _ in range(count)]
            if etype not in _SCALARS:
                raise GGUFError(f"{self.path}: corrupt GGUF metadata (unknown array type {etype})")
            dtype = np.dtype(_SCALARS[GGUFValueType(etype)][1])
            return np.frombuffer(self.take(count * dtype.itemsize), dtype=dtype.newbyteorder("<"))
        value = self.unpack(_SCALARS[vtype][0])
        return bool(value) if vtype == GGUFValueType.BOOL else value


class GGUFFile:
    """An opened GGUF file: `metadata`, `tensors` (name -> TensorInfo, file order), raw views."""

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        p = Path(path)
        if not p.exists():
            raise GGUFError(f"{self.path}: no such file")
        if p.is_dir():
            raise GGUFError(f"{self.path}: is a directory, not a GGUF file")
        size = p.stat().st_size
        with open(p, "rb") as fh:
            if size < 24:       # shorter than any header: a GGUF cut short, or not a GGUF at all
                what = "truncated GGUF file" if fh.read(4) == GGUF_MAGIC else "not a GGUF file"
                raise GGUFError(f"{self.path}: {what} (only {size} bytes)")
            self._mmap = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        self.file_size = size
        self._parse(memoryview(self._mmap))

    def _parse(self, buf: memoryview) -> None:
        cur = _Cursor(buf, self.path)
        if bytes(cur.take(4)) != GGUF_MAGIC:
            raise GGUFError(f"{self.path}: not a GGUF file (bad magic)")
        self.version = cur.u32()
        if self.version not in SUPPORTED_VERSIONS:
            raise GGUFError(f"{self.path}: unsupported GGUF version {self.version} "
                            f"(supported: {', '.join(map(str, SUPPORTED_VERSIONS))})")
        n_tensors, n_kv = cur.u64(), cur.u64()
        if n_tensors > len(buf) or n_kv > len(buf):
            raise GGUFError(f"{self.path}: corrupt GGUF header (counts larger than the file)")
        self.metadata: dict[str, object] = {}
        for _ in range(n_kv):
            key = cur.string()
            self.metadata[key] = cur.value(cur.u32())

        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.u32()
            if n_dims > 8:
                raise GGUFError(f"{self.path}: corrupt tensor table ({name}: {n_dims} dimensions)")
            shape = tuple(cur.u64() for _ in range(n_dims))
            qtype, rel_offset = cur.u32(), cur.u64()
            infos.append((name, shape, qtype, rel_offset))

        alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        if alignment <= 0 or alignment & (alignment - 1):
            raise GGUFError(f"{self.path}: corrupt GGUF header (alignment {alignment})")
        self.data_offset = (cur.pos + alignment - 1) // alignment * alignment

        self.tensors: dict[str, TensorInfo] = {}
        for name, shape, qtype, rel_offset in infos:
            try:
                gtype = GGMLQuantizationType(qtype)
                block_elems, block_bytes = GGML_QUANT_SIZES[gtype]
            except (ValueError, KeyError):
                raise GGUFError(f"{self.path}: tensor {name} has unknown tensor type {qtype}") from None
            if 0 in shape:      # ggml never writes one, and TensorInfo.n_rows / row_bytes divide by it
                raise GGUFError(f"{self.path}: corrupt tensor table ({name}: shape {list(shape)} has a 0 dimension)")
            n_elem = int(np.prod(shape, dtype=np.int64)) if shape else 1
            if shape and shape[0] % block_elems:
                raise GGUFError(f"{self.path}: tensor {name}: row of {shape[0]} is not a multiple of "
                                f"the {gtype.name} block size {block_elems}")
            nbytes = n_elem // block_elems * block_bytes
            offset = self.data_offset + rel_offset
            if offset + nbytes > self.file_size:
                raise GGUFError(f"{self.path}: truncated GGUF file (tensor {name} ends at byte "
                                f"{offset + nbytes}, file has {self.file_size})")
            self.tensors[name] = TensorInfo(name, shape, int(qtype), offset, nbytes)

    # ---- convenience -------------------------------------------------------------------------
    @property
    def arch(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def get(self, key: str, default=None):
        """Metadata value; a bare key is looked up under the architecture prefix first."""
        if key in self.metadata:
            return self.metadata[key]
        return self.metadata.get(f"{self.arch}.{key}", default)

    def tensor_bytes(self, name: str) -> np.ndarray:
        """Zero-copy uint8 view of a tensor's data as (rows, row_bytes)."""
        info = self.tensors[name]
        flat = np.frombuffer(self._mmap, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        return flat.reshape(info.n_rows, info.row_bytes)

    def tensor_f32(self, name: str) -> np.ndarray:
        """An F32 tensor as a float32 view in numpy order (reversed ggml shape)."""
        info = self.tensors[name]
        if info.qtype != GGMLQuantizationType.F32:
            raise GGUFError(f"{self.path}: tensor {name} is {info.type_name}, expected F32")
        flat = np.frombuffer(self._mmap, dtype=np.float32, count=info.n_elements, offset=info.offset)
        return flat.reshape(tuple(reversed(info.shape)))
