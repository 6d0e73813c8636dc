/* INT8 Linear with activations quantized per row: the service's own kernel beside FBGEMM's and
 * oneDNN's, computing the same bits as they do (service/quant/int8_linear.py).
 *
 * Each input row x is divided by its absolute maximum and quantized with the fixed scale 2^-6 and
 * zero point 64 (uint8 values 0..128, so the u8×s8 pair sums of CPUs without VNNI never saturate
 * int16); weights are int8 rows with one float scale per output channel. A row's output:
 *     y[n] = ((float)(Σ_k q[k]·w[n][k] − 64·Σ_k w[n][k]) · 2^-6 · scale[n]) · peak + bias[n]
 * The sums are integers — any order, any blocking, any number of rows gives the same bits — and
 * the float steps are those FBGEMM and oneDNN take, one rounding each (built with
 * -ffp-contract=off: no fused multiply-add may merge two of them).
 *
 * Weights are packed once into groups of GROUP = 32 output channels, 4 inputs of each side by side,
 * the order one VNNI dot product (vpdpbusd: 4 u8×s8 products added into each int32 lane) reads them
 * from tiles of L channels (L = 16 with AVX-512, 8 with AVX2): a decode step streams each group once
 * for every row it computes. The layout is the same on every CPU, so a checkpoint can store it and
 * every machine maps it as it is: a micro-kernel's COLUMNS = 4 tiles are one group with AVX2 (one
 * sequential stream, as this kernel has always read it) and two adjacent groups with AVX-512 (two
 * streams, each read whole).
 */
#include "simd.h"

int int8_lanes(void) { return L; }

#define GROUP 32 /* output channels of one packed group: the stored layout, whatever the CPU */
#define TILES 4  /* tiles of L output channels read together: a micro-kernel's columns */
#define COLUMNS (TILES * L)
#define STEP (GROUP * 4) /* bytes from one 4-input step of a group to the next */
#define TILES_PER_GROUP (GROUP / L < TILES ? GROUP / L : TILES)

int int8_group(void) { return GROUP; }

/* Bytes of the packed weights of an n × k matrix. */
int64_t int8_packed_bytes(int n, int k) { return round_up(n, GROUP) * round_up(k, 4); }

/* rows (n × k, int8, row-major) → [n/GROUP][k/4][GROUP][4]: each group of GROUP output channels
 * one contiguous stream, 4 inputs of each channel side by side; zeros pad both. Each row is read in
 * order and written 4 bytes at a time into its group (a group fits in cache). `sums` gets each
 * row's sum (what the zero point of the activations takes back). */
void int8_pack(const int8_t *rows, int n, int k, int8_t *out, int32_t *sums) {
    const int64_t k4 = round_up(k, 4) / 4, full = k / 4, group_bytes = k4 * STEP;
    if (n % GROUP || k % 4) memset(out, 0, int8_packed_bytes(n, k));
    for (int64_t row = 0; row < n; row++) {
        const int8_t *src = rows + row * k;
        int8_t *dst = out + (row / GROUP) * group_bytes + (row % GROUP) * 4;
        int32_t sum = 0;
        for (int64_t i = 0; i < k; i++) sum += src[i];
        sums[row] = sum;
        for (int64_t g = 0; g < full; g++) memcpy(dst + g * STEP, src + g * 4, 4);
        for (int j = 0; j < k % 4; j++) dst[full * STEP + j] = src[full * 4 + j];
    }
}

/* Weights a call reads once (a work item of one micro-kernel's rows: decode) are asked for
 * non-temporally this many 4-input steps ahead (4 KiB of each stream): into L1 without displacing
 * the caches' other lines. Measured here (AVX-512, 2 cores, 12 rounds): 96 % of the read bandwidth
 * against 93 % on the hardware's prefetch alone. Prefill's row blocks read their weights again from
 * L2 and ask for nothing. */
#define STREAM_STEPS 32
static inline void stream_ahead(const int8_t *p) { stream_lines(p + STREAM_STEPS * STEP, STEP); }

/* Rows [0, MB) of q against COLUMNS output channels: the first TILES_PER_GROUP tiles in the group at
 * `first`, the rest (AVX-512) in the group at `second`; each 4 inputs on are STEP bytes on. int32
 * sums into acc (MB × COLUMNS). ONCE: no other call reads these weights (stream_ahead). */
#define MICRO(NAME, MB, ONCE)                                                                                     \
    static void NAME(const uint8_t *q, int64_t kp, const int8_t *first, const int8_t *second, int32_t *acc) {     \
        vec s[MB][TILES];                                                                                         \
        for (int i = 0; i < MB; i++)                                                                              \
            for (int t = 0; t < TILES; t++) s[i][t] = ZERO();                                                     \
        for (int64_t g = 0; g < kp / 4; g++) {                                                                    \
            vec w[TILES];                                                                                         \
            if (ONCE) {                                                                                           \
                stream_ahead(first + g * STEP);                                                                   \
                if (TILES_PER_GROUP < TILES) stream_ahead(second + g * STEP);                                     \
            }                                                                                                     \
            for (int t = 0; t < TILES; t++)                                                                       \
                w[t] = LOAD((t < TILES_PER_GROUP ? first : second) + g * STEP + (t % TILES_PER_GROUP) * L * 4);   \
            for (int i = 0; i < MB; i++) {                                                                        \
                vec a = BROADCAST(q + i * kp + g * 4);                                                            \
                for (int t = 0; t < TILES; t++) s[i][t] = DOT(s[i][t], a, w[t]);                                  \
            }                                                                                                     \
        }                                                                                                         \
        for (int i = 0; i < MB; i++)                                                                              \
            for (int t = 0; t < TILES; t++) STORE(acc + i * COLUMNS + t * L, s[i][t]);                            \
    }
MICRO(micro_1, 1, 0)
MICRO(micro_2, 2, 0)
MICRO(micro_3, 3, 0)
MICRO(micro_4, 4, 0)
MICRO(micro_5, 5, 0)
MICRO(micro_6, 6, 0)
MICRO(stream_1, 1, 1)
MICRO(stream_2, 2, 1)
MICRO(stream_3, 3, 1)
MICRO(stream_4, 4, 1)
MICRO(stream_5, 5, 1)
MICRO(stream_6, 6, 1)

#define ROWS 6 /* rows of a micro-kernel call: 6 × TILES accumulators, 4 weight vectors and a broadcast in registers */
typedef void (*micro_fn)(const uint8_t *, int64_t, const int8_t *, const int8_t *, int32_t *);
/* [once][rows] */
static const micro_fn MICRO_ROWS[2][7] = {{0, micro_1, micro_2, micro_3, micro_4, micro_5, micro_6},
                                          {0, stream_1, stream_2, stream_3, stream_4, stream_5, stream_6}};

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
    const int64_t kp = round_up(a->k, 4), group_bytes = kp * GROUP;
    const int groups = (int)(round_up(a->n, COLUMNS) / COLUMNS); /* column blocks of COLUMNS channels */
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
            const int8_t *first = a->packed + (col0 / GROUP) * group_bytes;
            /* AVX-512's second group; past the last one (n padded to 32 only) the first is read again,
             * its sums never written out */
            const int8_t *second = col0 + GROUP < round_up(a->n, GROUP) ? first + group_bytes : first;
            const int once = m_end - block * block_rows <= ROWS;
            for (int m0 = block * block_rows; m0 < m_end && cols > 0; m0 += ROWS) {
                const int mb = m_end - m0 < ROWS ? m_end - m0 : ROWS;
                MICRO_ROWS[once][mb](q + m0 * kp, kp, first, second, acc);
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
