"""Turns: a user message in, a generated reply out, both committed to the store.

A :class:`Turn` is the handle a caller streams from; it owns its event queue, and only its own
methods (:meth:`Turn.push`, :meth:`Turn.finish`, :meth:`Turn.fail`) put events in it. A
:class:`TurnRunner` carries a turn out: it validates, commits the user message before any
generation starts, leases the session's cache from the KV manager, streams the engine's pieces into
the turn, and commits the reply when generation ends, also when it was cancelled or the reader went
away, so a crash loses nothing that was acknowledged.

Claiming a session (one change at a time) is the session service's business, not this module's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

from chatd.chat.template import ChatTemplate
from chatd.config import Settings
from chatd.counters import Counters
from chatd.domain import FinishReason, Role, SessionRecord, is_valid_unicode
from chatd.engine.model.runner import ModelInfo
from chatd.engine.model.sampling import SamplingParams
from chatd.engine.worker import EngineWorker, GenerationFailed, GenerationHandle, GenerationResult, TextPiece
from chatd.errors import BadRequest, ChatdError, ContextLengthExceeded, NotFound, ReplyNotSaved, TooLarge
from chatd.kv.manager import KVManager, Lease
from chatd.kv.prefix import common_prefix_len
from chatd.service.types import EditResult, GenerationOptions, Message, TurnResult, Usage
from chatd.store.records import MessageRecord
from chatd.store.repo import Repo

log = logging.getLogger(__name__)

TITLE_CHARS = 60
REPLY_COMMIT_DELAYS_S = (0.05, 0.25, 1.0)
"""Pauses between the attempts to store a reply (so 4 attempts in about 1.3 s) before the client is told
``reply_not_saved``: a store that is briefly locked or out of space gets a chance to recover."""

Conversation = Sequence[tuple[Role, str]]
"""A whole conversation sent by a caller that keeps it (the OpenAI API): (role, content) pairs, ending
with a user message."""


def _title(content: str) -> str:
    """A session's title from the first message it gets: its words, one space apart, cut to TITLE_CHARS."""
    return " ".join(content.split())[:TITLE_CHARS]


def to_message(record: MessageRecord, *, with_usage: bool = False) -> Message:
    """A stored message; ``with_usage`` adds a reply's finish reason and usage, and a user message's unanswered mark
    (what a resumed conversation shows)."""
    reply = with_usage and record.role == "assistant"
    return Message(index=record.index, role=record.role, content=record.content,  # type: ignore[arg-type]
                   created_at=record.created_at,
                   finish_reason=record.finish_reason if reply else None,  # type: ignore[arg-type]
                   usage=Usage.from_dict(record.usage) if reply and record.usage else None,
                   unanswered=True if with_usage and record.unanswered else None)


def require_unicode(text: str, what: str) -> None:
    """Raise BadRequest when ``text`` holds a lone surrogate: the tokenizer and the store cannot encode it.

    The wire's parser refuses such frames already; this guards every other caller of the service.
    """
    if not is_valid_unicode(text):
        raise BadRequest(f"{what} is not valid Unicode (it holds a lone surrogate)")


def _transient(session_id: str, index: int, role: Role, content: str, token_ids: tuple[int, ...], *,
               finish_reason: FinishReason | None = None) -> MessageRecord:
    """A message of a stateless request: shaped like a stored one, stored nowhere."""
    return MessageRecord(message_id=0, session_id=session_id, index=index, role=role, content=content,
                         token_ids=token_ids, created_at=datetime.now(UTC), finish_reason=finish_reason, usage=None)


async def _ready(user: MessageRecord) -> MessageRecord:
    return user


async def _settle(task: asyncio.Future[MessageRecord]) -> None:
    """Wait for a commit that is going ahead anyway (shielded from a cancelled caller); its own error, if
    any, is logged: the caller has another one to report."""
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        if not task.done():
            raise
    except Exception:
        log.info("storing a message failed while the turn failed for another reason", exc_info=True)


class Turn:
    """A change of one session in progress. Iterate :meth:`stream` for text; :attr:`result` is set at the end.

    Events arrive in order: text pieces, then exactly one of a result (:meth:`finish`) or an error
    (:meth:`fail`). :meth:`cancel` is safe at any time, from any task, before or after generation starts.
    """

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id
        self.result: TurnResult | EditResult | None = None
        self.task: asyncio.Task[None] | None = None
        self._events: asyncio.Queue[str | TurnResult | EditResult | BaseException] = asyncio.Queue()
        self._generation: GenerationHandle | None = None
        self._cancelled = False
        self._ended = False

    # ------------------------------------------------------------------ producer side (TurnRunner)

    def push(self, text: str) -> None:
        """Deliver a piece of generated text to the reader."""
        if not self._ended:
            self._events.put_nowait(text)

    def finish(self, result: TurnResult | EditResult) -> None:
        """End the turn with its result; later events are ignored."""
        if not self._ended:
            self._ended = True
            self._events.put_nowait(result)

    def fail(self, error: BaseException) -> None:
        """End the turn with an error (the reader's :meth:`stream` raises it); later events are ignored."""
        if not self._ended:
            self._ended = True
            self._events.put_nowait(error)

    def attach(self, generation: GenerationHandle) -> None:
        """The engine generation producing this turn's text; a cancel requested earlier reaches it now."""
        self._generation = generation
        if self._cancelled:
            generation.cancel()

    # ------------------------------------------------------------------ reader side

    def cancel(self) -> None:
        """Stop generating; the partial reply is kept with finish_reason "cancelled"."""
        self._cancelled = True
        if self._generation is not None:
            self._generation.cancel()

    @property
    def cancel_requested(self) -> bool:
        return self._cancelled

    async def stream(self) -> AsyncIterator[str]:
        """Text pieces as generated. Raises the turn's error (a ChatdError) if it failed."""
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


@dataclass
class TurnRunner:
    """Carries out ``send`` and ``edit`` turns for sessions the caller has already claimed."""

    settings: Settings
    repo: Repo
    template: ChatTemplate
    info: ModelInfo
    worker: EngineWorker
    kv: KVManager
    counters: Counters
    on_turn: list[Callable[[TurnResult], None]] = field(default_factory=list)
    """Hooks called with every committed turn (metrics)."""

    async def require(self, session_id: str) -> SessionRecord:
        """The session's record; NotFound when there is no such session."""
        record = await self.repo.get_session(session_id)
        if record is None:
            raise NotFound("no such session")
        return record

    async def _conversation(self, session_id: str) -> tuple[SessionRecord, list[MessageRecord]]:
        """The session's record and active messages in one read; NotFound when there is no such session."""
        try:
            return await self.repo.get_conversation(session_id)
        except NotFound:
            raise NotFound("no such session") from None

    def check_content(self, content: str) -> None:
        """Raise BadRequest (empty, not valid Unicode) or TooLarge for message content no turn may take."""
        if not content.strip():
            raise BadRequest("message content must not be empty")
        self._check_text(content)

    def _check_text(self, content: str) -> None:
        if len(content) > self.settings.server.max_message_chars:
            raise TooLarge(
                f"message of {len(content)} characters exceeds the limit of {self.settings.server.max_message_chars}")
        require_unicode(content, "message content")

    def _resolve(self, params: GenerationOptions | None, prompt_len: int) -> SamplingParams:
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

    async def send(self, turn: Turn, content: str, params: GenerationOptions | None) -> None:
        """Append a user message and generate the reply."""
        started = time.monotonic()
        self.check_content(content)
        record, messages = await self._conversation(turn.session_id)
        user_ids = self.template.message_ids("user", content, len(messages))
        prompt = self.template.prompt_ids([*(m.token_ids for m in messages), user_ids])
        resolved = self._resolve(params, len(prompt))

        async def store() -> MessageRecord:
            # One transaction: the message, and the title of a session that has none.
            return await self.repo.append_message(turn.session_id, "user", content, user_ids, unanswered=True,
                                                  title=None if record.title else _title(content))

        await self._generate(turn, store(), prompt, resolved, started, invalidated_from=None)

    async def edit(self, turn: Turn, index: int, content: str, params: GenerationOptions | None) -> None:
        """Replace message ``index``, drop the later ones (kept as edit history) and, for a user message,
        generate a new reply. The cache stays valid up to the first token that changed."""
        started = time.monotonic()
        self.check_content(content)
        await self.require(turn.session_id)
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
            turn.finish(EditResult(turn.session_id, to_message(edited), invalidated_from))
            return
        prompt = [*kept, *new_ids, *self.template.generation_prompt_ids]
        resolved = self._resolve(params, len(prompt))

        async def store() -> MessageRecord:
            user, _ = await self.repo.replace_from(turn.session_id, index, role, content, new_ids, unanswered=True)
            return user

        await self._generate(turn, store(), prompt, resolved, started, invalidated_from=invalidated_from)

    def check_conversation(self, messages: Conversation) -> None:
        """Raise BadRequest or TooLarge for a conversation no turn may take: it must end with a user
        message with content; system and assistant messages may be empty."""
        if not messages or messages[-1][0] != "user":
            raise BadRequest("the conversation must end with a user message")
        for role, content in messages:
            if role == "user":
                self.check_content(content)
            else:
                self._check_text(content)

    async def complete(self, turn: Turn, prompt: Sequence[int], messages: Conversation,
                       params: GenerationOptions | None) -> None:
        """Generate a reply to a conversation that is stored nowhere (a stateless request): ``turn.session_id``
        names an ephemeral cache (never snapshotted) whose longest shared prefix with ``prompt`` is reused.
        ``prompt`` is :meth:`render` of ``messages``."""
        started = time.monotonic()
        resolved = self._resolve(params, len(prompt))
        user = _transient(turn.session_id, len(messages) - 1, "user", messages[-1][1], ())
        await self._generate(turn, _ready(user), list(prompt), resolved, started, invalidated_from=None,
                             stored=False)

    def render(self, messages: Conversation) -> list[int]:
        """The prompt ids of a whole conversation (each message rendered at its position)."""
        self.check_conversation(messages)
        return self.template.prompt_ids(self.template.message_ids(role, content, index)
                                        for index, (role, content) in enumerate(messages))

    async def converse(self, turn: Turn, messages: Conversation, params: GenerationOptions | None) -> None:
        """Bring a stored session to the conversation the caller sent, like an edit, and reply to it.

        Messages equal (role and content) to the stored ones keep their stored ids, so a reply the server
        generated keeps its exact ids. From the first message that differs, the stored messages are replaced
        (the old ones archived as edit history, as :meth:`edit` does) by the caller's; the cache is cut at
        the first token that changed. The last message (a user one) is always committed anew: resending the
        stored conversation unchanged regenerates its last reply."""
        started = time.monotonic()
        self.check_conversation(messages)
        record, stored = await self._conversation(turn.session_id)
        same = 0
        while same < min(len(stored), len(messages)) and (stored[same].role, stored[same].content) == messages[same]:
            same += 1
        start = min(same, len(messages) - 1)
        kept = [m.token_ids for m in stored[:start]]
        new = [self.template.message_ids(role, content, index)
               for index, (role, content) in enumerate(messages[start:], start)]
        prompt = self.template.prompt_ids([*kept, *new])
        invalidated_from = None
        if start < len(stored):
            invalidated_from = common_prefix_len(self.template.conversation_ids(m.token_ids for m in stored),
                                                 self.template.conversation_ids([*kept, *new]))
        resolved = self._resolve(params, len(prompt))
        last = len(messages) - 1  # the user message the reply answers

        async def store() -> MessageRecord:
            role, content = messages[start]
            if start < len(stored):
                user, _ = await self.repo.replace_from(turn.session_id, start, role, content, new[0],
                                                       unanswered=start == last)
            else:
                user = await self.repo.append_message(turn.session_id, role, content, new[0],
                                                      unanswered=start == last)
            for index, ((role, content), ids) in enumerate(zip(messages[start + 1:], new[1:], strict=True),
                                                           start + 1):
                user = await self.repo.append_message(turn.session_id, role, content, ids, unanswered=index == last)
            if not record.title:
                await self.repo.set_title(turn.session_id, _title(messages[-1][1]))
            return user

        await self._generate(turn, store(), prompt, resolved, started, invalidated_from=invalidated_from)

    async def _generate(self, turn: Turn, store: Awaitable[MessageRecord], prompt: list[int],
                        params: SamplingParams, started: float, *, invalidated_from: int | None,
                        stored: bool = True) -> None:
        """Commit the turn's message(s) (``store``, resolving to the user message the reply answers) and
        generate the reply. The commit runs alongside the cache's preparation and the prompt's prefill, so
        its disk sync does not delay the first token; no text reaches the reader before it is durable. A
        failed commit stops the generation and is the turn's error."""
        committing = asyncio.ensure_future(store)
        try:
            lease = await self.kv.acquire(turn.session_id, prompt, params.max_tokens, ephemeral=not stored)
        except BaseException:
            await _settle(committing)
            raise
        result: GenerationResult | None = None
        try:
            handle = None
            if not turn.cancel_requested:
                handle = self.worker.generate(lease.cache, lease.prefill_ids, params,
                                              max_new_tokens=params.max_tokens, started_at=started)
                turn.attach(handle)
            try:
                user = await asyncio.shield(committing)
            except BaseException:
                if handle is not None:
                    handle.cancel()
                    async for _ in handle.events():  # the cache is the engine's until its last event
                        pass
                if not committing.done():  # this task was cancelled: the commit goes ahead anyway
                    await _settle(committing)
                raise
            if handle is not None:
                async for event in handle.events():
                    if isinstance(event, TextPiece):
                        turn.push(event.text)
                    elif isinstance(event, GenerationFailed):
                        raise event.error
                    else:
                        result = event
        except BaseException:
            self.kv.release(lease, ok=False)
            if not committing.done():  # e.g. the engine refused the job: the turn ends once its message is stored
                await _settle(committing)
            raise
        self.kv.release(lease, generated_ids=result.generated_ids if result else ())
        if result is not None and self.kv.snapshots is not None:
            self.kv.snapshots.observe_prefill(len(lease.prefill_ids), result.prefill_s)
        await self._commit_reply(turn, user, prompt, lease, result, started, invalidated_from, stored=stored)

    async def _commit_reply(self, turn: Turn, user: MessageRecord, prompt: list[int], lease: Lease,
                            result: GenerationResult | None, started: float, invalidated_from: int | None, *,
                            stored: bool = True) -> None:
        index = user.index + 1
        content_ids: tuple[int, ...]
        generated: tuple[int, ...]
        reason: FinishReason
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
            input_tokens=len(prompt), cached_tokens=lease.num_cached, cache_tier=lease.source,
            prefill_tokens=len(prompt) - lease.num_cached, output_tokens=len(generated),
            invalidated_from=invalidated_from, restore_ms=lease.restore_ms,
            ttft_ms=round(((first_token_at or time.monotonic()) - started) * 1000, 2),
            decode_tokens_per_s=round(tps, 2),
        )
        if stored:
            assistant = await self._store_reply(turn.session_id, user, text, ids, reason, usage)
        else:
            assistant = _transient(turn.session_id, index, "assistant", text, ids, finish_reason=reason)
        self.counters.count_turn(cached_tokens=usage.cached_tokens, prefill_tokens=usage.prefill_tokens)
        done = TurnResult(turn.session_id, to_message(user), to_message(assistant), reason, usage)
        for hook in self.on_turn:
            try:
                hook(done)
            except Exception:
                log.exception("turn hook failed")
        turn.finish(done)

    async def _store_reply(self, session_id: str, user: MessageRecord, text: str, ids: tuple[int, ...],
                           reason: FinishReason, usage: Usage) -> MessageRecord:
        """Commit the reply (clearing its user message's unanswered mark in the same transaction), retrying a
        store that fails; ReplyNotSaved when every attempt failed. A ChatdError (the session was deleted) is
        not retried."""
        for attempt, delay in enumerate((*REPLY_COMMIT_DELAYS_S, None), 1):
            try:
                return await self.repo.append_message(session_id, "assistant", text, ids, finish_reason=reason,
                                                      usage=usage.to_dict(), answers=user.message_id)
            except ChatdError:
                raise
            except Exception as exc:
                if delay is None:
                    log.warning("the reply in session %s could not be stored after %d attempts (%s: %s); its "
                                "user message stays marked unanswered", session_id[:8], attempt,
                                type(exc).__name__, exc)
                    raise ReplyNotSaved("the reply could not be saved; the message you sent is kept, marked "
                                        "unanswered") from None
                log.info("storing the reply in session %s failed (attempt %d: %s); retrying", session_id[:8],
                         attempt, type(exc).__name__)
                await asyncio.sleep(delay)
        raise AssertionError("unreachable")
