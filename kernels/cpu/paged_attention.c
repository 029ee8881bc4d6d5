/*
 * Paged attention on the CPU, float32, for ROWS of queries: every decode token and every
 * prefill token of a step in one call, keys and values read in place from the paged KV
 * cache (no gathered copy), GQA without repeating K/V.
 *
 *   kv_cache  [2, num_blocks, block_size, num_kv_heads, head_dim]   (0 = K, 1 = V), float32,
 *              or bf16 with kv_bf16 (widened to float32 as read: half the bytes to read)
 *   q, out    [num_rows, num_heads, head_dim]   query head h uses KV head h / group
 *   block_tables [num_reqs, table_stride] int32
 *   row_to_req [num_rows] int32: the block table row of each query row
 *   seq_lens   [num_rows] int32: the positions the row sees, its own included (its
 *              position + 1): 0 .. seq_len - 1 of its request
 *
 * A decode is one row per request (seq_len = the request's); a prefill chunk of a request
 * with context_len cached positions is one row per token, row j with seq_len =
 * context_len + j + 1 (causal), the step's K/V already written to the cache. Position p of
 * a request lives in block block_tables[req][p / block_size], slot p % block_size.
 *
 * Every row is split at fixed absolute positions (attention.h): the tasks, a part of up to
 * ATTN_ROW_BLOCK consecutive tokens of one request (a prefill chunk's rows share each
 * position's K/V read), are shared over the threads, then each row combines its parts in
 * order. A row's bits thus depend only on its query, the cache and its seq_len: a token
 * computed in a fresh prefill, after a cached prefix, in a chunk, alone or beside others in
 * its task, as a decode or in llama_decode.c's fused decode gets the same result. Within a
 * part, each position's K (all KV heads, contiguous) is read once, then its V: decode attention is memory-bound, and reading each block once, contiguously,
 * straight from the cache is what makes it fast (a task per KV head read strided thirds of
 * each block and measured 3x slower).
 *
 * It holds both users of that split: paged_attention_f32 (the batch kernel over rows) and
 * the per-part functions attention.h declares (attn_compute_part, attn_compute_window_part,
 * attn_combine_parts), which llama_decode.c's fused decode calls inside its own parallel
 * region.
 *
 * Built and loaded by aioengine/kernels/cpu.py; torch's OpenMP runtime is already loaded
 * then, so this shares its thread pool.
 */
#include <stdint.h>
#include <stdlib.h>

#include "attention.h"

/* Part buffers held at once: rows are taken in groups of at most this many parts (a row
 * with more goes alone), so a long prefill does not need a buffer per part of every row
 * (3000 rows of a 3000-token prompt: 19k parts, 46 MB for SmolLM2's heads). */
#define PARTS_PER_GROUP 2048

void attn_compute_rows_part(float *const *restrict parts_of, const float *restrict q,
                            int64_t q_stride, const void *restrict k_cache,
                            const void *restrict v_cache, int kv_bf16,
                            const int32_t *restrict table, const int32_t *restrict seq_lens,
                            int64_t R, int64_t window, int64_t j, int64_t num_heads,
                            int64_t group, int64_t kv_lo, int64_t kv_hi, int64_t head_dim,
                            int64_t block_size, int64_t block_stride, float scale,
                            float *restrict scores) {
    const int64_t P = attn_part_len(block_size);
    int64_t begins[ATTN_ROW_BLOCK], ends[ATTN_ROW_BLOCK];
    for (int64_t i = 0; i < R; i++) {
        const int64_t lo = attn_window_start(seq_lens[i], window);
        begins[i] = j * P > lo ? j * P : lo;
        ends[i] = j * P + P < seq_lens[i] ? j * P + P : seq_lens[i];
    }
    attend_request_rows(parts_of, q, q_stride, k_cache, v_cache, kv_bf16, table, begins, ends,
                        R, num_heads, group, kv_lo, kv_hi, head_dim, block_size, block_stride,
                        scale, scores, P);
}

void attn_compute_window_part(float *restrict part, const float *restrict q,
                              const void *restrict k_cache, const void *restrict v_cache,
                              int kv_bf16, const int32_t *restrict table, int64_t seq_len,
                              int64_t window, int64_t j, int64_t num_heads, int64_t group,
                              int64_t head_dim, int64_t block_size, int64_t block_stride,
                              float scale, float *restrict scores) {
    const int32_t len = (int32_t)seq_len;
    float *const parts_of[1] = {part};
    attn_compute_rows_part(parts_of, q, num_heads * head_dim, k_cache, v_cache, kv_bf16, table,
                           &len, 1, window, j, num_heads, group, 0, num_heads / group,
                           head_dim, block_size, block_stride, scale, scores);
}

void attn_compute_part(float *restrict part, const float *restrict q,
                       const void *restrict k_cache, const void *restrict v_cache, int kv_bf16,
                       const int32_t *restrict table, int64_t seq_len, int64_t j,
                       int64_t num_heads, int64_t group, int64_t head_dim, int64_t block_size,
                       int64_t block_stride, float scale, float *restrict scores) {
    attn_compute_window_part(part, q, k_cache, v_cache, kv_bf16, table, seq_len, 0, j,
                             num_heads, group, head_dim, block_size, block_stride, scale,
                             scores);
}

void attn_combine_parts(float *restrict o, const float *restrict parts, int64_t num_parts,
                        int64_t num_heads, int64_t head_dim) {
    attend_combine(o, parts, attn_part_floats(num_heads, head_dim), (int)num_parts, num_heads,
                   head_dim);
}

/* A task: part `part` of `rows` consecutive rows from `row` on, one request's consecutive
 * tokens (seq_lens rising by one), attended together (attn_compute_rows_part). */
typedef struct {
    int64_t row, rows, part;
} attn_task;

/* Rows r0 .. r1 - 1 as tasks into `tasks` (at most their parts' count: every task holds a
 * part of at least one row); returns how many. */
static int64_t group_tasks(attn_task *tasks, const int32_t *row_to_req,
                           const int32_t *seq_lens, int64_t r0, int64_t r1,
                           int64_t block_size, int64_t window) {
    int64_t n = 0;
    for (int64_t r = r0, end; r < r1; r = end) {
        end = r + 1;
        while (end < r1 && end - r < ATTN_ROW_BLOCK && row_to_req[end] == row_to_req[r] &&
               seq_lens[end] == seq_lens[end - 1] + 1)
            end++;
        const int64_t first = attn_first_part(seq_lens[r], window, block_size);
        const int64_t last = attn_num_parts(seq_lens[end - 1], block_size);
        for (int64_t j = first; j < last; j++) tasks[n++] = (attn_task){r, end - r, j};
    }
    return n;
}

/* Rows r0 .. returned - 1: at most PARTS_PER_GROUP parts, at least one row. */
static int64_t group_end(const int64_t *starts, int64_t r0, int64_t num_rows) {
    int64_t r1 = r0 + 1;
    while (r1 < num_rows && starts[r1 + 1] - starts[r0] <= PARTS_PER_GROUP) r1++;
    return r1;
}

/* starts[num_rows + 1]: the first part of each row; -2 for a row the tables cannot hold. */
static int row_parts(int64_t *starts, const int32_t *row_to_req, const int32_t *seq_lens,
                     int64_t num_rows, int64_t num_reqs, int64_t table_stride,
                     int64_t block_size, int64_t window) {
    starts[0] = 0;
    for (int64_t r = 0; r < num_rows; r++) {
        if (row_to_req[r] < 0 || row_to_req[r] >= num_reqs || seq_lens[r] < 1 ||
            seq_lens[r] > table_stride * block_size)
            return -2;
        starts[r + 1] = starts[r] + attn_num_parts(seq_lens[r], block_size)
                        - attn_first_part(seq_lens[r], window, block_size);
    }
    return 0;
}

/* The groups of rows (group_end) and their tasks: group g is rows bounds[g] ..
 * bounds[g + 1] - 1 and tasks[task_at[g]] .. tasks[task_at[g + 1] - 1]. Returns the number
 * of groups; *most: the largest group's parts. */
static int64_t plan_groups(attn_task *tasks, int64_t *bounds, int64_t *task_at,
                           int64_t *most, const int64_t *starts, const int32_t *row_to_req,
                           const int32_t *seq_lens, int64_t num_rows, int64_t block_size,
                           int64_t window) {
    int64_t g = 0;
    task_at[0] = 0, *most = 1;
    for (int64_t r0 = 0, r1; r0 < num_rows; r0 = r1, g++) {
        r1 = group_end(starts, r0, num_rows);
        if (starts[r1] - starts[r0] > *most) *most = starts[r1] - starts[r0];
        bounds[g] = r0;
        task_at[g + 1] = task_at[g] + group_tasks(tasks + task_at[g], row_to_req, seq_lens,
                                                  r0, r1, block_size, window);
    }
    bounds[g] = num_rows;
    return g;
}

/* Each row of `task`'s part buffer for the task's part (in its group's buffers from
 * `parts`, whose first row's first part is starts' entry `first`), NULL where the row has
 * no such part. */
static void task_parts(float **parts_of, attn_task task, const int64_t *starts, int64_t first,
                       const int32_t *seq_lens, int64_t window, int64_t block_size,
                       float *parts, int64_t stride) {
    for (int64_t i = 0; i < task.rows; i++) {
        const int64_t r = task.row + i;
        const int64_t j0 = attn_first_part(seq_lens[r], window, block_size);
        parts_of[i] = task.part >= j0 && task.part < starts[r + 1] - starts[r] + j0
                          ? parts + (starts[r] - first + task.part - j0) * stride
                          : NULL;
    }
}

/* window > 0: each row sees only its last `window` positions (a sliding window; the
 * table entries before them are never read). Returns 0, -1 when out of memory, -2 for a
 * row_to_req or seq_len out of range (nothing computed). */
int paged_attention_f32(float *restrict out, const float *restrict q,
                        const void *restrict kv_cache, int kv_bf16, int64_t num_blocks,
                        const int32_t *restrict block_tables, int64_t table_stride,
                        int64_t num_reqs, const int32_t *restrict row_to_req,
                        const int32_t *restrict seq_lens, int64_t num_rows, int64_t num_heads,
                        int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                        int64_t window, float scale, int num_threads) {
    const int64_t group = num_heads / num_kv_heads, q_size = num_heads * head_dim;
    const int64_t block_stride = block_size * num_kv_heads * head_dim;
    const int64_t stride = attn_part_floats(num_heads, head_dim);
    const void *k_cache = kv_cache;
    const void *v_cache = (const char *)kv_cache
                          + (size_t)(num_blocks * block_stride) * (kv_bf16 ? 2 : 4);
    int64_t *starts = malloc(sizeof(int64_t) * (size_t)(3 * num_rows + 3));
    if (starts == NULL) return -1;
    if (row_parts(starts, row_to_req, seq_lens, num_rows, num_reqs, table_stride, block_size,
                  window)) {
        free(starts);
        return -2;
    }
    int64_t *bounds = starts + num_rows + 1, *task_at = bounds + num_rows + 1, most;
    attn_task *tasks = malloc(sizeof(attn_task) * (size_t)(starts[num_rows] + 1));
    const int64_t num_groups = tasks == NULL ? 0
        : plan_groups(tasks, bounds, task_at, &most, starts, row_to_req, seq_lens, num_rows,
                      block_size, window);
    float *parts = tasks == NULL ? NULL : malloc(sizeof(float) * (size_t)(most * stride));
    if (parts == NULL) {
        free(tasks), free(starts);
        return -1;
    }
    const size_t score_bytes = (sizeof(float) * (size_t)(ATTN_ROW_BLOCK * num_heads
                                                         * attn_part_len(block_size))
                                + 63) / 64 * 64;
    int failed = 0;

#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *scores = aligned_alloc(64, score_bytes);
        if (scores == NULL) failed = 1;
        /* Every thread walks the same groups; a thread without memory still meets every
         * barrier (and the step reports failure). */
        for (int64_t g = 0; g < num_groups; g++) {
            const int64_t r0 = bounds[g], r1 = bounds[g + 1], first = starts[r0];
#pragma omp for schedule(dynamic, 1)
            for (int64_t t = task_at[g]; t < task_at[g + 1]; t++) {
                if (scores == NULL) continue;
                float *parts_of[ATTN_ROW_BLOCK];
                task_parts(parts_of, tasks[t], starts, first, seq_lens, window, block_size,
                           parts, stride);
                const int64_t row = tasks[t].row;
                attn_compute_rows_part(parts_of, q + row * q_size, q_size, k_cache, v_cache,
                                       kv_bf16, block_tables + row_to_req[row] * table_stride,
                                       seq_lens + row, tasks[t].rows, window, tasks[t].part,
                                       num_heads, group, 0, num_heads / group, head_dim,
                                       block_size, block_stride, scale, scores);
            } /* implicit barrier: the group's parts complete */
#pragma omp for schedule(static)
            for (int64_t r = r0; r < r1; r++)
                attn_combine_parts(out + r * q_size, parts + (starts[r] - first) * stride,
                                   starts[r + 1] - starts[r], num_heads, head_dim);
            /* implicit barrier: parts free for the next group */
        }
        free(scores);
    }
    free(tasks);
    free(parts);
    free(starts);
    return failed ? -1 : 0;
}
