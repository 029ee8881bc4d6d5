/*
 * A GGUF file's quantized blocks repacked into the packed any-M GEMM's panels (the layout
 * kernels/cpu_blocks.py's docstring defines; its torch `pack_blocks` is the reference and
 * tests/model/test_pack_blocks.py checks these bytes against it for every format).
 *
 * One pass per panel of 16 output rows, panels split across threads: for each group (one
 * file block of each of the panel's 16 rows) every column's block is read once, its fp16
 * fields copied, its scales unpacked straight into the group, and its codes unpacked into a
 * 16 x 256-byte scratch on the stack, from which the group's code chunks are written. Rows
 * at or past n read as a block of zero bytes, as the reference pads them.
 */
#include <stdint.h>
#include <string.h>

#include "gemm.h"

#define PACK_COLS GEMM_NR
#define PACK_MAX_BLOCK 256 /* weights of the largest block (the K-quants') */

/* Bytes of one file block; 0 for a format that is not a GGUF block format. */
static int64_t file_block_bytes(int fmt) {
    switch (fmt) {
    case GEMM_Q41P: return 20;
    case GEMM_Q80P: return 34;
    case GEMM_Q40P: return 18;
    case GEMM_Q4KP: return 144;
    case GEMM_Q5KP: return 176;
    case GEMM_Q6KP: return 210;
    default: return 0;
    }
}

/* Bits per code (8: Q8_0's byte chunks; 5 and 6: nibbles plus bit planes). */
static int code_bits(int fmt) {
    return fmt == GEMM_Q80P ? 8 : fmt == GEMM_Q5KP ? 5 : fmt == GEMM_Q6KP ? 6 : 4;
}

/* Bytes of a group's per-column fields, before its code chunks. */
static int64_t head_bytes(int fmt) {
    switch (fmt) {
    case GEMM_Q41P: return 64;
    case GEMM_Q4KP: case GEMM_Q5KP: return 320;
    case GEMM_Q6KP: return 288;
    default: return 32; /* Q4_0, Q8_0: d only */
    }
}

static inline void put_half(uint8_t *g, int64_t at, int c, const uint8_t *src) {
    g[at + 2 * c] = src[0];
    g[at + 2 * c + 1] = src[1];
}

/* A legacy 32-block (Q4_0, Q4_1, Q8_0) of column c: its fields into group g, codes to q. */
static void legacy_column(int fmt, const uint8_t *b, uint8_t *g, int c, uint8_t *q) {
    put_half(g, 0, c, b);
    if (fmt == GEMM_Q80P) {
        for (int i = 0; i < 32; i++) q[i] = b[2 + i] ^ 0x80;
        return;
    }
    const uint8_t *qs = b + 2;
    if (fmt == GEMM_Q41P) {
        put_half(g, 32, c, b + 2);
        qs = b + 4;
    }
    for (int i = 0; i < 16; i++) {
        q[i] = qs[i] & 0x0F;
        q[16 + i] = qs[i] >> 4;
    }
}

/* A Q4_K / Q5_K block of column c: d, dmin, the 6-bit scales and mins unpacked to bytes
 * (scales [8 sub-blocks][16 columns], mins as gemm_kquant_min_at), codes to q (sub-block s:
 * nibble half s & 1 of qs's 32-byte piece s / 2; Q5_K's bit 4 is bit s of qh[l]). */
static void kquant_column(int fmt, const uint8_t *b, uint8_t *g, int c, uint8_t *q) {
    put_half(g, 0, c, b);
    put_half(g, 32, c, b + 2);
    const uint8_t *s = b + 4;
    for (int w = 0; w < 4; w++) {
        g[64 + 16 * w + c] = s[w] & 63;
        g[gemm_kquant_min_at(w, c)] = s[4 + w] & 63;
        g[64 + 16 * (4 + w) + c] = (uint8_t)((s[8 + w] & 0x0F) | ((s[w] >> 6) << 4));
        g[gemm_kquant_min_at(4 + w, c)] = (uint8_t)((s[8 + w] >> 4) | ((s[4 + w] >> 6) << 4));
    }
    const int five = fmt == GEMM_Q5KP;
    const uint8_t *qs = b + (five ? 48 : 16), *qh = b + 16;
    for (int sub = 0; sub < 8; sub++) {
        const uint8_t *piece = qs + 32 * (sub >> 1);
        const int shift = 4 * (sub & 1);
        for (int l = 0; l < 32; l++) {
            uint8_t v = (uint8_t)((piece[l] >> shift) & 0x0F);
            if (five) v |= (uint8_t)(((qh[l] >> sub) & 1) << 4);
            q[32 * sub + l] = v;
        }
    }
}

/* A Q6_K block of column c (ql [128], qh [64], int8 scales [16], d): d, the 16 scales as
 * [16][16 columns], codes to q (per 128-weight half: pieces of 32 from ql's low nibbles,
 * then its high nibbles; bits 4-5 from qh's bit pair `piece`). */
static void q6k_column(const uint8_t *b, uint8_t *g, int c, uint8_t *q) {
    put_half(g, 0, c, b + 208);
    for (int w = 0; w < 16; w++) g[32 + 16 * w + c] = b[192 + w];
    for (int half = 0; half < 2; half++) {
        const uint8_t *ql = b + 64 * half, *qh = b + 128 + 32 * half;
        for (int piece = 0; piece < 4; piece++) {
            const uint8_t *lo = ql + 32 * (piece & 1);
            const int shift = 4 * (piece >> 1);
            uint8_t *dst = q + 128 * half + 32 * piece;
            for (int l = 0; l < 32; l++)
                dst[l] = (uint8_t)(((lo[l] >> shift) & 0x0F) | (((qh[l] >> (2 * piece)) & 3) << 4));
        }
    }
}

/* One 32-block's codes of the 16 columns (column c's at q + c * PACK_MAX_BLOCK) -> its
 * chunks at dst: byte chunks (bits 8), else nibble chunks then Q5_K's bit-4 plane or
 * Q6_K's two planes of bit pairs. */
static void code_chunks(uint8_t *dst, const uint8_t *q, int bits) {
    if (bits == 8) {
        for (int j = 0; j < 4; j++)
            for (int h = 0; h < 2; h++)
                for (int c = 0; c < PACK_COLS; c++) {
                    const uint8_t *col = q + c * PACK_MAX_BLOCK + 16 * h + 4 * j;
                    memcpy(dst + 128 * j + 64 * h + 4 * c, col, 4);
                }
        return;
    }
    for (int j = 0; j < 4; j++)
        for (int c = 0; c < PACK_COLS; c++) {
            const uint8_t *col = q + c * PACK_MAX_BLOCK + 4 * j;
            for (int t = 0; t < 4; t++)
                dst[64 * j + 4 * c + t] = (uint8_t)((col[t] & 0x0F) | (col[16 + t] << 4));
        }
    if (bits == 6) { /* a plane of bit pairs per half (cpu_blocks.py's docstring) */
        for (int h = 0; h < 2; h++)
            for (int c = 0; c < PACK_COLS; c++) {
                const uint8_t *col = q + c * PACK_MAX_BLOCK + 16 * h;
                for (int t = 0; t < 4; t++) {
                    unsigned v = 0;
                    for (int j = 0; j < 4; j++) v |= ((col[4 * j + t] >> 4) & 3u) << (2 * j);
                    dst[256 + 64 * h + 4 * c + t] = (uint8_t)v;
                }
            }
        return;
    }
    for (int bit = 4; bit < bits; bit++) {
        uint8_t *plane = dst + 256 + 64 * (bit - 4);
        for (int c = 0; c < PACK_COLS; c++) {
            const uint8_t *col = q + c * PACK_MAX_BLOCK;
            for (int t = 0; t < 4; t++) {
                unsigned v = 0;
                for (int j = 0; j < 4; j++)
                    v |= ((col[4 * j + t] >> bit) & 1u) << (2 * j)
                         | ((col[16 + 4 * j + t] >> bit) & 1u) << (2 * j + 1);
                plane[4 * c + t] = (uint8_t)v;
            }
        }
    }
}

/* Panel p: rows 16 p .. 16 p + 15 of blocks [n, groups * block bytes] -> its groups. */
static void pack_panel(uint8_t *out, const uint8_t *blocks, int64_t n, int64_t groups,
                       int fmt, int64_t p) {
    static const uint8_t zero_block[PACK_MAX_BLOCK] = {0};
    const int64_t bb = file_block_bytes(fmt), row_bytes = groups * bb;
    const int64_t gb = gemm_group_bytes(fmt), hb = head_bytes(fmt);
    const int bits = code_bits(fmt), subs = (int)(gemm_block_weights(fmt) / 32);
    const int64_t chunk = bits == 8 ? 512 : 256 + 64 * (bits - 4);
    uint8_t q[PACK_COLS * PACK_MAX_BLOCK];
    for (int64_t grp = 0; grp < groups; grp++) {
        uint8_t *g = out + (p * groups + grp) * gb;
        for (int c = 0; c < PACK_COLS; c++) {
            const int64_t row = p * PACK_COLS + c;
            const uint8_t *b = row < n ? blocks + row * row_bytes + grp * bb : zero_block;
            uint8_t *qc = q + c * PACK_MAX_BLOCK;
            if (fmt == GEMM_Q6KP) q6k_column(b, g, c, qc);
            else if (fmt == GEMM_Q4KP || fmt == GEMM_Q5KP) kquant_column(fmt, b, g, c, qc);
            else legacy_column(fmt, b, g, c, qc);
        }
        for (int s = 0; s < subs; s++) code_chunks(g + hb + s * chunk, q + 32 * s, bits);
    }
}

/*
 * out (packed panels, gemm_num_panels(n) * gemm_panel_bytes(fmt, k) bytes) <- blocks
 * uint8 [n, k / block weights * block bytes], a GGUF's blocks of format fmt (GEMM_Q41P,
 * GEMM_Q80P .. GEMM_Q6KP) in row order. Returns 0, or -2 (nothing written) for a format it
 * does not pack or a k that does not divide into its blocks.
 */
int pack_gguf_blocks(uint8_t *out, const uint8_t *blocks, int64_t n, int64_t k, int fmt,
                     int num_threads) {
    if (file_block_bytes(fmt) == 0 || k <= 0 || n < 0 || k % gemm_block_weights(fmt)) return -2;
    const int64_t groups = k / gemm_block_weights(fmt), panels = gemm_num_panels(n);
    if (num_threads < 1) num_threads = 1;
    if (panels < 2 || num_threads == 1) { /* not through OpenMP at all: parallel.h says why */
        for (int64_t p = 0; p < panels; p++) pack_panel(out, blocks, n, groups, fmt, p);
        return 0;
    }
    /* A panel at a time: a thread the OS has descheduled (a load runs the tokenizer's
     * thread beside this) leaves the others its share instead of a wait at the barrier. */
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1)
    for (int64_t p = 0; p < panels; p++) pack_panel(out, blocks, n, groups, fmt, p);
    return 0;
}
