"""hybridrt/runtime/config.py: the environment's switches read as documented, a flag or API argument
over the environment, the execution mode from the device and the plan, one frozen config a load
resolves (model.binder.config)."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from hybridrt.runtime.config import ENV, ENV_VARIABLES, Mode, RuntimeConfig, Switches, execution_mode, read_env, \
    resolve_config


def test_unset_variables_keep_the_defaults():
    assert read_env({}) == Switches()
    assert Switches() == Switches(exact=False, act_residual=True, fused_layers=True, cuda_graphs=True, int_isa="",
                                  amx=True, direct_launch=True)


@pytest.mark.parametrize("value,on", [("1", True), ("0", False), ("", False), ("yes", True)])
@pytest.mark.parametrize("field", ["exact", "act_residual", "fused_layers", "amx"])
def test_flag_variables_read_as_before(field, value, on):
    """Off for "" and "0", on for anything else (each variable's reading before the config)."""
    assert getattr(read_env({ENV_VARIABLES[field][0]: value}), field) is on


@pytest.mark.parametrize("value,on", [("1", True), ("0", False), (" 0 ", False), ("", True)])
def test_direct_launch_is_off_only_for_0(value, on):
    assert read_env({"HYBRIDRT_DIRECT_LAUNCH": value}).direct_launch is on


@pytest.mark.parametrize("value,on", [("1", True), ("0", False), ("", True)])
def test_cuda_graphs_are_off_only_for_0(value, on):
    assert read_env({"HYBRIDRT_CUDA_GRAPHS": value}).cuda_graphs is on


@pytest.mark.parametrize("device,planned,switch,tracing,graphs", [
    ("cuda", True, None, False, "cuda"), ("cuda", True, False, False, None), ("cuda", True, None, True, None),
    ("cuda", False, None, False, None), ("cpu", True, None, False, None),
])
def test_step_graphs_only_for_an_untraced_plan_on_cuda(device, planned, switch, tracing, graphs):
    c = resolve_config(device, planned, cuda_graphs=switch, environ={})
    assert c.step_graphs(tracing) == graphs
    assert resolve_config("cuda", True, environ={"HYBRIDRT_CUDA_GRAPHS": "0"}).step_graphs(False) is None


def test_int_isa_is_the_name_given():
    assert read_env({"HYBRIDRT_INT_ISA": "avx2"}).int_isa == "avx2"


def test_a_flag_or_argument_beats_the_environment():
    env = {"HYBRIDRT_EXACT_ACTIVATIONS": "1", "HYBRIDRT_ACT_RESIDUAL": "0", "HYBRIDRT_FUSED_LAYERS": "0"}
    from_env = resolve_config("cpu", False, environ=env)
    assert (from_env.exact, from_env.act_residual, from_env.fused_layers) == (True, False, False)
    assert from_env.mode is Mode.CPU_TORCH
    given = resolve_config("cpu", False, exact=False, act_residual=True, fused_layers=True, environ=env)
    assert (given.exact, given.act_residual, given.fused_layers) == (False, True, True)
    assert given.mode is Mode.CPU_FUSED


def test_process_wide_switches_are_the_kernels_reading():
    """The integer lowering, AMX and the direct launch are compiled in at import: a load reports
    ENV's reading whatever the environment says later."""
    c = resolve_config("cpu", False, environ={"HYBRIDRT_AMX": "0", "HYBRIDRT_INT_ISA": "portable",
                                              "HYBRIDRT_DIRECT_LAUNCH": "0"})
    assert (c.amx, c.int_isa, c.direct_launch) == (ENV.amx, ENV.int_isa, ENV.direct_launch)


@pytest.mark.parametrize("device,planned,fused,mode", [
    ("cpu", False, True, Mode.CPU_FUSED), ("cpu", False, False, Mode.CPU_TORCH),
    ("cuda", False, True, Mode.DEVICE_TRUNK), ("cpu", True, True, Mode.PLAN_ON_CPU),
    ("cpu", True, False, Mode.PLAN_ON_CPU), ("cuda", True, True, Mode.PLAN_ON_CUDA),
])
def test_execution_modes(device, planned, fused, mode):
    assert execution_mode(device, planned, fused) is mode
    assert mode.planned == planned and mode.trunk_on_cpu == (device == "cpu") and mode.fused == (mode is Mode.CPU_FUSED)


def test_an_unknown_device_has_no_mode():
    with pytest.raises(ValueError, match="'mps'"):
        execution_mode("mps", False, True)


def test_the_config_is_frozen():
    c = resolve_config("cpu", False, environ={})
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.exact = True
    with pytest.raises(TypeError):
        RuntimeConfig(exact=True)       # no mode: a config always has one


def test_a_head_binds_without_the_plan():
    """A trained MTP head's binder: the target's trunk and numerics, no executor."""
    assert resolve_config("cpu", True, environ={}).without_plan().mode is Mode.CPU_FUSED
    assert resolve_config("cpu", True, fused_layers=False, environ={}).without_plan().mode is Mode.CPU_TORCH
    assert resolve_config("cuda", True, exact=True, environ={}).without_plan() == \
        resolve_config("cuda", False, exact=True, environ={})


def test_importing_it_loads_no_torch():
    r = subprocess.run([sys.executable, "-c", "import sys, hybridrt.runtime.config; print('torch' in sys.modules)"],
                       capture_output=True, text=True, env=dict(os.environ))
    assert r.stdout.strip() == "False", r.stderr


def test_load_model_resolves_it_once(tiny_llama, monkeypatch):
    """The environment as the load finds it, an argument over it; the binder and what it bound
    hold that one config."""
    from hybridrt.runtime.loader import load_model

    monkeypatch.setenv("HYBRIDRT_ACT_RESIDUAL", "0")
    monkeypatch.setenv("HYBRIDRT_FUSED_LAYERS", "0")
    m = load_model(tiny_llama)
    assert not m.binder.config.act_residual and m.binder.config.mode is Mode.CPU_TORCH
    assert not m.binder.linear("blk.0.attn_output.weight").residual
    m = load_model(tiny_llama, act_residual=True, exact_activations=True, fused_layers=True)
    c = m.binder.config
    assert c.act_residual and c.exact and c.mode is Mode.CPU_FUSED
    assert m.binder.linear("blk.0.attn_output.weight").residual and m.output.exact
