"""Engine pieces: sampling, the paged session cache, batched decode, reconcile and eviction policy."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from chatd.config import GenerationSettings, ModelSettings
from chatd.engine.model.runner import ModelRunner
from chatd.engine.model.sampling import (
    NUCLEUS_CANDIDATES,
    SamplingError,
    SamplingParams,
    draw_rows,
    greedy_rows,
    make_generator,
    sample,
    sample_rows,
)
from chatd.engine.pool.kvcache import KVPool, any_layer_kv, appending
from chatd.errors import ConfigError
from chatd.kv import prefix
from chatd.kv.policy import CacheRecord, CostModel, choose_victims, idle_victims, persist_candidates, prefer_restore
from chatd.kv.prefix import common_prefix_len, longest_reusable, reusable_prefix
from chatd.service.types import GenerationOptions


def test_sampling_rules() -> None:
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    greedy = SamplingParams(max_tokens=1)
    assert sample(logits, greedy, None) == 1
    top1 = SamplingParams(max_tokens=1, temperature=1.0, top_k=1, seed=3)
    assert all(sample(logits, top1, make_generator(top1)) == 1 for _ in range(5))
    nucleus = SamplingParams(max_tokens=1, temperature=1.0, top_p=0.01, seed=3)
    assert sample(logits, nucleus, make_generator(nucleus)) == 1
    wide = SamplingParams(max_tokens=1, temperature=1.0, top_k=2, seed=11)
    gen = make_generator(wide)
    draws = {sample(logits, wide, gen) for _ in range(200)}
    assert draws == {1, 2}  # top-k 2 keeps exactly the two best tokens, both get drawn


def test_rows_sampled_together_equal_rows_sampled_alone() -> None:
    """A step's rows are sampled in one pass (one argmax, one finiteness check, one top-k); each row's
    draws come from its own generator, so they equal sampling that row alone with the same seed."""
    torch.manual_seed(0)
    logits = torch.randn(6, 3000) * 4
    params = [SamplingParams(max_tokens=1),  # greedy
              SamplingParams(max_tokens=1, temperature=0.7, top_p=0.95, top_k=50, seed=1),  # the defaults
              SamplingParams(max_tokens=1, temperature=1.0, top_k=5, seed=2),
              SamplingParams(max_tokens=1, temperature=0.8, top_p=0.9, seed=3),  # nucleus, no top-k
              SamplingParams(max_tokens=1, temperature=1.3, seed=4),  # the whole row
              SamplingParams(max_tokens=1, temperature=0.5, top_k=5000, top_p=0.5, seed=5)]  # top-k past the vocab
    together_gens = [make_generator(p) for p in params]
    alone_gens = [make_generator(p) for p in params]
    for _ in range(30):
        together = sample_rows(logits, params, together_gens)
        alone = [sample(logits[r], p, g) for r, (p, g) in enumerate(zip(params, alone_gens, strict=True))]
        assert together == alone
    assert together[0] == int(logits[0].argmax())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_greedy_rows_pick_what_torch_argmax_picks(dtype: torch.dtype) -> None:
    """Greedy rows on the CPU go through numpy's argmax: the same ids as torch.argmax, ties to the lowest id,
    a NaN as the largest value, rows of -inf and of signed zeros, and a strided view."""
    torch.manual_seed(3)
    logits = (torch.randn(9, 4099) * 8).to(dtype)
    logits[1, 17] = logits[1, 4000] = logits[1].max() + 1  # a tie: the lower id
    logits[2, 99] = logits[2, 3000] = float("nan")  # the first NaN
    logits[3] = -float("inf")
    logits[4] = 0.0
    logits[4, 10] = -0.0
    logits[4, 2] = -0.0
    logits[5, 4098] = float("inf")
    logits[6] = logits[6].round()  # many ties
    with torch.inference_mode():
        for rows in (logits, logits[:, ::2], logits[:1], logits.t().contiguous().t()):
            assert greedy_rows(rows) == rows.argmax(dim=-1).tolist()
    params = [SamplingParams(max_tokens=1)] * 9
    assert sample_rows(logits, params, [None] * 9) == logits.argmax(dim=-1).tolist()


def test_a_row_with_bad_logits_fails_alone() -> None:
    logits = torch.randn(3, 100)
    logits[1, 7] = float("nan")
    params = [SamplingParams(max_tokens=1, temperature=1.0, seed=s) for s in (1, 2, 3)]
    picks = sample_rows(logits, params, [make_generator(p) for p in params])
    assert isinstance(picks[1], SamplingError)
    assert all(isinstance(p, int) and 0 <= p < 100 for p in (picks[0], picks[2]))
    # Scores that are finite but huge overflow a row's sum: still sampled, not refused.
    huge = torch.full((1, 100), 3e37)
    huge[0, 42] = 3.1e37
    pick = sample_rows(huge, params[:1], [make_generator(params[0])])[0]
    assert isinstance(pick, int)
    for bad in (float("inf"), -float("inf")):
        row = torch.zeros(1, 100)
        row[0, 3] = bad
        assert isinstance(sample_rows(row, params[:1], [make_generator(params[0])])[0], SamplingError)


def test_a_nucleus_wider_than_the_candidates_is_drawn_from_the_whole_row() -> None:
    # 5,000 equal scores: the best NUCLEUS_CANDIDATES hold a fifth of the mass, short of top_p 0.99, so
    # the row is sorted whole and draws reach every part of it.
    logits = torch.zeros(1, 5000)
    params = SamplingParams(max_tokens=1, temperature=1.0, top_p=0.99, seed=9)
    gen = make_generator(params)
    draws = {sample_rows(logits, [params], [gen])[0] for _ in range(400)}
    assert NUCLEUS_CANDIDATES < 5000 and len(draws) > 300
    assert all(isinstance(d, int) for d in draws)
    whole = SamplingParams(max_tokens=1, temperature=1.0, top_p=0.2, seed=9)  # fits: the candidates serve
    assert isinstance(sample_rows(logits, [whole], [make_generator(whole)])[0], int)


def test_the_gpu_s_whole_row_draw_equals_the_cpu_s_candidates() -> None:
    """On a GPU a row without top-k is drawn from the whole row sorted; on the CPU from its best
    NUCLEUS_CANDIDATES when they hold its nucleus. The same uniform number picks the same token either way,
    and a row whose nucleus is wider is flagged for the whole-row draw."""
    torch.manual_seed(5)
    rows = 64
    scores = torch.randn(rows, 6000) * torch.linspace(0.5, 6, rows)[:, None]  # flat to peaked rows
    temperatures = torch.rand(rows) + 0.3
    ks = torch.where(torch.arange(rows) % 4 == 0, 20.0, 0.0)
    top_ps = torch.where(torch.arange(rows) % 3 == 0, 1.0, 0.9)
    uniforms = torch.rand(rows)
    narrow, short = draw_rows(scores, temperatures, ks, top_ps, uniforms, NUCLEUS_CANDIDATES, True)
    wide, never = draw_rows(scores, temperatures, ks, top_ps, uniforms, 6000, True)
    assert not never.any()
    assert short.any() and not short.all()  # the flat rows' nuclei do not fit the candidates
    assert not short[ks > 0].any()
    assert torch.equal(narrow[~short], wide[~short])


def test_params_resolve_overrides_defaults() -> None:
    defaults = GenerationSettings(max_tokens=100, temperature=0.7, top_p=0.9, top_k=40)
    p = SamplingParams.resolve(GenerationOptions(temperature=0, stop=["x"]), defaults)
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.stop) == (100, 0.0, 0.9, 40, ("x",))
    assert p.greedy


def test_session_cache_reserve_write_truncate_and_bytes() -> None:
    pool = KVPool(2, 3, 4, torch.float32, "cpu", num_blocks=8, block_size=4)
    cache = pool.session()
    assert cache.num_bytes == 0 and cache.length == 0
    cache.reserve(10)  # 3 blocks of 4
    assert cache.capacity == 12 and cache.num_bytes == 12 * cache.bytes_per_token() == 12 * 2 * 2 * 3 * 4 * 4
    assert pool.allocator.num_free_blocks == 5
    k = torch.randn(6, 3, 4)
    with appending([cache], [list(range(6))]) as step:
        for layer in range(2):
            pool.write(layer, step.slots, k, -k)
    assert cache.length == 6 and pool.allocator.num_free_blocks == 5  # written into the reserved room
    cache.truncate(2)
    assert cache.length == 2 and cache.capacity == 12
    keys, values = any_layer_kv(cache, 0)
    assert torch.equal(keys, k[:2].transpose(0, 1)) and torch.equal(values, -k[:2].transpose(0, 1))
    longer = torch.randn(11, 3, 4)  # 2 + 11 > 12: a fourth block comes from the pool, the prefix stays
    with appending([cache], [list(range(11))]) as step:
        for layer in range(2):
            pool.write(layer, step.slots, longer, longer)
    assert cache.length == 13 and cache.capacity == 16
    keys, _ = any_layer_kv(cache, 1)
    assert torch.equal(keys[:, :2], k[:2].transpose(0, 1)) and torch.equal(keys[:, 2:], longer.transpose(0, 1))
    cache.free()
    assert pool.allocator.num_free_blocks + pool.allocator.num_cached_blocks == 8 and cache.length == 0


def test_a_failed_forward_pass_leaves_the_cache_as_it_was() -> None:
    pool = KVPool(1, 1, 2, torch.float32, "cpu", num_blocks=4, block_size=2)
    cache = pool.session()
    with appending([cache], [[1, 2, 3]]) as step:
        pool.write(0, step.slots, torch.ones(3, 1, 2), torch.ones(3, 1, 2))
    try:
        with appending([cache], [[4, 5]]):
            raise RuntimeError("forward failed")
    except RuntimeError:
        pass
    assert cache.length == 3 and list(cache.token_ids) == [1, 2, 3]
    with appending([cache], [[4]]) as step:  # the next pass starts where the last good one ended
        assert step.starts == [3]
        pool.write(0, step.slots, torch.zeros(1, 1, 2), torch.zeros(1, 1, 2))
    assert cache.length == 4
    pool.allocator.verify()


def test_batched_decode_matches_one_at_a_time(tiny_runner: ModelRunner) -> None:
    prompts = [[1, 20, 30, 40], [1, 50], [1, 60, 70, 80, 90, 100, 110]]

    def run(batched: bool) -> list[list[float]]:
        caches = [tiny_runner.new_cache() for _ in prompts]
        nxt = [int(tiny_runner.prefill(c, p).argmax()) for c, p in zip(caches, prompts, strict=True)]
        rows: list[list[float]] = [[] for _ in prompts]
        for _ in range(6):
            if batched:
                logits = tiny_runner.decode(caches, nxt)
            else:
                logits = torch.stack([tiny_runner.decode([c], [t])[0] for c, t in zip(caches, nxt, strict=True)])
            nxt = logits.argmax(-1).tolist()
            for row, values in zip(rows, logits, strict=True):
                row.append(float(values.max()))
        return rows

    one, many = run(False), run(True)
    for a, b in zip(one, many, strict=True):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-4)


def test_prefill_in_chunks_equals_one_pass(tiny_runner: ModelRunner) -> None:
    ids = list(range(100, 400))
    whole = tiny_runner.new_cache()
    a = tiny_runner.prefill(whole, ids)
    chunked = tiny_runner.new_cache()
    for start in range(0, len(ids), 64):
        b = tiny_runner.prefill(chunked, ids[start:start + 64])
    assert torch.allclose(a, b, atol=1e-4)
    assert torch.allclose(any_layer_kv(whole, 1)[0], any_layer_kv(chunked, 1)[0], atol=1e-5)


def _packed_step_equals_separate_runs(runner: ModelRunner, kv_atol: float = 1e-5) -> None:
    """One packed step over prompt chunks of different lengths and decode tokens, each on a cache with a
    different history, equals running each alone: the same logits and the same K/V appended."""
    histories = [[1, 20, 30, 40], [1, 50], [], [1, 60, 70, 80, 90, 100, 110], [1, 5, 6]]
    runs = [[7], list(range(200, 237)), list(range(300, 305)), [9], list(range(400, 418))]

    def caches() -> list[Any]:
        made = [runner.new_cache() for _ in histories]
        for cache, history in zip(made, histories, strict=True):
            if history:
                runner.prefill(cache, history)
        return made

    alone_caches, packed_caches = caches(), caches()
    alone = torch.stack([runner.step([c], [r])[0] for c, r in zip(alone_caches, runs, strict=True)])
    packed = runner.step(packed_caches, runs)
    assert packed.shape == alone.shape and torch.allclose(packed, alone, atol=1e-4)
    for a, b in zip(alone_caches, packed_caches, strict=True):
        assert a.length == b.length
        for layer in (0, len(a.layers) - 1):
            (ak, av), (bk, bv) = any_layer_kv(a, layer), any_layer_kv(b, layer)
            assert torch.allclose(ak, bk, atol=kv_atol) and torch.allclose(av, bv, atol=kv_atol)


def test_packed_step_equals_separate_runs(tiny_runner: ModelRunner) -> None:
    assert tiny_runner.forward is not None  # the compact forward packs every run into one pass
    _packed_step_equals_separate_runs(tiny_runner)


def test_packed_step_equals_separate_runs_on_transformers_forward(tiny_runner: ModelRunner) -> None:
    _packed_step_equals_separate_runs(ModelRunner(tiny_runner.model, tiny_runner.tokenizer, tiny_runner.info))


def test_reconcile_prefix_rules() -> None:
    assert common_prefix_len([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix_len([], [1]) == 0
    assert reusable_prefix([1, 2, 3, 4], [1, 2, 3, 4, 5]) == 4
    # A prompt fully inside the cache still leaves one token to prefill (its logits start the reply).
    assert reusable_prefix([1, 2, 3, 4], [1, 2, 3]) == 2
    assert reusable_prefix([9, 9], [1, 2]) == 0


def test_the_donor_search_finds_the_longest_reusable_prefix_of_all_candidates() -> None:
    """The first candidate with the longest reusable prefix, as comparing every candidate whole finds it."""
    rng = random.Random(5)
    for case in range(400):
        base = [rng.randrange(4) for _ in range(rng.randrange(0, 40))]
        candidates = []
        for i in range(rng.randrange(0, 12)):
            cut = rng.randrange(0, len(base) + 1)
            candidates.append((i, base[:cut] + [rng.randrange(4) for _ in range(rng.randrange(0, 8))]))
        prompt = tuple(base[:rng.randrange(0, len(base) + 1)] + [rng.randrange(4) for _ in range(rng.randrange(0, 6))])
        min_tokens = rng.randrange(0, 8)
        best, best_len = None, min_tokens - 1
        for key, ids in candidates:  # every candidate compared whole
            if reusable_prefix(ids, prompt) > best_len:
                best, best_len = key, reusable_prefix(ids, prompt)
        expected = (best, best_len) if best is not None else (None, 0)
        assert longest_reusable(candidates, prompt, min_tokens) == expected, case


def test_the_donor_search_compares_whole_prefixes_only_where_a_candidate_could_be_longer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """500 resident sessions share a 1,000-token system prompt and then differ: a new session's search
    compares one of them whole, not all 500 (it ran on the event loop at every new session's first turn)."""
    rng = random.Random(7)
    system = [rng.randrange(49152) for _ in range(1000)]
    sessions = [(f"s{i}", [*system, i, *(rng.randrange(49152) for _ in range(30))]) for i in range(500)]
    compared: list[int] = []
    counting = prefix.reusable_prefix

    def reusable(cached_ids: list[int], prompt_ids: tuple[int, ...]) -> int:
        compared.append(1)
        return counting(cached_ids, prompt_ids)

    monkeypatch.setattr(prefix, "reusable_prefix", reusable)
    prompt = (*system, 100_000, 5, 6)  # a message of its own, after the shared prompt
    assert longest_reusable(sessions, prompt, 16) == ("s0", 1000)
    assert len(compared) == 1
    # one session that also shares the message's first token is longer, and found
    compared.clear()
    sessions[321] = ("s321", [*system, 100_000, 9])
    assert longest_reusable(sessions, prompt, 16) == ("s321", 1001)
    assert len(compared) == 2


def _rec(sid: str, size: int, used: float, busy: bool = False, persisted: bool = False) -> CacheRecord:
    return CacheRecord(sid, size, used, busy, persisted)


def test_policy_evicts_least_recently_used_idle_sessions() -> None:
    records = [_rec("a", 100, 5.0), _rec("b", 100, 1.0), _rec("c", 100, 3.0, busy=True), _rec("d", 100, 2.0)]
    assert choose_victims(records, need_bytes=50, used_bytes=400, budget_bytes=500) == []
    assert choose_victims(records, need_bytes=150, used_bytes=400, budget_bytes=500) == ["b"]
    assert choose_victims(records, need_bytes=250, used_bytes=400, budget_bytes=500) == ["b", "d"]
    assert choose_victims(records, need_bytes=250, used_bytes=400, budget_bytes=500, protect={"b"}) == ["d", "a"]
    # Only the busy session would be left: impossible for now.
    assert choose_victims(records, need_bytes=450, used_bytes=400, budget_bytes=500) is None


def test_policy_idle_and_persist_selection() -> None:
    records = [_rec("old", 1, 0.0), _rec("new", 1, 95.0), _rec("busy", 1, 0.0, busy=True),
               _rec("saved", 1, 10.0, persisted=True)]
    assert idle_victims(records, now=100.0, idle_s=30.0) == ["old", "saved"]
    assert idle_victims(records, now=100.0, idle_s=0) == []
    assert persist_candidates(records, now=100.0, idle_s=30.0) == ["old"]


def test_restore_or_recompute_by_cost() -> None:
    cpu = CostModel(prefill_tokens_per_s=300.0, restore_bytes_per_s=200e6)
    assert prefer_restore(num_tokens=2048, file_bytes=80_000_000, cost=cpu, min_tokens=64)
    assert not prefer_restore(num_tokens=10, file_bytes=400_000, cost=cpu, min_tokens=64)
    fast_gpu = CostModel(prefill_tokens_per_s=50_000.0, restore_bytes_per_s=200e6)
    assert not prefer_restore(num_tokens=512, file_bytes=20_000_000, cost=fast_gpu, min_tokens=64)


def test_sampling_draws_follow_the_filtered_distribution() -> None:
    # Scores 2, 1, 0, -1, -5: top-k 4 drops the last; top-p 0.9 then drops the fourth (the mass before it,
    # about 0.97, already reaches 0.9). The draws must follow softmax over the first three.
    logits = torch.tensor([0.0, 2.0, -1.0, 1.0, -5.0])
    params = SamplingParams(max_tokens=1, temperature=1.0, top_k=4, top_p=0.9, seed=7)
    gen = make_generator(params)
    counts = torch.zeros(5)
    for _ in range(3000):
        counts[sample(logits, params, gen)] += 1
    expected = torch.zeros(5)
    expected[[1, 3, 0]] = torch.softmax(torch.tensor([2.0, 1.0, 0.0]), dim=0)
    assert counts[2] == 0 and counts[4] == 0
    assert torch.allclose(counts / counts.sum(), expected, atol=0.03)


def test_warm_up_leaves_no_trace(tiny_runner: ModelRunner) -> None:
    ids = list(range(5, 40))
    before = tiny_runner.prefill(tiny_runner.new_cache(), ids)
    assert tiny_runner.warm_up(max_batch_size=4) > 0
    after = tiny_runner.prefill(tiny_runner.new_cache(), ids)
    assert torch.equal(before, after)


# [model] dtype = "bfloat16" / "int8" on the CPU: activations stay fp32, the KV cache is stored narrower (bf16
# values, or int8 values and one fp32 scale per position and head). Prefill, packed steps and decode all read and
# write it; the logits stay close to an fp32 cache's (bf16 K/V hold about 3 significant digits, int8 about 2)
# with the same best token. The KV tolerance: one bf16 rounding step, or an int8 one of a small row.
@pytest.mark.parametrize(("dtype", "kv_atol", "logit_atol"), [("bfloat16", 2e-2, 0.25), ("int8", 2e-2, 0.5)])
def test_compact_forward_runs_a_narrower_cache(tiny_dir: Path, dtype: str, kv_atol: float, logit_atol: float) -> None:
    runner = ModelRunner.load(ModelSettings(source=str(tiny_dir), threads=1, dtype=dtype), tiny_dir)  # type: ignore[arg-type]
    assert runner.forward is not None and runner.new_cache().dtype == getattr(torch, dtype)
    _packed_step_equals_separate_runs(runner, kv_atol=kv_atol)
    fp32 = ModelRunner.load(ModelSettings(source=str(tiny_dir), threads=1), tiny_dir)
    ids = list(range(10, 40))
    narrow, wide = runner.new_cache(), fp32.new_cache()
    for got, want in ((runner.prefill(narrow, ids), fp32.prefill(wide, ids)),
                      (runner.decode([narrow], [5])[0], fp32.decode([wide], [5])[0])):
        assert float((got - want).abs().max()) < logit_atol and int(got.argmax()) == int(want.argmax())
    if dtype == "int8":
        # Each position of a head takes head_dim bytes and its scale's 4; the first layer's K/V (computed from the
        # same embeddings either way) are stored to within half a step (the row's largest value / 127).
        info = runner.info
        assert info.bytes_per_token == 2 * info.num_layers * info.num_kv_heads * (info.head_dim + 4)
        for stored, exact in zip(any_layer_kv(narrow, 0), any_layer_kv(wide, 0), strict=True):
            step = exact.abs().amax(-1, keepdim=True) / 127
            assert bool(((stored - exact).abs() <= step * 0.5001).all())


def test_an_int8_cache_needs_the_compact_forward_on_the_cpu(tiny_dir: Path) -> None:
    with pytest.raises(ConfigError, match="int8"):
        ModelRunner.load(ModelSettings(source=str(tiny_dir), threads=1, dtype="int8", weights="transformers"),
                         tiny_dir)
