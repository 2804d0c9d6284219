/* RMSNorm with the residual add before it, in one pass over each row (vLLM's
 * fused_add_rms_norm): residual += x in place, then out = weight * normalize(residual).
 * With residual NULL it is the plain norm of x.
 *
 * Rounding is transformers' op by op, so results equal `kernels/cpu_fused.py`'s torch
 * reference: in bf16 the sum is rounded to bf16 before it is stored and normalized, the
 * normalized row is rounded before the weight multiply, and the product is rounded again
 * (LlamaRMSNorm casts back before `weight *`). Sums of squares are fp32; built with
 * -ffp-contract=off so no multiply-add is fused where torch rounds twice. Only the order
 * of the sum of squares differs from torch's (about 1e-7 relative).
 *
 * dtype 0 = fp32, 1 = bf16 for x, residual, weight and out alike; rows contiguous. */
#include "cpu_common.h"

#define DEFINE_ROW(NAME, T, LOAD, STORE)                                                     \
static void NAME(const T *x, T *residual, const T *weight, T *out, int width, float eps) {   \
    float sum = 0.0f;                                                                        \
    if (residual != 0) {                                                                     \
        for (int i = 0; i < width; i++) {                                                    \
            const float r = LOAD(STORE(LOAD(residual[i]) + LOAD(x[i])));                     \
            residual[i] = STORE(r);                                                          \
            sum += r * r;                                                                    \
        }                                                                                    \
    } else {                                                                                 \
        for (int i = 0; i < width; i++) { const float v = LOAD(x[i]); sum += v * v; }        \
    }                                                                                        \
    const T *src = residual != 0 ? residual : x;                                             \
    const float inv = 1.0f / sqrtf(sum / (float)width + eps);                                \
    for (int i = 0; i < width; i++)                                                          \
        out[i] = STORE(LOAD(weight[i]) * LOAD(STORE(LOAD(src[i]) * inv)));                   \
}

#define ID(x) (x)
DEFINE_ROW(row_f32, float, ID, ID)
DEFINE_ROW(row_bf16, uint16_t, bf16_to_f32, f32_to_bf16)

int add_rms_norm(int dtype, const void *x, void *residual, const void *weight, void *out,
                 long rows, int width, float eps, int num_threads) {
    #pragma omp parallel for num_threads(num_threads) if (rows * width >= PARALLEL_MIN_ELEMENTS)
    for (long r = 0; r < rows; r++) {
        const long at = r * width;
        if (dtype == 0) {
            row_f32((const float *)x + at, residual ? (float *)residual + at : 0,
                    weight, (float *)out + at, width, eps);
        } else {
            row_bf16((const uint16_t *)x + at, residual ? (uint16_t *)residual + at : 0,
                     weight, (uint16_t *)out + at, width, eps);
        }
    }
    return 0;
}
