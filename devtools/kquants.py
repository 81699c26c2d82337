"""Encoders of ggml's K-quant blocks (Q4_K, Q5_K, Q6_K) for test checkpoints: the ``gguf`` package dequantises
these types but does not quantise them. Each encoder is a plain min/max (or absolute-max) rounding, not
llama.cpp's search for the best scales: the blocks are valid, and the tests compare against what gguf dequantises
from them, so their quality does not matter.

Each takes fp32 ``[N, K]`` (K a multiple of 256) and returns uint8 ``[N, K / 256 * block bytes]``.
"""

from __future__ import annotations

import numpy as np

SUPER = 256


def _pack_scales(scales: np.ndarray, mins: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins per super-block into ggml's 12 bytes (the inverse of gguf_weights.q4_k_scales)."""
    sc, mn = scales.astype(np.uint8), mins.astype(np.uint8)
    out = np.empty((*sc.shape[:-1], 12), np.uint8)
    out[..., 0:4] = sc[..., 0:4] | ((sc[..., 4:8] >> 4) << 6)
    out[..., 4:8] = mn[..., 0:4] | ((mn[..., 4:8] >> 4) << 6)
    out[..., 8:12] = (sc[..., 4:8] & 0xF) | ((mn[..., 4:8] & 0xF) << 4)
    return out


def _scaled_sub_blocks(x: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """x ``[N, S, 8, 32]`` -> (d, dmin ``[N, S]`` fp16, 6-bit scales and mins ``[N, S, 8]``, quants 0..levels)."""
    low = np.minimum(x.min(axis=-1), 0.0)  # [N, S, 8]
    step = (x.max(axis=-1) - low) / levels
    d = (step.max(axis=-1) / 63).astype(np.float16)
    dmin = ((-low).max(axis=-1) / 63).astype(np.float16)
    d32, dmin32 = d.astype(np.float32)[..., None], dmin.astype(np.float32)[..., None]
    scales = np.clip(np.rint(np.divide(step, d32, out=np.zeros_like(step), where=d32 > 0)), 0, 63)
    mins = np.clip(np.rint(np.divide(-low, dmin32, out=np.zeros_like(low), where=dmin32 > 0)), 0, 63)
    sub_d, sub_m = (d32 * scales)[..., None], (dmin32 * mins)[..., None]
    q = np.divide(x + sub_m, sub_d, out=np.zeros_like(x), where=sub_d > 0)
    return d, dmin, scales, mins, np.clip(np.rint(q), 0, levels).astype(np.uint8)


def quantize_q4_k(values: np.ndarray) -> np.ndarray:
    """Q4_K: 144 bytes per 256 weights (``d``, ``dmin``, 12 bytes of scales, 128 of 4-bit quants)."""
    n, k = values.shape
    x = values.astype(np.float32).reshape(n, k // SUPER, 8, 32)
    d, dmin, scales, mins, q = _scaled_sub_blocks(x, 15)
    runs = (q[:, :, 0::2] | (q[:, :, 1::2] << 4)).reshape(n, k // SUPER, 128)
    out = np.concatenate([d[..., None].view(np.uint8), dmin[..., None].view(np.uint8), _pack_scales(scales, mins),
                          runs], axis=-1)
    return out.reshape(n, -1)


def quantize_q5_k(values: np.ndarray) -> np.ndarray:
    """Q5_K: 176 bytes per 256 weights (``d``, ``dmin``, 12 bytes of scales, 32 of fifth bits, 128 of low
    nibbles; sub-blocks 2r and 2r + 1 share byte run r, their fifth bits are bits 2r and 2r + 1 of ``qh``)."""
    n, k = values.shape
    x = values.astype(np.float32).reshape(n, k // SUPER, 8, 32)
    d, dmin, scales, mins, q = _scaled_sub_blocks(x, 31)
    low = q & 0xF
    runs = (low[:, :, 0::2] | (low[:, :, 1::2] << 4)).reshape(n, k // SUPER, 128)
    high = (q >> 4).astype(np.uint8)  # [N, S, 8, 32], 0 or 1
    qh = np.zeros((n, k // SUPER, 32), np.uint8)
    for sub in range(8):
        qh |= high[:, :, sub] << sub
    out = np.concatenate([d[..., None].view(np.uint8), dmin[..., None].view(np.uint8), _pack_scales(scales, mins),
                          qh, runs], axis=-1)
    return out.reshape(n, -1)


def quantize_q6_k(values: np.ndarray) -> np.ndarray:
    """Q6_K: 210 bytes per 256 weights (128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales, one
    per 16 weights, fp16 ``d``); ``w = d * scale * (q - 32)``."""
    n, k = values.shape
    x = values.astype(np.float32).reshape(n, k // SUPER, 16, 16)
    step = np.abs(x).max(axis=-1) / 31  # [N, S, 16]
    d = (step.max(axis=-1) / 127).astype(np.float16)
    d32 = d.astype(np.float32)[..., None]
    scales = np.clip(np.rint(np.divide(step, d32, out=np.zeros_like(step), where=d32 > 0)), -128, 127)
    sub = (d32 * scales)[..., None]
    q = np.clip(np.rint(np.divide(x, sub, out=np.zeros_like(x), where=sub != 0)), -32, 31).astype(np.int16) + 32
    q = q.astype(np.uint8).reshape(n, k // SUPER, 2, 4, 32)  # [half, quarter t, l]: weight 128 h + 32 t + l
    ql = np.concatenate([q[:, :, :, 0] & 0xF | ((q[:, :, :, 2] & 0xF) << 4),
                         q[:, :, :, 1] & 0xF | ((q[:, :, :, 3] & 0xF) << 4)], axis=-1)  # [N, S, 2, 64]
    qh = (q[:, :, :, 0] >> 4) | ((q[:, :, :, 1] >> 4) << 2) | ((q[:, :, :, 2] >> 4) << 4) | ((q[:, :, :, 3] >> 4) << 6)
    out = np.concatenate([ql.reshape(n, k // SUPER, 128), qh.reshape(n, k // SUPER, 64),
                          scales.astype(np.int8).view(np.uint8), d[..., None].view(np.uint8)], axis=-1)
    return out.reshape(n, -1)


ENCODERS = {"Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k, "Q6_K": quantize_q6_k}
