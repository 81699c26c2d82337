"""Snapshots of session caches: codec + atomic files + database records, off the event loop.

Encoding, compression and file I/O run on one dedicated I/O thread, so they neither block the event
loop nor the engine worker (whose generations keep running while a snapshot is written). The tensors
handed to :meth:`SnapshotService.save` must not change until it returns (the KV manager guarantees
it); restore decodes straight into a cache that no generation can see yet.

A file is written (atomically) before its record; a crash in between leaves a file whose header still
describes it exactly, and the startup pass reconciles files and records. Token ids decide validity:
the manager only reuses the prefix a snapshot shares with the session's stored ids.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import struct
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Protocol, TypeVar

import torch

from chatd.config import CacheSettings
from chatd.counters import Counters
from chatd.domain import SnapshotRecord
from chatd.engine.model.runner import ModelInfo
from chatd.engine.pool.kvcache import SessionKV
from chatd.engine.pool.paged import row_width
from chatd.engine.threads import confine_to_one_thread
from chatd.errors import SnapshotModelMismatch
from chatd.kv import policy
from chatd.kv.snapshot import ModelFingerprint, allocate_targets, read_info, read_snapshot, write_snapshot
from chatd.kv.snapshot_frames import PlaneKernels
from chatd.kv.snapshot_store import SnapshotStore

log = logging.getLogger(__name__)
T = TypeVar("T")

# Starting estimates before anything was measured on this machine (updated as turns run).
_INITIAL_PREFILL_TPS = {"cpu": 300.0, "cuda": 20_000.0}
_INITIAL_RESTORE_BPS = 200e6


class SnapshotIndex(Protocol):
    """The durable list of snapshot records this service keeps beside the files (the store's Repo is
    one). Each call is atomic; the service holds the only writer for snapshot records."""

    async def list_snapshots(self) -> list[SnapshotRecord]:
        """Every record."""
        ...

    async def put_snapshot(self, record: SnapshotRecord) -> None:
        """Record (or replace) the session's one snapshot; raises when the session does not exist."""
        ...

    async def delete_snapshot(self, session_id: str) -> bool:
        """Forget the session's record; False when there was none."""
        ...


def fingerprint_of(info: ModelInfo) -> ModelFingerprint:
    # head_dim: the width of a stored position (an int8 cache's rows carry their scale, chatd.engine.pool.paged)
    return ModelFingerprint(model_id=info.name, weights_hash=info.weights_hash, dtype=info.dtype_name,
                            num_layers=info.num_layers, num_kv_heads=info.num_kv_heads,
                            head_dim=row_width(info.dtype, info.head_dim))


def ids_digest(token_ids: Sequence[int]) -> str:
    return hashlib.sha256(struct.pack(f"<{len(token_ids)}I", *token_ids)).hexdigest()


class SnapshotService:
    def __init__(self, settings: CacheSettings, folder: Path, index: SnapshotIndex, info: ModelInfo, *,
                 counters: Counters | None = None, kernels: PlaneKernels | None = None) -> None:
        self.settings = settings
        self.kernels = kernels  # native byte-plane joins and splits, where the engine built them
        self.store = SnapshotStore(folder)
        self.index = index
        self.info = info
        self.fingerprint = fingerprint_of(info)
        self._fingerprint_digest = self.fingerprint.digest()  # in every record this service writes
        self.disk_budget_bytes = int(settings.disk_budget_mb * 1024 * 1024)
        self.cost = policy.CostModel(
            prefill_tokens_per_s=_INITIAL_PREFILL_TPS.get(info.device.type, 300.0),
            restore_bytes_per_s=_INITIAL_RESTORE_BPS)
        self._records: dict[str, SnapshotRecord] = {}
        self._disk_bytes = 0  # the records' file bytes, kept with them (_keep_record, _drop_record)
        # Its tensor copies run on itself alone: torch's parallel regions belong to the engine thread.
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="chatd-snapshot-io",
                                      initializer=confine_to_one_thread)
        self.counters = counters if counters is not None else Counters()

    async def _in_io(self, fn: Callable[..., T], *args: object) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._io, fn, *args)

    def close(self) -> None:
        self._io.shutdown(wait=True)

    # ------------------------------------------------------------------ startup

    async def startup(self, known_session_ids: Collection[str]) -> None:
        """Reconcile files and records: orphan files (no session, or no record) and records without a
        file go; files from another model go (they could never be restored)."""
        known = set(known_session_ids)
        records = {r.session_id: r for r in await self.index.list_snapshots()}
        files: dict[str, int] = await self._in_io(self.store.list)
        for session_id in list(files):
            if session_id not in known or session_id not in records:
                await self._in_io(self.store.delete, session_id)
                files.pop(session_id)
        for session_id, record in records.items():
            if session_id not in files or record.fingerprint != self._fingerprint_digest:
                await self._in_io(self.store.delete, session_id)
                await self.index.delete_snapshot(session_id)
                continue
            self._keep_record(record)
        if self._records:
            log.info("%d session snapshots on disk (%.1f MB)", len(self._records), self.disk_bytes / 1e6)

    # ------------------------------------------------------------------ queries

    async def record(self, session_id: str) -> SnapshotRecord | None:
        return self._records.get(session_id)

    def has(self, session_id: str) -> bool:
        """True while the session has a snapshot this service would try to restore."""
        return session_id in self._records

    def records(self) -> dict[str, SnapshotRecord]:
        return dict(self._records)

    @property
    def disk_bytes(self) -> int:
        """The snapshot files' bytes, as recorded (every save checks the disk budget against it)."""
        return self._disk_bytes

    def _keep_record(self, record: SnapshotRecord) -> None:
        self._drop_record(record.session_id)
        self._records[record.session_id] = record
        self._disk_bytes += record.file_bytes

    def _drop_record(self, session_id: str) -> None:
        record = self._records.pop(session_id, None)
        if record is not None:
            self._disk_bytes -= record.file_bytes

    # ------------------------------------------------------------------ save / load / delete

    async def save(self, session_id: str, token_ids: Sequence[int],
                   layers: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> SnapshotRecord:
        """Write the session's snapshot (replacing any older one) and record it.

        Raises OSError (disk full, I/O error) with the previous snapshot, if any, left intact."""
        ids = list(token_ids)
        # snapshot_dtype = "bfloat16" narrows fp32 caches; any other cache is stored as it is
        lossy = self.settings.snapshot_dtype != "native" and self.fingerprint.dtype == "float32"
        stored = self.settings.snapshot_dtype if lossy else None
        level = self.settings.zstd_level

        def write() -> int:
            return self.store.write(session_id, lambda f: write_snapshot(
                f, self.fingerprint, ids, layers, level=None if level == "auto" else level, stored_dtype=stored,
                kernels=self.kernels))

        file_bytes: int = await self._in_io(write)
        record = SnapshotRecord(
            session_id=session_id, file_name=self.store.path_for(session_id).name, num_tokens=len(ids),
            file_bytes=file_bytes, raw_bytes=len(ids) * self.info.bytes_per_token,
            fingerprint=self._fingerprint_digest, ids_digest=ids_digest(ids), created_at=datetime.now(UTC))
        await self.index.put_snapshot(record)
        self._keep_record(record)
        self.counters.num_snapshot_bytes_written += file_bytes
        await self._enforce_disk_budget(keep=session_id)
        return record

    async def read_ids(self, session_id: str) -> tuple[int, ...]:
        """The token ids a session's snapshot holds (header only). Raises SnapshotError / OSError."""

        def read() -> tuple[int, ...]:
            with self.store.open(session_id) as f:
                info = read_info(f)
            if info.fingerprint != self.fingerprint:
                raise SnapshotModelMismatch("the snapshot belongs to another model")
            return info.token_ids

        ids: tuple[int, ...] = await self._in_io(read)
        return ids

    async def read_into(self, session_id: str, token_ids: Sequence[int], targets: Layers) -> int:
        """Decode the snapshot, whose ids must equal ``token_ids``, into ``targets`` (see
        :func:`restore_targets`) on the I/O thread; return the file's size. Raises SnapshotError (the
        file is unusable: recompute) or OSError."""
        ids = list(token_ids)
        return await self._in_io(read_snapshot_file, self.store.path_for(session_id), self.fingerprint, ids, targets,
                                 self.kernels)

    def observe_restore(self, file_bytes: int, seconds: float) -> None:
        """Feed a measured restore throughput into the restore-vs-recompute estimate."""
        self.cost = policy.CostModel(
            prefill_tokens_per_s=self.cost.prefill_tokens_per_s,
            restore_bytes_per_s=policy.update_rate(self.cost.restore_bytes_per_s, file_bytes / max(seconds, 1e-6)))

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """Feed a measured prefill throughput into the restore-vs-recompute estimate."""
        if num_tokens >= 32 and seconds > 0:
            self.cost = policy.CostModel(
                prefill_tokens_per_s=policy.update_rate(self.cost.prefill_tokens_per_s, num_tokens / seconds),
                restore_bytes_per_s=self.cost.restore_bytes_per_s)

    async def delete(self, session_id: str) -> None:
        self._drop_record(session_id)
        await self._in_io(self.store.delete, session_id)
        await self.index.delete_snapshot(session_id)

    async def _enforce_disk_budget(self, *, keep: str) -> None:
        """Delete the oldest snapshots while the total exceeds the disk budget (those sessions will
        recompute on resume). The one just written is kept even if alone it exceeds the budget."""
        while self.disk_bytes > self.disk_budget_bytes:
            oldest = min((r for r in self._records.values() if r.session_id != keep),
                         key=lambda r: r.created_at, default=None)
            if oldest is None:
                return
            log.info("disk budget: deleting snapshot of session %s", oldest.session_id[:8])
            self.counters.num_snapshots_deleted_for_budget += 1
            await self.delete(oldest.session_id)


# ----------------------------------------------------------------------------- the restore path
# A restore is three steps: targets prepared on the engine thread, the file decoded into them on the
# I/O thread, the cache completed on the engine thread. The KV manager runs them in production; the
# benchmarks time the same three functions.

Layers = list[tuple[torch.Tensor, torch.Tensor]]


def restore_targets(cache: SessionKV, token_ids: Sequence[int], fingerprint: ModelFingerprint) -> Layers:
    """Engine thread. Hold the (empty) cache's slots for the snapshot's ``token_ids`` and say where to decode
    them: the pool's own blocks on the CPU when they are one run (no intermediate copy), else host
    tensors (pinned on an accelerator)."""
    direct = cache.restore_begin(token_ids)
    return direct if direct is not None else allocate_targets(fingerprint, len(token_ids))


def read_snapshot_file(path: Path, fingerprint: ModelFingerprint, token_ids: Sequence[int], targets: Layers,
                       kernels: PlaneKernels | None = None) -> int:
    """I/O thread. Decode the snapshot file at ``path`` into ``targets`` (byte planes joined by ``kernels``
    where given); return the file's size."""
    with path.open("rb") as f:
        read_snapshot(f, expected=fingerprint, expected_ids=token_ids, targets=targets,
                      thread_setup=confine_to_one_thread, kernels=kernels)
        return f.tell()


def finish_restore(cache: SessionKV, targets: Layers) -> None:
    """Engine thread. Make the decoded positions the cache's contents (writing them to the pool when they
    were decoded elsewhere)."""
    cache.restore_finish(targets)
