/* 4-bit Linear with activations quantized per row: the service's kernel for 4-bit weights
 * (service/quant/int4_linear.py).
 *
 * Weights are unsigned 4-bit values w in 0..15 in groups of G inputs along a row, each group with
 * its own zero point z (0..15) and fp16 scale s: the weight is s·(w − z) (GPTQ's and AWQ's form;
 * symmetric quantization is z = 8). Each input row is quantized as the INT8 kernel quantizes it
 * (simd.h: its absolute maximum, the fixed step 2^-6, values 64 ± 64), used here as signed
 * a = q − 64 in −64..64. A row's output:
 *     y[n] = (Σ_g s[n][g] · (Σ_{k∈g} w[n][k]·a[k] − z[n][g]·Σ_{k∈g} a[k])) · peak·2^-6 + bias[n]
 * The inner sums are integers (exact in any order); the groups are added in float in one fixed
 * order with one fused multiply-add each, then scaled: the same operations for a row whatever
 * else is in the call — a row's result never depends on the other rows.
 *
 * The packed layout does not depend on the CPU (a checkpoint may store it; AVX-512 and AVX2 read
 * the same bytes): output channels in groups of 64; per group, per 8 inputs, 256 bytes: 64
 * channels × 4 bytes, byte j of channel c holding input j in its low nibble and input j + 4 in its
 * high one. One 64-byte load, masked and shifted, is two vectors of 16 channels × 4 inputs — what
 * one VNNI dot product (vpdpbusd: 4 u8×s8 products added into each int32 lane) reads. Zero points
 * (u8) and scales (fp16) are stored per channel group and input group, 64 of each side by side.
 */
#include "simd.h"
#include "fixed.h"

/* DOT_AT(acc, u, p): acc += u (unsigned bytes) · the 4 signed bytes at p, broadcast. With AVX-512
 * VNNI the broadcast is the instruction's own memory operand ({1to16}): no register holds it. */
#if L == 16 && defined(__AVX512VNNI__)
static inline __m512i dot_at(__m512i acc, __m512i u, const void *p) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*(const int32_t *)p));
    return acc;
}
#define DOT_AT(acc, u, p) dot_at(acc, u, p)
#else
#define DOT_AT(acc, u, p) DOT(acc, u, BROADCAST(p))
#endif

#if L == 16
#define SRLI16(v, n) _mm512_srli_epi16(v, n)
#define AND(a, b) _mm512_and_si512(a, b)
#define SET8(x) _mm512_set1_epi8(x)
#define F_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define ZEROS_I32(p) _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p)))
#define SCALES_F32(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define ROWS 4 /* 4 rows × 4 vectors of sums and the weights (measured: 6 rows prefilled 1.4x slower) */
#else
#define SRLI16(v, n) _mm256_srli_epi16(v, n)
#define AND(a, b) _mm256_and_si256(a, b)
#define SET8(x) _mm256_set1_epi8(x)
#define F_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define ZEROS_I32(p) _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
#define SCALES_F32(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define ROWS 2 /* 16 registers only */
#endif

#define CHANNELS 64          /* output channels of one packed group */
#define STEP_BYTES 256       /* CHANNELS × 4 bytes: 8 inputs of every channel of a group */
#define SLICE 4              /* vectors of channels a micro-kernel computes: 64 channels (AVX-512) or 32 (AVX2) */
#define SLICE_CHANNELS (SLICE * L)
/* A slice reads SLICE_CHANNELS × 4 bytes of every STEP_BYTES: ask for them this many steps ahead
 * (DRAM's latency is not hidden by the hardware's prefetch alone). Weights a call reads once (a
 * work item of one micro-kernel's rows: decode) are asked for non-temporally: into L1 without
 * displacing the caches' other lines, 8 KiB ahead, and their zero points and scales two groups ahead
 * — measured here (AVX-512, 2 cores) 88-97 % of the read bandwidth against 80-90 % for the T0 hint 4 KiB
 * ahead (tried 4-16 KiB, T1 hints, none), then +5 % with the zero points and scales. Weights several
 * micro-kernel calls read again (prefill's row blocks) must stay in L2: T0. */
#define PREFETCH_STEPS 16
#define STREAM_STEPS 32
#define PREFETCH(p, once)                                                                                      \
    do {                                                                                                       \
        if (once)                                                                                              \
            stream_lines((p) + STREAM_STEPS * STEP_BYTES, SLICE_CHANNELS * 4);                                 \
        else                                                                                                   \
            for (int line = 0; line < SLICE_CHANNELS * 4; line += 64)                                          \
                _mm_prefetch((const char *)(p) + PREFETCH_STEPS * STEP_BYTES + line, _MM_HINT_T0);             \
    } while (0)

/* Bytes of the packed weights of an n × k matrix (k a multiple of 8). */
int64_t int4_packed_bytes(int n, int k) { return round_up(n, CHANNELS) * k / 2; }

/* Entries of the packed zero points (bytes) and scales (fp16) of an n × k matrix in groups of `group` inputs. */
int64_t int4_group_entries(int n, int k, int group) { return round_up(n, CHANNELS) * (k / group); }

/* values (n × k bytes, 0..15, row-major), zeros and scales (n × k/group, row-major) → the packed
 * layout above; padding channels get weights 0, zero 0 and scale 0 (their outputs are never written). */
void int4_pack(const uint8_t *values, const uint8_t *zeros, const uint16_t *scales, int n, int k, int group,
               uint8_t *packed, uint8_t *packed_zeros, uint16_t *packed_scales) {
    const int groups = k / group;
    const int64_t group_bytes = (int64_t)k / 8 * STEP_BYTES;
    memset(packed, 0, int4_packed_bytes(n, k));
    memset(packed_zeros, 0, int4_group_entries(n, k, group));
    memset(packed_scales, 0, int4_group_entries(n, k, group) * 2);
    for (int64_t row = 0; row < n; row++) {
        const uint8_t *src = values + row * k;
        const int64_t cg = row / CHANNELS, c = row % CHANNELS;
        uint8_t *dst = packed + cg * group_bytes + c * 4;
        for (int64_t step = 0; step < k / 8; step++)
            for (int j = 0; j < 4; j++)
                dst[step * STEP_BYTES + j] = (uint8_t)((src[step * 8 + j] & 15) | (src[step * 8 + 4 + j] & 15) << 4);
        for (int g = 0; g < groups; g++) {
            packed_zeros[(cg * groups + g) * CHANNELS + c] = zeros[row * groups + g];
            packed_scales[(cg * groups + g) * CHANNELS + c] = scales[row * groups + g];
        }
    }
}

/* Rows [0, MB) of a (signed activations, k each; `sums`: Σ a per input group) against one slice of
 * a channel group: float sums over the groups into f (MB × SLICE_CHANNELS). ONCE: no other call
 * reads this slice's weights (PREFETCH). */
#define MICRO(NAME, MB, ONCE)                                                                                       \
    static void NAME(const int8_t *a, const int32_t *sums, int64_t k, int group, const uint8_t *w,                  \
                     const uint8_t *zeros, const uint16_t *scales, float *f) {                                      \
        const int groups = (int)(k / group);                                                                        \
        const vec low = SET8(15);                                                                                   \
        for (int i = 0; i < MB * SLICE_CHANNELS; i++) f[i] = 0.0f;                                                  \
        for (int g = 0; g < groups; g++) {                                                                          \
            vec s[MB][SLICE];                                                                                       \
            if (ONCE) { /* the zero points and scales of the group after next: streams of their own */             \
                stream_lines(zeros + (g + 2) * CHANNELS, 64);                                                       \
                stream_lines(scales + (g + 2) * CHANNELS, 128);                                                     \
            }                                                                                                       \
            for (int i = 0; i < MB; i++)                                                                            \
                for (int v = 0; v < SLICE; v++) s[i][v] = ZERO();                                                   \
            for (int64_t step = (int64_t)g * group / 8; step < (int64_t)(g + 1) * group / 8; step++) {              \
                const uint8_t *at = w + step * STEP_BYTES;                                                          \
                PREFETCH(at, ONCE);                                                                                 \
                const int8_t *inputs = a + step * 8;                                                                \
                for (int v = 0; v < SLICE; v++) {                                                                   \
                    const vec raw = LOAD(at + v * L * 4);                                                           \
                    const vec lo = AND(raw, low), hi = AND(SRLI16(raw, 4), low);                                    \
                    for (int i = 0; i < MB; i++)                                                                    \
                        s[i][v] = DOT_AT(DOT_AT(s[i][v], lo, inputs + i * k), hi, inputs + i * k + 4);              \
                }                                                                                                   \
            }                                                                                                       \
            for (int v = 0; v < SLICE; v++) {                                                                       \
                const vec z = ZEROS_I32(zeros + g * CHANNELS + v * L);                                              \
                const vecf scale = SCALES_F32(scales + g * CHANNELS + v * L);                                       \
                for (int i = 0; i < MB; i++) {                                                                      \
                    const vec exact = I_SUB(s[i][v], I_MUL(z, I_SET(sums[i * groups + g])));                        \
                    float *out = f + i * SLICE_CHANNELS + v * L;                                                    \
                    F_STORE(out, F_FMA(F_FROM_INT(exact), scale, F_LOAD(out)));                                     \
                }                                                                                                   \
            }                                                                                                       \
        }                                                                                                           \
    }
MICRO(micro_1, 1, 0)
MICRO(micro_2, 2, 0)
MICRO(micro_3, 3, 0)
MICRO(micro_4, 4, 0)
MICRO(stream_1, 1, 1)
MICRO(stream_2, 2, 1)
MICRO(stream_3, 3, 1)
MICRO(stream_4, 4, 1)
typedef void (*micro_fn)(const int8_t *, const int32_t *, int64_t, int, const uint8_t *, const uint8_t *,
                         const uint16_t *, float *);
/* [once][rows] */
static const micro_fn MICRO_ROWS[2][5] = {{0, micro_1, micro_2, micro_3, micro_4},
                                          {0, stream_1, stream_2, stream_3, stream_4}};

#define BLOCK_ROWS 192 /* rows a work item runs against its channels, at most (they stay in cache meanwhile) */

typedef struct {
    const float *x;
    int64_t x_row;
    int m, k, n, group;
    const uint8_t *packed;
    const uint8_t *zeros;
    const uint16_t *scales;
    const float *bias; /* or NULL */
    float *y;
    int64_t y_row;
} Int4Linear;

/* One row's activations: the INT8 kernel's uint8 values made signed, and their sum per input group. */
static float signed_row(const float *x, int k, int group, uint8_t *scratch, int8_t *a, int32_t *sums) {
    const float peak = quantize_row(x, k, k, scratch);
    for (int g = 0; g < k / group; g++) {
        int32_t sum = 0;
        for (int i = g * group; i < (g + 1) * group; i++) {
            a[i] = (int8_t)(scratch[i] - ZERO_POINT);
            sum += a[i];
        }
        sums[g] = sum;
    }
    return peak;
}

int int4_linear(const Int4Linear *c, int threads) {
    const int64_t k = c->k, groups = k / c->group, group_bytes = k / 8 * STEP_BYTES;
    const int slices = (int)(round_up(c->n, CHANNELS) / SLICE_CHANNELS), per_group = CHANNELS / SLICE_CHANNELS;
    const int m = c->m > 0 ? c->m : 1;
    int8_t *a = aligned_alloc(64, round_up((int64_t)m * k, 64));
    uint8_t *scratch = aligned_alloc(64, round_up((int64_t)m * k, 64));
    int32_t *sums = malloc(sizeof(int32_t) * m * groups);
    float *peaks = malloc(sizeof(float) * m);
    if (!a || !scratch || !sums || !peaks) {
        free(a), free(scratch), free(sums), free(peaks);
        return 2;
    }
    const int row_blocks = (c->m + BLOCK_ROWS - 1) / BLOCK_ROWS, items = slices * row_blocks;
    const int block_rows = (int)round_up((c->m + row_blocks - 1) / (row_blocks > 0 ? row_blocks : 1), ROWS);
    if (threads < 1) threads = 1;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int i = 0; i < c->m; i++)
            peaks[i] = signed_row(c->x + i * c->x_row, c->k, c->group, scratch + i * k, a + i * k, sums + i * groups);
        float f[ROWS * SLICE_CHANNELS];
#pragma omp for schedule(static)
        for (int item = 0; item < items; item++) {
            const int slice = item % slices, block = item / slices;
            const int64_t cg = slice / per_group, within = (int64_t)(slice % per_group) * SLICE_CHANNELS;
            const int col0 = slice * SLICE_CHANNELS, cols = c->n - col0 < SLICE_CHANNELS ? c->n - col0 : SLICE_CHANNELS;
            const uint8_t *w = c->packed + cg * group_bytes + within * 4;
            const uint8_t *zeros = c->zeros + cg * groups * CHANNELS + within;
            const uint16_t *scales = c->scales + cg * groups * CHANNELS + within;
            const int m_end = (block + 1) * block_rows < c->m ? (block + 1) * block_rows : c->m;
            const int once = m_end - block * block_rows <= ROWS;
            for (int m0 = block * block_rows; m0 < m_end; m0 += ROWS) {
                const int mb = m_end - m0 < ROWS ? m_end - m0 : ROWS;
                MICRO_ROWS[once][mb](a + m0 * k, sums + m0 * groups, k, c->group, w, zeros, scales, f);
                for (int i = 0; i < mb; i++) {
                    const float step = peaks[m0 + i] * SCALE; /* exact: SCALE is a power of two */
                    float *y = c->y + (m0 + i) * c->y_row + col0;
                    for (int j = 0; j < cols; j++) {
                        const float v = f[i * SLICE_CHANNELS + j] * step;
                        y[j] = c->bias ? v + c->bias[col0 + j] : v;
                    }
                }
            }
        }
    }
    free(a), free(scratch), free(sums), free(peaks);
    return 0;
}

/* A mixture-of-experts layer's experts, all in one call (service/model/moe.py): each row's top_k
 * experts (gate/up → silu(gate)·up → down), weighted and added in the row's own rank order.
 *
 * The call's (row, rank) slots are sorted by expert (stable: row order within an expert), so each
 * expert's rows sit together and one pass over its weights serves all of them; every expert's
 * channel slices of every row block are work items of one parallel loop, so the threads share the
 * call's work however few rows each expert has (a decode step: one row, 8 experts). Each step is
 * the per-row computation `int4_linear` does — a row's input quantized once, its integer sums, the
 * groups added in one fixed order — so a row's result depends on nothing else in the call. */
typedef struct {
    const float *x; /* m × hidden, rows one after the other */
    int m, hidden, width, top_k, up_group, down_group;
    const int64_t *chosen;  /* m × top_k expert numbers, each row's in rank order */
    const float *weights;   /* m × top_k, the router's renormalised probabilities */
    const uint8_t *const *up_packed; /* per expert: gate/up (hidden → 2·width, gate rows first) */
    const uint8_t *const *up_zeros;
    const uint16_t *const *up_scales;
    const uint8_t *const *down_packed; /* per expert: down (width → hidden) */
    const uint8_t *const *down_zeros;
    const uint16_t *const *down_scales;
    float *y; /* m × hidden */
} Int4Experts;

typedef struct {
    int expert, slice, first, end; /* sorted slots [first, end) against one channel slice */
} ExpertItem;

/* The items of one projection over every expert's sorted slots: each expert's channel slices × its row blocks. */
static int expert_items(const int *starts, int experts, int n, ExpertItem *items) {
    const int slices = (int)(round_up(n, CHANNELS) / SLICE_CHANNELS);
    int count = 0;
    for (int e = 0; e < experts; e++)
        for (int first = starts[e]; first < starts[e + 1]; first += BLOCK_ROWS) {
            const int end = first + BLOCK_ROWS < starts[e + 1] ? first + BLOCK_ROWS : starts[e + 1];
            for (int s = 0; s < slices; s++) items[count++] = (ExpertItem){e, s, first, end};
        }
    return count;
}

/* One item: sorted slots [first, end) (signed activations a, k each) against one slice of an
 * expert's packed n × k weights, into out (a row of `n` floats per slot). */
static void expert_item(const ExpertItem *it, const int8_t *a, const int32_t *sums, const float *peaks, int64_t k,
                        int n, int group, const uint8_t *packed, const uint8_t *zeros, const uint16_t *scales,
                        float *out) {
    const int64_t groups = k / group, group_bytes = k / 8 * STEP_BYTES;
    const int per_group = CHANNELS / SLICE_CHANNELS;
    const int64_t cg = it->slice / per_group, within = (int64_t)(it->slice % per_group) * SLICE_CHANNELS;
    const int col0 = it->slice * SLICE_CHANNELS, cols = n - col0 < SLICE_CHANNELS ? n - col0 : SLICE_CHANNELS;
    const uint8_t *w = packed + cg * group_bytes + within * 4;
    zeros += cg * groups * CHANNELS + within;
    scales += cg * groups * CHANNELS + within;
    float f[ROWS * SLICE_CHANNELS];
    for (int m0 = it->first; m0 < it->end; m0 += ROWS) {
        const int mb = it->end - m0 < ROWS ? it->end - m0 : ROWS;
        MICRO_ROWS[it->end - it->first <= ROWS][mb](a + m0 * k, sums + m0 * groups, k, group, w, zeros, scales, f);
        for (int i = 0; i < mb; i++) {
            const float step = peaks[m0 + i] * SCALE;
            float *y = out + (int64_t)(m0 + i) * n + col0;
            for (int j = 0; j < cols; j++) y[j] = f[i * SLICE_CHANNELS + j] * step;
        }
    }
}

/* silu(gate)·up in place over a slot's gate half: fixed.h's exp, each element alone — the bits of
 * float_ops.c's silu_mul, on every instruction set (libm's expf was not). */
static void silu_times_up(float *g, int width) {
    int j = 0;
    for (; j + NATIVE <= width; j += NATIVE) n_store(g + j, n_silu(n_load(g + j)) * n_load(g + width + j));
    if (j < width) {
        const int rest = width - j;
        n_store_part(g + j, n_silu(n_load_part(g + j, rest)) * n_load_part(g + width + j, rest), rest);
    }
}

int int4_experts(const Int4Experts *c, int experts, int threads) {
    const int m = c->m, slots = c->m * c->top_k, hidden = c->hidden, width = c->width;
    const int up_slices = (int)(round_up(2 * width, CHANNELS) / SLICE_CHANNELS);
    const int down_slices = (int)(round_up(hidden, CHANNELS) / SLICE_CHANNELS);
    const int most_items = (slots + experts) * (up_slices > down_slices ? up_slices : down_slices);
    const int64_t widest = hidden > width ? hidden : width;
    int *starts = calloc(experts + 2, sizeof(int));
    int *sorted = malloc(sizeof(int) * (slots + 1));  /* position → slot (row·top_k + rank) */
    int *slot_at = malloc(sizeof(int) * (slots + 1)); /* slot → position */
    int8_t *a = aligned_alloc(64, round_up((int64_t)slots * widest + 1, 64));
    uint8_t *scratch = aligned_alloc(64, round_up((int64_t)slots * widest + 1, 64));
    int32_t *sums = malloc(sizeof(int32_t) * (slots + 1) * (hidden / c->up_group + width / c->down_group));
    float *peaks = malloc(sizeof(float) * (slots + 1));
    float *up = malloc(sizeof(float) * ((int64_t)slots * 2 * width + 1));
    float *down = malloc(sizeof(float) * ((int64_t)slots * hidden + 1));
    ExpertItem *items = malloc(sizeof(ExpertItem) * (most_items + 1));
    int status = 0;
    if (!starts || !sorted || !slot_at || !a || !scratch || !sums || !peaks || !up || !down || !items) {
        status = 2;
        goto done;
    }
    for (int s = 0; s < slots; s++) {
        if (c->chosen[s] < 0 || c->chosen[s] >= experts) {
            status = 3;
            goto done;
        }
        starts[c->chosen[s] + 2]++;
    }
    for (int e = 0; e < experts; e++) starts[e + 2] += starts[e + 1];
    for (int s = 0; s < slots; s++) { /* counting sort, stable: starts[e + 1] walks expert e's positions */
        const int at = starts[c->chosen[s] + 1]++;
        sorted[at] = s, slot_at[s] = at;
    }
    /* starts[e] is now where expert e's positions begin, starts[experts] the end */
    const int64_t up_groups = hidden / c->up_group, down_groups = width / c->down_group;
    if (threads < 1) threads = 1;
    int n_items = 0;
#pragma omp parallel num_threads(threads)
    {
        /* each position's input: its row quantized (rows sharing an expert list are quantized anew: the same bits) */
#pragma omp for schedule(static)
        for (int p = 0; p < slots; p++)
            peaks[p] = signed_row(c->x + (int64_t)(sorted[p] / c->top_k) * hidden, hidden, c->up_group,
                                  scratch + (int64_t)p * hidden, a + (int64_t)p * hidden, sums + p * up_groups);
#pragma omp single
        n_items = expert_items(starts, experts, 2 * width, items);
#pragma omp for schedule(static)
        for (int i = 0; i < n_items; i++) {
            const int e = items[i].expert;
            expert_item(&items[i], a, sums, peaks, hidden, 2 * width, c->up_group, c->up_packed[e], c->up_zeros[e],
                        c->up_scales[e], up);
        }
        /* silu(gate)·up, in place over the gate half, then quantized as the down projection's input */
#pragma omp for schedule(static)
        for (int p = 0; p < slots; p++) {
            float *g = up + (int64_t)p * 2 * width;
            silu_times_up(g, width);
            peaks[p] = signed_row(g, width, c->down_group, scratch + (int64_t)p * width, a + (int64_t)p * width,
                                  sums + p * down_groups);
        }
#pragma omp single
        n_items = expert_items(starts, experts, hidden, items);
#pragma omp for schedule(static)
        for (int i = 0; i < n_items; i++) {
            const int e = items[i].expert;
            expert_item(&items[i], a, sums, peaks, width, hidden, c->down_group, c->down_packed[e], c->down_zeros[e],
                        c->down_scales[e], down);
        }
        /* each row's experts added in its own rank order: first choice, second, … */
#pragma omp for schedule(static)
        for (int r = 0; r < m; r++) {
            float *y = c->y + (int64_t)r * hidden;
            const float *w = c->weights + (int64_t)r * c->top_k;
            const float *first = down + (int64_t)slot_at[r * c->top_k] * hidden;
            for (int j = 0; j < hidden; j++) y[j] = first[j] * w[0];
            for (int rank = 1; rank < c->top_k; rank++) {
                const float *o = down + (int64_t)slot_at[r * c->top_k + rank] * hidden;
                for (int j = 0; j < hidden; j++) y[j] = y[j] + o[j] * w[rank];
            }
        }
    }
done:
    free(starts), free(sorted), free(slot_at), free(a), free(scratch), free(sums), free(peaks), free(up), free(down);
    free(items);
    return status;
}
