"""Wiring: build every part from Settings, start it, and shut it down in order; and the operations
the edges call (listing and inspecting sessions, operator actions, stats).

``async with Chatd.open(settings) as core:`` gives a running :class:`SessionService` plus its parts;
the server's lifespan, the terminal chat and the tests all use this one path. The admin API and
/metrics go through :class:`Chatd`'s operations only, never to the parts behind them.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy.ext.asyncio import AsyncEngine

from chatd.chat.template import ChatTemplate
from chatd.config import Settings
from chatd.counters import Counters
from chatd.domain import SessionRecord, Tier, is_session_id
from chatd.engine.model.runner import ModelRunner
from chatd.engine.threads import run_in_passing_thread
from chatd.engine.worker import EngineWorker
from chatd.errors import BadRequest, NotFound
from chatd.kv.manager import KVManager
from chatd.kv.persistence import SnapshotService
from chatd.service.sessions import SessionService
from chatd.service.stats import Stats, Tiers, build_stats
from chatd.service.turns import TurnRunner, to_message
from chatd.service.types import Message, SessionInfo, TurnResult
from chatd.store import db
from chatd.store.repo import Repo

log = logging.getLogger(__name__)

MAX_PAGE_LIMIT = 500
"""The most sessions one page of :meth:`Chatd.list_sessions` (and ``GET /admin/sessions``) may ask for."""
MAX_PAGE_OFFSET = 1_000_000_000
"""The largest page offset accepted; beyond it is a BadRequest (SQLite's integers stop at 2**63 - 1)."""


@dataclass(frozen=True)
class SessionSummary:
    """A session as an operator sees it: its info plus where its cache is and how big."""

    info: SessionInfo
    kv_bytes: int
    """Allocated bytes of its resident cache; 0 when not resident."""
    snapshot_bytes: int
    """Size of its snapshot file; 0 when it has none."""
    last_active: datetime
    generating: bool


@dataclass(frozen=True)
class SessionListing:
    sessions: list[SessionSummary]
    total: int
    """How many sessions match the filter, over all pages."""


@dataclass(frozen=True)
class MessageLayout:
    """A stored message and where its token ids sit in the conversation's ids."""

    message: Message
    num_tokens: int
    token_span: tuple[int, int]
    """[start, end) of the message's ids in the conversation's ids."""
    content_span: tuple[int, int]
    """[start, end) of the content ids (without the template's header and footer)."""


@dataclass(frozen=True)
class SessionDetail:
    summary: SessionSummary
    messages: list[MessageLayout]
    cached_tokens: int
    """How many leading conversation ids the resident cache holds (0 when not resident)."""


@dataclass(frozen=True)
class ActionOutcome:
    done: bool
    tier: Tier
    """Where the session's cache is after the action."""


@dataclass
class Chatd:
    settings: Settings
    runner: ModelRunner
    worker: EngineWorker
    engine: AsyncEngine
    repo: Repo
    snapshots: SnapshotService
    kv: KVManager
    sessions: SessionService
    counters: Counters
    tiers: Tiers

    @classmethod
    @asynccontextmanager
    async def open(cls, settings: Settings, *, runner: ModelRunner | None = None, background: bool = True,
                   on_phase: Callable[[str], None] | None = None) -> AsyncIterator[Chatd]:
        """Start chatd: upgrade the database, load the model (unless ``runner`` is given), clean up
        snapshot files, start the engine worker and background cache maintenance. ``on_phase`` hears
        each start-up phase as it begins ("opening store", "loading model", "warming up"), for /readyz.

        On exit: running turns are cancelled and committed, idle caches are snapshotted, the worker
        stops and the database is closed.
        """
        phase = on_phase or (lambda _: None)
        phase("opening store")
        settings.data_path.mkdir(parents=True, exist_ok=True)
        await db.upgrade_async(settings.store_url)
        budget_bytes = int(settings.cache.device_budget_mb * 1024 * 1024)
        warm = runner is None
        if runner is None:
            phase("loading model")
            # Torch's parallel work belongs to the engine thread (chatd/engine/threads.py): the load runs in a
            # thread that ends afterwards, the warm-up on the engine thread below.
            settings_model, data_path = settings.model, settings.data_path
            runner = await run_in_passing_thread(lambda: ModelRunner.load(settings_model, data_path),
                                                 "chatd-load")
            runner.configure_pool(budget_bytes)
        else:
            # A shared, already loaded model (tests): this server gets its own KV pool, and still honours its
            # configuration's context cap.
            info = runner.info
            if settings.model.max_context and settings.model.max_context < info.max_context:
                info = dataclasses.replace(info, max_context=settings.model.max_context)
            runner = ModelRunner(runner.model, runner.tokenizer, info, runner.forward, runner.kernels)
            runner.huge_pages = settings.model.huge_pages and info.device.type == "cpu"
            runner.configure_pool(budget_bytes)
        engine = db.create_engine(settings.store_url, echo=settings.store.echo)
        repo = Repo(db.make_sessionmaker(engine))
        counters = Counters()
        phase("warming up")
        worker = EngineWorker(runner, decode_threads=settings.model.decode_threads,
                              prefill_chunk_tokens=settings.model.prefill_chunk_tokens,
                              max_batch_size=settings.model.max_batch_size, counters=counters,
                              stream_interval_s=settings.server.stream_interval_ms / 1000)
        worker.start()
        if warm:
            log.info("warming up the engine")
            try:
                warm_s = await worker.warm_up(settings.model.max_batch_size)
            except BaseException:
                worker.stop()
                raise
            log.info("engine warm in %.1f s", warm_s)
        snapshots = SnapshotService(settings.cache, settings.snapshot_path, repo, runner.info, counters=counters,
                                    kernels=runner.kernels)
        kv = KVManager(worker, runner.info, settings.cache, snapshots, counters=counters)
        turns = TurnRunner(settings, repo, ChatTemplate(runner.tokenizer), runner.info, worker, kv, counters)
        tiers = Tiers(kv, snapshots)
        sessions = SessionService(turns, tiers)
        core = cls(settings, runner, worker, engine, repo, snapshots, kv, sessions, counters, tiers)
        try:
            await snapshots.startup(await repo.all_session_ids())
            if background:
                kv.start()
            yield core
        finally:
            await core.close()

    async def close(self) -> None:
        try:
            await self.sessions.shutdown()
            await self.kv.stop()
            if self.worker.failure is None:
                persisted = await self.kv.persist_all()
                if persisted:
                    log.info("snapshotted %d sessions at shutdown", persisted)
            else:
                # Its tensors are no longer trusted; stored messages let those sessions recompute.
                log.warning("the engine thread had died: resident caches were not snapshotted")
        finally:
            stopped = self.worker.stop()
            self.snapshots.close()
            if stopped:  # nothing reads the KV pool any more: its memory goes now, not at a later collection
                self.runner.release_pool()
            await self.repo.close()
            await self.engine.dispose()

    # ------------------------------------------------------------------ reading

    def tier(self, session_id: str) -> Tier:
        """Where the session's cache is now (``"none"`` also for an unknown session)."""
        return self.tiers.tier(session_id)

    async def stats(self) -> Stats:
        """State and totals now, with the number of stored sessions (one read of the store)."""
        num_sessions = await self.repo.count_sessions()
        return self.live_stats(num_sessions=num_sessions)

    def live_stats(self, *, num_sessions: int | None = None) -> Stats:
        """State and totals now without reading the store: for scrapes, which must not wait.
        ``num_sessions`` is reported as given (None: not counted)."""
        return build_stats(counters=self.counters, tiers=self.tiers, kv=self.kv, snapshots=self.snapshots,
                              info=self.runner.info, num_generating=self.sessions.num_generating,
                              num_sessions=num_sessions)

    def on_turn(self, hook: Callable[[TurnResult], None]) -> None:
        """Call ``hook`` with every committed turn, on the event loop, before its client hears of it.
        A hook that raises is logged and does not affect the turn."""
        self.sessions.turns.on_turn.append(hook)

    async def list_sessions(self, tier: Tier | None = None, *, limit: int = 50, offset: int = 0) -> SessionListing:
        """A page of sessions, most recently active first; ``tier`` keeps those whose cache is there now.
        Raises BadRequest unless ``1 <= limit <= MAX_PAGE_LIMIT`` and ``0 <= offset <= MAX_PAGE_OFFSET``."""
        if not 1 <= limit <= MAX_PAGE_LIMIT:
            raise BadRequest(f"limit must be between 1 and {MAX_PAGE_LIMIT}")
        if not 0 <= offset <= MAX_PAGE_OFFSET:
            raise BadRequest(f"offset must be between 0 and {MAX_PAGE_OFFSET}")
        session_ids: list[str] | None = None
        if tier is not None:
            candidates = await self.repo.all_session_ids() if tier == "none" else self.tiers.cached_session_ids()
            session_ids = sorted(s for s in candidates if self.tiers.tier(s) == tier)
        records = await self.repo.list_sessions(limit=limit, offset=offset, session_ids=session_ids)
        total = await self.repo.count_sessions(session_ids)
        return SessionListing([await self._summary(r) for r in records], total)

    async def session_detail(self, session_id: str) -> SessionDetail:
        """The session, its messages with their token spans, and how much of it is cached.
        Raises NotFound (also for an id outside the session-id format)."""
        _require_session_id(session_id)
        record = await self.repo.get_session(session_id)
        if record is None:
            raise NotFound("no such session")
        template = self.sessions.template
        messages = []
        position = 0
        for m in await self.repo.get_messages(session_id):
            start, end = template.content_span(m.role, m.index, m.token_ids)
            messages.append(MessageLayout(
                to_message(m, with_usage=True), num_tokens=len(m.token_ids),
                token_span=(position, position + len(m.token_ids)), content_span=(position + start, position + end)))
            position += len(m.token_ids)
        summary = await self._summary(record)
        return SessionDetail(summary, messages, cached_tokens=len(self.kv.cached_ids(session_id) or []))

    async def _summary(self, record: SessionRecord) -> SessionSummary:
        session_id = record.session_id
        on_disk = await self.snapshots.record(session_id)
        info = self.sessions.session_info(record)
        return SessionSummary(info, kv_bytes=self.kv.kv_bytes(session_id),
                              snapshot_bytes=on_disk.file_bytes if on_disk else 0,
                              last_active=record.updated_at, generating=self.sessions.is_generating(session_id))

    # ------------------------------------------------------------------ operator actions

    async def evict(self, session_id: str) -> ActionOutcome:
        """Snapshot the session's cache (unless already on disk) and free its memory. ``done`` is False
        when it was not resident or the snapshot could not be written. Raises NotFound, and Busy while
        the session generates."""
        _require_session_id(session_id)
        done = await self.sessions.evict(session_id)
        return ActionOutcome(done, self.tier(session_id))

    async def restore(self, session_id: str) -> ActionOutcome:
        """Load the session's cache now (from its snapshot, or recomputed when there is none); ``done``
        says it is resident afterwards. Raises NotFound."""
        _require_session_id(session_id)
        restored = await self.sessions.restore(session_id)
        return ActionOutcome(restored == "device", self.tier(session_id))

    async def delete(self, session_id: str) -> bool:
        """Delete the session, its messages, edit history and snapshot (a running generation is
        cancelled first). False when there was no such session."""
        return await self.sessions.delete(session_id)


def _require_session_id(session_id: str) -> None:
    # An id outside the format can name no session; refusing it here keeps arbitrary text away from
    # the store and the snapshot folder (whose paths are built from ids).
    if not is_session_id(session_id):
        raise NotFound("no such session")
