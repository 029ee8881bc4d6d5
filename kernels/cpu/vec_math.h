/*
 * Small math for the CPU kernels, written so that loops calling it vectorise: libm's expf
 * is a scalar call, and vdivps ran at half the loop's speed on the AMD EPYC cores these were
 * tuned on. Each is within ~2 ulp over the range it documents (torch's own SIMD exp is too).
 */
#ifndef AIOENGINE_VEC_MATH_H
#define AIOENGINE_VEC_MATH_H

#include <stdint.h>
#include <string.h>

/* e^x for x clamped to [-87, 80]: x = n ln2 + r with |r| <= ln2 / 2, e^x = 2^n e^r, e^r by a
 * degree-7 Taylor polynomial (its truncation error is below float precision there). The
 * upper clamp keeps 1 + e^x well inside recip_f32's range: silu(g) for g < -80 comes out
 * ~1e-33 instead of 0. NaN passes through. */
static inline float exp_f32(float x) {
    x = x < -87.0f ? -87.0f : (x > 80.0f ? 80.0f : x);
    const float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
    /* ln 2 in two parts, so that n * ln2_hi is exact. */
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* 1 / d for d in [1, 1e35]: a first guess from the bit pattern (~12% off), then three
 * Newton steps y <- y (2 - d y), each squaring the relative error. */
static inline float recip_f32(float d) {
    int32_t bits;
    memcpy(&bits, &d, sizeof bits);
    bits = 0x7EF311C3 - bits;
    float y;
    memcpy(&y, &bits, sizeof y);
    y = y * (2.0f - d * y);
    y = y * (2.0f - d * y);
    y = y * (2.0f - d * y);
    return y;
}

/* A bf16 value (the high half of a float32) widened to float32: exact. */
static inline float bf16_to_f32(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* float32 to bf16, rounded to nearest even as torch's .to(torch.bfloat16) does for every
 * finite value and quiet NaN, so a K/V row the C kernels write has the bits torch's write
 * gives it. (No branch for signalling NaNs: this is in the GEMM's vector loops too.) */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

#endif /* AIOENGINE_VEC_MATH_H */
