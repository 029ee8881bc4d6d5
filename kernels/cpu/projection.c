/*
 * y = x w^T (* scales) (+ bias) on panel-packed weights (gemm.h, dispatched by
 * projection.h) on their own, for the projections run outside the fused decode of
 * llama_decode.c (the LM head, prefill chunks, mixed steps): cpu_gemm.gemm's and
 * cpu_blocks.gemm's entry points, for any number of rows.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "projection.h"

/* x [m, k] float32, W [n, k] a weight of parts (decode_layer.h's proj_weight), y [m, n],
 * bias [n] or NULL; all contiguous. x is prepared once for every part, each part written
 * into its columns of y. Returns 0, -1 when out of memory, or -2 (computing nothing) for a
 * weight proj_weight_ok refuses (a format code it does not know, the retired row-major
 * codes 0-4 included; parts reading x in different forms; rows not adding up to n). */
int packed_gemm_parts(float *restrict y, const float *restrict x, const proj_weight *W,
                      const float *restrict bias, int64_t m, int64_t n, int64_t k,
                      int num_threads) {
    if (!proj_weight_ok(W, n)) return -2;
    /* bf16 pairs (AVX512-BF16), or x quantized for the block and W8A8 panels. */
    const int needs_buffer = proj_x_form(W->parts[0].fmt) != 0;
    float *buf = needs_buffer
                     ? malloc(sizeof(float) * (size_t)proj_buffer_floats(W->parts[0].fmt, m, k))
                     : NULL;
    if (needs_buffer && buf == NULL) return -1;
    const float *xp = proj_prepare_x(buf, x, m, k, W);
    /* Below ~64K weights one thread is done before a second would start (and see
     * parallel.h on entering OpenMP for nothing). */
    if (n * k < 65536 || num_threads < 2) {
        proj_range(y, xp, W, bias, m, n, k, 0, gemm_num_panels(n));
    } else {
        proj_claim claims[num_threads];
        memset(claims, 0, sizeof(claims));
        /* x prepared once, shared by the threads. */
#pragma omp parallel num_threads(num_threads)
        proj_shared(y, xp, W, bias, m, n, k, omp_get_thread_num(), omp_get_num_threads(),
                    claims);
    }
    free(buf);
    return 0;
}

/* One part: packed_gemm_parts with w in format fmt, scales [n] for the int8 ones. */
int packed_gemm(float *restrict y, const float *restrict x, const void *w,
                const float *scales, int fmt, const float *restrict bias, int64_t m,
                int64_t n, int64_t k, int num_threads) {
    const proj_weight W = {
        .parts = {{.data = w, .scales = scales, .rows = n, .fmt = fmt}}, .num_parts = 1};
    return packed_gemm_parts(y, x, &W, bias, m, n, k, num_threads);
}
