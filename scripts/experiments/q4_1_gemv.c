/*
 * Experiment (issue 12): would a decode gemv that reads the GGUF's Q4_1 blocks directly
 * (20 bytes per 32 weights: fp16 d, fp16 m, 16 bytes of nibbles; w = d q + m) beat our
 * per-row int8 gemv (kernels/cpu/gemv.h, 32 bytes per 32 weights)? Two Q4_1 forms:
 *   q4_1_f32x: x stays float32, nibbles widened to float in registers (the int8
 *              weight-only gemv's arithmetic): y = sum_b d_b (q_b . x_b) + m_b sum(x_b)
 *   q4_1_q8x:  x quantized per 32-block to int8 (llama.cpp's Q4_1 x Q8_1), nibble x int8
 *              sums with AVX512-VNNI (vpdpbusd), one float scale per block
 * Both against int8 (widened, weight-only) and int8 W8A8 (VNNI), over the same number of
 * weights as SmolLM2-135M's layers, 2 threads. Build and run:
 *   gcc -O3 -march=native -fopenmp q4_1_gemv.c -o /tmp/q41 && /tmp/q41
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define K 576
#define N (106 * 1000 * 1000 / K) /* ~ the layers' weights */
#define NB (K / 32)

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static inline float h2f(uint16_t h) { return _cvtsh_ss(h); }

/* Q4_1 row r, float x. */
static float row_q41_f32x(const uint8_t *row, const float *x, const float *xsum) {
    __m256 acc = _mm256_setzero_ps();
    float t = 0.0f;
    for (int b = 0; b < NB; b++) {
        const uint8_t *blk = row + b * 20;
        uint16_t dh, mh;
        memcpy(&dh, blk, 2);
        memcpy(&mh, blk + 2, 2);
        const __m128i qs = _mm_loadu_si128((const __m128i *)(blk + 4));
        const __m128i lo = _mm_and_si128(qs, _mm_set1_epi8(0x0F));
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(qs, 4), _mm_set1_epi8(0x0F));
        const float *xb = x + b * 32;
        __m256 dot = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), _mm256_loadu_ps(xb));
        dot = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), _mm256_loadu_ps(xb + 8), dot);
        dot = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), _mm256_loadu_ps(xb + 16), dot);
        dot = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), _mm256_loadu_ps(xb + 24), dot);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(h2f(dh)), dot, acc);
        t += h2f(mh) * xsum[b];
    }
    float l[8];
    _mm256_storeu_ps(l, acc);
    return t + l[0] + l[1] + l[2] + l[3] + l[4] + l[5] + l[6] + l[7];
}

/* Q4_1 row r, x as int8 per 32-block (xq, scales sx): nibbles (u8) x int8 with VNNI; each
 * block's 8 int32 lanes go to float and into a float accumulator times d_b s_x,b (no
 * horizontal sum per block, as llama.cpp's kernels do). */
static float row_q41_q8x(const uint8_t *row, const int8_t *xq, const float *sx, const float *xsum) {
    __m256 acc = _mm256_setzero_ps();
    float t = 0.0f;
    for (int b = 0; b < NB; b++) {
        const uint8_t *blk = row + b * 20;
        uint16_t dh, mh;
        memcpy(&dh, blk, 2);
        memcpy(&mh, blk + 2, 2);
        const __m128i qs = _mm_loadu_si128((const __m128i *)(blk + 4));
        const __m128i lo = _mm_and_si128(qs, _mm_set1_epi8(0x0F));
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(qs, 4), _mm_set1_epi8(0x0F));
        const __m256i q = _mm256_set_m128i(hi, lo);
        const __m256i dot = _mm256_dpbusd_epi32(_mm256_setzero_si256(), q,
                                                _mm256_loadu_si256((const __m256i *)(xq + b * 32)));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(h2f(dh) * sx[b]), acc);
        t += h2f(mh) * xsum[b];
    }
    float l[8];
    _mm256_storeu_ps(l, acc);
    return t + l[0] + l[1] + l[2] + l[3] + l[4] + l[5] + l[6] + l[7];
}

/* int8 weight-only row (float x). */
static float row_i8(const int8_t *row, const float *x) {
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int d = 0; d < K; d += 32)
        for (int a = 0; a < 4; a++)
            acc[a] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(row + d + 8 * a)))),
                                     _mm256_loadu_ps(x + d + 8 * a), acc[a]);
    float l[8];
    _mm256_storeu_ps(l, _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
    return l[0] + l[1] + l[2] + l[3] + l[4] + l[5] + l[6] + l[7];
}

int main(void) {
    uint8_t *q41 = aligned_alloc(64, (size_t)N * NB * 20);
    int8_t *i8 = aligned_alloc(64, (size_t)N * K);
    for (size_t i = 0; i < (size_t)N * NB * 20; i++) q41[i] = (uint8_t)(i * 2654435761u >> 13);
    for (size_t r = 0; r < (size_t)N; r++)
        for (int b = 0; b < NB; b++) { /* sane fp16 d, m: 0.01, -0.05 */
            const uint16_t d = 0x211F, m = 0xAA66;
            memcpy(q41 + (r * NB + b) * 20, &d, 2);
            memcpy(q41 + (r * NB + b) * 20 + 2, &m, 2);
        }
    for (size_t i = 0; i < (size_t)N * K; i++) i8[i] = (int8_t)(i * 2654435761u >> 11);
    float x[K], xsum[NB], sx[NB];
    int8_t xq[K];
    for (int i = 0; i < K; i++) x[i] = (float)((i * 37) % 17) / 17.0f - 0.5f;
    for (int b = 0; b < NB; b++) {
        float s = 0, amax = 0;
        for (int j = 0; j < 32; j++) { s += x[b * 32 + j]; amax = amax > __builtin_fabsf(x[b * 32 + j]) ? amax : __builtin_fabsf(x[b * 32 + j]); }
        xsum[b] = s; sx[b] = amax / 127.0f;
        for (int j = 0; j < 32; j++) xq[b * 32 + j] = (int8_t)__builtin_nearbyintf(x[b * 32 + j] / sx[b]);
    }
    float *y = malloc(sizeof(float) * N);
    const char *names[3] = {"q4_1, float x", "q4_1, int8 x (VNNI)", "int8 weight-only"};
    const double bytes[3] = {(double)N * NB * 20, (double)N * NB * 20, (double)N * K};
    for (int kind = 0; kind < 3; kind++) {
        double best = 1e9;
        for (int rep = 0; rep < 20; rep++) {
            const double t0 = now();
#pragma omp parallel for num_threads(2) schedule(static)
            for (int r = 0; r < N; r++)
                y[r] = kind == 0 ? row_q41_f32x(q41 + (size_t)r * NB * 20, x, xsum)
                     : kind == 1 ? row_q41_q8x(q41 + (size_t)r * NB * 20, xq, sx, xsum)
                                 : row_i8(i8 + (size_t)r * K, x);
            const double dt = now() - t0;
            best = dt < best ? dt : best;
        }
        printf("%-22s %6.2f ms per pass over the layers' weights, %5.1f GB/s (checksum %g)\n",
               names[kind], best * 1e3, bytes[kind] / best / 1e9, (double)y[N / 2]);
    }
    return 0;
}
