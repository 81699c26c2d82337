/* The Q4_1 and Q8_0 tile matmuls, the ISA-independent part: the vector kernels' driver, which rounds x to int8
 * per block and shares the output groups out over the threads, and the entry point, which runs the kind a struct
 * chatd_kernels names. The vector loops are the variants' (matmul_avx512.c on AVX512-VNNI, matmul_avx2.c, and
 * matmul_scalar.c, the portable reference, which the CPU's features never choose); matmul_amx.c has AMX's own
 * kernel. chatd/engine/model/quant.py's TileQ4Linear and TileQ8Linear pack the weights.
 *
 * y[M, N] = x[M, K] @ W^T for bf16 x and y and a Q4_1 weight W (per block of 32 inputs: w = d * q + m,
 * q in 0..15, d and m fp16), or a Q8_0 one (w = d * q, q int8). The weights are packed in tiles of 16 outputs by
 * 32 inputs, in the layout of the kind that runs (AMX's, matmul_amx.c; the vector kernels', matmul_avx512.c),
 * chatd_q4_matmul_kind() saying which. Where AMX runs, a weight is packed in both layouts, the AMX tiles first and
 * then the vector kernels' (twice the bytes): calls of fewer than amx_min_rows rows (16) run the vector kernel on
 * the second half (docs/performance.md, "AMX hosts: steps of few rows on the vector kernel").
 */
#include <stdlib.h>

#include "kernels_impl.h"

/* Up to OWN_ROWS rows, each thread quantises every row of x into scratch of its own and runs its groups on that
 * copy, with no barrier between the two; more rows are quantised once, split over the threads, into one copy
 * that every thread then reads. The copy of one's own costs a thread the other rows' quantisation, and spares it
 * the barrier and the stores into lines the other core holds (the shared copy's lines were last read by every
 * core); from about 20 rows the other rows' quantisation costs what that saves (docs/performance.md, "Whose cache
 * a line is in, and an engine thread that waited for the event loop"). */
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

int chatd_q4_matmul(const struct chatd_kernels *kernels, const uint16_t *x, int m, int k, const uint8_t *tiles,
                    int q8, int n, uint16_t *y, int num_threads)
{
    const struct chatd_matmul_ops *ops = kernels->matmul;
    if (ops == NULL)
        return -1;
    if (ops->tiles != NULL) {
        if (m >= kernels->amx_min_rows)
            return ops->tiles(x, m, k, tiles, q8, n, y, num_threads);
        tiles += (int64_t)(n / 16) * (k / 32) * tile_bytes_for(q8); /* the vector layout follows the AMX one */
    }
    return vector_matmul(x, m, k, tiles, q8, n, y, num_threads, ops->quantise, ops->group);
}
