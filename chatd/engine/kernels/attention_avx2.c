/* Decode attention's AVX2 variant, for CPUs with AVX2 but not AVX-512 (AMD Zen 2 and Zen 3, Intel before Ice
 * Lake): the block walk on 8-lane vectors (attention.c shares the pairs out over the threads; kernels_impl.h has
 * the walk's bookkeeping). A block's 16 keys are scored as two vectors of 8, and the values are added in two
 * passes of half the head's chunks, so that the group's accumulators of a pass stay in the 16 registers there
 * are. Compiled with AVX2's flags (loader.py's SOURCES). */
#include "kernels_impl.h"
#define ATTENTION_SCALAR_INCLUDED /* its attend_pair, for the shapes the 8-lane walk does not take */
#include "attention_scalar.c"
#include "simd_avx2.h"

/* The 8 lanes' sums of 8 vectors: lane t of the result is the sum of v[t]'s lanes. */
static inline __m256 sum8x8(const __m256 *v)
{
    const __m256 a0 = _mm256_hadd_ps(v[0], v[1]), a1 = _mm256_hadd_ps(v[2], v[3]);
    const __m256 a2 = _mm256_hadd_ps(v[4], v[5]), a3 = _mm256_hadd_ps(v[6], v[7]);
    /* 128-bit lane l of b0: v0..v3's sums over their lane l; of b1: v4..v7's */
    const __m256 b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3);
    return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}

/* 8 K or V values from element `index` of an fp32, bf16 or int8 (kv_type) array, as fp32 (int8 unscaled). */
static inline __m256 kv8(const void *base, int64_t index, int kv_type)
{
    if (kv_type == KV_INT8)
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const int8_t *)base + index))));
    if (kv_type == KV_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + index))), 16));
    return _mm256_loadu_ps((const float *)base + index);
}

/* The walk over the blocks [first_block, end_block) of a sequence on 8 lanes (head_dim a multiple of 8,
 * block_size <= 16); the same state left per query head as attention_avx512.c's walk. */
static inline __attribute__((always_inline)) void
attend_blocks8(const float *restrict q, int64_t q_head_stride, const void *restrict keys,
               const void *restrict values, const int32_t *restrict table, int length, int first_block,
               int end_block, int group, int head_dim, int block_size, float scale, float *restrict state,
               const int kv_type)
{
    const int esize = kv_esize(kv_type), row = kv_row(kv_type, head_dim), chunks = head_dim / 8;
    const int half_chunks = (chunks + 1) / 2;
    float key_scale[16] __attribute__((aligned(32))), value_scale[16] __attribute__((aligned(32)));
    float score[MAX_GROUP][16] __attribute__((aligned(32)));
    __m256 dots[MAX_GROUP][16];
    float best[MAX_GROUP], total[MAX_GROUP];
    float *acc = state; /* per query head g: acc at state + g * (head_dim + 2) + 2, kept in memory between blocks */
    for (int g = 0; g < group; g++) {
        best[g] = -INFINITY;
        total[g] = 0.0f;
        for (int d = 0; d < head_dim; d++)
            acc[g * (head_dim + 2) + 2 + d] = 0.0f;
    }
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const int end = walk_end(length, end_block, block_size);
    for (int start = first_block * block_size, j = first_block; start < end; start += block_size, j++) {
        const int n = block_positions(length, start, block_size);
        const int64_t first = walk_block(keys, values, table, j, start, end, block_size, row, esize);
        for (int t = 0; t < n; t++) {
            const int64_t kt = first + (int64_t)t * row;
            __m256 key[MAX_HEAD_DIM / 8];
            for (int c = 0; c < chunks; c++)
                key[c] = kv8(keys, kt + 8 * c, kv_type);
            position_scales(keys, values, kt, head_dim, kv_type, &key_scale[t], &value_scale[t]);
            for (int g = 0; g < group; g++) {
                const float *qg = q + g * q_head_stride;
                __m256 dot = _mm256_mul_ps(_mm256_loadu_ps(qg), key[0]);
                for (int c = 1; c < chunks; c++)
                    dot = _mm256_fmadd_ps(_mm256_loadu_ps(qg + 8 * c), key[c], dot);
                dots[g][t] = dot;
            }
        }
        for (int t = n; t < 16; t++) {
            key_scale[t] = value_scale[t] = 0.0f;
            for (int g = 0; g < group; g++)
                dots[g][t] = _mm256_setzero_ps();
        }
        const __m256 live0 = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), lane));
        const __m256 live1 = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n - 8), lane));
        __m256 scale0 = _mm256_set1_ps(scale), scale1 = scale0;
        if (kv_type == KV_INT8) { /* an int8 key's scale multiplies its score, an int8 value's its softmax weight */
            scale0 = _mm256_mul_ps(_mm256_load_ps(key_scale), scale0);
            scale1 = _mm256_mul_ps(_mm256_load_ps(key_scale + 8), scale1);
        }
        const __m256 dead = _mm256_set1_ps(-INFINITY);
        for (int g = 0; g < group; g++) {
            const __m256 s0 = _mm256_blendv_ps(dead, _mm256_mul_ps(sum8x8(dots[g]), scale0), live0);
            const __m256 s1 = n > 8 ? _mm256_blendv_ps(dead, _mm256_mul_ps(sum8x8(dots[g] + 8), scale1), live1) : dead;
            const float top = softmax_top(best[g], hmax8(_mm256_max_ps(s0, s1)));
            const float shrink = softmax_shrink(best[g], top);
            const __m256 by = _mm256_set1_ps(top);
            const __m256 p0 = _mm256_and_ps(exp8(_mm256_sub_ps(s0, by)), live0);
            const __m256 p1 = n > 8 ? _mm256_and_ps(exp8(_mm256_sub_ps(s1, by)), live1) : _mm256_setzero_ps();
            softmax_add(&best[g], &total[g], top, shrink, hsum8(_mm256_add_ps(p0, p1)));
            if (kv_type == KV_INT8) {
                _mm256_store_ps(score[g], _mm256_mul_ps(p0, _mm256_load_ps(value_scale)));
                _mm256_store_ps(score[g] + 8, _mm256_mul_ps(p1, _mm256_load_ps(value_scale + 8)));
            } else {
                _mm256_store_ps(score[g], p0);
                _mm256_store_ps(score[g] + 8, p1);
            }
            float *a = acc + g * (head_dim + 2) + 2;
            const __m256 s = _mm256_set1_ps(shrink);
            for (int c = 0; c < chunks; c++)
                _mm256_storeu_ps(a + 8 * c, _mm256_mul_ps(_mm256_loadu_ps(a + 8 * c), s));
        }
        /* the values, in two passes over the block of half the chunks each: a pass's accumulators stay in
         * registers (3 query heads of 64-wide heads: 12 of the 16) */
        for (int c0 = 0; c0 < chunks; c0 += half_chunks) {
            const int c1 = c0 + half_chunks < chunks ? c0 + half_chunks : chunks;
            __m256 sum[MAX_GROUP][MAX_HEAD_DIM / 16];
            for (int g = 0; g < group; g++)
                for (int c = c0; c < c1; c++)
                    sum[g][c - c0] = _mm256_loadu_ps(acc + g * (head_dim + 2) + 2 + 8 * c);
            for (int t = 0; t < n; t++) {
                const int64_t vt = first + (int64_t)t * row;
                __m256 p[MAX_GROUP];
                for (int g = 0; g < group; g++)
                    p[g] = _mm256_broadcast_ss(&score[g][t]);
                for (int c = c0; c < c1; c++) {
                    const __m256 vc = kv8(values, vt + 8 * c, kv_type);
                    for (int g = 0; g < group; g++)
                        sum[g][c - c0] = _mm256_fmadd_ps(p[g], vc, sum[g][c - c0]);
                }
            }
            for (int g = 0; g < group; g++)
                for (int c = c0; c < c1; c++)
                    _mm256_storeu_ps(acc + g * (head_dim + 2) + 2 + 8 * c, sum[g][c - c0]);
        }
    }
    for (int g = 0; g < group; g++) {
        state[g * (head_dim + 2)] = best[g];
        state[g * (head_dim + 2) + 1] = total[g];
    }
}

ATTEND_BLOCKS_TABLE(attend_blocks8)

/* attention_avx512.c's finish16 on 8 lanes */
static void finish8(const float *restrict states, int parts, int group, int head_dim, float *restrict out)
{
    const int stride = group * (head_dim + 2);
    for (int g = 0; g < group; g++) {
        const float top = merge_top(states, parts, stride, g, head_dim);
        float total = 0.0f;
        for (int d = 0; d < head_dim; d++)
            out[g * head_dim + d] = 0.0f;
        if (top > -INFINITY) {
            for (int s = 0; s < parts; s++) {
                const float *st = states + s * stride + g * (head_dim + 2);
                if (st[0] == -INFINITY)
                    continue; /* a range with no position */
                const float weight = merge_weight(st, top, &total);
                for (int d = 0; d < head_dim; d += 8)
                    _mm256_storeu_ps(out + g * head_dim + d,
                                     _mm256_fmadd_ps(_mm256_set1_ps(weight), _mm256_loadu_ps(st + 2 + d),
                                                     _mm256_loadu_ps(out + g * head_dim + d)));
            }
        }
        const __m256 inv = _mm256_set1_ps(softmax_inverse(total));
        for (int d = 0; d < head_dim; d += 8)
            _mm256_storeu_ps(out + g * head_dim + d, _mm256_mul_ps(_mm256_loadu_ps(out + g * head_dim + d), inv));
    }
}

const struct chatd_attention_ops chatd_attention_avx2 = {8, ATTEND_BLOCKS_FOR_TYPES(attend_blocks8), finish8,
                                                      attend_pair};
