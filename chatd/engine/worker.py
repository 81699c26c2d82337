"""The engine worker: the one thread that owns the model and every KV tensor.

The event loop hands it work through a queue and gets results back through
``loop.call_soon_threadsafe``, once per step for all the step's events (one wake-up of the loop, not
one per session); nothing here blocks the loop. Those calls are made by a second thread, the courier,
in the order the worker hands them over: waking the loop lets the loop's thread take the interpreter
lock, and the worker would then wait for it before its next step, while the loop sends the step's frames.
The courier waits there instead, and the worker starts its next step (whose native part runs without the
lock). Work is of two kinds:

* generations (:meth:`EngineWorker.generate`): each is a prefill of the tokens the cache lacks,
  then decoding until EOS, ``max_tokens``, a stop string or cancellation. Each step is one packed
  forward pass over the next token of every decoding session and up to ``prefill_chunk_tokens``
  prompt tokens of waiting generations (continuous batching): long prompts run in chunks, so they
  never freeze the other sessions' streams, and many short prompts start in the same pass;
* calls (:meth:`EngineWorker.call`): any function that touches tensors (crop, reserve, export
  for a snapshot, restore), run between steps so it never races a forward pass.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from chatd.chat.stream import IncrementalDetokenizer, StopMatcher
from chatd.counters import Counters
from chatd.domain import FinishReason
from chatd.engine.model.runner import ModelRunner
from chatd.engine.model.sampling import SamplingParams, make_generator, sample, sample_rows
from chatd.engine.pool.kvcache import SessionKV
from chatd.engine.scheduler import Scheduler
from chatd.errors import Internal

log = logging.getLogger(__name__)
T = TypeVar("T")

@dataclass(frozen=True)
class TextPiece:
    text: str


@dataclass(frozen=True)
class GenerationResult:
    """How a generation ended. ``generated_ids`` are all sampled ids (an EOS included). The cache
    holds the first ``cache_length`` ids of ``prompt + generated_ids``: the last sampled id is never
    fed, and a generation cancelled during prefill leaves only part of the prompt."""

    generated_ids: tuple[int, ...]
    content_ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason
    cache_length: int
    stopped_by_string: bool
    started_at: float
    first_token_at: float | None
    finished_at: float
    prefill_s: float

    @property
    def decode_tokens_per_s(self) -> float:
        if self.first_token_at is None or len(self.generated_ids) < 2:
            return 0.0
        elapsed = self.finished_at - self.first_token_at
        return (len(self.generated_ids) - 1) / elapsed if elapsed > 0 else 0.0


@dataclass(frozen=True)
class GenerationFailed:
    error: BaseException


Event = TextPiece | GenerationResult | GenerationFailed


def _deliver(batch: Sequence[tuple[asyncio.Queue[Event], Event]]) -> None:
    for events, event in batch:
        events.put_nowait(event)


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Callable[..., object], args: tuple[object, ...]) -> None:
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:  # that loop is closed: nobody is waiting for this any more
        log.warning("dropped an engine delivery for a closed event loop")


@dataclass(eq=False)
class _Job:
    cache: SessionKV
    prefill_ids: list[int]
    params: SamplingParams
    max_new_tokens: int
    eos_ids: frozenset[int]
    emit: Callable[[Event], None]
    detok: IncrementalDetokenizer
    stopper: StopMatcher
    started_at: float
    generator: torch.Generator | None = None
    cancelled: bool = False
    prefill_pos: int = 0
    pending: int | None = None  # sampled, not yet fed
    generated: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    unsent: int = 0  # how many of ``text``'s last pieces are not emitted yet (stream_interval_s)
    last_sent_at: float | None = None
    first_token_at: float | None = None
    prefill_done_at: float | None = None


@dataclass
class GenerationHandle:
    """A running generation. Iterate :meth:`events`; :meth:`cancel` is safe at any time."""

    _job: _Job
    _events: asyncio.Queue[Event]
    _wake: Callable[[], None]

    def cancel(self) -> None:
        self._job.cancelled = True
        self._wake()

    async def events(self) -> AsyncIterator[Event]:
        """Text pieces, then exactly one GenerationResult or GenerationFailed."""
        while True:
            event = await self._events.get()
            yield event
            if not isinstance(event, TextPiece):
                return


class _Call:
    def __init__(self, fn: Callable[[], Any], done: Callable[[Any, BaseException | None], None],
                 then_job: bool = False) -> None:
        self.fn = fn
        self.done = done
        self.then_job = then_job  # a generation job follows once it has run (a turn's cache being prepared)


_STOP = object()
# After preparing a turn's cache, how long the engine waits for that turn's job before its next step, so
# that sessions starting together prefill in one step rather than one step apart (the job follows its cache
# within a few ms; a step of many decoding sessions takes longer than that).
JOB_WAIT_S = 0.01


class EngineWorker:
    """Owns the device. Start once, submit from the event loop, stop at shutdown."""

    def __init__(self, runner: ModelRunner, *, prefill_chunk_tokens: int = 256, max_batch_size: int = 16,
                 counters: Counters | None = None, decode_threads: int = 0, stream_interval_s: float = 0.0) -> None:
        """``decode_threads``: torch threads for decode steps; 0 = the same as prefill's. Prefill uses
        whatever torch is set to when the worker is made (``[model] threads``). ``stream_interval_s``: the least
        time between two text pieces of one generation (its first piece goes at once; text decoded meanwhile
        waits for the next piece, and the last piece goes with the end)."""
        self.runner = runner
        # The event loop encodes with runner.tokenizer while this thread decodes; a fast tokenizer is
        # one Rust object that must not be borrowed from two threads at once, so decode with a copy.
        self.tokenizer = copy.deepcopy(runner.tokenizer)
        self.scheduler: Scheduler[_Job] = Scheduler(prefill_chunk_tokens=prefill_chunk_tokens,
                                                    max_batch_size=max_batch_size)
        self.prefill_threads = torch.get_num_threads()
        self.decode_threads = decode_threads or self.prefill_threads
        self.stream_interval_s = stream_interval_s
        self._inbox: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        # Deliveries to event loops, in order: (loop, callback, args); None ends the courier thread.
        self._courier_queue: queue.SimpleQueue[tuple[asyncio.AbstractEventLoop, Callable[..., object],
                                                     tuple[object, ...]] | None] = queue.SimpleQueue()
        self._courier: threading.Thread | None = None
        # Events the worker thread emitted since its last flush, in order, with their loop and queue: sent
        # to each loop in one call after every step (``_flush``).
        self._outbox: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue[Event], Event]] = []
        # Set (once) when the thread ended on an error it could not contain; then every job and call fails.
        self.failure: BaseException | None = None
        # Its num_engine_* totals are written only by the worker thread.
        self.counters = counters if counters is not None else Counters()

    # ------------------------------------------------------------------ lifecycle (event loop side)

    def start(self) -> None:
        if self._thread is None:
            self._courier = threading.Thread(target=self._carry, name="chatd-engine-courier", daemon=True)
            self._courier.start()
            self._thread = threading.Thread(target=self._run, name="chatd-engine", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 30.0) -> bool:
        """Cancel running generations and join the thread; whether it has ended (False: still in a step
        after ``timeout``)."""
        thread = self._thread
        if thread is None:
            return True
        self._inbox.put(_STOP)
        thread.join(timeout)
        self._thread = None
        if not thread.is_alive() and self._courier is not None:
            self._courier_queue.put(None)  # after everything the worker handed over
            self._courier.join(timeout)
            self._courier = None
        return not thread.is_alive()

    @property
    def alive(self) -> bool:
        """True while the thread runs and has not died of an error (False before start and after stop)."""
        return self._thread is not None and self._thread.is_alive() and self.failure is None

    @property
    def num_active(self) -> int:
        return len(self.scheduler)

    def _wake(self) -> None:
        self._inbox.put(None)

    async def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn()`` on the worker thread between steps; return its result or raise its error."""
        # Shield: once queued the call runs anyway; a cancelled caller must not lose track of it.
        return await asyncio.shield(self.submit(fn))

    async def warm_up(self, max_batch_size: int) -> float:
        """Run the runner's warm-up on the worker thread, the one that runs every later step (its kernels'
        one-time set-up, and torch's OpenMP threads, belong to it); returns seconds."""
        return await self.call(lambda: self.runner.warm_up(max_batch_size))

    def submit(self, fn: Callable[[], T], *, then_job: bool = False) -> asyncio.Future[T]:
        """Queue ``fn()`` for the worker thread now (calls run in the order they are queued, between
        steps) and return a future of its result. Unlike :meth:`call`, the queueing happens before the
        caller's next await, so a caller can decide, queue, and release a lock before the work runs.

        ``then_job``: a generation job follows as soon as the result is back (a turn's cache being
        prepared); the worker then waits up to JOB_WAIT_S for it before stepping, so it joins the next
        step."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def done(result: Any, error: BaseException | None) -> None:
            def settle() -> None:
                if future.done():
                    return
                if error is not None:
                    future.set_exception(error)
                else:
                    future.set_result(result)
            self._deliver_soon(loop, settle)

        self._inbox.put(_Call(fn, done, then_job))
        if self.failure is not None:
            self._drain_dead_inbox()
        return future

    def generate(self, cache: SessionKV, prefill_ids: Sequence[int], params: SamplingParams,
                 *, max_new_tokens: int | None = None, started_at: float | None = None) -> GenerationHandle:
        """Start generating after appending ``prefill_ids`` (non-empty) to ``cache``.

        The cache must not be used by anything else until the handle yields its final event.
        """
        if not prefill_ids:
            raise ValueError("a generation needs at least one token to prefill")
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()

        def emit(event: Event) -> None:
            if threading.current_thread() is self._thread:
                self._outbox.append((loop, events, event))  # sent with the step's other events
            else:
                self._deliver_soon(loop, events.put_nowait, event)

        job = _Job(
            cache=cache, prefill_ids=list(prefill_ids), params=params,
            max_new_tokens=max_new_tokens if max_new_tokens is not None else params.max_tokens,
            eos_ids=self.runner.info.eos_token_ids, emit=emit,
            detok=IncrementalDetokenizer(self.tokenizer), stopper=StopMatcher(params.stop),
            started_at=started_at if started_at is not None else time.monotonic(),
            generator=None if params.greedy else make_generator(params),
        )
        self._inbox.put(job)
        if self.failure is not None:
            self._drain_dead_inbox()
        return GenerationHandle(job, events, self._wake)

    # ------------------------------------------------------------------ worker thread

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:
            # Per-job errors are contained in _step and _sample_and_accept; reaching here is a bug in
            # the worker itself. Fail every job and call, now and later, instead of leaving them hanging.
            log.critical("the engine thread died; every generation fails from now on", exc_info=exc)
            self.failure = exc
            for job in self.scheduler.clear():
                job.emit(GenerationFailed(Internal("the engine stopped")))
            self._drain_dead_inbox()
            self._flush()

    def _drain_dead_inbox(self) -> None:
        """Fail everything queued to a dead worker (safe from any thread; each item is taken once)."""
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, _Job):
                item.emit(GenerationFailed(Internal("the engine stopped")))
            elif isinstance(item, _Call):
                item.done(None, Internal("the engine stopped"))

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            busy = len(self.scheduler) > 0
            try:
                item = self._inbox.get(block=not busy)
            except queue.Empty:
                item = None
            awaited = 0  # jobs announced by the calls run since the last step, not arrived yet
            deadline = 0.0
            while True:
                if item is _STOP:
                    for job in self.scheduler:
                        job.cancelled = True
                    self._reap_cancelled()
                    self._flush()
                    return
                if isinstance(item, _Job):
                    self.scheduler.add(item)
                    awaited = max(awaited - 1, 0)
                elif isinstance(item, _Call):
                    if self._run_call(item) and item.then_job:
                        awaited += 1
                        deadline = time.monotonic() + JOB_WAIT_S
                try:
                    if awaited and (remaining := deadline - time.monotonic()) > 0:
                        item = self._inbox.get(timeout=remaining)
                    else:
                        item = self._inbox.get_nowait()
                except queue.Empty:
                    break
            self._reap_cancelled()
            self._step()
            self._flush()

    def _flush(self) -> None:
        """Send the events emitted since the last flush: one ``call_soon_threadsafe`` per event loop."""
        if not self._outbox:
            return
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Event], Event]]] = {}
        for loop, events, event in self._outbox:
            batches.setdefault(loop, []).append((events, event))
        self._outbox.clear()
        for loop, batch in batches.items():
            self._deliver_soon(loop, _deliver, batch)

    def _deliver_soon(self, loop: asyncio.AbstractEventLoop, callback: Callable[..., object], *args: object) -> None:
        """``loop.call_soon_threadsafe(callback, *args)``, made by the courier thread where it runs (after
        everything handed to it before), else here."""
        courier = self._courier
        if courier is not None and courier.is_alive():
            self._courier_queue.put((loop, callback, args))
        else:
            _call_soon(loop, callback, args)

    def _carry(self) -> None:
        """The courier thread: make the deliveries the worker hands over, in order, until told to stop."""
        while (item := self._courier_queue.get()) is not None:
            _call_soon(*item)

    def _run_call(self, call: _Call) -> bool:
        """Run a call and settle its future; whether it succeeded."""
        try:
            result = call.fn()
        except BaseException as exc:
            call.done(None, exc)
            return False
        call.done(result, None)
        return True

    def _reap_cancelled(self) -> None:
        for job in self.scheduler.take(lambda job: job.cancelled):
            self._finish(job, "cancelled")

    def _step(self) -> None:
        """One forward pass over the step the scheduler plans (:meth:`Scheduler.schedule`), then the sampling of
        every row whose run ended a prompt or fed a decode token."""
        batch = self.scheduler.schedule()
        if batch is None:
            return
        jobs = batch.jobs
        self._use_threads(self.prefill_threads if batch.wide else self.decode_threads)
        try:
            logits = self.runner.step([job.cache for job in jobs], batch.runs)
        except Exception as exc:
            for job in jobs:
                self.scheduler.remove(job)
                self._fail(job, exc)
            return
        decoding = batch.decoding
        if decoding:
            self.counters.num_engine_decode_steps += 1
            self.counters.num_engine_decode_tokens += len(decoding)
        for job in decoding:
            job.pending = None
        sampled: list[tuple[int, _Job]] = list(enumerate(decoding))
        for row, (job, chunk) in enumerate(batch.prefilling, start=len(decoding)):
            self.counters.num_engine_prefill_tokens += len(chunk)
            if self.scheduler.prefilled(job, len(chunk)):
                job.prefill_done_at = time.monotonic()
                sampled.append((row, job))
        picks = self._sample(logits, sampled)
        for (row, job), pick in zip(sampled, picks, strict=True):
            was_decoding = row < len(decoding)
            if self._accept_pick(job, pick) != was_decoding:
                # A decoding job that finished leaves the batch; a prompt that finished joins it.
                (self.scheduler.remove if was_decoding else self.scheduler.start_decoding)(job)

    @staticmethod
    def _use_threads(num_threads: int) -> None:
        # Decode steps may run on fewer threads than prompt chunks ([model] decode_threads). By default both use
        # every thread, the faster setting for one stream and for many, as long as this is the one thread running
        # torch's parallel regions (chatd/engine/threads.py).
        if torch.get_num_threads() != num_threads:
            torch.set_num_threads(num_threads)

    @staticmethod
    def _sample(logits: torch.Tensor, sampled: Sequence[tuple[int, _Job]]) -> list[int | Exception]:
        """The next token of each ``(row, job)`` from ``logits[row]``, every row in one pass on the logits'
        device (one wait for it); a row that cannot be sampled gets its error instead."""
        if not sampled:
            return []
        rows = [row for row, _ in sampled]
        jobs = [job for _, job in sampled]
        # Every row, as in a decode step: no index to copy to the device.
        chosen = logits if rows == list(range(logits.shape[0])) else logits[rows]
        try:
            return list(sample_rows(chosen, [job.params for job in jobs], [job.generator for job in jobs]))
        except Exception:
            log.exception("sampling a step's rows together failed; sampling them one by one")
        picks: list[int | Exception] = []
        for row, job in sampled:
            try:
                picks.append(sample(logits[row], job.params, job.generator))
            except Exception as exc:
                picks.append(exc)
        return picks

    def _accept_pick(self, job: _Job, pick: int | Exception) -> bool:
        """Record ``job``'s sampled token; return False when the job finished. An error (the row could not be
        sampled, a detokenizer failure) fails this job alone."""
        try:
            if isinstance(pick, Exception):
                raise pick
            return self._accept(job, pick)
        except Exception as exc:
            self._fail(job, exc)
            return False

    def _accept(self, job: _Job, token_id: int) -> bool:
        """Record a sampled token; return False when the job finished."""
        now = time.monotonic()
        if job.first_token_at is None:
            job.first_token_at = now
        job.generated.append(token_id)
        if token_id in job.eos_ids:
            self._finish(job, "stop")
            return False
        piece = job.stopper.feed(job.detok.push(token_id))
        if piece:
            job.text.append(piece)
            job.unsent += 1
            if job.last_sent_at is None or now - job.last_sent_at >= self.stream_interval_s:
                self._send_text(job, now)
        if job.stopper.stopped:
            self._finish(job, "stop", by_string=True)
            return False
        if job.cancelled:
            self._finish(job, "cancelled")
            return False
        if len(job.generated) >= job.max_new_tokens:
            self._finish(job, "length")
            return False
        job.pending = token_id
        return True

    def _send_text(self, job: _Job, now: float) -> None:
        """Emit the text generated since the last piece sent, as one piece."""
        if job.unsent:
            job.emit(TextPiece("".join(job.text[-job.unsent:])))
            job.unsent = 0
            job.last_sent_at = now

    def _finish(self, job: _Job, reason: FinishReason, *, by_string: bool = False) -> None:
        if not by_string:
            tail = job.stopper.feed(job.detok.flush()) + job.stopper.flush()
            if tail:
                job.text.append(tail)
                job.unsent += 1
        now = time.monotonic()
        self._send_text(job, now)
        content = [t for t in job.generated if t not in job.eos_ids]
        job.emit(GenerationResult(
            generated_ids=tuple(job.generated), content_ids=tuple(content), text="".join(job.text),
            finish_reason=reason, cache_length=job.cache.length, stopped_by_string=by_string,
            started_at=job.started_at, first_token_at=job.first_token_at, finished_at=now,
            prefill_s=(job.prefill_done_at or now) - job.started_at,
        ))

    def _fail(self, job: _Job, exc: Exception) -> None:
        log.exception("generation failed", exc_info=exc)
        self._send_text(job, time.monotonic())
        job.emit(GenerationFailed(Internal("generation failed")))
