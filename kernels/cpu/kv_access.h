/*
 * Reading and writing a paged K/V cache's elements, float32 or bf16 (kv_bf16): widened
 * exactly to float32 as read, rounded as torch rounds as written (attention.h's readers,
 * cache.c's and llama_decode.c's writers).
 */
#ifndef AIOENGINE_KV_ACCESS_H
#define AIOENGINE_KV_ACCESS_H

#include <stdint.h>
#include <string.h>

#include "vec_math.h"

/* Element i of a K/V cache in its element type, as float32. */
static inline __attribute__((always_inline)) float kv_at(const void *restrict cache, int64_t i,
                                                         const int kv_bf16) {
    return kv_bf16 ? bf16_to_f32(((const uint16_t *)cache)[i]) : ((const float *)cache)[i];
}

/* n floats into a K/V cache from element `at` on, in its element type: copied, or rounded
 * to bf16 (f32_to_bf16: torch's rounding). The one writer of K/V rows, for cache.c's
 * reshape_and_cache and llama_decode.c's fused step alike. */
static inline void kv_store_row(void *restrict cache, int64_t at, const float *restrict src,
                                int64_t n, int kv_bf16) {
    if (kv_bf16) {
        uint16_t *dst = (uint16_t *)cache + at;
        for (int64_t i = 0; i < n; i++) dst[i] = f32_to_bf16(src[i]);
    } else {
        memcpy((float *)cache + at, src, sizeof(float) * (size_t)n);
    }
}

/* The cache lines of n elements of a K/V cache from element `at` on, prefetched into L1
 * (locality 3) or L2 (2). A request's blocks lie anywhere in the cache, so the hardware
 * cannot guess the next one; a decode step's K/V comes from memory (the weights streamed
 * between two of its reads), and without these the attention waited on it. */
static inline void kv_prefetch(const void *cache, int64_t at, int64_t n, int kv_bf16,
                               const int locality) {
    const int64_t size = kv_bf16 ? 2 : 4;
    const char *p = (const char *)cache + at * size;
    for (int64_t off = 0; off < n * size; off += 64)
        if (locality == 3)
            __builtin_prefetch(p + off, 0, 3);
        else
            __builtin_prefetch(p + off, 0, 2);
}

/* The slots (element offsets of a position's row, all KV heads) of positions p .. p + n - 1
 * of a request whose blocks are `table`: one division for all of them (a 64-bit division
 * per position was a tenth of a decode step's attention). */
static inline void kv_slots(int64_t *restrict slots, const int32_t *restrict table, int64_t p,
                            int64_t n, int64_t block_size, int64_t block_stride,
                            int64_t slot_stride) {
    int64_t b = p / block_size, o = p % block_size;
    for (int64_t t = 0; t < n; t++) {
        slots[t] = (int64_t)table[b] * block_stride + o * slot_stride;
        if (++o == block_size) o = 0, b++;
    }
}

#endif /* AIOENGINE_KV_ACCESS_H */
