/* Rotary embedding applied in place to a [tokens, heads, head_dim] view (q or k inside
 * the qkv projection's output), reading the fp32 cos/sin tables by position directly: no
 * per-step gather of the tables, no rotate_half copy, no new tensor.
 *
 * Rounding is transformers' op by op (`x * cos + rotate_half(x) * sin`, built with
 * -ffp-contract=off): in bf16 the tables are rounded to bf16 first and each product and
 * the sum are rounded, so results equal `kernels/cpu_fused.py`'s torch reference exactly.
 *
 * dtype 0 = fp32, 1 = bf16. Heads of a token are contiguous (head stride = head_dim);
 * tokens are `token_stride` elements apart. Returns 0, or -2 when a position is outside
 * the tables' `table_rows`. */
#include "cpu_common.h"

static void token_f32(float *x, int num_heads, int head_dim, const float *cos,
                      const float *sin) {
    const int half = head_dim / 2;
    for (int h = 0; h < num_heads; h++) {
        float *xh = x + (long)h * head_dim;
        for (int d = 0; d < half; d++) {
            const float a = xh[d], b = xh[d + half];
            xh[d] = a * cos[d] + -b * sin[d];
            xh[d + half] = b * cos[d + half] + a * sin[d + half];
        }
    }
}

/* Each product and the sum rounded to bf16, as the stored result of each torch op is. The
 * token's table rows are rounded to bf16 once, not once per head (the heads share them),
 * measurably faster for a 2,048-token prefill's 9 heads x 64 on 2 threads. Head dims past
 * ROTARY_MAX_HEAD_DIM are refused (-3); cpu_fused.rotary_ sends them to the reference. */
#define ROTARY_MAX_HEAD_DIM 512

static void token_bf16(uint16_t *x, int num_heads, int head_dim, const float *cos,
                       const float *sin) {
    const int half = head_dim / 2;
    float c[ROTARY_MAX_HEAD_DIM], s[ROTARY_MAX_HEAD_DIM];
    for (int d = 0; d < head_dim; d++) {
        c[d] = round_bf16(cos[d]);
        s[d] = round_bf16(sin[d]);
    }
    for (int h = 0; h < num_heads; h++) {
        uint16_t *xh = x + (long)h * head_dim;
        for (int d = 0; d < half; d++) {
            const float a = bf16_to_f32(xh[d]), b = bf16_to_f32(xh[d + half]);
            const float lo = round_bf16(a * c[d]) + round_bf16(-b * s[d]);
            const float hi = round_bf16(b * c[d + half]) + round_bf16(a * s[d + half]);
            xh[d] = f32_to_bf16(lo);
            xh[d + half] = f32_to_bf16(hi);
        }
    }
}

int rotary_inplace(int dtype, void *x, long num_tokens, long token_stride, int num_heads,
                   int head_dim, const int64_t *positions, const float *cos, const float *sin,
                   long table_rows, int num_threads) {
    for (long t = 0; t < num_tokens; t++)
        if (positions[t] < 0 || positions[t] >= table_rows) return -2;
    if (dtype != 0 && head_dim > ROTARY_MAX_HEAD_DIM) return -3;
    #pragma omp parallel for num_threads(num_threads) \
        if (num_tokens * num_heads * head_dim >= PARALLEL_MIN_ELEMENTS)
    for (long t = 0; t < num_tokens; t++) {
        const long row = positions[t] * head_dim;
        if (dtype == 0) {
            token_f32((float *)x + t * token_stride, num_heads, head_dim, cos + row, sin + row);
        } else {
            token_bf16((uint16_t *)x + t * token_stride, num_heads, head_dim, cos + row,
                       sin + row);
        }
    }
    return 0;
}
