/*
 * The projections' dispatch over panel-packed weights, shared by projection.c (the
 * standalone call, cpu_gemm.gemm) and llama_decode.c (the fused decode):
 * y[m, c] = x[m, :] . w[c, :] (* scale[c]) (+ bias[c]) for x [M, k] float32 and w packed
 * at load into the any-M GEMM's panels (gemm.h: GEMM_F32P, GEMM_BF16P, GEMM_I8P,
 * GEMM_W8A8P, the GGUF block formats GEMM_Q41P and GEMM_Q80P..GEMM_Q6KP). A weight is
 * decode_layer.h's proj_weight: one part, or up to PROJ_MAX_PARTS parts of different
 * formats reading x in one form (a Q4_K_M file's q/k/v). proj_prepare_x puts x in that
 * form once, proj_range runs a range of the weight's panels (gemm_range, part by part,
 * each into its columns of y) and proj_shared splits one product over the threads.
 *
 * Codes 0-4 are retired: the row-major float32, bf16, int8 weight-only (0-2), W8A8 (3) and
 * Q4_1 (4) gemvs this header held when it was gemv.h. With the kernels built the loader
 * packs every weight they read (Linear.pack), so those loops ran only for weights a test
 * left unpacked; an unpacked weight takes the torch path (layers.linear) and the fused
 * decode declines it. Never passed, never reused: packed_gemm() returns -2 for them.
 */
#ifndef AIOENGINE_PROJECTION_H
#define AIOENGINE_PROJECTION_H

#include <stdint.h>

#include "decode_layer.h"
#include "gemm.h"
#include "q4_1.h"
#include "w8a8.h"

/* A format code proj_range reads: a packed one (the row-major codes are retired). */
static inline int proj_format_known(int fmt) { return gemm_is_packed(fmt); }

/* The form in which format fmt reads x: 0 float32 rows, 1 bf16 pairs (the AVX512-BF16
 * build's bf16), 2 int8 per 32-block (Q4_1, Q8_0, Q4_0: q41_prepare_x), 3 int8 per row
 * (W8A8), 4 int8 per 256 (the K-quants). The parts of one weight share it: x is prepared
 * once per projection. */
static inline int proj_x_form(int fmt) {
    if (gemm_x_is_pairs(fmt)) return 1;
    if (gemm_is_kquant(fmt)) return 4;
    if (gemm_is_block(fmt)) return 2;
    return fmt == GEMM_W8A8P ? 3 : 0;
}

/* Whether W is a weight [n, .] proj_range reads: 1..PROJ_MAX_PARTS parts in known formats
 * reading x in one form, every part but the last whole panels, their rows adding up to n. */
static inline int proj_weight_ok(const proj_weight *W, int64_t n) {
    if (W->num_parts < 1 || W->num_parts > PROJ_MAX_PARTS) return 0;
    int64_t rows = 0;
    for (int64_t j = 0; j < W->num_parts; j++) {
        const proj_part *p = &W->parts[j];
        if (!proj_format_known(p->fmt) || p->data == NULL || p->rows < 1 ||
            proj_x_form(p->fmt) != proj_x_form(W->parts[0].fmt) ||
            (j + 1 < W->num_parts && p->rows % GEMM_NR != 0))
            return 0;
        rows += p->rows;
    }
    return rows == n;
}

/* Floats of the buffer proj_prepare_x writes x [M, k] into for format fmt (the fused
 * decode's are sized by the model's widths and the step's formats). */
static inline int64_t proj_buffer_floats(int fmt, int64_t M, int64_t k) {
    const int64_t plain = M * k + 16;
    if (gemm_x_is_pairs(fmt)) {
        const int64_t pairs = M * gemm_x_pair_stride(k) + 16;
        return pairs > plain ? pairs : plain;
    }
    if (fmt != GEMM_W8A8P) return plain;
    const int64_t w8 = (M * w8_x_row_bytes(k) + 3) / 4;
    return w8 > plain ? w8 : plain;
}

/* x [M, k] in the form W's parts read (proj_x_form), in buf (proj_buffer_floats) where it
 * differs from x: bf16 pairs where the AVX512-BF16 build's dot-product instruction or AMX
 * tiles read them, quantized per 32 or 256 for the GGUF block formats (q4_1.h) and per row for W8A8
 * panels (w8a8.h); else the rows themselves. */
static inline const float *proj_prepare_x(float *restrict buf, const float *restrict x,
                                          int64_t M, int64_t k, const proj_weight *W) {
    switch (proj_x_form(W->parts[0].fmt)) {
    case 1:  /* [M, gemm_x_pair_stride(k)] pairs (proj_buffer_floats) */
        gemm_x_pairs((uint32_t *)buf, x, M, k);
        return buf;
    case 2:
        q41_prepare_x(buf, x, M, k, 32);
        return buf;
    case 4:
        q41_prepare_x(buf, x, M, k, 256);
        return buf;
    case 3:
        w8_prepare_x(buf, x, M, k);
        return buf;
    default:
        return x;
    }
}

/* Bytes of one row of x as proj_prepare_x leaves it for W (rows of any count from any row
 * on are prepared alike: every form is per row). */
static inline int64_t proj_x_row_bytes(const proj_weight *W, int64_t k) {
    switch (proj_x_form(W->parts[0].fmt)) {
    case 1: return 4 * gemm_x_pair_stride(k);
    case 2: case 4: return q41_x_row_bytes(k);
    case 3: return w8_x_row_bytes(k);
    default: return 4 * k;
    }
}

/* Panels [lo, hi) of y = x w^T (* scales) (+ bias) over W's parts (proj_weight_ok); x [M,
 * k] as proj_prepare_x leaves it, y [M, n], both contiguous. A panel of part j is written
 * into part j's columns of y (row stride n); its bias is bias's slice for them. */
static inline void proj_range(float *restrict y, const float *restrict xp, const proj_weight *W,
                              const float *restrict bias, int64_t M, int64_t n, int64_t k,
                              int64_t lo, int64_t hi) {
    int64_t first = 0;  /* part j's first panel */
    for (int64_t j = 0; j < W->num_parts && first < hi; j++) {
        const proj_part *p = &W->parts[j];
        const int64_t panels = gemm_num_panels(p->rows);
        const int64_t a = lo > first ? lo : first, b = hi < first + panels ? hi : first + panels;
        if (a < b) {
            const int64_t col = first * GEMM_NR;
            gemm_range(y + col, n, xp, p->data, p->scales, p->fmt,
                       bias == NULL ? NULL : bias + col, M, p->rows, k, a - first, b - first);
        }
        first += panels;
    }
}

/* Panels per claim of proj_shared over W: ~64 KB of its widest part's panels. */
static inline int64_t proj_claim_panels(const proj_weight *W, int64_t k) {
    int64_t chunk = gemm_claim_panels(W->parts[0].fmt, k);
    for (int64_t j = 1; j < W->num_parts; j++) {
        const int64_t c = gemm_claim_panels(W->parts[j].fmt, k);
        chunk = c < chunk ? c : chunk;
    }
    return chunk;
}

/* A claim counter for proj_shared, padded to 64 bytes: two counters of an array are never
 * on one cache line, whatever the array's alignment. */
typedef struct {
    int64_t next;
    char pad[56];
} proj_claim;

/* y = x w^T (+ bias) by all num_threads threads together, each calling this with x as
 * proj_prepare_x left it: every thread starts on its own contiguous range of panels (in
 * whole groups of 4), taking ~64 KB of them at a time (gemm_claim_panels), then takes what
 * is left of the others' ranges. A thread the OS preempts (the engine's event loop shares
 * these cores) then delays the product by a claim, not by its whole share. `claims`
 * [num_threads], zeroed, used for this product only. */
static inline void proj_shared(float *restrict y, const float *restrict xp, const proj_weight *W,
                               const float *restrict bias, int64_t M, int64_t n, int64_t k,
                               int tid, int num_threads, proj_claim *claims) {
    const int64_t units = gemm_num_panels(n), chunk = proj_claim_panels(W, k);
    for (int i = 0; i < num_threads; i++) {
        const int r = (tid + i) % num_threads;
        const int64_t lo = units * r / num_threads / 4 * 4;
        const int64_t hi = r + 1 == num_threads ? units : units * (r + 1) / num_threads / 4 * 4;
        for (;;) {
            const int64_t start = lo + chunk * __atomic_fetch_add(&claims[r].next, 1,
                                                                  __ATOMIC_RELAXED);
            if (start >= hi) break;
            proj_range(y, xp, W, bias, M, n, k, start, start + chunk < hi ? start + chunk : hi);
        }
    }
}

#endif /* AIOENGINE_PROJECTION_H */
