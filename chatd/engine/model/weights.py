"""The compact forward's weights: the projections as :class:`Linear` objects (dense at any float dtype, prepacked
bf16, int8, or a pair switched by the row count) and the Llama-family model's shape and layers, fused from a loaded
transformers model or from a GGUF's own quantised blocks (:mod:`chatd.engine.model.quant`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import torch
import torch.nn.functional as F

from chatd.engine.kernels.cpu import cpu_features
from chatd.engine.model.gguf_weights import GGUFWeights

# Model types whose forward this module has been checked to reproduce (tests/test_llama_forward.py and
# tests/test_architectures.py): Mistral is Llama's arithmetic (its sliding window only where it is at least the
# context), Qwen2 adds q/k/v biases. Anything else keeps transformers' forward.
SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2"})


class Linear(Protocol):
    """``y = x W^T (+ b)`` for ``x`` ``[M, in_features]`` fp32, returning ``[M, out_features]`` fp32."""

    in_features: int
    out_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


class Bf16Linear(Linear, Protocol):
    """A :class:`Linear` that also runs bf16 to bf16 (``bf16``: ``[M, in_features]`` contiguous bf16 in,
    ``[M, out_features]`` bf16 out), with no conversion around its kernel; ``takes_bf16`` says whether it can
    (a dense one only when its weight is bf16)."""

    takes_bf16: bool

    def bf16(self, x: torch.Tensor) -> torch.Tensor: ...


def takes_bf16(linear: Linear) -> bool:
    """Whether ``linear`` is a :class:`Bf16Linear` that can run bf16 to bf16."""
    return bool(getattr(linear, "takes_bf16", False)) and callable(getattr(linear, "bf16", None))


class Embedding(Protocol):
    """Token ids ``[n]`` int64 -> their embeddings ``[n, hidden]`` fp32."""

    def __call__(self, ids: torch.Tensor) -> torch.Tensor: ...


class DenseEmbedding:
    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight  # [vocab, hidden]

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight[ids].float()


class DenseLinear:
    """A dense projection; the weight may be stored in a lower precision than the activations."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight = weight  # [out_features, in_features]
        self.bias = None if bias is None else bias.to(weight.dtype)  # [out_features] or None
        self.out_features, self.in_features = weight.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.dtype == x.dtype:
            return F.linear(x, self.weight, self.bias)
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias).float()

    @property
    def takes_bf16(self) -> bool:
        return self.weight.dtype == torch.bfloat16

    def bf16(self, x: torch.Tensor) -> torch.Tensor:
        """bf16 ``[M, in]`` -> bf16 ``[M, out]`` (a bf16 weight only: see ``takes_bf16``)."""
        return F.linear(x, self.weight, self.bias)


class PackedBf16Linear:
    """A dense bf16 projection whose weight oneDNN has reordered once, at load, into the blocked layout its
    CPU matmul (AMX tiles or AVX512-BF16) reads. A plain bf16 ``F.linear`` reorders the weight on every
    call: for this model's small matrices that reorder, not the multiply, was most of the cost. The results are
    those of ``F.linear`` in bf16."""

    # The row count oneDNN is told to expect. Any count runs; 16 (a batched decode step) is as fast as the best
    # hint from 1 to 512 rows.
    _ROWS_HINT = 16

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.out_features, self.in_features = weight.shape
        bf16 = weight.to(torch.bfloat16).contiguous()  # [out_features, in_features]
        self.packed = torch.ops.mkldnn._reorder_linear_weight(bf16, self._ROWS_HINT)  # opaque oneDNN tensor
        self.bias = None if bias is None else bias.to(torch.bfloat16).contiguous()  # [out_features] or None

    @staticmethod
    def available() -> bool:
        """Whether this torch build has oneDNN's bf16 linear ops (CPU builds with mkldnn)."""
        try:
            return (torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
                    and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
                    and hasattr(torch.ops.mkldnn, "_linear_pointwise"))
        except (AttributeError, RuntimeError):
            return False

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.bf16(x.to(torch.bfloat16).contiguous()).float()

    takes_bf16 = True

    def bf16(self, x: torch.Tensor) -> torch.Tensor:
        """bf16 ``[M, in]`` -> bf16 ``[M, out]``."""
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [None], "")


class Int8Linear:
    """Weight-only int8 with one scale per output channel (symmetric, round to nearest)."""

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight = weight  # [out_features, in_features] int8
        self.scales = scales  # [out_features] bf16
        self.bias = bias
        self.out_features, self.in_features = weight.shape

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> Int8Linear:
        # weight: [out, in] fp32
        scales = (weight.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
        q = torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8)
        return cls(q.contiguous(), scales.to(torch.bfloat16), bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # The CPU kernel is fast only with bf16 activations and scales (fp32 takes a scalar path, far slower).
        out = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16).contiguous(), self.weight, self.scales).float()
        return out if self.bias is None else out + self.bias


class RowSwitchLinear:
    """One projection held twice: ``small`` for batches of fewer than ``min_rows`` rows (decode), ``large``
    for bigger ones (prefill chunks, wide decode steps). The weight-only int4 kernel reads a quarter of fp32's
    bytes but its cost grows with every row, while a dense matmul barely notices more rows, so past some row count
    the dense one is faster (chatd.engine.model.choices: BF16_TWIN_MIN_ROWS, FP32_TWIN_MIN_ROWS)."""

    def __init__(self, small: Linear, large: Linear, min_rows: int) -> None:
        self.small, self.large, self.min_rows = small, large, min_rows
        self.out_features, self.in_features = small.out_features, small.in_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return (self.large if x.shape[0] >= self.min_rows else self.small)(x)

    @property
    def takes_bf16(self) -> bool:
        return takes_bf16(self.small) and takes_bf16(self.large)

    def bf16(self, x: torch.Tensor) -> torch.Tensor:
        return cast(Bf16Linear, self.large if x.shape[0] >= self.min_rows else self.small).bf16(x)


@dataclass(frozen=True)
class LlamaShape:
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_positions: int

    @classmethod
    def from_config(cls, config: Any) -> LlamaShape:
        """Raises ValueError for configs this forward does not reproduce exactly (other RoPE scalings,
        sliding windows, other architectures)."""
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model type {config.model_type!r} is not a supported Llama-family decoder")
        rope = getattr(config, "rope_parameters", None) or {}
        rope_type = rope.get("rope_type", "default")
        if rope_type != "default":
            raise ValueError(f"RoPE type {rope_type!r} is not supported by the compact forward")
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"activation {config.hidden_act!r} is not supported by the compact forward")
        window = getattr(config, "sliding_window", None)
        if window and getattr(config, "use_sliding_window", True) and window < config.max_position_embeddings:
            raise ValueError(f"sliding-window attention ({window} of {config.max_position_embeddings} positions) "
                             "is not supported by the compact forward")
        heads = config.num_attention_heads
        return cls(
            num_layers=config.num_hidden_layers, hidden_size=config.hidden_size, num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            vocab_size=config.vocab_size, rms_norm_eps=float(config.rms_norm_eps),
            rope_theta=float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))),
            max_positions=int(config.max_position_embeddings),
        )


@dataclass
class LlamaLayer:
    attn_norm: torch.Tensor  # [hidden] fp32
    qkv: Linear  # hidden -> (heads + 2 * kv_heads) * head_dim
    o: Linear  # heads * head_dim -> hidden
    ffn_norm: torch.Tensor  # [hidden] fp32
    gate_up: Linear  # hidden -> 2 * intermediate (gate rows first)
    down: Linear  # intermediate -> hidden


@dataclass
class LlamaWeights:
    shape: LlamaShape
    embed: Embedding
    layers: list[LlamaLayer]
    norm: torch.Tensor  # [hidden] fp32
    lm_head: Linear  # hidden -> vocab
    runs_as: dict[str, str] = field(default_factory=dict)
    """From a GGUF: tensor kind -> how its blocks run (gguf_weights.read_blocks); empty otherwise."""


def weights_from_transformers(model: Any, make_linear: Callable[[torch.Tensor, torch.Tensor | None], Linear]
                              | None = None) -> LlamaWeights:
    """Fuse a loaded transformers Llama-family model's weights for the compact forward.

    ``make_linear(weight [out, in] fp32, bias)`` builds each projection (default: dense, in the model's
    dtype). The model's tensors are copied into fused ones, so the model can be dropped afterwards.
    """
    shape = LlamaShape.from_config(model.config)
    make = make_linear or (lambda w, b: DenseLinear(w, b))
    inner = model.model
    layers = []
    for block in inner.layers:
        attn, mlp = block.self_attn, block.mlp
        qkv_w = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).detach()
        biases = [attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]
        qkv_b = torch.cat(biases).detach() if all(b is not None for b in biases) else None
        if getattr(mlp.gate_proj, "bias", None) is not None or getattr(attn.o_proj, "bias", None) is not None:
            raise ValueError("biases outside the q/k/v projections are not supported by the compact forward")
        layers.append(LlamaLayer(
            attn_norm=block.input_layernorm.weight.detach().float(),
            qkv=make(qkv_w, qkv_b),
            o=make(attn.o_proj.weight.detach(), None),
            ffn_norm=block.post_attention_layernorm.weight.detach().float(),
            gate_up=make(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach(), None),
            down=make(mlp.down_proj.weight.detach(), None),
        ))
    return LlamaWeights(shape=shape, embed=DenseEmbedding(inner.embed_tokens.weight.detach().float()), layers=layers,
                        norm=inner.norm.weight.detach().float(),
                        lm_head=make(model.lm_head.weight.detach(), None))


def bf16_matmul_is_fast() -> bool:
    """Whether this CPU multiplies bf16 matrices in hardware (AMX tiles or AVX512-BF16). There a dense bf16
    matmul of a few rows or more costs about what reading its weights costs, nearly flat in the rows, where
    the int4 kernel pays for every row (docs/engine.md, "Weights and kernels")."""
    if not cpu_features().bf16_matmul:  # what the engine may use (CHATD_CPU_ISA may cap it)
        return False
    probes = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    try:
        return any(bool(getattr(torch.cpu, name)()) for name in probes if hasattr(torch.cpu, name))
    except RuntimeError:
        return False


def weights_from_gguf(gguf: GGUFWeights, dense: LlamaWeights | None = None, min_rows: int = 32) -> LlamaWeights:
    """The compact forward over a GGUF's own quantised blocks (chatd/engine/model/quant.py): Q4_1 projections
    through the int4 kernel, the Q8_0 embedding looked up row by row and used as the LM head.

    ``dense``: the same weights dequantised (fp32, or bf16 where the CPU has bf16 matmul units); batches of
    at least ``min_rows`` rows (prefill chunks, batched decode steps) then run those, LM head included."""
    d = gguf.dims
    shape = LlamaShape(num_layers=d.num_layers, hidden_size=d.hidden_size, num_heads=d.num_heads,
                       num_kv_heads=d.num_kv_heads, head_dim=d.head_dim, vocab_size=d.vocab_size,
                       rms_norm_eps=d.rms_norm_eps, rope_theta=d.rope_theta, max_positions=d.context_length)
    def pick(small: Linear, large: Linear | None) -> Linear:
        return small if large is None else RowSwitchLinear(small, large, min_rows)

    layers = []
    for index, layer in enumerate(gguf.layers):
        twin = dense.layers[index] if dense is not None else None
        layers.append(LlamaLayer(
            attn_norm=layer.attn_norm, ffn_norm=layer.ffn_norm,
            qkv=pick(layer.qkv, twin.qkv if twin else None), o=pick(layer.o, twin.o if twin else None),
            gate_up=pick(layer.gate_up, twin.gate_up if twin else None),
            down=pick(layer.down, twin.down if twin else None)))
    return LlamaWeights(shape=shape, embed=gguf.embed_tokens.rows, layers=layers, norm=gguf.final_norm,
                        lm_head=pick(cast(Linear, gguf.lm_head), dense.lm_head if dense is not None else None),
                        runs_as=dict(gguf.runs_as))
