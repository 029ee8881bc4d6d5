/*
 * One token's neox-style rotary embedding, float32, in place (rotary_embedding.c has the
 * batch kernel; llama_decode.c calls this directly).
 */
#ifndef AIOENGINE_ROTARY_EMBEDDING_H
#define AIOENGINE_ROTARY_EMBEDDING_H

#include <stdint.h>

/* One token's heads, rotated in place. */
static inline void rotate_token(float *restrict row, int64_t num_heads, int64_t head_dim,
                                const float *restrict c, const float *restrict s) {
    const int64_t half = head_dim / 2;
    for (int64_t h = 0; h < num_heads; h++) {
        float *x1 = row + h * head_dim, *x2 = x1 + half;
        for (int64_t i = 0; i < half; i++) {
            const float a = x1[i], b = x2[i];
            x1[i] = a * c[i] - b * s[i];
            x2[i] = b * c[i] + a * s[i];
        }
    }
}

#endif /* AIOENGINE_ROTARY_EMBEDDING_H */
