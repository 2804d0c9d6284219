/* Paged decode attention for CPU, straight from the block tables: no gather.
 *
 * One query token per sequence. For each (sequence, KV head) the kernel walks the
 * sequence's blocks once, scoring all the query heads of that KV head's GQA group against
 * each key and folding each value in with an online softmax (running max and sum), so K
 * and V are read exactly once, in place. Accumulation is fp32 whatever the cache dtype.
 *
 * Layout (kernels/reference.py): cache [num_blocks, block_size, num_kv_heads, head_dim];
 * query and out [num_seqs, num_heads, head_dim]; heads h = kv * group + g share KV head kv.
 * Keys of a sequence at positions >= seq_len, and < seq_len - window when window > 0, are
 * never read. Built by kernels/cpu_native.py with the system C compiler.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {  /* round to nearest even, as torch does */
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);  /* NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* One (sequence, kv head): q [group][head_dim] fp32 in, acc [group][head_dim] fp32 out. */
#define DEFINE_ONE_HEAD(NAME, T, LOAD)                                                       \
static void NAME(const float *q, const T *k_cache, const T *v_cache,                         \
                 const int32_t *blocks, int first, int last, int block_size,                 \
                 int num_kv_heads, int head_dim, int group, int kv, float scale,             \
                 float *acc, float *scores, float *row_max, float *row_sum) {                \
    for (int g = 0; g < group; g++) { row_max[g] = -INFINITY; row_sum[g] = 0.0f; }           \
    memset(acc, 0, sizeof(float) * group * head_dim);                                        \
    const long token_stride = (long)num_kv_heads * head_dim;                                 \
    for (int pos = first; pos < last; ) {                                                    \
        const int block = blocks[pos / block_size];                                          \
        const int offset = pos % block_size;                                                 \
        const int count = (block_size - offset < last - pos) ? block_size - offset : last - pos; \
        const T *k = k_cache + ((long)block * block_size + offset) * token_stride + (long)kv * head_dim; \
        const T *v = v_cache + ((long)block * block_size + offset) * token_stride + (long)kv * head_dim; \
        for (int g = 0; g < group; g++) {                                                    \
            const float *qg = q + g * head_dim;                                              \
            float block_max = -INFINITY;                                                     \
            for (int t = 0; t < count; t++) {                                                \
                const T *kt = k + t * token_stride;                                          \
                float dot = 0.0f;                                                            \
                for (int d = 0; d < head_dim; d++) dot += qg[d] * LOAD(kt[d]);               \
                dot *= scale;                                                                \
                scores[g * block_size + t] = dot;                                            \
                if (dot > block_max) block_max = dot;                                        \
            }                                                                                \
            float new_max = row_max[g] > block_max ? row_max[g] : block_max;                 \
            float rescale = expf(row_max[g] - new_max);  /* 0 on the first block */          \
            float *ag = acc + g * head_dim;                                                  \
            if (rescale != 1.0f) {                                                           \
                for (int d = 0; d < head_dim; d++) ag[d] *= rescale;                         \
            }                                                                                \
            float sum = row_sum[g] * rescale;                                                \
            for (int t = 0; t < count; t++) {                                                \
                float p = expf(scores[g * block_size + t] - new_max);                        \
                sum += p;                                                                    \
                const T *vt = v + t * token_stride;                                          \
                for (int d = 0; d < head_dim; d++) ag[d] += p * LOAD(vt[d]);                 \
            }                                                                                \
            row_max[g] = new_max;                                                            \
            row_sum[g] = sum;                                                                \
        }                                                                                    \
        pos += count;                                                                        \
    }                                                                                        \
    for (int g = 0; g < group; g++) {                                                        \
        float inv = 1.0f / row_sum[g];                                                       \
        for (int d = 0; d < head_dim; d++) acc[g * head_dim + d] *= inv;                     \
    }                                                                                        \
}

#define LOAD_F32(x) (x)
#define LOAD_BF16(x) bf16_to_f32(x)
DEFINE_ONE_HEAD(one_head_f32, float, LOAD_F32)
DEFINE_ONE_HEAD(one_head_bf16, uint16_t, LOAD_BF16)

/* dtype: 0 = fp32, 1 = bf16 (query, caches and out share it). The (sequence, KV head)
 * pairs are split across `num_threads` OpenMP threads. Built with -fopenmp, this library
 * needs libgomp.so.1, which the loader resolves to the copy torch already loaded: the
 * kernel runs on torch's own thread pool instead of competing with it for the cores.
 * Returns 0, or -1 when out of memory. */
int paged_decode(int dtype, const void *query, const void *k_cache, const void *v_cache,
                 const int32_t *block_tables, int max_blocks, const int32_t *seq_lens,
                 void *out, int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                 int block_size, float scale, int window, int num_threads) {
    const int group = num_heads / num_kv_heads;
    const long num_pairs = (long)num_seqs * num_kv_heads;
    int failed = 0;
    #pragma omp parallel num_threads(num_threads) reduction(|:failed)
    {
        float *work = malloc(sizeof(float) * (2 * group * head_dim + group * block_size + 2 * group));
        if (work == NULL) {
            failed = 1;
        }
        float *q = work, *acc = q + group * head_dim, *scores = acc + group * head_dim;
        float *row_max = scores + group * block_size, *row_sum = row_max + group;
        #pragma omp for schedule(static)
        for (long pair = 0; pair < num_pairs; pair++) {
            if (work == NULL) continue;
            const int s = (int)(pair / num_kv_heads), kv = (int)(pair % num_kv_heads);
            const int last = seq_lens[s];
            const int first = (window > 0 && last - window > 0) ? last - window : 0;
            const int32_t *blocks = block_tables + (long)s * max_blocks;
            const long head0 = ((long)s * num_heads + (long)kv * group) * head_dim;
            if (dtype == 0) {
                memcpy(q, (const float *)query + head0, sizeof(float) * group * head_dim);
                one_head_f32(q, k_cache, v_cache, blocks, first, last, block_size,
                             num_kv_heads, head_dim, group, kv, scale, acc, scores, row_max,
                             row_sum);
                memcpy((float *)out + head0, acc, sizeof(float) * group * head_dim);
            } else {
                const uint16_t *qs = (const uint16_t *)query + head0;
                for (int i = 0; i < group * head_dim; i++) q[i] = bf16_to_f32(qs[i]);
                one_head_bf16(q, k_cache, v_cache, blocks, first, last, block_size,
                              num_kv_heads, head_dim, group, kv, scale, acc, scores, row_max,
                              row_sum);
                uint16_t *os = (uint16_t *)out + head0;
                for (int i = 0; i < group * head_dim; i++) os[i] = f32_to_bf16(acc[i]);
            }
        }
        free(work);
    }
    return failed ? -1 : 0;
}
