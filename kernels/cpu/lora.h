/*
 * LoRA's row arithmetic (aioengine.lora.layers), shared by the standalone kernel (lora.c,
 * the layer path) and the fused decode kernel (llama_decode.c), so a token's adapter update
 * has the same bits on both, and in a block of tokens as alone. For one adapter slot of a
 * projection with S slices (qkv: 3, gate_up: 2, else 1), padded rank R:
 *
 * The weights are float32 or, with `bf16` set, bfloat16 (widened in registers: the
 * activations and sums stay float32):
 *
 *   a      [S, R, K]   each slice's A, rows past the slice's rank unused
 *   bt     [R, N]      B transposed: row j = column j of every slice's B (scaling folded in)
 *   ranks  [S]         each slice's rank, 0 where the adapter leaves it alone
 *
 *   shrink: u[s * R + j] = a[s, j] . x                          (j < ranks[s])
 *   expand: y[n] += u[s * R + j] * bt[j, n], j = 0, 1, ...      (n in slice s)
 *
 * Both take up to LORA_BLOCK tokens of one slot at once (token rows[t] at x + rows[t] *
 * x_stride, and so for y and u), so each A row and B row read serves them all: the two
 * products were load-bound one token at a time (27 GFLOP/s on two cores).
 */
#ifndef AIOENGINE_LORA_H
#define AIOENGINE_LORA_H

#include <stdint.h>
#include <string.h>

#define LORA_BLOCK 8

typedef float lora_v16 __attribute__((vector_size(64), aligned(4)));
typedef uint16_t lora_v16h __attribute__((vector_size(32), aligned(2)));
typedef uint32_t lora_v16u __attribute__((vector_size(64), aligned(4)));

static inline lora_v16 lora_load(const float *p) {
    lora_v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* 16 weights from element i of w (float32, or bf16 widened). */
static inline lora_v16 lora_wload(const void *w, int64_t i, int bf16) {
    if (!bf16) return lora_load((const float *)w + i);
    lora_v16h h;
    memcpy(&h, (const uint16_t *)w + i, sizeof h);
    const lora_v16u u = __builtin_convertvector(h, lora_v16u) << 16;
    lora_v16 v;
    memcpy(&v, &u, sizeof v);
    return v;
}

static inline float lora_w(const void *w, int64_t i, int bf16) {
    if (!bf16) return ((const float *)w)[i];
    const uint32_t b = (uint32_t)((const uint16_t *)w)[i] << 16;
    float f;
    memcpy(&f, &b, sizeof f);
    return f;
}

/* Lane sums in a fixed order: the same bits for every caller. */
static inline float lora_hsum(lora_v16 v) {
    float s = 0.0f;
    for (int k = 0; k < 16; k++) s += v[k];
    return s;
}

/* Rank rows [begin, end) of the flattened (s, j) range [0, S * R) for nt <= LORA_BLOCK
 * tokens: u[r * u_stride + i] = a[i] . x[r * x_stride], r = rows[t]. Rows past a slice's
 * rank are skipped. */
static inline __attribute__((always_inline)) void lora_shrink_n(
    float *restrict u, int64_t u_stride, const float *restrict x, int64_t x_stride,
    const int64_t *restrict rows, int64_t nt, const void *a, int bf16,
    const int32_t *restrict ranks, int64_t R, int64_t K, int64_t begin, int64_t end) {
    const int64_t kv = K / 16 * 16;
    for (int64_t i = begin; i < end; i++) {
        if (i % R >= ranks[i / R]) continue;
        lora_v16 acc[LORA_BLOCK];
        for (int64_t t = 0; t < nt; t++) acc[t] = (lora_v16){0};
        for (int64_t k = 0; k < kv; k += 16) {
            const lora_v16 w = lora_wload(a, i * K + k, bf16);
            for (int64_t t = 0; t < nt; t++) acc[t] += w * lora_load(x + rows[t] * x_stride + k);
        }
        for (int64_t t = 0; t < nt; t++) {
            float s = lora_hsum(acc[t]);
            for (int64_t k = kv; k < K; k++) s += lora_w(a, i * K + k, bf16) * x[rows[t] * x_stride + k];
            u[rows[t] * u_stride + i] = s;
        }
    }
}

/* The bodies take nt as a constant where the callers below pass one, so the per-token
 * accumulators are unrolled into registers (with a run-time count they lived on the
 * stack). */
static inline void lora_shrink(float *restrict u, int64_t u_stride, const float *restrict x,
                               int64_t x_stride, const int64_t *restrict rows, int64_t nt,
                               const void *a, int bf16, const int32_t *restrict ranks,
                               int64_t R, int64_t K, int64_t begin, int64_t end) {
    if (nt == LORA_BLOCK)
        lora_shrink_n(u, u_stride, x, x_stride, rows, LORA_BLOCK, a, bf16, ranks, R, K, begin,
                      end);
    else if (nt == 1)
        lora_shrink_n(u, u_stride, x, x_stride, rows, 1, a, bf16, ranks, R, K, begin, end);
    else
        lora_shrink_n(u, u_stride, x, x_stride, rows, nt, a, bf16, ranks, R, K, begin, end);
}

/* y[r * y_stride + n] += the update of output columns [begin, end) for nt <= LORA_BLOCK
 * tokens r = rows[t] from their u (slice sizes `slices`). */
static inline __attribute__((always_inline)) void lora_expand_n(
    float *restrict y, int64_t y_stride, const float *restrict u, int64_t u_stride,
    const int64_t *restrict rows, int64_t nt, const void *bt, int bf16,
    const int32_t *restrict ranks, const int64_t *restrict slices, int64_t S, int64_t R,
    int64_t N, int64_t begin, int64_t end) {
    int64_t off = 0;
    for (int64_t s = 0; s < S; off += slices[s], s++) {
        const int64_t lo = begin > off ? begin : off;
        const int64_t hi = end < off + slices[s] ? end : off + slices[s];
        const int64_t r = ranks[s];
        if (r == 0 || lo >= hi) continue;
        const float *restrict us = u + s * R;
        int64_t n = lo;
        for (; n + 16 <= hi; n += 16) {
            lora_v16 acc[LORA_BLOCK];
            for (int64_t t = 0; t < nt; t++) acc[t] = lora_load(y + rows[t] * y_stride + n);
            for (int64_t j = 0; j < r; j++) {
                const lora_v16 w = lora_wload(bt, j * N + n, bf16);
                for (int64_t t = 0; t < nt; t++) acc[t] += us[rows[t] * u_stride + j] * w;
            }
            for (int64_t t = 0; t < nt; t++)
                memcpy(y + rows[t] * y_stride + n, &acc[t], sizeof acc[t]);
        }
        for (; n < hi; n++)
            for (int64_t t = 0; t < nt; t++) {
                float acc = y[rows[t] * y_stride + n];
                for (int64_t j = 0; j < r; j++)
                    acc += us[rows[t] * u_stride + j] * lora_w(bt, j * N + n, bf16);
                y[rows[t] * y_stride + n] = acc;
            }
    }
}

static inline void lora_expand(float *restrict y, int64_t y_stride, const float *restrict u,
                               int64_t u_stride, const int64_t *restrict rows, int64_t nt,
                               const void *bt, int bf16, const int32_t *restrict ranks,
                               const int64_t *restrict slices, int64_t S, int64_t R, int64_t N,
                               int64_t begin, int64_t end) {
    if (nt == LORA_BLOCK)
        lora_expand_n(y, y_stride, u, u_stride, rows, LORA_BLOCK, bt, bf16, ranks, slices, S, R,
                      N, begin, end);
    else if (nt == 1)
        lora_expand_n(y, y_stride, u, u_stride, rows, 1, bt, bf16, ranks, slices, S, R, N, begin,
                      end);
    else
        lora_expand_n(y, y_stride, u, u_stride, rows, nt, bt, bf16, ranks, slices, S, R, N,
                      begin, end);
}

/* The adapter tokens of a step grouped into blocks of up to LORA_BLOCK tokens of one slot:
 * rows [T] the tokens with token_slots[t] in [0, L), by slot, in step order within a slot;
 * blocks [2 nb] each block's (offset into rows, count). Returns nb; *num_rows set. Every
 * caller groups alike (lora_apply, the fused decode step), though a token's bits do not
 * depend on its block. */
static inline int64_t lora_group_blocks(int64_t *restrict rows, int64_t *restrict blocks,
                                        int64_t *num_rows, const int32_t *restrict token_slots,
                                        int64_t T, int64_t L) {
    int64_t nr = 0, nb = 0;
    for (int64_t slot = 0; slot < L; slot++) {
        const int64_t first = nr;
        for (int64_t t = 0; t < T; t++)
            if (token_slots[t] == slot) rows[nr++] = t;
        for (int64_t b = first; b < nr; b += LORA_BLOCK) {
            blocks[2 * nb] = b;
            blocks[2 * nb + 1] = nr - b < LORA_BLOCK ? nr - b : LORA_BLOCK;
            nb++;
        }
    }
    *num_rows = nr;
    return nb;
}

/* Thread tid's share [*begin, *end) of N output columns (of nt), at multiples of 16 so a
 * column is in the same vector or tail pass of lora_expand whatever the threads. */
static inline void lora_column_share(int64_t N, int tid, int nt, int64_t *begin, int64_t *end) {
    *begin = N * tid / nt / 16 * 16;
    *end = tid == nt - 1 ? N : N * (tid + 1) / nt / 16 * 16;
}

#endif /* AIOENGINE_LORA_H */
