/*
 * attend_rows' scores (attention.h): s_hp = (q_h . k_p) * scale for each row of a request's
 * task and each position it sees, each position's K head widened once for every row. Two
 * forms: 16 positions in the lanes of AVX-512 registers where the build and the head size
 * allow, one position at a time (a vectorised dot product) otherwise. The build and the
 * head size choose, never the step, so a score's bits depend on its query and K alone.
 */
#ifndef AIOENGINE_ATTENTION_SCORES_H
#define AIOENGINE_ATTENTION_SCORES_H

#include <stdint.h>

#include "kv_access.h"

/* Row i's positions in the group of pn positions from p0, [*a, *b) (the part of its range
 * [begins[i], ends[i]) there); whether it has any and an output to take them. */
static inline int attn_row_span(float *const *restrict outs, const int64_t *restrict begins,
                                const int64_t *restrict ends, int64_t i, int64_t p0, int64_t pn,
                                int64_t *a, int64_t *b) {
    *a = p0 > begins[i] ? p0 : begins[i];
    *b = p0 + pn < ends[i] ? p0 + pn : ends[i];
    return outs[i] != NULL && *a < *b;
}

/* attend_rows' scores: s_hp = (q_h . k_p) * scale for each row's positions, into its
 * [num_heads, P] block of `scores` (the query heads of KV heads kv_lo .. kv_hi - 1 only);
 * each position's K head widened once for every row. */
static inline __attribute__((always_inline)) void attend_scores(
    float *const *restrict outs, const float *restrict q, int64_t q_stride,
    const void *restrict k_cache, const void *restrict v_cache, const int kv_bf16,
    const int32_t *restrict table, const int64_t *restrict begins,
    const int64_t *restrict ends, int64_t R, int64_t lo, int64_t hi, int64_t num_heads,
    int64_t group, int64_t kv_lo, int64_t kv_hi, const int64_t head_dim, int64_t block_size,
    int64_t block_stride, float scale, float *restrict scores, int64_t P) {
    const int64_t num_kv = num_heads / group, slot_stride = num_kv * head_dim;
    float row[head_dim];  /* a K head widened to float32, for every row that sees it */
    int64_t slots[32];    /* positions p0 .. p0 + 31: this group's and the next's */
    for (int64_t p = lo; p < hi; p++) {
        const int64_t t = (p - lo) % 16;
        if (t == 0)
            kv_slots(slots, table, p, hi - p < 32 ? hi - p : 32, block_size, block_stride,
                     slot_stride);
        const int64_t slot = slots[t];
        if (p + 16 < hi)  /* K 16 positions ahead, this V for attend_values */
            kv_prefetch(k_cache, slots[t + 16], slot_stride, kv_bf16, 3);
        kv_prefetch(v_cache, slot, slot_stride, kv_bf16, 2);
        for (int64_t g = kv_lo; g < kv_hi; g++) {
            for (int64_t d = 0; d < head_dim; d++)
                row[d] = kv_at(k_cache, slot + g * head_dim + d, kv_bf16);
            for (int64_t i = 0; i < R; i++) {
                if (outs[i] == NULL || p < begins[i] || p >= ends[i]) continue;
                for (int64_t h = g * group; h < (g + 1) * group; h++) {
                    const float *qh = q + i * q_stride + h * head_dim;
                    float dot = 0.0f;
                    for (int64_t d = 0; d < head_dim; d++) dot += qh[d] * row[d];
                    scores[(i * num_heads + h) * P + p - begins[i]] = dot * scale;
                }
            }
        }
    }
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* The lanes of positions [a, b) in a 16-position group from p0: a - p0 .. b - p0 - 1. */
static inline __mmask16 attn_span_lanes(int64_t a, int64_t b, int64_t p0) {
    return (__mmask16)(((1u << (b - p0)) - 1) & ~((1u << (a - p0)) - 1));
}

/* Lane t of the result = the sum of a[t]'s 16 lanes, for 16 vectors at once: pairs within
 * each 128-bit lane (unpacks), then the lanes (f32x4 shuffles). Every vector's sum is the
 * same sequence of adds, ((l0 + l2) + (l1 + l3)) per 128-bit lane j then (L0 + L1) + (L2 +
 * L3), whichever slot t it sits in: a score does not depend on its neighbours. */
static inline __m512 hsum16x16(const __m512 a[16]) {
    __m512 b[8], c[4];
    for (int i = 0; i < 8; i++)
        b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                             _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        const __m512d s = _mm512_castps_pd(b[2 * i]), t = _mm512_castps_pd(b[2 * i + 1]);
        c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(s, t)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(s, t)));
    }
    const int even = _MM_SHUFFLE(2, 0, 2, 0), odd = _MM_SHUFFLE(3, 1, 3, 1);
    const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], even),
                                    _mm512_shuffle_f32x4(c[0], c[1], odd));
    const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], even),
                                    _mm512_shuffle_f32x4(c[2], c[3], odd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, even), _mm512_shuffle_f32x4(w0, w1, odd));
}

/* attend_scores for head_dim a multiple of 16 (at most 256), 16 positions at a time: each
 * position's dot product a chain of FMAs over its 16-wide chunks in d order, then the 16
 * positions' lanes summed together (hsum16x16) instead of one horizontal sum per position
 * (which was most of a score's instructions). A score is the same instructions whatever
 * rows or positions share its block. */
static inline __attribute__((always_inline)) void attend_scores_x16(
    float *const *restrict outs, const float *restrict q, int64_t q_stride,
    const void *restrict k_cache, const void *restrict v_cache, const int kv_bf16,
    const int32_t *restrict table, const int64_t *restrict begins,
    const int64_t *restrict ends, int64_t R, int64_t lo, int64_t hi, int64_t num_heads,
    int64_t group, int64_t kv_lo, int64_t kv_hi, const int64_t head_dim, int64_t block_size,
    int64_t block_stride, float scale, float *restrict scores, int64_t P) {
    const int64_t num_kv = num_heads / group, slot_stride = num_kv * head_dim;
    const int64_t chunks = head_dim / 16;
    float krows[16 * head_dim];
    const __m512 vscale = _mm512_set1_ps(scale);
    int64_t slots[32];  /* positions p0 .. p0 + 31: this group's and the next's */
    for (int64_t p0 = lo; p0 < hi; p0 += 16) {
        const int64_t pn = hi - p0 < 16 ? hi - p0 : 16;
        kv_slots(slots, table, p0, hi - p0 < 32 ? hi - p0 : 32, block_size, block_stride,
                 slot_stride);
        for (int64_t g = kv_lo; g < kv_hi; g++) {
            for (int64_t t = 0; t < pn; t++) {  /* the K heads widened */
                const int64_t slot = slots[t] + g * head_dim;
                /* K 16 positions ahead into L1, this V into L2 for attend_values */
                if (p0 + t + 16 < hi)
                    kv_prefetch(k_cache, slots[t + 16] + g * head_dim, head_dim, kv_bf16, 3);
                kv_prefetch(v_cache, slot, head_dim, kv_bf16, 2);
                for (int64_t d = 0; d < head_dim; d++)
                    krows[t * head_dim + d] = kv_at(k_cache, slot + d, kv_bf16);
            }
            for (int64_t t = pn; t < 16; t++)  /* past hi: zeros, their scores unused */
                for (int64_t d = 0; d < head_dim; d++) krows[t * head_dim + d] = 0.0f;
            for (int64_t i = 0; i < R; i++) {
                int64_t a, b;
                if (!attn_row_span(outs, begins, ends, i, p0, pn, &a, &b)) continue;
                const __mmask16 keep = attn_span_lanes(a, b, p0);
                for (int64_t h = g * group; h < (g + 1) * group; h++) {
                    const float *qh = q + i * q_stride + h * head_dim;
                    __m512 qc[16], dots[16];
                    for (int64_t c = 0; c < chunks; c++) qc[c] = _mm512_loadu_ps(qh + 16 * c);
                    for (int t = 0; t < 16; t++) {
                        const float *k = krows + t * head_dim;
                        __m512 acc = _mm512_mul_ps(qc[0], _mm512_loadu_ps(k));
                        for (int64_t c = 1; c < chunks; c++)
                            acc = _mm512_fmadd_ps(qc[c], _mm512_loadu_ps(k + 16 * c), acc);
                        dots[t] = acc;
                    }
                    /* lane t to position p0 + t's place (masked lanes never touch memory) */
                    float *s = scores + (i * num_heads + h) * P - begins[i];
                    _mm512_mask_storeu_ps(s + p0, keep,
                                          _mm512_mul_ps(hsum16x16(dots), vscale));
                }
            }
        }
    }
}
#endif

#endif /* AIOENGINE_ATTENTION_SCORES_H */
