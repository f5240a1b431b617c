"""runtime/kernel_threads.py: work on a thread of its own, and the kernel pool that leaves with it."""
import os
import subprocess
import sys
import threading

import pytest

from hybridrt.runtime.kernel_threads import on_own_thread


def test_on_own_thread_returns_raises_and_runs_elsewhere():
    seen = []

    def fn(a, b=0):
        seen.append(threading.current_thread())
        return a + b

    assert on_own_thread(fn, 2, b=3) == 5
    assert seen[0] is not threading.current_thread() and not seen[0].is_alive()
    with pytest.raises(KeyError, match="gone"):
        on_own_thread(lambda: {}["gone"])


# A launching thread's libgomp pool outlives the launch and ends with the thread: the process's
# thread count shows it (a pool of 2 threads is one worker beside the launching thread).
POOLS = r"""
import os, time, numba
import numpy as np
numba.config.THREADING_LAYER = "omp"
from hybridrt.runtime.kernel_threads import on_own_thread

@numba.njit(parallel=True)
def total(x):
    s = 0.0
    for i in numba.prange(x.shape[0]):
        s += x[i]
    return s

def launch():
    numba.set_num_threads(2)
    return total(np.ones(4096))

tasks = lambda: len(os.listdir("/proc/self/task"))
on_own_thread(launch)       # the first launch starts the layer, and a thread of its own that stays
time.sleep(0.5)
before = tasks()
assert on_own_thread(launch) == 4096.0
for _ in range(100):        # the pool's workers leave as they wake to their master's end
    if tasks() == before:
        break
    time.sleep(0.02)
own = tasks()
launch()
print(before, own, tasks())
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs /proc")
def test_own_thread_takes_its_kernel_pool_along():
    try:
        import numba.np.ufunc.omppool  # noqa: F401
    except (ImportError, OSError):
        pytest.skip("Numba's OpenMP layer is not available")
    env = dict(os.environ, NUMBA_NUM_THREADS="2")
    out = subprocess.run([sys.executable, "-c", POOLS], env=env, capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr
    before, own, main = map(int, out.stdout.split())
    assert own == before        # the own thread's pool is gone with it
    assert main > before        # the main thread's stays (what the own thread avoids)


def test_serve_compiles_a_cold_cache_on_a_thread_that_leaves(tiny_llama, monkeypatch):
    """`serve` on a cold kernel cache compiles (warmup.announce_and_compile, which runs the kernels)
    on a thread that has exited before the sessions' steps start, so no kernel pool stays on the
    main thread beside the steps' (the module's docstring: a second pool cost one process 150 -> 58
    t/s)."""
    from hybridrt.runtime import compile_helper, warmup
    from tests.test_serve_plan import serve

    compiled_on = []
    monkeypatch.setattr(warmup, "kernels_cold", lambda: True)
    monkeypatch.setattr(compile_helper, "start", lambda *args, **kwargs: None)
    monkeypatch.setattr(warmup, "compile_kernels", lambda model: compiled_on.append(threading.current_thread()))
    status = serve(monkeypatch, ["-m", str(tiny_llama), "-c", "64", "--parallel", "2"],
                   lambda client: client.get("/health").status_code)
    assert status == 200 and len(compiled_on) == 1
    assert compiled_on[0] is not threading.main_thread() and not compiled_on[0].is_alive()
