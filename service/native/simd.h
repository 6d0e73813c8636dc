/* What the service's integer kernels share (int8_gemm.c, int4_gemm.c): vector types and operations
 * for AVX-512 or AVX2 (L = int32 lanes per vector), the u8×s8 dot product (VNNI where the CPU has it), and
 * the per-row quantization of activations both kernels use — so both give a row the same uint8 values. */
#pragma once
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define L 16
typedef __m512i vec;
#define LOAD(p) _mm512_loadu_si512((const void *)(p))
#define BROADCAST(p) _mm512_set1_epi32(*(const int32_t *)(p))
#define ZERO() _mm512_setzero_si512()
#define STORE(p, v) _mm512_storeu_si512((void *)(p), v)
#if defined(__AVX512VNNI__)
/* vpdpbusd by hand: with the intrinsic GCC copies every accumulator at every step (and spills) */
static inline __m512i dot_vnni(__m512i acc, __m512i a, __m512i b) {
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "vm"(b));
    return acc;
}
#define DOT(acc, a, b) dot_vnni(acc, a, b)
#else
#define DOT(acc, a, b) _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(a, b), _mm512_set1_epi16(1)))
#endif
#elif defined(__AVX2__)
#define L 8
typedef __m256i vec;
#define LOAD(p) _mm256_loadu_si256((const __m256i *)(p))
#define BROADCAST(p) _mm256_set1_epi32(*(const int32_t *)(p))
#define ZERO() _mm256_setzero_si256()
#define STORE(p, v) _mm256_storeu_si256((__m256i *)(p), v)
#if defined(__AVXVNNI__)
static inline __m256i dot_vnni(__m256i acc, __m256i a, __m256i b) {
    __asm__("{vex} vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "vm"(b));
    return acc;
}
#define DOT(acc, a, b) dot_vnni(acc, a, b)
#else
#define DOT(acc, a, b) _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1)))
#endif
#else
#error "the int8 kernel needs AVX2 at least"
#endif

#if L == 16
typedef __m512 vecf;
#define F_LOAD(p) _mm512_loadu_ps(p)
#define F_STORE(p, v) _mm512_storeu_ps(p, v)
#define F_SET(x) _mm512_set1_ps(x)
#define F_MUL(a, b) _mm512_mul_ps(a, b)
#define F_ADD(a, b) _mm512_add_ps(a, b)
#define F_DIV(a, b) _mm512_div_ps(a, b)
#define F_MAX(a, b) _mm512_max_ps(a, b)
#define F_ABS(a) _mm512_abs_ps(a)
#define F_FROM_INT(v) _mm512_cvtepi32_ps(v)
#define F_ROUND(a) _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define I_SUB(a, b) _mm512_sub_epi32(a, b)
#define I_MUL(a, b) _mm512_mullo_epi32(a, b)
#define I_SET(x) _mm512_set1_epi32(x)
static inline void store_u8(uint8_t *p, vecf rounded) { _mm_storeu_si128((__m128i *)p, _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(rounded))); }
#else
typedef __m256 vecf;
#define F_LOAD(p) _mm256_loadu_ps(p)
#define F_STORE(p, v) _mm256_storeu_ps(p, v)
#define F_SET(x) _mm256_set1_ps(x)
#define F_MUL(a, b) _mm256_mul_ps(a, b)
#define F_ADD(a, b) _mm256_add_ps(a, b)
#define F_DIV(a, b) _mm256_div_ps(a, b)
#define F_MAX(a, b) _mm256_max_ps(a, b)
#define F_ABS(a) _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a)
#define F_FROM_INT(v) _mm256_cvtepi32_ps(v)
#define F_ROUND(a) _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define I_SUB(a, b) _mm256_sub_epi32(a, b)
#define I_MUL(a, b) _mm256_mullo_epi32(a, b)
#define I_SET(x) _mm256_set1_epi32(x)
static inline void store_u8(uint8_t *p, vecf rounded) {
    __m256i v = _mm256_cvtps_epi32(rounded);
    __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    _mm_storel_epi64((__m128i *)p, _mm_packus_epi16(words, words));
}
#endif

#define ZERO_POINT 64
#define SCALE 0.015625f /* 2^-6 */

static inline int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

/* One row's uint8 values (k padded with the zero point) and its absolute maximum: round(x / (peak·2^-6) + 64),
 * the division and the addition rounded each (as the torch ops FBGEMM's path is given), ties to even. */
static float quantize_row(const float *x, int k, int kp, uint8_t *q) {
    const int body = k / L * L;
    vecf top = F_SET(0.0f);
    for (int i = 0; i < body; i += L) top = F_MAX(top, F_ABS(F_LOAD(x + i)));
    float lanes[L], peak = 0.0f;
    F_STORE(lanes, top);
    for (int i = 0; i < L; i++) peak = lanes[i] > peak ? lanes[i] : peak;
    for (int i = body; i < k; i++) peak = fabsf(x[i]) > peak ? fabsf(x[i]) : peak;
    if (peak < 1.17549435e-38f) peak = 1.17549435e-38f; /* float32's tiny: a row of zeros */
    const float step = peak * SCALE;
    const vecf steps = F_SET(step), zero_point = F_SET((float)ZERO_POINT);
    for (int i = 0; i < body; i += L) store_u8(q + i, F_ROUND(F_ADD(F_DIV(F_LOAD(x + i), steps), zero_point)));
    for (int i = body; i < k; i++) q[i] = (uint8_t)nearbyintf(x[i] / step + (float)ZERO_POINT);
    for (int i = k; i < kp; i++) q[i] = ZERO_POINT;
    return peak;
}

/* Ask for the `bytes` (a multiple of 64) at p non-temporally: weights a decode step reads once, brought
 * into L1 without displacing the caches' other lines (both kernels' decode path; see int4_gemm.c). */
static inline void stream_lines(const void *p, int bytes) {
    for (int line = 0; line < bytes; line += 64) _mm_prefetch((const char *)p + line, _MM_HINT_NTA);
}
