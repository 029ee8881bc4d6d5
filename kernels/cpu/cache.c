/*
 * reshape_and_cache on the CPU (vLLM's name): writes this step's keys and values into their
 * slots of the paged KV cache, float32 (reshape_and_cache_f32) or bf16 (_bf16: each value
 * rounded to nearest even, as torch's .to(torch.bfloat16) and the fused decode round).
 *
 *   key, value  [num_tokens, num_kv_heads * head_dim] rows, `key_stride` / `value_stride`
 *               floats apart (views into the fused qkv projection's output qualify)
 *   kv_cache    [2, num_blocks, block_size, num_kv_heads, head_dim]   (0 = K, 1 = V)
 *   slot_mapping [num_tokens] int64: block * block_size + offset, in [0, num_slots)
 *
 * One row copy per token and cache, in place of two index_copy_ calls (~25 us each at 32
 * tokens, for a few KB). The slots are checked first: if any is out of range nothing is
 * written and the return value is how many were (0 when all went in).
 */
#include <stdint.h>

#include "attention.h"
#include "parallel.h"

/* Both element types: kv_store_row per token and cache. */
static int64_t reshape_and_cache(const float *restrict key, const float *restrict value,
                                 int64_t key_stride, int64_t value_stride,
                                 void *restrict kv_cache, int kv_bf16, int64_t num_slots,
                                 const int64_t *restrict slot_mapping, int64_t num_tokens,
                                 int64_t row_size, int num_threads) {
    int64_t bad = 0;
    for (int64_t t = 0; t < num_tokens; t++)
        bad += slot_mapping[t] < 0 || slot_mapping[t] >= num_slots;
    if (bad) return bad;
    const int64_t v_start = num_slots * row_size;
    PARALLEL_FOR(t, num_tokens, 256,
                 kv_store_row(kv_cache, slot_mapping[t] * row_size, key + t * key_stride,
                              row_size, kv_bf16);
                 kv_store_row(kv_cache, v_start + slot_mapping[t] * row_size,
                              value + t * value_stride, row_size, kv_bf16));
    return 0;
}

int64_t reshape_and_cache_f32(const float *restrict key, const float *restrict value,
                              int64_t key_stride, int64_t value_stride,
                              float *restrict kv_cache, int64_t num_slots,
                              const int64_t *restrict slot_mapping, int64_t num_tokens,
                              int64_t row_size, int num_threads) {
    return reshape_and_cache(key, value, key_stride, value_stride, kv_cache, 0, num_slots,
                             slot_mapping, num_tokens, row_size, num_threads);
}

int64_t reshape_and_cache_bf16(const float *restrict key, const float *restrict value,
                               int64_t key_stride, int64_t value_stride,
                               uint16_t *restrict kv_cache, int64_t num_slots,
                               const int64_t *restrict slot_mapping, int64_t num_tokens,
                               int64_t row_size, int num_threads) {
    return reshape_and_cache(key, value, key_stride, value_stride, kv_cache, 1, num_slots,
                             slot_mapping, num_tokens, row_size, num_threads);
}
