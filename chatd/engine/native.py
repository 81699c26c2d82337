"""Native CPU kernels, compiled once per machine with torch's C++ extension builder.

:func:`decode_attention` is a decode step's attention for every session of the batch in one call: for each
row it appends the new position's K/V to that session's own buffers and attends the row's query heads over
them. Python then loops over layers only, not over sessions: a loop of per-row SDPA calls costs about
60 us per row and layer on this kind of CPU (two cache writes, a fused-attention call and the view
bookkeeping), more than the attention arithmetic itself at chat-sized contexts.

The kernel runs one task per (row, KV head) on torch's intra-op thread pool. Each task reads its keys once
for the whole query group (GQA), keeps the scores of the group in a scratch row, and accumulates the
values in fp32. Caches may be fp32, bf16 or fp16 (read into fp32, new positions rounded to
nearest even like torch's own casts); activations are fp32. Anything else uses the per-row path.

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

namespace {

inline float load(float x) { return x; }
inline float load(c10::BFloat16 x) { return static_cast<float>(x); }
inline float load(c10::Half x) { return static_cast<float>(x); }

// One task per (row, KV head): write the new K/V at lengths[b], then attend the head's query group over
// positions 0 .. lengths[b]. Scores of the group are kept in a scratch row; accumulation is fp32.
template <typename T>
void attend(const float* qd, const float* knd, const float* vnd, std::vector<T*>& kp, std::vector<T*>& vp,
            const std::vector<int64_t>& caps, const std::vector<int64_t>& lengths, float* od,
            int64_t B, int64_t H, int64_t KVH, int64_t D, float s) {
  const int64_t G = H / KVH;
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, key(D), value(D);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / KVH, h = task % KVH;
      const int64_t len = lengths[b] + 1;
      T* kbase = kp[b] + h * caps[b] * D;
      T* vbase = vp[b] + h * caps[b] * D;
      const float* kn = knd + (b * KVH + h) * D;
      const float* vn = vnd + (b * KVH + h) * D;
      for (int64_t d = 0; d < D; ++d) {
        kbase[lengths[b] * D + d] = static_cast<T>(kn[d]);
        vbase[lengths[b] * D + d] = static_cast<T>(vn[d]);
      }
      scores.assign(G * len, 0.f);
      const float* qh = qd + (b * H + h * G) * D;
      for (int64_t j = 0; j < len; ++j) {
        const T* kj = kbase + j * D;
        for (int64_t d = 0; d < D; ++d) key[d] = load(kj[d]);
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qh + g * D;
          float acc = 0.f;
#pragma omp simd reduction(+ : acc)
          for (int64_t d = 0; d < D; ++d) acc += qg[d] * key[d];
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
        const T* vj = vbase + j * D;
        for (int64_t d = 0; d < D; ++d) value[d] = load(vj[d]);
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * len + j];
          float* og = oh + g * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) og[d] += p * value[d];
        }
      }
    }
  });
}

template <typename T>
void run(const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new, std::vector<at::Tensor>& keys,
         std::vector<at::Tensor>& values, const std::vector<int64_t>& lengths, at::Tensor& out, float s) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KVH = k_new.size(1);
  std::vector<T*> kp(B), vp(B);
  std::vector<int64_t> caps(B);
  for (int64_t b = 0; b < B; ++b) {
    caps[b] = keys[b].size(2);
    TORCH_CHECK(lengths[b] < caps[b], "no room for the new position");
    kp[b] = keys[b].data_ptr<T>();
    vp[b] = values[b].data_ptr<T>();
  }
  attend<T>(q.data_ptr<float>(), k_new.data_ptr<float>(), v_new.data_ptr<float>(), kp, vp, caps, lengths,
            out.data_ptr<float>(), B, H, KVH, D, s);
}

}  // namespace

// q: [B, H, D] fp32; k_new, v_new: [B, KVH, D] fp32; keys[b], values[b]: [1, KVH, capacity_b, D]
// contiguous, all of one dtype (fp32, bf16 or fp16); lengths[b]: positions already cached. Writes the new
// K/V at lengths[b] (rounded to the cache's dtype) and returns out [B, H, D] fp32.
at::Tensor decode_attention(at::Tensor q, at::Tensor k_new, at::Tensor v_new,
                            std::vector<at::Tensor> keys, std::vector<at::Tensor> values,
                            std::vector<int64_t> lengths, double scale) {
  const int64_t B = q.size(0);
  TORCH_CHECK(q.is_contiguous() && k_new.is_contiguous() && v_new.is_contiguous(), "inputs must be contiguous");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_new.scalar_type() == at::kFloat &&
              v_new.scalar_type() == at::kFloat, "fp32 activations only");
  TORCH_CHECK((int64_t)keys.size() == B && (int64_t)values.size() == B && (int64_t)lengths.size() == B,
              "one cache per row");
  TORCH_CHECK(B > 0, "an empty batch");
  const auto dtype = keys[0].scalar_type();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(keys[b].is_contiguous() && values[b].is_contiguous(), "cache buffers must be contiguous");
    TORCH_CHECK(keys[b].scalar_type() == dtype && values[b].scalar_type() == dtype, "one cache dtype per call");
  }
  at::Tensor out = at::empty_like(q);
  const float s = static_cast<float>(scale);
  if (dtype == at::kFloat) {
    run<float>(q, k_new, v_new, keys, values, lengths, out, s);
  } else if (dtype == at::kBFloat16) {
    run<c10::BFloat16>(q, k_new, v_new, keys, values, lengths, out, s);
  } else if (dtype == at::kHalf) {
    run<c10::Half>(q, k_new, v_new, keys, values, lengths, out, s);
  } else {
    TORCH_CHECK(false, "cache dtype must be float32, bfloat16 or float16");
  }
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
            name = f"chatd_native_v2_{capability.lower() if flags else 'default'}"
            _module = load_inline(name=name, cpp_sources=_SOURCE, functions=["decode_attention"],
                                  extra_cflags=["-O3", "-fopenmp-simd", *flags], verbose=False)
        except Exception as exc:  # no compiler, no headers, a failed build: keep the per-row path
            _failed = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
            log.warning("native decode attention unavailable, using per-row attention: %s", _failed)
            return None
        log.info("native decode attention loaded in %.1f s", time.monotonic() - started)
        return _module
