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


def test_two_saves_at_once_keep_each_signature_on_its_own_data(tmp_path, monkeypatch):
    """Two processes compiling two signatures of one kernel at once: each save reads the index, takes
    the first free data file and writes both back. Without the lock (cpu_kernels/__init__.py) both
    took the same file and the index named one signature's machine code for the other; here the
    window between reading and writing the index is widened so that the two saves overlap in it."""
    import threading
    import time

    from numba.core import caching

    assert getattr(caching.IndexDataCacheFile.save, "locked", False)
    load_index = caching.IndexDataCacheFile._load_index

    def slow_load_index(self):
        overloads = load_index(self)
        time.sleep(0.2)             # both saves read the index before either writes it
        return overloads

    monkeypatch.setattr(caching.IndexDataCacheFile, "_load_index", slow_load_index)
    files = [caching.IndexDataCacheFile(str(tmp_path), "kernel-1.py311", b"stamp") for _ in range(2)]
    threads = [threading.Thread(target=f.save, args=(f"signature {i}", f"code {i}")) for i, f in enumerate(files)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    reader = caching.IndexDataCacheFile(str(tmp_path), "kernel-1.py311", b"stamp")
    assert [reader.load(f"signature {i}") for i in range(2)] == ["code 0", "code 1"]


def _formats_shape_errors(kernel, *args, parallel=False) -> bool:
    """Whether a fresh, uncached copy of `kernel` compiled for args carries Numba's formatted
    shape-mismatch message (cached code cannot be inspected, hence the copy)."""
    fresh = njit(kernel.py_func, nogil=True, parallel=parallel)
    fresh(*args)
    return "raise_with_shape_context" in "".join(fresh.inspect_llvm().values())


def test_kernels_copy_rows_without_numbas_formatted_shape_errors():
    """Assigning an array to a slice or a row (`a[i] = b`) makes Numba compile a shape-mismatch
    message formatted with string joins: ~3-4 s of a cold start in every kernel that does it (top-k,
    the residual rows, the MoE half, the Gated DeltaNet conv history). The kernels copy with loops
    instead (layer_fused.copy_2d; docs/history.md, "What a cold start compiles", says where not)."""
    import numpy as np

    from cpu_kernels import quantize_act, top_k

    @njit
    def row_from_array(a, b):
        a[0] = b

    @njit
    def with_copy_2d(a, b):
        layer_fused.copy_2d(a[:1], b)

    a, b = np.zeros((2, 3), np.float32), np.ones((1, 3), np.float32)
    assert _formats_shape_errors(row_from_array, a, b[0])          # the check sees the pattern
    assert not _formats_shape_errors(with_copy_2d, a, b)
    x = np.linspace(-1, 1, 2 * 64, dtype=np.float32).reshape(2, 64)
    assert not _formats_shape_errors(quantize_act._with_residual_rows, x, 32, np.empty((4, 64), np.float32))
    bits = np.arange(64, dtype=np.uint32).reshape(2, 32)
    assert not _formats_shape_errors(top_k.top_k_bits, bits, 31, np.zeros((2, 4), np.int64), parallel=True)
