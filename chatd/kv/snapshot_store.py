"""Snapshot files on disk: one file per session in one folder, written atomically.

Knows nothing about tensors: callers pass a ``write_body`` callback (normally a closure around
``chatd.kv.snapshot.write_snapshot``) and get plain binary file objects back to read.

Layout of the folder:
- ``<session_id>.kvsnap``: a completed snapshot (only these are listed, sized and opened).
- ``.<session_id>.<random>.tmp``: a write in progress; left over only by a crash, removed when a
  store is constructed.
Other names are ignored and never touched.

Plain blocking I/O with no shared mutable state: safe to call from worker threads (the server
uses a thread executor). Construct one store per folder per process, at startup: construction
removes every temp file, including one another live process could be writing.
"""

from __future__ import annotations

import builtins
import os
import tempfile
from collections.abc import Callable, Collection
from contextlib import suppress
from pathlib import Path
from typing import BinaryIO

from chatd.domain import is_session_id

SNAPSHOT_SUFFIX = ".kvsnap"
TEMP_PREFIX = "."
TEMP_SUFFIX = ".tmp"
_WRITE_BUFFER = 1 << 20  # the codec writes slab-sized frames; 1 MiB keeps syscalls few


def _open_for_write(fd: int) -> BinaryIO:
    """Buffered binary file over a fresh temp file's descriptor (a seam for fault-injection tests)."""
    return os.fdopen(fd, "wb", buffering=_WRITE_BUFFER)


def _is_temp_name(name: str) -> bool:
    return name.startswith(TEMP_PREFIX) and name.endswith(TEMP_SUFFIX)


class SnapshotStore:
    """One snapshot file per session in one folder."""

    def __init__(self, folder: Path) -> None:
        """Create ``folder`` (and parents) if needed and remove temp files left by crashed writes."""
        self._folder = Path(folder)
        self._folder.mkdir(parents=True, exist_ok=True)
        for entry in os.scandir(self._folder):
            if _is_temp_name(entry.name) and entry.is_file(follow_symlinks=False):
                with suppress(FileNotFoundError):
                    os.unlink(entry.path)

    @property
    def folder(self) -> Path:
        return self._folder

    def path_for(self, session_id: str) -> Path:
        """Final path of a session's snapshot. ValueError unless the id has the session-id format (chatd.domain)."""
        if not isinstance(session_id, str) or not is_session_id(session_id):
            raise ValueError(f"invalid session id {session_id!r}")
        return self._folder / f"{session_id}{SNAPSHOT_SUFFIX}"

    def write(self, session_id: str, write_body: Callable[[BinaryIO], object]) -> int:
        """Atomically replace the session's snapshot with what ``write_body`` writes; return its size.

        ``write_body`` gets a buffered binary file opened on a temp file in the same folder. After it
        returns, the file is flushed and fsynced, renamed over the final name, and the folder is
        fsynced. Readers therefore see the old snapshot or the complete new one, never a torn file,
        also across a crash. If anything fails before the rename (an error from ``write_body``,
        ENOSPC/EIO from write, flush, fsync or close, or the rename itself), the temp file is removed,
        the previous snapshot is untouched and the exception propagates. If only the final folder
        fsync fails, the new snapshot is in place but may not survive a power loss; that OSError
        propagates too. A folder deleted since the store was made is created again (with its parents).
        """
        final = self.path_for(session_id)
        fd, temp_name = self._make_temp(session_id)
        try:
            try:
                f = _open_for_write(fd)
            except BaseException:
                os.close(fd)
                raise
            with f:
                write_body(f)
                f.flush()
                os.fsync(f.fileno())
                size = os.fstat(f.fileno()).st_size
            os.replace(temp_name, final)
        except BaseException:
            with suppress(OSError):
                os.unlink(temp_name)
            raise
        self._fsync_folder()
        return size

    def _make_temp(self, session_id: str) -> tuple[int, str]:
        prefix = f"{TEMP_PREFIX}{session_id}."
        try:
            return tempfile.mkstemp(dir=self._folder, prefix=prefix, suffix=TEMP_SUFFIX)
        except FileNotFoundError:
            # The folder was removed while we ran (an operator, a cleanup job): without recreating it here
            # every later snapshot would fail and eviction could never free memory again.
            self._folder.mkdir(parents=True, exist_ok=True)
            return tempfile.mkstemp(dir=self._folder, prefix=prefix, suffix=TEMP_SUFFIX)

    def open(self, session_id: str) -> BinaryIO:
        """Open the session's completed snapshot for reading. FileNotFoundError if there is none."""
        return self.path_for(session_id).open("rb")

    def exists(self, session_id: str) -> bool:
        return self.path_for(session_id).is_file()

    def size(self, session_id: str) -> int | None:
        """Size in bytes of the session's snapshot, None if there is none."""
        try:
            return self.path_for(session_id).stat().st_size
        except FileNotFoundError:
            return None

    def delete(self, session_id: str) -> bool:
        """Remove the session's snapshot; True if one existed."""
        try:
            os.unlink(self.path_for(session_id))
        except FileNotFoundError:
            return False
        return True

    def list(self) -> dict[str, int]:
        """session_id -> file size of every completed snapshot (temp files and foreign names excluded).
        Empty when the folder is gone (the next write creates it again)."""
        result: dict[str, int] = {}
        try:
            entries = list(os.scandir(self._folder))
        except FileNotFoundError:
            return result
        for entry in entries:
            name = entry.name
            if not name.endswith(SNAPSHOT_SUFFIX):
                continue
            session_id = name[: -len(SNAPSHOT_SUFFIX)]
            if not is_session_id(session_id):
                continue
            try:
                if entry.is_file(follow_symlinks=False):
                    result[session_id] = entry.stat(follow_symlinks=False).st_size
            except FileNotFoundError:  # deleted by another thread between scandir and stat
                continue
        return result

    def total_bytes(self) -> int:
        return sum(self.list().values())

    def remove_orphans(self, known_session_ids: Collection[str]) -> builtins.list[str]:
        """Delete the snapshots of sessions not in ``known_session_ids``; return their ids, sorted."""
        known = set(known_session_ids)
        removed = [sid for sid in sorted(self.list()) if sid not in known and self.delete(sid)]
        return removed

    def _fsync_folder(self) -> None:
        # Makes the rename itself durable; POSIX-only (directories cannot be opened on Windows).
        if os.name != "posix":
            return
        fd = os.open(self._folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
