/* The float operations of an answer's path, computed in one fixed order with one implementation of
 * each transcendental (fixed.h), so their bits are the same on every instruction set the service runs
 * on: torch's norms, activations, softmax, sin/cos and float matrix products take paths chosen by the
 * CPU (ATen's AVX2 or AVX-512 kernels, MKL's and oneDNN's dispatch), whose sums run in other orders and
 * whose exp, tanh and erf round otherwise — and one flipped rounding before an activation is quantized
 * grows through the layers into another answer.
 *
 * - Row operations (`rms_norm`, `layer_norm`, `softmax`, `log_softmax`): a row's sums add input i into
 *   lane i mod 16, in input order, then the 16 lanes by fixed.h's tree — an order fixed by the row's
 *   length alone.
 * - Elementwise ones (`unary`: SiLU, sigmoid, GELU with tanh or erf; `silu_mul`): each element alone.
 * - `cos_sin`: each angle's cosine and sine computed in double, then rounded.
 * - `float_gemm`: y = x·wᵀ (+ bias) with w packed in panels of 16 output columns (`float_pack`); each
 *   output is one chain of fused multiply-adds over the inputs in order, from zero, then its bias —
 *   whatever the rows of the call, its blocking or its threads, so a row's result depends on that row
 *   alone (a float GEMM's blocking, and with it its rounding, changes with the number of rows).
 * - `vision_attention`: the vision tower's attention (each picture, or frame pair, attends within
 *   itself, not causally): rotary applied as transformers applies it, the queries scaled, then the
 *   scores, a softmax and the weighted values as two such products — each score one chain over the
 *   head's dimensions, each output one chain over the keys in order, then divided by the row's sum.
 *
 * Built with -ffp-contract=off (service/native/__init__.py): only the `fmadd`s written here are fused.
 * Called by service/native/float_ops.py. */
#include <stdlib.h>

#include "fixed.h"

int float_lanes(void) { return LANES; }

/* rows × groups vectors of n floats: vector (r, g) at x + r·x_row + g·x_group; y likewise. */
typedef struct {
    const float *x;
    int64_t x_row, x_group;
    int rows, groups, n;
    const float *weight, *bias; /* n floats each, or NULL */
    const float *z;             /* a second input (silu_mul's up) with x's layout */
    int64_t z_row, z_group;
    float eps;
    float *y;
    int64_t y_row, y_group;
} Rows;

/* Spread the rows over the threads only when there is enough work to pay for it. */
#define ENOUGH 32768

/* out = f(v) for each element v of a row of n (the CPU's own vectors, then a part of one): each alone. */
#define ELEMENTWISE(out, x, n, expression)                                \
    do {                                                                  \
        int i_ = 0;                                                       \
        for (; i_ + NATIVE <= (n); i_ += NATIVE) {                        \
            const vn v = n_load((x) + i_);                                \
            n_store((out) + i_, (expression));                            \
        }                                                                 \
        if (i_ < (n)) {                                                   \
            const vn v = n_load_part((x) + i_, (n) - i_);                 \
            n_store_part((out) + i_, (expression), (n) - i_);             \
        }                                                                 \
    } while (0)

/* The native vector of w (a weight or bias row, or none: `none`) at element i of a row of n. */
static inline vn n_at(const float *w, int i, int n, float none) {
    if (!w) return n_splat(none);
    return n - i >= NATIVE ? n_load(w + i) : n_load_part(w + i, n - i);
}

/* x / sqrt(mean(x²) + eps) · weight (torch's F.rms_norm; no weight: 1). */
static void rms_norm_one(const Rows *r, const float *x, float *y) {
    const int n = r->n;
    const vn s = n_splat(1.0f / __builtin_sqrtf(row_sum(x, n, 0.0f, 1) / (float)n + r->eps));
    if (!r->weight) {
        ELEMENTWISE(y, x, n, v * s);
        return;
    }
    for (int i = 0; i < n; i += NATIVE) {
        const int count = n - i < NATIVE ? n - i : NATIVE;
        const vn v = (count == NATIVE ? n_load(x + i) : n_load_part(x + i, count)) * s * n_at(r->weight, i, n, 1.0f);
        if (count == NATIVE)
            n_store(y + i, v);
        else
            n_store_part(y + i, v, count);
    }
}

/* (x - mean) / sqrt(var + eps) · weight + bias, the variance about the mean (torch's F.layer_norm). */
static void layer_norm_one(const Rows *r, const float *x, float *y) {
    const int n = r->n;
    const float mean = row_sum(x, n, 0.0f, 0) / (float)n;
    const vn m = n_splat(mean), s = n_splat(1.0f / __builtin_sqrtf(row_sum(x, n, mean, 1) / (float)n + r->eps));
    for (int i = 0; i < n; i += NATIVE) {
        const int count = n - i < NATIVE ? n - i : NATIVE;
        vn v = ((count == NATIVE ? n_load(x + i) : n_load_part(x + i, count)) - m) * s;
        if (r->weight) v = v * n_at(r->weight, i, n, 1.0f);
        if (r->bias) v = v + n_at(r->bias, i, n, 0.0f);
        if (count == NATIVE)
            n_store(y + i, v);
        else
            n_store_part(y + i, v, count);
    }
}

static void softmax_one(const Rows *r, const float *x, float *y) {
    const int n = r->n;
    const vn s = n_splat(exps(x, n, row_max(x, n), y));
    ELEMENTWISE(y, y, n, v / s);
}

/* x - max - log(Σ exp(x - max)) */
static void log_softmax_one(const Rows *r, const float *x, float *y) {
    const int n = r->n;
    const float top = row_max(x, n);
    const float log_sum = scalar(vlog(splat(exps(x, n, top, y))));
    const vn t = n_splat(top), l = n_splat(log_sum);
    ELEMENTWISE(y, x, n, (v - t) - l);
}

enum { SILU = 0, SIGMOID = 1, GELU_TANH = 2, GELU_ERF = 3 };

static inline vn gelu_tanh(vn x) {
    const vn inner = n_splat(0.7978845608028654f) * (x + n_splat(0.044715f) * (x * x * x));
    return n_splat(0.5f) * x * (n_splat(1.0f) + n_tanh(inner));
}

static inline vn gelu_erf(vn x) {
    return x * n_splat(0.5f) * (n_splat(1.0f) + n_erf(x * n_splat(0.7071067811865476f)));
}

typedef void (*row_fn)(const Rows *, const float *, float *);

static void each_vector(const Rows *r, row_fn f, int threads) {
    const int64_t count = (int64_t)r->rows * r->groups;
    if (count * r->n < ENOUGH || threads < 1) threads = 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t v = 0; v < count; v++) {
        const int64_t row = v / r->groups, group = v % r->groups;
        f(r, r->x + row * r->x_row + group * r->x_group, r->y + row * r->y_row + group * r->y_group);
    }
}

void rms_norm(const Rows *r, int threads) { each_vector(r, rms_norm_one, threads); }
void layer_norm(const Rows *r, int threads) { each_vector(r, layer_norm_one, threads); }
void softmax(const Rows *r, int threads) { each_vector(r, softmax_one, threads); }
void log_softmax(const Rows *r, int threads) { each_vector(r, log_softmax_one, threads); }

/* The same for plain rows (the forward's usual call: no structure to build, a few microseconds less a call). */
void rms_norm_rows(const float *x, int64_t x_row, int rows, int n, const float *weight, float eps, float *y,
                   int threads) {
    const Rows r = {.x = x, .x_row = x_row, .rows = rows, .groups = 1, .n = n, .weight = weight, .eps = eps,
                    .y = y, .y_row = n};
    rms_norm(&r, threads);
}

/* x[token] - max - log(Σ exp(x - max)) of one row: its log_softmax's element, without the rest. */
float log_softmax_at(const float *x, int n, int token) {
    static __thread float *scratch;
    static __thread int size;
    if (n > size) {
        free(scratch);
        scratch = malloc(sizeof(float) * (n + LANES));
        size = scratch ? n : 0;
        if (!scratch) return __builtin_nanf("");
    }
    const float top = row_max(x, n);
    const float log_sum = scalar(vlog(splat(exps(x, n, top, scratch))));
    return (x[token] - top) - log_sum;
}

/* f(x) elementwise, f one of SILU, SIGMOID, GELU_TANH, GELU_ERF. */
void unary(int kind, const Rows *r, int threads) {
    const int64_t count = (int64_t)r->rows * r->groups;
    if (count * r->n < ENOUGH || threads < 1) threads = 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t v = 0; v < count; v++) {
        const int64_t row = v / r->groups, group = v % r->groups;
        const float *x = r->x + row * r->x_row + group * r->x_group;
        float *y = r->y + row * r->y_row + group * r->y_group;
        switch (kind) {
        case SILU: ELEMENTWISE(y, x, r->n, n_silu(v)); break;
        case SIGMOID: ELEMENTWISE(y, x, r->n, n_sigmoid(v)); break;
        case GELU_TANH: ELEMENTWISE(y, x, r->n, gelu_tanh(v)); break;
        default: ELEMENTWISE(y, x, r->n, gelu_erf(v)); break;
        }
    }
}

/* silu(x) · z, rounded as the two torch ops round it. */
void silu_mul(const Rows *r, int threads) {
    const int64_t count = (int64_t)r->rows * r->groups;
    if (count * r->n < ENOUGH || threads < 1) threads = 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t v = 0; v < count; v++) {
        const int64_t row = v / r->groups, group = v % r->groups;
        const float *x = r->x + row * r->x_row + group * r->x_group;
        const float *z = r->z + row * r->z_row + group * r->z_group;
        float *y = r->y + row * r->y_row + group * r->y_group;
        int i = 0;
        for (; i + NATIVE <= r->n; i += NATIVE) n_store(y + i, n_silu(n_load(x + i)) * n_load(z + i));
        if (i < r->n) {
            const int rest = r->n - i;
            n_store_part(y + i, n_silu(n_load_part(x + i, rest)) * n_load_part(z + i, rest), rest);
        }
    }
}

/* cos and sin of each of `count` angles, computed in double and rounded to float. */
void cos_sin(const float *angles, int64_t count, float *cosines, float *sines) {
    for (int64_t i = 0; i < count; i++) {
        double s, c;
        sin_cos((double)angles[i], &s, &c);
        cosines[i] = (float)c;
        sines[i] = (float)s;
    }
}

/* ---- the fixed-order float matrix product ------------------------------------------------------------ */

/* Panels of 16 output columns: column c of input j at panel c / 16, offset j·16 + c mod 16. */
int64_t float_packed_floats(int n, int k) { return (int64_t)(n + LANES - 1) / LANES * LANES * k; }

/* w (n × k, row-major) → panels; the padding columns are zeros. */
void float_pack(const float *w, int n, int k, float *packed) {
    const int panels = (n + LANES - 1) / LANES;
#pragma omp parallel for schedule(static)
    for (int p = 0; p < panels; p++) {
        float *panel = packed + (int64_t)p * k * LANES;
        for (int c = 0; c < LANES; c++) {
            const int column = p * LANES + c;
            for (int j = 0; j < k; j++) panel[(int64_t)j * LANES + c] = column < n ? w[(int64_t)column * k + j] : 0.0f;
        }
    }
}

/* The products' own vectors: one AVX-512 register holds a panel's 16 columns, two AVX2 ones hold them
 * (a column's chain of fused multiply-adds is the same either way: each lane is its own chain). */
#if defined(__AVX512F__)
typedef __m512 vg;
#define N_LOAD(p) _mm512_loadu_ps(p)
#define N_STORE(p, v) _mm512_storeu_ps(p, v)
#define N_SET(x) _mm512_set1_ps(x)
#define N_ZERO() _mm512_setzero_ps()
#define N_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define N_ADD(a, b) _mm512_add_ps(a, b)
#define ROWS 8 /* 8 rows × 2 panels: 16 accumulators of the 32 registers */
#define PANELS 2
#else
typedef __m256 vg;
#define N_LOAD(p) _mm256_loadu_ps(p)
#define N_STORE(p, v) _mm256_storeu_ps(p, v)
#define N_SET(x) _mm256_set1_ps(x)
#define N_ZERO() _mm256_setzero_ps()
#define N_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define N_ADD(a, b) _mm256_add_ps(a, b)
#define ROWS 4 /* 4 rows × 1 panel: 8 accumulators of the 16 registers */
#define PANELS 1
#endif

/* R rows × P panels of outputs, inputs [k0, k1): acc = y (or 0 when `first`), acc = fma(x[r][j], w[j], acc)
 * for j in order; stored back to y, plus the bias when given (the last block). w: panel p at
 * w + p·panel, input j of it at + j·step. */
#define MICRO(R, P)                                                                                               \
    static void micro_##R##_##P(const float *x, int64_t x_row, const float *w, int64_t panel, int64_t step, int k0, \
                                int k1, float *y, int64_t y_row, int first, const float *bias) {                    \
        enum { V = P * HALVES };                                                                                  \
        vg acc[R][V];                                                                                             \
        for (int r = 0; r < R; r++)                                                                               \
            for (int v = 0; v < V; v++) acc[r][v] = first ? N_ZERO() : N_LOAD(y + r * y_row + v * NATIVE);        \
        for (int j = k0; j < k1; j++) {                                                                           \
            vg b[V];                                                                                              \
            for (int v = 0; v < V; v++) b[v] = N_LOAD(w + (v / HALVES) * panel + (int64_t)j * step + v % HALVES * NATIVE); \
            for (int r = 0; r < R; r++) {                                                                         \
                const vg a = N_SET(x[r * x_row + j]);                                                             \
                for (int v = 0; v < V; v++) acc[r][v] = N_FMA(a, b[v], acc[r][v]);                                \
            }                                                                                                     \
        }                                                                                                         \
        for (int r = 0; r < R; r++)                                                                               \
            for (int v = 0; v < V; v++)                                                                           \
                N_STORE(y + r * y_row + v * NATIVE, bias ? N_ADD(acc[r][v], N_LOAD(bias + v * NATIVE)) : acc[r][v]); \
    }

typedef void (*micro_fn)(const float *, int64_t, const float *, int64_t, int64_t, int, int, float *, int64_t, int,
                         const float *);

#if ROWS == 8
MICRO(1, 1) MICRO(2, 1) MICRO(3, 1) MICRO(4, 1) MICRO(5, 1) MICRO(6, 1) MICRO(7, 1) MICRO(8, 1)
MICRO(1, 2) MICRO(2, 2) MICRO(3, 2) MICRO(4, 2) MICRO(5, 2) MICRO(6, 2) MICRO(7, 2) MICRO(8, 2)
static const micro_fn MICROS[3][ROWS + 1] = {
    {0},
    {0, micro_1_1, micro_2_1, micro_3_1, micro_4_1, micro_5_1, micro_6_1, micro_7_1, micro_8_1},
    {0, micro_1_2, micro_2_2, micro_3_2, micro_4_2, micro_5_2, micro_6_2, micro_7_2, micro_8_2},
};
#else
MICRO(1, 1) MICRO(2, 1) MICRO(3, 1) MICRO(4, 1)
static const micro_fn MICROS[2][ROWS + 1] = {{0}, {0, micro_1_1, micro_2_1, micro_3_1, micro_4_1}};
#endif

#define K_BLOCK 256 /* inputs per pass over a panel pair: its 32 KiB stay in the L1 cache for every row block */

/* Rows [0, m) of x against panels [p0, p0 + P) of w (P = 1 or 2), every input: into y (row stride y_row),
 * whose columns are those of the panels. */
static void panel_pair(const float *x, int64_t x_row, int m, int k, const float *w, int64_t panel, int64_t step,
                       int P, const float *bias, float *y, int64_t y_row) {
    for (int k0 = 0; k0 < k; k0 += K_BLOCK) {
        const int k1 = k0 + K_BLOCK < k ? k0 + K_BLOCK : k;
        const float *b = k1 == k ? bias : 0;
        for (int r0 = 0; r0 < m; r0 += ROWS) {
            const int rows = m - r0 < ROWS ? m - r0 : ROWS;
            for (int p = 0; p < P; p += PANELS) /* AVX2: one panel at a time */
                MICROS[P - p < PANELS ? P - p : PANELS][rows](x + (int64_t)r0 * x_row, x_row, w + p * panel, panel, step,
                                                              k0, k1, y + (int64_t)r0 * y_row + p * LANES, y_row,
                                                              k0 == 0, b ? b + p * LANES : 0);
        }
    }
}

typedef struct {
    const float *x;
    int64_t x_row;
    int m, k, n;
    const float *packed; /* float_pack's panels */
    const float *bias;   /* n floats, or NULL */
    float *y;
    int64_t y_row;
} FloatGemm;

/* y = x·wᵀ + bias; 0, or 2 when out of memory. */
int float_gemm(const FloatGemm *g, int threads) {
    const int panels = (g->n + LANES - 1) / LANES, pairs = (panels + 1) / 2;
    const int64_t panel = (int64_t)g->k * LANES;
    /* the last pair when it holds padding columns: computed into scratch, then its own columns copied */
    const int ragged = g->n % (2 * LANES) ? 1 : 0;
    float *scratch = ragged ? malloc(sizeof(float) * 2 * LANES * (g->m > 0 ? g->m : 1)) : 0;
    float *bias = 0;
    if (ragged && g->bias) {
        bias = calloc(2 * LANES, sizeof(float));
        if (bias) memcpy(bias, g->bias + (int64_t)(pairs - 1) * 2 * LANES, sizeof(float) * (g->n - (pairs - 1) * 2 * LANES));
    }
    if ((ragged && !scratch) || (ragged && g->bias && !bias)) {
        free(scratch), free(bias);
        return 2;
    }
    if ((int64_t)g->m * g->n * g->k < ENOUGH || threads < 1) threads = 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int pair = 0; pair < pairs; pair++) {
        const int p0 = 2 * pair, P = p0 + 1 < panels ? 2 : 1;
        const float *w = g->packed + (int64_t)p0 * panel;
        if (ragged && pair == pairs - 1) {
            panel_pair(g->x, g->x_row, g->m, g->k, w, panel, LANES, P, g->bias ? bias : 0, scratch, 2 * LANES);
            const int columns = g->n - p0 * LANES;
            for (int r = 0; r < g->m; r++)
                memcpy(g->y + (int64_t)r * g->y_row + p0 * LANES, scratch + r * 2 * LANES, sizeof(float) * columns);
        } else {
            panel_pair(g->x, g->x_row, g->m, g->k, w, panel, LANES, P, g->bias ? g->bias + p0 * LANES : 0,
                       g->y + p0 * LANES, g->y_row);
        }
    }
    free(scratch), free(bias);
    return 0;
}

/* ---- the vision tower's attention ---------------------------------------------------------------------- */

typedef struct {
    const float *qkv;   /* tokens × (3 · heads · dim): each token's query heads, key heads, value heads */
    int64_t qkv_row;
    const float *cos, *sin; /* tokens × dim: the rotary embedding */
    const int32_t *starts;  /* segments + 1 token offsets: each segment attends within itself */
    int segments, heads, dim;
    float scale;
    float *out; /* tokens × (heads · dim) */
    int64_t out_row;
} VisionAttention;

#define QUERY_TILE 32 /* query rows a work item computes: their scores (32 × keys) stay in the L2 cache */

/* x·cos + rotate_half(x)·sin, rotate_half(x) = (-x2, x1): transformers' products and sums. */
static void rotate(const float *x, const float *cos, const float *sin, int dim, float *out) {
    const int half = dim / 2;
    for (int i = 0; i < dim; i++) {
        const float turned = i < half ? -x[i + half] : x[i - half];
        out[i] = x[i] * cos[i] + turned * sin[i];
    }
}

static float *call_scratch(size_t bytes) {
    static __thread struct scratch mine;
    return scratch_of(&mine, bytes, 1 << 20);
}

static float *item_scratch(size_t bytes) {
    static __thread struct scratch mine;
    return scratch_of(&mine, bytes, 65536);
}

static inline int64_t up16(int64_t x) { return (x + LANES - 1) / LANES * LANES; }

/* 0; 1 for sizes it cannot take; 2 when out of memory. */
int vision_attention(const VisionAttention *a, int threads) {
    const int heads = a->heads, dim = a->dim, dpad = (int)up16(dim);
    if (dim % 2 || a->segments < 1) return 1;
    /* per segment and head: queries rotated [length][dim], keys rotated in panels [length/16][dim][16],
     * values [length][dpad] (padding columns zero) */
    int64_t floats = 0, longest = 0;
    int64_t *offsets = malloc(sizeof(int64_t) * (a->segments + 1));
    if (!offsets) return 2;
    for (int s = 0; s < a->segments; s++) {
        const int64_t length = a->starts[s + 1] - a->starts[s];
        offsets[s] = floats;
        floats += heads * (length * dim + up16(length) * dim + length * dpad);
        longest = length > longest ? length : longest;
    }
    offsets[a->segments] = floats;
    float *packed = call_scratch(sizeof(float) * (floats + 1));
    if (!packed) {
        free(offsets);
        return 2;
    }
    int items = 0;
    for (int s = 0; s < a->segments; s++)
        items += heads * (int)((a->starts[s + 1] - a->starts[s] + QUERY_TILE - 1) / QUERY_TILE);
    const int64_t stride = up16(longest); /* a score row: every key, padding to whole panels */
    const size_t per_item = sizeof(float) * ((size_t)QUERY_TILE * stride + (size_t)QUERY_TILE * dpad + 2 * LANES);
    int failed = 0;
    if (threads < 1) threads = 1;
#pragma omp parallel num_threads(threads)
    {
        const unsigned int csr = _mm_getcsr();
        _mm_setcsr(csr | 0x8040); /* subnormals flushed, as in attention.c: tiny weights cost no assists */
#pragma omp for schedule(static)
        for (int sh = 0; sh < a->segments * heads; sh++) {
            const int s = sh / heads, h = sh % heads;
            const int start = a->starts[s], length = a->starts[s + 1] - start;
            float *q = packed + offsets[s] + (int64_t)h * (length * dim + up16(length) * dim + length * dpad);
            float *k = q + (int64_t)length * dim, *values = k + up16(length) * dim;
            float rotated[dim];
            for (int t = 0; t < length; t++) {
                const float *row = a->qkv + (int64_t)(start + t) * a->qkv_row;
                const float *cos = a->cos + (int64_t)(start + t) * dim, *sin = a->sin + (int64_t)(start + t) * dim;
                rotate(row + (int64_t)h * dim, cos, sin, dim, rotated);
                for (int d = 0; d < dim; d++) q[(int64_t)t * dim + d] = rotated[d] * a->scale; /* scaled once */
                rotate(row + (int64_t)(heads + h) * dim, cos, sin, dim, rotated);
                float *panel = k + (int64_t)(t / LANES) * dim * LANES + t % LANES;
                for (int d = 0; d < dim; d++) panel[d * LANES] = rotated[d];
                memcpy(values + (int64_t)t * dpad, row + (int64_t)(2 * heads + h) * dim, sizeof(float) * dim);
                memset(values + (int64_t)t * dpad + dim, 0, sizeof(float) * (dpad - dim));
            }
            for (int t = length; t < up16(length); t++) {
                float *panel = k + (int64_t)(t / LANES) * dim * LANES + t % LANES;
                for (int d = 0; d < dim; d++) panel[d * LANES] = 0.0f;
            }
        }
        float *scratch = item_scratch(per_item);
        if (!scratch) {
#pragma omp atomic write
            failed = 2;
        }
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < items; item++) {
            if (!scratch) continue;
            /* which segment, head and query tile */
            int s = 0, rest = item;
            for (;; s++) {
                const int tiles = heads * ((a->starts[s + 1] - a->starts[s] + QUERY_TILE - 1) / QUERY_TILE);
                if (rest < tiles) break;
                rest -= tiles;
            }
            const int start = a->starts[s], length = a->starts[s + 1] - start;
            const int tiles = (length + QUERY_TILE - 1) / QUERY_TILE, h = rest / tiles, tile = rest % tiles;
            const int q0 = tile * QUERY_TILE, rows = length - q0 < QUERY_TILE ? length - q0 : QUERY_TILE;
            const float *q = packed + offsets[s] + (int64_t)h * (length * dim + up16(length) * dim + length * dpad);
            const float *k = q + (int64_t)length * dim, *values = k + up16(length) * dim;
            const int64_t keys = up16(length), panel = (int64_t)dim * LANES;
            float *scores = scratch, *o = scores + (size_t)QUERY_TILE * stride;
            /* scores: each one chain over the head's dimensions */
            for (int p0 = 0; p0 < keys / LANES; p0 += 2) {
                const int P = p0 + 1 < keys / LANES ? 2 : 1;
                panel_pair(q + (int64_t)q0 * dim, dim, rows, dim, k + p0 * panel, panel, LANES, P, 0,
                           scores + p0 * LANES, stride);
            }
            /* softmax of each row over its segment's keys: exp(s - max), its sum in fixed order */
            float inverse[QUERY_TILE];
            for (int r = 0; r < rows; r++) {
                float *row = scores + (int64_t)r * stride;
                inverse[r] = 1.0f / exps(row, length, row_max(row, length), row);
            }
            /* values: each output one chain over the keys in order */
            for (int p0 = 0; p0 < dpad / LANES; p0 += 2) {
                const int P = p0 + 1 < dpad / LANES ? 2 : 1;
                panel_pair(scores, stride, rows, length, values + p0 * LANES, LANES, dpad, P, 0, o + p0 * LANES, dpad);
            }
            for (int r = 0; r < rows; r++) {
                float *out = a->out + (int64_t)(start + q0 + r) * a->out_row + (int64_t)h * dim;
                const vn w = n_splat(inverse[r]);
                ELEMENTWISE(out, o + (int64_t)r * dpad, dim, v * w);
            }
        }
        _mm_setcsr(csr);
    }
    free(offsets);
    return failed;
}

/* silu_mul for plain rows. */
void silu_mul_rows(const float *x, int64_t x_row, const float *z, int64_t z_row, int rows, int n, float *y,
                   int threads) {
    const Rows r = {.x = x, .x_row = x_row, .rows = rows, .groups = 1, .n = n, .z = z, .z_row = z_row, .y = y,
                    .y_row = n};
    silu_mul(&r, threads);
}
