/* The tile matmul on AVX512-VNNI vectors (AMD Zen 4 and later, Intel Cascade Lake and later; also the calls of few
 * rows where AMX runs). matmul.c quantises x and shares the output groups out over the threads; this file has the
 * vector loops. Compiled with AVX512-VNNI's flags (loader.py's SOURCES).
 *
 * The kernel runs integer dot products, as llama.cpp does: each row of x is rounded to int8 per block of 32
 * (kernels_impl.h's rule: dx = max |x| / 127, x ~ dx * xq), and one VPDPBUSD adds 4 products of a weight's 4-bit
 * (or offset 8-bit) quants and 4 int8 of xq into each of 16 int32 sums. A Q4_1 block then gives
 * d * dx * sum(q * xq) + m * dx * sum(xq); a Q8_0 block, stored as q + 128, d * dx * (sum((q + 128) * xq) - 128 *
 * sum(xq)). The weights take part exactly (d * q + m unrounded); x is rounded to 8 bits per block where the AMX
 * path rounds it to bf16 (llama.cpp's Q4_1 matmul rounds it the same way).
 * Its layout, per tile of 16 outputs by 32 inputs (quad row r holds inputs 4r..4r+3):
 *   Q4_1, 320 bytes: 4 vectors of 64 bytes, vector v holding quad row v in its low nibbles and quad row
 *     v + 4 in its high nibbles, output n's 4 quants at bytes 4n..4n+3; then 16 fp16 d, 16 fp16 m;
 *   Q8_0, 544 bytes: 8 vectors of 64 bytes, quad row r's q + 128 (as uint8) at bytes 4n..4n+3 of vector
 *     r; then 16 fp16 d.
 * The AVX2 kernel and the scalar reference read the same layout and compute the same bits.
 */
#include "kernels_impl.h"
#include "simd_avx512.h"

#define VECTOR_ROWS 8 /* rows of x per pass: 8 block sums and 8 totals in registers, beside the quad row in use */

/* One row of x (bf16, k values) quantised per block of 32: xq (int8), dx (the block's scale) and
 * dx * sum(xq) (what a block's offset term multiplies), to the bit (CHATD_EXACT). */
CHATD_EXACT void chatd_quantise_row_vnni(const uint16_t *row, int k, int8_t *xq, float *dx, float *dx_sum)
{
    for (int kb = 0; kb < k / 32; kb++) {
        const __m512 lo = widen_bf16x16(_mm256_loadu_si256((const __m256i *)(row + 32 * kb)));
        const __m512 hi = widen_bf16x16(_mm256_loadu_si256((const __m256i *)(row + 32 * kb + 16)));
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
        const float scale = x_block_scale(amax);
        const __m512 inverse = _mm512_set1_ps(x_block_inverse(scale));
        const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inverse));
        const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inverse));
        _mm_storeu_si128((__m128i *)(xq + 32 * kb), _mm512_cvtsepi32_epi8(qlo));
        _mm_storeu_si128((__m128i *)(xq + 32 * kb + 16), _mm512_cvtsepi32_epi8(qhi));
        dx[kb] = scale;
        dx_sum[kb] = scale * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
    }
}

/* Rows [row0, row0 + ROWS) of the quantised x against output group g, then y's 16 columns. ROWS is a
 * constant where this is inlined. */
static inline __attribute__((always_inline)) void vnni_rows(const int8_t *xq, const float *dx, const float *dx_sum,
                                                              int row0, const int ROWS, int k, const uint8_t *group,
                                                              int q8, int g, uint16_t *y, int n)
{
    const int blocks = k / 32, tile_bytes = tile_bytes_for(q8);
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    __m512 total[VECTOR_ROWS];
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; r++)
        total[r] = _mm512_setzero_ps();
    for (int kb = 0; kb < blocks; kb++) {
        const uint8_t *tile = group + (int64_t)kb * tile_bytes;
        prefetch_tiles_ahead(tile, tile_bytes);
        __m512 d, offset;
        if (q8) {
            d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(tile + 512)));
            offset = _mm512_mul_ps(d, _mm512_set1_ps(-128.0f));
        } else {
            d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(tile + 256)));
            offset = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(tile + 288)));
        }
        /* The rows' sums advance side by side (one dot product per row per quad row), so the out-of-order
         * core always has ROWS independent chains in flight. Each quad row's weights are unpacked where they
         * are used, so that with the loops unrolled the sums, the totals and the weights in use all stay in
         * registers. */
        __m512i sum[VECTOR_ROWS];
#pragma GCC unroll 8
        for (int r = 0; r < ROWS; r++)
            sum[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int v = 0; v < 8; v++) {
            __m512i w;
            if (q8)
                w = _mm512_loadu_si512((const void *)(tile + 64 * v));
            else if (v < 4)
                w = _mm512_and_si512(_mm512_loadu_si512((const void *)(tile + 64 * v)), low4);
            else
                w = _mm512_and_si512(_mm512_srli_epi16(_mm512_loadu_si512((const void *)(tile + 64 * (v - 4))), 4), low4);
#pragma GCC unroll 8
            for (int r = 0; r < ROWS; r++) {
                int32_t quad;
                memcpy(&quad, xq + (row0 + r) * (int64_t)k + 32 * kb + 4 * v, sizeof quad);
                sum[r] = _mm512_dpbusd_epi32(sum[r], w, _mm512_set1_epi32(quad));
            }
        }
#pragma GCC unroll 8
        for (int r = 0; r < ROWS; r++) {
            const int64_t at = (row0 + r) * (int64_t)blocks + kb;
            const __m512 scaled = _mm512_mul_ps(d, _mm512_set1_ps(dx[at]));
            total[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r]), scaled, total[r]);
            total[r] = _mm512_fmadd_ps(offset, _mm512_set1_ps(dx_sum[at]), total[r]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; r++)
        _mm256_storeu_si256((__m256i *)(y + (int64_t)(row0 + r) * n + 16 * g), bf16x16_finite(total[r]));
}

void chatd_vnni_group(const int8_t *xq, const float *dx, const float *dx_sum, int m, int k, const uint8_t *tiles,
                      int q8, int g, uint16_t *y, int n)
{
    const uint8_t *group = group_tiles(tiles, g, k, q8);
    int row0 = 0;
    for (; row0 + VECTOR_ROWS <= m; row0 += VECTOR_ROWS)
        vnni_rows(xq, dx, dx_sum, row0, VECTOR_ROWS, k, group, q8, g, y, n);
    switch (m - row0) {
    case 7: vnni_rows(xq, dx, dx_sum, row0, 7, k, group, q8, g, y, n); break;
    case 6: vnni_rows(xq, dx, dx_sum, row0, 6, k, group, q8, g, y, n); break;
    case 5: vnni_rows(xq, dx, dx_sum, row0, 5, k, group, q8, g, y, n); break;
    case 4: vnni_rows(xq, dx, dx_sum, row0, 4, k, group, q8, g, y, n); break;
    case 3: vnni_rows(xq, dx, dx_sum, row0, 3, k, group, q8, g, y, n); break;
    case 2: vnni_rows(xq, dx, dx_sum, row0, 2, k, group, q8, g, y, n); break;
    case 1: vnni_rows(xq, dx, dx_sum, row0, 1, k, group, q8, g, y, n); break;
    default: break;
    }
}

const struct chatd_matmul_ops chatd_matmul_vnni = {CHATD_MATMUL_VNNI, chatd_quantise_row_vnni, chatd_vnni_group, NULL};
