/*
 * The C contract of the fused decode kernel (llama_decode.c): what one decoder layer and
 * one decode step hand it, as typed structs rather than an int64 pointer table and ~30
 * positional arguments. Python mirrors these structs once (kernels/cpu_layout.py, as
 * ctypes.Structure classes); layout.c exports every struct's size and every field's offset
 * and size, and tests/model/test_c_layout.py fails where the mirror and this header
 * disagree. Add a field here: add it to layout.c's table and to the mirror too.
 */
#ifndef AIOENGINE_DECODE_LAYER_H
#define AIOENGINE_DECODE_LAYER_H

#include <stdint.h>

/* The most parts a projection weight has: a fused q/k/v whose parts are stored in different
 * formats (a Q4_K_M file's Q4_K q, k and Q6_K v). */
#define PROJ_MAX_PARTS 3

/* One part of a projection weight: `rows` output rows packed in format `fmt` (a packed
 * GEMM_*P code, gemm.h) at `data`, with their per-row scales [rows] for the int8 formats
 * (else NULL). */
typedef struct {
    const void *data;
    const float *scales;
    int64_t rows;
    int32_t fmt;
} proj_part;

/* A projection weight [n, k]: parts[0 .. num_parts) in output-row order, n the sum of their
 * rows, every part but the last a whole number of 16-row panels (so no panel straddles two
 * parts, and part j's columns of y start at 16 x the panels before it). All parts read x in
 * the same form (projection.h's proj_x_form: every GGUF block format shares one);
 * llama_decode refuses (-2) a weight whose parts do not. */
typedef struct {
    proj_part parts[PROJ_MAX_PARTS];
    int64_t num_parts;
} proj_weight;

/* One layer's weights, as LlamaDecoderLayer holds them (qkv_bias, q_norm, k_norm may be
 * NULL; each projection in its own format(s)), and its KV cache [2, num_blocks, block_size,
 * num_kv_heads, head_dim] (float32, or bf16 where the step's kv_bf16 says so). */
typedef struct {
    const float *input_norm;
    proj_weight qkv;
    const float *qkv_bias, *q_norm, *k_norm;
    proj_weight o;
    const float *post_norm;
    proj_weight gate_up;
    proj_weight down;
    void *kv_cache;
} decode_layer;

/* One projection's adapter slots (lora.h): a [L, S, R, K], bt [L, R, N] (float32, or bf16
 * for the whole step with lora_bf16), ranks [L, S] int32. */
typedef struct {
    const void *a, *bt;
    const int32_t *ranks;
} lora_proj;

/* A layer's adapter slots. The Python side (aioengine.lora.LoRAManager) keeps them as an
 * int64 tensor [num_layers, LORA_LAYER_POINTERS] of data pointers, in this field order. */
typedef struct {
    lora_proj qkv, o, gate_up, down;
} lora_layer;

/* The width of that table: the one definition (Python reads it through lora_layer's size
 * in layout.c's table and checks its mirror against it). */
#define LORA_LAYER_POINTERS 12
_Static_assert(sizeof(lora_layer) == LORA_LAYER_POINTERS * sizeof(void *),
               "lora_layer is LORA_LAYER_POINTERS pointers");

/* One decode step of num_tokens single-token rows over every layer.
 *
 * x [num_tokens, hidden]: the embeddings in, the final-normed hidden states out.
 * positions, slot_mapping [num_tokens] int64; block_tables [num_tokens, table_stride] and
 * seq_lens [num_tokens] int32 (as for paged_attention_f32, one row per token); cos/sin tables
 * [max_positions, head_dim / 2]; K/V are written to the caches rounded to bf16 (as torch rounds) and read back widened where
 * kv_bf16 is set.
 * aux NULL, or [num_tokens, num_aux * hidden]: its j-th hidden-wide column block receives
 * the residual stream into layer aux_layers[j] (each in [0, num_layers); the embeddings for
 * 0), the input of that layer's input norm. lora NULL, or [num_layers] adapter slots with
 * token_slots [num_tokens] (-1: the base model), the slots' padded rank lora_rank and
 * their format (lora_bf16: bf16, else float32).
 *
 * The model's fields (layers to num_threads) stay the same from step to step, the step's
 * (x onwards) change. The Python side keeps one struct per layer table (built with it) and
 * stores the call's values into it each call: int and float stores, cheaper than the ~30
 * converted arguments this struct replaced. */
typedef struct {
    /* the model */
    const decode_layer *layers;
    int64_t num_layers;
    const float *final_norm;
    int64_t hidden, num_heads, num_kv_heads, head_dim, intermediate;
    float eps, scale;
    const float *cos_table, *sin_table;
    int32_t num_threads;
    int32_t kv_bf16; /* every layer's KV cache in bf16 (else float32) */
    /* the step */
    float *x;
    int64_t num_tokens;
    const int64_t *positions, *slot_mapping;
    const int32_t *block_tables;
    int64_t table_stride;
    const int32_t *seq_lens;
    int64_t num_blocks, block_size;
    /* EAGLE-3's auxiliary hidden states, or NULL / 0 */
    float *aux;
    const int64_t *aux_layers;
    int64_t num_aux;
    /* the step's adapters, or NULL */
    const lora_layer *lora;
    const int32_t *token_slots;
    int64_t lora_rank;
    int32_t lora_bf16;
    /* An EAGLE-3 draft layer (spec_decode/eagle.py), or NULL (then no aux, no lora): x holds
     * the tokens' embeddings and eagle_hidden [num_tokens, hidden] the hidden states the
     * head reads. Layer 0's input is [rms(x) * input_norm | rms(eagle_hidden) *
     * eagle_hidden_norm], 2 hidden wide (its qkv weight [.., 2 hidden]); its residual stream
     * starts as eagle_hidden, or as its normed half with eagle_norm_before_residual. The
     * final residual stream (the next draft's hidden state) is written into eagle_hidden. */
    float *eagle_hidden;
    const float *eagle_hidden_norm;
    int32_t eagle_norm_before_residual;
    /* Tree verification rows (worker/spec_tree.py), or NULL / 0: in every layer, once the
     * step's K/V are written and before any row attends, the K and V of slot tree_src[i]
     * are copied to slot tree_dst[i] (the scratch blocks the node rows' block tables end
     * in, so that each node row sees the context and its ancestors at the positions a
     * chain's row would). No tree_dst is a tree_src. */
    const int64_t *tree_src, *tree_dst;
    int64_t num_tree_copies;
} decode_step;

/* Runs the step (llama_decode.c). Returns 0; the number of slots outside the cache, having
 * written nothing; -1 when out of memory; or -2, having done nothing, for a projection
 * weight it does not read (projection.h's proj_weight_ok: a format it does not know, the
 * retired row-major codes included; parts that read x in different forms; rows that do
 * not add up to the projection's width). */
int64_t llama_decode(const decode_step *step);

#endif /* AIOENGINE_DECODE_LAYER_H */
