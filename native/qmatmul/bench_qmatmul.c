/* T(n)/T(1) of qmatmul against llama.cpp's own CPU matmul (ggml graph, Q4_K weights in the
 * repack buffer as llama.cpp places them, Q6_K plain), same process, same threads, n = 1..64:
 *   ffn  - the 1.5B's FFN up shape, 8960 x 1536 Q4_K, 16 copies cycled so the weights come
 *          from memory as in a decode, not from the 32 MB L3;
 *   down - the FFN down shape, 1536 x 8960 Q4_K, 16 copies;
 *   out  - the Q6_K output matrix, 151936 x 1536;
 *   model - every matmul of one Qwen2.5 1.5B Q4_K_M pass (28 layers: q, k, v, o, gate, up,
 *          down, Q6_K attn_v/ffn_down in half of them, Q6_K output), 980 MB of weights;
 *   micro - ours alone on one thread: ns per weight block and activation row;
 *   check - the patched ggml's result against ours, bit for bit, n = 1..64.
 * Ours and ggml's alternate rep by rep; each column is the fastest of the reps. The "ours"
 * column is this file's own thread pool, not llama.cpp's: on two threads it has run up to 1.6x
 * slower than the same kernel inside the patched ggml, so only the ggml columns measure llama.cpp.
 * Both sides quantize their activations to Q8_K inside the timing (ggml does it per mul_mat).
 * Also checks ours against ggml's results (relative error) and whether ggml's row 0 keeps its
 * bits when the batch grows.
 *
 *   V=.venv/lib/python3*\/site-packages/llama_cpp/lib G=/tmp/src/llama_cpp_python-0.3.36/vendor/llama.cpp/ggml
 *   cc -O2 -ffp-contract=off -pthread -I$G/include native/qmatmul/qmatmul.c native/qmatmul/bench_qmatmul.c \
 *      -L$V -Wl,-rpath,$(realpath $V) -lggml -lggml-base -lggml-cpu -lm -o /tmp/bench_qmatmul
 *   flock /tmp/edgespec-cpu.lock /tmp/bench_qmatmul [threads=2] [path: avx2|avx512vnni|auto]
 *       [ffn,down,out,model,micro,check] [repack|norepack] [batch sizes, default 1,2,4,8,16,32,64]
 * With LD_LIBRARY_PATH pointing at a ggml built with llama_cpp_qmatmul.py's patch (and norepack),
 * the ggml columns are llama.cpp's patched matmul.
 */
#define _GNU_SOURCE
#include "qmatmul.h"

#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static uint64_t rnd64(void) { rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17; return rng; }

/* Random blocks with finite, decode-sized scales. */
static void fill_blocks(void *p, enum ggml_type t, size_t nblocks) {
    size_t bs = t == GGML_TYPE_Q4_K ? sizeof(qmm_block_q4_K) : sizeof(qmm_block_q6_K);
    uint64_t *u = p;
    for (size_t i = 0; i < nblocks * bs / 8; i++) u[i] = rnd64();
    for (size_t i = 0; i < nblocks; i++) {
        if (t == GGML_TYPE_Q4_K) {
            qmm_block_q4_K *b = (qmm_block_q4_K *)p + i;
            b->d = qmm_float_to_half(ldexpf(1.f + (rnd64() & 1023) / 1024.f, -11));
            b->dmin = qmm_float_to_half(ldexpf(1.f + (rnd64() & 1023) / 1024.f, -12));
        } else {
            qmm_block_q6_K *b = (qmm_block_q6_K *)p + i;
            b->d = qmm_float_to_half(ldexpf(1.f + (rnd64() & 1023) / 1024.f, -13));
        }
    }
}

typedef struct {
    enum ggml_type type;
    int M, K;
    void *w;                 /* our copy */
    struct ggml_tensor *gw;  /* ggml's (repacked for Q4_K) */
} mat;

/* ---------------------------------------------------------------- our side, on a thread pool */
static struct {
    int threads, path, n;
    mat *mats;
    int nmats;
    const float *x[2];          /* activations for K = 1536 and K = 8960 */
    qmm_block_q8_K *xq;         /* quantized activations of the current matrix */
    float *y;
    atomic_int arrived, gen, stop, awake, go;
    ggml_from_float_t q8;
} P;

static void barrier(void) {
    int g = atomic_load(&P.gen);
    if (atomic_fetch_add(&P.arrived, 1) == P.threads - 1) {
        atomic_store(&P.arrived, 0);
        atomic_fetch_add(&P.gen, 1);
    } else {
        while (atomic_load(&P.gen) == g) __builtin_ia32_pause();
    }
}

static void pass(int t) {
    for (int i = 0; i < P.nmats; i++) {
        mat *m = &P.mats[i];
        const float *x = P.x[m->K != 1536];
        for (int r = t; r < P.n; r += P.threads) P.q8(x + (size_t)r * m->K, P.xq + (size_t)r * (m->K / 256), m->K);
        barrier();
        int o0 = (int)((long)m->M * t / P.threads), o1 = (int)((long)m->M * (t + 1) / P.threads);
        if (m->type == GGML_TYPE_Q4_K) qmm_q4_K(P.path, m->K, o0, o1, P.n, m->w, P.xq, P.y, m->M);
        else qmm_q6_K(P.path, m->K, o0, o1, P.n, m->w, P.xq, P.y, m->M);
        barrier();
    }
}

/* Between passes the workers sleep on a condition variable: a spinning worker would take a core
 * from ggml's threads while ggml is timed. */
static pthread_mutex_t start_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t start_cv = PTHREAD_COND_INITIALIZER;
static int start_gen;

static void *worker(void *arg) {
    int t = (int)(long)arg, seen = 0;
    for (;;) {
        pthread_mutex_lock(&start_mu);
        while (start_gen == seen) pthread_cond_wait(&start_cv, &start_mu);
        seen = start_gen;
        pthread_mutex_unlock(&start_mu);
        if (atomic_load(&P.stop)) return NULL;
        atomic_fetch_add(&P.awake, 1);
        while (atomic_load(&P.go) != seen) __builtin_ia32_pause();
        pass(t);
    }
}

static void start_workers(void) {
    pthread_mutex_lock(&start_mu);
    start_gen++;
    pthread_cond_broadcast(&start_cv);
    pthread_mutex_unlock(&start_mu);
}

static double ours(mat *mats, int nmats, int n) {
    P.mats = mats; P.nmats = nmats; P.n = n;
    /* the workers are woken before the clock starts: their wake-up is not the kernel's time */
    atomic_store(&P.awake, 0);
    start_workers();
    while (atomic_load(&P.awake) != P.threads - 1) __builtin_ia32_pause();
    double t0 = now();
    atomic_store(&P.go, start_gen);
    pass(0);
    return now() - t0;
}

/* ---------------------------------------------------------------- ggml's side */
static ggml_backend_t backend;

typedef struct {
    struct ggml_context *ctx;
    struct ggml_cgraph *gf;
    struct ggml_tensor *first;
    ggml_backend_buffer_t buf;
} graph;

static graph build(mat *mats, int nmats, int n, const float *x1536, const float *x8960) {
    graph g;
    struct ggml_init_params ip = {.mem_size = ggml_tensor_overhead() * (nmats + 8) + ggml_graph_overhead_custom(4096, false), .no_alloc = true};
    g.ctx = ggml_init(ip);
    struct ggml_tensor *xa = ggml_new_tensor_2d(g.ctx, GGML_TYPE_F32, 1536, n), *xb = ggml_new_tensor_2d(g.ctx, GGML_TYPE_F32, 8960, n);
    g.gf = ggml_new_graph_custom(g.ctx, 4096, false);
    g.first = NULL;
    for (int i = 0; i < nmats; i++) {
        struct ggml_tensor *y = ggml_mul_mat(g.ctx, mats[i].gw, mats[i].K == 1536 ? xa : xb);
        if (!g.first) g.first = y;
        ggml_build_forward_expand(g.gf, y);
    }
    g.buf = ggml_backend_alloc_ctx_tensors_from_buft(g.ctx, ggml_backend_cpu_buffer_type());
    ggml_backend_tensor_set(xa, x1536, 0, sizeof(float) * 1536 * n);
    ggml_backend_tensor_set(xb, x8960, 0, sizeof(float) * 8960 * n);
    return g;
}

static double timed(graph *g) {
    double t0 = now();
    ggml_backend_graph_compute(backend, g->gf);
    return now() - t0;
}

static void release(graph *g, float *out_first) {
    if (out_first) ggml_backend_tensor_get(g->first, out_first, 0, ggml_nbytes(g->first));
    ggml_backend_buffer_free(g->buf);
    ggml_free(g->ctx);
}

static double theirs(mat *mats, int nmats, int n, const float *x1536, const float *x8960, float *out_first, int reps) {
    graph g = build(mats, nmats, n, x1536, x8960);
    double best = 1e30;
    for (int r = 0; r < reps; r++) best = fmin(best, timed(&g));
    release(&g, out_first);
    return best;
}

/* Weights for both sides: ours as blocks, ggml's through its buffer types. */
static void make_weights(mat *mats, int nmats, ggml_backend_buffer_type_t repack) {
    struct ggml_init_params ip = {.mem_size = ggml_tensor_overhead() * (nmats + 1), .no_alloc = true};
    struct ggml_context *c4 = ggml_init(ip), *c6 = ggml_init(ip);
    int n6 = 0;
    for (int i = 0; i < nmats; i++) {
        mat *m = &mats[i];
        size_t nb = (size_t)m->M * (m->K / 256), bs = m->type == GGML_TYPE_Q4_K ? 144 : 210;
        m->w = aligned_alloc(64, (nb * bs + 63) / 64 * 64);
        fill_blocks(m->w, m->type, nb);
        m->gw = ggml_new_tensor_2d(m->type == GGML_TYPE_Q4_K ? c4 : c6, m->type, m->K, m->M);
        n6 += m->type != GGML_TYPE_Q4_K;
    }
    ggml_backend_alloc_ctx_tensors_from_buft(c4, repack ? repack : ggml_backend_cpu_buffer_type());
    if (n6) ggml_backend_alloc_ctx_tensors_from_buft(c6, ggml_backend_cpu_buffer_type());
    for (int i = 0; i < nmats; i++) ggml_backend_tensor_set(mats[i].gw, mats[i].w, 0, ggml_nbytes(mats[i].gw));
}

static int ns[7] = {1, 2, 4, 8, 16, 32, 64}, nns = 7;

static void run(const char *name, mat *mats, int nmats, const float *x1536, const float *x8960, int reps) {
    double to[7], tg[7];
    const int M0 = mats[0].M;
    float *g1 = malloc(sizeof(float) * M0 * 64), *gn = malloc(sizeof(float) * M0 * 64), *o1 = malloc(sizeof(float) * M0 * 64);
    theirs(mats, nmats, 1, x1536, x8960, g1, 1);  /* warm-up, and ggml's one-row result */
    printf("%s: %d matmuls\n  n   ours ms  ours T(n)/T(1)   ggml ms  ggml T(n)/T(1)   ours/ggml   ggml row0 bits kept   ours vs ggml max rel err\n", name, nmats);
    for (int k = 0; k < nns; k++) {
        int n = ns[k];
        /* ours and ggml's alternate, so that other load on the machine falls on both */
        graph g = build(mats, nmats, n, x1536, x8960);
        timed(&g);
        to[k] = tg[k] = 1e30;
        for (int r = 0; r < reps; r++) {
            to[k] = fmin(to[k], ours(mats, nmats, n));
            tg[k] = fmin(tg[k], timed(&g));
        }
        release(&g, gn);
        /* ours for matrix 0 alone, to compare with ggml's result */
        P.n = n;
        for (int r = 0; r < n; r++) P.q8(x1536 + (size_t)r * 1536, P.xq + (size_t)r * 6, 1536);
        if (mats[0].type == GGML_TYPE_Q4_K) qmm_q4_K(P.path, 1536, 0, M0, n, mats[0].w, P.xq, o1, M0);
        double err = 0, mag = 0;
        for (int i = 0; i < M0 * n; i++) { err = fmax(err, fabs(o1[i] - gn[i])); mag = fmax(mag, fabs(gn[i])); }
        int kept = !memcmp(g1, gn, sizeof(float) * M0);
        printf("%3d  %8.2f  %8.2f        %8.2f  %8.2f        %6.2f      %-5s                 %.2g\n", n, to[k] * 1e3, to[k] / to[0],
               tg[k] * 1e3, tg[k] / tg[0], to[k] / tg[k], kept ? "yes" : "NO", err / mag);
    }
    free(g1); free(gn); free(o1);
}

int main(int argc, char **argv) {
    int threads = argc > 1 ? atoi(argv[1]) : 2;
    int path = QMM_AUTO;
    if (argc > 2)
        path = !strcmp(argv[2], "avx2") ? QMM_AVX2 : !strcmp(argv[2], "avx512vnni") ? QMM_AVX512 : QMM_AUTO;
    if (path == QMM_AUTO) path = qmm_best_path();
    const char *which = argc > 3 ? argv[3] : "ffn,model";
    ggml_cpu_init();
    backend = ggml_backend_cpu_init();
    ggml_backend_cpu_set_n_threads(backend, threads);
    ggml_backend_reg_t reg = ggml_backend_cpu_reg();
    ggml_backend_dev_t dev = ggml_backend_reg_dev_get(reg, 0);
    ggml_backend_dev_get_extra_bufts_t extra = (ggml_backend_dev_get_extra_bufts_t)ggml_backend_reg_get_proc_address(reg, "ggml_backend_dev_get_extra_bufts");
    ggml_backend_buffer_type_t repack = NULL;
    /* "norepack": Q4_K in the plain CPU buffer, as llama.cpp places it when the repack buffer
     * does not take Q4_K (native/qmatmul/llama_cpp_qmatmul.py's patched build). */
    const int norepack = argc > 4 && !strcmp(argv[4], "norepack");
    if (argc > 5) {  /* the batch sizes, e.g. 1,2,4,8,16 */
        nns = 0;
        for (char *p = argv[5]; *p && nns < 7; p += strcspn(p, ","), p += *p == ',') ns[nns++] = atoi(p);
    }
    for (ggml_backend_buffer_type_t *b = extra && !norepack ? extra(dev) : NULL; b && *b; b++)
        if (strstr(ggml_backend_buft_name(*b), "REPACK")) repack = *b;
    printf("threads %d, our path %s, ggml Q4_K weights in %s\n", threads, qmm_path_name(path), repack ? ggml_backend_buft_name(repack) : "CPU (no repack)");

    P.threads = threads; P.path = path;
    P.q8 = ggml_get_type_traits_cpu(GGML_TYPE_Q8_K)->from_float;
    P.xq = aligned_alloc(64, sizeof(qmm_block_q8_K) * 64 * 35);
    P.y = aligned_alloc(64, sizeof(float) * 64 * 151936);
    float *x1536 = malloc(sizeof(float) * 1536 * 64), *x8960 = malloc(sizeof(float) * 8960 * 64);
    for (int i = 0; i < 1536 * 64; i++) x1536[i] = (float)((int64_t)(rnd64() % 2001) - 1000) / 1000.f;
    for (int i = 0; i < 8960 * 64; i++) x8960[i] = (float)((int64_t)(rnd64() % 2001) - 1000) / 1000.f;
    P.x[0] = x1536; P.x[1] = x8960;
    pthread_t th[64];
    for (int t = 1; t < threads; t++) pthread_create(&th[t], NULL, worker, (void *)(long)t);

    if (strstr(which, "check")) {
        /* Small and quick: ggml's result for a Q4_K and a Q6_K matrix against ours, bit for bit,
         * n = 1..64 (equal only with the patched ggml, where ggml's matmul is ours). */
        mat c[2] = {{GGML_TYPE_Q4_K, 64, 1536, 0, 0}, {GGML_TYPE_Q6_K, 64, 1536, 0, 0}};
        make_weights(c, 2, repack);
        float *g = malloc(sizeof(float) * 64 * 64), *y = malloc(sizeof(float) * 64 * 64);
        for (int k = 0; k < 2; k++) {
            int same = 0;
            for (int n = 1; n <= 64; n++) {
                theirs(&c[k], 1, n, x1536, x8960, g, 1);
                for (int r = 0; r < n; r++) P.q8(x1536 + (size_t)r * 1536, P.xq + (size_t)r * 6, 1536);
                if (k == 0) qmm_q4_K(P.path, 1536, 0, 64, n, c[k].w, P.xq, y, 64);
                else qmm_q6_K(P.path, 1536, 0, 64, n, c[k].w, P.xq, y, 64);
                same += !memcmp(g, y, sizeof(float) * 64 * n);
            }
            printf("check %s: ggml's mul_mat equals qmatmul bit for bit for %d of 64 batch sizes\n", k ? "Q6_K" : "Q4_K", same);
        }
        free(g); free(y);
    }
    if (strstr(which, "micro")) {
        /* One thread: ns per weight block per activation row of Q4_K and Q6_K, weights in cache
         * (256 x 1536 Q4_K, 221 KB, repeated) and streamed (16 copies of 8960 x 1536, 124 MB of
         * Q4_K, 181 MB of Q6_K): compute cost apart from memory, and with it. */
        mat c4 = {GGML_TYPE_Q4_K, 256, 1536, 0, 0}, c6 = {GGML_TYPE_Q6_K, 256, 1536, 0, 0};
        make_weights(&c4, 1, NULL);
        make_weights(&c6, 1, NULL);
        mat s4[16], s6[16];
        for (int i = 0; i < 16; i++) s4[i] = (mat){GGML_TYPE_Q4_K, 8960, 1536, 0, 0}, s6[i] = (mat){GGML_TYPE_Q6_K, 8960, 1536, 0, 0};
        make_weights(s4, 16, NULL);
        make_weights(s6, 16, NULL);
        for (int k = 0; k < nns; k++) {
            const int n = ns[k];
            for (int r = 0; r < n; r++) P.q8(x1536 + (size_t)r * 1536, P.xq + (size_t)r * 6, 1536);
            double c[2] = {1e30, 1e30}, st[2] = {1e30, 1e30};
            for (int rep = 0; rep < 5; rep++) {
                double t0 = now();
                for (int i = 0; i < 20; i++) qmm_q4_K(P.path, 1536, 0, 256, n, c4.w, P.xq, P.y, 256);
                c[0] = fmin(c[0], (now() - t0) / 20);
                t0 = now();
                for (int i = 0; i < 20; i++) qmm_q6_K(P.path, 1536, 0, 256, n, c6.w, P.xq, P.y, 256);
                c[1] = fmin(c[1], (now() - t0) / 20);
                t0 = now();
                for (int i = 0; i < 16; i++) qmm_q4_K(P.path, 1536, 0, 8960, n, s4[i].w, P.xq, P.y, 8960);
                st[0] = fmin(st[0], (now() - t0) / 16);
                t0 = now();
                for (int i = 0; i < 16; i++) qmm_q6_K(P.path, 1536, 0, 8960, n, s6[i].w, P.xq, P.y, 8960);
                st[1] = fmin(st[1], (now() - t0) / 16);
            }
            printf("micro n=%2d: Q4_K cached %5.2f streamed %5.2f ns/block-row (%4.1f GB/s) | Q6_K cached %5.2f streamed %5.2f (%4.1f GB/s)\n", n,
                   c[0] * 1e9 / (256 * 6 * n), st[0] * 1e9 / (8960 * 6 * n), 8960 * 6 * 144 / st[0] / 1e9,
                   c[1] * 1e9 / (256 * 6 * n), st[1] * 1e9 / (8960 * 6 * n), 8960 * 6 * 210 / st[1] / 1e9);
        }
    }
    if (strstr(which, "ffn")) {
        mat ffn[16];
        for (int i = 0; i < 16; i++) ffn[i] = (mat){GGML_TYPE_Q4_K, 8960, 1536, 0, 0};
        make_weights(ffn, 16, repack);
        run("ffn up 8960x1536 Q4_K (x16 copies, 123 MB)", ffn, 16, x1536, x8960, 5);
    }
    if (strstr(which, "down")) {
        mat down[16];
        for (int i = 0; i < 16; i++) down[i] = (mat){GGML_TYPE_Q4_K, 1536, 8960, 0, 0};
        make_weights(down, 16, repack);
        run("ffn down 1536x8960 Q4_K (x16 copies, 124 MB)", down, 16, x1536, x8960, 5);
    }
    if (strstr(which, "out")) {
        mat out[1] = {{GGML_TYPE_Q6_K, 151936, 1536, 0, 0}};
        make_weights(out, 1, repack);
        run("output 151936x1536 Q6_K (191 MB)", out, 1, x1536, x8960, 5);
    }
    if (strstr(which, "model")) {
        static mat model[28 * 7 + 1];
        int k = 0;
        for (int l = 0; l < 28; l++) {
            enum ggml_type v = l % 2 ? GGML_TYPE_Q6_K : GGML_TYPE_Q4_K;  /* Q4_K_M: half of attn_v, ffn_down */
            model[k++] = (mat){GGML_TYPE_Q4_K, 1536, 1536, 0, 0};
            model[k++] = (mat){GGML_TYPE_Q4_K, 256, 1536, 0, 0};
            model[k++] = (mat){v, 256, 1536, 0, 0};
            model[k++] = (mat){GGML_TYPE_Q4_K, 1536, 1536, 0, 0};
            model[k++] = (mat){GGML_TYPE_Q4_K, 8960, 1536, 0, 0};
            model[k++] = (mat){GGML_TYPE_Q4_K, 8960, 1536, 0, 0};
            model[k++] = (mat){v, 1536, 8960, 0, 0};
        }
        model[k++] = (mat){GGML_TYPE_Q6_K, 151936, 1536, 0, 0};
        make_weights(model, k, repack);
        run("model: Qwen2.5 1.5B Q4_K_M matmuls (980 MB)", model, k, x1536, x8960, 5);
    }
    atomic_store(&P.stop, 1);
    start_workers();
    for (int t = 1; t < threads; t++) pthread_join(th[t], NULL);
    return 0;
}
