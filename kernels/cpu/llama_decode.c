/*
 * The decoder layers of a Llama-family model for a decode step (one token per request, any
 * number of requests) on the CPU, in one call: float32 activations, the projections'
 * weights panel-packed (gemm.h, through projection.h) in float32, bf16, int8 weight-only,
 * W8A8 or a GGUF's blocks (Q4_1, Q8_0, Q4_0, Q4_K, Q5_K, Q6_K), each projection in its own
 * format, or in parts of several (decode_layer.h's proj_weight: a Q4_K_M file's Q4_K q/k
 * and Q6_K v). Row-major weights are not read (their format codes are retired,
 * projection.h).
 *
 * At a few tokens the layers are bound by streaming their weights from memory (14 MB a
 * layer for SmolLM2-135M) and everything else is small; but layer by layer from Python each
 * layer is ~12 torch ops and kernel calls, ~130 us, 4 ms of a 19 ms step. Here one OpenMP
 * region runs every layer: the projections split by panels across the threads, each
 * thread taking the rest of another's share once done with its own (proj_shared,
 * projection.h); the per-token work (residual add, RMSNorm, SiLU-and-mul) done by every
 * thread on its own copy of the residual stream, which is cheaper than a barrier.
 * Attention splits every token's context into parts at fixed absolute positions
 * (attention.h), shares the (token, part) tasks over the threads and every thread combines
 * each token's parts in order on its own copy, with the very functions of the layerwise kernel
 * (paged_decode_attention.c): a token's arithmetic depends on its seq_len alone, not on
 * how many tokens the step has or which path ran it, so a verification step of k + 1 rows,
 * a prefill and a decode agree bit for bit and greedy speculative decoding keeps the very
 * tokens of plain decoding. Six barriers a
 * layer (after qkv, the K/V write, attention, o, gate_up and down; one more with LoRA and
 * one more in a tree step, see below), one of them between
 * writing every token's K/V and any token attending: the
 * tokens of one request (speculative decoding's verified tokens, each its own row with its
 * own position and seq_len) read the slots the tokens before them write. A tree
 * verification step (EAGLE-2 drafts) has one more, after copying the step's K/V into its
 * node rows' scratch slots (decode_layer.h's tree_src/tree_dst; each node row's own block
 * table ends in them): a node row then attends over its context and ancestors exactly as a
 * chain's row at its position would, the layer path's bits (worker/spec_tree.py).
 *
 * Per layer, with x the previous layer's output (the embeddings for layer 0):
 *   residual += x (layer 0: residual = x);  h = rms_norm(residual) * input_norm
 *   qkv = h qkv^T (+ qkv_bias);  q, k: per-head RMSNorm (q_norm/k_norm, Qwen3), then RoPE
 *   k, v -> the paged cache at slot_mapping;  attn = decode attention over the context
 *   x = attn o^T;  residual += x;  h = rms_norm(residual) * post_norm
 *   x = silu_and_mul(h gate_up^T) down^T
 * and at the end x = rms_norm(residual + x) * final_norm: the arithmetic of
 * LlamaDecoderLayer.forward, which stays the reference the tests compare this with.
 * Optionally (EAGLE-3's auxiliary hidden states) the residual stream into some layers
 * (`residual` after the layer's first line) is copied out as well.
 *
 * With LoRA (`lora` not NULL), every token whose `token_slots` entry is >= 0 adds its
 * adapter's update to each projection's output (lora.h's rows, as the layer path's
 * lora_apply computes them), the tokens of a slot in blocks and the work split over the
 * threads as lora_decode.h describes: one barrier more a layer (after gate_up's expand).
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "activation.h"
#include "attention.h"
#include "decode_layer.h"
#include "layernorm.h"
#include "lora_decode.h"
#include "projection.h"
#include "rotary_embedding.h"

static void head_rms_norm(float *restrict x, const float *restrict weight, int64_t num_heads,
                          int64_t head_dim, float eps) {
    for (int64_t h = 0; h < num_heads; h++) {
        float *xh = x + h * head_dim;
        const float inv = inv_rms(xh, head_dim, eps);
        for (int64_t i = 0; i < head_dim; i++) xh[i] = xh[i] * inv * weight[i];
    }
}

/* What attention needs from the step, the same for every layer. */
typedef struct {
    int64_t num_heads, num_kv_heads, head_dim, q_size, kv_size, num_slots, block_size,
        table_stride;
    float eps, scale;
    int kv_bf16;
    const int64_t *positions, *slot_mapping;
    const int32_t *block_tables, *seq_lens;
    const float *cos_table, *sin_table;
} attention_step;

/* Token t's q heads from its qkv row into q: normed (q_norm, Qwen3), then rotated. */
static void prepare_q(float *restrict q, const float *restrict qkv_row,
                      const decode_layer *layer, const attention_step *s, int64_t t) {
    memcpy(q, qkv_row, sizeof(float) * (size_t)s->q_size);
    if (layer->q_norm != NULL) head_rms_norm(q, layer->q_norm, s->num_heads, s->head_dim, s->eps);
    const int64_t half = s->head_dim / 2;
    rotate_token(q, s->num_heads, s->head_dim, s->cos_table + s->positions[t] * half,
                 s->sin_table + s->positions[t] * half);
}

/* Token t's k heads normed (k_norm) and rotated in its qkv row, then its k and v written to
 * the layer's cache at its slot. */
static void write_kv(float *restrict qkv_row, const decode_layer *layer,
                     const attention_step *s, int64_t t) {
    float *k = qkv_row + s->q_size, *v = k + s->kv_size;
    if (layer->k_norm != NULL)
        head_rms_norm(k, layer->k_norm, s->num_kv_heads, s->head_dim, s->eps);
    const int64_t half = s->head_dim / 2;
    rotate_token(k, s->num_kv_heads, s->head_dim, s->cos_table + s->positions[t] * half,
                 s->sin_table + s->positions[t] * half);
    const int64_t at = s->slot_mapping[t] * s->kv_size;
    kv_store_row(layer->kv_cache, at, k, s->kv_size, s->kv_bf16);
    kv_store_row(layer->kv_cache, s->num_slots * s->kv_size + at, v, s->kv_size, s->kv_bf16);
}

/* Slot src's K and V copied to slot dst in the layer's cache (a tree node row's scratch
 * slot, decode_layer.h): the bytes as stored, what the layer path's index_copy_ moves. */
static void copy_kv_slot(const decode_layer *layer, const attention_step *s, int64_t src,
                         int64_t dst) {
    const size_t row = (size_t)s->kv_size * (s->kv_bf16 ? 2 : 4);
    char *k = layer->kv_cache, *v = k + (size_t)s->num_slots * row;
    memcpy(k + dst * row, k + src * row, row);
    memcpy(v + dst * row, v + src * row, row);
}

/* Part j of token t's attention (attention.h's fixed-position parts) into `part`: the very
 * function paged_attention_f32 runs, so a fused row has the bits of a layerwise one. */
static void attend_part(float *restrict part, const float *restrict q,
                        const decode_layer *layer, const attention_step *s, int64_t t,
                        int64_t j, float *restrict scores) {
    const void *k_cache = layer->kv_cache;
    const void *v_cache = (const char *)k_cache
                          + (size_t)(s->num_slots * s->kv_size) * (s->kv_bf16 ? 2 : 4);
    attn_compute_part(part, q, k_cache, v_cache, s->kv_bf16,
                      s->block_tables + t * s->table_stride,
                      s->seq_lens[t], j, s->num_heads, s->num_heads / s->num_kv_heads,
                      s->head_dim, s->block_size, s->block_size * s->kv_size, s->scale, scores);
}

/* The step's (token, part) tasks, tokens in order, each its attn_num_parts: tasks[2 k] is
 * task k's token, tasks[2 k + 1] its part. NULL when out of memory; *num_tasks set. */
static int64_t *part_tasks(const int32_t *seq_lens, int64_t M, int64_t block_size,
                           int64_t *num_tasks) {
    int64_t n = 0;
    for (int64_t t = 0; t < M; t++) n += attn_num_parts(seq_lens[t], block_size);
    *num_tasks = n;
    int64_t *tasks = malloc(sizeof(int64_t) * (size_t)(2 * n));
    if (tasks == NULL) return NULL;
    for (int64_t t = 0, k = 0; t < M; t++)
        for (int64_t j = 0; j < attn_num_parts(seq_lens[t], block_size); j++, k++) {
            tasks[2 * k] = t;
            tasks[2 * k + 1] = j;
        }
    return tasks;
}

/* An EAGLE-3 draft layer's input row (decode_layer.h): h [2 hidden] = [rms(emb) *
 * input_norm | rms(hidden) * eagle_hidden_norm], and the residual stream's start r. */
static void eagle_input_row(float *restrict h, float *restrict r, const float *restrict emb,
                            const float *restrict hid, const float *restrict input_norm,
                            const decode_step *d, float eps) {
    const int64_t n = d->hidden;
    rms_norm_row(h, emb, input_norm, n, eps);
    rms_norm_row(h + n, hid, d->eagle_hidden_norm, n, eps);
    memcpy(r, d->eagle_norm_before_residual ? h + n : hid, sizeof(float) * (size_t)n);
}

/* Whether every projection of every layer is a weight proj_range reads at its width
 * (proj_weight_ok); *xbuf_floats set to the largest buffer proj_prepare_x needs over them
 * for M rows of at most `wide` inputs. */
static int layers_ok(const decode_step *d, int64_t M, int64_t wide, int64_t *xbuf_floats) {
    const int64_t q_size = d->num_heads * d->head_dim, kv_size = d->num_kv_heads * d->head_dim;
    *xbuf_floats = M * wide + 16;
    for (int64_t l = 0; l < d->num_layers; l++) {
        const decode_layer *layer = d->layers + l;
        const proj_weight *w[4] = {&layer->qkv, &layer->o, &layer->gate_up, &layer->down};
        const int64_t n[4] = {q_size + 2 * kv_size, d->hidden, 2 * d->intermediate, d->hidden};
        for (int i = 0; i < 4; i++) {
            if (!proj_weight_ok(w[i], n[i])) return 0;
            for (int64_t j = 0; j < w[i]->num_parts; j++) {
                const int64_t f = proj_buffer_floats(w[i]->parts[j].fmt, M, wide);
                *xbuf_floats = f > *xbuf_floats ? f : *xbuf_floats;
            }
        }
    }
    return 1;
}

/* The step of `d` (decode_layer.h: its fields' meaning and the return value). */
int64_t llama_decode(const decode_step *d) {
    float *restrict x = d->x;
    const decode_layer *restrict layers = d->layers;
    const float *restrict final_norm = d->final_norm;
    const int64_t num_layers = d->num_layers, num_tokens = d->num_tokens, hidden = d->hidden;
    const int64_t num_heads = d->num_heads, num_kv_heads = d->num_kv_heads;
    const int64_t head_dim = d->head_dim, intermediate = d->intermediate;
    const float eps = d->eps, scale = d->scale;
    const int64_t *restrict positions = d->positions, *restrict slot_mapping = d->slot_mapping;
    const float *restrict cos_table = d->cos_table, *restrict sin_table = d->sin_table;
    const int32_t *restrict block_tables = d->block_tables, *restrict seq_lens = d->seq_lens;
    const int64_t table_stride = d->table_stride, num_blocks = d->num_blocks;
    const int64_t block_size = d->block_size;
    float *restrict aux = d->aux;
    const int64_t *restrict aux_layers = d->aux_layers;
    const int64_t num_aux = d->num_aux;
    const lora_layer *restrict lora = d->lora;
    const int32_t *restrict token_slots = d->token_slots;
    const int64_t lora_rank = d->lora_rank;
    const int lora_bf16 = d->lora_bf16, num_threads = d->num_threads;
    const int64_t M = num_tokens, q_size = num_heads * head_dim;
    const int64_t kv_size = num_kv_heads * head_dim, qkv_size = q_size + 2 * kv_size;
    float *restrict eagle_hidden = d->eagle_hidden;
    /* Layer 0's qkv input: 2 hidden wide for an EAGLE-3 draft layer. */
    const int64_t qkv_in0 = eagle_hidden != NULL ? 2 * hidden : hidden;
    const attention_step step = {
        .num_heads = num_heads, .num_kv_heads = num_kv_heads, .head_dim = head_dim,
        .q_size = q_size, .kv_size = kv_size, .num_slots = num_blocks * block_size,
        .block_size = block_size, .table_stride = table_stride, .eps = eps, .scale = scale,
        .kv_bf16 = d->kv_bf16, .positions = positions, .slot_mapping = slot_mapping, .block_tables = block_tables,
        .seq_lens = seq_lens, .cos_table = cos_table, .sin_table = sin_table};
    int64_t wide = hidden > intermediate ? hidden : intermediate;
    wide = wide > q_size ? wide : q_size;
    wide = wide > qkv_in0 ? wide : qkv_in0;
    int64_t xbuf_floats;
    if (!layers_ok(d, M, wide, &xbuf_floats)) return -2;
    int64_t bad = 0;
    for (int64_t t = 0; t < M; t++)
        bad += slot_mapping[t] < 0 || slot_mapping[t] >= step.num_slots;
    const int64_t num_tree_copies = d->num_tree_copies;
    for (int64_t i = 0; i < num_tree_copies; i++)
        bad += d->tree_src[i] < 0 || d->tree_src[i] >= step.num_slots || d->tree_dst[i] < 0 ||
               d->tree_dst[i] >= step.num_slots;
    if (bad) return bad;
    /* A part of a token's attention: [o: q_size | max: num_heads | sum: num_heads]. */
    const int64_t part_stride = attn_part_floats(num_heads, head_dim);
    int64_t num_parts;
    int64_t *tasks = part_tasks(seq_lens, M, block_size, &num_parts);
    if (tasks == NULL) return -1;
    /* Shared: the qkv projection, every token's attention parts, the gate_up projection,
     * the LoRA shrinks; the K/V loop's token blocks (lora_decode.h). */
    const int64_t attn_floats = num_parts * part_stride;
    const int64_t R = lora == NULL ? 0 : lora_rank;
    float *shared = malloc(sizeof(float) * (size_t)(M * (qkv_size + 2 * intermediate) + attn_floats +
                                                    lora_step_floats(M, R)));
    int64_t *kv_rows = malloc(sizeof(int64_t) * (size_t)(3 * M));
    if (shared == NULL || kv_rows == NULL) {
        free(kv_rows);
        free(shared);
        free(tasks);
        return -1;
    }
    float *qkv = shared, *gate_up = qkv + M * qkv_size, *attn = gate_up + M * 2 * intermediate;
    lora_step ls = {.R = R, .bf16 = lora_bf16};
    lora_step_init(&ls, attn + attn_floats, M, R);
    const int64_t num_kv_blocks =
        lora_step_blocks(&ls, kv_rows, kv_rows + M, lora == NULL ? NULL : token_slots, M);
    /* Claim counters of every projection of the step: [num_layers, 4, num_threads]. */
    proj_claim *claims = calloc((size_t)(num_layers * 4 * num_threads), sizeof(proj_claim));
    if (claims == NULL) {
        free(kv_rows);
        free(shared);
        free(tasks);
        return -1;
    }
    int failed = 0;
    const int64_t qkv_slices[3] = {q_size, kv_size, kv_size};
    const int64_t gate_up_slices[2] = {intermediate, intermediate};
    const int64_t hidden_slices[1] = {hidden};

#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
        /* Private: the residual stream, the normed input of a projection, a rotated q,
         * every token's combined attention, one part's scores. */
        const int64_t score_floats = num_heads * attn_part_len(block_size);
        float *residual = malloc(sizeof(float) * (size_t)(M * (hidden + wide + q_size) + q_size +
                                                          score_floats + xbuf_floats));
        float *h = residual + M * hidden, *own_attn = h + M * wide, *q = own_attn + M * q_size;
        float *scores = q + q_size;
        /* A projection's input as its weight's parts read it (proj_prepare_x). */
        float *xbuf = scores + score_floats;
        /* A thread without memory skips the work but still meets every barrier. */
        const int ok = residual != NULL;
        failed = !ok;
        for (int64_t l = 0; l < num_layers; l++) {
            const decode_layer *layer = layers + l;
            proj_claim *c = claims + l * 4 * num_threads;
            if (ok) {
                const int64_t qkv_in = l == 0 ? qkv_in0 : hidden;
                if (l > 0) {  /* x with the last layer's down update (lora_decode.h) */
                    memcpy(h, x, sizeof(float) * (size_t)(M * hidden));
                    if (ls.nb > 0)
                        lora_step_expand(&ls, h, hidden, ls.u_down, &lora[l - 1].down,
                                         hidden_slices, 1, hidden, 0, hidden);
                }
                for (int64_t t = 0; t < M; t++) {
                    float *ht = h + t * qkv_in, *rt = residual + t * hidden;
                    if (l == 0 && eagle_hidden != NULL) {
                        eagle_input_row(ht, rt, x + t * hidden, eagle_hidden + t * hidden,
                                        layer->input_norm, d, eps);
                    } else if (l == 0) {
                        memcpy(rt, x + t * hidden, sizeof(float) * (size_t)hidden);
                        rms_norm_row(ht, rt, layer->input_norm, hidden, eps);
                    } else {
                        fused_add_rms_norm_row(ht, rt, layer->input_norm, hidden, eps);
                    }
                }
                /* The residual stream into this layer, where asked for (every thread holds
                 * the same copy: one writes it out). */
                if (aux != NULL && tid == 0)
                    for (int64_t j = 0; j < num_aux; j++)
                        if (aux_layers[j] == l)
                            for (int64_t t = 0; t < M; t++)
                                memcpy(aux + (t * num_aux + j) * hidden, residual + t * hidden,
                                       sizeof(float) * (size_t)hidden);
                if (ls.nb > 0)
                    lora_step_shrink(&ls, ls.u_qkv, h, qkv_in, &lora[l].qkv, 3, hidden, tid, nt);
                proj_shared(qkv, proj_prepare_x(xbuf, h, M, qkv_in, &layer->qkv), &layer->qkv,
                            layer->qkv_bias, M, qkv_size, qkv_in, tid, nt, c);
            }
#pragma omp barrier
            /* Every token's K/V into the cache before any token attends: the tokens of one
             * request (speculative decoding verifies several, each its own row) read the
             * slots the ones before them write. */
#pragma omp for schedule(static)
            for (int64_t b = 0; b < num_kv_blocks; b++) {
                if (!ok) continue;
                if (b < ls.nb)
                    lora_step_expand_block(&ls, b, qkv, qkv_size, ls.u_qkv, &lora[l].qkv,
                                           qkv_slices, 3, qkv_size, 0, qkv_size);
                for (int64_t i = 0; i < kv_rows[M + 2 * b + 1]; i++) {
                    const int64_t t = kv_rows[kv_rows[M + 2 * b] + i];
                    write_kv(qkv + t * qkv_size, layer, &step, t);
                }
            }
            /* implicit barrier: the step's K/V written */
            if (num_tree_copies > 0) {  /* then the tree rows' scratch slots (decode_layer.h) */
#pragma omp for schedule(static)
                for (int64_t i = 0; i < num_tree_copies; i++)
                    copy_kv_slot(layer, &step, d->tree_src[i], d->tree_dst[i]);
            } /* implicit barrier: every node row's context and path in place */
            /* The (token, part) tasks of every token over the threads, then every thread
             * combines every token's parts in order on its own copy (no barrier after): a
             * token's bits depend on its seq_len alone, never on M or the threads
             * (attention.h). */
            int64_t prepared = -1;  /* the token whose q is in `q` */
#pragma omp for schedule(static)
            for (int64_t k = 0; k < num_parts; k++) {
                if (!ok) continue;
                const int64_t t = tasks[2 * k], j = tasks[2 * k + 1];
                if (t != prepared) prepare_q(q, qkv + t * qkv_size, layer, &step, t);
                prepared = t;
                attend_part(attn + k * part_stride, q, layer, &step, t, j, scores);
            } /* implicit barrier: every part */
            for (int64_t t = 0, first = 0; t < M && ok; t++) {
                const int64_t n = attn_num_parts(seq_lens[t], block_size);
                attn_combine_parts(own_attn + t * q_size, attn + first * part_stride, n,
                                   num_heads, head_dim);
                first += n;
            }
            const float *attn_out = own_attn;
            if (ok) {
                if (ls.nb > 0)
                    lora_step_shrink(&ls, ls.u_o, attn_out, q_size, &lora[l].o, 1, q_size, tid, nt);
                proj_shared(x, proj_prepare_x(xbuf, attn_out, M, q_size, &layer->o), &layer->o,
                            NULL, M, hidden, q_size, tid, nt, c + num_threads);
            }
#pragma omp barrier
            if (ok) {
                memcpy(h, x, sizeof(float) * (size_t)(M * hidden));
                if (ls.nb > 0)
                    lora_step_expand(&ls, h, hidden, ls.u_o, &lora[l].o, hidden_slices, 1, hidden,
                                     0, hidden);
                for (int64_t t = 0; t < M; t++)
                    fused_add_rms_norm_row(h + t * hidden, residual + t * hidden, layer->post_norm,
                                           hidden, eps);
                if (ls.nb > 0)
                    lora_step_shrink(&ls, ls.u_gate_up, h, hidden, &lora[l].gate_up, 2, hidden,
                                     tid, nt);
                proj_shared(gate_up, proj_prepare_x(xbuf, h, M, hidden, &layer->gate_up),
                            &layer->gate_up, NULL, M, 2 * intermediate, hidden, tid, nt,
                            c + 2 * num_threads);
            }
#pragma omp barrier
            if (ls.nb > 0) {  /* gate_up's update split by columns, in place */
                int64_t begin, end;
                lora_column_share(2 * intermediate, tid, nt, &begin, &end);
                if (ok)
                    lora_step_expand(&ls, gate_up, 2 * intermediate, ls.u_gate_up,
                                     &lora[l].gate_up, gate_up_slices, 2, 2 * intermediate,
                                     begin, end);
#pragma omp barrier
            }
            if (ok) {
                for (int64_t t = 0; t < M; t++) {
                    const float *g = gate_up + t * 2 * intermediate;
                    silu_and_mul_row(h + t * intermediate, g, g + intermediate, intermediate);
                }
                if (ls.nb > 0)  /* its update applied where the next layer (or the end) reads x */
                    lora_step_shrink(&ls, ls.u_down, h, intermediate, &lora[l].down, 1,
                                     intermediate, tid, nt);
                proj_shared(x, proj_prepare_x(xbuf, h, M, intermediate, &layer->down),
                            &layer->down, NULL, M, hidden, intermediate, tid, nt,
                            c + 3 * num_threads);
            }
#pragma omp barrier
        }
        if (tid == 0 && ok && ls.nb > 0)
            lora_step_expand(&ls, x, hidden, ls.u_down, &lora[num_layers - 1].down, hidden_slices,
                             1, hidden, 0, hidden);
        if (tid == 0 && ok)
            for (int64_t t = 0; t < M; t++) {
                fused_add_rms_norm_row(x + t * hidden, residual + t * hidden, final_norm, hidden,
                                       eps);
                if (eagle_hidden != NULL)  /* the next draft step's hidden state */
                    memcpy(eagle_hidden + t * hidden, residual + t * hidden,
                           sizeof(float) * (size_t)hidden);
            }
        free(residual);
    }
    free(claims);
    free(kv_rows);
    free(shared);
    free(tasks);
    return failed ? -1 : 0;
}
