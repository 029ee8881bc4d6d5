/*
 * The LoRA update of a projection for a step of T tokens, in place (the layer path; the
 * fused decode kernel applies the same rows itself): y [T, N] += each token's slot's
 * update for x [T, K] (lora.h). a [L, S, R, K], bt [L, R, N] (float32, or bf16 with
 * `bf16`), ranks [L, S] int32 for the projection's L slots; token_slots [T] int32, -1 for a token of the base model.
 *
 * Tokens go in blocks of up to LORA_BLOCK of one slot, in step order within a slot (a
 * decode step's rows of several adapters interleave). Threads split the shrinks by
 * (block, rank row), then the expands by output columns. Returns 0, or -1 when out of
 * memory.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "lora.h"

int lora_apply_f32(float *restrict y, const float *restrict x, const void *a, const void *bt,
                   int bf16, const int32_t *restrict ranks,
                   const int64_t *restrict slices, const int32_t *restrict token_slots,
                   int64_t T, int64_t S, int64_t R, int64_t K, int64_t N, int64_t L,
                   int num_threads) {
    const int64_t SR = S * R, esize = bf16 ? 2 : 4;
    const char *a_bytes = a, *bt_bytes = bt;
    float *u = malloc(sizeof(float) * (size_t)(T * SR));
    /* rows: the adapter tokens grouped by slot; blocks: (offset into rows, count). */
    int64_t *rows = malloc(sizeof(int64_t) * (size_t)(3 * T + 1));
    if (u == NULL || rows == NULL) {
        free(u);
        free(rows);
        return -1;
    }
    int64_t *blocks = rows + T, nr;
    const int64_t nb = lora_group_blocks(rows, blocks, &nr, token_slots, T, L);
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t item = 0; item < nb * SR; item++) {
            const int64_t b = item / SR, i = item % SR;
            const int64_t *r = rows + blocks[2 * b], slot = token_slots[r[0]];
            lora_shrink(u, SR, x, K, r, blocks[2 * b + 1], a_bytes + slot * SR * K * esize, bf16,
                        ranks + slot * S, R, K, i, i + 1);
        }
        /* implicit barrier: every u computed */
        int64_t begin, end;
        lora_column_share(N, omp_get_thread_num(), omp_get_num_threads(), &begin, &end);
        for (int64_t b = 0; b < nb; b++) {
            const int64_t *r = rows + blocks[2 * b], slot = token_slots[r[0]];
            lora_expand(y, N, u, SR, r, blocks[2 * b + 1], bt_bytes + slot * R * N * esize, bf16,
                        ranks + slot * S, slices, S, R, N, begin, end);
        }
    }
    free(rows);
    free(u);
    return 0;
}
