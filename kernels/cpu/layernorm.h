/*
 * One row of RMSNorm, float32 (layernorm.c has the batch kernels; llama_decode.c calls the
 * rows directly):
 *
 *   rms_norm_row:            out = x / sqrt(mean(x^2) + eps) * weight
 *   fused_add_rms_norm_row:  residual = x + residual;  x = rms_norm(residual)   (in place)
 */
#ifndef AIOENGINE_LAYERNORM_H
#define AIOENGINE_LAYERNORM_H

#include <math.h>
#include <stdint.h>

static inline float inv_rms(const float *restrict x, int64_t hidden, float eps) {
    float sum = 0.0f;
    for (int64_t i = 0; i < hidden; i++) sum += x[i] * x[i];
    return 1.0f / sqrtf(sum / (float)hidden + eps);
}

static inline void rms_norm_row(float *restrict out, const float *restrict x,
                         const float *restrict weight, int64_t hidden, float eps) {
    const float inv = inv_rms(x, hidden, eps);
    for (int64_t i = 0; i < hidden; i++) out[i] = x[i] * inv * weight[i];
}

static inline void fused_add_rms_norm_row(float *restrict x, float *restrict residual,
                                   const float *restrict weight, int64_t hidden, float eps) {
    for (int64_t i = 0; i < hidden; i++) residual[i] += x[i];
    const float inv = inv_rms(residual, hidden, eps);
    for (int64_t i = 0; i < hidden; i++) x[i] = residual[i] * inv * weight[i];
}

#endif /* AIOENGINE_LAYERNORM_H */
