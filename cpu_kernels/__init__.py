"""Numba CPU kernels: quant formats, k-input matvecs, the fused layer halves.

Two things happen on import. First, the on-disk cache of these kernels is keyed by the sources of the whole
package, not only the kernel's own file. Numba discards a cached kernel when its own source file
changes, but these kernels inline functions from each other (layer_fused inlines ffn's activation
and matvec_int's dot products, ffn and matvec_amx inline matvec_int's decoders): after a change to
ffn.py alone, the fused layer halves would keep running the old activation from the cache, and two
paths that must give the same bits would not. So every kernel here carries one stamp, a hash of all
the package's .py files: any change to any of them recompiles them all (Numba's default otherwise,
and for every other package).

Second, Numba's cache index is written under a file lock. Numba adds an entry by reading the
function's index, taking the first free data file number and writing both back; two processes that
compile two signatures of one kernel at once (the test suite's workers, a server beside a `run`)
could take the same number, and the index then named the other process's machine code for a
signature: a segmentation fault when it was loaded (seen on the fused attention half). Under the
lock each save reads the index as the last writer left it.
"""
from __future__ import annotations

import functools
import hashlib
from pathlib import Path

try:
    import fcntl
except ImportError:         # not on Windows: saves stay unlocked there
    fcntl = None

from numba.core import caching

_PACKAGE = Path(__file__).resolve().parent


@functools.lru_cache(maxsize=None)
def package_stamp() -> bytes:
    """sha256 over the package's .py sources in name order (Numba stamps one file the same way)."""
    digest = hashlib.sha256()
    for path in sorted(_PACKAGE.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.digest()


class _PackageStamp:
    """Locator mixin: the package stamp for kernels defined in this package, nothing for others
    (Numba's next locator class takes those)."""

    def get_source_stamp(self):
        return package_stamp()

    @classmethod
    def from_function(cls, py_func, py_file):
        if Path(py_file).resolve().parent != _PACKAGE:
            return None
        return super().from_function(py_func, py_file)


class PackageUserProvidedLocator(_PackageStamp, caching.UserProvidedCacheLocator):
    """NUMBA_CACHE_DIR, package-stamped."""


class PackageInTreeLocator(_PackageStamp, caching.InTreeCacheLocator):
    """__pycache__ beside the sources, package-stamped."""


if PackageInTreeLocator not in caching.CacheImpl._locator_classes:
    # Numba's own order (a user-provided NUMBA_CACHE_DIR first, then in-tree), ahead of its classes;
    # a read-only install falls through to Numba's user-wide locator (per-file stamps: a pip upgrade
    # replaces every file anyway)
    caching.CacheImpl._locator_classes[:0] = [PackageUserProvidedLocator, PackageInTreeLocator]


def _locked(save):
    @functools.wraps(save)
    def locked_save(self, key, data):
        with open(self._index_path + ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                return save(self, key, data)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
    locked_save.locked = True
    return locked_save


if fcntl is not None and not getattr(caching.IndexDataCacheFile.save, "locked", False):
    caching.IndexDataCacheFile.save = _locked(caching.IndexDataCacheFile.save)
