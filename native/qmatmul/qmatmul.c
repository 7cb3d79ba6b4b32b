/* Small-batch Q4_K / Q6_K x Q8_K matmul; see qmatmul.h.
 *
 * Order of summation, the same on every path and for every n: within a 256-weight block the
 * products are summed as integers into 8 lanes (lane l takes bytes 4l..4l+3 of every 32-byte
 * chunk, times that chunk's scale) - integer sums are exact, so the lanes' values do not depend
 * on how the SIMD code groups them. Each lane then takes acc_l = fma(d_w*d_x, lane, acc_l) block
 * after block (Q4_K also fma(-dmin_w*d_x, mins_l, acc_l)), and the row's result is
 * ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7)). The scalar path is that definition written out; it is
 * the tests' oracle, and the SIMD paths equal it bit for bit.
 *
 * Build with -ffp-contract=off: a compiler-fused multiply-add would change the scalar bits. */
#include "qmatmul.h"

#include <math.h>
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

/* The 8 scales and 8 mins of a Q4_K block (6 bits each, packed in 12 bytes). */
static inline void q4k_scales(const uint8_t *s, uint8_t sc[8], uint8_t m[8]) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        m[j] = s[j + 4] & 63;
        sc[j + 4] = (uint8_t)((s[j + 8] & 0xf) | ((s[j] >> 6) << 4));
        m[j + 4] = (uint8_t)((s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4));
    }
}

static inline float hsum8_ref(const float a[8]) {
    float v0 = a[0] + a[4], v1 = a[1] + a[5], v2 = a[2] + a[6], v3 = a[3] + a[7];
    return (v0 + v2) + (v1 + v3);
}

/* ---------------------------------------------------------------- scalar reference */

static void q4k_scalar(int K, int o0, int o1, int n, const qmm_block_q4_K *W,
                       const qmm_block_q8_K *X, float *Y, size_t ldy) {
    const int nb = K / QMM_QK;
    float acc[QMM_MAX_ROWS][8];
    for (int o = o0; o < o1; o++) {
        memset(acc, 0, sizeof acc);
        for (int b = 0; b < nb; b++) {
            const qmm_block_q4_K *w = &W[(size_t)o * nb + b];
            uint8_t sc[8], m[8], q[256];
            q4k_scales(w->scales, sc, m);
            for (int g = 0; g < 4; g++)
                for (int l = 0; l < 32; l++) {
                    q[64 * g + l] = w->qs[32 * g + l] & 0xf;
                    q[64 * g + 32 + l] = w->qs[32 * g + l] >> 4;
                }
            const float dw = qmm_half_to_float(w->d), dmw = qmm_half_to_float(w->dmin);
            for (int r = 0; r < n; r++) {
                const qmm_block_q8_K *x = &X[(size_t)r * nb + b];
                int32_t is[8] = {0}, ms[8];
                for (int j = 0; j < 8; j++)
                    for (int l = 0; l < 8; l++) {
                        int t = 0;
                        for (int u = 0; u < 4; u++) t += q[32 * j + 4 * l + u] * x->qs[32 * j + 4 * l + u];
                        is[l] += sc[j] * t;
                    }
                for (int l = 0; l < 8; l++) ms[l] = m[l] * (x->bsums[2 * l] + x->bsums[2 * l + 1]);
                const float dd = dw * x->d, dm = dmw * x->d;
                for (int l = 0; l < 8; l++) {
                    acc[r][l] = fmaf(dd, (float)is[l], acc[r][l]);
                    acc[r][l] = fmaf(-dm, (float)ms[l], acc[r][l]);
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

AVX2_T static inline float hsum8_avx(__m256 a) {
    __m128 v4 = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    __m128 v2 = _mm_add_ps(v4, _mm_movehl_ps(v4, v4));
    return _mm_cvtss_f32(_mm_add_ss(v2, _mm_movehdup_ps(v2)));
}

/* acc += dd*is - dm*ms, lane by lane, as the reference's two fmaf. */
AVX2_T static inline __m256 q4k_fold(__m256 acc, __m256i is, __m256i ms, __m256 dw, __m256 dmw, float dx) {
    const __m256 vx = _mm256_set1_ps(dx);
    acc = _mm256_fmadd_ps(_mm256_mul_ps(dw, vx), _mm256_cvtepi32_ps(is), acc);
    return _mm256_fnmadd_ps(_mm256_mul_ps(dmw, vx), _mm256_cvtepi32_ps(ms), acc);
}

AVX2_T static void q4k_avx2(int K, int o0, int o1, int n, const qmm_block_q4_K *W,
                            const qmm_block_q8_K *X, float *Y, size_t ldy) {
    const int nb = K / QMM_QK;
    const __m256i m4 = _mm256_set1_epi8(0xf);
    __m256 acc[QMM_MAX_ROWS];
    for (int o = o0; o < o1; o++) {
        for (int r = 0; r < n; r++) acc[r] = _mm256_setzero_ps();
        for (int b = 0; b < nb; b++) {
            const qmm_block_q4_K *w = &W[(size_t)o * nb + b];
            uint8_t sc[8], m[8];
            q4k_scales(w->scales, sc, m);
            __m256i q[8], s[8];
            for (int g = 0; g < 4; g++) {
                __m256i v = _mm256_loadu_si256((const __m256i *)(w->qs + 32 * g));
                q[2 * g] = _mm256_and_si256(v, m4);
                q[2 * g + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
            }
            for (int j = 0; j < 8; j++) s[j] = _mm256_set1_epi16(sc[j]);
            const __m256i mins = _mm256_setr_epi16(m[0], m[0], m[1], m[1], m[2], m[2], m[3], m[3],
                                                   m[4], m[4], m[5], m[5], m[6], m[6], m[7], m[7]);
            const __m256 dw = _mm256_set1_ps(_cvtsh_ss(w->d)), dmw = _mm256_set1_ps(_cvtsh_ss(w->dmin));
            for (int r = 0; r < n; r++) {
                const qmm_block_q8_K *x = &X[(size_t)r * nb + b];
                __m256i p[8];
                for (int j = 0; j < 8; j++)
                    p[j] = _mm256_madd_epi16(_mm256_maddubs_epi16(q[j], _mm256_loadu_si256((const __m256i *)(x->qs + 32 * j))), s[j]);
                __m256i is = _mm256_add_epi32(_mm256_add_epi32(_mm256_add_epi32(p[0], p[1]), _mm256_add_epi32(p[2], p[3])),
                                              _mm256_add_epi32(_mm256_add_epi32(p[4], p[5]), _mm256_add_epi32(p[6], p[7])));
                __m256i ms = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)x->bsums), mins);
                acc[r] = q4k_fold(acc[r], is, ms, dw, dmw, x->d);
            }
        }
        for (int r = 0; r < n; r++) Y[(size_t)r * ldy + o] = hsum8_avx(acc[r]);
    }
}

/* The 8 32-byte chunks of a Q6_K block, 0..63 each, in element order. */
AVX2_T static inline void q6k_unpack_avx2(const qmm_block_q6_K *w, __m256i q[8]) {
    const __m256i m4 = _mm256_set1_epi8(0xf), m3 = _mm256_set1_epi8(3);
    for (int h = 0; h < 2; h++) {
        __m256i l0 = _mm256_loadu_si256((const __m256i *)(w->ql + 64 * h));
        __m256i l1 = _mm256_loadu_si256((const __m256i *)(w->ql + 64 * h + 32));
        __m256i hb = _mm256_loadu_si256((const __m256i *)(w->qh + 32 * h));
        q[4 * h + 0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_slli_epi16(_mm256_and_si256(hb, m3), 4));
        q[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2), m3), 4));
        q[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 4), m3), 4));
        q[4 * h + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 6), m3), 4));
    }
}

AVX2_T static void q6k_avx2(int K, int o0, int o1, int n, const qmm_block_q6_K *W,
                            const qmm_block_q8_K *X, float *Y, size_t ldy) {
    const int nb = K / QMM_QK;
    __m256 acc[QMM_MAX_ROWS];
    for (int o = o0; o < o1; o++) {
        for (int r = 0; r < n; r++) acc[r] = _mm256_setzero_ps();
        for (int b = 0; b < nb; b++) {
            const qmm_block_q6_K *w = &W[(size_t)o * nb + b];
            __m256i q[8], s[8];
            q6k_unpack_avx2(w, q);
            const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)w->scales));
            for (int c = 0; c < 8; c++)
                s[c] = _mm256_setr_epi16(w->scales[2 * c], w->scales[2 * c], w->scales[2 * c], w->scales[2 * c],
                                         w->scales[2 * c], w->scales[2 * c], w->scales[2 * c], w->scales[2 * c],
                                         w->scales[2 * c + 1], w->scales[2 * c + 1], w->scales[2 * c + 1], w->scales[2 * c + 1],
                                         w->scales[2 * c + 1], w->scales[2 * c + 1], w->scales[2 * c + 1], w->scales[2 * c + 1]);
            const __m256 dw = _mm256_set1_ps(_cvtsh_ss(w->d));
            for (int r = 0; r < n; r++) {
                const qmm_block_q8_K *x = &X[(size_t)r * nb + b];
                __m256i p[8];
                for (int c = 0; c < 8; c++)
                    p[c] = _mm256_madd_epi16(_mm256_maddubs_epi16(q[c], _mm256_loadu_si256((const __m256i *)(x->qs + 32 * c))), s[c]);
                __m256i is = _mm256_add_epi32(_mm256_add_epi32(_mm256_add_epi32(p[0], p[1]), _mm256_add_epi32(p[2], p[3])),
                                              _mm256_add_epi32(_mm256_add_epi32(p[4], p[5]), _mm256_add_epi32(p[6], p[7])));
                __m256i ms = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)x->bsums), sc16);
                is = _mm256_sub_epi32(is, _mm256_slli_epi32(ms, 5));
                acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(x->d)), _mm256_cvtepi32_ps(is), acc[r]);
            }
        }
        for (int r = 0; r < n; r++) Y[(size_t)r * ldy + o] = hsum8_avx(acc[r]);
    }
}

/* ---------------------------------------------------------------- AVX-512 VNNI */
/* 64 bytes per instruction: vpmaddubsw, then vpdpwssd applies the 16-bit scales and accumulates.
 * Lanes 8..15 (the odd 32-byte chunks) are added onto lanes 0..7 at the end of the block: the
 * same integers as the 8-lane paths. */
#define AVX512_T __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))

AVX512_T static inline __m256i fold512(__m512i v) {
    return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
}

AVX512_T static inline __m512i two16(int a, int b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16((short)a)), _mm256_set1_epi16((short)b), 1);
}

AVX512_T static void q4k_avx512(int K, int o0, int o1, int n, const qmm_block_q4_K *W,
                                const qmm_block_q8_K *X, float *Y, size_t ldy) {
    const int nb = K / QMM_QK;
    const __m256i m4 = _mm256_set1_epi8(0xf);
    __m256 acc[QMM_MAX_ROWS];
    for (int o = o0; o < o1; o++) {
        for (int r = 0; r < n; r++) acc[r] = _mm256_setzero_ps();
        for (int b = 0; b < nb; b++) {
            const qmm_block_q4_K *w = &W[(size_t)o * nb + b];
            uint8_t sc[8], m[8];
            q4k_scales(w->scales, sc, m);
            __m512i q[4], s[4];
            for (int g = 0; g < 4; g++) {
                __m256i v = _mm256_loadu_si256((const __m256i *)(w->qs + 32 * g));
                q[g] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(v, m4)),
                                          _mm256_and_si256(_mm256_srli_epi16(v, 4), m4), 1);
                s[g] = two16(sc[2 * g], sc[2 * g + 1]);
            }
            const __m256i mins = _mm256_setr_epi16(m[0], m[0], m[1], m[1], m[2], m[2], m[3], m[3],
                                                   m[4], m[4], m[5], m[5], m[6], m[6], m[7], m[7]);
            const __m256 dw = _mm256_set1_ps(_cvtsh_ss(w->d)), dmw = _mm256_set1_ps(_cvtsh_ss(w->dmin));
            for (int r = 0; r < n; r++) {
                const qmm_block_q8_K *x = &X[(size_t)r * nb + b];
                __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();
                a0 = _mm512_dpwssd_epi32(a0, _mm512_maddubs_epi16(q[0], _mm512_loadu_si512(x->qs)), s[0]);
                a1 = _mm512_dpwssd_epi32(a1, _mm512_maddubs_epi16(q[1], _mm512_loadu_si512(x->qs + 64)), s[1]);
                a0 = _mm512_dpwssd_epi32(a0, _mm512_maddubs_epi16(q[2], _mm512_loadu_si512(x->qs + 128)), s[2]);
                a1 = _mm512_dpwssd_epi32(a1, _mm512_maddubs_epi16(q[3], _mm512_loadu_si512(x->qs + 192)), s[3]);
                __m256i is = fold512(_mm512_add_epi32(a0, a1));
                __m256i ms = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)x->bsums), mins);
                const __m256 vx = _mm256_set1_ps(x->d);
                acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(dw, vx), _mm256_cvtepi32_ps(is), acc[r]);
                acc[r] = _mm256_fnmadd_ps(_mm256_mul_ps(dmw, vx), _mm256_cvtepi32_ps(ms), acc[r]);
            }
        }
        for (int r = 0; r < n; r++) Y[(size_t)r * ldy + o] = hsum8_avx(acc[r]);
    }
}

AVX512_T static void q6k_avx512(int K, int o0, int o1, int n, const qmm_block_q6_K *W,
                                const qmm_block_q8_K *X, float *Y, size_t ldy) {
    const int nb = K / QMM_QK;
    __m256 acc[QMM_MAX_ROWS];
    for (int o = o0; o < o1; o++) {
        for (int r = 0; r < n; r++) acc[r] = _mm256_setzero_ps();
        for (int b = 0; b < nb; b++) {
            const qmm_block_q6_K *w = &W[(size_t)o * nb + b];
            __m256i q8[8];
            q6k_unpack_avx2(w, q8);
            __m512i q[4], s[4];
            for (int g = 0; g < 4; g++) {
                q[g] = _mm512_inserti64x4(_mm512_castsi256_si512(q8[2 * g]), q8[2 * g + 1], 1);
                const int8_t *c = w->scales + 4 * g;
                s[g] = _mm512_inserti64x4(
                    _mm512_castsi256_si512(_mm256_setr_epi16(c[0], c[0], c[0], c[0], c[0], c[0], c[0], c[0],
                                                             c[1], c[1], c[1], c[1], c[1], c[1], c[1], c[1])),
                    _mm256_setr_epi16(c[2], c[2], c[2], c[2], c[2], c[2], c[2], c[2],
                                      c[3], c[3], c[3], c[3], c[3], c[3], c[3], c[3]), 1);
            }
            const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)w->scales));
            const __m256 dw = _mm256_set1_ps(_cvtsh_ss(w->d));
            for (int r = 0; r < n; r++) {
                const qmm_block_q8_K *x = &X[(size_t)r * nb + b];
                __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();
                a0 = _mm512_dpwssd_epi32(a0, _mm512_maddubs_epi16(q[0], _mm512_loadu_si512(x->qs)), s[0]);
                a1 = _mm512_dpwssd_epi32(a1, _mm512_maddubs_epi16(q[1], _mm512_loadu_si512(x->qs + 64)), s[1]);
                a0 = _mm512_dpwssd_epi32(a0, _mm512_maddubs_epi16(q[2], _mm512_loadu_si512(x->qs + 128)), s[2]);
                a1 = _mm512_dpwssd_epi32(a1, _mm512_maddubs_epi16(q[3], _mm512_loadu_si512(x->qs + 192)), s[3]);
                __m256i is = fold512(_mm512_add_epi32(a0, a1));
                __m256i ms = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)x->bsums), sc16);
                is = _mm256_sub_epi32(is, _mm256_slli_epi32(ms, 5));
                acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(x->d)), _mm256_cvtepi32_ps(is), acc[r]);
            }
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
    static const char *names[] = {"auto", "scalar", "avx2", "avx512vnni"};
    return path >= 0 && path <= 3 ? names[path] : "?";
}

static int check(int *path, int K, int o0, int o1, int n) {
    if (*path == QMM_AUTO) *path = qmm_best_path();
    return have(*path) && K > 0 && K % QMM_QK == 0 && n >= 1 && n <= QMM_MAX_ROWS && o0 >= 0 && o1 >= o0;
}

int qmm_q4_K(int path, int K, int o0, int o1, int n, const qmm_block_q4_K *W,
             const qmm_block_q8_K *X, float *Y, size_t ldy) {
    if (!check(&path, K, o0, o1, n)) return -1;
#ifdef QMM_X86
    if (path == QMM_AVX512) { q4k_avx512(K, o0, o1, n, W, X, Y, ldy); return 0; }
    if (path == QMM_AVX2) { q4k_avx2(K, o0, o1, n, W, X, Y, ldy); return 0; }
#endif
    q4k_scalar(K, o0, o1, n, W, X, Y, ldy);
    return 0;
}

int qmm_q6_K(int path, int K, int o0, int o1, int n, const qmm_block_q6_K *W,
             const qmm_block_q8_K *X, float *Y, size_t ldy) {
    if (!check(&path, K, o0, o1, n)) return -1;
#ifdef QMM_X86
    if (path == QMM_AVX512) { q6k_avx512(K, o0, o1, n, W, X, Y, ldy); return 0; }
    if (path == QMM_AVX2) { q6k_avx2(K, o0, o1, n, W, X, Y, ldy); return 0; }
#endif
    q6k_scalar(K, o0, o1, n, W, X, Y, ldy);
    return 0;
}
