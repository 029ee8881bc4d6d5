/*
 * GEMM_W8A8P, the any-M GEMM's tiles for W8A8 (gemm_w8a8.c includes this once): int8 weights
 * with per-column float32 scales, x quantized per row to int8 (w8a8.h), exact int32 sums.
 * The weight [n, k] is repacked at load (kernels/cpu_gemm_w8a8.py `pack_w8a8`) into panels
 * of GEMM_NR = 16 output columns, each 64 * (1 + ceil(k / 4)) bytes:
 *
 *   [0, 64)          the 16 columns' weight sums (int32): what x's +128 offset adds
 *   64 + 64 g + ...  rows 4 g .. 4 g + 3 of the 16 columns, column c at bytes 4 c .. 4 c + 3
 *                    (the last group's rows past k are zeros)
 *
 * so one 32-bit lane is one column (ik_llama.cpp's Q8_K_R8 / SGLang's VNNI layouts) and
 * `vpdpbusd` multiplies a group's 16 columns x 4 k by 4 bytes of x broadcast to every lane.
 * Every load of a group serves every row of the tile; the last panel's columns past n are
 * zeros. Per output element (row r, column c):
 *
 *   dot = sum_k q_w[c, k] q_x[r, k]                 (an exact int32, in any order)
 *   y = ((float)dot * s_x[r]) * s_w[c] (+ bias[c])  (w8a8.h's w8_store)
 *
 * torch's `_int_mm` path (layers._w8a8_linear) bit for bit, whatever M, the tile, the
 * thread or the build (VNNI: x + 128 as unsigned bytes, the offset's 128 * sum_k q_w taken
 * back from the panel's sums; AVX2: 16-bit multiply-adds; else plain C).
 */
#ifndef AIOENGINE_GEMM_W8A8_H
#define AIOENGINE_GEMM_W8A8_H

#include <stdint.h>
#include <string.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "gemm.h"
#include "w8a8.h"

#define W8_GROUP_BYTES 64 /* 4 k of a panel's 16 columns */

/* Row r's dot products of one panel's 16 columns stored through w8_store. */
static inline void w8_store_panel(float *restrict y, const int32_t *dot, int64_t c0, int64_t n,
                                  float sx, const float *restrict scales,
                                  const float *restrict bias) {
    const int64_t count = n - c0 < GEMM_NR ? n - c0 : GEMM_NR;
    if (count > 0) w8_store(y + c0, dot, count, sx, scales + c0, bias ? bias + c0 : NULL);
}

#if defined(GEMV_VNNI)
typedef int32_t w8_v16i __attribute__((vector_size(64)));

/* Rows [0, MR) of x (prepared, row stride xrow bytes) against P panels from w. */
static inline __attribute__((always_inline)) void gemm_w8_tile_zmm(
    float *restrict y, int64_t ldy, const uint8_t *restrict xq, const uint8_t *restrict w,
    int64_t panel_bytes, int64_t k, int64_t c0, int64_t n, const float *restrict scales,
    const float *restrict bias, const int MR, const int P) {
    const int64_t k4 = w8_k4(k), xrow = w8_x_row_bytes(k);
    /* Accumulators as int32 vectors, not __m512i (64-bit lanes): GCC keeps an array of
     * vectors in registers only when every access uses the one vector type. */
    w8_v16i acc[MR][P];
    for (int m = 0; m < MR; m++)
        for (int p = 0; p < P; p++) acc[m][p] = (w8_v16i){0};
    for (int64_t g = 0; g < k4; g++) {
        for (int p = 0; p < P; p++) {
            const __m512i wv = _mm512_loadu_si512(w + p * panel_bytes + W8_GROUP_BYTES * (1 + g));
            for (int m = 0; m < MR; m++) {
                int32_t four;
                memcpy(&four, w8_x_quants(xq + m * xrow) + 4 * g, 4);
                acc[m][p] = (w8_v16i)_mm512_dpbusd_epi32((__m512i)acc[m][p],
                                                         _mm512_set1_epi32(four), wv);
            }
        }
    }
    /* The offset's share, 128 * the column's weight sum, taken back exactly; every sum
     * leaves the registers before the first (out-of-line) store call. */
    int32_t dot[MR][P][16] __attribute__((aligned(64)));
    for (int p = 0; p < P; p++) {
        const __m512i offset = _mm512_slli_epi32(_mm512_loadu_si512(w + p * panel_bytes), 7);
        for (int m = 0; m < MR; m++)
            _mm512_store_si512(dot[m][p], _mm512_sub_epi32((__m512i)acc[m][p], offset));
    }
    for (int m = 0; m < MR; m++)
        for (int p = 0; p < P; p++)
            w8_store_panel(y + m * ldy, dot[m][p], c0 + GEMM_NR * p, n,
                           w8_x_scale(xq + m * xrow), scales, bias);
}

/* Panels per tile: MR * P accumulators within 24 of the 32 registers. */
static inline int gemm_w8_tile_panels(int64_t mr) { return mr == 1 ? 8 : mr == 2 ? 6 : 4; }

#define W8_ZMM(MR, P) \
    gemm_w8_tile_zmm(y, ldy, xq, w, panel_bytes, k, c0, n, scales, bias, MR, P)

/* A tile of mr rows (1..6) over np panels: the widest tile while np allows it, then one
 * panel at a time (which changes no element's arithmetic). */
static void gemm_w8_tile_any(float *restrict y, int64_t ldy, const uint8_t *restrict xq,
                             const uint8_t *restrict w, int64_t panel_bytes, int64_t k,
                             int64_t c0, int64_t n, const float *restrict scales,
                             const float *restrict bias, int64_t mr, int64_t np) {
    const int64_t tp = gemm_w8_tile_panels(mr);
    for (int64_t done = 0; done < np;) {
        const int full = np - done >= tp;
        switch (mr * 2 + full) {
        case 2: W8_ZMM(1, 1); break;
        case 3: W8_ZMM(1, 8); break;
        case 4: W8_ZMM(2, 1); break;
        case 5: W8_ZMM(2, 6); break;
        case 6: W8_ZMM(3, 1); break;
        case 7: W8_ZMM(3, 4); break;
        case 8: W8_ZMM(4, 1); break;
        case 9: W8_ZMM(4, 4); break;
        case 10: W8_ZMM(5, 1); break;
        case 11: W8_ZMM(5, 4); break;
        case 12: W8_ZMM(6, 1); break;
        default: W8_ZMM(6, 4); break;
        }
        const int64_t step = full ? tp : 1;
        done += step;
        w += step * panel_bytes;
        c0 += step * GEMM_NR;
    }
}

#elif defined(__AVX2__)
/* AVX2 (and AVX-512 without VNNI): a quarter panel (4 columns x 4 k, 16 bytes) widened to
 * int16 per ymm; `vpmaddwd` with 4 int16 of x broadcast leaves column i's k 0-1 products
 * in lane 2 i and its k 2-3 products in lane 2 i + 1, summed exactly into int32 lanes; the
 * two lanes of a column are added at the end. MR <= 3 rows: 4 MR accumulators. */
static inline __attribute__((always_inline)) void gemm_w8_tile_ymm(
    float *restrict y, int64_t ldy, const uint8_t *restrict xq, const uint8_t *restrict w,
    int64_t k, int64_t c0, int64_t n, const float *restrict scales,
    const float *restrict bias, const int MR) {
    const int64_t k4 = w8_k4(k), xrow = w8_x_row_bytes(k);
    __m256i acc[MR][4];
    for (int m = 0; m < MR; m++)
        for (int q = 0; q < 4; q++) acc[m][q] = _mm256_setzero_si256();
    for (int64_t g = 0; g < k4; g++) {
        __m256i xb[MR];
        for (int m = 0; m < MR; m++) {
            int64_t four;
            memcpy(&four, w8_x_quants(xq + m * xrow) + 4 * g, 8);
            xb[m] = _mm256_set1_epi64x(four);
        }
        for (int q = 0; q < 4; q++) {
            const __m256i wv = _mm256_cvtepi8_epi16(_mm_loadu_si128(
                (const __m128i *)(w + W8_GROUP_BYTES * (1 + g) + 16 * q)));
            for (int m = 0; m < MR; m++)
                acc[m][q] = _mm256_add_epi32(acc[m][q], _mm256_madd_epi16(wv, xb[m]));
        }
    }
    for (int m = 0; m < MR; m++) {
        int32_t lanes[32], dot[16];
        for (int q = 0; q < 4; q++) _mm256_storeu_si256((__m256i *)(lanes + 8 * q), acc[m][q]);
        for (int c = 0; c < 16; c++) dot[c] = lanes[2 * c] + lanes[2 * c + 1];
        w8_store_panel(y + m * ldy, dot, c0, n, w8_x_scale(xq + m * xrow), scales, bias);
    }
}

static void gemm_w8_tile_any(float *restrict y, int64_t ldy, const uint8_t *restrict xq,
                             const uint8_t *restrict w, int64_t panel_bytes, int64_t k,
                             int64_t c0, int64_t n, const float *restrict scales,
                             const float *restrict bias, int64_t mr, int64_t np) {
    const int64_t xrow = w8_x_row_bytes(k);
    for (int64_t p = 0; p < np; p++)
        for (int64_t m = 0; m < mr; m += 3) {
            const uint8_t *xm = xq + m * xrow, *wp = w + p * panel_bytes;
            float *ym = y + m * ldy;
            const int64_t c = c0 + GEMM_NR * p;
            switch (mr - m < 3 ? mr - m : 3) {
            case 1: gemm_w8_tile_ymm(ym, ldy, xm, wp, k, c, n, scales, bias, 1); break;
            case 2: gemm_w8_tile_ymm(ym, ldy, xm, wp, k, c, n, scales, bias, 2); break;
            default: gemm_w8_tile_ymm(ym, ldy, xm, wp, k, c, n, scales, bias, 3); break;
            }
        }
}

#else
/* Without AVX2: plain C, the same integer sums and epilogue. */
static void gemm_w8_tile_any(float *restrict y, int64_t ldy, const uint8_t *restrict xq,
                             const uint8_t *restrict w, int64_t panel_bytes, int64_t k,
                             int64_t c0, int64_t n, const float *restrict scales,
                             const float *restrict bias, int64_t mr, int64_t np) {
    const int64_t xrow = w8_x_row_bytes(k);
    for (int64_t p = 0; p < np; p++)
        for (int64_t m = 0; m < mr; m++) {
            const i8_xelem *qx = w8_x_quants(xq + m * xrow);
            const int8_t *panel = (const int8_t *)(w + p * panel_bytes) + W8_GROUP_BYTES;
            int32_t dot[16];
            for (int c = 0; c < 16; c++) {
                int32_t t = 0;
                for (int64_t d = 0; d < k; d++)
                    t += (int32_t)panel[W8_GROUP_BYTES * (d / 4) + 4 * c + d % 4] *
                         ((int32_t)qx[d] - I8_XOFFSET);
                dot[c] = t;
            }
            w8_store_panel(y + m * ldy, dot, c0 + GEMM_NR * p, n, w8_x_scale(xq + m * xrow),
                           scales, bias);
        }
}
#endif

#endif /* AIOENGINE_GEMM_W8A8_H */
