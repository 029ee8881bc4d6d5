/*
 * The SIMD register tiles of the any-M GEMM on a GGUF's K-quant blocks (GEMM_Q4KP,
 * GEMM_Q5KP, GEMM_Q6KP; gemm_blocks.h includes this once, and its header comment is the
 * arithmetic per output element that these tiles reproduce bit for bit; cpu_blocks.py's
 * docstring is the panel layout).
 *
 * A tile is MR rows of x by P panels (16 columns each, one 32-bit lane per column). Per
 * 32-weight sub-block it sums each column's integer dot products over the four nibble chunks
 * (four consecutive k of a column in one lane: `vpdpbusd` with 4 bytes of x broadcast, or
 * u8 x s8 pairs into int16 and pairs of int16 into int32 without VNNI), with the bits above
 * the nibble merged in from the bit planes first (Q5_K: for chunk j, bit 2 j of a plane
 * byte belongs to the low nibble's weight and bit 2 j + 1 to the high one's; Q6_K: bits
 * 2 j, 2 j + 1 of the low or the high half's plane), moved into place by one 16-bit shift
 * and a byte mask (the mask drops every bit that crossed a byte). Then, per
 * column: Q4_K/Q5_K sc dot added to the group's integer sum (its mins' sum mn sx formed
 * once per group, a column's two mins an int16 pair against x's two block sums), then the
 * group's two fmas; Q6_K the integer sc_a (dot16 - 32 sx16) + sc_b (...) and one fma with
 * d s per sub-block. Every product is formed in the order the plain C tile forms it, so each
 * element gets the C tile's roundings whatever the tile, M or the build.
 *
 * int16 bounds without VNNI: a maddubs pair is at most 2 x 63 x 127 = 16002, so at most two
 * are summed in int16 before widening (the Q4_K/Q5_K chunk's low and high halves:
 * 2 x 2 x 31 x 127 = 15748; Q6_K widens each one, its halves' sums being kept apart).
 */
#ifndef AIOENGINE_GEMM_KQUANT_H
#define AIOENGINE_GEMM_KQUANT_H

#include <stdint.h>
#include <string.h>

#include "gemm.h"
#include "q4_1.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

static inline int32_t kq_load4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* The byte offsets of a K-quant group: sub-block s's codes, and the per-column fields. */
static inline int64_t kq_codes(int fmt, int s) {
    return fmt == GEMM_Q4KP ? 320 + 256 * s : fmt == GEMM_Q5KP ? 320 + 320 * s : 288 + 384 * s;
}

/* The sums of x's 32-blocks b and b + 1 (each within +-4064) as an int16 pair, broadcast. */
static inline int32_t kq_sum_pair_i(const uint8_t *row, int64_t nb, int64_t b) {
    return (int32_t)(((uint32_t)q41_x_sum(row, nb, b) & 0xFFFFu) |
                     ((uint32_t)q41_x_sum(row, nb, b + 1) << 16));
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define kq_sum_pair(row, nb, b) _mm512_set1_epi32(kq_sum_pair_i(row, nb, b))

/* int32-lane vectors between uses (see gemm_q4_1.h's q41_v16i: GCC keeps an array of them
 * in registers, not an array of __m512i). */
typedef int32_t kq_v16i __attribute__((vector_size(64)));

/* v shifted left by S bits (right by -S) in 16-bit lanes; S a constant after unrolling. */
static inline __attribute__((always_inline)) __m512i kq_shift_zmm(__m512i v, const int S) {
    return S >= 0 ? _mm512_slli_epi16(v, S) : _mm512_srli_epi16(v, -S);
}

/* acc += per lane, sum of its 4 u8 codes times 4 s8 x. */
static inline __attribute__((always_inline)) kq_v16i kq_dot_zmm(kq_v16i acc, __m512i w,
                                                                __m512i x) {
#if defined(__AVX512VNNI__)
    return (kq_v16i)_mm512_dpbusd_epi32((__m512i)acc, w, x);
#else
    return (kq_v16i)_mm512_add_epi32(
        (__m512i)acc, _mm512_madd_epi16(_mm512_maddubs_epi16(w, x), _mm512_set1_epi16(1)));
#endif
}

/* acc += both halves' products (codes <= 31: their int16 sum stays within 15748). */
static inline __attribute__((always_inline)) kq_v16i kq_dot2_zmm(kq_v16i acc, __m512i lo,
                                                                 __m512i xlo, __m512i hi,
                                                                 __m512i xhi) {
#if defined(__AVX512VNNI__)
    return kq_dot_zmm(kq_dot_zmm(acc, lo, xlo), hi, xhi);
#else
    const __m512i t = _mm512_add_epi16(_mm512_maddubs_epi16(lo, xlo),
                                       _mm512_maddubs_epi16(hi, xhi));
    return (kq_v16i)_mm512_add_epi32((__m512i)acc, _mm512_madd_epi16(t, _mm512_set1_epi16(1)));
#endif
}

/* acc += per lane, the products of its two int16 of a and of b, summed. */
static inline __attribute__((always_inline)) __m512i kq_dot16_zmm(__m512i acc, __m512i a,
                                                                  __m512i b) {
#if defined(__AVX512VNNI__)
    return _mm512_dpwssd_epi32(acc, a, b);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}

/* Chunk j of a sub-block's codes (at c): the low-half and high-half codes of 16 columns. */
static inline __attribute__((always_inline)) void kq_codes_zmm(const uint8_t *c, const int j,
                                                               const int F, __m512i *lo,
                                                               __m512i *hi) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    const __m512i raw = _mm512_loadu_si512(c + 64 * j);
    __m512i l = _mm512_and_si512(raw, low), h = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
    if (F == GEMM_Q6KP) {
        /* The planes of bit pairs: e's bits 2 j, 2 j + 1 are bits 4, 5 of the low half's
         * code in chunk j, o's of the high half's: one shift per half per chunk. */
        const __m512i e = _mm512_loadu_si512(c + 256), o = _mm512_loadu_si512(c + 320);
        const __m512i b45 = _mm512_set1_epi8(0x30);
        l = _mm512_or_si512(l, _mm512_and_si512(kq_shift_zmm(e, 4 - 2 * j), b45));
        h = _mm512_or_si512(h, _mm512_and_si512(kq_shift_zmm(o, 4 - 2 * j), b45));
    } else if (F == GEMM_Q5KP) {
        const __m512i b4 = _mm512_set1_epi8(0x10), p4 = _mm512_loadu_si512(c + 256);
        l = _mm512_or_si512(l, _mm512_and_si512(kq_shift_zmm(p4, 4 - 2 * j), b4));
        h = _mm512_or_si512(h, _mm512_and_si512(kq_shift_zmm(p4, 3 - 2 * j), b4));
    }
    *lo = l;
    *hi = h;
}

/* Rows [0, MR) of x (prepared) against P panels from w in K-quant format F: columns
 * [c0, c0 + 16 P) of y, those below n stored. */
static inline __attribute__((always_inline)) void gemm_kq_tile_zmm(
    float *restrict y, int64_t ldy, const uint8_t *restrict xq, const uint8_t *restrict w,
    int64_t panel_bytes, int64_t k, int64_t c0, int64_t n, const float *restrict bias,
    const int MR, const int P, const int F) {
    const int64_t nb = k / 32, xrow = q41_x_row_bytes(k), gb = gemm_group_bytes(F);
    const int prefetch = gemm_tile_prefetches(MR);
    __m512 acc[MR][P];
    for (int m = 0; m < MR; m++)
        for (int p = 0; p < P; p++) acc[m][p] = _mm512_setzero_ps();
    kq_v16i dlo[MR][P], dhi[MR][P]; /* one sub-block's sums (Q6_K: its halves apart) */
    kq_v16i isum[MR][P];             /* Q4_K/Q5_K: a group's sum of sc dot */
    for (int64_t g = 0; g < nb / 8; g++) {
        for (int m = 0; m < MR; m++)
            for (int p = 0; p < P; p++) isum[m][p] = (kq_v16i){0};
        for (int s = 0; s < 8; s++) {
            const int64_t b = 8 * g + s;
            for (int m = 0; m < MR; m++)
                for (int p = 0; p < P; p++) dlo[m][p] = dhi[m][p] = (kq_v16i){0};
            if (prefetch)
                gemm_prefetch_panels(w, panel_bytes, P, g * gb + s * gb / 8, gb / 8,
                                     GEMM_PREFETCH_BLOCKS * gb / 8);
            for (int j = 0; j < 4; j++)
                for (int p = 0; p < P; p++) {
                    __m512i lo, hi;
                    kq_codes_zmm(w + p * panel_bytes + g * gb + kq_codes(F, s), j, F, &lo, &hi);
                    for (int m = 0; m < MR; m++) {
                        const int8_t *qx = q41_x_quants(xq + m * xrow, nb, b) + 4 * j;
                        const __m512i xlo = _mm512_set1_epi32(kq_load4(qx));
                        const __m512i xhi = _mm512_set1_epi32(kq_load4(qx + 16));
                        if (F == GEMM_Q6KP) {
                            dlo[m][p] = kq_dot_zmm(dlo[m][p], lo, xlo);
                            dhi[m][p] = kq_dot_zmm(dhi[m][p], hi, xhi);
                        } else {
                            dlo[m][p] = kq_dot2_zmm(dlo[m][p], lo, xlo, hi, xhi);
                        }
                    }
                }
            for (int p = 0; p < P; p++) {
                const uint8_t *grp = w + p * panel_bytes + g * gb;
                if (F == GEMM_Q6KP) {
                    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)grp));
                    const __m512i sa = _mm512_cvtepi8_epi32(
                        _mm_loadu_si128((const __m128i *)(grp + 32 + 32 * s)));
                    const __m512i sb = _mm512_cvtepi8_epi32(
                        _mm_loadu_si128((const __m128i *)(grp + 48 + 32 * s)));
                    for (int m = 0; m < MR; m++) {
                        const uint8_t *row = xq + m * xrow;
                        const int32_t sx = q41_x_sum(row, nb, b), sx16 = q41_x_half_sum(row, nb, b);
                        const __m512i ia = _mm512_mullo_epi32(
                            sa, _mm512_sub_epi32((__m512i)dlo[m][p], _mm512_set1_epi32(32 * sx16)));
                        const __m512i ib = _mm512_mullo_epi32(
                            sb, _mm512_sub_epi32((__m512i)dhi[m][p],
                                                 _mm512_set1_epi32(32 * (sx - sx16))));
                        const __m512 ds = _mm512_mul_ps(d, _mm512_set1_ps(q41_x_scale(row, b)));
                        acc[m][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(ia, ib)),
                                                    ds, acc[m][p]);
                    }
                } else {
                    const __m512i sc = _mm512_cvtepu8_epi32(
                        _mm_loadu_si128((const __m128i *)(grp + 64 + 16 * s)));
                    for (int m = 0; m < MR; m++)
                        isum[m][p] = (kq_v16i)_mm512_add_epi32(
                            (__m512i)isum[m][p], _mm512_mullo_epi32(sc, (__m512i)dlo[m][p]));
                }
            }
        }
        if (F == GEMM_Q6KP) continue;
        for (int p = 0; p < P; p++) {
            const uint8_t *grp = w + p * panel_bytes + g * gb;
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)grp));
            const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(grp + 32)));
            __m512i mn[4]; /* sub-blocks 2 t, 2 t + 1's mins of a column as an int16 pair */
            for (int t = 0; t < 4; t++)
                mn[t] = _mm512_cvtepu8_epi16(
                    _mm256_loadu_si256((const __m256i *)(grp + 192 + 32 * t)));
            for (int m = 0; m < MR; m++) {
                const uint8_t *row = xq + m * xrow;
                __m512i msum = _mm512_setzero_si512();
                for (int t = 0; t < 4; t++)
                    msum = kq_dot16_zmm(msum, mn[t], kq_sum_pair(row, nb, 8 * g + 2 * t));
                const __m512 xs = _mm512_set1_ps(q41_x_scale(row, 8 * g));
                acc[m][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps((__m512i)isum[m][p]),
                                            _mm512_mul_ps(d, xs), acc[m][p]);
                acc[m][p] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(msum), _mm512_mul_ps(dmin, xs),
                                             acc[m][p]);
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

/* Panels per tile by rows: accumulators (2 MR P registers, 3 MR P with Q4_K/Q5_K's group
 * sums and Q6_K's halves: the compiler keeps the group sums in the stack where short) within
 * about 24 of the 32 zmm; each divides gemm_tile_panels(mr), so a claim's panels split into
 * whole tiles. */
static inline int gemm_kq_tile_panels(int fmt, int64_t mr) {
    if (fmt == GEMM_Q6KP) return mr == 1 ? 4 : mr == 2 ? 3 : mr == 3 ? 2 : 1;
    return mr == 1 ? 8 : mr == 2 ? 6 : mr == 3 ? 4 : 2;
}

#define KQ_ZMM(MR, P, F) gemm_kq_tile_zmm(y, ldy, xq, w, panel_bytes, k, c0, n, bias, MR, P, F)
/* Only the widest tile of each row count and the one-row one-panel tile are compiled (each
 * shape is a copy of the tile: every shape cost the build seconds). Panels short of a whole
 * tile (a weight's last, only where its panels are not a multiple of the widest tile's)
 * run row by row, panel by panel, which changes no element's arithmetic. */
#define KQ_ZMM_CASES(F, P1, P2, P3, P4)                                                   \
    if (!full) {                                                                          \
        for (int64_t r = 0; r < mr; r++)                                                  \
            gemm_kq_tile_zmm(y + r * ldy, ldy, xq + r * xrow, w, panel_bytes, k, c0, n,   \
                             bias, 1, 1, F);                                              \
    } else {                                                                              \
        switch (mr) {                                                                     \
        case 1: KQ_ZMM(1, P1, F); break;                                                  \
        case 2: KQ_ZMM(2, P2, F); break;                                                  \
        case 3: KQ_ZMM(3, P3, F); break;                                                  \
        case 4: KQ_ZMM(4, P4, F); break;                                                  \
        case 5: KQ_ZMM(5, P4, F); break;                                                  \
        default: KQ_ZMM(6, P4, F); break;                                                 \
        }                                                                                 \
    }

/* A tile of mr rows (1..6) over np panels in K-quant format fmt. */
static void gemm_kq_tile_any(int fmt, float *restrict y, int64_t ldy, const uint8_t *restrict xq,
                             const uint8_t *restrict w, int64_t panel_bytes, int64_t k,
                             int64_t c0, int64_t n, const float *restrict bias, int64_t mr,
                             int64_t np) {
    const int64_t tp = gemm_kq_tile_panels(fmt, mr), xrow = q41_x_row_bytes(k);
    for (int64_t done = 0; done < np;) {
        const int full = np - done >= tp;
        if (fmt == GEMM_Q4KP) {
            KQ_ZMM_CASES(GEMM_Q4KP, 8, 6, 4, 2)
        } else if (fmt == GEMM_Q5KP) {
            KQ_ZMM_CASES(GEMM_Q5KP, 8, 6, 4, 2)
        } else {
            KQ_ZMM_CASES(GEMM_Q6KP, 4, 3, 2, 1)
        }
        const int64_t step = full ? tp : 1;
        done += step;
        w += step * panel_bytes;
        c0 += step * GEMM_NR;
    }
}
#define GEMM_HAVE_KQ_TILES 1

#elif defined(__AVX2__)
/* AVX2: half a panel (8 columns) per ymm, as gemm_q4_1.h's AVX2 tile (half i of a tile
 * from half h0 of w's panel is half (h0 + i) % 2 of panel (h0 + i) / 2: its codes and
 * planes 32 bytes on for the second half, fp16 fields 16 bytes on, byte fields 8). u8 x s8
 * pairs into int16, summed in int16 over the chunks that fit (Q4_K: all four, 8 x 2 x 15 x
 * 127; Q5_K: two, 4 x 2 x 31 x 127; Q6_K: two per half, 2 x 2 x 63 x 127), then pairs of
 * int16 into int32 (Q4_K/Q5_K: each pair times the column's sc <= 63, so a group's sum stays
 * within 8 x 2 x 31496 x 63 < 2^31). */

static inline __attribute__((always_inline)) __m256i kq_shift_ymm(__m256i v, const int S) {
    return S >= 0 ? _mm256_slli_epi16(v, S) : _mm256_srli_epi16(v, -S);
}

/* Chunk j's low-half and high-half codes of 8 columns (c: the half's first code byte). */
static inline __attribute__((always_inline)) void kq_codes_ymm(const uint8_t *c, const int j,
                                                               const int F, __m256i *lo,
                                                               __m256i *hi) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m256i raw = _mm256_loadu_si256((const __m256i *)(c + 64 * j));
    __m256i l = _mm256_and_si256(raw, low), h = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
    if (F == GEMM_Q6KP) { /* as kq_codes_zmm */
        const __m256i e = _mm256_loadu_si256((const __m256i *)(c + 256));
        const __m256i o = _mm256_loadu_si256((const __m256i *)(c + 320));
        const __m256i b45 = _mm256_set1_epi8(0x30);
        l = _mm256_or_si256(l, _mm256_and_si256(kq_shift_ymm(e, 4 - 2 * j), b45));
        h = _mm256_or_si256(h, _mm256_and_si256(kq_shift_ymm(o, 4 - 2 * j), b45));
    } else if (F == GEMM_Q5KP) {
        const __m256i b4 = _mm256_set1_epi8(0x10);
        const __m256i p4 = _mm256_loadu_si256((const __m256i *)(c + 256));
        l = _mm256_or_si256(l, _mm256_and_si256(kq_shift_ymm(p4, 4 - 2 * j), b4));
        h = _mm256_or_si256(h, _mm256_and_si256(kq_shift_ymm(p4, 3 - 2 * j), b4));
    }
    *lo = l;
    *hi = h;
}

static inline __attribute__((always_inline)) void gemm_kq_tile_ymm(
    float *restrict y, int64_t ldy, const uint8_t *restrict xq, const uint8_t *restrict w,
    int64_t h0, int64_t panel_bytes, int64_t k, int64_t c0, int64_t n,
    const float *restrict bias, const int MR, const int H, const int F) {
    const int64_t nb = k / 32, xrow = q41_x_row_bytes(k), gb = gemm_group_bytes(F);
    const int prefetch = gemm_tile_prefetches(MR);
    const int widen = F == GEMM_Q4KP ? 4 : 2; /* chunks summed in int16 */
    const __m256i ones = _mm256_set1_epi16(1);
    const uint8_t *panel[H];
    int64_t second[H]; /* 1 for a panel's second half */
    for (int h = 0; h < H; h++) {
        panel[h] = w + ((h0 + h) / 2) * panel_bytes;
        second[h] = (h0 + h) % 2;
    }
    __m256 acc[MR][H];
    for (int m = 0; m < MR; m++)
        for (int h = 0; h < H; h++) acc[m][h] = _mm256_setzero_ps();
    /* Q4_K/Q5_K: the group's sum of sc dot (each widening madd multiplies by the column's
     * sc, an int16 pair per lane); Q6_K: a 32-block's sums, its halves apart */
    __m256i dlo[MR][H], dhi[MR][H];
    for (int64_t g = 0; g < nb / 8; g++) {
        for (int m = 0; m < MR; m++)
            for (int h = 0; h < H; h++) dlo[m][h] = dhi[m][h] = _mm256_setzero_si256();
        for (int s = 0; s < 8; s++) {
            const int64_t b = 8 * g + s;
            __m256i lo16[MR][H], hi16[MR][H], wide[H];
            if (prefetch)
                gemm_prefetch_panels(panel[0], panel_bytes, (H + 1) / 2, g * gb + s * gb / 8,
                                     gb / 8, GEMM_PREFETCH_BLOCKS * gb / 8);
            for (int h = 0; h < H; h++) {
                if (F == GEMM_Q6KP) {
                    wide[h] = ones;
                } else {
                    const __m256i sc = _mm256_cvtepu8_epi32(_mm_loadl_epi64(
                        (const __m128i *)(panel[h] + g * gb + 64 + 16 * s + 8 * second[h])));
                    wide[h] = _mm256_or_si256(sc, _mm256_slli_epi32(sc, 16));
                }
                for (int m = 0; m < MR; m++) {
                    lo16[m][h] = hi16[m][h] = _mm256_setzero_si256();
                    if (F == GEMM_Q6KP) dlo[m][h] = dhi[m][h] = _mm256_setzero_si256();
                }
            }
            for (int j = 0; j < 4; j++)
                for (int h = 0; h < H; h++) {
                    __m256i lo, hi;
                    kq_codes_ymm(panel[h] + g * gb + kq_codes(F, s) + 32 * second[h], j, F,
                                 &lo, &hi);
                    for (int m = 0; m < MR; m++) {
                        const int8_t *qx = q41_x_quants(xq + m * xrow, nb, b) + 4 * j;
                        const __m256i xlo = _mm256_set1_epi32(kq_load4(qx));
                        const __m256i xhi = _mm256_set1_epi32(kq_load4(qx + 16));
                        const __m256i plo = _mm256_maddubs_epi16(lo, xlo);
                        const __m256i phi = _mm256_maddubs_epi16(hi, xhi);
                        if (F == GEMM_Q6KP) {
                            lo16[m][h] = _mm256_add_epi16(lo16[m][h], plo);
                            hi16[m][h] = _mm256_add_epi16(hi16[m][h], phi);
                        } else {
                            lo16[m][h] = _mm256_add_epi16(lo16[m][h], _mm256_add_epi16(plo, phi));
                        }
                        if ((j + 1) % widen == 0) {
                            dlo[m][h] = _mm256_add_epi32(dlo[m][h],
                                                         _mm256_madd_epi16(lo16[m][h], wide[h]));
                            if (F == GEMM_Q6KP)
                                dhi[m][h] = _mm256_add_epi32(dhi[m][h],
                                                             _mm256_madd_epi16(hi16[m][h], ones));
                            lo16[m][h] = hi16[m][h] = _mm256_setzero_si256();
                        }
                    }
                }
            if (F != GEMM_Q6KP) continue;
            for (int h = 0; h < H; h++) {
                const uint8_t *grp = panel[h] + g * gb;
                const int64_t f16 = 16 * second[h], f8 = 8 * second[h];
                const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(grp + f16)));
                const __m256i sa = _mm256_cvtepi8_epi32(
                    _mm_loadl_epi64((const __m128i *)(grp + 32 + 32 * s + f8)));
                const __m256i sb = _mm256_cvtepi8_epi32(
                    _mm_loadl_epi64((const __m128i *)(grp + 48 + 32 * s + f8)));
                for (int m = 0; m < MR; m++) {
                    const uint8_t *row = xq + m * xrow;
                    const int32_t sx = q41_x_sum(row, nb, b), sx16 = q41_x_half_sum(row, nb, b);
                    const __m256i ia = _mm256_mullo_epi32(
                        sa, _mm256_sub_epi32(dlo[m][h], _mm256_set1_epi32(32 * sx16)));
                    const __m256i ib = _mm256_mullo_epi32(
                        sb, _mm256_sub_epi32(dhi[m][h], _mm256_set1_epi32(32 * (sx - sx16))));
                    const __m256 ds = _mm256_mul_ps(d, _mm256_set1_ps(q41_x_scale(row, b)));
                    acc[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(ia, ib)),
                                                ds, acc[m][h]);
                }
            }
        }
        if (F == GEMM_Q6KP) continue;
        for (int h = 0; h < H; h++) { /* the group's float steps */
            const uint8_t *grp = panel[h] + g * gb;
            const int64_t f16 = 16 * second[h];
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(grp + f16)));
            const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(grp + 32 + f16)));
            __m256i mn[4];
            for (int t = 0; t < 4; t++)
                mn[t] = _mm256_cvtepu8_epi16(
                    _mm_loadu_si128((const __m128i *)(grp + 192 + 32 * t + f16)));
            for (int m = 0; m < MR; m++) {
                const uint8_t *row = xq + m * xrow;
                __m256i msum = _mm256_setzero_si256();
                for (int t = 0; t < 4; t++)
                    msum = _mm256_add_epi32(msum, _mm256_madd_epi16(
                        mn[t], _mm256_set1_epi32(kq_sum_pair_i(row, nb, 8 * g + 2 * t))));
                const __m256 xs = _mm256_set1_ps(q41_x_scale(row, 8 * g));
                acc[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dlo[m][h]), _mm256_mul_ps(d, xs),
                                            acc[m][h]);
                acc[m][h] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_mul_ps(dmin, xs),
                                             acc[m][h]);
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

#define KQ_YMM(MR, H, F)                                                                  \
    gemm_kq_tile_ymm(y, ldy, xq, w + (i / 2) * panel_bytes, i % 2, panel_bytes, k,        \
                     c0 + (i / 2) * GEMM_NR, n, bias, MR, H, F)
/* Tiles of W1 half panels for one row, W2 for two, one for more; the rest half by half. */
#define KQ_YMM_CASES(F, W1, W2)                                                           \
    switch (mr * 2 + full) {                                                              \
    case 2: KQ_YMM(1, 1, F); break;                                                       \
    case 3: KQ_YMM(1, W1, F); break;                                                      \
    case 4: case 5: if (full && W2 > 1) KQ_YMM(2, W2, F); else KQ_YMM(2, 1, F); break;    \
    case 6: case 7: KQ_YMM(3, 1, F); break;                                               \
    case 8: case 9: KQ_YMM(4, 1, F); break;                                               \
    case 10: case 11: KQ_YMM(5, 1, F); break;                                             \
    default: KQ_YMM(6, 1, F); break;                                                      \
    }

/* A tile of mr rows (1..6) over np panels in K-quant format fmt: accumulators (3 MR H
 * registers, Q6_K's 5 MR H) within about 12 of the 16 ymm. */
static void gemm_kq_tile_any(int fmt, float *restrict y, int64_t ldy, const uint8_t *restrict xq,
                             const uint8_t *restrict w, int64_t panel_bytes, int64_t k,
                             int64_t c0, int64_t n, const float *restrict bias, int64_t mr,
                             int64_t np) {
    const int64_t halves = 2 * np;
    const int64_t width = fmt == GEMM_Q6KP ? (mr == 1 ? 2 : 1) : mr == 1 ? 4 : mr == 2 ? 2 : 1;
    for (int64_t i = 0; i < halves;) {
        const int full = halves - i >= width;
        if (fmt == GEMM_Q4KP) {
            KQ_YMM_CASES(GEMM_Q4KP, 4, 2)
        } else if (fmt == GEMM_Q5KP) {
            KQ_YMM_CASES(GEMM_Q5KP, 4, 2)
        } else {
            KQ_YMM_CASES(GEMM_Q6KP, 2, 1)
        }
        i += full ? width : 1;
    }
}
#define GEMM_HAVE_KQ_TILES 1

#endif /* AVX-512, AVX2 */

#endif /* AIOENGINE_GEMM_KQUANT_H */
