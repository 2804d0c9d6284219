/* Batched LoRA for multi-LoRA serving: for every row i of a step whose slot s = slots[i] is
 * >= 0, out[i] += (x[i] @ A[s]^T) @ BT[s], in place; rows with a negative slot are untouched.
 *
 * Layouts (kernels/lora.py prepares and checks them): x [n, in_f]; A [num_slots, rank, in_f];
 * BT [num_slots, rank, out_f] (B transposed, the adapter's scaling folded in); out [n, out_f];
 * slots int32 [n]. All contiguous, one dtype: 0 = fp32, 1 = bf16.
 *
 * Rounding: the shrink t = A[s] @ x[i] and the expand delta = t @ BT[s] are fp32 (bf16 inputs
 * are widened exactly), and out[i] + delta is rounded once to out's dtype (to nearest even,
 * as torch); only the order of the fp32 sums differs from kernels/lora.py's reference.
 *
 * Work: the rows are counting-sorted by slot (stable, O(n + num_slots), so the caller need
 * not sort the batch) and cut into blocks of at most ROW_BLOCK rows of one slot. The shrink
 * runs over (block, RANK_TILE ranks) items: an A row is read once per pair of the block's
 * rows, from L1 after the first. The expand runs over (block, COL_CHUNK columns) items: the
 * [rank][COL_CHUNK] tile of BT stays in L1 for all the block's rows, so BT[s] streams from
 * memory once per block instead of once per row (prefill), and a decode row's columns still
 * split over the threads. Threads are OpenMP's (torch's pool), only past PARALLEL_MIN_MACS.
 * Measured on one core (1,024 rows over 8 slots, 576 -> 16 -> 960, fp32), blocks of 16 rows
 * beat blocks of 2 and blocks of 64 (fewer, longer items).
 *
 * Vectors are GCC/Clang vector extensions, not intrinsics (as in cpu_linear.c): the same
 * source is AVX-512 code on x86-64-v4, AVX2 on v3, SSE pairs on the baseline, NEON on ARM.
 * Left to GCC's auto-vectorizer, the same loops kept the expand's sums on the stack and ran
 * far slower (64 rows of 576 -> 16 -> 960 on one core).
 * bf16 is read two values per 32-bit word: the low halves (even elements) shifted up and
 * the high halves masked are each a vector of fp32, with no lane shuffles. A dot product
 * does not care about the lane order, and the expand's accumulators keep it until
 * add2_bf16 interleaves the rounded sums back. Built by kernels/cpu_native.py.
 *
 * Returns 0, -1 when a slot is >= num_slots (nothing written), -2 when out of memory. */
#include <stdlib.h>
#include "cpu_common.h"

#if defined(__AVX512F__)
#define VEC 16  /* floats per vector: a zmm register */
#else
#define VEC 8   /* AVX2's ymm, or two SSE / NEON halves */
#endif
#define ROW_BLOCK 16  /* rows of one slot per work item */
#define RANK_TILE 4   /* ranks per shrink item: 4 ranks x 2 rows of sums share their loads */
#define COL_PAIRS 2   /* vec2s of columns per expand item: 2 rows x 4 vector accumulators */
#define COL_CHUNK (COL_PAIRS * 2 * VEC)
/* Below this many multiply-adds one thread is as fast as two (2 cores: 4 rows of 576 -> 16
 * -> 960, 98k of them, measured the same either way; 8 rows ran faster on two). */
#define PARALLEL_MIN_MACS 65536L

typedef float vec __attribute__((vector_size(VEC * 4), aligned(4)));
/* bf16 pairs, read and written where uint16_t values lie */
typedef uint32_t uvec __attribute__((vector_size(VEC * 4), aligned(2), may_alias));
typedef struct { vec a, b; } vec2;  /* 2 * VEC consecutive values, in their type's lanes */

typedef struct {
    long first;  /* index of the block's first row in the slot order */
    int count;   /* rows, 1..ROW_BLOCK */
    int slot;
} block_t;

static inline float f32_id(float v) { return v; }

static inline vec2 load2_f32(const float *p) {  /* unaligned */
    return (vec2){*(const vec *)p, *(const vec *)(p + VEC)};
}

/* The even elements in .a, the odd ones in .b: exact, bf16 is fp32's high half. */
static inline vec2 load2_bf16(const uint16_t *p) {
    const uvec words = *(const uvec *)p;
    return (vec2){(vec)(words << 16), (vec)(words & 0xffff0000u)};
}

static inline void add2_f32(float *o, vec2 v) {
    *(vec *)o += v.a;
    *(vec *)(o + VEC) += v.b;
}

/* fp32 bits -> their bf16 in the high half (f32_to_bf16 of cpu_common.h, on a vector). */
static inline uvec round_bf16_high(uvec bits) {
    const uvec nan = (uvec)((bits & 0x7fffffffu) > 0x7f800000u);  /* all ones where NaN */
    const uvec rounded = bits + 0x7fffu + ((bits >> 16) & 1u);
    return ((rounded & ~nan) | ((bits | 0x00400000u) & nan)) & 0xffff0000u;
}

static inline void add2_bf16(uint16_t *o, vec2 v) {
    const vec2 old = load2_bf16(o);
    *(uvec *)o = (round_bf16_high((uvec)(old.a + v.a)) >> 16)
                 | round_bf16_high((uvec)(old.b + v.b));
}

static inline float hsum(vec v) {
    float sum = 0.0f;
    for (int j = 0; j < VEC; j++) sum += v[j];
    return sum;
}

/* Rows of x grouped by slot: order[] lists the rows with a slot >= 0, slot by slot, each
 * slot's rows ascending; blocks[] cuts each slot's run into ROW_BLOCK pieces. Returns the
 * number of blocks. */
static long plan_blocks(const int32_t *slots, long n, long num_slots, long *counts,
                        long *order, block_t *blocks) {
    for (long s = 0; s <= num_slots; s++) counts[s] = 0;
    for (long i = 0; i < n; i++)
        if (slots[i] >= 0) counts[slots[i] + 1]++;
    for (long s = 0; s < num_slots; s++) counts[s + 1] += counts[s];  /* starts */
    long num_blocks = 0;
    for (long s = 0; s < num_slots; s++)
        for (long first = counts[s]; first < counts[s + 1]; first += ROW_BLOCK) {
            const long left = counts[s + 1] - first;
            blocks[num_blocks++] = (block_t){first, left < ROW_BLOCK ? (int)left : ROW_BLOCK,
                                             (int)s};
        }
    for (long i = 0; i < n; i++)
        if (slots[i] >= 0) order[counts[slots[i]]++] = i;
    return num_blocks;
}

/* t[i][rk[q]] = A[rk[q]] . x[rows[i]] for ROWS rows and RANK_TILE ranks: each vector of x
 * and of A is loaded once for all of them, into ROWS x RANK_TILE x 2 independent sums that
 * hide the multiply-add latency. */
#define DEFINE_SHRINK_TILE(NAME, T, LOAD2, TO_F32, ROWS)                                    \
static inline void NAME(const T *x, const long *rows, const T *const *ar, const long *rk,  \
                        long in_f, long rank, float *t) {                                   \
    const T *xr[ROWS];                                                                      \
    for (int i = 0; i < ROWS; i++) xr[i] = x + rows[i] * in_f;                              \
    vec2 acc[ROWS][RANK_TILE] = {0};                                                        \
    const long k_vec = in_f / (2 * VEC) * (2 * VEC);                                        \
    for (long k = 0; k < k_vec; k += 2 * VEC) {                                             \
        vec2 xv[ROWS];                                                                      \
        _Pragma("GCC unroll 8") for (int i = 0; i < ROWS; i++) xv[i] = LOAD2(xr[i] + k);    \
        _Pragma("GCC unroll 8") for (int q = 0; q < RANK_TILE; q++) {                       \
            const vec2 av = LOAD2(ar[q] + k);                                               \
            _Pragma("GCC unroll 8") for (int i = 0; i < ROWS; i++) {                        \
                acc[i][q].a += av.a * xv[i].a;                                              \
                acc[i][q].b += av.b * xv[i].b;                                              \
            }                                                                               \
        }                                                                                   \
    }                                                                                       \
    for (int i = 0; i < ROWS; i++)                                                          \
        for (int q = 0; q < RANK_TILE; q++) {                                               \
            float sum = hsum(acc[i][q].a + acc[i][q].b);                                    \
            for (long k = k_vec; k < in_f; k++) sum += TO_F32(ar[q][k]) * TO_F32(xr[i][k]); \
            t[i * rank + rk[q]] = sum;                                                      \
        }                                                                                   \
}

/* out[rows[i]][c0 .. c0 + COL_CHUNK) += t[i] @ BT[:, c0 ..) for ROWS rows: each BT vector
 * is loaded once for all of them, into accumulators that stay in registers. */
#define DEFINE_EXPAND_TILE(NAME, T, LOAD2, ADD2, ROWS)                                      \
static inline void NAME(T *out, const long *rows, const T *bt, long out_f, long rank,      \
                        const float *t, long c0) {                                          \
    vec2 acc[ROWS][COL_PAIRS] = {0};                                                        \
    for (long r = 0; r < rank; r++) {                                                       \
        const T *b = bt + r * out_f + c0;                                                   \
        _Pragma("GCC unroll 8") for (int q = 0; q < COL_PAIRS; q++) {                       \
            const vec2 bv = LOAD2(b + q * 2 * VEC);                                         \
            _Pragma("GCC unroll 8") for (int i = 0; i < ROWS; i++) {                        \
                const float ti = t[i * rank + r];                                           \
                acc[i][q].a += bv.a * ti;                                                   \
                acc[i][q].b += bv.b * ti;                                                   \
            }                                                                               \
        }                                                                                   \
    }                                                                                       \
    for (int i = 0; i < ROWS; i++)                                                          \
        for (int q = 0; q < COL_PAIRS; q++)                                                 \
            ADD2(out + rows[i] * out_f + c0 + q * 2 * VEC, acc[i][q]);                      \
}

/* One dtype's work on a block's rows: the shrink for ranks r0..r0+RANK_TILE-1 (a rank past
 * the last one is clamped to it and rewrites the same value), the expand of the columns
 * c0.., a full chunk or the columns past the last one (one at a time). Rows go two at a
 * time, then the odd one alone: a decode step's block is often a single row. */
#define DEFINE_BLOCK_OPS(SUFFIX, T, LOAD2, ADD2, TO_F32, FROM_F32)                          \
DEFINE_SHRINK_TILE(shrink2_##SUFFIX, T, LOAD2, TO_F32, 2)                                   \
DEFINE_SHRINK_TILE(shrink1_##SUFFIX, T, LOAD2, TO_F32, 1)                                   \
DEFINE_EXPAND_TILE(expand2_##SUFFIX, T, LOAD2, ADD2, 2)                                     \
DEFINE_EXPAND_TILE(expand1_##SUFFIX, T, LOAD2, ADD2, 1)                                     \
static void shrink_##SUFFIX(const T *x, const T *a, const long *rows, int count, long in_f, \
                            long rank, long r0, float *t) {                                 \
    const T *ar[RANK_TILE];                                                                 \
    long rk[RANK_TILE];                                                                     \
    for (int q = 0; q < RANK_TILE; q++) {                                                   \
        rk[q] = r0 + q < rank ? r0 + q : rank - 1;                                          \
        ar[q] = a + rk[q] * in_f;                                                           \
    }                                                                                       \
    int i = 0;                                                                              \
    for (; i + 2 <= count; i += 2)                                                          \
        shrink2_##SUFFIX(x, rows + i, ar, rk, in_f, rank, t + i * rank);                    \
    if (i < count) shrink1_##SUFFIX(x, rows + i, ar, rk, in_f, rank, t + i * rank);         \
}                                                                                           \
static void expand_##SUFFIX(T *out, const T *bt, const long *rows, int count, long out_f,  \
                            long rank, const float *t, long c0) {                           \
    if (c0 + COL_CHUNK > out_f) {                                                           \
        for (int i = 0; i < count; i++)                                                     \
            for (long c = c0; c < out_f; c++) {                                             \
                float sum = 0.0f;                                                           \
                for (long r = 0; r < rank; r++)                                             \
                    sum += t[i * rank + r] * TO_F32(bt[r * out_f + c]);                     \
                T *o = out + rows[i] * out_f + c;                                           \
                *o = FROM_F32(TO_F32(*o) + sum);                                            \
            }                                                                               \
        return;                                                                             \
    }                                                                                       \
    int i = 0;                                                                              \
    for (; i + 2 <= count; i += 2)                                                          \
        expand2_##SUFFIX(out, rows + i, bt, out_f, rank, t + i * rank, c0);                 \
    if (i < count) expand1_##SUFFIX(out, rows + i, bt, out_f, rank, t + i * rank, c0);      \
}

DEFINE_BLOCK_OPS(f32, float, load2_f32, add2_f32, f32_id, f32_id)
DEFINE_BLOCK_OPS(bf16, uint16_t, load2_bf16, add2_bf16, bf16_to_f32, f32_to_bf16)

static void shrink_item(int dtype, const void *x, const void *a, const long *order,
                        const block_t *b, long in_f, long rank, long r0, float *t) {
    const long slot_offset = (long)b->slot * rank * in_f;
    float *tb = t + b->first * rank;
    if (dtype == 0)
        shrink_f32((const float *)x, (const float *)a + slot_offset, order + b->first,
                   b->count, in_f, rank, r0, tb);
    else
        shrink_bf16((const uint16_t *)x, (const uint16_t *)a + slot_offset, order + b->first,
                    b->count, in_f, rank, r0, tb);
}

static void expand_item(int dtype, void *out, const void *bt, const long *order,
                        const block_t *b, long out_f, long rank, long c0, const float *t) {
    const long slot_offset = (long)b->slot * rank * out_f;
    const float *tb = t + b->first * rank;
    if (dtype == 0)
        expand_f32((float *)out, (const float *)bt + slot_offset, order + b->first, b->count,
                   out_f, rank, tb, c0);
    else
        expand_bf16((uint16_t *)out, (const uint16_t *)bt + slot_offset, order + b->first,
                    b->count, out_f, rank, tb, c0);
}

int lora_apply(int dtype, const void *x, const void *a, const void *bt, const int32_t *slots,
               void *out, long n, long in_f, long out_f, long rank, long num_slots,
               int num_threads) {
    long num_rows = 0;
    for (long i = 0; i < n; i++) {
        if (slots[i] >= num_slots) return -1;
        num_rows += slots[i] >= 0;
    }
    if (num_rows == 0 || rank == 0) return 0;
    const long max_blocks = num_rows / ROW_BLOCK + num_slots;
    char *scratch = malloc(sizeof(long) * (num_slots + 1 + num_rows)
                           + sizeof(block_t) * max_blocks + sizeof(float) * num_rows * rank);
    if (!scratch) return -2;
    long *counts = (long *)scratch, *order = counts + num_slots + 1;
    block_t *blocks = (block_t *)(order + num_rows);
    float *t = (float *)(blocks + max_blocks);  /* [num_rows][rank], in slot order */
    const long num_blocks = plan_blocks(slots, n, num_slots, counts, order, blocks);
    const long rank_tiles = (rank + RANK_TILE - 1) / RANK_TILE;
    const long col_chunks = (out_f + COL_CHUNK - 1) / COL_CHUNK;
    const long macs = num_rows * rank * (in_f + out_f);
    #pragma omp parallel num_threads(num_threads) if (macs >= PARALLEL_MIN_MACS)
    {
        #pragma omp for schedule(static)
        for (long item = 0; item < num_blocks * rank_tiles; item++)
            shrink_item(dtype, x, a, order, &blocks[item / rank_tiles], in_f, rank,
                        item % rank_tiles * RANK_TILE, t);
        #pragma omp for schedule(static)
        for (long item = 0; item < num_blocks * col_chunks; item++)
            expand_item(dtype, out, bt, order, &blocks[item / col_chunks], out_f, rank,
                        item % col_chunks * COL_CHUNK, t);
    }
    free(scratch);
    return 0;
}
