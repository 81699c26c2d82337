"""The native decode-attention kernel (chatd/engine/decode_attention.c): built once per machine and cached,
equal to torch's attention over the same block tables, and used by the compact forward's decode steps
with the same greedy tokens as without it."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from chatd.engine.kvcache import KVPool, attend
from chatd.engine.native import EngineKernels, build, load_kernels
from chatd.engine.runner import ModelRunner


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> EngineKernels:
    loaded = load_kernels(tmp_path_factory.mktemp("native"))
    assert loaded is not None, "the test machine has a C compiler (make test installs one: scripts/setup.sh)"
    return loaded


def test_the_library_is_built_once_and_reused(tmp_path: Path) -> None:
    first = build(tmp_path)
    stamp = first.stat().st_mtime_ns
    assert build(tmp_path) == first and first.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no scratch left behind


def test_loading_the_kernel_leaves_the_process_arithmetic_alone(kernel: EngineKernels) -> None:
    # Linked with -ffast-math, a shared library switches the process to flush denormals to zero on load,
    # and then a temperature of 1e-40 divided scores by 0 in sampling.
    assert torch.tensor(1e-40).item() > 0
    assert (torch.tensor([1.0]) * 1e-39 / 1e-39).item() == pytest.approx(1.0)


def test_without_a_compiler_the_engine_keeps_torch_attention(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    with caplog.at_level(logging.WARNING, logger="chatd.engine.native"):
        assert load_kernels(tmp_path / "cache") is None
    assert "native kernels unavailable" in caplog.text
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(9, 3), (4, 4), (8, 1)])
def test_kernel_equals_torch_attention_over_scattered_blocks(kernel: EngineKernels, num_heads: int,
                                                             num_kv_heads: int) -> None:
    torch.manual_seed(num_heads * 10 + num_kv_heads)
    head_dim, layers = 64, 2
    pool = KVPool.for_budget(4 << 20, layers, num_kv_heads, head_dim, torch.float32, "cpu")
    pool.tensors.kv.normal_()
    size = pool.block_size
    lengths = [1, 5, size, size + 1, 7 * size - 3, 40]
    width = max(-(-n // size) for n in lengths)
    order = torch.randperm(pool.num_blocks)[: len(lengths) * width].view(len(lengths), width).to(torch.int32)
    # Rows of the step in another order than the tables, and some rows of the step not decode rows at all.
    rows = torch.tensor([7, 0, 3, 5, 1, 2], dtype=torch.int32)
    q = torch.randn(8, num_heads + num_kv_heads, head_dim)[:, :num_heads]  # a view, as the forward passes it
    out = torch.full((8, num_heads * head_dim), float("nan"))
    keys, values = pool.tensors.kv[1, 0], pool.tensors.kv[1, 1]
    kernel.decode_attention(q, out, rows, keys, values, order, torch.tensor(lengths, dtype=torch.int32),
                            head_dim ** -0.5)
    group = num_heads // num_kv_heads
    for i, n in enumerate(lengths):
        ids = order[i].long()
        k = keys[:, ids].flatten(1, 2)[:, :n][None]
        v = values[:, ids].flatten(1, 2)[:, :n][None]
        folded = q[int(rows[i])].reshape(num_kv_heads, group, head_dim)[None]
        expected = attend(folded, [(k, v)], None, head_dim ** -0.5).reshape(-1)
        torch.testing.assert_close(out[int(rows[i])], expected, rtol=1e-5, atol=1e-5)
    untouched = sorted(set(range(8)) - set(rows.tolist()))
    assert torch.isnan(out[untouched]).all()


def test_decode_steps_with_the_kernel_equal_torch_attention(real_runner: ModelRunner) -> None:
    """The fp32 engine on the CPU decodes through the kernel (tests/test_kv_pool.py checks its greedy tokens
    against transformers over fragmented tables); here each step's logits equal the torch path's."""
    forward = real_runner.forward
    assert forward is not None and forward.kernels is not None
    prompts = [real_runner.tokenizer(text * n).input_ids for n, text in
               enumerate(("The capital of France is", "Water boils at", "One, two, three, four,"), start=1)]

    def run(kernel: EngineKernels | None) -> list[torch.Tensor]:
        saved, forward.kernels = forward.kernels, kernel
        caches = [real_runner.new_cache() for _ in prompts]
        try:
            tokens = [int(real_runner.prefill(c, p).argmax()) for c, p in zip(caches, prompts, strict=True)]
            steps = []
            for _ in range(6):
                logits = real_runner.decode(caches, tokens)
                steps.append(logits)
                tokens = logits.argmax(-1).tolist()
            return steps
        finally:
            forward.kernels = saved
            for cache in caches:
                cache.free()

    with_kernel, with_torch = run(forward.kernels), run(None)
    for a, b in zip(with_kernel, with_torch, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        assert a.argmax(-1).tolist() == b.argmax(-1).tolist()


def test_rope_and_the_kv_write_are_bit_for_bit_the_torch_paths(real_runner: ModelRunner) -> None:
    """The native RoPE + K/V write leaves the same bits in the pool as torch's ops, so snapshots do not
    depend on which path computed them; a prompt's logits (its attention runs through torch either way)
    are identical too."""
    forward = real_runner.forward
    assert forward is not None and forward.kernels is not None
    prompt = real_runner.tokenizer("A long time ago, in a kingdom by the sea, there lived a " * 6).input_ids

    def prefill(kernels: EngineKernels | None) -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
        saved, forward.kernels = forward.kernels, kernels
        cache = real_runner.new_cache()
        try:
            logits = [real_runner.prefill(cache, prompt[:40]), real_runner.prefill(cache, prompt[40:])]
            return logits, [(k.clone(), v.clone()) for k, v in cache.filled_layers()]
        finally:
            forward.kernels = saved
            cache.free()

    (native_logits, native_kv), (torch_logits, torch_kv) = prefill(forward.kernels), prefill(None)
    for a, b in zip(native_logits, torch_logits, strict=True):
        assert torch.equal(a, b)
    for (k1, v1), (k2, v2) in zip(native_kv, torch_kv, strict=True):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


def test_a_position_past_the_rope_table_is_refused_and_changes_nothing(tiny_runner: ModelRunner) -> None:
    forward = tiny_runner.forward
    assert forward is not None and forward.kernels is not None
    limit = forward.cos.shape[0]
    cache = tiny_runner.new_cache()
    try:
        tiny_runner.prefill(cache, [5] * (limit - 2))
        with pytest.raises(IndexError, match="RoPE positions"):
            tiny_runner.prefill(cache, [6, 7, 8])
        assert cache.length == limit - 2  # the step was aborted: nothing appended
        tiny_runner.prefill(cache, [6, 7])  # up to the last position is fine
        assert cache.length == limit
    finally:
        cache.free()
