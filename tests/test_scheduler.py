"""The engine's step planning (chatd.engine.scheduler), without a model: which generations and prompt chunks go
into each step, in what order, and how a long prompt is split."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from chatd.engine.scheduler import PREFILL_SLACK, WIDE_STEP_ROWS, Batch, Scheduler


@dataclass(eq=False)
class Job:
    name: str
    prefill_ids: list[int] = field(default_factory=list)
    prefill_pos: int = 0
    pending: int | None = None


def _decoding(scheduler: Scheduler[Job], name: str, token: int = 1) -> Job:
    job = Job(name, [0], 1, token)
    scheduler.start_decoding(job)
    return job


def test_running_generations_take_rows_first_and_rotate_when_more_than_a_batch() -> None:
    scheduler: Scheduler[Job] = Scheduler(prefill_chunk_tokens=16, max_batch_size=2)
    jobs = [_decoding(scheduler, name, token) for name, token in (("a", 10), ("b", 11), ("c", 12))]
    first = scheduler.schedule()
    assert first is not None and first.decoding == jobs[:2] and first.runs == [[10], [11]]
    second = scheduler.schedule()
    assert second is not None and [job.name for job in second.decoding] == ["c", "a"]
    assert scheduler.schedule() is not None
    assert len(scheduler) == 3


def test_prompts_share_the_step_budget_and_a_small_rest_goes_in_whole() -> None:
    budget = 64
    slack = int(budget * PREFILL_SLACK)
    scheduler: Scheduler[Job] = Scheduler(prefill_chunk_tokens=budget, max_batch_size=4)
    short = Job("short", list(range(40)))
    almost = Job("almost", list(range(budget - 40 + slack)))  # its rest exceeds what is left by the slack
    later = Job("later", list(range(5)))
    for job in (short, almost, later):
        scheduler.add(job)
    batch = scheduler.schedule()
    assert batch is not None and [(job.name, len(chunk)) for job, chunk in batch.prefilling] == [
        ("short", 40), ("almost", budget - 40 + slack)]
    assert batch.jobs == [short, almost] and batch.wide
    # Both prompts completed: they leave the waiting queue; "later" is next.
    assert scheduler.prefilled(short, 40) and scheduler.prefilled(almost, budget - 40 + slack)
    assert list(scheduler.waiting) == [later]


def test_a_long_prompt_is_split_at_the_budget_and_waits_its_turn() -> None:
    scheduler: Scheduler[Job] = Scheduler(prefill_chunk_tokens=32, max_batch_size=4)
    long, other = Job("long", list(range(100))), Job("other", list(range(10)))
    scheduler.add(long)
    scheduler.add(other)
    batch = scheduler.schedule()
    assert batch is not None and [len(chunk) for _, chunk in batch.prefilling] == [32]
    assert batch.prefilling[0][1] == list(range(32))
    assert not scheduler.prefilled(long, 32)
    assert list(scheduler.waiting) == [other, long]  # round robin
    batch = scheduler.schedule()
    assert batch is not None and [(job.name, len(chunk)) for job, chunk in batch.prefilling] == [
        ("other", 10), ("long", 22)]
    assert batch.prefilling[1][1] == list(range(32, 54))


def test_a_step_is_wide_only_with_a_prompt_chunk_and_enough_rows() -> None:
    decoding = [Job(str(i), [0], 1, i) for i in range(WIDE_STEP_ROWS)]
    assert not Batch(decoding, []).wide  # decode rows alone never are
    assert Batch(decoding[:1], [(Job("p"), list(range(WIDE_STEP_ROWS - 1)))]).wide
    assert not Batch(decoding[:1], [(Job("p"), list(range(WIDE_STEP_ROWS - 2)))]).wide


def test_taking_and_removing_generations() -> None:
    scheduler: Scheduler[Job] = Scheduler(prefill_chunk_tokens=16, max_batch_size=4)
    waiting = Job("w", [1, 2])
    scheduler.add(waiting)
    running = _decoding(scheduler, "r")
    assert list(scheduler) == [waiting, running]
    assert scheduler.take(lambda job: job.name == "r") == [running]
    scheduler.remove(waiting)
    assert len(scheduler) == 0 and scheduler.schedule() is None
    with pytest.raises(AssertionError):
        _ = Batch([Job("x", [0], 1, None)], []).runs
