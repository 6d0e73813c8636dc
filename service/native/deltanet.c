/* Qwen3.5's Gated DeltaNet token mixer (its linear-attention layers), after the input projections and
 * before out_proj: the causal depthwise convolution with its state, SiLU, the L2 norms of queries and
 * keys, the gated delta rule's recurrence, and the gated RMSNorm — for any number of sequences, each
 * with any number of consecutive tokens.
 *
 * Exact by construction. A token's output and the state it leaves are computed by one fixed sequence
 * of float operations that depends on nothing but that token's inputs and the state before it: the
 * recurrence runs token by token (no chunked form, whose bits would depend on where a chunk starts),
 * so a token decoded alone, in a batch of any neighbours, in a prefill piece of any length, or after
 * a pause or a cache hit gets the same bits. The same holds across instruction sets: every vector is
 * GCC's 16-float vector (one AVX-512 register or two AVX2 ones: the same lanes either way), every
 * sum over lanes is one fixed tree, no multiply-add is fused (-ffp-contract=off), and exp and log are
 * fixed.h's polynomials (libm's may take instruction-set-specific paths).
 *
 * Built by service/native/__init__.py; called by service/model/deltanet.py. */
#include <stdlib.h>

#include "fixed.h"

/* softplus(x) = log(1 + e^x) (x itself above 20, as torch's), with log1p's correction for small e^x. */
static inline float softplus(float x) {
    if (x > 20.0f) return x;
    float t = scalar(vexp(splat(x)));
    float u = 1.0f + t;
    if (u == 1.0f) return t;
    return scalar(vlog(splat(u))) * (t / (u - 1.0f));
}

typedef struct {
    int nk, nv, dk, dv, kernel; /* key heads, value heads, their sizes, the convolution's width */
    const float *conv_weight;   /* [kernel, conv_dim]: tap t of every channel (conv_dim = 2·nk·dk + nv·dv) */
    const float *a_log;         /* [nv] */
    const float *dt_bias;       /* [nv] */
    const float *norm_weight;   /* [dv] */
    float eps;
} Layer;

typedef struct {
    int n;                        /* this sequence's tokens in the call */
    const float *qkv;             /* [n, conv_dim] (row stride qkv_row): before the convolution */
    const float *z, *b, *a;       /* [n, nv·dv], [n, nv], [n, nv] (row strides below) */
    int64_t qkv_row, z_row, b_row, a_row;
    const float *conv_before;     /* [kernel - 1, conv_dim]: the inputs of the last kernel - 1 tokens, oldest first */
    const float *state_before;    /* [nv, dk, dv]: the recurrent state before these tokens */
    float *conv_state, *state;    /* the same after them: the buffers above (in place) or others (the call can
                                     then be undone, or redone for fewer tokens) */
    float *mixed;                 /* [n, conv_dim + 2·nv]: scratch, the convolved q, k, v, then each token's gates */
    float *out;                   /* [n, nv·dv] (row stride out_row) */
    int64_t out_row;
} Sequence;

static inline int conv_dim(const Layer *l) { return 2 * l->nk * l->dk + l->nv * l->dv; }

/* Channels [c0, c1) of one sequence's tokens: the convolution over the previous kernel - 1 inputs
 * and its own, SiLU; then the state keeps the last kernel - 1 inputs. c0 and c1 are multiples of 16. */
static void convolve(const Layer *l, const Sequence *s, int c0, int c1) {
    const int dim = conv_dim(l), taps = l->kernel, keep = taps - 1;
    for (int c = c0; c < c1; c += LANES) {
        for (int t = 0; t < s->n; t++) {
            vf acc = splat(0.0f);
            for (int j = 0; j < taps; j++) {
                int at = t - keep + j; /* the input this tap reads: a past one from the state if negative */
                const float *x = at < 0 ? s->conv_before + (int64_t)(keep + at) * dim : s->qkv + at * s->qkv_row;
                acc = acc + load(l->conv_weight + (int64_t)j * dim + c) * load(x + c);
            }
            store(s->mixed + (int64_t)t * dim + c, vsilu(acc));
        }
        /* the new state: the last `keep` inputs, older ones from the state where n < keep */
        vf window[8];
        for (int j = 0; j < keep; j++) {
            int at = s->n - keep + j;
            window[j] = load(at < 0 ? s->conv_before + (int64_t)(keep + at) * dim + c : s->qkv + at * s->qkv_row + c);
        }
        for (int j = 0; j < keep; j++) store(s->conv_state + (int64_t)j * dim + c, window[j]);
    }
}

/* x (d floats, d a multiple of 16) scaled to unit length (eps 1e-6 under the root, as FLA's), times `scale`. */
static void unit(float *x, int d, float scale) {
    vf acc = splat(0.0f);
    for (int i = 0; i < d; i += LANES) acc = acc + load(x + i) * load(x + i);
    float inverse = 1.0f / __builtin_sqrtf(total(acc) + 1e-6f);
    for (int i = 0; i < d; i += LANES) store(x + i, load(x + i) * splat(inverse) * splat(scale));
}

/* Value head h of one sequence, columns [c, c + VECS·16) of its state, token by token: the state
 * decays, learns the token's key → value (the delta rule), and is read by the token's query. Each
 * column evolves on its own, in one fixed order of rows, so the bits are those of any tiling; a
 * block's rows are read in address order (whole 512-byte rows at dv = 128 with AVX-512), which the
 * hardware's prefetch follows (16-column slabs, 64 bytes of every row, took 40 % longer a decoded
 * token), and its dk × VECS·16 floats (64 KiB at dk = 128 with AVX-512) stay in L2 between the two
 * passes of a token and over a prefill piece. */
#define RECUR(VECS)                                                                                        \
    static void recur_##VECS(const Layer *l, const Sequence *s, int h, int c) {                            \
        const int dim = conv_dim(l), dk = l->dk, dv = l->dv, kh = h / (l->nv / l->nk);                     \
        float *state = s->state + (int64_t)h * dk * dv + c;                                                \
        const float *before = s->state_before + (int64_t)h * dk * dv + c;                                  \
        const float *gates = s->mixed + (int64_t)s->n * dim; /* [n, nv, 2]: decay, beta */                 \
        for (int t = 0; t < s->n; t++) {                                                                   \
            const float *row = s->mixed + (int64_t)t * dim;                                                \
            const float *q = row + kh * dk, *k = row + l->nk * dk + kh * dk;                               \
            const vf e = splat(gates[(t * l->nv + h) * 2]), beta = splat(gates[(t * l->nv + h) * 2 + 1]);  \
            const float *from = t == 0 ? before : state;                                                   \
            vf kv[VECS], delta[VECS], out[VECS];                                                           \
            for (int v = 0; v < VECS; v++) kv[v] = splat(0.0f);                                            \
            for (int i = 0; i < dk; i++)                                                                   \
                for (int v = 0; v < VECS; v++)                                                             \
                    kv[v] = kv[v] + load(from + i * dv + v * LANES) * e * splat(k[i]);                     \
            for (int v = 0; v < VECS; v++) {                                                               \
                delta[v] = (load(row + 2 * l->nk * dk + h * dv + c + v * LANES) - kv[v]) * beta;           \
                out[v] = splat(0.0f);                                                                      \
            }                                                                                              \
            for (int i = 0; i < dk; i++)                                                                   \
                for (int v = 0; v < VECS; v++) {                                                           \
                    vf updated = load(from + i * dv + v * LANES) * e + splat(k[i]) * delta[v];             \
                    store(state + i * dv + v * LANES, updated);                                            \
                    out[v] = out[v] + updated * splat(q[i]);                                               \
                }                                                                                          \
            for (int v = 0; v < VECS; v++)                                                                 \
                store(s->out + t * s->out_row + h * dv + c + v * LANES, out[v]);                           \
        }                                                                                                  \
    }
/* Columns a work item takes: a whole 128-wide row of the state in AVX-512's 32 registers, half of
 * one in AVX2's 16 (the bits are the same either way: each column's sums run in the same order) */
#if defined(__AVX512F__)
#define WIDE 8
#else
#define WIDE 4
#endif
RECUR(1)
RECUR(WIDE)

/* Token t's value head h: its decay and its write strength beta, once for every column block. */
static void gate(const Layer *l, const Sequence *s, int t, int h, float *gates) {
    const float rate = -scalar(vexp(splat(l->a_log[h])));
    gates[0] = scalar(vexp(splat(rate * softplus(s->a[t * s->a_row + h] + l->dt_bias[h]))));
    gates[1] = 1.0f / (1.0f + scalar(vexp(splat(-s->b[t * s->b_row + h]))));
}

/* Token t's value head h, in place: RMS-normed, weighted, gated by SiLU(z). */
static void norm_gate(const Layer *l, const Sequence *s, int t, int h) {
    const int dv = l->dv;
    float *o = s->out + t * s->out_row + h * dv;
    const float *z = s->z + t * s->z_row + h * dv;
    vf squares = splat(0.0f);
    for (int c = 0; c < dv; c += LANES) squares = squares + load(o + c) * load(o + c);
    const vf inverse = splat(1.0f / __builtin_sqrtf(total(squares) / (float)dv + l->eps));
    for (int c = 0; c < dv; c += LANES)
        store(o + c, load(o + c) * inverse * load(l->norm_weight + c) * vsilu(load(z + c)));
}

int deltanet_lanes(void) { return LANES; }

/* `count` sequences through one layer; 0 on success. */
int deltanet(const Layer *l, const Sequence *seqs, int count, int threads) {
    const int dim = conv_dim(l), dk = l->dk;
    for (int i = 0; i < count; i++)
        if (seqs[i].n < 1) return 1;
    if (l->dk % LANES || l->dv % LANES || l->nv % l->nk || l->kernel < 2 || l->kernel > 9)
        return 1;
    const int channel_blocks = dim / LANES, items = count * channel_blocks;
    const float query_scale = 1.0f / __builtin_sqrtf((float)dk);
    if (threads < 1) threads = 1;
#pragma omp parallel num_threads(threads)
    {
        /* subnormals flushed on these threads (as deterministic as the rest, and no microcode assists) */
        const unsigned int csr = _mm_getcsr();
        _mm_setcsr(csr | 0x8040);
#pragma omp for schedule(static)
        for (int item = 0; item < items; item++) {
            const Sequence *s = seqs + item / channel_blocks;
            int c = item % channel_blocks * LANES;
            convolve(l, s, c, c + LANES);
        }
#pragma omp for schedule(static)
        for (int item = 0; item < count * l->nk; item++) {
            const Sequence *s = seqs + item / l->nk;
            int kh = item % l->nk;
            for (int t = 0; t < s->n; t++) {
                float *row = s->mixed + (int64_t)t * dim;
                unit(row + kh * dk, dk, query_scale);
                unit(row + l->nk * dk + kh * dk, dk, 1.0f);
            }
        }
#pragma omp for schedule(static)
        for (int item = 0; item < count * l->nv; item++) {
            const Sequence *s = seqs + item / l->nv;
            float *gates = s->mixed + (int64_t)s->n * dim;
            for (int t = 0; t < s->n; t++) gate(l, s, t, item % l->nv, gates + (t * l->nv + item % l->nv) * 2);
        }
        const int vecs = l->dv % (WIDE * LANES) == 0 ? WIDE : 1, blocks = l->dv / (vecs * LANES);
#pragma omp for schedule(static)
        for (int item = 0; item < count * l->nv * blocks; item++) {
            const Sequence *s = seqs + item / (l->nv * blocks);
            const int h = item / blocks % l->nv, c = item % blocks * vecs * LANES;
            if (vecs == WIDE) recur_WIDE(l, s, h, c); else recur_1(l, s, h, c);
        }
#pragma omp for schedule(static)
        for (int item = 0; item < count * l->nv; item++) {
            const Sequence *s = seqs + item / l->nv;
            for (int t = 0; t < s->n; t++) norm_gate(l, s, t, item % l->nv);
        }
        _mm_setcsr(csr);
    }
    return 0;
}
