"""scripts/probe_int8_peak.py: bad input is one error line and exit 2; on a CPU with AVX-512 VNNI
each chain count prints its rate, elsewhere the missing instruction set is the error."""
from __future__ import annotations

import re

import llvmlite.binding as llvm

import probe_int8_peak  # scripts/ is on sys.path (conftest)
from tests.test_bench_mission import script_error


def test_bad_chains(capsys):
    assert "--chains takes positive integers" in script_error(capsys, probe_int8_peak.main, ["--chains", "0,4"])
    assert "--chains takes positive integers" in script_error(capsys, probe_int8_peak.main, ["--chains", "x"])


def test_rates_or_the_missing_instructions(capsys):
    llvm.initialize_native_target()
    if not llvm.get_host_cpu_features().get("avx512vnni"):
        assert "no AVX-512 VNNI" in script_error(capsys, probe_int8_peak.main, ["--chains", "1"])
        return
    assert probe_int8_peak.main(["--chains", "1,3", "--ops", "30000"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].endswith("one thread") and len(lines) == 3
    for line, chains in zip(lines[1:], (1, 3)):
        assert re.fullmatch(rf"\s*{chains} chains:\s+[0-9.]+ G vpdpbusd/s,\s+\d+ G int8 products/s", line), line
