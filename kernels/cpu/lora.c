/*
 * The LoRA update of a projection for a step of T tokens, in place (the layer path; the
 * fused decode kernel applies the same rows itself): y [T, N] += each token's slot's
 * update for x [T, K] (lora.h). a [L, S, R, K], bt [L, R, N], ranks [L, S] int32 for the
 * projection's L slots; token_slots [T] int32, -1 for a token of the base model. Threads
 * split the shrinks by (token, slice, rank row), then the expands by output columns.
 * Returns 0, or -1 when out of memory.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "lora.h"

int lora_apply_f32(float *restrict y, const float *restrict x, const float *restrict a,
                   const float *restrict bt, const int32_t *restrict ranks,
                   const int64_t *restrict slices, const int32_t *restrict token_slots,
                   int64_t T, int64_t S, int64_t R, int64_t K, int64_t N, int num_threads) {
    float *u = malloc(sizeof(float) * (size_t)(T * S * R));
    if (u == NULL) return -1;
    const int64_t SR = S * R;
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < T * SR; i++) {
            const int64_t t = i / SR, slot = token_slots[t];
            if (slot >= 0)
                lora_shrink(u + t * SR, x + t * K, a + slot * SR * K, ranks + slot * S, R, K,
                            i % SR, i % SR + 1);
        }
        /* implicit barrier: every u computed */
        const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t begin = N * tid / nt / 16 * 16;
        const int64_t end = tid == nt - 1 ? N : N * (tid + 1) / nt / 16 * 16;
        for (int64_t t = 0; t < T; t++) {
            const int64_t slot = token_slots[t];
            if (slot >= 0)
                lora_expand(y + t * N, u + t * SR, bt + slot * R * N, ranks + slot * S, slices,
                            S, R, N, begin, end);
        }
    }
    free(u);
    return 0;
}
