"""native/qmatmul: the small-batch Q4_K/Q6_K verification matmul and the attention beside it.
Compiles the C tests and the library with the system C compiler, runs the C tests, and checks
through ctypes that each row's result has the same bits whatever the batch size (1..64) and the
row's place in it, on every path this CPU has, and that it is the dot of the blocks as gguf-py
dequantizes them (the attention: softmax attention in numpy)."""
from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "native" / "qmatmul"
CC = shutil.which("cc") or shutil.which("gcc")
FLAGS = ["-O2", "-ffp-contract=off", "-Wall", "-Werror"]
SCALAR, AVX2, AVX512 = 1, 2, 3
Q4_K, Q6_K = GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K
BLOCK = {Q4_K: 144, Q6_K: 210}
Q8_K_BLOCK = 292  # float d, int8 qs[256], int16 bsums[16]

pytestmark = pytest.mark.skipif(CC is None, reason="no C compiler")


@pytest.fixture(scope="module")
def build(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("qmatmul")
    subprocess.run([CC, *FLAGS, str(SRC / "qmatmul.c"), str(SRC / "test_qmatmul.c"), "-lm",
                    "-o", str(out / "test_qmatmul")], check=True)
    subprocess.run([CC, *FLAGS, str(SRC / "qmatmul.c"), str(SRC / "qattn.c"), str(SRC / "test_qattn.c"), "-lm",
                    "-o", str(out / "test_qattn")], check=True)
    subprocess.run([CC, *FLAGS, "-shared", "-fPIC", str(SRC / "qmatmul.c"), str(SRC / "qattn.c"), "-lm",
                    "-o", str(out / "libqmatmul.so")], check=True)
    return out


@pytest.fixture(scope="module")
def lib(build):
    lib = ctypes.CDLL(str(build / "libqmatmul.so"))
    for name in ("qmm_q4_K", "qmm_q6_K"):
        fn = getattr(lib, name)
        fn.argtypes = [ctypes.c_int] * 5 + [ctypes.c_void_p] * 3 + [ctypes.c_size_t]
        fn.restype = ctypes.c_int
    return lib


def test_c_tests_pass(build):
    run = subprocess.run([str(build / "test_qmatmul")], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "all passed" in run.stdout
    assert " differ in any bit" in run.stdout and "FAIL" not in run.stdout


def test_c_attention_tests_pass(build):
    run = subprocess.run([str(build / "test_qattn")], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "all passed" in run.stdout and "FAIL" not in run.stdout


class Problem(ctypes.Structure):  # qattn_problem (native/qmatmul/qattn.h)
    _fields_ = [(n, ctypes.c_int) for n in ("dk", "dv", "n_tokens", "n_head", "n_head_kv", "n_kv")] + [
        ("scale", ctypes.c_float),
        ("q", ctypes.c_void_p), ("q_token", ctypes.c_size_t), ("q_head", ctypes.c_size_t),
        ("k", ctypes.c_void_p), ("k_cell", ctypes.c_size_t), ("k_head", ctypes.c_size_t),
        ("v", ctypes.c_void_p), ("v_cell", ctypes.c_size_t), ("v_head", ctypes.c_size_t),
        ("mask", ctypes.c_void_p), ("mask_token", ctypes.c_size_t),
        ("out", ctypes.c_void_p), ("out_token", ctypes.c_size_t), ("out_head", ctypes.c_size_t)]


def attention(lib, path, q, k, v, mask, nth=2) -> np.ndarray:
    """qattn over q (tokens, heads, d) f32, k/v (kv heads, cells, d) f16, mask (tokens, cells) f16."""
    n, h, dk = q.shape
    out = np.full((n, h, v.shape[2]), np.nan, np.float32)
    p = Problem(dk, v.shape[2], n, h, k.shape[0], k.shape[1], 1 / np.sqrt(dk),
                q.ctypes.data, *q.strides[:2], k.ctypes.data, k.strides[1], k.strides[0],
                v.ctypes.data, v.strides[1], v.strides[0], mask.ctypes.data, mask.strides[0],
                out.ctypes.data, *out.strides[:2])
    for ith in range(nth):
        assert lib.qattn_f16(path, ctypes.byref(p), ith, nth) == 0
    return out


@pytest.mark.parametrize("path", [SCALAR, AVX2])
def test_attention_rows_keep_their_bits_and_match_softmax(lib, path):
    """Qwen2.5-1.5B's heads (12 query heads on 2 KV heads of 128): the rows of a 9-token batch equal
    the same tokens computed alone with fewer cells, and softmax attention in float64."""
    if path == AVX2 and lib.qattn_best_path() != AVX2:
        pytest.skip("no AVX2 on this CPU")
    rng = np.random.default_rng(7)
    n, cells, start = 9, 300, 280
    q = rng.standard_normal((n, 12, 128)).astype(np.float32)
    k = rng.uniform(-1, 1, (2, cells, 128)).astype(np.float16)
    v = rng.uniform(-1, 1, (2, cells, 128)).astype(np.float16)
    visible = np.arange(cells)[None, :] <= start + np.arange(n)[:, None]
    mask = np.where(visible, 0, -np.inf).astype(np.float16)
    batch = attention(lib, path, q, k, v, mask, nth=3)
    for t in range(n):
        alone = attention(lib, path, q[t:t + 1].copy(), k[:, :start + t + 1].copy(), v[:, :start + t + 1].copy(),
                          mask[t:t + 1, :start + t + 1].copy(), nth=1)
        assert np.array_equal(batch[t], alone[0]), t
    s = np.einsum("thd,hcd->thc", q.astype(np.float64), np.repeat(k, 6, axis=0).astype(np.float64)) / np.sqrt(128)
    s = np.where(visible[:, None, :], s, -np.inf)
    p = np.exp(s - s.max(axis=2, keepdims=True))
    want = np.einsum("thc,hcd->thd", p / p.sum(axis=2, keepdims=True), np.repeat(v, 6, axis=0).astype(np.float64))
    assert np.abs(batch - want).max() < 1e-5


def weights(rng, qtype, rows: int, k: int) -> np.ndarray:
    """Random blocks of qtype with decode-sized fp16 scales, shape (rows, bytes per row)."""
    w = rng.integers(0, 256, size=(rows, k // 256, BLOCK[qtype]), dtype=np.uint8)
    if qtype == Q4_K:
        w[:, :, 0:2] = np.float16(rng.uniform(1, 2, size=(rows, k // 256)) / 2048).view(np.uint8).reshape(rows, k // 256, 2)
        w[:, :, 2:4] = np.float16(rng.uniform(1, 2, size=(rows, k // 256)) / 4096).view(np.uint8).reshape(rows, k // 256, 2)
    else:
        w[:, :, 208:210] = np.float16(rng.uniform(1, 2, size=(rows, k // 256)) / 8192).view(np.uint8).reshape(rows, k // 256, 2)
    return w.reshape(rows, -1)


def activations(rng, rows: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Q8_K rows (bytes) and the values they stand for (float64)."""
    nb = k // 256
    qs = rng.integers(-127, 128, size=(rows, nb, 256), dtype=np.int8)
    d = rng.uniform(0.001, 0.01, size=(rows, nb)).astype(np.float32)
    blocks = np.zeros((rows, nb, Q8_K_BLOCK), dtype=np.uint8)
    blocks[:, :, 0:4] = d.view(np.uint8).reshape(rows, nb, 4)
    blocks[:, :, 4:260] = qs.view(np.uint8)
    bsums = qs.reshape(rows, nb, 16, 16).astype(np.int16).sum(axis=3, dtype=np.int16)
    blocks[:, :, 260:292] = bsums.view(np.uint8).reshape(rows, nb, 32)
    values = (d[:, :, None].astype(np.float64) * qs).reshape(rows, k)
    return blocks.reshape(rows, -1), values


def matmul(lib, qtype, path: int, w: np.ndarray, x: np.ndarray, k: int) -> np.ndarray:
    m, n = w.shape[0], x.shape[0]
    w, x = np.ascontiguousarray(w), np.ascontiguousarray(x)
    y = np.full((n, m), np.nan, dtype=np.float32)
    fn = lib.qmm_q4_K if qtype == Q4_K else lib.qmm_q6_K
    rc = fn(path, k, 0, m, n, w.ctypes.data, x.ctypes.data, y.ctypes.data, m)
    if rc != 0:
        pytest.skip(f"path {path} not on this CPU")
    return y


@pytest.mark.parametrize("qtype", [Q4_K, Q6_K], ids=["Q4_K", "Q6_K"])
def test_dot_of_the_dequantized_blocks(lib, qtype):
    rng = np.random.default_rng(1)
    k, m = 1536, 24
    w = weights(rng, qtype, m, k)
    x, xv = activations(rng, 5, k)
    wv = quants.dequantize(w, qtype).astype(np.float64).reshape(m, k)
    exact, mag = xv @ wv.T, np.abs(xv) @ np.abs(wv).T
    y = matmul(lib, qtype, SCALAR, w, x, k)
    assert np.all(np.abs(y - exact) <= 1e-6 * mag)


@pytest.mark.parametrize("path", [SCALAR, AVX2, AVX512], ids=["scalar", "avx2", "avx512vnni"])
@pytest.mark.parametrize("qtype", [Q4_K, Q6_K], ids=["Q4_K", "Q6_K"])
def test_rows_keep_their_bits_whatever_the_batch(lib, qtype, path):
    rng = np.random.default_rng(2)
    k, m = 2304, 40
    w = weights(rng, qtype, m, k)
    x, _ = activations(rng, 64, k)
    alone = np.stack([matmul(lib, qtype, SCALAR, w, x[r:r + 1], k)[0] for r in range(64)])
    sizes = range(1, 65) if path != SCALAR else (2, 3, 5, 17, 64)
    for n in sizes:
        rows = rng.permutation(64)[:n]  # n rows, each at a random place
        y = matmul(lib, qtype, path, w, x[rows], k)
        assert np.array_equal(y.view(np.uint32), alone[rows].view(np.uint32)), f"n={n}"


def _ggml_base():
    """ggml's base library from the installed llama-cpp-python wheel, or None."""
    import importlib.util
    spec = importlib.util.find_spec("llama_cpp")
    found = sorted(Path(spec.origin).parent.glob("lib/libggml-base.so*")) if spec and spec.origin else []
    return ctypes.CDLL(str(found[0])) if found else None


@pytest.mark.parametrize("path", [SCALAR, AVX2, AVX512], ids=["scalar", "avx2", "avx512vnni"])
def test_activations_are_quantized_with_the_bits_of_ggmls_reference(lib, path):
    ggml = _ggml_base()
    if ggml is None:
        pytest.skip("llama-cpp-python is not installed")
    rng = np.random.default_rng(3)
    k = 32 * 256
    x = (rng.standard_normal(k) * np.exp2(rng.integers(-8, 8, k))).astype(np.float32)
    x[256:512] = 0  # an all-zero block
    x[512 + 7], x[512 + 200] = 999, -999  # tied magnitudes: the first takes -127
    ref, ours = np.zeros(k // 256 * Q8_K_BLOCK, np.uint8), np.zeros(k // 256 * Q8_K_BLOCK, np.uint8)
    ggml.quantize_row_q8_K_ref(ctypes.c_void_p(x.ctypes.data), ctypes.c_void_p(ref.ctypes.data), ctypes.c_int64(k))
    if lib.qmm_quantize_q8_K(path, ctypes.c_void_p(x.ctypes.data), ctypes.c_void_p(ours.ctypes.data), k) != 0:
        pytest.skip(f"path {path} not on this CPU")
    assert np.array_equal(ours, ref)


def _patch_module():
    import importlib.util
    import sys
    spec = importlib.util.spec_from_file_location("llama_cpp_qmatmul", SRC / "llama_cpp_qmatmul.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_llama_cpp_patch_applies_once_and_needs_its_anchors(tmp_path):
    mod = _patch_module()
    for patch in mod.PATCHES:  # each anchor amid other text, as in the pinned llama.cpp
        path = tmp_path / patch.path
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text((path.read_text() if path.exists() else "// head\n") + patch.old + "// tail\n")
    assert mod.apply_all(tmp_path) == [*mod.COPIES.values(), *(p.name for p in mod.PATCHES)]
    assert mod.apply_all(tmp_path) == []
    copied = (tmp_path / mod.CPU / "edgespec-qattn.c").read_text()
    assert '#include "edgespec-qmatmul.h"' in copied and '#include "qmatmul.h"' not in copied
    assert '#include "edgespec-qattn.h"' in copied and '#include "qattn.h"' not in copied
    cpu = (tmp_path / mod.CPU / "ggml-cpu.c").read_text()
    assert cpu.index("static bool edgespec_qmatmul_forward") < cpu.index("if (edgespec_qmatmul_forward(")
    ops = (tmp_path / mod.CPU / "ops.cpp").read_text()
    assert ops.index("static bool edgespec_qattn_forward") < ops.index("if (edgespec_qattn_forward(")
    broken = tmp_path / "broken"
    (broken / mod.CPU).mkdir(parents=True)
    for patch in mod.PATCHES:
        (broken / patch.path).write_text("// a llama.cpp without the anchors\n")
    with pytest.raises(mod.PatchError, match="found 0 times"):
        mod.apply_all(broken)


def test_upstream_diff_carries_the_kernels_and_patches_as_they_are():
    """native/qmatmul/upstream/*.patch (upstream.sh's output) holds today's kernel files and one
    guarded hunk per patch: regenerate it (bash native/qmatmul/upstream.sh SDIST) after a change."""
    mod = _patch_module()
    diff = (SRC / "upstream" / "ggml-cpu-batch-invariant.patch").read_text()
    files = {}
    for section in diff.split("diff --git a/")[1:]:
        name = section.split(" ", 1)[0]
        files[name] = "".join(line[1:] + "\n" for line in section.splitlines()
                              if line.startswith("+") and not line.startswith("+++"))
    for src, dst in mod.COPIES.items():
        assert files[f"ggml/src/ggml-cpu/{dst}"] == mod.copied_text(src), f"{dst} in the diff is not today's {src}"
    assert "option(GGML_CPU_BATCH_INVARIANT" in files["ggml/CMakeLists.txt"]
    assert sum(text.count("#ifdef GGML_USE_CPU_BATCH_INVARIANT") for text in files.values()) == 5
    assert "edgespec:" not in diff  # the patch rules' markers stay in edgespec's build


def _install_cpu():
    import importlib.util
    spec = importlib.util.spec_from_file_location("install_cpu", SRC / "install_cpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_installed_backend_is_swapped_keeping_the_wheels_files(tmp_path):
    """install_cpu copies the built library over each libggml-cpu.so* of the wheel (a wheel holds
    copies, not links), keeps each original once, and puts them back with --stock."""
    ic = _install_cpu()
    lib = tmp_path / "lib"
    lib.mkdir()
    for name in ("libggml-cpu.so", "libggml-cpu.so.0", "libggml-cpu.so.0.25.3", "libggml.so.0"):
        (lib / name).write_bytes(b"stock " + name.encode())
    built = tmp_path / "built.so"
    built.write_bytes(b"patched")
    assert [p.name for p in ic.install(lib, built)] == ["libggml-cpu.so", "libggml-cpu.so.0", "libggml-cpu.so.0.25.3"]
    ic.install(lib, built)  # a second install keeps the wheel's files, not the patched ones
    assert (lib / "libggml-cpu.so.0").read_bytes() == b"patched" and (lib / "libggml.so.0").read_bytes().startswith(b"stock")
    assert (lib / "libggml-cpu.so.0.stock").read_bytes() == b"stock libggml-cpu.so.0"
    ic.restore(lib)
    assert sorted(p.name for p in lib.iterdir()) == ["libggml-cpu.so", "libggml-cpu.so.0", "libggml-cpu.so.0.25.3",
                                                     "libggml.so.0"]
    assert (lib / "libggml-cpu.so.0").read_bytes() == b"stock libggml-cpu.so.0"


def test_the_cached_backend_is_keyed_by_what_goes_into_it(monkeypatch):
    ic = _install_cpu()
    monkeypatch.setenv("CMAKE_ARGS", "-DA=1")
    key = ic.cache_key("0.3.36")
    assert ic.cache_key("0.3.36") == key and ic.cache_key("0.3.37") != key
    monkeypatch.setenv("CMAKE_ARGS", "-DA=2")
    assert ic.cache_key("0.3.36") != key


def test_the_loaded_backend_says_whether_rows_keep_their_bits(model_path):
    """With qmatmul loaded (`make` installs it on a CPU build), the rows of a batch with flash
    attention have a one-token decode's bits; edgespec reads which backend it has from the
    library, and a test of its rows agrees."""
    from conftest import TARGET
    from edgespec.llama import invariant
    from edgespec.llama.backend import ContextParams, LlamaContext, LlamaModel, ModelParams, qmatmul_loaded

    model = LlamaModel(model_path(TARGET), ModelParams())
    ctx = LlamaContext(model, ContextParams(n_ctx=256, flash_attn=True))
    try:
        deviation = invariant.deviation(ctx)
    finally:
        ctx.close()
        model.close()
    assert (deviation == 0.0) == qmatmul_loaded(), deviation
