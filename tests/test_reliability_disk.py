"""Reliability suite: a full disk under the snapshot folder and under the database.

The data folder (database and snapshots) lives on a small tmpfs when this machine lets the test mount one
(root in a container that allows it); otherwise the same scenarios run with ``ENOSPC`` / SQLITE_FULL
injected into the snapshot store and the repository. Either way a real uvicorn serves real websocket
clients, and:
- a snapshot that cannot be written keeps its session resident, and eviction works again once there is room;
- a reply whose commit fails is reported (``reply_not_saved``) and its user message stays marked
  ``unanswered``; a user message that cannot be stored fails the turn before any generation;
- the server keeps answering throughout, and every turn works again once space is back.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sqlite3
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy.exc import OperationalError

from chatd.client import ChatClient, ChatError
from chatd.config import Settings
from chatd.engine.model.runner import ModelRunner
from tests.support import InProcessServer

TMPFS_MB = 24


class TmpfsDisk:
    """A tmpfs mounted for the test: ``fill`` writes a filler file until the disk is full."""

    kind = "tmpfs"

    def __init__(self, mount: Path) -> None:
        self.mount = mount
        self.filler = mount / "filler"

    def fill(self) -> None:
        with self.filler.open("ab", buffering=0) as out:
            for size in (64 * 1024, 512):  # then the last few bytes
                with contextlib.suppress(OSError):
                    while True:
                        out.write(b"\0" * size)

    def free(self) -> None:
        self.filler.unlink(missing_ok=True)


class InjectedDisk:
    """No tmpfs here: ``fill`` makes the snapshot store raise ENOSPC and the repository SQLITE_FULL."""

    kind = "injected"

    def __init__(self) -> None:
        self.server: InProcessServer | None = None
        self.saved: dict[str, Any] = {}

    def fill(self) -> None:
        assert self.server is not None
        core = self.server.core
        store, repo = core.snapshots.store, core.repo
        self.saved = {"write": store.write, "append": repo.append_message, "replace": repo.replace_from}

        def no_space(*args: Any, **kwargs: Any) -> Any:
            raise OSError(errno.ENOSPC, "No space left on device")

        async def db_full(*args: Any, **kwargs: Any) -> Any:
            raise OperationalError("INSERT ...", {}, sqlite3.OperationalError("database or disk is full"))

        store.write = no_space  # type: ignore[method-assign]
        repo.append_message = db_full  # type: ignore[method-assign]
        repo.replace_from = db_full  # type: ignore[method-assign]

    def free(self) -> None:
        if self.saved and self.server is not None:
            core = self.server.core
            core.snapshots.store.write = self.saved["write"]  # type: ignore[method-assign]
            core.repo.append_message = self.saved["append"]  # type: ignore[method-assign]
            core.repo.replace_from = self.saved["replace"]  # type: ignore[method-assign]
            self.saved = {}


@contextlib.contextmanager
def small_disk(folder: Path, *, inject: bool) -> Iterator[TmpfsDisk | InjectedDisk]:
    folder.mkdir(parents=True, exist_ok=True)
    mounted = not inject and os.geteuid() == 0 and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={TMPFS_MB}m", "tmpfs", str(folder)],
        capture_output=True, check=False).returncode == 0
    try:
        yield TmpfsDisk(folder) if mounted else InjectedDisk()
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(folder)], capture_output=True, check=False)


@pytest.fixture(params=["small-disk", "injected"])
def disk_server(request: pytest.FixtureRequest, tmp_path: Path, make_settings: Callable[..., Settings],
                tiny_dir: Path, tiny_runner: ModelRunner) -> Iterator[tuple[InProcessServer, TmpfsDisk | InjectedDisk]]:
    """"small-disk": a tmpfs where one can be mounted, else injected errors; "injected": always injected, so
    the fallback is exercised on every machine."""
    with small_disk(tmp_path / "disk", inject=request.param == "injected") as disk:
        settings = make_settings(tiny_dir, cache={"restore_min_tokens": 0}).model_copy(
            update={"data_dir": str(tmp_path / "disk" / "data")})
        with InProcessServer(settings, tiny_runner) as server:
            if isinstance(disk, InjectedDisk):
                disk.server = server
            try:
                yield server, disk
            finally:
                disk.free()


def _history_is_marked(messages: list[Any]) -> bool:
    """Every user message is followed by a reply, or marked unanswered."""
    for num, message in enumerate(messages):
        if message.role == "user":
            answered = num + 1 < len(messages) and messages[num + 1].role == "assistant"
            if not answered and not message.unanswered:
                return False
    return True


async def test_a_full_disk_under_snapshots_and_database(disk_server: tuple[InProcessServer, TmpfsDisk | InjectedDisk],
                                                        figures: Callable[..., None]) -> None:
    server, disk = disk_server
    outcomes: dict[str, str] = {}
    async with await ChatClient.connect(server.ws_url) as client, \
            httpx.AsyncClient(base_url=server.http_url, headers=server.admin_headers, timeout=30) as http:
        a = (await client.create_session(system="Be brief.")).session_id
        b = (await client.create_session()).session_id
        await (await client.send(a, "some history " * 20, max_tokens=200, temperature=1.0, seed=1)).result()

        # 1. Snapshot folder full: the eviction fails, the session stays resident.
        disk.fill()
        evicted = (await http.post(f"/admin/sessions/{a}/evict")).json()
        assert evicted["done"] is False and evicted["tier"] == "device"
        assert (await http.get("/healthz")).status_code == 200
        outcomes["snapshot_write"] = "kept resident"

        # 2. Database full before a turn: the user message cannot be stored, the turn fails before generating.
        with pytest.raises(ChatError) as refused:
            await (await client.send(b, "while full", max_tokens=20)).result()
        outcomes["user_commit"] = refused.value.code
        assert refused.value.code in ("internal", "reply_not_saved")
        disk.free()
        _, messages = await client.resume(b)
        assert _history_is_marked(messages)

        # 3. Database full during a reply: reported, and the user message stays marked.
        reply = await client.send(b, "a long answer please", max_tokens=1500, temperature=1.0, seed=2)
        async for _ in reply:
            disk.fill()
            break
        try:
            async for _ in reply:
                pass
            outcomes["reply_commit"] = "stored"  # tmpfs: the write-ahead log still had room
        except ChatError as exc:
            assert exc.code == "reply_not_saved"
            outcomes["reply_commit"] = exc.code
        disk.free()
        _, messages = await client.resume(b)
        assert _history_is_marked(messages)
        if outcomes["reply_commit"] == "reply_not_saved":
            assert messages[-1].role == "user" and messages[-1].unanswered

        # 4. Space is back: eviction, restore and turns work; nothing acknowledged is lost.
        evicted = (await http.post(f"/admin/sessions/{a}/evict")).json()
        assert evicted["done"] is True and evicted["tier"] == "disk"
        done = await (await client.send(a, "back again", max_tokens=10, temperature=0)).result()
        assert done.type == "message.done" and done.usage.cache_tier == "disk"
        done = await (await client.send(b, "and here", max_tokens=10, temperature=0)).result()
        assert done.type == "message.done"
        _, messages = await client.resume(b)
        assert _history_is_marked(messages) and messages[-1].role == "assistant"
    assert server.core.counters.num_snapshot_write_failures >= 1
    figures("disk_full", disk=disk.kind, cases=4, outcomes=outcomes, lost_acknowledged=0, server_errors=0)
