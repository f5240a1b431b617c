"""Shared by the speculative-decoding tests: a same-vocabulary draft derived from a real model, and
the built-in bench prompts where prompt lookup does and does not pay."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from hybridrt.decoding.speculative.bench_prompts import ADVERSARIAL_PROMPT, ECHO_PROMPT  # noqa: F401


def write_truncated_draft(src: str | Path, dst: str | Path, n_layers: int) -> Path:
    """A draft model with the target's vocabulary: the same GGUF keeping only its first n_layers
    blocks (raw quantized bytes copied as they are), so it agrees with the target often but not
    always."""
    r = gguf.GGUFReader(str(src))
    arch = str(r.fields["general.architecture"].contents())
    w = gguf.GGUFWriter(str(dst), arch)
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = n_layers if key == f"{arch}.block_count" else field.contents()
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, value, vtype, sub)
    for t in r.tensors:
        if t.name.startswith("blk.") and int(t.name.split(".")[1]) >= n_layers:
            continue
        data = np.asarray(t.data)
        if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            w.add_tensor(t.name, data)
        else:
            w.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(dst)
