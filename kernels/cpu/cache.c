/*
 * reshape_and_cache on the CPU (vLLM's name): writes this step's keys and values into their
 * slots of the paged KV cache, float32.
 *
 *   key, value  [num_tokens, num_kv_heads * head_dim] rows, `key_stride` / `value_stride`
 *               floats apart (views into the fused qkv projection's output qualify)
 *   kv_cache    [2, num_blocks, block_size, num_kv_heads, head_dim]   (0 = K, 1 = V)
 *   slot_mapping [num_tokens] int64: block * block_size + offset, in [0, num_slots)
 *
 * One row copy per token and cache, in place of two index_copy_ calls (~25 us each at 32
 * tokens, for a few KB). A slot out of range is skipped and counted: the return value is
 * the number of tokens not written (0 when all went in).
 */
#include <stdint.h>
#include <string.h>

/* Token t's key and value rows into their slot; 1 if the slot is out of range (skipped). */
static inline int64_t copy_token(const float *restrict key, const float *restrict value,
                                 int64_t key_stride, int64_t value_stride,
                                 float *restrict k_cache, float *restrict v_cache,
                                 int64_t num_slots, const int64_t *restrict slot_mapping,
                                 int64_t t, int64_t row_size) {
    const int64_t slot = slot_mapping[t];
    if (slot < 0 || slot >= num_slots) return 1;
    memcpy(k_cache + slot * row_size, key + t * key_stride, sizeof(float) * row_size);
    memcpy(v_cache + slot * row_size, value + t * value_stride, sizeof(float) * row_size);
    return 0;
}

int64_t reshape_and_cache_f32(const float *restrict key, const float *restrict value,
                           int64_t key_stride, int64_t value_stride, float *restrict kv_cache,
                           int64_t num_slots, const int64_t *restrict slot_mapping,
                           int64_t num_tokens, int64_t row_size, int num_threads) {
    float *k_cache = kv_cache, *v_cache = kv_cache + num_slots * row_size;
    int64_t skipped = 0;
    if (num_tokens < 256) { /* no OpenMP region at all: see layernorm.c */
        for (int64_t t = 0; t < num_tokens; t++)
            skipped += copy_token(key, value, key_stride, value_stride, k_cache, v_cache,
                                  num_slots, slot_mapping, t, row_size);
        return skipped;
    }
#pragma omp parallel for num_threads(num_threads) schedule(static) reduction(+ : skipped)
    for (int64_t t = 0; t < num_tokens; t++)
        skipped += copy_token(key, value, key_stride, value_stride, k_cache, v_cache,
                              num_slots, slot_mapping, t, row_size);
    return skipped;
}
