/*
 * The decoder layers of a Llama-family model for a decode step (one token per request, any
 * number of requests) on the CPU, in one call: float32 activations, the projections'
 * weights panel-packed (gemm.h, through projection.h) in float32, bf16, int8 weight-only,
 * W8A8 or a GGUF's blocks (Q4_1, Q8_0, Q4_0, Q4_K, Q5_K, Q6_K), each projection in its own
 * format, or in parts of several (decode_layer.h's proj_weight: a Q4_K_M file's Q4_K q/k
 * and Q6_K v). Row-major weights are not read (their format codes are retired,
 * projection.h).
 *
 * At a few tokens the layers are bound by streaming their weights from memory and
 * everything else is small; but layer by layer from Python each layer is ~12 torch ops and
 * kernel calls, whose fixed costs add up to a sizeable part of a small model's step (the
 * figures are in docs/benchmarks.md). Here one OpenMP
 * region runs every layer: the projections split by panels across the threads, each
 * thread taking the rest of another's share once done with its own (proj_shared,
 * projection.h); the per-token work (residual add, RMSNorm, SiLU-and-mul) done by every
 * thread on its own copy of the residual stream, which is cheaper than a barrier.
 * Attention splits every token's context into parts at fixed absolute positions
 * (attention.h), shares the tasks (a part of a token, or of a run of one request's
 * consecutive tokens, which reads each position's K/V once; or some of its KV heads, where
 * there are too few parts to go round) over the threads and every
 * thread combines
 * each token's parts in order on its own copy, with the very functions of the layerwise kernel
 * (paged_attention.c): a token's arithmetic depends on its seq_len alone, not on
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
 * The code follows these phases: one static function each, all called by every thread of
 * the one parallel region; decode_one_layer runs a layer's phases between its barriers.
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

/* A task of the step's attention: part `part` of `rows` consecutive tokens of one request
 * from `token` on (a verification's rows, or a lone decode token), attended together, in
 * the query heads of KV heads kv_lo .. kv_hi - 1. */
typedef struct {
    int64_t token, rows, part, kv_lo, kv_hi;
} attn_task;

/* Whether token t continues token t - 1's request: the next position, and the same block
 * table over the blocks t reads (a tree step's node rows have tables of their own), so
 * either table reads the same K/V. */
static int continues_request(const int32_t *seq_lens, const int32_t *tables,
                             int64_t table_stride, int64_t block_size, int64_t t) {
    if (seq_lens[t] != seq_lens[t - 1] + 1) return 0;
    int64_t blocks = (seq_lens[t] + block_size - 1) / block_size;
    blocks = blocks < table_stride ? blocks : table_stride; /* never past the row */
    return memcmp(tables + t * table_stride, tables + (t - 1) * table_stride,
                  sizeof(int32_t) * (size_t)blocks) == 0;
}

/* The step's tasks into `tasks` (NULL: only counted) for runs of at most `most` tokens of
 * one request, runs in token order, each run's parts in order, each part's KV heads in
 * `splits` equal ranges (splits divides num_kv_heads); returns how many. */
static int64_t plan_tasks(attn_task *tasks, const decode_step *d, int64_t most,
                          int64_t splits) {
    const int64_t per = d->num_kv_heads / splits;
    int64_t n = 0;
    for (int64_t t = 0, end; t < d->num_tokens; t = end) {
        for (end = t + 1; end < d->num_tokens && end - t < most &&
                          continues_request(d->seq_lens, d->block_tables, d->table_stride,
                                            d->block_size, end);
             end++) {
        }
        const int64_t parts = attn_num_parts(d->seq_lens[end - 1], d->block_size);
        for (int64_t j = 0; j < parts; j++)
            for (int64_t g = 0; g < splits; g++, n++)
                if (tasks != NULL) tasks[n] = (attn_task){t, end - t, j, g * per, g * per + per};
    }
    return n;
}

/* How many ranges to split each (run, part)'s KV heads into, of the divisors of
 * num_kv_heads: the fewest whose busiest thread gets the least, counted in whole (run,
 * part)s, for n of them over the threads (a lone decode token's one part, all its heads
 * on one thread while the other waited at the barrier, was 5% of a 1B model's step). */
static int64_t head_splits(const decode_step *d, int64_t n) {
    const int64_t num_kv = d->num_kv_heads, nt = d->num_threads;
    int64_t best = 1;
    double best_load = (double)((n + nt - 1) / nt);
    for (int64_t g = 2; g <= num_kv; g++) {
        if (num_kv % g != 0) continue;
        const double load = (double)((n * g + nt - 1) / nt) / (double)g;
        if (load < best_load) best = g, best_load = load;
    }
    return best;
}

/* The step's attention tasks: a request's consecutive tokens (a verification's k + 1 rows)
 * in runs of up to ATTN_ROW_BLOCK that read each position's K/V once (attend_rows; one
 * row per task read a long context's K/V once per row), their KV heads split where that
 * spreads the work better (head_splits), runs halved while there are still fewer tasks
 * than threads. Neither changes a token's bits (attn_compute_rows_part). NULL when out of
 * memory; *num_tasks set. */
static attn_task *step_tasks(const decode_step *d, int64_t *num_tasks) {
    int64_t most = ATTN_ROW_BLOCK;
    const int64_t splits = head_splits(d, plan_tasks(NULL, d, most, 1));
    while (most > 1 && plan_tasks(NULL, d, most, splits) < d->num_threads)
        most = (most + 1) / 2;
    *num_tasks = plan_tasks(NULL, d, most, splits);
    attn_task *tasks = malloc(sizeof(attn_task) * (size_t)(*num_tasks + 1));
    if (tasks != NULL) plan_tasks(tasks, d, most, splits);
    return tasks;
}

/* Task k's rows attended (their q prepared into q, q_size apart), each row's part into
 * its token's part buffers from `attn` (part_first[t]: token t's first), NULL for a row
 * without that part: the very function paged_attention_f32 runs, so a fused row has the
 * bits of a layerwise one. */
static void attend_task(float *restrict attn, const int64_t *part_first, int64_t part_stride,
                        const float *restrict q, const decode_layer *layer,
                        const attention_step *s, attn_task task, float *restrict scores) {
    const void *k_cache = layer->kv_cache;
    const void *v_cache = (const char *)k_cache
                          + (size_t)(s->num_slots * s->kv_size) * (s->kv_bf16 ? 2 : 4);
    float *parts_of[ATTN_ROW_BLOCK];
    for (int64_t i = 0; i < task.rows; i++) {
        const int64_t t = task.token + i;
        parts_of[i] = task.part < part_first[t + 1] - part_first[t]
                          ? attn + (part_first[t] + task.part) * part_stride
                          : NULL;
    }
    attn_compute_rows_part(parts_of, q, s->q_size, k_cache, v_cache, s->kv_bf16,
                           s->block_tables + task.token * s->table_stride,
                           s->seq_lens + task.token, task.rows, 0, task.part, s->num_heads,
                           s->num_heads / s->num_kv_heads, task.kv_lo, task.kv_hi,
                           s->head_dim, s->block_size, s->block_size * s->kv_size, s->scale,
                           scores);
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

/* The step as every phase reads it: set before the parallel region (decode_init,
 * decode_alloc), only read inside it; the buffers it points to are shared by the threads. */
typedef struct {
    const decode_step *d;
    attention_step att;
    int64_t M, hidden, intermediate, q_size, kv_size, qkv_size;
    int64_t qkv_in0;     /* layer 0's qkv input: 2 hidden wide for an EAGLE-3 draft layer */
    int64_t wide;        /* the widest input of any projection */
    int64_t xbuf_floats; /* the largest buffer proj_prepare_x needs (layers_ok) */
    /* A part of a token's attention: [o: q_size | max: num_heads | sum: num_heads]. */
    int64_t part_stride, num_tasks;
    attn_task *tasks;    /* step_tasks's */
    int64_t *part_first; /* [M + 1]: token t's parts are attn's part_first[t] .. [t + 1] - 1 */
    /* Shared: the qkv projection, every token's attention parts, the gate_up projection,
     * the LoRA shrinks (ls); the K/V loop's token blocks (kv_rows, lora_decode.h). */
    float *shared, *qkv, *gate_up, *attn;
    int64_t *kv_rows, num_kv_blocks;
    lora_step ls;
    /* Claim counters of every projection of the step: [num_layers, 4, num_threads]. */
    proj_claim *claims;
    int64_t qkv_slices[3], gate_up_slices[2], hidden_slices[1];
} decode_ctx;

/* A thread's own buffers (one allocation, at residual): the residual stream, the normed
 * input of a projection, every token's combined attention, a rotated q, one part's
 * scores, a projection's input as its weight's parts read it (proj_prepare_x). A thread
 * without them (ok 0) skips the work but still meets every barrier. */
typedef struct {
    int tid, nt, ok;
    float *residual, *h, *own_attn, *q, *scores, *xbuf;
} decode_thread;

/* c's sizes and attention step for d; nothing allocated. */
static void decode_init(decode_ctx *c, const decode_step *d) {
    const int64_t q_size = d->num_heads * d->head_dim, kv_size = d->num_kv_heads * d->head_dim;
    *c = (decode_ctx){
        .d = d, .M = d->num_tokens, .hidden = d->hidden, .intermediate = d->intermediate,
        .q_size = q_size, .kv_size = kv_size, .qkv_size = q_size + 2 * kv_size,
        .qkv_in0 = d->eagle_hidden != NULL ? 2 * d->hidden : d->hidden,
        .part_stride = attn_part_floats(d->num_heads, d->head_dim),
        .qkv_slices = {q_size, kv_size, kv_size},
        .gate_up_slices = {d->intermediate, d->intermediate}, .hidden_slices = {d->hidden}};
    c->att = (attention_step){
        .num_heads = d->num_heads, .num_kv_heads = d->num_kv_heads, .head_dim = d->head_dim,
        .q_size = q_size, .kv_size = kv_size, .num_slots = d->num_blocks * d->block_size,
        .block_size = d->block_size, .table_stride = d->table_stride, .eps = d->eps,
        .scale = d->scale, .kv_bf16 = d->kv_bf16, .positions = d->positions,
        .slot_mapping = d->slot_mapping, .block_tables = d->block_tables,
        .seq_lens = d->seq_lens, .cos_table = d->cos_table, .sin_table = d->sin_table};
    int64_t wide = d->hidden > d->intermediate ? d->hidden : d->intermediate;
    wide = wide > q_size ? wide : q_size;
    c->wide = wide > c->qkv_in0 ? wide : c->qkv_in0;
}

/* How many of the step's slots (its tokens' and its tree copies') lie outside the cache. */
static int64_t bad_slots(const decode_step *d, int64_t num_slots) {
    int64_t bad = 0;
    for (int64_t t = 0; t < d->num_tokens; t++)
        bad += d->slot_mapping[t] < 0 || d->slot_mapping[t] >= num_slots;
    for (int64_t i = 0; i < d->num_tree_copies; i++)
        bad += d->tree_src[i] < 0 || d->tree_src[i] >= num_slots || d->tree_dst[i] < 0 ||
               d->tree_dst[i] >= num_slots;
    return bad;
}

static void decode_free(decode_ctx *c) {
    free(c->claims);
    free(c->kv_rows);
    free(c->shared);
    free(c->tasks);
    free(c->part_first);
}

/* c's shared buffers, attention tasks, LoRA token blocks and claim counters. 0, or -1
 * holding nothing when out of memory. */
static int decode_alloc(decode_ctx *c) {
    const decode_step *d = c->d;
    const int64_t M = c->M, R = d->lora == NULL ? 0 : d->lora_rank;
    c->tasks = step_tasks(d, &c->num_tasks);
    c->part_first = malloc(sizeof(int64_t) * (size_t)(M + 1));
    if (c->part_first != NULL) {
        c->part_first[0] = 0;
        for (int64_t t = 0; t < M; t++)
            c->part_first[t + 1] = c->part_first[t] + attn_num_parts(d->seq_lens[t],
                                                                     d->block_size);
    }
    const int64_t attn_floats = (c->part_first == NULL ? 0 : c->part_first[M]) * c->part_stride;
    c->shared = malloc(sizeof(float) * (size_t)(M * (c->qkv_size + 2 * c->intermediate) +
                                                attn_floats + lora_step_floats(M, R)));
    c->kv_rows = malloc(sizeof(int64_t) * (size_t)(3 * M));
    c->claims = calloc((size_t)(d->num_layers * 4 * d->num_threads), sizeof(proj_claim));
    if (c->tasks == NULL || c->part_first == NULL || c->shared == NULL || c->kv_rows == NULL ||
        c->claims == NULL) {
        decode_free(c);
        return -1;
    }
    c->qkv = c->shared;
    c->gate_up = c->qkv + M * c->qkv_size;
    c->attn = c->gate_up + M * 2 * c->intermediate;
    c->ls = (lora_step){.R = R, .bf16 = d->lora_bf16};
    lora_step_init(&c->ls, c->attn + attn_floats, M, R);
    c->num_kv_blocks = lora_step_blocks(&c->ls, c->kv_rows, c->kv_rows + M,
                                        d->lora == NULL ? NULL : d->token_slots, M);
    return 0;
}

/* The calling thread's buffers, inside the parallel region. */
static decode_thread decode_thread_init(const decode_ctx *c) {
    decode_thread ts = {.tid = omp_get_thread_num(), .nt = omp_get_num_threads()};
    const int64_t M = c->M, q_size = c->q_size;
    /* q and scores for a task's rows (up to ATTN_ROW_BLOCK) */
    const int64_t q_floats = ATTN_ROW_BLOCK * q_size;
    const int64_t score_floats = ATTN_ROW_BLOCK * c->att.num_heads
                                 * attn_part_len(c->att.block_size);
    /* xbuf on a cache line (64 bytes, 16 floats): AMX reads it as tiles of 64-byte rows,
     * which cost a third more split over two lines (projection.c). */
    const int64_t xbuf_at = (M * (c->hidden + c->wide + q_size) + q_floats + score_floats + 15)
                            / 16 * 16;
    ts.residual = aligned_alloc(64, sizeof(float) * (size_t)((xbuf_at + c->xbuf_floats + 15)
                                                             / 16 * 16));
    ts.ok = ts.residual != NULL;
    if (!ts.ok) return ts;
    ts.h = ts.residual + M * c->hidden;
    ts.own_attn = ts.h + M * c->wide;
    ts.q = ts.own_attn + M * q_size;
    ts.scores = ts.q + q_floats;
    ts.xbuf = ts.residual + xbuf_at;
    return ts;
}

/* Projection p's (0 qkv, 1 o, 2 gate_up, 3 down) claim counters in layer l. */
static proj_claim *layer_claims(const decode_ctx *c, int64_t l, int64_t p) {
    return c->claims + (l * 4 + p) * c->d->num_threads;
}

/* Layer l's qkv input rows into h (qkv_in wide) and the residual stream into the layer:
 * layer 0 starts it from the embeddings (an EAGLE-3 draft layer from its two inputs), a
 * later layer adds the last layer's output x, with its down update (lora_decode.h). */
static void layer_input(const decode_ctx *c, const decode_thread *ts, int64_t l) {
    const decode_step *d = c->d;
    const float *input_norm = d->layers[l].input_norm, *x = d->x;
    const int64_t M = c->M, hidden = c->hidden, qkv_in = l == 0 ? c->qkv_in0 : hidden;
    float *h = ts->h, *residual = ts->residual;
    if (l > 0) {
        memcpy(h, x, sizeof(float) * (size_t)(M * hidden));
        if (c->ls.nb > 0)
            lora_step_expand(&c->ls, h, hidden, c->ls.u_down, &d->lora[l - 1].down,
                             c->hidden_slices, 1, hidden, 0, hidden);
    }
    for (int64_t t = 0; t < M; t++) {
        float *ht = h + t * qkv_in, *rt = residual + t * hidden;
        if (l == 0 && d->eagle_hidden != NULL) {
            eagle_input_row(ht, rt, x + t * hidden, d->eagle_hidden + t * hidden, input_norm, d,
                            d->eps);
        } else if (l == 0) {
            memcpy(rt, x + t * hidden, sizeof(float) * (size_t)hidden);
            rms_norm_row(ht, rt, input_norm, hidden, d->eps);
        } else {
            fused_add_rms_norm_row(ht, rt, input_norm, hidden, d->eps);
        }
    }
}

/* The residual stream into layer l, where aux asks for it (every thread holds the same
 * copy: thread 0 writes it out). */
static void copy_aux(const decode_ctx *c, const decode_thread *ts, int64_t l) {
    const decode_step *d = c->d;
    if (d->aux == NULL || ts->tid != 0) return;
    const int64_t hidden = c->hidden, num_aux = d->num_aux;
    for (int64_t j = 0; j < num_aux; j++)
        if (d->aux_layers[j] == l)
            for (int64_t t = 0; t < c->M; t++)
                memcpy(d->aux + (t * num_aux + j) * hidden, ts->residual + t * hidden,
                       sizeof(float) * (size_t)hidden);
}

/* This thread's share of qkv = h qkv^T (+ qkv_bias), its share of the LoRA shrink first. */
static void qkv_projection(const decode_ctx *c, const decode_thread *ts, int64_t l) {
    const decode_layer *layer = c->d->layers + l;
    const int64_t qkv_in = l == 0 ? c->qkv_in0 : c->hidden;
    if (c->ls.nb > 0)
        lora_step_shrink(&c->ls, c->ls.u_qkv, ts->h, qkv_in, &c->d->lora[l].qkv, 3, c->hidden,
                         ts->tid, ts->nt);
    proj_shared(c->qkv, proj_prepare_x(ts->xbuf, ts->h, c->M, qkv_in, &layer->qkv), &layer->qkv,
                layer->qkv_bias, c->M, c->qkv_size, qkv_in, ts->tid, ts->nt,
                layer_claims(c, l, 0));
}

/* Every token's K/V into layer l's cache, by token block over the threads (qkv's LoRA
 * update first, lora_decode.h). The loop's implicit barrier puts every write before any
 * token attends: the tokens of one request (speculative decoding verifies several, each
 * its own row) read the slots the ones before them write. */
static void write_step_kv(const decode_ctx *c, const decode_thread *ts, int64_t l) {
    const decode_layer *layer = c->d->layers + l;
    const int64_t M = c->M, qkv_size = c->qkv_size, *kv_rows = c->kv_rows;
#pragma omp for schedule(static)
    for (int64_t b = 0; b < c->num_kv_blocks; b++) {
        if (!ts->ok) continue;
        if (b < c->ls.nb)
            lora_step_expand_block(&c->ls, b, c->qkv, qkv_size, c->ls.u_qkv, &c->d->lora[l].qkv,
                                   c->qkv_slices, 3, qkv_size, 0, qkv_size);
        for (int64_t i = 0; i < kv_rows[M + 2 * b + 1]; i++) {
            const int64_t t = kv_rows[kv_rows[M + 2 * b] + i];
            write_kv(c->qkv + t * qkv_size, layer, &c->att, t);
        }
    }
}

/* A tree step's copies into its node rows' scratch slots (decode_layer.h), over the
 * threads; the loop's implicit barrier puts every node row's context and path in place
 * before any row attends. Nothing, and no barrier, in any other step. */
static void copy_tree_slots(const decode_ctx *c, int64_t l) {
    const decode_step *d = c->d;
    if (d->num_tree_copies <= 0) return;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < d->num_tree_copies; i++)
        copy_kv_slot(d->layers + l, &c->att, d->tree_src[i], d->tree_dst[i]);
}

/* The (token, part) tasks of every token over the threads (the loop's implicit barrier:
 * every part done), then every thread combines every token's parts in order into its own
 * copy (no barrier after): a token's bits depend on its seq_len alone, never on M or the
 * threads (attention.h). */
static void attention(const decode_ctx *c, const decode_thread *ts, int64_t l) {
    const decode_layer *layer = c->d->layers + l;
    const int64_t qkv_size = c->qkv_size, q_size = c->q_size;
    attn_task prepared = {-1, 0, 0, 0, 0}; /* the run whose q is in ts->q */
#pragma omp for schedule(static)
    for (int64_t k = 0; k < c->num_tasks; k++) {
        if (!ts->ok) continue;
        const attn_task task = c->tasks[k];
        if (task.token != prepared.token || task.rows != prepared.rows)
            for (int64_t i = 0; i < task.rows; i++)
                prepare_q(ts->q + i * q_size, c->qkv + (task.token + i) * qkv_size, layer,
                          &c->att, task.token + i);
        prepared = task;
        attend_task(c->attn, c->part_first, c->part_stride, ts->q, layer, &c->att, task,
                    ts->scores);
    }
    for (int64_t t = 0; t < c->M && ts->ok; t++)
        attn_combine_parts(ts->own_attn + t * q_size, c->attn + c->part_first[t] * c->part_stride,
                           c->part_first[t + 1] - c->part_first[t], c->att.num_heads,
                           c->att.head_dim);
}

/* This thread's share of x = attn o^T, its share of the LoRA shrink first. */
static void o_projection(const decode_ctx *c, const decode_thread *ts, int64_t l) {
    if (!ts->ok) return;
    const decode_layer *layer = c->d->layers + l;
    const int64_t q_size = c->q_size;
    if (c->ls.nb > 0)
        lora_step_shrink(&c->ls, c->ls.u_o, ts->own_attn, q_size, &c->d->lora[l].o, 1, q_size,
                         ts->tid, ts->nt);
    proj_shared(c->d->x, proj_prepare_x(ts->xbuf, ts->own_attn, c->M, q_size, &layer->o),
                &layer->o, NULL, c->M, c->hidden, q_size, ts->tid, ts->nt,
                layer_claims(c, l, 1));
}

/* residual += x (with o's update, on this thread's copy); h = rms_norm(residual) *
 * post_norm; this thread's share of gate_up = h gate_up^T, its LoRA shrink's first. */
static void mlp_gate_up(const decode_ctx *c, const decode_thread *ts, int64_t l) {
    if (!ts->ok) return;
    const decode_step *d = c->d;
    const decode_layer *layer = d->layers + l;
    const int64_t M = c->M, hidden = c->hidden, intermediate = c->intermediate;
    memcpy(ts->h, d->x, sizeof(float) * (size_t)(M * hidden));
    if (c->ls.nb > 0)
        lora_step_expand(&c->ls, ts->h, hidden, c->ls.u_o, &d->lora[l].o, c->hidden_slices, 1,
                         hidden, 0, hidden);
    for (int64_t t = 0; t < M; t++)
        fused_add_rms_norm_row(ts->h + t * hidden, ts->residual + t * hidden, layer->post_norm,
                               hidden, d->eps);
    if (c->ls.nb > 0)
        lora_step_shrink(&c->ls, c->ls.u_gate_up, ts->h, hidden, &d->lora[l].gate_up, 2, hidden,
                         ts->tid, ts->nt);
    proj_shared(c->gate_up, proj_prepare_x(ts->xbuf, ts->h, M, hidden, &layer->gate_up),
                &layer->gate_up, NULL, M, 2 * intermediate, hidden, ts->tid, ts->nt,
                layer_claims(c, l, 2));
}

/* This thread's columns of gate_up's LoRA update, in place in the shared gate_up. */
static void gate_up_lora(const decode_ctx *c, const decode_thread *ts, int64_t l) {
    const int64_t n = 2 * c->intermediate;
    int64_t begin, end;
    lora_column_share(n, ts->tid, ts->nt, &begin, &end);
    if (ts->ok)
        lora_step_expand(&c->ls, c->gate_up, n, c->ls.u_gate_up, &c->d->lora[l].gate_up,
                         c->gate_up_slices, 2, n, begin, end);
}

/* h = silu_and_mul(gate_up); this thread's share of x = h down^T, its LoRA shrink's
 * first (the update is applied where the next layer, or the end, reads x). */
static void mlp_down(const decode_ctx *c, const decode_thread *ts, int64_t l) {
    if (!ts->ok) return;
    const decode_layer *layer = c->d->layers + l;
    const int64_t M = c->M, intermediate = c->intermediate;
    for (int64_t t = 0; t < M; t++) {
        const float *g = c->gate_up + t * 2 * intermediate;
        silu_and_mul_row(ts->h + t * intermediate, g, g + intermediate, intermediate);
    }
    if (c->ls.nb > 0)
        lora_step_shrink(&c->ls, c->ls.u_down, ts->h, intermediate, &c->d->lora[l].down, 1,
                         intermediate, ts->tid, ts->nt);
    proj_shared(c->d->x, proj_prepare_x(ts->xbuf, ts->h, M, intermediate, &layer->down),
                &layer->down, NULL, M, c->hidden, intermediate, ts->tid, ts->nt,
                layer_claims(c, l, 3));
}

/* Layer l by this thread, between the layer's barriers: the projections' barriers (after
 * qkv, o, gate_up and down), the implicit ones of the K/V writes, the tree copies (a tree
 * step only) and the attention parts, and one more with LoRA (after gate_up's expand). */
static void decode_one_layer(const decode_ctx *c, const decode_thread *ts, int64_t l) {
    if (ts->ok) {
        layer_input(c, ts, l);
        copy_aux(c, ts, l);
        qkv_projection(c, ts, l);
    }
#pragma omp barrier
    write_step_kv(c, ts, l);
    copy_tree_slots(c, l);
    attention(c, ts, l);
    o_projection(c, ts, l);
#pragma omp barrier
    mlp_gate_up(c, ts, l);
#pragma omp barrier
    if (c->ls.nb > 0) {
        gate_up_lora(c, ts, l);
#pragma omp barrier
    }
    mlp_down(c, ts, l);
#pragma omp barrier
}

/* x = rms_norm(residual + x) * final_norm, the last layer's down update added to x first,
 * and an EAGLE-3 draft's next hidden state (the final residual stream): thread 0's copy. */
static void final_norm(const decode_ctx *c, const decode_thread *ts) {
    if (ts->tid != 0 || !ts->ok) return;
    const decode_step *d = c->d;
    const int64_t hidden = c->hidden;
    if (c->ls.nb > 0)
        lora_step_expand(&c->ls, d->x, hidden, c->ls.u_down, &d->lora[d->num_layers - 1].down,
                         c->hidden_slices, 1, hidden, 0, hidden);
    for (int64_t t = 0; t < c->M; t++) {
        fused_add_rms_norm_row(d->x + t * hidden, ts->residual + t * hidden, d->final_norm,
                               hidden, d->eps);
        if (d->eagle_hidden != NULL)
            memcpy(d->eagle_hidden + t * hidden, ts->residual + t * hidden,
                   sizeof(float) * (size_t)hidden);
    }
}

/* Every layer and the final norm by the calling thread, one of the region's team.
 * Returns whether it ran out of memory. */
static int decode_layers(const decode_ctx *c) {
    const decode_thread ts = decode_thread_init(c);
    for (int64_t l = 0; l < c->d->num_layers; l++) decode_one_layer(c, &ts, l);
    final_norm(c, &ts);
    free(ts.residual);
    return !ts.ok;
}

/* The step of `d` (decode_layer.h: its fields' meaning and the return value). */
int64_t llama_decode(const decode_step *d) {
    decode_ctx c;
    decode_init(&c, d);
    if (!layers_ok(d, c.M, c.wide, &c.xbuf_floats)) return -2;
    const int64_t bad = bad_slots(d, c.att.num_slots);
    if (bad) return bad;
    if (decode_alloc(&c) != 0) return -1;
    int failed = 0;
    /* The one parallel region of the step: every layer's phases run inside it. */
#pragma omp parallel num_threads(d->num_threads) reduction(| : failed)
    failed = decode_layers(&c);
    decode_free(&c);
    return failed ? -1 : 0;
}
