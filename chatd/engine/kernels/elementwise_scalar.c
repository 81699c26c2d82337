/* The element-wise steps' portable reference, one row at a time, plain C (elementwise.c shares the rows out over
 * the threads). Compiled on its own it is the scalar variant; elementwise_avx2.c compiles this same file with
 * AVX2's flags as the AVX2 variant, where gcc vectorises its loops 8 lanes wide (the sum of squares reassociated
 * under -ffast-math, expf through glibc's vector expf), which is all the AVX2 variant needs.
 * ROWS_TABLE names the table it defines. */
#include "kernels_impl.h"

#ifndef ROWS_TABLE
#define ROWS_TABLE chatd_rows_scalar
#endif

static CHATD_EXACT_UNFUSED void rope_row_portable(float *row, const float *c, const float *s, void *keys, void *values,
                                                  int64_t head_stride, int64_t slot, int num_heads, int num_kv_heads,
                                                  int head_dim, int kv_type)
{
    rope_row(row, c, s, keys, values, head_stride, slot, num_heads, num_kv_heads, head_dim, kv_type,
             quantize_row_portable);
}

static void add_rms_norm_row(float *x, const uint16_t *a, const float *weight, float eps, uint16_t *o, int hidden)
{
    if (a != NULL) {
        for (int d = 0; d < hidden; d++)
            x[d] += from_bf16(a[d]);
    }
    float squares = 0.0f;
    for (int d = 0; d < hidden; d++)
        squares += x[d] * x[d];
    const float inv = 1.0f / sqrtf(squares / (float)hidden + eps);
    for (int d = 0; d < hidden; d++)
        o[d] = to_bf16((x[d] * inv) * weight[d]);
}

static void silu_mul_row(const uint16_t *g, const uint16_t *u, uint16_t *o, int inter)
{
    for (int j = 0; j < inter; j++)
        o[j] = silu_mul_one(g[j], u[j]);
}

static void widen_bf16(const uint16_t *x, float *out, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        out[i] = from_bf16(x[i]);
}

static void round_bf16(const float *x, uint16_t *out, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        out[i] = to_bf16(x[i]);
}

const struct chatd_row_ops ROWS_TABLE = {rope_row_portable, add_rms_norm_row, silu_mul_row, widen_bf16, round_bf16};
