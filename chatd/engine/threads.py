"""Which threads run torch's parallel CPU work: the engine worker's, and no other for long.

torch's CPU kernels parallelise through OpenMP (GNU libgomp in the CPU wheels). libgomp keeps a team of
helper threads for every thread that has started a parallel region, for as long as that thread lives.
Once the process holds more of these threads than the machine has cores, libgomp stops letting idle
helpers spin between regions and parks them in the kernel, so each of the hundreds of small parallel
regions of a decode step waits for a wake-up: a decode step then takes nearly twice as long once the model
was loaded on another thread that stayed alive (asyncio's executor), or once another thread made one large
tensor copy.

So the model is loaded in a thread that ends right after (:func:`run_in_passing_thread`; its team goes
with it), the warm-up runs on the engine thread, and chatd's other threads that touch tensors (snapshot
encoding and decoding) call :func:`confine_to_one_thread` first: their regions then run on themselves
alone and create no team.
"""

from __future__ import annotations

import asyncio
import ctypes
import threading
from collections.abc import Callable
from functools import cache
from typing import TypeVar

import torch

T = TypeVar("T")


@cache
def _libgomp() -> ctypes.CDLL | None:
    # The soname torch's own libraries were linked against: dlopen hands back the copy already loaded.
    try:
        lib = ctypes.CDLL("libgomp.so.1")
        lib.omp_set_num_threads.argtypes = [ctypes.c_int]
        lib.omp_set_num_threads.restype = None
        lib.omp_get_max_threads.restype = ctypes.c_int
        return lib
    except (OSError, AttributeError):
        return None  # another OpenMP runtime, or none: nothing to confine


def confine_to_one_thread() -> None:
    """Run the OpenMP parallel regions the calling thread starts on that thread alone (it affects this
    thread only; torch.set_num_threads, which the engine uses, sets the whole process)."""
    lib = _libgomp()
    if lib is not None:
        # torch sets a thread's OpenMP thread count to its global one the first time that thread enters
        # its parallel-loop helper; let that happen first (a copy too small to start a region does it),
        # then override the count for this thread.
        torch.empty(64, dtype=torch.bfloat16).copy_(torch.ones(64))
        lib.omp_set_num_threads(1)


async def run_in_passing_thread(fn: Callable[[], T], name: str) -> T:
    """``fn()`` in a new thread that ends when it returns (so do any OpenMP threads it started)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)  # type: ignore[arg-type]

    def work() -> None:
        try:
            result = fn()
        except BaseException as exc:
            loop.call_soon_threadsafe(settle, None, exc)
        else:
            loop.call_soon_threadsafe(settle, result, None)

    thread = threading.Thread(target=work, name=name, daemon=True)
    thread.start()
    result = await future
    thread.join()  # it is already returning (a moment): its OpenMP team is released on the way out
    return result
