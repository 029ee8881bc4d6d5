/*
 * The any-M GEMM on a GGUF's block formats other than Q4_1 (gemm_q4_1.h): Q8_0, Q4_0,
 * Q4_K, Q5_K, Q6_K, repacked losslessly at load by kernels/cpu_blocks.py, whose docstring
 * is the panel layout (gemm_blocks.c includes this once). A panel is k / G groups of
 * gemm_group_bytes(fmt), one per file block of G = 32 (256 for the K-quants) weights of its
 * 16 columns: per-column fields (fp16 d, dmin; the K-quants' sub-block scales as bytes),
 * then per 32 weights the unsigned codes q: nibble chunks (four consecutive k of a column
 * in one 32-bit lane, low halves weights 0..15, high halves 16..31), byte chunks (Q8_0,
 * q + 128), bit planes for the bits above the nibble (Q5_K, Q6_K).
 *
 * x is quantized to int8 per 32 (Q8_0, Q4_0) or per 256 (the K-quants; q4_1.h's
 * q41_prepare_x: scale s, per 32-block the sum sx of its values and sx16 of its first 16).
 * Per output element (column c, row r), with dot = sum_j q_j qx_j over a 32-block (and
 * dot16 over its first 16) exact int32, per 32-block b in order:
 *
 *   Q8_0:      acc = fma((float)(dot - 128 sx), d s, acc)
 *   Q4_0:      acc = fma((float)(dot - 8 sx), d s, acc)
 *   Q6_K:      acc = fma((float)(sc_a (dot16 - 32 sx16) + sc_b (dot - dot16 - 32 (sx - sx16))),
 *                        d s, acc)   (sc_a, sc_b the 16-weight halves' int8 scales; the
 *                                     integer is within 2^24, so exact as a float)
 *
 * and per 256-group in order (Q4_K, Q5_K: the integers summed over its eight 32-blocks, as
 * ggml's q4_K x q8_K, within 2^31):
 *
 *   isum = sum_s sc_s dot_s,  msum = sum_s mn_s sx_s
 *   acc = fma(-(float)msum, dmin s, fma((float)isum, d s, acc))
 *
 * every product such as d s rounded to float32 once, then y = acc (+ bias): one sequence of
 * roundings whatever M, the tile, the thread or the build. Integer sums are exact, so the
 * SIMD tiles (gemm_legacy.h, gemm_kquant.h where a build has them) give the plain C tile's
 * bits (gemm_blk_tile_c below, the reference and the build without AVX2).
 */
#ifndef AIOENGINE_GEMM_BLOCKS_H
#define AIOENGINE_GEMM_BLOCKS_H

#include <stdint.h>
#include <string.h>

#include "gemm.h"
#include "q4_1.h"
#include "gemm_legacy.h"
#include "gemm_kquant.h"

/* Where 32-block s (0..7 in a K-quant group, else 0) of a group starts its codes. */
static inline int64_t blk_codes_offset(int fmt, int64_t s) {
    switch (fmt) {
    case GEMM_Q80P: case GEMM_Q40P: return 32;
    case GEMM_Q4KP: return 320 + 256 * s;
    case GEMM_Q5KP: return 320 + 320 * s;
    default: return 288 + 384 * s; /* GEMM_Q6KP */
    }
}

static inline int blk_bits(int fmt) {
    return fmt == GEMM_Q80P ? 8 : fmt == GEMM_Q5KP ? 5 : fmt == GEMM_Q6KP ? 6 : 4;
}

/* Code of weight w (0..31) of column i in a 32-block whose codes start at `codes`. */
static inline int32_t blk_code(int fmt, const uint8_t *codes, int i, int w) {
    const int hi = w >= 16, j = (w % 16) / 4, t = w % 4;
    if (fmt == GEMM_Q80P) return codes[128 * j + 64 * hi + 4 * i + t];
    const uint8_t byte = codes[64 * j + 4 * i + t];
    int32_t q = hi ? byte >> 4 : byte & 0x0F;
    if (fmt == GEMM_Q6KP) return q | ((codes[256 + 64 * hi + 4 * i + t] >> (2 * j)) & 3) << 4;
    for (int bit = 4; bit < blk_bits(fmt); bit++) {
        const uint8_t plane = codes[256 + 64 * (bit - 4) + 4 * i + t];
        q |= ((plane >> (2 * j + hi)) & 1) << bit;
    }
    return q;
}

/* The plain C tile: rows [0, mr) of x (prepared) against np panels from w, columns
 * [c0, c0 + 16 np) of y, those below n stored; the header's arithmetic per element. */
static void gemm_blk_tile_c(int fmt, float *restrict y, int64_t ldy, const uint8_t *restrict xq,
                            const uint8_t *restrict w, int64_t panel_bytes, int64_t k, int64_t c0,
                            int64_t n, const float *restrict bias, int64_t mr, int64_t np) {
    const int64_t nb = k / 32, xrow = q41_x_row_bytes(k), gw = gemm_block_weights(fmt) / 32;
    const int64_t gb = gemm_group_bytes(fmt);
    for (int64_t p = 0; p < np; p++)
        for (int64_t m = 0; m < mr; m++)
            for (int i = 0; i < GEMM_NR && c0 + GEMM_NR * p + i < n; i++) {
                const uint8_t *row = xq + m * xrow;
                float acc = 0.0f;
                int32_t isum = 0, msum = 0; /* Q4_K/Q5_K: the group's sums */
                for (int64_t b = 0; b < nb; b++) {
                    const uint8_t *g = w + p * panel_bytes + (b / gw) * gb;
                    const int64_t s = b % gw;
                    const uint8_t *codes = g + blk_codes_offset(fmt, s);
                    const int8_t *qx = q41_x_quants(row, nb, b);
                    int32_t dot = 0, dot16 = 0;
                    for (int j = 0; j < 32; j++) {
                        const int32_t prod = blk_code(fmt, codes, i, j) * qx[j];
                        dot += prod;
                        dot16 += j < 16 ? prod : 0;
                    }
                    const float xs = q41_x_scale(row, b), d = q41_half(g + 2 * i);
                    const int32_t sx = q41_x_sum(row, nb, b), sx16 = q41_x_half_sum(row, nb, b);
                    if (fmt == GEMM_Q80P || fmt == GEMM_Q40P) {
                        const int32_t off = fmt == GEMM_Q80P ? 128 : 8;
                        acc = __builtin_fmaf((float)(dot - off * sx), d * xs, acc);
                    } else if (fmt == GEMM_Q6KP) {
                        const int32_t sa = (int8_t)g[32 + 16 * (2 * s) + i];
                        const int32_t sb = (int8_t)g[32 + 16 * (2 * s + 1) + i];
                        const int32_t idot = sa * (dot16 - 32 * sx16) +
                                             sb * (dot - dot16 - 32 * (sx - sx16));
                        acc = __builtin_fmaf((float)idot, d * xs, acc);
                    } else {
                        isum += (int32_t)g[64 + 16 * s + i] * dot;
                        msum += (int32_t)g[gemm_kquant_min_at(s, i)] * sx;
                        if (s == 7) {
                            const float dmin = q41_half(g + 32 + 2 * i);
                            acc = __builtin_fmaf(-(float)msum, dmin * xs,
                                                 __builtin_fmaf((float)isum, d * xs, acc));
                            isum = msum = 0;
                        }
                    }
                }
                const int64_t c = c0 + GEMM_NR * p + i;
                y[m * ldy + c] = bias ? acc + bias[c] : acc;
            }
}

/* A tile of mr rows (1..6) over np panels in format fmt (a GGUF block format other than
 * Q4_1): the build's SIMD tiles where it has them, else the plain C tile. */
static void gemm_blk_tile_any(int fmt, float *restrict y, int64_t ldy,
                              const uint8_t *restrict xq, const uint8_t *restrict w,
                              int64_t panel_bytes, int64_t k, int64_t c0, int64_t n,
                              const float *restrict bias, int64_t mr, int64_t np) {
#if defined(GEMM_HAVE_KQ_TILES)
    if (fmt == GEMM_Q4KP || fmt == GEMM_Q5KP || fmt == GEMM_Q6KP) {
        gemm_kq_tile_any(fmt, y, ldy, xq, w, panel_bytes, k, c0, n, bias, mr, np);
        return;
    }
#endif
#if defined(GEMM_LEGACY_SIMD)
    if (fmt == GEMM_Q80P || fmt == GEMM_Q40P) {
        gemm_leg_tile_any(fmt, y, ldy, xq, w, panel_bytes, k, c0, n, bias, mr, np);
        return;
    }
#endif
    gemm_blk_tile_c(fmt, y, ldy, xq, w, panel_bytes, k, c0, n, bias, mr, np);
}

#endif /* AIOENGINE_GEMM_BLOCKS_H */
