/*
 * Few-row matrix-vector products: y[m, r] = dot(w[r, :], x[m, :]) (* scale[r]) (+ bias[r])
 * for x [M, k] float32 with M of 1 to 4 at a time (decode of a few requests), w [n, k]
 * row-major (a torch Linear weight) in one of three storage formats:
 *
 *   GEMV_F32   float32
 *   GEMV_BF16  bfloat16; x is rounded to bf16 first and y to bf16 at the end, so that a
 *              decode step computes what the large-batch path (oneDNN's bf16 matmul: bf16
 *              inputs, fp32 accumulation, a bf16 result) computes, up to summation order
 *   GEMV_I8    int8 with one float32 scale per output row, weight-only: x stays float32,
 *              y = (x . q_r) * scale[r]
 *
 * W8A8 and a GGUF's Q4_1 blocks have no row-major form here: every such weight is packed
 * at load into the any-M GEMM's panels (gemm.h: GEMM_W8A8P, GEMM_Q41P), which
 * gemv_prepare_x / gemv_range / gemv_shared hand on to it. Codes 3 (row-major W8A8) and 4
 * (row-major Q4_1) are retired: never passed, never reused.
 *
 * Decode on the CPU is bound by streaming the weights from memory, so the loop is written
 * for that: each thread walks its own contiguous range of weight rows one row at a time
 * (one sequential stream; interleaving 2-4 rows ran at 22-24 GB/s against 32 here) with
 * enough independent 8-wide accumulators to keep FMA latency out of the way. Over
 * SmolLM2-135M's layer weights on 2 EPYC cores the float32 form streams at 32 GB/s where a
 * `sum()` reads 34 and MKL's gemv 29 (42-45 vs 51-53 and 36-37 in the machine's faster
 * phase). GCC/Clang vector extensions rather than intrinsics: the same code on any target
 * (kernels/cpu.py builds it once per instruction set and picks one at run time); bf16 and
 * int8 widen to float32 in registers, which still halves or quarters the bytes read. Where
 * the build targets AVX512-BF16, bf16 rows use its dot-product instruction instead.
 */
#ifndef AIOENGINE_GEMV_H
#define AIOENGINE_GEMV_H

#include <stdint.h>
#include <string.h>

#include "gemm.h"
#include "q4_1.h"
#include "vec_math.h"
#include "w8a8.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define GEMV_DPBF16 1
#endif

/* 3 and 4 retired (row-major W8A8 and Q4_1, see above); the GEMM_*P codes start at 5. */
enum { GEMV_F32 = 0, GEMV_BF16 = 1, GEMV_I8 = 2 };

/* A weight in its storage format; `scales` [n] for the int8 ones, else NULL. */
typedef struct {
    const void *data;
    const float *scales;
    int fmt;
} gemv_weight;

typedef float v8f __attribute__((vector_size(32), aligned(4)));
typedef uint32_t v8u __attribute__((vector_size(32), aligned(4)));
typedef int32_t v8i __attribute__((vector_size(32), aligned(4)));
typedef uint16_t v8h __attribute__((vector_size(16), aligned(2)));
typedef int8_t v8b __attribute__((vector_size(8), aligned(1)));

/* A format code gemv_range reads: row-major (not the retired 3 and 4) or packed. */
static inline int gemv_format_known(int fmt) {
    return fmt == GEMV_F32 || fmt == GEMV_BF16 || fmt == GEMV_I8 || gemm_is_packed(fmt);
}

static inline float hsum_v8f(v8f v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

/* Bytes of one row-major weight row of k elements. */
static inline int64_t gemv_row_bytes(int fmt, int64_t k) {
    return fmt == GEMV_F32 ? 4 * k : fmt == GEMV_BF16 ? 2 * k : k;
}

/* Formats whose x gemv_prepare_x rewrites into a buffer. */
static inline int gemv_needs_buffer(int fmt) {
    return fmt == GEMV_BF16 || fmt == GEMM_Q41P || fmt == GEMM_W8A8P || gemm_x_is_pairs(fmt);
}

/* Floats of the buffer gemv_prepare_x writes x into (the fused decode's are sized by the
 * model's widths: M * max(k) + 16, which holds this for any k >= 5). */
static inline int64_t gemv_buffer_floats(int fmt, int64_t M, int64_t k) {
    const int64_t plain = M * k + 16;
    if (fmt != GEMM_W8A8P) return plain;
    const int64_t w8 = (M * w8_x_row_bytes(k) + 3) / 4;
    return w8 > plain ? w8 : plain;
}

/* bf16 <-> float32: vec_math.h's f32_to_bf16 and bf16_to_f32. */
static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

/* 8 weights of row `wr` from element d on, as float32. */
static inline __attribute__((always_inline)) v8f load_w8(const void *wr, int64_t d, const int F) {
    if (F == GEMV_F32) return *(const v8f *)((const float *)wr + d);
    if (F == GEMV_BF16) {
        const v8u u = __builtin_convertvector(*(const v8h *)((const uint16_t *)wr + d), v8u) << 16;
        return (v8f)u;
    }
#if defined(__AVX2__)
    /* GCC scalarises the generic char -> int conversion (8 movsbl): 5.7 GB/s. */
    const __m128i b = _mm_loadl_epi64((const __m128i *)((const int8_t *)wr + d));
    return (v8f)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
#else
    return __builtin_convertvector(__builtin_convertvector(*(const v8b *)((const int8_t *)wr + d), v8i), v8f);
#endif
}

static inline __attribute__((always_inline)) float load_w1(const void *wr, int64_t d, const int F) {
    if (F == GEMV_F32) return ((const float *)wr)[d];
    if (F == GEMV_BF16) return bf16_to_f32(((const uint16_t *)wr)[d]);
    return (float)((const int8_t *)wr)[d];
}

/* Rows [lo, hi) for M rows of x (a constant after inlining), A accumulators per x row:
 * M * A independent FMA chains per 8 * A weights. x is the row data as the format wants
 * it (bf16-rounded for GEMV_BF16). */
static inline __attribute__((always_inline)) void gemv_rows(
    float *restrict y, int64_t y_stride, const float *restrict x, const gemv_weight *W,
    const float *restrict bias, int64_t lo, int64_t hi, int64_t k, const int M, const int A,
    const int F) {
    const int64_t step = 8 * A, k_vec = k - k % step, row_bytes = gemv_row_bytes(F, k);
    for (int64_t r = lo; r < hi; r++) {
        const void *wr = (const char *)W->data + r * row_bytes;
        v8f acc[M][A];
        for (int m = 0; m < M; m++)
            for (int a = 0; a < A; a++) acc[m][a] = (v8f){0};
        for (int64_t d = 0; d < k_vec; d += step)
            for (int a = 0; a < A; a++) {
                const v8f wv = load_w8(wr, d + 8 * a, F);
                for (int m = 0; m < M; m++)
                    acc[m][a] += wv * *(const v8f *)(x + m * k + d + 8 * a);
            }
        const float b = bias ? bias[r] : 0.0f, s = F == GEMV_I8 ? W->scales[r] : 1.0f;
        for (int m = 0; m < M; m++) {
            v8f sum = acc[m][0];
            for (int a = 1; a < A; a++) sum += acc[m][a];
            float t = hsum_v8f(sum);
            for (int64_t d = k_vec; d < k; d++) t += load_w1(wr, d, F) * x[m * k + d];
            t = t * s + b;
            y[m * y_stride + r] = F == GEMV_BF16 ? round_bf16(t) : t;
        }
    }
}

#ifdef GEMV_DPBF16
/* GEMV_BF16 rows with AVX512-BF16's dot product: 32 bf16 pairs a step, x packed to bf16
 * (xb [M, k]). Same arithmetic as gemv_rows (exact bf16 products, float32 sums). */
static inline __attribute__((always_inline)) void gemv_rows_dpbf16(
    float *restrict y, int64_t y_stride, const uint16_t *restrict xb, const gemv_weight *W,
    const float *restrict bias, int64_t lo, int64_t hi, int64_t k, const int M, const int A) {
    const int64_t step = 32 * A, k_vec = k - k % step;
    for (int64_t r = lo; r < hi; r++) {
        const uint16_t *wr = (const uint16_t *)W->data + r * k;
        __m512 acc[M][A];
        for (int m = 0; m < M; m++)
            for (int a = 0; a < A; a++) acc[m][a] = _mm512_setzero_ps();
        for (int64_t d = 0; d < k_vec; d += step)
            for (int a = 0; a < A; a++) {
                const __m512bh wv = (__m512bh)_mm512_loadu_si512(wr + d + 32 * a);
                for (int m = 0; m < M; m++)
                    acc[m][a] = _mm512_dpbf16_ps(
                        acc[m][a], (__m512bh)_mm512_loadu_si512(xb + m * k + d + 32 * a), wv);
            }
        const float b = bias ? bias[r] : 0.0f;
        for (int m = 0; m < M; m++) {
            __m512 sum = acc[m][0];
            for (int a = 1; a < A; a++) sum = _mm512_add_ps(sum, acc[m][a]);
            float t = _mm512_reduce_add_ps(sum);
            for (int64_t d = k_vec; d < k; d++) t += bf16_to_f32(wr[d]) * bf16_to_f32(xb[m * k + d]);
            y[m * y_stride + r] = round_bf16(t + b);
        }
    }
}
#endif

/* x [M, k] in the form format `fmt` reads, in buf (gemv_buffer_floats) where it differs
 * from x: the rows themselves for float32 and int8 weight-only, rounded to bf16 for GEMV_BF16
 * (packed to bf16 where the dot-product instruction reads them), quantized per 32-block for
 * Q4_1 panels (q4_1.h) and per row for W8A8 panels (w8a8.h). */
static inline const float *gemv_prepare_x(float *restrict buf, const float *restrict x,
                                          int64_t M, int64_t k, int fmt) {
#if defined(__AVX512BF16__)
    if (gemm_x_is_pairs(fmt)) {  /* [M, ceil(k / 2)] pairs fit in the [M, k] floats */
        gemm_x_pairs((uint32_t *)buf, x, M, k);
        return buf;
    }
#endif
    if (fmt == GEMM_Q41P) {
        q41_prepare_x(buf, x, M, k);
        return buf;
    }
    if (fmt == GEMM_W8A8P) {
        w8_prepare_x(buf, x, M, k);
        return buf;
    }
    if (fmt != GEMV_BF16) return x;
#ifdef GEMV_DPBF16
    uint16_t *xb = (uint16_t *)buf;
    for (int64_t i = 0; i < M * k; i++) xb[i] = f32_to_bf16(x[i]);
#else
    for (int64_t i = 0; i < M * k; i++) buf[i] = round_bf16(x[i]);
#endif
    return buf;
}

#define GEMV_CASES(F)                                                                       \
    switch (m4) {                                                                          \
    case 1: gemv_rows(ym, n, xm, W, bias, lo, hi, k, 1, 4, F); break;                      \
    case 2: gemv_rows(ym, n, xm, W, bias, lo, hi, k, 2, 4, F); break;                      \
    case 3: gemv_rows(ym, n, xm, W, bias, lo, hi, k, 3, 2, F); break;                      \
    default: gemv_rows(ym, n, xm, W, bias, lo, hi, k, 4, 2, F); break;                     \
    }

/* Rows [lo, hi) of y = x w^T (+ bias); x [M, k] as gemv_prepare_x leaves it, y [M, n],
 * both contiguous; more than 4 rows of x go 4 at a time. */
static inline void gemv_range(float *restrict y, const float *restrict xp, const gemv_weight *W,
                              const float *restrict bias, int64_t M, int64_t n, int64_t k,
                              int64_t lo, int64_t hi) {
    if (gemm_is_packed(W->fmt)) {  /* lo, hi: panels */
        gemm_range(y, n, xp, W->data, W->scales, W->fmt, bias, M, n, k, lo, hi);
        return;
    }
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
        float *ym = y + m0 * n;
        const int64_t m4 = M - m0 < 4 ? M - m0 : 4;
#ifdef GEMV_DPBF16
        const float *xm = W->fmt == GEMV_BF16 ? (const float *)((const uint16_t *)xp + m0 * k)
                                              : xp + m0 * k;
#else
        const float *xm = xp + m0 * k;
#endif
        if (W->fmt == GEMV_F32) {
            GEMV_CASES(GEMV_F32)
        } else if (W->fmt == GEMV_I8) {
            GEMV_CASES(GEMV_I8)
        } else {  /* GEMV_BF16 */
#ifdef GEMV_DPBF16
            const uint16_t *xb = (const uint16_t *)xm;
            switch (m4) {
            case 1: gemv_rows_dpbf16(ym, n, xb, W, bias, lo, hi, k, 1, 2); break;
            case 2: gemv_rows_dpbf16(ym, n, xb, W, bias, lo, hi, k, 2, 2); break;
            case 3: gemv_rows_dpbf16(ym, n, xb, W, bias, lo, hi, k, 3, 2); break;
            default: gemv_rows_dpbf16(ym, n, xb, W, bias, lo, hi, k, 4, 2); break;
            }
#else
            GEMV_CASES(GEMV_BF16)
#endif
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

/* y = x w^T (+ bias) by all num_threads threads together, each calling this with x as
 * gemv_prepare_x left it: every thread starts on its own contiguous range (n / num_threads
 * rows), taking ~64 KB of rows at a time, then takes what is left of the others' ranges. A
 * thread the OS preempts (the engine's event loop shares these cores) then delays the
 * product by a chunk, not by its whole share. `claims` [num_threads], zeroed, used for this
 * product only. */
static inline void gemv_shared(float *restrict y, const float *restrict xp, const gemv_weight *W,
                               const float *restrict bias, int64_t M, int64_t n, int64_t k,
                               int tid, int num_threads, gemv_claim *claims) {
    /* Packed weights (gemm.h) are claimed by panels, in whole groups of 4. */
    const int packed = gemm_is_packed(W->fmt);
    const int64_t units = packed ? gemm_num_panels(n) : n;
    int64_t chunk = packed ? gemm_claim_panels(W->fmt, k) : GEMV_CLAIM_BYTES / gemv_row_bytes(W->fmt, k);
    chunk = chunk > 0 ? chunk : 1;
    for (int i = 0; i < num_threads; i++) {
        const int r = (tid + i) % num_threads;
        int64_t lo = units * r / num_threads, hi = units * (r + 1) / num_threads;
        if (packed) lo = lo / 4 * 4, hi = r + 1 == num_threads ? units : hi / 4 * 4;
        for (;;) {
            const int64_t start = lo + chunk * __atomic_fetch_add(&claims[r].next, 1,
                                                                  __ATOMIC_RELAXED);
            if (start >= hi) break;
            gemv_range(y, xp, W, bias, M, n, k, start, start + chunk < hi ? start + chunk : hi);
        }
    }
}

#endif /* AIOENGINE_GEMV_H */
