/* The Q4_1 panel tiles (gemm_q4_1.h) in a translation unit of their own: the build compiles
 * each storage family's tiles in parallel (gemm.c alone took 34 s of one core). */
#include "gemm_q4_1.h"

void gemm_q41_tile(float *restrict y, int64_t ldy, const uint8_t *restrict xq,
                   const uint8_t *restrict w, int64_t panel_bytes, int64_t k, int64_t c0,
                   int64_t n, const float *restrict bias, int64_t mr, int64_t np) {
    gemm_q41_tile_any(y, ldy, xq, w, panel_bytes, k, c0, n, bias, mr, np);
}
