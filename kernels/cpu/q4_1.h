/*
 * What the Q4_1 panel GEMM (gemm_q4_1.h, format GEMM_Q41P) reads besides its panels: the
 * GGUF block's fp16 fields and x quantized per 32-block. A GGUF Q4_1 block is 20 bytes for
 * 32 weights: fp16 d, fp16 m, 16 bytes of nibbles (byte j holds weight j in its low half,
 * weight j + 16 in its high half); w = d q + m. x is quantized to int8 per group of G = 32
 * values (Q4_1, Q4_0, Q8_0: llama.cpp's Q8_1 idea, our rounding) or G = 256 (the K-quants,
 * as ggml's Q8_K): s = max|x_group| * (the float nearest 1/127), 1 for a zero group, qx =
 * round_half_even(x / s), as int8_rows.quantize_int8_rows does, bit for bit.
 */
#ifndef AIOENGINE_Q4_1_H
#define AIOENGINE_Q4_1_H

#include <stdint.h>
#include <string.h>

#if defined(__F16C__)
#include <immintrin.h>
#endif

/* fp16 -> float32 without F16C: exact for every fp16 (subnormals included). */
static inline float q41_half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
    float f;
    if (exp == 0) {
        f = (float)man * (1.0f / 16777216.0f); /* man * 2^-24 */
        return sign ? -f : f;
    }
    const uint32_t bits = sign | (exp == 31 ? 0x7F800000u | (man << 13)
                                            : ((exp + 112) << 23) | (man << 13));
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

/* x [M, k] quantized per group of G (32 or 256, k a multiple): per row, nb = k / 32 scales
 * (float; one per 32-block, a group's blocks all holding its scale), nb block sums of qx
 * (int32), nb sums of each block's first 16 qx (int32: Q6_K's 16-weight scales), then k
 * int8; rows one after another. Every GGUF block format reads this one form
 * (gemm_blocks.h), G = 256 for the K-quants and 32 for the others. */
static inline int64_t q41_x_row_bytes(int64_t k) { return (k / 32) * 12 + k; }

static inline void q41_prepare_x(float *restrict buf, const float *restrict x, int64_t M,
                                 int64_t k, int64_t group) {
    const int64_t nb = k / 32, per = group / 32;
    for (int64_t m = 0; m < M; m++) {
        uint8_t *row = (uint8_t *)buf + m * q41_x_row_bytes(k);
        float *s = (float *)row;
        int32_t *sums = (int32_t *)(row + nb * 4), *half_sums = (int32_t *)(row + nb * 8);
        int8_t *q = (int8_t *)(row + nb * 12);
        float sb = 1.0f;
        for (int64_t b = 0; b < nb; b++) {
            const float *xb = x + m * k + b * 32;
            if (b % per == 0) { /* the group's scale */
                float amax = 0.0f;
                for (int j = 0; j < (int)group; j++) {
                    const float a = __builtin_fabsf(xb[j]);
                    amax = a > amax ? a : amax;
                }
                sb = amax * (1.0f / 127.0f);
                sb = sb > 0.0f ? sb : 1.0f;
            }
            /* In two passes that vectorise (a division and a rounding per lane, as the
             * scalar code rounds them), then the int8 values and their sum. */
            int32_t v[32], total = 0, half = 0;
            for (int j = 0; j < 32; j++) {
                const float r = __builtin_nearbyintf(xb[j] / sb);
                v[j] = (int32_t)(r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r));
            }
            for (int j = 0; j < 32; j++) {
                q[b * 32 + j] = (int8_t)v[j];
                total += v[j];
                half += j < 16 ? v[j] : 0;
            }
            s[b] = sb;
            sums[b] = total;
            half_sums[b] = half;
        }
    }
}


/* Row `row` of x as q41_prepare_x leaves it (k = 32 nb): block b's scale s_b, the sum of
 * its quantized values (and of its first 16), and those 32 values. */
static inline float q41_x_scale(const uint8_t *row, int64_t b) {
    float s;
    memcpy(&s, row + 4 * b, 4);
    return s;
}

static inline int32_t q41_x_sum(const uint8_t *row, int64_t nb, int64_t b) {
    int32_t t;
    memcpy(&t, row + nb * 4 + 4 * b, 4);
    return t;
}

static inline int32_t q41_x_half_sum(const uint8_t *row, int64_t nb, int64_t b) {
    int32_t t;
    memcpy(&t, row + nb * 8 + 4 * b, 4);
    return t;
}

static inline const int8_t *q41_x_quants(const uint8_t *row, int64_t nb, int64_t b) {
    return (const int8_t *)(row + nb * 12) + 32 * b;
}

#endif /* AIOENGINE_Q4_1_H */
