/* Writes a step's keys and values into their cache slots: one row copy per token, read
 * straight from the qkv projection's output (rows `stride` elements apart), where torch's
 * index_copy_ takes an element-wise path for such a strided source (many times slower for a
 * 2,048-token prefill: `python -m bench.worker_ops`, which writes bench/results/worker_ops.md).
 *
 * Rows of `row_bytes` (num_kv_heads * head_dim elements); caches [num_slots][row]. Slot -1
 * means "do not store". Returns 0, or -2 (nothing written) when a slot is past num_slots. */
#include <stdint.h>
#include <string.h>

#include "cpu_common.h"

int store_kv(const char *key, const char *value, long key_stride_bytes,
             long value_stride_bytes, char *k_cache, char *v_cache, const int64_t *slots,
             long num_tokens, long row_bytes, long num_slots, int num_threads) {
    for (long t = 0; t < num_tokens; t++)
        if (slots[t] < -1 || slots[t] >= num_slots) return -2;
    #pragma omp parallel for num_threads(num_threads) \
        if (num_tokens * row_bytes >= 4 * PARALLEL_MIN_ELEMENTS)
    for (long t = 0; t < num_tokens; t++) {
        const long slot = slots[t];
        if (slot < 0) continue;
        memcpy(k_cache + slot * row_bytes, key + t * key_stride_bytes, row_bytes);
        memcpy(v_cache + slot * row_bytes, value + t * value_stride_bytes, row_bytes);
    }
    return 0;
}
