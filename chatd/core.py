"""Wiring: build every part from Settings, start it, and shut it down in order.

``async with Chatd.open(settings) as core:`` gives a running :class:`SessionService` plus its parts;
the server's lifespan, the terminal chat and the tests all use this one path.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncEngine

from chatd.chat.template import ChatTemplate
from chatd.config import Settings
from chatd.engine.runner import ModelRunner
from chatd.engine.worker import EngineWorker
from chatd.kv.manager import KVManager
from chatd.kv.persistence import SnapshotService
from chatd.sessions import SessionService
from chatd.store import db
from chatd.store.repo import Repo
from chatd.turns import TurnRunner

log = logging.getLogger(__name__)


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

    @classmethod
    @asynccontextmanager
    async def open(cls, settings: Settings, *, runner: ModelRunner | None = None,
                   background: bool = True) -> AsyncIterator[Chatd]:
        """Start chatd: upgrade the database, load the model (unless ``runner`` is given), clean up
        snapshot files, start the engine worker and background cache maintenance.

        On exit: running turns are cancelled and committed, idle caches are snapshotted, the worker
        stops and the database is closed.
        """
        settings.data_path.mkdir(parents=True, exist_ok=True)
        await db.upgrade_async(settings.store_url)
        if runner is None:
            runner = await asyncio.to_thread(ModelRunner.load, settings.model, settings.data_path)
        elif settings.model.max_context and settings.model.max_context < runner.info.max_context:
            # A shared, already loaded model (tests) still honours this configuration's context cap.
            runner = ModelRunner(runner.model, runner.tokenizer,
                                 dataclasses.replace(runner.info, max_context=settings.model.max_context))
        engine = db.create_engine(settings.store_url, echo=settings.store.echo)
        repo = Repo(db.make_sessionmaker(engine))
        worker = EngineWorker(runner, prefill_chunk_tokens=settings.model.prefill_chunk_tokens,
                              max_batch_size=settings.model.max_batch_size)
        worker.start()
        snapshots = SnapshotService(settings.cache, settings.snapshot_path, repo, runner.info)
        kv = KVManager(worker, runner.info, settings.cache, snapshots)
        turns = TurnRunner(settings, repo, ChatTemplate(runner.tokenizer), runner.info, worker, kv)
        sessions = SessionService(turns)
        core = cls(settings, runner, worker, engine, repo, snapshots, kv, sessions)
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
            self.worker.stop()
            self.snapshots.close()
            await self.engine.dispose()
