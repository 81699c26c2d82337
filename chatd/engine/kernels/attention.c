/* Decode attention over the paged KV pool, one query token per sequence, every sequence of a step in one call:
 * the ISA-independent part. The walks over a sequence's blocks are the variants' (attention_avx512.c,
 * attention_avx2.c, and attention_scalar.c, the portable reference); this file shares the work out over the
 * threads, splits a long sequence's blocks into ranges and merges their results.
 *
 * The pool of one layer holds K and V per KV head as a flat matrix of slots, [num_blocks * block_size,
 * head_dim] (chatd/engine/pool/paged.py); a sequence's positions are the slots of its block table, in order.
 * For each (sequence, KV head) pair a walk goes over the sequence's blocks once, scoring the block's keys against
 * every query head of the group (grouped-query attention) while they are in cache, and keeps a running softmax
 * (max, sum, weighted sum of values) per query head, so K and V are each read once and nothing is gathered or
 * padded. Pairs are spread over the threads of the OpenMP runtime that torch itself uses (the same libgomp is
 * loaded once per process): in runs of consecutive pairs for short sequences, as the threads come for them for
 * long ones, split into ranges of blocks where there are few.
 *
 * fp32 queries and output, fp32 accumulation. The pool holds K/V as fp32, bf16 or int8 rows (kv_type,
 * chatd_kernels.h), read as fp32; a walk applies an int8 key's scale to its score and an int8 value's scale to
 * its softmax weight, once per position rather than per element.
 */
#include <stdlib.h>

#include "kernels_impl.h"

#ifdef _OPENMP
#include <omp.h>
#else
static inline int omp_get_thread_num(void) { return 0; }
static inline int omp_get_num_threads(void) { return 1; }
#endif

#define SPLIT_MIN_BLOCKS 8 /* a pair's blocks are split for the threads only into ranges this long or more */
/* A call whose longest sequence has at most this many blocks gives each thread a run of consecutive (row, KV
 * head) pairs (consecutive_pairs, below), so that a thread reads the lines it has just written; longer ones hand
 * out pairs as the threads come for them, which keeps the threads level when one slows down, where that costs
 * more than the lines save. A thread also asks for the first block of its run's next pair ahead (a walk asks
 * for each next block of its own pair). docs/performance.md, "Whose cache a line is in, and an engine thread
 * that waited for the event loop". */
#define CONSECUTIVE_MAX_BLOCKS 32

int chatd_decode_attention_limits(int group, int head_dim, int block_size)
{
    return group >= 1 && group <= MAX_GROUP && head_dim >= 1 && head_dim <= MAX_HEAD_DIM && block_size >= 1 &&
           block_size <= MAX_BLOCK;
}

/* Where there are fewer pairs than twice the threads (one session's step), a long pair is split so that every
 * thread has work; otherwise, and for contexts under SPLIT_MIN_BLOCKS blocks, 1 (each pair whole). The call's
 * items, pairs times ranges, run on the threads whenever there are two or more (docs/performance.md, "Short
 * contexts ran decode attention on one thread"). */
int chatd_decode_attention_parts(int pairs, int blocks, int num_threads)
{
    int parts = pairs < 2 * num_threads ? (2 * num_threads + pairs - 1) / pairs : 1;
    parts = parts < blocks / SPLIT_MIN_BLOCKS ? parts : blocks / SPLIT_MIN_BLOCKS;
    return parts > 1 ? parts : 1;
}

/* The (row, KV head) pairs [*first, *end) that thread `thread` of `threads` attends: consecutive pairs, the
 * call's blocks shared out evenly (a pair weighs its row's blocks, plus one for its fixed costs). A thread then
 * attends the rows whose queries and new K/V it has just written itself (chatd_rope_write gives each thread
 * consecutive rows) and writes the outputs it will round (chatd_round_bf16_rows, likewise), where pairs taken
 * as they come read and write many lines that the other core holds. */
static void consecutive_pairs(const int32_t *lengths, int rows, int num_kv_heads, int block_size, int thread,
                              int threads, int *first, int *end)
{
    int64_t total = 0;
    for (int r = 0; r < rows; r++)
        total += (int64_t)num_kv_heads * ((lengths[r] + block_size - 1) / block_size + 1);
    int64_t before = 0;
    *first = *end = rows * num_kv_heads;
    for (int pair = 0, found = 0; pair < rows * num_kv_heads; pair++) {
        const int64_t share = before * threads / total; /* the thread whose share the pair starts in */
        if (!found && share >= thread) {
            *first = pair;
            found = 1;
        }
        if (share > thread) {
            *end = pair;
            return;
        }
        before += (lengths[pair / num_kv_heads] + block_size - 1) / block_size + 1;
    }
}

void chatd_decode_attention(const struct chatd_kernels *kernels, const float *q, int64_t q_row_stride,
                            const int32_t *row_index, float *out, const void *keys, const void *values,
                            int64_t head_stride, const int32_t *tables, int64_t table_stride, const int32_t *lengths,
                            int rows, int num_heads, int num_kv_heads, int head_dim, int block_size, float scale,
                            int num_threads, int kv_type)
{
    const struct chatd_attention_ops *ops = kernels->attention;
    const int esize = kv_esize(kv_type);
    const int group = num_heads / num_kv_heads;
    const int pairs = rows * num_kv_heads;
    if (ops->lanes > 0 && head_dim % ops->lanes == 0 && block_size <= 16) {
        const attend_blocks_fn attend_blocks = ops->attend_blocks[kv_type];
        /* Fewer (row, KV head) pairs than twice the threads (one session's decode step): each pair's blocks
         * are split into ranges that run in parallel, then merged, so every thread has work. */
        int longest = 0;
        for (int r = 0; r < rows; r++)
            longest = lengths[r] > longest ? lengths[r] : longest;
        const int blocks = (longest + block_size - 1) / block_size;
        const int parts = chatd_decode_attention_parts(pairs, blocks, num_threads);
        const int state_size = group * (head_dim + 2);
        float *states = parts > 1 ? malloc(sizeof(float) * (size_t)pairs * parts * state_size) : NULL;
        const int per = parts > 1 ? (blocks + parts - 1) / parts : blocks;
        const int items = pairs * (states != NULL ? parts : 1);
        int next = 0; /* the next item to take, where they are taken as they come */
#pragma omp parallel num_threads(num_threads) if (items > 1)
        {
            /* ranges of split pairs and the pairs of long sequences as the threads come for them, the pairs of
             * short ones in a run of consecutive pairs per thread */
            int item = 0, end = items;
            const int dynamic = states != NULL || blocks > CONSECUTIVE_MAX_BLOCKS;
            if (!dynamic)
                consecutive_pairs(lengths, rows, num_kv_heads, block_size, omp_get_thread_num(), omp_get_num_threads(),
                                  &item, &end);
            for (;;) {
                if (dynamic) {
#pragma omp atomic capture
                    item = next++;
                    if (item >= items)
                        break;
                } else if (item >= end) {
                    break;
                }
                const int pair = states != NULL ? item / parts : item, part = states != NULL ? item % parts : 0;
                const int r = pair / num_kv_heads, h = pair % num_kv_heads;
                const float *qr = q + (int64_t)row_index[r] * q_row_stride + (int64_t)h * group * head_dim;
                const int first = states != NULL ? part * per : 0, stop = states != NULL ? first + per : blocks;
                float local[MAX_GROUP * (MAX_HEAD_DIM + 2)];
                float *state = states != NULL ? states + (int64_t)item * state_size : local;
                if (!dynamic && item + 1 < end) { /* the run's next pair: its first block, as this one's next ones */
                    const int r1 = (item + 1) / num_kv_heads, h1 = (item + 1) % num_kv_heads;
                    const int bytes = block_size * kv_row(kv_type, head_dim) * esize;
                    prefetch_block((const char *)keys + h1 * head_stride * esize,
                                   (const char *)values + h1 * head_stride * esize,
                                   (int64_t)tables[(int64_t)r1 * table_stride] * bytes, bytes);
                }
                attend_blocks(qr, head_dim, (const char *)keys + h * head_stride * esize,
                              (const char *)values + h * head_stride * esize, tables + (int64_t)r * table_stride,
                              lengths[r], first, stop, group, head_dim, block_size, scale, state);
                if (states == NULL)
                    ops->finish(state, 1, group, head_dim,
                                out + (int64_t)row_index[r] * num_heads * head_dim + (int64_t)h * group * head_dim);
                if (!dynamic)
                    item++;
            }
        }
        if (states != NULL) {
            for (int pair = 0; pair < pairs; pair++) {
                const int r = pair / num_kv_heads, h = pair % num_kv_heads;
                ops->finish(states + (int64_t)pair * parts * state_size, parts, group, head_dim,
                            out + (int64_t)row_index[r] * num_heads * head_dim + (int64_t)h * group * head_dim);
            }
            free(states);
        }
        return;
    }
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (pairs > 1)
    for (int pair = 0; pair < pairs; pair++) {
        const int r = pair / num_kv_heads, h = pair % num_kv_heads;
        const float *qr = q + (int64_t)row_index[r] * q_row_stride + (int64_t)h * group * head_dim;
        float *o = out + (int64_t)row_index[r] * num_heads * head_dim + (int64_t)h * group * head_dim;
        ops->attend_pair(qr, head_dim, o, (const char *)keys + h * head_stride * esize,
                         (const char *)values + h * head_stride * esize, tables + (int64_t)r * table_stride,
                         lengths[r], group, head_dim, block_size, scale, kv_type);
    }
}
