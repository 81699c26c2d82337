"""Which generations and prompt chunks go into the engine's next step (continuous batching).

The scheduler holds two queues: generations whose prompt is still being prefilled (``waiting``) and generations
that decode one token a step (``running``). :meth:`Scheduler.schedule` plans one step: the next token of up to
``max_batch_size`` running generations and as many waiting prompt tokens as fit in ``prefill_chunk_tokens``,
packed into one forward pass. A long prompt is split over several steps while the other sessions keep streaming,
and the short prompts of many new sessions start in the same pass. It knows nothing of tensors or threads: the
engine worker (:mod:`chatd.engine.worker`) runs the plan and reports back through :meth:`Scheduler.prefilled`,
:meth:`Scheduler.start_decoding` and :meth:`Scheduler.remove`.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

# A prompt whose rest exceeds what is left of a step's prompt budget by at most this fraction of
# prefill_chunk_tokens goes in whole, rather than leaving a few tokens for the next step: its first token then
# comes a whole step sooner, for a step at most this much longer (sixteen new sessions' short prompts all start
# in one step: docs/engine.md, "Scheduling").
PREFILL_SLACK = 1 / 8
# A step with a prompt chunk and at least this many rows in all is "wide": it runs on the prefill thread count.
WIDE_STEP_ROWS = 8


class Schedulable(Protocol):
    """What the scheduler reads and writes of a generation."""

    prefill_ids: list[int]
    """The tokens to append to the cache before the first sampled one."""
    prefill_pos: int
    """How many of ``prefill_ids`` earlier steps appended."""
    pending: int | None
    """The sampled token the next step feeds (running generations only)."""


J = TypeVar("J", bound=Schedulable)


@dataclass(frozen=True)
class Batch(Generic[J]):
    """One step's plan: every ``decoding`` generation feeds its pending token, every ``prefilling`` one a chunk of
    its prompt, in that order (row ``i`` of the step's logits belongs to ``jobs[i]``)."""

    decoding: list[J]
    prefilling: list[tuple[J, list[int]]]

    @property
    def jobs(self) -> list[J]:
        return [*self.decoding, *(job for job, _ in self.prefilling)]

    @property
    def runs(self) -> list[list[int]]:
        """The token runs of the step, one per job: a pending token, or a prompt chunk."""
        tokens = [job.pending for job in self.decoding]
        assert all(token is not None for token in tokens), "every decoding job has a sampled token to feed"
        return [[token] for token in tokens if token is not None] + [chunk for _, chunk in self.prefilling]

    @property
    def wide(self) -> bool:
        """A prompt chunk is in the step and the step has WIDE_STEP_ROWS rows or more."""
        return bool(self.prefilling) and len(self.decoding) + sum(len(c) for _, c in self.prefilling) >= WIDE_STEP_ROWS


class Scheduler(Generic[J]):
    """The waiting and running generations, and the plan of each step. Not thread-safe: the engine thread owns it."""

    def __init__(self, *, prefill_chunk_tokens: int, max_batch_size: int) -> None:
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.max_batch_size = max_batch_size
        self.waiting: deque[J] = deque()
        """Generations still prefilling, in the order their chunks are taken (round robin)."""
        self.running: deque[J] = deque()
        """Generations decoding, in the order they get rows (rotated when there are more than a batch)."""

    def __len__(self) -> int:
        return len(self.waiting) + len(self.running)

    def __iter__(self) -> Iterator[J]:
        return itertools.chain(self.waiting, self.running)

    def add(self, job: J) -> None:
        """A new generation: its prompt waits for the next steps."""
        self.waiting.append(job)

    def schedule(self) -> Batch[J] | None:
        """The next step's plan, or None when there is nothing to run.

        Running generations come first, up to ``max_batch_size``; when more are running, the queue rotates so the
        others go first next time. Then waiting prompts, in order, until ``prefill_chunk_tokens`` are taken; a
        prompt whose rest would leave no more than PREFILL_SLACK of the budget for a later step goes in whole."""
        decoding = list(itertools.islice(self.running, self.max_batch_size))
        if len(self.running) > len(decoding):
            self.running.rotate(-len(decoding))
        budget = self.prefill_chunk_tokens
        slack = int(self.prefill_chunk_tokens * PREFILL_SLACK)
        prefilling: list[tuple[J, list[int]]] = []
        for job in self.waiting:
            if budget <= 0:
                break
            rest = len(job.prefill_ids) - job.prefill_pos
            size = rest if rest <= budget + slack else budget
            chunk = job.prefill_ids[job.prefill_pos : job.prefill_pos + size]
            prefilling.append((job, chunk))
            budget -= len(chunk)
        if not decoding and not prefilling:
            return None
        return Batch(decoding, prefilling)

    def prefilled(self, job: J, num_tokens: int) -> bool:
        """``job``'s chunk of ``num_tokens`` went through; whether its prompt is complete. An incomplete one goes to
        the back of the waiting queue (its next chunk waits its turn); a complete one leaves it, and the caller
        either :meth:`start_decoding` or drops it."""
        job.prefill_pos += num_tokens
        self.waiting.remove(job)
        if job.prefill_pos < len(job.prefill_ids):
            self.waiting.append(job)
            return False
        return True

    def start_decoding(self, job: J) -> None:
        """A generation whose prompt is complete decodes from the next step on."""
        self.running.append(job)

    def remove(self, job: J) -> None:
        """``job`` leaves the scheduler (finished, failed or cancelled)."""
        for queue in (self.waiting, self.running):
            if job in queue:
                queue.remove(job)
                return

    def take(self, predicate: Callable[[J], bool]) -> list[J]:
        """Remove and return every generation ``predicate`` holds for (waiting ones first)."""
        taken = [job for job in self if predicate(job)]
        for job in taken:
            self.remove(job)
        return taken

    def clear(self) -> list[J]:
        """Remove and return every generation."""
        return self.take(lambda _: True)
