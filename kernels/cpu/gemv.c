/*
 * y = x w^T (+ bias) for a few rows of x, float32: the kernel of gemv.h on its own, for the
 * projections `linear` runs outside the fused decode of llama_decode.c (the LM head, and
 * few-row steps that are not pure decode).
 */
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "gemv.h"

/* x [m, k], w [n, k], y [m, n], bias [n] or NULL; all contiguous. */
void gemv_f32(float *restrict y, const float *restrict x, const float *restrict w,
              const float *restrict bias, int64_t m, int64_t n, int64_t k, int num_threads) {
    /* Below ~64K weights (256 KB) one thread is done before a second would start (and see
     * parallel.h on entering OpenMP for nothing). */
    if (n * k < 65536 || num_threads < 2) {
        gemv_range(y, x, w, bias, m, n, k, 0, n);
        return;
    }
    gemv_claim claims[num_threads];
    memset(claims, 0, sizeof(claims));
#pragma omp parallel num_threads(num_threads)
    gemv_shared(y, x, w, bias, m, n, k, omp_get_thread_num(), omp_get_num_threads(), claims);
}
