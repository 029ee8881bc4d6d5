/*
 * y = x w^T (* scale) (+ bias) for ANY number of rows M, on weights packed once at load into
 * panels of GEMM_NR = 16 output columns:
 *
 *   packed [num_panels, k, 16]: element (k, j) of panel p is w[16 p + j, k] (bf16: the
 *   columns in the order 0, 8, 1, 9, ..., 7, 15, see gemm_load16); the last panel's
 *   columns past n are zeros (kernels/cpu_gemm.py `pack_weight` writes it).
 *
 * in float32, bf16 or int8 (per-column float32 scales, weight-only) — the GEMM_*P formats —
 * or a GGUF's Q4_1 blocks (GEMM_Q41P, gemm_q4_1.h: a panel is k / 32 groups of 320 bytes,
 * the 16 columns' fp16 d, fp16 m and nibbles of one 32-block interleaved; x quantized per
 * 32-block to int8, integer dot products per block), or int8 W8A8 (GEMM_W8A8P,
 * gemm_w8a8.h: 4 consecutive k of a column in one 32-bit lane, x quantized per row, exact
 * integer sums through `vpdpbusd`).
 * One register tile of MR rows x 16 P columns of float32 accumulators walks k once: each
 * step loads 16 P weights, widens them to float32 in registers (bf16 by a shift, int8 by a
 * sign-extend and convert), broadcasts one x element per row and does the tile's fused
 * multiply-adds, so every weight load serves every row of the tile. The tile's shape follows
 * M (gemm.c: 1 x 64, 2 x 48, 3 x 32, 4-6 x 16 with AVX2's 16 ymm registers; 1 x 128, 2 x 96,
 * 3-6 x 64 with AVX-512's 32 zmm), threads split the panels (claims as proj_shared, so a
 * preempted thread delays a step by one claim), and a thread runs all the step's rows over a
 * panel group while it is in L1/L2: a weight crosses memory once per step whatever M is.
 * The AVX512-BF16 build multiplies bf16 weights by x rounded to bf16, two k at a time
 * (vdpbf16ps; gemm.c's gemm_tile_dpbf16). Where AMX is on (gemm_amx.c), bf16 weights are
 * packed in the tiles' own layout instead (GEMM_BF16T: [num_panels, pairs, 16 columns, 2],
 * k zero-padded to 32) and every row count runs on AMX tiles, or on their exact emulation.
 *
 * Deterministic by construction: y[m, c] is ONE accumulator lane, c's column of its panel,
 * summed by fused multiply-adds in the order k = 0, 1, ..., k - 1 and then scaled and biased
 * the same way, whatever the tile, the row block, M, the thread or the claim that computed
 * it. So a row gives the same bits alone, in a 64-row step, in a prefill chunk or a
 * speculative verification (tests/model/test_cpu_gemm.py checks it bit for bit). x stays
 * float32 (not rounded to bf16) except in the AVX512-BF16 build's bf16 case: the products
 * are exact float32 products of the stored weights, the sum a float32 sum.
 */
#ifndef AIOENGINE_GEMM_H
#define AIOENGINE_GEMM_H

#include <stdint.h>

enum { GEMM_F32P = 5, GEMM_BF16P = 6, GEMM_I8P = 7, GEMM_Q41P = 8, GEMM_W8A8P = 9,
       /* a GGUF's other block formats (gemm_blocks.h; kernels/cpu_blocks.py packs them) */
       GEMM_Q80P = 10, GEMM_Q40P = 11, GEMM_Q4KP = 12, GEMM_Q5KP = 13, GEMM_Q6KP = 14,
       /* bf16 in AMX's tile layout (gemm_amx.c) */
       GEMM_BF16T = 15 };
#define GEMM_NR 16
/* Rows per pass over the panels: x's rows of a pass (48 x k floats) stay in L2. */
#define GEMM_ROWS_PER_PASS 48

static inline int gemm_is_packed(int fmt) { return fmt >= GEMM_F32P && fmt <= GEMM_BF16T; }

/* Whether fmt is a GGUF K-quant: x quantized per 256 (q41_prepare_x). */
static inline int gemm_is_kquant(int fmt) { return fmt >= GEMM_Q4KP && fmt <= GEMM_Q6KP; }

/* Whether fmt is a GGUF block format: x quantized per 32 or 256 (q41_prepare_x). */
static inline int gemm_is_block(int fmt) {
    return fmt == GEMM_Q41P || (fmt >= GEMM_Q80P && fmt <= GEMM_Q6KP);
}

/* A block format's weights per panel group and bytes per group (16 columns' block). */
static inline int64_t gemm_block_weights(int fmt) { return fmt >= GEMM_Q4KP ? 256 : 32; }

/* Where sub-block s's min of column c sits in a Q4_K/Q5_K group: [4 pairs of sub-blocks]
 * [16 columns][2], a column's two mins one int16 lane once widened (cpu_blocks.py). */
static inline int64_t gemm_kquant_min_at(int64_t s, int64_t c) {
    return 192 + 32 * (s / 2) + 2 * c + s % 2;
}

static inline int64_t gemm_group_bytes(int fmt) {
    switch (fmt) {
    case GEMM_Q41P: return 320;
    case GEMM_Q80P: return 544;
    case GEMM_Q40P: return 288;
    case GEMM_Q4KP: return 2368;
    case GEMM_Q5KP: return 2880;
    default: return 3360; /* GEMM_Q6KP */
    }
}

static inline int64_t gemm_elem_bytes(int fmt) {
    return fmt == GEMM_F32P ? 4 : fmt == GEMM_BF16P || fmt == GEMM_BF16T ? 2 : 1;
}

/* Pairs of k per row of AMX's layouts, of x (gemm_x_pairs) and of a GEMM_BF16T panel:
 * ceil(k / 2) rounded up to the tiles' 16-pair chunk (zeros past k), so a tile never reads
 * past a row or a panel. */
static inline int64_t gemm_x_pair_stride(int64_t k) { return (k + 31) / 32 * 16; }

/* Bytes of one panel of k rows (block formats: k / block weights groups; W8A8: the 16
 * columns' int32 weight sums, then 16 columns x 4 bytes per 4 rows, gemm_w8a8.h; bf16 tile
 * layout: 16 columns x 4 bytes per pair of rows, whole 16-pair chunks). */
static inline int64_t gemm_panel_bytes(int fmt, int64_t k) {
    if (fmt == GEMM_W8A8P) return 64 * (1 + (k + 3) / 4);
    if (fmt == GEMM_BF16T) return 64 * gemm_x_pair_stride(k);
    if (gemm_is_block(fmt)) return k / gemm_block_weights(fmt) * gemm_group_bytes(fmt);
    return gemm_elem_bytes(fmt) * GEMM_NR * k;
}

/* Software prefetch ahead of a block-format tile's panel streams. A tile of at most
 * GEMM_PREFETCH_MAX_ROWS rows reading a panel group from memory (gemm_first_row_block) asks,
 * while it reads bytes [at, at + len) of each of its P panels, for the bytes `ahead`
 * (GEMM_PREFETCH_BLOCKS 32-weight blocks) further on, past a panel's end those of the next
 * tile's panels (w + P panel_bytes on: a claim's panels are consecutive), into L2. The
 * cores' own prefetchers keep too few reads in flight for a short tile's several streams,
 * so it read the memory below its bandwidth while the same tile ran 3-4x faster from L3
 * (docs/benchmarks.md, "Block formats' reads from memory"). Taller tiles, and the bf16
 * tile, leave the code out: there it slowed the steps whose weights are in cache (prefill's
 * and a small model's), prefetching or not. A prefetch never faults, so asking past a
 * weight's end is harmless; it changes no result. */
#define GEMM_PREFETCH_BLOCKS 16
#define GEMM_PREFETCH_MAX_ROWS 4
/* Set by gemm_range around the tiles it runs: 1 for its passes' first row blocks, the tiles
 * that read a panel group from memory, 0 for the later ones, which find it in cache (a
 * step of 8 rows is two blocks of 4). Thread-local (each thread runs its own claims); 1 for
 * a tile run by any other caller. */
extern _Thread_local int gemm_first_row_block;

/* Whether a block-format tile of MR rows (a constant) prefetches: read once per tile (a
 * thread-local); a constant 0 for taller tiles, so they compile no prefetch code at all. */
static inline __attribute__((always_inline)) int gemm_tile_prefetches(const int MR) {
    return MR <= GEMM_PREFETCH_MAX_ROWS && gemm_first_row_block;
}

static inline __attribute__((always_inline)) void gemm_prefetch_panels(
    const uint8_t *w, int64_t panel_bytes, int P, int64_t at, int64_t len, int64_t ahead) {
    int64_t t = at + ahead, next = 0;
    if (t >= panel_bytes) {
        t -= panel_bytes;
        next = P;
    }
    for (int p = 0; p < P; p++) {
        const uint8_t *base = w + (p + next) * panel_bytes;
        for (int64_t o = t & ~(int64_t)63; o < t + len; o += 64)
            __builtin_prefetch(base + o, 0, 2);
    }
}

static inline int64_t gemm_num_panels(int64_t n) { return (n + GEMM_NR - 1) / GEMM_NR; }

/* Panels per register tile by its rows: with AVX-512 (32 zmm registers, a panel row per
 * register) 8-16 chains of 4-cycle FMAs in flight and at most 24 accumulators; with AVX2
 * (16 ymm registers, two per panel row) at most 12. */
#if defined(__AVX512F__)
static inline int gemm_tile_panels(int64_t mr) { return mr == 1 ? 8 : mr == 2 ? 6 : 4; }
#else
static inline int gemm_tile_panels(int64_t mr) { return mr == 1 ? 4 : mr == 2 ? 3 : mr == 3 ? 2 : 1; }
#endif

/* How GEMM_BF16T weights are multiplied (gemm_amx.c): 1 on AMX tiles (the amx build, with
 * the kernel's permission), else (2) by an exact emulation of the tiles' arithmetic. Set
 * once by gemm_set_amx_mode, before any product. */
extern int gemm_amx_mode;

/* Asks for mode 0 (none: Python packs bf16 as GEMM_BF16P), 1 (tiles) or 2 (emulated);
 * returns the mode set: 0 for 1 where this build has no AMX or the kernel refuses the tile
 * state (fail closed). */
int gemm_set_amx_mode(int mode);

/* Whether gemm_range reads x of format fmt as gemm_x_pairs leaves it: bf16 pairs for AMX
 * tiles (GEMM_BF16T) and for vdpbf16ps (the AVX512-BF16 build's GEMM_BF16P); else float32
 * [M, k]. */
static inline int gemm_x_is_pairs(int fmt) {
#if defined(__AVX512BF16__)
    return fmt == GEMM_BF16P || fmt == GEMM_BF16T;
#else
    return fmt == GEMM_BF16T;
#endif
}

/* x [rows, k] float32 -> xp [rows, gemm_x_pair_stride(k)] bf16 pairs (zeros past k),
 * rounded to nearest even (gemm.c). */
void gemm_x_pairs(uint32_t *restrict xp, const float *restrict x, int64_t rows, int64_t k);

/* gemm_range for GEMM_BF16T, on AMX tiles or emulated (gemm_amx_mode): xp as gemm_x_pairs
 * leaves it. */
void gemm_amx_range(float *restrict y, int64_t ldy, const uint32_t *restrict xp, const void *w,
                    int64_t panel_bytes, int64_t k, int64_t n, const float *restrict bias,
                    int64_t M, int64_t p_lo, int64_t p_hi);

/* gemm_range for the GGUF block formats but Q4_1 on AMX int8 tiles, or their emulation
 * (gemm_amx_mode), with the vector tiles' bits (gemm_amx_blocks.c); gemm_range takes it
 * where gemm_amx_blocks_takes: a mode set, one of those formats, at least
 * AMX_BLOCK_MIN_ROWS rows. xq as q41_prepare_x leaves it. */
#define AMX_BLOCK_MIN_ROWS 32
int gemm_amx_blocks_takes(int fmt, int64_t M);
void gemm_amx_blocks_range(float *restrict y, int64_t ldy, const uint8_t *restrict xq,
                           const uint8_t *restrict w, int64_t panel_bytes, int fmt, int64_t k,
                           int64_t n, const float *restrict bias, int64_t M, int64_t p_lo,
                           int64_t p_hi);

/* gemm_range for GEMM_W8A8P on AMX int8 tiles, or their emulation (gemm_amx_mode), with
 * the vector tiles' bits (gemm_amx_w8a8.c); gemm_range takes it where gemm_amx_w8a8_takes:
 * a mode set, a build whose W8A8 x is bytes, at least AMX_W8A8_MIN_ROWS rows. */
#define AMX_W8A8_MIN_ROWS 8
int gemm_amx_w8a8_takes(int64_t M);
void gemm_amx_w8a8_range(float *restrict y, int64_t ldy, const uint8_t *restrict xq,
                         const uint8_t *restrict w, int64_t panel_bytes, int64_t k, int64_t n,
                         const float *restrict scales, const float *restrict bias, int64_t M,
                         int64_t p_lo, int64_t p_hi);

/* A tile of mr rows (1..6) over np panels of one storage, y's columns from c0 on (those
 * past n dropped): float32, bf16 and int8 weight-only (gemm_f32.c, gemm_bf16.c,
 * gemm_int8.c over gemm_float.h), Q4_1 (gemm_q4_1.c), the other GGUF block formats
 * (gemm_blocks.c) and W8A8 (gemm_w8a8.c), each storage's tiles a translation unit of its
 * own so that the build compiles them in parallel; gemm_range calls them. */
void gemm_f32_tile(float *restrict y, int64_t ldy, const float *restrict x,
                   const char *restrict w, int64_t panel_bytes, int64_t k, int64_t c0,
                   int64_t n, const float *restrict scales, const float *restrict bias,
                   int64_t mr, int64_t np);
void gemm_bf16_tile(float *restrict y, int64_t ldy, const float *restrict x,
                    const char *restrict w, int64_t panel_bytes, int64_t k, int64_t c0,
                    int64_t n, const float *restrict scales, const float *restrict bias,
                    int64_t mr, int64_t np);
void gemm_int8_tile(float *restrict y, int64_t ldy, const float *restrict x,
                    const char *restrict w, int64_t panel_bytes, int64_t k, int64_t c0,
                    int64_t n, const float *restrict scales, const float *restrict bias,
                    int64_t mr, int64_t np);
void gemm_q41_tile(float *restrict y, int64_t ldy, const uint8_t *restrict xq,
                   const uint8_t *restrict w, int64_t panel_bytes, int64_t k, int64_t c0,
                   int64_t n, const float *restrict bias, int64_t mr, int64_t np);
void gemm_blocks_tile(int fmt, float *restrict y, int64_t ldy, const uint8_t *restrict xq,
                      const uint8_t *restrict w, int64_t panel_bytes, int64_t k, int64_t c0,
                      int64_t n, const float *restrict bias, int64_t mr, int64_t np);
void gemm_w8a8_tile(float *restrict y, int64_t ldy, const uint8_t *restrict xq,
                    const uint8_t *restrict w, int64_t panel_bytes, int64_t k, int64_t c0,
                    int64_t n, const float *restrict scales, const float *restrict bias,
                    int64_t mr, int64_t np);

/* Panels [p_lo, p_hi) of y [M, n] (row stride ldy) = x [M, k] w^T (* scales) (+ bias), w
 * packed in format fmt: every row of x over those panels (gemm.c). Defined once, not
 * inline: every caller runs the same machine code. */
void gemm_range(float *restrict y, int64_t ldy, const float *restrict x, const void *w,
                const float *scales, int fmt, const float *restrict bias, int64_t M, int64_t n,
                int64_t k, int64_t p_lo, int64_t p_hi);

/* Panels per claim of gemm_shared: ~64 KB of weights, a whole number of the widest tile's
 * panels (the one-row tile's: 8 with AVX-512, else 4). */
static inline int64_t gemm_claim_panels(int fmt, int64_t k) {
    const int64_t unit = gemm_tile_panels(1);
    int64_t c = 65536 / gemm_panel_bytes(fmt, k);
    c = c / unit * unit;
    return c > unit ? c : unit;
}

#endif /* AIOENGINE_GEMM_H */
