/* fp32 linear layers (y = x W^T + b) for CPU, on weights packed once into column panels.
 *
 * Packed layout: W [N, K] becomes ceil(N / PANEL) panels, each [K][PANEL]: panel p holds
 * output columns PANEL*p.., one row of PANEL per input index k (columns past N are zero).
 * PANEL is one vector: 16 floats where the compiler targets AVX-512 (a zmm register), else
 * 8 (AVX2's ymm, or two SSE / NEON halves); `linear_panel()` says which this build packs
 * for. The inner loop is a vector load of W and a multiply-add per row of x, and a panel
 * streams through memory (and the prefetcher) once per x tile.
 *
 * Tiles: ROWS rows of x times PANELS panels of W held in ROWS x PANELS vector accumulators
 * (the register file: 6 x 2 with AVX2's 16 registers), over all of K. Few rows (decode at
 * batch 1-4) get more panels per tile, so enough independent multiply-add chains hide the
 * FMA latency while each weight byte is read exactly once: that is what makes batch-1
 * decode run at the memory's bandwidth instead of a GEMV library's fraction of it. Threads
 * (OpenMP, torch's own pool) split the panels; x is read from cache.
 *
 * Vectors are GCC/Clang vector extensions, not intrinsics: the same source is AVX2 code
 * under -march=native on x86-64-v3, AVX-512 halves on v4, SSE pairs on a baseline x86-64
 * and NEON on ARM. Built by kernels/cpu_native.py.
 */
#include <math.h>
#include <stddef.h>
#include <omp.h>

#if defined(__AVX512F__)
#define PANEL 16
#else
#define PANEL 8
#endif

typedef float vec __attribute__((vector_size(PANEL * 4), aligned(4)));

static inline vec load_panel_row(const float *p) { return *(const vec *)p; }  /* unaligned */

int linear_panel(void) { return PANEL; }

static inline void store_cols(float *y, vec acc, const float *bias, long col, long n) {
    if (col + PANEL <= n) {
        if (bias) acc += *(const vec *)(bias + col);
        *(vec *)(y + col) = acc;
        return;
    }
    for (int j = 0; j < PANEL && col + j < n; j++)
        y[col + j] = acc[j] + (bias ? bias[col + j] : 0.0f);
}

/* One tile: rows m0..m0+R-1 of x, panels p0..p0+P-1. */
#define DEFINE_TILE(NAME, R, P)                                                              \
static void NAME(const float *x, long ldx, const float *w, long k_dim, long n,               \
                 const float *bias, float *y, long ldy, long p0) {                           \
    vec acc[R][P];                                                                            \
    _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                      \
        _Pragma("GCC unroll 8") for (int q = 0; q < P; q++) acc[r][q] = (vec){0};             \
    const float *panel = w + p0 * k_dim * PANEL;                                             \
    const long stride = k_dim * PANEL;                                                       \
    for (long k = 0; k < k_dim; k++) {                                                       \
        vec wv[P];                                                                            \
        _Pragma("GCC unroll 8") for (int q = 0; q < P; q++)                                  \
            wv[q] = load_panel_row(panel + q * stride + k * PANEL);                                   \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                \
            const float s = x[r * ldx + k];                                                  \
            _Pragma("GCC unroll 8") for (int q = 0; q < P; q++) acc[r][q] += wv[q] * s;      \
        }                                                                                    \
    }                                                                                        \
    for (int r = 0; r < R; r++)                                                              \
        for (int q = 0; q < P; q++)                                                          \
            store_cols(y + r * ldy, acc[r][q], bias, (p0 + q) * PANEL, n);                   \
}

DEFINE_TILE(tile_1x8, 1, 8)
DEFINE_TILE(tile_2x4, 2, 4)
DEFINE_TILE(tile_3x4, 3, 4)
DEFINE_TILE(tile_4x3, 4, 3)
DEFINE_TILE(tile_5x2, 5, 2)
DEFINE_TILE(tile_6x2, 6, 2)
#if PANEL == 16  /* AVX-512's 32 registers: 6 x 4 accumulators and 4 weight vectors */
DEFINE_TILE(tile_6x4, 6, 4)
#endif
DEFINE_TILE(tile_1x2, 1, 2)
DEFINE_TILE(tile_2x2, 2, 2)
DEFINE_TILE(tile_3x2, 3, 2)
DEFINE_TILE(tile_4x2, 4, 2)
DEFINE_TILE(tile_1x1, 1, 1)
DEFINE_TILE(tile_2x1, 2, 1)
DEFINE_TILE(tile_3x1, 3, 1)
DEFINE_TILE(tile_4x1, 4, 1)
DEFINE_TILE(tile_5x1, 5, 1)
DEFINE_TILE(tile_6x1, 6, 1)

typedef void (*tile_fn)(const float *, long, const float *, long, long, const float *,
                        float *, long, long);

/* The tiles for `rows` rows (1..6): the widest, and the two- and one-panel tiles that take
 * a thread's leftover panels (two at a time: a one-panel tile does as many loads as
 * multiply-adds). `long_x`: x has more than LONG_X_ROWS rows, where AVX-512's 6 x 4 tile
 * (more multiply-adds per load) is used: on the Zen 4 EPYC it measured faster than oneDNN
 * at 2,048 rows where the 6 x 2 tile was slower (`python -m bench.linear --rows 2048`). */
typedef struct {
    tile_fn wide, pair, narrow;
    int panels;  /* the wide tile's */
} Tiles;

static Tiles tiles_for(long rows, int long_x) {
#if PANEL == 16
    if (rows == 6 && long_x) return (Tiles){tile_6x4, tile_6x2, tile_6x1, 4};
#else
    (void)long_x;
#endif
    switch (rows) {
    case 1: return (Tiles){tile_1x8, tile_1x2, tile_1x1, 8};
    case 2: return (Tiles){tile_2x4, tile_2x2, tile_2x1, 4};
    case 3: return (Tiles){tile_3x4, tile_3x2, tile_3x1, 4};
    case 4: return (Tiles){tile_4x3, tile_4x2, tile_4x1, 3};
    case 5: return (Tiles){tile_5x2, tile_5x2, tile_5x1, 2};
    default: return (Tiles){tile_6x2, tile_6x2, tile_6x1, 2};
    }
}

/* Rows per block of a long x (prefill): the block (ROW_BLOCK x K floats, 720 KB at K = 1536)
 * stays in L2 while every panel group of the thread sweeps it, instead of all of x streaming
 * through the caches once per panel group. A decode step's few rows are one block. */
#define ROW_BLOCK 120
/* More rows than this: the wide 6 x 4 tiles on AVX-512 (tiles_for). On a Xeon (family 6,
 * model 167) they beat the 6 x 2 tiles from 8 rows on (SmolLM2's layers, through 64 rows);
 * on Zen 4, which runs a zmm instruction as two halves, 6 x 2 measured faster at 64 rows, so
 * there the wide tiles start above that. */
#ifndef LONG_X_ROWS  /* bench.linear --panels-define LONG_X_ROWS=64 times another choice */
#if defined(__znver4__) || defined(__znver5__)
#define LONG_X_ROWS 64
#else
#define LONG_X_ROWS 6
#endif
#endif

/* y[m, n] = x[m, k] W^T (+ bias), W packed as above. Each thread takes an equal run of
 * panels (a decode step's 24-panel K/V projections must not leave a core idle) and walks it
 * a few panels at a time, sweeping every row tile of a row block over those before moving
 * on, so they stay in cache across the row tiles. */
int linear_f32(int num_threads, const float *x, long m, long k_dim, const float *w_packed,
               long n, const float *bias, float *y) {
    const long num_panels = (n + PANEL - 1) / PANEL;
    const int long_x = m > LONG_X_ROWS;
    const int full = long_x && PANEL == 16 ? 4 : 2;  /* panels per group of 6-row tiles */
    const int group = m <= 1 ? 8 : (m <= 3 ? 4 : (m <= 4 ? 3 : full));
    #pragma omp parallel num_threads(num_threads)
    {
        const int threads = omp_get_num_threads(), t = omp_get_thread_num();
        const long first = num_panels * t / threads, last = num_panels * (t + 1) / threads;
        for (long b0 = 0; b0 < m; b0 += ROW_BLOCK) {
            const long b1 = b0 + ROW_BLOCK < m ? b0 + ROW_BLOCK : m;
            for (long p0 = first; p0 < last; p0 += group) {
                const long p1 = p0 + group < last ? p0 + group : last;
                for (long m0 = b0; m0 < b1; ) {
                    const long rows = b1 - m0 >= 6 ? 6 : b1 - m0;
                    const Tiles tiles = tiles_for(rows, long_x);
                    const float *xr = x + m0 * k_dim;
                    float *yr = y + m0 * n;
                    long p = p0;
                    for (; p + tiles.panels <= p1; p += tiles.panels)
                        tiles.wide(xr, k_dim, w_packed, k_dim, n, bias, yr, n, p);
                    for (; p + 2 <= p1; p += 2)
                        tiles.pair(xr, k_dim, w_packed, k_dim, n, bias, yr, n, p);
                    for (; p < p1; p++) tiles.narrow(xr, k_dim, w_packed, k_dim, n, bias, yr, n, p);
                    m0 += rows;
                }
            }
        }
    }
    return 0;
}

/* W [n, k] row-major -> the packed panels (out holds ceil(n / PANEL) * k * PANEL floats). */
int pack_f32(int num_threads, const float *w, long n, long k_dim, float *out) {
    const long num_panels = (n + PANEL - 1) / PANEL;
    #pragma omp parallel for num_threads(num_threads) schedule(static)
    for (long p = 0; p < num_panels; p++) {
        float *panel = out + p * k_dim * PANEL;
        for (long k = 0; k < k_dim; k++)
            for (int j = 0; j < PANEL; j++) {
                const long col = p * PANEL + j;
                panel[k * PANEL + j] = col < n ? w[col * k_dim + k] : 0.0f;
            }
    }
    return 0;
}

/* Mixture-of-experts experts in one call (kernels/moe.py has the semantics): the step's
 * (token, slot) pairs counted and placed by expert (slot-major within an expert, as
 * transformers' loop gathers them), each expert's rows gathered once, its gate|up and down
 * projections through linear_f32 on its panels, SiLU-and-mul between, and the weighted rows
 * added into each token's output experts ascending (transformers' order). Ids outside
 * 0..num_experts-1 are skipped. w13 / w2: every expert's packed panels back to back (w13:
 * 2 * inter outputs over hidden, w2: hidden outputs over inter). Scratch: rows [pairs,
 * hidden], gate_up [pairs, 2 * inter], act [pairs, inter], down [pairs, hidden], and
 * 2 * pairs + 2 * (num_experts + 1) longs. */
int moe_f32(int num_threads, const float *x, long tokens, long hidden, const long *ids,
            const float *weights, int top_k, int num_experts, const float *w13, const float *w2,
            long inter, float *y, float *rows, float *gate_up, float *act, float *down,
            long *scratch) {
    const long pairs = tokens * top_k;
    long *pair_of = scratch, *row_of = scratch + pairs;
    long *start = row_of + pairs, *fill = start + num_experts + 1;
    const long w13_size = (2 * inter + PANEL - 1) / PANEL * PANEL * hidden;
    const long w2_size = (hidden + PANEL - 1) / PANEL * PANEL * inter;
    for (int e = 0; e <= num_experts; e++) start[e] = 0;
    for (long p = 0; p < pairs; p++) {  /* p = k * tokens + t: slot-major */
        const long e = ids[(p % tokens) * top_k + p / tokens];
        if (e >= 0 && e < num_experts) start[e + 1]++;
    }
    for (int e = 0; e < num_experts; e++) start[e + 1] += start[e];
    for (int e = 0; e < num_experts; e++) fill[e] = start[e];
    for (long p = 0; p < pairs; p++) {
        const long e = ids[(p % tokens) * top_k + p / tokens];
        row_of[p] = e >= 0 && e < num_experts ? fill[e]++ : -1;
        if (row_of[p] >= 0) pair_of[row_of[p]] = p;
    }
    const long used = start[num_experts];
    #pragma omp parallel for num_threads(num_threads) schedule(static)
    for (long r = 0; r < used; r++) {
        const float *src = x + (pair_of[r] % tokens) * hidden;
        for (long c = 0; c < hidden; c++) rows[r * hidden + c] = src[c];
    }
    for (int e = 0; e < num_experts; e++) {
        const long r0 = start[e], n = start[e + 1] - r0;
        if (n == 0) continue;
        linear_f32(num_threads, rows + r0 * hidden, n, hidden, w13 + e * w13_size, 2 * inter,
                   NULL, gate_up + r0 * 2 * inter);
        /* Per element, so threads change nothing but the time: a prefill's experts have
         * hundreds of rows. */
        #pragma omp parallel for num_threads(num_threads) schedule(static) if (n * inter >= 4096)
        for (long r = r0; r < r0 + n; r++) {
            const float *g = gate_up + r * 2 * inter;
            for (long c = 0; c < inter; c++)
                act[r * inter + c] = g[c] / (1.0f + expf(-g[c])) * g[inter + c];
        }
        linear_f32(num_threads, act + r0 * inter, n, inter, w2 + e * w2_size, hidden, NULL,
                   down + r0 * hidden);
    }
    #pragma omp parallel for num_threads(num_threads) schedule(static)
    for (long t = 0; t < tokens; t++) {
        float *out = y + t * hidden;
        for (long c = 0; c < hidden; c++) out[c] = 0.0f;
        long done = -1;  /* the last expert added: slots go experts ascending */
        for (int added = 0; added < top_k; added++) {
            int best = -1;
            for (int k = 0; k < top_k; k++) {
                const long e = ids[t * top_k + k];
                if (row_of[(long)k * tokens + t] >= 0 && e > done &&
                    (best < 0 || e < ids[t * top_k + best]))
                    best = k;
            }
            if (best < 0) break;
            done = ids[t * top_k + best];
            const float w = weights[t * top_k + best];
            const float *src = down + row_of[(long)best * tokens + t] * hidden;
            for (long c = 0; c < hidden; c++) out[c] += w * src[c];
        }
    }
    return 0;
}
