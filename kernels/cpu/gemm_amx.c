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

#if defined(__AVX512F__) || defined(__AMX_TILE__)
#include <immintrin.h>
#endif

#include "gemm.h"

int gemm_amx_mode = 0;

/* The tile configuration ldtilecfg reads (palette 1: eight tiles of up to 16 x 64 bytes). */
typedef struct {
    uint8_t palette, start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

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

/* ---- the emulation: tiles in thread-local memory ---- */

static __thread amx_config emu_cfg;
static __thread uint8_t emu_tile[8][16][64] __attribute__((aligned(64)));

static inline float amx_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint32_t amx_u32(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

/* A float32 bit pattern with a denormal read as (or flushed to) a signed zero. */
static inline uint32_t amx_flush(uint32_t u) {
    return (u & 0x7F800000u) == 0 ? u & 0x80000000u : u;
}

/* bf16 element i of a tile row, widened, denormal read as zero. */
static inline float amx_bf16(const uint8_t *row, int i) {
    uint16_t h;
    memcpy(&h, row + 2 * i, 2);
    return amx_f32(amx_flush((uint32_t)h << 16));
}

static void emu_configure(const amx_config *c) {
    emu_cfg = *c;
    memset(emu_tile, 0, sizeof(emu_tile));
}

static void emu_load(int t, const void *p, int64_t stride) {
    for (int r = 0; r < emu_cfg.rows[t]; r++)
        memcpy(emu_tile[t][r], (const char *)p + r * stride, emu_cfg.colsb[t]);
}

static void emu_store(int t, void *p, int64_t stride) {
    for (int r = 0; r < emu_cfg.rows[t]; r++)
        memcpy((char *)p + r * stride, emu_tile[t][r], emu_cfg.colsb[t]);
}

static void emu_zero(int t) { memset(emu_tile[t], 0, sizeof(emu_tile[t])); }

/* The sums run in plain float32 steps: the build's -fassociative-math must not regroup
 * them (the two chains and their order are the instruction's arithmetic). */
__attribute__((optimize("no-associative-math", "fp-contract=off"))) static void emu_dpbf16(
    int c, int a, int b) {
    const int pairs = emu_cfg.colsb[a] / 4, cols = emu_cfg.colsb[c] / 4;
    for (int m = 0; m < emu_cfg.rows[c]; m++) {
        float even[16] = {0}, odd[16] = {0};
        for (int kk = 0; kk < pairs; kk++) {
            const float x0 = amx_bf16(emu_tile[a][m], 2 * kk);
            const float x1 = amx_bf16(emu_tile[a][m], 2 * kk + 1);
            for (int n = 0; n < cols; n++) {
                /* exact products (8-bit significands), one rounding per sum */
                const float p0 = x0 * amx_bf16(emu_tile[b][kk], 2 * n);
                const float p1 = x1 * amx_bf16(emu_tile[b][kk], 2 * n + 1);
                even[n] = amx_f32(amx_flush(amx_u32(even[n] + p0)));
                odd[n] = amx_f32(amx_flush(amx_u32(odd[n] + p1)));
            }
        }
        float *acc = (float *)emu_tile[c][m];
        for (int n = 0; n < cols; n++) {
            const float dot = amx_f32(amx_flush(amx_u32(even[n] + odd[n])));
            acc[n] = amx_f32(amx_flush(amx_u32(amx_f32(amx_flush(amx_u32(acc[n]))) + dot)));
        }
    }
}

/* ---- the four operations: hardware (hw = 1, AMX builds only) or the emulation ---- */

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define AMX_HW_CONFIG(c) _tile_loadconfig(c)
#define AMX_HW_ZERO(t) _tile_zero(t)
#define AMX_HW_LOAD(t, p, s) _tile_loadd(t, p, s)
#define AMX_HW_STORE(t, p, s) _tile_stored(t, p, s)
#define AMX_HW_DP(c, a, b) _tile_dpbf16ps(c, a, b)
#else
#define AMX_HW_CONFIG(c) abort()
#define AMX_HW_ZERO(t) abort()
#define AMX_HW_LOAD(t, p, s) abort()
#define AMX_HW_STORE(t, p, s) abort()
#define AMX_HW_DP(c, a, b) abort()
#endif
/* t, c, a, b: literal tile numbers (the instructions encode them). */
#define AMX_CONFIG(hw, c) do { if (hw) AMX_HW_CONFIG(c); else emu_configure(c); } while (0)
#define AMX_ZERO(hw, t) do { if (hw) AMX_HW_ZERO(t); else emu_zero(t); } while (0)
#define AMX_LOAD(hw, t, p, s) do { if (hw) AMX_HW_LOAD(t, p, s); else emu_load(t, p, s); } while (0)
#define AMX_STORE(hw, t, p, s) do { if (hw) AMX_HW_STORE(t, p, s); else emu_store(t, p, s); } while (0)
#define AMX_DP(hw, c, a, b) do { if (hw) AMX_HW_DP(c, a, b); else emu_dpbf16(c, a, b); } while (0)

/* ---- the kernel ---- */

/* A thread's copy of two panels in the tile layout (grown, never freed: the threads live as
 * long as the process). */
static __thread uint8_t *amx_b_buf;
static __thread int64_t amx_b_cap;

static uint8_t *amx_b_scratch(int64_t bytes) {
    if (bytes > amx_b_cap) {
        free(amx_b_buf);
        amx_b_buf = aligned_alloc(64, (size_t)bytes);
        amx_b_cap = amx_b_buf ? bytes : 0;
    }
    return amx_b_buf;
}

/* Panel `panel` (gemm.h's bf16 layout: k rows of 16 bf16, columns in the order 0, 8, 1, 9,
 * ..., 7, 15) -> dst [pairs][16 columns][2]: row r holds every column's (k = 2 r, 2 r + 1)
 * pair in column order (the tile layout of B), zeros past k. */
static void amx_pairs_of_panel(uint8_t *restrict dst, const uint8_t *restrict panel, int64_t k,
                               int64_t pairs) {
    const int64_t whole = k / 2;
#if defined(__AVX512BW__)
    static const int16_t order[32] __attribute__((aligned(64))) = {
        0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30,
        1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31};
    const __m512i idx = _mm512_load_si512(order);
    for (int64_t r = 0; r < whole; r++)
        _mm512_store_si512(dst + 64 * r, _mm512_permutexvar_epi16(
                                             idx, _mm512_loadu_si512(panel + 64 * r)));
#else
    for (int64_t r = 0; r < whole; r++)
        for (int j = 0; j < 16; j++) {
            const int slot = j < 8 ? 2 * j : 2 * (j - 8) + 1;
            memcpy(dst + 64 * r + 4 * j, panel + 64 * r + 2 * slot, 2);
            memcpy(dst + 64 * r + 4 * j + 2, panel + 64 * r + 32 + 2 * slot, 2);
        }
#endif
    memset(dst + 64 * whole, 0, (size_t)(64 * (pairs - whole)));
    if (k % 2)
        for (int j = 0; j < 16; j++) {
            const int slot = j < 8 ? 2 * j : 2 * (j - 8) + 1;
            memcpy(dst + 64 * whole + 4 * j, panel + 64 * whole + 2 * slot, 2);
        }
}

/* The C tiles of one (row tile pair, panel pair) into y, through the epilogue. */
static inline void amx_write(float *restrict y, int64_t ldy, const float tile[4][16][16],
                             int64_t m_rows, int64_t c0, int np, int64_t n,
                             const float *restrict bias) {
    for (int64_t i = 0; i < m_rows; i++)
        for (int q = 0; q < np; q++) {
            const float *acc = tile[(i >= 16 ? 2 : 0) + q][i % 16];
            for (int j = 0; j < 16; j++) {
                const int64_t c = c0 + 16 * q + j;
                if (c < n) {
                    const float v = bias ? acc[j] + bias[c] : acc[j];
                    y[i * ldy + c] = v;
                }
            }
        }
}

/* Panels [p_lo, p_hi) of y = x w^T (+ bias) for every row: x as bf16 pairs, xs =
 * gemm_x_pair_stride(k) pairs per row (zeros past k). Per panel pair, its tile-layout copy
 * is made once and serves every row; per 32 rows, 4 C tiles walk k's chunks. */
static inline __attribute__((always_inline)) void amx_range(
    float *restrict y, int64_t ldy, const uint32_t *restrict xp, const char *restrict w,
    int64_t panel_bytes, int64_t k, int64_t n, const float *restrict bias, int64_t M,
    int64_t p_lo, int64_t p_hi, const int hw) {
    const int64_t xs = gemm_x_pair_stride(k), chunks = xs / 16;
    uint8_t *bs = amx_b_scratch(2 * xs * 64);
    if (bs == NULL) abort();  /* a few hundred KB; no error path in gemm_range */
    amx_config cfg;
    int r0_cfg = -1, r1_cfg = -1;
    float tile[4][16][16] __attribute__((aligned(64)));
    for (int64_t p = p_lo; p < p_hi; p += 2) {
        const int np = p + 1 < p_hi ? 2 : 1;
        for (int q = 0; q < np; q++)
            amx_pairs_of_panel(bs + q * xs * 64, (const uint8_t *)w + (p + q) * panel_bytes, k, xs);
        for (int64_t m0 = 0; m0 < M; m0 += 32) {
            const int r0 = M - m0 < 16 ? (int)(M - m0) : 16;
            const int r1 = M - m0 - 16 <= 0 ? 0 : M - m0 - 16 < 16 ? (int)(M - m0 - 16) : 16;
            if (r0 != r0_cfg || r1 != r1_cfg) {  /* (and on entry: another library's
                                                  * tiles may have run on this thread) */
                amx_config_rows(&cfg, r0, r1);
                AMX_CONFIG(hw, &cfg);
                r0_cfg = r0, r1_cfg = r1;
            }
            const uint32_t *a = xp + m0 * xs;
            AMX_ZERO(hw, 0); AMX_ZERO(hw, 1);
            if (r1) { AMX_ZERO(hw, 2); AMX_ZERO(hw, 3); }
            for (int64_t c = 0; c < chunks; c++) {
                AMX_LOAD(hw, 4, a + 16 * c, xs * 4);
                AMX_LOAD(hw, 6, bs + 1024 * c, 64);
                AMX_DP(hw, 0, 4, 6);
                if (np == 2) {
                    AMX_LOAD(hw, 7, bs + xs * 64 + 1024 * c, 64);
                    AMX_DP(hw, 1, 4, 7);
                }
                if (r1) {
                    AMX_LOAD(hw, 5, a + 16 * xs + 16 * c, xs * 4);
                    AMX_DP(hw, 2, 5, 6);
                    if (np == 2) AMX_DP(hw, 3, 5, 7);
                }
            }
            AMX_STORE(hw, 0, tile[0], 64);
            AMX_STORE(hw, 1, tile[1], 64);
            if (r1) { AMX_STORE(hw, 2, tile[2], 64); AMX_STORE(hw, 3, tile[3], 64); }
            amx_write(y + m0 * ldy, ldy, (const float(*)[16][16])tile, r0 + r1, p * GEMM_NR, np,
                      n, bias);
        }
    }
}

void gemm_amx_range(float *restrict y, int64_t ldy, const uint32_t *restrict xp, const void *w,
                    int64_t panel_bytes, int64_t k, int64_t n, const float *restrict bias,
                    int64_t M, int64_t p_lo, int64_t p_hi) {
    if (gemm_amx_mode == 1)
        amx_range(y, ldy, xp, (const char *)w, panel_bytes, k, n, bias, M, p_lo, p_hi, 1);
    else
        amx_range(y, ldy, xp, (const char *)w, panel_bytes, k, n, bias, M, p_lo, p_hi, 0);
}

/* The tile state needs the kernel's permission (Linux 5.16+: arch_prctl
 * ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA, once per process); without it the first tile
 * instruction faults. */
static int amx_permitted(void) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(SYS_arch_prctl)
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
