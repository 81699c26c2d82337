/* The inside of chatd's kernels library (chatd_kernels.h explains the files): the dispatch table, the limits, and
 * the ISA-independent pieces that every variant of an op family shares, so that the portable reference and the
 * AVX2 and AVX-512 files differ only in their vector loops. Nothing here is exported from the library.
 *
 * Helpers that vector files inline are plain C: the scalar bookkeeping around the vector loops (the block walk of
 * decode attention, the online softmax, the merge of split walks, the tile layouts, x's int8 rounding rule) and
 * whole portable steps that every variant runs alike (RoPE with the K/V write, whose int8 rows each variant
 * quantises its own way).
 */
#ifndef CHATD_KERNELS_IMPL_H
#define CHATD_KERNELS_IMPL_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "chatd_kernels.h"

#define CHATD_HIDDEN __attribute__((visibility("hidden")))
/* Arithmetic that must hold to the bit (the tests recompute it): compiled without -ffast-math's rewrites, and
 * UNFUSED also without contracting a product and a sum into one rounding, as torch's separate ops round. A helper
 * called from such a function carries the same attribute, or gcc would not inline it there. */
#define CHATD_EXACT __attribute__((optimize("no-fast-math")))
#define CHATD_EXACT_UNFUSED __attribute__((optimize("no-fast-math", "fp-contract=off")))

/* ---------------------------------------------------------------- limits of decode attention */

#define MAX_GROUP 16
#define MAX_HEAD_DIM 256
#define MAX_BLOCK 64

#define KV_F32 CHATD_KV_F32
#define KV_BF16 CHATD_KV_BF16
#define KV_INT8 CHATD_KV_INT8
#define KV_SCALE_BYTES CHATD_KV_SCALE_BYTES

/* ---------------------------------------------------------------- bf16 */

/* bf16 <-> fp32, round to nearest even, exactly as torch's .to(torch.bfloat16) rounds. */
static inline uint16_t to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x40u); /* NaN stays a (quiet) NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float from_bf16(uint16_t b)
{
    const uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* ---------------------------------------------------------------- the paged pool's K/V */

/* Bytes per stored element, and elements per stored position of one head (an int8 row carries its scale). */
static inline int kv_esize(int kv_type) { return kv_type == KV_F32 ? 4 : kv_type == KV_BF16 ? 2 : 1; }
static inline int kv_row(int kv_type, int head_dim) { return head_dim + (kv_type == KV_INT8 ? KV_SCALE_BYTES : 0); }

/* The scale of the int8 row starting at element `index`. */
static inline float row_scale(const void *base, int64_t index, int head_dim)
{
    float scale;
    memcpy(&scale, (const int8_t *)base + index + head_dim, sizeof scale);
    return scale;
}

/* Element `index` of a K or V array of fp32, bf16 or int8 (kv_type) values, as fp32 (an int8 value unscaled). */
static inline float kv_at(const void *base, int64_t index, int kv_type)
{
    return kv_type == KV_BF16  ? from_bf16(((const uint16_t *)base)[index])
           : kv_type == KV_INT8 ? (float)((const int8_t *)base)[index]
                                : ((const float *)base)[index];
}

/* Asks for the `bytes` of K and V at byte `offset` of the pool's K and V into the cache, a line at a time. */
static inline void prefetch_block(const void *keys, const void *values, int64_t offset, int bytes)
{
    for (int line = 0; line < bytes; line += 64) {
        __builtin_prefetch((const char *)keys + offset + line, 0, 3);
        __builtin_prefetch((const char *)values + offset + line, 0, 3);
    }
}

/* ---------------------------------------------------------------- the block walk of decode attention */

/* A sequence's positions are the slots of its block table, in order. A walk visits its blocks [first_block,
 * end_block) (all of them, or one range where a pair's blocks are split over the threads), block j starting at
 * position start = j * block_size. */

/* The position the walk stops at: its last block's end, or the sequence's length. */
static inline int walk_end(int length, int end_block, int block_size)
{
    return end_block * block_size < length ? end_block * block_size : length;
}

/* How many positions of the block starting at `start` the sequence holds (fewer in its last block). */
static inline int block_positions(int length, int start, int block_size)
{
    return length - start < block_size ? length - start : block_size;
}

/* The element index of block j's first position in the pool's K and V; the walk's next block, which sits
 * elsewhere in the pool, is asked into the cache meanwhile. */
static inline int64_t walk_block(const void *keys, const void *values, const int32_t *table, int j, int start, int end,
                                 int block_size, int row, int esize)
{
    if (start + block_size < end)
        prefetch_block(keys, values, (int64_t)table[j + 1] * block_size * row * esize, block_size * row * esize);
    return (int64_t)table[j] * block_size * row;
}

/* An int8 position's scales (its key's scales the key's score, its value's the softmax weight: once per
 * position, not per element); nothing for fp32 and bf16 pools. */
static inline void position_scales(const void *keys, const void *values, int64_t at, int head_dim, int kv_type,
                                   float *key_scale, float *value_scale)
{
    if (kv_type == KV_INT8) {
        *key_scale = row_scale(keys, at, head_dim);
        *value_scale = row_scale(values, at, head_dim);
    }
}

/* ---------------------------------------------------------------- the online softmax */

/* Per query head a walk keeps a running softmax: the largest score so far (best, -inf before the first block),
 * the sum of exp(score - best), and the values weighted by those, not yet divided. It leaves that state per query
 * head g at state + g * (head_dim + 2): best, the sum, then the head_dim weighted values. */

/* The largest score once a block whose largest is top_here is in. */
static inline float softmax_top(float best, float top_here) { return top_here > best ? top_here : best; }

/* The factor that rescales what was summed against best to the new largest, top: 0 on the first block. */
static inline float softmax_shrink(float best, float top) { return expf(best - top); }

/* The sum once a block's exponentials (taken against top, summing to block_sum) are in; top becomes best. */
static inline void softmax_add(float *best, float *total, float top, float shrink, float block_sum)
{
    *total = *total * shrink + block_sum;
    *best = top;
}

/* 1 / the sum: the last step's factor, 0 where no position was seen. */
static inline float softmax_inverse(float total) { return total > 0.0f ? 1.0f / total : 0.0f; }

/* The merge of split walks: `parts` states of query head g, state s at states + s * stride. The largest of their
 * bests; -inf where none saw a position. */
static inline float merge_top(const float *states, int parts, int stride, int g, int head_dim)
{
    float top = -INFINITY;
    for (int s = 0; s < parts; s++) {
        const float b = states[s * stride + g * (head_dim + 2)];
        top = b > top ? b : top;
    }
    return top;
}

/* A state's weight in the merge, its sum added into *total (the caller skips a range with no position: best
 * -inf). */
static inline float merge_weight(const float *st, float top, float *total)
{
    const float weight = expf(st[0] - top);
    *total += st[1] * weight;
    return weight;
}

/* The table of a block walk `walk` (an always-inline function of the vector files): the walk compiled once per
 * K/V storage type, and within each, common shapes (64-wide heads, groups of 1 to 4 query heads per KV head)
 * get copies of their own, in which the compiler unrolls the loops over heads and chunks and keeps every
 * accumulator in a register. ATTEND_BLOCKS_TABLE(walk) defines walk_KV_F32, walk_KV_BF16 and walk_KV_INT8. */
typedef void (*attend_blocks_fn)(const float *, int64_t, const void *, const void *, const int32_t *, int, int, int,
                                 int, int, int, float, float *);
#define ATTEND_SHAPE(walk, kv_type, g, d)                                                                           \
    walk(q, q_head_stride, keys, values, table, length, first_block, end_block, g, d, block_size, scale, state,     \
         kv_type)
#define ATTEND_FOR_TYPE(walk, kv_type)                                                                              \
    static void walk##_##kv_type(const float *q, int64_t q_head_stride, const void *keys, const void *values,       \
                                 const int32_t *table, int length, int first_block, int end_block, int group,       \
                                 int head_dim, int block_size, float scale, float *state)                           \
    {                                                                                                               \
        if (head_dim == 64 && group == 1) ATTEND_SHAPE(walk, kv_type, 1, 64);                                       \
        else if (head_dim == 64 && group == 2) ATTEND_SHAPE(walk, kv_type, 2, 64);                                  \
        else if (head_dim == 64 && group == 3) ATTEND_SHAPE(walk, kv_type, 3, 64);                                  \
        else if (head_dim == 64 && group == 4) ATTEND_SHAPE(walk, kv_type, 4, 64);                                  \
        else ATTEND_SHAPE(walk, kv_type, group, head_dim);                                                          \
    }
#define ATTEND_BLOCKS_TABLE(walk)                                                                                   \
    ATTEND_FOR_TYPE(walk, KV_F32)                                                                                   \
    ATTEND_FOR_TYPE(walk, KV_BF16)                                                                                  \
    ATTEND_FOR_TYPE(walk, KV_INT8)
#define ATTEND_BLOCKS_FOR_TYPES(walk) {walk##_KV_F32, walk##_KV_BF16, walk##_KV_INT8}

/* ---------------------------------------------------------------- element-wise pieces every variant shares */

/* x[0, n) as an int8 row: n values, then the fp32 scale (chatd_kernels.h's rule), one value at a time. The
 * vector variants take it for rows their lanes do not divide. */
static inline CHATD_EXACT_UNFUSED void quantize_row_portable(const float *x, int n, int8_t *out)
{
    float top = 0.0f;
    for (int d = 0; d < n; d++)
        top = fabsf(x[d]) > top ? fabsf(x[d]) : top;
    const float scale = top / 127.0f;
    for (int d = 0; d < n; d++)
        out[d] = scale > 0.0f ? (int8_t)rintf(x[d] / scale) : 0;
    memcpy(out + n, &scale, sizeof scale);
}

typedef void (*quantize_row_fn)(const float *x, int n, int8_t *out);

/* One row of chatd_rope_write: its Q and K heads rotated in place (c, s: the row's position in the cos / sin
 * tables), then its K and V heads written at `slot`. Products are rounded before they are added, as torch's
 * separate multiplications and addition do, and the int8 scale and values are divisions rounded as torch rounds
 * them, so the cache holds the same bits as on the torch path; each variant inlines this with its own int8 row
 * (`quantize`, a constant where it is called). */
static inline __attribute__((always_inline)) CHATD_EXACT_UNFUSED void
rope_row(float *row, const float *c, const float *s, void *keys, void *values, int64_t head_stride, int64_t slot,
         int num_heads, int num_kv_heads, int head_dim, int kv_type, quantize_row_fn quantize)
{
    const int half = head_dim / 2, rotated = num_heads + num_kv_heads, row_elements = kv_row(kv_type, head_dim);
    for (int h = 0; h < rotated; h++) {
        float *x = row + (int64_t)h * head_dim;
        for (int j = 0; j < half; j++) {
            const float a = x[j], b = x[j + half];
            const float a_cos = a * c[j], b_sin = b * s[j], b_cos = b * c[j + half], a_sin = a * s[j + half];
            x[j] = a_cos - b_sin;
            x[j + half] = b_cos + a_sin;
        }
    }
    const int64_t at = slot * row_elements;
    for (int h = 0; h < num_kv_heads; h++) {
        const float *k = row + (int64_t)(num_heads + h) * head_dim;
        const float *v = row + (int64_t)(rotated + h) * head_dim;
        const int64_t to = h * head_stride + at;
        if (kv_type == KV_INT8) {
            quantize(k, head_dim, (int8_t *)keys + to);
            quantize(v, head_dim, (int8_t *)values + to);
        } else if (kv_type == KV_BF16) {
            uint16_t *kd = (uint16_t *)keys + to, *vd = (uint16_t *)values + to;
            for (int d = 0; d < head_dim; d++) {
                kd[d] = to_bf16(k[d]);
                vd[d] = to_bf16(v[d]);
            }
        } else {
            float *kd = (float *)keys + to, *vd = (float *)values + to;
            for (int d = 0; d < head_dim; d++) {
                kd[d] = k[d];
                vd[d] = v[d];
            }
        }
    }
}

/* One value of chatd_silu_mul: bf16(silu(gate) * up). */
static inline uint16_t silu_mul_one(uint16_t gate, uint16_t up)
{
    const float x = from_bf16(gate);
    return to_bf16(x / (1.0f + expf(-x)) * from_bf16(up));
}

/* ---------------------------------------------------------------- the tile matmuls' layouts */

#define Q4_TILE_BYTES 320
#define Q8_TILE_BYTES 544

#define PREFETCH_AHEAD 4 /* tiles */
/* The vector kernels also ask for the tile PREFETCH_FAR tiles ahead into L2: a group's tiles are one stream
 * through memory, and 4 tiles (1.3 KB) ahead the request comes too late to cover the memory's latency once a step
 * of several rows works through the weights as fast as memory delivers them (docs/performance.md, "Weights
 * prefetched further ahead, and what bounds a step on this Zen 4"). */
#define PREFETCH_FAR 32 /* tiles */

static inline int tile_bytes_for(int q8) { return q8 ? Q8_TILE_BYTES : Q4_TILE_BYTES; }

/* The first tile of output group g (16 outputs) of a [n, k] weight: its k / 32 tiles run over the input blocks. */
static inline const uint8_t *group_tiles(const uint8_t *tiles, int g, int k, int q8)
{
    return tiles + (int64_t)g * (k / 32) * tile_bytes_for(q8);
}

/* A vector kernel's requests for the tiles ahead of `tile`: PREFETCH_AHEAD into L1, PREFETCH_FAR into L2. */
static inline void prefetch_tiles_ahead(const uint8_t *tile, int tile_bytes)
{
    for (int line = 0; line < tile_bytes; line += 64) {
        __builtin_prefetch(tile + PREFETCH_AHEAD * tile_bytes + line, 0, 3);
        __builtin_prefetch(tile + PREFETCH_FAR * tile_bytes + line, 0, 2);
    }
}

/* The vector kernels round x to int8 per block of 32 inputs, as llama.cpp does: a block's scale dx = max |x| / 127,
 * xq = round-half-even(x * (1 / dx)) (0 for a block of zeros), and dx * sum(xq), which a block's offset term
 * multiplies. Exact (the tests recompute these bits). */
static inline CHATD_EXACT float x_block_scale(float amax) { return amax / 127.0f; }
static inline CHATD_EXACT float x_block_inverse(float scale) { return scale > 0.0f ? 1.0f / scale : 0.0f; }

/* ---------------------------------------------------------------- the dispatch table */

/* Decode attention's variant: a vector walk over ranges of blocks, and the portable walk of whole pairs
 * (attention_scalar.c, compiled with the variant's flags) for the shapes the vector walk does not take (head_dim
 * not a multiple of `lanes`, blocks of more than 16 positions), and for every shape where lanes is 0. */
struct chatd_attention_ops {
    int lanes;
    attend_blocks_fn attend_blocks[3]; /* per kv_type: the walk over blocks [first_block, end_block), its state left */
    /* the attention of `group` query heads from the states of `parts` consecutive ranges: merged and divided */
    void (*finish)(const float *states, int parts, int group, int head_dim, float *out);
    /* one (sequence, KV head) pair walked whole, its attention written to out */
    void (*attend_pair)(const float *q, int64_t q_head_stride, float *out, const void *keys, const void *values,
                        const int32_t *table, int length, int group, int head_dim, int block_size, float scale,
                        int kv_type);
};

/* The element-wise steps' variant, one row at a time (elementwise.c shares the rows out over the threads). */
struct chatd_row_ops {
    void (*rope_row)(float *row, const float *c, const float *s, void *keys, void *values, int64_t head_stride,
                     int64_t slot, int num_heads, int num_kv_heads, int head_dim, int kv_type);
    void (*add_rms_norm_row)(float *x, const uint16_t *add, const float *weight, float eps, uint16_t *out,
                             int hidden);
    void (*silu_mul_row)(const uint16_t *gate, const uint16_t *up, uint16_t *out, int inter);
    void (*widen_bf16)(const uint16_t *x, float *out, int64_t n);
    void (*round_bf16)(const float *x, uint16_t *out, int64_t n);
};

/* A tile matmul kind. The vector kernels (and the scalar reference) quantise each row of x per block of 32, then
 * run each group of 16 outputs over all rows (matmul.c spreads both over the threads); AMX also has a kernel of its
 * own for calls of amx_min_rows rows or more, the vector kernel taking the weights' second layout below that. */
typedef void (*quantise_row_fn)(const uint16_t *row, int k, int8_t *xq, float *dx, float *dx_sum);
typedef void (*vector_group_fn)(const int8_t *xq, const float *dx, const float *dx_sum, int m, int k,
                                const uint8_t *tiles, int q8, int g, uint16_t *y, int n);
typedef int (*tile_matmul_fn)(const uint16_t *x, int m, int k, const uint8_t *tiles, int q8, int n, uint16_t *y,
                              int num_threads);
struct chatd_matmul_ops {
    int kind; /* CHATD_MATMUL_* */
    quantise_row_fn quantise;
    vector_group_fn group;
    tile_matmul_fn tiles; /* AMX's own kernel; NULL for the vector kernels */
};

/* The variants one caller runs (chatd_kernels_init fills it). */
struct chatd_kernels {
    int features; /* the CHATD_CPU_* bits it was filled from */
    int isa;      /* CHATD_ISA_* of `attention` and `rows` */
    const struct chatd_attention_ops *attention;
    const struct chatd_row_ops *rows;
    const struct chatd_matmul_ops *matmul; /* NULL: no tile matmul */
    int amx_min_rows;
};

/* The variants (each table in its family's file of that ISA). */
extern CHATD_HIDDEN const struct chatd_attention_ops chatd_attention_scalar, chatd_attention_avx2,
    chatd_attention_avx512;
extern CHATD_HIDDEN const struct chatd_row_ops chatd_rows_scalar, chatd_rows_avx2, chatd_rows_avx512;
extern CHATD_HIDDEN const struct chatd_matmul_ops chatd_matmul_scalar, chatd_matmul_avx2, chatd_matmul_vnni,
    chatd_matmul_amx;

/* Shared between files of the library. */
CHATD_HIDDEN void chatd_widen_bf16_rows(const struct chatd_kernels *kernels, const uint16_t *x, float *out, int rows,
                                        int64_t n, int num_threads);
CHATD_HIDDEN void chatd_round_bf16_rows(const struct chatd_kernels *kernels, const float *x, uint16_t *out, int rows,
                                        int64_t n, int num_threads);
CHATD_HIDDEN void chatd_quantise_row_vnni(const uint16_t *row, int k, int8_t *xq, float *dx, float *dx_sum);
CHATD_HIDDEN void chatd_vnni_group(const int8_t *xq, const float *dx, const float *dx_sum, int m, int k,
                                   const uint8_t *tiles, int q8, int g, uint16_t *y, int n);
CHATD_HIDDEN int chatd_amx_ready(void);

#endif
