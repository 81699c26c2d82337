"""SessionService: create / send / edit / resume / evict / restore / delete.

One conversation changes one step at a time: a session with a generation (or any other change)
in progress answers ``busy`` to the next change. The turns themselves are carried out by
:class:`chatd.service.turns.TurnRunner` (commit the user message, generate, commit the reply).

Turns run as their own tasks, detached from whoever reads them: a reader that disappears only
cancels the generation; the bookkeeping (committing the partial reply, returning the cache) always
completes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine, Sequence
from typing import Any

from chatd.domain import SessionRecord, Tier, is_session_id, new_session_id
from chatd.errors import Busy, ChatdError, ContextLengthExceeded, Internal, TooLarge
from chatd.service.pool import PrefixPool
from chatd.service.stats import Tiers
from chatd.service.turns import Conversation, Turn, TurnRunner, require_unicode, to_message
from chatd.service.types import GenerationOptions, Message, SessionInfo
from chatd.store.records import MessageRecord
from chatd.tasks import TaskSet

log = logging.getLogger(__name__)


class SessionService:
    """Session operations for the edges (websocket, admin, terminal); turns run through ``turns``."""

    def __init__(self, turns: TurnRunner, tiers: Tiers) -> None:
        self.turns = turns
        self.tiers = tiers
        self.settings, self.repo, self.template, self.info, self.kv = (
            turns.settings, turns.repo, turns.template, turns.info, turns.kv)
        self._claims: dict[str, Turn | str] = {}
        self._background = TaskSet()
        self.pool = PrefixPool(self.kv)
        """The ephemeral caches of stateless requests (:meth:`complete`)."""

    # ------------------------------------------------------------------ helpers

    def _claim(self, session_id: str, holder: Turn | str) -> None:
        if session_id in self._claims:
            raise Busy("a generation or another change is already running in this session")
        self._claims[session_id] = holder

    def _unclaim(self, session_id: str, holder: Turn | str) -> None:
        if self._claims.get(session_id) is holder:
            del self._claims[session_id]

    def is_generating(self, session_id: str) -> bool:
        return isinstance(self._claims.get(session_id), Turn)

    @property
    def num_generating(self) -> int:
        return sum(isinstance(c, Turn) for c in self._claims.values())

    def session_info(self, record: SessionRecord) -> SessionInfo:
        """A session's record and where its cache is now."""
        return SessionInfo.of(record, self.tiers.tier(record.session_id))

    # ------------------------------------------------------------------ sessions

    async def create(self, *, system: str | None = None, title: str | None = None) -> SessionInfo:
        """Create a session, with ``system`` as message 0 when given.

        Raises BadRequest (text that is not valid Unicode), TooLarge or ContextLengthExceeded (the
        system prompt); the input is checked and tokenised before the session is stored, so a refused
        create leaves nothing behind.
        """
        if system is not None and len(system) > self.settings.server.max_message_chars:
            raise TooLarge(f"system prompt exceeds the limit of {self.settings.server.max_message_chars} characters")
        require_unicode(system or "", "system prompt")
        require_unicode(title or "", "title")
        ids = self.template.message_ids("system", system, 0) if system else None
        if ids is not None and len(ids) >= self.info.max_context:
            raise ContextLengthExceeded("the system prompt does not fit the model's context")
        session_id = new_session_id()
        record = await self.repo.create_session(session_id, (title or "").strip()[:200])
        if system and ids is not None:
            await self.repo.append_message(session_id, "system", system, ids)
            record = await self.turns.require(session_id)
        return self.session_info(record)

    async def get(self, session_id: str) -> tuple[SessionInfo, list[MessageRecord]]:
        record = await self.turns.require(session_id)
        messages = await self.repo.get_messages(session_id)
        return self.session_info(record), messages

    async def resume(self, session_id: str) -> tuple[SessionInfo, list[Message]]:
        """The session and its messages; restoring its cache starts right away in the background."""
        info, messages = await self.get(session_id)
        if not self.kv.is_resident(session_id) and messages and session_id not in self._claims:
            ids = self.template.conversation_ids(m.token_ids for m in messages)
            self._background.spawn(self._restore_quietly(session_id, ids))
        return info, [to_message(m, with_usage=True) for m in messages]

    async def _restore_quietly(self, session_id: str, ids: Sequence[int]) -> None:
        try:
            await self.kv.restore(session_id, ids)
        except ChatdError as exc:
            log.info("background restore of %s skipped: %s", session_id[:8], exc.message)
        except Exception:
            log.exception("background restore of %s failed", session_id[:8])

    async def restore(self, session_id: str) -> Tier:
        """Load the session's cache now (operator action)."""
        await self.turns.require(session_id)
        messages = await self.repo.get_messages(session_id)
        ids = self.template.conversation_ids(m.token_ids for m in messages)
        return await self.kv.restore(session_id, ids)

    async def evict(self, session_id: str) -> bool:
        """Snapshot to disk and free memory now. Raises Busy while the session generates."""
        await self.turns.require(session_id)
        if session_id in self._claims:
            raise Busy("the session is generating")
        return await self.kv.evict(session_id)

    async def delete(self, session_id: str) -> bool:
        """Delete the session, its messages and snapshot. A running generation is cancelled first.
        False when there was no such session (also for an id outside the session-id format)."""
        if not is_session_id(session_id):
            return False  # it names no session, and the snapshot store refuses to build a path from it
        holder = self._claims.get(session_id)
        if isinstance(holder, Turn):
            holder.cancel()
            if holder.task is not None:
                with contextlib.suppress(Exception):
                    await asyncio.shield(holder.task)
        deleted = await self.repo.delete_session(session_id)
        await self.kv.drop(session_id)
        return deleted

    async def cancel(self, session_id: str) -> bool:
        """Cancel the session's running generation; False when none is running."""
        holder = self._claims.get(session_id)
        if isinstance(holder, Turn):
            holder.cancel()
            return True
        return False

    # ------------------------------------------------------------------ turns

    def send(self, session_id: str, content: str, params: GenerationOptions | None = None) -> Turn:
        """Start a turn: append a user message and generate the reply.

        Raises Busy immediately when the session is already changing; everything else (NotFound,
        BadRequest, ContextLengthExceeded) is raised from the turn's stream before any token.
        """
        turn = Turn(session_id)
        self._claim(session_id, turn)
        turn.task = asyncio.ensure_future(self._guard(turn, self.turns.send(turn, content, params)))
        return turn

    def edit(self, session_id: str, index: int, content: str, params: GenerationOptions | None = None) -> Turn:
        """Replace message ``index`` and drop the messages after it (kept as edit history).

        The turn's result is a TurnResult (a user message was edited: a new reply is generated) or
        an EditResult (system or assistant message)."""
        turn = Turn(session_id)
        self._claim(session_id, turn)
        turn.task = asyncio.ensure_future(self._guard(turn, self.turns.edit(turn, index, content, params)))
        return turn

    def converse(self, session_id: str, messages: Conversation, params: GenerationOptions | None = None) -> Turn:
        """Bring the session to ``messages`` (a whole conversation, ending with a user message) and reply.

        Stored messages that equal the caller's are kept; from the first that differs they are replaced, as
        an edit replaces them (see :meth:`TurnRunner.converse`). Raises Busy immediately when the session is
        already changing; NotFound, BadRequest and ContextLengthExceeded come from the turn's stream."""
        turn = Turn(session_id)
        self._claim(session_id, turn)
        turn.task = asyncio.ensure_future(self._guard(turn, self.turns.converse(turn, messages, params)))
        return turn

    def complete(self, messages: Conversation, params: GenerationOptions | None = None, *,
                 partition: str = "") -> Turn:
        """Reply to a conversation that is stored nowhere (a stateless request), in a pool cache chosen by
        its longest shared prefix (:class:`~chatd.service.pool.PrefixPool`). ``partition`` keeps callers apart: a
        request takes over only caches of its own partition.

        Raises BadRequest or TooLarge immediately for a conversation no turn may take; the turn's
        ``session_id`` is the pool cache's id, which is no session and must not be shown to the caller."""
        prompt = self.turns.render(messages)
        turn = Turn(self.pool.choose(prompt, partition, busy=self._claims.__contains__))
        self._claim(turn.session_id, turn)
        turn.task = asyncio.ensure_future(self._guard(turn, self.turns.complete(turn, prompt, messages, params)))
        return turn

    async def _guard(self, turn: Turn, work: Coroutine[Any, Any, None]) -> None:
        try:
            await work
        except ChatdError as exc:
            turn.fail(exc)
        except Exception:
            log.exception("turn in session %s failed", turn.session_id[:8])
            turn.fail(Internal("the turn failed"))
        finally:
            self._unclaim(turn.session_id, turn)

    async def shutdown(self) -> None:
        """Cancel running turns and wait for their replies to be committed."""
        for holder in list(self._claims.values()):
            if isinstance(holder, Turn):
                holder.cancel()
        tasks = [h.task for h in self._claims.values() if isinstance(h, Turn) and h.task is not None]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self._background.cancel()
