"""Snapshot files on disk: atomic replace, crash and disk-full safety, listing, orphans, path safety."""

from __future__ import annotations

import errno
import io
import os
import shutil
import threading
from pathlib import Path
from typing import BinaryIO

import pytest
import torch

from chatd.kv import snapshot_store
from chatd.kv.snapshot import ModelFingerprint, allocate_targets, read_snapshot, write_snapshot
from chatd.kv.snapshot_store import SnapshotStore

SID_A = "A" * 22
SID_B = "b-_9" * 6
SID_C = "CccccccccccccccccccccC"


def body(content: bytes):
    def write_body(f: BinaryIO) -> None:
        f.write(content)

    return write_body


def temp_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


def read(store: SnapshotStore, session_id: str) -> bytes:
    with store.open(session_id) as f:
        return f.read()


@pytest.fixture
def store(tmp_path: Path) -> SnapshotStore:
    return SnapshotStore(tmp_path / "snapshots")


def test_write_read_size_exists_delete(store: SnapshotStore) -> None:
    assert not store.exists(SID_A) and store.size(SID_A) is None
    with pytest.raises(FileNotFoundError):
        store.open(SID_A)
    assert store.write(SID_A, body(b"x" * 1000)) == 1000
    assert store.exists(SID_A) and store.size(SID_A) == 1000 and read(store, SID_A) == b"x" * 1000
    assert store.path_for(SID_A).parent == store.folder
    assert store.delete(SID_A) is True
    assert store.delete(SID_A) is False
    assert not store.exists(SID_A)


def test_write_replaces_the_old_file_atomically(store: SnapshotStore) -> None:
    store.write(SID_A, body(b"old" * 100))
    store.write(SID_A, body(b"new!"))
    assert read(store, SID_A) == b"new!"
    assert store.list() == {SID_A: 4}
    assert temp_files(store.folder) == []


def test_write_body_gets_a_real_buffered_file(store: SnapshotStore) -> None:
    seen: list[object] = []

    def write_body(f: BinaryIO) -> None:
        seen.append(f)
        assert isinstance(f, io.BufferedWriter) and f.fileno() >= 0
        # While writing, only a temp file exists: the final name still holds the old snapshot.
        assert read(store, SID_A) == b"old"
        f.write(b"new")

    store.write(SID_A, body(b"old"))
    store.write(SID_A, write_body)
    assert seen and read(store, SID_A) == b"new"


def test_crash_before_rename_keeps_the_old_snapshot(store: SnapshotStore, monkeypatch) -> None:
    store.write(SID_A, body(b"old snapshot"))

    def crash(src: object, dst: object) -> None:
        raise OSError(errno.EIO, "simulated crash at rename")

    monkeypatch.setattr(snapshot_store.os, "replace", crash)
    with pytest.raises(OSError, match="simulated crash"):
        store.write(SID_A, body(b"new snapshot"))
    monkeypatch.undo()
    assert read(store, SID_A) == b"old snapshot"
    assert temp_files(store.folder) == []


def test_write_body_error_after_writing_keeps_the_old_snapshot(store: SnapshotStore) -> None:
    store.write(SID_A, body(b"old snapshot"))

    class Boom(RuntimeError):
        pass

    def write_then_fail(f: BinaryIO) -> None:
        f.write(b"half of a new snap")
        f.flush()
        raise Boom("encoder failed")

    with pytest.raises(Boom):
        store.write(SID_A, write_then_fail)
    assert read(store, SID_A) == b"old snapshot"
    assert temp_files(store.folder) == [] and store.list() == {SID_A: 12}


def test_enospc_from_write_body_keeps_the_old_snapshot(store: SnapshotStore) -> None:
    store.write(SID_A, body(b"old snapshot"))

    def disk_full(f: BinaryIO) -> None:
        f.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError) as excinfo:
        store.write(SID_A, disk_full)
    assert excinfo.value.errno == errno.ENOSPC
    assert read(store, SID_A) == b"old snapshot" and temp_files(store.folder) == []


class FullDisk(io.FileIO):
    """A raw file with room for ``ROOM`` bytes; every write past that fails with ENOSPC, like a full disk."""

    ROOM = 50

    def write(self, data) -> int:  # type: ignore[override]
        if self.tell() + len(data) > self.ROOM:
            raise OSError(errno.ENOSPC, "No space left on device")
        return super().write(data)


@pytest.mark.parametrize("size", [100, 5000, 3 << 20])
def test_enospc_from_the_file_itself_keeps_the_old_snapshot(
    store: SnapshotStore, monkeypatch, size: int
) -> None:
    """The disk fills up under the buffered file: at the final flush (small bodies stay in the 1 MiB
    buffer) or inside write_body's own write call (a body larger than the buffer)."""
    store.write(SID_A, body(b"old snapshot"))
    monkeypatch.setattr(
        snapshot_store, "_open_for_write", lambda fd: io.BufferedWriter(FullDisk(fd, "wb"), 1 << 20)
    )
    with pytest.raises(OSError) as excinfo:
        store.write(SID_A, body(b"y" * size))
    assert excinfo.value.errno == errno.ENOSPC
    monkeypatch.undo()
    assert read(store, SID_A) == b"old snapshot" and temp_files(store.folder) == []
    # The store keeps working once there is room again.
    assert store.write(SID_A, body(b"fits now")) == 8


def test_enospc_while_the_codec_streams_keeps_the_old_snapshot(store: SnapshotStore, monkeypatch) -> None:
    fp = ModelFingerprint("m", "h", "float32", 8, 3, 64)
    layers = [(torch.randn(3, 400, 64), torch.randn(3, 400, 64)) for _ in range(8)]  # ~5 MiB of frames
    store.write(SID_A, lambda f: write_snapshot(f, fp, range(400), layers[:8]))
    before = read(store, SID_A)
    monkeypatch.setattr(
        snapshot_store, "_open_for_write", lambda fd: io.BufferedWriter(FullDisk(fd, "wb"), 1 << 20)
    )
    monkeypatch.setattr(FullDisk, "ROOM", 2 << 20)
    calls: list[int] = []

    def encode(f: BinaryIO) -> None:
        calls.append(1)
        write_snapshot(f, fp, list(range(1, 401)), layers)

    with pytest.raises(OSError) as excinfo:
        store.write(SID_A, encode)
    assert excinfo.value.errno == errno.ENOSPC and calls == [1]
    monkeypatch.undo()
    assert read(store, SID_A) == before and temp_files(store.folder) == []


def test_fsync_failure_keeps_the_old_snapshot(store: SnapshotStore, monkeypatch) -> None:
    store.write(SID_A, body(b"old snapshot"))

    def eio(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(snapshot_store.os, "fsync", eio)
    with pytest.raises(OSError):
        store.write(SID_A, body(b"new"))
    monkeypatch.undo()
    assert read(store, SID_A) == b"old snapshot" and temp_files(store.folder) == []


def test_failed_first_write_leaves_nothing(store: SnapshotStore) -> None:
    with pytest.raises(ValueError):
        store.write(SID_A, lambda f: (f.write(b"abc"), int("not a number")))
    assert not store.exists(SID_A) and os.listdir(store.folder) == []


def test_a_folder_deleted_at_runtime_is_recreated_by_the_next_write(store: SnapshotStore) -> None:
    store.write(SID_A, body(b"old"))
    shutil.rmtree(store.folder)
    # Reads see no snapshots rather than failing.
    assert store.list() == {} and store.total_bytes() == 0 and not store.exists(SID_A)
    assert store.write(SID_A, body(b"new!")) == 4
    assert read(store, SID_A) == b"new!" and store.list() == {SID_A: 4}
    assert temp_files(store.folder) == []


def test_a_folder_deleted_with_its_parents_is_recreated(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "data" / "snapshots")
    shutil.rmtree(tmp_path / "data")
    assert store.write(SID_B, body(b"b" * 20)) == 20
    assert read(store, SID_B) == b"b" * 20


def test_construction_removes_leftover_temp_files_only(tmp_path: Path) -> None:
    folder = tmp_path / "snaps"
    store = SnapshotStore(folder)
    store.write(SID_A, body(b"done"))
    (folder / f".{SID_B}.k2j4h5.tmp").write_bytes(b"torn write")
    (folder / f".{SID_A}.zz.tmp").write_bytes(b"torn write")
    (folder / "README").write_text("not ours")
    assert len(temp_files(folder)) == 2
    reopened = SnapshotStore(folder)
    assert temp_files(folder) == []
    assert reopened.list() == {SID_A: 4} and (folder / "README").exists()


def test_list_total_and_remove_orphans(store: SnapshotStore) -> None:
    store.write(SID_A, body(b"a" * 10))
    store.write(SID_B, body(b"b" * 20))
    store.write(SID_C, body(b"c" * 30))
    (store.folder / f".{SID_C}.abc.tmp").write_bytes(b"in flight")
    (store.folder / "short.kvsnap").write_bytes(b"not a valid session id")
    assert store.list() == {SID_A: 10, SID_B: 20, SID_C: 30}
    assert store.total_bytes() == 60
    assert store.remove_orphans({SID_B, "unknown-session-id-xyz"}) == sorted([SID_A, SID_C])
    assert store.list() == {SID_B: 20}
    assert store.remove_orphans([SID_B]) == []
    assert (store.folder / "short.kvsnap").exists()


@pytest.mark.parametrize(
    "session_id",
    [
        "../../etc/passwd",
        "../" + "a" * 20,
        "a" * 15,
        "a" * 65,
        "a" * 20 + "/x",
        "a" * 20 + "\n",
        "a" * 20 + ".kvsnap",
        "a" * 20 + "=",
        "é" * 20,
        "",
        "a" * 10 + "\x00" + "a" * 10,
    ],
)
def test_invalid_session_ids_are_rejected(store: SnapshotStore, session_id: str) -> None:
    for call in (store.path_for, store.exists, store.size, store.delete, store.open):
        with pytest.raises(ValueError):
            call(session_id)
    with pytest.raises(ValueError):
        store.write(session_id, body(b"x"))
    assert os.listdir(store.folder) == []


def test_valid_session_id_bounds(store: SnapshotStore) -> None:
    for session_id in ("a" * 16, "Z" * 64, "-_" * 8):
        assert store.path_for(session_id).name == f"{session_id}.kvsnap"


def test_concurrent_writers_from_threads(store: SnapshotStore) -> None:
    ids = [f"{i:02d}" * 10 for i in range(8)]
    errors: list[BaseException] = []

    def work(session_id: str) -> None:
        try:
            for round_ in range(5):
                store.write(session_id, body(session_id.encode() * (round_ + 1)))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(sid,)) for sid in ids for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert store.list() == {sid: 20 * 5 for sid in ids}
    assert temp_files(store.folder) == []


def test_codec_streams_through_the_store(store: SnapshotStore) -> None:
    fp = ModelFingerprint("SmolLM2-135M-Instruct", "ff" * 32, "float32", 4, 3, 64)
    gen = torch.Generator().manual_seed(1)
    layers = [
        (torch.randn(3, 50, 64, generator=gen), torch.randn(3, 50, 64, generator=gen)) for _ in range(4)
    ]
    ids = list(range(100, 150))
    size = store.write(SID_A, lambda f: write_snapshot(f, fp, ids, layers))
    assert size == store.size(SID_A)
    targets = allocate_targets(fp, 50)
    with store.open(SID_A) as f:
        read_snapshot(f, expected=fp, expected_ids=ids, targets=targets)
    for (k, v), (tk, tv) in zip(layers, targets, strict=True):
        assert torch.equal(k.view(torch.int32), tk.view(torch.int32))
        assert torch.equal(v.view(torch.int32), tv.view(torch.int32))
