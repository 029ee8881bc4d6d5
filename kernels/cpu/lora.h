/*
 * LoRA's row arithmetic (aioengine.lora.layers), shared by the standalone kernel (lora.c,
 * the layer path) and the fused decode kernel (llama_decode.c), so a token's adapter update
 * has the same bits on both. For one token of one adapter slot of a projection with S
 * slices (qkv: 3, gate_up: 2, else 1), padded rank R:
 *
 *   a      [S, R, K]   each slice's A, rows past the slice's rank unused
 *   bt     [R, N]      B transposed: row j = column j of every slice's B (scaling folded in)
 *   ranks  [S]         each slice's rank, 0 where the adapter leaves it alone
 *
 *   shrink: u[s * R + j] = a[s, j] . x                          (j < ranks[s])
 *   expand: y[n] += u[s * R + j] * bt[j, n], j = 0, 1, ...      (n in slice s)
 */
#ifndef AIOENGINE_LORA_H
#define AIOENGINE_LORA_H

#include <stdint.h>

/* Sixteen independent partial sums (vectorised by -O3 without reassociation), then summed
 * in a fixed order: the same bits on every call. */
static inline float lora_dot(const float *restrict a, const float *restrict b, int64_t n) {
    float acc[16] = {0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int k = 0; k < 16; k++) acc[k] += a[i + k] * b[i + k];
    float s = 0.0f;
    for (int k = 0; k < 16; k++) s += acc[k];
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* u[s * R + j] for the S slices' first ranks[s] rows, items [begin, end) of the flattened
 * (s, j) range [0, S * R). */
static inline void lora_shrink(float *restrict u, const float *restrict x,
                               const float *restrict a, const int32_t *restrict ranks,
                               int64_t R, int64_t K, int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; i++)
        if (i % R < ranks[i / R]) u[i] = lora_dot(a + i * K, x, K);
}

/* y[n] += the update of output columns [begin, end) from u (slice sizes `slices`). */
static inline void lora_expand(float *restrict y, const float *restrict u,
                               const float *restrict bt, const int32_t *restrict ranks,
                               const int64_t *restrict slices, int64_t S, int64_t R,
                               int64_t N, int64_t begin, int64_t end) {
    int64_t off = 0;
    for (int64_t s = 0; s < S; off += slices[s], s++) {
        const int64_t lo = begin > off ? begin : off;
        const int64_t hi = end < off + slices[s] ? end : off + slices[s];
        for (int64_t j = 0; j < ranks[s] && lo < hi; j++) {
            const float uj = u[s * R + j];
            const float *restrict row = bt + j * N;
            for (int64_t n = lo; n < hi; n++) y[n] += uj * row[n];
        }
    }
}

#endif /* AIOENGINE_LORA_H */
