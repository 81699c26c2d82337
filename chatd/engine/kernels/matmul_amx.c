/* The tile matmul on the CPU's AMX tiles (matmul.c runs it for calls of amx_min_rows rows or more, 16 unless set;
 * fewer rows take the AVX512-VNNI kernel on the weights' second layout, below). Compiled with AMX's flags
 * (loader.py's SOURCES).
 *
 * Each block of 16 outputs by 32 inputs is read once and dequantised once into a bf16 tile, which then multiplies
 * every row of x: the cost of a call is the weight's 0.625 bytes per value plus the dequantisation, nearly flat in
 * M, where a dequantise-per-row kernel pays for every row; a pass pays that dequantisation whatever its rows, so
 * AMX is ahead of the vector kernel only from about 16 rows (docs/performance.md, "AMX hosts: steps of few rows
 * on the vector kernel"). A value is dequantised as bf16(fp32(fp32(d * q) + m)), exactly the bf16 copy of the
 * fp32 weights that chatd's dense twin holds, so the two paths differ only in the order of the fp32 sums.
 *
 * AMX layout, per tile (16 outputs n0..n0+15, inputs kb*32..kb*32+31), 320 bytes:
 *   16 rows of 16 bytes: row r holds the 32 values (n, k) = (n0 + e / 2, kb * 32 + 2r + e % 2), e = 0..31,
 *     value e in the low nibble of byte e for e < 16 and in the high nibble of byte e - 16 otherwise. Once
 *     dequantised, row r is row r of the tile's B operand in AMX's pairwise (VNNI) layout;
 *   16 fp16 d, then 16 fp16 m, one per output.
 * Tiles run over kb within an output group: tile (g, kb) is at ((g * K / 32) + kb) * 320.
 * A Q8_0 weight (w = d * q, q int8, d fp16) is packed the same way with 544-byte tiles: 16 rows of the 32
 * int8 values in pairwise order (value e at byte e), then the 16 outputs' fp16 d.
 * Where AMX runs, a weight is packed in both layouts, the AMX tiles first and then the vector kernel's (twice the
 * bytes).
 */
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "kernels_impl.h"
#include "simd_avx512.h"

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
int chatd_amx_ready(void)
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
 * each weight tile both slices, where one pass of 64 rows loads a slice of x for every product
 * (docs/performance.md, "Sixteen new sessions at once: the pool's first writes, many-row AMX matmuls, a split
 * prompt").
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

/* Every CPU with AMX has AVX512-VNNI: its vector kernel takes the calls of few rows. */
const struct chatd_matmul_ops chatd_matmul_amx = {CHATD_MATMUL_AMX, chatd_quantise_row_vnni, chatd_vnni_group,
                                                  amx_matmul};
