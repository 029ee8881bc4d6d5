/*
 * Paged decode attention on the CPU, float32: one query token per request, keys and values
 * read in place from the paged KV cache (no gathered copy), GQA without repeating K/V.
 *
 *   kv_cache  [2, num_blocks, block_size, num_kv_heads, head_dim]   (0 = K, 1 = V)
 *   q, out    [num_reqs, num_heads, head_dim]   query head h uses KV head h / group
 *   block_tables [num_reqs, table_stride] int32, seq_lens [num_reqs] int32
 *
 * Position p of request n lives in block block_tables[n][p / block_size], slot
 * p % block_size. One task per request: it scores every query head against every key,
 * walking the blocks in order so each block's K (all KV heads, contiguous) is read once,
 * takes an exact softmax per head, then sums the values the same way. Decode attention is
 * memory-bound: reading each block once, contiguously, straight from the cache is the whole
 * point (a task per KV head reads strided thirds of each block and measured 3x slower).
 *
 * Built and loaded by aioengine/kernels/cpu.py; torch's OpenMP runtime is already loaded
 * then, so this shares its thread pool.
 */
#include <stdint.h>
#include <stdlib.h>

#include "attention.h"

int paged_decode_attention_f32(float *restrict out, const float *restrict q,
                               const float *restrict kv_cache, int64_t num_blocks,
                               const int32_t *restrict block_tables, int64_t table_stride,
                               const int32_t *restrict seq_lens, int64_t num_reqs,
                               int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                               int64_t block_size, float scale, int num_threads) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t block_stride = block_size * num_kv_heads * head_dim;
    const float *k_cache = kv_cache;
    const float *v_cache = kv_cache + num_blocks * block_stride;
    int64_t max_seq_len = 1;
    for (int64_t n = 0; n < num_reqs; n++)
        if (seq_lens[n] > max_seq_len) max_seq_len = seq_lens[n];
    int failed = 0;

#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        /* scores [num_heads, max_seq_len], then the softmax's max and sum per head. */
        float *scores = malloc(sizeof(float) * (size_t)(num_heads * (max_seq_len + 2)));
        if (scores == NULL) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t n = 0; n < num_reqs; n++) {
            if (scores == NULL) continue;
            const int64_t offset = n * num_heads * head_dim;
            const int32_t *table = block_tables + n * table_stride;
            float *max = scores + num_heads * max_seq_len, *sum = max + num_heads;
            attend_request(out + offset, max, sum, q + offset, k_cache, v_cache, table, 0,
                           seq_lens[n], num_heads, group, head_dim, block_size, block_stride,
                           scale, scores);
            attend_normalize(out + offset, sum, num_heads, head_dim);
        }
        free(scores);
    }
    return failed ? -1 : 0;
}
