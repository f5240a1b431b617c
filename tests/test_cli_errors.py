"""Bad input: one `error:` line on stderr, exit code 2, never a traceback."""
from __future__ import annotations

import struct
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter

from tests.real_models import SMOLLM2, require


def run_cli(*args):
    return subprocess.run([sys.executable, "-c", "from hybridrt.cli.commands import main; main()", *args],
                          capture_output=True, text=True)


def assert_one_line_error(result, *fragments):
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    assert "Traceback" not in result.stderr
    for frag in fragments:
        assert frag in lines[0], lines[0]


def write_gguf(path, arch="llama", qtype=GGMLQuantizationType.F32):
    w = GGUFWriter(str(path), arch)
    w.add_block_count(1)
    data = np.zeros((4, 32), dtype=np.float32)
    if qtype == GGMLQuantizationType.F32:
        w.add_tensor("token_embd.weight", data)
    else:
        from gguf.quants import quantize
        w.add_tensor("token_embd.weight", quantize(data, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_missing_path(tmp_path):
    assert_one_line_error(run_cli("info", str(tmp_path / "nope.gguf")), "no such file")


def test_directory(tmp_path):
    assert_one_line_error(run_cli("info", str(tmp_path)), "is a directory")


def test_bad_magic(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"NOPE" + bytes(100))
    assert_one_line_error(run_cli("info", str(p)), "bad magic")


def test_truncated_file(tmp_path):
    good = write_gguf(tmp_path / "good.gguf")
    data = good.read_bytes()
    for cut in (8, 30, len(data) // 2, len(data) - 8):
        p = tmp_path / f"cut{cut}.gguf"
        p.write_bytes(data[:cut])
        assert_one_line_error(run_cli("info", str(p)), "truncated")


def test_unsupported_version(tmp_path):
    data = bytearray(write_gguf(tmp_path / "good.gguf").read_bytes())
    data[4:8] = struct.pack("<I", 7)
    p = tmp_path / "v7.gguf"
    p.write_bytes(bytes(data))
    assert_one_line_error(run_cli("info", str(p)), "unsupported GGUF version 7")


def test_unknown_tensor_type(tmp_path):
    good = write_gguf(tmp_path / "good.gguf")
    data = bytearray(good.read_bytes())
    # the tensor record ends with: type (u32), offset (u64); the type of the only tensor is F32 = 0
    name = b"token_embd.weight"
    at = data.index(name) + len(name) + 4 + 2 * 8
    assert struct.unpack_from("<I", data, at)[0] == 0
    struct.pack_into("<I", data, at, 77)
    p = tmp_path / "type77.gguf"
    p.write_bytes(bytes(data))
    assert_one_line_error(run_cli("info", str(p)), "token_embd.weight", "unknown tensor type 77")


def test_zero_dimension(tmp_path):
    data = bytearray(write_gguf(tmp_path / "good.gguf").read_bytes())
    # the tensor record: name, n_dims (u32), dims (u64 each: 32, 4), type, offset; the row count -> 0
    name = b"token_embd.weight"
    at = data.index(name) + len(name) + 4 + 8
    assert struct.unpack_from("<Q", data, at)[0] == 4
    struct.pack_into("<Q", data, at, 0)
    p = tmp_path / "zero.gguf"
    p.write_bytes(bytes(data))
    for cmd in (("info", str(p)), ("run", "-m", str(p), "-p", "hi")):
        assert_one_line_error(run_cli(*cmd), "token_embd.weight", "0 dimension")


def test_unknown_architecture(tmp_path):
    p = write_gguf(tmp_path / "arch.gguf", arch="mamba9")
    assert_one_line_error(run_cli("info", str(p)), "unsupported architecture 'mamba9'", "llama")


def test_unknown_model_name():
    assert_one_line_error(run_cli("info", "-m", "gpt-17"), "unknown model 'gpt-17'")


def test_info_json_on_real_model():
    require(SMOLLM2)
    r = run_cli("info", str(SMOLLM2), "--json")
    assert r.returncode == 0, r.stderr
    import json
    info = json.loads(r.stdout)
    assert info["architecture"] == "llama" and info["layers"] == 30
    assert info["vocab_size"] == 49152 and info["tokenizer"] == "gpt2"
    assert info["bytes_per_type"]["Q4_1"] > 0


def _prompt_file(tmp_path, data: bytes) -> str:
    p = tmp_path / "prompt.txt"
    p.write_bytes(data)
    return str(p)


# (command and flags, "{tmp}" standing for a fresh directory; fragment of the one error line). Each
# was a traceback, a silent acceptance or a multi-line box before a review as a user (fc59ccf)
BAD_VALUES = [
    ("run -t -3", "-t -3"), ("run --temp nan", "--temp"), ("run --top-p 2", "--top-p"),
    ("run --min-p 1.5", "--min-p"), ("run --top-k -1", "--top-k"), ("run -c -1", "-c -1"),
    ("run --spec-type ngram-simple --spec-ngram-size-n 1", "--spec-ngram-size-n"),
    ("run --spec-draft-n-min 10 --spec-draft-n-max 3", "--spec-draft-n-min 10"),
    ("run --spec-draft-vocab -1", "--spec-draft-vocab must be >= 0"),
    ("bench --spec-type draft-mtp --spec-draft-vocab -1", "--spec-draft-vocab must be >= 0"),
    ("run --spec-type ngram-simple --spec-draft-vocab 64", "needs --spec-type draft-mtp"),
    ("run --spec-type draft-mtp --spec-draft-vocab 64", "no MTP (nextn) head"),
    ("run --trace {tmp}/no/such/t.json", "no such directory"), ("run --trace {tmp}", "is a directory"),
    ("run -n abc", "Invalid value for '-n'"), ("run --no-such-flag 3", "No such option"),
    ("bench -p 0", "-p 0"), ("bench -r 0", "-r 0"), ("serve --log-level bogus", "--log-level bogus"),
    ("serve --batch-tokens -1", "--batch-tokens >= 0"),
    ("plan -c 9999999", "training context"), ("plan --spec-draft-n-max 500", "--spec-draft-n-max"),
    ("run --spec-type ngram-simple,draft-mtp,draft-simple", "at most one"),
    ("plan --spec-type ngram-simple,bogus", "unknown --spec-type 'bogus'"),
]


@pytest.mark.parametrize("args,fragment", BAD_VALUES, ids=[f[1] for f in BAD_VALUES])
def test_bad_values_are_one_line_errors(tmp_path, args, fragment):
    require(SMOLLM2)
    command, *flags = args.format(tmp=tmp_path).split()
    prompt = [] if command in ("bench", "serve", "plan") else ["-p", "hi", "-n", "2"]
    assert_one_line_error(run_cli(command, "-m", str(SMOLLM2), *prompt, *flags), fragment)


def test_bad_prompt_files(tmp_path):
    require(SMOLLM2)
    m = ["run", "-m", str(SMOLLM2), "-n", "2"]
    assert_one_line_error(run_cli(*m, "-f", _prompt_file(tmp_path, b"caf\xe9 au lait")), "not UTF-8")   # latin-1
    assert_one_line_error(run_cli(*m, "-f", str(tmp_path)), "is a directory")
    assert_one_line_error(run_cli(*m, "-p", "hi", "-f", _prompt_file(tmp_path, b"hello")), "not both")


def test_serve_on_a_port_in_use_fails_before_loading():
    import socket

    require(SMOLLM2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        r = run_cli("serve", "-m", str(SMOLLM2), "--port", str(s.getsockname()[1]))
    assert_one_line_error(r, "cannot listen on 127.0.0.1:")
    assert "serving" not in r.stderr and "hybridrt serve:" not in r.stderr


def test_bare_command_prints_help():
    r = run_cli()
    assert r.returncode == 2 and "Usage" in r.stdout + r.stderr and "Traceback" not in r.stderr

