"""Which threads launch the parallel CPU kernels, for a process that launches from several.

Numba's OpenMP layer (libgomp) keeps a pool of worker threads per *launching* thread, alive until
that thread exits. libgomp spins its idle workers for a while before they sleep, but only while it
manages no more threads than there are cores; beyond that it barely spins, and every parallel region
pays a sleeping team's wake-up. A second pool is enough: in one process on 2 cores, 64 SmolLM2 tokens
at 2 threads decode at ~150 t/s on the first launching thread and at ~58 t/s on a second one after
the first had launched (the server's warm-up on the main thread, its steps on a worker); on a second
thread alone, ~145 t/s (BENCHMARKS.md, "Serving: concurrent streams").

So a process that decodes on a worker thread does its other parallel work (a warm-up) on a thread
that exits when done, taking its pool with it: `on_own_thread`.
"""
from __future__ import annotations

import threading
from typing import Callable, TypeVar

T = TypeVar("T")


def on_own_thread(fn: Callable[..., T], *args, name: str = "hybridrt-kernels", **kwargs) -> T:
    """fn(*args, **kwargs) on a new thread, waited for; its result returned, its exception raised
    here. The thread's kernel pool ends with it, so the threads that decode afterwards are the only
    ones with a pool."""
    box: dict[str, object] = {}

    def body() -> None:
        try:
            box["result"] = fn(*args, **kwargs)
        except BaseException as e:      # noqa: BLE001 - handed to the caller, whatever it is
            box["error"] = e

    thread = threading.Thread(target=body, name=name)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["result"]
