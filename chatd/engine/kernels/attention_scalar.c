/* Decode attention's portable reference: one (sequence, KV head) pair walked whole, one value at a time, plain C.
 * The same walk as the vector variants' (kernels_impl.h's block walk and online softmax), with the running
 * softmax's values accumulated in arrays instead of registers. Compiled on its own it is the scalar variant (CPUs
 * without AVX2, other architectures); attention_avx2.c and attention_avx512.c #include it
 * (ATTENTION_SCALAR_INCLUDED) and compile it with their flags for the shapes their vector walks do not take. */
#include "kernels_impl.h"

static void attend_pair(const float *restrict q, int64_t q_head_stride, float *restrict out, const void *restrict keys,
                        const void *restrict values, const int32_t *restrict table, int length, int group,
                        int head_dim, int block_size, float scale, int kv_type)
{
    const int row = kv_row(kv_type, head_dim);
    float acc[MAX_GROUP][MAX_HEAD_DIM];
    float score[MAX_GROUP][MAX_BLOCK];
    float best[MAX_GROUP], total[MAX_GROUP];
    for (int g = 0; g < group; g++) {
        best[g] = -INFINITY;
        total[g] = 0.0f;
        for (int d = 0; d < head_dim; d++)
            acc[g][d] = 0.0f;
    }
    for (int start = 0, j = 0; start < length; start += block_size, j++) {
        const int n = block_positions(length, start, block_size);
        const int64_t first = (int64_t)table[j] * block_size * row;
        for (int t = 0; t < n; t++) {
            const int64_t kt = first + (int64_t)t * row;
            const float key_scale = kv_type == KV_INT8 ? row_scale(keys, kt, head_dim) * scale : scale;
            for (int g = 0; g < group; g++) {
                const float *qg = q + g * q_head_stride;
                float dot = 0.0f;
                for (int d = 0; d < head_dim; d++)
                    dot += qg[d] * kv_at(keys, kt + d, kv_type);
                score[g][t] = dot * key_scale;
            }
        }
        for (int g = 0; g < group; g++) {
            float top = best[g];
            for (int t = 0; t < n; t++)
                top = softmax_top(top, score[g][t]);
            const float shrink = softmax_shrink(best[g], top);
            float sum = 0.0f;
            for (int t = 0; t < n; t++) {
                score[g][t] = expf(score[g][t] - top);
                sum += score[g][t];
            }
            softmax_add(&best[g], &total[g], top, shrink, sum);
            for (int d = 0; d < head_dim; d++)
                acc[g][d] *= shrink;
        }
        for (int t = 0; t < n; t++) {
            const int64_t vt = first + (int64_t)t * row;
            const float value_scale = kv_type == KV_INT8 ? row_scale(values, vt, head_dim) : 1.0f;
            for (int g = 0; g < group; g++) {
                const float p = score[g][t] * value_scale;
                for (int d = 0; d < head_dim; d++)
                    acc[g][d] += p * kv_at(values, vt + d, kv_type);
            }
        }
    }
    for (int g = 0; g < group; g++) {
        const float inv = softmax_inverse(total[g]);
        for (int d = 0; d < head_dim; d++)
            out[g * head_dim + d] = acc[g][d] * inv;
    }
}

#ifndef ATTENTION_SCALAR_INCLUDED
/* No block walk: every shape runs attend_pair. */
const struct chatd_attention_ops chatd_attention_scalar = {0, {NULL, NULL, NULL}, NULL, attend_pair};
#endif
