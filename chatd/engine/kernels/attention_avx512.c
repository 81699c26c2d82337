/* Decode attention's AVX-512 variant: the block walk 16 lanes at a time (attention.c shares the pairs out over the
 * threads; kernels_impl.h has the walk's bookkeeping). Compiled with AVX-512's flags (loader.py's SOURCES). */
#include "kernels_impl.h"
#define ATTENTION_SCALAR_INCLUDED /* its attend_pair, for the shapes the 16-lane walk does not take */
#include "attention_scalar.c"
#include "simd_avx512.h"

/* The 16 lanes' sums of 16 vectors: lane t of the result is the sum of v[t]'s lanes. A tree of pairwise
 * interleaves and adds: 45 instructions for the 16 sums, where a horizontal sum takes about 10 each. */
static inline __m512 sum16x16(const __m512 *v)
{
    __m512 a[8], b[4];
    for (int i = 0; i < 8; i++) /* 128-bit lane l: v[2i] l0 + l2, v[2i+1] l0 + l2, v[2i] l1 + l3, v[2i+1] l1 + l3 */
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* 128-bit lane l: that lane's part of the sums of v[4i..4i+3] */
        const __m512d lo = _mm512_castps_pd(a[2 * i]), hi = _mm512_castps_pd(a[2 * i + 1]);
        b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(lo, hi)), _mm512_castpd_ps(_mm512_unpackhi_pd(lo, hi)));
    }
    /* c: b0's 128-bit lanes 0+1 and 2+3, then b1's; d likewise of b2 and b3; then their lanes added pairwise */
    const __m512 c = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88), _mm512_shuffle_f32x4(b[0], b[1], 0xdd));
    const __m512 d = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88), _mm512_shuffle_f32x4(b[2], b[3], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x88), _mm512_shuffle_f32x4(c, d, 0xdd));
}

/* 16 K or V values from element `index` of an fp32, bf16 or int8 (kv_type) array, as fp32 (int8 unscaled). */
static inline __m512 kv16(const void *base, int64_t index, int kv_type)
{
    if (kv_type == KV_INT8)
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)base + index))));
    return kv_type == KV_BF16 ? load_bf16x16((const uint16_t *)base + index)
                              : _mm512_loadu_ps((const float *)base + index);
}

/* The walk over the blocks [first_block, end_block) of a sequence, 16 lanes at a time (head_dim a multiple of 16,
 * block_size <= 16: one vector of scores per query head and block). It leaves the running softmax's state per
 * query head (kernels_impl.h). */
static inline __attribute__((always_inline)) void
attend_blocks16(const float *restrict q, int64_t q_head_stride, const void *restrict keys,
                const void *restrict values, const int32_t *restrict table, int length, int first_block,
                int end_block, int group, int head_dim, int block_size, float scale, float *restrict state,
                const int kv_type)
{
    const int esize = kv_esize(kv_type), row = kv_row(kv_type, head_dim);
    float key_scale[16] __attribute__((aligned(64))), value_scale[16] __attribute__((aligned(64)));
    __m512 acc[MAX_GROUP][MAX_HEAD_DIM / 16];
    float score[MAX_GROUP][16] __attribute__((aligned(64)));
    __m512 dots[MAX_GROUP][16]; /* per query head, its 16 products with each key of the block */
    float best[MAX_GROUP], total[MAX_GROUP];
    const int chunks = head_dim / 16;
    for (int g = 0; g < group; g++) {
        best[g] = -INFINITY;
        total[g] = 0.0f;
        for (int c = 0; c < chunks; c++)
            acc[g][c] = _mm512_setzero_ps();
    }
    const int end = walk_end(length, end_block, block_size);
    for (int start = first_block * block_size, j = first_block; start < end; start += block_size, j++) {
        const int n = block_positions(length, start, block_size);
        const __mmask16 live = (__mmask16)((1u << n) - 1u);
        const int64_t first = walk_block(keys, values, table, j, start, end, block_size, row, esize);
        /* Each key is widened once for the group's query heads; each head's 16 products per key are summed
         * for the block's keys together (sum16x16), the unused lanes of a partial block over zeros. */
        for (int t = 0; t < n; t++) {
            const int64_t kt = first + (int64_t)t * row;
            __m512 key[MAX_HEAD_DIM / 16];
            for (int c = 0; c < chunks; c++)
                key[c] = kv16(keys, kt + 16 * c, kv_type);
            position_scales(keys, values, kt, head_dim, kv_type, &key_scale[t], &value_scale[t]);
            for (int g = 0; g < group; g++) {
                const float *qg = q + g * q_head_stride;
                __m512 dot = _mm512_mul_ps(_mm512_loadu_ps(qg), key[0]);
                for (int c = 1; c < chunks; c++)
                    dot = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * c), key[c], dot);
                dots[g][t] = dot;
            }
        }
        /* an int8 key's scale multiplies its score, an int8 value's its softmax weight (below) */
        const __m512 score_scale = kv_type == KV_INT8
                                       ? _mm512_mul_ps(_mm512_maskz_load_ps(live, key_scale), _mm512_set1_ps(scale))
                                       : _mm512_set1_ps(scale);
        for (int g = 0; g < group; g++) {
            for (int t = n; t < 16; t++)
                dots[g][t] = _mm512_setzero_ps();
            _mm512_store_ps(score[g], _mm512_mul_ps(sum16x16(dots[g]), score_scale));
        }
        for (int g = 0; g < group; g++) {
            const __m512 s = _mm512_maskz_load_ps(live, score[g]);
            const float top = softmax_top(best[g], _mm512_mask_reduce_max_ps(live, s));
            const float shrink = softmax_shrink(best[g], top);
            const __m512 p = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(s, _mm512_set1_ps(top))));
            _mm512_store_ps(score[g], kv_type == KV_INT8 ? _mm512_mul_ps(p, _mm512_maskz_load_ps(live, value_scale)) : p);
            softmax_add(&best[g], &total[g], top, shrink, _mm512_reduce_add_ps(p));
            const __m512 by = _mm512_set1_ps(shrink);
            for (int c = 0; c < chunks; c++)
                acc[g][c] = _mm512_mul_ps(acc[g][c], by);
        }
        for (int t = 0; t < n; t++) {
            const int64_t vt = first + (int64_t)t * row;
            for (int c = 0; c < chunks; c++) {
                const __m512 vc = kv16(values, vt + 16 * c, kv_type);
                for (int g = 0; g < group; g++)
                    acc[g][c] = _mm512_fmadd_ps(_mm512_set1_ps(score[g][t]), vc, acc[g][c]);
            }
        }
    }
    for (int g = 0; g < group; g++) {
        float *st = state + g * (head_dim + 2);
        st[0] = best[g];
        st[1] = total[g];
        for (int c = 0; c < chunks; c++)
            _mm512_storeu_ps(st + 2 + 16 * c, acc[g][c]);
    }
}

ATTEND_BLOCKS_TABLE(attend_blocks16)

/* The attention of query heads [g0, g0 + group) from the states of `parts` block ranges (consecutive,
 * head_dim + 2 floats per query head each, as attend_blocks16 leaves them): the running softmaxes merged
 * and divided. */
static void finish16(const float *restrict states, int parts, int group, int head_dim, float *restrict out)
{
    const int stride = group * (head_dim + 2), chunks = head_dim / 16;
    for (int g = 0; g < group; g++) {
        const float top = merge_top(states, parts, stride, g, head_dim);
        float total = 0.0f;
        __m512 acc[MAX_HEAD_DIM / 16];
        for (int c = 0; c < chunks; c++)
            acc[c] = _mm512_setzero_ps();
        if (top > -INFINITY) {
            for (int s = 0; s < parts; s++) {
                const float *st = states + s * stride + g * (head_dim + 2);
                if (st[0] == -INFINITY)
                    continue; /* a range with no position */
                const float weight = merge_weight(st, top, &total);
                for (int c = 0; c < chunks; c++)
                    acc[c] = _mm512_fmadd_ps(_mm512_set1_ps(weight), _mm512_loadu_ps(st + 2 + 16 * c), acc[c]);
            }
        }
        const __m512 inv = _mm512_set1_ps(softmax_inverse(total));
        for (int c = 0; c < chunks; c++)
            _mm512_storeu_ps(out + g * head_dim + 16 * c, _mm512_mul_ps(acc[c], inv));
    }
}

const struct chatd_attention_ops chatd_attention_avx512 = {16, ATTEND_BLOCKS_FOR_TYPES(attend_blocks16), finish16,
                                                      attend_pair};
