/* The tile matmul's portable reference, one output at a time, plain C, on the vector kernels' layout
 * (matmul_avx512.c describes it). It computes their bits: x rounded to int8 by the same rule (kernels_impl.h),
 * each block's integer sums exact, and each block's two terms added into the fp32 total in their order, one fused
 * rounding each (fmaf, as the vector kernels' FMA instructions). It runs only where chosen
 * (chatd_q4_matmul_select): on a CPU without AVX2 the engine keeps torch's own int4 matmul, as it did before this
 * file existed. matmul.c quantises x and shares the output groups out over the threads. */
#include "kernels_impl.h"

/* fp16 bits -> fp32, exact (subnormals, infinities and NaN included). */
static inline float from_fp16(uint16_t h)
{
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
    uint32_t bits;
    if (exponent == 0x1fu)
        bits = sign | 0x7f800000u | (mantissa << 13);
    else if (exponent != 0)
        bits = sign | ((exponent + 112u) << 23) | (mantissa << 13);
    else if (mantissa == 0)
        bits = sign;
    else { /* a subnormal: mantissa * 2^-24, exact in fp32 */
        const float magnitude = (float)mantissa * 0x1p-24f;
        return sign ? -magnitude : magnitude;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* One row of x quantised per block of 32, as matmul_avx512.c's: xq, dx and dx * sum(xq). */
static CHATD_EXACT void quantise_row_scalar(const uint16_t *row, int k, int8_t *xq, float *dx, float *dx_sum)
{
    for (int kb = 0; kb < k / 32; kb++) {
        const uint16_t *block = row + 32 * kb;
        float amax = 0.0f;
        for (int i = 0; i < 32; i++) {
            const float a = fabsf(from_bf16(block[i]));
            amax = a > amax ? a : amax;
        }
        const float scale = x_block_scale(amax);
        const float inverse = x_block_inverse(scale);
        int32_t sum = 0; /* of the rounded values before they are clamped to int8, as the vector kernels sum them */
        for (int i = 0; i < 32; i++) {
            const int32_t q = (int32_t)rintf(from_bf16(block[i]) * inverse); /* to nearest even */
            sum += q;
            xq[32 * kb + i] = (int8_t)(q > 127 ? 127 : q < -128 ? -128 : q);
        }
        dx[kb] = scale;
        dx_sum[kb] = scale * (float)sum;
    }
}

/* Output o's quant i (0..31) of a tile: Q4_1's 4-bit q, Q8_0's q + 128. Input i is in quad row i / 4, at byte
 * 4 * o + i % 4 of that row's vector (Q4_1: quad rows 4..7 in the high nibbles of vectors 0..3). */
static inline int32_t tile_quant(const uint8_t *tile, int q8, int o, int i)
{
    const int quad = i / 4, at = 4 * o + i % 4;
    if (q8)
        return tile[64 * quad + at];
    return quad < 4 ? tile[64 * quad + at] & 0x0f : tile[64 * (quad - 4) + at] >> 4;
}

/* Output group g (16 outputs) for every row of the quantised x. */
static CHATD_EXACT void scalar_group(const int8_t *xq, const float *dx, const float *dx_sum, int m, int k,
                                     const uint8_t *tiles, int q8, int g, uint16_t *y, int n)
{
    const int blocks = k / 32, tile_bytes = tile_bytes_for(q8);
    const uint8_t *group = group_tiles(tiles, g, k, q8);
    for (int r = 0; r < m; r++) {
        float total[16];
        for (int o = 0; o < 16; o++)
            total[o] = 0.0f;
        for (int kb = 0; kb < blocks; kb++) {
            const uint8_t *tile = group + (int64_t)kb * tile_bytes;
            const int8_t *xb = xq + (int64_t)r * k + 32 * kb;
            const int64_t at = (int64_t)r * blocks + kb;
            for (int o = 0; o < 16; o++) {
                int32_t dot = 0;
                for (int i = 0; i < 32; i++)
                    dot += tile_quant(tile, q8, o, i) * xb[i];
                uint16_t half;
                memcpy(&half, tile + (q8 ? 512 : 256) + 2 * o, sizeof half);
                const float d = from_fp16(half);
                float offset = d * -128.0f; /* Q8_0: the quants' offset of 128 taken back */
                if (!q8) {
                    memcpy(&half, tile + 288 + 2 * o, sizeof half);
                    offset = from_fp16(half); /* Q4_1: m */
                }
                total[o] = fmaf((float)dot, d * dx[at], total[o]);
                total[o] = fmaf(offset, dx_sum[at], total[o]);
            }
        }
        for (int o = 0; o < 16; o++)
            y[(int64_t)r * n + 16 * g + o] = to_bf16(total[o]);
    }
}

const struct chatd_matmul_ops chatd_matmul_scalar = {CHATD_MATMUL_SCALAR, quantise_row_scalar, scalar_group, NULL};
