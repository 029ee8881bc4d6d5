/*
 * The float storages' register tiles (GEMM_F32P, GEMM_BF16P, GEMM_I8P; gemm.h describes
 * the layouts and why a row's bits do not depend on the step) as always-inline templates.
 * gemm_f32.c, gemm_bf16.c and gemm_int8.c each instantiate one storage's (gemm_float_tile),
 * so the build compiles the three in parallel (one unit of all three took 26 s of a core).
 */
#ifndef AIOENGINE_GEMM_FLOAT_H
#define AIOENGINE_GEMM_FLOAT_H

#include <stdint.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "gemm.h"

typedef float g8f __attribute__((vector_size(32), aligned(4)));

typedef uint32_t g8u __attribute__((vector_size(32), aligned(4)));
typedef int8_t g8b __attribute__((vector_size(8), aligned(1)));
typedef int32_t g8i __attribute__((vector_size(32), aligned(4)));

/* One fused multiply-add: an FMA instruction where the target has one, else a multiply then
 * an add (never chosen per call site by the compiler's contraction). */
static inline __attribute__((always_inline)) g8f gemm_fma(g8f a, g8f b, g8f c) {
#if defined(__FMA__)
    return (g8f)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    return a * b + c;
#endif
}

/* Panel row d's 16 weights (at `row`) as two float32 vectors. */
static inline __attribute__((always_inline)) void gemm_load16(const char *row, const int F,
                                                              g8f *lo, g8f *hi) {
    if (F == GEMM_F32P) {
        *lo = *(const g8f *)row;
        *hi = *(const g8f *)(row + 32);
    } else if (F == GEMM_BF16P) {
        /* Lane i holds columns (i, i + 8) as its low and high halves (pack_weight's bf16
         * order): one load, a shift and a mask widen all 16. */
        const g8u u = *(const g8u *)row;
        *lo = (g8f)(u << 16);
        *hi = (g8f)(u & 0xFFFF0000u);
    } else {
#if defined(__AVX2__)
        *lo = (g8f)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)row)));
        *hi = (g8f)_mm256_cvtepi32_ps(
            _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(row + 8))));
#else
        *lo = __builtin_convertvector(__builtin_convertvector(*(const g8b *)row, g8i), g8f);
        *hi = __builtin_convertvector(__builtin_convertvector(*(const g8b *)(row + 8), g8i), g8f);
#endif
    }
}

/* The epilogue of one output element: (acc * scale) + bias, the same for every tile. */
static inline float gemm_out(float acc, const float *scales, const float *bias, int64_t c) {
    const float s = scales ? acc * scales[c] : acc;
    return bias ? s + bias[c] : s;
}

/* Rows [0, MR) of x (row stride k) against P panels from `w` (panel stride panel_bytes):
 * columns [c0, c0 + 16 P) of y (row stride ldy), those below n stored. */
static inline __attribute__((always_inline)) void gemm_tile(
    float *restrict y, int64_t ldy, const float *restrict x, const char *restrict w,
    int64_t panel_bytes, int64_t k, int64_t c0, int64_t n, const float *restrict scales,
    const float *restrict bias, const int MR, const int P, const int F) {
    const int64_t row_bytes = GEMM_NR * (F == GEMM_F32P ? 4 : F == GEMM_BF16P ? 2 : 1);
    g8f acc[MR][2 * P];
    for (int m = 0; m < MR; m++)
        for (int j = 0; j < 2 * P; j++) acc[m][j] = (g8f){0};
    for (int64_t d = 0; d < k; d++) {
        for (int p = 0; p < P; p++) {
            g8f w0, w1;
            gemm_load16(w + p * panel_bytes + d * row_bytes, F, &w0, &w1);
            for (int m = 0; m < MR; m++) {
                const float s = x[m * k + d];
                const g8f xb = {s, s, s, s, s, s, s, s};
                acc[m][2 * p] = gemm_fma(xb, w0, acc[m][2 * p]);
                acc[m][2 * p + 1] = gemm_fma(xb, w1, acc[m][2 * p + 1]);
            }
        }
    }
    for (int m = 0; m < MR; m++)
        for (int j = 0; j < 2 * P; j++)
            for (int i = 0; i < 8; i++) {
                const int64_t c = c0 + 8 * j + i;
                if (c < n) y[m * ldy + c] = gemm_out(acc[m][j][i], scales, bias, c);
            }
}

/* A tile of MR rows (1..6) over panels [p, p + P) with P <= gemm_tile_panels(MR); the
 * shapes compiled as constants. */
#define GEMM_TILE_ARGS(MR, P, F)                                                            \
    gemm_tile(y, ldy, x, w, panel_bytes, k, c0, n, scales, bias, MR, P, F)
#define GEMM_TILE_CASES(F)                                                                  \
    switch (mr * 8 + np) {                                                                 \
    case 9: GEMM_TILE_ARGS(1, 1, F); break;                                                 \
    case 10: GEMM_TILE_ARGS(1, 2, F); break;                                                \
    case 11: GEMM_TILE_ARGS(1, 3, F); break;                                                \
    case 12: GEMM_TILE_ARGS(1, 4, F); break;                                                \
    case 17: GEMM_TILE_ARGS(2, 1, F); break;                                                \
    case 18: GEMM_TILE_ARGS(2, 2, F); break;                                                \
    case 19: GEMM_TILE_ARGS(2, 3, F); break;                                                \
    case 25: GEMM_TILE_ARGS(3, 1, F); break;                                                \
    case 26: GEMM_TILE_ARGS(3, 2, F); break;                                                \
    case 33: GEMM_TILE_ARGS(4, 1, F); break;                                                \
    case 41: GEMM_TILE_ARGS(5, 1, F); break;                                                \
    default: GEMM_TILE_ARGS(6, 1, F); break;                                                \
    }

#if defined(__AVX512F__)
/* AVX-512: a panel row is one zmm of 16 float32 lanes (32 registers, so wider tiles). The
 * arithmetic per output element is the AVX2 tile's exactly (one lane, fused multiply-adds
 * in k order, the same epilogue): a row gets the same bits from either build. bf16 panels
 * widen with a zero-extend and a shift, which leaves lane 2 i holding column i and lane
 * 2 i + 1 column i + 8 (pack_weight's order); the store undoes that. */
static inline __attribute__((always_inline)) __m512 gemm_load16_zmm(const char *row,
                                                                    const int F) {
    if (F == GEMM_F32P) return _mm512_loadu_ps(row);
    if (F == GEMM_BF16P)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)row)), 16));
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)row)));
}

/* The column of lane i of a zmm tile in format F. */
static inline int64_t gemm_zmm_column(int i, const int F) {
    return F == GEMM_BF16P ? (i >> 1) + 8 * (i & 1) : i;
}

static inline __attribute__((always_inline)) void gemm_tile_zmm(
    float *restrict y, int64_t ldy, const float *restrict x, const char *restrict w,
    int64_t panel_bytes, int64_t k, int64_t c0, int64_t n, const float *restrict scales,
    const float *restrict bias, const int MR, const int P, const int F) {
    const int64_t row_bytes = GEMM_NR * (F == GEMM_F32P ? 4 : F == GEMM_BF16P ? 2 : 1);
    __m512 acc[MR][P];
    for (int m = 0; m < MR; m++)
        for (int p = 0; p < P; p++) acc[m][p] = _mm512_setzero_ps();
    for (int64_t d = 0; d < k; d++) {
        for (int p = 0; p < P; p++) {
            const __m512 wv = gemm_load16_zmm(w + p * panel_bytes + d * row_bytes, F);
            for (int m = 0; m < MR; m++)
                acc[m][p] = _mm512_fmadd_ps(_mm512_set1_ps(x[m * k + d]), wv, acc[m][p]);
        }
    }
    for (int m = 0; m < MR; m++)
        for (int p = 0; p < P; p++) {
            float lanes[16] __attribute__((aligned(64)));
            _mm512_store_ps(lanes, acc[m][p]);
            for (int i = 0; i < 16; i++) {
                const int64_t c = c0 + GEMM_NR * p + gemm_zmm_column(i, F);
                if (c < n) y[m * ldy + c] = gemm_out(lanes[i], scales, bias, c);
            }
        }
}


#if defined(__AVX512BF16__)
/* bf16 with AVX512-BF16: vdpbf16ps takes pairs of k. x is rounded to bf16 once per pass
 * (gemm_x_pairs) and each weight load, two consecutive k rows of a panel (64 bytes), is
 * interleaved by one vpermw into 16 (k, k + 1) pairs in column order; every lane then
 * accumulates its column in k-pair order, whatever M, the tile or the thread, so a row's
 * bits still do not depend on the step. This build's bf16 products thus round x to bf16
 * (as oneDNN's bf16 matmul does); the other builds keep x in float32. */
static const int16_t gemm_pair_index[32] __attribute__((aligned(64))) = {
    0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30,
    1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31};


/* One pair of k rows of panel p (raw: the two rows as loaded) into every row's accumulator. */
#define GEMM_DP_STEP(raw)                                                                   \
    do {                                                                                   \
        const __m512bh wv = (__m512bh)_mm512_permutexvar_epi16(idx, raw);                   \
        for (int m = 0; m < MR; m++)                                                       \
            acc[m][p] = _mm512_dpbf16_ps(                                                  \
                acc[m][p], (__m512bh)_mm512_set1_epi32((int)xp[m * xs + d2]), wv);         \
    } while (0)

static inline __attribute__((always_inline)) void gemm_tile_dpbf16(
    float *restrict y, int64_t ldy, const uint32_t *restrict xp, const char *restrict w,
    int64_t panel_bytes, int64_t k, int64_t c0, int64_t n, const float *restrict bias,
    const int MR, const int P) {
    const int64_t xs = gemm_x_pair_stride(k);  /* x's row stride in pairs */
    const __m512i idx = _mm512_load_si512(gemm_pair_index);
    __m512 acc[MR][P];
    for (int m = 0; m < MR; m++)
        for (int p = 0; p < P; p++) acc[m][p] = _mm512_setzero_ps();
    /* Whole pairs with plain loads (a masked load in this loop cost 1.5-2.5x), then the
     * last row of an odd k as a pair whose second row is zeros (masked: the bytes after
     * it are the next panel's, or past the end). */
    for (int64_t d2 = 0; d2 < k / 2; d2++)
        for (int p = 0; p < P; p++) {
            const __m512i raw = _mm512_loadu_si512(w + p * panel_bytes + d2 * 64);
            GEMM_DP_STEP(raw);
        }
    if (k % 2) {
        const int64_t d2 = k / 2;
        for (int p = 0; p < P; p++) {
            const __m512i raw = _mm512_maskz_loadu_epi16(0xFFFFu, w + p * panel_bytes + d2 * 64);
            GEMM_DP_STEP(raw);
        }
    }
    for (int m = 0; m < MR; m++)
        for (int p = 0; p < P; p++) {
            float lanes[16] __attribute__((aligned(64)));
            _mm512_store_ps(lanes, acc[m][p]);
            for (int i = 0; i < 16; i++) {
                const int64_t c = c0 + GEMM_NR * p + i;
                if (c < n) y[m * ldy + c] = gemm_out(lanes[i], NULL, bias, c);
            }
        }
}
#endif /* __AVX512BF16__ */

/* One instantiation per (rows, format) at the full width and one at a single panel: a
 * narrower tile (the last panels of a claim) runs panel by panel, which changes no
 * element's arithmetic; instantiating every width made the build exceed its time limit. */
#define GEMM_ZMM_ARGS(MR, P, F)                                                             \
    gemm_tile_zmm(y, ldy, x, w, panel_bytes, k, c0, n, scales, bias, MR, P, F)
#define GEMM_ZMM_CASES(F)                                                                   \
    switch (mr * 2 + (full ? 1 : 0)) {                                                     \
    case 2: GEMM_ZMM_ARGS(1, 1, F); break;                                                  \
    case 3: GEMM_ZMM_ARGS(1, 8, F); break;                                                  \
    case 4: GEMM_ZMM_ARGS(2, 1, F); break;                                                  \
    case 5: GEMM_ZMM_ARGS(2, 6, F); break;                                                  \
    case 6: GEMM_ZMM_ARGS(3, 1, F); break;                                                  \
    case 7: GEMM_ZMM_ARGS(3, 4, F); break;                                                  \
    case 8: GEMM_ZMM_ARGS(4, 1, F); break;                                                  \
    case 9: GEMM_ZMM_ARGS(4, 4, F); break;                                                  \
    case 10: GEMM_ZMM_ARGS(5, 1, F); break;                                                 \
    case 11: GEMM_ZMM_ARGS(5, 4, F); break;                                                 \
    case 12: GEMM_ZMM_ARGS(6, 1, F); break;                                                 \
    default: GEMM_ZMM_ARGS(6, 4, F); break;                                                 \
    }

#if defined(__AVX512BF16__)
#define GEMM_DP_ARGS(MR, P)                                                                 \
    gemm_tile_dpbf16(y, ldy, (const uint32_t *)x, w, panel_bytes, k, c0, n, bias, MR, P)
#define GEMM_DP_CASES                                                                       \
    switch (mr * 2 + (full ? 1 : 0)) {                                                     \
    case 2: GEMM_DP_ARGS(1, 1); break;                                                      \
    case 3: GEMM_DP_ARGS(1, 8); break;                                                      \
    case 4: GEMM_DP_ARGS(2, 1); break;                                                      \
    case 5: GEMM_DP_ARGS(2, 6); break;                                                      \
    case 6: GEMM_DP_ARGS(3, 1); break;                                                      \
    case 7: GEMM_DP_ARGS(3, 4); break;                                                      \
    case 8: GEMM_DP_ARGS(4, 1); break;                                                      \
    case 9: GEMM_DP_ARGS(4, 4); break;                                                      \
    case 10: GEMM_DP_ARGS(5, 1); break;                                                     \
    case 11: GEMM_DP_ARGS(5, 4); break;                                                     \
    case 12: GEMM_DP_ARGS(6, 1); break;                                                     \
    default: GEMM_DP_ARGS(6, 4); break;                                                     \
    }
#endif
#endif /* __AVX512F__ */

/* A tile of mr rows (1..6) over np <= gemm_tile_panels(mr) panels of storage F (a
 * constant); x is the tile's first row as gemm_range passes it (bf16 pairs in the
 * AVX512-BF16 build's bf16 case). */
static inline __attribute__((always_inline)) void gemm_float_tile(
    float *restrict y, int64_t ldy, const float *restrict x, const char *restrict w,
    int64_t panel_bytes, int64_t k, int64_t c0, int64_t n, const float *restrict scales,
    const float *restrict bias, int64_t mr, int64_t np, const int F) {
#if defined(__AVX512F__)
    const int full = np == gemm_tile_panels(mr);
    for (int64_t q = 0; q < (full ? 1 : np); q++) {
#if defined(__AVX512BF16__)
        if (F == GEMM_BF16P) {
            GEMM_DP_CASES
        } else
#endif
        {
            GEMM_ZMM_CASES(F)
        }
        w += panel_bytes;
        c0 += GEMM_NR;
    }
#else
    GEMM_TILE_CASES(F)
#endif
}

#endif /* AIOENGINE_GEMM_FLOAT_H */
