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
from chatd.engine.model.rope import Rope, config_rope

# Model types whose forward this module has been checked to reproduce (tests/test_llama_forward.py and
# tests/test_architectures.py): Mistral is Llama's arithmetic with a sliding window, Qwen2 adds q/k/v biases, Qwen3
# q/k norms, Phi-3 fuses the projections as this forward does, Gemma 2 and 3 add norms around attention and MLP,
# scaled embeddings, GELU, alternating local and global layers (and Gemma 2 soft-capping). Anything else keeps
# transformers' forward.
SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text"})


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


_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


@dataclass(frozen=True)
class LlamaShape:
    """A decoder's shape and the parts of its arithmetic that differ between the families the compact forward
    runs. The defaults are Llama's; :attr:`plain` says a model has nothing else."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_positions: int
    ropes: tuple[Rope, ...] = ()
    """The distinct RoPE tables (empty: the default one of ``rope_theta``)."""
    layer_ropes: tuple[int, ...] = ()
    """Each layer's index into ``ropes`` (empty: 0 for every layer)."""
    windows: tuple[int | None, ...] = ()
    """Each layer's sliding window (a query at position i sees keys at i - window + 1 ... i), None for full
    attention; empty where no layer's window is shorter than the context."""
    qk_norm: bool = False
    """Each head's q and k RMS-normed before RoPE (Qwen3, Gemma 3)."""
    sandwich_norms: bool = False
    """The attention's and the MLP's outputs RMS-normed before their residual adds (Gemma 2 and 3)."""
    activation: str = "silu"
    """The MLP's gate activation: ``silu`` or ``gelu_tanh``."""
    embed_scale: float = 1.0
    """The embeddings' multiplier (Gemma: the square root of the hidden size)."""
    attention_scale: float | None = None
    """The scores' multiplier (None: ``head_dim ** -0.5``)."""
    attention_softcap: float | None = None
    """Scores capped as ``cap * tanh(score / cap)`` (Gemma 2)."""
    final_softcap: float | None = None
    """Logits capped likewise (Gemma 2)."""

    @property
    def plain(self) -> bool:
        """Llama's arithmetic throughout, one RoPE table: what the native fused paths run."""
        return (len(self.ropes) <= 1 and not self.windows and not self.qk_norm and not self.sandwich_norms
                and self.activation == "silu" and self.embed_scale == 1.0 and self.attention_softcap is None
                and self.final_softcap is None)

    @property
    def native_attention(self) -> bool:
        """Whether the native attention kernel (plain causal attention at any scale) computes every layer's."""
        return not self.windows and self.attention_softcap is None

    def rope_of(self, layer: int) -> int:
        return self.layer_ropes[layer] if self.layer_ropes else 0

    def all_ropes(self) -> tuple[Rope, ...]:
        return self.ropes or (Rope.default(self.rope_theta, self.head_dim),)

    @classmethod
    def from_config(cls, config: Any) -> LlamaShape:
        """Raises ValueError for configs this forward does not reproduce exactly (RoPE scalings that follow the
        sequence length, partial rotary embeddings, other architectures)."""
        model_type = config.model_type
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model type {model_type!r} is not a supported decoder")
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
        if act not in _ACTIVATIONS:
            raise ValueError(f"activation {act!r} is not supported by the compact forward")
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        layer_types: list[str] = list(getattr(config, "layer_types", None) or [])
        params = getattr(config, "rope_parameters", None) or {}
        per_type = bool(layer_types) and isinstance(params.get(layer_types[0]), dict)
        if per_type:
            names = sorted(set(layer_types))
            ropes = tuple(config_rope(config, name) for name in names)
            layer_ropes = tuple(names.index(kind) for kind in layer_types)
        else:
            ropes, layer_ropes = (config_rope(config, None),), ()
        positions = int(config.max_position_embeddings)
        window = getattr(config, "sliding_window", None)
        windows: tuple[int | None, ...] = ()
        if window and window < positions:
            if layer_types:
                windows = tuple(window if kind == "sliding_attention" else None for kind in layer_types)
            else:  # Mistral, Phi-3: every layer
                windows = (window,) * config.num_hidden_layers
            if not any(windows):
                windows = ()
        gemma = model_type.startswith("gemma")
        scalar = getattr(config, "query_pre_attn_scalar", None)
        return cls(
            num_layers=config.num_hidden_layers, hidden_size=config.hidden_size, num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads, head_dim=head_dim,
            vocab_size=config.vocab_size, rms_norm_eps=float(config.rms_norm_eps),
            rope_theta=float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)) if not per_type
                             else 10000.0),
            max_positions=positions, ropes=ropes, layer_ropes=layer_ropes, windows=windows,
            qk_norm=model_type in ("qwen3", "gemma3_text"), sandwich_norms=gemma, activation=_ACTIVATIONS[act],
            embed_scale=float(config.hidden_size ** 0.5) if gemma else 1.0,
            attention_scale=float(scalar) ** -0.5 if gemma and scalar else None,
            attention_softcap=getattr(config, "attn_logit_softcapping", None) if gemma else None,
            final_softcap=getattr(config, "final_logit_softcapping", None) if gemma else None,
        )


@dataclass
class LlamaLayer:
    attn_norm: torch.Tensor  # [hidden] fp32
    qkv: Linear  # hidden -> (heads + 2 * kv_heads) * head_dim
    o: Linear  # heads * head_dim -> hidden
    ffn_norm: torch.Tensor  # [hidden] fp32
    gate_up: Linear  # hidden -> 2 * intermediate (gate rows first)
    down: Linear  # intermediate -> hidden
    q_norm: torch.Tensor | None = None  # [head_dim] fp32 (LlamaShape.qk_norm)
    k_norm: torch.Tensor | None = None
    post_attn_norm: torch.Tensor | None = None  # [hidden] fp32 (LlamaShape.sandwich_norms)
    post_ffn_norm: torch.Tensor | None = None


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
    """Fuse a loaded transformers model's weights (a model type of SUPPORTED_MODEL_TYPES) for the compact forward.

    ``make_linear(weight [out, in] fp32, bias)`` builds each projection (default: dense, in the model's
    dtype). The model's tensors are copied into fused ones, so the model can be dropped afterwards. Gemma's norms
    scale by ``1 + weight``: that sum is what is kept.
    """
    shape = LlamaShape.from_config(model.config)
    make = make_linear or (lambda w, b: DenseLinear(w, b))
    gemma = model.config.model_type.startswith("gemma")

    def norm(module: Any) -> torch.Tensor:
        weight = module.weight.detach().float()
        return weight + 1.0 if gemma else weight.clone()

    def joined(owner: Any, fused: str, parts: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        if hasattr(owner, fused):  # Phi-3 holds them fused already
            linear = getattr(owner, fused)
            return linear.weight.detach(), None if linear.bias is None else linear.bias.detach()
        linears = [getattr(owner, name) for name in parts]
        biases = [getattr(linear, "bias", None) for linear in linears]
        bias = torch.cat([b for b in biases if b is not None]).detach() if None not in biases else None
        return torch.cat([linear.weight for linear in linears]).detach(), bias

    inner = model.model
    layers = []
    for block in inner.layers:
        attn, mlp = block.self_attn, block.mlp
        qkv_w, qkv_b = joined(attn, "qkv_proj", ("q_proj", "k_proj", "v_proj"))
        gate_up_w, gate_up_b = joined(mlp, "gate_up_proj", ("gate_proj", "up_proj"))
        if gate_up_b is not None or getattr(attn.o_proj, "bias", None) is not None \
                or getattr(mlp.down_proj, "bias", None) is not None:
            raise ValueError("biases outside the q/k/v projections are not supported by the compact forward")
        layers.append(LlamaLayer(
            attn_norm=norm(block.input_layernorm), qkv=make(qkv_w, qkv_b), o=make(attn.o_proj.weight.detach(), None),
            ffn_norm=norm(block.pre_feedforward_layernorm if gemma else block.post_attention_layernorm),
            gate_up=make(gate_up_w, None), down=make(mlp.down_proj.weight.detach(), None),
            q_norm=norm(attn.q_norm) if shape.qk_norm else None, k_norm=norm(attn.k_norm) if shape.qk_norm else None,
            post_attn_norm=norm(block.post_attention_layernorm) if gemma else None,
            post_ffn_norm=norm(block.post_feedforward_layernorm) if gemma else None,
        ))
    return LlamaWeights(shape=shape, embed=DenseEmbedding(inner.embed_tokens.weight.detach().float()), layers=layers,
                        norm=norm(inner.norm), lm_head=make(model.lm_head.weight.detach(), None))


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


def weights_from_gguf(gguf: GGUFWeights, dense: LlamaWeights | None = None, min_rows: int = 32,
                      config: Any | None = None) -> LlamaWeights:
    """The compact forward over a GGUF's own quantised blocks (chatd/engine/model/quant.py): Q4_1 projections
    through the int4 kernel, the Q8_0 embedding looked up row by row and used as the LM head.

    ``dense``: the same weights dequantised (fp32, or bf16 where the CPU has bf16 matmul units); batches of
    at least ``min_rows`` rows (prefill chunks, batched decode steps) then run those, LM head included.
    ``config``: the model's transformers config (the converted folder's), whose RoPE scaling the file's header
    does not carry; without it the file's plain RoPE."""
    d = gguf.dims
    shape = LlamaShape(num_layers=d.num_layers, hidden_size=d.hidden_size, num_heads=d.num_heads,
                       num_kv_heads=d.num_kv_heads, head_dim=d.head_dim, vocab_size=d.vocab_size,
                       rms_norm_eps=d.rms_norm_eps, rope_theta=d.rope_theta, max_positions=d.context_length)
    if config is not None:
        described = LlamaShape.from_config(config)
        if (described.num_layers, described.hidden_size, described.num_heads, described.num_kv_heads,
                described.head_dim) != (d.num_layers, d.hidden_size, d.num_heads, d.num_kv_heads, d.head_dim):
            raise ValueError("the GGUF's shape is not its converted model's")
        shape = described
    elif d.architecture != "llama":
        raise ValueError(f"a {d.architecture} GGUF's blocks run with its model's config")
    def pick(small: Linear, large: Linear | None) -> Linear:
        return small if large is None else RowSwitchLinear(small, large, min_rows)

    layers = []
    for index, layer in enumerate(gguf.layers):
        twin = dense.layers[index] if dense is not None else None
        layers.append(LlamaLayer(
            attn_norm=layer.attn_norm, ffn_norm=layer.ffn_norm,
            qkv=pick(layer.qkv, twin.qkv if twin else None), o=pick(layer.o, twin.o if twin else None),
            gate_up=pick(layer.gate_up, twin.gate_up if twin else None),
            down=pick(layer.down, twin.down if twin else None), q_norm=layer.q_norm, k_norm=layer.k_norm,
            post_attn_norm=layer.post_attn_norm, post_ffn_norm=layer.post_ffn_norm))
    return LlamaWeights(shape=shape, embed=gguf.embed_tokens.rows, layers=layers, norm=gguf.final_norm,
                        lm_head=pick(cast(Linear, gguf.lm_head), dense.lm_head if dense is not None else None),
                        runs_as=dict(gguf.runs_as))
