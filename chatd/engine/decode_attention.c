/* Decode attention over chatd's paged KV pool, for the CPU: one query token per sequence, every sequence
 * of a step in one call (chatd/engine/native.py builds and loads this file).
 *
 * The pool of one layer holds K and V per KV head as a flat matrix of slots, [num_blocks * block_size,
 * head_dim] (chatd/engine/paged.py); a sequence's positions are the slots of its block table, in order.
 * For each (sequence, KV head) pair the kernel walks the sequence's blocks once, scoring the block's keys
 * against every query head of the group (grouped-query attention) while they are in cache, and keeps a
 * running softmax (max, sum, weighted sum of values) per query head, so K and V are each read once and
 * nothing is gathered or padded. Pairs are spread over the threads of the OpenMP runtime that torch itself
 * uses (the same libgomp is loaded once per process).
 *
 * fp32 in, fp32 out, fp32 accumulation.
 */
#include <math.h>
#include <stdint.h>

#define MAX_GROUP 16
#define MAX_HEAD_DIM 256
#define MAX_BLOCK 64

int chatd_decode_attention_limits(int group, int head_dim, int block_size)
{
    return group >= 1 && group <= MAX_GROUP && head_dim >= 1 && head_dim <= MAX_HEAD_DIM && block_size >= 1 &&
           block_size <= MAX_BLOCK;
}

static void attend_pair(const float *restrict q, int64_t q_head_stride, float *restrict out,
                        const float *restrict keys, const float *restrict values, const int32_t *restrict table,
                        int length, int group, int head_dim, int block_size, float scale)
{
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
        const int n = length - start < block_size ? length - start : block_size;
        const int64_t first = (int64_t)table[j] * block_size * head_dim;
        const float *k = keys + first, *v = values + first;
        for (int t = 0; t < n; t++) {
            const float *kt = k + (int64_t)t * head_dim;
            for (int g = 0; g < group; g++) {
                const float *qg = q + g * q_head_stride;
                float dot = 0.0f;
                for (int d = 0; d < head_dim; d++)
                    dot += qg[d] * kt[d];
                score[g][t] = dot * scale;
            }
        }
        for (int g = 0; g < group; g++) {
            float top = best[g];
            for (int t = 0; t < n; t++)
                top = score[g][t] > top ? score[g][t] : top;
            const float shrink = expf(best[g] - top); /* 0 on the first block (best = -inf) */
            float sum = 0.0f;
            for (int t = 0; t < n; t++) {
                score[g][t] = expf(score[g][t] - top);
                sum += score[g][t];
            }
            total[g] = total[g] * shrink + sum;
            best[g] = top;
            for (int d = 0; d < head_dim; d++)
                acc[g][d] *= shrink;
        }
        for (int t = 0; t < n; t++) {
            const float *vt = v + (int64_t)t * head_dim;
            for (int g = 0; g < group; g++) {
                const float p = score[g][t];
                for (int d = 0; d < head_dim; d++)
                    acc[g][d] += p * vt[d];
            }
        }
    }
    for (int g = 0; g < group; g++) {
        const float inv = total[g] > 0.0f ? 1.0f / total[g] : 0.0f;
        for (int d = 0; d < head_dim; d++)
            out[g * head_dim + d] = acc[g][d] * inv;
    }
}

/* q: query rows, [.., num_heads, head_dim] with row stride q_row_stride (elements); row r of the call is
 *    q_rows[r]. out: [.., num_heads * head_dim] contiguous rows; row r written at out_rows[r] (may equal q_rows).
 * keys, values: this layer's K and V of KV head 0; head h starts head_stride elements further.
 * tables: [rows, table_stride] block ids; lengths: [rows] positions each row attends (its cache, new token
 * included). */
void chatd_decode_attention(const float *q, int64_t q_row_stride, const int32_t *q_rows, float *out,
                            const int32_t *out_rows, const float *keys, const float *values, int64_t head_stride,
                            const int32_t *tables, int64_t table_stride, const int32_t *lengths, int rows,
                            int num_heads, int num_kv_heads, int head_dim, int block_size, float scale,
                            int num_threads)
{
    const int group = num_heads / num_kv_heads;
    const int pairs = rows * num_kv_heads;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (pairs > 1)
    for (int pair = 0; pair < pairs; pair++) {
        const int r = pair / num_kv_heads, h = pair % num_kv_heads;
        const float *qr = q + (int64_t)q_rows[r] * q_row_stride + (int64_t)h * group * head_dim;
        float *o = out + (int64_t)out_rows[r] * num_heads * head_dim + (int64_t)h * group * head_dim;
        attend_pair(qr, head_dim, o, keys + h * head_stride, values + h * head_stride,
                    tables + (int64_t)r * table_stride, lengths[r], group, head_dim, block_size, scale);
    }
}
