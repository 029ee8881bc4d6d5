/*
 * W8A8's activations: each row of x quantized to int8 with its own scale, as
 * layers.quantize_int8_rows does, bit for bit: s_x = max|x| * (the float nearest 1/127), 1
 * for a zero row; q = round_half_even(x / s_x) clamped to [-127, 127], as the panel GEMM
 * (gemm_w8a8.h, GEMM_W8A8P) reads it. An element is stored as the build's multiply wants it: q + 128 as uint8
 * where AVX512-VNNI's `vpdpbusd` (unsigned x signed bytes) runs, else q as int16 (16-bit
 * multiply-adds). Either way the products' sums are exact integers.
 */
#ifndef AIOENGINE_W8A8_H
#define AIOENGINE_W8A8_H

#include <stdint.h>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define GEMV_VNNI 1
typedef uint8_t i8_xelem;
#define I8_XOFFSET 128
#else
typedef int16_t i8_xelem;
#define I8_XOFFSET 0
#endif

/* Row x [k] quantized: its scale into *sx, q + I8_XOFFSET into q [k]. */
static inline void i8_quantize_row(float *restrict sx, i8_xelem *restrict q,
                                   const float *restrict x, int64_t k) {
    float amax = 0.0f;
    for (int64_t i = 0; i < k; i++) {
        const float a = __builtin_fabsf(x[i]);
        amax = a > amax ? a : amax;
    }
    /* Times the float nearest 1/127, not a division: torch divides a tensor by a Python
     * number by multiplying with its reciprocal. */
    float s = amax * (1.0f / 127.0f);
    s = s > 0.0f ? s : 1.0f;
    *sx = s;
    for (int64_t i = 0; i < k; i++) {
        float v = __builtin_nearbyintf(x[i] / s);
        v = v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v);
        q[i] = (i8_xelem)((int32_t)v + I8_XOFFSET);
    }
}

/* The panel GEMM's x: per row its scale (a float), then k rounded up to a multiple of 4
 * quantized elements (the padding q = 0), rows one after another. */
static inline int64_t w8_k4(int64_t k) { return (k + 3) / 4; }

static inline int64_t w8_x_row_bytes(int64_t k) {
    return 4 + 4 * w8_k4(k) * (int64_t)sizeof(i8_xelem);
}

static inline void w8_prepare_x(float *restrict buf, const float *restrict x, int64_t M,
                                int64_t k) {
    const int64_t padded = 4 * w8_k4(k);
    for (int64_t m = 0; m < M; m++) {
        uint8_t *row = (uint8_t *)buf + m * w8_x_row_bytes(k);
        i8_xelem *q = (i8_xelem *)(row + 4);
        float s;
        i8_quantize_row(&s, q, x + m * k, k);
        __builtin_memcpy(row, &s, 4);
        for (int64_t i = k; i < padded; i++) q[i] = (i8_xelem)I8_XOFFSET;
    }
}

static inline float w8_x_scale(const uint8_t *row) {
    float s;
    __builtin_memcpy(&s, row, 4);
    return s;
}

static inline const i8_xelem *w8_x_quants(const uint8_t *row) {
    return (const i8_xelem *)(row + 4);
}

/* y[c] = ((float)dot[c] * s_x) * s_w[c] (+ bias[c]) for `count` columns from c0, each
 * step rounded on its own in that order (no fused multiply-add): torch's `_int_mm`
 * result `.float().mul_(s_x).mul_(s_w).add_(bias)` (layers._w8a8_linear), bit for bit.
 * Not inlined, so the build's contraction of a * b + c never reaches it. */
__attribute__((noinline, optimize("no-associative-math", "fp-contract=off"))) static void
w8_store(float *restrict y, const int32_t *restrict dot, int64_t count, float sx,
         const float *restrict sw, const float *restrict bias) {
    for (int64_t i = 0; i < count; i++) {
        float v = (float)dot[i] * sx;
        v = v * sw[i];
        y[i] = bias ? v + bias[i] : v;
    }
}

#endif /* AIOENGINE_W8A8_H */
