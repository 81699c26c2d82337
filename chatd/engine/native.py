"""Native CPU kernels, compiled once per machine with torch's C++ extension builder.

:func:`decode_attention` is a decode step's attention for every session of the batch in one call: for each
row it appends the new position's K/V to that session's own buffers and attends the row's query heads over
them. Python then loops over layers only, not over sessions: a loop of per-row SDPA calls costs about
60 us per row and layer on this kind of CPU (two cache writes, a fused-attention call and the view
bookkeeping), more than the attention arithmetic itself at chat-sized contexts.

The kernel runs one task per (row, KV head) on torch's intra-op thread pool. Each task reads its keys once
for the whole query group (GQA), keeps the scores of the group in a scratch row, and accumulates the
values in fp32. It needs fp32 caches on the CPU; anything else uses the per-row path.

Building needs a C++ compiler (about a minute, once; torch caches the library under
``TORCH_EXTENSIONS_DIR``). Without one, :func:`load` logs why and returns None, and the engine keeps the
per-row path, which computes the same values.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

log = logging.getLogger(__name__)

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <vector>

// q: [B, H, D]; k_new, v_new: [B, KVH, D]; keys[b], values[b]: [1, KVH, capacity_b, D] contiguous;
// lengths[b]: positions already cached. Writes the new K/V at lengths[b] and returns out [B, H, D].
at::Tensor decode_attention(at::Tensor q, at::Tensor k_new, at::Tensor v_new,
                            std::vector<at::Tensor> keys, std::vector<at::Tensor> values,
                            std::vector<int64_t> lengths, double scale) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KVH = k_new.size(1);
  const int64_t G = H / KVH;
  TORCH_CHECK(q.is_contiguous() && k_new.is_contiguous() && v_new.is_contiguous(), "inputs must be contiguous");
  TORCH_CHECK(q.scalar_type() == at::kFloat, "fp32 only");
  TORCH_CHECK((int64_t)keys.size() == B && (int64_t)values.size() == B && (int64_t)lengths.size() == B,
              "one cache per row");
  std::vector<float*> kp(B), vp(B);
  std::vector<int64_t> caps(B);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(keys[b].is_contiguous() && values[b].is_contiguous(), "cache buffers must be contiguous");
    TORCH_CHECK(keys[b].scalar_type() == at::kFloat && values[b].scalar_type() == at::kFloat, "fp32 caches only");
    caps[b] = keys[b].size(2);
    TORCH_CHECK(lengths[b] < caps[b], "no room for the new position");
    kp[b] = keys[b].data_ptr<float>();
    vp[b] = values[b].data_ptr<float>();
  }
  at::Tensor out = at::empty({B, H, D}, q.options());
  const float* qd = q.data_ptr<float>();
  const float* knd = k_new.data_ptr<float>();
  const float* vnd = v_new.data_ptr<float>();
  float* od = out.data_ptr<float>();
  const float s = static_cast<float>(scale);
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / KVH, h = task % KVH;
      const int64_t len = lengths[b] + 1;
      float* kbase = kp[b] + h * caps[b] * D;
      float* vbase = vp[b] + h * caps[b] * D;
      const float* kn = knd + (b * KVH + h) * D;
      const float* vn = vnd + (b * KVH + h) * D;
      for (int64_t d = 0; d < D; ++d) {
        kbase[lengths[b] * D + d] = kn[d];
        vbase[lengths[b] * D + d] = vn[d];
      }
      scores.assign(G * len, 0.f);
      const float* qh = qd + (b * H + h * G) * D;
      for (int64_t j = 0; j < len; ++j) {
        const float* kj = kbase + j * D;
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qh + g * D;
          float acc = 0.f;
#pragma omp simd reduction(+ : acc)
          for (int64_t d = 0; d < D; ++d) acc += qg[d] * kj[d];
          scores[g * len + j] = acc * s;
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* row = scores.data() + g * len;
        float m = row[0];
        for (int64_t j = 1; j < len; ++j) m = row[j] > m ? row[j] : m;
        float sum = 0.f;
        for (int64_t j = 0; j < len; ++j) { row[j] = std::exp(row[j] - m); sum += row[j]; }
        const float inv = 1.f / sum;
        for (int64_t j = 0; j < len; ++j) row[j] *= inv;
      }
      float* oh = od + (b * H + h * G) * D;
      for (int64_t i = 0; i < G * D; ++i) oh[i] = 0.f;
      for (int64_t j = 0; j < len; ++j) {
        const float* vj = vbase + j * D;
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * len + j];
          float* og = oh + g * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) og[d] += p * vj[d];
        }
      }
    }
  });
  return out;
}
"""

_CAPABILITY_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512dq", "-mavx2", "-mfma"],
    "AVX2": ["-mavx2", "-mfma"],
}
_lock = threading.Lock()
_module: Any = None
_failed: str | None = None


def load() -> Any | None:
    """The compiled kernels (built on first use, then loaded from torch's cache), or None when they cannot
    be built here (the reason is logged once)."""
    global _module, _failed
    with _lock:
        if _module is not None or _failed is not None:
            return _module
        started = time.monotonic()
        log.info("loading the native decode-attention kernel (compiled the first time on a machine: ~1 min)")
        try:
            import os
            import sys

            import torch
            from torch.utils.cpp_extension import load_inline

            # ninja comes with chatd's dependencies, in the environment's bin folder, which need not be on PATH.
            bin_dir = os.path.dirname(sys.executable)
            if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
                os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
            # The vector width torch itself dispatches to on this CPU; the library's name carries it, so a
            # cache shared by different machines never loads code built for wider vectors.
            capability = torch.backends.cpu.get_cpu_capability()
            flags = _CAPABILITY_FLAGS.get(capability, [])
            name = f"chatd_native_v1_{capability.lower() if flags else 'default'}"
            _module = load_inline(name=name, cpp_sources=_SOURCE, functions=["decode_attention"],
                                  extra_cflags=["-O3", "-fopenmp-simd", *flags], verbose=False)
        except Exception as exc:  # no compiler, no headers, a failed build: keep the per-row path
            _failed = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
            log.warning("native decode attention unavailable, using per-row attention: %s", _failed)
            return None
        log.info("native decode attention loaded in %.1f s", time.monotonic() - started)
        return _module
