"""Routes llama.cpp's CPU matmul of Q4_K and Q6_K weights through native/qmatmul, patched into the
llama.cpp that llama-cpp-python vendors before a build:

    python native/qmatmul/llama_cpp_qmatmul.py SRC   # SRC: llama-cpp-python's extracted source

What it changes in vendor/llama.cpp/ggml/src/ggml-cpu: qmatmul.{c,h} are copied in as
edgespec-qmatmul.{c,h} and added to the CPU backend's sources; ggml_compute_forward_mul_mat
hands a 2-D Q4_K/Q6_K x F32 product to them before any other path (tiled, llamafile, vec_dot),
for every batch size (in chunks of 64 rows), so a row's logits have the same bits in a one-token
decode and in any verification batch; and Q4_K is no longer repacked on AVX2 (the repacked
weights never reach ggml_compute_forward_mul_mat). Same rules as native/llama_cpp_patches.py:
each patch replaces one anchored block; applying twice changes nothing; a missing anchor stops
with one line. All of it is behind a CMake option, GGML_CPU_BATCH_INVARIANT (off unless the build
turns it on, as install_cpu.py does), so the diff (upstream.sh) is one that could go upstream.
"""
from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # native/: the patch rules of llama_cpp_patches.py

import llama_cpp_patches  # isort: skip  (after the path above)
from llama_cpp_patches import MARK, Patch, PatchError  # isort: skip

CPU = "vendor/llama.cpp/ggml/src/ggml-cpu"


OPTION = Patch(
    "batch-invariant-option", "vendor/llama.cpp/ggml/CMakeLists.txt",
    'option(GGML_CPU_KLEIDIAI     "ggml: use KleidiAI optimized kernels if applicable" OFF)\n',
    'option(GGML_CPU_KLEIDIAI     "ggml: use KleidiAI optimized kernels if applicable" OFF)\n'
    f"# {MARK} batch-invariant-option\n"
    'option(GGML_CPU_BATCH_INVARIANT "ggml: CPU Q4_K/Q6_K matmul and F16 flash attention whose rows do not depend on the batch" OFF)\n',
)

SOURCES = Patch(
    "qmatmul-sources", f"{CPU}/CMakeLists.txt",
    "    if (GGML_CPU_REPACK)\n        target_compile_definitions(${GGML_CPU_NAME} PRIVATE GGML_USE_CPU_REPACK)\n    endif()\n",
    "    if (GGML_CPU_REPACK)\n        target_compile_definitions(${GGML_CPU_NAME} PRIVATE GGML_USE_CPU_REPACK)\n    endif()\n\n"
    f"    if (GGML_CPU_BATCH_INVARIANT)  # {MARK} qmatmul-sources\n"
    "        target_compile_definitions(${GGML_CPU_NAME} PRIVATE GGML_USE_CPU_BATCH_INVARIANT)\n"
    "        list(APPEND GGML_CPU_SOURCES\n"
    "            ggml-cpu/edgespec-qmatmul.c\n            ggml-cpu/edgespec-qmatmul.h\n"
    "            ggml-cpu/edgespec-qattn.c\n            ggml-cpu/edgespec-qattn.h)\n"
    "    endif()\n",
)

FORWARD_FN = Patch(
    "qmatmul-forward-fn", f"{CPU}/ggml-cpu.c",
    "void ggml_compute_forward_mul_mat(\n",
    f"#ifdef GGML_USE_CPU_BATCH_INVARIANT  // {MARK} qmatmul-forward-fn\n"
    "// Q4_K/Q6_K x F32, 2-D: each activation row to Q8_K (rows shared out by thread), then each\n"
    "// thread its share of the output rows for up to 64 activation rows at a time. A row's result\n"
    "// does not depend on the batch (edgespec-qmatmul.h).\n"
    "#include \"edgespec-qmatmul.h\"\n"
    "static bool edgespec_qmatmul_forward(const struct ggml_compute_params * params, struct ggml_tensor * dst) {\n"
    "    const struct ggml_tensor * src0 = dst->src[0];\n"
    "    const struct ggml_tensor * src1 = dst->src[1];\n"
    "    if (params->use_ref || (src0->type != GGML_TYPE_Q4_K && src0->type != GGML_TYPE_Q6_K) ||\n"
    "        src1->type != GGML_TYPE_F32 || src0->ne[2] != 1 || src0->ne[3] != 1 || src1->ne[2] != 1 ||\n"
    "        src1->ne[3] != 1 || src0->nb[1] != ggml_row_size(src0->type, src0->ne[0]) ||\n"
    "        src1->nb[0] != sizeof(float) || dst->nb[0] != sizeof(float) || qmm_best_path() == QMM_SCALAR) {\n"
    "        return false;\n"
    "    }\n"
    "    const int ith = params->ith, nth = params->nth;\n"
    "    const int64_t K = src0->ne[0], M = src0->ne[1], N = src1->ne[1];\n"
    "    const size_t row = ggml_row_size(GGML_TYPE_Q8_K, K);\n"
    "    char * wdata = params->wdata;\n"
    "    GGML_ASSERT(params->wsize >= row*N);\n"
    "    for (int64_t r = ith; r < N; r += nth) {\n"
    "        qmm_quantize_q8_K(QMM_AUTO, (const float *) ((const char *) src1->data + r*src1->nb[1]),\n"
    "                          (qmm_block_q8_K *) (wdata + r*row), (int) K);  // ggml's reference, in SIMD\n"
    "    }\n"
    "    ggml_barrier(params->threadpool);\n"
    "    const int o0 = (int) (M*ith/nth), o1 = (int) (M*(ith + 1)/nth);\n"
    "    for (int64_t r0 = 0; r0 < N; r0 += QMM_MAX_ROWS) {\n"
    "        const int n = (int) (N - r0 < QMM_MAX_ROWS ? N - r0 : QMM_MAX_ROWS);\n"
    "        const qmm_block_q8_K * x = (const qmm_block_q8_K *) (wdata + r0*row);\n"
    "        float * y = (float *) ((char *) dst->data + r0*dst->nb[1]);\n"
    "        const size_t ldy = dst->nb[1]/sizeof(float);\n"
    "        const int rc = src0->type == GGML_TYPE_Q4_K\n"
    "            ? qmm_q4_K(QMM_AUTO, (int) K, o0, o1, n, (const qmm_block_q4_K *) src0->data, x, y, ldy)\n"
    "            : qmm_q6_K(QMM_AUTO, (int) K, o0, o1, n, (const qmm_block_q6_K *) src0->data, x, y, ldy);\n"
    "        GGML_ASSERT(rc == 0);\n"
    "    }\n"
    "    return true;\n"
    "}\n"
    "#endif\n\n"
    "void ggml_compute_forward_mul_mat(\n",
)

FORWARD_CALL = Patch(
    "qmatmul-forward-call", f"{CPU}/ggml-cpu.c",
    "    // If tiled is supported, it will execute the full op here and we return\n",
    f"#ifdef GGML_USE_CPU_BATCH_INVARIANT  // {MARK} qmatmul-forward-call\n"
    "    if (edgespec_qmatmul_forward(params, dst)) {\n"
    "        return;\n"
    "    }\n"
    "#endif\n\n"
    "    // If tiled is supported, it will execute the full op here and we return\n",
)

NO_Q4K_REPACK = Patch(
    "qmatmul-no-q4k-repack", f"{CPU}/repack.cpp",
    "    } else if (cur->type == GGML_TYPE_Q4_K) {\n        if (ggml_cpu_has_avx2()) {\n",
    "    } else if (cur->type == GGML_TYPE_Q4_K) {\n"
    f"#ifdef GGML_USE_CPU_BATCH_INVARIANT  // {MARK} qmatmul-no-q4k-repack: read as stored\n"
    "        if (false) {\n"
    "#else\n"
    "        if (ggml_cpu_has_avx2()) {\n"
    "#endif\n",
)

ATTN_HEAD = ("void ggml_compute_forward_flash_attn_ext(\n        const ggml_compute_params * params,\n"
             "        ggml_tensor * dst) {\n")
ATTN = Patch(
    "qattn-forward", f"{CPU}/ops.cpp", ATTN_HEAD,
    f"#ifdef GGML_USE_CPU_BATCH_INVARIANT  // {MARK} qattn-forward\n"
    "// Flash attention over an f16 cache: every query row in one fixed order whatever the batch\n"
    "// (edgespec-qattn.h); other types, ALiBi, soft-capping and sinks keep llama.cpp's kernel.\n"
    "extern \"C\" {\n#include \"edgespec-qattn.h\"\n}\n"
    "static bool edgespec_qattn_forward(const ggml_compute_params * params, ggml_tensor * dst) {\n"
    "    const ggml_tensor * q = dst->src[0], * k = dst->src[1], * v = dst->src[2], * mask = dst->src[3];\n"
    "    float scale, max_bias, softcap;\n"
    "    memcpy(&scale, (const float *) dst->op_params + 0, sizeof(float));\n"
    "    memcpy(&max_bias, (const float *) dst->op_params + 1, sizeof(float));\n"
    "    memcpy(&softcap, (const float *) dst->op_params + 2, sizeof(float));\n"
    "    if (params->use_ref || dst->src[4] || max_bias != 0.0f || softcap != 0.0f || q->type != GGML_TYPE_F32 ||\n"
    "        k->type != GGML_TYPE_F16 || v->type != GGML_TYPE_F16 || q->ne[3] != 1 || k->ne[3] != 1 ||\n"
    "        v->ne[3] != 1 || q->nb[0] != sizeof(float) || k->ne[1] != v->ne[1] || k->ne[2] != v->ne[2] ||\n"
    "        (mask && (mask->type != GGML_TYPE_F16 || mask->ne[0] < k->ne[1] || mask->ne[2] != 1 || mask->ne[3] != 1)) ||\n"
    "        qattn_best_path() == QATTN_SCALAR) {\n"
    "        return false;\n"
    "    }\n"
    "    const qattn_problem p = {\n"
    "        (int) k->ne[0], (int) v->ne[0], (int) q->ne[1], (int) q->ne[2], (int) k->ne[2], (int) k->ne[1], scale,\n"
    "        (const float *) q->data, q->nb[1], q->nb[2],\n"
    "        (const uint16_t *) k->data, k->nb[1], k->nb[2],\n"
    "        (const uint16_t *) v->data, v->nb[1], v->nb[2],\n"
    "        mask ? (const uint16_t *) mask->data : nullptr, mask ? mask->nb[1] : 0,\n"
    "        (float *) dst->data, dst->nb[2], dst->nb[1],\n"
    "    };\n"
    "    const int rc = qattn_f16(QATTN_AUTO, &p, params->ith, params->nth);\n"
    "    GGML_ASSERT(rc != -2 && \"qattn: out of memory\");\n"
    "    return rc == 0;\n"
    "}\n"
    "#endif\n\n"
    + ATTN_HEAD +
    "#ifdef GGML_USE_CPU_BATCH_INVARIANT\n"
    "    if (edgespec_qattn_forward(params, dst)) {\n"
    "        return;\n"
    "    }\n"
    "#endif\n",
)

PATCHES = (OPTION, SOURCES, FORWARD_FN, FORWARD_CALL, NO_Q4K_REPACK, ATTN)
COPIES = {"qmatmul.c": "edgespec-qmatmul.c", "qmatmul.h": "edgespec-qmatmul.h",
          "qattn.c": "edgespec-qattn.c", "qattn.h": "edgespec-qattn.h"}


def copied_text(src: str) -> str:
    """Kernel file ``src`` as it is copied into ggml-cpu (COPIES), its includes renamed too."""
    text = (HERE / src).read_text()
    for name, copy in COPIES.items():
        if name.endswith(".h"):
            text = text.replace(f'#include "{name}"', f'#include "{copy}"')
    return text


def apply_all(root: Path) -> list[str]:
    """Copies the kernel into the tree and applies every patch (llama_cpp_patches.apply_all's
    rules); the names of those that changed something."""
    changed = []
    for src, dst in COPIES.items():
        text = copied_text(src)
        target = root / CPU / dst
        if not target.exists() or target.read_text() != text:
            target.write_text(text)
            changed.append(dst)
    return changed + llama_cpp_patches.apply_all(root, PATCHES)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    try:
        changed = apply_all(Path(argv[1]))
    except (PatchError, OSError) as exc:
        print(f"llama_cpp_qmatmul: {exc}", file=sys.stderr)
        return 1
    print("llama_cpp_qmatmul: " + (", ".join(changed) if changed else "already applied"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
