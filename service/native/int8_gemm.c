/* INT8 Linear with activations quantized per row: the service's own kernel beside FBGEMM's and
 * oneDNN's, computing the same bits as they do (service/int8_linear.py).
 *
 * Each input row x is divided by its absolute maximum and quantized with the fixed scale 2^-6 and
 * zero point 64 (uint8 values 0..128, so the u8×s8 pair sums of CPUs without VNNI never saturate
 * int16); weights are int8 rows with one float scale per output channel. A row's output:
 *     y[n] = ((float)(Σ_k q[k]·w[n][k] − 64·Σ_k w[n][k]) · 2^-6 · scale[n]) · peak + bias[n]
 * The sums are integers — any order, any blocking, any number of rows gives the same bits — and
 * the float steps are those FBGEMM and oneDNN take, one rounding each (built with
 * -ffp-contract=off: no fused multiply-add may merge two of them).
 *
 * Weights are packed once into tiles of L output channels × 4 inputs (L = 16 with AVX-512, 8 with
 * AVX2), the order one VNNI dot product (vpdpbusd: 4 u8×s8 products added into each int32 lane)
 * reads them: a decode step streams each tile once for every row it computes.
 */
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

int int8_lanes(void) { return L; }

static inline int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

#define TILES 4 /* tiles of L output channels read together: a micro-kernel's columns */
#define COLUMNS (TILES * L)

/* Bytes of the packed weights of an n × k matrix. */
int64_t int8_packed_bytes(int n, int k) { return round_up(n, COLUMNS) * round_up(k, 4); }

/* rows (n × k, int8, row-major) → [n/COLUMNS][k/4][COLUMNS][4]: each group of COLUMNS output
 * channels one contiguous stream, 4 inputs of each channel side by side; zeros pad both. Each row
 * is read in order and written 4 bytes at a time into its group (a group fits in cache). `sums`
 * gets each row's sum (what the zero point of the activations takes back). */
void int8_pack(const int8_t *rows, int n, int k, int8_t *out, int32_t *sums) {
    const int64_t k4 = round_up(k, 4) / 4, full = k / 4, group_bytes = k4 * COLUMNS * 4;
    if (n % COLUMNS || k % 4) memset(out, 0, int8_packed_bytes(n, k));
    for (int64_t row = 0; row < n; row++) {
        const int8_t *src = rows + row * k;
        int8_t *dst = out + (row / COLUMNS) * group_bytes + (row % COLUMNS) * 4;
        int32_t sum = 0;
        for (int64_t i = 0; i < k; i++) sum += src[i];
        sums[row] = sum;
        for (int64_t g = 0; g < full; g++) memcpy(dst + g * COLUMNS * 4, src + g * 4, 4);
        for (int j = 0; j < k % 4; j++) dst[full * COLUMNS * 4 + j] = src[full * 4 + j];
    }
}

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

/* Rows [0, MB) of q against one group of COLUMNS output channels: int32 sums into acc (MB × COLUMNS). */
#define MICRO(MB)                                                                                                  \
    static void micro_##MB(const uint8_t *q, int64_t kp, const int8_t *group, int32_t *acc) {                      \
        vec s[MB][TILES];                                                                                         \
        for (int i = 0; i < MB; i++)                                                                              \
            for (int t = 0; t < TILES; t++) s[i][t] = ZERO();                                                     \
        for (int64_t g = 0; g < kp / 4; g++) {                                                                    \
            const int8_t *at = group + g * COLUMNS * 4;                                                           \
            vec w[TILES];                                                                                         \
            for (int t = 0; t < TILES; t++) w[t] = LOAD(at + t * L * 4);                                          \
            for (int i = 0; i < MB; i++) {                                                                        \
                vec a = BROADCAST(q + i * kp + g * 4);                                                            \
                for (int t = 0; t < TILES; t++) s[i][t] = DOT(s[i][t], a, w[t]);                                  \
            }                                                                                                     \
        }                                                                                                         \
        for (int i = 0; i < MB; i++)                                                                              \
            for (int t = 0; t < TILES; t++) STORE(acc + i * COLUMNS + t * L, s[i][t]);                            \
    }
MICRO(1)
MICRO(2)
MICRO(3)
MICRO(4)
MICRO(5)
MICRO(6)

#define ROWS 6 /* rows of a micro-kernel call: 6 × TILES accumulators, 4 weight vectors and a broadcast in registers */
typedef void (*micro_fn)(const uint8_t *, int64_t, const int8_t *, int32_t *);
static const micro_fn MICRO_ROWS[7] = {0, micro_1, micro_2, micro_3, micro_4, micro_5, micro_6};

#define BLOCK_ROWS 192 /* rows a work item runs against its columns, at most (its rows stay in cache meanwhile) */

/* One row's outputs from its int32 sums, the float steps FBGEMM and oneDNN take (one rounding each). */
static void output_row(const int32_t *acc, const int32_t *column_sums, const float *scales, const float *bias,
                       float peak, int cols, float *y) {
    const int body = cols / L * L;
    const vecf scale = F_SET(SCALE), peaks = F_SET(peak);
    for (int c = 0; c < body; c += L) {
        vec sum = I_SUB(LOAD(acc + c), I_MUL(LOAD(column_sums + c), I_SET(ZERO_POINT)));
        vecf v = F_MUL(F_MUL(F_MUL(F_FROM_INT(sum), scale), F_LOAD(scales + c)), peaks);
        F_STORE(y + c, bias ? F_ADD(v, F_LOAD(bias + c)) : v);
    }
    for (int c = body; c < cols; c++) {
        float v = (float)(acc[c] - ZERO_POINT * column_sums[c]) * SCALE;
        v = v * scales[c];
        v = v * peak;
        y[c] = bias ? v + bias[c] : v;
    }
}

typedef struct {
    const float *x;
    int64_t x_row;
    int m, k, n;
    const int8_t *packed;
    const int32_t *column_sums; /* Σ_k w[n][k] per output channel */
    const float *scales;
    const float *bias; /* or NULL */
    float *y;
    int64_t y_row;
} Linear;

int int8_linear(const Linear *a, int threads) {
    const int64_t kp = round_up(a->k, 4), group_bytes = kp * COLUMNS;
    const int groups = (int)(round_up(a->n, COLUMNS) / COLUMNS);
    uint8_t *q = aligned_alloc(64, round_up((int64_t)a->m * kp, 64));
    float *peaks = malloc(sizeof(float) * (a->m > 0 ? a->m : 1));
    if (!q || !peaks) {
        free(q);
        free(peaks);
        return 2;
    }
    const int row_blocks = (a->m + BLOCK_ROWS - 1) / BLOCK_ROWS, items = groups * row_blocks;
    const int block_rows = (int)round_up((a->m + row_blocks - 1) / (row_blocks > 0 ? row_blocks : 1), ROWS); /* even blocks */
    if (threads < 1) threads = 1;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int i = 0; i < a->m; i++) peaks[i] = quantize_row(a->x + i * a->x_row, a->k, (int)kp, q + i * kp);
        int32_t acc[ROWS * COLUMNS];
#pragma omp for schedule(static)
        for (int item = 0; item < items; item++) {
            const int group = item % groups, block = item / groups;
            const int m_end = (block + 1) * block_rows < a->m ? (block + 1) * block_rows : a->m;
            const int col0 = group * COLUMNS, cols = a->n - col0 < COLUMNS ? a->n - col0 : COLUMNS;
            for (int m0 = block * block_rows; m0 < m_end; m0 += ROWS) {
                const int mb = m_end - m0 < ROWS ? m_end - m0 : ROWS;
                MICRO_ROWS[mb](q + m0 * kp, kp, a->packed + group * group_bytes, acc);
                for (int i = 0; i < mb; i++)
                    output_row(acc + i * COLUMNS, a->column_sums + col0, a->scales + col0, a->bias ? a->bias + col0 : 0,
                               peaks[m0 + i], cols, a->y + (m0 + i) * a->y_row + col0);
            }
        }
    }
    free(q);
    free(peaks);
    return 0;
}
