"""Background tasks that nobody awaits directly, kept referenced until they finish.

asyncio holds only weak references to tasks, so a fire-and-forget task can be garbage-collected
mid-flight; every owner of such tasks (the websocket connection, the session service, the KV
manager) keeps them in a :class:`TaskSet`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class TaskSet:
    """A set of running tasks. ``spawn`` starts one; it leaves the set when it finishes."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        task: asyncio.Task[T] = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def __len__(self) -> int:
        return len(self._tasks)

    def cancel(self) -> None:
        """Cancel every task still running (does not wait)."""
        for task in list(self._tasks):
            task.cancel()

    async def join(self) -> None:
        """Wait until every task that is running now has finished; their errors are not raised here."""
        for task in list(self._tasks):
            with contextlib.suppress(BaseException):
                await task
