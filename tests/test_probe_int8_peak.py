"""scripts/probe_int8_peak.py: bad input is one error line and exit 2; where the kernels' integer
lowering (simd_int.ISA) has a vector form each chain count prints its rate (the avx2 step computes
real products: its loop IR checks out against numpy; each VNNI step compiles to its vpdpbusd),
on the portable lowering the missing instructions are the error."""
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
        assert "no int8 dot step to probe" in script_error(capsys, probe_int8_peak.main, ["--chains", "1"])
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


def test_the_portable_lowering_is_an_error(capsys, monkeypatch):
    """The probe measures the form the kernels run: on the portable lowering (HYBRIDRT_INT_ISA or a
    CPU without AVX2) there is none."""
    monkeypatch.setattr(probe_int8_peak.simd_int, "ISA", "portable")
    assert "no int8 dot step to probe" in script_error(capsys, probe_int8_peak.main, ["--chains", "1"])


@pytest.mark.parametrize("int16", [False, True])
@pytest.mark.parametrize("isa, cpu, register", [("avxvnni", "alderlake", "ymm"),
                                                ("avx512vnni", "sapphirerapids", "zmm")])
def test_each_vnni_step_is_one_instruction(isa, cpu, register, int16):
    """Compiled (not run) for a CPU with the instruction, a chain's step is one vpdpbusd (int16:
    vpdpwssd) on registers of the lowering's width: the probe counts its products a step."""
    llvm.initialize_all_targets()
    llvm.initialize_all_asmprinters()
    triple = "x86_64-unknown-linux-gnu"
    target = llvm.Target.from_triple(triple).create_target_machine(cpu=cpu, opt=2)
    asm = target.emit_assembly(llvm.parse_assembly(probe_int8_peak.loop_ir(2, isa, triple, int16)))
    dots = re.findall(rf"{'vpdpwssd' if int16 else 'vpdpbusd'}\s+%(\w)mm", asm)
    assert len(dots) == 2 and set(dots) == {register[0]}, asm
    products = probe_int8_peak.PRODUCTS_INT16 if int16 else probe_int8_peak.PRODUCTS
    assert products[isa] == {"ymm": 32, "zmm": 64}[register] // (2 if int16 else 1)


def test_the_avx2_int16_step_sums_its_products():
    """The int16 step's loop: chain c's step i adds (u_c[0] + i) s[0] + (u_c[1] + i) s[1] in lane 0."""
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    if not llvm.get_host_cpu_features().get("avx2"):
        pytest.skip("no AVX2 on this host")
    keep = []       # the engine must outlive the calls
    run = probe_int8_peak.compiled_loop(3, "avx2", keep, int16=True)
    s = np.array([(517 * j) % 4001 - 2000 for j in range(2)])
    us = [np.array([1 + (j + c) % 15 for j in range(2)]) for c in range(3)]
    assert run(7) == sum(int((u + i) @ s) for u in us for i in range(7))


def test_int16_rates(capsys):
    llvm.initialize_native_target()
    isa = probe_int8_peak.host_isa()
    if isa is None:
        pytest.skip("no vector lowering on this host")
    assert probe_int8_peak.main(["--chains", "2", "--ops", "30000", "--int16"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert f"{probe_int8_peak.PRODUCTS_INT16[isa]} int16 products a step" in lines[0]
    assert re.fullmatch(r"\s*2 chains:\s+[0-9.]+ G steps/s,\s+\d+ G int16 products/s", lines[1]), lines[1]
