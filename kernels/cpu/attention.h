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

#include "attention_bf16.h"
#include "attention_scores.h"
#include "kv_access.h"
#include "vec_math.h"

/* The largest of s[0 .. n - 1] (-inf for none). In 16 lanes, then across them: a max is
 * exact in any order, and one running max waits on each compare (vmaxss, one element per
 * 4 cycles: a sixth of a prefill's attention went there). */
static inline float max_f32(const float *restrict s, int64_t n) {
    float lane[16];
    for (int l = 0; l < 16; l++) lane[l] = -INFINITY;
    int64_t p = 0;
    for (; p + 16 <= n; p += 16)
        for (int l = 0; l < 16; l++) lane[l] = s[p + l] > lane[l] ? s[p + l] : lane[l];
    for (int l = 0; p < n; p++, l++) lane[l] = s[p] > lane[l] ? s[p] : lane[l];
    float mx = -INFINITY;
    for (int l = 0; l < 16; l++) mx = lane[l] > mx ? lane[l] : mx;
    return mx;
}

/* Each row's scores of query heads h_lo .. h_hi - 1 to e^(s - max) in place; their max, sum
 * and o = 0 into its out. */
static inline __attribute__((always_inline)) void attend_softmax(
    float *const *restrict outs, const int64_t *restrict begins, const int64_t *restrict ends,
    int64_t R, int64_t num_heads, int64_t h_lo, int64_t h_hi, const int64_t head_dim,
    float *restrict scores, int64_t P) {
    for (int64_t i = 0; i < R; i++) {
        if (outs[i] == NULL) continue;
        const int64_t len = ends[i] > begins[i] ? ends[i] - begins[i] : 0;
        float *o = outs[i], *max = o + num_heads * head_dim, *sum = max + num_heads;
        for (int64_t h = h_lo; h < h_hi; h++) {
            float *s = scores + (i * num_heads + h) * P;
            const float mx = max_f32(s, len);
            float total = 0.0f;
            /* exp_f32 vectorises, libm's expf does not: 30 layers at 32 requests x 180
             * tokens went from 24 to 20 ms. */
            for (int64_t p = 0; p < len; p++) {
                s[p] = exp_f32(s[p] - mx);
                total += s[p];
            }
            max[h] = mx;
            sum[h] = total;
            for (int64_t d = 0; d < head_dim; d++) o[h * head_dim + d] = 0.0f;
        }
    }
}

/* o += e^(s - max) v over each row's positions. In groups of 16 absolute positions: each
 * head's o stays in registers over a group (one load and store of o per group, not per
 * position). The compiler may split a group's sum (-fassociative-math), so the groups are
 * fixed positions: a row's sums depend on its own range alone, not on the other rows of
 * its task. */
static inline __attribute__((always_inline)) void attend_values(
    float *const *restrict outs, const void *restrict v_cache, const int kv_bf16,
    const int32_t *restrict table, const int64_t *restrict begins,
    const int64_t *restrict ends, int64_t R, int64_t lo, int64_t hi, int64_t num_heads,
    int64_t group, int64_t kv_lo, int64_t kv_hi, const int64_t head_dim, int64_t block_size,
    int64_t block_stride, const float *restrict scores, int64_t P) {
    const int64_t num_kv = num_heads / group, slot_stride = num_kv * head_dim;
    float vrows[16 * head_dim];
    int64_t slots[16];
    for (int64_t p0 = lo - lo % 16; p0 < hi; p0 += 16) {
        const int64_t pn = hi - p0 < 16 ? hi - p0 : 16, first = p0 < lo ? lo - p0 : 0;
        kv_slots(slots + first, table, p0 + first, pn - first, block_size, block_stride,
                 slot_stride);
        for (int64_t g = kv_lo; g < kv_hi; g++) {
            for (int64_t t = first; t < pn; t++)
                for (int64_t d = 0; d < head_dim; d++)
                    vrows[t * head_dim + d] = kv_at(v_cache, slots[t] + g * head_dim + d,
                                                    kv_bf16);
            for (int64_t i = 0; i < R; i++) {
                int64_t a, b;
                if (!attn_row_span(outs, begins, ends, i, p0, pn, &a, &b)) continue;
                for (int64_t h = g * group; h < (g + 1) * group; h++) {
                    const float *w = scores + (i * num_heads + h) * P - begins[i];
                    float *oh = outs[i] + h * head_dim, acc[head_dim];
                    for (int64_t d = 0; d < head_dim; d++) acc[d] = oh[d];
                    for (int64_t p = a; p < b; p++) {
                        const float *v = vrows + (p - p0) * head_dim;
                        for (int64_t d = 0; d < head_dim; d++) acc[d] += w[p] * v[d];
                    }
                    for (int64_t d = 0; d < head_dim; d++) oh[d] = acc[d];
                }
            }
        }
    }
}

/* Rows of queries of one request against their positions: row i (query q + i * q_stride)
 * against [begins[i], ends[i]) (the whole context, one part of it, or with a sliding window
 * the part from the window's oldest position, which may start inside a block); a row with
 * outs[i] == NULL is skipped. Leaves in outs[i], per query head h, the unnormalised
 * o[h] = sum_p e^(s_hp - m_h) v_p with m_h = max_p s_hp after it (max, num_heads floats)
 * and sum[h] = sum_p e^(s_hp - m_h) after that (attn_part_floats' layout): a full softmax
 * divides by the sum (attend_normalize), split parts combine first (attend_combine). An
 * empty range leaves o = 0, max = -inf, sum = 0.
 *
 * Each position's K and V (all KV heads, widened once) serve every row that sees it: a
 * prefill chunk's rows share their request's K/V, so a block of rows reads it once instead of
 * once per row (per row it was the attention's cost: its loads stalled). A row's arithmetic
 * is the same instructions whatever R is and wherever the row sits (this one function for
 * every row count), so its bits depend only on its query, its K/V and its range.
 *
 * `scores` holds R * num_heads * P floats (P >= every row's range). Always inlined with
 * head_dim a constant (64, 128) so the dot products and value sums compile to straight
 * vector code. Query head h uses KV head h / group.
 *
 * Only the query heads of KV heads kv_lo .. kv_hi - 1 are computed (every other head of
 * outs is left as it was): heads never mix, so a task may take some of them and another
 * task the rest, each head's bits the same as with all of them in one call (a lone decode
 * row's attention then spreads over the threads, llama_decode.c). */
static inline __attribute__((always_inline)) void attend_rows(
    float *const *restrict outs, const float *restrict q, int64_t q_stride,
    const void *restrict k_cache, const void *restrict v_cache, const int kv_bf16,
    const int32_t *restrict table, const int64_t *restrict begins,
    const int64_t *restrict ends, int64_t R, int64_t num_heads, int64_t group, int64_t kv_lo,
    int64_t kv_hi, const int64_t head_dim, int64_t block_size, int64_t block_stride,
    float scale, float *restrict scores, int64_t P) {
    int64_t lo = INT64_MAX, hi = 0;  /* the positions any row sees */
    for (int64_t i = 0; i < R; i++)
        if (outs[i] != NULL && begins[i] < ends[i]) {
            lo = begins[i] < lo ? begins[i] : lo;
            hi = ends[i] > hi ? ends[i] : hi;
        }
#if defined(__AVX512BF16__)
    if (kv_bf16 && head_dim % 32 == 0 && head_dim <= 256) {
        attend_scores_dp(outs, q, q_stride, (const uint16_t *)k_cache,
                         (const uint16_t *)v_cache, table, begins, ends, R, lo, hi, num_heads,
                         group, kv_lo, kv_hi, head_dim, block_size, block_stride, scale,
                         scores, P);
        attend_softmax(outs, begins, ends, R, num_heads, kv_lo * group, kv_hi * group,
                       head_dim, scores, P);
        attend_values_dp(outs, (const uint16_t *)v_cache, table, begins, ends, R, lo, hi,
                         num_heads, group, kv_lo, kv_hi, head_dim, block_size, block_stride,
                         scores, P);
        return;
    }
#endif
#if defined(__AVX512F__)
    if (head_dim % 16 == 0 && head_dim <= 256)
        attend_scores_x16(outs, q, q_stride, k_cache, v_cache, kv_bf16, table, begins, ends,
                          R, lo, hi, num_heads, group, kv_lo, kv_hi, head_dim, block_size,
                          block_stride, scale, scores, P);
    else
#endif
        attend_scores(outs, q, q_stride, k_cache, v_cache, kv_bf16, table, begins, ends, R,
                      lo, hi, num_heads, group, kv_lo, kv_hi, head_dim, block_size,
                      block_stride, scale, scores, P);
    attend_softmax(outs, begins, ends, R, num_heads, kv_lo * group, kv_hi * group, head_dim,
                   scores, P);
    attend_values(outs, v_cache, kv_bf16, table, begins, ends, R, lo, hi, num_heads, group,
                  kv_lo, kv_hi, head_dim, block_size, block_stride, scores, P);
}

/* attend_rows() for one cache element type, the common head sizes compiled as constants. */
#define ATTEND_HEAD_SIZES(KV_BF16)                                                          \
    do {                                                                                   \
        if (head_dim == 64)                                                                \
            attend_rows(outs, q, q_stride, k_cache, v_cache, KV_BF16, table, begins, ends, \
                        R, num_heads, group, kv_lo, kv_hi, 64, block_size, block_stride,   \
                        scale, scores, P);                                                 \
        else if (head_dim == 128)                                                          \
            attend_rows(outs, q, q_stride, k_cache, v_cache, KV_BF16, table, begins, ends, \
                        R, num_heads, group, kv_lo, kv_hi, 128, block_size, block_stride,  \
                        scale, scores, P);                                                 \
        else                                                                               \
            attend_rows(outs, q, q_stride, k_cache, v_cache, KV_BF16, table, begins, ends, \
                        R, num_heads, group, kv_lo, kv_hi, head_dim, block_size,           \
                        block_stride, scale, scores, P);                                   \
    } while (0)

/* attend_rows() with the cache's element type and the common head sizes as constants. */
static inline void attend_request_rows(float *const *restrict outs, const float *restrict q,
                                       int64_t q_stride, const void *restrict k_cache,
                                       const void *restrict v_cache, int kv_bf16,
                                       const int32_t *restrict table,
                                       const int64_t *restrict begins,
                                       const int64_t *restrict ends, int64_t R,
                                       int64_t num_heads, int64_t group, int64_t kv_lo,
                                       int64_t kv_hi, int64_t head_dim,
                                       int64_t block_size, int64_t block_stride, float scale,
                                       float *restrict scores, int64_t P) {
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

/* The attention of a context split in num_parts ranges from their attend_rows results,
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

/* Rows attended together: a prefill chunk's (or a verification's) consecutive tokens of one
 * request, up to this many, read each position's K/V once (attend_rows). */
#define ATTN_ROW_BLOCK 16

/* Part j of R <= ATTN_ROW_BLOCK rows of one request (queries q + i * q_stride, seq_lens[i],
 * under a sliding window of `window` positions, 0: none) into parts_of[i], NULL for a row
 * without a part j, the query heads of KV heads kv_lo .. kv_hi - 1 (attend_rows). `scores`
 * holds R * num_heads * attn_part_len(block_size) floats. Every row's bits are those of
 * attn_compute_part on it alone. */
void attn_compute_rows_part(float *const *restrict parts_of, const float *restrict q,
                            int64_t q_stride, const void *restrict k_cache,
                            const void *restrict v_cache, int kv_bf16,
                            const int32_t *restrict table, const int32_t *restrict seq_lens,
                            int64_t R, int64_t window, int64_t j, int64_t num_heads,
                            int64_t group, int64_t kv_lo, int64_t kv_hi, int64_t head_dim,
                            int64_t block_size, int64_t block_stride, float scale,
                            float *restrict scores);

/* Part j of one token (query q, its request's block table, its seq_len) into `part`
 * (attn_part_floats): attend_rows over the part's positions, K/V of the cache's element type
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
