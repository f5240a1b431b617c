"""scripts/probe_int8_peak.py: bad input is one error line and exit 2; on a CPU with AVX-512 VNNI or
AVX2 each chain count prints its rate (the avx2 step computes real products: its loop IR checks
out against numpy), elsewhere the missing instruction set is the error."""
from __future__ import annotations

import re

import llvmlite.binding as llvm
import numpy as np
import pytest

import probe_int8_peak  # scripts/ is on sys.path (conftest)
from tests.test_bench_mission import script_error


def test_bad_chains(capsys):
    assert "--chains takes positive integers" in script_error(capsys, probe_int8_peak.main, ["--chains", "0,4"])
    assert "--chains takes positive integers" in script_error(capsys, probe_int8_peak.main, ["--chains", "x"])


def test_rates_or_the_missing_instructions(capsys):
    llvm.initialize_native_target()
    isa = probe_int8_peak.host_isa()
    if isa is None:
        assert "neither AVX-512 VNNI nor AVX2" in script_error(capsys, probe_int8_peak.main, ["--chains", "1"])
        return
    assert probe_int8_peak.main(["--chains", "1,3", "--ops", "30000"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert f"one thread, {isa}" in lines[0] and len(lines) == 3
    for line, chains in zip(lines[1:], (1, 3)):
        assert re.fullmatch(rf"\s*{chains} chains:\s+[0-9.]+ G steps/s,\s+\d+ G int8 products/s", line), line


def test_the_avx2_step_sums_its_products():
    """run(n) returns lane 0 of the chains' sum: chain c's step i adds (u_c[0] + i) s[0] + ... +
    (u_c[3] + i) s[3], u_c its own, so the loop does the products it counts (none hoisted out of
    it or shared between chains)."""
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    if not llvm.get_host_cpu_features().get("avx2"):
        pytest.skip("no AVX2 on this host")
    keep = []
    run = probe_int8_peak.compiled_loop(3, "avx2", keep)
    s = np.array([(5 * j) % 31 - 15 for j in range(4)])
    us = [np.array([1 + (j + c) % 15 for j in range(4)]) for c in range(3)]
    assert run(7) == sum(int((u + i) @ s) for u in us for i in range(7))
