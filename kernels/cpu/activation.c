/*
 * SiLU-and-mul on the CPU, float32 (vLLM's silu_and_mul): for x [num_tokens, 2 * d] whose
 * rows are [gate | up], out[t, i] = silu(gate[t, i]) * up[t, i], out [num_tokens, d].
 *
 * One pass over the fused gate_up projection's output in place of torch's chunk, silu and
 * mul (a strided SiLU and two temporaries), with exp and the reciprocal from vec_math.h so
 * that the loop vectorises.
 */
#include <stdint.h>

#include "activation.h"
#include "parallel.h"

void silu_and_mul_f32(float *restrict out, const float *restrict x, int64_t num_tokens,
                      int64_t d, int num_threads) {
    /* Threads from 32K elements on (22 rows of SmolLM2's 1536). */
    PARALLEL_FOR(t, num_tokens, (32768 + d - 1) / d,
                 silu_and_mul_row(out + t * d, x + t * 2 * d, x + t * 2 * d + d, d));
}
