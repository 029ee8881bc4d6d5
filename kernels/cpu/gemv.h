/*
 * Few-row matrix-vector products, float32: y[m, r] = dot(w[r, :], x[m, :]) (+ bias[r]) for
 * x [M, k] with M of 1 to 4 (decode of a few requests), w [n, k] row-major (a torch Linear
 * weight).
 *
 * Decode on the CPU is bound by streaming the weights from memory, so the loop is written
 * for that: each thread walks its own contiguous range of weight rows one row at a time
 * (one sequential stream; interleaving 2-4 rows ran at 22-24 GB/s against 32 here) with
 * enough independent 8-wide accumulators to keep FMA latency out of the way. Over
 * SmolLM2-135M's layer weights on 2 EPYC cores this streams at 32 GB/s where a `sum()`
 * reads 34 and MKL's gemv 29 (42-45 vs 51-53 and 36-37 in the machine's faster phase).
 * GCC/Clang vector extensions rather than intrinsics: the same code on any target.
 */
#ifndef AIOENGINE_GEMV_H
#define AIOENGINE_GEMV_H

#include <stdint.h>

typedef float v8f __attribute__((vector_size(32), aligned(4)));

static inline float hsum_v8f(v8f v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

/* Rows [lo, hi) for M rows of x (a constant after inlining), A accumulators per x row:
 * M * A independent FMA chains per 8 * A weights. */
static inline __attribute__((always_inline)) void gemv_rows(
    float *restrict y, int64_t y_stride, const float *restrict x, const float *restrict w,
    const float *restrict bias, int64_t lo, int64_t hi, int64_t k, const int M, const int A) {
    const int64_t step = 8 * A, k_vec = k - k % step;
    for (int64_t r = lo; r < hi; r++) {
        const float *wr = w + r * k;
        v8f acc[M][A];
        for (int m = 0; m < M; m++)
            for (int a = 0; a < A; a++) acc[m][a] = (v8f){0};
        for (int64_t d = 0; d < k_vec; d += step)
            for (int a = 0; a < A; a++) {
                const v8f wv = *(const v8f *)(wr + d + 8 * a);
                for (int m = 0; m < M; m++)
                    acc[m][a] += wv * *(const v8f *)(x + m * k + d + 8 * a);
            }
        const float b = bias ? bias[r] : 0.0f;
        for (int m = 0; m < M; m++) {
            v8f sum = acc[m][0];
            for (int a = 1; a < A; a++) sum += acc[m][a];
            float s = hsum_v8f(sum);
            for (int64_t d = k_vec; d < k; d++) s += wr[d] * x[m * k + d];
            y[m * y_stride + r] = s + b;
        }
    }
}

/* Rows [lo, hi) of y = x w^T (+ bias); x [M, k], y [M, n], both contiguous; more than 4
 * rows of x go 4 at a time. */
static inline void gemv_range(float *restrict y, const float *restrict x,
                              const float *restrict w, const float *restrict bias, int64_t M,
                              int64_t n, int64_t k, int64_t lo, int64_t hi) {
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
        float *ym = y + m0 * n;
        const float *xm = x + m0 * k;
        switch (M - m0) {
        case 1: gemv_rows(ym, n, xm, w, bias, lo, hi, k, 1, 4); break;
        case 2: gemv_rows(ym, n, xm, w, bias, lo, hi, k, 2, 4); break;
        case 3: gemv_rows(ym, n, xm, w, bias, lo, hi, k, 3, 2); break;
        default: gemv_rows(ym, n, xm, w, bias, lo, hi, k, 4, 2); break;
        }
    }
}

/* A claim counter for gemv_shared, padded to 64 bytes: two counters of an array are never
 * on one cache line, whatever the array's alignment. */
typedef struct {
    int64_t next;
    char pad[56];
} gemv_claim;

/* Rows per claim: ~64 KB of weights. */
#define GEMV_CLAIM_BYTES 65536

/* y = x w^T (+ bias) by all num_threads threads together, each calling this: every thread
 * starts on its own contiguous range (n / num_threads rows), taking ~64 KB of rows at a time, then
 * takes what is left of the others' ranges. A thread the OS preempts (the engine's event
 * loop shares these cores) then delays the product by a chunk, not by its whole share.
 * `claims` [num_threads], zeroed, used for this product only. */
static inline void gemv_shared(float *restrict y, const float *restrict x,
                               const float *restrict w, const float *restrict bias, int64_t M,
                               int64_t n, int64_t k, int tid, int num_threads,
                               gemv_claim *claims) {
    int64_t chunk = GEMV_CLAIM_BYTES / ((int64_t)sizeof(float) * k);
    chunk = chunk > 0 ? chunk : 1;
    for (int i = 0; i < num_threads; i++) {
        const int r = (tid + i) % num_threads;
        const int64_t lo = n * r / num_threads, hi = n * (r + 1) / num_threads;
        for (;;) {
            const int64_t start = lo + chunk * __atomic_fetch_add(&claims[r].next, 1,
                                                                  __ATOMIC_RELAXED);
            if (start >= hi) break;
            gemv_range(y, x, w, bias, M, n, k, start, start + chunk < hi ? start + chunk : hi);
        }
    }
}

#endif /* AIOENGINE_GEMV_H */
