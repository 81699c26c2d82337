"""Transparent huge pages under the engine's CPU tensors (chatd/engine/hugepages.py): the system's mode read
from sysfs; a fresh tensor advised before it is written, and one advised after, end up on huge pages where the
system lends them on request (``madvise``, this project's machines); a loaded runner's weights and its KV
pool do, and a runner told not to leaves its pool on small pages."""

from __future__ import annotations

from pathlib import Path

import torch

from chatd.engine.hugepages import HUGE_PAGE, advise_huge_pages, huge_page_bytes, thp_mode
from chatd.engine.runner import ModelRunner

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
    tensor = torch.ones(32 << 20, dtype=torch.uint8)  # written on small pages
    if MODE == "madvise":
        assert huge_page_bytes(tensor) == 0
    advice = advise_huge_pages([tensor])
    if not LENDS:
        assert advice == advice.__class__(0, 0)
        return
    assert advice.collapsed >= 14  # the 15-16 regions inside the tensor, not the ends it shares
    assert huge_page_bytes(tensor) >= 28 << 20
    assert torch.all(tensor == 1)  # the copy into huge pages kept the contents


def test_small_tensors_are_left_alone() -> None:
    assert advise_huge_pages([torch.ones(1000), torch.ones(HUGE_PAGE // 16)]).regions == 0


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
    if LENDS:
        assert sum(huge_page_bytes(t) > 0 for t in weights) >= len(forward.weights.layers)
