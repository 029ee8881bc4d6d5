/*
 * GEMM_Q41P, the any-M GEMM's tiles on a GGUF's Q4_1 blocks (gemm_q4_1.c includes this once).
 * The blocks are repacked at load (kernels/cpu_gemm.py `pack_weight`), byte for byte, into
 * panels of GEMM_NR = 16 output columns; a panel is k / 32 groups of 320 bytes, group b
 * holding 32-block b of its 16 columns:
 *
 *   [0, 32)    d of columns 0..15 (fp16)
 *   [32, 64)   m of columns 0..15 (fp16)
 *   [64, 320)  4 chunks of 64 bytes; chunk j holds, for column c at bytes 4 c .. 4 c + 3,
 *              the column's nibble bytes 4 j .. 4 j + 3 (low halves: weights 4 j .. 4 j + 3
 *              of the block, high halves: weights 16 + 4 j .. 16 + 4 j + 3)
 *
 * the interleave of ik_llama.cpp's *_R8 and llama.cpp's block_q4_0x8 layouts, four bytes
 * per column so that one 32-bit lane is one column: a chunk's low (high) nibbles are 16
 * columns x 4 consecutive k, which `vpdpbusd` multiplies by 4 bytes of x broadcast to every
 * lane and sums into the column's int32 lane. Every load of a chunk, d and m serves every
 * row of the tile. The last panel's columns past n are zero blocks.
 *
 * x is quantized per 32-block to int8 (q4_1.h's q41_prepare_x). Per output element
 * (column c, row r) and block b, in the order b = 0, 1, ...:
 *
 *   dot = sum_j q_j qx_j                        (an exact int32, in any order)
 *   acc = fma((float)dot, d_c * s_b, acc)       (d_c * s_b rounded to float32)
 *   acc = fma(m_c, s_b * (float)sum_j qx_j, acc)
 *
 * then y = acc (+ bias): one sequence of roundings whatever M, the tile or the thread, and
 * the same in the AVX-512 and AVX2 builds (VNNI or 16-bit multiply-adds: integer sums are
 * exact). Compared with a float64 product of the dequantized weights and x quantized and
 * multiplied back (layers.quantize_dequantize_blocks), only float32 rounding differs.
 */
#ifndef AIOENGINE_GEMM_Q4_1_H
#define AIOENGINE_GEMM_Q4_1_H

#include <stdint.h>
#include <string.h>

#include "gemm.h"
#include "q4_1.h"

#define Q41_GROUP_BYTES 320 /* one 32-block of a panel's 16 columns */

static inline int32_t q41_load4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* The plain C tile's two per-block float steps: the vector tiles' fused multiply-adds where
 * the target has FMA (else each product rounded: the baseline build's own bits). */
static inline float q41_block_step(float acc, int32_t dot, float d, float mn, float s,
                                   float sm) {
#if defined(__FMA__)
    return __builtin_fmaf(mn, sm, __builtin_fmaf((float)dot, d * s, acc));
#else
    return mn * sm + ((float)dot * (d * s) + acc);
#endif
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
/* One chunk's 4 k of every column into a row's lanes: VNNI's u8 x s8 dot product into
 * int32, else u8 x s8 pairs into int16 (8 chunks' sums stay within 8 * 2 * 15 * 127) and
 * pairs of int16 into int32 at the block's end. */
/* The sums live in int32-lane vectors, never __m512i (64-bit lanes) between uses: GCC keeps
 * an array of vectors in registers only when every access has the one vector type (with
 * __m512i it kept them on the stack, a load and a store around every multiply-add). */
typedef int32_t q41_v16i __attribute__((vector_size(64)));
#if defined(__AVX512VNNI__)
#define Q41_ZMM_DOT(acc, w, x) \
    ((acc) = (q41_v16i)_mm512_dpbusd_epi32((__m512i)(acc), (w), (x)))
#define Q41_ZMM_INT32(acc) ((__m512i)(acc))
#else
#define Q41_ZMM_DOT(acc, w, x) \
    ((acc) = (q41_v16i)_mm512_add_epi16((__m512i)(acc), _mm512_maddubs_epi16((w), (x))))
#define Q41_ZMM_INT32(acc) _mm512_madd_epi16((__m512i)(acc), _mm512_set1_epi16(1))
#endif

/* Rows [0, MR) of x (prepared, row stride xrow bytes) against P panels from w: columns
 * [c0, c0 + 16 P) of y, those below n stored. */
static inline __attribute__((always_inline)) void gemm_q41_tile_zmm(
    float *restrict y, int64_t ldy, const uint8_t *restrict xq, const uint8_t *restrict w,
    int64_t panel_bytes, int64_t k, int64_t c0, int64_t n, const float *restrict bias,
    const int MR, const int P) {
    const int64_t nb = k / 32, xrow = q41_x_row_bytes(k);
    const int prefetch = gemm_tile_prefetches(MR);
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512 acc[MR][P];
    for (int m = 0; m < MR; m++)
        for (int p = 0; p < P; p++) acc[m][p] = _mm512_setzero_ps();
    q41_v16i dot[MR][P]; /* one block's integer sums (declared once: see q41_v16i) */
    for (int64_t b = 0; b < nb; b++) {
        for (int m = 0; m < MR; m++)
            for (int p = 0; p < P; p++) dot[m][p] = (q41_v16i){0};
        if (prefetch)
            gemm_prefetch_panels(w, panel_bytes, P, b * Q41_GROUP_BYTES, Q41_GROUP_BYTES,
                                 GEMM_PREFETCH_BLOCKS * Q41_GROUP_BYTES);
        for (int j = 0; j < 4; j++)
            for (int p = 0; p < P; p++) {
                const __m512i raw = _mm512_loadu_si512(w + p * panel_bytes +
                                                       b * Q41_GROUP_BYTES + 64 + 64 * j);
                const __m512i lo = _mm512_and_si512(raw, low);
                const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
                for (int m = 0; m < MR; m++) {
                    const int8_t *qx = q41_x_quants(xq + m * xrow, nb, b) + 4 * j;
                    Q41_ZMM_DOT(dot[m][p], lo, _mm512_set1_epi32(q41_load4(qx)));
                    Q41_ZMM_DOT(dot[m][p], hi, _mm512_set1_epi32(q41_load4(qx + 16)));
                }
            }
        for (int p = 0; p < P; p++) {
            const uint8_t *g = w + p * panel_bytes + b * Q41_GROUP_BYTES;
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)g));
            const __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(g + 32)));
            for (int m = 0; m < MR; m++) {
                const uint8_t *row = xq + m * xrow;
                const float s = q41_x_scale(row, b), sm = s * (float)q41_x_sum(row, nb, b);
                const __m512 dotf = _mm512_cvtepi32_ps(Q41_ZMM_INT32(dot[m][p]));
                acc[m][p] = _mm512_fmadd_ps(dotf, _mm512_mul_ps(d, _mm512_set1_ps(s)), acc[m][p]);
                acc[m][p] = _mm512_fmadd_ps(mn, _mm512_set1_ps(sm), acc[m][p]);
            }
        }
    }
    for (int m = 0; m < MR; m++)
        for (int p = 0; p < P; p++) {
            float lanes[16] __attribute__((aligned(64)));
            _mm512_store_ps(lanes, acc[m][p]);
            for (int i = 0; i < 16; i++) {
                const int64_t c = c0 + GEMM_NR * p + i;
                if (c < n) y[m * ldy + c] = bias ? lanes[i] + bias[c] : lanes[i];
            }
        }
}

/* Panels per Q4_1 tile: 2 * MR * P registers of accumulators (int and float) within 24. */
static inline int gemm_q41_tile_panels(int64_t mr) {
    return mr == 1 ? 8 : mr == 2 ? 6 : mr == 3 ? 4 : 2;
}

#define Q41_ZMM(MR, P) gemm_q41_tile_zmm(y, ldy, xq, w, panel_bytes, k, c0, n, bias, MR, P)

/* A tile of mr rows (1..6) over np panels: the widest tile while np allows it, then one
 * panel at a time (which changes no element's arithmetic). */
static void gemm_q41_tile_any(float *restrict y, int64_t ldy, const uint8_t *restrict xq,
                              const uint8_t *restrict w, int64_t panel_bytes, int64_t k,
                              int64_t c0, int64_t n, const float *restrict bias, int64_t mr,
                              int64_t np) {
    const int64_t tp = gemm_q41_tile_panels(mr);
    for (int64_t done = 0; done < np;) {
        const int full = np - done >= tp;
        switch (mr * 2 + full) {
        case 2: Q41_ZMM(1, 1); break;
        case 3: Q41_ZMM(1, 8); break;
        case 4: Q41_ZMM(2, 1); break;
        case 5: Q41_ZMM(2, 6); break;
        case 6: Q41_ZMM(3, 1); break;
        case 7: Q41_ZMM(3, 4); break;
        case 8: Q41_ZMM(4, 1); break;
        case 9: Q41_ZMM(4, 2); break;
        case 10: Q41_ZMM(5, 1); break;
        case 11: Q41_ZMM(5, 2); break;
        case 12: Q41_ZMM(6, 1); break;
        default: Q41_ZMM(6, 2); break;
        }
        const int64_t step = full ? tp : 1;
        done += step;
        w += step * panel_bytes;
        c0 += step * GEMM_NR;
    }
}

#elif defined(__AVX2__)
/* AVX2: half a panel (8 columns) per ymm; u8 x s8 pairs into int16, a block's 8 chunks
 * summed in int16 (within 8 * 2 * 15 * 127), pairs of int16 into int32 once per block.
 * Half i of the tile (from half h0 of w's panel) is half (h0 + i) % 2 of panel
 * (h0 + i) / 2: its chunk bytes 32 bytes on for the second half, d and m 16 bytes on. */
static inline __attribute__((always_inline)) void gemm_q41_tile_ymm(
    float *restrict y, int64_t ldy, const uint8_t *restrict xq, const uint8_t *restrict w,
    int64_t h0, int64_t panel_bytes, int64_t k, int64_t c0, int64_t n,
    const float *restrict bias, const int MR, const int H) {
    const int64_t nb = k / 32, xrow = q41_x_row_bytes(k);
    const int prefetch = gemm_tile_prefetches(MR);
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    const uint8_t *panel[H];
    int64_t second[H]; /* 1 for a panel's second half */
    for (int h = 0; h < H; h++) {
        panel[h] = w + ((h0 + h) / 2) * panel_bytes;
        second[h] = (h0 + h) % 2;
    }
    __m256 acc[MR][H];
    for (int m = 0; m < MR; m++)
        for (int h = 0; h < H; h++) acc[m][h] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256i dot[MR][H];
        for (int m = 0; m < MR; m++)
            for (int h = 0; h < H; h++) dot[m][h] = _mm256_setzero_si256();
        if (prefetch)
            gemm_prefetch_panels(panel[0], panel_bytes, (H + 1) / 2, b * Q41_GROUP_BYTES,
                                 Q41_GROUP_BYTES, GEMM_PREFETCH_BLOCKS * Q41_GROUP_BYTES);
        for (int j = 0; j < 4; j++)
            for (int h = 0; h < H; h++) {
                const uint8_t *chunk =
                    panel[h] + b * Q41_GROUP_BYTES + 64 + 64 * j + 32 * second[h];
                const __m256i raw = _mm256_loadu_si256((const __m256i *)chunk);
                const __m256i lo = _mm256_and_si256(raw, low);
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
                for (int m = 0; m < MR; m++) {
                    const int8_t *qx = q41_x_quants(xq + m * xrow, nb, b) + 4 * j;
                    const __m256i x_lo = _mm256_set1_epi32(q41_load4(qx));
                    const __m256i x_hi = _mm256_set1_epi32(q41_load4(qx + 16));
                    dot[m][h] = _mm256_add_epi16(
                        dot[m][h], _mm256_add_epi16(_mm256_maddubs_epi16(lo, x_lo),
                                                    _mm256_maddubs_epi16(hi, x_hi)));
                }
            }
        for (int h = 0; h < H; h++) {
            const uint8_t *g = panel[h] + b * Q41_GROUP_BYTES + 16 * second[h];
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g));
            const __m256 mn = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + 32)));
            for (int m = 0; m < MR; m++) {
                const uint8_t *row = xq + m * xrow;
                const float s = q41_x_scale(row, b), sm = s * (float)q41_x_sum(row, nb, b);
                const __m256 dotf = _mm256_cvtepi32_ps(_mm256_madd_epi16(dot[m][h], ones));
                acc[m][h] = _mm256_fmadd_ps(dotf, _mm256_mul_ps(d, _mm256_set1_ps(s)), acc[m][h]);
                acc[m][h] = _mm256_fmadd_ps(mn, _mm256_set1_ps(sm), acc[m][h]);
            }
        }
    }
    for (int m = 0; m < MR; m++)
        for (int h = 0; h < H; h++) {
            float lanes[8];
            _mm256_storeu_ps(lanes, acc[m][h]);
            for (int i = 0; i < 8; i++) {
                const int64_t c = c0 + 8 * (h0 + h) + i;
                if (c < n) y[m * ldy + c] = bias ? lanes[i] + bias[c] : lanes[i];
            }
        }
}

#define Q41_YMM(MR, H) \
    gemm_q41_tile_ymm(y, ldy, xq, w + (i / 2) * panel_bytes, i % 2, panel_bytes, k, \
                      c0 + (i / 2) * GEMM_NR, n, bias, MR, H)

/* A tile of mr rows (1..6) over np panels, as tiles of 4 half panels (one row), 2 (two
 * rows) or 1 (more), the remainder half by half: at most 12 accumulators of the 16
 * registers. */
static void gemm_q41_tile_any(float *restrict y, int64_t ldy, const uint8_t *restrict xq,
                              const uint8_t *restrict w, int64_t panel_bytes, int64_t k,
                              int64_t c0, int64_t n, const float *restrict bias, int64_t mr,
                              int64_t np) {
    const int64_t halves = 2 * np, width = mr == 1 ? 4 : mr == 2 ? 2 : 1;
    for (int64_t i = 0; i < halves;) {
        const int full = halves - i >= width;
        switch (mr * 2 + full) {
        case 2: Q41_YMM(1, 1); break;
        case 3: Q41_YMM(1, 4); break;
        case 4: Q41_YMM(2, 1); break;
        case 5: Q41_YMM(2, 2); break;
        case 6: case 7: Q41_YMM(3, 1); break;
        case 8: case 9: Q41_YMM(4, 1); break;
        case 10: case 11: Q41_YMM(5, 1); break;
        default: Q41_YMM(6, 1); break;
        }
        i += full ? width : 1;
    }
}

#else
/* Without AVX2: plain C, the same arithmetic per element (exact integer dot products, the
 * two float steps of q41_block_step). */
static void gemm_q41_tile_any(float *restrict y, int64_t ldy, const uint8_t *restrict xq,
                              const uint8_t *restrict w, int64_t panel_bytes, int64_t k,
                              int64_t c0, int64_t n, const float *restrict bias, int64_t mr,
                              int64_t np) {
    const int64_t nb = k / 32, xrow = q41_x_row_bytes(k);
    for (int64_t p = 0; p < np; p++)
        for (int64_t m = 0; m < mr; m++)
            for (int64_t i = 0; i < GEMM_NR && c0 + GEMM_NR * p + i < n; i++) {
                const uint8_t *row = xq + m * xrow;
                float acc = 0.0f;
                for (int64_t b = 0; b < nb; b++) {
                    const uint8_t *g = w + p * panel_bytes + b * Q41_GROUP_BYTES;
                    const int8_t *qx = q41_x_quants(row, nb, b);
                    int32_t dot = 0;
                    for (int j = 0; j < 16; j++) {
                        const uint8_t byte = g[64 + 64 * (j / 4) + 4 * i + j % 4];
                        dot += (int32_t)(byte & 0x0F) * qx[j] + (int32_t)(byte >> 4) * qx[j + 16];
                    }
                    const float s = q41_x_scale(row, b);
                    acc = q41_block_step(acc, dot, q41_half(g + 2 * i), q41_half(g + 32 + 2 * i),
                                         s, s * (float)q41_x_sum(row, nb, b));
                }
                const int64_t c = c0 + GEMM_NR * p + i;
                y[m * ldy + c] = bias ? acc + bias[c] : acc;
            }
}
#endif

#endif /* AIOENGINE_GEMM_Q4_1_H */
