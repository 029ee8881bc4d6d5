/* The float32 storage's tiles (gemm_float.h), a translation unit of their own. */
#include "gemm_float.h"

void gemm_f32_tile(float *restrict y, int64_t ldy, const float *restrict x,
                   const char *restrict w, int64_t panel_bytes, int64_t k, int64_t c0,
                   int64_t n, const float *restrict scales, const float *restrict bias,
                   int64_t mr, int64_t np) {
    gemm_float_tile(y, ldy, x, w, panel_bytes, k, c0, n, scales, bias, mr, np, GEMM_F32P);
}
