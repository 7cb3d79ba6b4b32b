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

/* ggml's quantize_row_q8_K_ref: scale -127/x_max where x_max is the first value of largest
 * magnitude; q = min(127, round(x * scale)) by adding 1.5*2^23 (ties to even); d = 1/scale. An
 * all-zero block gets d = 0, zero quants and zero sums. */
static inline int8_t q8_round(float v) {
    float f = v + 12582912.f;
    int32_t i;
    memcpy(&i, &f, 4);
    i = (i & 0x007fffff) - 0x00400000;
    return (int8_t)(i < 127 ? i : 127);
}

static void q8_block_scalar(const float *x, qmm_block_q8_K *y) {
    float max = 0, amax = 0;
    for (int i = 0; i < QMM_QK; i++)
        if (fabsf(x[i]) > amax) { amax = fabsf(x[i]); max = x[i]; }
    memset(y, 0, sizeof *y);
    if (amax == 0) return;
    const float iscale = -127.f / max;
    for (int i = 0; i < QMM_QK; i++) y->qs[i] = q8_round(iscale * x[i]);
    for (int g = 0; g < 16; g++)
        for (int i = 0; i < 16; i++) y->bsums[g] = (int16_t)(y->bsums[g] + y->qs[16 * g + i]);
    y->d = 1 / iscale;
}

#ifdef QMM_X86
/* The same bits, 8 floats at a time: the sums are of small integers, the products and the
 * rounding add are single IEEE operations like the scalar ones. ggml's x86 build quantizes
 * activations with the scalar reference: 2.4% of a 16-row verification of the 1.5B. */
__attribute__((target("avx2,fma,f16c"))) static void q8_block_avx2(const float *x, qmm_block_q8_K *y) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 m = _mm256_setzero_ps();
    for (int i = 0; i < QMM_QK; i += 8)  /* a NaN is skipped, as by the scalar compare: max_ps returns m */
        m = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)), m);
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    if (amax == 0) { memset(y, 0, sizeof *y); return; }
    float max = 0;
    for (int i = 0; i < QMM_QK; i += 8) {  /* the first value of largest magnitude */
        const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)), _mm256_set1_ps(amax), _CMP_EQ_OQ));
        if (hit) { max = x[i + __builtin_ctz((unsigned)hit)]; break; }
    }
    const float iscale = -127.f / max;
    const __m256 vs = _mm256_set1_ps(iscale), magic = _mm256_set1_ps(12582912.f);
    const __m256i mant = _mm256_set1_epi32(0x007fffff), bias = _mm256_set1_epi32(0x00400000), top = _mm256_set1_epi32(127);
    for (int i = 0; i < QMM_QK; i += 32) {
        __m256i q[4];
        for (int k = 0; k < 4; k++) {
            const __m256 f = _mm256_add_ps(_mm256_mul_ps(vs, _mm256_loadu_ps(x + i + 8 * k)), magic);
            q[k] = _mm256_min_epi32(_mm256_sub_epi32(_mm256_and_si256(_mm256_castps_si256(f), mant), bias), top);
        }
        /* 32 int32 to 32 int8 in order: the packs interleave 128-bit lanes, one permute restores them */
        const __m256i w = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        _mm256_storeu_si256((__m256i *)(y->qs + i), _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        const __m256i s01 = _mm256_add_epi32(q[0], q[1]), s23 = _mm256_add_epi32(q[2], q[3]);
        const __m256i h = _mm256_hadd_epi32(s01, s23);  /* pairs; 128-bit lanes: s01 lo, s23 lo | s01 hi, s23 hi */
        const __m256i h2 = _mm256_hadd_epi32(h, h);
        const __m128i t = _mm_add_epi32(_mm256_castsi256_si128(h2), _mm256_extracti128_si256(h2, 1));
        y->bsums[i / 16] = (int16_t)_mm_extract_epi32(t, 0);
        y->bsums[i / 16 + 1] = (int16_t)_mm_extract_epi32(t, 1);
    }
    y->d = 1 / iscale;
}
#endif

static int have(int path);

int qmm_quantize_q8_K(int path, const float *x, qmm_block_q8_K *y, int K) {
    if (path == QMM_AUTO) path = have(QMM_AVX2) ? QMM_AVX2 : QMM_SCALAR;
    if (!have(path) || K <= 0 || K % QMM_QK) return -1;
    for (int b = 0; b < K / QMM_QK; b++) {
#ifdef QMM_X86
        if (path != QMM_SCALAR) { q8_block_avx2(x + (size_t)b * QMM_QK, y + b); continue; }  /* AVX-512 machines too */
#endif
        q8_block_scalar(x + (size_t)b * QMM_QK, y + b);
    }
    return 0;
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

/* What the kernels read of one block of two activation rows (rows 2p and 2p+1 of pair p; an odd
 * last row fills both halves), each as one 512-bit vector: for the AVX-512 kernels, chunk c of
 * the quants (32 bytes) of both rows, the even row first; the 8 lanes' share of the Q4_K min
 * term, d_x * (bsums[2l] + bsums[2l+1]); d_x in 8 lanes; the 16 bsums. Built once per call, a
 * thread's scratch grown as needed. With the quants of a pair side by side, a 512-bit product
 * holds the same chunk of two rows, so the rows' lanes need no folding and a pair takes one
 * accumulator: 16 rows fit the registers (one thread, cached, Q4_K at n = 16: 3.19 to 2.5 ns a
 * block and row). */
typedef struct {
    int8_t qs[8][64];
    float xm[16], xd[16];
    int16_t bsums[32];
} __attribute__((aligned(64))) qmm_pair;

static _Thread_local qmm_pair *pair_buf;
static _Thread_local size_t pair_cap;

static const qmm_pair *row_pairs(int n, int nb, const qmm_block_q8_K *X, int with_qs) {
    size_t need = (size_t)(n + 1) / 2 * nb;
    if (need > pair_cap) {
        qmm_pair *p = aligned_alloc(64, need * sizeof *p);
        if (!p) return NULL;
        free(pair_buf);
        pair_buf = p;
        pair_cap = need;
    }
    for (int p = 0; p < (n + 1) / 2; p++)
        for (int b = 0; b < nb; b++)
            for (int h = 0; h < 2; h++) {
                const int r = 2 * p + h < n ? 2 * p + h : n - 1;
                const qmm_block_q8_K *x = &X[(size_t)r * nb + b];
                qmm_pair *pb = &pair_buf[(size_t)p * nb + b];
                for (int c = 0; with_qs && c < 8; c++) memcpy(pb->qs[c] + 32 * h, x->qs + 32 * c, 32);
                for (int l = 0; l < 8; l++) {
                    pb->xm[8 * h + l] = x->d * (float)(x->bsums[2 * l] + x->bsums[2 * l + 1]);
                    pb->xd[8 * h + l] = x->d;
                }
                memcpy(pb->bsums + 16 * h, x->bsums, sizeof x->bsums);
            }
    return pair_buf;
}

/* ---------------------------------------------------------------- scalar reference */

static void q4k_scalar(int K, int o0, int o1, int n, const qmm_block_q4_K *W,
                       const qmm_block_q8_K *X, const qmm_pair *P, float *Y, size_t ldy) {
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
                const float *xmb = P[(size_t)(r / 2) * nb + b].xm + 8 * (r % 2);
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

/* Each 32-byte group of a block's quants is unpacked in registers and used at once by up to 8
 * activation rows; nothing of the block goes through memory (a whole block unpacked first, 16
 * vectors, spilled to the stack: 16.4 against 8.6 ns a Q4_K block at n = 1, one thread). One
 * weight row per pass: two or four side by side were no faster on one thread and up to 2x
 * slower on two. */

#define UNROLL _Pragma("GCC unroll 8")
#define ALIGN32 __attribute__((aligned(32)))
#define Z 0x80  /* pshufb: a zero byte */

/* pshufb patterns over q4k_scales_avx2: scale j as every 16-bit lane; min l as 32-bit lane l. */
static const uint8_t q4k_scale_pat[8][32] ALIGN32 = {
#define S(j) {j, Z, j, Z, j, Z, j, Z, j, Z, j, Z, j, Z, j, Z, j, Z, j, Z, j, Z, j, Z, j, Z, j, Z, j, Z, j, Z}
    S(0), S(1), S(2), S(3), S(4), S(5), S(6), S(7)
#undef S
};
static const uint8_t q4k_min_pat[32] ALIGN32 = {8, Z, Z, Z, 9, Z, Z, Z, 10, Z, Z, Z, 11, Z, Z, Z,
                                               12, Z, Z, Z, 13, Z, Z, Z, 14, Z, Z, Z, 15, Z, Z, Z};
/* Q6_K chunk c: scale 2c%8 over the low 128-bit half, 2c%8+1 over the high half (16-bit lanes
 * of a half of the scales widened to 16 bits). */
static const uint8_t q6k_scale_pat[4][32] ALIGN32 = {
#define S(k) {2*k, 2*k+1, 2*k, 2*k+1, 2*k, 2*k+1, 2*k, 2*k+1, 2*k, 2*k+1, 2*k, 2*k+1, 2*k, 2*k+1, 2*k, 2*k+1, \
               2*k+2, 2*k+3, 2*k+2, 2*k+3, 2*k+2, 2*k+3, 2*k+2, 2*k+3, 2*k+2, 2*k+3, 2*k+2, 2*k+3, 2*k+2, 2*k+3, 2*k+2, 2*k+3}
    S(0), S(2), S(4), S(6)
#undef S
};
#undef Z

/* A Q4_K block's 8 scales (bytes 0-7) and 8 mins (bytes 8-15) in both 128-bit halves, decoded
 * from its 12 scale bytes (the 16-byte load also reads qs[0..3], which it drops). */
AVX2_T INLINE __m256i q4k_scales_avx2(const uint8_t *s) {
    const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)s));
    const __m256i low6 = _mm256_and_si256(v, _mm256_set1_epi8(0x3f));                      /* sc0-3, m0-3 */
    const __m256i top2 = _mm256_and_si256(_mm256_srli_epi16(v, 2), _mm256_set1_epi8(0x30));  /* bits 6-7 of bytes 0-7, at 4-5 */
    const __m256i nlo = _mm256_and_si256(v, _mm256_set1_epi8(0xf));
    const __m256i nhi = _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0xf));
    const __m256i high = _mm256_or_si256(_mm256_unpackhi_epi32(nlo, nhi), top2);            /* sc4-7, m4-7 */
    return _mm256_unpacklo_epi32(low6, high);
}

/* One Q4_K block of one weight row against NR activation rows (x, pb: the rows' block and their
 * pairs' block, strides in blocks). Per row the integer lanes and the two fmas of the definition;
 * -(dmin*m) times xm is an fnmadd, the same rounding as an fma of the negated product. */
AVX2_T INLINE void q4k_block_avx2(const int NR, const qmm_block_q4_K *w, const qmm_block_q8_K *x, size_t xstride,
                                  const qmm_pair *pb, size_t pstride, __m256 *acc) {
    const __m256i m4 = _mm256_set1_epi8(0xf), sm = q4k_scales_avx2(w->scales);
    __m256i a[8];
    UNROLL
    for (int t = 0; t < NR; t++) a[t] = _mm256_setzero_si256();
    UNROLL
    for (int g = 0; g < 4; g++) {
        const __m256i bits = _mm256_loadu_si256((const __m256i *)(w->qs + 32 * g));
        const __m256i lo = _mm256_and_si256(bits, m4), hi = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4);
        const __m256i sl = _mm256_shuffle_epi8(sm, _mm256_load_si256((const __m256i *)q4k_scale_pat[2 * g]));
        const __m256i sh = _mm256_shuffle_epi8(sm, _mm256_load_si256((const __m256i *)q4k_scale_pat[2 * g + 1]));
        UNROLL
        for (int t = 0; t < NR; t++) {
            const int8_t *q = x[t * xstride].qs + 64 * g;
            a[t] = _mm256_add_epi32(a[t], _mm256_madd_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)q)), sl));
            a[t] = _mm256_add_epi32(a[t], _mm256_madd_epi16(_mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(q + 32))), sh));
        }
    }
    int dm;
    memcpy(&dm, &w->d, 4);
    const __m128 ds = _mm_cvtph_ps(_mm_cvtsi32_si128(dm));  /* d, dmin */
    const __m256 dw = _mm256_broadcastss_ps(ds);
    const __m256 mf = _mm256_cvtepi32_ps(_mm256_shuffle_epi8(sm, _mm256_load_si256((const __m256i *)q4k_min_pat)));
    const __m256 mp = _mm256_mul_ps(_mm256_broadcastss_ps(_mm_movehdup_ps(ds)), mf);  /* dmin*m */
    UNROLL
    for (int t = 0; t < NR; t++) {
        acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_broadcast_ss(&x[t * xstride].d)), _mm256_cvtepi32_ps(a[t]), acc[t]);
        acc[t] = _mm256_fnmadd_ps(mp, _mm256_loadu_ps(pb[t / 2 * pstride].xm + 8 * (t % 2)), acc[t]);
    }
}

/* The 32 quants of Q6_K chunk c (0..63, element order). */
AVX2_T INLINE __m256i q6k_chunk_avx2(const qmm_block_q6_K *w, int c) {
    const int h = c / 4, k = c % 4;
    const __m256i m4 = _mm256_set1_epi8(0xf);
    const __m256i l = _mm256_loadu_si256((const __m256i *)(w->ql + 64 * h + 32 * (k & 1)));
    const __m256i hb = _mm256_loadu_si256((const __m256i *)(w->qh + 32 * h));
    const __m256i lo = k < 2 ? _mm256_and_si256(l, m4) : _mm256_and_si256(_mm256_srli_epi16(l, 4), m4);
    const __m256i hi = k == 0 ? _mm256_slli_epi16(_mm256_and_si256(hb, _mm256_set1_epi8(3)), 4)
                     : k == 1 ? _mm256_slli_epi16(_mm256_and_si256(hb, _mm256_set1_epi8(12)), 2)
                     : k == 2 ? _mm256_and_si256(hb, _mm256_set1_epi8(48))
                              : _mm256_srli_epi16(_mm256_and_si256(hb, _mm256_set1_epi8(-64)), 2);
    return _mm256_or_si256(lo, hi);
}

AVX2_T INLINE void q6k_block_avx2(const int NR, const qmm_block_q6_K *w, const qmm_block_q8_K *x, size_t xstride,
                                  const qmm_pair *pb, size_t pstride, __m256 *acc) {
    (void)pb, (void)pstride;
    const __m256i s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)w->scales));
    const __m256i s_lo = _mm256_permute2x128_si256(s16, s16, 0x00), s_hi = _mm256_permute2x128_si256(s16, s16, 0x11);
    __m256i a[8];
    UNROLL
    for (int t = 0; t < NR; t++) a[t] = _mm256_setzero_si256();
    UNROLL
    for (int c = 0; c < 8; c++) {
        const __m256i q = q6k_chunk_avx2(w, c);
        const __m256i s = _mm256_shuffle_epi8(c < 4 ? s_lo : s_hi, _mm256_load_si256((const __m256i *)q6k_scale_pat[c % 4]));
        UNROLL
        for (int t = 0; t < NR; t++)
            a[t] = _mm256_add_epi32(a[t], _mm256_madd_epi16(_mm256_maddubs_epi16(q, _mm256_loadu_si256((const __m256i *)(x[t * xstride].qs + 32 * c))), s));
    }
    const __m256 dw = _mm256_set1_ps(_cvtsh_ss(w->d));
    UNROLL
    for (int t = 0; t < NR; t++) {
        const __m256i ms = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)x[t * xstride].bsums), s16);
        const __m256i is = _mm256_sub_epi32(a[t], _mm256_slli_epi32(ms, 5));
        acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_broadcast_ss(&x[t * xstride].d)), _mm256_cvtepi32_ps(is), acc[t]);
    }
}

/* Activation rows in groups of G (8 on AVX2, 16 on AVX-512; the last group 1..G): ROWS(NR, o0,
 * o1, args...) for the group starting at activation row r (the args may read r). The weight rows
 * go in tiles of about 16 KB, every group over a tile before the next, so that with several
 * groups the later ones read the tile from cache, not memory (16 rows in two groups, one thread:
 * Q6_K 5.0 to 4.1 ns a block and row). */
#define QMM_CASE(k, ROWS, ...) case k: ROWS(k, t0, t1, __VA_ARGS__); break;
#define QMM_CASES_8(ROWS, ...)                                                                   \
    QMM_CASE(1, ROWS, __VA_ARGS__) QMM_CASE(2, ROWS, __VA_ARGS__) QMM_CASE(3, ROWS, __VA_ARGS__) \
    QMM_CASE(4, ROWS, __VA_ARGS__) QMM_CASE(5, ROWS, __VA_ARGS__) QMM_CASE(6, ROWS, __VA_ARGS__) \
    QMM_CASE(7, ROWS, __VA_ARGS__) QMM_CASE(8, ROWS, __VA_ARGS__)
#define QMM_CASES_16(ROWS, ...)                                                                  \
    QMM_CASES_8(ROWS, __VA_ARGS__) QMM_CASE(9, ROWS, __VA_ARGS__) QMM_CASE(10, ROWS, __VA_ARGS__) \
    QMM_CASE(11, ROWS, __VA_ARGS__) QMM_CASE(12, ROWS, __VA_ARGS__) QMM_CASE(13, ROWS, __VA_ARGS__) \
    QMM_CASE(14, ROWS, __VA_ARGS__) QMM_CASE(15, ROWS, __VA_ARGS__) QMM_CASE(16, ROWS, __VA_ARGS__)
#define QMM_BY_GROUP(G, ...) QMM_BY_GROUP_(G, __VA_ARGS__)
#define QMM_BY_GROUP_(G, ROWS, WBYTES, ...)                                                      \
    for (int t0 = o0, tile = 16384 / (WBYTES) > 1 ? 16384 / (WBYTES) : 1; t0 < o1; t0 += tile) {  \
        const int t1 = o1 - t0 < tile ? o1 : t0 + tile;                                          \
        for (int r = 0; r < n; r += G)                                                           \
            switch (n - r < G ? n - r : G) { QMM_CASES_##G(ROWS, __VA_ARGS__) }                  \
    }

/* One weight type's kernels for a path (Q: q4k or q6k, T: its block type's suffix), over the
 * path's block function Q_block_ISA and accumulators (ACC_ISA, NACC_ISA(NR) of them for NR rows,
 * ZERO_ISA, SUM_ISA: row t's 8 lanes summed) in groups of GROUP_ISA rows: Q_rows_ISA takes
 * weight rows [o0, o1) against activation rows 0..NR-1 (X, P and Y start at the first), one
 * weight row per pass; Q_ISA the whole matmul. */
#define QMM_TYPE_KERNELS(Q, T, ISA, TARGET)                                                                       \
TARGET INLINE void Q##_rows_##ISA(const int NR, int o0, int o1, int nb, const qmm_block_##T *W,                   \
                                  const qmm_block_q8_K *X, const qmm_pair *P, float *Y, size_t ldy) {            \
    for (int o = o0; o < o1; o++) {                                                                              \
        const qmm_block_##T *w = W + (size_t)o * nb;                                                             \
        ACC_##ISA acc[8];                                                                                        \
        UNROLL                                                                                                   \
        for (int t = 0; t < NACC_##ISA(NR); t++) acc[t] = ZERO_##ISA();                                          \
        for (int b = 0; b < nb; b++) Q##_block_##ISA(NR, w + b, X + b, nb, P + b, nb, acc);                      \
        UNROLL                                                                                                   \
        for (int t = 0; t < NR; t++) Y[t * ldy + o] = SUM_##ISA(acc, t);                                         \
    }                                                                                                            \
}                                                                                                                \
TARGET static void Q##_##ISA(int K, int o0, int o1, int n, const qmm_block_##T *W, const qmm_block_q8_K *X,      \
                             const qmm_pair *P, float *Y, size_t ldy) {                                          \
    const int nb = K / QMM_QK;                                                                                   \
    QMM_BY_GROUP(GROUP_##ISA, Q##_rows_##ISA, nb * (int)sizeof *W, nb, W, X + (size_t)r * nb,                    \
                 P + (size_t)r / 2 * nb, Y + (size_t)r * ldy, ldy)                                               \
}
#define QMM_KERNELS(ISA, TARGET) QMM_TYPE_KERNELS(q4k, q4_K, ISA, TARGET) QMM_TYPE_KERNELS(q6k, q6_K, ISA, TARGET)

/* AVX2: one 8-lane accumulator per activation row. */
typedef __m256 ACC_avx2;
#define NACC_avx2(NR) (NR)
#define GROUP_avx2 8
#define ZERO_avx2 _mm256_setzero_ps
#define SUM_avx2(acc, t) hsum8_avx((acc)[t])
QMM_KERNELS(avx2, AVX2_T)

/* ---------------------------------------------------------------- AVX-512 VNNI */
/* Two activation rows a vector: each 32-byte chunk of a weight block is unpacked in registers
 * into both halves of a 512-bit vector and multiplied by the same chunk of a row pair (the even
 * row in the low half, from the pair table), vpmaddubsw then vpdpwssd (which applies the 16-bit
 * scales and accumulates), 64 bytes an instruction. Lane l of each half gets the integers of the
 * 8-lane paths, so the same bits; the float part also runs on the two rows at once. */
#define AVX512_T __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))

AVX512_T INLINE __m512 pair512(__m256 lo, __m256 hi) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1));
}

AVX512_T INLINE __m512i join512(__m256i lo, __m256i hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

/* A 256-bit vector in both halves of a 512-bit one (from memory: a broadcast load, no ALU op). */
AVX512_T INLINE __m512i twice512(__m256i v) {
    return _mm512_broadcast_i64x4(v);
}

AVX512_T INLINE __m512i twice512_at(const void *p) {
    return twice512(_mm256_loadu_si256((const __m256i *)p));
}

/* One row pair (n = 2, or a last odd row): two chunks of one row in a vector instead, 2g in the
 * low half and 2g+1 in the high half, unpacked by one masked shift and one and; the row's two
 * halves are folded into its 8 lanes at the end of the block. Fewer unpacking ops where only one
 * pair reads each chunk (the 1.5B with qattn: T(2) 75-77 to 73-74 ms). */
#define HIGH_WORDS 0xffff0000u  /* the 16-bit lanes of the high 256 bits */

/* Row a's lanes 8..15 added onto its lanes 0..7 in the low half, row b's in the high half. */
AVX512_T INLINE __m512i fold_pair(__m512i a, __m512i b) {
    return _mm512_add_epi32(_mm512_shuffle_i64x2(a, b, 0x44), _mm512_shuffle_i64x2(a, b, 0xee));
}

/* The integer part of one row pair (NR <= 2) in that layout: q[g] holds chunks 2g and 2g+1 of
 * the weights, sc[g] their scales. */
AVX512_T INLINE __m512i one_pair_avx512(const int NR, const __m512i q[4], const __m512i sc[4],
                                        const qmm_block_q8_K *x, size_t xstride) {
    __m512i a[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
    UNROLL
    for (int g = 0; g < 4; g++)
        UNROLL
        for (int t = 0; t < NR; t++)
            a[t] = _mm512_dpwssd_epi32(a[t], _mm512_maddubs_epi16(q[g], _mm512_loadu_si512(x[t * xstride].qs + 64 * g)), sc[g]);
    return fold_pair(a[0], a[NR - 1]);
}

AVX512_T INLINE __m512i q4k_one_pair_avx512(const int NR, const qmm_block_q4_K *w, const qmm_block_q8_K *x,
                                            size_t xstride, __m512i sm4) {
    const __m512i m4 = _mm512_set1_epi8(0xf);
    __m512i q[4], sc[4];
    UNROLL
    for (int g = 0; g < 4; g++) {
        const __m512i bits = twice512_at(w->qs + 32 * g);
        q[g] = _mm512_and_si512(_mm512_mask_srli_epi16(bits, HIGH_WORDS, bits, 4), m4);
        sc[g] = _mm512_shuffle_epi8(sm4, _mm512_loadu_si512(q4k_scale_pat[2 * g]));
    }
    return one_pair_avx512(NR, q, sc, x, xstride);
}

/* Q6_K chunks 2g and 2g+1 in one vector: their low 4 bits are 64 consecutive bytes of ql (low or
 * high nibbles), their top 2 bits the same 32 bytes of qh shifted by 2 more in the high half. */
AVX512_T INLINE __m512i q6k_two_chunks_avx512(const qmm_block_q6_K *w, int g) {
    const __m512i m4 = _mm512_set1_epi8(0xf), m2 = _mm512_set1_epi8(0x30);
    const __m512i l = _mm512_loadu_si512(w->ql + 64 * (g / 2));
    const __m512i h = twice512_at(w->qh + 32 * (g / 2));
    const __m512i lo = g % 2 ? _mm512_and_si512(_mm512_srli_epi16(l, 4), m4) : _mm512_and_si512(l, m4);
    /* qh bits 2k, 2k+1 of chunk k = c % 4 to bits 4, 5: left by 4 and 2 (k = 0, 1), right by 0 and 2 (k = 2, 3) */
    const __m512i hi = g % 2 ? _mm512_and_si512(_mm512_mask_srli_epi16(h, HIGH_WORDS, h, 2), m2)
                             : _mm512_and_si512(_mm512_mask_slli_epi16(_mm512_slli_epi16(h, 4), HIGH_WORDS, h, 2), m2);
    return _mm512_or_si512(lo, hi);
}

AVX512_T INLINE __m512i q6k_one_pair_avx512(const int NR, const qmm_block_q6_K *w, const qmm_block_q8_K *x,
                                            size_t xstride, __m512i s_lo, __m512i s_hi) {
    __m512i q[4], sc[4];
    UNROLL
    for (int g = 0; g < 4; g++) {
        q[g] = q6k_two_chunks_avx512(w, g);
        sc[g] = _mm512_shuffle_epi8(g < 2 ? s_lo : s_hi, _mm512_loadu_si512(q6k_scale_pat[2 * g % 4]));
    }
    return one_pair_avx512(NR, q, sc, x, xstride);
}

/* The integer part of a block for NR rows (NP pairs): chunks 2g (into a) and 2g+1 (into b, which
 * is a itself from 5 pairs on, where the registers run short; up to 4 pairs the second chain
 * hides vpdpwssd's latency). CHUNKS(g, q0, s0, q1, s1) gives both chunks' quants and scales. */
#define QMM_INT_AVX512(NR, pb, pstride, a, CHUNKS, ONE_PAIR)                                              \
    const int NP = ((NR) + 1) / 2, SPLIT = NP <= 4;                                                      \
    __m512i a[8], a##_b[8];                                                                              \
    UNROLL                                                                                               \
    for (int p = 0; p < NP; p++) a[p] = _mm512_setzero_si512();                                          \
    if ((NR) <= 2) a[0] = ONE_PAIR;                                                                      \
    else {                                                                                               \
    UNROLL                                                                                               \
    for (int p = 0; p < NP; p++) a##_b[p] = _mm512_setzero_si512();                                      \
    UNROLL                                                                                               \
    for (int g = 0; g < 4; g++) {                                                                        \
        __m512i q0, s0, q1, s1;                                                                          \
        CHUNKS(g, q0, s0, q1, s1);                                                                       \
        UNROLL                                                                                           \
        for (int p = 0; p < NP; p++) {                                                                   \
            const int8_t *x = pb[p * (pstride)].qs[2 * g];                                               \
            a[p] = _mm512_dpwssd_epi32(a[p], _mm512_maddubs_epi16(q0, _mm512_load_si512(x)), s0);        \
            const __m512i m = _mm512_maddubs_epi16(q1, _mm512_load_si512(x + 64));                      \
            if (SPLIT) a##_b[p] = _mm512_dpwssd_epi32(a##_b[p], m, s1);                                  \
            else a[p] = _mm512_dpwssd_epi32(a[p], m, s1);                                                \
        }                                                                                                \
    }                                                                                                    \
    UNROLL                                                                                               \
    for (int p = 0; p < NP; p++) a[p] = SPLIT ? _mm512_add_epi32(a[p], a##_b[p]) : a[p];               \
    }

AVX512_T INLINE void q4k_block_avx512(const int NR, const qmm_block_q4_K *w, const qmm_block_q8_K *x, size_t xstride,
                                      const qmm_pair *pb, size_t pstride, __m512 *acc) {
    const __m512i m4 = _mm512_set1_epi8(0xf);
    const __m256i sm = q4k_scales_avx2(w->scales);
    const __m512i sm4 = twice512(sm);
#define Q4K_CHUNKS(g, q0, s0, q1, s1)                                          \
    const __m512i bits = twice512_at(w->qs + 32 * g);                          \
    q0 = _mm512_and_si512(bits, m4);                                           \
    q1 = _mm512_and_si512(_mm512_srli_epi16(bits, 4), m4);                     \
    s0 = _mm512_shuffle_epi8(sm4, twice512_at(q4k_scale_pat[2 * g]));          \
    s1 = _mm512_shuffle_epi8(sm4, twice512_at(q4k_scale_pat[2 * g + 1]))
    QMM_INT_AVX512(NR, pb, pstride, a, Q4K_CHUNKS, q4k_one_pair_avx512(NR, w, x, xstride, sm4))
#undef Q4K_CHUNKS
    int dm;
    memcpy(&dm, &w->d, 4);
    const __m128 ds = _mm_cvtph_ps(_mm_cvtsi32_si128(dm));  /* d, dmin */
    const __m512 dw = _mm512_broadcastss_ps(ds);
    const __m256 mf = _mm256_cvtepi32_ps(_mm256_shuffle_epi8(sm, _mm256_load_si256((const __m256i *)q4k_min_pat)));
    const __m256 mp8 = _mm256_mul_ps(_mm256_broadcastss_ps(_mm_movehdup_ps(ds)), mf);  /* dmin*m */
    const __m512 mp = pair512(mp8, mp8);
    UNROLL
    for (int p = 0; p < NP; p++) {
        const qmm_pair *q = &pb[p * pstride];
        acc[p] = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_load_ps(q->xd)), _mm512_cvtepi32_ps(a[p]), acc[p]);
        acc[p] = _mm512_fnmadd_ps(mp, _mm512_load_ps(q->xm), acc[p]);
    }
}

/* Q6_K chunk c (0..7, element order) in both halves: its low 4 bits are 32 bytes of ql (low or
 * high nibbles), its top 2 bits a bit pair of the 32 bytes of qh it shares with 3 other chunks.
 * q6k_chunk_avx2's steps on broadcast loads: that function's result broadcast instead cost
 * 2-5% a Q6_K block and row at n = 4..16 (one thread, cached). */
AVX512_T INLINE __m512i q6k_chunk_avx512(const qmm_block_q6_K *w, int c) {
    const int h = c / 4, k = c % 4;
    const __m512i m4 = _mm512_set1_epi8(0xf);
    const __m512i l = twice512_at(w->ql + 64 * h + 32 * (k & 1));
    const __m512i hb = twice512_at(w->qh + 32 * h);
    const __m512i lo = k < 2 ? _mm512_and_si512(l, m4) : _mm512_and_si512(_mm512_srli_epi16(l, 4), m4);
    const __m512i hi = k == 0 ? _mm512_slli_epi16(_mm512_and_si512(hb, _mm512_set1_epi8(3)), 4)
                     : k == 1 ? _mm512_slli_epi16(_mm512_and_si512(hb, _mm512_set1_epi8(12)), 2)
                     : k == 2 ? _mm512_and_si512(hb, _mm512_set1_epi8(48))
                              : _mm512_srli_epi16(_mm512_and_si512(hb, _mm512_set1_epi8(-64)), 2);
    return _mm512_or_si512(lo, hi);
}

AVX512_T INLINE void q6k_block_avx512(const int NR, const qmm_block_q6_K *w, const qmm_block_q8_K *x, size_t xstride,
                                      const qmm_pair *pb, size_t pstride, __m512 *acc) {
    const __m256i s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)w->scales));
    const __m512i s_lo = twice512(_mm256_permute2x128_si256(s16, s16, 0x00)), s_hi = twice512(_mm256_permute2x128_si256(s16, s16, 0x11));
#define Q6K_CHUNKS(g, q0, s0, q1, s1)                                                  \
    q0 = q6k_chunk_avx512(w, 2 * g);                                                   \
    q1 = q6k_chunk_avx512(w, 2 * g + 1);                                               \
    s0 = _mm512_shuffle_epi8(g < 2 ? s_lo : s_hi, twice512_at(q6k_scale_pat[2 * g % 4]));     \
    s1 = _mm512_shuffle_epi8(g < 2 ? s_lo : s_hi, twice512_at(q6k_scale_pat[(2 * g + 1) % 4]))
    QMM_INT_AVX512(NR, pb, pstride, a, Q6K_CHUNKS, q6k_one_pair_avx512(NR, w, x, xstride, s_lo, s_hi))
#undef Q6K_CHUNKS
    const __m512 dw = _mm512_set1_ps(_cvtsh_ss(w->d));
    const __m512i s32 = join512(s16, s16);
    UNROLL
    for (int p = 0; p < NP; p++) {
        const qmm_pair *q = &pb[p * pstride];
        const __m512i ms = _mm512_madd_epi16(_mm512_load_si512(q->bsums), s32);
        const __m512i is = _mm512_sub_epi32(a[p], _mm512_slli_epi32(ms, 5));
        acc[p] = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_load_ps(q->xd)), _mm512_cvtepi32_ps(is), acc[p]);
    }
}

/* Row 2p in the low half of accumulator p, row 2p+1 in the high half. */
typedef __m512 ACC_avx512;
#define NACC_avx512(NR) (((NR) + 1) / 2)
#define GROUP_avx512 16
#define ZERO_avx512 _mm512_setzero_ps
#define SUM_avx512(acc, t) hsum8_avx((t) & 1 ? _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd((acc)[(t) / 2]), 1)) \
                                             : _mm512_castps512_ps256((acc)[(t) / 2]))
QMM_KERNELS(avx512, AVX512_T)
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

/* AVX2 wherever the CPU has it, for one row; see auto_path for batches. */
int qmm_best_path(void) {
    return have(QMM_AVX2) ? QMM_AVX2 : QMM_SCALAR;
}

/* QMM_AUTO for n rows: AVX-512 VNNI from 2 rows where the CPU has it. Every path gives the same
 * bits, so the choice may follow n. On a 2-core AVX-512 Xeon VM, one thread, ns a Q4_K block and
 * row, cached: AVX2 9.7, 6.8, 5.4, 4.7 at n = 1, 2, 4, 16; AVX-512 VNNI 5.4-5.7, 3.8, 2.5 at
 * n = 2, 4, 16. */
static int auto_path(int n) {
    return n >= 2 && have(QMM_AVX512) ? QMM_AVX512 : qmm_best_path();
}

const char *qmm_path_name(int path) {
    static const char *names[] = {"auto", "scalar", "avx2", "avx512vnni"};
    return path >= 0 && path <= 3 ? names[path] : "?";
}

static int check(int *path, int K, int o0, int o1, int n) {
    if (*path == QMM_AUTO) *path = auto_path(n);
    return have(*path) && K > 0 && K % QMM_QK == 0 && n >= 1 && n <= QMM_MAX_ROWS && o0 >= 0 && o1 >= o0;
}

int qmm_q4_K(int path, int K, int o0, int o1, int n, const qmm_block_q4_K *W,
             const qmm_block_q8_K *X, float *Y, size_t ldy) {
    if (!check(&path, K, o0, o1, n)) return -1;
    const qmm_pair *P = row_pairs(n, K / QMM_QK, X, path == QMM_AVX512 && n > 2);
    if (!P) return -1;
#ifdef QMM_X86
    if (path == QMM_AVX512) { q4k_avx512(K, o0, o1, n, W, X, P, Y, ldy); return 0; }
    /* Both AVX2 kernels give the same bits, so the choice may follow n: in the real 1.5B one
     * weight row per pass was faster up to n = 8, two from n = 32 (n = 16 a tie). */
    if (path == QMM_AVX2) { q4k_avx2(K, o0, o1, n, W, X, P, Y, ldy); return 0; }
#endif
    q4k_scalar(K, o0, o1, n, W, X, P, Y, ldy);
    return 0;
}

int qmm_q6_K(int path, int K, int o0, int o1, int n, const qmm_block_q6_K *W,
             const qmm_block_q8_K *X, float *Y, size_t ldy) {
    if (!check(&path, K, o0, o1, n)) return -1;
#ifdef QMM_X86
    if (path == QMM_AVX512) {
        const qmm_pair *P = row_pairs(n, K / QMM_QK, X, n > 2);
        if (!P) return -1;
        q6k_avx512(K, o0, o1, n, W, X, P, Y, ldy);
        return 0;
    }
    if (path == QMM_AVX2) { q6k_avx2(K, o0, o1, n, W, X, NULL, Y, ldy); return 0; }  /* reads X alone */
#endif
    q6k_scalar(K, o0, o1, n, W, X, Y, ldy);
    return 0;
}
