/* chatd's native CPU kernels for one layer of a forward step (chatd/engine/kernels/loader.py builds and loads
 * this file): RoPE with the K/V write into the paged pool (chatd_rope_write, at the end), and decode
 * attention over the pool, one query token per sequence, every sequence of a step in one call.
 *
 * The pool of one layer holds K and V per KV head as a flat matrix of slots, [num_blocks * block_size,
 * head_dim] (chatd/engine/pool/paged.py); a sequence's positions are the slots of its block table, in order.
 * For each (sequence, KV head) pair the kernel walks the sequence's blocks once, scoring the block's keys
 * against every query head of the group (grouped-query attention) while they are in cache, and keeps a
 * running softmax (max, sum, weighted sum of values) per query head, so K and V are each read once and
 * nothing is gathered or padded. Pairs are spread over the threads of the OpenMP runtime that torch itself
 * uses (the same libgomp is loaded once per process): in runs of consecutive pairs for short sequences, as
 * the threads come for them for long ones, split into ranges of blocks where there are few.
 *
 * fp32 queries and output, fp32 accumulation. The pool holds K/V as fp32, bf16 or int8 (kv_type, below), read
 * as fp32. An int8 position of a head is a row of head_dim int8 values followed by its fp32 scale (4 bytes,
 * native byte order): value d is q[d] * scale, where scale = max|x| / 127 and q[d] = round-to-even(x[d] / scale)
 * (0 where the row is all zeros). The kernel applies a key's scale to its score and a value's scale to its
 * softmax weight, once per position rather than per element.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#else
static inline int omp_get_thread_num(void) { return 0; }
static inline int omp_get_num_threads(void) { return 1; }
#endif

#define MAX_GROUP 16
#define MAX_HEAD_DIM 256
#define MAX_BLOCK 64
#define SPLIT_MIN_BLOCKS 8 /* a pair's blocks are split for the threads only into ranges this long or more */
/* Steps of this many rows or more run RoPE with the K/V write, the residual add with RMSNorm, and the bf16
 * conversions around attention (chatd/engine/kernels/step.c) on the threads, each thread on its own rows. Below it the
 * fork and join cost more than they save. Per-step A/B on this 2-core Zen 4 (the two versions alternating
 * step by step, 400-500 steps each, 64-token contexts), step time on the threads vs on one: 2 rows +1.8 %,
 * 4 rows +1.9 %, 6 rows -1.0 %, 8 rows -0.6 % and -2.0 %, 12 rows -3.1 %, 16 rows -1.8 % and -2.3 % (8
 * rows gained only once the weights were prefetched further ahead, tile_matmul.c). */
#define PARALLEL_ROWS 8
/* A decode call whose longest sequence has at most this many blocks gives each thread a run of consecutive
 * (row, KV head) pairs (consecutive_pairs, below); longer ones hand out pairs as the threads come for them,
 * which keeps the threads level when one slows down. Per-step A/B on the 2-core Zen 4, the runs vs pairs as
 * they come, all sequences of equal length: 64 positions (4 blocks) 8 rows -2.5 %, 16 rows -3.8 %; 128
 * positions 8 rows +0.6 %, 16 rows -3.3 %; 512 positions 8 rows -2.3 %; 1,024 positions 8 rows +1.4 %, 16 rows
 * +0.1 %. One row of 2,048 positions among 15 of 64: -0.4 % (the runs share out blocks, not pairs). A thread
 * also prefetches the first block of its run's next pair (the walk prefetches each next block of a pair):
 * 64 positions, 8 rows -1.5 % and -0.9 %, 16 rows -1.2 % and -1.5 % (the first blocks of the next two pairs
 * did as well, all blocks of the next pair nothing). */
#define CONSECUTIVE_MAX_BLOCKS 32

/* kv_type: how the pool stores K and V */
#define KV_F32 0
#define KV_BF16 1
#define KV_INT8 2
#define KV_SCALE_BYTES 4 /* an int8 row's trailing fp32 scale */

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

/* bf16 <-> fp32, round to nearest even, exactly as torch's .to(torch.bfloat16) rounds (also used by the
 * element-wise kernels at the end). */
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

#if defined(__AVX512F__)
#include <immintrin.h>
/* 16 bf16 values to fp32, and 16 fp32 values to bf16 rounded as to_bf16 rounds (to nearest even, NaN kept
 * quiet; denormals kept, unlike the hardware conversion instruction). */
static inline __m512 load_bf16x16(const uint16_t *src)
{
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)src)), 16));
}

static inline __m512 maskz_load_bf16x16(__mmask16 m, const uint16_t *src)
{
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, src)), 16));
}

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
#endif

/* Element `index` of a K or V array of fp32, bf16 or int8 (kv_type) values, as fp32 (an int8 value unscaled). */
static inline float kv_at(const void *base, int64_t index, int kv_type)
{
    return kv_type == KV_BF16  ? from_bf16(((const uint16_t *)base)[index])
           : kv_type == KV_INT8 ? (float)((const int8_t *)base)[index]
                                : ((const float *)base)[index];
}

int chatd_decode_attention_limits(int group, int head_dim, int block_size)
{
    return group >= 1 && group <= MAX_GROUP && head_dim >= 1 && head_dim <= MAX_HEAD_DIM && block_size >= 1 &&
           block_size <= MAX_BLOCK;
}

/* Asks for the `bytes` of K and V at byte `offset` of the pool's K and V into the cache, a line at a time. */
static inline void prefetch_block(const void *keys, const void *values, int64_t offset, int bytes)
{
    for (int line = 0; line < bytes; line += 64) {
        __builtin_prefetch((const char *)keys + offset + line, 0, 3);
        __builtin_prefetch((const char *)values + offset + line, 0, 3);
    }
}

/* The table attend_blocks_for[kv_type] of a block walk `walk` (attend_blocks16 or attend_blocks8, below, one per
 * vector width): the walk compiled once per K/V storage type, and within each, common shapes (64-wide heads,
 * groups of 1 to 4 query heads per KV head) get copies of their own, in which the compiler unrolls the loops over
 * heads and chunks and keeps every accumulator in a register. */
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
    ATTEND_FOR_TYPE(walk, KV_INT8)                                                                                  \
    static const attend_blocks_fn attend_blocks_for[3] = {walk##_KV_F32, walk##_KV_BF16, walk##_KV_INT8};

#if defined(__AVX512F__)
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

/* The same walk as attend_pair below, 16 lanes at a time (head_dim a multiple of 16, block_size <= 16: one
 * vector of scores per query head and block), over the blocks [first_block, end_block) of the sequence.
 * It leaves the running softmax's state per query head g in state + g * (head_dim + 2): the largest
 * score, the sum of exp(score - largest), and the values weighted by those, not yet divided. */
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
    const int end = end_block * block_size < length ? end_block * block_size : length;
    for (int start = first_block * block_size, j = first_block; start < end; start += block_size, j++) {
        const int n = length - start < block_size ? length - start : block_size;
        const __mmask16 live = (__mmask16)((1u << n) - 1u);
        const int64_t first = (int64_t)table[j] * block_size * row;
        if (start + block_size < end) /* the next block's K and V: another place in the pool */
            prefetch_block(keys, values, (int64_t)table[j + 1] * block_size * row * esize, block_size * row * esize);
        /* Each key is widened once for the group's query heads; each head's 16 products per key are summed
         * for the block's keys together (sum16x16), the unused lanes of a partial block over zeros. */
        for (int t = 0; t < n; t++) {
            const int64_t kt = first + (int64_t)t * row;
            __m512 key[MAX_HEAD_DIM / 16];
            for (int c = 0; c < chunks; c++)
                key[c] = kv16(keys, kt + 16 * c, kv_type);
            if (kv_type == KV_INT8) {
                key_scale[t] = row_scale(keys, kt, head_dim);
                value_scale[t] = row_scale(values, kt, head_dim);
            }
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
            const float top_here = _mm512_mask_reduce_max_ps(live, s);
            const float top = top_here > best[g] ? top_here : best[g];
            const float shrink = expf(best[g] - top); /* 0 on the first block (best = -inf) */
            const __m512 p = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(s, _mm512_set1_ps(top))));
            _mm512_store_ps(score[g], kv_type == KV_INT8 ? _mm512_mul_ps(p, _mm512_maskz_load_ps(live, value_scale)) : p);
            total[g] = total[g] * shrink + _mm512_reduce_add_ps(p);
            best[g] = top;
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
        float top = -INFINITY;
        for (int s = 0; s < parts; s++) {
            const float b = states[s * stride + g * (head_dim + 2)];
            top = b > top ? b : top;
        }
        float total = 0.0f;
        __m512 acc[MAX_HEAD_DIM / 16];
        for (int c = 0; c < chunks; c++)
            acc[c] = _mm512_setzero_ps();
        if (top > -INFINITY) {
            for (int s = 0; s < parts; s++) {
                const float *st = states + s * stride + g * (head_dim + 2);
                if (st[0] == -INFINITY)
                    continue; /* a range with no position */
                const float weight = expf(st[0] - top);
                total += st[1] * weight;
                for (int c = 0; c < chunks; c++)
                    acc[c] = _mm512_fmadd_ps(_mm512_set1_ps(weight), _mm512_loadu_ps(st + 2 + 16 * c), acc[c]);
            }
        }
        const __m512 inv = _mm512_set1_ps(total > 0.0f ? 1.0f / total : 0.0f);
        for (int c = 0; c < chunks; c++)
            _mm512_storeu_ps(out + g * head_dim + 16 * c, _mm512_mul_ps(acc[c], inv));
    }
}
#define VECTOR_LANES 16
#define finish_states finish16

#elif defined(__AVX2__) && defined(__FMA__)
/* The same walk on 8-lane vectors, for CPUs with AVX2 but not AVX512 (AMD Zen 2 and Zen 3, Intel before Ice
 * Lake): a block's 16 keys are scored as two vectors of 8, and the values are added in two passes of half the
 * head's chunks, so that the group's accumulators of a pass stay in the 16 registers there are. */
#include <immintrin.h>

/* e^x for 8 lanes, as exp16; x is held to [-87.3, 88.3] (so 2^n stays a normal float): a lane below gives
 * about 1e-38 instead of a denormal or 0. */
static inline __m256 exp8(__m256 x)
{
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3f)), _mm256_set1_ps(-87.3f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}

/* The 8 lanes' sums of 8 vectors: lane t of the result is the sum of v[t]'s lanes. */
static inline __m256 sum8x8(const __m256 *v)
{
    const __m256 a0 = _mm256_hadd_ps(v[0], v[1]), a1 = _mm256_hadd_ps(v[2], v[3]);
    const __m256 a2 = _mm256_hadd_ps(v[4], v[5]), a3 = _mm256_hadd_ps(v[6], v[7]);
    /* 128-bit lane l of b0: v0..v3's sums over their lane l; of b1: v4..v7's */
    const __m256 b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3);
    return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}

static inline float hmax8(__m256 v)
{
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}

static inline float hsum8(__m256 v)
{
    __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_add_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_add_ss(m, _mm_shuffle_ps(m, m, 1)));
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

/* attend_blocks16 on 8 lanes (head_dim a multiple of 8, block_size <= 16); the same state left per query head. */
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
    const int end = end_block * block_size < length ? end_block * block_size : length;
    for (int start = first_block * block_size, j = first_block; start < end; start += block_size, j++) {
        const int n = length - start < block_size ? length - start : block_size;
        const int64_t first = (int64_t)table[j] * block_size * row;
        if (start + block_size < end) /* the next block's K and V: another place in the pool */
            prefetch_block(keys, values, (int64_t)table[j + 1] * block_size * row * esize, block_size * row * esize);
        for (int t = 0; t < n; t++) {
            const int64_t kt = first + (int64_t)t * row;
            __m256 key[MAX_HEAD_DIM / 8];
            for (int c = 0; c < chunks; c++)
                key[c] = kv8(keys, kt + 8 * c, kv_type);
            if (kv_type == KV_INT8) {
                key_scale[t] = row_scale(keys, kt, head_dim);
                value_scale[t] = row_scale(values, kt, head_dim);
            }
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
            const float top_here = hmax8(_mm256_max_ps(s0, s1));
            const float top = top_here > best[g] ? top_here : best[g];
            const float shrink = expf(best[g] - top); /* 0 on the first block (best = -inf) */
            const __m256 by = _mm256_set1_ps(top);
            const __m256 p0 = _mm256_and_ps(exp8(_mm256_sub_ps(s0, by)), live0);
            const __m256 p1 = n > 8 ? _mm256_and_ps(exp8(_mm256_sub_ps(s1, by)), live1) : _mm256_setzero_ps();
            total[g] = total[g] * shrink + hsum8(_mm256_add_ps(p0, p1));
            best[g] = top;
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

/* finish16 on 8 lanes */
static void finish8(const float *restrict states, int parts, int group, int head_dim, float *restrict out)
{
    const int stride = group * (head_dim + 2);
    for (int g = 0; g < group; g++) {
        float top = -INFINITY;
        for (int s = 0; s < parts; s++) {
            const float b = states[s * stride + g * (head_dim + 2)];
            top = b > top ? b : top;
        }
        float total = 0.0f;
        for (int d = 0; d < head_dim; d++)
            out[g * head_dim + d] = 0.0f;
        if (top > -INFINITY) {
            for (int s = 0; s < parts; s++) {
                const float *st = states + s * stride + g * (head_dim + 2);
                if (st[0] == -INFINITY)
                    continue; /* a range with no position */
                const float weight = expf(st[0] - top);
                total += st[1] * weight;
                for (int d = 0; d < head_dim; d += 8)
                    _mm256_storeu_ps(out + g * head_dim + d,
                                     _mm256_fmadd_ps(_mm256_set1_ps(weight), _mm256_loadu_ps(st + 2 + d),
                                                     _mm256_loadu_ps(out + g * head_dim + d)));
            }
        }
        const __m256 inv = _mm256_set1_ps(total > 0.0f ? 1.0f / total : 0.0f);
        for (int d = 0; d < head_dim; d += 8)
            _mm256_storeu_ps(out + g * head_dim + d, _mm256_mul_ps(_mm256_loadu_ps(out + g * head_dim + d), inv));
    }
}
#define VECTOR_LANES 8
#define finish_states finish8
#endif

static void attend_pair(const float *restrict q, int64_t q_head_stride, float *restrict out,
                        const void *restrict keys, const void *restrict values, const int32_t *restrict table,
                        int length, int group, int head_dim, int block_size, float scale, int kv_type)
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
        const int n = length - start < block_size ? length - start : block_size;
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
        const float inv = total[g] > 0.0f ? 1.0f / total[g] : 0.0f;
        for (int d = 0; d < head_dim; d++)
            out[g * head_dim + d] = acc[g][d] * inv;
    }
}

/* Into how many ranges of blocks the decode kernel splits each (row, KV head) pair of a call: `pairs` pairs
 * whose longest sequence has `blocks` blocks, on `num_threads` threads. Where there are fewer pairs than twice
 * the threads (one session's step), a long pair is split so that every thread has work; otherwise, and for
 * contexts under SPLIT_MIN_BLOCKS blocks, 1 (each pair whole). The call's items, pairs times ranges, run on
 * the threads whenever there are two or more. */
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

/* q: query rows, [.., num_heads, head_dim] with row stride q_row_stride (elements); row r of the call is
 *    row_index[r]. out: [.., num_heads * head_dim] contiguous rows; the call's row r goes to out row row_index[r].
 * keys, values: this layer's K and V of KV head 0, fp32, bf16 or int8 rows (kv_type); head h starts head_stride
 * elements further (a slot's position starts at slot * (head_dim, plus the scale's 4 for int8)).
 * tables: [rows, table_stride] block ids; lengths: [rows] positions each row attends (its cache, new token
 * included). */
void chatd_decode_attention(const float *q, int64_t q_row_stride, const int32_t *row_index, float *out,
                            const void *keys, const void *values, int64_t head_stride,
                            const int32_t *tables, int64_t table_stride, const int32_t *lengths, int rows,
                            int num_heads, int num_kv_heads, int head_dim, int block_size, float scale,
                            int num_threads, int kv_type)
{
    const int esize = kv_esize(kv_type);
    const int group = num_heads / num_kv_heads;
    const int pairs = rows * num_kv_heads;
#if defined(VECTOR_LANES)
    if (head_dim % VECTOR_LANES == 0 && block_size <= 16) {
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
                attend_blocks_for[kv_type](
                    qr, head_dim, (const char *)keys + h * head_stride * esize,
                    (const char *)values + h * head_stride * esize, tables + (int64_t)r * table_stride, lengths[r],
                    first, stop, group, head_dim, block_size, scale, state);
                if (states == NULL)
                    finish_states(state, 1, group, head_dim,
                             out + (int64_t)row_index[r] * num_heads * head_dim + (int64_t)h * group * head_dim);
                if (!dynamic)
                    item++;
            }
        }
        if (states != NULL) {
            for (int pair = 0; pair < pairs; pair++) {
                const int r = pair / num_kv_heads, h = pair % num_kv_heads;
                finish_states(states + (int64_t)pair * parts * state_size, parts, group, head_dim,
                         out + (int64_t)row_index[r] * num_heads * head_dim + (int64_t)h * group * head_dim);
            }
            free(states);
        }
        return;
    }
#endif
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (pairs > 1)
    for (int pair = 0; pair < pairs; pair++) {
        const int r = pair / num_kv_heads, h = pair % num_kv_heads;
        const float *qr = q + (int64_t)row_index[r] * q_row_stride + (int64_t)h * group * head_dim;
        float *o = out + (int64_t)row_index[r] * num_heads * head_dim + (int64_t)h * group * head_dim;
        attend_pair(qr, head_dim, o, (const char *)keys + h * head_stride * esize,
                    (const char *)values + h * head_stride * esize, tables + (int64_t)r * table_stride, lengths[r],
                    group, head_dim, block_size, scale, kv_type);
    }
}

/* x[0, n) as an int8 row: n values, then the fp32 scale (the rule at the top of this file). */
__attribute__((optimize("no-fast-math", "fp-contract=off")))
static void quantize_row(const float *x, int n, int8_t *out)
{
#if defined(__AVX512F__)
    if (n % 16 == 0) { /* the same operations 16 lanes at a time: division and rounding are exact per lane */
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
#endif
    float top = 0.0f;
    for (int d = 0; d < n; d++)
        top = fabsf(x[d]) > top ? fabsf(x[d]) : top;
    const float scale = top / 127.0f;
    for (int d = 0; d < n; d++)
        out[d] = scale > 0.0f ? (int8_t)rintf(x[d] / scale) : 0;
    memcpy(out + n, &scale, sizeof scale);
}

/* RoPE and the K/V write of one layer for every row of a step, in one call (the torch path: five
 * element-wise ops and two indexed copies per layer).
 *
 * qkv: rows of [num_heads + 2 * num_kv_heads, head_dim] (Q heads, then K, then V), row stride row_stride
 * elements; the Q and K heads are rotated in place at the row's position, in transformers' half-split
 * convention (element j pairs with j + head_dim / 2), with cos / sin tables [max_positions, head_dim].
 * Then the row's K and V heads are copied into this layer's pool at the row's slot (head h of K at
 * keys + h * head_stride + slot * row elements), as fp32, rounded to bf16, or quantised to an int8 row with its
 * scale (kv_type; the rule at the top of this file). Products are rounded before they are added, as torch's
 * separate multiplications and addition do, and the int8 scale and values are divisions rounded as torch
 * rounds them, so the cache holds the same bits as on the torch path. */
__attribute__((optimize("no-fast-math", "fp-contract=off")))
void chatd_rope_write(float *qkv, int64_t row_stride, const int64_t *positions, const float *cos_table,
                      const float *sin_table, void *keys, void *values, int64_t head_stride,
                      const int64_t *slots, int rows, int num_heads, int num_kv_heads, int head_dim,
                      int num_threads, int kv_type)
{
    const int half = head_dim / 2, rotated = num_heads + num_kv_heads, row_elements = kv_row(kv_type, head_dim);
#pragma omp parallel for num_threads(num_threads) if (rows >= PARALLEL_ROWS)
    for (int r = 0; r < rows; r++) {
        float *row = qkv + (int64_t)r * row_stride;
        const float *c = cos_table + positions[r] * head_dim, *s = sin_table + positions[r] * head_dim;
        for (int h = 0; h < rotated; h++) {
            float *x = row + (int64_t)h * head_dim;
            for (int j = 0; j < half; j++) {
                const float a = x[j], b = x[j + half];
                const float a_cos = a * c[j], b_sin = b * s[j], b_cos = b * c[j + half], a_sin = a * s[j + half];
                x[j] = a_cos - b_sin;
                x[j + half] = b_cos + a_sin;
            }
        }
        const int64_t at = slots[r] * row_elements;
        for (int h = 0; h < num_kv_heads; h++) {
            const float *k = row + (int64_t)(num_heads + h) * head_dim;
            const float *v = row + (int64_t)(rotated + h) * head_dim;
            const int64_t to = h * head_stride + at;
            if (kv_type == KV_INT8) {
                quantize_row(k, head_dim, (int8_t *)keys + to);
                quantize_row(v, head_dim, (int8_t *)values + to);
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
}

/* ------------------------------------------------------------------------------------------------------
 * The element-wise steps around a layer's bf16 projections (a q4 model, or a dense bf16 one): the
 * projections take and return bf16, everything between them runs here in fp32 and is rounded to bf16
 * once, round to nearest even, exactly as torch's .to(torch.bfloat16) rounds. */

/* The residual add and the RMSNorm that follows it, for every row:
 *   h[r] += add[r] (bf16, row stride add_stride elements; skipped when add is NULL), in place, in fp32;
 *   out[r] = bf16((h[r] * 1/sqrt(mean(h[r]^2) + eps)) * weight), out contiguous [rows, hidden].
 * The order of operations is transformers' LlamaRMSNorm in fp32. */
void chatd_add_rms_norm(float *h, const uint16_t *add, int64_t add_stride, const float *weight, float eps,
                        uint16_t *out, int rows, int hidden, int num_threads)
{
#pragma omp parallel for num_threads(num_threads) if (rows >= PARALLEL_ROWS || (int64_t)rows * hidden >= 65536)
    for (int r = 0; r < rows; r++) {
        float *x = h + (int64_t)r * hidden;
#if defined(__AVX512F__)
        {
            const uint16_t *a = add != NULL ? add + (int64_t)r * add_stride : NULL;
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
            uint16_t *o = out + (int64_t)r * hidden;
            for (int d = 0; d < hidden; d += 16) {
                const __mmask16 m = hidden - d >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (hidden - d)) - 1u);
                const __m512 y = _mm512_mul_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + d), inv),
                                               _mm512_maskz_loadu_ps(m, weight + d));
                _mm256_mask_storeu_epi16(o + d, m, bf16x16(y));
            }
            continue;
        }
#endif
        if (add != NULL) {
            const uint16_t *a = add + (int64_t)r * add_stride;
            for (int d = 0; d < hidden; d++)
                x[d] += from_bf16(a[d]);
        }
        float squares = 0.0f;
        for (int d = 0; d < hidden; d++)
            squares += x[d] * x[d];
        const float inv = 1.0f / sqrtf(squares / (float)hidden + eps);
        uint16_t *o = out + (int64_t)r * hidden;
        for (int d = 0; d < hidden; d++)
            o[d] = to_bf16((x[d] * inv) * weight[d]);
    }
}

/* The MLP's activation: gate_up rows are [gate (inter) | up (inter)] in bf16, contiguous;
 * out[r, j] = bf16(silu(gate[r, j]) * up[r, j]), out contiguous [rows, inter]. On the threads from 8,192
 * values (a decode step of 8 SmolLM2 rows: 0.25 -> 0.18 ms a step; 16 rows 0.43 -> 0.30). */
void chatd_silu_mul(const uint16_t *gate_up, uint16_t *out, int rows, int inter, int num_threads)
{
#pragma omp parallel for num_threads(num_threads) if ((int64_t)rows * inter >= 8192)
    for (int r = 0; r < rows; r++) {
        const uint16_t *g = gate_up + (int64_t)r * 2 * inter, *u = g + inter;
        uint16_t *o = out + (int64_t)r * inter;
        int j = 0;
#if defined(__AVX512F__)
        for (; j + 16 <= inter; j += 16) {
            const __m512 x = load_bf16x16(g + j);
            const __m512 silu = _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f),
                                                                exp16(_mm512_sub_ps(_mm512_setzero_ps(), x))));
            _mm256_storeu_si256((__m256i *)(o + j), bf16x16(_mm512_mul_ps(silu, load_bf16x16(u + j))));
        }
#endif
        for (; j < inter; j++) {
            const float x = from_bf16(g[j]);
            o[j] = to_bf16(x / (1.0f + expf(-x)) * from_bf16(u[j]));
        }
    }
}

/* bf16 -> fp32 (exact) and fp32 -> bf16 (rounded as torch rounds) for n contiguous values: the conversions a
 * forward step makes between kernels (chatd/engine/kernels/step.c), which calls them per row, on the threads from
 * PARALLEL_ROWS rows (chatd_widen_bf16_rows, chatd_round_bf16_rows). */
void chatd_widen_bf16(const uint16_t *x, float *out, int64_t n)
{
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(out + i, load_bf16x16(x + i));
#endif
    for (; i < n; i++)
        out[i] = from_bf16(x[i]);
}

void chatd_round_bf16(const float *x, uint16_t *out, int64_t n)
{
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(out + i), bf16x16(_mm512_loadu_ps(x + i)));
#endif
    for (; i < n; i++)
        out[i] = to_bf16(x[i]);
}

/* The same for `rows` rows of n values each, contiguous. */
void chatd_widen_bf16_rows(const uint16_t *x, float *out, int rows, int64_t n, int num_threads)
{
#pragma omp parallel for num_threads(num_threads) if (rows >= PARALLEL_ROWS)
    for (int r = 0; r < rows; r++)
        chatd_widen_bf16(x + r * n, out + r * n, n);
}

void chatd_round_bf16_rows(const float *x, uint16_t *out, int rows, int64_t n, int num_threads)
{
#pragma omp parallel for num_threads(num_threads) if (rows >= PARALLEL_ROWS)
    for (int r = 0; r < rows; r++)
        chatd_round_bf16(x + r * n, out + r * n, n);
}
