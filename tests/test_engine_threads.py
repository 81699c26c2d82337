"""Torch's parallel CPU work stays on the engine's thread (chatd/engine/threads.py): a thread that loads
the model leaves no OpenMP team behind, and a confined thread's tensor work starts none."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

import pytest
import torch

from chatd.engine.threads import confine_to_one_thread, run_in_passing_thread


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _parallel_work() -> None:
    source = torch.randn(4_000_000)
    target = torch.empty(4_000_000, dtype=torch.bfloat16)
    for _ in range(3):
        target.copy_(source)  # large enough for torch to split it over its threads


def _settled_thread_count() -> int:
    """The process's OS thread count once threads that are on their way out have gone (a KV pool still
    being populated by an earlier test's runner included)."""
    for thread in threading.enumerate():
        if thread.name == "chatd-populate":
            thread.join(120)
    count = _os_threads()
    for _ in range(100):
        time.sleep(0.01)
        now = _os_threads()
        if now == count:
            return now
        count = now
    return count


def _threads_while_alive(work: Callable[[], None]) -> int:
    """OS threads, besides itself, that a new thread which ran ``work`` holds while it is alive."""
    done, release = threading.Event(), threading.Event()

    def body() -> None:
        work()
        done.set()
        release.wait(30)

    baseline = _settled_thread_count()
    thread = threading.Thread(target=body)
    thread.start()
    assert done.wait(30)
    alive = _os_threads()
    release.set()
    thread.join()
    assert _settled_thread_count() == baseline  # its helpers end with it
    return alive - baseline - 1


def test_a_thread_that_ran_parallel_work_keeps_an_openmp_team_unless_confined(two_torch_threads: None) -> None:
    # Without confinement the thread holds a helper of its own for as long as it lives; that is what slows
    # the engine's regions down (chatd/engine/threads.py).
    assert _threads_while_alive(_parallel_work) >= 1

    def confined() -> None:
        confine_to_one_thread()
        _parallel_work()

    assert _threads_while_alive(confined) == 0


async def test_work_in_a_passing_thread_leaves_no_thread_behind(two_torch_threads: None) -> None:
    baseline = _settled_thread_count()
    seen: list[str] = []

    def load() -> int:
        seen.append(threading.current_thread().name)
        _parallel_work()
        return 42

    assert await run_in_passing_thread(load, "chatd-test-load") == 42
    assert seen == ["chatd-test-load"]
    assert _settled_thread_count() == baseline


async def test_an_error_in_a_passing_thread_reaches_the_caller() -> None:
    def fail() -> None:
        raise ValueError("no model here")

    with pytest.raises(ValueError, match="no model here"):
        await run_in_passing_thread(fail, "chatd-test-fail")
