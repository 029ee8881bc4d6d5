/* The other GGUF block formats' tiles (gemm_blocks.h: Q8_0, Q4_0 and the K-quants) in a
 * translation unit of their own, compiled beside gemm.c's. */
#include "gemm_blocks.h"

void gemm_blocks_tile(int fmt, float *restrict y, int64_t ldy, const uint8_t *restrict xq,
                      const uint8_t *restrict w, int64_t panel_bytes, int64_t k, int64_t c0,
                      int64_t n, const float *restrict bias, int64_t mr, int64_t np) {
    gemm_blk_tile_any(fmt, y, ldy, xq, w, panel_bytes, k, c0, n, bias, mr, np);
}
