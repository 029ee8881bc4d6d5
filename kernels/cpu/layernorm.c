/*
 * RMSNorm on the CPU, float32 (vLLM's rms_norm and fused_add_rms_norm), per token row of
 * `hidden` floats:
 *
 *   rms_norm:            out = x / sqrt(mean(x^2) + eps) * weight
 *   fused_add_rms_norm:  residual = x + residual;  x = rms_norm(residual)   (both in place)
 *
 * torch's rms_norm on the CPU is ~7 ops (pow, mean, add, rsqrt, two muls and a cast) with
 * their temporaries, ~30 us per call even for one row; the residual add is one more. Here
 * each row is read and written once, with the sum of squares in one vector pass.
 */
#include <stdint.h>

#include "layernorm.h"
#include "parallel.h"

/* out and x [num_tokens, hidden], contiguous; out must not overlap x. */
void rms_norm_f32(float *restrict out, const float *restrict x, const float *restrict weight,
                  int64_t num_tokens, int64_t hidden, float eps, int num_threads) {
    PARALLEL_FOR(t, num_tokens, 64,
                 rms_norm_row(out + t * hidden, x + t * hidden, weight, hidden, eps));
}

/* x and residual [num_tokens, hidden], contiguous, distinct. */
void fused_add_rms_norm_f32(float *restrict x, float *restrict residual,
                            const float *restrict weight, int64_t num_tokens, int64_t hidden,
                            float eps, int num_threads) {
    PARALLEL_FOR(t, num_tokens, 64,
                 fused_add_rms_norm_row(x + t * hidden, residual + t * hidden, weight, hidden,
                                        eps));
}
