"""SessionService: create / send / edit / resume / evict / restore / delete.

One conversation changes one step at a time: a session with a generation (or any other change)
in progress answers ``busy`` to the next change. A turn commits the user message before any
generation starts and the assistant message when generation ends — also when it was cancelled or
the client went away — so a crash loses nothing that was acknowledged.

Turns run as their own tasks, detached from whoever reads them: a reader that disappears only
cancels the generation; the bookkeeping (committing the partial reply, returning the cache) always
completes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

from chatd.chat.template import ChatTemplate
from chatd.config import Settings
from chatd.domain import FinishReason, Tier, new_session_id
from chatd.engine.runner import ModelInfo
from chatd.engine.sampling import SamplingParams
from chatd.engine.worker import EngineWorker, GenerationFailed, GenerationHandle, GenerationResult, TextPiece
from chatd.errors import BadRequest, Busy, ChatdError, ContextLengthExceeded, Internal, NotFound, TooLarge
from chatd.kv.manager import KVManager, Lease, common_prefix_len
from chatd.protocol import GenerationParams, Message, SessionInfo, Usage
from chatd.store.repo import MessageRecord, Repo, SessionRecord

log = logging.getLogger(__name__)

TITLE_CHARS = 60


def to_message(record: MessageRecord, *, with_usage: bool = False) -> Message:
    """The wire form of a stored message; ``with_usage`` adds an assistant reply's finish reason and usage."""
    message = Message(index=record.index, role=record.role, content=record.content,  # type: ignore[arg-type]
                      created_at=record.created_at)
    if with_usage and record.role == "assistant":
        message.finish_reason = record.finish_reason  # type: ignore[assignment]
        message.usage = Usage.model_validate(record.usage) if record.usage else None
    return message


@dataclass(frozen=True)
class TurnResult:
    session_id: str
    user_message: Message
    assistant_message: Message
    finish_reason: FinishReason
    usage: Usage


@dataclass(frozen=True)
class EditResult:
    """An edit of a system or assistant message: nothing is generated."""

    session_id: str
    message: Message
    invalidated_from: int


class Turn:
    """A generation in progress. Iterate :meth:`stream` for text; :attr:`result` is set at the end."""

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id
        self.result: TurnResult | EditResult | None = None
        self._events: asyncio.Queue[str | TurnResult | EditResult | BaseException] = asyncio.Queue()
        self._handle: GenerationHandle | None = None
        self._cancelled = False
        self.task: asyncio.Task[None] | None = None

    def cancel(self) -> None:
        """Stop generating; the partial reply is kept with finish_reason "cancelled"."""
        self._cancelled = True
        if self._handle is not None:
            self._handle.cancel()

    @property
    def cancel_requested(self) -> bool:
        return self._cancelled

    async def stream(self) -> AsyncIterator[str]:
        """Text pieces as generated. Raises the turn's error (ChatdError) if it failed."""
        while True:
            event = await self._events.get()
            if isinstance(event, str):
                yield event
            elif isinstance(event, (TurnResult, EditResult)):
                self.result = event
                return
            else:
                raise event

    async def wait(self) -> TurnResult | EditResult:
        """Drain the stream and return the result."""
        async for _ in self.stream():
            pass
        assert self.result is not None
        return self.result


class SessionService:
    def __init__(self, settings: Settings, repo: Repo, template: ChatTemplate, info: ModelInfo,
                 worker: EngineWorker, kv: KVManager) -> None:
        self.settings = settings
        self.repo = repo
        self.template = template
        self.info = info
        self.worker = worker
        self.kv = kv
        self._claims: dict[str, Turn | str] = {}
        self._background: set[asyncio.Task[object]] = set()
        self.on_turn: list[Callable[[TurnResult], None]] = []
        self.num_turns = 0
        self.num_cached_tokens = 0
        self.num_prefill_tokens = 0

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

    async def _require(self, session_id: str) -> SessionRecord:
        record = await self.repo.get_session(session_id)
        if record is None:
            raise NotFound("no such session")
        return record

    async def tier_of(self, session_id: str) -> Tier:
        if self.kv.is_resident(session_id):
            return "device"
        if self.kv.snapshots is not None and await self.kv.snapshots.record(session_id) is not None:
            return "disk"
        return "none"

    async def session_info(self, record: SessionRecord, tier: Tier | None = None) -> SessionInfo:
        return SessionInfo(
            session_id=record.session_id, title=record.title, created_at=record.created_at,
            updated_at=record.updated_at, message_count=record.message_count,
            token_count=record.token_count, tier=tier or await self.tier_of(record.session_id))

    def _check_content(self, content: str) -> None:
        if not content.strip():
            raise BadRequest("message content must not be empty")
        if len(content) > self.settings.server.max_message_chars:
            raise TooLarge(
                f"message of {len(content)} characters exceeds the limit of {self.settings.server.max_message_chars}")

    def _resolve(self, params: GenerationParams | None, prompt_len: int) -> SamplingParams:
        """Resolve sampling params; refuse before any work when the reply cannot fit the context."""
        resolved = SamplingParams.resolve(params, self.settings.generation)
        room = self.info.max_context - prompt_len
        if room < 1:
            raise ContextLengthExceeded(
                f"the conversation has {prompt_len} tokens; the model's context holds {self.info.max_context}")
        explicit = params is not None and params.max_tokens is not None
        if resolved.max_tokens > room:
            if explicit:
                raise ContextLengthExceeded(
                    f"{prompt_len} prompt tokens + max_tokens {resolved.max_tokens} exceed the model's context "
                    f"of {self.info.max_context} tokens")
            resolved = SamplingParams(room, resolved.temperature, resolved.top_p, resolved.top_k,
                                      resolved.seed, resolved.stop)
        self.kv.check_fits(prompt_len + resolved.max_tokens)
        return resolved

    def _spawn(self, coro: Coroutine[Any, Any, object]) -> asyncio.Task[object]:
        task: asyncio.Task[object] = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    # ------------------------------------------------------------------ sessions

    async def create(self, *, system: str | None = None, title: str | None = None) -> SessionInfo:
        if system is not None and len(system) > self.settings.server.max_message_chars:
            raise TooLarge(f"system prompt exceeds the limit of {self.settings.server.max_message_chars} characters")
        session_id = new_session_id()
        record = await self.repo.create_session(session_id, (title or "").strip()[:200])
        if system:
            ids = self.template.message_ids("system", system, 0)
            if len(ids) >= self.info.max_context:
                await self.repo.delete_session(session_id)
                raise ContextLengthExceeded("the system prompt does not fit the model's context")
            await self.repo.append_message(session_id, "system", system, ids)
            record = await self._require(session_id)
        return await self.session_info(record, "none")

    async def get(self, session_id: str) -> tuple[SessionInfo, list[MessageRecord]]:
        record = await self._require(session_id)
        messages = await self.repo.get_messages(session_id)
        return await self.session_info(record), messages

    async def resume(self, session_id: str) -> tuple[SessionInfo, list[Message]]:
        """The session and its messages; restoring its cache starts right away in the background."""
        info, messages = await self.get(session_id)
        if not self.kv.is_resident(session_id) and messages and session_id not in self._claims:
            ids = self.template.conversation_ids(m.token_ids for m in messages)
            self._spawn(self._restore_quietly(session_id, ids))
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
        await self._require(session_id)
        messages = await self.repo.get_messages(session_id)
        ids = self.template.conversation_ids(m.token_ids for m in messages)
        return await self.kv.restore(session_id, ids)

    async def evict(self, session_id: str) -> bool:
        """Snapshot to disk and free memory now. Raises Busy while the session generates."""
        await self._require(session_id)
        if session_id in self._claims:
            raise Busy("the session is generating")
        return await self.kv.evict(session_id)

    async def delete(self, session_id: str) -> bool:
        """Delete the session, its messages and snapshot. A running generation is cancelled first."""
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

    def send(self, session_id: str, content: str, params: GenerationParams | None = None) -> Turn:
        """Start a turn: append a user message and generate the reply.

        Raises Busy immediately when the session is already changing; everything else (NotFound,
        BadRequest, ContextLengthExceeded) is raised from the turn's stream before any token.
        """
        turn = Turn(session_id)
        self._claim(session_id, turn)
        turn.task = asyncio.ensure_future(self._guard(turn, self._send(turn, content, params)))
        return turn

    def edit(self, session_id: str, index: int, content: str, params: GenerationParams | None = None) -> Turn:
        """Replace message ``index`` and drop the messages after it (kept as edit history).

        The turn's result is a TurnResult (a user message was edited: a new reply is generated) or
        an EditResult (system or assistant message)."""
        turn = Turn(session_id)
        self._claim(session_id, turn)
        turn.task = asyncio.ensure_future(self._guard(turn, self._edit(turn, index, content, params)))
        return turn

    async def _guard(self, turn: Turn, work: object) -> None:
        try:
            await work  # type: ignore[misc]
        except ChatdError as exc:
            turn._events.put_nowait(exc)
        except Exception:
            log.exception("turn in session %s failed", turn.session_id[:8])
            turn._events.put_nowait(Internal("the turn failed"))
        finally:
            self._unclaim(turn.session_id, turn)

    async def _send(self, turn: Turn, content: str, params: GenerationParams | None) -> None:
        started = time.monotonic()
        self._check_content(content)
        record = await self._require(turn.session_id)
        messages = await self.repo.get_messages(turn.session_id)
        user_ids = self.template.message_ids("user", content, len(messages))
        prompt = self.template.prompt_ids([*(m.token_ids for m in messages), user_ids])
        resolved = self._resolve(params, len(prompt))
        user = await self.repo.append_message(turn.session_id, "user", content, user_ids)
        if not record.title:
            await self.repo.set_title(turn.session_id, " ".join(content.split())[:TITLE_CHARS])
        await self._generate(turn, user, prompt, resolved, started, invalidated_from=None)

    async def _edit(self, turn: Turn, index: int, content: str, params: GenerationParams | None) -> None:
        started = time.monotonic()
        self._check_content(content)
        await self._require(turn.session_id)
        messages = await self.repo.get_messages(turn.session_id)
        if not 0 <= index < len(messages):
            raise BadRequest(f"message index {index} out of range (the session has {len(messages)} messages)")
        role = messages[index].role
        new_ids = self.template.message_ids(role, content, index)
        old_ids = self.template.conversation_ids(m.token_ids for m in messages)
        kept = self.template.conversation_ids(m.token_ids for m in messages[:index])
        invalidated_from = common_prefix_len(old_ids, [*kept, *new_ids])
        if role != "user":
            if len(kept) + len(new_ids) >= self.info.max_context:
                raise ContextLengthExceeded("the edited conversation does not fit the model's context")
            edited, _ = await self.repo.replace_from(turn.session_id, index, role, content, new_ids)
            turn._events.put_nowait(EditResult(turn.session_id, to_message(edited), invalidated_from))
            return
        prompt = [*kept, *new_ids, *self.template.generation_prompt_ids]
        resolved = self._resolve(params, len(prompt))
        user, _ = await self.repo.replace_from(turn.session_id, index, role, content, new_ids)
        await self._generate(turn, user, prompt, resolved, started, invalidated_from=invalidated_from)

    async def _generate(self, turn: Turn, user: MessageRecord, prompt: list[int], params: SamplingParams,
                        started: float, *, invalidated_from: int | None) -> None:
        lease = await self.kv.acquire(turn.session_id, prompt, params.max_tokens)
        result: GenerationResult | None = None
        try:
            if turn.cancel_requested:
                result = None
            else:
                handle = self.worker.generate(lease.cache, lease.prefill_ids, params,
                                              max_new_tokens=params.max_tokens, started_at=started)
                turn._handle = handle
                if turn.cancel_requested:
                    handle.cancel()
                async for event in handle.events():
                    if isinstance(event, TextPiece):
                        turn._events.put_nowait(event.text)
                    elif isinstance(event, GenerationFailed):
                        raise event.error
                    else:
                        result = event
        except BaseException:
            self.kv.release(lease, ok=False)
            raise
        self.kv.release(lease, generated_ids=result.generated_ids if result else ())
        if result is not None and self.kv.snapshots is not None:
            self.kv.snapshots.observe_prefill(len(lease.prefill_ids), result.prefill_s)
        await self._commit_reply(turn, user, prompt, lease, result, started, invalidated_from)

    async def _commit_reply(self, turn: Turn, user: MessageRecord, prompt: list[int], lease: Lease,
                            result: GenerationResult | None, started: float, invalidated_from: int | None) -> None:
        index = user.index + 1
        content_ids: tuple[int, ...]
        generated: tuple[int, ...]
        if result is None:  # cancelled before the first forward pass
            text, content_ids, generated, reason = "", (), (), "cancelled"
            first_token_at, tps = None, 0.0
        else:
            text, generated, reason = result.text, result.generated_ids, result.finish_reason
            content_ids = result.content_ids
            if result.stopped_by_string:
                # The ids ran past the stop string; store ids that match the text kept.
                content_ids = tuple(self.template.encode_content(text))
            first_token_at, tps = result.first_token_at, result.decode_tokens_per_s
        ids = self.template.assistant_ids(content_ids, index)
        usage = Usage(
            input_tokens=len(prompt), cached_tokens=lease.num_cached, cache_tier=lease.tier,
            prefill_tokens=len(prompt) - lease.num_cached, output_tokens=len(generated),
            invalidated_from=invalidated_from, restore_ms=lease.restore_ms,
            ttft_ms=round(((first_token_at or time.monotonic()) - started) * 1000, 2),
            decode_tokens_per_s=round(tps, 2),
        )
        assistant = await self.repo.append_message(turn.session_id, "assistant", text, ids,
                                                   finish_reason=reason, usage=usage.model_dump())
        self.num_turns += 1
        self.num_cached_tokens += usage.cached_tokens
        self.num_prefill_tokens += usage.prefill_tokens
        done = TurnResult(turn.session_id, to_message(user), to_message(assistant), reason, usage)  # type: ignore[arg-type]
        for hook in self.on_turn:
            try:
                hook(done)
            except Exception:
                log.exception("turn hook failed")
        turn._events.put_nowait(done)

    async def shutdown(self) -> None:
        """Cancel running turns and wait for their replies to be committed."""
        for holder in list(self._claims.values()):
            if isinstance(holder, Turn):
                holder.cancel()
        tasks = [h.task for h in self._claims.values() if isinstance(h, Turn) and h.task is not None]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        for task in list(self._background):
            task.cancel()
