/* Structured output's token mask applied in place to fp32 logits: for each constrained row,
 * every token whose bit is clear in the row's bitmask (llguidance's layout: 32 tokens per
 * int32 word, token i at bit i % 32 of word i / 32) becomes -inf, as do tokens past the
 * mask's last word. One pass over the row, skipping whole words that allow all 32 tokens:
 * unpacking the bits to a bool tensor and masked_fill over 64 rows of a 49k vocabulary took
 * a large share of a SmolLM2 decode step; this takes a small fraction of that. */
#include <stdint.h>

#include "cpu_common.h"

static void mask_row(float *x, long vocab, const uint32_t *bits, long words) {
    const long covered = words * 32 < vocab ? words * 32 : vocab;
    for (long w = 0; w * 32 < covered; w++) {
        const uint32_t word = bits[w];
        if (word == 0xffffffffu) continue;
        const long base = w * 32, end = base + 32 < covered ? base + 32 : covered;
        if (word == 0u) {
            for (long i = base; i < end; i++) x[i] = -INFINITY;
            continue;
        }
        for (long i = base; i < end; i++)
            if (!((word >> (i - base)) & 1u)) x[i] = -INFINITY;
    }
    for (long i = covered; i < vocab; i++) x[i] = -INFINITY;
}

int apply_token_bitmask(float *logits, long vocab, long row_stride, const int64_t *rows,
                        long num_rows, const int32_t *bits, long words, int num_threads) {
    #pragma omp parallel for num_threads(num_threads) if (num_rows * vocab >= 4 * PARALLEL_MIN_ELEMENTS)
    for (long k = 0; k < num_rows; k++)
        mask_row(logits + rows[k] * row_stride, vocab, (const uint32_t *)(bits + k * words), words);
    return 0;
}

/* Greedy choice under the mask, without applying it: the first index of the largest allowed
 * logit (the first allowed NaN, as torch.argmax counts NaN largest), or 0 when no allowed
 * token is above -inf, as torch.argmax of a row masked to all -inf. What argmax gives after
 * apply_token_bitmask, with no copy of the logits and no writes: a constrained greedy row
 * reads only the words its grammar allows. */
static int64_t masked_row_argmax(const float *x, long vocab, const uint32_t *bits, long words) {
    const long covered = words * 32 < vocab ? words * 32 : vocab;
    float best = -INFINITY;
    int64_t at = -1;
    for (long w = 0; w * 32 < covered; w++) {
        uint32_t word = bits[w];
        const long base = w * 32, width = covered - base < 32 ? covered - base : 32;
        if (width < 32) word &= (1u << width) - 1u;
        if (word == 0u) continue;
        if (word == 0xffffffffu) {
            for (long i = base; i < base + 32; i++) {
                const float v = x[i];
                if (v != v) return i;
                if (v > best) { best = v; at = i; }
            }
            continue;
        }
        while (word) {
            const long i = base + __builtin_ctz(word);
            const float v = x[i];
            if (v != v) return i;
            if (v > best) { best = v; at = i; }
            word &= word - 1u;
        }
    }
    return at < 0 ? 0 : at;
}

int argmax_masked_rows(const float *logits, long vocab, long row_stride, const int64_t *rows,
                       long num_rows, const int32_t *bits, long words, int64_t *out,
                       int num_threads) {
    #pragma omp parallel for num_threads(num_threads) if (num_rows * vocab >= 4 * PARALLEL_MIN_ELEMENTS)
    for (long k = 0; k < num_rows; k++)
        out[k] = masked_row_argmax(logits + rows[k] * row_stride, vocab,
                                   (const uint32_t *)(bits + k * words), words);
    return 0;
}
