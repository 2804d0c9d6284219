/* Query tokens of a sequence that brings more than one (a prompt, a prefill chunk after
 * cached context, a prompt after a prefix-cache hit), for cpu_decode.c's paged_attention:
 * the tile routine for one run of a sequence's tokens and one KV head.
 *
 * A tile is EXT_TOKENS query tokens x the query heads sharing one KV head (GQA's group):
 * rows r = token * group + head, all reading the same keys, so K and V are read once per
 * tile for every head of the group. The tile's queries are transposed once (qt[d][row],
 * pre-scaled), so every score comes out of vectors across rows: a key's element broadcast
 * times a vector of rows' query elements, keys and values read in place in their blocks
 * with no copy. Keys go in runs of EXT_KEYS; an online softmax (running max and sum per
 * row, vectors across rows too) folds each run's values into the fp32 output rows, each
 * row's head_dim sums held in registers over the run. Causality and the sliding window
 * are per row: row r sees keys at positions <= its own and > its own - window.
 *
 * Vectors are GCC/Clang vector extensions (as in cpu_linear.c): AVX-512 code where the
 * compiler targets it, AVX2, SSE or NEON otherwise, from this one source. */
#ifndef PAGEMESH_CPU_EXTEND_H
#define PAGEMESH_CPU_EXTEND_H

#include <stdint.h>

#include "cpu_common.h"

#define EXT_TOKENS 32  /* query tokens per tile */
#define EXT_KEYS 32    /* keys per run */
#if defined(__AVX512F__)
#define EXT_VEC 16     /* floats per vector */
#define PV_VECS 16     /* value sums held in registers: half of AVX-512's 32 */
#elif defined(__AVX__)
#define EXT_VEC 8
#define PV_VECS 8      /* half of AVX2's 16 */
#else
#define EXT_VEC 4      /* SSE, NEON: 128-bit vectors */
#define PV_VECS 8
#endif
#define SCORE_KEYS 4   /* keys scored together, with up to SCORE_VECS vectors of rows */
#if defined(__AVX512F__)
#define SCORE_VECS 4   /* 16 sums and 4 query vectors of 32 registers */
#else
#define SCORE_VECS 2   /* 8 sums and 2 query vectors of 16 */
#endif

typedef float ext_vec __attribute__((vector_size(EXT_VEC * 4), aligned(4)));
typedef int32_t ext_int __attribute__((vector_size(EXT_VEC * 4), aligned(4)));
typedef uint32_t ext_bits __attribute__((vector_size(EXT_VEC * 4), aligned(4)));
typedef uint16_t ext_half __attribute__((vector_size(EXT_VEC * 2), aligned(2)));

static inline ext_vec load_f32(const float *p) { return *(const ext_vec *)p; }
static inline ext_vec load_bf16(const uint16_t *p) {
    return (ext_vec)(__builtin_convertvector(*(const ext_half *)p, ext_bits) << 16);
}
static inline ext_vec splat(float x) { return x - (ext_vec){0}; }
static inline ext_vec select_vec(ext_int mask, ext_vec a, ext_vec b) {
    return (ext_vec)(((ext_int)a & mask) | ((ext_int)b & ~mask));
}
static inline ext_vec max_vec(ext_vec a, ext_vec b) { return select_vec(a > b, a, b); }

/* exp_approx (cpu_common.h) on a vector: the same clamp, reduction and polynomial. */
static inline ext_vec exp_vec(ext_vec x) {
    x = max_vec(x, splat(-87.0f));
    x = select_vec(x > splat(88.0f), splat(88.0f), x);
    const ext_vec y = x * EXP_LOG2E + 0.5f;
    const ext_vec truncated = __builtin_convertvector(__builtin_convertvector(y, ext_int), ext_vec);
    const ext_vec n = truncated + __builtin_convertvector(truncated > y, ext_vec);  /* floor */
    const ext_vec r = x - n * EXP_LN2_HI + n * EXP_LN2_LO;
    const ext_vec e = EXP_POLY(r) * r * r + r + 1.0f;
    return e * (ext_vec)((__builtin_convertvector(n, ext_int) + 127) << 23);
}

/* One tile's scratch, per thread (extend_scratch_floats floats). `padded`: the tile's rows
 * rounded up to whole vectors (its largest: EXT_TOKENS x group). */
typedef struct {
    int padded;
    float *qt;               /* [head_dim][padded]: the queries, transposed and scaled */
    float *o;                /* [padded][head_dim]: the output sums */
    float *s;                /* [EXT_KEYS][padded]: a run's scores, then probabilities */
    float *row_max, *row_sum, *rescale;  /* [padded] */
    int32_t *first_key, *last_key;       /* [padded]: each row's visible keys, inclusive */
    const void **k_rows, **v_rows;       /* [EXT_KEYS]: the run's keys and values */
} ExtendScratch;

static int extend_padded(int rows) { return (rows + EXT_VEC - 1) / EXT_VEC * EXT_VEC; }

static long extend_scratch_floats(int group, int head_dim) {
    const long padded = extend_padded(EXT_TOKENS * group);
    return 2 * padded * head_dim + EXT_KEYS * padded + 5 * padded
           + 2L * EXT_KEYS * (long)(sizeof(void *) / sizeof(float)) + EXT_VEC + 4;
}

static ExtendScratch extend_scratch(float *work, int group, int head_dim) {
    ExtendScratch x;
    x.padded = extend_padded(EXT_TOKENS * group);
    x.qt = work;
    x.o = x.qt + (long)head_dim * x.padded;
    x.s = x.o + (long)x.padded * head_dim;
    x.row_max = x.s + (long)EXT_KEYS * x.padded;
    x.row_sum = x.row_max + x.padded;
    x.rescale = x.row_sum + x.padded;
    x.first_key = (int32_t *)(x.rescale + x.padded);
    x.last_key = x.first_key + x.padded;
    uintptr_t at = (uintptr_t)(x.last_key + x.padded);
    at = (at + sizeof(void *) - 1) & ~(uintptr_t)(sizeof(void *) - 1);
    x.k_rows = (const void **)at;
    x.v_rows = x.k_rows + EXT_KEYS;
    return x;
}

/* s[t][rows rv0..] = key t . qt[.][rows], for KEYS keys from t0 and VECS row vectors. */
#define DEFINE_SCORES(NAME, T, LOAD, KEYS, VECS)                                             \
static void NAME(const ExtendScratch *x, int t0, int rv0, int head_dim) {                    \
    const int padded = x->padded;                                                            \
    ext_vec acc[KEYS][VECS];                                                                 \
    const T *k[KEYS];                                                                        \
    _Pragma("GCC unroll 8") for (int j = 0; j < KEYS; j++) {                                 \
        k[j] = (const T *)x->k_rows[t0 + j];                                                 \
        _Pragma("GCC unroll 8") for (int c = 0; c < VECS; c++) acc[j][c] = (ext_vec){0};     \
    }                                                                                        \
    const float *qt = x->qt + (long)rv0 * EXT_VEC;                                           \
    for (int d = 0; d < head_dim; d++) {                                                     \
        ext_vec q[VECS];                                                                     \
        _Pragma("GCC unroll 8") for (int c = 0; c < VECS; c++)                               \
            q[c] = load_f32(qt + (long)d * padded + c * EXT_VEC);                            \
        _Pragma("GCC unroll 8") for (int j = 0; j < KEYS; j++) {                             \
            const float kd = LOAD(k[j][d]);                                                  \
            _Pragma("GCC unroll 8") for (int c = 0; c < VECS; c++) acc[j][c] += kd * q[c];   \
        }                                                                                    \
    }                                                                                        \
    _Pragma("GCC unroll 8") for (int j = 0; j < KEYS; j++)                                   \
        _Pragma("GCC unroll 8") for (int c = 0; c < VECS; c++)                               \
            *(ext_vec *)(x->s + (long)(t0 + j) * padded + (rv0 + c) * EXT_VEC) = acc[j][c];  \
}

/* Keys t.. (K of them: 4 or 1) against every row vector, widest tiles first. */
#define SCORE_SWEEP(NAME, K, t, vecs, head_dim) {                                            \
    int rv = 0;                                                                              \
    for (; SCORE_VECS >= 4 && rv + 4 <= vecs; rv += 4) NAME##_##K##x4(x, t, rv, head_dim);   \
    for (; SCORE_VECS >= 3 && rv + 3 <= vecs; rv += 3) NAME##_##K##x3(x, t, rv, head_dim);   \
    for (; rv + 2 <= vecs; rv += 2) NAME##_##K##x2(x, t, rv, head_dim);                      \
    for (; rv < vecs; rv++) NAME##_##K##x1(x, t, rv, head_dim);                              \
}

/* Every score of a run of `count` keys. */
#define DEFINE_SCORE_RUN(NAME, T)                                                            \
DEFINE_SCORES(NAME##_4x4, T, LOAD_##T, SCORE_KEYS, 4)                                        \
DEFINE_SCORES(NAME##_4x3, T, LOAD_##T, SCORE_KEYS, 3)                                        \
DEFINE_SCORES(NAME##_4x2, T, LOAD_##T, SCORE_KEYS, 2)                                        \
DEFINE_SCORES(NAME##_4x1, T, LOAD_##T, SCORE_KEYS, 1)                                        \
DEFINE_SCORES(NAME##_1x4, T, LOAD_##T, 1, 4)                                                 \
DEFINE_SCORES(NAME##_1x3, T, LOAD_##T, 1, 3)                                                 \
DEFINE_SCORES(NAME##_1x2, T, LOAD_##T, 1, 2)                                                 \
DEFINE_SCORES(NAME##_1x1, T, LOAD_##T, 1, 1)                                                 \
static void NAME(const ExtendScratch *x, int count, int vecs, int head_dim) {                \
    int t = 0;                                                                               \
    for (; t + SCORE_KEYS <= count; t += SCORE_KEYS) SCORE_SWEEP(NAME, 4, t, vecs, head_dim);  \
    for (; t < count; t++) SCORE_SWEEP(NAME, 1, t, vecs, head_dim);                          \
}

/* A run's scores (keys first..first+count-1) to probabilities, vectors across rows: each
 * row's keys outside its visible range get 0; running max and sum updated; rescale[r] is
 * what the row's output so far is multiplied by (0 while the row has seen no key). */
static void extend_softmax(const ExtendScratch *x, int vecs, int first, int count) {
    const long padded = x->padded;
    for (int c = 0; c < vecs; c++) {
        const long at = (long)c * EXT_VEC;
        const ext_int lo = *(const ext_int *)(x->first_key + at);
        const ext_int hi = *(const ext_int *)(x->last_key + at);
        const ext_vec old = load_f32(x->row_max + at);
        ext_vec top = splat(-INFINITY);
        for (int t = 0; t < count; t++) {
            const ext_int key = (first + t) - (ext_int){0};
            const ext_int seen = (key >= lo) & (key <= hi);
            top = select_vec(seen, max_vec(top, load_f32(x->s + t * padded + at)), top);
        }
        const ext_vec new_max = max_vec(old, top);
        const ext_int any = new_max > splat(-INFINITY);
        const ext_vec rescale = select_vec(any, exp_vec(old - new_max), (ext_vec){0});
        ext_vec sum = (ext_vec){0};
        for (int t = 0; t < count; t++) {
            const ext_int key = (first + t) - (ext_int){0};
            const ext_int seen = (key >= lo) & (key <= hi);
            float *st = x->s + t * padded + at;
            const ext_vec p = select_vec(seen, exp_vec(load_f32(st) - new_max), (ext_vec){0});
            *(ext_vec *)st = p;
            sum += p;
        }
        *(ext_vec *)(x->row_max + at) = new_max;
        *(ext_vec *)(x->row_sum + at) = load_f32(x->row_sum + at) * rescale + sum;
        *(ext_vec *)(x->rescale + at) = rescale;
    }
}

/* out rows += probabilities x the run's value rows, for a head dim HD known here: as many
 * rows at once as keep their sums in PV_VECS registers, over the run's keys. */
#define DEFINE_VALUES(NAME, T, HD)                                                           \
static void NAME(const ExtendScratch *x, int rows, int count, int head_dim_arg) {            \
    (void)head_dim_arg;                                                                      \
    enum { VECS = HD / EXT_VEC, ROWS = VECS >= PV_VECS ? 1 : PV_VECS / VECS };               \
    const long padded = x->padded;                                                           \
    for (int r0 = 0; r0 < rows; r0 += ROWS) {                                                \
        ext_vec out[ROWS][VECS];                                                             \
        _Pragma("GCC unroll 8") for (int j = 0; j < ROWS; j++)                               \
            _Pragma("GCC unroll 16") for (int c = 0; c < VECS; c++)                          \
                out[j][c] = load_f32(x->o + (long)(r0 + j) * HD + c * EXT_VEC)               \
                            * x->rescale[r0 + j];                                            \
        for (int t = 0; t < count; t++) {                                                    \
            const T *vt = (const T *)x->v_rows[t];                                           \
            _Pragma("GCC unroll 8") for (int j = 0; j < ROWS; j++) {                         \
                const float p = x->s[t * padded + r0 + j];                                   \
                _Pragma("GCC unroll 16") for (int c = 0; c < VECS; c++)                      \
                    out[j][c] += p * LOAD_VEC_##T(vt + c * EXT_VEC);                         \
            }                                                                                \
        }                                                                                    \
        _Pragma("GCC unroll 8") for (int j = 0; j < ROWS; j++)                               \
            _Pragma("GCC unroll 16") for (int c = 0; c < VECS; c++)                          \
                *(ext_vec *)(x->o + (long)(r0 + j) * HD + c * EXT_VEC) = out[j][c];          \
    }                                                                                        \
}

/* The same for any head dim, one row at a time through memory. */
#define DEFINE_VALUES_ANY(NAME, T)                                                           \
static void NAME(const ExtendScratch *x, int rows, int count, int head_dim) {                \
    const long padded = x->padded;                                                           \
    for (int r = 0; r < rows; r++) {                                                         \
        float *o = x->o + (long)r * head_dim;                                                \
        for (int d = 0; d < head_dim; d++) o[d] *= x->rescale[r];                            \
        for (int t = 0; t < count; t++) {                                                    \
            const T *vt = (const T *)x->v_rows[t];                                           \
            const float p = x->s[t * padded + r];                                            \
            for (int d = 0; d < head_dim; d++) o[d] += p * LOAD_##T(vt[d]);                  \
        }                                                                                    \
    }                                                                                        \
}

/* One tile: `rows` rows whose queries are in x->qt and visible keys in x->first_key and
 * x->last_key, over keys first_key..last_key (inclusive) of KV head kv; leaves the
 * unnormalized sums in x->o and their softmax sums in x->row_sum. */
#define DEFINE_EXTEND(NAME, T, SCORES, VALUES)                                               \
static void NAME(ExtendScratch *x, int rows, const T *k_cache, const T *v_cache,             \
                 const int32_t *blocks, int block_size, long token_stride, int kv,           \
                 int first_key, int last_key, int head_dim) {                                \
    const int vecs = extend_padded(rows) / EXT_VEC;                                          \
    for (int r = 0; r < vecs * EXT_VEC; r++) { x->row_max[r] = -INFINITY; x->row_sum[r] = 0.0f; } \
    memset(x->o, 0, sizeof(float) * (long)vecs * EXT_VEC * head_dim);                     \
    for (int first = first_key; first <= last_key; first += EXT_KEYS) {                      \
        const int count = last_key + 1 - first < EXT_KEYS ? last_key + 1 - first : EXT_KEYS; \
        for (int t = 0; t < count; t++) {                                                    \
            const int key = first + t;                                                       \
            const long at = ((long)blocks[key / block_size] * block_size + key % block_size) \
                            * token_stride + (long)kv * head_dim;                            \
            x->k_rows[t] = k_cache + at;                                                     \
            x->v_rows[t] = v_cache + at;                                                     \
        }                                                                                    \
        SCORES(x, count, vecs, head_dim);                                                    \
        extend_softmax(x, vecs, first, count);                                               \
        VALUES(x, rows, count, head_dim);                                                    \
    }                                                                                        \
}

#endif
