/* The element-wise steps' AVX-512 variant, one row at a time, 16 lanes (elementwise.c shares the rows out over
 * the threads). Row lengths the lanes do not divide finish one value at a time, as the portable reference does.
 * Compiled with AVX-512's flags (loader.py's SOURCES). */
#include "kernels_impl.h"
#include "simd_avx512.h"

/* x[0, n) as an int8 row (chatd_kernels.h's rule): the portable reference's operations 16 lanes at a time, where
 * division and rounding are exact per lane, so the bits are the same. */
static CHATD_EXACT_UNFUSED void quantize_row16(const float *x, int n, int8_t *out)
{
    if (n % 16 == 0) {
        __m512 top16 = _mm512_setzero_ps();
        for (int d = 0; d < n; d += 16)
            top16 = _mm512_max_ps(top16, _mm512_abs_ps(_mm512_loadu_ps(x + d)));
        const float scale = _mm512_reduce_max_ps(top16) / 127.0f;
        const __m512 by = _mm512_set1_ps(scale);
        for (int d = 0; d < n; d += 16) {
            const __m512 q = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(x + d), by),
                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            _mm_storeu_si128((__m128i *)(out + d),
                             scale > 0.0f ? _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(q)) : _mm_setzero_si128());
        }
        memcpy(out + n, &scale, sizeof scale);
        return;
    }
    quantize_row_portable(x, n, out);
}

static CHATD_EXACT_UNFUSED void rope_row16(float *row, const float *c, const float *s, void *keys, void *values,
                                           int64_t head_stride, int64_t slot, int num_heads, int num_kv_heads,
                                           int head_dim, int kv_type)
{
    rope_row(row, c, s, keys, values, head_stride, slot, num_heads, num_kv_heads, head_dim, kv_type, quantize_row16);
}

static void add_rms_norm_row16(float *x, const uint16_t *a, const float *weight, float eps, uint16_t *o, int hidden)
{
    __m512 squares16 = _mm512_setzero_ps();
    for (int d = 0; d < hidden; d += 16) {
        const __mmask16 m = hidden - d >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (hidden - d)) - 1u);
        __m512 xd = _mm512_maskz_loadu_ps(m, x + d);
        if (a != NULL) {
            xd = _mm512_add_ps(xd, maskz_load_bf16x16(m, a + d));
            _mm512_mask_storeu_ps(x + d, m, xd);
        }
        squares16 = _mm512_fmadd_ps(xd, xd, squares16);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(squares16) / (float)hidden + eps));
    for (int d = 0; d < hidden; d += 16) {
        const __mmask16 m = hidden - d >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (hidden - d)) - 1u);
        const __m512 y = _mm512_mul_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + d), inv),
                                       _mm512_maskz_loadu_ps(m, weight + d));
        _mm256_mask_storeu_epi16(o + d, m, bf16x16(y));
    }
}

static void silu_mul_row16(const uint16_t *g, const uint16_t *u, uint16_t *o, int inter)
{
    int j = 0;
    for (; j + 16 <= inter; j += 16) {
        const __m512 x = load_bf16x16(g + j);
        const __m512 silu = _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f),
                                                            exp16(_mm512_sub_ps(_mm512_setzero_ps(), x))));
        _mm256_storeu_si256((__m256i *)(o + j), bf16x16(_mm512_mul_ps(silu, load_bf16x16(u + j))));
    }
    for (; j < inter; j++)
        o[j] = silu_mul_one(g[j], u[j]);
}

static void widen_bf16_16(const uint16_t *x, float *out, int64_t n)
{
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(out + i, load_bf16x16(x + i));
    for (; i < n; i++)
        out[i] = from_bf16(x[i]);
}

static void round_bf16_16(const float *x, uint16_t *out, int64_t n)
{
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(out + i), bf16x16(_mm512_loadu_ps(x + i)));
    for (; i < n; i++)
        out[i] = to_bf16(x[i]);
}

const struct chatd_row_ops chatd_rows_avx512 = {rope_row16, add_rms_norm_row16, silu_mul_row16, widen_bf16_16,
                                                round_bf16_16};
