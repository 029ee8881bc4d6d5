/*
 * The bf16 GEMM on AMX tiles (tdpbf16ps), and an exact software emulation of the same tile
 * operations that every build runs (gemm.h's gemm_amx_mode: 0 off, 1 the hardware, 2 the
 * emulation). One kernel, written once over four tile operations (configure, zero, load,
 * store and the dot product); only what those operations do differs between the modes.
 *
 * The arithmetic of one tdpbf16ps, as measured on a Sapphire Rapids core (scripts/
 * amx_check.sh re-proves it on every AMX machine it runs on): for output element (m, n) and
 * the 16 bf16 pairs of one 32-wide k chunk, two float32 partial sums start at +0, E over the
 * even k and O over the odd k, each a chain of fused multiply-adds in k order (bf16 products
 * are exact in float32, so each step is one rounding); then C = C + (E + O), rounded twice.
 * Every input denormal (bf16 operands, C) is read as zero and every result denormal
 * flushed to zero; round to nearest even throughout. (The SDM's older pseudocode, a single
 * chain over k alternating even and odd, and vdpbf16ps's odd-then-even chain both differ
 * from the hardware in ~1 element in 5.)
 *
 * Deterministic by construction: an element's value is a fixed sequence of those
 * instructions, one per k chunk in k order, over its own row of x and column of w; the row
 * count of its tile, the tile's place in the step, the thread and the claim never enter.
 * k is zero-padded to whole chunks in both operands (a zero product leaves E and O
 * unchanged: they start at +0 and round to nearest even never makes -0 from a sum of
 * unlike signs), so a tail chunk is an ordinary chunk.
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "amx_tiles.h"
#include "gemm.h"

int gemm_amx_mode = 0;

/* Tiles 0-3 accumulate C (row tile 0: 0 and 1, row tile 1: 2 and 3, each 16 columns),
 * 4-5 hold x's two row tiles, 6-7 the two panels' k chunk. */
enum { AMX_C00 = 0, AMX_C01 = 1, AMX_C10 = 2, AMX_C11 = 3, AMX_A0 = 4, AMX_A1 = 5,
       AMX_B0 = 6, AMX_B1 = 7 };

static void amx_config_rows(amx_config *c, int r0, int r1) {
    memset(c, 0, sizeof(*c));
    c->palette = 1;
    const int rows[8] = {r0, r0, r1, r1, r0, r1, 16, 16};
    for (int t = 0; t < 8; t++)
        if (rows[t] > 0) {
            c->rows[t] = (uint8_t)rows[t];
            c->colsb[t] = 64;
        }
}

/* ---- the kernel ---- */

/* y [rows, cols] (row stride ldy) += bias [cols], or nothing without a bias: the epilogue
 * of tiles stored straight into y. */
static inline void amx_add_bias(float *restrict y, int64_t ldy, int64_t rows, int64_t cols,
                                const float *restrict bias) {
    if (bias == NULL) return;
    for (int64_t i = 0; i < rows; i++)
        for (int64_t j = 0; j < cols; j++) y[i * ldy + j] += bias[j];
}

/* Row tile `half` (0 or 1) of the C tiles in `tile` into y: columns past n dropped (the
 * last panel's), the bias added. */
static inline void amx_write_tail(float *restrict y, int64_t ldy, const float tile[4][16][16],
                                  int half, int64_t rows, int64_t c0, int np, int64_t n,
                                  const float *restrict bias) {
    for (int64_t i = 0; i < rows; i++)
        for (int q = 0; q < np; q++)
            for (int j = 0; j < 16; j++) {
                const int64_t c = c0 + 16 * q + j;
                if (c < n) y[i * ldy + c] = tile[2 * half + q][i][j] + (bias ? bias[c] : 0.0f);
            }
}

/* Panels [p_lo, p_hi) of y = x w^T (+ bias) for every row: x as bf16 pairs, xs =
 * gemm_x_pair_stride(k) pairs per row (zeros past k); w in the tile layout (gemm.h's
 * GEMM_BF16T: panel p is [xs][16 columns][2], row r holding every column's (k = 2 r,
 * 2 r + 1) pair, zeros past k), so a k chunk of a panel is one B tile as it lies. Per 32
 * rows and panel pair, 4 C tiles walk k's chunks. Rows outside, panels inside: the 32 rows'
 * A tiles (36 KB at k = 576) stay in L1 while the panels stream from L2 in address order
 * (~5% over panels outside at M = 512). */
static inline __attribute__((always_inline)) void amx_range(
    float *restrict y, int64_t ldy, const uint32_t *restrict xp, const char *restrict w,
    int64_t panel_bytes, int64_t k, int64_t n, const float *restrict bias, int64_t M,
    int64_t p_lo, int64_t p_hi, const int hw) {
    const int64_t xs = gemm_x_pair_stride(k), chunks = xs / 16;
    amx_config cfg;
    int r0_cfg = -1, r1_cfg = -1;
    float tile[4][16][16] __attribute__((aligned(64)));
    for (int64_t m0 = 0; m0 < M; m0 += 32) {
        const int r0 = M - m0 < 16 ? (int)(M - m0) : 16;
        const int r1 = M - m0 - 16 <= 0 ? 0 : M - m0 - 16 < 16 ? (int)(M - m0 - 16) : 16;
        if (r0 != r0_cfg || r1 != r1_cfg) {  /* (and on entry: another library's
                                              * tiles may have run on this thread) */
            amx_config_rows(&cfg, r0, r1);
            AMX_CONFIG(hw, &cfg);
            r0_cfg = r0, r1_cfg = r1;
        }
        for (int64_t p = p_lo; p < p_hi; p += 2) {
            const int np = p + 1 < p_hi ? 2 : 1;
            const char *b0 = w + p * panel_bytes, *b1 = b0 + panel_bytes;
            const uint32_t *a = xp + m0 * xs;
            AMX_ZERO(hw, 0); AMX_ZERO(hw, 1);
            if (r1) { AMX_ZERO(hw, 2); AMX_ZERO(hw, 3); }
            /* A chunk's four loads, then its four products: a load interleaved between
             * products waits for them (tiles are not renamed), ~4.5x slower here. */
            for (int64_t c = 0; c < chunks; c++) {
                AMX_LOAD(hw, 4, a + 16 * c, xs * 4);
                if (r1) AMX_LOAD(hw, 5, a + 16 * xs + 16 * c, xs * 4);
                AMX_LOAD(hw, 6, b0 + 1024 * c, 64);
                if (np == 2) AMX_LOAD(hw, 7, b1 + 1024 * c, 64);
                AMX_DP(hw, 0, 4, 6);
                if (np == 2) AMX_DP(hw, 1, 4, 7);
                if (r1) {
                    AMX_DP(hw, 2, 5, 6);
                    if (np == 2) AMX_DP(hw, 3, 5, 7);
                }
            }
            /* whole columns: the tiles straight into y, then the bias (adding +0.0f
             * instead would turn a -0 into +0: no bias, no add) */
            const int64_t c0 = p * GEMM_NR;
            float *yo = y + m0 * ldy;
            if (c0 + 16 * np <= n) {
                AMX_STORE(hw, 0, yo + c0, ldy * 4);
                if (np == 2) AMX_STORE(hw, 1, yo + c0 + 16, ldy * 4);
                if (r1) {
                    AMX_STORE(hw, 2, yo + 16 * ldy + c0, ldy * 4);
                    if (np == 2) AMX_STORE(hw, 3, yo + 16 * ldy + c0 + 16, ldy * 4);
                }
                amx_add_bias(yo + c0, ldy, r0 + r1, 16 * np, bias ? bias + c0 : NULL);
            } else {
                AMX_STORE(hw, 0, tile[0], 64);
                AMX_STORE(hw, 1, tile[1], 64);
                amx_write_tail(yo, ldy, (const float(*)[16][16])tile, 0, r0, c0, np, n, bias);
                if (r1) {
                    AMX_STORE(hw, 2, tile[2], 64);
                    AMX_STORE(hw, 3, tile[3], 64);
                    amx_write_tail(yo + 16 * ldy, ldy, (const float(*)[16][16])tile, 1, r1, c0,
                                   np, n, bias);
                }
            }
        }
    }
}

void gemm_amx_range(float *restrict y, int64_t ldy, const uint32_t *restrict xp, const void *w,
                    int64_t panel_bytes, int64_t k, int64_t n, const float *restrict bias,
                    int64_t M, int64_t p_lo, int64_t p_hi) {
    if (gemm_amx_mode == 1)
        amx_range(y, ldy, xp, (const char *)w, panel_bytes, k, n, bias, M, p_lo, p_hi, 1);
    else  /* a GEMM_BF16T weight with the tiles off or missing: the same bits, slowly */
        amx_range(y, ldy, xp, (const char *)w, panel_bytes, k, n, bias, M, p_lo, p_hi, 0);
}

/* The tile state needs the kernel's permission (Linux 5.16+: arch_prctl
 * ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA, once per process); without it the first tile
 * instruction faults. */
static int amx_permitted(void) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__) && defined(SYS_arch_prctl)
    static int state = -1;  /* called under the Python loader's lock */
    if (state < 0) state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                   18 /* XFEATURE_XTILEDATA */) == 0;
    return state;
#else
    return 0;
#endif
}

int gemm_set_amx_mode(int mode) {
    if (mode == 1 && !amx_permitted()) mode = 0;  /* fail closed: today's kernels */
    gemm_amx_mode = mode == 1 || mode == 2 ? mode : 0;
    return gemm_amx_mode;
}
