"""What the model runs as, decided from the settings and the machine: the device, the dtypes, the weights'
precision, and the compact forward built for them (dense, int8, or the packaged GGUF's own q4 blocks with a dense
twin for wide steps)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from chatd.engine.kernels.loader import EngineKernels
from chatd.engine.model.forward import LlamaForward
from chatd.engine.model.gguf_weights import load_gguf_weights
from chatd.engine.model.weights import (
    DenseLinear,
    Int8Linear,
    Linear,
    LlamaShape,
    PackedBf16Linear,
    bf16_matmul_is_fast,
    weights_from_gguf,
    weights_from_transformers,
)
from chatd.errors import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(setting: str) -> torch.device:
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if setting.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"model.device = {setting!r} but CUDA is not available")
    return torch.device(setting)


def resolve_dtype(setting: str, device: torch.device) -> torch.dtype:
    """The dtype transformers loads the model in (its forward's activations); fp32 for an int8 KV cache."""
    if setting == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if setting == "int8":
        return torch.float32
    return DTYPES[setting]


def resolve_kv_dtype(setting: str, device: torch.device, weights: str, *, native: bool = True) -> torch.dtype:
    """The KV cache's dtype: ``setting`` unless ``auto``. ``auto`` is int8 for the packaged model's ``q4``
    weights on the CPU where the native kernels run (``native``; bfloat16 where they do not): a decode step
    reads about half a bf16 cache's bytes and a quarter of fp32's, snapshots shrink by a third against bf16
    and restore faster, at a cost in agreement with the fp32 forward far below the q4 weights' own
    (docs/performance.md). Otherwise the model's own dtype (``float32`` weights keep an fp32 cache: their
    greedy replies equal transformers' exactly)."""
    if setting == "auto" and weights == "q4" and device.type == "cpu":
        return torch.int8 if native and sys.byteorder == "little" else torch.bfloat16
    if setting == "int8":
        if sys.byteorder != "little":  # an int8 row's scale is written in the host's order (docs/snapshot-format.md)
            raise ConfigError('model.dtype = "int8" (an int8 KV cache) needs a little-endian host')
        if weights == "transformers" or device.type != "cpu":
            raise ConfigError('model.dtype = "int8" (an int8 KV cache) runs on the compact forward on the CPU: it '
                              'needs model.weights other than "transformers" and the CPU as the device')
        return torch.int8
    return resolve_dtype(setting, device)


def resolve_weights(setting: str, device: torch.device, config: Any, *, has_gguf: bool = False) -> str:
    """The weight precision to run: ``setting`` unless ``auto``. ConfigError when a compact-forward
    precision is asked for a model the compact forward does not reproduce. ``has_gguf``: the model came from a
    GGUF whose blocks ``q4`` runs as they are (``auto`` then runs them on the CPU); ``q4`` for any other source
    quantises on load."""
    try:
        LlamaShape.from_config(config)
        supported = True
    except ValueError as exc:
        if setting not in ("auto", "transformers"):
            raise ConfigError(f"model.weights = {setting!r} needs a Llama-family model: {exc}") from exc
        supported = False
    if setting != "auto":
        return setting
    if not supported:
        return "transformers"
    if has_gguf and device.type == "cpu":
        # The file's own precision: a fraction of fp32's weight traffic per token, at the precision llama.cpp runs
        # (the agreement figures: python -m benchmarks.quality).
        return "q4"
    # fp32 on the CPU: bf16 and fp16 matmuls are several times slower there and int8 has no fast kernel.
    return "bfloat16" if device.type == "cuda" else "float32"


def compact_forward_problem(config: Any) -> str:
    """Why the compact forward does not run a model (the setting, where it could)."""
    try:
        LlamaShape.from_config(config)
    except ValueError as exc:
        return str(exc)
    return 'model.weights = "transformers"'


def compact_forward(model: Any, weights: str, device: torch.device) -> LlamaForward:
    """The compact forward over ``model``'s weights stored as ``weights`` (a dense dtype name or int8).
    For ``q4`` see :func:`gguf_forward`."""
    def make(weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
        if weights == "int8":
            return Int8Linear.quantize(weight.float(), bias)
        if weights == "bfloat16" and device.type == "cpu":
            return bf16_linear(weight, bias)
        return DenseLinear(weight.to(DTYPES[weights]).contiguous(), bias)

    return LlamaForward(weights_from_transformers(model, make), device)


def bf16_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
    """A bf16 projection on the CPU: prepacked for oneDNN where torch has it, else a plain bf16 matmul."""
    if PackedBf16Linear.available():
        return PackedBf16Linear(weight, bias)
    return DenseLinear(weight.to(torch.bfloat16).contiguous(), bias)


# Batches of at least this many rows run the dense twin of a ``q4`` model: bf16 where the CPU multiplies
# bf16 in hardware (its cost is flat in the rows, the int4 kernel's grows with each), else fp32, which only
# pays from prefill-sized batches on.
BF16_TWIN_MIN_ROWS = 8
FP32_TWIN_MIN_ROWS = 32


def gguf_forward(device: torch.device, path: Path, dequantised: Any | None = None,
                 kernels: EngineKernels | None = None, config: Any | None = None) -> LlamaForward:
    """The compact forward over a GGUF's quantised blocks at ``path`` (gguf_weights: each type read as Q4_1 or Q8_0).

    ``kernels`` with a tile matmul (:attr:`EngineKernels.tile_matmul_kind`: AMX tiles, AVX512-VNNI
    or AVX2 vectors; with AMX, steps of few rows on the vectors): the Q4_1 and Q8_0 blocks run on it, at the blocks'
    memory traffic and growing slowly in the rows; there is no twin (``python -m benchmarks.quant_matmul``).
    Without one, ``dequantised`` (the converted fp32 model, the same weights dequantised exactly) gives
    batches of several rows (prefill chunks, decode steps of many sessions) a dense twin: bf16 on a CPU with
    bf16 matmul units, else fp32 for prefill-sized batches; single-session decode steps run the blocks.
    ``config``: the model's transformers config, for what the file's header leaves out (RoPE scaling)."""
    if device.type != "cpu":
        raise ConfigError('model.weights = "q4" runs on the CPU; use bfloat16 on CUDA')
    tiles = kernels is not None and kernels.tile_matmul_kind is not None
    gguf = load_gguf_weights(path, kernels=kernels if tiles else None)
    if gguf.lossy():  # the twin holds the file's values, the blocks requantised ones: they would disagree
        dequantised = None
    if dequantised is None or tiles:
        return LlamaForward(weights_from_gguf(gguf, config=config), device)
    if bf16_matmul_is_fast():
        twin = weights_from_transformers(dequantised, bf16_linear)
        return LlamaForward(weights_from_gguf(gguf, twin, BF16_TWIN_MIN_ROWS, config), device)
    return LlamaForward(weights_from_gguf(gguf, weights_from_transformers(dequantised), FP32_TWIN_MIN_ROWS, config),
                        device)
