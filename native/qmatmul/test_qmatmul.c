/* Tests of qmatmul: every row of every batch (n = 1..64, the row at every position) has the bits
 * of the scalar reference's one-row result, on every path this CPU has; the reference is within
 * float rounding of the exact dot of the dequantized blocks; splitting the output rows changes
 * nothing.  Exit status 0 when all pass.
 *
 *   cc -O2 -ffp-contract=off native/qmatmul/qmatmul.c native/qmatmul/test_qmatmul.c -lm -o /tmp/test_qmatmul && /tmp/test_qmatmul
 */
#include "qmatmul.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test_util.h"

static void fill_q4(qmm_block_q4_K *w, size_t nblocks) {
    for (size_t i = 0; i < nblocks; i++) {
        for (int j = 0; j < 12; j++) w[i].scales[j] = (uint8_t)rnd();
        for (int j = 0; j < 128; j++) w[i].qs[j] = (uint8_t)rnd();
        w[i].d = qmm_float_to_half(ldexpf(0.5f + 0.5f * fabsf(frnd()), -10 - (int)(rnd() % 4)));
        w[i].dmin = qmm_float_to_half(ldexpf(0.5f + 0.5f * fabsf(frnd()), -11 - (int)(rnd() % 4)));
    }
    w[0].d = 1;  /* a subnormal fp16 scale */
}

static void fill_q6(qmm_block_q6_K *w, size_t nblocks) {
    for (size_t i = 0; i < nblocks; i++) {
        for (int j = 0; j < 128; j++) w[i].ql[j] = (uint8_t)rnd();
        for (int j = 0; j < 64; j++) w[i].qh[j] = (uint8_t)rnd();
        for (int j = 0; j < 16; j++) w[i].scales[j] = (int8_t)(rnd() % 255 - 127);
        w[i].d = qmm_float_to_half(ldexpf(0.5f + 0.5f * fabsf(frnd()), -12 - (int)(rnd() % 4)));
    }
}

static void fill_x(qmm_block_q8_K *x, int rows, int K) {
    float *f = malloc(sizeof(float) * K);
    for (int r = 0; r < rows; r++) {
        float s = ldexpf(1.f, (int)(rnd() % 8) - 4);
        for (int i = 0; i < K; i++) f[i] = s * frnd() * (rnd() % 16 == 0 ? 8.f : 1.f);
        if (r == 1) memset(f, 0, sizeof(float) * QMM_QK);  /* an all-zero block */
        qmm_quantize_q8_K(QMM_AUTO, f, x + (size_t)r * (K / QMM_QK), K);
    }
    free(f);
}

/* The exact dot (in double) of dequantized weight row o and activation row r, and the sum of
 * |w||x| that bounds its float rounding. */
static void exact_q4(const qmm_block_q4_K *W, const qmm_block_q8_K *X, int K, double *dot, double *mag) {
    *dot = *mag = 0;
    for (int b = 0; b < K / QMM_QK; b++) {
        const uint8_t *s = W[b].scales;
        double d = qmm_half_to_float(W[b].d), dm = qmm_half_to_float(W[b].dmin);
        for (int e = 0; e < 256; e++) {
            int j = e / 32, g = e / 64, hi = (e / 32) % 2;
            int sc = j < 4 ? s[j] & 63 : (s[j + 4] & 0xf) | ((s[j - 4] >> 6) << 4);
            int m = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
            int q = hi ? W[b].qs[32 * g + e % 32] >> 4 : W[b].qs[32 * g + e % 32] & 0xf;
            double w = d * sc * q - dm * m, x = (double)X[b].d * X[b].qs[e];
            *dot += w * x;
            *mag += fabs(w * x);
        }
    }
}

static void exact_q6(const qmm_block_q6_K *W, const qmm_block_q8_K *X, int K, double *dot, double *mag) {
    *dot = *mag = 0;
    for (int b = 0; b < K / QMM_QK; b++) {
        double d = qmm_half_to_float(W[b].d);
        for (int e = 0; e < 256; e++) {
            int h = e / 128, k = e % 128, l = k % 32, part = k / 32;
            int lo = part % 2 ? W[b].ql[64 * h + 32 + l] : W[b].ql[64 * h + l];
            lo = part < 2 ? lo & 0xf : lo >> 4;
            int q = lo | (((W[b].qh[32 * h + l] >> (2 * part)) & 3) << 4);
            double w = d * W[b].scales[e / 16] * (q - 32), x = (double)X[b].d * X[b].qs[e];
            *dot += w * x;
            *mag += fabs(w * x);
        }
    }
}

typedef int (*mm_fn)(int, int, int, int, int, const void *, const qmm_block_q8_K *, float *, size_t);

static int run_q4(int path, int K, int o0, int o1, int n, const void *W, const qmm_block_q8_K *X, float *Y, size_t ldy) {
    return qmm_q4_K(path, K, o0, o1, n, W, X, Y, ldy);
}
static int run_q6(int path, int K, int o0, int o1, int n, const void *W, const qmm_block_q8_K *X, float *Y, size_t ldy) {
    return qmm_q6_K(path, K, o0, o1, n, W, X, Y, ldy);
}

static void test_type(const char *name, mm_fn mm, const void *W, size_t wrow, int K, int M,
                      const qmm_block_q8_K *pool, int exact_is_q4) {
    const int nb = K / QMM_QK, P = QMM_MAX_ROWS;
    float *ref = malloc(sizeof(float) * P * M), *Y = malloc(sizeof(float) * P * M);
    qmm_block_q8_K *batch = malloc(sizeof(qmm_block_q8_K) * P * nb);
    /* The oracle: each pool row alone, scalar. */
    for (int r = 0; r < P; r++)
        CHECK(mm(QMM_SCALAR, K, 0, M, 1, W, pool + (size_t)r * nb, ref + (size_t)r * M, M) == 0, "scalar");
    /* Against the exact dot of the dequantized values. */
    double worst = 0;
    for (int r = 0; r < P; r++)
        for (int o = 0; o < M; o++) {
            double dot, mag;
            const char *w = (const char *)W + wrow * o;
            if (exact_is_q4) exact_q4((const qmm_block_q4_K *)w, pool + (size_t)r * nb, K, &dot, &mag);
            else exact_q6((const qmm_block_q6_K *)w, pool + (size_t)r * nb, K, &dot, &mag);
            double err = fabs(ref[(size_t)r * M + o] - dot) / (mag > 0 ? mag : 1);
            if (err > worst) worst = err;
            CHECK(err <= 4e-6, "%s K=%d row %d out %d: %.9g vs exact %.9g", name, K, r, o, ref[(size_t)r * M + o], dot);
        }
    printf("%s K=%d M=%d: scalar reference within %.2g of the exact dot (relative to sum |w x|)\n", name, K, M, worst);
    for (int path = QMM_AUTO; path <= QMM_AVX512; path++) {  /* auto: a path by n, the same bits */
        if (mm(path, K, 0, 1, 1, W, pool, Y, M) != 0) { printf("  %s: not on this CPU\n", qmm_path_name(path)); continue; }
        long rows = 0, diff = 0;
        for (int n = 1; n <= P; n++) {
            if (path == QMM_SCALAR && n > 8 && n != P) continue;  /* the slow oracle: a few n */
            for (int shift = 0; shift < (path == QMM_SCALAR ? 1 : 3); shift++) {
                int src[QMM_MAX_ROWS];
                for (int k = 0; k < n; k++) src[k] = (k * 7 + shift * 13 + n) % P;  /* rows at varied positions */
                for (int k = 0; k < n; k++) memcpy(batch + (size_t)k * nb, pool + (size_t)src[k] * nb, sizeof(qmm_block_q8_K) * nb);
                /* Output rows in two calls split at an odd place: the split changes nothing. */
                int cut = M / 3;
                CHECK(mm(path, K, 0, cut, n, W, batch, Y, M) == 0 && mm(path, K, cut, M, n, W, batch, Y, M) == 0, "call");
                for (int k = 0; k < n; k++, rows++)
                    if (memcmp(Y + (size_t)k * M, ref + (size_t)src[k] * M, sizeof(float) * M)) {
                        diff++;
                        CHECK(0, "%s %s K=%d n=%d position %d (pool row %d): bits differ from the one-row reference",
                              name, qmm_path_name(path), K, n, k, src[k]);
                    }
            }
        }
        printf("  %s: %ld batch rows (n = 1..64, varied positions), %ld differ in any bit\n", qmm_path_name(path), rows, diff);
    }
    free(ref); free(Y); free(batch);
}

/* The activations' quantizer: every path gives the scalar path's bits, on blocks whose largest
 * magnitude is positive, negative, tied between signs (the first wins), zero, or beside a NaN. */
static void test_quantize(void) {
    enum { K = 64 * QMM_QK };
    float *f = malloc(sizeof(float) * K);
    qmm_block_q8_K *ref = malloc(sizeof(qmm_block_q8_K) * K / QMM_QK), *y = malloc(sizeof(qmm_block_q8_K) * K / QMM_QK);
    for (int i = 0; i < K; i++) f[i] = ldexpf(frnd(), (int)(rnd() % 16) - 8);
    for (int b = 0; b < K / QMM_QK; b++) {
        float *x = f + (size_t)b * QMM_QK;
        if (b % 4 == 1) { x[7] = 999.f; x[200] = -999.f; }  /* tie: + first */
        if (b % 4 == 2) { x[3] = -999.f; x[100] = 999.f; }  /* tie: - first */
        if (b % 8 == 3) memset(x, 0, sizeof(float) * QMM_QK);
        if (b % 8 == 7) x[5] = NAN;
    }
    CHECK(qmm_quantize_q8_K(QMM_SCALAR, f, ref, K) == 0, "scalar quantize");
    CHECK(ref[1].d < 0 && ref[1].qs[7] == -127 && ref[1].qs[200] == 127 && ref[2].d > 0 && ref[2].qs[3] == -127 &&
          ref[2].qs[100] == 127, "the first of tied maxima takes -127");
    for (int path = QMM_AVX2; path <= QMM_AVX512; path++) {
        if (qmm_quantize_q8_K(path, f, y, K) != 0) { printf("  quantize %s: not on this CPU\n", qmm_path_name(path)); continue; }
        int diff = 0;
        for (int b = 0; b < K / QMM_QK; b++) diff += memcmp(&y[b], &ref[b], sizeof y[b]) != 0;
        CHECK(diff == 0, "quantize %s: %d blocks differ from the scalar path", qmm_path_name(path), diff);
        printf("  quantize %s: %d blocks, %d differ from the scalar path in any bit\n", qmm_path_name(path), K / QMM_QK, diff);
    }
    free(f); free(ref); free(y);
}

int main(void) {
    printf("best path on this CPU: %s\n", qmm_path_name(qmm_best_path()));
    test_quantize();
    const int Ks[] = {256, 1536, 2304};
    for (int t = 0; t < 3; t++) {
        int K = Ks[t], M = 19, nb = K / QMM_QK;
        qmm_block_q8_K *pool = malloc(sizeof(qmm_block_q8_K) * QMM_MAX_ROWS * nb);
        fill_x(pool, QMM_MAX_ROWS, K);
        qmm_block_q4_K *w4 = malloc(sizeof(qmm_block_q4_K) * M * nb);
        fill_q4(w4, (size_t)M * nb);
        test_type("Q4_K", run_q4, w4, sizeof(qmm_block_q4_K) * nb, K, M, pool, 1);
        qmm_block_q6_K *w6 = malloc(sizeof(qmm_block_q6_K) * M * nb);
        fill_q6(w6, (size_t)M * nb);
        test_type("Q6_K", run_q6, w6, sizeof(qmm_block_q6_K) * nb, K, M, pool, 0);
        free(pool); free(w4); free(w6);
    }
    float y;
    qmm_block_q8_K x[1];
    qmm_block_q4_K w[1];
    CHECK(qmm_q4_K(QMM_AUTO, 256, 0, 1, 65, w, x, &y, 1) == -1, "n=65 refused");
    CHECK(qmm_q4_K(QMM_AUTO, 100, 0, 1, 1, w, x, &y, 1) == -1, "K%%256 refused");
    printf(failures ? "FAILED: %d\n" : "all passed\n", failures);
    return failures != 0;
}
