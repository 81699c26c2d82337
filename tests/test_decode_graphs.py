"""The decode step as fixed-shape graphs (chatd/engine/model/graphs.py).

On every machine: the uncaptured fixed-shape step (padding rows, padded block tables, bucketed widths)
against the eager forward, token for token, and the runner's routing. Where a CUDA device exists
(benchmarks/gpu.sh's machine): captured graphs against the same step run uncaptured."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from chatd.config import ModelSettings
from chatd.engine.model.forward import LlamaForward
from chatd.engine.model.graphs import DecodeGraphs, batch_buckets, width_buckets
from chatd.engine.model.runner import ModelRunner
from chatd.engine.pool.kvcache import SessionKV, any_layer_kv

POOL_BYTES = 64 * 1024 * 1024
PROMPT_LENGTHS = (7, 60, 131, 300)  # 300 positions span 19 blocks: past the narrowest width (16)


def _twin(runner: ModelRunner) -> ModelRunner:
    """A runner over the same weights with torch's ops alone (no native kernels) and a pool of its own."""
    assert runner.forward is not None
    twin = ModelRunner(runner.model, runner.tokenizer, runner.info,
                       LlamaForward(runner.forward.weights, runner.info.device))
    twin.configure_pool(POOL_BYTES)
    return twin


@pytest.fixture
def pair(tiny_runner: ModelRunner) -> Iterator[tuple[ModelRunner, ModelRunner]]:
    """(eager, graphs): two runners over the tiny model's weights; the second routes decode steps through
    uncaptured decode graphs for batches of up to 4."""
    eager, graphed = _twin(tiny_runner), _twin(tiny_runner)
    assert graphed.build_decode_graphs(4, capture=False) is not None
    yield eager, graphed
    assert graphed.graphs is not None
    graphed.graphs.close()


def _prompt(length: int, salt: int) -> list[int]:
    return [(97 * i + 31 * salt) % 40000 + 100 for i in range(length)]


def _prefilled(runner: ModelRunner, lengths: tuple[int, ...]) -> tuple[list[SessionKV], list[int]]:
    caches, firsts = [], []
    for salt, length in enumerate(lengths):
        cache = runner.new_cache()
        firsts.append(int(runner.prefill(cache, _prompt(length, salt)).argmax()))
        caches.append(cache)
    return caches, firsts


def test_buckets() -> None:
    assert batch_buckets(16) == [1, 2, 4, 8, 16]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert batch_buckets(1) == [1]
    assert width_buckets(512) == [16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512]
    assert width_buckets(100) == [16, 24, 32, 48, 64, 96, 100]
    assert width_buckets(20) == [16, 20]
    assert width_buckets(16) == [16]
    assert width_buckets(3) == [3]


def test_fixed_shape_step_equals_the_eager_decode(pair: tuple[ModelRunner, ModelRunner]) -> None:
    eager, graphed = pair
    graphs = graphed.graphs
    assert graphs is not None
    caches_e, firsts_e = _prefilled(eager, PROMPT_LENGTHS)
    caches_g, firsts_g = _prefilled(graphed, PROMPT_LENGTHS)
    assert firsts_e == firsts_g
    tokens = firsts_e
    # Greedy steps of 3 sessions (padded to the bucket of 4), then of all 4: every row equals the eager
    # forward's, and the padding rows touch no session.
    for step in range(6):
        rows = [0, 2, 3] if step < 3 else [0, 1, 2, 3]
        want = eager.decode([caches_e[r] for r in rows], [tokens[r] for r in rows])
        replays = graphs.replays
        got = graphed.decode([caches_g[r] for r in rows], [tokens[r] for r in rows])
        assert graphs.replays == replays + 1
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        for row, logits in zip(rows, want, strict=True):
            tokens[row] = int(logits.argmax())
        assert all(int(g.argmax()) == tokens[r] for r, g in zip(rows, got, strict=True))
    for cache_e, cache_g in zip(caches_e, caches_g, strict=True):
        assert cache_e.length == cache_g.length
        assert graphs.scratch_block not in cache_g.block_ids
        for layer in range(eager.info.num_layers):
            for a, b in zip(any_layer_kv(cache_e, layer), any_layer_kv(cache_g, layer), strict=True):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_only_decode_steps_that_fit_a_bucket_take_the_graphs(pair: tuple[ModelRunner, ModelRunner]) -> None:
    _, graphed = pair
    graphs = graphed.graphs
    assert graphs is not None
    caches, firsts = _prefilled(graphed, (20, 30, 40, 50, 60))
    replays = graphs.replays
    graphed.step(caches[:2], [[firsts[0]], [5, 6, 7]])  # a prompt chunk in the step: eager
    graphed.decode(caches, firsts)  # 5 sessions, the largest bucket is 4: eager
    assert graphs.replays == replays
    graphed.decode(caches[:4], firsts[:4])
    assert graphs.replays == replays + 1
    assert not graphs.fits([_at_length(graphed, graphs.max_context)])


def _at_length(runner: ModelRunner, length: int) -> SessionKV:
    cache = runner.new_cache()
    cache.begin(list(range(length)))
    cache.commit()
    return cache


def test_closing_the_graphs_gives_the_pool_back_whole(tiny_runner: ModelRunner) -> None:
    runner = _twin(tiny_runner)
    pool = runner.pool
    free = pool.allocator.num_available_blocks
    graphs = runner.build_decode_graphs(8, capture=False)
    assert graphs is not None
    assert pool.allocator.num_available_blocks == free - 1  # the scratch block
    caches, firsts = _prefilled(runner, (33, 70))
    runner.decode(caches, firsts)
    assert graphs.replays == 1
    for cache in caches:
        cache.free(forget=True)
    with pytest.raises(RuntimeError):  # the scratch block is held: the pool is not empty
        DecodeGraphs(graphs.forward, pool, 4, 512, capture=False)
    runner.configure_pool(POOL_BYTES)  # a new pool: the graphs of the old one are closed and dropped
    assert runner.graphs is None and runner.pool is not pool
    assert pool.allocator.num_available_blocks == free
    graphs.close()  # closing twice is harmless


def test_warm_up_builds_the_graphs_and_runs_through_them(tiny_runner: ModelRunner) -> None:
    runner = _twin(tiny_runner)
    runner.cuda_graphs = True  # as load sets it on CUDA; on the CPU the step runs uncaptured
    free = runner.pool.allocator.num_available_blocks
    runner.warm_up(4)
    graphs = runner.graphs
    assert graphs is not None and graphs.batches == [1, 2, 4]
    assert graphs.replays == 2  # the warm-up's one-session and full-batch decode steps
    assert runner.pool.allocator.num_available_blocks == free - 1
    runner.warm_up(4)  # a second warm-up keeps the graphs
    assert runner.graphs is graphs
    graphs.close()


@pytest.mark.real_model
def test_real_model_greedy_ids_through_the_fixed_shape_step(real_runner: ModelRunner) -> None:
    eager, graphed = _twin(real_runner), _twin(real_runner)
    assert graphed.build_decode_graphs(4, capture=False) is not None
    lengths = (12, 45, 140)
    caches_e, tokens_e = _prefilled(eager, lengths)
    caches_g, tokens_g = _prefilled(graphed, lengths)
    ids_e: list[list[int]] = [[t] for t in tokens_e]
    ids_g: list[list[int]] = [[t] for t in tokens_g]
    for _ in range(12):
        tokens_e = [int(x) for x in eager.decode(caches_e, tokens_e).argmax(-1)]
        tokens_g = [int(x) for x in graphed.decode(caches_g, tokens_g).argmax(-1)]
        for row in range(len(lengths)):
            ids_e[row].append(tokens_e[row])
            ids_g[row].append(tokens_g[row])
    assert ids_g == ids_e
    assert graphed.graphs is not None and graphed.graphs.replays == 12


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device (benchmarks/gpu.sh)")
@pytest.mark.parametrize("weights", ["float32", "bfloat16"])
def test_captured_graphs_replay_the_step(tiny_dir: Path, weights: str) -> None:
    """Replayed graphs give the same logits and K/V as the same step run uncaptured, at every bucket used."""
    settings = ModelSettings(source=str(tiny_dir), device="cuda", weights=weights, max_context=1024)
    runner = ModelRunner.load(settings, tiny_dir)
    reference = ModelRunner(runner.model, runner.tokenizer, runner.info, runner.forward)
    for r in (runner, reference):
        r.configure_pool(POOL_BYTES)
    captured = runner.build_decode_graphs(8, capture=True)
    uncaptured = reference.build_decode_graphs(8, capture=False)
    assert captured is not None and uncaptured is not None
    assert captured.capture_s > 0 and len(captured._graphs) == len(captured.batches) * len(captured.widths)
    lengths = (5, 17, 250, 300, 31, 700)
    caches_c, tokens_c = _prefilled(runner, lengths)
    caches_u, tokens_u = _prefilled(reference, lengths)
    assert tokens_c == tokens_u
    for step in range(5):
        count = (1, 3, 6, 2, 6)[step]
        got = runner.decode(caches_c[:count], tokens_c[:count])
        want = reference.decode(caches_u[:count], tokens_u[:count])
        assert torch.equal(got, want), (step, (got - want).abs().max())
        tokens_c[:count] = tokens_u[:count] = [int(x) for x in want.argmax(-1)]
    assert captured.replays == uncaptured.replays == 5
    for cache_c, cache_u in zip(caches_c, caches_u, strict=True):
        for layer in range(runner.info.num_layers):
            for a, b in zip(any_layer_kv(cache_c, layer), any_layer_kv(cache_u, layer), strict=True):
                assert torch.equal(a, b)
