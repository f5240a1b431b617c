"""The CPU kernels' disk cache is keyed by the whole package's sources (cpu_kernels/__init__.py):
kernels inline functions from other modules of the package, so a change to any module must
recompile every kernel, not only those defined in the changed file."""
from __future__ import annotations

import hashlib
from pathlib import Path

from numba import njit

import cpu_kernels
from cpu_kernels import PackageInTreeLocator, PackageUserProvidedLocator, ffn, layer_fused, package_stamp


def test_kernels_carry_the_package_stamp():
    for kernel in (ffn._act_times_rows, layer_fused.ffn_block):
        locator = kernel._cache._impl.locator
        assert isinstance(locator, (PackageInTreeLocator, PackageUserProvidedLocator))
        assert locator.get_source_stamp() == package_stamp()
    # the stamp covers every module: it is the hash of all of them, ffn.py's bytes included
    digest = hashlib.sha256()
    for path in sorted(Path(cpu_kernels.__file__).parent.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    assert package_stamp() == digest.digest()


def test_other_code_keeps_numbas_own_stamp(tmp_path):
    @njit(cache=True)
    def elsewhere(x):
        return x + 1

    elsewhere(1)
    assert not isinstance(elsewhere._cache._impl.locator, (PackageInTreeLocator, PackageUserProvidedLocator))
