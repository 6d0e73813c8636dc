/* What every float kernel of the service shares (float_ops.c, attention.c, deltanet.c, int4_gemm.c's
 * experts), so that a result's bits depend on its inputs alone — not on the instruction set the kernel
 * was built for, nor on the library a CPU happens to dispatch to:
 *
 * - GCC's 16-float vectors: one AVX-512 register, or two AVX2 ones — the same lanes, the same adds;
 * - fused multiply-adds only where a kernel writes `fmadd` (built with -ffp-contract=off: the compiler
 *   fuses nothing behind its back; AVX2 and AVX-512 both round a fused multiply-add once);
 * - one fixed tree for a vector's sum (`total`: lanes j and j + 8, then j + 4, j + 2, j + 1);
 * - one implementation of each transcendental (fixed_math.h): exp and log (Cephes' expf — its polynomial in
 *   fused multiply-adds — and logf), tanh (Cephes'
 *   tanhf), erf (Cephes' erff and erfcf), and sin and cos in double (fdlibm's kernels) — libm's and
 *   the vector libraries' take instruction-set-specific paths.
 */
#pragma once
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16
typedef float vf __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(LANES * sizeof(int32_t))));

static inline vf splat(float x) { return (vf){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

static inline vf load(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store(float *p, vf v) { memcpy(p, &v, sizeof v); }

/* The first `count` (0..16) floats at p, zeros after them. */
static inline vf load_part(const float *p, int count) {
    float lanes[LANES] = {0};
    memcpy(lanes, p, sizeof(float) * count);
    return load(lanes);
}

static inline void store_part(float *p, vf v, int count) {
    float lanes[LANES];
    store(lanes, v);
    memcpy(p, lanes, sizeof(float) * count);
}

static inline vf pick(vi mask, vf a, vf b) { return (vf)(((vi)a & mask) | ((vi)b & ~mask)); }

static inline vf vmax(vf a, vf b) { return pick(a > b, a, b); }

/* a·b + c rounded once, lane by lane: one instruction on AVX-512, two on AVX2, the same bits. */
static inline vf fmadd(vf a, vf b, vf c) {
#if defined(__AVX512F__)
    return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
    union {
        vf v;
        __m256 h[2];
    } x = {a}, y = {b}, z = {c}, r;
    r.h[0] = _mm256_fmadd_ps(x.h[0], y.h[0], z.h[0]);
    r.h[1] = _mm256_fmadd_ps(x.h[1], y.h[1], z.h[1]);
    return r.v;
#else
#error "the float kernels need FMA (x86-64-v3) at least"
#endif
}

/* The fixed tree: lanes j and j + 8, then j and j + 4, j and j + 2, then the last two. */
static inline float total(vf acc) {
    float p[LANES];
    memcpy(p, &acc, sizeof p);
    for (int width = LANES / 2; width >= 1; width /= 2)
        for (int j = 0; j < width; j++) p[j] = p[j] + p[j + width];
    return p[0];
}

static inline float max_lanes(vf a) {
    float x[LANES];
    store(x, a);
    float m = x[0];
    for (int i = 1; i < LANES; i++) m = x[i] > m ? x[i] : m;
    return m;
}

static inline float scalar(vf v) { return v[0]; }

#define V vf
#define VI vi
#define SPLAT splat
#define PICK pick
#define FMADD fmadd
#define NAME(f) v##f
#include "fixed_math.h"
#undef V
#undef VI
#undef SPLAT
#undef PICK
#undef FMADD
#undef NAME

/* The CPU's own vectors (vn, NATIVE floats: 16 with AVX-512, 8 with AVX2), for the loops whose every
 * element is alone or whose sums keep the 16 lanes apart: GCC keeps its 16-float vectors in memory inside
 * AVX2 loops, many times slower. A 16-lane sum is HALVES native sums (lanes 0-7, then 8-15). */
#if defined(__AVX512F__)
#define NATIVE 16
typedef vf vn;
typedef vi vni;
#define n_splat splat
#define n_pick pick
#define n_fmadd fmadd
#define n_exp vexp
#define n_log vlog
#define n_sigmoid vsigmoid
#define n_silu vsilu
#define n_tanh vtanh
#define n_erf verf
#else
#define NATIVE 8
typedef float vn __attribute__((vector_size(NATIVE * sizeof(float))));
typedef int32_t vni __attribute__((vector_size(NATIVE * sizeof(int32_t))));
static inline vn n_splat(float x) { return (vn){x, x, x, x, x, x, x, x}; }
static inline vn n_pick(vni mask, vn a, vn b) { return (vn)(((vni)a & mask) | ((vni)b & ~mask)); }
static inline vn n_fmadd(vn a, vn b, vn c) { return (vn)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c); }
#define V vn
#define VI vni
#define SPLAT n_splat
#define PICK n_pick
#define FMADD n_fmadd
#define NAME(f) n_##f
#include "fixed_math.h"
#undef V
#undef VI
#undef SPLAT
#undef PICK
#undef FMADD
#undef NAME
#endif
#define HALVES (LANES / NATIVE)

static inline vn n_load(const float *p) {
    vn v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void n_store(float *p, vn v) { memcpy(p, &v, sizeof v); }

static inline vn n_load_part(const float *p, int count) {
    float lanes[NATIVE] = {0};
    memcpy(lanes, p, sizeof(float) * count);
    return n_load(lanes);
}

static inline void n_store_part(float *p, vn v, int count) {
    float lanes[NATIVE];
    n_store(lanes, v);
    memcpy(p, lanes, sizeof(float) * count);
}

static inline vni n_lanes(void) {
    vni lane;
    for (int l = 0; l < NATIVE; l++) lane[l] = l;
    return lane;
}

/* One 16-lane sum held as HALVES native ones, added by total's tree (lanes j and j + 8 first). */
static inline float n_total(const vn *acc) {
#if NATIVE == 16
    return total(acc[0]);
#else
    const vn both = acc[0] + acc[1];
    float p[NATIVE];
    memcpy(p, &both, sizeof p);
    for (int width = NATIVE / 2; width >= 1; width /= 2)
        for (int j = 0; j < width; j++) p[j] = p[j] + p[j + width];
    return p[0];
#endif
}

/* Σ (x[i] - shift)² (squares) or Σ (x[i] - shift) over a row of n: input i in lane i mod 16, in order, then
 * total's tree — an order fixed by n alone. */
static inline float row_sum(const float *x, int n, float shift, int squares) {
    vn acc[HALVES];
    for (int h = 0; h < HALVES; h++) acc[h] = n_splat(0.0f);
    const vn s = n_splat(shift), zero = n_splat(0.0f);
    const vni lane = n_lanes();
    for (int i = 0; i < n; i += LANES)
        for (int h = 0; h < HALVES; h++) {
            const int at = i + h * NATIVE, rest = n - at;
            if (rest <= 0) break;
            vn v = (rest >= NATIVE ? n_load(x + at) : n_load_part(x + at, rest)) - s;
            v = n_pick(lane < rest, v, zero);
            acc[h] = acc[h] + (squares ? v * v : v);
        }
    return n_total(acc);
}

/* The row's largest value (NaN if it holds one, as torch's max): lanes folded in order, exact. */
static inline float row_max(const float *x, int n) {
    vn top[HALVES];
    vni nan = (vni){0};
    for (int h = 0; h < HALVES; h++) top[h] = n_splat(x[0]);
    int i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int h = 0; h < HALVES; h++) {
            const vn v = n_load(x + i + h * NATIVE);
            top[h] = n_pick(v > top[h], v, top[h]);
            nan |= v != v;
        }
    float lanes[LANES], m;
    for (int h = 0; h < HALVES; h++) n_store(lanes + h * NATIVE, top[h]);
    m = lanes[0];
    for (int l = 1; l < LANES; l++) m = lanes[l] > m ? lanes[l] : m;
    for (; i < n; i++) {
        m = x[i] > m ? x[i] : m;
        nan[0] |= x[i] != x[i];
    }
    for (int l = 0; l < NATIVE; l++)
        if (nan[l]) return x[0] - x[0] + __builtin_nanf("");
    return m;
}

/* exp(x - top) of a row of n into y, and their sum as row_sum adds them. */
static inline float exps(const float *x, int n, float top, float *y) {
    vn acc[HALVES];
    for (int h = 0; h < HALVES; h++) acc[h] = n_splat(0.0f);
    const vn t = n_splat(top), zero = n_splat(0.0f);
    const vni lane = n_lanes();
    for (int i = 0; i < n; i += LANES)
        for (int h = 0; h < HALVES; h++) {
            const int at = i + h * NATIVE, rest = n - at;
            if (rest <= 0) break;
            if (rest >= NATIVE) {
                const vn e = n_exp(n_load(x + at) - t);
                n_store(y + at, e);
                acc[h] = acc[h] + e;
            } else {
                const vn e = n_pick(lane < rest, n_exp(n_load_part(x + at, rest) - t), zero);
                n_store_part(y + at, e, rest);
                acc[h] = acc[h] + e;
            }
        }
    return n_total(acc);
}

/* sin and cos of a double: the argument reduced by multiples of pi/2 (three parts, exact for
 * |x| < 2^19 · pi/2), then fdlibm's kernels on [-pi/4, pi/4]. */
static inline void sin_cos(double x, double *s, double *c) {
    const double k = __builtin_nearbyint(x * 6.36619772367581382433e-01);
    double r = x - k * 1.57079632673412561417e+00;
    r = r - k * 6.07710050630396597660e-11;
    r = r - k * 2.02226624871116645580e-21;
    const double z = r * r;
    const double sine =
        r + r * z *
                (-1.66666666666666324348e-01 +
                 z * (8.33333333332248946124e-03 +
                      z * (-1.98412698298579493134e-04 +
                           z * (2.75573137070700676789e-06 + z * (-2.50507602534068634195e-08 + z * 1.58969099521155010221e-10)))));
    const double cosine =
        1.0 - 0.5 * z +
        z * z *
            (4.16666666666666019037e-02 +
             z * (-1.38888888888741095749e-03 +
                  z * (2.48015872894767294178e-05 +
                       z * (-2.75573143513906633035e-07 + z * (2.08757232129817482790e-09 + z * -1.13596475577881948265e-11)))));
    switch ((int64_t)k & 3) {
    case 0: *s = sine, *c = cosine; break;
    case 1: *s = cosine, *c = -sine; break;
    case 2: *s = -sine, *c = -cosine; break;
    default: *s = -cosine, *c = sine; break;
    }
}

/* A thread's scratch memory, kept between calls (allocating it per call cost tens of microseconds in a
 * decode step), grown in steps of `step` bytes when a call needs more; NULL when it cannot be. */
struct scratch {
    float *buffer;
    size_t size;
};

static inline float *scratch_of(struct scratch *s, size_t bytes, size_t step) {
    if (bytes > s->size) {
        free(s->buffer);
        s->size = (bytes + step - 1) / step * step;
        s->buffer = aligned_alloc(64, s->size);
        if (!s->buffer) s->size = 0;
    }
    return s->buffer;
}
