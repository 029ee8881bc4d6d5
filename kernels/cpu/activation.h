/*
 * One row of SiLU-and-mul, float32 (activation.c has the batch kernel; llama_decode.c calls
 * the row directly): out[i] = silu(gate[i]) * up[i].
 */
#ifndef AIOENGINE_ACTIVATION_H
#define AIOENGINE_ACTIVATION_H

#include <stdint.h>

#include "vec_math.h"

/* A function of its own: restrict on the row pointers is what lets the loop vectorise
 * without a runtime overlap check. */
static inline void silu_and_mul_row(float *restrict out, const float *restrict gate,
                             const float *restrict up, int64_t d) {
    for (int64_t i = 0; i < d; i++) {
        const float g = gate[i];
        out[i] = g * recip_f32(1.0f + exp_f32(-g)) * up[i];
    }
}

#endif /* AIOENGINE_ACTIVATION_H */
