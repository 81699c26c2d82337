/* chatd's weight-stationary Q4_1 and Q8_0 matmuls for the CPU's AMX tiles, its AVX512-VNNI vector units or,
 * where it has neither, AVX2 (chatd/engine/kernels/loader.py builds and loads this file next to decode_attention.c; chatd/engine/model/quant.py's
 * TileQ4Linear and TileQ8Linear pack the weights).
 *
 * y[M, N] = x[M, K] @ W^T for bf16 x and y and a Q4_1 weight W (per block of 32 inputs: w = d * q + m,
 * q in 0..15, d and m fp16). On AMX, each block of 16 outputs by 32 inputs is read once and dequantised once
 * into a bf16 tile, which then multiplies every row of x: the cost of a call is the weight's 0.625 bytes per
 * value plus the dequantisation, nearly flat in M, where a dequantise-per-row kernel pays for every row.
 * A value is dequantised as bf16(fp32(fp32(d * q) + m)), exactly the bf16 copy of the fp32 weights
 * that chatd's dense twin holds, so the two paths differ only in the order of the fp32 sums.
 *
 * AMX layout, per tile (16 outputs n0..n0+15, inputs kb*32..kb*32+31), 320 bytes:
 *   16 rows of 16 bytes: row r holds the 32 values (n, k) = (n0 + e / 2, kb * 32 + 2r + e % 2), e = 0..31,
 *     value e in the low nibble of byte e for e < 16 and in the high nibble of byte e - 16 otherwise. Once
 *     dequantised, row r is row r of the tile's B operand in AMX's pairwise (VNNI) layout;
 *   16 fp16 d, then 16 fp16 m, one per output.
 * Tiles run over kb within an output group: tile (g, kb) is at ((g * K / 32) + kb) * 320.
 *
 * A Q8_0 weight (w = d * q, q int8, d fp16) is packed the same way with 544-byte tiles: 16 rows of the 32
 * int8 values in pairwise order (value e at byte e), then the 16 outputs' fp16 d.
 *
 * Where the CPU has no AMX but AVX512-VNNI (AMD Zen 4 and later, Intel Cascade Lake and later), the vector
 * kernel runs integer dot products instead, as llama.cpp does: each row of x is quantised per block of 32
 * to int8 with one fp32 scale (dx = max |x| / 127, x ~ dx * xq), and one VPDPBUSD adds 4 products of a
 * weight's 4-bit (or offset 8-bit) quants and 4 int8 of xq into each of 16 int32 sums. A Q4_1 block then
 * gives d * dx * sum(q * xq) + m * dx * sum(xq); a Q8_0 block, stored as q + 128, d * dx * (sum((q + 128) *
 * xq) - 128 * sum(xq)). The weights take part exactly (d * q + m unrounded); x is rounded to 8 bits per
 * block where the AMX path rounds it to bf16 (llama.cpp's Q4_1 matmul rounds it the same way).
 * Its layout, per tile of 16 outputs by 32 inputs (quad row r holds inputs 4r..4r+3):
 *   Q4_1, 320 bytes: 4 vectors of 64 bytes, vector v holding quad row v in its low nibbles and quad row
 *     v + 4 in its high nibbles, output n's 4 quants at bytes 4n..4n+3; then 16 fp16 d, 16 fp16 m;
 *   Q8_0, 544 bytes: 8 vectors of 64 bytes, quad row r's q + 128 (as uint8) at bytes 4n..4n+3 of vector
 *     r; then 16 fp16 d.
 * The AVX2 kernel (at the end of this file) reads the same layout as two 32-byte halves per vector.
 * chatd_q4_matmul_kind() says which kernel this process runs (and so which layout the weights need).
 *
 * Where AMX runs, a weight is packed in both layouts, the AMX tiles first and then the vector kernel's
 * (twice the bytes): calls of fewer than chatd_q4_matmul_amx_rows() rows (16) run the vector kernel on the
 * second half, which is ahead there (measured on a 2-core Sapphire Rapids, all of SmolLM2-135M's projections:
 * 59 against 25 GMAC/s at 1 row, 261 against 178 at 8, 306 against 292 at 12, 307 against 335 at 16 and 340
 * against 540 at 32): a tile pass costs one dequantisation of the weight whatever the rows, and AMX pays
 * that back from about 16 rows.
 */
#include <stdint.h>
#include <string.h>

#define Q4_TILE_BYTES 320
#define Q8_TILE_BYTES 544

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define HAVE_VNNI 1
#endif
/* AMX only beside the vector kernel, which takes the steps of few rows (every CPU with AMX has AVX512-VNNI) */
#if defined(HAVE_VNNI) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define HAVE_AMX 1
#endif

#if defined(HAVE_VNNI) || defined(HAVE_AMX)
#include <immintrin.h>
#include <stdlib.h>

#define PREFETCH_AHEAD 4 /* tiles */
#endif

/* The vector kernels (AVX512-VNNI, AVX2) also ask for the tile PREFETCH_FAR tiles ahead into L2: a group's
 * tiles are one stream through memory, and at 4 tiles (1.3 KB) the request comes too late to cover the
 * memory's latency once a step of several rows works through the weights as fast as memory delivers them.
 * Per-step A/B on this 2-core Zen 4 (the two alternating step by step, 400 steps each, 64-token contexts),
 * step time with the far prefetch vs without: AVX512-VNNI 1 and 2 rows unchanged, 4 rows -4 %, 8 rows
 * -10.8 %, 16 rows -8.9 % (16 to 128 tiles did as well as 32 at 8 and 16 rows, worse at 1); AVX2 -5 % at 1,
 * 8 and 16 rows. */
#define PREFETCH_FAR 32 /* tiles */

/* ---------------------------------------------------------------- AMX */

#ifdef HAVE_AMX
#include <sys/syscall.h>
#include <unistd.h>

static inline void dequantise_q8(const uint8_t *tile, uint16_t *restrict out /* [16][32] */)
{
    const __m512i pairs_lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i pairs_hi = _mm512_add_epi32(pairs_lo, _mm512_set1_epi32(8));
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(tile + 512)));
    const __m512 d_lo = _mm512_permutexvar_ps(pairs_lo, d), d_hi = _mm512_permutexvar_ps(pairs_hi, d);
    for (int r = 0; r < 16; r++) {
        const __m128i *row = (const __m128i *)(tile + 32 * r);
        /* d * q is exact in fp32 (11 by 8 significant bits) */
        const __m512 w_lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(row))), d_lo);
        const __m512 w_hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(row + 1))), d_hi);
        _mm512_store_si512((__m512i *)(out + 32 * r), (__m512i)_mm512_cvtne2ps_pbh(w_hi, w_lo));
    }
}

static inline void dequantise_q4(const uint8_t *tile, uint16_t *restrict out /* [16][32] */)
{
    const __m512i pairs_lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i pairs_hi = _mm512_add_epi32(pairs_lo, _mm512_set1_epi32(8));
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(tile + 256)));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(tile + 288)));
    const __m512 d_lo = _mm512_permutexvar_ps(pairs_lo, d), d_hi = _mm512_permutexvar_ps(pairs_hi, d);
    const __m512 m_lo = _mm512_permutexvar_ps(pairs_lo, m), m_hi = _mm512_permutexvar_ps(pairs_hi, m);
    const __m128i low4 = _mm_set1_epi8(0x0f);
    for (int r = 0; r < 16; r++) {
        const __m128i bytes = _mm_loadu_si128((const __m128i *)(tile + 16 * r));
        const __m512 q_lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(bytes, low4)));
        const __m512 q_hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), low4)));
        /* d * q is exact in fp32 (11 by 4 significant bits): one fused rounding is the twin's two */
        const __m512 w_lo = _mm512_fmadd_ps(q_lo, d_lo, m_lo);
        const __m512 w_hi = _mm512_fmadd_ps(q_hi, d_hi, m_hi);
        _mm512_store_si512((__m512i *)(out + 32 * r), (__m512i)_mm512_cvtne2ps_pbh(w_hi, w_lo));
    }
}


#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define MAX_M_TILES 4 /* rows per pass: 4 accumulator tiles of 16 */
/* gcc's tile load and store intrinsics are asm statements that do not tell the compiler they read or
 * write memory: without this fence it may drop the stores of a dequantised tile that only a tile load
 * reads, or read an accumulator's copy before the tile store has written it. */
#define MEMORY_FENCE() __asm__ __volatile__("" ::: "memory")

struct tile_config {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* 1 when this process may use the AMX tile registers (Linux asks each process to request them). */
static int amx_ready(void)
{
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

/* Every tile 16 rows of 64 bytes. */
static struct tile_config full_tiles(void)
{
    struct tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    return cfg;
}

/* Calls of up to 64 rows: one pass, a group of 16 outputs at a time. Tiles 0..3: accumulators (16 fp32 per
 * row), one per 16-row slice of x; 4: a full slice of x; 5: the last slice when it is partial (it and its
 * accumulator have that many rows); 6 and 7: dequantised weight tiles (16 pair rows of 32 bf16), alternate
 * input blocks, so one block's dequantisation overlaps the previous block's multiplication. */
static void configure_pass(int rows)
{
    const int full = rows / 16, tail_rows = rows % 16;
    struct tile_config cfg = full_tiles();
    if (tail_rows > 0) {
        cfg.rows[5] = (uint8_t)tail_rows;
        cfg.rows[full] = (uint8_t)tail_rows;
    }
    _tile_loadconfig(&cfg);
}

/* Rows [row0, row0 + rows) of x against output group g, every input block, then y's 16 columns. */
#define MULTIPLY(A, C, B)                                                                                      \
    _tile_loadd(A, x + (int64_t)(row0 + 16 * (C)) * k + 32 * kb, 2 * k);                                       \
    _tile_dpbf16ps(C, A, B)
#define MULTIPLY_ALL(B)                                                                                        \
    do {                                                                                                       \
        _tile_loadd(B, buffer, 64);                                                                            \
        if (slices > 0) { if (full > 0) { MULTIPLY(4, 0, B); } else { MULTIPLY(5, 0, B); } }                   \
        if (slices > 1) { if (full > 1) { MULTIPLY(4, 1, B); } else { MULTIPLY(5, 1, B); } }                   \
        if (slices > 2) { if (full > 2) { MULTIPLY(4, 2, B); } else { MULTIPLY(5, 2, B); } }                   \
        if (slices > 3) { if (full > 3) { MULTIPLY(4, 3, B); } else { MULTIPLY(5, 3, B); } }                   \
    } while (0)

static void one_pass_group(const uint16_t *x, int rows, int row0, int k, const uint8_t *tiles, int q8, int g,
                           uint16_t *y, int n, uint16_t *b /* [2][16][32], 64-byte aligned */, float *c /* [64][16] */)
{
    const int blocks = k / 32, full = rows / 16, tail = rows % 16, slices = full + (tail > 0);
    const int tile_bytes = q8 ? Q8_TILE_BYTES : Q4_TILE_BYTES;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const uint8_t *group = tiles + (int64_t)g * blocks * tile_bytes;
    for (int kb = 0; kb < blocks; kb++) {
        uint16_t *buffer = b + 512 * (kb & 1);
        const uint8_t *tile = group + (int64_t)kb * tile_bytes;
        for (int line = 0; line < tile_bytes; line += 64)
            _mm_prefetch((const char *)tile + PREFETCH_AHEAD * tile_bytes + line, _MM_HINT_T0);
        if (q8)
            dequantise_q8(tile, buffer);
        else
            dequantise_q4(tile, buffer);
        MEMORY_FENCE();
        /* full slices use tile 4, the partial last one tile 5 (its row count is in the configuration) */
        if (kb & 1)
            MULTIPLY_ALL(7);
        else
            MULTIPLY_ALL(6);
    }
    _tile_stored(0, c, 64);
    if (slices > 1) _tile_stored(1, c + 16 * 16, 64);
    if (slices > 2) _tile_stored(2, c + 32 * 16, 64);
    if (slices > 3) _tile_stored(3, c + 48 * 16, 64);
    MEMORY_FENCE();
    for (int r = 0; r < rows; r++)
        _mm256_storeu_si256((__m256i *)(y + (int64_t)(row0 + r) * n + 16 * g),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(c + 16 * r)));
}

static void one_pass_matmul(const uint16_t *x, int m, int k, const uint8_t *tiles, int q8, int n, uint16_t *y,
                            int num_threads)
{
    const int groups = n / 16;
#pragma omp parallel num_threads(num_threads)
    {
        uint16_t b[2 * 16 * 32] __attribute__((aligned(64)));
        float c[MAX_M_TILES * 16 * 16] __attribute__((aligned(64)));
        configure_pass(m);
#pragma omp for schedule(static)
        for (int g = 0; g < groups; g++)
            one_pass_group(x, m, 0, k, tiles, q8, g, y, n, b, c);
        _tile_release();
    }
}

/* Calls of more rows (prompt chunks, many prompts at once): each weight tile is dequantised once per call into
 * a per-thread copy of its group's tiles, and passes of up to 32 rows multiply the copies. A pass takes one or
 * two 16-row slices of x (tiles 4 and 5) against two groups of outputs (their weight tiles in 6 and 7); tiles
 * 0..3 accumulate the four products: accumulator 2 * slice + group. Each slice meets both groups' weights and
 * each weight tile both slices, where one pass of 64 rows loads a slice of x for every product (measured on a
 * 2-core Sapphire Rapids, all of SmolLM2-135M's projections at 256 rows: 43 -> 31 ms).
 * Slices pair up from the end of x, so the last slice (the only one that may have fewer than 16 rows) is
 * slice 1 of the last pass, and a lone slice (an odd count) is slice 0 of the first. Every tile has 16 rows,
 * except tiles 2, 3 and 5 in the last pass where the last slice is partial (``last_rows``). */
static void configure_pairs(int last_rows)
{
    struct tile_config cfg = full_tiles();
    cfg.rows[2] = cfg.rows[3] = cfg.rows[5] = (uint8_t)last_rows;
    _tile_loadconfig(&cfg);
}

/* 16 fp32 per row of accumulator copy c, ``rows`` rows, into y's 16 columns of output group g from row ``row``. */
static inline void store_rows(const float *c, int rows, uint16_t *y, int64_t row, int n, int g)
{
    for (int r = 0; r < rows; r++)
        _mm256_storeu_si256((__m256i *)(y + (row + r) * n + 16 * g),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(c + 16 * r)));
}

/* Every row of x (m > 32) against output groups g and, where ``two``, g + 1. The first pass dequantises each
 * block's weight tiles into ``kept`` (per group, 512 bf16 per input block, the second group's after the
 * first's); later passes multiply those. */
static void pair_groups(const uint16_t *x, int m, int k, const uint8_t *tiles, int q8, int g, int two, uint16_t *y,
                        int n, uint16_t *kept, float *c /* [4][16][16] */)
{
    const int blocks = k / 32, tile_bytes = q8 ? Q8_TILE_BYTES : Q4_TILE_BYTES, slices = (m + 15) / 16;
    const uint8_t *first_group = tiles + (int64_t)g * blocks * tile_bytes;
    const uint8_t *second_group = first_group + (int64_t)blocks * tile_bytes;
    const int lone = slices % 2;
    for (int s0 = 0, pass = 0; s0 < slices; s0 += (pass == 0 && lone) ? 1 : 2, pass++) {
        const int paired = !(pass == 0 && lone), row0 = 16 * s0;
        const int rows1 = !paired ? 0 : m - row0 - 16 < 16 ? m - row0 - 16 : 16;
        const uint16_t *x0 = x + (int64_t)row0 * k, *x1 = x0 + (int64_t)16 * k;
        if (rows1 > 0 && rows1 < 16) /* the last pass, its second slice partial */
            configure_pairs(rows1);
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int kb = 0; kb < blocks; kb++) {
            uint16_t *b0 = kept + 512 * kb, *b1 = b0 + (int64_t)512 * blocks;
            if (pass == 0) {
                const uint8_t *tile0 = first_group + (int64_t)kb * tile_bytes;
                const uint8_t *tile1 = second_group + (int64_t)kb * tile_bytes;
                for (int line = 0; line < tile_bytes; line += 64) {
                    _mm_prefetch((const char *)tile0 + PREFETCH_AHEAD * tile_bytes + line, _MM_HINT_T0);
                    if (two)
                        _mm_prefetch((const char *)tile1 + PREFETCH_AHEAD * tile_bytes + line, _MM_HINT_T0);
                }
                if (q8)
                    dequantise_q8(tile0, b0);
                else
                    dequantise_q4(tile0, b0);
                if (two && q8)
                    dequantise_q8(tile1, b1);
                else if (two)
                    dequantise_q4(tile1, b1);
                MEMORY_FENCE();
            }
            _tile_loadd(6, b0, 64);
            _tile_loadd(4, x0 + 32 * kb, 2 * k);
            _tile_dpbf16ps(0, 4, 6);
            if (two) {
                _tile_loadd(7, b1, 64);
                _tile_dpbf16ps(1, 4, 7);
            }
            if (paired) {
                _tile_loadd(5, x1 + 32 * kb, 2 * k);
                _tile_dpbf16ps(2, 5, 6);
                if (two)
                    _tile_dpbf16ps(3, 5, 7);
            }
        }
        const int rows0 = 16; /* only slice 1 of the last pass can be partial (m > 32) */
        _tile_stored(0, c, 64);
        if (two) _tile_stored(1, c + 256, 64);
        if (paired) _tile_stored(2, c + 512, 64);
        if (paired && two) _tile_stored(3, c + 768, 64);
        MEMORY_FENCE();
        store_rows(c, rows0, y, row0, n, g);
        if (two) store_rows(c + 256, rows0, y, row0, n, g + 1);
        if (paired) store_rows(c + 512, rows1, y, row0 + 16, n, g);
        if (paired && two) store_rows(c + 768, rows1, y, row0 + 16, n, g + 1);
        if (rows1 > 0 && rows1 < 16) /* full slices again for the next groups */
            configure_pairs(16);
    }
}

/* 0, or -2 when scratch memory could not be had. */
static int pairs_matmul(const uint16_t *x, int m, int k, const uint8_t *tiles, int q8, int n, uint16_t *y,
                        int num_threads)
{
    const int groups = n / 16, pairs = (groups + 1) / 2;
    const size_t kept_bytes = (size_t)2 * 512 * sizeof(uint16_t) * (size_t)(k / 32);
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float c[4 * 16 * 16] __attribute__((aligned(64)));
        uint16_t *kept = aligned_alloc(64, kept_bytes);
        failed = kept == NULL;
        if (kept != NULL)
            configure_pairs(16);
#pragma omp for schedule(static)
        for (int p = 0; p < pairs; p++)
            if (kept != NULL)
                pair_groups(x, m, k, tiles, q8, 2 * p, 2 * p + 1 < groups, y, n, kept, c);
        if (kept != NULL)
            _tile_release();
        free(kept);
    }
    return failed ? -2 : 0;
}

/* 0, or -2 when scratch memory could not be had. */
static int amx_matmul(const uint16_t *x, int m, int k, const uint8_t *tiles, int q8, int n, uint16_t *y,
                      int num_threads)
{
    if (m > 16 * MAX_M_TILES)
        return pairs_matmul(x, m, k, tiles, q8, n, y, num_threads);
    one_pass_matmul(x, m, k, tiles, q8, n, y, num_threads);
    return 0;
}

#endif /* HAVE_AMX */

/* ---------------------------------------------------------------- AVX512-VNNI */

#ifdef HAVE_VNNI

#define VECTOR_ROWS 8 /* rows of x per pass: 8 block sums and 8 totals in registers, beside the quad row in use */

/* bf16 bits -> fp32 (exact) */
static inline __m512 widen_bf16(__m256i bits)
{
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

/* fp32 -> bf16 bits, rounded to nearest even (finite values) */
static inline __m256i narrow_bf16(__m512 values)
{
    const __m512i bits = _mm512_castps_si512(values);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

/* One row of x (bf16, k values) quantised per block of 32: xq (int8), dx (the block's scale) and
 * dx * sum(xq) (what a block's offset term multiplies). Compiled without -ffast-math's rewrites, so that
 * dx = max |x| / 127 and xq = round_half_even(x * (1 / dx)) hold to the bit (the tests recompute them). */
__attribute__((optimize("no-fast-math"))) static void quantise_row(const uint16_t *row, int k, int8_t *xq, float *dx, float *dx_sum)
{
    for (int kb = 0; kb < k / 32; kb++) {
        const __m512 lo = widen_bf16(_mm256_loadu_si256((const __m256i *)(row + 32 * kb)));
        const __m512 hi = widen_bf16(_mm256_loadu_si256((const __m256i *)(row + 32 * kb + 16)));
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
        const float scale = amax / 127.0f;
        const __m512 inverse = _mm512_set1_ps(scale > 0.0f ? 1.0f / scale : 0.0f);
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
    const int blocks = k / 32, tile_bytes = q8 ? Q8_TILE_BYTES : Q4_TILE_BYTES;
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    __m512 total[VECTOR_ROWS];
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; r++)
        total[r] = _mm512_setzero_ps();
    for (int kb = 0; kb < blocks; kb++) {
        const uint8_t *tile = group + (int64_t)kb * tile_bytes;
        for (int line = 0; line < tile_bytes; line += 64) {
            _mm_prefetch((const char *)tile + PREFETCH_AHEAD * tile_bytes + line, _MM_HINT_T0);
            _mm_prefetch((const char *)tile + PREFETCH_FAR * tile_bytes + line, _MM_HINT_T1);
        }
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
        _mm256_storeu_si256((__m256i *)(y + (int64_t)(row0 + r) * n + 16 * g), narrow_bf16(total[r]));
}

static void vnni_group(const int8_t *xq, const float *dx, const float *dx_sum, int m, int k, const uint8_t *tiles,
                       int q8, int g, uint16_t *y, int n)
{
    const int tile_bytes = q8 ? Q8_TILE_BYTES : Q4_TILE_BYTES;
    const uint8_t *group = tiles + (int64_t)g * (k / 32) * tile_bytes;
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

#endif /* HAVE_VNNI */

/* ---------------------------------------------------------------- AVX2 */

/* Where the CPU has neither AMX nor AVX512 (AMD Zen 2 and Zen 3, Intel before Ice Lake), the same integer dot
 * products on 256-bit vectors, on the vector kernel's layout: the 32-byte halves of a 64-byte vector are outputs
 * 0..7 and 8..15 of the tile. VPMADDUBSW multiplies unsigned by signed bytes and adds adjacent pairs into int16
 * lanes; a weight is split into 4-bit parts (Q4_1's quant is one, Q8_0's q + 128 two), so that a pair stays
 * within 2 * 15 * 127 and the int16 sums of a block's 8 quad rows within 30,480: no lane saturates, and the
 * block's sums are exact, as on AVX512-VNNI. VPMADDWD then adds the int16 pairs into one int32 per output (with
 * weight 16 for a Q8_0 quant's high part). x is quantised exactly as the VNNI kernel quantises it, so the two
 * compute the same block sums and differ only in the order of the fp32 sums. */

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define HAVE_AVX2 1
#endif

#ifdef HAVE_AVX2
#include <immintrin.h>
#include <stdlib.h>

#ifndef PREFETCH_AHEAD
#define PREFETCH_AHEAD 4 /* tiles */
#endif
#define AVX2_ROWS 4 /* rows of x per pass: a block sum (and a Q8_0 one's second) and a total each, in registers */

/* 8 bf16 values -> fp32 (exact) */
static inline __m256 widen_bf16x8(__m128i bits)
{
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

/* 8 fp32 values -> bf16 bits, rounded to nearest even (finite values) */
static inline __m128i narrow_bf16x8(__m256 values)
{
    const __m256i bits = _mm256_castps_si256(values);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
    /* packus works per 128-bit lane: lanes 0 and 2 of the 64-bit view hold the 8 results in order */
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(rounded, rounded), 0x08));
}

/* As the VNNI kernel's quantise_row, on 8 lanes: the same xq, dx and dx_sum. */
__attribute__((optimize("no-fast-math"))) static void quantise_row_avx2(const uint16_t *row, int k, int8_t *xq,
                                                                       float *dx, float *dx_sum)
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
        const float scale = _mm_cvtss_f32(m4) / 127.0f;
        const __m256 inverse = _mm256_set1_ps(scale > 0.0f ? 1.0f / scale : 0.0f);
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
    const int blocks = k / 32, tile_bytes = q8 ? Q8_TILE_BYTES : Q4_TILE_BYTES;
    const __m256i low4 = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1), sixteens = _mm256_set1_epi16(16);
    __m256 total[AVX2_ROWS];
    for (int r = 0; r < ROWS; r++)
        total[r] = _mm256_setzero_ps();
    for (int kb = 0; kb < blocks; kb++) {
        const uint8_t *tile = group + (int64_t)kb * tile_bytes;
        if (half == 0)
            for (int line = 0; line < tile_bytes; line += 64) {
                _mm_prefetch((const char *)tile + PREFETCH_AHEAD * tile_bytes + line, _MM_HINT_T0);
                _mm_prefetch((const char *)tile + PREFETCH_FAR * tile_bytes + line, _MM_HINT_T1);
            }
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
    const int tile_bytes = q8 ? Q8_TILE_BYTES : Q4_TILE_BYTES;
    const uint8_t *group = tiles + (int64_t)g * (k / 32) * tile_bytes;
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

#endif /* HAVE_AVX2 */

/* ---------------------------------------------------------------- the vector kernels' driver */

#if defined(HAVE_VNNI) || defined(HAVE_AVX2)
typedef void (*quantise_row_fn)(const uint16_t *row, int k, int8_t *xq, float *dx, float *dx_sum);
typedef void (*vector_group_fn)(const int8_t *xq, const float *dx, const float *dx_sum, int m, int k,
                                const uint8_t *tiles, int q8, int g, uint16_t *y, int n);

/* Up to OWN_ROWS rows, each thread quantises every row of x into scratch of its own and runs its groups on that
 * copy, with no barrier between the two; more rows are quantised once, split over the threads, into one copy
 * that every thread then reads. The copy of one's own costs a thread the other rows' quantisation, and spares it
 * the barrier and the stores into lines the other core holds (the shared copy's lines were last read by every
 * core). Per-step A/B on the 2-core Zen 4 (AVX512-VNNI, 250-400 steps each, 64-token contexts, repeated runs),
 * step time with the copies of one's own vs the shared one: 1 row -5 %, 4 rows -8 %, 8 rows -5 % to 0, 12 rows
 * -8 % to +3 %, 16 rows -8 % to +1 %; 20 and 32 rows even, 64 rows +3 %. AVX2: -2 % at 1 and 8 rows. */
#define OWN_ROWS 16

/* This thread's scratch for its own copy of the quantised rows, kept from call to call (it stays in the core's
 * cache) and grown as calls need: NULL when no memory could be had. */
static __thread void *own_scratch;
static __thread size_t own_capacity;

static void *own_buffer(size_t bytes)
{
    if (bytes > own_capacity) {
        free(own_scratch);
        own_capacity = (bytes + 4095) & ~(size_t)4095;
        own_scratch = aligned_alloc(64, own_capacity);
        if (own_scratch == NULL)
            own_capacity = 0;
    }
    return own_scratch;
}

/* Every row of x quantised per block of 32 (`quantise`), then each group of 16 outputs over all rows (`group`),
 * the groups spread over the threads. */
static int vector_matmul(const uint16_t *x, int m, int k, const uint8_t *tiles, int q8, int n, uint16_t *y,
                         int num_threads, quantise_row_fn quantise, vector_group_fn group)
{
    const int groups = n / 16, blocks = k / 32;
    /* xq (m * k int8), then dx and dx_sum (m * blocks fp32 each) */
    const size_t xq_bytes = ((size_t)m * k + 63) & ~(size_t)63, bytes = xq_bytes + 2 * (size_t)m * blocks * sizeof(float);
    int failed = 0;
    if (m <= OWN_ROWS) {
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
        {
            int8_t *xq = own_buffer(bytes);
            failed = xq == NULL;
            if (xq != NULL) {
                float *dx = (float *)(xq + xq_bytes), *dx_sum = dx + (size_t)m * blocks;
                for (int r = 0; r < m; r++)
                    quantise(x + (int64_t)r * k, k, xq + (int64_t)r * k, dx + (int64_t)r * blocks,
                             dx_sum + (int64_t)r * blocks);
#pragma omp for schedule(static) nowait
                for (int g = 0; g < groups; g++)
                    group(xq, dx, dx_sum, m, k, tiles, q8, g, y, n);
            }
        }
        return failed ? -2 : 0;
    }
    int8_t *xq = aligned_alloc(64, (bytes + 63) & ~(size_t)63);
    if (xq == NULL)
        return -2;
    float *dx = (float *)(xq + xq_bytes), *dx_sum = dx + (size_t)m * blocks;
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int r = 0; r < m; r++)
            quantise(x + (int64_t)r * k, k, xq + (int64_t)r * k, dx + (int64_t)r * blocks,
                     dx_sum + (int64_t)r * blocks);
        /* the loop's barrier: every row is quantised */
#pragma omp for schedule(static)
        for (int g = 0; g < groups; g++)
            group(xq, dx, dx_sum, m, k, tiles, q8, g, y, n);
    }
    free(xq);
    return 0;
}
#endif

/* ---------------------------------------------------------------- entry points */

static int matmul_kind = -1;

#define AMX_MIN_ROWS 16
static int amx_min_rows = AMX_MIN_ROWS;

/* The kinds' codes (chatd/engine/kernels/loader.py names them). */
#define KIND_NONE 0
#define KIND_VNNI 1
#define KIND_AMX 2
#define KIND_AVX2 3

static int available(int kind)
{
    switch (kind) {
#ifdef HAVE_AMX
    case KIND_AMX: return amx_ready();
#endif
#ifdef HAVE_VNNI
    case KIND_VNNI: return 1;
#endif
#ifdef HAVE_AVX2
    case KIND_AVX2: return 1;
#endif
    default: return 0;
    }
}

static int best_kind(void)
{
    static const int preference[] = {KIND_AMX, KIND_VNNI, KIND_AVX2};
    for (int i = 0; i < 3; i++)
        if (available(preference[i]))
            return preference[i];
    return KIND_NONE;
}

/* 2: AMX tiles (compiled in, and granted to this process), 1: AVX512-VNNI vectors, 3: AVX2 vectors, 0: none. */
int chatd_q4_matmul_kind(void)
{
    if (matmul_kind < 0)
        matmul_kind = best_kind();
    return matmul_kind;
}

/* Run ``kind`` from now on where this build and CPU have it (the vector kernels also run where AMX does: tests
 * compare them), the best one for 0; returns the kind in effect. The weights' layout follows the kind (AVX2's is
 * AVX512-VNNI's). */
int chatd_q4_matmul_select(int kind)
{
    matmul_kind = kind != KIND_NONE && available(kind) ? kind : best_kind();
    return matmul_kind;
}

/* Where AMX runs, calls of ``rows`` rows or more take it, fewer the vector kernel; 0 keeps the setting
 * (tests take 1: AMX for every call). Returns the setting in effect. */
int chatd_q4_matmul_amx_rows(int rows)
{
    if (rows > 0)
        amx_min_rows = rows;
    return amx_min_rows;
}

/* y [m, n] bf16 = x [m, k] bf16 (contiguous) @ W^T, W packed in the layout of the kind in effect ([n / 16][k /
 * 32] tiles, Q8_0 ones where q8; with AMX the AMX tiles, then the same tiles in the vector layout); n a
 * multiple of 16, k of 32. Returns 0; -1 where no kernel runs here, -2 when scratch memory could not be had. */
int chatd_q4_matmul(const uint16_t *x, int m, int k, const uint8_t *tiles, int q8, int n, uint16_t *y,
                    int num_threads)
{
    const int kind = chatd_q4_matmul_kind();
#ifdef HAVE_AMX
    if (kind == KIND_AMX) {
        if (m < amx_min_rows) /* the vector layout follows the AMX one */
            return vector_matmul(x, m, k, tiles + (int64_t)(n / 16) * (k / 32) * (q8 ? Q8_TILE_BYTES : Q4_TILE_BYTES),
                                 q8, n, y, num_threads, quantise_row, vnni_group);
        return amx_matmul(x, m, k, tiles, q8, n, y, num_threads);
    }
#endif
#ifdef HAVE_VNNI
    if (kind == KIND_VNNI)
        return vector_matmul(x, m, k, tiles, q8, n, y, num_threads, quantise_row, vnni_group);
#endif
#ifdef HAVE_AVX2
    if (kind == KIND_AVX2)
        return vector_matmul(x, m, k, tiles, q8, n, y, num_threads, quantise_row_avx2, avx2_group);
#endif
    (void)x, (void)m, (void)k, (void)tiles, (void)q8, (void)n, (void)y, (void)num_threads, (void)kind;
    return -1;
}
