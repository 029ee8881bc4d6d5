/*
 * The projections' dispatch over panel-packed weights, shared by projection.c (the
 * standalone call, cpu_gemm.gemm) and llama_decode.c (the fused decode):
 * y[m, c] = x[m, :] . w[c, :] (* scale[c]) (+ bias[c]) for x [M, k] float32 and w packed
 * at load into the any-M GEMM's panels (gemm.h: GEMM_F32P, GEMM_BF16P, GEMM_I8P,
 * GEMM_Q41P, GEMM_W8A8P). proj_prepare_x puts x in the form its format reads, proj_range
 * runs a range of panels (gemm_range) and proj_shared splits one product over the threads.
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

#include "gemm.h"
#include "q4_1.h"
#include "w8a8.h"

/* A weight in its packed format; `scales` [n] for the int8 ones, else NULL. */
typedef struct {
    const void *data;
    const float *scales;
    int fmt;
} proj_weight;

/* A format code proj_range reads: a packed one (the row-major codes are retired). */
static inline int proj_format_known(int fmt) { return gemm_is_packed(fmt); }

/* Formats whose x proj_prepare_x rewrites into a buffer. */
static inline int proj_needs_buffer(int fmt) {
    return gemm_is_block(fmt) || fmt == GEMM_W8A8P || gemm_x_is_pairs(fmt);
}

/* Floats of the buffer proj_prepare_x writes x into (the fused decode's are sized by the
 * model's widths: M * max(k) + 16, which holds this for any k >= 5). */
static inline int64_t proj_buffer_floats(int fmt, int64_t M, int64_t k) {
    const int64_t plain = M * k + 16;
    if (fmt != GEMM_W8A8P) return plain;
    const int64_t w8 = (M * w8_x_row_bytes(k) + 3) / 4;
    return w8 > plain ? w8 : plain;
}

/* x [M, k] in the form format `fmt` reads, in buf (proj_buffer_floats) where it differs
 * from x: bf16 pairs where the AVX512-BF16 build's dot-product instruction reads them,
 * quantized per 32-block for the GGUF block formats (q4_1.h) and per row for W8A8 panels (w8a8.h);
 * else the rows themselves. */
static inline const float *proj_prepare_x(float *restrict buf, const float *restrict x,
                                          int64_t M, int64_t k, int fmt) {
#if defined(__AVX512BF16__)
    if (gemm_x_is_pairs(fmt)) {  /* [M, ceil(k / 2)] pairs fit in the [M, k] floats */
        gemm_x_pairs((uint32_t *)buf, x, M, k);
        return buf;
    }
#endif
    if (gemm_is_block(fmt)) {
        q41_prepare_x(buf, x, M, k);
        return buf;
    }
    if (fmt == GEMM_W8A8P) {
        w8_prepare_x(buf, x, M, k);
        return buf;
    }
    return x;
}

/* Panels [lo, hi) of y = x w^T (* scales) (+ bias); x [M, k] as proj_prepare_x leaves it,
 * y [M, n], both contiguous. */
static inline void proj_range(float *restrict y, const float *restrict xp, const proj_weight *W,
                              const float *restrict bias, int64_t M, int64_t n, int64_t k,
                              int64_t lo, int64_t hi) {
    gemm_range(y, n, xp, W->data, W->scales, W->fmt, bias, M, n, k, lo, hi);
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
    const int64_t units = gemm_num_panels(n), chunk = gemm_claim_panels(W->fmt, k);
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
