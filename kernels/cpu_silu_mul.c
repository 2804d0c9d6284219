/* SiLU(gate) * up over the gate|up projection's output [rows, 2 * width] into out
 * [rows, width], one pass, no intermediate tensors (vLLM's silu_and_mul).
 *
 * silu(g) = g / (1 + exp(-g)) with the vectorizable exp of cpu_common.h (within 2 ulp of
 * expf; torch's own vectorized exp differs from expf by up to 1). In bf16 the SiLU is
 * rounded to bf16 before the multiply and the product again, as torch's two ops round.
 *
 * dtype 0 = fp32, 1 = bf16; rows contiguous. */
#include "cpu_common.h"

static void row_f32(const float *gate_up, float *out, long width) {
    const float *up = gate_up + width;
    for (long i = 0; i < width; i++) {
        const float g = gate_up[i];
        out[i] = (g / (1.0f + exp_approx(-g))) * up[i];
    }
}

static void row_bf16(const uint16_t *gate_up, uint16_t *out, long width) {
    const uint16_t *up = gate_up + width;
    for (long i = 0; i < width; i++) {
        const float g = bf16_to_f32(gate_up[i]);
        const float silu = round_bf16(g / (1.0f + exp_approx(-g)));
        out[i] = f32_to_bf16(silu * bf16_to_f32(up[i]));
    }
}

int silu_mul(int dtype, const void *gate_up, void *out, long rows, long width,
             int num_threads) {
    #pragma omp parallel for num_threads(num_threads) if (rows * width >= PARALLEL_MIN_ELEMENTS)
    for (long r = 0; r < rows; r++) {
        if (dtype == 0) {
            row_f32((const float *)gate_up + 2 * r * width, (float *)out + r * width, width);
        } else {
            row_bf16((const uint16_t *)gate_up + 2 * r * width, (uint16_t *)out + r * width,
                     width);
        }
    }
    return 0;
}
