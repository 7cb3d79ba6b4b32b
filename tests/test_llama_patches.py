"""native/llama_cpp_patches.py: the llama.cpp source patches a CUDA build carries, and how
`doctor` tells a patched build from a stock one."""
from __future__ import annotations

import glob
import importlib.util
import subprocess
import sys
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


def tree(tmp_path: Path, text: str = STOCK) -> Path:
    path = tmp_path / patches.CUDA
    path.parent.mkdir(parents=True)
    path.write_text(text)
    return tmp_path


def test_patches_apply_once_and_then_change_nothing(tmp_path):
    root = tree(tmp_path)
    assert patches.apply_all(root) == ["graphs-per-shape", "graphs-per-shape-feature"]
    text = (root / patches.CUDA).read_text()
    assert patches.PER_SHAPE_KEY.old not in text and "<< 48" in text
    assert f'{{ "{GRAPHS_PER_SHAPE}", "1" }}' in text and text.startswith("// head\n") and text.endswith("// tail\n")
    assert patches.apply_all(root) == [] and (root / patches.CUDA).read_text() == text


def test_a_missing_or_repeated_anchor_stops_the_build(tmp_path):
    changed = STOCK.replace("return cgraph->nodes[0];", "return cgraph->nodes[1];")
    with pytest.raises(patches.PatchError, match="graphs-per-shape' replaces was found 0 times"):
        patches.apply(changed, patches.PER_SHAPE_KEY)
    with pytest.raises(patches.PatchError, match="found 2 times"):
        patches.apply(STOCK + STOCK, patches.PER_SHAPE_FEATURE)
    with pytest.raises(patches.PatchError, match="not found"):
        patches.apply_all(tmp_path)
    assert not (tmp_path / patches.CUDA).exists()


def test_the_script_says_one_line_and_exits_2_on_a_wrong_folder(tmp_path):
    bad = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path)], capture_output=True, text=True, check=False)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and bad.stderr.startswith("error: ")
    ok = subprocess.run([sys.executable, str(SCRIPT), str(tree(tmp_path))], capture_output=True, text=True, check=False)
    assert ok.returncode == 0 and "graphs-per-shape" in ok.stdout


def test_the_pinned_source_takes_the_patches(tmp_path):
    """Where `make install GPU=cuda` has fetched the pinned llama-cpp-python source: the patches
    apply to its real ggml-cuda.cu (the GPU machine's run.sh applies them to the same archive)."""
    found = sorted(glob.glob(str(ROOT / "build" / "llama-cpp-python" / "llama_cpp_python-*" / patches.CUDA)))
    if not found:
        pytest.skip("no llama-cpp-python source in build/ (`make build/llama-cpp-python/.patched` fetches it)")
    copy = tree(tmp_path, Path(found[-1]).read_text())
    patches.apply_all(copy)  # idempotent: the folder may hold it patched already
    assert patches.apply_all(copy) == [] and "edgespec: graphs-per-shape\n" in (copy / patches.CUDA).read_text()


def test_doctor_tells_the_patched_build_from_a_stock_one():
    assert patches.GRAPHS_PER_SHAPE == GRAPHS_PER_SHAPE  # the word the patch prints is the one read
    # system info of the H100 runs (benchmarks/device/results): stock, then patched; a CPU build
    stock = "CUDA : ARCHS = 900 | USE_GRAPHS = 1 | FA_QUANTS = q4_0-q4_0 | CPU : SSE3 = 1 | AVX2 = 1 |"
    patched = "CUDA : ARCHS = 900 | USE_GRAPHS = 1 | GRAPHS_PER_SHAPE = 1 | FA_QUANTS = q4_0-q4_0 | CPU : SSE3 = 1 |"
    assert cuda_graphs(stock) == "per-context" and cuda_graphs(patched) == "per-shape"
    assert cuda_graphs("CPU : SSE3 = 1 | AVX = 1 | AVX2 = 1 | LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 |") is None
