/* y = x W^T for a linear layer kept in GGUF blocks (Q8_0, Q4_0, Q4_1), for a few rows of x.
 *
 * Decoding one or a few requests is bound by reading the weights: dequantizing a whole
 * layer to fp32 first (the torch path) writes and reads 4 bytes per weight, where the
 * blocks hold 0.56-1.06. This kernel reads each block once, dequantizes its 32 weights
 * into registers with gguf's own fp32 arithmetic (built without FMA contraction, so the
 * weights equal gguf.quants.dequantize bit for bit), and multiplies them into every row of
 * x. Output rows are split across torch's OpenMP threads (see cpu_native.py). Sums run in
 * a fixed order per output, not BLAS's, so results differ from dequantize + F.linear by
 * rounding only.
 */
#include <stdint.h>
#include <string.h>

#define QK 32
#define MAX_ROWS 16

#ifdef __F16C__
#include <immintrin.h>
static inline float f16_to_f32(uint16_t h) { return _cvtsh_ss(h); }  /* exact, one instruction */
#else
static inline float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ffu, bits;
    if (exponent == 0x1f) {
        bits = sign | 0x7f800000u | (mantissa << 13);  /* inf / NaN */
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else if (mantissa == 0) {
        bits = sign;
    } else {  /* subnormal: normalise */
        exponent = 113;
        while ((mantissa & 0x400u) == 0) { mantissa <<= 1; exponent--; }
        bits = sign | (exponent << 23) | ((mantissa & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}
#endif

static inline uint16_t read_u16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

/* One block's 32 weights, as gguf.quants computes them. type: 0 Q8_0, 1 Q4_0, 2 Q4_1. */
static inline void dequantize_block(int type, const uint8_t *b, float *w) {
    const float d = f16_to_f32(read_u16(b));
    if (type == 0) {
        const int8_t *q = (const int8_t *)(b + 2);
        for (int j = 0; j < QK; j++) w[j] = (float)q[j] * d;
    } else if (type == 1) {
        const uint8_t *q = b + 2;
        for (int j = 0; j < QK / 2; j++) {
            w[j] = d * (float)((int)(q[j] & 0x0f) - 8);
            w[j + QK / 2] = d * (float)((int)(q[j] >> 4) - 8);
        }
    } else {
        const float m = f16_to_f32(read_u16(b + 2));
        const uint8_t *q = b + 4;
        for (int j = 0; j < QK / 2; j++) {
            w[j] = d * (float)(q[j] & 0x0f) + m;
            w[j + QK / 2] = d * (float)(q[j] >> 4) + m;
        }
    }
}

static const int BLOCK_BYTES[3] = {34, 18, 20};

/* x [m, k] fp32 row-major, blocks [n, k / 32 * block bytes], y [m, y_stride] fp32: writes
 * columns [0, n) of y. Returns -1 when m > MAX_ROWS or the type is unknown. */
int gguf_matmul(int type, const uint8_t *blocks, int n, int k, const float *x, int m,
                float *y, long y_stride, int num_threads) {
    if (m > MAX_ROWS || m < 1 || type < 0 || type > 2 || k % QK) return -1;
    const long row_bytes = (long)(k / QK) * BLOCK_BYTES[type];
    #pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int row = 0; row < n; row++) {
        /* Lane-wise partial sums across blocks, reduced once per output at the end: a
         * horizontal sum per 32-weight block would cost as much as the block itself. */
        float acc[MAX_ROWS][QK];
        float w[QK];
        memset(acc, 0, sizeof(float) * QK * m);
        const uint8_t *b = blocks + row * row_bytes;
        for (int block = 0; block < k / QK; block++, b += BLOCK_BYTES[type]) {
            dequantize_block(type, b, w);
            for (int r = 0; r < m; r++) {
                const float *xr = x + (long)r * k + block * QK;
                for (int j = 0; j < QK; j++) acc[r][j] += w[j] * xr[j];
            }
        }
        for (int r = 0; r < m; r++) {
            float sum = 0.0f;
            for (int j = 0; j < QK; j++) sum += acc[r][j];
            y[r * y_stride + row] = sum;
        }
    }
    return 0;
}
