"""The native kernels (chatd/engine/kernels/decode_attention.c, tile_matmul.c, step.c; the byte planes,
chatd/kv/planes.c): built once per machine and cached; decode attention equal to torch's over the same block
tables, and used by the compact forward's decode steps with the same greedy tokens as without it; the element-wise
steps equal to torch's; the Q4_1 and Q8_0 tile matmuls (AMX tiles, AVX512-VNNI and AVX2 vectors, each where the CPU
has it) equal to their references: the bf16 dequantised weights (AMX), the exact weights times x rounded to int8 per
block (VNNI, AVX2); where the CPU has AVX512, the attention and element-wise kernels also as built for AVX2 alone
(x86-64-v3); a whole q4 step in one native call equal to the loop over layers, bit for bit; the snapshot codec's
byte-plane split and join (planes.c, a library of its own) equal to numpy's."""

from __future__ import annotations

import dataclasses
import logging
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from chatd.engine.kernels.cpu import cpu_features
from chatd.engine.kernels.loader import NATIVE_ARCH, EngineKernels, build, load_kernels
from chatd.engine.model.choices import gguf_forward
from chatd.engine.model.forward import NATIVE_ATTENTION_MAX_RUN
from chatd.engine.model.quant import (
    TILE_KINDS,
    Q4_1Weight,
    Q8_0Weight,
    TileQ4Linear,
    TileQ8Linear,
    pack_for,
    pack_q4_quads,
    pack_q4_tiles,
    pack_q8_quads,
    pack_q8_tiles,
)
from chatd.engine.model.runner import ModelRunner
from chatd.engine.pool.kvcache import KVPool, attend
from chatd.engine.pool.paged import INT8_SCALE_BYTES, dequantize_rows, quantize_rows

# The kernels for this CPU and, where it has AVX512, also built for x86-64-v3 (AVX2, FMA, F16C), which compiles
# the AVX2 attention and element-wise paths a CPU without AVX512 runs (a Zen 3's, say) in their place.
# (CHATD_CPU_ISA=avx2 makes the native build the x86-64-v3 one: chatd.engine.kernels.cpu.)
_HAS_AVX512 = cpu_features().x86 and cpu_features().avx512
_ARCHES = [NATIVE_ARCH, *(["x86-64-v3"] if _HAS_AVX512 else [])]


@pytest.fixture(scope="module", params=_ARCHES)
def kernel(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> EngineKernels:
    loaded = load_kernels(tmp_path_factory.mktemp("native"), request.param)
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
    with caplog.at_level(logging.WARNING, logger="chatd.engine.kernels.loader"):
        assert load_kernels(tmp_path / "cache") is None
    assert "native kernels unavailable" in caplog.text
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


# Many rows (each (row, KV head) pair walks its blocks on one thread: for short sequences in a run of consecutive
# pairs per thread, for one over 32 blocks as the threads come for them), and one long row: few pairs, so each
# pair's blocks are split into ranges across the threads and merged (the sizes are in blocks of 16).
_ATTENTION_CASES = [((1, 5, 16, 17, 7 * 16 - 3, 40), (7, 0, 3, 5, 1, 2)), ((1000,), (3,)), ((300, 5), (2, 6)),
                    ((600, 3, 40, 17), (1, 4, 0, 6))]


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize(("lengths", "rows"), _ATTENTION_CASES)
# Groups of 1 to 4 query heads per KV head (64-wide heads) run copies of the kernel of their own; 8 the general one.
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(9, 3), (4, 4), (4, 2), (8, 2), (8, 1)])
def test_kernel_equals_torch_attention_over_scattered_blocks(kernel: EngineKernels, num_heads: int,
                                                             num_kv_heads: int, lengths: tuple[int, ...],
                                                             rows: tuple[int, ...], kv_dtype: torch.dtype,
                                                             two_torch_threads: None) -> None:
    torch.manual_seed(num_heads * 10 + num_kv_heads)
    head_dim, layers = 64, 2
    pool = KVPool.for_budget(16 << 20, layers, num_kv_heads, head_dim, kv_dtype, "cpu")
    if pool.quantized:  # int8 rows: values and their scale (chatd.engine.pool.paged.quantize_rows)
        pool.tensors.kv.copy_(quantize_rows(torch.randn(*pool.tensors.kv.shape[:-1], head_dim) * 3))
    else:
        pool.tensors.kv.normal_()
    size = pool.block_size
    width = max(-(-n // size) for n in lengths)
    order = torch.randperm(pool.num_blocks)[: len(lengths) * width].view(len(lengths), width).to(torch.int32)
    # The unused slots of each sequence's last block hold whatever was there: NaN here (an int8 row's scale),
    # which must not reach the result (the kernel reads a whole block of keys at a time).
    nan = torch.tensor([float("nan")]).view(torch.int8) if pool.quantized else float("nan")
    for i, n in enumerate(lengths):
        if n % size:
            pool.tensors.kv[:, :, :, int(order[i, (n - 1) // size]), n % size:, -nan_width(pool):] = nan
    # Rows of the step in another order than the tables, and some rows of the step not decode rows at all.
    rows = torch.tensor(rows, dtype=torch.int32)
    q = torch.randn(8, num_heads + num_kv_heads, head_dim)[:, :num_heads]  # a view, as the forward passes it
    out = torch.full((8, num_heads * head_dim), float("nan"))
    keys, values = pool.tensors.kv[1, 0], pool.tensors.kv[1, 1]
    kernel.decode_attention(q, out, rows, keys, values, order, torch.tensor(lengths, dtype=torch.int32),
                            head_dim ** -0.5)
    group = num_heads // num_kv_heads
    for i, n in enumerate(lengths):
        ids = order[i].long()
        k, v = keys[:, ids].flatten(1, 2)[:, :n][None], values[:, ids].flatten(1, 2)[:, :n][None]
        if pool.quantized:
            k, v = dequantize_rows(k), dequantize_rows(v)
        folded = q[int(rows[i])].reshape(num_kv_heads, group, head_dim)[None]
        expected = attend(folded, [(k, v)], None, head_dim ** -0.5).reshape(-1)
        # (int8: each key's scale multiplies its whole dot product, each value's its weight, not every element)
        tolerance = 2e-5 if pool.quantized else 1e-5
        torch.testing.assert_close(out[int(rows[i])], expected, rtol=tolerance, atol=tolerance)
    untouched = sorted(set(range(8)) - set(rows.tolist()))
    assert torch.isnan(out[untouched]).all()


def nan_width(pool: KVPool) -> int:
    """How many trailing elements of a position hold NaN in the test above: the scale of an int8 row, all of
    an fp32 or bf16 one."""
    return INT8_SCALE_BYTES if pool.quantized else pool.head_dim


def _with_kv(runner: ModelRunner, kv_dtype: torch.dtype) -> ModelRunner:
    """The same model and forward over a pool of its own holding K/V as ``kv_dtype``."""
    if kv_dtype == runner.info.dtype:
        return runner
    other = ModelRunner(runner.model, runner.tokenizer, dataclasses.replace(runner.info, dtype=kv_dtype),
                        runner.forward)
    other.configure_pool(256 << 20)
    return other


@pytest.mark.parametrize("threads", [2, 4])
def test_decode_attention_spreads_every_call_of_two_or_more_pairs_over_the_threads(kernel: EngineKernels,
                                                                                  threads: int) -> None:
    """A call's pairs (or, for fewer pairs than twice the threads, their block ranges) run on the threads
    whenever there are two or more. Short contexts once got 0 ranges, which ran every pair of a 16-session
    step on one thread while the others waited."""
    for pairs in range(1, 65):
        for blocks in range(0, 129):
            parts = kernel.attention_parts(pairs, blocks, threads)
            assert parts >= 1, (pairs, blocks)  # 0 ranges turned the parallel region off
            assert parts == 1 or blocks // parts >= 8, (pairs, blocks, parts)  # ranges of 8 blocks or more
            if pairs >= 2 * threads:
                assert parts == 1, (pairs, blocks, parts)  # enough pairs: each stays whole
    # one session's step over a long context (3 KV heads, 2,048 tokens): its pairs split so all threads work
    assert 3 * kernel.attention_parts(3, 128, threads) >= 2 * threads


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_decode_steps_with_the_kernel_equal_torch_attention(real_runner: ModelRunner, kv_dtype: torch.dtype) -> None:
    """The engine on the CPU decodes through the kernel (tests/test_kv_pool.py checks its greedy tokens
    against transformers over fragmented tables); here each step's logits equal the torch path's, and so
    do the prompts' (short chunks attend through the kernel, causally, in a step with other runs), with
    an fp32 pool and with a bf16 one."""
    real_runner = _with_kv(real_runner, kv_dtype)
    forward = real_runner.forward
    assert forward is not None and forward.kernels is not None
    prompts = [real_runner.tokenizer(text * n).input_ids for n, text in
               enumerate(("The capital of France is", "Water boils at", "One, two, three, four,"), start=1)]

    def run(kernel: EngineKernels | None) -> list[torch.Tensor]:
        saved, forward.kernels = forward.kernels, kernel
        # the torch path's attention in fp32, as the kernel's is (with AMX, prompt chunks over a bf16 pool
        # attend in bf16: tests/test_llama_forward.py)
        saved_bf16, forward.bf16_attention = forward.bf16_attention, False
        caches = [real_runner.new_cache() for _ in prompts]
        try:
            halves = [(p[:len(p) // 2], p[len(p) // 2:]) for p in prompts]
            real_runner.step(caches, [first for first, _ in halves])  # every run a chunk of several tokens
            prompt_logits = real_runner.step(caches, [second for _, second in halves])
            tokens = prompt_logits.argmax(-1).tolist()
            steps = [prompt_logits]
            for _ in range(6):
                logits = real_runner.decode(caches, tokens)
                steps.append(logits)
                tokens = logits.argmax(-1).tolist()
            return steps
        finally:
            forward.kernels, forward.bf16_attention = saved, saved_bf16
            for cache in caches:
                cache.free()

    with_kernel, with_torch = run(forward.kernels), run(None)
    # The two attentions add in different orders (~1e-6 apart). In fp32 that stays ~1e-5 in the logits;
    # rounding K/V to bf16 turns such differences into one-unit flips of some stored values, a few 1e-2; an
    # int8 flip is a coarser unit (1/127 of the row's largest value), a few 1e-1 at most.
    tolerance = {torch.float32: 1e-4, torch.bfloat16: 0.1, torch.int8: 0.4}[kv_dtype]
    for a, b in zip(with_kernel, with_torch, strict=True):
        torch.testing.assert_close(a, b, rtol=tolerance, atol=tolerance)
        assert a.argmax(-1).tolist() == b.argmax(-1).tolist()


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_rope_and_the_kv_write_are_bit_for_bit_the_torch_paths(real_runner: ModelRunner,
                                                               kv_dtype: torch.dtype) -> None:
    """The native RoPE + K/V write leaves the same bits in the pool as torch's ops (fp32, or rounded to
    bf16 alike), so snapshots do not depend on which path computed them; a prompt's logits (chunks longer
    than the native attention is given here, so it runs through torch either way) are identical too."""
    real_runner = _with_kv(real_runner, kv_dtype)
    assert real_runner.pool.dtype == kv_dtype
    forward = real_runner.forward
    assert forward is not None and forward.kernels is not None
    prompt = real_runner.tokenizer("A long time ago, in a kingdom by the sea, there lived a " * 12).input_ids
    assert len(prompt) > 2 * (NATIVE_ATTENTION_MAX_RUN + 1)  # both chunks longer than the kernel takes

    def prefill(kernels: EngineKernels | None) -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
        saved, forward.kernels = forward.kernels, kernels
        longest, forward.native_attention_max_run = forward.native_attention_max_run, NATIVE_ATTENTION_MAX_RUN
        cache = real_runner.new_cache()
        try:
            cut = NATIVE_ATTENTION_MAX_RUN + 1
            logits = [real_runner.prefill(cache, prompt[:cut]), real_runner.prefill(cache, prompt[cut:])]
            return logits, [(k.clone(), v.clone()) for k, v in cache.filled_layers()]
        finally:
            forward.kernels = saved
            forward.native_attention_max_run = longest
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


def _bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance between two bf16 tensors of one sign per element, in units in the last place."""
    return int((a.view(torch.int16).int() - b.view(torch.int16).int()).abs().max())


def test_add_rms_norm_equals_torch(kernel: EngineKernels) -> None:
    torch.manual_seed(3)
    for rows, hidden in ((1, 576), (7, 64), (300, 576)):  # 300 rows take the threaded loop
        h = torch.randn(rows, hidden) * 3
        weight = torch.rand(hidden) + 0.5
        wide = torch.randn(rows, 2 * hidden).to(torch.bfloat16)
        add = wide[:, :hidden]  # a strided view: rows of a wider tensor
        expected_h = h + add.float()
        expected = F.rms_norm(expected_h, (hidden,), weight, 1e-5).to(torch.bfloat16)
        got = kernel.add_rms_norm(h, add, weight, 1e-5)
        assert torch.equal(h, expected_h)  # the residual add is exact, in place
        assert _bf16_ulps(got, expected) <= 1  # the sum of squares is added in another order
        assert (got == expected).float().mean() > 0.99
        again = kernel.add_rms_norm(h, None, weight, 1e-5)  # no add: the norm alone, h unchanged
        assert torch.equal(again, got) and torch.equal(h, expected_h)
    with pytest.raises(ValueError):
        kernel.add_rms_norm(torch.randn(2, 8), None, torch.ones(9), 1e-5)


def test_silu_mul_equals_torch(kernel: EngineKernels) -> None:
    torch.manual_seed(4)
    for rows, inter in ((1, 1536), (200, 1536)):
        gate_up = (torch.randn(rows, 2 * inter) * 4).to(torch.bfloat16)
        gate, up = gate_up.float().chunk(2, dim=-1)
        expected = (F.silu(gate) * up).to(torch.bfloat16)
        got = kernel.silu_mul(gate_up)
        assert _bf16_ulps(got, expected) <= 1
        assert (got == expected).float().mean() > 0.99
    with pytest.raises(ValueError):
        kernel.silu_mul(torch.randn(2, 8))


def test_q4_steps_between_projections_run_natively_with_torchs_results(real_runner: ModelRunner,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The packaged q4 model with the kernels runs every step between its projections natively (the
    projections bf16 to bf16); its logits equal the torch path's up to bf16 rounding, for prompt chunks
    and for decode steps narrow (the int4 blocks) and wide (the dense twin) alike, with the same greedy
    tokens wherever the choice is clear. (A bf16 activation one unit off in the last place moves later
    layers; both paths are as far from the fp32 forward, which tests/test_llama_forward.py checks.)"""
    assert real_runner.forward is not None and real_runner.forward.kernels is not None
    # The torch int4 path with the bf16 dense twin, as a CPU with bf16 matmul units runs it where it has no
    # tile kernel (taken here on any CPU: the twin's products are the same, only slower without those units).
    monkeypatch.setattr("chatd.engine.model.choices.bf16_matmul_is_fast", lambda: True)
    forward = gguf_forward(torch.device("cpu"), real_runner.model)
    assert forward.bf16_projections
    runner = ModelRunner(real_runner.model, real_runner.tokenizer, real_runner.info, forward)
    texts = ("The capital of France is", "Water boils at", "One, two, three, four,", "Dear diary, today")
    prompts = [runner.tokenizer(text * n).input_ids for n, text in enumerate(texts, start=1)]

    kernels = real_runner.forward.kernels
    calls = {"norm": 0, "silu": 0}

    def counted(name: str, method: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def call(*args: object) -> torch.Tensor:
            calls[name] += 1
            return method(*args)
        return call

    monkeypatch.setattr(kernels, "add_rms_norm", counted("norm", kernels.add_rms_norm))
    monkeypatch.setattr(kernels, "silu_mul", counted("silu", kernels.silu_mul))

    def run(kernels: EngineKernels | None, copies: int) -> list[torch.Tensor]:
        forward.kernels = kernels
        caches = [runner.new_cache() for _ in range(copies) for _ in prompts]
        try:
            first = [runner.prefill(c, p) for c, p in zip(caches, prompts * copies, strict=True)]
            steps = [torch.stack(first)]
            tokens = steps[0].argmax(-1).tolist()
            for _ in range(5):
                steps.append(runner.decode(caches, tokens))
                tokens = steps[-1].argmax(-1).tolist()
            return steps
        finally:
            forward.kernels = None
            for cache in caches:
                cache.free()

    layers = forward.shape.num_layers
    for copies in (1, 3):  # 4 rows per step: the int4 blocks; 12 rows: the dense twin
        native, plain = run(kernels, copies), run(None, copies)
        forwards = len(prompts) * copies + 5  # each prompt's prefill, then 5 decode steps
        assert calls == {"norm": forwards * (2 * layers + 1), "silu": forwards * layers}
        calls.update(norm=0, silu=0)
        for a, b in zip(native, plain, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1.0)
            top2 = b.topk(2, dim=-1).values
            clear = (top2[:, 0] - top2[:, 1] > 1.0).tolist()
            assert any(clear)
            for row, is_clear in enumerate(clear):
                if is_clear:
                    assert int(a[row].argmax()) == int(b[row].argmax())


def _q4_weight(n: int, k: int, seed: int) -> Q4_1Weight:
    generator = torch.Generator().manual_seed(seed)
    return Q4_1Weight(scale=(torch.rand(n, k // 32, generator=generator) * 0.01).half(),
                      minimum=(-torch.rand(n, k // 32, generator=generator) * 0.08).half(),
                      quants=torch.randint(0, 16, (n, k), generator=generator, dtype=torch.uint8))


def _q8_weight(n: int, k: int, generator: torch.Generator) -> Q8_0Weight:
    return Q8_0Weight(scale=(torch.rand(n, k // 32, generator=generator) * 0.01).half(),
                      quants=torch.randint(-128, 128, (n, k), generator=generator, dtype=torch.int8))


@pytest.fixture(params=TILE_KINDS)
def tile_kind(request: pytest.FixtureRequest, kernel: EngineKernels) -> Iterator[str]:
    """Each tile kernel this CPU has, selected for the test and the best one restored after it."""
    kind: str = request.param
    if kernel.select_tile_matmul(kind) != kind:
        kernel.select_tile_matmul(None)
        pytest.skip(f"this CPU has no {kind} tile kernel")
    try:
        yield kind
    finally:
        kernel.select_tile_matmul(None)


def _tile_reference(kind: str, x: torch.Tensor, weight: Q4_1Weight | Q8_0Weight) -> torch.Tensor:
    """What the tile kernel ``kind`` computes, before its output is rounded to bf16 (fp64): on AMX, x times the
    bf16 copy of the dequantised weight; on AVX512-VNNI, the exact weight times x rounded to int8 per block of
    32 (scale max |x| / 127, to nearest even)."""
    if kind == "amx":
        return x.double() @ weight.dequantize().to(torch.bfloat16).double().T
    m, k = x.shape
    blocks = x.float().view(m, k // 32, 32)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    rounded = torch.round(blocks * inverse) * scale  # dx * xq
    return rounded.reshape(m, k).double() @ weight.dequantize().double().T


def _layout_shape(kind: str, n: int, k: int, tile_bytes: int) -> tuple[int, ...]:
    """Under AMX a weight is packed twice: the AMX tiles, then the vector kernel's (for calls of few rows)."""
    return (2, n // 16, k // 32, tile_bytes) if kind == "amx" else (n // 16, k // 32, tile_bytes)


def _kind_for(kernel: EngineKernels, kind: str, m: int) -> str:
    """The kernel a call of ``m`` rows runs under ``kind``: with AMX, the vectors below ``amx_min_rows``."""
    return "avx512-vnni" if kind == "amx" and m < kernel.amx_min_rows else kind


@pytest.fixture(params=["default", "every call"])
def amx_rows(request: pytest.FixtureRequest, kernel: EngineKernels) -> Iterator[str]:
    """The AMX threshold as the engine runs it, and AMX for every call (``amx_min_rows`` 1)."""
    default = kernel.amx_min_rows
    if request.param == "every call":
        kernel.amx_min_rows = 1
    try:
        yield request.param
    finally:
        kernel.amx_min_rows = default


def test_the_q4_tile_matmul_equals_its_reference(kernel: EngineKernels, tile_kind: str, amx_rows: str) -> None:
    """The tile kernel computes exactly its reference (:func:`_tile_reference`) for any row count: one pass of
    rows, partial passes, several passes. Only the order of the fp32 sums differs, and the output is rounded
    to bf16 once; and it stays close to the exact product. Under AMX, calls of fewer rows than
    ``amx_min_rows`` compute the vector kernel's reference."""
    for n, k in ((48, 64), (960, 576), (576, 1536)):
        weight = _q4_weight(n, k, n + k)
        tiles = pack_for(tile_kind, weight)
        assert tiles.shape == _layout_shape(tile_kind, n, k, 320)
        for m in (1, 3, 8, 15, 16, 17, 40, 64, 100, 150):
            x = torch.randn(m, k).to(torch.bfloat16)
            got = kernel.tile_matmul(x, tiles, n).double()
            want = _tile_reference(_kind_for(kernel, tile_kind, m), x, weight)
            scale = want.abs().max()
            # within a bf16 rounding of the largest output (half an ulp: under 2 ** -8 of it), and the fp32
            # sums' own rounding
            assert (got - want).abs().max() <= 1.05 * 2 ** -8 * scale, (tile_kind, n, k, m)
            exact = x.double() @ weight.dequantize().double().T
            assert (got - exact).abs().max() <= 0.02 * exact.abs().max(), (tile_kind, n, k, m)
    with pytest.raises(ValueError):
        kernel.tile_matmul(torch.randn(2, 64).to(torch.bfloat16), pack_for(tile_kind, _q4_weight(32, 64, 1)), 48)


def test_the_q8_tile_matmul_equals_its_reference(kernel: EngineKernels, tile_kind: str, amx_rows: str) -> None:
    """The same for a Q8_0 weight (the LM head's format)."""
    generator = torch.Generator().manual_seed(11)
    for n, k in ((32, 64), (4096, 576)):
        weight = _q8_weight(n, k, generator)
        tiles = pack_for(tile_kind, weight)
        assert tiles.shape == _layout_shape(tile_kind, n, k, 544)
        for m in (1, 4, 9, 16, 70):
            x = torch.randn(m, k).to(torch.bfloat16)
            want = _tile_reference(_kind_for(kernel, tile_kind, m), x, weight)
            got = kernel.tile_matmul(x, tiles, n, q8=True).double()
            assert (got - want).abs().max() <= 1.05 * 2 ** -8 * want.abs().max(), (tile_kind, n, k, m)
        linear = TileQ8Linear(weight, kernel)
        few = torch.randn(1, k).to(torch.bfloat16)
        want = few.double() @ weight.dequantize().double().T
        assert (linear.bf16(few).double() - want).abs().max() <= 0.02 * want.abs().max()
    with pytest.raises(ValueError):  # Q4_1 tiles are not Q8_0 ones
        kernel.tile_matmul(torch.randn(4, 64).to(torch.bfloat16), pack_for(tile_kind, _q4_weight(32, 64, 1)), 32,
                           q8=True)


def test_a_rows_product_does_not_depend_on_the_calls_other_rows(kernel: EngineKernels, tile_kind: str) -> None:
    """Calls of up to 16 rows quantise x once per thread, larger ones once in all (tile_matmul.c's OWN_ROWS): a
    row's outputs are the same bits whichever way it went, alone, among a few rows or among many."""
    generator = torch.Generator().manual_seed(17)
    default = kernel.amx_min_rows
    kernel.amx_min_rows = 1000  # under AMX too, every call here on the vectors (AMX rounds x its own way)
    try:
        for weight, n, k, is_q8 in ((_q4_weight(960, 576, 7), 960, 576, False),
                                    (_q8_weight(96, 1536, generator), 96, 1536, True)):
            tiles = pack_for(tile_kind, weight)
            x = torch.randn(40, k, generator=generator).to(torch.bfloat16)
            whole = kernel.tile_matmul(x, tiles, n, q8=is_q8)
            parts = [kernel.tile_matmul(x[start:end], tiles, n, q8=is_q8)
                     for start, end in ((0, 1), (1, 4), (4, 20), (20, 36), (36, 40))]
            assert torch.equal(torch.cat(parts), whole), (tile_kind, n, k)
    finally:
        kernel.amx_min_rows = default


def test_the_layouts_keep_every_quant_and_scale() -> None:
    """Each layout holds every quant and scale exactly once, where the kernels' comments say."""
    weight = _q4_weight(32, 64, 5)  # 2 output groups, 2 blocks
    quads, tiles = pack_q4_quads(weight), pack_q4_tiles(weight)
    g, kb, n, row = 1, 1, 5, 3  # quad row 3 of block 1: inputs 32 + 12..15 of output 16 + 5
    q = weight.quants[16 + n, 32 + 4 * row : 32 + 4 * row + 4]
    assert torch.equal(quads[g, kb, 64 * row + 4 * n : 64 * row + 4 * n + 4] & 0x0F, q)
    q_high = weight.quants[16 + n, 32 + 4 * (row + 4) : 32 + 4 * (row + 4) + 4]  # quad row 7, high nibbles
    assert torch.equal(quads[g, kb, 64 * row + 4 * n : 64 * row + 4 * n + 4] >> 4, q_high)
    assert torch.equal(quads[g, kb, 256:288].view(torch.float16), weight.scale[16:32, kb])
    assert torch.equal(quads[g, kb, 288:320].view(torch.float16), weight.minimum[16:32, kb])
    assert torch.equal(tiles[g, kb, 256:320], quads[g, kb, 256:320])
    q8 = Q8_0Weight(scale=torch.rand(32, 2).half(), quants=torch.randint(-128, 128, (32, 64), dtype=torch.int8))
    packed = pack_q8_quads(q8)
    value = packed[g, kb, 64 * row + 4 * n : 64 * row + 4 * n + 4].to(torch.int16) - 128
    assert torch.equal(value, q8.quants[16 + n, 32 + 4 * row : 32 + 4 * row + 4].to(torch.int16))
    assert torch.equal(packed[g, kb, 512:544].view(torch.float16), q8.scale[16:32, kb])
    assert pack_q8_tiles(q8).shape == packed.shape
    assert torch.equal(pack_for("amx", weight), torch.stack([tiles, quads]))  # AMX's, then the vectors'
    assert torch.equal(pack_for("avx512-vnni", weight), quads)
    with pytest.raises(ValueError):
        pack_for("avx512-bf16", weight)


def test_the_tile_kinds_agree(kernel: EngineKernels) -> None:
    """Where the CPU has AMX, its vector kernel gives the same products, to x's int8 rounding."""
    if kernel.select_tile_matmul("amx") != "amx":
        kernel.select_tile_matmul(None)
        pytest.skip("this CPU has no AMX tiles")
    weight = _q4_weight(960, 576, 3)
    x = torch.randn(24, 576).to(torch.bfloat16)
    try:
        on_tiles = kernel.tile_matmul(x, pack_for("amx", weight), 960).float()
        assert kernel.select_tile_matmul("avx512-vnni") == "avx512-vnni"
        on_vectors = kernel.tile_matmul(x, pack_for("avx512-vnni", weight), 960).float()
    finally:
        kernel.select_tile_matmul(None)
    assert (on_tiles - on_vectors).abs().max() <= 0.02 * on_tiles.abs().max()


def test_the_avx2_kernel_computes_the_avx512_vnni_kernels_bits(kernel: EngineKernels) -> None:
    """AVX2 reads the VNNI layout as two halves and sums the same exact integer block sums, in the same fp32 order:
    on a CPU with both, Q4_1 and Q8_0 products are equal bit for bit, whatever the rows."""
    if kernel.select_tile_matmul("avx512-vnni") != "avx512-vnni":
        kernel.select_tile_matmul(None)
        pytest.skip("this CPU (or this build) has no AVX512-VNNI to compare with")
    generator = torch.Generator().manual_seed(13)
    q8 = _q8_weight(80, 3072, generator)
    try:
        for weight, n, k, is_q8 in ((_q4_weight(960, 576, 3), 960, 576, False), (q8, 80, 3072, True)):
            for m in (1, 3, 8, 17):
                x = torch.randn(m, k, generator=generator).to(torch.bfloat16)
                assert kernel.select_tile_matmul("avx512-vnni") == "avx512-vnni"
                on_512 = kernel.tile_matmul(x, pack_for("avx512-vnni", weight), n, q8=is_q8)
                assert kernel.select_tile_matmul("avx2") == "avx2"
                on_256 = kernel.tile_matmul(x, pack_for("avx2", weight), n, q8=is_q8)
                assert torch.equal(on_512, on_256), (n, k, m)
    finally:
        kernel.select_tile_matmul(None)


def test_under_amx_calls_of_few_rows_run_the_vector_kernel_and_many_the_tiles(kernel: EngineKernels) -> None:
    """Under AMX, a call of fewer rows than ``amx_min_rows`` (16) equals the vector kernel's result on the
    same weight bit for bit (it runs that kernel, on the second layout), and a call of more rows equals
    AMX's (the rows do not depend on one another in either kernel)."""
    if kernel.select_tile_matmul("amx") != "amx":
        kernel.select_tile_matmul(None)
        pytest.skip("this CPU has no AMX tiles")
    weight = _q4_weight(960, 576, 4)
    both = pack_for("amx", weight)
    x = torch.randn(40, 576).to(torch.bfloat16)
    default = kernel.amx_min_rows
    try:
        assert default == 16
        mixed = {m: kernel.tile_matmul(x[:m].contiguous(), both, 960) for m in (1, 5, 15, 16, 40)}
        kernel.amx_min_rows = 1
        on_tiles = kernel.tile_matmul(x, both, 960)
        assert kernel.select_tile_matmul("avx512-vnni") == "avx512-vnni"
        on_vectors = kernel.tile_matmul(x, pack_for("avx512-vnni", weight), 960)
    finally:
        kernel.select_tile_matmul(None)
        kernel.amx_min_rows = default
    for m, got in mixed.items():
        want = (on_vectors if m < default else on_tiles)[:m]
        assert torch.equal(got, want), m
    assert not torch.equal(on_tiles[:15], on_vectors[:15])  # the two kernels round x differently
    with pytest.raises(ValueError):
        kernel.amx_min_rows = 0


def test_under_amx_a_call_of_many_rows_equals_its_rows_in_calls_of_64(kernel: EngineKernels) -> None:
    """Calls of more than 64 rows run AMX's second kernel (each weight dequantised once per call, slices of x
    paired against pairs of output groups, the last slice partial or a slice alone): every row's sums run in
    the same order as in the one-pass kernel of calls up to 64 rows, so the results are equal bit for bit, for
    Q4_1 and Q8_0 weights, an odd number of output groups included."""
    if kernel.select_tile_matmul("amx") != "amx":
        kernel.select_tile_matmul(None)
        pytest.skip("this CPU has no AMX tiles")
    generator = torch.Generator().manual_seed(12)
    q8 = _q8_weight(80, 3072, generator)
    default = kernel.amx_min_rows
    kernel.amx_min_rows = 1  # the last rows' call may be short: on the tiles too
    try:
        for weight, n, k, is_q8 in ((_q4_weight(48, 576, 5), 48, 576, False),
                                    (_q4_weight(576, 1536, 6), 576, 1536, False), (q8, 80, 3072, True)):
            tiles = pack_for("amx", weight)
            for m in (65, 80, 96, 100, 150, 272):
                x = torch.randn(m, k, generator=generator).to(torch.bfloat16)
                together = kernel.tile_matmul(x, tiles, n, q8=is_q8)
                apart = torch.cat([kernel.tile_matmul(x[i:i + 64].contiguous(), tiles, n, q8=is_q8)
                                   for i in range(0, m, 64)])
                assert torch.equal(together, apart), (n, k, m)
    finally:
        kernel.select_tile_matmul(None)
        kernel.amx_min_rows = default


def test_the_tile_linear_refuses_a_kernel_its_weights_are_not_packed_for(kernel: EngineKernels) -> None:
    if not kernel.tile_matmul_kind:
        pytest.skip("this CPU has no tile kernel (neither AMX, AVX512-VNNI nor AVX2)")
    linear = TileQ4Linear(_q4_weight(64, 96, 7), kernel)
    linear.kind = "avx512-vnni" if linear.kind == "amx" else "amx"  # as if packed for the other kernel
    with pytest.raises(RuntimeError, match="packed for"):
        linear.bf16(torch.randn(8, 96).to(torch.bfloat16))


def test_the_packaged_model_runs_its_q4_blocks_on_the_tile_kernel(real_runner: ModelRunner) -> None:
    """With a tile kernel, every projection of the packaged model, the LM head included, runs its GGUF blocks
    for every batch: no dense twin at all."""
    kernels = real_runner.forward.kernels if real_runner.forward is not None else None
    assert kernels is not None
    if not kernels.tile_matmul_kind:
        pytest.skip("this CPU has no tile kernel (neither AMX, AVX512-VNNI nor AVX2)")
    forward = gguf_forward(torch.device("cpu"), real_runner.model, kernels)
    for layer in forward.weights.layers:
        assert all(isinstance(p, TileQ4Linear) for p in (layer.qkv, layer.o, layer.gate_up, layer.down))
    assert isinstance(forward.weights.lm_head, TileQ8Linear)


@pytest.mark.parametrize("tile_kind", TILE_KINDS)
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float32, torch.int8])
def test_a_whole_step_in_one_native_call_equals_the_loop_over_layers(real_runner: ModelRunner, tile_kind: str,
                                                                    kv_dtype: torch.dtype) -> None:
    """With every projection on the tile kernel, a step whose runs all attend natively (decode tokens, prompt
    chunks) runs as one native call (chatd/engine/kernels/step.c). It calls the same kernels in the same order, so its
    logits and the K/V it writes equal the Python loop's bit for bit; a chunk longer than the native attention
    takes (as on a CPU whose SDPA runs in bf16) keeps the loop."""
    kernels = real_runner.forward.kernels if real_runner.forward is not None else None
    assert kernels is not None
    # The kind is selected on the runner's own library (each loaded library keeps its own selection).
    if kernels.select_tile_matmul(tile_kind) != tile_kind:
        kernels.select_tile_matmul(None)
        pytest.skip(f"this CPU has no {tile_kind} tile kernel")
    try:
        _whole_step_equals_the_loop(real_runner, kernels, tile_kind, kv_dtype)
    finally:
        kernels.select_tile_matmul(None)


def _whole_step_equals_the_loop(real_runner: ModelRunner, kernels: EngineKernels, tile_kind: str,
                                kv_dtype: torch.dtype) -> None:
    forward = gguf_forward(torch.device("cpu"), real_runner.model, kernels)
    forward.kernels = kernels
    forward.native_attention_max_run = NATIVE_ATTENTION_MAX_RUN
    info = dataclasses.replace(real_runner.info, dtype=kv_dtype)
    texts = ("The capital of France is", "Water boils at", "One, two, three, four,", "Dear diary, today", "Hi")
    prompts = [real_runner.tokenizer(text * n).input_ids for n, text in enumerate(texts, start=1)]
    long_prompt = real_runner.tokenizer("A long story begins here. " * 12).input_ids
    assert len(long_prompt) > NATIVE_ATTENTION_MAX_RUN >= max(map(len, prompts))

    def run(native: bool) -> tuple[list[torch.Tensor], torch.Tensor, int]:
        runner = ModelRunner(real_runner.model, real_runner.tokenizer, info, forward)
        runner.configure_pool(64 << 20)
        forward.use_native_step, before = native, forward.native_steps
        caches = [runner.new_cache() for _ in range(len(prompts) + 1)]
        try:
            out = [runner.step(caches[:-1], prompts)]  # five short chunks packed: one native step
            out.append(runner.step(caches[-1:], [long_prompt]))  # too long for the native attention: the loop
            tokens = [*out[0].argmax(-1).tolist(), int(out[1].argmax(-1)[0])]
            for width in (len(caches), 1, len(caches), 4):  # decode steps of several sessions, and of one
                logits = runner.decode(caches[:width], tokens[:width])
                out.append(logits)
                tokens[:width] = logits.argmax(-1).tolist()
            pool = runner.pool.tensors.kv  # [layers, 2, kv_heads, blocks, block_size, head_dim]
            written = torch.cat([pool[:, :, :, torch.tensor(c.block_ids)].flatten(3, 4)[:, :, :, :c.length]
                                 for c in caches], dim=3)  # each cache's positions (not a block's unused slots)
            return out, written, forward.native_steps - before
        finally:
            forward.use_native_step = True
            for cache in caches:
                cache.free()

    native, written_native, native_steps = run(True)
    loop, written_loop, loop_steps = run(False)
    assert loop_steps == 0
    assert native_steps == 5  # the packed chunks and every decode step, of one session as of six
    for a, b in zip(native, loop, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(written_native, written_loop)


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float32])
def test_where_every_chunk_attends_natively_a_prompt_is_the_same_bits_however_it_is_chunked(
        real_runner: ModelRunner, kv_dtype: torch.dtype) -> None:
    """Where SDPA would run in fp32 (no AMX tiles), prompt chunks of every length attend through the native kernel,
    so with the projections on the vector tile kernel a whole prompt step is one native call. Each row's
    projections, RoPE, K/V write and attention are then computed alone, by the same code whatever else is in its
    call: a prompt prefilled in one chunk or in three leaves the same K/V bits and ends on the same logits."""
    kernels = real_runner.forward.kernels if real_runner.forward is not None else None
    assert kernels is not None
    if kernels.tile_matmul_kind not in ("avx512-vnni", "avx2", "amx"):
        pytest.skip("this CPU has no tile kernel")
    forward = gguf_forward(torch.device("cpu"), real_runner.model, kernels)
    forward.kernels = kernels
    assert forward.native_attention_max_run == (NATIVE_ATTENTION_MAX_RUN if forward.bf16_attention else sys.maxsize)
    forward.native_attention_max_run = sys.maxsize  # what a CPU without AMX runs; on AMX, for this test
    default_rows, kernels.amx_min_rows = kernels.amx_min_rows, 1 << 20  # AMX rounds x its own way: vectors only
    info = dataclasses.replace(real_runner.info, dtype=kv_dtype)
    runner = ModelRunner(real_runner.model, real_runner.tokenizer, info, forward)
    runner.configure_pool(64 << 20)
    prompt = real_runner.tokenizer("Once upon a time a fox lived in the woods near a river. " * 10).input_ids
    assert len(prompt) > 2 * NATIVE_ATTENTION_MAX_RUN

    def prefill(cuts: list[int]) -> tuple[torch.Tensor, torch.Tensor, int]:
        cache, before = runner.new_cache(), forward.native_steps
        try:
            for start, end in zip([0, *cuts], [*cuts, len(prompt)], strict=True):
                logits = runner.prefill(cache, prompt[start:end])
            keys_values = torch.cat([torch.cat([k, v]) for k, v in cache.filled_layers()])
            return logits, keys_values.clone(), forward.native_steps - before
        finally:
            cache.free()

    try:
        whole, whole_kv, whole_steps = prefill([])
        parts, parts_kv, parts_steps = prefill([NATIVE_ATTENTION_MAX_RUN + 7, len(prompt) - 40])
    finally:
        kernels.amx_min_rows = default_rows
    assert (whole_steps, parts_steps) == (1, 3)  # every chunk, the longest too, in one native call
    assert torch.equal(whole, parts)
    assert torch.equal(whole_kv, parts_kv)


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("n", [0, 1, 63, 64, 4097])
def test_byte_planes_split_and_join_like_numpy(kernel: EngineKernels, size: int, n: int) -> None:
    # planes[p] is byte p of every element, most significant first, whatever the host's byte order.
    gen = np.random.default_rng(n * size)
    elements = gen.integers(0, 256, size=(n, size), dtype=np.uint8)
    words = elements.view(np.uint16 if size == 2 else np.uint32).reshape(n)
    want = np.stack([((words >> (8 * (size - 1 - p))) & 0xFF).astype(np.uint8) for p in range(size)])
    planes = np.full((size, n), 0xAA, dtype=np.uint8)
    kernel.split_planes(elements, planes)
    assert np.array_equal(planes, want)
    back = np.zeros((n, size), dtype=np.uint8)
    kernel.join_planes(planes, back)
    assert np.array_equal(back, elements)


def test_byte_planes_refuse_shapes_they_cannot_take(kernel: EngineKernels) -> None:
    elements = np.zeros((10, 2), dtype=np.uint8)
    with pytest.raises(ValueError, match="join_planes"):
        kernel.join_planes(np.zeros((2, 9), dtype=np.uint8), elements)  # counts differ
    with pytest.raises(ValueError, match="split_planes"):
        kernel.split_planes(np.zeros((10, 8), dtype=np.uint8), np.zeros((8, 10), dtype=np.uint8))  # 8-byte elements
    with pytest.raises(ValueError, match="join_planes"):
        kernel.join_planes(np.zeros((2, 20), dtype=np.uint8)[:, ::2], elements)  # not contiguous
    assert not elements.any()
