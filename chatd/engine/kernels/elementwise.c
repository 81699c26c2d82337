/* The element-wise steps of a forward step, the ISA-independent part: each kernel here shares a step's rows out
 * over the threads and runs its variant's row function on each (elementwise_avx512.c, elementwise_avx2.c, and
 * elementwise_scalar.c, the portable reference). RoPE with the K/V write into the paged pool, and around a
 * layer's bf16 projections (a q4 model, or a dense bf16 one): the projections take and return bf16, everything
 * between them runs here in fp32 and is rounded to bf16 once, to nearest even, exactly as torch's
 * .to(torch.bfloat16) rounds. */
#include "kernels_impl.h"

/* Steps of this many rows or more run RoPE with the K/V write, the residual add with RMSNorm, and the bf16
 * conversions around attention on the threads, each thread on its own rows; below it the fork and join cost more
 * than they save (docs/performance.md, "Weights prefetched further ahead, and what bounds a step on this Zen 4").
 * Each thread's rows are consecutive, as decode attention's runs of pairs are (attention.c), so a thread attends
 * the rows it has just written. */
#define PARALLEL_ROWS 8

void chatd_rope_write(const struct chatd_kernels *kernels, float *qkv, int64_t row_stride, const int64_t *positions,
                      const float *cos_table, const float *sin_table, void *keys, void *values, int64_t head_stride,
                      const int64_t *slots, int rows, int num_heads, int num_kv_heads, int head_dim, int num_threads,
                      int kv_type)
{
    const struct chatd_row_ops *ops = kernels->rows;
#pragma omp parallel for num_threads(num_threads) if (rows >= PARALLEL_ROWS)
    for (int r = 0; r < rows; r++)
        ops->rope_row(qkv + (int64_t)r * row_stride, cos_table + positions[r] * head_dim,
                      sin_table + positions[r] * head_dim, keys, values, head_stride, slots[r], num_heads,
                      num_kv_heads, head_dim, kv_type);
}

/* The order of operations is transformers' LlamaRMSNorm in fp32. A single row of a wide model is worth the
 * threads too (65,536 values). */
void chatd_add_rms_norm(const struct chatd_kernels *kernels, float *h, const uint16_t *add, int64_t add_stride,
                        const float *weight, float eps, uint16_t *out, int rows, int hidden, int num_threads)
{
    const struct chatd_row_ops *ops = kernels->rows;
#pragma omp parallel for num_threads(num_threads) if (rows >= PARALLEL_ROWS || (int64_t)rows * hidden >= 65536)
    for (int r = 0; r < rows; r++)
        ops->add_rms_norm_row(h + (int64_t)r * hidden, add != NULL ? add + (int64_t)r * add_stride : NULL, weight, eps,
                              out + (int64_t)r * hidden, hidden);
}

/* On the threads from 8,192 values, where the exponentials of a decode step of 8 SmolLM2 rows outweigh the fork
 * and join (docs/performance.md, "An int8 KV cache, the q4 model's default on the CPU"). */
void chatd_silu_mul(const struct chatd_kernels *kernels, const uint16_t *gate_up, uint16_t *out, int rows, int inter,
                    int num_threads)
{
    const struct chatd_row_ops *ops = kernels->rows;
#pragma omp parallel for num_threads(num_threads) if ((int64_t)rows * inter >= 8192)
    for (int r = 0; r < rows; r++) {
        const uint16_t *g = gate_up + (int64_t)r * 2 * inter;
        ops->silu_mul_row(g, g + inter, out + (int64_t)r * inter, inter);
    }
}

/* bf16 -> fp32 (exact) and fp32 -> bf16 (rounded as torch rounds) for `rows` rows of n contiguous values: the
 * conversions a forward step makes between kernels (step.c). */
void chatd_widen_bf16_rows(const struct chatd_kernels *kernels, const uint16_t *x, float *out, int rows, int64_t n,
                           int num_threads)
{
    const struct chatd_row_ops *ops = kernels->rows;
#pragma omp parallel for num_threads(num_threads) if (rows >= PARALLEL_ROWS)
    for (int r = 0; r < rows; r++)
        ops->widen_bf16(x + r * n, out + r * n, n);
}

void chatd_round_bf16_rows(const struct chatd_kernels *kernels, const float *x, uint16_t *out, int rows, int64_t n,
                           int num_threads)
{
    const struct chatd_row_ops *ops = kernels->rows;
#pragma omp parallel for num_threads(num_threads) if (rows >= PARALLEL_ROWS)
    for (int r = 0; r < rows; r++)
        ops->round_bf16(x + r * n, out + r * n, n);
}
