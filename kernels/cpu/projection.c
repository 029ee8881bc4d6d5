/*
 * y = x w^T (* scales) (+ bias) on panel-packed weights (gemm.h, dispatched by
 * projection.h) on their own, for the projections run outside the fused decode of
 * llama_decode.c (the LM head, prefill chunks, mixed steps): cpu_gemm.gemm's entry point,
 * for any number of rows.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "projection.h"

/* x [m, k] float32, w [n, k] packed in format fmt (GEMM_*P), scales [n] for the int8 ones,
 * y [m, n], bias [n] or NULL; all contiguous. Returns 0, -1 when out of memory, or -2
 * (computing nothing) for a format code it does not know (proj_format_known: the retired
 * row-major codes 0-4 included). */
int packed_gemm(float *restrict y, const float *restrict x, const void *w,
                const float *scales, int fmt, const float *restrict bias, int64_t m,
                int64_t n, int64_t k, int num_threads) {
    if (!proj_format_known(fmt)) return -2;
    const proj_weight W = {.data = w, .scales = scales, .fmt = fmt};
    /* bf16 pairs (AVX512-BF16), or x quantized for Q4_1 and W8A8 panels. */
    float *buf = proj_needs_buffer(fmt)
                     ? malloc(sizeof(float) * (size_t)proj_buffer_floats(fmt, m, k))
                     : NULL;
    if (proj_needs_buffer(fmt) && buf == NULL) return -1;
    /* Below ~64K weights one thread is done before a second would start (and see
     * parallel.h on entering OpenMP for nothing). */
    if (n * k < 65536 || num_threads < 2) {
        proj_range(y, proj_prepare_x(buf, x, m, k, fmt), &W, bias, m, n, k, 0,
                   gemm_num_panels(n));
    } else {
        proj_claim claims[num_threads];
        memset(claims, 0, sizeof(claims));
        const float *xp = proj_prepare_x(buf, x, m, k, fmt);
        /* x prepared once, shared by the threads. */
#pragma omp parallel num_threads(num_threads)
        proj_shared(y, xp, &W, bias, m, n, k, omp_get_thread_num(), omp_get_num_threads(),
                    claims);
    }
    free(buf);
    return 0;
}
