/* Greedy sampling's argmax over each row of fp32 logits [rows][vocab], rows across threads:
 * one read of the logits at memory speed, where torch's argmax over 64 rows of a 49k
 * vocabulary was a visible share of a SmolLM2 decode step. As torch.argmax: the first index
 * of the largest value, and a NaN counts as larger than any number (the first NaN wins). */
#include <stdint.h>
#include <string.h>

#include "cpu_common.h"

/* Two passes over the row, each of which the compiler vectorizes. First the largest value:
 * each float's bits mapped to an integer that orders as the floats do (negative ones with
 * their magnitude bits flipped), so the running maxima are integer maxima, which every
 * vector ISA has and which need no -ffast-math (a float `v > m ? v : m` is not vectorized
 * without it), with a NaN check beside them. Then the first index whose value equals that
 * largest one as a float (so -0.0 and +0.0 tie, as in torch), sixteen compared at a time;
 * the row, 196 KB for a 49k vocabulary, is still in L2 from the first pass. The one-pass
 * loop this replaced kept each lane's index too and was not vectorized, and measured slower.
 * `python -m bench.worker_ops` (which writes bench/results/worker_ops.md) times this against
 * torch.argmax, with torch.amax's one read of the logits as the floor. */
#define LANES 16

static inline int32_t order_key(uint32_t bits) {
    return (int32_t)(bits ^ ((uint32_t)((int32_t)bits >> 31) & 0x7fffffffu));
}

static inline float key_value(int32_t key) {
    const uint32_t bits = (uint32_t)key ^ ((uint32_t)(key >> 31) & 0x7fffffffu);
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

static int64_t row_argmax(const float *x, long n) {
    const uint32_t *bits = (const uint32_t *)(const void *)x;
    int32_t lane[LANES];
    for (int j = 0; j < LANES; j++) lane[j] = INT32_MIN;
    uint32_t nan = 0;  /* nonzero once a NaN (exponent all ones, mantissa nonzero) is seen */
    long i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; j++) {
            const uint32_t b = bits[i + j];
            nan |= (b & 0x7fffffffu) > 0x7f800000u;
            const int32_t key = order_key(b);
            lane[j] = key > lane[j] ? key : lane[j];
        }
    int32_t top_key = INT32_MIN;
    for (int j = 0; j < LANES; j++) top_key = lane[j] > top_key ? lane[j] : top_key;
    for (; i < n; i++) {
        nan |= (bits[i] & 0x7fffffffu) > 0x7f800000u;
        const int32_t key = order_key(bits[i]);
        top_key = key > top_key ? key : top_key;
    }
    if (nan) {  /* rare: the first NaN is the answer */
        for (long k = 0; k < n; k++)
            if (x[k] != x[k]) return k;
    }
    const float top = key_value(top_key);
    long k = 0;
    if (top != 0.0f) {  /* equal as floats = equal bits (no NaN, no signed zero): integers */
        uint32_t top_bits;
        memcpy(&top_bits, &top, sizeof top_bits);
        for (; k + LANES <= n; k += LANES) {
            uint32_t hit = 0;
            for (int j = 0; j < LANES; j++) hit |= bits[k + j] == top_bits;
            if (hit) break;
        }
    }
    for (; k < n; k++)
        if (x[k] == top) return k;
    return 0;  /* no values at all: torch says 0 */
}

int argmax_rows(const float *logits, long rows, long vocab, long row_stride, int64_t *out,
                int num_threads) {
    #pragma omp parallel for num_threads(num_threads) if (rows * vocab >= 4 * PARALLEL_MIN_ELEMENTS)
    for (long r = 0; r < rows; r++) out[r] = row_argmax(logits + r * row_stride, vocab);
    return 0;
}
