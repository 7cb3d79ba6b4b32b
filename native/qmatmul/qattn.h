/* Attention for verification on the CPU: llama.cpp's flash-attention op over an f16 KV cache,
 * computed so that a query row's output has the same bits whatever the number of query rows in
 * the batch, its place there, the number of threads, and how many masked cells follow it. With
 * qmatmul this makes a verified row equal its one-token decode, bit for bit.
 *
 * Each K/V block is converted once and used by every query row that shares it (the heads of one
 * KV head, several tokens); every row still runs the one fixed sequence of operations defined in
 * qattn.c, so grouping changes the speed and never the bits. The tensor layouts are llama.cpp's. */
#ifndef EDGESPEC_QATTN_H
#define EDGESPEC_QATTN_H

#include <stddef.h>
#include <stdint.h>

#define QATTN_MAX_D 256     /* largest head size, K and V */
#define QATTN_CELLS 32      /* cells per block, at fixed offsets from cell 0 */
#define QATTN_MAX_ROWS 32   /* query rows (token x head) that share one pass over K and V */

enum { QATTN_AUTO = 0, QATTN_SCALAR = 1, QATTN_AVX2 = 2 };

typedef struct {
    int dk, dv;                       /* head sizes: multiples of 8, at most QATTN_MAX_D */
    int n_tokens, n_head, n_head_kv;  /* n_head a multiple of n_head_kv */
    int n_kv;                         /* cells of K and V */
    float scale;                      /* applied to q.k before the mask is added */
    /* strides in bytes */
    const float *q; size_t q_token, q_head;       /* dk floats per row */
    const uint16_t *k; size_t k_cell, k_head;     /* IEEE binary16 */
    const uint16_t *v; size_t v_cell, v_head;
    const uint16_t *mask; size_t mask_token;      /* binary16, added to scores; -inf hides a cell; NULL: none */
    float *out; size_t out_token, out_head;       /* dv floats per row */
} qattn_problem;

/* The path QATTN_AUTO picks on this CPU. */
int qattn_best_path(void);

/* Thread ith of nth computes its share of the rows; every thread of a call must pass the same
 * problem and nth. Returns 0, -1 for bad sizes or a path this CPU lacks, -2 when out of memory. */
int qattn_f16(int path, const qattn_problem *p, int ith, int nth);

#endif
