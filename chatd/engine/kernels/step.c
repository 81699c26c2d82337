/* A whole forward step of the q4 model in one call (chatd/engine/model/forward.py's LlamaForward.step takes it when
 * every projection is on the tile kernel and every run attends through the native kernel: decode steps and
 * short prompt chunks).
 *
 * It calls the same kernels in the same order as the step's Python loop does with the native kernels and
 * bf16 projections, on the same buffers' values, so its logits equal that loop's bit for bit (the tests
 * compare them). What it saves is the loop itself: per layer nine kernel calls through ctypes, each with its
 * checks and tensors made around it (about 40 us a layer, 1.2 ms of a 30-layer step), and the interpreter
 * lock taken back between them, which the event loop's thread then has to wait for. One call holds no lock
 * for the whole step.
 *
 * Per layer, for rows x of the step (h: the residual stream, fp32):
 *   x = rms_norm(h += pending) (bf16); qkv = x @ Wqkv (bf16, widened to fp32); RoPE and the K/V write into
 *   the pool; attention of the Q heads over each row's block table (fp32), rounded to bf16; h += that @ Wo;
 *   x = rms_norm(h) (bf16); pending = silu_mul(x @ Wgate_up) @ Wdown (bf16).
 * Then h += pending, the final norm of the rows whose logits are wanted, and the LM head (Q8_0) into bf16.
 */
#include <stdint.h>
#include <stdlib.h>

/* The kernels this step runs (decode_attention.c, tile_matmul.c). */
void chatd_add_rms_norm(float *h, const uint16_t *add, int64_t add_stride, const float *weight, float eps,
                        uint16_t *out, int rows, int hidden, int num_threads);
void chatd_rope_write(float *qkv, int64_t row_stride, const int64_t *positions, const float *cos_table,
                      const float *sin_table, void *keys, void *values, int64_t head_stride, const int64_t *slots,
                      int rows, int num_heads, int num_kv_heads, int head_dim, int num_threads, int kv_type);
void chatd_decode_attention(const float *q, int64_t q_row_stride, const int32_t *row_index, float *out,
                            const void *keys, const void *values, int64_t head_stride, const int32_t *tables,
                            int64_t table_stride, const int32_t *lengths, int rows, int num_heads, int num_kv_heads,
                            int head_dim, int block_size, float scale, int num_threads, int kv_type);
void chatd_silu_mul(const uint16_t *gate_up, uint16_t *out, int rows, int inter, int num_threads);
void chatd_widen_bf16_rows(const uint16_t *x, float *out, int rows, int64_t n, int num_threads);
void chatd_round_bf16_rows(const float *x, uint16_t *out, int rows, int64_t n, int num_threads);
int chatd_q4_matmul(const uint16_t *x, int m, int k, const uint8_t *tiles, int q8, int n, uint16_t *y,
                    int num_threads);

/* One layer's weights and pool (pointers into tensors the caller keeps alive). */
struct chatd_layer {
    const float *attn_norm, *ffn_norm;             /* [hidden] fp32 */
    const uint8_t *qkv, *o, *gate_up, *down;       /* Q4_1 weights packed for the tile kernel in effect */
    void *keys, *values;                           /* this layer's K and V of KV head 0 in the pool */
};

/* The model's sizes and the pool's layout. */
struct chatd_shape {
    int num_layers, hidden, num_heads, num_kv_heads, head_dim, inter, vocab, block_size;
    int kv_type; /* the pool's K/V storage: 0 fp32, 1 bf16, 2 int8 rows (decode_attention.c) */
    float eps, scale;
    int64_t head_stride; /* elements from one KV head's slots to the next's */
};

/* h: [rows, hidden] fp32, the rows' embeddings, left holding the residual stream after the last layer.
 * positions, slots: [rows] int64 (each row's position, and its slot in the pool); cos_table, sin_table:
 * [max_positions, head_dim] (positions are checked by the caller). tables: [rows, table_stride] int32 block
 * ids, lengths: [rows] positions each row attends (its own included). last: [num_last] rows whose logits are
 * wanted; logits: [num_last, vocab] bf16. Returns 0; -1 where no tile kernel runs, -2 without memory. */
int chatd_forward_step(const struct chatd_shape *s, const struct chatd_layer *layers, const float *final_norm,
                       const uint8_t *lm_head, float *h, int rows, const int64_t *positions, const float *cos_table,
                       const float *sin_table, const int64_t *slots, const int32_t *tables, int64_t table_stride,
                       const int32_t *lengths, const int32_t *last, int num_last, uint16_t *logits,
                       int num_threads)
{
    const int hidden = s->hidden, qkv_n = (s->num_heads + 2 * s->num_kv_heads) * s->head_dim;
    const int q_n = s->num_heads * s->head_dim, inter = s->inter;
    const int64_t r = rows;
    /* bf16 buffers: x (norm outputs), qkv, attention (rounded), gate_up, act, pending, attended, final rows */
    const int64_t halves = r * hidden + r * qkv_n + r * q_n + r * 2 * inter + r * inter + 2 * r * hidden +
                           (int64_t)num_last * hidden;
    const int64_t floats = r * qkv_n + r * q_n;
    uint16_t *half = malloc(sizeof(uint16_t) * (size_t)halves);
    float *single = malloc(sizeof(float) * (size_t)floats);
    int32_t *order = malloc(sizeof(int32_t) * (size_t)(rows > 0 ? rows : 1));
    int status = half != NULL && single != NULL && order != NULL ? 0 : -2;
    if (status == 0) {
        uint16_t *x = half, *qkv = x + r * hidden, *attention = qkv + r * qkv_n, *gate_up = attention + r * q_n;
        uint16_t *act = gate_up + r * 2 * inter, *pending = act + r * inter, *attended = pending + r * hidden;
        uint16_t *final_rows = attended + r * hidden;
        float *qkv32 = single, *attention32 = qkv32 + r * qkv_n;
        for (int i = 0; i < rows; i++)
            order[i] = i;
        for (int l = 0; l < s->num_layers && status == 0; l++) {
            const struct chatd_layer *w = &layers[l];
            chatd_add_rms_norm(h, l > 0 ? pending : NULL, hidden, w->attn_norm, s->eps, x, rows, hidden,
                               num_threads);
            if ((status = chatd_q4_matmul(x, rows, hidden, w->qkv, 0, qkv_n, qkv, num_threads)) != 0)
                break;
            chatd_widen_bf16_rows(qkv, qkv32, rows, qkv_n, num_threads);
            chatd_rope_write(qkv32, qkv_n, positions, cos_table, sin_table, w->keys, w->values, s->head_stride,
                             slots, rows, s->num_heads, s->num_kv_heads, s->head_dim, num_threads, s->kv_type);
            chatd_decode_attention(qkv32, qkv_n, order, attention32, w->keys, w->values, s->head_stride, tables,
                                   table_stride, lengths, rows, s->num_heads, s->num_kv_heads, s->head_dim,
                                   s->block_size, s->scale, num_threads, s->kv_type);
            chatd_round_bf16_rows(attention32, attention, rows, q_n, num_threads);
            if ((status = chatd_q4_matmul(attention, rows, q_n, w->o, 0, hidden, attended, num_threads)) != 0)
                break;
            chatd_add_rms_norm(h, attended, hidden, w->ffn_norm, s->eps, x, rows, hidden, num_threads);
            if ((status = chatd_q4_matmul(x, rows, hidden, w->gate_up, 0, 2 * inter, gate_up, num_threads)) != 0)
                break;
            chatd_silu_mul(gate_up, act, rows, inter, num_threads);
            status = chatd_q4_matmul(act, rows, inter, w->down, 0, hidden, pending, num_threads);
        }
        if (status == 0) {
            chatd_add_rms_norm(h, s->num_layers > 0 ? pending : NULL, hidden, final_norm, s->eps, x, rows, hidden,
                               num_threads);
            for (int i = 0; i < num_last; i++)
                for (int d = 0; d < hidden; d++)
                    final_rows[(int64_t)i * hidden + d] = x[(int64_t)last[i] * hidden + d];
            status = chatd_q4_matmul(final_rows, num_last, hidden, lm_head, 1, s->vocab, logits, num_threads);
        }
    }
    free(half);
    free(single);
    free(order);
    return status;
}
