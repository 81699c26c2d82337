/* The AVX-512 vector helpers the *_avx512.c and matmul_amx.c files share (compiled only with AVX-512's flags). */
#ifndef CHATD_SIMD_AVX512_H
#define CHATD_SIMD_AVX512_H

#include <immintrin.h>

/* 16 bf16 values (their bits) to fp32: exact. */
static inline __m512 widen_bf16x16(__m256i bits)
{
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

static inline __m512 load_bf16x16(const uint16_t *src)
{
    return widen_bf16x16(_mm256_loadu_si256((const __m256i *)src));
}

static inline __m512 maskz_load_bf16x16(__mmask16 m, const uint16_t *src)
{
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, src)), 16));
}

/* 16 fp32 values to bf16 rounded as to_bf16 rounds (to nearest even, NaN kept quiet; denormals kept, unlike the
 * hardware conversion instruction). */
static inline __m256i bf16x16(__m512 f)
{
    const __m512i u = _mm512_castps_si512(f);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
    rounded = _mm512_mask_mov_epi32(rounded, nan,
                                    _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
    return _mm512_cvtepi32_epi16(rounded);
}

/* The same rounding for finite values only (the matmuls' outputs): no NaN lanes to keep. */
static inline __m256i bf16x16_finite(__m512 values)
{
    const __m512i bits = _mm512_castps_si512(values);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

/* e^x for 16 lanes: x = n ln2 + r with |r| <= ln2 / 2, a degree-6 Taylor polynomial in r (relative error
 * about 1e-7, a unit in the last place), scaled by 2^n. Lanes below -87.3 give 0 or a denormal, above
 * 88.7 the largest finite value's neighbourhood; a NaN stays a NaN. */
static inline __m512 exp16(__m512 x)
{
    x = _mm512_min_ps(x, _mm512_set1_ps(88.7f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

#endif
