/*
 * attend_rows' products over a bf16 K/V cache on AVX512-BF16 (attention.h): vdpbf16ps takes
 * pairs of bf16 products into float32 lanes, twice the multiply-adds of a float32 FMA per
 * instruction, and reads K and V as stored (no widening). Where a verification's rows
 * attend a long context the float32 kernels ran at ~70% of the FMA peak and the attention
 * was 40% of the step (9 rows, ~700 positions, the bundled model), so the products
 * themselves had to get cheaper.
 *
 * What it rounds: the query to bf16 once per use (as this build's GEMMs round their inputs,
 * gemm.h), and each softmax weight e^(s - max) to bf16 for the value sums (as FlashAttention
 * does); the scores, the max, the sums and every accumulator stay float32. llama.cpp's CPU
 * attention likewise rounds the query to its f16 cache's type. A row's bits still depend
 * only on its query, its K/V and its range: every product is the same instructions in the
 * same order whatever the rows beside it, and which kernel runs depends on the build and
 * the cache's type alone, never on the step.
 */
#ifndef AIOENGINE_ATTENTION_BF16_H
#define AIOENGINE_ATTENTION_BF16_H

#if defined(__AVX512BF16__)
#include <immintrin.h>
#include <stdint.h>

#include "attention_scores.h"
#include "kv_access.h"

/* The largest head_dim / 16 the value kernel holds in registers for one head. */
#define ATTN_DP_MAX_CHUNKS 16

/* 32 floats of a query head from q on as 32 bf16 in order (element e in 16-bit lane e). */
static inline __m512bh attn_q_bf16(const float *restrict q) {
    return _mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + 16), _mm512_loadu_ps(q));
}

/* attend_scores over a bf16 cache, head_dim a multiple of 32 (at most 256): s_hp = (q_h .
 * k_p) * scale, each position's dot product a chain of vdpbf16ps over its 32-wide chunks
 * in d order, the 16 positions of a group then summed across lanes together (hsum16x16). */
static inline __attribute__((always_inline)) void attend_scores_dp(
    float *const *restrict outs, const float *restrict q, int64_t q_stride,
    const uint16_t *restrict k_cache, const uint16_t *restrict v_cache,
    const int32_t *restrict table, const int64_t *restrict begins,
    const int64_t *restrict ends, int64_t R, int64_t lo, int64_t hi, int64_t num_heads,
    int64_t group, int64_t kv_lo, int64_t kv_hi, const int64_t head_dim, int64_t block_size,
    int64_t block_stride, float scale, float *restrict scores, int64_t P) {
    const int64_t num_kv = num_heads / group, slot_stride = num_kv * head_dim;
    const int64_t chunks = head_dim / 32;
    const __m512 vscale = _mm512_set1_ps(scale);
    int64_t slots[32];  /* positions p0 .. p0 + 31: this group's and the next's */
    for (int64_t p0 = lo; p0 < hi; p0 += 16) {
        const int64_t pn = hi - p0 < 16 ? hi - p0 : 16;
        kv_slots(slots, table, p0, hi - p0 < 32 ? hi - p0 : 32, block_size, block_stride,
                 slot_stride);
        for (int64_t g = kv_lo; g < kv_hi; g++) {
            const uint16_t *krow[16];  /* past hi: the last row again, its scores unused */
            for (int64_t t = 0; t < 16; t++) {
                krow[t] = k_cache + slots[t < pn ? t : pn - 1] + g * head_dim;
                if (t < pn && p0 + t + 16 < hi)  /* K 16 positions ahead, this V for later */
                    kv_prefetch(k_cache, slots[t + 16] + g * head_dim, head_dim, 1, 3);
                if (t < pn) kv_prefetch(v_cache, slots[t] + g * head_dim, head_dim, 1, 2);
            }
            for (int64_t i = 0; i < R; i++) {
                int64_t a, b;
                if (!attn_row_span(outs, begins, ends, i, p0, pn, &a, &b)) continue;
                const __mmask16 keep = attn_span_lanes(a, b, p0);
                for (int64_t h = g * group; h < (g + 1) * group; h++) {
                    const float *qh = q + i * q_stride + h * head_dim;
                    __m512bh qc[ATTN_DP_MAX_CHUNKS / 2];
                    __m512 dots[16];
                    for (int64_t c = 0; c < chunks; c++) qc[c] = attn_q_bf16(qh + 32 * c);
                    for (int t = 0; t < 16; t++) {
                        __m512 acc = _mm512_setzero_ps();
                        for (int64_t c = 0; c < chunks; c++)
                            acc = _mm512_dpbf16_ps(
                                acc, qc[c], (__m512bh)_mm512_loadu_si512(krow[t] + 32 * c));
                        dots[t] = acc;
                    }
                    float *s = scores + (i * num_heads + h) * P - begins[i];
                    _mm512_mask_storeu_ps(s + p0, keep, _mm512_mul_ps(hsum16x16(dots), vscale));
                }
            }
        }
    }
}

/* 16-bit lane 2d + e of the pairs of two 16-element rows held as [row 0 | row 1]: row e's
 * element d, so 32-bit lane d holds (row 0's d, row 1's d). */
static const int16_t attn_pair_index[32] __attribute__((aligned(64))) = {
    0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
    8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};

/* V of a 16-position group as 8 position pairs x head_dim / 16 chunks of 16 (d, pair)
 * lanes (pairs[j * chunks + c]: positions p0 + 2j and p0 + 2j + 1, d in chunk c), zeros
 * for positions before `first` or from pn on (so a zero weight never meets stale bits). */
static inline __attribute__((always_inline)) void attn_v_pairs(
    __m512i *restrict pairs, const uint16_t *restrict v_cache, const int64_t *restrict slots,
    int64_t first, int64_t pn, int64_t g, const int64_t head_dim) {
    const int64_t chunks = head_dim / 16;
    const __m512i idx = _mm512_load_si512(attn_pair_index);
    for (int64_t j = 0; j < 8; j++) {
        const int64_t t0 = 2 * j, t1 = 2 * j + 1;
        const int in0 = t0 >= first && t0 < pn, in1 = t1 >= first && t1 < pn;
        const uint16_t *r0 = v_cache + (in0 ? slots[t0] : 0) + g * head_dim;
        const uint16_t *r1 = v_cache + (in1 ? slots[t1] : 0) + g * head_dim;
        for (int64_t c = 0; c < chunks; c++) {
            const __m256i lo = in0 ? _mm256_loadu_si256((const __m256i *)(r0 + 16 * c))
                                   : _mm256_setzero_si256();
            const __m256i hi = in1 ? _mm256_loadu_si256((const __m256i *)(r1 + 16 * c))
                                   : _mm256_setzero_si256();
            const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
            pairs[j * chunks + c] = _mm512_permutexvar_epi16(idx, both);
        }
    }
}

/* attend_values over a bf16 cache, head_dim a multiple of 32 (at most 256): o += e^(s -
 * max) v, the weights rounded to bf16 in position pairs (a pair's weight outside the row's
 * range is 0), each pair of positions one vdpbf16ps per 16 elements of o, the pairs in
 * position order. A row takes the pairs its range touches, whatever the other rows take. */
static inline __attribute__((always_inline)) void attend_values_dp(
    float *const *restrict outs, const uint16_t *restrict v_cache,
    const int32_t *restrict table, const int64_t *restrict begins,
    const int64_t *restrict ends, int64_t R, int64_t lo, int64_t hi, int64_t num_heads,
    int64_t group, int64_t kv_lo, int64_t kv_hi, const int64_t head_dim, int64_t block_size,
    int64_t block_stride, const float *restrict scores, int64_t P) {
    const int64_t num_kv = num_heads / group, slot_stride = num_kv * head_dim;
    const int64_t chunks = head_dim / 16;
    __m512i pairs[8 * ATTN_DP_MAX_CHUNKS];
    int64_t slots[16];
    for (int64_t p0 = lo - lo % 16; p0 < hi; p0 += 16) {
        const int64_t pn = hi - p0 < 16 ? hi - p0 : 16, first = p0 < lo ? lo - p0 : 0;
        kv_slots(slots + first, table, p0 + first, pn - first, block_size, block_stride,
                 slot_stride);
        for (int64_t g = kv_lo; g < kv_hi; g++) {
            attn_v_pairs(pairs, v_cache, slots, first, pn, g, head_dim);
            for (int64_t i = 0; i < R; i++) {
                int64_t a, b;
                if (!attn_row_span(outs, begins, ends, i, p0, pn, &a, &b)) continue;
                const __mmask16 keep = attn_span_lanes(a, b, p0);
                const int64_t j_lo = (a - p0) / 2, j_hi = (b - p0 + 1) / 2;
                for (int64_t h = g * group; h < (g + 1) * group; h++) {
                    const float *w = scores + (i * num_heads + h) * P - begins[i] + p0;
                    uint32_t wp[8];  /* (w[2j], w[2j + 1]) as bf16, 0 outside [a, b) */
                    _mm256_storeu_si256((__m256i *)wp, (__m256i)_mm512_cvtneps_pbh(
                                                           _mm512_maskz_loadu_ps(keep, w)));
                    float *oh = outs[i] + h * head_dim;
                    __m512 acc[ATTN_DP_MAX_CHUNKS];
                    for (int64_t c = 0; c < chunks; c++) acc[c] = _mm512_loadu_ps(oh + 16 * c);
                    for (int64_t j = j_lo; j < j_hi; j++) {
                        const __m512bh wj = (__m512bh)_mm512_set1_epi32((int)wp[j]);
                        for (int64_t c = 0; c < chunks; c++)
                            acc[c] = _mm512_dpbf16_ps(acc[c], wj,
                                                      (__m512bh)pairs[j * chunks + c]);
                    }
                    for (int64_t c = 0; c < chunks; c++) _mm512_storeu_ps(oh + 16 * c, acc[c]);
                }
            }
        }
    }
}
#endif /* __AVX512BF16__ */

#endif /* AIOENGINE_ATTENTION_BF16_H */
