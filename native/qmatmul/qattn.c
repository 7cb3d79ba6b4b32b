/* Batch-invariant flash attention over an f16 cache; see qattn.h.
 *
 * One query row's sequence of operations, the same on every path and whatever else is computed
 * beside it. Cells go in blocks of QATTN_CELLS at fixed offsets from cell 0; a block in which the
 * row's mask hides every cell is skipped. In a block:
 *   s_c = fma(dot(q, k_c), scale, mask_c)   dot: 8 lanes, lane l sums elements 8i+l in order
 *                                            with fma, then ((a0+a4)+(a2+a6))+((a1+a5)+(a3+a7))
 *   M'  = max(M, max over visible s_c);  when M' > M: acc *= e(M - M'), S *= e(M - M')
 *   p_c = e(s_c - M');  S += p_c in cell order;  acc[d] = fma(p_c, v_c[d], acc[d]) in cell order
 * and finally out = acc * (1/S). e() is one polynomial exp, lane by lane. Hidden cells are never
 * read into a row's sums, so cells past a row (later tokens of its batch, or stale cells of a
 * one-token decode) cannot change it. The scalar path is that definition written out, the tests'
 * oracle; the AVX2 path equals it bit for bit.
 *
 * Build the tests with -ffp-contract=off: a compiler-fused multiply-add would change the scalar
 * bits. ggml builds as gnu11, where GCC fuses by default; only the AVX2 path runs there (the
 * patch keeps llama.cpp's kernel on CPUs without it), and no multiply in it feeds an add. */
#include "qattn.h"
#include "qmatmul.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define QATTN_X86 1
#endif

#define C QATTN_CELLS

/* ---------------------------------------------------------------- the definition (scalar) */

/* Cephes' expf: x clamped, 2^n times a degree-7 polynomial of the remainder. */
#define EXP_HI 88.3762626647949f
#define EXP_LO -87.3365478515625f
#define LOG2E 1.44269504088896341f
#define LN2_HI 0.693359375f
#define LN2_LO -2.12194440e-4f
static const float EXP_P[6] = {1.9875691500E-4f, 1.3981999507E-3f, 8.3334519073E-3f,
                               4.1665795894E-2f, 1.6666665459E-1f, 5.0000001201E-1f};

static float exp_ref(float x) {
    if (x != x) return x;  /* NaN: a broken score stays visible, as in the AVX2 path */
    x = x < EXP_LO ? EXP_LO : (x > EXP_HI ? EXP_HI : x);
    const float n = nearbyintf(x * LOG2E);
    float r = fmaf(n, -LN2_HI, x);
    r = fmaf(n, -LN2_LO, r);
    float p = EXP_P[0];
    for (int i = 1; i < 6; i++) p = fmaf(p, r, EXP_P[i]);
    const float r2 = r * r;
    float y = fmaf(p, r2, r);
    y = y + 1.0f;
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, 4);
    return y * two_n;
}

static float hsum8_ref(const float a[8]) {
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

static float dot_ref(const float *q, const float *k, int d) {
    float a[8];
    for (int l = 0; l < 8; l++) a[l] = q[l] * k[l];
    for (int i = 8; i < d; i += 8)
        for (int l = 0; l < 8; l++) a[l] = fmaf(q[i + l], k[i + l], a[l]);
    return hsum8_ref(a);
}

/* One path's steps of the definition; vis: bit c set for each visible cell c of a block. */
typedef struct {
    void (*convert)(const uint16_t *src, size_t stride, int n, int d, float *dst);
    void (*dots)(const float *q, const float *kb, int dk, float *s);          /* all C cells */
    void (*exps)(const float *s, float m, float *p);                           /* all C cells */
    void (*accumulate)(float *acc, const float *p, uint32_t vis, const float *vb, int dv);
    void (*rescale)(float *acc, float f, int dv);
} kernels;

static void convert_ref(const uint16_t *src, size_t stride, int n, int d, float *dst) {
    for (int c = 0; c < n; c++) {
        const uint16_t *row = (const uint16_t *)((const char *)src + c * stride);
        for (int i = 0; i < d; i++) dst[c * d + i] = qmm_half_to_float(row[i]);
    }
}

static void dots_ref(const float *q, const float *kb, int dk, float *s) {
    for (int c = 0; c < C; c++) s[c] = dot_ref(q, kb + c * dk, dk);
}

static void exps_ref(const float *s, float m, float *p) {
    for (int c = 0; c < C; c++) p[c] = exp_ref(s[c] - m);
}

static void accumulate_ref(float *acc, const float *p, uint32_t vis, const float *vb, int dv) {
    for (int d = 0; d < dv; d++) {
        float a = acc[d];
        for (uint32_t m = vis; m; m &= m - 1) {
            const int c = __builtin_ctz(m);
            a = fmaf(p[c], vb[c * dv + d], a);
        }
        acc[d] = a;
    }
}

static void rescale_ref(float *acc, float f, int dv) {
    for (int d = 0; d < dv; d++) acc[d] = acc[d] * f;
}

static const kernels REF = {convert_ref, dots_ref, exps_ref, accumulate_ref, rescale_ref};

/* ---------------------------------------------------------------- AVX2 */
#ifdef QATTN_X86
#define AVX2_T __attribute__((target("avx2,fma,f16c")))

AVX2_T static void convert_avx2(const uint16_t *src, size_t stride, int n, int d, float *dst) {
    for (int c = 0; c < n; c++) {
        const uint16_t *row = (const uint16_t *)((const char *)src + c * stride);
        for (int i = 0; i < d; i += 8)
            _mm256_storeu_ps(dst + c * d + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + i))));
    }
}

AVX2_T static inline float hsum8_avx2(__m256 a) {
    __m128 v4 = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    __m128 v2 = _mm_add_ps(v4, _mm_movehl_ps(v4, v4));
    return _mm_cvtss_f32(_mm_add_ss(v2, _mm_movehdup_ps(v2)));
}

/* Eight cells a pass: q's chunk is loaded once for all eight. */
AVX2_T static void dots_avx2(const float *q, const float *kb, int dk, float *s) {
    for (int c0 = 0; c0 < C; c0 += 8) {
        const float *k = kb + c0 * dk;
        __m256 qv = _mm256_loadu_ps(q), a[8];
        for (int j = 0; j < 8; j++) a[j] = _mm256_mul_ps(qv, _mm256_loadu_ps(k + j * dk));
        for (int i = 8; i < dk; i += 8) {
            qv = _mm256_loadu_ps(q + i);
            for (int j = 0; j < 8; j++) a[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + j * dk + i), a[j]);
        }
        for (int j = 0; j < 8; j++) s[c0 + j] = hsum8_avx2(a[j]);
    }
}

AVX2_T static void exps_avx2(const float *s, float m, float *p) {
    const __m256 mv = _mm256_set1_ps(m);
    for (int c = 0; c < C; c += 8) {
        __m256 x = _mm256_sub_ps(_mm256_loadu_ps(s + c), mv);
        /* operands in this order: min/max return the second one when unordered, so NaN stays NaN */
        x = _mm256_min_ps(_mm256_set1_ps(EXP_HI), _mm256_max_ps(_mm256_set1_ps(EXP_LO), x));
        const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_HI), x);
        r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_LO), r);
        __m256 y = _mm256_set1_ps(EXP_P[0]);
        for (int i = 1; i < 6; i++) y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(EXP_P[i]));
        y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), r);
        y = _mm256_add_ps(y, _mm256_set1_ps(1.0f));
        const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
        _mm256_storeu_ps(p + c, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
    }
}

/* 32 dimensions a pass kept in registers across the block's visible cells. */
AVX2_T static void accumulate_avx2(float *acc, const float *p, uint32_t vis, const float *vb, int dv) {
    int d = 0;
    for (; d + 32 <= dv; d += 32) {
        __m256 a0 = _mm256_loadu_ps(acc + d), a1 = _mm256_loadu_ps(acc + d + 8);
        __m256 a2 = _mm256_loadu_ps(acc + d + 16), a3 = _mm256_loadu_ps(acc + d + 24);
        for (uint32_t m = vis; m; m &= m - 1) {
            const int c = __builtin_ctz(m);
            const __m256 pc = _mm256_broadcast_ss(p + c);
            const float *v = vb + c * dv + d;
            a0 = _mm256_fmadd_ps(pc, _mm256_loadu_ps(v), a0);
            a1 = _mm256_fmadd_ps(pc, _mm256_loadu_ps(v + 8), a1);
            a2 = _mm256_fmadd_ps(pc, _mm256_loadu_ps(v + 16), a2);
            a3 = _mm256_fmadd_ps(pc, _mm256_loadu_ps(v + 24), a3);
        }
        _mm256_storeu_ps(acc + d, a0); _mm256_storeu_ps(acc + d + 8, a1);
        _mm256_storeu_ps(acc + d + 16, a2); _mm256_storeu_ps(acc + d + 24, a3);
    }
    for (; d < dv; d += 8) {
        __m256 a = _mm256_loadu_ps(acc + d);
        for (uint32_t m = vis; m; m &= m - 1) {
            const int c = __builtin_ctz(m);
            a = _mm256_fmadd_ps(_mm256_broadcast_ss(p + c), _mm256_loadu_ps(vb + c * dv + d), a);
        }
        _mm256_storeu_ps(acc + d, a);
    }
}

AVX2_T static void rescale_avx2(float *acc, float f, int dv) {
    const __m256 fv = _mm256_set1_ps(f);
    for (int d = 0; d < dv; d += 8) _mm256_storeu_ps(acc + d, _mm256_mul_ps(_mm256_loadu_ps(acc + d), fv));
}

static const kernels AVX2 = {convert_avx2, dots_avx2, exps_avx2, accumulate_avx2, rescale_avx2};
#endif

/* ---------------------------------------------------------------- rows */

typedef struct {
    float *kb, *vb, *acc;   /* C x dk, C x dv, QATTN_MAX_ROWS x dv */
    float m[QATTN_MAX_ROWS], sum[QATTN_MAX_ROWS];
} scratch;

/* Bit c: cell c0 + c exists and the token's mask does not hide it. */
static uint32_t visible(const qattn_problem *p, int t, int c0) {
    const int n = p->n_kv - c0 < C ? p->n_kv - c0 : C;
    uint32_t vis = n == 32 ? 0xffffffffu : (1u << n) - 1;
    if (p->mask) {
        const uint16_t *mrow = (const uint16_t *)((const char *)p->mask + t * p->mask_token) + c0;
        for (int c = 0; c < n; c++)
            if (mrow[c] == 0xfc00) vis &= ~(1u << c);  /* binary16 -inf */
    }
    return vis;
}

/* One block of one row: the definition's steps, in its order. */
static void row_block(const kernels *K, const qattn_problem *p, scratch *w, int r, const float *q,
                      const uint16_t *mrow, uint32_t vis) {
    float s[C], e[C];
    K->dots(q, w->kb, p->dk, s);
    float m = -INFINITY;
    for (uint32_t b = vis; b; b &= b - 1) {
        const int c = __builtin_ctz(b);
        s[c] = fmaf(s[c], p->scale, mrow ? qmm_half_to_float(mrow[c]) : 0.0f);
        m = s[c] > m ? s[c] : m;
    }
    float *acc = w->acc + r * p->dv;
    if (m > w->m[r]) {
        if (w->m[r] != -INFINITY) {
            const float f = exp_ref(w->m[r] - m);
            K->rescale(acc, f, p->dv);
            w->sum[r] = w->sum[r] * f;
        }
        w->m[r] = m;
    }
    for (int c = 0; c < C; c++)
        if (!(vis >> c & 1)) s[c] = w->m[r];  /* finite lanes for the vector exp; never used */
    K->exps(s, w->m[r], e);
    for (uint32_t b = vis; b; b &= b - 1) w->sum[r] = w->sum[r] + e[__builtin_ctz(b)];
    K->accumulate(acc, e, vis, w->vb, p->dv);
}

/* Rows (tokens t0..t1) x (heads h0..h1, all of KV head g): every block, then the outputs. */
static void unit(const kernels *K, const qattn_problem *p, scratch *w, int g, int h0, int h1, int t0, int t1) {
    const int nh = h1 - h0;
    for (int r = 0; r < (t1 - t0) * nh; r++) {
        w->m[r] = -INFINITY;
        w->sum[r] = 0.0f;
        memset(w->acc + r * p->dv, 0, sizeof(float) * p->dv);
    }
    const uint16_t *k = (const uint16_t *)((const char *)p->k + g * p->k_head);
    const uint16_t *v = (const uint16_t *)((const char *)p->v + g * p->v_head);
    for (int c0 = 0; c0 < p->n_kv; c0 += C) {
        uint32_t vis[QATTN_MAX_ROWS], any = 0;
        for (int t = t0; t < t1; t++) any |= vis[t - t0] = visible(p, t, c0);
        if (!any) continue;
        const int n = p->n_kv - c0 < C ? p->n_kv - c0 : C;
        K->convert((const uint16_t *)((const char *)k + c0 * p->k_cell), p->k_cell, n, p->dk, w->kb);
        K->convert((const uint16_t *)((const char *)v + c0 * p->v_cell), p->v_cell, n, p->dv, w->vb);
        memset(w->kb + n * p->dk, 0, sizeof(float) * (C - n) * p->dk);
        for (int t = t0; t < t1; t++) {
            if (!vis[t - t0]) continue;
            const uint16_t *mrow = p->mask ? (const uint16_t *)((const char *)p->mask + t * p->mask_token) + c0 : NULL;
            for (int h = h0; h < h1; h++) {
                const float *q = (const float *)((const char *)p->q + t * p->q_token + h * p->q_head);
                row_block(K, p, w, (t - t0) * nh + h - h0, q, mrow, vis[t - t0]);
            }
        }
    }
    for (int t = t0; t < t1; t++)
        for (int h = h0; h < h1; h++) {
            const int r = (t - t0) * nh + h - h0;
            const float inv = w->sum[r] == 0.0f ? 0.0f : 1.0f / w->sum[r];
            float *out = (float *)((char *)p->out + t * p->out_token + h * p->out_head);
            for (int d = 0; d < p->dv; d++) out[d] = w->acc[r * p->dv + d] * inv;
        }
}

/* ---------------------------------------------------------------- work split and dispatch */

/* Units: KV head x head group x token block; groups shrink until every thread has one. */
static void grid(const qattn_problem *p, int nth, int *hb, int *tb, int *units) {
    const int rk = p->n_head / p->n_head_kv;
    int h = rk < QATTN_MAX_ROWS ? rk : QATTN_MAX_ROWS;
    for (;;) {
        const int t = QATTN_MAX_ROWS / h < p->n_tokens ? QATTN_MAX_ROWS / h : p->n_tokens;
        const int u = p->n_head_kv * ((rk + h - 1) / h) * ((p->n_tokens + t - 1) / t);
        if (u >= nth || h == 1) { *hb = h; *tb = t; *units = u; return; }
        h = (h + 1) / 2;
    }
}

/* AVX2 needs what qmatmul's SIMD paths need (AVX2, FMA, F16C): its dispatch answers for both. */
static int have(int path) {
    return path == QATTN_SCALAR || (path == QATTN_AVX2 && qmm_best_path() != QMM_SCALAR);
}

int qattn_best_path(void) {
    return have(QATTN_AVX2) ? QATTN_AVX2 : QATTN_SCALAR;
}

int qattn_f16(int path, const qattn_problem *p, int ith, int nth) {
    if (path == QATTN_AUTO) path = qattn_best_path();
    if (!have(path) || p->dk <= 0 || p->dv <= 0 || p->dk % 8 || p->dv % 8 || p->dk > QATTN_MAX_D ||
        p->dv > QATTN_MAX_D || p->n_head_kv <= 0 || p->n_head % p->n_head_kv || p->n_tokens <= 0 ||
        p->n_kv < 0 || nth <= 0 || ith < 0 || ith >= nth) {
        return -1;
    }
    const kernels *K = &REF;
#ifdef QATTN_X86
    if (path == QATTN_AVX2) K = &AVX2;
#endif
    int hb, tb, units;
    grid(p, nth, &hb, &tb, &units);
    if (ith >= units) return 0;
    scratch w;
    const size_t bytes = sizeof(float) * ((size_t)C * p->dk + (size_t)C * p->dv + (size_t)QATTN_MAX_ROWS * p->dv);
    w.kb = aligned_alloc(32, (bytes + 31) / 32 * 32);
    if (!w.kb) return -2;
    w.vb = w.kb + C * p->dk;
    w.acc = w.vb + C * p->dv;
    const int rk = p->n_head / p->n_head_kv, groups = (rk + hb - 1) / hb, blocks = (p->n_tokens + tb - 1) / tb;
    for (int u = ith; u < units; u += nth) {
        const int g = u / (groups * blocks), hg = u / blocks % groups, tk = u % blocks;
        const int h0 = g * rk + hg * hb, h1 = h0 + hb < (g + 1) * rk ? h0 + hb : (g + 1) * rk;
        const int t0 = tk * tb, t1 = t0 + tb < p->n_tokens ? t0 + tb : p->n_tokens;
        unit(K, p, &w, g, h0, h1, t0, t1);
    }
    free(w.kb);
    return 0;
}
