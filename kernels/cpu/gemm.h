/*
 * y = x w^T (* scale) (+ bias) for ANY number of rows M, on weights packed once at load into
 * panels of GEMM_NR = 16 output columns:
 *
 *   packed [num_panels, k, 16]: element (k, j) of panel p is w[16 p + j, k] (bf16: the
 *   columns in the order 0, 8, 1, 9, ..., 7, 15, see gemm_load16); the last panel's
 *   columns past n are zeros (kernels/cpu_gemm.py `pack_weight` writes it).
 *
 * in float32, bf16 or int8 (per-column float32 scales, weight-only) — the GEMM_*P formats.
 * One register tile of MR rows x 16 P columns of float32 accumulators walks k once: each
 * step loads 16 P weights (widened to float32 in registers: bf16 by a shift, int8 by a
 * sign-extend and convert), broadcasts one x element per row and does MR x 2 P fused
 * multiply-adds, so every weight load serves every row of the tile. The tile's shape follows
 * M (1 x 64, 2 x 48, 3 x 32, then blocks of 4-6 rows x 16: at most 12 of the 16 AVX2
 * registers hold accumulators), threads split the panels (claims as gemv_shared, so a
 * preempted thread delays a step by one claim), and a thread runs all the step's rows over a
 * panel group while it is in L1/L2: a weight crosses memory once per step whatever M is.
 *
 * Deterministic by construction: y[m, c] is ONE accumulator lane, c's column of its panel,
 * summed by fused multiply-adds in the order k = 0, 1, ..., k - 1 and then scaled and biased
 * the same way, whatever the tile, the row block, M, the thread or the claim that computed
 * it. So a row gives the same bits alone, in a 64-row step, in a prefill chunk or a
 * speculative verification (tests/kernels/test_cpu_gemm.py checks it bit for bit). x stays
 * float32 (not rounded to bf16): the products are exact float32 products of the stored
 * weights, the sum a float32 sum.
 */
#ifndef AIOENGINE_GEMM_H
#define AIOENGINE_GEMM_H

#include <stdint.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

enum { GEMM_F32P = 5, GEMM_BF16P = 6, GEMM_I8P = 7 };
#define GEMM_NR 16
/* Rows per pass over the panels: x's rows of a pass (48 x k floats) stay in L2. */
#define GEMM_ROWS_PER_PASS 48

typedef float g8f __attribute__((vector_size(32), aligned(4)));
typedef uint16_t g8h __attribute__((vector_size(16), aligned(2)));
typedef uint32_t g8u __attribute__((vector_size(32), aligned(4)));
typedef int8_t g8b __attribute__((vector_size(8), aligned(1)));
typedef int32_t g8i __attribute__((vector_size(32), aligned(4)));

static inline int gemm_is_packed(int fmt) { return fmt >= GEMM_F32P && fmt <= GEMM_I8P; }

static inline int64_t gemm_elem_bytes(int fmt) {
    return fmt == GEMM_F32P ? 4 : fmt == GEMM_BF16P ? 2 : 1;
}

/* Bytes of one panel of k rows. */
static inline int64_t gemm_panel_bytes(int fmt, int64_t k) {
    return gemm_elem_bytes(fmt) * GEMM_NR * k;
}

static inline int64_t gemm_num_panels(int64_t n) { return (n + GEMM_NR - 1) / GEMM_NR; }

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

static inline int gemm_tile_panels(int64_t mr) { return mr == 1 ? 4 : mr == 2 ? 3 : mr == 3 ? 2 : 1; }

static void gemm_tile_any(float *restrict y, int64_t ldy, const float *restrict x,
                          const char *restrict w, int64_t panel_bytes, int64_t k, int64_t c0,
                          int64_t n, const float *restrict scales, const float *restrict bias,
                          int64_t mr, int64_t np, int fmt) {
    if (fmt == GEMM_BF16P) {
        GEMM_TILE_CASES(GEMM_BF16P)
    } else if (fmt == GEMM_F32P) {
        GEMM_TILE_CASES(GEMM_F32P)
    } else {
        GEMM_TILE_CASES(GEMM_I8P)
    }
}

/* Row block b of M rows split into blocks of 4-6 (or one block of M <= 6): its first row
 * and size. The split does not change any element's arithmetic, only the tile shapes. */
static inline void gemm_row_block(int64_t M, int64_t b, int64_t *m0, int64_t *mr) {
    const int64_t nb = (M + 5) / 6;
    *m0 = M * b / nb;
    *mr = M * (b + 1) / nb - *m0;
}

/* Panels [p_lo, p_hi) of y [M, n] (row stride ldy) for every row of x [M, k]. */
static inline void gemm_range(float *restrict y, int64_t ldy, const float *restrict x,
                              const void *w, const float *scales, int fmt,
                              const float *restrict bias, int64_t M, int64_t n, int64_t k,
                              int64_t p_lo, int64_t p_hi) {
    const int64_t panel_bytes = gemm_panel_bytes(fmt, k);
    for (int64_t r0 = 0; r0 < M; r0 += GEMM_ROWS_PER_PASS) {
        const int64_t rows = M - r0 < GEMM_ROWS_PER_PASS ? M - r0 : GEMM_ROWS_PER_PASS;
        const int64_t nb = (rows + 5) / 6;
        int64_t group = 1;  /* panels a pass takes at once: the widest tile's */
        for (int64_t b = 0; b < nb; b++) {
            int64_t m0, mr;
            gemm_row_block(rows, b, &m0, &mr);
            group = gemm_tile_panels(mr) > group ? gemm_tile_panels(mr) : group;
        }
        for (int64_t g = p_lo; g < p_hi; g += group) {
            const int64_t g_end = g + group < p_hi ? g + group : p_hi;
            for (int64_t b = 0; b < nb; b++) {
                int64_t m0, mr;
                gemm_row_block(rows, b, &m0, &mr);
                const int64_t tp = gemm_tile_panels(mr);
                for (int64_t p = g; p < g_end; p += tp) {
                    const int64_t np = g_end - p < tp ? g_end - p : tp;
                    gemm_tile_any(y + (r0 + m0) * ldy, ldy, x + (r0 + m0) * k,
                                  (const char *)w + p * panel_bytes, panel_bytes, k,
                                  p * GEMM_NR, n, scales, bias, mr, np, fmt);
                }
            }
        }
    }
}

/* Panels per claim of gemm_shared: ~64 KB of weights, a whole number of 4-panel groups. */
static inline int64_t gemm_claim_panels(int fmt, int64_t k) {
    int64_t c = 65536 / gemm_panel_bytes(fmt, k);
    c = c / 4 * 4;
    return c > 4 ? c : 4;
}

#endif /* AIOENGINE_GEMM_H */
