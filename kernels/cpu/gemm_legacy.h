/*
 * SIMD register tiles of GGUF's legacy 32-weight formats Q8_0 (GEMM_Q80P) and Q4_0
 * (GEMM_Q40P) for the AVX-512 and AVX2 builds (gemm_blocks.h includes this; its header
 * comment is the arithmetic per element and kernels/cpu_blocks.py the panel layout).
 * The tiles are gemm_q4_1.h's: MR rows x P panels, a 32-bit lane per column holding 4
 * consecutive k, x broadcast 4 bytes at a time, one load of a chunk and of d serving
 * every row of the tile.
 *
 * The integer dot - off sx of a block is exact whichever instructions form it, and the float
 * steps are the C tile's, in its order (d s rounded once, one fused multiply-add per block,
 * the bias added last), so these tiles give gemm_blk_tile_c's bits:
 *   Q4_0 nibbles: u8 (<= 15) x s8 by `vpdpbusd`, or `pmaddubsw` into int16 (a block's 8
 *     chunk products stay within 8 * 2 * 15 * 127 < 2^15) widened once per block; minus 8 sx.
 *   Q8_0 bytes (codes q + 128 <= 255): VNNI's `vpdpbusd` on the codes, minus 128 sx; without
 *     VNNI `pmaddubsw` on u8 codes would saturate int16 (2 * 255 * 127), so the signed value
 *     q = code ^ 0x80 is multiplied as |q| x (x with q's sign) (pairs within 2 * 128 * 127
 *     < 2^15) and widened to int32 per chunk: that sum is already dot - 128 sx.
 */
#ifndef AIOENGINE_GEMM_LEGACY_H
#define AIOENGINE_GEMM_LEGACY_H

#include <stdint.h>

#include "gemm.h"
#include "gemm_q4_1.h"
#include "q4_1.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define LEG_Q80_GROUP_BYTES 544
#define LEG_Q40_GROUP_BYTES 288
#define LEG_CODES 32 /* the codes follow the 16 columns' fp16 d */

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define GEMM_LEGACY_SIMD 1

/* A Q8_0 byte chunk as the tile multiplies it (prepared once, used by every row). */
#if defined(__AVX512VNNI__)
typedef __m512i leg_q80_zmm_w;
#define LEG_Q80_ZMM_OFFSET 128 /* the sum is dot over the codes: subtract 128 sx */

static inline __attribute__((always_inline)) leg_q80_zmm_w leg_q80_zmm_prep(__m512i codes) {
    return codes;
}

static inline __attribute__((always_inline)) q41_v16i leg_q80_zmm_dot(q41_v16i acc,
                                                                      leg_q80_zmm_w w,
                                                                      __m512i x) {
    return (q41_v16i)_mm512_dpbusd_epi32((__m512i)acc, w, x);
}
#else
typedef struct {
    __m512i mag;   /* |code - 128| as u8 (128 stays 0x80 = 128 unsigned) */
    __mmask64 neg; /* code - 128 < 0 */
} leg_q80_zmm_w;
#define LEG_Q80_ZMM_OFFSET 0 /* the sum is over signed q already */

static inline __attribute__((always_inline)) leg_q80_zmm_w leg_q80_zmm_prep(__m512i codes) {
    const __m512i q = _mm512_xor_si512(codes, _mm512_set1_epi8((char)0x80));
    return (leg_q80_zmm_w){_mm512_abs_epi8(q), _mm512_movepi8_mask(q)};
}

static inline __attribute__((always_inline)) q41_v16i leg_q80_zmm_dot(q41_v16i acc,
                                                                      leg_q80_zmm_w w,
                                                                      __m512i x) {
    const __m512i xs = _mm512_mask_sub_epi8(x, w.neg, _mm512_setzero_si512(), x);
    const __m512i pairs = _mm512_maddubs_epi16(w.mag, xs);
    return (q41_v16i)_mm512_add_epi32((__m512i)acc,
                                      _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)));
}
#endif

/* Rows [0, MR) of x (prepared) against P panels of format F (GEMM_Q80P or GEMM_Q40P) from
 * w: columns [c0, c0 + 16 P) of y, those below n stored. */
static inline __attribute__((always_inline)) void gemm_leg_tile_zmm(
    float *restrict y, int64_t ldy, const uint8_t *restrict xq, const uint8_t *restrict w,
    int64_t panel_bytes, int64_t k, int64_t c0, int64_t n, const float *restrict bias,
    const int F, const int MR, const int P) {
    const int64_t nb = k / 32, xrow = q41_x_row_bytes(k);
    const int64_t gb = F == GEMM_Q80P ? LEG_Q80_GROUP_BYTES : LEG_Q40_GROUP_BYTES;
    const int32_t off = F == GEMM_Q80P ? LEG_Q80_ZMM_OFFSET : 8;
    const int prefetch = gemm_tile_prefetches(MR);
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512 acc[MR][P];
    for (int m = 0; m < MR; m++)
        for (int p = 0; p < P; p++) acc[m][p] = _mm512_setzero_ps();
    q41_v16i dot[MR][P]; /* one block's integer sums (one vector type: see q41_v16i) */
    for (int64_t b = 0; b < nb; b++) {
        for (int m = 0; m < MR; m++)
            for (int p = 0; p < P; p++) dot[m][p] = (q41_v16i){0};
        if (prefetch)
            gemm_prefetch_panels(w, panel_bytes, P, b * gb, gb, GEMM_PREFETCH_BLOCKS * gb);
        for (int j = 0; j < 4; j++)
            for (int p = 0; p < P; p++) {
                const uint8_t *codes = w + p * panel_bytes + b * gb + LEG_CODES;
                if (F == GEMM_Q80P) {
                    const leg_q80_zmm_w lo = leg_q80_zmm_prep(_mm512_loadu_si512(codes + 128 * j));
                    const leg_q80_zmm_w hi =
                        leg_q80_zmm_prep(_mm512_loadu_si512(codes + 128 * j + 64));
                    for (int m = 0; m < MR; m++) {
                        const int8_t *qx = q41_x_quants(xq + m * xrow, nb, b) + 4 * j;
                        dot[m][p] = leg_q80_zmm_dot(dot[m][p], lo, _mm512_set1_epi32(q41_load4(qx)));
                        dot[m][p] =
                            leg_q80_zmm_dot(dot[m][p], hi, _mm512_set1_epi32(q41_load4(qx + 16)));
                    }
                } else {
                    const __m512i raw = _mm512_loadu_si512(codes + 64 * j);
                    const __m512i lo = _mm512_and_si512(raw, low);
                    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
                    for (int m = 0; m < MR; m++) {
                        const int8_t *qx = q41_x_quants(xq + m * xrow, nb, b) + 4 * j;
                        Q41_ZMM_DOT(dot[m][p], lo, _mm512_set1_epi32(q41_load4(qx)));
                        Q41_ZMM_DOT(dot[m][p], hi, _mm512_set1_epi32(q41_load4(qx + 16)));
                    }
                }
            }
        for (int p = 0; p < P; p++) {
            const uint8_t *g = w + p * panel_bytes + b * gb;
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)g));
            for (int m = 0; m < MR; m++) {
                const uint8_t *row = xq + m * xrow;
                const __m512i sums = F == GEMM_Q80P ? (__m512i)dot[m][p] : Q41_ZMM_INT32(dot[m][p]);
                const __m512i idot =
                    _mm512_sub_epi32(sums, _mm512_set1_epi32(off * q41_x_sum(row, nb, b)));
                const __m512 ds = _mm512_mul_ps(d, _mm512_set1_ps(q41_x_scale(row, b)));
                acc[m][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(idot), ds, acc[m][p]);
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

#define LEG_ZMM(F, MR, P) \
    gemm_leg_tile_zmm(y, ldy, xq, w, panel_bytes, k, c0, n, bias, F, MR, P)
/* The shapes instantiated: Q4_1's full tiles (gemm_q41_tile_panels: 2 MR P accumulators
 * within 24 registers), 2 x 2 (M = 2 meets 6 + 2 panels in every 8-panel claim) and 1 x 1;
 * each further instantiation adds ~0.4 s to the build of gemm_blocks.c. */
#define LEG_ZMM_CASES(F)                                                                    \
    switch (mr * 16 + p) {                                                                 \
    case 17: LEG_ZMM(F, 1, 1); break;                                                       \
    case 24: LEG_ZMM(F, 1, 8); break;                                                       \
    case 34: LEG_ZMM(F, 2, 2); break;                                                       \
    case 38: LEG_ZMM(F, 2, 6); break;                                                       \
    case 52: LEG_ZMM(F, 3, 4); break;                                                       \
    case 66: LEG_ZMM(F, 4, 2); break;                                                       \
    case 82: LEG_ZMM(F, 5, 2); break;                                                       \
    default: LEG_ZMM(F, 6, 2); break;                                                       \
    }

/* One instantiated tile: (mr, p) one of LEG_ZMM_CASES's shapes. */
static void gemm_leg_tile_shape(int fmt, float *restrict y, int64_t ldy,
                                const uint8_t *restrict xq, const uint8_t *restrict w,
                                int64_t panel_bytes, int64_t k, int64_t c0, int64_t n,
                                const float *restrict bias, int64_t mr, int64_t p) {
    if (fmt == GEMM_Q80P) {
        LEG_ZMM_CASES(GEMM_Q80P)
    } else {
        LEG_ZMM_CASES(GEMM_Q40P)
    }
}

/* A tile of mr rows (1..6) over np panels of Q8_0 or Q4_0: the widest tile while np allows,
 * then 2 x 2, then a lone panel row by row (no element's arithmetic depends on the shape). */
static void gemm_leg_tile_any(int fmt, float *restrict y, int64_t ldy,
                              const uint8_t *restrict xq, const uint8_t *restrict w,
                              int64_t panel_bytes, int64_t k, int64_t c0, int64_t n,
                              const float *restrict bias, int64_t mr, int64_t np) {
    const int64_t tp = gemm_q41_tile_panels(mr), xrow = q41_x_row_bytes(k);
    for (int64_t done = 0; done < np;) {
        const int64_t left = np - done;
        const int64_t step = left >= tp ? tp : mr == 2 && left >= 2 ? 2 : 1;
        if (step > 1 || mr == 1)
            gemm_leg_tile_shape(fmt, y, ldy, xq, w, panel_bytes, k, c0, n, bias, mr, step);
        else
            for (int64_t m = 0; m < mr; m++)
                gemm_leg_tile_shape(fmt, y + m * ldy, ldy, xq + m * xrow, w, panel_bytes, k, c0,
                                    n, bias, 1, 1);
        done += step;
        w += step * panel_bytes;
        c0 += step * GEMM_NR;
    }
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define GEMM_LEGACY_SIMD 1

/* AVX2: half a panel (8 columns) per ymm, as gemm_q4_1.h's AVX2 tile: half i of the tile
 * (from half h0 of w's panel) is half (h0 + i) % 2 of panel (h0 + i) / 2, its chunk bytes
 * 32 bytes on for the second half, its d 16 bytes on. Q4_0 sums a block in int16 pairs,
 * Q8_0 (signed q, |q| x sign-adjusted x) widens each chunk's pairs to int32. */
static inline __attribute__((always_inline)) void gemm_leg_tile_ymm(
    float *restrict y, int64_t ldy, const uint8_t *restrict xq, const uint8_t *restrict w,
    int64_t h0, int64_t panel_bytes, int64_t k, int64_t c0, int64_t n,
    const float *restrict bias, const int F, const int MR, const int H) {
    const int64_t nb = k / 32, xrow = q41_x_row_bytes(k);
    const int64_t gb = F == GEMM_Q80P ? LEG_Q80_GROUP_BYTES : LEG_Q40_GROUP_BYTES;
    const int32_t off = F == GEMM_Q80P ? 0 : 8;
    const int prefetch = gemm_tile_prefetches(MR);
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    const __m256i bias8 = _mm256_set1_epi8((char)0x80);
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
            gemm_prefetch_panels(panel[0], panel_bytes, (H + 1) / 2, b * gb, gb,
                                 GEMM_PREFETCH_BLOCKS * gb);
        for (int j = 0; j < 4; j++)
            for (int h = 0; h < H; h++) {
                const uint8_t *codes = panel[h] + b * gb + LEG_CODES + 32 * second[h];
                if (F == GEMM_Q80P) {
                    const __m256i q_lo = _mm256_xor_si256(
                        _mm256_loadu_si256((const __m256i *)(codes + 128 * j)), bias8);
                    const __m256i q_hi = _mm256_xor_si256(
                        _mm256_loadu_si256((const __m256i *)(codes + 128 * j + 64)), bias8);
                    const __m256i mag_lo = _mm256_abs_epi8(q_lo), mag_hi = _mm256_abs_epi8(q_hi);
                    for (int m = 0; m < MR; m++) {
                        const int8_t *qx = q41_x_quants(xq + m * xrow, nb, b) + 4 * j;
                        const __m256i x_lo = _mm256_sign_epi8(_mm256_set1_epi32(q41_load4(qx)), q_lo);
                        const __m256i x_hi =
                            _mm256_sign_epi8(_mm256_set1_epi32(q41_load4(qx + 16)), q_hi);
                        const __m256i s_lo = _mm256_madd_epi16(_mm256_maddubs_epi16(mag_lo, x_lo), ones);
                        const __m256i s_hi = _mm256_madd_epi16(_mm256_maddubs_epi16(mag_hi, x_hi), ones);
                        dot[m][h] = _mm256_add_epi32(dot[m][h], _mm256_add_epi32(s_lo, s_hi));
                    }
                } else {
                    const __m256i raw = _mm256_loadu_si256((const __m256i *)(codes + 64 * j));
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
            }
        for (int h = 0; h < H; h++) {
            const uint8_t *g = panel[h] + b * gb + 16 * second[h];
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g));
            for (int m = 0; m < MR; m++) {
                const uint8_t *row = xq + m * xrow;
                const __m256i sums = F == GEMM_Q80P ? dot[m][h] : _mm256_madd_epi16(dot[m][h], ones);
                const __m256i idot =
                    _mm256_sub_epi32(sums, _mm256_set1_epi32(off * q41_x_sum(row, nb, b)));
                const __m256 ds = _mm256_mul_ps(d, _mm256_set1_ps(q41_x_scale(row, b)));
                acc[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(idot), ds, acc[m][h]);
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

#define LEG_YMM(F, MR, H) \
    gemm_leg_tile_ymm(y, ldy, xq, w + (i / 2) * panel_bytes, i % 2, panel_bytes, k, \
                      c0 + (i / 2) * GEMM_NR, n, bias, F, MR, H)
/* Q4_1's AVX2 shapes: 4 half panels for one row, 2 for two, 1 for more (<= 12 of the 16
 * registers as accumulators), the remainder half by half. */
#define LEG_YMM_CASES(F)                                                                    \
    switch (mr * 2 + full) {                                                               \
    case 2: LEG_YMM(F, 1, 1); break;                                                        \
    case 3: LEG_YMM(F, 1, 4); break;                                                        \
    case 4: LEG_YMM(F, 2, 1); break;                                                        \
    case 5: LEG_YMM(F, 2, 2); break;                                                        \
    case 6: case 7: LEG_YMM(F, 3, 1); break;                                                \
    case 8: case 9: LEG_YMM(F, 4, 1); break;                                                \
    case 10: case 11: LEG_YMM(F, 5, 1); break;                                              \
    default: LEG_YMM(F, 6, 1); break;                                                       \
    }

/* A tile of mr rows (1..6) over np panels of Q8_0 or Q4_0. */
static void gemm_leg_tile_any(int fmt, float *restrict y, int64_t ldy,
                              const uint8_t *restrict xq, const uint8_t *restrict w,
                              int64_t panel_bytes, int64_t k, int64_t c0, int64_t n,
                              const float *restrict bias, int64_t mr, int64_t np) {
    const int64_t halves = 2 * np, width = mr == 1 ? 4 : mr == 2 ? 2 : 1;
    for (int64_t i = 0; i < halves;) {
        const int full = halves - i >= width;
        if (fmt == GEMM_Q80P) {
            LEG_YMM_CASES(GEMM_Q80P)
        } else {
            LEG_YMM_CASES(GEMM_Q40P)
        }
        i += full ? width : 1;
    }
}
#endif

#endif /* AIOENGINE_GEMM_LEGACY_H */
