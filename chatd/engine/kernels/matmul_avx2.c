/* The tile matmul on AVX2 vectors, where the CPU has neither AMX nor AVX-512 (AMD Zen 2 and Zen 3, Intel before
 * Ice Lake): matmul_avx512.c's integer dot products on 256-bit vectors, on its layout (the 32-byte halves of a
 * 64-byte vector are outputs 0..7 and 8..15 of the tile). matmul.c quantises x and shares the output groups out
 * over the threads; this file has the vector loops. Compiled with AVX2's flags (loader.py's SOURCES).
 *
 * VPMADDUBSW multiplies unsigned by signed bytes and adds adjacent pairs into int16 lanes; a weight is split into
 * 4-bit parts (Q4_1's quant is one, Q8_0's q + 128 two), so that a pair stays within 2 * 15 * 127 and the int16
 * sums of a block's 8 quad rows within 30,480: no lane saturates, and the block's sums are exact, as on
 * AVX512-VNNI. VPMADDWD then adds the int16 pairs into one int32 per output (with weight 16 for a Q8_0 quant's
 * high part). x is quantised exactly as the VNNI kernel quantises it, and each block's sums are added into the
 * fp32 totals in the same order, so the two compute the same bits.
 */
#include "kernels_impl.h"
#include "simd_avx2.h"

#define AVX2_ROWS 4 /* rows of x per pass: a block sum (and a Q8_0 one's second) and a total each, in registers */

/* As matmul_avx512.c's quantise row, on 8 lanes: the same xq, dx and dx_sum. */
static CHATD_EXACT void quantise_row_avx2(const uint16_t *row, int k, int8_t *xq, float *dx, float *dx_sum)
{
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int kb = 0; kb < k / 32; kb++) {
        __m256 part[4];
        __m256 amax = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            part[i] = widen_bf16x8(_mm_loadu_si128((const __m128i *)(row + 32 * kb + 8 * i)));
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, part[i]));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
        const float scale = x_block_scale(_mm_cvtss_f32(m4));
        const __m256 inverse = _mm256_set1_ps(x_block_inverse(scale));
        __m256i q[4];
        for (int i = 0; i < 4; i++)
            q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(part[i], inverse)); /* to nearest even */
        /* int32 -> int8 with saturation; the packs interleave 128-bit lanes, the permute restores the order */
        const __m256i q16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[1]), 0xd8);
        const __m256i q16b = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2], q[3]), 0xd8);
        const __m256i q8 = _mm256_permute4x64_epi64(_mm256_packs_epi16(q16, q16b), 0xd8);
        _mm256_storeu_si256((__m256i *)(xq + 32 * kb), q8);
        const __m256i s = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
        dx[kb] = scale;
        dx_sum[kb] = scale * (float)_mm_cvtsi128_si32(s4);
    }
}

/* Rows [row0, row0 + ROWS) of the quantised x against half `half` (outputs 8 * half .. + 7) of output group g. */
static inline __attribute__((always_inline)) void avx2_rows(const int8_t *xq, const float *dx, const float *dx_sum,
                                                             int row0, const int ROWS, int k, const uint8_t *group,
                                                             int q8, int g, int half, uint16_t *y, int n)
{
    const int blocks = k / 32, tile_bytes = tile_bytes_for(q8);
    const __m256i low4 = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1), sixteens = _mm256_set1_epi16(16);
    __m256 total[AVX2_ROWS];
    for (int r = 0; r < ROWS; r++)
        total[r] = _mm256_setzero_ps();
    for (int kb = 0; kb < blocks; kb++) {
        const uint8_t *tile = group + (int64_t)kb * tile_bytes;
        if (half == 0)
            prefetch_tiles_ahead(tile, tile_bytes);
        __m256 d, offset;
        if (q8) {
            d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(tile + 512 + 16 * half)));
            offset = _mm256_mul_ps(d, _mm256_set1_ps(-128.0f));
        } else {
            d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(tile + 256 + 16 * half)));
            offset = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(tile + 288 + 16 * half)));
        }
        __m256i sum[AVX2_ROWS], high[AVX2_ROWS]; /* int16 pair sums; high: a Q8_0 quant's upper 4 bits' */
        for (int r = 0; r < ROWS; r++)
            sum[r] = high[r] = _mm256_setzero_si256();
        if (q8) {
#pragma GCC unroll 8
            for (int v = 0; v < 8; v++) {
                const __m256i raw = _mm256_loadu_si256((const __m256i *)(tile + 64 * v + 32 * half));
                const __m256i lo = _mm256_and_si256(raw, low4);
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
#pragma GCC unroll 8
                for (int r = 0; r < ROWS; r++) {
                    int32_t quad;
                    memcpy(&quad, xq + (row0 + r) * (int64_t)k + 32 * kb + 4 * v, sizeof quad);
                    const __m256i xv = _mm256_set1_epi32(quad);
                    sum[r] = _mm256_add_epi16(sum[r], _mm256_maddubs_epi16(lo, xv));
                    high[r] = _mm256_add_epi16(high[r], _mm256_maddubs_epi16(hi, xv));
                }
            }
        } else {
#pragma GCC unroll 4
            for (int v = 0; v < 4; v++) {
                const __m256i raw = _mm256_loadu_si256((const __m256i *)(tile + 64 * v + 32 * half));
                const __m256i lo = _mm256_and_si256(raw, low4);                         /* quad row v */
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);  /* quad row v + 4 */
#pragma GCC unroll 8
                for (int r = 0; r < ROWS; r++) {
                    int32_t a, b;
                    memcpy(&a, xq + (row0 + r) * (int64_t)k + 32 * kb + 4 * v, sizeof a);
                    memcpy(&b, xq + (row0 + r) * (int64_t)k + 32 * kb + 4 * (v + 4), sizeof b);
                    sum[r] = _mm256_add_epi16(sum[r], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(a)));
                    sum[r] = _mm256_add_epi16(sum[r], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(b)));
                }
            }
        }
#pragma GCC unroll 8
        for (int r = 0; r < ROWS; r++) {
            __m256i dot = _mm256_madd_epi16(sum[r], ones);
            if (q8)
                dot = _mm256_add_epi32(dot, _mm256_madd_epi16(high[r], sixteens));
            const int64_t at = (row0 + r) * (int64_t)blocks + kb;
            total[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(d, _mm256_set1_ps(dx[at])), total[r]);
            total[r] = _mm256_fmadd_ps(offset, _mm256_set1_ps(dx_sum[at]), total[r]);
        }
    }
    for (int r = 0; r < ROWS; r++)
        _mm_storeu_si128((__m128i *)(y + (int64_t)(row0 + r) * n + 16 * g + 8 * half), narrow_bf16x8(total[r]));
}

static void avx2_group(const int8_t *xq, const float *dx, const float *dx_sum, int m, int k, const uint8_t *tiles,
                       int q8, int g, uint16_t *y, int n)
{
    const uint8_t *group = group_tiles(tiles, g, k, q8);
    for (int half = 0; half < 2; half++) {
        int row0 = 0;
        for (; row0 + AVX2_ROWS <= m; row0 += AVX2_ROWS)
            avx2_rows(xq, dx, dx_sum, row0, AVX2_ROWS, k, group, q8, g, half, y, n);
        switch (m - row0) {
        case 3: avx2_rows(xq, dx, dx_sum, row0, 3, k, group, q8, g, half, y, n); break;
        case 2: avx2_rows(xq, dx, dx_sum, row0, 2, k, group, q8, g, half, y, n); break;
        case 1: avx2_rows(xq, dx, dx_sum, row0, 1, k, group, q8, g, half, y, n); break;
        default: break;
        }
    }
}

const struct chatd_matmul_ops chatd_matmul_avx2 = {CHATD_MATMUL_AVX2, quantise_row_avx2, avx2_group, NULL};
