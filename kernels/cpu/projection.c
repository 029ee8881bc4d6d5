/*
 * y = x w^T (* scales) (+ bias) on panel-packed weights (gemm.h, dispatched by
 * projection.h) on their own, for the projections run outside the fused decode of
 * llama_decode.c (the LM head, prefill chunks, mixed steps): cpu_gemm.gemm's and
 * cpu_blocks.gemm's entry points, for any number of rows.
 */
#include <omp.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "projection.h"

static pthread_key_t x_buffer_key;
static pthread_once_t x_buffer_once = PTHREAD_ONCE_INIT;

static void x_buffer_key_init(void) { pthread_key_create(&x_buffer_key, free); }

/* The calling thread's buffer for x as the weight reads it, at least `bytes`, kept from
 * call to call (freed with the thread): a fresh one each call was a fresh mapping for a
 * prefill chunk's x, whose pages faulted in every time. On a cache line: AMX reads x's
 * rows as tiles of 64-byte rows, and one split over two lines cost a third of the speed
 * (malloc's large blocks sit 16 bytes into a page). NULL when out of memory. */
static float *x_buffer(size_t bytes) {
    typedef struct { size_t bytes; float *data; } x_buf;
    pthread_once(&x_buffer_once, x_buffer_key_init);
    x_buf *b = pthread_getspecific(x_buffer_key);
    if (b != NULL && b->bytes >= bytes) return b->data;
    const size_t want = (bytes + 63) / 64 * 64;
    x_buf *grown = aligned_alloc(64, 64 + want);  /* the header, then the data */
    if (grown == NULL) return NULL;
    grown->bytes = want;
    grown->data = (float *)((char *)grown + 64);
    free(b);
    pthread_setspecific(x_buffer_key, grown);
    return grown->data;
}

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
        ? x_buffer(sizeof(float) * (size_t)proj_buffer_floats(W->parts[0].fmt, m, k))
        : NULL;
    if (needs_buffer && buf == NULL) return -1;
    /* Below ~64K weights one thread is done before a second would start (and see
     * parallel.h on entering OpenMP for nothing). */
    if (n * k < 65536 || num_threads < 2) {
        proj_range(y, proj_prepare_x(buf, x, m, k, W), W, bias, m, n, k, 0,
                   gemm_num_panels(n));
        return 0;
    }
    proj_claim claims[num_threads];
    memset(claims, 0, sizeof(claims));
    const float *xp = needs_buffer ? buf : x;
    const int64_t row_bytes = proj_x_row_bytes(W, k);
#pragma omp parallel num_threads(num_threads)
    {
        /* x prepared once, 16 rows a task, then shared by the threads. */
        if (needs_buffer) {
#pragma omp for schedule(static)
            for (int64_t r0 = 0; r0 < m; r0 += 16)
                proj_prepare_x((float *)((char *)buf + r0 * row_bytes), x + r0 * k,
                               m - r0 < 16 ? m - r0 : 16, k, W);
        }  /* (the loop's barrier: all of x before any product) */
        proj_shared(y, xp, W, bias, m, n, k, omp_get_thread_num(), omp_get_num_threads(),
                    claims);
    }
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
