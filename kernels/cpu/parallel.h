/*
 * PARALLEL_FOR(t, n, min_n, body): `for (int64_t t = 0; t < n; t++) body`, as an OpenMP
 * parallel for over `num_threads` threads (a variable of that name must be in scope), or on
 * the calling thread alone when n < min_n.
 *
 * Below min_n the loop never enters OpenMP at all: even a region with if(0) makes libgomp
 * shrink the calling thread's team to one, and the next torch op with two threads (MKL's
 * gemv) then ran at a quarter of its speed (a 1-token decode step went from 18 to 51 ms of
 * forward). Every kernel with a per-token loop goes through this.
 */
#ifndef AIOENGINE_PARALLEL_H
#define AIOENGINE_PARALLEL_H

#include <stdint.h>

#define PARALLEL_FOR(t, n, min_n, ...)                                                     \
    do {                                                                                   \
        if ((n) < (min_n)) {                                                               \
            for (int64_t t = 0; t < (n); t++) { __VA_ARGS__; }                             \
        } else {                                                                           \
            _Pragma("omp parallel for num_threads(num_threads) schedule(static)")          \
            for (int64_t t = 0; t < (n); t++) { __VA_ARGS__; }                             \
        }                                                                                  \
    } while (0)

#endif /* AIOENGINE_PARALLEL_H */
