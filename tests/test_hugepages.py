"""Transparent huge pages under the engine's CPU tensors (chatd/engine/pool/hugepages.py): the system's mode read
from sysfs; a fresh tensor advised before it is written, and one advised after, end up on huge pages where the
system lends them on request (``madvise``, this project's machines); a loaded runner's weights and its KV
pool do, and a runner told not to leaves its pool on small pages. A pool's pages are faulted in ahead of use
by a thread, its contents untouched, and given back to the system when its server closes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from chatd.config import Settings
from chatd.engine.model.runner import ModelRunner
from chatd.engine.model.weights import PackedBf16Linear
from chatd.engine.pool.hugepages import (
    HUGE_PAGE,
    advise_huge_pages,
    huge_page_bytes,
    populate_in_background,
    release_pages,
    thp_mode,
)
from chatd.service.core import Chatd

MODE = thp_mode()
LENDS = MODE in ("always", "madvise")  # huge pages to a range that asks


def test_the_mode_is_the_bracketed_word(tmp_path: Path) -> None:
    enabled = tmp_path / "enabled"
    enabled.write_text("always [madvise] never\n")
    assert thp_mode(enabled) == "madvise"
    enabled.write_text("[never] madvise always\n")
    assert thp_mode(enabled) == "never"
    assert thp_mode(tmp_path / "missing") == ""


def test_a_fresh_tensor_advised_before_it_is_written_gets_huge_pages() -> None:
    tensor = torch.empty(64 << 20, dtype=torch.uint8)  # a fresh mapping: nothing written yet
    advice = advise_huge_pages([tensor])
    tensor.fill_(1)
    if not LENDS:  # "never": nothing was asked, nothing changed
        assert advice.regions == 0 and huge_page_bytes(tensor) == 0
        return
    assert 31 <= advice.regions <= 33  # the 2 MiB regions the 64 MiB touch (an end shared with unmapped memory fails)
    assert huge_page_bytes(tensor) >= 60 << 20  # all but the unaligned ends


def test_a_written_tensor_is_collapsed_into_huge_pages_at_once() -> None:
    # written on small pages; past glibc's largest mmap threshold (32 MiB), so always a fresh mapping, never heap
    # memory an earlier test's tensor left advised
    tensor = torch.ones(64 << 20, dtype=torch.uint8)
    if MODE == "madvise":
        assert huge_page_bytes(tensor) == 0
    advice = advise_huge_pages([tensor])
    if not LENDS:
        assert advice == advice.__class__(0, 0)
        return
    assert advice.collapsed >= 30  # the 31-32 regions inside the tensor, not the ends it shares
    assert huge_page_bytes(tensor) >= 60 << 20
    assert torch.all(tensor == 1)  # the copy into huge pages kept the contents


def test_small_tensors_are_left_alone() -> None:
    assert advise_huge_pages([torch.ones(1000), torch.ones(HUGE_PAGE // 16)]).regions == 0


@pytest.mark.skipif(not PackedBf16Linear.available(), reason="this torch build has no oneDNN bf16 linear ops")
def test_an_opaque_prepacked_weight_is_skipped_not_an_error() -> None:
    packed = PackedBf16Linear(torch.randn(1024, 1024)).packed  # oneDNN's own layout: no storage to advise
    assert advise_huge_pages([packed]).regions == 0


def _resident_bytes(tensor: torch.Tensor) -> int:
    """Rss of the mappings that overlap ``tensor``'s memory (/proc/self/smaps)."""
    storage = tensor.untyped_storage()
    start, end = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
    total, overlaps = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=1)[0] if line else ""
        if "-" in head and not head.endswith(":"):
            lo, _, hi = head.partition("-")
            overlaps = int(lo, 16) < end and int(hi, 16) > start
        elif overlaps and head == "Rss:":
            total += int(line.split()[1]) * 1024
    return total


def test_a_tensor_is_populated_in_the_background_with_its_contents_kept() -> None:
    tensor = torch.empty(64 << 20, dtype=torch.uint8)  # a fresh mapping: nothing written yet
    advise_huge_pages([tensor])
    tensor[: 1 << 20] = 7  # in use already: the first MiB written
    tensor[-4096:] = 9
    before = _resident_bytes(tensor)
    assert before < 32 << 20  # most of it not faulted in yet
    thread = populate_in_background(tensor, chunk=8 << 20)
    assert thread is not None
    thread.join(60)
    assert not thread.is_alive()
    assert _resident_bytes(tensor) >= 64 << 20  # every page faulted in, without writing
    assert torch.all(tensor[: 1 << 20] == 7) and torch.all(tensor[-4096:] == 9)
    if LENDS:
        assert huge_page_bytes(tensor) >= 60 << 20
    assert populate_in_background(torch.empty(4, device="meta")) is None  # not CPU memory: nothing to do


def _fresh_pool_runner(runner: ModelRunner, huge_pages: bool) -> ModelRunner:
    """The same model and forward over a new pool of its own."""
    other = ModelRunner(runner.model, runner.tokenizer, runner.info, runner.forward, runner.kernels)
    other.huge_pages = huge_pages
    other.configure_pool(64 << 20)
    return other


def test_a_runner_puts_its_weights_and_pool_on_huge_pages_unless_told_not_to(real_runner: ModelRunner) -> None:
    assert real_runner.huge_pages  # [model] huge_pages defaults to true on the CPU
    forward = real_runner.forward
    assert forward is not None
    weights = forward.weight_tensors()
    assert sum(t.numel() * t.element_size() for t in weights) > 400 << 20  # the fp32 model: every projection
    prompt = real_runner.tokenizer("The quick brown fox jumps over the lazy dog. " * 40).input_ids
    for huge_pages in (True, False):
        runner = _fresh_pool_runner(real_runner, huge_pages)
        cache = runner.new_cache()
        try:
            runner.prefill(cache, prompt)
            on_huge = huge_page_bytes(runner.pool.tensors.kv)
        finally:
            cache.free()
        if huge_pages and LENDS:
            assert on_huge >= 2 * HUGE_PAGE
        if not huge_pages and MODE == "madvise":
            assert on_huge == 0
        # With huge pages a thread faults the pool's pages in ahead of use (each would cost the step that first
        # writes it a 2 MiB allocation); without, they fault in on use.
        assert (runner.pool.populating is not None) == huge_pages
        assert runner.pool.wait_populated(60)
        if huge_pages:
            assert _resident_bytes(runner.pool.tensors.kv) >= 60 << 20
    if LENDS:
        assert sum(huge_page_bytes(t) > 0 for t in weights) >= len(forward.weights.layers)


def test_released_pages_go_back_to_the_system_and_read_as_zeros() -> None:
    tensor = torch.full((32 << 20,), 5, dtype=torch.uint8)
    before = _resident_bytes(tensor)  # of its mapping, which may hold other memory as well
    assert before >= 32 << 20
    assert release_pages(tensor)
    assert before - _resident_bytes(tensor) >= 31 << 20  # all but the pages its ends share with other memory
    assert int(tensor[1 << 20]) == 0 and int(tensor[-(1 << 20)]) == 0  # still mapped: touching it is harmless
    assert not release_pages(torch.empty(4, device="meta"))


async def test_a_closed_server_gives_its_populated_pool_back_at_once(
        make_settings: Callable[..., Settings], tiny_dir: Path, tiny_runner: ModelRunner) -> None:
    """Tests open a server per test in one process: a pool left to the garbage collector stays resident
    (populated whole) until a full collection, and a few dozen of them exhausted a 24 GiB machine."""
    settings = make_settings(tiny_dir, cache={"device_budget_mb": 256}, model={"huge_pages": True})
    async with Chatd.open(settings, runner=tiny_runner, background=False) as core:
        pool = core.runner.pool
        assert pool.populating is not None and pool.wait_populated(60)
        populated = _resident_bytes(pool.tensors.kv)
        assert populated >= 250 << 20
    assert pool.populated
    assert populated - _resident_bytes(pool.tensors.kv) >= 250 << 20  # pool still referenced here; its memory not
