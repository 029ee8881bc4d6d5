/*
 * SiLU-and-mul on the CPU, float32 (vLLM's silu_and_mul): for x [num_tokens, 2 * d] whose
 * rows are [gate | up], out[t, i] = silu(gate[t, i]) * up[t, i], out [num_tokens, d].
 *
 * One pass over the fused gate_up projection's output in place of torch's chunk, silu and
 * mul (a strided SiLU and two temporaries), with exp and the reciprocal from vec_math.h so
 * that the loop vectorises.
 */
#include <stdint.h>

#include "vec_math.h"

/* A function of its own: restrict on the row pointers is what lets the loop vectorise
 * without a runtime overlap check. */
static void silu_and_mul_row(float *restrict out, const float *restrict gate,
                             const float *restrict up, int64_t d) {
    for (int64_t i = 0; i < d; i++) {
        const float g = gate[i];
        out[i] = g * recip_f32(1.0f + exp_f32(-g)) * up[i];
    }
}

void silu_and_mul_f32(float *restrict out, const float *restrict x, int64_t num_tokens,
                      int64_t d, int num_threads) {
    if (num_tokens * d < 32768) { /* no OpenMP region at all: see layernorm.c */
        for (int64_t t = 0; t < num_tokens; t++)
            silu_and_mul_row(out + t * d, x + t * 2 * d, x + t * 2 * d + d, d);
        return;
    }
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t t = 0; t < num_tokens; t++)
        silu_and_mul_row(out + t * d, x + t * 2 * d, x + t * 2 * d + d, d);
}
