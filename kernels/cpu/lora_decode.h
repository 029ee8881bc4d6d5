/*
 * LoRA in the fused decode step (llama_decode.c), with lora.h's row arithmetic, so a
 * token's update has the bits lora_apply gives it on the layer path, in any step.
 *
 * The step's adapter tokens are grouped by slot into blocks of up to LORA_BLOCK
 * (lora_group_blocks, as lora_apply groups them), so each A and B row read serves a whole
 * block. The work is split over the threads, not repeated by each:
 *   - a projection's shrink: this thread's share of the (block, rank row) tasks, from its
 *     own copy of the projection's input into a buffer shared by the threads, done before
 *     the projection's GEMM so the GEMM's claims (projection.h) even out the shares, and read
 *     after the GEMM's barrier;
 *   - qkv's expand: by block, in the loop that writes the tokens' K/V (llama_decode.c puts
 *     the base tokens in blocks of one after the adapter blocks: with no adapter that loop
 *     is the one over tokens);
 *   - gate_up's expand (the largest: 2 intermediate columns): by output columns, in place
 *     in the shared gate_up, then one barrier before SiLU-and-mul reads it;
 *   - o's and down's expands (hidden columns, a few microseconds): by every thread into its
 *     own copy of the residual input, where it reads the projection's output, which is
 *     cheaper than a barrier.
 */
#ifndef AIOENGINE_LORA_DECODE_H
#define AIOENGINE_LORA_DECODE_H

#include <stdint.h>

#include "decode_layer.h"
#include "lora.h"

/* The step's adapter blocks and the shrink outputs, shared by the threads. */
typedef struct {
    const int32_t *token_slots;
    int64_t R;
    int bf16;
    const int64_t *rows, *blocks;  /* lora_group_blocks's */
    int64_t nb;                    /* adapter blocks: 0 without adapters */
    float *u_qkv, *u_o, *u_gate_up, *u_down;  /* [M, 3R], [M, R], [M, 2R], [M, R] */
} lora_step;

/* Floats of lora_step's four shrink buffers for M tokens of padded rank R. */
static inline int64_t lora_step_floats(int64_t M, int64_t R) { return M * 7 * R; }

static inline void lora_step_init(lora_step *ls, float *u, int64_t M, int64_t R) {
    ls->u_qkv = u;
    ls->u_o = u + M * 3 * R;
    ls->u_gate_up = ls->u_o + M * R;
    ls->u_down = ls->u_gate_up + M * 2 * R;
}

/* The step's tokens in blocks: ls's adapter blocks (lora_group_blocks; none where
 * token_slots is NULL), then every base token in a block of its own, into rows [M] and
 * blocks [2 M] (offset into rows, count). Returns the number of blocks. */
static inline int64_t lora_step_blocks(lora_step *ls, int64_t *restrict rows,
                                       int64_t *restrict blocks,
                                       const int32_t *restrict token_slots, int64_t M) {
    int64_t num_slots = 0, nr = 0;
    for (int64_t t = 0; t < M && token_slots != NULL; t++)
        num_slots = token_slots[t] >= num_slots ? token_slots[t] + 1 : num_slots;
    ls->token_slots = token_slots;
    ls->rows = rows;
    ls->blocks = blocks;
    ls->nb = lora_group_blocks(rows, blocks, &nr, token_slots, M, num_slots);
    int64_t nb = ls->nb;
    for (int64_t t = 0; t < M; t++)
        if (token_slots == NULL || token_slots[t] < 0) {
            rows[nr] = t;
            blocks[2 * nb] = nr++;
            blocks[2 * nb++ + 1] = 1;
        }
    return nb;
}

/* Slot `slot`'s A or B of projection p, as a byte pointer for either format. */
static inline const void *lora_slot_at(const void *base, int64_t slot, int64_t elems, int bf16) {
    return (const char *)base + slot * elems * (bf16 ? 2 : 4);
}

/* Thread tid's share (of nt) of projection p's shrink tasks: u [M, S R] from x [M, K] (row
 * stride x_stride). */
static inline void lora_step_shrink(const lora_step *ls, float *restrict u,
                                    const float *restrict x, int64_t x_stride,
                                    const lora_proj *p, int64_t S, int64_t K, int tid, int nt) {
    const int64_t SR = S * ls->R, n = ls->nb * SR;
    const int64_t first = n * tid / nt, last = n * (tid + 1) / nt;
    for (int64_t b = first / SR; b < ls->nb && b * SR < last; b++) {
        const int64_t *r = ls->rows + ls->blocks[2 * b], slot = ls->token_slots[r[0]];
        const int64_t begin = first > b * SR ? first - b * SR : 0;
        const int64_t end = last < (b + 1) * SR ? last - b * SR : SR;
        lora_shrink(u, SR, x, x_stride, r, ls->blocks[2 * b + 1],
                    lora_slot_at(p->a, slot, SR * K, ls->bf16), ls->bf16, p->ranks + slot * S,
                    ls->R, K, begin, end);
    }
}

/* Block b's expand into y [M, N] (row stride y_stride), columns [begin, end). */
static inline void lora_step_expand_block(const lora_step *ls, int64_t b, float *restrict y,
                                          int64_t y_stride, const float *restrict u,
                                          const lora_proj *p, const int64_t *slices, int64_t S,
                                          int64_t N, int64_t begin, int64_t end) {
    const int64_t *r = ls->rows + ls->blocks[2 * b], slot = ls->token_slots[r[0]];
    lora_expand(y, y_stride, u, S * ls->R, r, ls->blocks[2 * b + 1],
                lora_slot_at(p->bt, slot, ls->R * N, ls->bf16), ls->bf16, p->ranks + slot * S,
                slices, S, ls->R, N, begin, end);
}

/* Every block's expand, columns [begin, end). */
static inline void lora_step_expand(const lora_step *ls, float *restrict y, int64_t y_stride,
                                    const float *restrict u, const lora_proj *p,
                                    const int64_t *slices, int64_t S, int64_t N, int64_t begin,
                                    int64_t end) {
    for (int64_t b = 0; b < ls->nb; b++)
        lora_step_expand_block(ls, b, y, y_stride, u, p, slices, S, N, begin, end);
}

#endif /* AIOENGINE_LORA_DECODE_H */
