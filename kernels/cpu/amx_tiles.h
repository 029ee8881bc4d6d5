/*
 * The AMX tile operations the tile kernels are written over (configure, zero, load, store
 * and the dot products: tdpbf16ps for gemm_amx.c's bf16 GEMM, tdpbsud for
 * gemm_amx_blocks.c's GGUF block formats, tdpbusd for gemm_amx_w8a8.c's W8A8), each
 * either the instruction (hw = 1: AMX builds only, with the kernel's permission) or an
 * exact software emulation every build runs. gemm_amx.c's header comment is tdpbf16ps's
 * measured arithmetic; tdpbsud's and tdpbusd's are exact integer arithmetic (int32 sums of
 * s8 x u8 products, wrapping), which the emulation reproduces trivially. Each translation unit that includes this has its own emulated tile
 * state, per thread: a kernel configures the tiles on entry.
 */
#ifndef AIOENGINE_AMX_TILES_H
#define AIOENGINE_AMX_TILES_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) || defined(__AMX_TILE__)
#include <immintrin.h>
#endif

/* The tile configuration ldtilecfg reads (palette 1: eight tiles of up to 16 x 64 bytes). */
typedef struct {
    uint8_t palette, start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

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

static inline void emu_configure(const amx_config *c) {
    emu_cfg = *c;
    memset(emu_tile, 0, sizeof(emu_tile));
}

static inline void emu_load(int t, const void *p, int64_t stride) {
    for (int r = 0; r < emu_cfg.rows[t]; r++)
        memcpy(emu_tile[t][r], (const char *)p + r * stride, emu_cfg.colsb[t]);
}

static inline void emu_store(int t, void *p, int64_t stride) {
    for (int r = 0; r < emu_cfg.rows[t]; r++)
        memcpy((char *)p + r * stride, emu_tile[t][r], emu_cfg.colsb[t]);
}

static inline void emu_zero(int t) { memset(emu_tile[t], 0, sizeof(emu_tile[t])); }

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

/* tdpbsud (a_signed) and tdpbusd: C[m][n] += sum over the k bytes of A's row m of A[m][kk]
 * times B[kk / 4][4 n + kk % 4] (B in the VNNI layout: four consecutive k of a column per
 * dword), one operand's bytes signed and the other's unsigned, in int32, wrapping (the
 * kernels' sums stay far inside int32). */
static inline void emu_dp_int8(int c, int a, int b, int a_signed) {
    const int kb = emu_cfg.colsb[a], cols = emu_cfg.colsb[c] / 4;
    for (int m = 0; m < emu_cfg.rows[c]; m++) {
        int32_t *acc = (int32_t *)emu_tile[c][m];
        for (int n = 0; n < cols; n++) {
            int32_t sum = 0;
            for (int kk = 0; kk < kb; kk++) {
                const uint8_t x = emu_tile[a][m][kk], w = emu_tile[b][kk / 4][4 * n + kk % 4];
                sum += a_signed ? (int32_t)(int8_t)x * (int32_t)w
                                : (int32_t)x * (int32_t)(int8_t)w;
            }
            acc[n] = (int32_t)((uint32_t)acc[n] + (uint32_t)sum);
        }
    }
}

/* One tile's shape in a configuration; a zero size leaves the tile unconfigured. */
static inline void amx_config_tile(amx_config *c, int t, int rows, int colsb) {
    if (rows > 0 && colsb > 0) {
        c->rows[t] = (uint8_t)rows;
        c->colsb[t] = (uint16_t)colsb;
    }
}

/* ---- the four operations: hardware (hw = 1, AMX builds only) or the emulation ---- */

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__)
#define AMX_HW_CONFIG(c) _tile_loadconfig(c)
#define AMX_HW_ZERO(t) _tile_zero(t)
#define AMX_HW_LOAD(t, p, s) _tile_loadd(t, p, s)
#define AMX_HW_STORE(t, p, s) _tile_stored(t, p, s)
#define AMX_HW_DP(c, a, b) _tile_dpbf16ps(c, a, b)
#define AMX_HW_DPBSUD(c, a, b) _tile_dpbsud(c, a, b)
#define AMX_HW_DPBUSD(c, a, b) _tile_dpbusd(c, a, b)
#else
#define AMX_HW_CONFIG(c) abort()
#define AMX_HW_ZERO(t) abort()
#define AMX_HW_LOAD(t, p, s) abort()
#define AMX_HW_STORE(t, p, s) abort()
#define AMX_HW_DP(c, a, b) abort()
#define AMX_HW_DPBSUD(c, a, b) abort()
#define AMX_HW_DPBUSD(c, a, b) abort()
#endif
/* t, c, a, b: literal tile numbers (the instructions encode them). */
#define AMX_CONFIG(hw, c) do { if (hw) AMX_HW_CONFIG(c); else emu_configure(c); } while (0)
#define AMX_ZERO(hw, t) do { if (hw) AMX_HW_ZERO(t); else emu_zero(t); } while (0)
#define AMX_LOAD(hw, t, p, s) do { if (hw) AMX_HW_LOAD(t, p, s); else emu_load(t, p, s); } while (0)
#define AMX_STORE(hw, t, p, s) do { if (hw) AMX_HW_STORE(t, p, s); else emu_store(t, p, s); } while (0)
#define AMX_DP(hw, c, a, b) do { if (hw) AMX_HW_DP(c, a, b); else emu_dpbf16(c, a, b); } while (0)
#define AMX_DPBSUD(hw, c, a, b) \
    do { if (hw) AMX_HW_DPBSUD(c, a, b); else emu_dp_int8(c, a, b, 1); } while (0)
#define AMX_DPBUSD(hw, c, a, b) \
    do { if (hw) AMX_HW_DPBUSD(c, a, b); else emu_dp_int8(c, a, b, 0); } while (0)

#endif /* AIOENGINE_AMX_TILES_H */
