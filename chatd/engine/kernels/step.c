/* A whole forward step of the q4 model in one call (chatd/engine/model/forward.py's LlamaForward.step takes it when
 * every projection is on the tile kernel and every run attends through the native kernel: decode steps and
 * short prompt chunks).
 *
 * It calls the same kernels in the same order as the step's Python loop does with the native kernels and
 * bf16 projections, on the same buffers' values, so its logits equal that loop's bit for bit (the tests
 * compare them). What it saves is the loop itself: per layer nine kernel calls through ctypes, each with its
 * checks and tensors made around it, and the interpreter lock taken back between them, which the event loop's
 * thread then has to wait for (docs/performance.md, "A turn's store calls on plain sqlite3, and a whole q4 step in
 * one native call"). One call holds no lock for the whole step. It runs the variants `kernels` names, as the
 * loop's calls do.
 *
 * Per layer, for rows x of the step (h: the residual stream, fp32):
 *   x = rms_norm(h += pending) (bf16); qkv = x @ Wqkv (bf16, widened to fp32); RoPE and the K/V write into
 *   the pool; attention of the Q heads over each row's block table (fp32), rounded to bf16; h += that @ Wo;
 *   x = rms_norm(h) (bf16); pending = silu_mul(x @ Wgate_up) @ Wdown (bf16).
 * Then h += pending, the final norm of the rows whose logits are wanted, and the LM head (Q8_0) into bf16.
 */
#include <stdlib.h>

#include "kernels_impl.h"

int chatd_forward_step(const struct chatd_kernels *kernels, const struct chatd_shape *s,
                       const struct chatd_layer *layers, const float *final_norm, const uint8_t *lm_head, float *h,
                       int rows, const int64_t *positions, const float *cos_table, const float *sin_table,
                       const int64_t *slots, const int32_t *tables, int64_t table_stride, const int32_t *lengths,
                       const int32_t *last, int num_last, uint16_t *logits, int num_threads)
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
            chatd_add_rms_norm(kernels, h, l > 0 ? pending : NULL, hidden, w->attn_norm, s->eps, x, rows, hidden,
                               num_threads);
            if ((status = chatd_q4_matmul(kernels, x, rows, hidden, w->qkv, 0, qkv_n, qkv, num_threads)) != 0)
                break;
            chatd_widen_bf16_rows(kernels, qkv, qkv32, rows, qkv_n, num_threads);
            chatd_rope_write(kernels, qkv32, qkv_n, positions, cos_table, sin_table, w->keys, w->values,
                             s->head_stride, slots, rows, s->num_heads, s->num_kv_heads, s->head_dim, num_threads,
                             s->kv_type);
            chatd_decode_attention(kernels, qkv32, qkv_n, order, attention32, w->keys, w->values, s->head_stride,
                                   tables, table_stride, lengths, rows, s->num_heads, s->num_kv_heads, s->head_dim,
                                   s->block_size, s->scale, num_threads, s->kv_type);
            chatd_round_bf16_rows(kernels, attention32, attention, rows, q_n, num_threads);
            status = chatd_q4_matmul(kernels, attention, rows, q_n, w->o, 0, hidden, attended, num_threads);
            if (status != 0)
                break;
            chatd_add_rms_norm(kernels, h, attended, hidden, w->ffn_norm, s->eps, x, rows, hidden, num_threads);
            status = chatd_q4_matmul(kernels, x, rows, hidden, w->gate_up, 0, 2 * inter, gate_up, num_threads);
            if (status != 0)
                break;
            chatd_silu_mul(kernels, gate_up, act, rows, inter, num_threads);
            status = chatd_q4_matmul(kernels, act, rows, inter, w->down, 0, hidden, pending, num_threads);
        }
        if (status == 0) {
            chatd_add_rms_norm(kernels, h, s->num_layers > 0 ? pending : NULL, hidden, final_norm, s->eps, x, rows,
                               hidden, num_threads);
            for (int i = 0; i < num_last; i++)
                for (int d = 0; d < hidden; d++)
                    final_rows[(int64_t)i * hidden + d] = x[(int64_t)last[i] * hidden + d];
            status =
                chatd_q4_matmul(kernels, final_rows, num_last, hidden, lm_head, 1, s->vocab, logits, num_threads);
        }
    }
    free(half);
    free(single);
    free(order);
    return status;
}
