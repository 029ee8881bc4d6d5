/*
 * The greedy token of each row of logits: out[r] = the index of row r's largest element, the
 * first of equal ones, a NaN counting as the largest (the first NaN): torch.argmax's rule,
 * so a greedy token never depends on which path picked it.
 *
 * torch's CPU argmax walks a row one element at a time with its index (1.9 ms for 32 rows
 * of a 49,152-token vocabulary, a fifteenth of a 32-row decode step on the AMX Xeon). In
 * vector lanes, each lane keeping its largest value and the first index holding it, a row
 * costs about what reading it does. The compiler does not vectorise the lane loop written
 * in C (the index select defeats it), hence the intrinsics; the baseline build walks.
 */
#include <math.h>
#include <stdint.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "parallel.h"

/* The first NaN of x [n], or -1. */
static int64_t first_nan(const float *restrict x, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (x[i] != x[i]) return i;
    return -1;
}

#if defined(__AVX512F__)
/* Lane l sees elements l, l + 16, ... in order and keeps a strictly larger one, so it holds
 * its first largest; across lanes the largest value wins and equals go to the smaller
 * index. Indices in int32 lanes (a row is far below 2^31 elements). */
static int64_t argmax_row(const float *restrict x, int64_t n) {
    __m512 best = _mm512_set1_ps(-INFINITY);
    __m512i at = _mm512_set1_epi32(-1), idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8,
                                                                 9, 10, 11, 12, 13, 14, 15);
    const __m512i step = _mm512_set1_epi32(16);
    __mmask16 nan = 0;
    for (int64_t p = 0; p < n; p += 16) {
        const __mmask16 in = n - p >= 16 ? 0xFFFF : (__mmask16)((1u << (n - p)) - 1);
        const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), in, x + p);
        const __mmask16 gt = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        best = _mm512_mask_mov_ps(best, gt, v);
        at = _mm512_mask_mov_epi32(at, gt, idx);
        idx = _mm512_add_epi32(idx, step);
    }
    if (nan) return first_nan(x, n);
    const float mx = _mm512_reduce_max_ps(best);
    if (mx == -INFINITY) return 0;  /* every element -inf: the first */
    const __mmask16 top = _mm512_cmp_ps_mask(best, _mm512_set1_ps(mx), _CMP_EQ_OQ);
    return _mm512_mask_reduce_min_epi32(top, at);
}
#elif defined(__AVX2__)
/* As the AVX-512 row, in 8 lanes. */
static int64_t argmax_row(const float *restrict x, int64_t n) {
    __m256 best = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
    __m256i at = _mm256_set1_epi32(-1), idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i step = _mm256_set1_epi32(8);
    int64_t p = 0;
    for (; p + 8 <= n; p += 8) {
        const __m256 v = _mm256_loadu_ps(x + p);
        const __m256 gt = _mm256_cmp_ps(v, best, _CMP_GT_OQ);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        best = _mm256_blendv_ps(best, v, gt);
        at = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(at),
                                                  _mm256_castsi256_ps(idx), gt));
        idx = _mm256_add_epi32(idx, step);
    }
    if (_mm256_movemask_ps(nan)) return first_nan(x, n);
    float lanes[8];
    int32_t where[8];
    _mm256_storeu_ps(lanes, best);
    _mm256_storeu_si256((__m256i *)where, at);
    int64_t arg = 0;
    float mx = -INFINITY;
    for (int l = 0; l < 8; l++)  /* lanes that kept an element (each > -inf) */
        if (where[l] >= 0 && (lanes[l] > mx || (lanes[l] == mx && where[l] < arg)))
            mx = lanes[l], arg = where[l];
    for (; p < n; p++) {  /* the tail, past every lane's index */
        if (x[p] != x[p]) return first_nan(x, n);
        if (x[p] > mx) mx = x[p], arg = p;
    }
    return mx == -INFINITY ? 0 : arg;  /* every element -inf: the first */
}
#else
static int64_t argmax_row(const float *restrict x, int64_t n) {
    int64_t arg = 0;
    for (int64_t i = 0; i < n; i++) {
        if (x[i] != x[i]) return i;
        if (x[i] > x[arg]) arg = i;
    }
    return arg;
}
#endif

void argmax_rows_f32(int64_t *restrict out, const float *restrict x, int64_t rows, int64_t n,
                     int num_threads) {
    /* Threads from 2 rows of a large vocabulary on (a row is tens of microseconds). */
    PARALLEL_FOR(r, rows, n >= 16384 ? 2 : 64, out[r] = argmax_row(x + r * n, n));
}
