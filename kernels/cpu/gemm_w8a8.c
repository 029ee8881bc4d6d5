/* The W8A8 tiles (gemm_w8a8.h) in a translation unit of their own, compiled beside
 * gemm.c's. */
#include "gemm_w8a8.h"

void gemm_w8a8_tile(float *restrict y, int64_t ldy, const uint8_t *restrict xq,
                    const uint8_t *restrict w, int64_t panel_bytes, int64_t k, int64_t c0,
                    int64_t n, const float *restrict scales, const float *restrict bias,
                    int64_t mr, int64_t np) {
    gemm_w8_tile_any(y, ldy, xq, w, panel_bytes, k, c0, n, scales, bias, mr, np);
}
