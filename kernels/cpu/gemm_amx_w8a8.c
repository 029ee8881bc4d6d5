/*
 * gemm_range for GEMM_W8A8P on AMX int8 tiles (tdpbusd: x + 128 as unsigned A, the int8
 * weights as signed B), or their emulation (gemm_amx_mode), with the vector tiles' bits
 * (gemm_w8a8.h's header is the arithmetic per element): a tile sums each element's exact
 * int32 dot over all of k, the offset's 128 * the column's weight sum is taken back, and
 * w8a8.h's w8_store rounds it as torch's `_int_mm` path does. So the path is chosen by row
 * count alone and a row has the same bits on either.
 *
 * The panel layout is tdpbusd's B layout as it lies: after the 64 bytes of sums, group g
 * holds k 4 g .. 4 g + 3 of the 16 columns, one column per dword, so 16 groups (64 k) of a
 * panel are one B tile of 16 rows of 64 bytes, loaded with stride 64. A k tail of fewer than
 * 16 groups has tiles of its own shape (A_T, B_T0, B_T1). Only builds whose x is bytes
 * (GEMV_VNNI: q + 128 as uint8) take this path; the others keep theirs (x as int16).
 */
#include <stdint.h>
#include <string.h>

#include "amx_tiles.h"
#include "gemm.h"
#include "gemm_w8a8.h"
#include "w8a8.h"

#if defined(GEMV_VNNI)

/* Tiles (literals: the instructions encode them): x's 64 k, two panels' 64 k, their two
 * accumulators; the k tail's x and panels. */
#define AMXW_A 0
#define AMXW_B0 1
#define AMXW_B1 2
#define AMXW_C0 3
#define AMXW_C1 4
#define AMXW_AT 5
#define AMXW_BT0 6
#define AMXW_BT1 7

static void amxw_config(amx_config *c, int rows, int tail) {
    memset(c, 0, sizeof(*c));
    c->palette = 1;
    amx_config_tile(c, AMXW_A, rows, 64);
    amx_config_tile(c, AMXW_B0, 16, 64);
    amx_config_tile(c, AMXW_B1, 16, 64);
    amx_config_tile(c, AMXW_C0, rows, 64);
    amx_config_tile(c, AMXW_C1, rows, 64);
    amx_config_tile(c, AMXW_AT, rows, 4 * tail);
    amx_config_tile(c, AMXW_BT0, tail, 64);
    amx_config_tile(c, AMXW_BT1, tail, 64);
}

/* The dots of row tile rows [0, r) (x at a: its first row's quants, stride xrow) against
 * np (1 or 2) panels from w, into dot[np][16][16]. */
static inline __attribute__((always_inline)) void amxw_dots(
    const int hw, const uint8_t *a, int64_t xrow, const uint8_t *w, int64_t panel_bytes,
    int np, int64_t chunks, int tail, int32_t dot[2][16][16]) {
    const uint8_t *b0 = w + 64, *b1 = b0 + panel_bytes;  /* past the sums */
    AMX_ZERO(hw, AMXW_C0);
    if (np == 2) AMX_ZERO(hw, AMXW_C1);
    for (int64_t c = 0; c < chunks; c++) {
        /* the loads, then the products: a tile's load waits for the products reading it */
        AMX_LOAD(hw, AMXW_A, a + 64 * c, xrow);
        AMX_LOAD(hw, AMXW_B0, b0 + 1024 * c, 64);
        if (np == 2) AMX_LOAD(hw, AMXW_B1, b1 + 1024 * c, 64);
        AMX_DPBUSD(hw, AMXW_C0, AMXW_A, AMXW_B0);
        if (np == 2) AMX_DPBUSD(hw, AMXW_C1, AMXW_A, AMXW_B1);
    }
    if (tail) {
        AMX_LOAD(hw, AMXW_AT, a + 64 * chunks, xrow);
        AMX_LOAD(hw, AMXW_BT0, b0 + 1024 * chunks, 64);
        if (np == 2) AMX_LOAD(hw, AMXW_BT1, b1 + 1024 * chunks, 64);
        AMX_DPBUSD(hw, AMXW_C0, AMXW_AT, AMXW_BT0);
        if (np == 2) AMX_DPBUSD(hw, AMXW_C1, AMXW_AT, AMXW_BT1);
    }
    AMX_STORE(hw, AMXW_C0, dot[0], 64);
    if (np == 2) AMX_STORE(hw, AMXW_C1, dot[1], 64);
}

/* Row m's 16 dots of a whole panel (columns c0 .. c0 + 15, all below n) into y: the offset
 * taken back, then w8_store's steps in 16 lanes, each rounded on its own (the empty asm
 * statements keep the build's contraction and reassociation from fusing them). */
static inline void amxw_store16(float *restrict y, const int32_t *dot, const int32_t *sums,
                                float sx, const float *restrict sw,
                                const float *restrict bias) {
    const __m512i d = _mm512_sub_epi32(_mm512_load_si512(dot),
                                       _mm512_slli_epi32(_mm512_loadu_si512(sums), 7));
    __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(d), _mm512_set1_ps(sx));
    __asm__("" : "+v"(v));
    v = _mm512_mul_ps(v, _mm512_loadu_ps(sw));
    __asm__("" : "+v"(v));
    if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias));
    _mm512_storeu_ps(y, v);
}

static inline __attribute__((always_inline)) void amxw_range(
    const int hw, float *restrict y, int64_t ldy, const uint8_t *restrict xq,
    const uint8_t *restrict w, int64_t panel_bytes, int64_t k, int64_t n,
    const float *restrict scales, const float *restrict bias, int64_t M, int64_t p_lo,
    int64_t p_hi) {
    const int64_t k4 = w8_k4(k), chunks = k4 / 16, xrow = w8_x_row_bytes(k);
    const int tail = (int)(k4 % 16);
    int32_t dot[2][16][16] __attribute__((aligned(64)));
    amx_config cfg;
    int configured = -1;  /* (and on entry: other tiles may have run on this thread) */
    for (int64_t m0 = 0; m0 < M; m0 += 16) {
        const int r = M - m0 < 16 ? (int)(M - m0) : 16;
        if (r != configured) {
            amxw_config(&cfg, r, tail);
            AMX_CONFIG(hw, &cfg);
            configured = r;
        }
        const uint8_t *x0 = xq + m0 * xrow;
        for (int64_t p = p_lo; p < p_hi; p += 2) {
            const int np = p + 1 < p_hi ? 2 : 1;
            amxw_dots(hw, (const uint8_t *)w8_x_quants(x0), xrow, w + p * panel_bytes,
                      panel_bytes, np, chunks, tail, dot);
            for (int q = 0; q < np; q++) {
                int32_t sums[16];
                memcpy(sums, w + (p + q) * panel_bytes, sizeof(sums));
                const int64_t c0 = (p + q) * GEMM_NR;
                for (int m = 0; m < r; m++) {
                    const float sx = w8_x_scale(x0 + m * xrow);
                    if (c0 + GEMM_NR <= n) {
                        amxw_store16(y + (m0 + m) * ldy + c0, dot[q][m], sums, sx, scales + c0,
                                     bias ? bias + c0 : NULL);
                        continue;
                    }
                    for (int i = 0; i < 16; i++) dot[q][m][i] -= 128 * sums[i];
                    w8_store_panel(y + (m0 + m) * ldy, dot[q][m], c0, n, sx, scales, bias);
                }
            }
        }
    }
}

int gemm_amx_w8a8_takes(int64_t M) { return gemm_amx_mode != 0 && M >= AMX_W8A8_MIN_ROWS; }

void gemm_amx_w8a8_range(float *restrict y, int64_t ldy, const uint8_t *restrict xq,
                         const uint8_t *restrict w, int64_t panel_bytes, int64_t k, int64_t n,
                         const float *restrict scales, const float *restrict bias, int64_t M,
                         int64_t p_lo, int64_t p_hi) {
    if (gemm_amx_mode == 1)
        amxw_range(1, y, ldy, xq, w, panel_bytes, k, n, scales, bias, M, p_lo, p_hi);
    else
        amxw_range(0, y, ldy, xq, w, panel_bytes, k, n, scales, bias, M, p_lo, p_hi);
}

#else  /* x as int16: this build's own tiles */

int gemm_amx_w8a8_takes(int64_t M) {
    (void)M;
    return 0;
}

void gemm_amx_w8a8_range(float *restrict y, int64_t ldy, const uint8_t *restrict xq,
                         const uint8_t *restrict w, int64_t panel_bytes, int64_t k, int64_t n,
                         const float *restrict scales, const float *restrict bias, int64_t M,
                         int64_t p_lo, int64_t p_hi) {
    (void)y, (void)ldy, (void)xq, (void)w, (void)panel_bytes, (void)k, (void)n, (void)scales;
    (void)bias, (void)M, (void)p_lo, (void)p_hi;
    abort();
}

#endif
