/*
 * The any-M GEMM's register tiles and their walk over the panels (gemm.h describes the
 * packed layout, the tiles and why a row's bits do not depend on the step): x as bf16
 * pairs, and gemm_range, which walks the tiles of every storage, each storage's in a unit
 * of its own (gemm_f32.c, gemm_bf16.c, gemm_int8.c over gemm_float.h; gemm_q4_1.c,
 * gemm_blocks.c, gemm_w8a8.c): projection.c and llama_decode.c share one copy of each,
 * and the build compiles them in parallel.
 */
#include <stdint.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "gemm.h"
#include "q4_1.h"
#include "w8a8.h"

_Thread_local int gemm_first_row_block = 1;

#if !defined(__AVX512BF16__)
/* gemm.h's gemm_x_pairs without the instruction (the AMX emulation's x in the other
 * builds): round to nearest even, a NaN kept a quiet NaN. */
static inline uint32_t gemm_bf16_bits(float f) {
    uint32_t u;
    __builtin_memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (u >> 16) | 0x40u;
    return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
}

void gemm_x_pairs(uint32_t *restrict xp, const float *restrict x, int64_t rows, int64_t k) {
    const int64_t xs = gemm_x_pair_stride(k);
    for (int64_t m = 0; m < rows; m++)
        for (int64_t j = 0; j < xs; j++) {
            const uint32_t lo = 2 * j < k ? gemm_bf16_bits(x[m * k + 2 * j]) : 0;
            const uint32_t hi = 2 * j + 1 < k ? gemm_bf16_bits(x[m * k + 2 * j + 1]) : 0;
            xp[m * xs + j] = lo | hi << 16;
        }
}
#endif

#if defined(__AVX512BF16__)
/* gemm.h's gemm_x_pairs, rounded by the instruction (to nearest even). */
void gemm_x_pairs(uint32_t *restrict xp, const float *restrict x, int64_t rows, int64_t k) {
    const int64_t xs = gemm_x_pair_stride(k), k2 = (k + 1) / 2;
    for (int64_t m = 0; m < rows; m++) {
        for (int64_t d = 0; d < k; d += 32) {
            const int64_t left = k - d;
            const __mmask16 lo = left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1);
            const __mmask16 hi = left >= 32 ? 0xFFFF : left <= 16 ? 0
                                                   : (__mmask16)((1u << (left - 16)) - 1);
            const __m512 a = _mm512_maskz_loadu_ps(lo, x + m * k + d);
            const __m512 b = _mm512_maskz_loadu_ps(hi, x + m * k + d + 16);
            const __m512i pairs = (__m512i)_mm512_cvtne2ps_pbh(b, a);
            const int64_t n2 = left >= 32 ? 16 : (left + 1) / 2;
            _mm512_mask_storeu_epi32(xp + m * xs + d / 2, (__mmask16)((1u << n2) - 1), pairs);
        }
        for (int64_t j = k2; j < xs; j++) xp[m * xs + j] = 0;
    }
}
#endif

/* A tile of mr rows (1..6) over np <= gemm_tile_panels(mr) panels in format fmt: each
 * storage's tiles in its own unit (gemm.h). */
static void gemm_tile_any(float *restrict y, int64_t ldy, const float *restrict x,
                          const char *restrict w, int64_t panel_bytes, int64_t k, int64_t c0,
                          int64_t n, const float *restrict scales, const float *restrict bias,
                          int64_t mr, int64_t np, int fmt) {
    const uint8_t *xq = (const uint8_t *)x, *wq = (const uint8_t *)w;
    if (fmt == GEMM_Q41P)
        gemm_q41_tile(y, ldy, xq, wq, panel_bytes, k, c0, n, bias, mr, np);
    else if (gemm_is_block(fmt))
        gemm_blocks_tile(fmt, y, ldy, xq, wq, panel_bytes, k, c0, n, bias, mr, np);
    else if (fmt == GEMM_W8A8P)
        gemm_w8a8_tile(y, ldy, xq, wq, panel_bytes, k, c0, n, scales, bias, mr, np);
    else if (fmt == GEMM_BF16P)
        gemm_bf16_tile(y, ldy, x, w, panel_bytes, k, c0, n, scales, bias, mr, np);
    else if (fmt == GEMM_F32P)
        gemm_f32_tile(y, ldy, x, w, panel_bytes, k, c0, n, scales, bias, mr, np);
    else
        gemm_int8_tile(y, ldy, x, w, panel_bytes, k, c0, n, scales, bias, mr, np);
}

/* Row block b of M rows split into blocks of 4-6 (or one block of M <= 6): its first row
 * and size. The split does not change any element's arithmetic, only the tile shapes. */
/* Blocks of at most 6 rows (two 2+2 blocks of 3-panel tiles for M = 4 measured slower than
 * one 4 x 16 tile: 15.2 vs 14.5 ms over SmolLM2's projections). */
static inline int64_t gemm_num_row_blocks(int64_t M) { return (M + 5) / 6; }

static inline void gemm_row_block(int64_t M, int64_t b, int64_t *m0, int64_t *mr) {
    const int64_t nb = gemm_num_row_blocks(M);
    *m0 = M * b / nb;
    *mr = M * (b + 1) / nb - *m0;
}

/* gemm.h's gemm_range: panels [p_lo, p_hi) for every row of x, row blocks of at most 6
 * rows in passes of GEMM_ROWS_PER_PASS, each panel group taken by every row block while it
 * is in L1/L2. */
void gemm_range(float *restrict y, int64_t ldy, const float *restrict x,
                              const void *w, const float *scales, int fmt,
                              const float *restrict bias, int64_t M, int64_t n, int64_t k,
                              int64_t p_lo, int64_t p_hi) {
    const int64_t panel_bytes = gemm_panel_bytes(fmt, k);
    if (fmt == GEMM_BF16T) {
        gemm_amx_range(y, ldy, (const uint32_t *)x, w, panel_bytes, k, n, bias, M, p_lo, p_hi);
        return;
    }
    if (fmt == GEMM_W8A8P && gemm_amx_w8a8_takes(M)) {
        gemm_amx_w8a8_range(y, ldy, (const uint8_t *)x, (const uint8_t *)w, panel_bytes, k, n,
                            scales, bias, M, p_lo, p_hi);
        return;
    }
    if (gemm_amx_blocks_takes(fmt, M)) {
        gemm_amx_blocks_range(y, ldy, (const uint8_t *)x, (const uint8_t *)w, panel_bytes, fmt,
                              k, n, bias, M, p_lo, p_hi);
        return;
    }
    /* x's row stride in floats (bf16 pairs, one float's size each, where gemm_x_pairs
     * prepared x; block formats: q41_prepare_x's rows, 44 bytes per 32-block) */
    const int64_t x_stride = gemm_is_block(fmt)      ? q41_x_row_bytes(k) / 4
                             : fmt == GEMM_W8A8P    ? w8_x_row_bytes(k) / 4
                             : gemm_x_is_pairs(fmt) ? gemm_x_pair_stride(k)
                                                    : k;
    for (int64_t r0 = 0; r0 < M; r0 += GEMM_ROWS_PER_PASS) {
        const int64_t rows = M - r0 < GEMM_ROWS_PER_PASS ? M - r0 : GEMM_ROWS_PER_PASS;
        const int64_t nb = gemm_num_row_blocks(rows);
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
                gemm_first_row_block = b == 0;
                for (int64_t p = g; p < g_end; p += tp) {
                    const int64_t np = g_end - p < tp ? g_end - p : tp;
                    gemm_tile_any(y + (r0 + m0) * ldy, ldy, x + (r0 + m0) * x_stride,
                                  (const char *)w + p * panel_bytes, panel_bytes, k,
                                  p * GEMM_NR, n, scales, bias, mr, np, fmt);
                }
            }
        }
    }
    gemm_first_row_block = 1;
}

