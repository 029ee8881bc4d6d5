/*
 * The decoder layers of a Llama-family model for a decode step of 1-4 tokens (one per
 * request), float32 on the CPU, in one call.
 *
 * At a few tokens the layers are bound by streaming their weights from memory (14 MB a
 * layer for SmolLM2-135M) and everything else is small; but layer by layer from Python each
 * layer is ~12 torch ops and kernel calls, ~130 us, 4 ms of a 19 ms step. Here one OpenMP
 * region runs every layer: the projections split by weight rows across the threads
 * (gemv.h); the per-token work (residual add, RMSNorm, SiLU-and-mul) done by every thread
 * on its own copy of the residual stream, which is cheaper than a barrier; RoPE, the cache
 * write and attention one request per thread. Four barriers a layer.
 *
 * Per layer, with x the previous layer's output (the embeddings for layer 0):
 *   residual += x (layer 0: residual = x);  h = rms_norm(residual) * input_norm
 *   qkv = h qkv^T (+ qkv_bias);  q, k: per-head RMSNorm (q_norm/k_norm, Qwen3), then RoPE
 *   k, v -> the paged cache at slot_mapping;  attn = decode attention over the context
 *   x = attn o^T;  residual += x;  h = rms_norm(residual) * post_norm
 *   x = silu_and_mul(h gate_up^T) down^T
 * and at the end x = rms_norm(residual + x) * final_norm: the arithmetic of
 * LlamaDecoderLayer.forward, which stays the reference the tests compare this with.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "activation.h"
#include "attention.h"
#include "gemv.h"
#include "layernorm.h"
#include "rotary_embedding.h"

/* One layer's weights, as LlamaDecoderLayer holds them (qkv_bias, q_norm, k_norm may be
 * NULL), and its KV cache [2, num_blocks, block_size, num_kv_heads, head_dim]. The Python
 * side passes an int64 tensor [num_layers, 10] of these pointers. */
typedef struct {
    const float *input_norm, *qkv, *qkv_bias, *q_norm, *k_norm, *o, *post_norm, *gate_up,
        *down;
    float *kv_cache;
} decode_layer;

static void head_rms_norm(float *restrict x, const float *restrict weight, int64_t num_heads,
                          int64_t head_dim, float eps) {
    for (int64_t h = 0; h < num_heads; h++) {
        float *xh = x + h * head_dim;
        const float inv = inv_rms(xh, head_dim, eps);
        for (int64_t i = 0; i < head_dim; i++) xh[i] = xh[i] * inv * weight[i];
    }
}

/* x [num_tokens, hidden]: the embeddings in, the final-normed hidden states out.
 * positions, slot_mapping [num_tokens] int64; block_tables [num_tokens, table_stride] and
 * seq_lens [num_tokens] int32 (as for paged_decode_attention_f32); cos/sin tables
 * [max_positions, head_dim / 2]. Returns 0; the number of slots outside the cache, having
 * written nothing; or -1 when out of memory. */
int64_t llama_decode_f32(float *restrict x, const decode_layer *restrict layers,
                         int64_t num_layers, const float *restrict final_norm,
                         int64_t num_tokens, int64_t hidden, int64_t num_heads,
                         int64_t num_kv_heads, int64_t head_dim, int64_t intermediate,
                         float eps, float scale, const int64_t *restrict positions,
                         const float *restrict cos_table, const float *restrict sin_table,
                         const int64_t *restrict slot_mapping,
                         const int32_t *restrict block_tables, int64_t table_stride,
                         const int32_t *restrict seq_lens, int64_t num_blocks,
                         int64_t block_size, int num_threads) {
    const int64_t M = num_tokens, q_size = num_heads * head_dim;
    const int64_t kv_size = num_kv_heads * head_dim, qkv_size = q_size + 2 * kv_size;
    const int64_t num_slots = num_blocks * block_size, half = head_dim / 2;
    const int64_t group = num_heads / num_kv_heads, block_stride = block_size * kv_size;
    int64_t bad = 0, max_seq_len = 1;
    for (int64_t t = 0; t < M; t++) {
        bad += slot_mapping[t] < 0 || slot_mapping[t] >= num_slots;
        if (seq_lens[t] > max_seq_len) max_seq_len = seq_lens[t];
    }
    if (bad) return bad;
    /* Shared: the qkv projection, the attention output, the gate_up projection. */
    float *shared = malloc(sizeof(float) * (size_t)(M * (qkv_size + q_size + 2 * intermediate)));
    if (shared == NULL) return -1;
    float *qkv = shared, *attn = qkv + M * qkv_size, *gate_up = attn + M * q_size;
    const int64_t wide = hidden > intermediate ? hidden : intermediate;
    int failed = 0;

#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
        /* Private: the residual stream, the normed input of a projection, attention scores. */
        float *residual = malloc(sizeof(float) *
                                 (size_t)(M * (hidden + wide) + num_heads * max_seq_len));
        float *h = residual + M * hidden, *scores = h + M * wide;
        /* A thread without memory skips the work but still meets every barrier. */
        const int ok = residual != NULL;
        failed = !ok;
        for (int64_t l = 0; l < num_layers; l++) {
            const decode_layer *layer = layers + l;
            if (ok) {
                for (int64_t t = 0; t < M; t++) {
                    float *ht = h + t * hidden, *rt = residual + t * hidden;
                    if (l == 0) {
                        memcpy(rt, x + t * hidden, sizeof(float) * (size_t)hidden);
                        rms_norm_row(ht, rt, layer->input_norm, hidden, eps);
                    } else {
                        memcpy(ht, x + t * hidden, sizeof(float) * (size_t)hidden);
                        fused_add_rms_norm_row(ht, rt, layer->input_norm, hidden, eps);
                    }
                }
                gemv_part(qkv, h, layer->qkv, layer->qkv_bias, M, qkv_size, hidden, tid, nt);
            }
#pragma omp barrier
            float *k_cache = layer->kv_cache, *v_cache = k_cache + num_slots * kv_size;
#pragma omp for schedule(static)
            for (int64_t t = 0; t < M; t++) {
                if (!ok) continue;
                float *q = qkv + t * qkv_size, *k = q + q_size, *v = k + kv_size;
                if (layer->q_norm != NULL) {
                    head_rms_norm(q, layer->q_norm, num_heads, head_dim, eps);
                    head_rms_norm(k, layer->k_norm, num_kv_heads, head_dim, eps);
                }
                /* q and k heads are adjacent: one rotation over both. */
                rotate_token(q, num_heads + num_kv_heads, head_dim,
                             cos_table + positions[t] * half, sin_table + positions[t] * half);
                memcpy(k_cache + slot_mapping[t] * kv_size, k, sizeof(float) * (size_t)kv_size);
                memcpy(v_cache + slot_mapping[t] * kv_size, v, sizeof(float) * (size_t)kv_size);
                attend_request(attn + t * q_size, q, k_cache, v_cache,
                               block_tables + t * table_stride, seq_lens[t], num_heads, group,
                               head_dim, block_size, block_stride, scale, scores);
            } /* implicit barrier: attn complete */
            if (ok) gemv_part(x, attn, layer->o, NULL, M, hidden, q_size, tid, nt);
#pragma omp barrier
            if (ok) {
                for (int64_t t = 0; t < M; t++) {
                    float *ht = h + t * hidden;
                    memcpy(ht, x + t * hidden, sizeof(float) * (size_t)hidden);
                    fused_add_rms_norm_row(ht, residual + t * hidden, layer->post_norm, hidden,
                                           eps);
                }
                gemv_part(gate_up, h, layer->gate_up, NULL, M, 2 * intermediate, hidden, tid,
                          nt);
            }
#pragma omp barrier
            if (ok) {
                for (int64_t t = 0; t < M; t++) {
                    const float *g = gate_up + t * 2 * intermediate;
                    silu_and_mul_row(h + t * intermediate, g, g + intermediate, intermediate);
                }
                gemv_part(x, h, layer->down, NULL, M, hidden, intermediate, tid, nt);
            }
#pragma omp barrier
        }
        if (tid == 0 && ok)
            for (int64_t t = 0; t < M; t++)
                fused_add_rms_norm_row(x + t * hidden, residual + t * hidden, final_norm, hidden,
                                       eps);
        free(residual);
    }
    free(shared);
    return failed ? -1 : 0;
}
