"""The fused quantized matvec's launch parameters: one table by card, quant type, shape class and k.

`triton_matvec` takes every launch from here: rows per program, warps, software pipelining depth,
split-K, chunks decoded per loop step, tile order and how the tokens' dots are taken. A table maps
(quant type, shape class, k class) to a `MatvecParams`; a card takes the first measured table whose
name pattern matches its name (torch.cuda.get_device_name), failing that one measured on its compute
capability, failing that `DEFAULT`. Where a measured table has no rows for a (type, shape class) the
default's rows hold.

DEFAULT is the choice matvec_triton made before this table (the old `launch_config`), for every k:
nothing changes until a GPU measurement replaces it. Measured tables are JSON files written by
`scripts/bench_gpu_kernels.py --sweep --write-table` on a GPU and committed as
gpu_kernels/matvec_tables/<card>.json. None is committed yet: no card has been swept.

Bits: a token's output row must be bitwise the same alone or inside a k-token verify batch, so the
launches a table picks for the k classes of one (type, shape class) must give a row the same float
operations in the same order. BITS_FIELDS change that order in the kernel's program (the tile order
changes the reduction order, split-K the chunk sums' grouping, the dot mode the whole dot): a table's
rows agree on them across k, and loading one that does not is an error. The other fields leave a
row's operations in the program unchanged (the interpreter checks it, tests/test_matvec_table.py);
whether the compiler then reduces in the same tree is the GPU's to show, and the sweep writes only
rows whose outputs it found bitwise equal across the k classes (one "bits group").
"""
from __future__ import annotations

import dataclasses
import fnmatch
import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from cpu_kernels.formats import QUANT_TYPES, type_name

K_MAX = 16          # tokens per launch (triton_matvec.K_MAX; the accumulator is [BLOCK_N, K_MAX])
TABLE_DIR = Path(__file__).resolve().parent / "matvec_tables"

# the types with a fused kernel (formats.QUANT_TYPES rows with DeviceKernel.triton), by name
FUSED_TYPE_NAMES: dict[str, int] = {t.name: t.qtype for t in QUANT_TYPES if t.device.triton}

# Tile order, from the sm_90 PTX of each type (no layout conversion is left inside the token loop
# either way; what differs is the shuffles a token's reduction costs). Q4_K and Q5_K keep their
# quant bytes at 16-byte aligned offsets (144- and 176-byte blocks, quants at 16 and 48): the byte
# loads are 16-byte vectors and a [BLOCK_N, G, L] tile (rows first) gives each thread one row, 3
# shuffles a token. The types that load bytes singly or in pairs get 4 rows a thread from a
# rows-first tile (20 shuffles) but one row from a [G, BLOCK_N, L] tile (rows in the middle, 2
# shuffles). Q4_1, Q5_1 and IQ4_XS (4- and 8-byte aligned) are not clean either way; rows first
# needs fewer barriers per chunk.
ROWS_FIRST_TYPES = frozenset(t.qtype for t in QUANT_TYPES if t.device.rows_first)      # DeviceKernel.rows_first

# A matrix's shape class. TALL_ROWS is the old launch_config's threshold (16-row programs give a
# matrix of 8192+ rows 512+ programs, ~4 per SM on an H100's 132); LONG_COLS marks rows long enough
# that a few programs walking them serially underfill the card (Qwen3.6-27B's 5120 x 17408 ffn_down).
TALL_ROWS = 8192
LONG_COLS = 8192
SHAPE_CLASSES = ("tall", "long", "small")

# k classes: a decode step (1), short drafts (2-4), longer ones (5-8, 9-16)
K_CLASSES = ((1, 1), (2, 4), (5, 8), (9, 16))

DOT_MODES = ("loop", "ieee", "tf32x3")


def shape_class(n_out: int, n_in: int) -> str:
    """tall: 8192+ output rows; long: fewer rows of 8192+ weights; small: the rest."""
    if n_out >= TALL_ROWS:
        return "tall"
    return "long" if n_in >= LONG_COLS else "small"


def k_class(k: int) -> str:
    """The name of k's class: "1", "2-4", "5-8" or "9-16"."""
    for lo, hi in K_CLASSES:
        if lo <= k <= hi:
            return k_class_name(lo, hi)
    raise ValueError(f"k must be 1..{K_MAX}, got {k}")


def k_class_name(lo: int, hi: int) -> str:
    return str(lo) if lo == hi else f"{lo}-{hi}"


K_CLASS_NAMES = tuple(k_class_name(lo, hi) for lo, hi in K_CLASSES)


@dataclass(frozen=True)
class MatvecParams:
    """One launch of the fused matvec.

    block_n: output rows per program. num_warps: warps per program. num_stages: Triton's software
    pipelining depth (3 is Triton's CUDA default, what every launch got before this table).
    rows_mid: tiles [G, BLOCK_N, L] instead of [BLOCK_N, G, L] (triton_matvec.ROWS_FIRST_TYPES).
    split_k: programs per block of rows, each summing a contiguous run of the row's chunks; the last
    to finish adds the runs' sums in split order. unroll: chunks decoded per loop step before their
    dots (1 or 2: twice the loads in flight). dot: how a chunk meets the tokens: "loop", a loop over
    the k tokens with a multiply, an add and a tree reduction each (exact float32 products, what
    every launch did before this table); "ieee", one tl.dot of the [BLOCK_N, 128] weight pieces with
    the [128, 16] activations (float32 fused multiply-adds); "tf32x3", the same on tensor cores, each
    float32 split into three tf32 products (float32 accuracy, not its rounding). The dot modes need
    block_n >= 16 (tl.dot's smallest tile)."""
    block_n: int
    num_warps: int
    rows_mid: bool
    num_stages: int = 3
    split_k: int = 1
    unroll: int = 1
    dot: str = "loop"

    def __post_init__(self):
        def power_of_two(v, lo, hi):
            return isinstance(v, int) and lo <= v <= hi and v & (v - 1) == 0
        problems = []
        if not power_of_two(self.block_n, 1, 128):
            problems.append(f"block_n {self.block_n} is not a power of two in 1..128")
        if not power_of_two(self.num_warps, 1, 16):
            problems.append(f"num_warps {self.num_warps} is not a power of two in 1..16")
        if not isinstance(self.num_stages, int) or not 1 <= self.num_stages <= 8:
            problems.append(f"num_stages {self.num_stages} is not in 1..8")
        if not isinstance(self.split_k, int) or not 1 <= self.split_k <= 64:
            problems.append(f"split_k {self.split_k} is not in 1..64")
        if self.unroll not in (1, 2):
            problems.append(f"unroll {self.unroll} is not 1 or 2")
        if self.dot not in DOT_MODES:
            problems.append(f"dot {self.dot!r} is not one of {', '.join(DOT_MODES)}")
        elif self.dot != "loop" and self.block_n < 16:
            problems.append(f"dot {self.dot!r} needs block_n >= 16, got {self.block_n}")
        if not isinstance(self.rows_mid, bool):
            problems.append(f"rows_mid {self.rows_mid!r} is not a bool")
        if problems:
            raise ValueError("MatvecParams: " + "; ".join(problems))

    def label(self) -> str:
        """Short form for tables: 16x4 (rows x warps), m (rows in the middle), s2 (stages), k4
        (split), u2 (unroll), the dot mode when not the loop."""
        parts = [f"{self.block_n}x{self.num_warps}" + ("m" if self.rows_mid else "")]
        parts += [f"s{self.num_stages}"] if self.num_stages != 3 else []
        parts += [f"k{self.split_k}"] if self.split_k != 1 else []
        parts += [f"u{self.unroll}"] if self.unroll != 1 else []
        parts += [self.dot] if self.dot != "loop" else []
        return "-".join(parts)


# what orders a row's float operations in the kernel's program: the same for every k of a matrix
BITS_FIELDS = ("rows_mid", "split_k", "dot")


def bits_key(params: MatvecParams) -> tuple:
    return tuple(getattr(params, f) for f in BITS_FIELDS)


def default_params(qtype: int, shape: str) -> MatvecParams:
    """The launch matvec_triton used before the table, for every k."""
    # GEMV is memory bound: the GPU needs many programs in flight to cover DRAM latency (an H100 has
    # 132 SMs), and each program's chunk is BLOCK_N x 256 weights held in registers.
    if int(qtype) not in ROWS_FIRST_TYPES:
        # Rows in the middle: 16 rows and 2 warps (64 weights a thread; 1088 programs for a
        # 17408-row matrix, 320 for a 5120-row one), the shape whose PTX keeps one row a thread
        # without spills.
        return MatvecParams(16, 2, True)
    if shape == "tall":
        # Rows first: 16 rows and 4 warps keep a chunk at 32 weights a thread (no spills) and give a
        # 17408-row FFN matrix 1088 programs.
        return MatvecParams(16, 4, False)
    # A 5120-row matrix would get only 320 of those (2.4 per SM): narrower matrices take 8 rows and
    # 2 warps (640 programs, the same weights per thread).
    return MatvecParams(8, 2, False)


def check_plan(plan: Sequence[MatvecParams], what: str) -> None:
    """A plan (the launch for k = 1..K_MAX, index k - 1) must keep BITS_FIELDS the same for every k."""
    keys = {bits_key(p) for p in plan}
    if len(keys) > 1:
        raise ValueError(f"{what}: the launches for different k differ in {'/'.join(BITS_FIELDS)} "
                         f"({sorted(keys)}): a token's bits would depend on k")


@dataclass(frozen=True)
class MatvecTable:
    """Launches by (type name, shape class, k class name), measured on `card`. match: an fnmatch
    pattern on the device name that selects this table; capability: (major, minor), the fallback
    key for cards no table's pattern names. A (type, shape class) has a row for every k class or
    none (the default's rows hold), and its rows agree on BITS_FIELDS."""
    card: str
    rows: Mapping[tuple[str, str, str], MatvecParams]
    match: str | None = None
    capability: tuple[int, int] | None = None
    measured: Mapping = dataclasses.field(default_factory=dict)    # what the sweep recorded (not read here)

    def __post_init__(self):
        groups: dict[tuple[str, str], dict[str, MatvecParams]] = {}
        for (tname, shape, kname), params in self.rows.items():
            if tname not in FUSED_TYPE_NAMES:
                raise ValueError(f"matvec table {self.card}: {tname} has no fused kernel")
            if shape not in SHAPE_CLASSES:
                raise ValueError(f"matvec table {self.card}: shape class {shape!r} is not one of {SHAPE_CLASSES}")
            if kname not in K_CLASS_NAMES:
                raise ValueError(f"matvec table {self.card}: k class {kname!r} is not one of {K_CLASS_NAMES}")
            groups.setdefault((tname, shape), {})[kname] = params
        for (tname, shape), by_k in groups.items():
            missing = [k for k in K_CLASS_NAMES if k not in by_k]
            if missing:
                raise ValueError(f"matvec table {self.card}: {tname} {shape} has no row for k in {missing}")
            check_plan(list(by_k.values()), f"matvec table {self.card}: {tname} {shape}")

    def plan_for(self, qtype: int, shape: str) -> tuple[MatvecParams, ...]:
        """The launch for each k = 1..K_MAX (index k - 1) of a matrix of this type and shape class."""
        tname = type_name(qtype)
        if (tname, shape, K_CLASS_NAMES[0]) not in self.rows:
            return DEFAULT.plan_for(qtype, shape)          # DEFAULT has every row
        return tuple(self.rows[tname, shape, k_class(k)] for k in range(1, K_MAX + 1))

    def plan(self, qtype: int, n_out: int, n_in: int) -> tuple[MatvecParams, ...]:
        return self.plan_for(qtype, shape_class(n_out, n_in))

    def to_json(self) -> dict:
        rows = [{"type": t, "shape": s, "k": k, "launch": dataclasses.asdict(p),
                 **({"measured": self.measured[t, s, k]} if (t, s, k) in self.measured else {})}
                for (t, s, k), p in self.rows.items()]
        return {"card": self.card, "match": self.match,
                "capability": list(self.capability) if self.capability else None, "rows": rows}

    @classmethod
    def from_json(cls, obj: dict) -> MatvecTable:
        try:
            rows = {(r["type"], r["shape"], r["k"]): MatvecParams(**r["launch"]) for r in obj["rows"]}
            measured = {(r["type"], r["shape"], r["k"]): r["measured"] for r in obj["rows"] if "measured" in r}
            capability = tuple(obj["capability"]) if obj.get("capability") else None
            return cls(obj["card"], rows, obj.get("match"), capability, measured)
        except (KeyError, TypeError) as e:
            raise ValueError(f"matvec table: {e!r} (expected card, match, capability, rows of type, shape, k, "
                             f"launch)") from None

    def save(self, path: Path | str) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls, path: Path | str) -> MatvecTable:
        try:
            return cls.from_json(json.loads(Path(path).read_text()))
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None


DEFAULT = MatvecTable("default", {(tname, shape, k): default_params(qtype, shape)
                                  for tname, qtype in FUSED_TYPE_NAMES.items()
                                  for shape in SHAPE_CLASSES for k in K_CLASS_NAMES})


@functools.cache
def committed_tables() -> tuple[MatvecTable, ...]:
    """Every table in gpu_kernels/matvec_tables/, in file name order."""
    return tuple(MatvecTable.load(p) for p in sorted(TABLE_DIR.glob("*.json")))


def select_table(tables: Sequence[MatvecTable], card: str, capability: tuple[int, int] | None) -> MatvecTable:
    """The first table whose pattern matches the card's name, else the first measured on its
    compute capability, else DEFAULT."""
    for t in tables:
        if t.match and fnmatch.fnmatchcase(card, t.match):
            return t
    for t in tables:
        if capability is not None and t.capability == tuple(capability):
            return t
    return DEFAULT


def table_for_device(device) -> MatvecTable:
    """The table for a torch device: CUDA devices by name and capability, anything else DEFAULT."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return DEFAULT
    return _cuda_table(torch.cuda.current_device() if device.index is None else device.index)


@functools.cache
def _cuda_table(index: int) -> MatvecTable:
    # cached: every QuantLinear placed on the device asks
    import torch
    return select_table(committed_tables(), torch.cuda.get_device_name(index), torch.cuda.get_device_capability(index))
