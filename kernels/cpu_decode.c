/* Paged decode attention for CPU, straight from the block tables: no gather.
 *
 * One query token per sequence. For each sequence the kernel walks its blocks once, scoring
 * every query head against its KV head's keys and folding the values in with an online
 * softmax (running max and sum per head), so K and V are read exactly once, in place and
 * in order. Accumulation is fp32 whatever the cache dtype.
 *
 * Layout (kernels/reference.py): cache [num_blocks, block_size, num_kv_heads, head_dim];
 * query and out [num_seqs, num_heads, head_dim]; heads h = kv * group + g share KV head kv.
 * Keys of a sequence at positions >= seq_len, and < seq_len - window when window > 0, are
 * never read. Built by kernels/cpu_native.py with the system C compiler.
 */
#include <stdlib.h>

#include "cpu_common.h"
#include "cpu_extend.h"

/* One sequence, all heads: q [num_heads][head_dim] fp32 in, acc [num_heads][head_dim] fp32
 * out. Walking whole tokens (every KV head of a token is one contiguous row) keeps the
 * reads sequential within a block, which is what lets the hardware prefetcher stream the
 * cache from memory; the next block is prefetched by hand while this one is computed.
 *
 * The work is arranged for instruction-level parallelism, not just vectors: scores are
 * computed four tokens at a time (four independent dot products share each q load, where
 * one dot at a time is a chain of dependent multiply-adds), and each head's output row is
 * accumulated over a block's tokens in registers (HD, the head dim, a compile-time
 * constant for the common sizes) instead of through memory once per token. */
#define DEFINE_ONE_SEQ(NAME, T, LOAD, HD)                                                    \
static void NAME(const float *q, const T *k_cache, const T *v_cache,                         \
                 const int32_t *blocks, int first, int last, int block_size,                 \
                 int num_heads, int num_kv_heads, int head_dim_arg, float scale,             \
                 float *acc, float *scores, float *row_max, float *row_sum, int normalize) {  \
    const int head_dim = HD;                                                                 \
    (void)head_dim_arg;                                                                      \
    const int group = num_heads / num_kv_heads;                                              \
    const long token_stride = (long)num_kv_heads * head_dim;                                 \
    for (int h = 0; h < num_heads; h++) { row_max[h] = -INFINITY; row_sum[h] = 0.0f; }       \
    memset(acc, 0, sizeof(float) * num_heads * head_dim);                                    \
    for (int pos = first; pos < last; ) {                                                    \
        const int block = blocks[pos / block_size];                                          \
        const int offset = pos % block_size;                                                 \
        const int count = (block_size - offset < last - pos) ? block_size - offset : last - pos; \
        const T *k = k_cache + ((long)block * block_size + offset) * token_stride;           \
        const T *v = v_cache + ((long)block * block_size + offset) * token_stride;           \
        if (pos + count < last) {                                                            \
            const long next = (long)blocks[(pos + count) / block_size] * block_size * token_stride; \
            for (long b = 0; b < (long)block_size * token_stride * (long)sizeof(T); b += 64) { \
                __builtin_prefetch((const char *)(k_cache + next) + b);                      \
                __builtin_prefetch((const char *)(v_cache + next) + b);                      \
            }                                                                                \
        }                                                                                    \
        for (int h = 0; h < num_heads; h++) {                                                \
            const float *qh = q + h * head_dim;                                              \
            const T *kh = k + (h / group) * head_dim;                                        \
            float *sh = scores + h * block_size;                                             \
            int t = 0;                                                                       \
            for (; t + 4 <= count; t += 4) {                                                 \
                const T *k0 = kh + t * token_stride, *k1 = k0 + token_stride;                \
                const T *k2 = k1 + token_stride, *k3 = k2 + token_stride;                    \
                float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;                            \
                for (int d = 0; d < head_dim; d++) {                                         \
                    const float x = qh[d];                                                   \
                    a0 += x * LOAD(k0[d]); a1 += x * LOAD(k1[d]);                            \
                    a2 += x * LOAD(k2[d]); a3 += x * LOAD(k3[d]);                            \
                }                                                                            \
                sh[t] = a0 * scale; sh[t + 1] = a1 * scale;                                  \
                sh[t + 2] = a2 * scale; sh[t + 3] = a3 * scale;                              \
            }                                                                                \
            for (; t < count; t++) {                                                         \
                const T *kt = kh + t * token_stride;                                         \
                float dot = 0.0f;                                                            \
                for (int d = 0; d < head_dim; d++) dot += qh[d] * LOAD(kt[d]);               \
                sh[t] = dot * scale;                                                         \
            }                                                                                \
        }                                                                                    \
        for (int h = 0; h < num_heads; h++) {                                                \
            float *sh = scores + h * block_size;                                             \
            float block_max = sh[0];                                                         \
            for (int t = 1; t < count; t++) block_max = sh[t] > block_max ? sh[t] : block_max; \
            const float new_max = row_max[h] > block_max ? row_max[h] : block_max;           \
            const float rescale = exp_approx(row_max[h] - new_max);  /* ~0 on the first block */ \
            float sum = 0.0f;                                                                \
            for (int t = 0; t < count; t++) { sh[t] = exp_approx(sh[t] - new_max); sum += sh[t]; } \
            row_max[h] = new_max;                                                            \
            row_sum[h] = row_sum[h] * rescale + sum;                                         \
            const T *vh = v + (h / group) * head_dim;                                        \
            float *ah = acc + h * head_dim;                                                  \
            float out[HD];                                                                   \
            for (int d = 0; d < head_dim; d++) out[d] = ah[d] * rescale;                     \
            for (int t = 0; t < count; t++) {                                                \
                const T *vt = vh + t * token_stride;                                         \
                const float p = sh[t];                                                       \
                for (int d = 0; d < head_dim; d++) out[d] += p * LOAD(vt[d]);                \
            }                                                                                \
            for (int d = 0; d < head_dim; d++) ah[d] = out[d];                               \
        }                                                                                    \
        pos += count;                                                                        \
    }                                                                                        \
    for (int h = 0; normalize && h < num_heads; h++) {                                       \
        const float inv = 1.0f / row_sum[h];                                                 \
        for (int d = 0; d < head_dim; d++) acc[h * head_dim + d] *= inv;                     \
    }                                                                                        \
}

#define LOAD_F32(x) (x)
#define LOAD_BF16(x) bf16_to_f32(x)
/* The head dims most models have get their own code (HD constant: the output row lives in
 * registers); any other head dim takes the generic one (the row a variable-length array). */
DEFINE_ONE_SEQ(one_seq_f32_64, float, LOAD_F32, 64)
DEFINE_ONE_SEQ(one_seq_f32_128, float, LOAD_F32, 128)
DEFINE_ONE_SEQ(one_seq_f32_any, float, LOAD_F32, head_dim_arg)
DEFINE_ONE_SEQ(one_seq_bf16_64, uint16_t, LOAD_BF16, 64)
DEFINE_ONE_SEQ(one_seq_bf16_128, uint16_t, LOAD_BF16, 128)
DEFINE_ONE_SEQ(one_seq_bf16_any, uint16_t, LOAD_BF16, head_dim_arg)

/* A sequence's keys are split across threads only when there are fewer sequences than
 * threads (batch 1, a few long requests), and each part keeps at least this many. */
#define MIN_SPLIT_TOKENS 128

typedef struct {
    int first, last;  /* the sequence's visible keys */
    int parts;        /* how many threads share them */
    int chunk;        /* keys per part, a whole number of blocks */
} SeqSplit;

static SeqSplit seq_split(const int32_t *seq_lens, int s, int window, int max_parts,
                          int block_size) {
    SeqSplit split;
    split.last = seq_lens[s];
    split.first = (window > 0 && split.last - window > 0) ? split.last - window : 0;
    const int keys = split.last - split.first;
    int parts = keys / MIN_SPLIT_TOKENS;
    parts = parts < 1 ? 1 : (parts > max_parts ? max_parts : parts);
    const int blocks = (keys + block_size - 1) / block_size;
    split.chunk = ((blocks + parts - 1) / parts) * block_size;
    split.parts = split.chunk > 0 ? (keys + split.chunk - 1) / split.chunk : 1;
    return split;
}

typedef void (*one_seq_f32_fn)(const float *, const float *, const float *, const int32_t *,
                               int, int, int, int, int, int, float, float *, float *, float *,
                               float *, int);
typedef void (*one_seq_bf16_fn)(const float *, const uint16_t *, const uint16_t *,
                                const int32_t *, int, int, int, int, int, int, float, float *,
                                float *, float *, float *, int);

/* One sequence's fp32 result row into `out` in the kernel's dtype (0 fp32, 1 bf16). */
static void store_row(int dtype, const float *acc, void *out, int s, long width) {
    if (dtype == 0) {
        memcpy((float *)out + s * width, acc, sizeof(float) * width);
    } else {
        uint16_t *os = (uint16_t *)out + s * width;
        for (long i = 0; i < width; i++) os[i] = f32_to_bf16(acc[i]);
    }
}

/* Folds a split sequence's parts (each: num_heads rows of head_dim unnormalized sums, then
 * each head's running max, then its sum) into its output row, fp32. */
static void merge_parts(const float *parts, int num_parts, int num_heads, int head_dim,
                        float *out) {
    const long width = (long)num_heads * head_dim;
    const long stride = width + 2L * num_heads;
    for (int h = 0; h < num_heads; h++) {
        float top = -INFINITY;
        for (int p = 0; p < num_parts; p++) {
            const float m = parts[p * stride + width + h];
            top = m > top ? m : top;
        }
        float total = 0.0f;
        float *o = out + (long)h * head_dim;
        for (int d = 0; d < head_dim; d++) o[d] = 0.0f;
        for (int p = 0; p < num_parts; p++) {
            const float *part = parts + p * stride;
            const float weight = exp_approx(part[width + h] - top);
            total += weight * part[width + num_heads + h];
            for (int d = 0; d < head_dim; d++) o[d] += weight * part[(long)h * head_dim + d];
        }
        const float inv = 1.0f / total;
        for (int d = 0; d < head_dim; d++) o[d] *= inv;
    }
}

/* dtype: 0 = fp32, 1 = bf16 (query, caches and out share it). Sequences are split across
 * `num_threads` OpenMP threads; with fewer sequences than threads, a sequence's keys are
 * too (vLLM's KV split): each thread scores its run of keys with its own running max and
 * sum, and the parts are folded together after (the log-sum-exp merge), so one long
 * request's attention uses every core instead of one. Built with -fopenmp, this library
 * needs libgomp.so.1, which the loader resolves to the copy torch already loaded: the
 * kernel runs on torch's own thread pool instead of competing with it for the cores.
 * split_keys 0 keeps every sequence on one thread. Returns 0, or -1 when out of memory. */
int paged_decode(int dtype, const void *query, const void *k_cache, const void *v_cache,
                 const int32_t *block_tables, int max_blocks, const int32_t *seq_lens,
                 void *out, int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                 int block_size, float scale, int window, int num_threads, int split_keys) {
    const long width = (long)num_heads * head_dim;
    const long part_stride = width + 2L * num_heads;
    /* With fewer sequences than threads, each sequence's keys go to up to this many. */
    const int max_parts = split_keys && num_seqs < num_threads
                          ? (num_threads + num_seqs - 1) / num_seqs : 1;
    float *partials = NULL;
    if (max_parts > 1) {
        partials = malloc(sizeof(float) * (long)num_seqs * max_parts * part_stride);
        if (partials == NULL) return -1;
    }
    const one_seq_f32_fn f32 = head_dim == 64 ? one_seq_f32_64
                             : head_dim == 128 ? one_seq_f32_128 : one_seq_f32_any;
    const one_seq_bf16_fn bf16 = head_dim == 64 ? one_seq_bf16_64
                               : head_dim == 128 ? one_seq_bf16_128 : one_seq_bf16_any;
    int failed = 0;
    #pragma omp parallel num_threads(num_threads) reduction(|:failed)
    {
        float *work = malloc(sizeof(float) * (2 * width + (long)num_heads * block_size + 2 * num_heads));
        if (work == NULL) failed = 1;
        float *q = work, *acc = q + width, *scores = acc + width;
        float *row_max = scores + (long)num_heads * block_size, *row_sum = row_max + num_heads;
        #pragma omp for schedule(dynamic, 1)
        for (long item = 0; item < (long)num_seqs * max_parts; item++) {
            const int s = (int)(item / max_parts), part = (int)(item % max_parts);
            const SeqSplit split = seq_split(seq_lens, s, window, max_parts, block_size);
            if (work == NULL || part >= split.parts) continue;
            const int first = split.first + part * split.chunk;
            const int last = first + split.chunk < split.last ? first + split.chunk : split.last;
            const int whole = split.parts == 1;  /* normalized here, else merged below */
            const int32_t *blocks = block_tables + (long)s * max_blocks;
            if (dtype == 0) {
                memcpy(q, (const float *)query + s * width, sizeof(float) * width);
                f32(q, k_cache, v_cache, blocks, first, last, block_size, num_heads,
                    num_kv_heads, head_dim, scale, acc, scores, row_max, row_sum, whole);
            } else {
                const uint16_t *qs = (const uint16_t *)query + s * width;
                for (long i = 0; i < width; i++) q[i] = bf16_to_f32(qs[i]);
                bf16(q, k_cache, v_cache, blocks, first, last, block_size, num_heads,
                     num_kv_heads, head_dim, scale, acc, scores, row_max, row_sum, whole);
            }
            if (whole) {
                store_row(dtype, acc, out, s, width);
            } else {
                float *slot = partials + item * part_stride;
                memcpy(slot, acc, sizeof(float) * width);
                memcpy(slot + width, row_max, sizeof(float) * num_heads);
                memcpy(slot + width + num_heads, row_sum, sizeof(float) * num_heads);
            }
        }
        /* The for's barrier: every part is in. Each split sequence's parts fold into it. */
        #pragma omp for schedule(static)
        for (int s = 0; s < num_seqs; s++) {
            const SeqSplit split = seq_split(seq_lens, s, window, max_parts, block_size);
            if (work == NULL || split.parts == 1) continue;
            merge_parts(partials + (long)s * max_parts * part_stride, split.parts, num_heads,
                        head_dim, acc);
            store_row(dtype, acc, out, s, width);
        }
        free(work);
    }
    free(partials);
    return failed ? -1 : 0;
}

#define LOAD_float(x) (x)
#define LOAD_uint16_t(x) bf16_to_f32(x)
#define LOAD_VEC_float load_f32
#define LOAD_VEC_uint16_t load_bf16
DEFINE_SCORE_RUN(scores_f32, float)
DEFINE_SCORE_RUN(scores_bf16, uint16_t)
DEFINE_VALUES(values_f32_64, float, 64)
DEFINE_VALUES(values_f32_128, float, 128)
DEFINE_VALUES_ANY(values_f32_any, float)
DEFINE_VALUES(values_bf16_64, uint16_t, 64)
DEFINE_VALUES(values_bf16_128, uint16_t, 128)
DEFINE_VALUES_ANY(values_bf16_any, uint16_t)
DEFINE_EXTEND(extend_f32_64, float, scores_f32, values_f32_64)
DEFINE_EXTEND(extend_f32_128, float, scores_f32, values_f32_128)
DEFINE_EXTEND(extend_f32_any, float, scores_f32, values_f32_any)
DEFINE_EXTEND(extend_bf16_64, uint16_t, scores_bf16, values_bf16_64)
DEFINE_EXTEND(extend_bf16_128, uint16_t, scores_bf16, values_bf16_128)
DEFINE_EXTEND(extend_bf16_any, uint16_t, scores_bf16, values_bf16_any)

typedef void (*extend_f32_fn)(ExtendScratch *, int, const float *, const float *,
                              const int32_t *, int, long, int, int, int, int);
typedef void (*extend_bf16_fn)(ExtendScratch *, int, const uint16_t *, const uint16_t *,
                               const int32_t *, int, long, int, int, int, int);

/* One work item of a mixed batch: a decoding sequence (token < 0), or EXT_TOKENS query
 * tokens of a sequence from `token` on, for one KV head. */
typedef struct { int seq, token, kv; } WorkItem;

/* What every work item of one paged_attention call reads (its arguments). */
typedef struct {
    int dtype;
    const void *query, *k_cache, *v_cache;
    const int32_t *block_tables, *seq_lens, *query_start_loc;
    void *out;
    int max_blocks, num_heads, num_kv_heads, head_dim, block_size, window, group;
    long width, token_stride;  /* a token's query row; a token's row in the cache */
    float scale;
} Batch;

/* A decoding sequence: all heads of its one token, as paged_decode without the split. */
static void attend_decode(const Batch *b, int s, float *work) {
    const int hd = b->head_dim, heads = b->num_heads, seq_len = b->seq_lens[s];
    const int32_t *blocks = b->block_tables + (long)s * b->max_blocks;
    const long row0 = b->query_start_loc[s];
    float *q = work, *acc = q + b->width, *scores = acc + b->width;
    float *row_max = scores + (long)heads * b->block_size, *row_sum = row_max + heads;
    const int first = b->window > 0 && seq_len - b->window > 0 ? seq_len - b->window : 0;
    if (b->dtype == 0) {
        const one_seq_f32_fn f32 = hd == 64 ? one_seq_f32_64
                                 : hd == 128 ? one_seq_f32_128 : one_seq_f32_any;
        memcpy(q, (const float *)b->query + row0 * b->width, sizeof(float) * b->width);
        f32(q, b->k_cache, b->v_cache, blocks, first, seq_len, b->block_size, heads,
            b->num_kv_heads, hd, b->scale, acc, scores, row_max, row_sum, 1);
    } else {
        const one_seq_bf16_fn bf16 = hd == 64 ? one_seq_bf16_64
                                   : hd == 128 ? one_seq_bf16_128 : one_seq_bf16_any;
        const uint16_t *qs = (const uint16_t *)b->query + row0 * b->width;
        for (long j = 0; j < b->width; j++) q[j] = bf16_to_f32(qs[j]);
        bf16(q, b->k_cache, b->v_cache, blocks, first, seq_len, b->block_size, heads,
             b->num_kv_heads, hd, b->scale, acc, scores, row_max, row_sum, 1);
    }
    store_row(b->dtype, acc, b->out, (int)row0, b->width);
}

/* Where row r (token r / group, head r % group of KV head `kv`) of a tile from `token0` of
 * the sequence whose rows start at row0 sits in query and out. */
static long tile_row_at(const Batch *b, long row0, int token0, int kv, int r) {
    return (row0 + token0 + r / b->group) * b->width
           + ((long)kv * b->group + r % b->group) * b->head_dim;
}

/* A tile (cpu_extend.h): its queries transposed and scaled into x, each row's visible keys,
 * the tile routine, then each row normalized into out. */
static void attend_tile(const Batch *b, WorkItem item, ExtendScratch *x) {
    const int hd = b->head_dim, s = item.seq, seq_len = b->seq_lens[s];
    const long row0 = b->query_start_loc[s];
    const int q_len = b->query_start_loc[s + 1] - b->query_start_loc[s];
    const int tokens = q_len - item.token < EXT_TOKENS ? q_len - item.token : EXT_TOKENS;
    const int rows = tokens * b->group, padded = extend_padded(rows);
    const int first_pos = seq_len - q_len + item.token;  /* the tile's first token's */
    for (int r = 0; r < padded; r++) {
        const int pos = first_pos + r / b->group, seen = r < rows;
        const int lowest = b->window > 0 && pos - b->window + 1 > 0 ? pos - b->window + 1 : 0;
        x->first_key[r] = seen ? lowest : 1;  /* padding rows see no key */
        x->last_key[r] = seen ? pos : 0;
        const long at = tile_row_at(b, row0, item.token, item.kv, r);
        for (int d = 0; d < hd; d++) {
            float q = 0.0f;
            if (seen)
                q = b->dtype == 0 ? ((const float *)b->query)[at + d]
                                  : bf16_to_f32(((const uint16_t *)b->query)[at + d]);
            x->qt[(long)d * x->padded + r] = q * b->scale;
        }
    }
    const int32_t *blocks = b->block_tables + (long)s * b->max_blocks;
    const int first_key = x->first_key[0], last_key = first_pos + tokens - 1;
    if (b->dtype == 0) {
        const extend_f32_fn ext = hd == 64 ? extend_f32_64
                                : hd == 128 ? extend_f32_128 : extend_f32_any;
        ext(x, rows, b->k_cache, b->v_cache, blocks, b->block_size, b->token_stride, item.kv,
            first_key, last_key, hd);
    } else {
        const extend_bf16_fn ext = hd == 64 ? extend_bf16_64
                                 : hd == 128 ? extend_bf16_128 : extend_bf16_any;
        ext(x, rows, b->k_cache, b->v_cache, blocks, b->block_size, b->token_stride, item.kv,
            first_key, last_key, hd);
    }
    for (int r = 0; r < rows; r++) {
        const long at = tile_row_at(b, row0, item.token, item.kv, r);
        const float inv = 1.0f / x->row_sum[r];
        for (int d = 0; d < hd; d++) {
            const float v = x->o[(long)r * hd + d] * inv;
            if (b->dtype == 0) ((float *)b->out)[at + d] = v;
            else ((uint16_t *)b->out)[at + d] = f32_to_bf16(v);
        }
    }
}

/* The work items: every tile of the longer sequences (first: the long items start early),
 * then the decodes. NULL when out of memory; *count gets how many. */
static WorkItem *work_items(const int32_t *query_start_loc, int num_seqs, int num_kv_heads,
                            long *count) {
    long num_items = 0;
    for (int s = 0; s < num_seqs; s++) {
        const int q_len = query_start_loc[s + 1] - query_start_loc[s];
        num_items += q_len <= 1 ? q_len
                                : (long)(q_len + EXT_TOKENS - 1) / EXT_TOKENS * num_kv_heads;
    }
    WorkItem *items = malloc(sizeof(WorkItem) * (num_items > 0 ? num_items : 1));
    if (items == NULL) return NULL;
    long next = 0;
    for (int s = 0; s < num_seqs; s++) {
        const int q_len = query_start_loc[s + 1] - query_start_loc[s];
        for (int token = 0; q_len > 1 && token < q_len; token += EXT_TOKENS)
            for (int kv = 0; kv < num_kv_heads; kv++) items[next++] = (WorkItem){s, token, kv};
    }
    for (int s = 0; s < num_seqs; s++)
        if (query_start_loc[s + 1] - query_start_loc[s] == 1) items[next++] = (WorkItem){s, -1, 0};
    *count = num_items;
    return items;
}

/* A whole batch in one call, decodes and prefills mixed (vLLM's unified CPU attention):
 * query and out [num_tokens, num_heads, head_dim], sequence s's query tokens the rows
 * query_start_loc[s]..query_start_loc[s + 1] - 1, the newest of its seq_lens[s] tokens,
 * whose keys and values (this step's included) are already in the cache. Work items are the
 * decodes (one thread per sequence, as paged_decode without the split) and the tiles of the
 * longer sequences (cpu_extend.h), the tiles first, handed out one at a time to the threads.
 * dtype as paged_decode's. Returns 0, -1 when out of memory, or -2 (nothing written) when a
 * sequence has more query tokens than context. */
int paged_attention(int dtype, const void *query, const void *k_cache, const void *v_cache,
                    const int32_t *block_tables, int max_blocks, const int32_t *seq_lens,
                    const int32_t *query_start_loc, void *out, int num_seqs, int num_heads,
                    int num_kv_heads, int head_dim, int block_size, float scale, int window,
                    int num_threads) {
    const Batch b = {dtype, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                     out, max_blocks, num_heads, num_kv_heads, head_dim, block_size, window,
                     num_heads / num_kv_heads, (long)num_heads * head_dim,
                     (long)num_kv_heads * head_dim, scale};
    for (int s = 0; s < num_seqs; s++) {
        const int q_len = query_start_loc[s + 1] - query_start_loc[s];
        if (q_len < 0 || q_len > seq_lens[s]) return -2;
    }
    long num_items = 0;
    WorkItem *items = work_items(query_start_loc, num_seqs, num_kv_heads, &num_items);
    if (items == NULL) return -1;
    const long decode_floats = 2 * b.width + (long)num_heads * block_size + 2 * num_heads;
    const long extend_floats = extend_scratch_floats(b.group, head_dim);
    int failed = 0;
    #pragma omp parallel num_threads(num_threads) reduction(|:failed)
    {
        float *work = malloc(sizeof(float) * (decode_floats > extend_floats ? decode_floats
                                                                            : extend_floats));
        if (work == NULL) failed = 1;
        ExtendScratch x = extend_scratch(work, b.group, head_dim);
        #pragma omp for schedule(dynamic, 1)
        for (long i = 0; i < num_items; i++) {
            if (work == NULL) continue;
            if (items[i].token < 0) attend_decode(&b, items[i].seq, work);
            else attend_tile(&b, items[i], &x);
        }
        free(work);
    }
    free(items);
    return failed ? -1 : 0;
}
