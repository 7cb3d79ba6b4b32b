/* Tests of qattn: every query row of a batch (1..64 tokens, GQA heads) has the bits of the same
 * token computed alone, with fewer cells and any number of threads, on every path this CPU has;
 * the AVX2 path equals the scalar definition; and the result is within float rounding of
 * softmax attention computed in double. Exit status 0 when all pass.
 *
 *   cc -O2 -ffp-contract=off native/qmatmul/qmatmul.c native/qmatmul/qattn.c native/qmatmul/test_qattn.c -lm -o /tmp/test_qattn && /tmp/test_qattn
 */
#include "qattn.h"
#include "qmatmul.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test_util.h"

#define NEG_INF_HALF 0xfc00

/* A cache of n_kv cells (K and V of n_head_kv heads) and n_tok queries at positions pos0..:
 * token t sees cells 0..pos0+t except every 7th (another sequence's), later cells hold stale
 * values (NaN in V for some: they must never be read). */
typedef struct {
    int dk, dv, n_head, n_head_kv, n_kv, n_tok, pos0;
    float *q;          /* [tok][head][dk] */
    uint16_t *k, *v;   /* [head][cell][d] */
    uint16_t *mask;    /* [tok][n_kv] */
} case_t;

static case_t make_case(int dk, int dv, int n_head, int n_head_kv, int n_kv, int n_tok, int pos0) {
    case_t c = {.dk = dk, .dv = dv, .n_head = n_head, .n_head_kv = n_head_kv, .n_kv = n_kv, .n_tok = n_tok, .pos0 = pos0};
    c.q = malloc(sizeof(float) * n_tok * n_head * dk);
    c.k = malloc(2 * (size_t)n_head_kv * n_kv * dk);
    c.v = malloc(2 * (size_t)n_head_kv * n_kv * dv);
    c.mask = malloc(2 * (size_t)n_tok * n_kv);
    for (int i = 0; i < n_tok * n_head * dk; i++) c.q[i] = 2.f * frnd();
    for (int i = 0; i < n_head_kv * n_kv * dk; i++) c.k[i] = qmm_float_to_half(frnd());
    for (int i = 0; i < n_head_kv * n_kv * dv; i++) c.v[i] = qmm_float_to_half(frnd());
    for (int h = 0; h < n_head_kv; h++)
        for (int cell = pos0 + n_tok; cell < n_kv; cell += 5) c.v[((size_t)h * n_kv + cell) * dv] = 0x7e00;  /* NaN */
    for (int t = 0; t < n_tok; t++)
        for (int cell = 0; cell < n_kv; cell++)
            c.mask[(size_t)t * n_kv + cell] = cell <= pos0 + t && cell % 7 != 3 ? 0 : NEG_INF_HALF;
    return c;
}

static void free_case(case_t *c) { free(c->q); free(c->k); free(c->v); free(c->mask); }

/* Tokens t0..t0+n of the case over its first n_kv cells, out[tok][head][dv]. */
static int run(const case_t *c, int path, int t0, int n, int n_kv, int nth, float *out) {
    qattn_problem p = {
        .dk = c->dk, .dv = c->dv, .n_tokens = n, .n_head = c->n_head, .n_head_kv = c->n_head_kv,
        .n_kv = n_kv, .scale = 1.0f / sqrtf((float)c->dk),
        .q = c->q + (size_t)t0 * c->n_head * c->dk, .q_token = sizeof(float) * c->n_head * c->dk,
        .q_head = sizeof(float) * c->dk,
        .k = c->k, .k_cell = 2 * (size_t)c->dk, .k_head = 2 * (size_t)c->n_kv * c->dk,
        .v = c->v, .v_cell = 2 * (size_t)c->dv, .v_head = 2 * (size_t)c->n_kv * c->dv,
        .mask = c->mask + (size_t)t0 * c->n_kv, .mask_token = 2 * (size_t)c->n_kv,
        .out = out, .out_token = sizeof(float) * c->n_head * c->dv, .out_head = sizeof(float) * c->dv,
    };
    for (int ith = 0; ith < nth; ith++) {
        const int rc = qattn_f16(path, &p, ith, nth);
        if (rc) return rc;
    }
    return 0;
}

/* Softmax attention in double for token t, head h; the largest |out| error allowed: a few float
 * roundings of the output's magnitude. */
static void exact(const case_t *c, int t, int h, double *out) {
    const int g = h / (c->n_head / c->n_head_kv);
    const float *q = c->q + ((size_t)t * c->n_head + h) * c->dk;
    double m = -INFINITY, sum = 0;
    double *s = malloc(sizeof(double) * c->n_kv);
    for (int cell = 0; cell < c->n_kv; cell++) {
        s[cell] = -INFINITY;
        if (c->mask[(size_t)t * c->n_kv + cell] == NEG_INF_HALF) continue;
        double d = 0;
        for (int i = 0; i < c->dk; i++) d += (double)q[i] * qmm_half_to_float(c->k[((size_t)g * c->n_kv + cell) * c->dk + i]);
        s[cell] = d / sqrt((double)c->dk);
        m = s[cell] > m ? s[cell] : m;
    }
    for (int i = 0; i < c->dv; i++) out[i] = 0;
    for (int cell = 0; cell < c->n_kv; cell++) {
        if (s[cell] == -INFINITY) continue;
        const double p = exp(s[cell] - m);
        sum += p;
        for (int i = 0; i < c->dv; i++) out[i] += p * qmm_half_to_float(c->v[((size_t)g * c->n_kv + cell) * c->dv + i]);
    }
    for (int i = 0; i < c->dv; i++) out[i] /= sum;
    free(s);
}

static void test_case(int dk, int dv, int n_head, int n_head_kv, int n_kv, int n_tok, int pos0) {
    case_t c = make_case(dk, dv, n_head, n_head_kv, n_kv, n_tok, pos0);
    const size_t row = (size_t)n_head * dv;
    float *alone = malloc(sizeof(float) * n_tok * row), *batch = malloc(sizeof(float) * n_tok * row);
    /* the oracle: each token alone on the scalar path, one thread, only the cells up to its own
     * rounded up to 256 (as llama.cpp's cache view of a one-token decode) */
    for (int t = 0; t < n_tok; t++) {
        int n = (pos0 + t + 1 + 255) / 256 * 256;
        n = n < n_kv ? n : n_kv;
        CHECK(run(&c, QATTN_SCALAR, t, 1, n, 1, alone + t * row) == 0, "scalar run");
    }
    double worst = 0;
    double *ex = malloc(sizeof(double) * dv);
    for (int t = 0; t < n_tok; t += 7)
        for (int h = 0; h < n_head; h += 3) {
            exact(&c, t, h, ex);
            for (int i = 0; i < dv; i++) {
                const double err = fabs(alone[t * row + h * dv + i] - ex[i]);
                worst = err > worst ? err : worst;
            }
        }
    CHECK(worst < 2e-5, "dk %d: %g from exact attention", dk, worst);
    const int paths[] = {QATTN_SCALAR, QATTN_AVX2}, nths[] = {1, 3, 16};
    for (int pi = 0; pi < 2; pi++) {
        if (paths[pi] == QATTN_AVX2 && qattn_best_path() != QATTN_AVX2) continue;
        for (int ni = 0; ni < 3; ni++)
            for (int n = 1; n <= n_tok; n = n < 9 ? n + 1 : n * 2 + 1) {
                if (paths[pi] == QATTN_SCALAR && (ni > 0 || (n != 2 && n != 19))) continue;  /* slow; AVX2 equals it */
                for (int t0 = (n + ni) % 3; t0 + n <= n_tok; t0 += n > 4 ? n : 5) {
                    memset(batch, 0xff, sizeof(float) * n * row);
                    CHECK(run(&c, paths[pi], t0, n, n_kv, nths[ni], batch) == 0, "run");
                    CHECK(memcmp(batch, alone + t0 * row, sizeof(float) * n * row) == 0,
                          "path %d, %d threads: rows %d..%d differ from one-token decodes (dk %d)",
                          paths[pi], nths[ni], t0, t0 + n - 1, dk);
                }
            }
    }
    printf("dk %d dv %d heads %d/%d cells %d tokens %d at %d: %g from exact\n", dk, dv, n_head, n_head_kv,
           n_kv, n_tok, pos0, worst);
    free(ex); free(alone); free(batch); free_case(&c);
}

int main(void) {
    printf("best path on this CPU: %s\n", qattn_best_path() == QATTN_AVX2 ? "avx2" : "scalar");
    test_case(128, 128, 12, 2, 768, 64, 600);   /* Qwen2.5 1.5B's heads */
    test_case(64, 64, 9, 3, 300, 40, 200);      /* SmolLM2's */
    test_case(256, 256, 4, 1, 97, 20, 0);       /* Gemma 3's head size, a cache under one block */
    test_case(72, 40, 6, 6, 130, 17, 100);      /* no GQA; head sizes not a multiple of 32 */
    /* a NaN in a visible key cell stays visible on every path, as in llama.cpp's kernel */
    case_t nan_case = make_case(8, 8, 1, 1, 40, 1, 30);
    nan_case.k[5 * 8 + 2] = 0x7e00;
    for (int path = QATTN_SCALAR; path <= qattn_best_path(); path++) {
        float out[8];
        CHECK(run(&nan_case, path, 0, 1, 40, 1, out) == 0 && isnan(out[0]), "path %d: NaN score hidden", path);
    }
    free_case(&nan_case);
    qattn_problem bad = {.dk = 100, .dv = 128, .n_tokens = 1, .n_head = 1, .n_head_kv = 1};
    CHECK(qattn_f16(QATTN_AUTO, &bad, 0, 1) == -1, "dk %% 8 refused");
    bad.dk = 512;
    CHECK(qattn_f16(QATTN_AUTO, &bad, 0, 1) == -1, "dk > max refused");
    printf(failures ? "FAILED: %d\n" : "all passed\n", failures);
    return failures != 0;
}
