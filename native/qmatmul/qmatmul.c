/* Small-batch Q4_K / Q6_K x Q8_K matmul; see qmatmul.h.
 *
 * Order of summation, the same on every path and for every n: within a 256-weight block the
 * products are summed as integers into 8 lanes (lane l takes bytes 4l..4l+3 of every 32-byte
 * chunk, times that chunk's scale) - integer sums are exact, so the lanes' values do not depend
 * on how the SIMD code groups them. Each lane then takes acc_l = fma(d_w*d_x, lane, acc_l) block
 * after block (Q4_K then acc_l = fma(-(dmin_w*min_l), d_x*(bsums[2l]+bsums[2l+1]), acc_l)), and
 * the row's result is ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7)). The scalar path is that definition written out; it is
 * the tests' oracle, and the SIMD paths equal it bit for bit.
 *
 * Build with -ffp-contract=off: a compiler-fused multiply-add would change the scalar bits. */
#include "qmatmul.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define QMM_X86 1
#endif

float qmm_half_to_float(qmm_half h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else {  /* subnormal: normalise */
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) { man <<= 1; exp--; }
            bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

qmm_half qmm_float_to_half(float f) {  /* round to nearest even; finite inputs of test data */
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000;
    int32_t exp = (int32_t)((x >> 23) & 0xff) - 127 + 15;
    uint32_t man = x & 0x7fffff;
    if (exp >= 31) return (qmm_half)(sign | 0x7c00);
    if (exp <= 0) {
        if (exp < -10) return (qmm_half)sign;
        man |= 0x800000;
        uint32_t shift = (uint32_t)(14 - exp), half = 1u << (shift - 1);
        uint32_t r = man >> shift, rem = man & ((1u << shift) - 1);
        if (rem > half || (rem == half && (r & 1))) r++;
        return (qmm_half)(sign | r);
    }
    uint32_t r = ((uint32_t)exp << 10) | (man >> 13), rem = man & 0x1fff;
    if (rem > 0x1000 || (rem == 0x1000 && (r & 1))) r++;
    return (qmm_half)(sign | r);
}

void qmm_quantize_q8_K(const float *x, qmm_block_q8_K *y, int K) {
    for (int b = 0; b < K / QMM_QK; b++, x += QMM_QK) {
        float amax = 0;
        for (int i = 0; i < QMM_QK; i++) amax = fmaxf(amax, fabsf(x[i]));
        float d = amax / 127.f, id = amax > 0 ? 127.f / amax : 0.f;
        for (int i = 0; i < QMM_QK; i++) {
            int v = (int)lrintf(x[i] * id);
            y[b].qs[i] = (int8_t)(v > 127 ? 127 : v < -127 ? -127 : v);
        }
        for (int g = 0; g < 16; g++) {
            int s = 0;
            for (int i = 0; i < 16; i++) s += y[b].qs[16 * g + i];
            y[b].bsums[g] = (int16_t)s;
        }
        y[b].d = d;
    }
}

/* The 8 scales and 8 mins of a Q4_K block (6 bits each, packed in 12 bytes), as 8 bytes each:
 * scales 0-3 and mins 0-3 are the low 6 bits of bytes 0-3 and 4-7; scales and mins 4-7 take
 * their low 4 bits from bytes 8-11 and their top 2 bits from the top of bytes 0-3 and 4-7. */
static inline void q4k_scales(const uint8_t *s, uint64_t *sc, uint64_t *m) {
    uint32_t u0, u1, u2;
    memcpy(&u0, s, 4); memcpy(&u1, s + 4, 4); memcpy(&u2, s + 8, 4);
    uint32_t sc_lo = u0 & 0x3f3f3f3fu, m_lo = u1 & 0x3f3f3f3fu;
    uint32_t sc_hi = (u2 & 0x0f0f0f0fu) | (((u0 >> 6) & 0x03030303u) << 4);
    uint32_t m_hi = ((u2 >> 4) & 0x0f0f0f0fu) | (((u1 >> 6) & 0x03030303u) << 4);
    *sc = (uint64_t)sc_hi << 32 | sc_lo;
    *m = (uint64_t)m_hi << 32 | m_lo;
}

static inline float hsum8_ref(const float a[8]) {
    float v0 = a[0] + a[4], v1 = a[1] + a[5], v2 = a[2] + a[6], v3 = a[3] + a[7];
    return (v0 + v2) + (v1 + v3);
}

/* Per activation row and block, the 8 lanes' share of the Q4_K min term: d_x * (bsums[2l] +
 * bsums[2l+1]). Computed once per call: a thread's scratch, grown as needed. */
static _Thread_local float *xm_buf;
static _Thread_local size_t xm_cap;

static float *q4k_xmins(int n, int nb, const qmm_block_q8_K *X) {
    size_t need = (size_t)n * nb * 8;
    if (need > xm_cap) {
        float *p = realloc(xm_buf, need * sizeof(float));
        if (!p) return NULL;
        xm_buf = p;
        xm_cap = need;
    }
    for (int r = 0; r < n; r++)
        for (int b = 0; b < nb; b++) {
            const qmm_block_q8_K *x = &X[(size_t)r * nb + b];
            for (int l = 0; l < 8; l++)
                xm_buf[((size_t)r * nb + b) * 8 + l] = x->d * (float)(x->bsums[2 * l] + x->bsums[2 * l + 1]);
        }
    return xm_buf;
}

/* ---------------------------------------------------------------- scalar reference */

static void q4k_scalar(int K, int o0, int o1, int n, const qmm_block_q4_K *W,
                       const qmm_block_q8_K *X, const float *xm, float *Y, size_t ldy) {
    const int nb = K / QMM_QK;
    float acc[QMM_MAX_ROWS][8];
    for (int o = o0; o < o1; o++) {
        memset(acc, 0, sizeof acc);
        for (int b = 0; b < nb; b++) {
            const qmm_block_q4_K *w = &W[(size_t)o * nb + b];
            uint64_t sc8, m8;
            q4k_scales(w->scales, &sc8, &m8);
            uint8_t q[256];
            for (int g = 0; g < 4; g++)
                for (int l = 0; l < 32; l++) {
                    q[64 * g + l] = w->qs[32 * g + l] & 0xf;
                    q[64 * g + 32 + l] = w->qs[32 * g + l] >> 4;
                }
            const float dw = qmm_half_to_float(w->d), dmw = qmm_half_to_float(w->dmin);
            float mw[8];
            for (int l = 0; l < 8; l++) mw[l] = -(dmw * (float)(uint8_t)(m8 >> 8 * l));
            for (int r = 0; r < n; r++) {
                const qmm_block_q8_K *x = &X[(size_t)r * nb + b];
                const float *xmb = xm + ((size_t)r * nb + b) * 8;
                int32_t is[8] = {0};
                for (int j = 0; j < 8; j++)
                    for (int l = 0; l < 8; l++) {
                        int t = 0;
                        for (int u = 0; u < 4; u++) t += q[32 * j + 4 * l + u] * x->qs[32 * j + 4 * l + u];
                        is[l] += (int)(uint8_t)(sc8 >> 8 * j) * t;
                    }
                const float dd = dw * x->d;
                for (int l = 0; l < 8; l++) {
                    acc[r][l] = fmaf(dd, (float)is[l], acc[r][l]);
                    acc[r][l] = fmaf(mw[l], xmb[l], acc[r][l]);
                }
            }
        }
        for (int r = 0; r < n; r++) Y[(size_t)r * ldy + o] = hsum8_ref(acc[r]);
    }
}

/* Q6_K weights in element order, 0..63 (the -32 is taken off through bsums). */
static inline void q6k_unpack(const qmm_block_q6_K *w, uint8_t q[256]) {
    for (int h = 0; h < 2; h++) {
        const uint8_t *ql = w->ql + 64 * h, *qh = w->qh + 32 * h;
        uint8_t *y = q + 128 * h;
        for (int l = 0; l < 32; l++) {
            y[l] = (uint8_t)((ql[l] & 0xf) | ((qh[l] & 3) << 4));
            y[l + 32] = (uint8_t)((ql[l + 32] & 0xf) | (((qh[l] >> 2) & 3) << 4));
            y[l + 64] = (uint8_t)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4));
            y[l + 96] = (uint8_t)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4));
        }
    }
}

static void q6k_scalar(int K, int o0, int o1, int n, const qmm_block_q6_K *W,
                       const qmm_block_q8_K *X, float *Y, size_t ldy) {
    const int nb = K / QMM_QK;
    float acc[QMM_MAX_ROWS][8];
    for (int o = o0; o < o1; o++) {
        memset(acc, 0, sizeof acc);
        for (int b = 0; b < nb; b++) {
            const qmm_block_q6_K *w = &W[(size_t)o * nb + b];
            uint8_t q[256];
            q6k_unpack(w, q);
            const float dw = qmm_half_to_float(w->d);
            for (int r = 0; r < n; r++) {
                const qmm_block_q8_K *x = &X[(size_t)r * nb + b];
                int32_t is[8] = {0};
                for (int c = 0; c < 8; c++)
                    for (int l = 0; l < 8; l++) {
                        int t = 0;
                        for (int u = 0; u < 4; u++) t += q[32 * c + 4 * l + u] * x->qs[32 * c + 4 * l + u];
                        is[l] += w->scales[2 * c + l / 4] * t;
                    }
                const float dd = dw * x->d;
                for (int l = 0; l < 8; l++) {
                    int32_t ms = x->bsums[2 * l] * w->scales[2 * l] + x->bsums[2 * l + 1] * w->scales[2 * l + 1];
                    acc[r][l] = fmaf(dd, (float)(is[l] - 32 * ms), acc[r][l]);
                }
            }
        }
        for (int r = 0; r < n; r++) Y[(size_t)r * ldy + o] = hsum8_ref(acc[r]);
    }
}

#ifdef QMM_X86
/* ---------------------------------------------------------------- AVX2 */
#define AVX2_T __attribute__((target("avx2,fma,f16c")))
#define INLINE static inline __attribute__((always_inline))

AVX2_T static inline float hsum8_avx(__m256 a) {
    __m128 v4 = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    __m128 v2 = _mm_add_ps(v4, _mm_movehl_ps(v4, v4));
    return _mm_cvtss_f32(_mm_add_ss(v2, _mm_movehdup_ps(v2)));
}

/* Byte patterns that spread one 16-bit lane of a 128-bit half over the whole half. */
static const uint8_t spread16[8][16] = {
#define S(k) {2*k, 2*k+1, 2*k, 2*k+1, 2*k, 2*k+1, 2*k, 2*k+1, 2*k, 2*k+1, 2*k, 2*k+1, 2*k, 2*k+1, 2*k, 2*k+1}
    S(0), S(1), S(2), S(3), S(4), S(5), S(6), S(7)
#undef S
};

/* One Q4_K block unpacked: the 8 sub-blocks' 4-bit values, their scales spread over 16-bit
 * lanes, the block's d, and -dmin*min per lane. */
typedef struct {
    __m256i q[8], s[8];
    __m256 dw, mw;
} q4k_avx2_block;

AVX2_T INLINE void q4k_unpack_avx2(const qmm_block_q4_K *w, q4k_avx2_block *u) {
    const __m256i m4 = _mm256_set1_epi8(0xf);
    for (int g = 0; g < 4; g++) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(w->qs + 32 * g));
        u->q[2 * g] = _mm256_and_si256(v, m4);
        u->q[2 * g + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    }
    uint64_t sc8, m8;
    q4k_scales(w->scales, &sc8, &m8);
    const __m256i sc = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)sc8)));
    for (int j = 0; j < 8; j++)
        u->s[j] = _mm256_shuffle_epi8(sc, _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)spread16[j])));
    uint32_t dm;
    memcpy(&dm, &w->d, 4);
    const __m128 ds = _mm_cvtph_ps(_mm_cvtsi32_si128((int)dm));  /* d, dmin */
    u->dw = _mm256_broadcastss_ps(ds);
    const __m256 dmin = _mm256_broadcastss_ps(_mm_movehdup_ps(ds));
    const __m256 mf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)m8)));
    u->mw = _mm256_xor_ps(_mm256_mul_ps(dmin, mf), _mm256_set1_ps(-0.f));
}

/* NR activation rows against one unpacked block. */
AVX2_T INLINE void q4k_rows_avx2(const int NR, const q4k_avx2_block *u, const qmm_block_q8_K *x0, size_t xstride,
                                 const float *xm0, size_t xmstride, __m256 *acc) {
    __m256i a[4];
    for (int t = 0; t < NR; t++) a[t] = _mm256_setzero_si256();
    for (int j = 0; j < 8; j++)
        for (int t = 0; t < NR; t++) {
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(x0[t * xstride].qs + 32 * j));
            a[t] = _mm256_add_epi32(a[t], _mm256_madd_epi16(_mm256_maddubs_epi16(u->q[j], xv), u->s[j]));
        }
    for (int t = 0; t < NR; t++) {
        const __m256 dd = _mm256_mul_ps(u->dw, _mm256_broadcast_ss(&x0[t * xstride].d));
        acc[t] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(a[t]), acc[t]);
        acc[t] = _mm256_fmadd_ps(u->mw, _mm256_loadu_ps(xm0 + t * xmstride), acc[t]);
    }
}

AVX2_T static void q4k_avx2(int K, int o0, int o1, int n, const qmm_block_q4_K *W,
                            const qmm_block_q8_K *X, const float *xm, float *Y, size_t ldy) {
    const int nb = K / QMM_QK;
    __m256 acc[QMM_MAX_ROWS];
    for (int o = o0; o < o1; o++) {
        for (int r = 0; r < n; r++) acc[r] = _mm256_setzero_ps();
        for (int b = 0; b < nb; b++) {
            q4k_avx2_block u;
            q4k_unpack_avx2(&W[(size_t)o * nb + b], &u);
            int r = 0;
            for (; r + 4 <= n; r += 4) q4k_rows_avx2(4, &u, &X[(size_t)r * nb + b], nb, xm + ((size_t)r * nb + b) * 8, nb * 8, acc + r);
            for (; r < n; r++) q4k_rows_avx2(1, &u, &X[(size_t)r * nb + b], nb, xm + ((size_t)r * nb + b) * 8, nb * 8, acc + r);
        }
        for (int r = 0; r < n; r++) Y[(size_t)r * ldy + o] = hsum8_avx(acc[r]);
    }
}

/* Two weight rows at once: each activation chunk loaded once for both. Same arithmetic per
 * (weight row, activation row) as q4k_rows_avx2, so the same bits. */
AVX2_T INLINE void q4k_rows2_avx2(const int NR, const q4k_avx2_block *u, const qmm_block_q8_K *x0, size_t xstride,
                                  const float *xm0, size_t xmstride, __m256 *acc0, __m256 *acc1) {
    __m256i a[4], c[4];
    for (int t = 0; t < NR; t++) a[t] = c[t] = _mm256_setzero_si256();
    for (int j = 0; j < 8; j++)
        for (int t = 0; t < NR; t++) {
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(x0[t * xstride].qs + 32 * j));
            a[t] = _mm256_add_epi32(a[t], _mm256_madd_epi16(_mm256_maddubs_epi16(u[0].q[j], xv), u[0].s[j]));
            c[t] = _mm256_add_epi32(c[t], _mm256_madd_epi16(_mm256_maddubs_epi16(u[1].q[j], xv), u[1].s[j]));
        }
    for (int t = 0; t < NR; t++) {
        const __m256 dx = _mm256_broadcast_ss(&x0[t * xstride].d), xm = _mm256_loadu_ps(xm0 + t * xmstride);
        acc0[t] = _mm256_fmadd_ps(_mm256_mul_ps(u[0].dw, dx), _mm256_cvtepi32_ps(a[t]), acc0[t]);
        acc0[t] = _mm256_fmadd_ps(u[0].mw, xm, acc0[t]);
        acc1[t] = _mm256_fmadd_ps(_mm256_mul_ps(u[1].dw, dx), _mm256_cvtepi32_ps(c[t]), acc1[t]);
        acc1[t] = _mm256_fmadd_ps(u[1].mw, xm, acc1[t]);
    }
}

AVX2_T static void q4k_avx2_r2(int K, int o0, int o1, int n, const qmm_block_q4_K *W,
                               const qmm_block_q8_K *X, const float *xm, float *Y, size_t ldy) {
    const int nb = K / QMM_QK;
    __m256 acc0[QMM_MAX_ROWS], acc1[QMM_MAX_ROWS];
    int o = o0;
    for (; o + 2 <= o1; o += 2) {
        for (int r = 0; r < n; r++) acc0[r] = acc1[r] = _mm256_setzero_ps();
        for (int b = 0; b < nb; b++) {
            q4k_avx2_block u[2];
            q4k_unpack_avx2(&W[(size_t)o * nb + b], &u[0]);
            q4k_unpack_avx2(&W[(size_t)(o + 1) * nb + b], &u[1]);
            int r = 0;
            for (; r + 4 <= n; r += 4)
                q4k_rows2_avx2(4, u, &X[(size_t)r * nb + b], nb, xm + ((size_t)r * nb + b) * 8, nb * 8, acc0 + r, acc1 + r);
            for (; r < n; r++)
                q4k_rows2_avx2(1, u, &X[(size_t)r * nb + b], nb, xm + ((size_t)r * nb + b) * 8, nb * 8, acc0 + r, acc1 + r);
        }
        for (int r = 0; r < n; r++) {
            Y[(size_t)r * ldy + o] = hsum8_avx(acc0[r]);
            Y[(size_t)r * ldy + o + 1] = hsum8_avx(acc1[r]);
        }
    }
    if (o < o1) q4k_avx2(K, o, o1, n, W, X, xm, Y, ldy);
}

/* One Q6_K block unpacked: 8 32-byte chunks of 0..63 in element order, each chunk's two scales
 * spread over its 16-bit lanes (8 each), the 16 scales as 16-bit, and d. */
typedef struct {
    __m256i q[8], s[8], sc16;
    __m256 dw;
} q6k_avx2_block;

AVX2_T INLINE void q6k_unpack_avx2(const qmm_block_q6_K *w, q6k_avx2_block *u) {
    const __m256i m4 = _mm256_set1_epi8(0xf), m3 = _mm256_set1_epi8(3);
    for (int h = 0; h < 2; h++) {
        __m256i l0 = _mm256_loadu_si256((const __m256i *)(w->ql + 64 * h));
        __m256i l1 = _mm256_loadu_si256((const __m256i *)(w->ql + 64 * h + 32));
        __m256i hb = _mm256_loadu_si256((const __m256i *)(w->qh + 32 * h));
        u->q[4 * h + 0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_slli_epi16(_mm256_and_si256(hb, m3), 4));
        u->q[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2), m3), 4));
        u->q[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 4), m3), 4));
        u->q[4 * h + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 6), m3), 4));
    }
    u->sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)w->scales));
    const __m256i lo = _mm256_permute2x128_si256(u->sc16, u->sc16, 0x00), hi = _mm256_permute2x128_si256(u->sc16, u->sc16, 0x11);
    for (int c = 0; c < 8; c++) {
        const int k = (2 * c) % 8;
        const __m256i pat = _mm256_setr_m128i(_mm_loadu_si128((const __m128i *)spread16[k]), _mm_loadu_si128((const __m128i *)spread16[k + 1]));
        u->s[c] = _mm256_shuffle_epi8(c < 4 ? lo : hi, pat);
    }
    u->dw = _mm256_set1_ps(_cvtsh_ss(w->d));
}

AVX2_T INLINE void q6k_rows_avx2(const int NR, const q6k_avx2_block *u, const qmm_block_q8_K *x0, size_t xstride, __m256 *acc) {
    __m256i a[4];
    for (int t = 0; t < NR; t++) a[t] = _mm256_setzero_si256();
    for (int c = 0; c < 8; c++)
        for (int t = 0; t < NR; t++) {
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(x0[t * xstride].qs + 32 * c));
            a[t] = _mm256_add_epi32(a[t], _mm256_madd_epi16(_mm256_maddubs_epi16(u->q[c], xv), u->s[c]));
        }
    for (int t = 0; t < NR; t++) {
        const __m256i ms = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)x0[t * xstride].bsums), u->sc16);
        const __m256i is = _mm256_sub_epi32(a[t], _mm256_slli_epi32(ms, 5));
        const __m256 dd = _mm256_mul_ps(u->dw, _mm256_broadcast_ss(&x0[t * xstride].d));
        acc[t] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(is), acc[t]);
    }
}

AVX2_T static void q6k_avx2(int K, int o0, int o1, int n, const qmm_block_q6_K *W,
                            const qmm_block_q8_K *X, float *Y, size_t ldy) {
    const int nb = K / QMM_QK;
    __m256 acc[QMM_MAX_ROWS];
    for (int o = o0; o < o1; o++) {
        for (int r = 0; r < n; r++) acc[r] = _mm256_setzero_ps();
        for (int b = 0; b < nb; b++) {
            q6k_avx2_block u;
            q6k_unpack_avx2(&W[(size_t)o * nb + b], &u);
            int r = 0;
            for (; r + 4 <= n; r += 4) q6k_rows_avx2(4, &u, &X[(size_t)r * nb + b], nb, acc + r);
            for (; r < n; r++) q6k_rows_avx2(1, &u, &X[(size_t)r * nb + b], nb, acc + r);
        }
        for (int r = 0; r < n; r++) Y[(size_t)r * ldy + o] = hsum8_avx(acc[r]);
    }
}

/* ---------------------------------------------------------------- AVX-512 VNNI */
/* 64 bytes per instruction: vpmaddubsw, then vpdpwssd applies the 16-bit scales and accumulates.
 * Lanes 8..15 (the odd 32-byte chunks) are added onto lanes 0..7 at the end of the block: the
 * same integers as the 8-lane paths. */
#define AVX512_T __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))

AVX512_T INLINE __m256i fold512(__m512i v) {
    return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
}

/* 16-bit lane indexes: 16 of a, 16 of b; or 8 each of a..d. */
AVX512_T INLINE __m512i idx2(int a, int b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16((short)a)), _mm256_set1_epi16((short)b), 1);
}

typedef struct {
    __m512i q[4], s[4];
    __m256 dw, mw;
} q4k_avx512_block;

AVX512_T INLINE void q4k_unpack_avx512(const qmm_block_q4_K *w, q4k_avx512_block *u) {
    const __m256i m4 = _mm256_set1_epi8(0xf);
    uint64_t sc8, m8;
    q4k_scales(w->scales, &sc8, &m8);
    const __m512i sc = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)sc8)));
    for (int g = 0; g < 4; g++) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(w->qs + 32 * g));
        u->q[g] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(v, m4)),
                                     _mm256_and_si256(_mm256_srli_epi16(v, 4), m4), 1);
        u->s[g] = _mm512_permutexvar_epi16(idx2(2 * g, 2 * g + 1), sc);
    }
    uint32_t dm;
    memcpy(&dm, &w->d, 4);
    const __m128 ds = _mm_cvtph_ps(_mm_cvtsi32_si128((int)dm));
    u->dw = _mm256_broadcastss_ps(ds);
    const __m256 dmin = _mm256_broadcastss_ps(_mm_movehdup_ps(ds));
    const __m256 mf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)m8)));
    u->mw = _mm256_xor_ps(_mm256_mul_ps(dmin, mf), _mm256_set1_ps(-0.f));
}

AVX512_T INLINE void q4k_rows_avx512(const int NR, const q4k_avx512_block *u, const qmm_block_q8_K *x0, size_t xstride,
                                     const float *xm0, size_t xmstride, __m256 *acc) {
    __m512i a[4];
    for (int t = 0; t < NR; t++) a[t] = _mm512_setzero_si512();
    for (int g = 0; g < 4; g++)
        for (int t = 0; t < NR; t++)
            a[t] = _mm512_dpwssd_epi32(a[t], _mm512_maddubs_epi16(u->q[g], _mm512_loadu_si512(x0[t * xstride].qs + 64 * g)), u->s[g]);
    for (int t = 0; t < NR; t++) {
        const __m256 dd = _mm256_mul_ps(u->dw, _mm256_broadcast_ss(&x0[t * xstride].d));
        acc[t] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(fold512(a[t])), acc[t]);
        acc[t] = _mm256_fmadd_ps(u->mw, _mm256_loadu_ps(xm0 + t * xmstride), acc[t]);
    }
}

AVX512_T static void q4k_avx512(int K, int o0, int o1, int n, const qmm_block_q4_K *W,
                                const qmm_block_q8_K *X, const float *xm, float *Y, size_t ldy) {
    const int nb = K / QMM_QK;
    __m256 acc[QMM_MAX_ROWS];
    for (int o = o0; o < o1; o++) {
        for (int r = 0; r < n; r++) acc[r] = _mm256_setzero_ps();
        for (int b = 0; b < nb; b++) {
            q4k_avx512_block u;
            q4k_unpack_avx512(&W[(size_t)o * nb + b], &u);
            int r = 0;
            for (; r + 4 <= n; r += 4) q4k_rows_avx512(4, &u, &X[(size_t)r * nb + b], nb, xm + ((size_t)r * nb + b) * 8, nb * 8, acc + r);
            for (; r < n; r++) q4k_rows_avx512(1, &u, &X[(size_t)r * nb + b], nb, xm + ((size_t)r * nb + b) * 8, nb * 8, acc + r);
        }
        for (int r = 0; r < n; r++) Y[(size_t)r * ldy + o] = hsum8_avx(acc[r]);
    }
}

typedef struct {
    __m512i q[4], s[4];
    __m256i sc16;
    __m256 dw;
} q6k_avx512_block;

AVX512_T INLINE void q6k_unpack_avx512(const qmm_block_q6_K *w, q6k_avx512_block *u) {
    q6k_avx2_block v;
    q6k_unpack_avx2(w, &v);
    const __m512i sc = _mm512_castsi256_si512(v.sc16);
    for (int g = 0; g < 4; g++) {
        u->q[g] = _mm512_inserti64x4(_mm512_castsi256_si512(v.q[2 * g]), v.q[2 * g + 1], 1);
        const __m512i idx = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_setr_m128i(_mm_set1_epi16((short)(4 * g)), _mm_set1_epi16((short)(4 * g + 1)))),
            _mm256_setr_m128i(_mm_set1_epi16((short)(4 * g + 2)), _mm_set1_epi16((short)(4 * g + 3))), 1);
        u->s[g] = _mm512_permutexvar_epi16(idx, sc);
    }
    u->sc16 = v.sc16;
    u->dw = v.dw;
}

AVX512_T INLINE void q6k_rows_avx512(const int NR, const q6k_avx512_block *u, const qmm_block_q8_K *x0, size_t xstride, __m256 *acc) {
    __m512i a[4];
    for (int t = 0; t < NR; t++) a[t] = _mm512_setzero_si512();
    for (int g = 0; g < 4; g++)
        for (int t = 0; t < NR; t++)
            a[t] = _mm512_dpwssd_epi32(a[t], _mm512_maddubs_epi16(u->q[g], _mm512_loadu_si512(x0[t * xstride].qs + 64 * g)), u->s[g]);
    for (int t = 0; t < NR; t++) {
        const __m256i ms = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)x0[t * xstride].bsums), u->sc16);
        const __m256i is = _mm256_sub_epi32(fold512(a[t]), _mm256_slli_epi32(ms, 5));
        const __m256 dd = _mm256_mul_ps(u->dw, _mm256_broadcast_ss(&x0[t * xstride].d));
        acc[t] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(is), acc[t]);
    }
}

AVX512_T static void q6k_avx512(int K, int o0, int o1, int n, const qmm_block_q6_K *W,
                                const qmm_block_q8_K *X, float *Y, size_t ldy) {
    const int nb = K / QMM_QK;
    __m256 acc[QMM_MAX_ROWS];
    for (int o = o0; o < o1; o++) {
        for (int r = 0; r < n; r++) acc[r] = _mm256_setzero_ps();
        for (int b = 0; b < nb; b++) {
            q6k_avx512_block u;
            q6k_unpack_avx512(&W[(size_t)o * nb + b], &u);
            int r = 0;
            for (; r + 4 <= n; r += 4) q6k_rows_avx512(4, &u, &X[(size_t)r * nb + b], nb, acc + r);
            for (; r < n; r++) q6k_rows_avx512(1, &u, &X[(size_t)r * nb + b], nb, acc + r);
        }
        for (int r = 0; r < n; r++) Y[(size_t)r * ldy + o] = hsum8_avx(acc[r]);
    }
}
#endif

/* ---------------------------------------------------------------- dispatch */

static int have(int path) {
    switch (path) {
    case QMM_SCALAR: return 1;
#ifdef QMM_X86
    case QMM_AVX2:
    case QMM_AVX2_1ROW:
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    case QMM_AVX512:
        return have(QMM_AVX2) && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
#endif
    default: return 0;
    }
}

int qmm_best_path(void) {
    return have(QMM_AVX512) ? QMM_AVX512 : have(QMM_AVX2) ? QMM_AVX2 : QMM_SCALAR;
}

const char *qmm_path_name(int path) {
    static const char *names[] = {"auto", "scalar", "avx2", "avx512vnni", "avx2-1row"};
    return path >= 0 && path <= 4 ? names[path] : "?";
}

static int check(int *path, int K, int o0, int o1, int n) {
    if (*path == QMM_AUTO) *path = qmm_best_path();
    return have(*path) && K > 0 && K % QMM_QK == 0 && n >= 1 && n <= QMM_MAX_ROWS && o0 >= 0 && o1 >= o0;
}

int qmm_q4_K(int path, int K, int o0, int o1, int n, const qmm_block_q4_K *W,
             const qmm_block_q8_K *X, float *Y, size_t ldy) {
    if (!check(&path, K, o0, o1, n)) return -1;
    const float *xm = q4k_xmins(n, K / QMM_QK, X);
    if (!xm) return -1;
#ifdef QMM_X86
    if (path == QMM_AVX512) { q4k_avx512(K, o0, o1, n, W, X, xm, Y, ldy); return 0; }
    /* Both AVX2 kernels give the same bits, so the choice may follow n: in the real 1.5B one
     * weight row per pass was faster up to n = 8, two from n = 32 (n = 16 a tie). */
    if (path == QMM_AVX2 && n >= 16) { q4k_avx2_r2(K, o0, o1, n, W, X, xm, Y, ldy); return 0; }
    if (path == QMM_AVX2) { q4k_avx2(K, o0, o1, n, W, X, xm, Y, ldy); return 0; }
    if (path == QMM_AVX2_1ROW) { q4k_avx2(K, o0, o1, n, W, X, xm, Y, ldy); return 0; }
#endif
    q4k_scalar(K, o0, o1, n, W, X, xm, Y, ldy);
    return 0;
}

int qmm_q6_K(int path, int K, int o0, int o1, int n, const qmm_block_q6_K *W,
             const qmm_block_q8_K *X, float *Y, size_t ldy) {
    if (!check(&path, K, o0, o1, n)) return -1;
#ifdef QMM_X86
    if (path == QMM_AVX512) { q6k_avx512(K, o0, o1, n, W, X, Y, ldy); return 0; }
    if (path == QMM_AVX2 || path == QMM_AVX2_1ROW) { q6k_avx2(K, o0, o1, n, W, X, Y, ldy); return 0; }
#endif
    q6k_scalar(K, o0, o1, n, W, X, Y, ldy);
    return 0;
}
