/* Small-batch quantized matmul for verification on the CPU: Y[r][o] = W[o] . X[r] for 1..64
 * activation rows, each weight block read and unpacked once for all rows, and every row summed
 * in one fixed order, so a row's result has the same bits whatever n is and wherever the row
 * sits in the batch (and on every path: scalar, AVX2, AVX-512 VNNI).
 *
 * The block layouts are llama.cpp's (ggml-common.h), so its tensors are used as they are. */
#ifndef EDGESPEC_QMATMUL_H
#define EDGESPEC_QMATMUL_H

#include <stddef.h>
#include <stdint.h>

#define QMM_QK 256
#define QMM_MAX_ROWS 64

typedef uint16_t qmm_half; /* IEEE binary16 bits */

typedef struct {
    qmm_half d;          /* super-block scale for the 6-bit scales */
    qmm_half dmin;       /* super-block scale for the 6-bit mins */
    uint8_t scales[12];  /* 8 scales and 8 mins, 6 bits each */
    uint8_t qs[128];     /* 4-bit quants: byte l of 32-byte group g holds sub-blocks 2g (low) and 2g+1 (high) */
} qmm_block_q4_K;        /* weight = d*sc*q - dmin*m */

typedef struct {
    uint8_t ql[128];     /* low 4 bits */
    uint8_t qh[64];      /* high 2 bits */
    int8_t scales[16];   /* one per 16 weights */
    qmm_half d;
} qmm_block_q6_K;        /* weight = d*sc*(q - 32) */

typedef struct {
    float d;
    int8_t qs[256];
    int16_t bsums[16];   /* sum of each 16 quants */
} qmm_block_q8_K;        /* activation = d*q */

enum { QMM_AUTO = 0, QMM_SCALAR = 1, QMM_AVX2 = 2, QMM_AVX512 = 3 };

/* The path QMM_AUTO picks on this CPU for one row (from 2 rows: AVX-512 VNNI where the CPU has it). */
int qmm_best_path(void);
const char *qmm_path_name(int path);

/* Y[r*ldy + o] for o in [o0, o1), r in [0, n): the dot of weight row o (K/256 blocks, rows
 * consecutive) and activation row r (K/256 blocks, rows consecutive). n in 1..64, K % 256 == 0.
 * Returns 0, or -1 for a path this CPU or build lacks or bad sizes. */
int qmm_q4_K(int path, int K, int o0, int o1, int n, const qmm_block_q4_K *W,
             const qmm_block_q8_K *X, float *Y, size_t ldy);
int qmm_q6_K(int path, int K, int o0, int o1, int n, const qmm_block_q6_K *W,
             const qmm_block_q8_K *X, float *Y, size_t ldy);

/* Activations to Q8_K with the bits of ggml's quantize_row_q8_K_ref (which ggml's x86 CPU backend
 * uses), K % 256 == 0; every path gives the same bits. Returns 0, or -1 as the matmuls do. */
int qmm_quantize_q8_K(int path, const float *x, qmm_block_q8_K *y, int K);

/* fp16 <-> fp32, for tests and benches. */
float qmm_half_to_float(qmm_half h);
qmm_half qmm_float_to_half(float f);

#endif
