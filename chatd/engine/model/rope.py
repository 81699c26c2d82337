"""RoPE as the compact forward runs it: each table's inverse frequencies, read from a transformers config the way
transformers computes them (every scaling whose frequencies do not follow the sequence length), and the
per-frequency divisors llama.cpp keeps in a GGUF's ``rope_freqs`` tensor, both ways."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS


@dataclass(frozen=True)
class Rope:
    """One RoPE table's inverse frequencies (``head_dim / 2`` of them) and the factor its cos and sin are
    scaled by (1 but for YaRN-style scalings), as transformers computes them for the config."""

    inv_freq: tuple[float, ...]
    scaling: float = 1.0

    @classmethod
    def default(cls, theta: float, head_dim: int) -> Rope:
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return cls(tuple((1.0 / (theta ** exponents)).tolist()))


# RoPE scalings whose frequencies do not depend on the sequence length (transformers' "dynamic" and "longrope" do).
_STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def config_rope(config: Any, layer_type: str | None) -> Rope:
    """The RoPE table of the layers of ``layer_type`` (None: every layer's)."""
    params = getattr(config, "rope_parameters", None) or {}
    if layer_type is not None:
        params = params[layer_type]
    rope_type = params.get("rope_type", "default")
    if rope_type not in _STATIC_ROPE_TYPES:
        raise ValueError(f"RoPE type {rope_type!r} is not supported by the compact forward")
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"partial rotary embeddings ({partial}) are not supported by the compact forward")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if rope_type == "default":
        return Rope.default(float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0))), head_dim)
    compute = ROPE_INIT_FUNCTIONS[rope_type]
    inv_freq, scaling = compute(config, None, layer_type=layer_type) if layer_type else compute(config, None)
    return Rope(tuple(inv_freq.float().tolist()), float(scaling))


def rope_freq_factors(config: Any) -> torch.Tensor | None:
    """The per-frequency divisors llama.cpp applies to a model's default RoPE frequencies (the ``rope_freqs`` tensor
    its converter writes for Llama 3's scaling): default / scaled inverse frequencies, fp32 ``[head_dim / 2]``.
    None for a plain RoPE; ValueError for a scaling that is not a fixed divisor per frequency."""
    rope = config_rope(config, None)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    params = getattr(config, "rope_parameters", None) or {}
    theta = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    default = Rope.default(theta, head_dim)
    if rope == default:
        return None
    if rope.scaling != 1.0:
        raise ValueError(f"RoPE type {params.get('rope_type')!r} scales attention: no GGUF frequency factors for it")
    return torch.tensor(default.inv_freq, dtype=torch.float64) / torch.tensor(rope.inv_freq, dtype=torch.float64)


# Llama 3's RoPE scalings as released (3.1 to 3.3: factor 8 or 32, original context 8192), and smaller contexts for
# tiny test models: what rope_parameters_from_factors recognises in a ``rope_freqs`` tensor.
_LLAMA3_FACTORS = (2.0, 4.0, 8.0, 16.0, 32.0, 64.0)
_LLAMA3_ORIGINAL_CONTEXTS = (1024, 2048, 4096, 8192, 16384, 32768)


def rope_parameters_from_factors(factors: torch.Tensor, theta: float, head_dim: int) -> dict[str, Any] | None:
    """transformers' ``rope_parameters`` whose frequencies are the default ones divided by ``factors`` (a GGUF's
    ``rope_freqs``): linear scaling where every factor is the same, else the Llama 3 scaling that gives them; None
    when none does."""
    factors = factors.double().flatten()
    if torch.allclose(factors, factors[0].expand_as(factors), rtol=1e-6):
        return {"rope_type": "linear", "rope_theta": theta, "factor": float(factors[0])}
    default = torch.tensor(Rope.default(theta, head_dim).inv_freq, dtype=torch.float64)
    wavelengths = 2 * torch.pi / default
    for factor in _LLAMA3_FACTORS:
        for original in _LLAMA3_ORIGINAL_CONTEXTS:
            for low, high in ((1.0, 4.0), (1.0, 2.0), (2.0, 4.0)):
                smooth = ((original / wavelengths - low) / (high - low)).clamp(0.0, 1.0)
                want = 1.0 / ((1 - smooth) / factor + smooth)
                if torch.allclose(want, factors, rtol=1e-4):
                    return {"rope_type": "llama3", "rope_theta": theta, "factor": factor, "low_freq_factor": low,
                            "high_freq_factor": high, "original_max_position_embeddings": original}
    return None
