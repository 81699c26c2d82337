/* chatd's native CPU kernels: the one header of the library. It declares every function the library exports
 * (chatd/engine/kernels/loader.py binds each with ctypes, and tests/test_kernel_header.py checks those argtypes
 * against the prototypes here) and the structs and codes that Python and C share. Every source file includes it.
 *
 * The library, one per machine, built by loader.py with the machine's C compiler:
 *   chatd_kernels.h       this file: what the library exports
 *   kernels_impl.h        inside the library: the dispatch table's types, the limits, and the ISA-independent
 *                         helpers every variant shares (bf16 rounding, the pool's rows, the block walk, the
 *                         online softmax's bookkeeping, the tile layouts, x's int8 rounding rule)
 *   simd_avx2.h, simd_avx512.h   the vector helpers of one instruction set (bf16 conversions, e^x, reductions)
 *   dispatch.c            the table: which variant of each op family a struct chatd_kernels runs
 *   <family>.c            an op family's ISA-independent part: the work shared out over the threads, the
 *                         merge of partial results, the choice between a variant's paths
 *   <family>_scalar.c     the family's portable reference, plain C that any CPU runs
 *   <family>_avx2.c, <family>_avx512.c, matmul_amx.c
 *                         the family's vector loops for one instruction set, each file compiled with that
 *                         set's -m flags (loader.py's SOURCES), so that the library built on any x86-64
 *                         machine holds every variant; on other machines only the portable files are built
 *   step.c                a whole forward step of the q4 model, through the same table
 * The families: attention (decode attention over the paged KV pool), elementwise (RoPE with the K/V write, the
 * residual add with RMSNorm, SiLU x up, bf16 conversions) and matmul (the Q4_1 and Q8_0 tile matmuls).
 *
 * Dispatch: the caller owns a struct chatd_kernels (chatd_kernels_size() bytes, opaque) and fills it once with
 * chatd_kernels_init from the CPU features it may use (CHATD_CPU_*, below: loader.py passes those of
 * chatd.engine.kernels.cpu.cpu_features(), after CHATD_CPU_ISA's cap). Every kernel takes it and runs the
 * variants it names, so two of them in one process run their own variants side by side (the tests load one
 * per variant): nothing in the library is a process-wide setting.
 */
#ifndef CHATD_KERNELS_H
#define CHATD_KERNELS_H

#include <stdint.h>

/* kv_type: how the pool stores K and V. An int8 position of a head is a row of head_dim int8 values followed by
 * its fp32 scale (CHATD_KV_SCALE_BYTES, native byte order): value d is q[d] * scale, scale = max|x| / 127,
 * q[d] = round-to-even(x[d] / scale) (0 where the row is all zeros), as chatd.engine.pool.paged.quantize_rows. */
#define CHATD_KV_F32 0
#define CHATD_KV_BF16 1
#define CHATD_KV_INT8 2
#define CHATD_KV_SCALE_BYTES 4

/* The CPU features chatd_kernels_init may use, as bits. Each implies the ones above it (the loader passes a
 * feature only with its prerequisites): the AVX-512 files are also compiled with AVX2's flags. */
#define CHATD_CPU_AVX2 1        /* avx2, fma, f16c (x86-64-v3's vector units) */
#define CHATD_CPU_AVX512 2      /* avx512f, avx512bw, avx512vl */
#define CHATD_CPU_AVX512_VNNI 4 /* avx512_vnni */
#define CHATD_CPU_AVX512_BF16 8 /* avx512_bf16 */
#define CHATD_CPU_AMX 16        /* amx_tile, amx_int8, amx_bf16 (and the process's permission, asked at init) */

/* Which variant the attention and element-wise ops run (chatd_kernels_isa). */
#define CHATD_ISA_SCALAR 0
#define CHATD_ISA_AVX2 1
#define CHATD_ISA_AVX512 2

/* The tile matmul kinds (chatd_q4_matmul_kind). The scalar one is the portable reference: it computes the
 * vector kernels' bits, and runs only where chosen (chatd_q4_matmul_select), never by the CPU's features. */
#define CHATD_MATMUL_NONE 0
#define CHATD_MATMUL_VNNI 1
#define CHATD_MATMUL_AMX 2
#define CHATD_MATMUL_AVX2 3
#define CHATD_MATMUL_SCALAR 4

/* The variants one caller runs (kernels_impl.h has its members). */
struct chatd_kernels;

/* One layer's weights and pool (pointers into tensors the caller keeps alive). */
struct chatd_layer {
    const float *attn_norm, *ffn_norm;       /* [hidden] fp32 */
    const uint8_t *qkv, *o, *gate_up, *down; /* Q4_1 weights packed for the tile kernel in effect */
    void *keys, *values;                     /* this layer's K and V of KV head 0 in the pool */
};

/* The model's sizes and the pool's layout. */
struct chatd_shape {
    int num_layers, hidden, num_heads, num_kv_heads, head_dim, inter, vocab, block_size;
    int kv_type; /* the pool's K/V storage, CHATD_KV_* */
    float eps, scale;
    int64_t head_stride; /* elements from one KV head's slots to the next's */
};

/* ---------------------------------------------------------------- dispatch (dispatch.c) */

/* The bytes of a struct chatd_kernels, for the caller to allocate. */
int64_t chatd_kernels_size(void);

/* Fill `kernels` from the CPU features its caller may use (CHATD_CPU_* bits): the widest attention and
 * element-wise variant they allow, and the best tile matmul (AMX where the process is granted the tiles, else
 * AVX512-VNNI, else AVX2, else none), AMX taking calls of 16 rows or more. */
void chatd_kernels_init(struct chatd_kernels *kernels, int features);

/* CHATD_ISA_* of the attention and element-wise ops `kernels` runs. */
int chatd_kernels_isa(const struct chatd_kernels *kernels);

/* CHATD_MATMUL_* of the tile matmul `kernels` runs (and so the layout its weights need). */
int chatd_q4_matmul_kind(const struct chatd_kernels *kernels);

/* Run the tile matmul `kind` from now on where `kernels`' features have it (the vector kernels also where AMX
 * runs, AVX2 where AVX512-VNNI does, the scalar reference anywhere: tests compare them), the best one for
 * CHATD_MATMUL_NONE; returns the kind in effect. The weights' layout follows the kind (AVX2's and the scalar
 * reference's are AVX512-VNNI's). */
int chatd_q4_matmul_select(struct chatd_kernels *kernels, int kind);

/* Where AMX runs, calls of `rows` rows or more take it, fewer the vector kernel; 0 keeps the setting (tests take
 * 1: AMX for every call). Returns the setting in effect. */
int chatd_q4_matmul_amx_rows(struct chatd_kernels *kernels, int rows);

/* ---------------------------------------------------------------- the tile matmul (matmul.c) */

/* y [m, n] bf16 = x [m, k] bf16 (contiguous) @ W^T, W packed in the layout of the kind in effect ([n / 16][k /
 * 32] tiles, Q8_0 ones where q8; with AMX the AMX tiles, then the same tiles in the vector layout); n a
 * multiple of 16, k of 32. Returns 0; -1 where no kernel runs here, -2 when scratch memory could not be had. */
int chatd_q4_matmul(const struct chatd_kernels *kernels, const uint16_t *x, int m, int k, const uint8_t *tiles,
                    int q8, int n, uint16_t *y, int num_threads);

/* ---------------------------------------------------------------- decode attention (attention.c) */

/* 1 where the kernel takes a group of `group` query heads per KV head, heads of `head_dim` and blocks of
 * `block_size` positions. */
int chatd_decode_attention_limits(int group, int head_dim, int block_size);

/* Into how many ranges of blocks the decode kernel splits each (row, KV head) pair of a call: `pairs` pairs
 * whose longest sequence has `blocks` blocks, on `num_threads` threads (1: each pair whole). */
int chatd_decode_attention_parts(int pairs, int blocks, int num_threads);

/* q: query rows, [.., num_heads, head_dim] with row stride q_row_stride (elements); row r of the call is
 *    row_index[r]. out: [.., num_heads * head_dim] contiguous rows; the call's row r goes to out row row_index[r].
 * keys, values: this layer's K and V of KV head 0, fp32, bf16 or int8 rows (kv_type); head h starts head_stride
 * elements further (a slot's position starts at slot * (head_dim, plus the scale's 4 for int8)).
 * tables: [rows, table_stride] block ids; lengths: [rows] positions each row attends (its cache, new token
 * included). */
void chatd_decode_attention(const struct chatd_kernels *kernels, const float *q, int64_t q_row_stride,
                            const int32_t *row_index, float *out, const void *keys, const void *values,
                            int64_t head_stride, const int32_t *tables, int64_t table_stride, const int32_t *lengths,
                            int rows, int num_heads, int num_kv_heads, int head_dim, int block_size, float scale,
                            int num_threads, int kv_type);

/* ---------------------------------------------------------------- element-wise steps (elementwise.c) */

/* RoPE and the K/V write of one layer for every row of a step. qkv: rows of [num_heads + 2 * num_kv_heads,
 * head_dim] (Q heads, then K, then V), row stride row_stride elements; the Q and K heads are rotated in place at
 * the row's position (transformers' half-split convention, cos / sin tables [max_positions, head_dim]), then the
 * row's K and V heads are written into this layer's pool at the row's slot (head h of K at keys + h * head_stride
 * + slot * row elements) as fp32, rounded to bf16, or as an int8 row (kv_type). The same bits as torch's ops. */
void chatd_rope_write(const struct chatd_kernels *kernels, float *qkv, int64_t row_stride, const int64_t *positions,
                      const float *cos_table, const float *sin_table, void *keys, void *values, int64_t head_stride,
                      const int64_t *slots, int rows, int num_heads, int num_kv_heads, int head_dim, int num_threads,
                      int kv_type);

/* The residual add and the RMSNorm that follows it, for every row:
 *   h[r] += add[r] (bf16, row stride add_stride elements; skipped when add is NULL), in place, in fp32;
 *   out[r] = bf16((h[r] * 1/sqrt(mean(h[r]^2) + eps)) * weight), out contiguous [rows, hidden]. */
void chatd_add_rms_norm(const struct chatd_kernels *kernels, float *h, const uint16_t *add, int64_t add_stride,
                        const float *weight, float eps, uint16_t *out, int rows, int hidden, int num_threads);

/* The MLP's activation: gate_up rows are [gate (inter) | up (inter)] in bf16, contiguous;
 * out[r, j] = bf16(silu(gate[r, j]) * up[r, j]), out contiguous [rows, inter]. */
void chatd_silu_mul(const struct chatd_kernels *kernels, const uint16_t *gate_up, uint16_t *out, int rows, int inter,
                    int num_threads);

/* ---------------------------------------------------------------- a whole forward step (step.c) */

/* h: [rows, hidden] fp32, the rows' embeddings, left holding the residual stream after the last layer.
 * positions, slots: [rows] int64 (each row's position, and its slot in the pool); cos_table, sin_table:
 * [max_positions, head_dim] (positions are checked by the caller). tables: [rows, table_stride] int32 block
 * ids, lengths: [rows] positions each row attends (its own included). last: [num_last] rows whose logits are
 * wanted; logits: [num_last, vocab] bf16. Returns 0; -1 where no tile kernel runs, -2 without memory. */
int chatd_forward_step(const struct chatd_kernels *kernels, const struct chatd_shape *s,
                       const struct chatd_layer *layers, const float *final_norm, const uint8_t *lm_head, float *h,
                       int rows, const int64_t *positions, const float *cos_table, const float *sin_table,
                       const int64_t *slots, const int32_t *tables, int64_t table_stride, const int32_t *lengths,
                       const int32_t *last, int num_last, uint16_t *logits, int num_threads);

#endif
