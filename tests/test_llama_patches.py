"""native/llama_cpp_patches.py: the llama.cpp source patches a CUDA build carries, and how
`doctor` tells a patched build from a stock one."""
from __future__ import annotations

import glob
import importlib.util
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from edgespec.llama.kernels import GRAPHS_PER_SHAPE, cuda_graphs

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "native" / "llama_cpp_patches.py"
_spec = importlib.util.spec_from_file_location("llama_cpp_patches", SCRIPT)
patches = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = patches  # dataclasses look their module up there
_spec.loader.exec_module(patches)

# The two anchors as the pinned llama.cpp has them, amid other text.
STOCK = ("// head\n" + patches.PER_SHAPE_KEY.old + "\n// middle\n"
         "    #ifdef GGML_CUDA_FORCE_MMQ\n        features.push_back({ \"FORCE_MMQ\", \"1\" });\n    #endif\n\n"
         + patches.PER_SHAPE_FEATURE.old + "\n// tail\n")


def stock_text(path: str) -> str:
    """A file that holds every anchor of the patches to ``path``, amid other text."""
    if path == patches.CUDA:
        return STOCK
    return "// head\n" + "// middle\n".join(p.old for p in patches.PATCHES if p.path == path) + "// tail\n"


def tree(tmp_path: Path, texts: dict[str, str] | None = None) -> Path:
    """A llama-cpp-python source tree with the files the patches change."""
    for path in {p.path for p in patches.PATCHES}:
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text((texts or {}).get(path) or stock_text(path))
    return tmp_path


def test_patches_apply_once_and_then_change_nothing(tmp_path):
    root = tree(tmp_path)
    assert patches.apply_all(root) == [p.name for p in patches.PATCHES]
    text = (root / patches.CUDA).read_text()
    assert patches.PER_SHAPE_KEY.old not in text and "<< 48" in text
    assert f'{{ "{GRAPHS_PER_SHAPE}", "1" }}' in text and text.startswith("// head\n") and text.endswith("// tail\n")
    header = (root / patches.LLAMA_H).read_text()
    assert all(f"{name}(struct llama_context * ctx" in header for name in patches.ARGMAX_API + patches.TOPK_API)
    context = (root / patches.CONTEXT_CPP).read_text()
    assert all(f"{name}(llama_context * ctx" in context for name in patches.ARGMAX_API + patches.TOPK_API)
    before = {p.path: (root / p.path).read_text() for p in patches.PATCHES}
    assert patches.apply_all(root) == [] and all((root / k).read_text() == v for k, v in before.items())


def test_a_missing_or_repeated_anchor_stops_the_build(tmp_path):
    changed = STOCK.replace("return cgraph->nodes[0];", "return cgraph->nodes[1];")
    with pytest.raises(patches.PatchError, match="graphs-per-shape' replaces was found 0 times"):
        patches.apply(changed, patches.PER_SHAPE_KEY)
    with pytest.raises(patches.PatchError, match="found 2 times"):
        patches.apply(STOCK + STOCK, patches.PER_SHAPE_FEATURE)
    with pytest.raises(patches.PatchError, match="not found"):
        patches.apply_all(tmp_path)
    assert not (tmp_path / patches.CUDA).exists()
    with pytest.raises(patches.PatchError, match="'argmax-extract' replaces was found 0 times"):
        patches.apply(stock_text(patches.CONTEXT_CPP).replace("needs_raw_logits(", "raw("), next(p for p in patches.PATCHES if p.name == "argmax-extract"))


def test_the_script_says_one_line_and_exits_2_on_a_wrong_folder(tmp_path):
    bad = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path)], capture_output=True, text=True, check=False)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and bad.stderr.startswith("error: ")
    ok = subprocess.run([sys.executable, str(SCRIPT), str(tree(tmp_path / "src"))], capture_output=True, text=True,
                        check=False)
    assert ok.returncode == 0 and "graphs-per-shape" in ok.stdout


# What the patched key reads of llama.cpp's structs, and a main that prints its keys.
KEY_HARNESS = r"""#include <cstdint>
#include <cstdio>
enum ggml_op { GGML_OP_NONE, GGML_OP_ARGMAX, GGML_OP_GET_ROWS };
struct ggml_tensor { int64_t ne[4]; ggml_op op; };
struct ggml_cgraph { int n_nodes; ggml_tensor ** nodes; };
@KEY@
int main() {
    ggml_tensor a{}, b{}; ggml_tensor * nodes[2] = {&a, &b}; ggml_cgraph g{2, nodes};
    const int shapes[4][2] = {{1, 1}, {9, 9}, {9, 1}, {257, 1}};
    for (auto & s : shapes) {
        a.ne[1] = s[0]; b.ne[1] = s[1];
        std::printf("%llx\n", (unsigned long long) ((uintptr_t) ggml_cuda_graph_get_key(&g) ^ (uintptr_t) &a));
    }
    b.op = GGML_OP_ARGMAX; b.ne[0] = 7; b.ne[1] = 1; a.ne[1] = 9;  // the outputs' argmax: [7] ids
    std::printf("%llx\n", (unsigned long long) ((uintptr_t) ggml_cuda_graph_get_key(&g) ^ (uintptr_t) &a));
    b.op = GGML_OP_GET_ROWS; b.ne[0] = 1; b.ne[1] = 40; b.ne[2] = 5;  // the outputs' top k: [1, 40, 5] logits
    std::printf("%llx\n", (unsigned long long) ((uintptr_t) ggml_cuda_graph_get_key(&g) ^ (uintptr_t) &a));
    g.n_nodes = 0;
    std::printf("%llx\n", (unsigned long long) ((uintptr_t) ggml_cuda_graph_get_key(&g) ^ (uintptr_t) &a));
}
"""


def test_the_patched_key_compiles_and_keys_each_shape(tmp_path):
    """The C++ the patch puts in ggml-cuda.cu (host code there), built by this machine's compiler:
    the key is the first node's address with (rows, outputs) mod 256 in bits 48-63, so shapes get
    their own map slots (outputs counted by the argmax's length or the top k's rows where the graph
    ends in them); an
    empty graph keeps llama.cpp's key."""
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    src, exe = tmp_path / "key.cpp", tmp_path / "key"
    src.write_text(KEY_HARNESS.replace("@KEY@", patches.PER_SHAPE_KEY.new))
    subprocess.run([cxx, "-std=c++17", "-Wall", "-Werror", "-o", str(exe), str(src)], check=True)
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split()
    assert [int(x, 16) for x in out] == [(1 << 48) | (1 << 56), (9 << 48) | (9 << 56), (9 << 48) | (1 << 56),
                                         (1 << 48) | (1 << 56), (9 << 48) | (7 << 56), (9 << 48) | (5 << 56),
                                         0]  # 257 rows share 1's slot


def pinned_archive() -> Path:
    """The pinned llama-cpp-python source archive where `make demo GPU=cuda` downloaded it."""
    found = sorted(glob.glob(str(ROOT / "build" / "llama-cpp-python" / "llama_cpp_python-*.tar.gz")))
    if not found:
        pytest.skip("no llama-cpp-python archive in build/ (`make build/llama-cpp-python/.patched` fetches it)")
    return Path(found[-1])


def test_the_pinned_source_takes_the_patches(tmp_path):
    """Where `make demo GPU=cuda` has downloaded the pinned llama-cpp-python source archive: its
    stock files take every patch (the GPU machine's run.sh applies them to the same archive and
    builds it)."""
    texts = {}
    with tarfile.open(pinned_archive()) as tar:
        for member in tar.getmembers():
            path = next((p.path for p in patches.PATCHES if member.name.endswith(p.path)), None)
            if path is not None:
                texts[path] = tar.extractfile(member).read().decode("utf-8")
    root = tree(tmp_path, texts)
    assert set(texts) == {p.path for p in patches.PATCHES}
    assert patches.apply_all(root) == [p.name for p in patches.PATCHES]
    assert patches.apply_all(root) == []


def test_doctor_tells_the_patched_build_from_a_stock_one(monkeypatch):
    assert patches.GRAPHS_PER_SHAPE == GRAPHS_PER_SHAPE  # the word the patch prints is the one read
    # system info of the H100 runs (benchmarks/device/results): stock, then patched; a CPU build
    stock = "CUDA : ARCHS = 900 | USE_GRAPHS = 1 | FA_QUANTS = q4_0-q4_0 | CPU : SSE3 = 1 | AVX2 = 1 |"
    patched = "CUDA : ARCHS = 900 | USE_GRAPHS = 1 | GRAPHS_PER_SHAPE = 1 | FA_QUANTS = q4_0-q4_0 | CPU : SSE3 = 1 |"
    monkeypatch.delenv("GGML_CUDA_DISABLE_GRAPHS", raising=False)
    assert cuda_graphs(stock) == "per-context" and cuda_graphs(patched) == "per-shape"
    monkeypatch.setenv("GGML_CUDA_DISABLE_GRAPHS", "")  # llama.cpp reads any value, even empty
    assert cuda_graphs(patched) == "disabled"
    assert cuda_graphs("CPU : SSE3 = 1 | AVX = 1 | AVX2 = 1 | LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 |") is None


def test_a_cuda_build_is_found_before_llama_cpp_loads_it(tmp_path, monkeypatch):
    """edgespec imports onnxruntime before a CUDA llama.cpp (edgespec/llama/__init__.py): the
    build is told from the libraries llama_cpp will load, LLAMA_CPP_LIB_PATH's and its own."""
    from edgespec.llama import _cuda_build

    own = Path(importlib.util.find_spec("llama_cpp").origin).parent / "lib"
    cuda_here = any(own.glob("*ggml-cuda*"))
    monkeypatch.delenv("LLAMA_CPP_LIB_PATH", raising=False)
    assert _cuda_build() == cuda_here
    monkeypatch.setenv("LLAMA_CPP_LIB_PATH", str(tmp_path))
    (tmp_path / "libggml-cpu.so").touch()
    assert _cuda_build() == cuda_here
    (tmp_path / "libggml-cuda.so").touch()
    assert _cuda_build()
    monkeypatch.chdir(tmp_path)  # llama_cpp reads an empty path as the working directory
    monkeypatch.setenv("LLAMA_CPP_LIB_PATH", "")
    assert _cuda_build()


def test_onnxruntime_is_not_imported_after_llama_cpp(monkeypatch, caplog):
    """Where llama_cpp came first, edgespec leaves onnxruntime alone and says why."""
    import edgespec.llama as el

    monkeypatch.delitem(sys.modules, "onnxruntime", raising=False)
    with caplog.at_level("WARNING", logger="edgespec.llama"):
        el._onnxruntime_first()
    assert "onnxruntime" not in sys.modules
    assert "import edgespec first" in caplog.text


# What of cuBLAS the CUDA backend's common header names, for a toolkit installed without it.
CUBLAS_STUB = """#pragma once
#define CUBLAS_VER_MAJOR 13
#define CUBLAS_VER_MINOR 0
typedef enum { CUBLAS_STATUS_SUCCESS, CUBLAS_STATUS_NOT_INITIALIZED, CUBLAS_STATUS_ALLOC_FAILED,
    CUBLAS_STATUS_INVALID_VALUE, CUBLAS_STATUS_ARCH_MISMATCH, CUBLAS_STATUS_MAPPING_ERROR,
    CUBLAS_STATUS_EXECUTION_FAILED, CUBLAS_STATUS_INTERNAL_ERROR, CUBLAS_STATUS_NOT_SUPPORTED } cublasStatus_t;
typedef struct cublasContext * cublasHandle_t;
typedef enum { CUBLAS_DEFAULT_MATH, CUBLAS_TENSOR_OP_MATH, CUBLAS_TF32_TENSOR_OP_MATH } cublasMath_t;
typedef enum { CUBLAS_COMPUTE_16F, CUBLAS_COMPUTE_32F } cublasComputeType_t;
const char * cublasGetStatusString(cublasStatus_t);
cublasStatus_t cublasCreate(cublasHandle_t *);
cublasStatus_t cublasSetMathMode(cublasHandle_t, cublasMath_t);
cublasStatus_t cublasSetStream(cublasHandle_t, cudaStream_t);
cublasStatus_t cublasSetWorkspace(cublasHandle_t, void *, size_t);
"""


def _ggml_cuda_source(name: str) -> bool:
    """ggml's headers, its src/ files and the CUDA backend's, of the archive's ``name``s."""
    rest = name.partition("/vendor/llama.cpp/ggml/")[2]
    return rest.startswith("include/") or rest.startswith("src/") and (
        "/" not in rest[4:] or rest.startswith("src/ggml-cuda/"))


def test_the_patched_top_k_builds_for_cuda_with_its_radix_select(tmp_path):
    """The radix select llama.cpp wrote for HIP, which the top-k patches build for CUDA: the
    pinned top-k.cu, patched, compiles with this machine's nvcc for the H100/H200, and its op now
    launches the radix kernels (llama.cpp's own TOP_K tests check the results on the GPU machine:
    `bash benchmarks/device/run.sh topk`)."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("no CUDA compiler")
    with tarfile.open(pinned_archive()) as tar:
        tar.extractall(tmp_path, members=[m for m in tar.getmembers() if _ggml_cuda_source(m.name)])
    root = next(tmp_path.glob("llama_cpp_python-*"))
    topk = root / patches.TOPK
    for p in patches.TOPK_ROWS:
        topk.write_text(patches.apply(topk.read_text(encoding="utf-8"), p), encoding="utf-8")
    (tmp_path / "stub").mkdir()
    (tmp_path / "stub" / "cublas_v2.h").write_text(CUBLAS_STUB)
    ggml = topk.parents[2]
    obj = tmp_path / "top-k.o"
    subprocess.run([nvcc, "-std=c++17", "-arch=sm_90", "-O1", f"-I{tmp_path / 'stub'}", f"-I{ggml / 'include'}",
                    f"-I{ggml / 'src'}", f"-I{topk.parent}", "-c", str(topk), "-o", str(obj)], check=True)
    symbols = subprocess.run(["nm", "-C", str(obj)], capture_output=True, text=True, check=True).stdout
    for kernel in ("top_k_radix_histogram", "top_k_radix_select", "top_k_radix_gather"):
        assert kernel in symbols
