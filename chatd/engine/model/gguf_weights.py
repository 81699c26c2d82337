"""A GGUF's weights as the compact forward's q4 path runs them (the architectures of Q4_ARCHITECTURES): every
projection in one of the two block formats the kernels multiply (Q4_1 or Q8_0, :mod:`chatd.engine.model.quant`),
whatever ggml type the file holds.

Each tensor is read at the closest format it fits, and the load says how (:attr:`GGUFWeights.runs_as`):

- **as it is**: Q4_1 and Q8_0; Q4_0 as the Q4_1 blocks of the same values (``m = -8 d``, exact);
- **repacked**: Q5_0 into Q8_0 (``q - 16`` fits int8, the scale unchanged: exact); Q4_K into Q4_1 (each
  sub-block of 32 is ``d * sc * q - dmin * m``, a Q4_1 block whose ``d * sc`` and ``dmin * m`` are rounded to
  fp16: a relative 2^-11 on the scales, nothing on the quants);
- **requantised** (lossy, reported): Q5_1, Q5_K, Q6_K and any other block type gguf dequantises, into Q8_0
  (ggml's rounding, 8 bits per weight with a scale per 32). A file of F16 / BF16 / F32 projections does not come
  here: ``q4`` quantises it on load (:mod:`chatd.engine.model.quantise`).

Projections whose types differ in one fused group (q|k|v, gate|up: Q4_K_M files keep ``attn_v`` in Q6_K) run as
separate calls concatenated (:class:`ConcatLinear`); a forward with any such projection runs its layers through
the Python loop rather than the one native step call, which takes Q4_1 projections only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from chatd.engine.model.quant import (
    GROUP_SIZE,
    Int4Linear,
    Int8RowLinear,
    Q4_1Weight,
    Q8_0Linear,
    Q8_0Weight,
    TileQ4Linear,
    TileQ8Linear,
    cat_q8_rows,
    cat_rows,
    read_tensor,
    rope_row_order,
)

T = gguf.GGMLQuantizationType
_AS_IS = (T.Q4_0, T.Q4_1, T.Q8_0)
_Q4_K_BLOCK_BYTES = 144
_Q8_0_BLOCK_BYTES = 34
_SUPER = 256  # weights per K-quant super-block

Blocks = Q4_1Weight | Q8_0Weight


def how_type_runs(type_name: str) -> str:
    """How :func:`read_blocks` runs a matrix of ggml type ``type_name``."""
    if type_name in ("Q4_1", "Q8_0"):
        return "as it is"
    return {"Q4_0": "as Q4_1 (exact)", "Q4_K": "repacked to Q4_1 (scales rounded to fp16)",
            "Q5_0": "repacked to Q8_0 (exact)"}.get(type_name, f"requantised from {type_name} to Q8_0 (lossy)")


def read_blocks(tensor: Any) -> tuple[Blocks, str]:
    """One matrix of a ``gguf.GGUFReader`` in a format the kernels run, and how it got there (``"as it is"``,
    ``"repacked ..."``, ``"requantised ... (lossy)"``). ValueError for a type gguf cannot dequantise."""
    kind = tensor.tensor_type
    if kind in _AS_IS:
        value = read_tensor(tensor)
        assert isinstance(value, Q4_1Weight | Q8_0Weight)
        return value, how_type_runs(kind.name)
    dims = [int(v) for v in reversed(list(tensor.shape))]
    if len(dims) != 2 or dims[1] % GROUP_SIZE:
        raise ValueError(f"{tensor.name}: expected an [N, K] matrix with K a multiple of {GROUP_SIZE}, got {dims}")
    raw = np.asarray(tensor.data)
    if kind == T.Q4_K:
        return q4_k_as_q4_1(raw, *dims), how_type_runs(kind.name)
    try:
        values = gguf.quants.dequantize(raw, kind).astype(np.float32, copy=False).reshape(dims)
    except NotImplementedError as exc:
        raise ValueError(f"{tensor.name}: gguf cannot dequantise {kind.name}") from exc
    if kind == T.Q5_0:
        scale = np.ascontiguousarray(raw.reshape(dims[0], -1, 22)[:, :, 0:2]).view(np.float16)[..., 0]
        return q8_0_on_scale(values, scale), how_type_runs(kind.name)
    return quantise_q8_0(values), how_type_runs(kind.name)


def quantise_q8_0(values: np.ndarray) -> Q8_0Weight:
    """fp32 ``[N, K]`` into Q8_0 blocks with ggml's rounding (the ``gguf`` package's quantiser)."""
    n, k = values.shape
    raw = gguf.quants.quantize(np.ascontiguousarray(values, dtype=np.float32), T.Q8_0)
    blocks = raw.reshape(n, k // GROUP_SIZE, _Q8_0_BLOCK_BYTES)
    return Q8_0Weight(
        scale=torch.from_numpy(np.ascontiguousarray(blocks[:, :, 0:2]).view(np.float16)[..., 0].copy()),
        quants=torch.from_numpy(np.ascontiguousarray(blocks[:, :, 2:]).view(np.int8).reshape(n, k).copy()))


def q8_0_on_scale(values: np.ndarray, scale: np.ndarray) -> Q8_0Weight:
    """fp32 ``[N, K]`` whose every block of 32 is an integer multiple of its fp16 ``scale`` ``[N, K/32]`` (in
    -128..127): the Q8_0 blocks holding exactly those values."""
    n, k = values.shape
    d = scale.astype(np.float32)[..., None]
    q = np.divide(values.reshape(n, k // GROUP_SIZE, GROUP_SIZE), d, out=np.zeros((n, k // GROUP_SIZE, GROUP_SIZE),
                                                                                  np.float32), where=d != 0)
    return Q8_0Weight(scale=torch.from_numpy(scale.copy()),
                      quants=torch.from_numpy(np.rint(q).astype(np.int8).reshape(n, k)))


def q4_k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit scales and mins of K-quant super-blocks from their 12 packed bytes (``[..., 12]`` uint8 ->
    two ``[..., 8]`` int arrays): sub-blocks 0-3 in the low 6 bits of bytes 0-3 and 4-7, sub-blocks 4-7 in the
    nibbles of bytes 8-11 with their top 2 bits in the high bits of bytes 0-3 and 4-7."""
    q = packed.astype(np.int32)
    scales = np.concatenate([q[..., 0:4] & 63, (q[..., 8:12] & 0xF) | ((q[..., 0:4] >> 6) << 4)], axis=-1)
    mins = np.concatenate([q[..., 4:8] & 63, (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)], axis=-1)
    return scales, mins


def q4_k_as_q4_1(raw: np.ndarray, n: int, k: int) -> Q4_1Weight:
    """Q4_K blocks (144 bytes per 256 weights: fp16 ``d`` and ``dmin``, 12 bytes of scales, 128 of quants, each
    32-byte run holding one sub-block in its low nibbles and the next in its high ones) as Q4_1 blocks of 32."""
    if k % _SUPER:
        raise ValueError(f"Q4_K needs K a multiple of {_SUPER}, got {k}")
    blocks = raw.reshape(n, k // _SUPER, _Q4_K_BLOCK_BYTES)
    d = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)[..., 0].astype(np.float32)
    dmin = np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0].astype(np.float32)
    scales, mins = q4_k_scales(blocks[..., 4:16])
    runs = blocks[..., 16:].reshape(n, k // _SUPER, 4, GROUP_SIZE)
    quants = np.stack([runs & 0x0F, runs >> 4], axis=3).reshape(n, k)  # sub-block 2r low nibbles, 2r + 1 high
    return Q4_1Weight(
        scale=torch.from_numpy((d[..., None] * scales).astype(np.float16).reshape(n, k // GROUP_SIZE)),
        minimum=torch.from_numpy((-(dmin[..., None] * mins)).astype(np.float16).reshape(n, k // GROUP_SIZE)),
        quants=torch.from_numpy(np.ascontiguousarray(quants)))


class BiasedLinear:
    """A block projection plus a bias added in fp32 (Qwen2's q/k/v; the block kernels take none)."""

    def __init__(self, inner: Any, bias: torch.Tensor) -> None:
        self.inner, self.bias = inner, bias.float().contiguous()  # [out_features]
        self.in_features, self.out_features = int(inner.in_features), int(inner.out_features)
        self.takes_bf16 = bool(getattr(inner, "takes_bf16", False))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) + self.bias

    def bf16(self, x: torch.Tensor) -> torch.Tensor:
        return (self.inner.bf16(x).float() + self.bias).to(torch.bfloat16)


class ConcatLinear:
    """Projections of one input run one after the other, outputs side by side (a fused group whose weights
    are in different block formats). bf16 in and out where every part takes bf16."""

    def __init__(self, parts: Sequence[Any]) -> None:
        self.parts = list(parts)
        self.in_features = int(self.parts[0].in_features)
        self.out_features = sum(int(p.out_features) for p in self.parts)
        self.takes_bf16 = all(getattr(p, "takes_bf16", False) for p in self.parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)

    def bf16(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part.bf16(x) for part in self.parts], dim=-1)


# GGUF architectures whose files the q4 path reads (as llama.cpp lays them out; chatd.engine.model.gguf_file
# writes the same): the compact forward's families.
Q4_ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3")


@dataclass(frozen=True)
class LlamaDims:
    """The model's shape and constants, read from the GGUF metadata."""

    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    context_length: int
    rope_theta: float
    rms_norm_eps: float
    bos_token_id: int | None
    eos_token_id: int | None

    @property
    def q_size(self) -> int:
        """Rows of Q in the fused qkv output (``num_heads * head_dim``)."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Rows of K, and of V, in the fused qkv output (``num_kv_heads * head_dim``)."""
        return self.num_kv_heads * self.head_dim


Projection = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer. ``qkv(x)`` splits as ``[q_size, kv_size, kv_size]`` with q and k rows already in
    transformers' rotate-half RoPE layout; ``gate_up(x)`` splits as ``[intermediate, intermediate]``."""

    attn_norm: torch.Tensor  # [H] fp32
    qkv: Any  # H -> q_size + 2 * kv_size (a projection of quant.py, or a ConcatLinear of them)
    o: Any  # q_size -> H
    ffn_norm: torch.Tensor  # [H] fp32
    gate_up: Any  # H -> 2 * I
    down: Any  # I -> H
    q_norm: torch.Tensor | None = None  # [head_dim] fp32 (Qwen3, Gemma 3)
    k_norm: torch.Tensor | None = None
    post_attn_norm: torch.Tensor | None = None  # [H] fp32 (Gemma; stored as 1 + weight, as it runs)
    post_ffn_norm: torch.Tensor | None = None


@dataclass(frozen=True)
class GGUFWeights:
    """Everything a compact Llama forward needs, in block formats. ``embed_tokens.rows(ids)`` gives the fp32
    embeddings (equal to the fp32 table, without keeping one); ``lm_head(x)`` gives fp32 logits."""

    dims: LlamaDims
    embed_tokens: Q8_0Weight
    layers: tuple[LayerWeights, ...]
    final_norm: torch.Tensor  # [H] fp32
    lm_head: torch.nn.Module | TileQ8Linear  # fp32 [..., H] -> fp32 [..., vocab]
    runs_as: dict[str, str] = field(default_factory=dict)
    """Tensor kind -> how it runs (``"Q4_K: repacked to Q4_1 (scales rounded to fp16)"``, ...)."""

    def lossy(self) -> list[str]:
        """The kinds requantised with a loss of precision."""
        return [kind for kind, how in self.runs_as.items() if "lossy" in how]


def read_dims(reader: gguf.GGUFReader) -> LlamaDims:
    """The dimensions and constants from a GGUF file's metadata (``<architecture>.*`` keys)."""

    def field(key: str, default: Any = None) -> Any:
        found = reader.fields.get(key)
        return default if found is None else found.contents()

    arch = str(field("general.architecture"))
    if arch not in Q4_ARCHITECTURES:
        raise ValueError(f"expected a GGUF of {', '.join(Q4_ARCHITECTURES)}, got architecture {arch!r}")
    hidden = int(field(f"{arch}.embedding_length"))
    heads = int(field(f"{arch}.attention.head_count"))
    vocab = field(f"{arch}.vocab_size")
    if vocab is None:
        vocab = len(field("tokenizer.ggml.tokens", []))
    return LlamaDims(
        architecture=arch,
        hidden_size=hidden,
        num_layers=int(field(f"{arch}.block_count")),
        num_heads=heads,
        num_kv_heads=int(field(f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(field(f"{arch}.attention.key_length", 0)
                     or field(f"{arch}.rope.dimension_count", hidden // heads)),
        intermediate_size=int(field(f"{arch}.feed_forward_length")),
        vocab_size=int(vocab),
        context_length=int(field(f"{arch}.context_length")),
        rope_theta=float(field(f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(field(f"{arch}.attention.layer_norm_rms_epsilon")),
        bos_token_id=_optional_int(field("tokenizer.ggml.bos_token_id")),
        eos_token_id=_optional_int(field("tokenizer.ggml.eos_token_id")),
    )


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _vector(tensors: dict[str, Any], name: str) -> torch.Tensor:
    value = read_tensor(tensors[name])
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{name}: expected a float vector, got {tensors[name].tensor_type!r}")
    return value


class Maker:
    """Makes each block matrix a projection on the tile kernel where ``kernels`` has one, else on torch's int4
    kernel (Q8_0 through :class:`Q8_0Linear`)."""

    def __init__(self, kernels: Any | None) -> None:
        self.kernels = kernels if kernels is not None and kernels.tile_matmul_kind else None

    def __call__(self, weight: Blocks) -> Projection:
        if isinstance(weight, Q4_1Weight):
            return TileQ4Linear(weight, self.kernels) if self.kernels is not None else Int4Linear(weight)
        return TileQ8Linear(weight, self.kernels) if self.kernels is not None else Q8_0Linear(weight)

    def fused(self, parts: Sequence[Blocks]) -> Projection:
        """One projection over ``parts`` stacked along N: fused where they share a format."""
        if all(isinstance(p, Q4_1Weight) for p in parts):
            return self(cat_rows([p for p in parts if isinstance(p, Q4_1Weight)]))
        if all(isinstance(p, Q8_0Weight) for p in parts):
            return self(cat_q8_rows([p for p in parts if isinstance(p, Q8_0Weight)]))
        return ConcatLinear([self(p) for p in parts])


def read_layer(reader: gguf.GGUFReader, dims: LlamaDims, index: int, make: Maker | None = None,
               runs_as: dict[str, str] | None = None) -> LayerWeights:
    """Decoder layer ``index`` of a GGUF, each matrix in a block format (:func:`read_blocks`) made a projection by
    ``make`` (torch's int4 kernel by default; a llama file's q and k rows reordered to transformers' layout; q|k|v
    and gate|up fused, as Phi-3's files hold them already), with the layer's biases and extra norms where the
    architecture has them. ``runs_as`` collects how each tensor kind runs."""
    make = make or Maker(None)
    tensors = {t.name: t for t in reader.tensors}
    p = f"blk.{index}."

    def blocks(kind: str, rows: torch.Tensor | None = None) -> Blocks:
        tensor = tensors[p + kind + ".weight"]
        weight, how = read_blocks(tensor)
        if runs_as is not None:
            runs_as.setdefault(kind, f"{tensor.tensor_type.name}: {how}")
        return weight if rows is None else weight.select_rows(rows)

    def vector(kind: str) -> torch.Tensor | None:
        return _vector(tensors, p + kind) if p + kind in tensors else None

    llama = dims.architecture == "llama"  # llama.cpp interleaves a llama file's q and k rows for its RoPE
    if p + "attn_qkv.weight" in tensors:
        qkv = make(blocks("attn_qkv"))
    else:
        qkv = make.fused([blocks("attn_q", rope_row_order(dims.num_heads, dims.head_dim) if llama else None),
                          blocks("attn_k", rope_row_order(dims.num_kv_heads, dims.head_dim) if llama else None),
                          blocks("attn_v")])
    biases = [vector(f"{kind}.bias") for kind in ("attn_q", "attn_k", "attn_v")]
    if not llama and all(b is not None for b in biases):
        qkv = BiasedLinear(qkv, torch.cat([b for b in biases if b is not None]))
    gate_up = (make.fused([blocks("ffn_gate"), blocks("ffn_up")]) if p + "ffn_gate.weight" in tensors
               else make(blocks("ffn_up")))  # Phi-3: gate and up in one tensor
    return LayerWeights(
        attn_norm=_vector(tensors, p + "attn_norm.weight"), qkv=qkv, o=make(blocks("attn_output")),
        ffn_norm=_vector(tensors, p + "ffn_norm.weight"), gate_up=gate_up, down=make(blocks("ffn_down")),
        q_norm=vector("attn_q_norm.weight"), k_norm=vector("attn_k_norm.weight"),
        post_attn_norm=vector("post_attention_norm.weight"), post_ffn_norm=vector("post_ffw_norm.weight"),
    )


def _table(tensors: dict[str, Any], name: str, runs_as: dict[str, str]) -> Q8_0Weight:
    """The token embedding or the LM head as Q8_0 (the row lookup and the head run Q8_0 only)."""
    tensor = tensors[name]
    weight, how = read_blocks(tensor)
    if isinstance(weight, Q4_1Weight):  # Q4_0 / Q4_1 / Q4_K: their values onto Q8_0's grid
        weight, how = quantise_q8_0(weight.dequantize().numpy()), "requantised to Q8_0 (lossy)"
    runs_as[name.removesuffix(".weight")] = f"{tensor.tensor_type.name}: {how}"
    return weight


def load_gguf_weights(path: str | Path, lm_head: str = "q8_0", kernels: Any | None = None) -> GGUFWeights:
    """Read a GGUF's matrices (an architecture of Q4_ARCHITECTURES) into block formats (:func:`read_blocks`) and
    pack them for torch's int4 kernel, or for the native tile kernel where ``kernels``
    (:class:`chatd.engine.kernels.loader.EngineKernels`) has one. ``lm_head``: ``"q8_0"`` (:class:`Q8_0Linear`
    or the tile kernel) or ``"int8_rows"`` (:class:`Int8RowLinear`). A separate ``output.weight`` is used for the
    head when the file has one. The result holds no fp32 copy of a quantised matrix."""
    make = Maker(kernels)
    reader = gguf.GGUFReader(str(path))
    dims = read_dims(reader)
    tensors = {t.name: t for t in reader.tensors}
    runs_as: dict[str, str] = {}
    embed = _table(tensors, "token_embd.weight", runs_as)
    head_weight = _table(tensors, "output.weight", runs_as) if "output.weight" in tensors else embed
    head: torch.nn.Module | TileQ8Linear
    if lm_head == "q8_0" and make.kernels is not None:
        head = TileQ8Linear(head_weight, make.kernels)
    elif lm_head == "q8_0":
        head = Q8_0Linear(head_weight)
    elif lm_head == "int8_rows":
        head = Int8RowLinear(head_weight)
    else:
        raise ValueError(f"lm_head must be 'q8_0' or 'int8_rows', got {lm_head!r}")
    layers = tuple(read_layer(reader, dims, i, make, runs_as) for i in range(dims.num_layers))
    return GGUFWeights(dims=dims, embed_tokens=embed, layers=layers,
                       final_norm=_vector(tensors, "output_norm.weight"), lm_head=head, runs_as=runs_as)
