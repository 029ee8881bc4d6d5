/*
 * gemm_range for the GGUF block formats Q8_0, Q4_0, Q4_K, Q5_K and Q6_K on AMX int8 tiles
 * (tdpbsud: x's int8 rows as A, the weights' unsigned codes as B), with the same bits as
 * their vector tiles (gemm_blocks.h's header is the arithmetic per element). What a tile
 * forms is each 32-block's integer dot of codes and x (Q6_K: its two 16-weight halves
 * apart), exact whichever instruction sums it; the float steps after it are the vector
 * tiles' own, per block in k order. So an element's bits do not depend on whether its row
 * ran here or on vector registers, which is what lets gemm_range pick this path by row
 * count alone (AMX_BLOCK_MIN_ROWS) and keep greedy output identical under batching.
 *
 * The panel layout (kernels/cpu_blocks.py) keeps a column's four consecutive k in one
 * dword, which is tdpbsud's B layout: a 32-block's B tile is 8 rows of 64 bytes, rows 0-3
 * the low-half codes of chunks 0-3 (k 0..15), rows 4-7 the high halves (k 16..31), the bits
 * above the nibble merged in. Each panel of the range is unpacked once into that form
 * (512 bytes per block, per thread) and then read by every 16-row tile of x.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx_tiles.h"
#include "gemm.h"
#include "gemm_blocks.h"
#include "q4_1.h"

/* Tiles (literals: the instructions encode the tile numbers). One dot per block (Q8_0, Q4_0,
 * Q4_K, Q5_K): x's block in A, three panels' codes in B0-B2, their dots in C0-C2, so that
 * three products are in flight (a tile is not renamed: its next load waits for the product
 * reading it). Q6_K: the two 16-weight halves of one panel's block, A0/A1, B0/B1 (4 rows),
 * C0/C1. */
#define AMXB_A0 0
#define AMXB_A1 7
#define AMXB_B0 1
#define AMXB_B1 2
#define AMXB_B2 3
#define AMXB_C0 4
#define AMXB_C1 5
#define AMXB_C2 6

static void amxb_config(amx_config *c, int rows, int q6) {
    memset(c, 0, sizeof(*c));
    c->palette = 1;
    const int bt[3] = {AMXB_B0, AMXB_B1, AMXB_B2}, ct[3] = {AMXB_C0, AMXB_C1, AMXB_C2};
    amx_config_tile(c, AMXB_A0, rows, q6 ? 16 : 32);
    amx_config_tile(c, AMXB_A1, rows, q6 ? 16 : 32);
    for (int i = 0; i < 3; i++) {
        amx_config_tile(c, bt[i], q6 ? 4 : 8, 64);
        amx_config_tile(c, ct[i], rows, 64);
    }
}

/* 32-block s of a group (at grp) of format F as a B tile: out[64 r + 4 i + t] is column
 * i's code for k = 4 r + t. */
static inline __attribute__((always_inline)) void amxb_unpack(const int F, const uint8_t *grp,
                                                              int64_t s, uint8_t *out) {
    const uint8_t *codes = grp + blk_codes_offset(F, s);
    if (F == GEMM_Q80P) {  /* byte chunks: chunk j's low half, then its high half */
        for (int j = 0; j < 4; j++) {
            memcpy(out + 64 * j, codes + 128 * j, 64);
            memcpy(out + 64 * (4 + j), codes + 128 * j + 64, 64);
        }
        return;
    }
#if defined(GEMM_HAVE_KQ_TILES) && defined(__AVX512F__) && defined(__AVX512BW__)
    for (int j = 0; j < 4; j++) {
        __m512i lo, hi;
        kq_codes_zmm(codes, j, F, &lo, &hi);  /* (Q4_0's nibbles are Q4_K's) */
        _mm512_storeu_si512(out + 64 * j, lo);
        _mm512_storeu_si512(out + 64 * (4 + j), hi);
    }
#else
    for (int r = 0; r < 8; r++)
        for (int i = 0; i < 16; i++)
            for (int t = 0; t < 4; t++) out[64 * r + 4 * i + t] = (uint8_t)blk_code(F, codes, i, 4 * r + t);
#endif
}

/* Per thread: the range's panels unpacked, grown as needed and kept (a thread's largest). */
static __thread uint8_t *amxb_codes;
static __thread int64_t amxb_capacity;

static uint8_t *amxb_scratch(int64_t bytes) {
    if (bytes > amxb_capacity) {
        free(amxb_codes);
        amxb_codes = aligned_alloc(64, (size_t)((bytes + 63) / 64 * 64));
        amxb_capacity = amxb_codes ? bytes : 0;
    }
    return amxb_codes;
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
typedef __m512 amxb_acc;
typedef __m512i amxb_iacc;
#else
typedef struct { float v[16]; } amxb_acc;
typedef struct { int32_t v[16]; } amxb_iacc;
#endif

/* What the float steps read of x's rows, per block and row of a 16-row tile (tables of
 * [nb][16], built once per tile and read by every panel): xs the scale; t1 Q8_0/Q4_0 off
 * sx, Q4_K/Q5_K the sums of blocks b and b + 1 as an int16 pair (b even), Q6_K 32 sx16;
 * t2 Q6_K 32 (sx - sx16). */
typedef struct {
    float *xs;
    int32_t *t1i, *t2;
} amxb_rows_t;

static inline void amxb_tables(const int F, amxb_rows_t *t, const uint8_t *const rows[16],
                               int64_t nb) {
    for (int64_t b = 0; b < nb; b++)
        for (int m = 0; m < 16; m++) {
            const float xs = q41_x_scale(rows[m], b);
            const int32_t sx = q41_x_sum(rows[m], nb, b), sx16 = q41_x_half_sum(rows[m], nb, b);
            t->xs[16 * b + m] = xs;
            if (F == GEMM_Q80P || F == GEMM_Q40P)
                t->t1i[16 * b + m] = (F == GEMM_Q80P ? 128 : 8) * sx;
            else if (F == GEMM_Q6KP)
                t->t1i[16 * b + m] = 32 * sx16, t->t2[16 * b + m] = 32 * (sx - sx16);
            else if (b % 2 == 0)
                t->t1i[16 * b + m] = kq_sum_pair_i(rows[m], nb, b);
        }
}

/* acc[m] (16 columns of row m) gets block b's terms, the dots in c (Q6_K: c the low halves',
 * chi the high halves'; Q4_K/Q5_K: isum[m] the group's sum of sc dot until its last block).
 * The steps are the vector tiles' (gemm_kquant.h, gemm_legacy.h), element by element. */
static inline __attribute__((always_inline)) void amxb_block(
    const int F, amxb_acc *restrict acc, amxb_iacc *restrict isum, const int32_t c[16][16],
    const int32_t chi[16][16], const uint8_t *grp, int64_t s, const amxb_rows_t *t, int64_t b) {
    const float *xs = t->xs + 16 * b;
    const int32_t *t1i = t->t1i + 16 * b, *t2 = t->t2 + 16 * b;
    const int32_t *pairs = t->t1i + 16 * (b - s);  /* K-quants: the group's first block's */
#if defined(__AVX512F__) && defined(__AVX512BW__)
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)grp));
    if (F == GEMM_Q80P || F == GEMM_Q40P) {
        for (int m = 0; m < 16; m++) {
            const __m512i idot = _mm512_sub_epi32(_mm512_load_si512(c[m]), _mm512_set1_epi32(t1i[m]));
            const __m512 ds = _mm512_mul_ps(d, _mm512_set1_ps(xs[m]));
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(idot), ds, acc[m]);
        }
    } else if (F == GEMM_Q6KP) {
        const __m512i sa = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(grp + 32 + 32 * s)));
        const __m512i sb = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(grp + 48 + 32 * s)));
        for (int m = 0; m < 16; m++) {
            const __m512i ia = _mm512_mullo_epi32(
                sa, _mm512_sub_epi32(_mm512_load_si512(c[m]), _mm512_set1_epi32(t1i[m])));
            const __m512i ib = _mm512_mullo_epi32(
                sb, _mm512_sub_epi32(_mm512_load_si512(chi[m]), _mm512_set1_epi32(t2[m])));
            const __m512 ds = _mm512_mul_ps(d, _mm512_set1_ps(xs[m]));
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(ia, ib)), ds, acc[m]);
        }
    } else {  /* Q4_K, Q5_K */
        const __m512i sc =
            _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(grp + 64 + 16 * s)));
        for (int m = 0; m < 16; m++)
            isum[m] = _mm512_add_epi32(isum[m], _mm512_mullo_epi32(sc, _mm512_load_si512(c[m])));
        if (s < 7) return;
        const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(grp + 32)));
        __m512i mn[4];
        for (int q = 0; q < 4; q++)
            mn[q] = _mm512_cvtepu8_epi16(
                _mm256_loadu_si256((const __m256i *)(grp + 192 + 32 * q)));
        for (int m = 0; m < 16; m++) {
            __m512i msum = _mm512_setzero_si512();
            for (int q = 0; q < 4; q++)
                msum = kq_dot16_zmm(msum, mn[q], _mm512_set1_epi32(pairs[32 * q + m]));
            const __m512 x = _mm512_set1_ps(xs[m]);
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[m]), _mm512_mul_ps(d, x), acc[m]);
            acc[m] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(msum), _mm512_mul_ps(dmin, x), acc[m]);
            isum[m] = _mm512_setzero_si512();
        }
    }
#else  /* gemm_blk_tile_c's steps, one element at a time (the emulation's builds) */
    for (int m = 0; m < 16; m++)
        for (int i = 0; i < 16; i++) {
            const float d = q41_half(grp + 2 * i);
            float *a = &acc[m].v[i];
            if (F == GEMM_Q80P || F == GEMM_Q40P) {
                *a = __builtin_fmaf((float)(c[m][i] - t1i[m]), d * xs[m], *a);
            } else if (F == GEMM_Q6KP) {
                const int32_t sa = (int8_t)grp[32 + 32 * s + i], sb = (int8_t)grp[48 + 32 * s + i];
                const int32_t idot = sa * (c[m][i] - t1i[m]) + sb * (chi[m][i] - t2[m]);
                *a = __builtin_fmaf((float)idot, d * xs[m], *a);
            } else {
                int32_t *is = &isum[m].v[i];
                *is += (int32_t)grp[64 + 16 * s + i] * c[m][i];
                if (s < 7) continue;
                int32_t msum = 0;
                for (int q = 0; q < 8; q++) {
                    const int32_t pair = pairs[32 * (q / 2) + m];
                    const int32_t sx = q % 2 ? pair >> 16 : (int16_t)(pair & 0xFFFF);
                    msum += (int32_t)grp[gemm_kquant_min_at(q, i)] * sx;
                }
                const float dmin = q41_half(grp + 32 + 2 * i);
                *a = __builtin_fmaf(-(float)msum, dmin * xs[m],
                                    __builtin_fmaf((float)*is, d * xs[m], *a));
                *is = 0;
            }
        }
#endif
}

/* Rows [0, r) of acc into y's columns [c0, c0 + 16) below n, plus the bias. */
static inline void amxb_write(float *restrict y, int64_t ldy, const amxb_acc acc[16], int r,
                              int64_t c0, int64_t n, const float *restrict bias) {
    for (int m = 0; m < r; m++) {
        float lanes[16] __attribute__((aligned(64)));
        memcpy(lanes, &acc[m], sizeof(lanes));
        for (int i = 0; i < 16 && c0 + i < n; i++)
            y[m * ldy + c0 + i] = bias ? lanes[i] + bias[c0 + i] : lanes[i];
    }
}

/* One product into C tile `ct` of the panel's block b codes in B tile `bt` (A0 holds x's
 * block), stored to cb: the literal tile numbers per slot of the three in flight. */
#define AMXB_DOT(hw, bt, ct, codes, cb)                                                      \
    do {                                                                                       \
        AMX_LOAD(hw, bt, codes, 64);                                                           \
        AMX_ZERO(hw, ct);                                                                      \
        AMX_DPBSUD(hw, ct, AMXB_A0, bt);                                                       \
        AMX_STORE(hw, ct, cb, 64);                                                             \
    } while (0)

/* 16-row tile t of x against the range's np panels (w: the first; their blocks unpacked at
 * `codes`, 512 bytes a block): acc [np][16] accumulators (isum [np][16] the K-quants'
 * group sums). Blocks outside, panels inside: x's A tile is loaded once per block for every
 * panel. */
static inline __attribute__((always_inline)) void amxb_rows(
    const int F, const int hw, const amxb_rows_t *t, const int8_t *xq0, int64_t xrow,
    const uint8_t *w, int64_t panel_bytes, int64_t np, const uint8_t *codes, int64_t nb,
    int32_t cbuf[3][16][16], amxb_acc *acc, amxb_iacc *isum) {
    const int64_t gw = gemm_block_weights(F) / 32, gb = gemm_group_bytes(F);
    memset(acc, 0, (size_t)np * 16 * sizeof(amxb_acc));
    memset(isum, 0, (size_t)np * 16 * sizeof(amxb_iacc));
    for (int64_t b = 0; b < nb; b++) {
        const int8_t *a = xq0 + 32 * b;
        const uint8_t *bt = codes + 512 * b;
        const int64_t g = (b / gw) * gb, s = b % gw;
        if (F == GEMM_Q6KP) {
            AMX_LOAD(hw, AMXB_A0, a, xrow);
            AMX_LOAD(hw, AMXB_A1, a + 16, xrow);
            for (int64_t p = 0; p < np; p++) {
                const uint8_t *pc = bt + p * nb * 512;
                AMX_LOAD(hw, AMXB_B0, pc, 64);
                AMX_LOAD(hw, AMXB_B1, pc + 256, 64);
                AMX_ZERO(hw, AMXB_C0);
                AMX_ZERO(hw, AMXB_C1);
                AMX_DPBSUD(hw, AMXB_C0, AMXB_A0, AMXB_B0);
                AMX_DPBSUD(hw, AMXB_C1, AMXB_A1, AMXB_B1);
                AMX_STORE(hw, AMXB_C0, cbuf[0], 64);
                AMX_STORE(hw, AMXB_C1, cbuf[1], 64);
                amxb_block(F, acc + 16 * p, isum + 16 * p, (const int32_t(*)[16])cbuf[0],
                           (const int32_t(*)[16])cbuf[1], w + p * panel_bytes + g, s, t, b);
            }
            continue;
        }
        AMX_LOAD(hw, AMXB_A0, a, xrow);
        for (int64_t p = 0; p < np; p += 3) {
            const int64_t q = np - p < 3 ? np - p : 3;
            const uint8_t *pc = bt + p * nb * 512;
            AMXB_DOT(hw, AMXB_B0, AMXB_C0, pc, cbuf[0]);
            if (q > 1) AMXB_DOT(hw, AMXB_B1, AMXB_C1, pc + nb * 512, cbuf[1]);
            if (q > 2) AMXB_DOT(hw, AMXB_B2, AMXB_C2, pc + 2 * nb * 512, cbuf[2]);
            for (int64_t i = 0; i < q; i++)
                amxb_block(F, acc + 16 * (p + i), isum + 16 * (p + i),
                           (const int32_t(*)[16])cbuf[i], NULL,
                           w + (p + i) * panel_bytes + g, s, t, b);
        }
    }
}

static inline __attribute__((always_inline)) void amxb_range(
    const int F, const int hw, float *restrict y, int64_t ldy, const uint8_t *restrict xq,
    const uint8_t *restrict w, int64_t panel_bytes, int64_t k, int64_t n,
    const float *restrict bias, int64_t M, int64_t p_lo, int64_t p_hi) {
    const int64_t nb = k / 32, xrow = q41_x_row_bytes(k), np = p_hi - p_lo;
    const int64_t gw = gemm_block_weights(F) / 32, gb = gemm_group_bytes(F);
    const int64_t code_bytes = np * nb * 512, acc_bytes = np * 16 * (int64_t)sizeof(amxb_acc);
    const int64_t isum_bytes = np * 16 * (int64_t)sizeof(amxb_iacc);
    uint8_t *codes = amxb_scratch(code_bytes + acc_bytes + isum_bytes + 3 * nb * 64);
    if (codes == NULL) abort();
    amxb_acc *acc = (amxb_acc *)(codes + code_bytes);
    amxb_iacc *isum = (amxb_iacc *)(codes + code_bytes + acc_bytes);
    char *tab = (char *)codes + code_bytes + acc_bytes + isum_bytes;
    const amxb_rows_t t = {(float *)tab, (int32_t *)(tab + nb * 64), (int32_t *)(tab + nb * 128)};
    for (int64_t p = 0; p < np; p++)
        for (int64_t b = 0; b < nb; b++)
            amxb_unpack(F, w + (p_lo + p) * panel_bytes + (b / gw) * gb, b % gw,
                        codes + (p * nb + b) * 512);
    int32_t cbuf[3][16][16] __attribute__((aligned(64)));
    memset(cbuf, 0, sizeof(cbuf));  /* rows past a short tile's are read, their lanes dropped */
    amx_config cfg;
    int configured = -1;  /* (and on entry: other tiles may have run on this thread) */
    for (int64_t m0 = 0; m0 < M; m0 += 16) {
        const int r = M - m0 < 16 ? (int)(M - m0) : 16;
        if (r != configured) {
            amxb_config(&cfg, r, F == GEMM_Q6KP);
            AMX_CONFIG(hw, &cfg);
            configured = r;
        }
        const uint8_t *rows[16];
        for (int m = 0; m < 16; m++) rows[m] = xq + (m0 + (m < r ? m : r - 1)) * xrow;
        amxb_tables(F, &t, rows, nb);
        amxb_rows(F, hw, &t, q41_x_quants(rows[0], nb, 0), xrow, w + p_lo * panel_bytes,
                  panel_bytes, np, codes, nb, cbuf, acc, isum);
        for (int64_t p = 0; p < np; p++)
            amxb_write(y + m0 * ldy, ldy, acc + 16 * p, r, (p_lo + p) * GEMM_NR, n, bias);
    }
}

int gemm_amx_blocks_takes(int fmt, int64_t M) {
    return gemm_amx_mode != 0 && M >= AMX_BLOCK_MIN_ROWS &&
           (fmt == GEMM_Q80P || fmt == GEMM_Q40P || fmt == GEMM_Q4KP || fmt == GEMM_Q5KP ||
            fmt == GEMM_Q6KP);
}

#define AMXB_FORMATS(HW)                                                                      \
    switch (fmt) {                                                                            \
    case GEMM_Q80P: amxb_range(GEMM_Q80P, HW, y, ldy, xq, w, panel_bytes, k, n, bias, M, p_lo, p_hi); break; \
    case GEMM_Q40P: amxb_range(GEMM_Q40P, HW, y, ldy, xq, w, panel_bytes, k, n, bias, M, p_lo, p_hi); break; \
    case GEMM_Q4KP: amxb_range(GEMM_Q4KP, HW, y, ldy, xq, w, panel_bytes, k, n, bias, M, p_lo, p_hi); break; \
    case GEMM_Q5KP: amxb_range(GEMM_Q5KP, HW, y, ldy, xq, w, panel_bytes, k, n, bias, M, p_lo, p_hi); break; \
    default: amxb_range(GEMM_Q6KP, HW, y, ldy, xq, w, panel_bytes, k, n, bias, M, p_lo, p_hi); break; \
    }

void gemm_amx_blocks_range(float *restrict y, int64_t ldy, const uint8_t *restrict xq,
                           const uint8_t *restrict w, int64_t panel_bytes, int fmt, int64_t k,
                           int64_t n, const float *restrict bias, int64_t M, int64_t p_lo,
                           int64_t p_hi) {
    if (gemm_amx_mode == 1) {
        AMXB_FORMATS(1)
    } else {
        AMXB_FORMATS(0)
    }
}
