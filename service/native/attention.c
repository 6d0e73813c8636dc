/* Causal attention whose result for a query row depends on that row and its keys only.
 *
 * A query at position p attends keys 0..p of its own cache. Every number it produces is computed
 * by one fixed sequence of operations that depends on nothing but p: its dot products with keys,
 * taken a block of W keys at a time from key 0 (the blocks are absolute, so a decode step and a
 * prefill piece that holds the same query cut the keys alike), a fixed lane tree per sum, an
 * exp of its own, softmax sums in key order, values accumulated in key order. How many query rows
 * share the call, where a prefill piece starts, or which thread runs it changes no bit. (Library
 * attention — SDPA's flash kernel, BLAS — picks blockings and GEMV/GEMM paths by the number of
 * query rows, so the same token's keys differ in the last bits between decode and prefill.)
 *
 * Built by service/native/__init__.py for service/model/attention.py with the machine's own flags
 * (-march=native): the same binary computes every path of one server. All loops run on whole
 * vectors (padded blocks, zeroed tails), so one instruction sequence computes every element. And
 * the same on every instruction set: blocks of 16 keys and 16-float vectors everywhere (fixed.h: one
 * AVX-512 register or two AVX2 ones, summed by the same tree), fused multiply-adds only where this
 * file writes `fmadd` (built with -ffp-contract=off), fixed.h's exp.
 */
#include <stdlib.h>

#include "fixed.h"

#define W LANES /* keys per block, lanes per vector: 16 on every instruction set (two registers on AVX2) */

typedef uint32_t vu __attribute__((vector_size(W * 4)));
typedef uint16_t vh __attribute__((vector_size(W * 2)));

int attention_lanes(void) { return W; }

static inline vf load_f32(const float *p) { return load(p); }

static inline void store_f32(float *p, vf v) { store(p, v); }

static inline vf load_bf16(const uint16_t *p) {
    vh h;
    memcpy(&h, p, sizeof h);
    vu u = __builtin_convertvector(h, vu) << 16;
    vf f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* The W dot products of one block, each a W-lane partial vector, summed lane-wise by the same
 * tree for every key (halves added at distance W/2, W/4, ... 1): lane t of the result is key t. */
static inline vf reduce_block(vf *a) {
    vf b[8], c[4], d[2];
    for (int t = 0; t < 8; t++)
        b[t] = __builtin_shuffle(a[t], a[t + 8], (vi){0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}) +
               __builtin_shuffle(a[t], a[t + 8], (vi){8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31});
    for (int t = 0; t < 4; t++)
        c[t] = __builtin_shuffle(b[t], b[t + 4], (vi){0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27}) +
               __builtin_shuffle(b[t], b[t + 4], (vi){4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31});
    for (int t = 0; t < 2; t++)
        d[t] = __builtin_shuffle(c[t], c[t + 2], (vi){0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29}) +
               __builtin_shuffle(c[t], c[t + 2], (vi){2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31});
    return __builtin_shuffle(d[0], d[1], (vi){0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30}) +
           __builtin_shuffle(d[0], d[1], (vi){1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31});
}

typedef struct {
    const float *q;      /* [n, q_heads, dim] */
    int64_t q_row;       /* floats between rows */
    int n, start;        /* query rows; the first one's position (it attends keys 0..start) */
    const void *k, *v;   /* the cache: [kv_heads, capacity, dim] with the strides below */
    int64_t kv_head, kv_token;
    int bf16;            /* keys and values in bfloat16 (else float32) */
    float *out;          /* [n, q_heads, dim] */
    int64_t out_row;
    int q_heads, kv_heads, dim;
    float scale;
} Attention;

static inline vf load_kv(const Attention *a, const void *base, int64_t offset) {
    return a->bf16 ? load_bf16((const uint16_t *)base + offset) : load_f32((const float *)base + offset);
}

#if !defined(__AVX512F__)
/* 8 keys' or values' floats as one AVX2 register (GCC keeps its 16-float vectors in memory there). */
static inline __m256 load8_kv(int bf16, const void *base, int64_t offset) {
    if (!bf16) return _mm256_loadu_ps((const float *)base + offset);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + offset));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#endif

/* Keys j0..j0+W-1 of one head as float32 rows in `block` (W × dim); rows past `avail` are zeros. */
static void load_block(const Attention *a, const void *head, int j0, int avail, float *block) {
    for (int t = 0; t < W; t++) {
        float *row = block + (int64_t)t * a->dim;
        if (j0 + t >= avail) {
            memset(row, 0, sizeof(float) * a->dim);
            continue;
        }
        int64_t at = (int64_t)(j0 + t) * a->kv_token;
#if defined(__AVX512F__)
        for (int c = 0; c < a->dim; c += W) store_f32(row + c, load_kv(a, head, at + c));
#else
        for (int c = 0; c < a->dim; c += 8) _mm256_storeu_ps(row + c, load8_kv(a->bf16, head, at + c));
#endif
    }
}

#if defined(__AVX512F__)
/* One query against a block of W keys (W × dim floats): lane t of `out` is key t's score. */
static inline void block_scores(const float *q, const float *block, int dim, float scale, float *out) {
    vf dots[W];
    for (int t = 0; t < W; t++) dots[t] = splat(0.0f);
    for (int c = 0; c < dim / W; c++) {
        vf qc = load_f32(q + c * W);
        for (int t = 0; t < W; t++) dots[t] = fmadd(qc, load_f32(block + t * dim + c * W), dots[t]);
    }
    store_f32(out, reduce_block(dots) * splat(scale));
}
#else
/* AVX2 computes the same sums on its own 8-float registers (GCC keeps its 16-float vectors in memory
 * inside such loops): a 16-lane vector is two registers, lanes 0-7 and 8-15. */
typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

/* The tree's levels after its first (lanes j and j + 8), for 8 keys: h[t] holds key t's 8 half sums;
 * lane t of the result is key t's total (lanes j and j + 4, then j + 2, then j + 1, as reduce_block). */
static inline v8 reduce_halves(const v8 *h) {
    v8 b[4], c[2];
    for (int t = 0; t < 4; t++)
        b[t] = __builtin_shuffle(h[t], h[t + 4], (v8i){0, 1, 2, 3, 8, 9, 10, 11}) +
               __builtin_shuffle(h[t], h[t + 4], (v8i){4, 5, 6, 7, 12, 13, 14, 15});
    for (int t = 0; t < 2; t++)
        c[t] = __builtin_shuffle(b[t], b[t + 2], (v8i){0, 1, 8, 9, 4, 5, 12, 13}) +
               __builtin_shuffle(b[t], b[t + 2], (v8i){2, 3, 10, 11, 6, 7, 14, 15});
    return __builtin_shuffle(c[0], c[1], (v8i){0, 8, 2, 10, 4, 12, 6, 14}) +
           __builtin_shuffle(c[0], c[1], (v8i){1, 9, 3, 11, 5, 13, 7, 15});
}

/* reduce_block's sums, 4 keys at a time: each key's lanes j and j + 8 added once its chains are done. */
static inline void block_scores(const float *q, const float *block, int dim, float scale, float *out) {
    v8 halves[W];
    for (int t0 = 0; t0 < W; t0 += 4) {
        __m256 lo[4], hi[4];
        for (int t = 0; t < 4; t++) lo[t] = hi[t] = _mm256_setzero_ps();
        for (int c = 0; c < dim; c += W) {
            const __m256 qlo = _mm256_loadu_ps(q + c), qhi = _mm256_loadu_ps(q + c + 8);
            for (int t = 0; t < 4; t++) {
                const float *k = block + (t0 + t) * dim + c;
                lo[t] = _mm256_fmadd_ps(qlo, _mm256_loadu_ps(k), lo[t]);
                hi[t] = _mm256_fmadd_ps(qhi, _mm256_loadu_ps(k + 8), hi[t]);
            }
        }
        for (int t = 0; t < 4; t++) halves[t0 + t] = (v8)_mm256_add_ps(lo[t], hi[t]);
    }
    const v8 factor = (v8){scale, scale, scale, scale, scale, scale, scale, scale};
    v8 first = reduce_halves(halves) * factor, second = reduce_halves(halves + 8) * factor;
    memcpy(out, &first, sizeof first);
    memcpy(out + 8, &second, sizeof second);
}

/* Σ_j p[j] · values[j] for two queries, 32 of the head's dimensions at a time (then 16): the same chains
 * in key order as the 16-lane loops, on 8 registers of sums. */
static void weighted_values_avx2(const Attention *a, const void *values, const float *p0, const float *p1, int limit,
                                 float *o0, float *o1) {
    for (int c0 = 0; c0 < a->dim; c0 += 32) {
        const int n = a->dim - c0 >= 32 ? 4 : 2; /* registers per query */
        __m256 x[4], y[4];
        for (int v = 0; v < 4; v++) x[v] = y[v] = _mm256_setzero_ps();
        for (int j = 0; j < limit; j++) {
            const int64_t at = (int64_t)j * a->kv_token + c0;
            const __m256 w0 = _mm256_set1_ps(p0[j]), w1 = _mm256_set1_ps(p1[j]);
            for (int v = 0; v < 4; v++) {
                if (v >= n) break;
                const __m256 value = load8_kv(a->bf16, values, at + v * 8);
                x[v] = _mm256_fmadd_ps(w0, value, x[v]);
                y[v] = _mm256_fmadd_ps(w1, value, y[v]);
            }
        }
        for (int v = 0; v < n; v++) {
            _mm256_storeu_ps(o0 + c0 + v * 8, x[v]);
            _mm256_storeu_ps(o1 + c0 + v * 8, y[v]);
        }
    }
}
#endif

/* Σ_j p[j] · values[j] over j < limit, in key order, for two queries at once (they share each
 * value load): `CHUNKS` vectors per query kept in registers where the head size is one of these. */
#define WEIGHTED_VALUES(CHUNKS)                                                                                    \
    static void weighted_values_##CHUNKS(const Attention *a, const void *values, const float *p0, const float *p1, \
                                         int limit, float *o0, float *o1) {                                        \
        vf x[CHUNKS], y[CHUNKS];                                                                                  \
        for (int c = 0; c < CHUNKS; c++) x[c] = y[c] = splat(0.0f);                                               \
        for (int j = 0; j < limit; j++) {                                                                         \
            const int64_t at = (int64_t)j * a->kv_token;                                                          \
            const vf w0 = splat(p0[j]), w1 = splat(p1[j]);                                                        \
            for (int c = 0; c < CHUNKS; c++) {                                                                    \
                vf value = load_kv(a, values, at + c * W);                                                        \
                x[c] = fmadd(w0, value, x[c]);                                                                    \
                y[c] = fmadd(w1, value, y[c]);                                                                    \
            }                                                                                                     \
        }                                                                                                         \
        for (int c = 0; c < CHUNKS; c++) {                                                                        \
            store_f32(o0 + c * W, x[c]);                                                                          \
            store_f32(o1 + c * W, y[c]);                                                                          \
        }                                                                                                         \
    }
WEIGHTED_VALUES(1)
WEIGHTED_VALUES(2)
WEIGHTED_VALUES(4)
WEIGHTED_VALUES(8)
WEIGHTED_VALUES(16)

/* Any other head size: the same sums, accumulated in memory. */
static void weighted_values_any(const Attention *a, const void *values, const float *p0, const float *p1, int limit,
                                float *o0, float *o1) {
    const int chunks = a->dim / W;
    for (int c = 0; c < chunks; c++) store_f32(o0 + c * W, splat(0.0f)), store_f32(o1 + c * W, splat(0.0f));
    for (int j = 0; j < limit; j++) {
        const int64_t at = (int64_t)j * a->kv_token;
        const vf w0 = splat(p0[j]), w1 = splat(p1[j]);
        for (int c = 0; c < chunks; c++) {
            vf value = load_kv(a, values, at + c * W);
            store_f32(o0 + c * W, fmadd(w0, value, load_f32(o0 + c * W)));
            store_f32(o1 + c * W, fmadd(w1, value, load_f32(o1 + c * W)));
        }
    }
}

static void weighted_values(const Attention *a, const void *values, const float *p0, const float *p1, int limit,
                            float *o0, float *o1) {
#if !defined(__AVX512F__)
    weighted_values_avx2(a, values, p0, p1, limit, o0, o1);
    return;
#endif
    switch (a->dim / W) {
    case 1: weighted_values_1(a, values, p0, p1, limit, o0, o1); break;
    case 2: weighted_values_2(a, values, p0, p1, limit, o0, o1); break;
    case 4: weighted_values_4(a, values, p0, p1, limit, o0, o1); break;
    case 8: weighted_values_8(a, values, p0, p1, limit, o0, o1); break;
    case 16: weighted_values_16(a, values, p0, p1, limit, o0, o1); break;
    default: weighted_values_any(a, values, p0, p1, limit, o0, o1);
    }
}

/* One kv head, query rows [r0, r1): `scores` holds (r1 - r0) * group rows of `stride` floats. */
static void attend_tile(const Attention *a, int head, int r0, int r1, float *scores, int64_t stride, float *block,
                        float *acc) {
    const int group = a->q_heads / a->kv_heads, dim = a->dim, chunks = dim / W;
    const int rows = (r1 - r0) * group, avail = a->start + r1;
    const void *keys = (const char *)a->k + head * a->kv_head * (a->bf16 ? 2 : 4);
    const void *values = (const char *)a->v + head * a->kv_head * (a->bf16 ? 2 : 4);

    /* scores: every query against every block of keys up to its own position */
    for (int j0 = 0; j0 < avail; j0 += W) {
        load_block(a, keys, j0, avail, block);
        for (int i = 0; i < rows; i++) {
            int r = r0 + i / group;
            if (j0 > a->start + r) continue;
            const float *q = a->q + r * a->q_row + (head * group + i % group) * dim;
            block_scores(q, block, dim, a->scale, scores + i * stride + j0);
        }
    }
    /* softmax of each query's own keys, in key order (fixed.h's row_max and exps) */
    for (int i = 0; i < rows; i++) {
        const int limit = a->start + r0 + i / group + 1;
        float *s = scores + i * stride;
        s[stride - 1] = 1.0f / exps(s, limit, row_max(s, limit), s); /* kept beside the row: never a key's */
    }
    /* values: each query's weighted sum in key order, then scaled by 1 / sum */
    for (int i = 0; i < rows; i += 2) {
        const int r = r0 + i / group, limit = a->start + r + 1, pair = i + 1 < rows && (i + 1) / group == i / group;
        const float *p0 = scores + i * stride, *p1 = pair ? p0 + stride : p0;
        float *o0 = a->out + r * a->out_row + (head * group + i % group) * dim;
        float *o1 = pair ? o0 + dim : acc;
        weighted_values(a, values, p0, p1, limit, o0, o1);
        vf inverse0 = splat(p0[stride - 1]), inverse1 = splat(p1[stride - 1]);
        for (int c = 0; c < chunks; c++) {
            store_f32(o0 + c * W, load_f32(o0 + c * W) * inverse0);
            if (pair) store_f32(o1 + c * W, load_f32(o1 + c * W) * inverse1);
        }
        if (!pair) i--; /* an odd group: the next pair starts at the next query */
    }
}

/* This thread's scratch memory (fixed.h's scratch_of). */
static float *thread_scratch(size_t bytes) {
    static __thread struct scratch mine;
    return scratch_of(&mine, bytes, 65536);
}

/* Rows per work item: enough queries to reuse each block of keys, few enough to keep them in cache. */
#define TILE_ROWS 16

int attention(const Attention *a, int threads) {
    if (a->dim % W || a->q_heads % a->kv_heads) return 1;
    const int group = a->q_heads / a->kv_heads;
    const int tiles = (a->n + TILE_ROWS - 1) / TILE_ROWS, items = tiles * a->kv_heads;
    const int64_t stride = ((int64_t)(a->start + a->n + W) / W) * W + W; /* keys, padding, and the 1/sum */
    const int tile_rows = a->n < TILE_ROWS ? a->n : TILE_ROWS;
    const size_t per_thread = sizeof(float) * ((size_t)tile_rows * group * stride + (size_t)W * a->dim +
                                               (size_t)a->dim);
    int failed = 0;
    if (threads > items) threads = items;
#pragma omp parallel num_threads(threads > 0 ? threads : 1)
    {
        /* Subnormal numbers flushed to zero (FTZ, DAZ) on this thread while it attends: a query that
         * weighs some keys at ~1e-38 would otherwise pay a microcode assist per tiny product (many
         * times slower), and flushing is as deterministic as the rest. */
        const unsigned int csr = _mm_getcsr();
        _mm_setcsr(csr | 0x8040);
        float *scratch = thread_scratch(per_thread);
        if (!scratch) {
#pragma omp atomic write
            failed = 2;
        } else {
            float *scores = scratch, *block = scores + (size_t)tile_rows * group * stride;
            float *acc = block + (size_t)W * a->dim;
#pragma omp for schedule(dynamic, 1)
            for (int item = 0; item < items; item++) {
                int head = item % a->kv_heads, tile = item / a->kv_heads;
                int r0 = tile * TILE_ROWS, r1 = r0 + TILE_ROWS < a->n ? r0 + TILE_ROWS : a->n;
                attend_tile(a, head, r0, r1, scores, stride, block, acc);
            }
        }
        _mm_setcsr(csr);
    }
    return failed;
}
