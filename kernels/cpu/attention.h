/*
 * Attention of one query token over its request's paged K/V, in float32 arithmetic over a
 * float32 or bf16 cache (kv_bf16: each K/V element widened exactly to float32 as it is
 * read; paged_attention.c explains the layout and has the batch kernel;
 * llama_decode.c uses the same parts).
 *
 * Fixed-position parts: a token with seq_len positions (its position + 1) attends to parts
 * j = 0 .. attn_num_parts(seq_len) - 1, part j covering [j * P, min((j + 1) * P, seq_len))
 * with P = attn_part_len(block_size), and its result is ALWAYS attn_combine_parts over its
 * parts in order, even with one. The bits of a token's attention then depend only on its
 * query, its K/V and its seq_len: not on how many rows the step has, how a prompt was
 * chunked, whether a prefix came from the cache, which kernel ran (batch or fused decode) or
 * how many threads shared the (token, part) tasks. Greedy output no longer changes with
 * prefix caching, chunk size or batch (issue 29).
 */
#ifndef AIOENGINE_ATTENTION_H
#define AIOENGINE_ATTENTION_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec_math.h"

/* Element i of a K/V cache in its element type, as float32. */
static inline __attribute__((always_inline)) float kv_at(const void *restrict cache, int64_t i,
                                                         const int kv_bf16) {
    return kv_bf16 ? bf16_to_f32(((const uint16_t *)cache)[i]) : ((const float *)cache)[i];
}

/* n floats into a K/V cache from element `at` on, in its element type: copied, or rounded
 * to bf16 (f32_to_bf16: torch's rounding). The one writer of K/V rows, for cache.c's
 * reshape_and_cache and llama_decode.c's fused step alike. */
static inline void kv_store_row(void *restrict cache, int64_t at, const float *restrict src,
                                int64_t n, int kv_bf16) {
    if (kv_bf16) {
        uint16_t *dst = (uint16_t *)cache + at;
        for (int64_t i = 0; i < n; i++) dst[i] = f32_to_bf16(src[i]);
    } else {
        memcpy((float *)cache + at, src, sizeof(float) * (size_t)n);
    }
}

/* One request's query against its positions [begin, end) (the whole context, one thread's
 * part of it, or with a sliding window the part from the window's oldest position, which
 * may start inside a block). Leaves, per query head h, the
 * unnormalised o[h] = sum_p e^(s_hp - m_h) v_p with m_h = max_p s_hp in max[h] and
 * sum[h] = sum_p e^(s_hp - m_h): a full softmax divides by the sum (attend_normalize), split
 * parts combine first (attend_combine). An empty range leaves o = 0, max = -inf, sum = 0.
 *
 * `scores` holds [num_heads, end - begin] floats. Always inlined with head_dim a constant
 * (64, 128) so the dot products and value sums compile to straight vector code instead of
 * short runtime-length loops. Query head h uses KV head h / group. */
static inline __attribute__((always_inline)) void attend_range(
    float *restrict o, float *restrict max, float *restrict sum, const float *restrict q,
    const void *restrict k_cache, const void *restrict v_cache, const int kv_bf16,
    const int32_t *restrict table, int64_t begin, int64_t end, int64_t num_heads,
    int64_t group, const int64_t head_dim, int64_t block_size, int64_t block_stride,
    float scale, float *restrict scores) {
    const int64_t slot_stride = (num_heads / group) * head_dim, len = end - begin;
    for (int64_t start = begin, stop; start < end; start = stop) {
        const int64_t block_start = start - start % block_size;
        const int64_t kb = (int64_t)table[start / block_size] * block_stride;
        stop = block_start + block_size < end ? block_start + block_size : end;
        for (int64_t p = start; p < stop; p++) {
            const int64_t slot = kb + (p - block_start) * slot_stride;
            for (int64_t h = 0; h < num_heads; h++) {
                const int64_t k = slot + (h / group) * head_dim;
                const float *qh = q + h * head_dim;
                float dot = 0.0f;
                for (int64_t d = 0; d < head_dim; d++)
                    dot += qh[d] * kv_at(k_cache, k + d, kv_bf16);
                scores[h * len + p - begin] = dot * scale;
            }
        }
    }
    for (int64_t h = 0; h < num_heads; h++) {
        float *s = scores + h * len;
        float mx = -INFINITY;
        for (int64_t p = 0; p < len; p++) mx = s[p] > mx ? s[p] : mx;
        float total = 0.0f;
        /* exp_f32 vectorises, libm's expf does not: 30 layers at 32 requests x 180 tokens
         * went from 24 to 20 ms. */
        for (int64_t p = 0; p < len; p++) {
            s[p] = exp_f32(s[p] - mx);
            total += s[p];
        }
        max[h] = mx;
        sum[h] = total;
        for (int64_t d = 0; d < head_dim; d++) o[h * head_dim + d] = 0.0f;
    }
    for (int64_t start = begin, stop; start < end; start = stop) {
        const int64_t block_start = start - start % block_size;
        const int64_t vb = (int64_t)table[start / block_size] * block_stride;
        stop = block_start + block_size < end ? block_start + block_size : end;
        for (int64_t p = start; p < stop; p++) {
            const int64_t slot = vb + (p - block_start) * slot_stride;
            for (int64_t h = 0; h < num_heads; h++) {
                const int64_t v = slot + (h / group) * head_dim;
                const float w = scores[h * len + p - begin];
                float *oh = o + h * head_dim;
                for (int64_t d = 0; d < head_dim; d++)
                    oh[d] += w * kv_at(v_cache, v + d, kv_bf16);
            }
        }
    }
}

/* attend_range() for one cache element type, the common head sizes compiled as constants. */
#define ATTEND_HEAD_SIZES(KV_BF16)                                                          \
    do {                                                                                   \
        if (head_dim == 64)                                                                \
            attend_range(o, max, sum, q, k_cache, v_cache, KV_BF16, table, begin, end,     \
                         num_heads, group, 64, block_size, block_stride, scale, scores);   \
        else if (head_dim == 128)                                                          \
            attend_range(o, max, sum, q, k_cache, v_cache, KV_BF16, table, begin, end,     \
                         num_heads, group, 128, block_size, block_stride, scale, scores);  \
        else                                                                               \
            attend_range(o, max, sum, q, k_cache, v_cache, KV_BF16, table, begin, end,     \
                         num_heads, group, head_dim, block_size, block_stride, scale,      \
                         scores);                                                          \
    } while (0)

/* attend_range() with the cache's element type and the common head sizes as constants. */
static inline void attend_request(float *restrict o, float *restrict max, float *restrict sum,
                                  const float *restrict q, const void *restrict k_cache,
                                  const void *restrict v_cache, int kv_bf16,
                                  const int32_t *restrict table, int64_t begin, int64_t end,
                                  int64_t num_heads, int64_t group, int64_t head_dim,
                                  int64_t block_size, int64_t block_stride, float scale,
                                  float *restrict scores) {
    if (kv_bf16)
        ATTEND_HEAD_SIZES(1);
    else
        ATTEND_HEAD_SIZES(0);
}

/* o[h] /= sum[h]: the softmax of a whole context (every sum >= 1: the max term is e^0). */
static inline void attend_normalize(float *restrict o, const float *restrict sum,
                                    int64_t num_heads, int64_t head_dim) {
    for (int64_t h = 0; h < num_heads; h++) {
        const float inv = 1.0f / sum[h];
        for (int64_t d = 0; d < head_dim; d++) o[h * head_dim + d] *= inv;
    }
}

/* The attention of a context split in num_parts ranges from their attend_range results,
 * part i at parts + i * part_stride laid out as [o: num_heads * head_dim | max: num_heads |
 * sum: num_heads]: o[h] = sum_i e^(m_i - m) o_i[h] / sum_i e^(m_i - m) sum_i[h], m the
 * largest m_i (empty parts, with max -inf, weigh 0). */
static inline void attend_combine(float *restrict o, const float *restrict parts,
                                  int64_t part_stride, int num_parts, int64_t num_heads,
                                  int64_t head_dim) {
    const int64_t max_at = num_heads * head_dim, sum_at = max_at + num_heads;
    for (int64_t h = 0; h < num_heads; h++) {
        float m = -INFINITY, total = 0.0f;
        for (int i = 0; i < num_parts; i++) {
            const float mi = parts[i * part_stride + max_at + h];
            m = mi > m ? mi : m;
        }
        float *oh = o + h * head_dim;
        for (int64_t d = 0; d < head_dim; d++) oh[d] = 0.0f;
        for (int i = 0; i < num_parts; i++) {
            const float *part = parts + i * part_stride;
            if (part[sum_at + h] == 0.0f) continue;  /* empty */
            const float w = exp_f32(part[max_at + h] - m);
            total += w * part[sum_at + h];
            for (int64_t d = 0; d < head_dim; d++) oh[d] += w * part[h * head_dim + d];
        }
        const float inv = 1.0f / total;
        for (int64_t d = 0; d < head_dim; d++) oh[d] *= inv;
    }
}

/* Positions per part (before rounding up to whole blocks): parts are independent tasks, so
 * a decode of >= 2 parts spreads over the threads; each costs one part buffer and a combine
 * term, negligible next to its P x num_heads dot products. */
#define ATTN_PART_POSITIONS 256

/* P: ATTN_PART_POSITIONS rounded up to a multiple of block_size (a part starts on a block). */
static inline int64_t attn_part_len(int64_t block_size) {
    return (ATTN_PART_POSITIONS + block_size - 1) / block_size * block_size;
}

/* How many parts a token with seq_len positions (>= 1) attends to. */
static inline int64_t attn_num_parts(int64_t seq_len, int64_t block_size) {
    const int64_t P = attn_part_len(block_size);
    return (seq_len + P - 1) / P;
}

/* The oldest position a token with seq_len positions sees under a sliding window (0: none),
 * and its first part: with a window it attends to parts first .. attn_num_parts - 1, part j
 * covering [max(j * P, lo), min((j + 1) * P, seq_len)): still fixed absolute positions. */
static inline int64_t attn_window_start(int64_t seq_len, int64_t window) {
    return window > 0 && seq_len > window ? seq_len - window : 0;
}

static inline int64_t attn_first_part(int64_t seq_len, int64_t window, int64_t block_size) {
    return attn_window_start(seq_len, window) / attn_part_len(block_size);
}

/* Floats of one part buffer: [o: num_heads * head_dim | max: num_heads | sum: num_heads]. */
static inline int64_t attn_part_floats(int64_t num_heads, int64_t head_dim) {
    return num_heads * (head_dim + 2);
}

/* Part j of one token (query q, its request's block table, its seq_len) into `part`
 * (attn_part_floats): attend_range over the part's positions, K/V of the cache's element type
 * (kv_bf16: bf16, else float32; k_cache/v_cache and block_stride in elements). `scores` holds
 * num_heads * attn_part_len(block_size) floats. Defined once, in paged_attention.c,
 * not inline: every caller runs the same machine code, so the same bits. */
void attn_compute_part(float *restrict part, const float *restrict q,
                       const void *restrict k_cache, const void *restrict v_cache, int kv_bf16,
                       const int32_t *restrict table, int64_t seq_len, int64_t j,
                       int64_t num_heads, int64_t group, int64_t head_dim, int64_t block_size,
                       int64_t block_stride, float scale, float *restrict scores);

/* attn_compute_part of a token under a sliding window (window 0: none): part j's positions
 * from the window's oldest on (attn_window_start). */
void attn_compute_window_part(float *restrict part, const float *restrict q,
                              const void *restrict k_cache, const void *restrict v_cache,
                              int kv_bf16, const int32_t *restrict table, int64_t seq_len,
                              int64_t window, int64_t j, int64_t num_heads, int64_t group,
                              int64_t head_dim, int64_t block_size, int64_t block_stride,
                              float scale, float *restrict scores);

/* A token's attention o [num_heads * head_dim] from its num_parts consecutive part buffers
 * (attend_combine, in order). Defined once, like attn_compute_part. */
void attn_combine_parts(float *restrict o, const float *restrict parts, int64_t num_parts,
                        int64_t num_heads, int64_t head_dim);

#endif /* AIOENGINE_ATTENTION_H */
