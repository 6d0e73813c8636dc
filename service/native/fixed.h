/* What every float kernel of the service shares (float_ops.c, attention.c, deltanet.c, int4_gemm.c's
 * experts), so that a result's bits depend on its inputs alone — not on the instruction set the kernel
 * was built for, nor on the library a CPU happens to dispatch to:
 *
 * - GCC's 16-float vectors: one AVX-512 register, or two AVX2 ones — the same lanes, the same adds;
 * - fused multiply-adds only where a kernel writes `fmadd` (built with -ffp-contract=off: the compiler
 *   fuses nothing behind its back; AVX2 and AVX-512 both round a fused multiply-add once);
 * - one fixed tree for a vector's sum (`total`: lanes j and j + 8, then j + 4, j + 2, j + 1);
 * - one implementation of each transcendental: exp and log (Cephes' expf — its polynomial in fused
 *   multiply-adds — and logf), tanh (Cephes'
 *   tanhf), erf (Cephes' erff and erfcf), and sin and cos in double (fdlibm's kernels) — libm's and
 *   the vector libraries' take instruction-set-specific paths.
 */
#pragma once
#include <immintrin.h>
#include <stdint.h>
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

/* exp(x), clamped to [-87.3, 88.3] (0 below, float's largest finite scale above): Cephes' expf, its
 * polynomial in fused multiply-adds. */
static inline vf vexp(vf x) {
    vi tiny = x < splat(-87.3f);
    x = pick(x > splat(88.3f), splat(88.3f), x);
    x = pick(tiny, splat(-87.3f), x);
    const vf magic = splat(12582912.0f); /* 1.5 * 2^23: adding it rounds to an integer */
    vf n = fmadd(x, splat(1.44269504088896341f), magic) - magic;
    vf r = fmadd(n, splat(-0.693359375f), x);
    r = fmadd(n, splat(2.12194440e-4f), r);
    vf p = splat(1.9875691500e-4f);
    p = fmadd(p, r, splat(1.3981999507e-3f));
    p = fmadd(p, r, splat(8.3334519073e-3f));
    p = fmadd(p, r, splat(4.1665795894e-2f));
    p = fmadd(p, r, splat(1.6666665459e-1f));
    p = fmadd(p, r, splat(5.0000001201e-1f));
    p = fmadd(p, r * r, r) + splat(1.0f);
    /* 2^n in two factors, so n = 128 (x near 88.3) stays finite */
    vi half = __builtin_convertvector(n, vi) / 2;
    vi bits0 = (half + 127) << 23, bits1 = (__builtin_convertvector(n, vi) - half + 127) << 23;
    vf scale0, scale1;
    memcpy(&scale0, &bits0, sizeof scale0);
    memcpy(&scale1, &bits1, sizeof scale1);
    return pick(tiny, splat(0.0f), p * scale0 * scale1);
}

/* log(x) for x > 0 normal: Cephes' logf. */
static inline vf vlog(vf x) {
    vi bits;
    memcpy(&bits, &x, sizeof bits);
    vi exponent = ((bits >> 23) & 0xff) - 126;
    bits = (bits & 0x007fffff) | 0x3f000000; /* the mantissa in [0.5, 1) */
    vf m;
    memcpy(&m, &bits, sizeof m);
    vi small = m < splat(0.707106781186547524f);
    vf e = __builtin_convertvector(exponent, vf) - pick(small, splat(1.0f), splat(0.0f));
    m = pick(small, m + m, m) - splat(1.0f);
    vf z = m * m;
    vf p = splat(7.0376836292e-2f);
    p = p * m + splat(-1.1514610310e-1f);
    p = p * m + splat(1.1676998740e-1f);
    p = p * m + splat(-1.2420140846e-1f);
    p = p * m + splat(1.4249322787e-1f);
    p = p * m + splat(-1.6668057665e-1f);
    p = p * m + splat(2.0000714765e-1f);
    p = p * m + splat(-2.4999993993e-1f);
    p = p * m + splat(3.3333331174e-1f);
    vf y = p * m * z;
    y = y + e * splat(-2.12194440e-4f);
    y = y - z * splat(0.5f);
    return m + y + e * splat(0.693359375f);
}

static inline vf vsigmoid(vf x) { return splat(1.0f) / (splat(1.0f) + vexp(-x)); }

/* x·sigmoid(x) as torch writes it: x / (1 + e^-x). */
static inline vf vsilu(vf x) { return x / (splat(1.0f) + vexp(-x)); }

static inline vf vabs(vf x) { return (vf)((vi)x & 0x7fffffff); }

static inline vf vcopysign(vf magnitude, vf sign) {
    return (vf)(((vi)magnitude & 0x7fffffff) | ((vi)sign & (int32_t)0x80000000));
}

/* tanh(x): Cephes' tanhf — an odd polynomial below 0.625, 1 - 2 / (e^2|x| + 1) above. */
static inline vf vtanh(vf x) {
    const vf a = vabs(x);
    vf z = x * x;
    vf p = splat(-5.70498872745e-3f);
    p = p * z + splat(2.06390887954e-2f);
    p = p * z + splat(-5.37397155531e-2f);
    p = p * z + splat(1.33314422036e-1f);
    p = p * z + splat(-3.33332819422e-1f);
    const vf small = p * z * x + x;
    const vf large = vcopysign(splat(1.0f) - splat(2.0f) / (vexp(a + a) + splat(1.0f)), x);
    return pick(a < splat(0.625f), small, large);
}

/* erf(x): Cephes' erff below |x| = 1, 1 - erfcf(|x|) (signed) above — erfcf from e^-x² and a
 * polynomial in 1/x² (one for |x| < 2, one beyond); 1 past |x| = 9 (erfc underflows). */
static inline vf verf(vf x) {
    const vf a = vabs(x);
    const vf z = x * x;
    vf t = splat(7.853861353153693e-5f);
    t = t * z + splat(-8.010193625184903e-4f);
    t = t * z + splat(5.188327685732524e-3f);
    t = t * z + splat(-2.685381193529856e-2f);
    t = t * z + splat(1.128358514861418e-1f);
    t = t * z + splat(-3.761262582423300e-1f);
    t = t * z + splat(1.128379165726710e0f);
    const vf inner = x * t;
    const vf q = splat(1.0f) / pick(a < splat(1.0f), splat(1.0f), a);
    const vf y = q * q;
    vf p = splat(2.326819970068386e-2f);
    p = p * y + splat(-1.387039388740657e-1f);
    p = p * y + splat(3.687424674597105e-1f);
    p = p * y + splat(-5.824733027278666e-1f);
    p = p * y + splat(6.210004621745983e-1f);
    p = p * y + splat(-4.944515323274145e-1f);
    p = p * y + splat(3.404879937665872e-1f);
    p = p * y + splat(-2.741127028184656e-1f);
    p = p * y + splat(5.638259427386472e-1f);
    vf r = splat(-1.047766399936249e1f);
    r = r * y + splat(1.297719955372516e1f);
    r = r * y + splat(-7.495518717768503e0f);
    r = r * y + splat(2.921019019210786e0f);
    r = r * y + splat(-1.015265279202700e0f);
    r = r * y + splat(4.218463358204948e-1f);
    r = r * y + splat(-2.820767439740514e-1f);
    r = r * y + splat(5.641895067754075e-1f);
    const vf tail = vexp(-z) * q * pick(a < splat(2.0f), p, r);
    const vf outer = vcopysign(pick(a < splat(9.0f), splat(1.0f) - tail, splat(1.0f)), x);
    return pick(a < splat(1.0f), inner, outer);
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
