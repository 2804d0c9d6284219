/* Greedy sampling's argmax over each row of fp32 logits [rows][vocab], rows across threads:
 * one read of the logits at memory speed, where torch's argmax over 64 rows of a 49k
 * vocabulary took 4 ms of a SmolLM2 decode step. As torch.argmax: the first index of the
 * largest value, and a NaN counts as larger than any number (the first NaN wins). */
#include <stdint.h>

#include "cpu_common.h"

static int64_t row_argmax(const float *x, long n) {
    /* Eight running maxima in lanes the compiler vectorizes; ties resolved to the lowest
     * index afterwards. */
    float best[8];
    int64_t at[8];
    for (int j = 0; j < 8; j++) { best[j] = -INFINITY; at[j] = -1; }
    int has_nan = 0;
    long i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) {
            const float v = x[i + j];
            has_nan |= v != v;
            if (v > best[j]) { best[j] = v; at[j] = i + j; }
        }
    float top = -INFINITY;
    int64_t index = -1;
    for (int j = 0; j < 8; j++)
        if (at[j] >= 0 && (best[j] > top || (best[j] == top && at[j] < index)))
            { top = best[j]; index = at[j]; }
    for (; i < n; i++) {
        has_nan |= x[i] != x[i];
        if (x[i] > top) { top = x[i]; index = i; }
    }
    if (has_nan)  /* rare: find the first one */
        for (long k = 0; k < n; k++)
            if (x[k] != x[k]) return k;
    return index < 0 ? 0 : index;  /* every value -inf (or no values): torch says 0 */
}

int argmax_rows(const float *logits, long rows, long vocab, long row_stride, int64_t *out,
                int num_threads) {
    #pragma omp parallel for num_threads(num_threads) if (rows * vocab >= 4 * PARALLEL_MIN_ELEMENTS)
    for (long r = 0; r < rows; r++) out[r] = row_argmax(logits + r * row_stride, vocab);
    return 0;
}
