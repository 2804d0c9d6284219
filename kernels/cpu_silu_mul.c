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

/* In two passes over chunks of the row: SiLU in fp32 (the loop of row_f32), then the
 * rounding and the multiply. As one loop, GCC's vector code for it ran several times slower
 * than the fp32 row (on one thread at 2,048 x 1,536: a large part of a bf16 prefill step's
 * glue); as two it comes close to the fp32 row. */
#define SILU_CHUNK 512

static void row_bf16(const uint16_t *restrict gate_up, uint16_t *restrict out, long width) {
    const uint16_t *up = gate_up + width;
    float silu[SILU_CHUNK];
    for (long start = 0; start < width; start += SILU_CHUNK) {
        const long n = width - start < SILU_CHUNK ? width - start : SILU_CHUNK;
        for (long i = 0; i < n; i++) {
            const float g = bf16_to_f32(gate_up[start + i]);
            silu[i] = g / (1.0f + exp_approx(-g));
        }
        for (long i = 0; i < n; i++) {
            out[start + i] = f32_to_bf16(round_bf16(silu[i]) * bf16_to_f32(up[start + i]));
        }
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
