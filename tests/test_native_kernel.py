"""The native kernels (chatd/engine/kernels/: chatd_kernels.h lists the files; the byte planes, chatd/kv/planes.c).

One library per machine, built once and cached, holds every variant of every op: the portable scalar reference and,
on x86-64, the AVX2, AVX-512 and AMX files. One table-driven test runs every op (:data:`OPS`) on every variant this
CPU can run, the scalar reference included (a class it lacks skips, naming the feature), against torch: decode
attention over fp32, bf16 and int8 pools equal to torch's over the same block tables; RoPE with the K/V write bit for
bit torch's ops; the residual add with RMSNorm and SiLU x up equal to torch's; the Q4_1 and Q8_0 tile matmuls equal to
their references (AMX: x times the bf16 dequantised weights; the vector kernels and the scalar reference: the exact
weights times x rounded to int8 per block), the vector kernels to the scalar reference's bits, and a row's product
the same bits whatever else is in its call; a whole q4 step in one native call equal to the loop of the same kernels
bit for bit; the byte planes like numpy.

Then: the dispatch table (each loaded set of kernels its own, chosen from the CPU's features after CHATD_CPU_ISA's
cap; a library of the portable files alone runs the scalar variants); the engine's decode steps and prompts through
the kernels with the torch path's results, on the real model; the tile kinds against one another (AVX2 computes
AVX512-VNNI's bits; AMX's few-row calls run the vector kernel); a whole q4 step of the real model in one native call
equal to the loop over layers. tests/test_kernel_header.py ties the ctypes signatures to the header."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from chatd.engine.kernels import loader
from chatd.engine.kernels.cpu import ISA_ENV, cpu_features
from chatd.engine.kernels.loader import (
    NATIVE_ARCH,
    VARIANTS,
    EngineKernels,
    StepPlan,
    build,
    load_kernels,
    variant_missing,
)
from chatd.engine.model.choices import gguf_forward
from chatd.engine.model.forward import NATIVE_ATTENTION_MAX_RUN
from chatd.engine.model.packaged import PACKAGED_GGUF, packaged_model_dir
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

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def native_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("native")


@pytest.fixture(scope="module")
def kernels(native_dir: Path) -> EngineKernels:
    """The kernels as the engine loads them: the best variants this CPU has (after CHATD_CPU_ISA's cap)."""
    loaded = load_kernels(native_dir)
    assert loaded is not None, "the test machine has a C compiler (make test installs one: scripts/setup.sh)"
    return loaded


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request: pytest.FixtureRequest, native_dir: Path) -> tuple[str, EngineKernels]:
    """Each variant this CPU can run (a class it lacks skips, naming the feature), from the same library."""
    missing = variant_missing(request.param)
    if missing:
        pytest.skip(missing)
    loaded = load_kernels(native_dir, request.param)
    assert loaded is not None, "the test machine has a C compiler (make test installs one: scripts/setup.sh)"
    return request.param, loaded


def test_the_library_is_built_once_and_reused(tmp_path: Path) -> None:
    first = build(tmp_path)
    stamp = first.stat().st_mtime_ns
    assert build(tmp_path) == first and first.stat().st_mtime_ns == stamp
    assert build(tmp_path, "scalar") == first  # one library holds every variant
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no scratch left behind


def test_loading_the_kernel_leaves_the_process_arithmetic_alone(kernels: EngineKernels) -> None:
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


# ----------------------------------------------------------------------------- every op on every variant


# Many rows (each (row, KV head) pair walks its blocks on one thread: for short sequences in a run of consecutive
# pairs per thread, for one over 32 blocks as the threads come for them), and one long row: few pairs, so each
# pair's blocks are split into ranges across the threads and merged (the sizes are in blocks of 16).
_ATTENTION_CASES = [((1, 5, 16, 17, 7 * 16 - 3, 40), (7, 0, 3, 5, 1, 2)), ((1000,), (3,)), ((300, 5), (2, 6)),
                    ((600, 3, 40, 17), (1, 4, 0, 6))]
# Groups of 1 to 4 query heads per KV head (64-wide heads) run copies of the kernel of their own; 8 the general one.
# Heads of 24 (not a multiple of AVX-512's 16 lanes) and 12 (nor of AVX2's 8) take the portable walk of whole pairs.
_ATTENTION_SHAPES = [(9, 3, 64), (4, 4, 64), (4, 2, 64), (8, 2, 64), (8, 1, 64), (4, 2, 24), (6, 2, 12)]


def _check_decode_attention(kernels: EngineKernels, kv_dtype: torch.dtype) -> None:
    for num_heads, num_kv_heads, head_dim in _ATTENTION_SHAPES:
        for lengths, rows in _ATTENTION_CASES:
            _attention_equals_torch(kernels, num_heads, num_kv_heads, head_dim, lengths, rows, kv_dtype)


def _attention_equals_torch(kernels: EngineKernels, num_heads: int, num_kv_heads: int, head_dim: int,
                            lengths: tuple[int, ...], rows_of_step: tuple[int, ...], kv_dtype: torch.dtype) -> None:
    torch.manual_seed(num_heads * 10 + num_kv_heads)
    layers = 2
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
    rows = torch.tensor(rows_of_step, dtype=torch.int32)
    q = torch.randn(8, num_heads + num_kv_heads, head_dim)[:, :num_heads]  # a view, as the forward passes it
    out = torch.full((8, num_heads * head_dim), float("nan"))
    keys, values = pool.tensors.kv[1, 0], pool.tensors.kv[1, 1]
    kernels.decode_attention(q, out, rows, keys, values, order, torch.tensor(lengths, dtype=torch.int32),
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
        torch.testing.assert_close(out[int(rows[i])], expected, rtol=tolerance, atol=tolerance,
                                   msg=lambda m, i=i: f"{(num_heads, num_kv_heads, head_dim, lengths)} row {i}: {m}")
    untouched = sorted(set(range(8)) - set(rows.tolist()))
    assert torch.isnan(out[untouched]).all()


def nan_width(pool: KVPool) -> int:
    """How many trailing elements of a position hold NaN in the attention check: the scale of an int8 row, all of
    an fp32 or bf16 one."""
    return INT8_SCALE_BYTES if pool.quantized else pool.head_dim


def _rope_tables(head_dim: int, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[positions, head_dim]`` as the compact forward makes them (chatd.engine.model.forward)."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = torch.outer(torch.arange(positions, dtype=torch.float32), inv_freq)
    table = torch.cat([freqs, freqs], dim=-1)
    return table.cos(), table.sin()


def _stored(x: torch.Tensor, kv_dtype: torch.dtype) -> torch.Tensor:
    """K or V ``[..., head_dim]`` as a pool of ``kv_dtype`` stores it (chatd.engine.pool.kvcache.KVPool.write)."""
    return quantize_rows(x) if kv_dtype == torch.int8 else x.to(kv_dtype)


def _check_rope_write(kernels: EngineKernels) -> None:
    """The rotation and the K/V write leave the bits torch's ops leave (the compact forward's torch path), for
    steps of a few rows and of enough to run on the threads."""
    torch.manual_seed(5)
    num_heads, num_kv_heads, head_dim, blocks = 9, 3, 64, 12
    cos, sin = _rope_tables(head_dim, 256)
    for kv_dtype in (torch.float32, torch.bfloat16, torch.int8):
        for rows in (3, 12):
            qkv = torch.randn(rows, (num_heads + 2 * num_kv_heads) * head_dim) * 3
            positions = torch.randint(0, 256, (rows,))
            slots = torch.randperm(blocks * 16)[:rows]
            row = head_dim + (INT8_SCALE_BYTES if kv_dtype == torch.int8 else 0)
            keys = torch.zeros(num_kv_heads, blocks, 16, row, dtype=kv_dtype)
            values = torch.zeros_like(keys)
            heads = qkv.view(rows, -1, head_dim)
            qk = heads[:, :num_heads + num_kv_heads]
            half = head_dim // 2
            rotated = qk * cos[positions][:, None] + torch.cat([-qk[..., half:], qk[..., :half]], dim=-1) * sin[
                positions][:, None]
            expected_qkv = torch.cat([rotated, heads[:, num_heads + num_kv_heads:]], dim=1).reshape(rows, -1)
            expected_keys, expected_values = keys.clone(), values.clone()
            k, v = rotated[:, num_heads:], heads[:, num_heads + num_kv_heads:]
            expected_keys.view(num_kv_heads, -1, row)[:, slots] = _stored(k, kv_dtype).transpose(0, 1)
            expected_values.view(num_kv_heads, -1, row)[:, slots] = _stored(v, kv_dtype).transpose(0, 1)
            kernels.rope_write(qkv, num_heads, positions, cos, sin, keys, values, slots)
            assert torch.equal(qkv, expected_qkv), (kv_dtype, rows)
            assert torch.equal(keys, expected_keys) and torch.equal(values, expected_values), (kv_dtype, rows)


def _bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance between two bf16 tensors of one sign per element, in units in the last place."""
    return int((a.view(torch.int16).int() - b.view(torch.int16).int()).abs().max())


def _check_add_rms_norm(kernels: EngineKernels) -> None:
    torch.manual_seed(3)
    for rows, hidden in ((1, 576), (7, 64), (300, 576), (3, 100)):  # 300 rows take the threaded loop
        h = torch.randn(rows, hidden) * 3
        weight = torch.rand(hidden) + 0.5
        wide = torch.randn(rows, 2 * hidden).to(torch.bfloat16)
        add = wide[:, :hidden]  # a strided view: rows of a wider tensor
        expected_h = h + add.float()
        expected = F.rms_norm(expected_h, (hidden,), weight, 1e-5).to(torch.bfloat16)
        got = kernels.add_rms_norm(h, add, weight, 1e-5)
        assert torch.equal(h, expected_h)  # the residual add is exact, in place
        assert _bf16_ulps(got, expected) <= 1  # the sum of squares is added in another order
        assert (got == expected).float().mean() > 0.99
        again = kernels.add_rms_norm(h, None, weight, 1e-5)  # no add: the norm alone, h unchanged
        assert torch.equal(again, got) and torch.equal(h, expected_h)
    with pytest.raises(ValueError):
        kernels.add_rms_norm(torch.randn(2, 8), None, torch.ones(9), 1e-5)


def _check_silu_mul(kernels: EngineKernels) -> None:
    torch.manual_seed(4)
    for rows, inter in ((1, 1536), (200, 1536), (3, 100)):
        gate_up = (torch.randn(rows, 2 * inter) * 4).to(torch.bfloat16)
        gate, up = gate_up.float().chunk(2, dim=-1)
        expected = (F.silu(gate) * up).to(torch.bfloat16)
        got = kernels.silu_mul(gate_up)
        assert _bf16_ulps(got, expected) <= 1
        assert (got == expected).float().mean() > 0.99
    with pytest.raises(ValueError):
        kernels.silu_mul(torch.randn(2, 8))


def _q4_weight(n: int, k: int, seed: int) -> Q4_1Weight:
    generator = torch.Generator().manual_seed(seed)
    return Q4_1Weight(scale=(torch.rand(n, k // 32, generator=generator) * 0.01).half(),
                      minimum=(-torch.rand(n, k // 32, generator=generator) * 0.08).half(),
                      quants=torch.randint(0, 16, (n, k), generator=generator, dtype=torch.uint8))


def _q8_weight(n: int, k: int, generator: torch.Generator) -> Q8_0Weight:
    return Q8_0Weight(scale=(torch.rand(n, k // 32, generator=generator) * 0.01).half(),
                      quants=torch.randint(-128, 128, (n, k), generator=generator, dtype=torch.int8))


# The tile matmul each variant runs; the scalar reference only where selected (the CPU's features never choose it).
_VARIANT_MATMUL = {"amx": "amx", "avx512": "avx512-vnni", "avx2": "avx2", "scalar": "scalar"}


def _pack(kind: str, weight: Q4_1Weight | Q8_0Weight) -> torch.Tensor:
    """``weight`` packed for the tile kernel ``kind`` (the scalar reference reads the vector kernels' layout)."""
    return pack_for("avx512-vnni" if kind == "scalar" else kind, weight)


@contextlib.contextmanager
def _variant_matmul(kernels: EngineKernels, variant: str) -> Iterator[str]:
    """The variant's tile matmul selected for the block (skips where this CPU or process has not got it), the
    kernels' own choice and AMX threshold restored after."""
    kind = _VARIANT_MATMUL[variant]
    default_rows = kernels.amx_min_rows
    if kernels.select_tile_matmul(kind) != kind:
        kernels.select_tile_matmul(None)
        feature = "AMX tiles granted to this process" if kind == "amx" else "AVX512-VNNI (avx512_vnni)"
        pytest.skip(f"this CPU lacks {feature}")
    try:
        yield kind
    finally:
        kernels.select_tile_matmul(None)
        kernels.amx_min_rows = default_rows


def _amx_settings(kernels: EngineKernels, kind: str) -> Iterator[None]:
    """Under AMX: the threshold as the engine runs it, then AMX for every call (``amx_min_rows`` 1); else once."""
    yield
    if kind == "amx":
        kernels.amx_min_rows = 1
        yield


def _tile_reference(kind: str, x: torch.Tensor, weight: Q4_1Weight | Q8_0Weight) -> torch.Tensor:
    """What the tile kernel ``kind`` computes, before its output is rounded to bf16 (fp64): on AMX, x times the
    bf16 copy of the dequantised weight; on AVX512-VNNI, AVX2 and the scalar reference, the exact weight times x
    rounded to int8 per block of 32 (scale max |x| / 127, to nearest even)."""
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


def _kind_for(kernels: EngineKernels, kind: str, m: int) -> str:
    """The kernel a call of ``m`` rows runs under ``kind``: with AMX, the vectors below ``amx_min_rows``."""
    return "avx512-vnni" if kind == "amx" and m < kernels.amx_min_rows else kind


def _scalar_product(kernels: EngineKernels, kind: str, x: torch.Tensor, weight: Q4_1Weight | Q8_0Weight, n: int,
                    q8: bool) -> torch.Tensor:
    """x times ``weight`` on the scalar reference, ``kind`` selected again after."""
    assert kernels.select_tile_matmul("scalar") == "scalar"
    try:
        return kernels.tile_matmul(x, _pack("scalar", weight), n, q8=q8)
    finally:
        assert kernels.select_tile_matmul(kind) == kind


def _check_q4_matmul(kernels: EngineKernels, variant: str) -> None:
    """The tile kernel computes exactly its reference (:func:`_tile_reference`) for any row count: one pass of
    rows, partial passes, several passes. Only the order of the fp32 sums differs, and the output is rounded
    to bf16 once; and it stays close to the exact product. Under AMX, calls of fewer rows than
    ``amx_min_rows`` compute the vector kernel's reference. The vector kernels compute the scalar reference's
    bits (the same integer block sums, added in the same order)."""
    torch.manual_seed(6)
    with _variant_matmul(kernels, variant) as kind:
        for _ in _amx_settings(kernels, kind):
            for n, k in ((48, 64), (960, 576), (576, 1536)):
                weight = _q4_weight(n, k, n + k)
                tiles = _pack(kind, weight)
                assert tiles.shape == _layout_shape(kind, n, k, 320)
                for m in (1, 3, 8, 15, 16, 17, 40, 64, 100, 150):
                    x = torch.randn(m, k).to(torch.bfloat16)
                    got = kernels.tile_matmul(x, tiles, n)
                    want = _tile_reference(_kind_for(kernels, kind, m), x, weight)
                    scale = want.abs().max()
                    # within a bf16 rounding of the largest output (half an ulp: under 2 ** -8 of it), and the fp32
                    # sums' own rounding
                    assert (got.double() - want).abs().max() <= 1.05 * 2 ** -8 * scale, (kind, n, k, m)
                    exact = x.double() @ weight.dequantize().double().T
                    assert (got.double() - exact).abs().max() <= 0.02 * exact.abs().max(), (kind, n, k, m)
                    if _kind_for(kernels, kind, m) != "amx" and kind != "scalar":
                        assert torch.equal(got, _scalar_product(kernels, kind, x, weight, n, False)), (kind, n, k, m)
        with pytest.raises(ValueError):
            kernels.tile_matmul(torch.randn(2, 64).to(torch.bfloat16), _pack(kind, _q4_weight(32, 64, 1)), 48)


def _check_q8_matmul(kernels: EngineKernels, variant: str) -> None:
    """The same for a Q8_0 weight (the LM head's format)."""
    generator = torch.Generator().manual_seed(11)
    with _variant_matmul(kernels, variant) as kind:
        for _ in _amx_settings(kernels, kind):
            for n, k in ((32, 64), (4096, 576)):
                weight = _q8_weight(n, k, generator)
                tiles = _pack(kind, weight)
                assert tiles.shape == _layout_shape(kind, n, k, 544)
                for m in (1, 4, 9, 16, 70):
                    x = torch.randn(m, k).to(torch.bfloat16)
                    want = _tile_reference(_kind_for(kernels, kind, m), x, weight)
                    got = kernels.tile_matmul(x, tiles, n, q8=True)
                    assert (got.double() - want).abs().max() <= 1.05 * 2 ** -8 * want.abs().max(), (kind, n, k, m)
                    if _kind_for(kernels, kind, m) != "amx" and kind != "scalar":
                        assert torch.equal(got, _scalar_product(kernels, kind, x, weight, n, True)), (kind, n, k, m)
                if kind != "scalar":  # (pack_for, which the linear packs with, has no scalar layout of its own)
                    linear = TileQ8Linear(weight, kernels)
                    few = torch.randn(1, k).to(torch.bfloat16)
                    want = few.double() @ weight.dequantize().double().T
                    assert (linear.bf16(few).double() - want).abs().max() <= 0.02 * want.abs().max()
        with pytest.raises(ValueError):  # Q4_1 tiles are not Q8_0 ones
            kernels.tile_matmul(torch.randn(4, 64).to(torch.bfloat16), _pack(kind, _q4_weight(32, 64, 1)), 32,
                                q8=True)


def _check_rows_alone(kernels: EngineKernels, variant: str) -> None:
    """Calls of up to 16 rows quantise x once per thread, larger ones once in all (matmul.c's OWN_ROWS): a
    row's outputs are the same bits whichever way it went, alone, among a few rows or among many."""
    generator = torch.Generator().manual_seed(17)
    with _variant_matmul(kernels, variant) as kind:
        kernels.amx_min_rows = 1000  # under AMX too, every call here on the vectors (AMX rounds x its own way)
        for weight, n, k, is_q8 in ((_q4_weight(960, 576, 7), 960, 576, False),
                                    (_q8_weight(96, 1536, generator), 96, 1536, True)):
            tiles = _pack(kind, weight)
            x = torch.randn(40, k, generator=generator).to(torch.bfloat16)
            whole = kernels.tile_matmul(x, tiles, n, q8=is_q8)
            parts = [kernels.tile_matmul(x[start:end], tiles, n, q8=is_q8)
                     for start, end in ((0, 1), (1, 4), (4, 20), (20, 36), (36, 40))]
            assert torch.equal(torch.cat(parts), whole), (kind, n, k)


@dataclasses.dataclass
class _TinyQ4Model:
    """A random 2-layer q4 model and its pool, as a StepPlan takes them."""

    plan: StepPlan
    layers: list[dict[str, torch.Tensor]]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float


def _tiny_q4_model(kind: str, kv_dtype: torch.dtype, seed: int) -> _TinyQ4Model:
    torch.manual_seed(seed)
    num_layers, hidden, num_heads, num_kv_heads, head_dim, inter, vocab = 2, 128, 4, 2, 32, 256, 512
    row = head_dim + (INT8_SCALE_BYTES if kv_dtype == torch.int8 else 0)
    kv = torch.zeros(num_layers, 2, num_kv_heads, 8, 16, row, dtype=kv_dtype)
    layers = [{"attn_norm": torch.rand(hidden) + 0.5, "ffn_norm": torch.rand(hidden) + 0.5,
               "qkv": _pack(kind, _q4_weight((num_heads + 2 * num_kv_heads) * head_dim, hidden, seed + 10 * i)),
               "o": _pack(kind, _q4_weight(hidden, num_heads * head_dim, seed + 10 * i + 1)),
               "gate_up": _pack(kind, _q4_weight(2 * inter, hidden, seed + 10 * i + 2)),
               "down": _pack(kind, _q4_weight(hidden, inter, seed + 10 * i + 3))} for i in range(num_layers)]
    lm_head = _pack(kind, _q8_weight(vocab, hidden, torch.Generator().manual_seed(seed)))
    plan = StepPlan(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, inter=inter, eps=1e-5,
                    scale=head_dim ** -0.5, layers=layers, final_norm=torch.rand(hidden) + 0.5, lm_head=lm_head,
                    vocab=vocab, kv=kv, kind=kind)
    return _TinyQ4Model(plan, layers, num_heads, num_kv_heads, head_dim, 1e-5)


def _loop_over_layers(kernels: EngineKernels, model: _TinyQ4Model, h: torch.Tensor, positions: torch.Tensor,
                      cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor,
                      lengths: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """What chatd_forward_step computes, one kernel call at a time (the compact forward's loop with native steps)."""
    plan, rows = model.plan, h.shape[0]
    heads, kv_heads, head_dim = model.num_heads, model.num_kv_heads, model.head_dim
    pending: torch.Tensor | None = None
    order = torch.arange(rows, dtype=torch.int32)
    for index, layer in enumerate(model.layers):
        qkv_n = (heads + 2 * kv_heads) * head_dim
        x = kernels.add_rms_norm(h, pending, layer["attn_norm"], model.eps)
        qkv = kernels.tile_matmul(x, layer["qkv"], qkv_n).float()
        kernels.rope_write(qkv, heads, positions, cos, sin, plan.kv[index, 0], plan.kv[index, 1], slots)
        attention = torch.empty(rows, heads * head_dim)
        kernels.decode_attention(qkv.view(rows, -1, head_dim)[:, :heads], attention, order, plan.kv[index, 0],
                                 plan.kv[index, 1], tables, lengths, plan.shape.scale)
        attended = kernels.tile_matmul(attention.to(torch.bfloat16), layer["o"], h.shape[1])
        x = kernels.add_rms_norm(h, attended, layer["ffn_norm"], model.eps)
        act = kernels.silu_mul(kernels.tile_matmul(x, layer["gate_up"], 2 * plan.shape.inter))
        pending = kernels.tile_matmul(act, layer["down"], h.shape[1])
    x = kernels.add_rms_norm(h, pending, plan.final_norm, model.eps)
    return kernels.tile_matmul(x[last.long()].contiguous(), plan.lm_head, plan.shape.vocab, q8=True)


def _check_forward_step(kernels: EngineKernels, variant: str) -> None:
    """A whole step in one native call (step.c) runs the same kernels in the same order as the loop over layers,
    so its logits, the residual stream and the K/V it writes are the loop's bits: a prompt step of three sequences
    (19 rows: the threaded element-wise loops, AMX's tiles from 16 rows), then a decode step of the three."""
    with _variant_matmul(kernels, variant) as kind:
        head_dim = 32
        cos, sin = _rope_tables(head_dim, 64)
        prompt = [8, 6, 5]
        steps = [  # (positions, slots, tables, lengths) of each row; sequence s owns block 2 * s + 1
            ([p for n in prompt for p in range(n)],
             [16 * (2 * s + 1) + p for s, n in enumerate(prompt) for p in range(n)],
             [[2 * s + 1] for s, n in enumerate(prompt) for _ in range(n)], [p + 1 for n in prompt for p in range(n)]),
            (prompt, [16 * (2 * s + 1) + n for s, n in enumerate(prompt)], [[2 * s + 1] for s in range(3)],
             [n + 1 for n in prompt]),
        ]
        for kv_dtype in (torch.float32, torch.bfloat16, torch.int8):
            native, loop = _tiny_q4_model(kind, kv_dtype, 21), _tiny_q4_model(kind, kv_dtype, 21)
            for step, (positions, slots, tables, lengths) in enumerate(steps):
                args = (torch.tensor(positions), cos, sin, torch.tensor(slots), torch.tensor(tables, dtype=torch.int32),
                        torch.tensor(lengths, dtype=torch.int32))
                last = torch.tensor([len(positions) - 1, 0], dtype=torch.int32)
                h = torch.randn(len(positions), 128, generator=torch.Generator().manual_seed(step))
                h_native, h_loop = h.clone(), h.clone()
                logits = kernels.forward_step(native.plan, h_native, *args, last)
                expected = _loop_over_layers(kernels, loop, h_loop, *args, last)
                assert torch.equal(logits, expected), (kind, kv_dtype, step)
                assert torch.equal(h_native, h_loop), (kind, kv_dtype, step)
                assert torch.equal(native.plan.kv, loop.plan.kv), (kind, kv_dtype, step)


def _check_byte_planes(kernels: EngineKernels) -> None:
    # planes[p] is byte p of every element, most significant first, whatever the host's byte order.
    for size in (2, 4):
        for n in (0, 1, 63, 64, 4097):
            gen = np.random.default_rng(n * size)
            elements = gen.integers(0, 256, size=(n, size), dtype=np.uint8)
            words = elements.view(np.uint16 if size == 2 else np.uint32).reshape(n)
            want = np.stack([((words >> (8 * (size - 1 - p))) & 0xFF).astype(np.uint8) for p in range(size)])
            planes = np.full((size, n), 0xAA, dtype=np.uint8)
            kernels.split_planes(elements, planes)
            assert np.array_equal(planes, want), (size, n)
            back = np.zeros((n, size), dtype=np.uint8)
            kernels.join_planes(planes, back)
            assert np.array_equal(back, elements), (size, n)


# Every op, as (kernels, variant name) -> None: the table the next test runs on every variant.
OPS: dict[str, Callable[[EngineKernels, str], None]] = {
    "decode attention, fp32 pool": lambda kernels, _: _check_decode_attention(kernels, torch.float32),
    "decode attention, bf16 pool": lambda kernels, _: _check_decode_attention(kernels, torch.bfloat16),
    "decode attention, int8 pool": lambda kernels, _: _check_decode_attention(kernels, torch.int8),
    "rope_write": lambda kernels, _: _check_rope_write(kernels),
    "add_rms_norm": lambda kernels, _: _check_add_rms_norm(kernels),
    "silu_mul": lambda kernels, _: _check_silu_mul(kernels),
    "Q4_1 tile matmul": _check_q4_matmul,
    "Q8_0 tile matmul": _check_q8_matmul,
    "tile matmul, each row alone": _check_rows_alone,
    "forward_step": _check_forward_step,
    "split and join byte planes": lambda kernels, _: _check_byte_planes(kernels),  # (one library, no variants)
}


@pytest.mark.parametrize("op", list(OPS))
def test_every_op_on_every_variant(variant: tuple[str, EngineKernels], op: str, two_torch_threads: None) -> None:
    name, kernels = variant
    expected_isa = {"amx": "avx512", "avx512": "avx512", "avx2": "avx2", "scalar": "scalar"}[name]
    assert kernels.isa == expected_isa  # the variant's own attention and element-wise files run
    OPS[op](kernels, name)


#---------------------------------------------------------------------- the engine through the kernels (the real model)


def _with_kv(runner: ModelRunner, kv_dtype: torch.dtype) -> ModelRunner:
    """The same model and forward over a pool of its own holding K/V as ``kv_dtype``."""
    if kv_dtype == runner.info.dtype:
        return runner
    other = ModelRunner(runner.model, runner.tokenizer, dataclasses.replace(runner.info, dtype=kv_dtype),
                        runner.forward)
    other.configure_pool(256 << 20)
    return other


@pytest.mark.parametrize("threads", [2, 4])
def test_decode_attention_spreads_every_call_of_two_or_more_pairs_over_the_threads(kernels: EngineKernels,
                                                                                  threads: int) -> None:
    """A call's pairs (or, for fewer pairs than twice the threads, their block ranges) run on the threads
    whenever there are two or more. Short contexts once got 0 ranges, which ran every pair of a 16-session
    step on one thread while the others waited."""
    for pairs in range(1, 65):
        for blocks in range(0, 129):
            parts = kernels.attention_parts(pairs, blocks, threads)
            assert parts >= 1, (pairs, blocks)  # 0 ranges turned the parallel region off
            assert parts == 1 or blocks // parts >= 8, (pairs, blocks, parts)  # ranges of 8 blocks or more
            if pairs >= 2 * threads:
                assert parts == 1, (pairs, blocks, parts)  # enough pairs: each stays whole
    # one session's step over a long context (3 KV heads, 2,048 tokens): its pairs split so all threads work
    assert 3 * kernels.attention_parts(3, 128, threads) >= 2 * threads


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
    forward = gguf_forward(torch.device("cpu"), packaged_model_dir() / PACKAGED_GGUF, real_runner.model)
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


# ------------------------------------------------------ the tile kinds against one another, the real model's whole step


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


def test_the_tile_kinds_agree(kernels: EngineKernels) -> None:
    """Where the CPU has AMX, its vector kernel gives the same products, to x's int8 rounding."""
    if kernels.select_tile_matmul("amx") != "amx":
        kernels.select_tile_matmul(None)
        pytest.skip("this CPU has no AMX tiles")
    weight = _q4_weight(960, 576, 3)
    x = torch.randn(24, 576).to(torch.bfloat16)
    try:
        on_tiles = kernels.tile_matmul(x, pack_for("amx", weight), 960).float()
        assert kernels.select_tile_matmul("avx512-vnni") == "avx512-vnni"
        on_vectors = kernels.tile_matmul(x, pack_for("avx512-vnni", weight), 960).float()
    finally:
        kernels.select_tile_matmul(None)
    assert (on_tiles - on_vectors).abs().max() <= 0.02 * on_tiles.abs().max()


def test_the_avx2_kernel_computes_the_avx512_vnni_kernels_bits(kernels: EngineKernels) -> None:
    """AVX2 reads the VNNI layout as two halves and sums the same exact integer block sums, in the same fp32 order:
    on a CPU with both, Q4_1 and Q8_0 products are equal bit for bit, whatever the rows."""
    if kernels.select_tile_matmul("avx512-vnni") != "avx512-vnni":
        kernels.select_tile_matmul(None)
        pytest.skip("this CPU (or this build) has no AVX512-VNNI to compare with")
    generator = torch.Generator().manual_seed(13)
    q8 = _q8_weight(80, 3072, generator)
    try:
        for weight, n, k, is_q8 in ((_q4_weight(960, 576, 3), 960, 576, False), (q8, 80, 3072, True)):
            for m in (1, 3, 8, 17):
                x = torch.randn(m, k, generator=generator).to(torch.bfloat16)
                assert kernels.select_tile_matmul("avx512-vnni") == "avx512-vnni"
                on_512 = kernels.tile_matmul(x, pack_for("avx512-vnni", weight), n, q8=is_q8)
                assert kernels.select_tile_matmul("avx2") == "avx2"
                on_256 = kernels.tile_matmul(x, pack_for("avx2", weight), n, q8=is_q8)
                assert torch.equal(on_512, on_256), (n, k, m)
    finally:
        kernels.select_tile_matmul(None)


def test_under_amx_calls_of_few_rows_run_the_vector_kernel_and_many_the_tiles(kernels: EngineKernels) -> None:
    """Under AMX, a call of fewer rows than ``amx_min_rows`` (16) equals the vector kernel's result on the
    same weight bit for bit (it runs that kernels, on the second layout), and a call of more rows equals
    AMX's (the rows do not depend on one another in either kernels)."""
    if kernels.select_tile_matmul("amx") != "amx":
        kernels.select_tile_matmul(None)
        pytest.skip("this CPU has no AMX tiles")
    weight = _q4_weight(960, 576, 4)
    both = pack_for("amx", weight)
    x = torch.randn(40, 576).to(torch.bfloat16)
    default = kernels.amx_min_rows
    try:
        assert default == 16
        mixed = {m: kernels.tile_matmul(x[:m].contiguous(), both, 960) for m in (1, 5, 15, 16, 40)}
        kernels.amx_min_rows = 1
        on_tiles = kernels.tile_matmul(x, both, 960)
        assert kernels.select_tile_matmul("avx512-vnni") == "avx512-vnni"
        on_vectors = kernels.tile_matmul(x, pack_for("avx512-vnni", weight), 960)
    finally:
        kernels.select_tile_matmul(None)
        kernels.amx_min_rows = default
    for m, got in mixed.items():
        want = (on_vectors if m < default else on_tiles)[:m]
        assert torch.equal(got, want), m
    assert not torch.equal(on_tiles[:15], on_vectors[:15])  # the two kernels round x differently
    with pytest.raises(ValueError):
        kernels.amx_min_rows = 0


def test_under_amx_a_call_of_many_rows_equals_its_rows_in_calls_of_64(kernels: EngineKernels) -> None:
    """Calls of more than 64 rows run AMX's second kernel (each weight dequantised once per call, slices of x
    paired against pairs of output groups, the last slice partial or a slice alone): every row's sums run in
    the same order as in the one-pass kernel of calls up to 64 rows, so the results are equal bit for bit, for
    Q4_1 and Q8_0 weights, an odd number of output groups included."""
    if kernels.select_tile_matmul("amx") != "amx":
        kernels.select_tile_matmul(None)
        pytest.skip("this CPU has no AMX tiles")
    generator = torch.Generator().manual_seed(12)
    q8 = _q8_weight(80, 3072, generator)
    default = kernels.amx_min_rows
    kernels.amx_min_rows = 1  # the last rows' call may be short: on the tiles too
    try:
        for weight, n, k, is_q8 in ((_q4_weight(48, 576, 5), 48, 576, False),
                                    (_q4_weight(576, 1536, 6), 576, 1536, False), (q8, 80, 3072, True)):
            tiles = pack_for("amx", weight)
            for m in (65, 80, 96, 100, 150, 272):
                x = torch.randn(m, k, generator=generator).to(torch.bfloat16)
                together = kernels.tile_matmul(x, tiles, n, q8=is_q8)
                apart = torch.cat([kernels.tile_matmul(x[i:i + 64].contiguous(), tiles, n, q8=is_q8)
                                   for i in range(0, m, 64)])
                assert torch.equal(together, apart), (n, k, m)
    finally:
        kernels.select_tile_matmul(None)
        kernels.amx_min_rows = default


def test_the_tile_linear_refuses_a_kernel_its_weights_are_not_packed_for(kernels: EngineKernels) -> None:
    if not kernels.tile_matmul_kind:
        pytest.skip("this CPU has no tile kernel (neither AMX, AVX512-VNNI nor AVX2)")
    linear = TileQ4Linear(_q4_weight(64, 96, 7), kernels)
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
    forward = gguf_forward(torch.device("cpu"), packaged_model_dir() / PACKAGED_GGUF, real_runner.model, kernels)
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
    forward = gguf_forward(torch.device("cpu"), packaged_model_dir() / PACKAGED_GGUF, real_runner.model, kernels)
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
    forward = gguf_forward(torch.device("cpu"), packaged_model_dir() / PACKAGED_GGUF, real_runner.model, kernels)
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


def test_byte_planes_refuse_shapes_they_cannot_take(kernels: EngineKernels) -> None:
    elements = np.zeros((10, 2), dtype=np.uint8)
    with pytest.raises(ValueError, match="join_planes"):
        kernels.join_planes(np.zeros((2, 9), dtype=np.uint8), elements)  # counts differ
    with pytest.raises(ValueError, match="split_planes"):
        kernels.split_planes(np.zeros((10, 8), dtype=np.uint8), np.zeros((8, 10), dtype=np.uint8))  # 8-byte elements
    with pytest.raises(ValueError, match="join_planes"):
        kernels.join_planes(np.zeros((2, 20), dtype=np.uint8)[:, ::2], elements)  # not contiguous
    assert not elements.any()


# ----------------------------------------------------------------------------- the dispatch table


def test_the_native_kernels_run_the_best_variants_this_cpu_has(kernels: EngineKernels) -> None:
    features = cpu_features()
    assert kernels.isa == ("avx512" if features.avx512 and "avx512vl" in features.flags
                           else "avx2" if features.avx2 else "scalar")


def test_each_loaded_set_of_kernels_keeps_its_own_table(native_dir: Path) -> None:
    """Two sets of kernels in one process run their own variants: choosing another tile matmul or AMX threshold on
    one leaves the other as it was (nothing in the library is a process-wide setting)."""
    native = EngineKernels(build(native_dir))
    reference = EngineKernels(build(native_dir), arch="scalar")
    assert reference.isa == "scalar" and reference.tile_matmul_kind is None  # a CPU without AVX2 keeps torch's int4
    before = native.tile_matmul_kind
    assert reference.select_tile_matmul("scalar") == "scalar"
    reference.amx_min_rows = 3
    assert native.tile_matmul_kind == before and native.amx_min_rows == 16
    x = torch.randn(3, 64).to(torch.bfloat16)
    weight = _q4_weight(32, 64, 9)
    on_reference = reference.tile_matmul(x, _pack("scalar", weight), 32)
    if before in ("avx2", "avx512-vnni"):  # the native kernels still run their own kind, with its bits
        assert torch.equal(native.tile_matmul(x, pack_for(before, weight), 32), on_reference)
    assert reference.select_tile_matmul(None) is None


def test_a_variant_this_cpu_lacks_is_refused_naming_the_feature(native_dir: Path) -> None:
    with pytest.raises(ValueError, match="no kernel variant"):
        variant_missing("x86-64-v3")
    with pytest.raises(ValueError, match="no kernel variant"):
        build(native_dir, "avx1024")
    assert variant_missing(NATIVE_ARCH) is None and variant_missing("scalar") is None
    for name in VARIANTS:
        missing = variant_missing(name)
        if missing is None:
            continue
        assert missing.startswith("this CPU lacks ")  # and the flags it lacks, e.g. "AVX-512 (avx512f, ...)"
        with pytest.raises(ValueError, match="this CPU lacks"):
            load_kernels(native_dir, name)


@pytest.mark.skipif(not cpu_features().avx2, reason="this CPU lacks AVX2 (avx2, fma, f16c)")
@pytest.mark.parametrize("cap", ["avx2", "avx512"])
def test_chatd_cpu_isa_caps_the_variants_the_table_chooses(cap: str, tmp_path: Path) -> None:
    """In a fresh process with CHATD_CPU_ISA=avx2 the engine's kernels are the AVX2 variants whatever this CPU has
    beyond AVX2 (the same library as without the cap); with avx512, no AMX tiles."""
    if cap == "avx512" and not cpu_features().avx512:
        pytest.skip("this CPU lacks AVX-512 (avx512f): the avx512 cap changes nothing here")
    code = ("import json; from pathlib import Path; from chatd.engine.kernels.loader import load_kernels; "
            f"k = load_kernels(Path({str(tmp_path)!r})); print(json.dumps([k.isa, k.tile_matmul_kind]))")
    env = {**os.environ, ISA_ENV: cap}
    env.pop("ATEN_CPU_CAPABILITY", None)
    env.pop("ONEDNN_MAX_CPU_ISA", None)
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
                         check=True)
    isa, kind = json.loads(run.stdout.strip().splitlines()[-1])
    if cap == "avx2":
        assert (isa, kind) == ("avx2", "avx2")
    else:
        assert isa == "avx512" and kind != "amx"


def test_a_library_of_the_portable_files_alone_runs_the_scalar_variants(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """What a machine other than x86-64 builds: the portable files only. Its table holds the scalar variants
    whatever features are passed, and no tile matmul but the scalar reference where chosen."""
    monkeypatch.setattr(loader, "SOURCES", tuple(s for s in loader.SOURCES if s.isa == "portable"))
    monkeypatch.setattr(loader, "_DEFINES", ())
    portable = EngineKernels(build(tmp_path))
    assert portable.isa == "scalar" and portable.tile_matmul_kind is None
    assert portable.select_tile_matmul("avx2") is None
    _attention_equals_torch(portable, 4, 2, 64, (300, 5), (2, 6), torch.int8)
    _check_add_rms_norm(portable)
    assert portable.select_tile_matmul("scalar") == "scalar"
    weight = _q4_weight(48, 64, 3)
    x = torch.randn(5, 64).to(torch.bfloat16)
    got = portable.tile_matmul(x, _pack("scalar", weight), 48).double()
    want = _tile_reference("scalar", x, weight)
    assert (got - want).abs().max() <= 1.05 * 2 ** -8 * want.abs().max()
