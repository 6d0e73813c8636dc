/* fixed.h's transcendentals, written once for a vector type: included by fixed.h for its 16-float vectors
 * and, on AVX2, again for the CPU's own 8-float ones (each lane the same operations: the same bits). Before
 * each inclusion: V and VI (the float and int32 vector types), SPLAT, PICK and FMADD for them, and NAME(f),
 * the name of function f. */

/* exp(x), clamped to [-87.3, 88.3] (0 below, float's largest finite scale above): Cephes' expf, its
 * polynomial in fused multiply-adds. */
static inline V NAME(exp)(V x) {
    VI tiny = x < SPLAT(-87.3f);
    x = PICK(x > SPLAT(88.3f), SPLAT(88.3f), x);
    x = PICK(tiny, SPLAT(-87.3f), x);
    const V magic = SPLAT(12582912.0f); /* 1.5 * 2^23: adding it rounds to an integer */
    V n = FMADD(x, SPLAT(1.44269504088896341f), magic) - magic;
    V r = FMADD(n, SPLAT(-0.693359375f), x);
    r = FMADD(n, SPLAT(2.12194440e-4f), r);
    V p = SPLAT(1.9875691500e-4f);
    p = FMADD(p, r, SPLAT(1.3981999507e-3f));
    p = FMADD(p, r, SPLAT(8.3334519073e-3f));
    p = FMADD(p, r, SPLAT(4.1665795894e-2f));
    p = FMADD(p, r, SPLAT(1.6666665459e-1f));
    p = FMADD(p, r, SPLAT(5.0000001201e-1f));
    p = FMADD(p, r * r, r) + SPLAT(1.0f);
    /* 2^n in two factors, so n = 128 (x near 88.3) stays finite */
    VI half = __builtin_convertvector(n, VI) / 2;
    VI bits0 = (half + 127) << 23, bits1 = (__builtin_convertvector(n, VI) - half + 127) << 23;
    V scale0, scale1;
    memcpy(&scale0, &bits0, sizeof scale0);
    memcpy(&scale1, &bits1, sizeof scale1);
    return PICK(tiny, SPLAT(0.0f), p * scale0 * scale1);
}

/* log(x) for x > 0 normal: Cephes' logf. */
static inline V NAME(log)(V x) {
    VI bits;
    memcpy(&bits, &x, sizeof bits);
    VI exponent = ((bits >> 23) & 0xff) - 126;
    bits = (bits & 0x007fffff) | 0x3f000000; /* the mantissa in [0.5, 1) */
    V m;
    memcpy(&m, &bits, sizeof m);
    VI small = m < SPLAT(0.707106781186547524f);
    V e = __builtin_convertvector(exponent, V) - PICK(small, SPLAT(1.0f), SPLAT(0.0f));
    m = PICK(small, m + m, m) - SPLAT(1.0f);
    V z = m * m;
    V p = SPLAT(7.0376836292e-2f);
    p = p * m + SPLAT(-1.1514610310e-1f);
    p = p * m + SPLAT(1.1676998740e-1f);
    p = p * m + SPLAT(-1.2420140846e-1f);
    p = p * m + SPLAT(1.4249322787e-1f);
    p = p * m + SPLAT(-1.6668057665e-1f);
    p = p * m + SPLAT(2.0000714765e-1f);
    p = p * m + SPLAT(-2.4999993993e-1f);
    p = p * m + SPLAT(3.3333331174e-1f);
    V y = p * m * z;
    y = y + e * SPLAT(-2.12194440e-4f);
    y = y - z * SPLAT(0.5f);
    return m + y + e * SPLAT(0.693359375f);
}

static inline V NAME(sigmoid)(V x) { return SPLAT(1.0f) / (SPLAT(1.0f) + NAME(exp)(-x)); }

/* x·sigmoid(x) as torch writes it: x / (1 + e^-x). */
static inline V NAME(silu)(V x) { return x / (SPLAT(1.0f) + NAME(exp)(-x)); }

static inline V NAME(abs)(V x) { return (V)((VI)x & 0x7fffffff); }

static inline V NAME(copysign)(V magnitude, V sign) {
    return (V)(((VI)magnitude & 0x7fffffff) | ((VI)sign & (int32_t)0x80000000));
}

/* tanh(x): Cephes' tanhf — an odd polynomial below 0.625, 1 - 2 / (e^2|x| + 1) above. */
static inline V NAME(tanh)(V x) {
    const V a = NAME(abs)(x);
    V z = x * x;
    V p = SPLAT(-5.70498872745e-3f);
    p = p * z + SPLAT(2.06390887954e-2f);
    p = p * z + SPLAT(-5.37397155531e-2f);
    p = p * z + SPLAT(1.33314422036e-1f);
    p = p * z + SPLAT(-3.33332819422e-1f);
    const V small = p * z * x + x;
    const V large = NAME(copysign)(SPLAT(1.0f) - SPLAT(2.0f) / (NAME(exp)(a + a) + SPLAT(1.0f)), x);
    return PICK(a < SPLAT(0.625f), small, large);
}

/* erf(x): Cephes' erff below |x| = 1, 1 - erfcf(|x|) (signed) above — erfcf from e^-x² and a
 * polynomial in 1/x² (one for |x| < 2, one beyond); 1 past |x| = 9 (erfc underflows). */
static inline V NAME(erf)(V x) {
    const V a = NAME(abs)(x);
    const V z = x * x;
    V t = SPLAT(7.853861353153693e-5f);
    t = t * z + SPLAT(-8.010193625184903e-4f);
    t = t * z + SPLAT(5.188327685732524e-3f);
    t = t * z + SPLAT(-2.685381193529856e-2f);
    t = t * z + SPLAT(1.128358514861418e-1f);
    t = t * z + SPLAT(-3.761262582423300e-1f);
    t = t * z + SPLAT(1.128379165726710e0f);
    const V inner = x * t;
    const V q = SPLAT(1.0f) / PICK(a < SPLAT(1.0f), SPLAT(1.0f), a);
    const V y = q * q;
    V p = SPLAT(2.326819970068386e-2f);
    p = p * y + SPLAT(-1.387039388740657e-1f);
    p = p * y + SPLAT(3.687424674597105e-1f);
    p = p * y + SPLAT(-5.824733027278666e-1f);
    p = p * y + SPLAT(6.210004621745983e-1f);
    p = p * y + SPLAT(-4.944515323274145e-1f);
    p = p * y + SPLAT(3.404879937665872e-1f);
    p = p * y + SPLAT(-2.741127028184656e-1f);
    p = p * y + SPLAT(5.638259427386472e-1f);
    V r = SPLAT(-1.047766399936249e1f);
    r = r * y + SPLAT(1.297719955372516e1f);
    r = r * y + SPLAT(-7.495518717768503e0f);
    r = r * y + SPLAT(2.921019019210786e0f);
    r = r * y + SPLAT(-1.015265279202700e0f);
    r = r * y + SPLAT(4.218463358204948e-1f);
    r = r * y + SPLAT(-2.820767439740514e-1f);
    r = r * y + SPLAT(5.641895067754075e-1f);
    const V tail = NAME(exp)(-z) * q * PICK(a < SPLAT(2.0f), p, r);
    const V outer = NAME(copysign)(PICK(a < SPLAT(9.0f), SPLAT(1.0f) - tail, SPLAT(1.0f)), x);
    return PICK(a < SPLAT(1.0f), inner, outer);
}
