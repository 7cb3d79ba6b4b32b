"""Puts the CPU backend with qmatmul (llama_cpp_qmatmul.py) into an installed llama-cpp-python:

    python native/qmatmul/install_cpu.py     # with the venv's python; `make install` runs it

Only ggml's CPU backend changes, and the wheel ships it as its own library (llama_cpp/lib/
libggml-cpu.so*, found by libggml through its RUNPATH), so only that library is built: the
pinned source from pip (its cache, else the index), patched, then cmake's ggml-cpu target with
the flags the wheel was built with (CMAKE_ARGS). The built library is cached under
$EDGESPEC_KERNEL_CACHE (default ~/.cache/edgespec/ggml-cpu), keyed by everything that goes into
it, so a second install on the machine copies it (under a second); a cold build took 57 s on 2
cores. The wheel's own files are kept beside it as *.stock; --stock puts them back.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
KERNEL = ("llama_cpp_qmatmul.py", "qmatmul.c", "qmatmul.h", "qattn.c", "qattn.h", "install_cpu.py",
          "../llama_cpp_patches.py")


def _lib_dir() -> Path:
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        sys.exit("install_cpu: llama-cpp-python is not installed in this environment")
    return Path(spec.origin).parent / "lib"


def _run(*args: str) -> str:
    return subprocess.run(args, check=True, capture_output=True, text=True).stdout


def cache_key(version: str) -> str:
    """A hash of what the built library depends on: the source's version, the kernel and its
    patch, the flags, the compiler, and what -march=native means on this CPU."""
    h = hashlib.sha256(f"llama-cpp-python {version}\n{' '.join(_cmake_args())}\n".encode())
    for name in KERNEL:
        h.update((HERE / name).read_bytes())
    cc = os.environ.get("CC", "cc")
    h.update(_run(cc, "--version").encode())
    h.update(_run(cc, "-march=native", "-Q", "--help=target").encode())
    return h.hexdigest()[:20]


def build(version: str, out: Path) -> None:
    """Builds the patched libggml-cpu.so into ``out``."""
    sys.path.insert(0, str(HERE))
    import llama_cpp_qmatmul  # isort: skip  (native/qmatmul on the path)

    with tempfile.TemporaryDirectory(prefix="edgespec-ggml-cpu-") as tmp:
        work = Path(tmp)
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                        "--dest", str(work), f"llama-cpp-python=={version}"], check=True)
        archive = next(work.glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(archive) as tar:
            members = [m for m in tar.getmembers() if "/vendor/llama.cpp/" in m.name]
            try:
                tar.extractall(work, members=members, filter="data")
            except TypeError:  # Python without extraction filters (before 3.10.12 / 3.11.4)
                tar.extractall(work, members=members)
        src = next(work.glob("llama_cpp_python-*/"))
        llama_cpp_qmatmul.apply_all(src)
        flags = [a for a in _cmake_args() if a.startswith("-DCMAKE_C") or a.startswith("-DGGML_")]
        cmake = _cmake()
        _run(cmake, "-S", str(src / "vendor/llama.cpp"), "-B", str(work / "build"), "-DCMAKE_BUILD_TYPE=Release",
             "-DBUILD_SHARED_LIBS=ON", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
             "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=OFF", "-DLLAMA_BUILD_SERVER=OFF",
             "-DGGML_CPU_BATCH_INVARIANT=ON", *flags)
        _run(cmake, "--build", str(work / "build"), "--target", "ggml-cpu", "-j", str(os.cpu_count() or 2))
        built = next(p for p in (work / "build").rglob("libggml-cpu.so*") if not p.is_symlink())
        out.mkdir(parents=True, exist_ok=True)
        shutil.copy2(built, out / "libggml-cpu.so.part")
        os.replace(out / "libggml-cpu.so.part", out / "libggml-cpu.so")


def _cmake() -> str:
    """cmake from the PATH or this environment, else installed into this environment (as pip's
    build of the wheel itself does)."""
    here = Path(sys.executable).parent / "cmake"
    found = shutil.which("cmake") or (str(here) if here.exists() else None)
    if found is None:
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "cmake"], check=True)
        found = str(here)
    return found


def _cmake_args() -> list[str]:
    return shlex.split(os.environ.get("CMAKE_ARGS", ""))


def install(lib: Path, built: Path) -> list[Path]:
    """Copies ``built`` over every libggml-cpu.so* of the wheel (copies, not links, in a wheel),
    keeping each original once as *.stock; returns the files replaced."""
    targets = sorted(p for p in lib.glob("libggml-cpu.so*") if not p.name.endswith(".stock"))
    for t in targets:
        stock = t.with_name(t.name + ".stock")
        if not stock.exists():
            shutil.copy2(t, stock)
        tmp = t.with_name(t.name + ".part")
        shutil.copy2(built, tmp)
        os.replace(tmp, t)
    return targets


def restore(lib: Path) -> None:
    for stock in lib.glob("libggml-cpu.so*.stock"):
        os.replace(stock, stock.with_name(stock.name[: -len(".stock")]))


def main(argv: list[str]) -> int:
    lib = _lib_dir()
    if argv[1:] == ["--stock"]:
        restore(lib)
        print(f"install_cpu: the wheel's CPU backend is back in {lib}")
        return 0
    version = importlib.metadata.version("llama-cpp-python")
    root = Path(os.environ.get("EDGESPEC_KERNEL_CACHE") or Path.home() / ".cache/edgespec/ggml-cpu")
    cached = root / cache_key(version) / "libggml-cpu.so"
    if not cached.exists():
        print("install_cpu: building llama.cpp's CPU backend with qmatmul (about a minute on 2 cores)")
        try:
            build(version, cached.parent)
        except (subprocess.CalledProcessError, StopIteration, OSError) as exc:
            detail = getattr(exc, "stderr", "") or ""
            print(f"install_cpu: build failed: {exc} {detail[-2000:]}", file=sys.stderr)
            return 1
    replaced = install(lib, cached)
    print(f"install_cpu: {len(replaced)} file(s) of {lib} now hold {cached}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
