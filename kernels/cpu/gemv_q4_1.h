/*
 * GEMV_Q4_1 rows of gemv.h: the GGUF's own Q4_1 blocks, read as the file holds them. A
 * block is 20 bytes for 32 weights: fp16 d, fp16 m, 16 bytes of nibbles (byte j holds
 * weight j in its low half, weight j + 16 in its high half); w = d q + m. x is quantized
 * per 32-block to int8 first (llama.cpp's Q4_1 x Q8_1): s_b = max|x_b| / 127, qx = round(x / s_b),
 * so each block is an exact integer sum and
 *
 *   y = sum_b s_b (d_b sum_j q_j qx_j + m_b sum_j qx_j) (+ bias)
 *
 * (layers._q4_1_linear computes the same from dequantized values, up to float rounding).
 * Measured (scripts/experiments/q4_1_gemv.c): with float x the nibble widening is
 * compute-bound (14-17 GB/s); with int8 x and VNNI, 27-28 GB/s.
 */
#ifndef AIOENGINE_GEMV_Q4_1_H
#define AIOENGINE_GEMV_Q4_1_H

#include <stdint.h>

#include "q4_1.h"

#if defined(__AVX2__)
/* The 8 int32 lanes of a block's q . qx (the lanes sum to it): nibbles (unsigned) x int8. */
static inline __m256i q41_block_lanes(const uint8_t *restrict qs, const int8_t *restrict qx) {
    const __m128i v = _mm_loadu_si128((const __m128i *)qs);
    const __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0x0F)),
                                       _mm_and_si128(v, _mm_set1_epi8(0x0F)));
    const __m256i x = _mm256_loadu_si256((const __m256i *)qx);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), q, x);
#else
    /* u8 x s8 pairs into int16 (|15 * 127 * 2| fits), then pairs of those into int32. */
    return _mm256_madd_epi16(_mm256_maddubs_epi16(q, x), _mm256_set1_epi16(1));
#endif
}
#endif

static inline __attribute__((always_inline)) void gemv_rows_q41(
    float *restrict y, int64_t y_stride, const float *restrict xp, int64_t M_all,
    const gemv_weight *W, const float *restrict bias, int64_t lo, int64_t hi, int64_t k,
    int64_t m0, const int M) {
    (void)M_all; /* gemv_rows_i8's signature: rows here are m0-relative, whatever M_all */
    const int64_t nb = k / 32, xrow = q41_x_row_bytes(k);
    const uint8_t *x0 = (const uint8_t *)xp + m0 * xrow;
    for (int64_t r = lo; r < hi; r++) {
        const uint8_t *wr = (const uint8_t *)W->data + r * nb * 20;
        float t[4] = {0.0f, 0.0f, 0.0f, 0.0f};  /* the m_b sum_j qx_j terms */
#if defined(__AVX2__)
        /* Each block's lanes to float, times s_b d_b, into float lanes: no horizontal sum
         * per block (2.4 against 5.4 ms a pass in scripts/experiments/q4_1_gemv.c). */
        __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                         _mm256_setzero_ps()};
#endif
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = wr + b * 20;
            const float d = q41_half(blk), mn = q41_half(blk + 2);
            for (int m = 0; m < M; m++) {
                const uint8_t *xr = x0 + m * xrow;
                const float sb = ((const float *)xr)[b];
                const int8_t *qx = (const int8_t *)(xr + nb * 8) + b * 32;
                t[m] += sb * mn * (float)((const int32_t *)(xr + nb * 4))[b];
#if defined(__AVX2__)
                acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q41_block_lanes(blk + 4, qx)),
                                         _mm256_set1_ps(sb * d), acc[m]);
#else
                int32_t dot = 0;
                for (int j = 0; j < 16; j++)
                    dot += (int32_t)(blk[4 + j] & 0x0F) * qx[j] + (int32_t)(blk[4 + j] >> 4) * qx[j + 16];
                t[m] += sb * d * (float)dot;
#endif
            }
        }
        const float bv = bias ? bias[r] : 0.0f;
        for (int m = 0; m < M; m++) {
#if defined(__AVX2__)
            float l[8];
            _mm256_storeu_ps(l, acc[m]);
            t[m] += ((l[0] + l[4]) + (l[1] + l[5])) + ((l[2] + l[6]) + (l[3] + l[7]));
#endif
            y[m * y_stride + r] = t[m] + bv;
        }
    }
}

#endif /* AIOENGINE_GEMV_Q4_1_H */
