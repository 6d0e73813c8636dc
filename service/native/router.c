/* A mixture-of-experts router's logits, each row alone: y[r][e] = x[r] · w[e] in fp32, summed in one
 * fixed order that depends on nothing but the inputs' length — not on the rows of the call, their
 * position in it, the threads or the instruction set. Input i is added to partial sum i mod 16
 * (a product, then a sum: no fused multiply-add, built with -ffp-contract=off), in input order; the
 * 16 partial sums are then added by one fixed tree. A float GEMM (MKL) chooses its blocking by the
 * number of rows, so a token routed alone and in a prefill piece could differ in the last bits — and
 * a near tie between two experts turn into another choice of experts.
 *
 * GCC's 16-float vectors are one AVX-512 register or two AVX2 ones: the same lanes either way. */
#include "fixed.h" /* 16-float vectors (vf), load, and the fixed tree that adds a vector's lanes (total) */

#define ROWS 4 /* rows sharing each load of the router's weights */

/* `count` (1..ROWS) rows of x (row stride x_row floats) against expert e's weights (k floats). */
static void rows_against(const float *x, int64_t x_row, int count, const float *w, int k, float *y, int64_t y_row) {
    vf acc[ROWS];
    for (int r = 0; r < count; r++) acc[r] = (vf){0};
    int whole = k / LANES * LANES;
    for (int i = 0; i < whole; i += LANES) {
        vf wv = load(w + i);
        for (int r = 0; r < count; r++) acc[r] = acc[r] + load(x + r * x_row + i) * wv;
    }
    for (int r = 0; r < count; r++) {
        float p[LANES];
        memcpy(p, &acc[r], sizeof p);
        for (int i = whole; i < k; i++) p[i - whole] = p[i - whole] + x[r * x_row + i] * w[i]; /* lane i mod 16 */
        memcpy(&acc[r], p, sizeof p);
        y[r * y_row] = total(acc[r]);
    }
}

/* y (rows × experts, row stride `experts`) = x (rows × k, row stride x_row) · wᵀ (w: experts × k, contiguous). */
void router_logits(const float *x, int64_t x_row, const float *w, float *y, int rows, int experts, int k, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int e = 0; e < experts; e++)
        for (int r = 0; r < rows; r += ROWS)
            rows_against(x + (int64_t)r * x_row, x_row, rows - r < ROWS ? rows - r : ROWS, w + (int64_t)e * k, k,
                         y + (int64_t)r * experts + e, experts);
}
