"""One thread per process runs the models: loading, every step of every loop, the benchmark's peers.

Why one: PyTorch's CPU parallelism is OpenMP, and OpenMP keeps a team of worker threads per
thread that starts parallel work. Two such threads in one process (a model loaded on the main
thread, then stepped on the step loop's thread) mean two teams on the same cores; libgomp
then stops its workers spinning between parallel regions (more busy threads than cores), and
every one of the thousands of small regions of a decode step waits for a sleeping worker to
wake. Measured on a 2-core AMD EPYC (AVX-512 BF16), the demo target's 1-row step: 36 ms when
one thread loads and steps it, 68 ms when the step loop's thread steps a model the main thread
loaded; a near-zero-compute model of its depth at 64 rows, 53 ms against 221 ms.

So every piece of model work goes through ``run``, which executes it on this module's thread
(inline when already there). The step loops of several engines in one process share it, a
step at a time: on one device their passes would queue for it anyway.

Threads: the compute thread starts with the count last set anywhere (``torch.set_num_threads``
before it starts); ``set_threads`` changes it later, there and on the calling thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from queue import SimpleQueue
from typing import TypeVar

import torch

T = TypeVar("T")

_lock = threading.Lock()
_thread: threading.Thread | None = None
_jobs: SimpleQueue = SimpleQueue()


def _serve() -> None:
    while True:
        future, fn, args, kwargs = _jobs.get()
        if not future.set_running_or_notify_cancel():
            continue
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # the caller re-raises it
            future.set_exception(exc)


def _ensure() -> None:
    global _thread
    with _lock:
        if _thread is None or not _thread.is_alive():
            _thread = threading.Thread(target=_serve, name="specdec-compute", daemon=True)
            _thread.start()


def on_compute_thread() -> bool:
    return threading.current_thread() is _thread


def run(fn: Callable[..., T], *args, **kwargs) -> T:
    """``fn(*args, **kwargs)`` on the compute thread; its result, or its exception raised here."""
    if on_compute_thread():
        return fn(*args, **kwargs)
    _ensure()
    future: Future = Future()
    _jobs.put((future, fn, args, kwargs))
    return future.result()


def set_threads(n: int) -> None:
    """Torch CPU threads for model work (the compute thread) and for the calling thread."""
    torch.set_num_threads(n)
    run(torch.set_num_threads, n)
