"""The packaged GGUF model at the precision it ships in: Q4_1 and Q8_0 weights run through torch's CPU
weight-only kernels, without an fp32 copy of any quantized matrix.

What the file holds (ggml block layouts, 32 weights per block along a row of an ``[N, K]`` weight):

- Q4_1, 20 bytes: fp16 ``d``, fp16 ``m``, 16 bytes of 4-bit quants; byte ``j`` holds weight ``j`` in its
  low nibble and weight ``j + 16`` in its high nibble; ``w = d * q + m`` with ``q`` in 0..15.
- Q8_0, 34 bytes: fp16 ``d``, 32 int8 quants; ``w = d * q``.

Both are read into unpacked holders (:class:`Q4_1Weight`, :class:`Q8_0Weight`) whose
:meth:`~Q4_1Weight.dequantize` gives fp32 values equal, bit for bit, to the fp32 weights transformers
dequantizes from the same file (the tests check it).

The matmul kernel, ``torch.ops.aten._weight_int4pack_mm_for_cpu(A, B_packed, 32, scale_zeros)``, computes
``A @ W^T`` with ``W[n, k] = (u - 8) * scale[g, n] + zero[g, n]`` for the unsigned 4-bit value ``u`` that was
packed and ``g = k // 32``; so a Q4_1 block goes in as ``scale = d`` and ``zero = m + 8 * d``. ``A``,
``scale_zeros`` and the output share one dtype. On the CPU only bfloat16 has a vectorised kernel (fp32 and fp16
take a scalar fallback, far slower), so activations and the scale/zero table are bfloat16, accumulation is fp32
inside the kernel and the result is rounded to bfloat16 once, then returned as fp32: an error of the order of
llama.cpp's own, which quantizes a Q4_1 matmul's activations to 8 bits per 32-block (the quality figures,
``python -m benchmarks.quality``, bound it).

The Q8_0 LM head goes through the same int4 kernel, exactly: each int8 ``q`` splits into ``16 * hi + lo``
with ``lo = q & 15`` and ``hi = q >> 4`` (arithmetic shift, -8..7), and the two nibble matrices are laid
side by side along K (scales ``16 d`` and ``d``, zeros ``0`` and ``8 d``), fed with ``[x, x]``. Requantizing
to per-row int8 for ``torch.ops.aten._weight_int8pack_mm`` is a little faster at one row but several times less
accurate; :class:`Int8RowLinear` keeps that option for measurement.

Packed int4 weights are in a layout chosen for the running CPU's vector width (AVX512 vs AVX2 tile the
rows differently): pack on the machine that runs them, never store them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import gguf
import numpy as np
import torch

GROUP_SIZE = 32  # weights per ggml block, and the kernel's group size
TILE_KINDS = ("amx", "avx512-vnni", "avx2")  # the native tile kernels (EngineKernels.tile_matmul_kind)
# the kinds that read the vector layout only (AVX2 reads AVX512-VNNI's 64-byte vectors as two halves)
VECTOR_KINDS = ("avx512-vnni", "avx2")
_Q4_0_BLOCK_BYTES = 18
_Q4_1_BLOCK_BYTES = 20
_Q8_0_BLOCK_BYTES = 34
_INNER_K_TILES = 2  # required by the packing op's signature; the CPU packing does not depend on it
_KERNEL_N_MULTIPLE = 16  # the CPU packing op's requirement on N

@dataclass(frozen=True)
class Q4_1Weight:
    """An ``[N, K]`` Q4_1 weight, unpacked to one uint8 per 4-bit quant; no value is rounded.

    ``scale`` and ``minimum`` are the file's fp16 ``d`` and ``m`` unchanged. Rows may be reordered
    (:meth:`select_rows`) and stacked (:func:`cat_rows`): blocks run along K, so both keep them whole.
    """

    scale: torch.Tensor  # [N, K/32] fp16 (d)
    minimum: torch.Tensor  # [N, K/32] fp16 (m)
    quants: torch.Tensor  # [N, K] uint8, values 0..15

    @property
    def shape(self) -> tuple[int, int]:
        """``(N, K)``: output features, input features."""
        n, k = self.quants.shape
        return int(n), int(k)

    def dequantize(self) -> torch.Tensor:
        """fp32 ``[N, K]`` with ``w = d * q + m`` (product and sum each rounded in fp32, as ggml does)."""
        n, k = self.shape
        q = self.quants.view(n, k // GROUP_SIZE, GROUP_SIZE).to(torch.float32)
        w = q * self.scale.to(torch.float32)[..., None]
        w = w + self.minimum.to(torch.float32)[..., None]
        return w.reshape(n, k)  # [N, K] fp32

    def select_rows(self, index: torch.Tensor) -> Q4_1Weight:
        """The weight with rows ``index`` (int64 ``[N']``) in that order."""
        return Q4_1Weight(self.scale.index_select(0, index), self.minimum.index_select(0, index),
                          self.quants.index_select(0, index))


@dataclass(frozen=True)
class Q8_0Weight:
    """An ``[N, K]`` Q8_0 weight (the token embedding, which is also the tied LM head); exact."""

    scale: torch.Tensor  # [N, K/32] fp16 (d)
    quants: torch.Tensor  # [N, K] int8

    @property
    def shape(self) -> tuple[int, int]:
        """``(N, K)``."""
        n, k = self.quants.shape
        return int(n), int(k)

    def dequantize(self) -> torch.Tensor:
        """fp32 ``[N, K]`` with ``w = d * q``."""
        return self.rows(torch.arange(self.shape[0]))

    def select_rows(self, index: torch.Tensor) -> Q8_0Weight:
        """The weight with rows ``index`` (int64 ``[N']``) in that order."""
        return Q8_0Weight(self.scale.index_select(0, index), self.quants.index_select(0, index))

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """fp32 ``[*ids.shape, K]``: the dequantized rows ``ids`` (an embedding lookup), equal to indexing
        :meth:`dequantize` but without materialising the whole table."""
        k = self.shape[1]
        flat = ids.reshape(-1).to(torch.int64)
        q = self.quants.index_select(0, flat).view(-1, k // GROUP_SIZE, GROUP_SIZE).to(torch.float32)
        w = q * self.scale.index_select(0, flat).to(torch.float32)[..., None]
        return w.reshape(*ids.shape, k)  # [..., K] fp32


def cat_rows(parts: Sequence[Q4_1Weight]) -> Q4_1Weight:
    """Stack Q4_1 weights with the same K along N (fused projections such as q|k|v)."""
    return Q4_1Weight(torch.cat([p.scale for p in parts]), torch.cat([p.minimum for p in parts]),
                      torch.cat([p.quants for p in parts]))


def cat_q8_rows(parts: Sequence[Q8_0Weight]) -> Q8_0Weight:
    """Stack Q8_0 weights with the same K along N."""
    return Q8_0Weight(torch.cat([p.scale for p in parts]), torch.cat([p.quants for p in parts]))


def read_tensor(tensor: Any) -> Q4_1Weight | Q8_0Weight | torch.Tensor:
    """One tensor of a ``gguf.GGUFReader`` (a ``ReaderTensor``): Q4_1 and Q8_0 as unpacked holders (Q4_0 as the
    Q4_1 blocks of the same values), F32, F16 and BF16 as an fp32 tensor of the ggml shape reversed (``[N, K]``
    for a matrix). Copies out of the memory map. Other types raise ``ValueError``."""
    kind = tensor.tensor_type
    dims = [int(v) for v in reversed(list(tensor.shape))]  # ggml lists ne0 (K) first
    raw = np.asarray(tensor.data)
    if kind == gguf.GGMLQuantizationType.F32:
        return torch.from_numpy(raw.astype(np.float32, copy=True)).reshape(dims)
    if kind in (gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16):
        return torch.from_numpy(gguf.quants.dequantize(raw, kind).astype(np.float32, copy=False)).reshape(dims)
    if len(dims) != 2 or dims[1] % GROUP_SIZE:
        raise ValueError(f"{tensor.name}: expected an [N, K] matrix with K a multiple of {GROUP_SIZE}, got {dims}")
    n, k = dims
    if kind == gguf.GGMLQuantizationType.Q4_1:
        blocks = raw.reshape(n, k // GROUP_SIZE, _Q4_1_BLOCK_BYTES)
        packed = blocks[:, :, 4:]  # [N, K/32, 16] uint8
        quants = np.concatenate([packed & 0x0F, packed >> 4], axis=2)  # low nibbles are weights 0..15
        return Q4_1Weight(
            scale=torch.from_numpy(np.ascontiguousarray(blocks[:, :, 0:2]).view(np.float16)[..., 0].copy()),
            minimum=torch.from_numpy(np.ascontiguousarray(blocks[:, :, 2:4]).view(np.float16)[..., 0].copy()),
            quants=torch.from_numpy(quants.reshape(n, k)),
        )
    if kind == gguf.GGMLQuantizationType.Q4_0:
        # w = d * (q - 8): a Q4_1 block with m = -8 d, exact in fp16 (a power-of-two multiple), and d * q + m
        # equals d * (q - 8) bit for bit in fp32 (both terms and the sum need at most 15 significant bits).
        blocks = raw.reshape(n, k // GROUP_SIZE, _Q4_0_BLOCK_BYTES)
        packed = blocks[:, :, 2:]
        quants = np.concatenate([packed & 0x0F, packed >> 4], axis=2)
        scale = np.ascontiguousarray(blocks[:, :, 0:2]).view(np.float16)[..., 0].copy()
        return Q4_1Weight(scale=torch.from_numpy(scale), minimum=torch.from_numpy(scale * np.float16(-8)),
                          quants=torch.from_numpy(quants.reshape(n, k)))
    if kind == gguf.GGMLQuantizationType.Q8_0:
        blocks = raw.reshape(n, k // GROUP_SIZE, _Q8_0_BLOCK_BYTES)
        return Q8_0Weight(
            scale=torch.from_numpy(np.ascontiguousarray(blocks[:, :, 0:2]).view(np.float16)[..., 0].copy()),
            quants=torch.from_numpy(np.ascontiguousarray(blocks[:, :, 2:]).view(np.int8).reshape(n, k).copy()),
        )
    raise ValueError(f"{tensor.name}: unsupported tensor type {kind!r}")


def rope_row_order(num_heads: int, head_dim: int) -> torch.Tensor:
    """int64 ``[num_heads * head_dim]``: for each row of a Q or K projection in transformers' layout, the
    row of the GGUF tensor it comes from. llama.cpp stores each head's rows interleaved (pairs
    ``(2j, 2j+1)`` rotate together); transformers wants the two halves (``j`` and ``j + head_dim/2``)."""
    rows = torch.arange(num_heads * head_dim).view(num_heads, head_dim // 2, 2)
    return rows.transpose(1, 2).reshape(-1)


def _run_int4(x: torch.Tensor, packed: torch.Tensor, scale_zeros: torch.Tensor, n: int) -> torch.Tensor:
    lead = x.shape[:-1]
    a = x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous()  # [M, K] bf16
    if a.shape[0] == 0:
        return x.new_empty(*lead, n)
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(a, packed, GROUP_SIZE, scale_zeros)  # [M, N] bf16
    return out.to(torch.float32).reshape(*lead, n)


def _pack(quants: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quants [N, K] 0..15, scale/zero [N, K/32] fp32 -> (packed [N, K/2] uint8, scale_zeros [K/32, N, 2] bf16)."""
    n = quants.shape[0]
    if n % _KERNEL_N_MULTIPLE:
        raise ValueError(f"the int4 kernel needs N to be a multiple of {_KERNEL_N_MULTIPLE}, got {n}")
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(quants.to(torch.int32).contiguous(), _INNER_K_TILES)
    scale_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
    return packed, scale_zeros


class Int4Linear(torch.nn.Module):
    """``y = x @ W^T`` for a Q4_1 weight, through the bf16 int4 group-32 CPU kernel.

    ``forward`` takes fp32 ``[..., K]`` and returns fp32 ``[..., N]``. The quants are used exactly; ``d``
    and ``m + 8d`` are rounded to bfloat16 (relative 2^-9), the activations are rounded to bfloat16 and
    the result is rounded to bfloat16 once (~0.3% relative error vs. fp32 on this model's weights).
    """

    packed: torch.Tensor  # [N, K/2] uint8, layout specific to this CPU's vector width
    scale_zeros: torch.Tensor  # [K/32, N, 2] bf16: (d, m + 8d)

    def __init__(self, weight: Q4_1Weight) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        d = weight.scale.to(torch.float32)  # [N, K/32]
        zero = weight.minimum.to(torch.float32) + 8 * d  # w = (q - 8) d + (m + 8d)
        packed, scale_zeros = _pack(weight.quants, d, zero)
        self.register_buffer("packed", packed)
        self.register_buffer("scale_zeros", scale_zeros)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _run_int4(x, self.packed, self.scale_zeros, self.out_features)  # [..., N] fp32

    takes_bf16 = True

    def bf16(self, x: torch.Tensor) -> torch.Tensor:
        """bf16 ``[M, K]`` (contiguous) -> bf16 ``[M, N]``: the kernel alone, no conversion on either side."""
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP_SIZE, self.scale_zeros)


def pack_q4_tiles(weight: Q4_1Weight) -> torch.Tensor:
    """A Q4_1 ``[N, K]`` weight in the AMX tile kernel's layout (``chatd/engine/kernels/matmul_amx.c``): uint8
    ``[N / 16, K / 32, 320]``, per tile of 16 outputs by 32 inputs the 512 quants in AMX's pairwise
    order, two per byte, then the 16 outputs' fp16 ``d`` and ``m``. Quants and scales are kept exactly."""
    n, k = weight.shape
    if n % 16 or k % GROUP_SIZE:
        raise ValueError(f"the tile kernel needs N a multiple of 16 and K of 32, got {n} x {k}")
    groups, blocks = n // 16, k // GROUP_SIZE
    # [group, output, block, pair row, pair] -> [group, block, pair row, output * 2 + pair]
    q = weight.quants.view(groups, 16, blocks, 16, 2).permute(0, 2, 3, 1, 4).reshape(groups, blocks, 16, 32)
    nibbles = (q[..., :16] | (q[..., 16:] << 4)).reshape(groups, blocks, 256)
    return torch.cat([nibbles, _per_tile(weight.scale, groups, blocks), _per_tile(weight.minimum, groups, blocks)],
                     dim=-1).contiguous()


def _per_tile(values: torch.Tensor, groups: int, blocks: int) -> torch.Tensor:
    """``[N, K/32]`` fp16 -> ``[groups, blocks, 32]`` bytes: each tile's 16 outputs' values."""
    return values.view(groups, 16, blocks).permute(0, 2, 1).contiguous().view(torch.uint8)


class _TileLinear:
    """``y = x @ W^T`` for a quantised weight on the native tile kernel (:meth:`EngineKernels.tile_matmul`),
    bf16 in and out, at the quantised weight's memory traffic: each tile of the weight is read once per call,
    for every row. On AMX tiles it is dequantised to exactly the bf16 copy of the dequantised fp32 weight (the
    dense twin's values); on AVX512-VNNI or AVX2 vectors the quants multiply x rounded to int8 per block of 32
    (as llama.cpp does). Where AMX runs, calls of fewer rows than :attr:`EngineKernels.amx_min_rows` take the
    vector kernel, on the second layout the weight is packed in (:func:`pack_for`)."""

    takes_bf16 = True
    q8 = False

    def __init__(self, weight: Q4_1Weight | Q8_0Weight, kernels: Any) -> None:
        self.out_features, self.in_features = weight.shape
        self.kind: str = kernels.tile_matmul_kind  # the layout the weight is packed in
        self.tiles = pack_for(self.kind, weight)
        self.kernels = kernels

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        a = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        return self.bf16(a).to(torch.float32).reshape(*lead, self.out_features)

    def bf16(self, x: torch.Tensor) -> torch.Tensor:
        """bf16 ``[M, K]`` (contiguous) -> bf16 ``[M, N]``."""
        if self.kernels.tile_matmul_kind != self.kind:
            raise RuntimeError(f"weights packed for the {self.kind} tile kernel, but "
                               f"{self.kernels.tile_matmul_kind} runs")
        return cast(torch.Tensor, self.kernels.tile_matmul(x, self.tiles, self.out_features, q8=self.q8))


class TileQ4Linear(_TileLinear):
    """A Q4_1 projection on the tile kernel (:func:`pack_for`)."""


def pack_q8_tiles(weight: Q8_0Weight) -> torch.Tensor:
    """A Q8_0 ``[N, K]`` weight in the AMX tile kernel's layout: uint8 ``[N / 16, K / 32, 544]``, per tile
    of 16 outputs by 32 inputs the 512 int8 quants in AMX's pairwise order, then the 16 outputs' fp16 ``d``."""
    n, k = weight.shape
    if n % 16 or k % GROUP_SIZE:
        raise ValueError(f"the tile kernel needs N a multiple of 16 and K of 32, got {n} x {k}")
    groups, blocks = n // 16, k // GROUP_SIZE
    q = weight.quants.view(groups, 16, blocks, 16, 2).permute(0, 2, 3, 1, 4).reshape(groups, blocks, 512)
    return torch.cat([q.contiguous().view(torch.uint8), _per_tile(weight.scale, groups, blocks)], dim=-1).contiguous()


def pack_q4_quads(weight: Q4_1Weight) -> torch.Tensor:
    """A Q4_1 ``[N, K]`` weight in the vector tile kernel's layout (AVX512-VNNI,
    ``chatd/engine/kernels/matmul_avx512.c``): uint8 ``[N / 16, K / 32, 320]``; per tile of 16 outputs by 32 inputs,
    4 vectors of 64 bytes (vector v: quad row v in the low nibbles, quad row v + 4 in the high ones, output n's 4
    quants at bytes 4n..4n+3), then the 16 outputs' fp16 ``d`` and ``m``. Quants and scales are kept exactly."""
    n, k = weight.shape
    if n % 16 or k % GROUP_SIZE:
        raise ValueError(f"the tile kernel needs N a multiple of 16 and K of 32, got {n} x {k}")
    groups, blocks = n // 16, k // GROUP_SIZE
    # [group, output, block, quad row, j] -> [group, block, quad row, output, j]
    q = weight.quants.view(groups, 16, blocks, 8, 4).permute(0, 2, 3, 1, 4)
    nibbles = (q[:, :, :4] | (q[:, :, 4:] << 4)).reshape(groups, blocks, 256)
    return torch.cat([nibbles, _per_tile(weight.scale, groups, blocks), _per_tile(weight.minimum, groups, blocks)],
                     dim=-1).contiguous()


def pack_q8_quads(weight: Q8_0Weight) -> torch.Tensor:
    """A Q8_0 ``[N, K]`` weight in the vector tile kernel's layout: uint8 ``[N / 16, K / 32, 544]``; per tile, 8
    vectors of 64 bytes (vector r: quad row r, output n's 4 values ``q + 128`` at bytes 4n..4n+3), then the 16
    outputs' fp16 ``d``."""
    n, k = weight.shape
    if n % 16 or k % GROUP_SIZE:
        raise ValueError(f"the tile kernel needs N a multiple of 16 and K of 32, got {n} x {k}")
    groups, blocks = n // 16, k // GROUP_SIZE
    offset = weight.quants.view(torch.uint8) ^ 0x80  # q + 128 as uint8
    q = offset.view(groups, 16, blocks, 8, 4).permute(0, 2, 3, 1, 4).reshape(groups, blocks, 512)
    return torch.cat([q, _per_tile(weight.scale, groups, blocks)], dim=-1).contiguous()


def pack_for(kind: str, weight: Q4_1Weight | Q8_0Weight) -> torch.Tensor:
    """``weight`` in the layout the tile kernel ``kind`` (:attr:`EngineKernels.tile_matmul_kind`) reads: the
    vector kernels' ``[N / 16, K / 32, tile bytes]`` (AVX512-VNNI's and AVX2's); under AMX ``[2, ...]``, the AMX
    tiles and then the vector kernel's, which takes the calls of few rows (``chatd/engine/kernels/matmul.c``)."""
    if kind not in TILE_KINDS:
        raise ValueError(f"no tile kernel {kind!r}")
    quads = pack_q8_quads(weight) if isinstance(weight, Q8_0Weight) else pack_q4_quads(weight)
    if kind in VECTOR_KINDS:
        return quads
    tiles = pack_q8_tiles(weight) if isinstance(weight, Q8_0Weight) else pack_q4_tiles(weight)
    return torch.stack([tiles, quads])


class TileQ8Linear(_TileLinear):
    """A Q8_0 projection (the LM head) on the tile kernel (:func:`pack_for`)."""

    q8 = True


Q4Linear = Int4Linear | TileQ4Linear


class Q8_0Linear(torch.nn.Module):
    """``y = x @ W^T`` for a Q8_0 weight (the LM head), exactly represented in the int4 kernel.

    Each int8 quant is split into a high and a low nibble laid side by side along K, so the kernel sees
    an ``[N, 2K]`` int4 weight fed with ``[x, x]``. fp32 ``[..., K]`` in, fp32 ``[..., N]`` out; the same
    bf16 rounding as :class:`Int4Linear`.
    """

    packed: torch.Tensor  # [N, K] uint8 (2K nibbles), layout specific to this CPU
    scale_zeros: torch.Tensor  # [2K/32, N, 2] bf16: hi half (16d, 0), lo half (d, 8d)

    def __init__(self, weight: Q8_0Weight) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        q = weight.quants.to(torch.int32)  # [N, K]
        halves = torch.cat([(q >> 4) + 8, q & 0x0F], dim=1)  # [N, 2K]: q = 16 * hi + lo, hi stored offset by 8
        d = weight.scale.to(torch.float32)  # [N, K/32]
        scale = torch.cat([16 * d, d], dim=1)  # [N, 2K/32]
        zero = torch.cat([torch.zeros_like(d), 8 * d], dim=1)
        packed, scale_zeros = _pack(halves, scale, zero)
        self.register_buffer("packed", packed)
        self.register_buffer("scale_zeros", scale_zeros)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _run_int4(torch.cat([x, x], dim=-1), self.packed, self.scale_zeros, self.out_features)

    takes_bf16 = True

    def bf16(self, x: torch.Tensor) -> torch.Tensor:
        """bf16 ``[M, K]`` -> bf16 ``[M, N]``."""
        return torch.ops.aten._weight_int4pack_mm_for_cpu(torch.cat([x, x], dim=-1), self.packed, GROUP_SIZE,
                                                          self.scale_zeros)


class Int8RowLinear(torch.nn.Module):
    """``y = x @ W^T`` with W requantized to int8 with one scale per output row
    (``torch.ops.aten._weight_int8pack_mm``, bf16). Lossy: Q8_0's per-32 scales are folded into one per
    row (1.1% relative logit error on the packaged LM head). Kept for comparison; fp32 in, fp32 out."""

    weight: torch.Tensor  # [N, K] int8
    scales: torch.Tensor  # [N] bf16

    def __init__(self, weight: Q8_0Weight | Q4_1Weight) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        w = weight.dequantize()  # [N, K] fp32, transient
        scales = (w.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
        self.register_buffer("weight", torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scales.to(torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        a = x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous()  # [M, K] bf16
        out = torch.ops.aten._weight_int8pack_mm(a, self.weight, self.scales)  # [M, N] bf16
        return out.to(torch.float32).reshape(*lead, self.out_features)
