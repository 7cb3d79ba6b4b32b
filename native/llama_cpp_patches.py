"""Source patches applied to the llama.cpp that llama-cpp-python vendors, before a CUDA build.

    python native/llama_cpp_patches.py SRC     # SRC: llama-cpp-python's extracted source archive

Each patch replaces one anchored block of text; applying twice changes nothing, and an anchor
that is missing (a llama.cpp that changed) stops the build with one line instead of building
something unmeasured. Standalone on purpose: the Makefile runs it before llama-cpp-python is
reinstalled, and benchmarks/device/run.sh on the GPU machine, so what is measured is what ships.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

CUDA = "vendor/llama.cpp/ggml/src/ggml-cuda/ggml-cuda.cu"
MARK = "edgespec:"

# The feature every patched CUDA build reports in llama_print_system_info(), read by `doctor`
# (edgespec.llama.kernels.GRAPHS_PER_SHAPE must be the same word).
GRAPHS_PER_SHAPE = "GRAPHS_PER_SHAPE"


@dataclass(frozen=True)
class Patch:
    name: str
    path: str   # relative to the llama-cpp-python source
    old: str    # the exact text replaced, once
    new: str    # contains MARK + name, so a patched file is recognised


class PatchError(RuntimeError):
    pass


# llama.cpp keeps its CUDA graphs in a map keyed by the graph's first node, whose address is the
# same for every batch size, so one context has one graph and a decode replays it only after two
# decodes of its own shape (ggml-org/llama.cpp#28652). A verifier's batch sizes change from step
# to step: on an H100 a 7B-shaped target pays 0.76 ms (of a 3.9 ms step) and the 0.5B drafter
# 2.55 ms per change. With the batch's row count and its outputs' in the key each shape keeps its
# graph: 0.47 / 0.54 ms per change, and `auto`'s target decodes on 30 Spec-Bench questions 10%
# faster on one machine (benchmarks/RESULTS-gpu.md section 18). The key only picks a slot of the
# map: llama.cpp's node-by-node property check still guards every replay, so two graphs that
# share a slot (row counts mod 256, or pointers that use bits 48-63) cost a rebuild, never a
# wrong result. An empty graph, or a 32-bit build, keeps llama.cpp's own key.
PER_SHAPE_KEY = Patch(
    "graphs-per-shape", CUDA,
    "static const void * ggml_cuda_graph_get_key(ggml_cgraph * cgraph) {\n"
    "    return cgraph->nodes[0];\n"
    "}",
    f"static const void * ggml_cuda_graph_get_key(ggml_cgraph * cgraph) {{  // {MARK} graphs-per-shape\n"
    "#if UINTPTR_MAX > 0xffffffffu\n"
    "    if (cgraph->n_nodes > 0) {\n"
    "        const uintptr_t rows = (uintptr_t) (cgraph->nodes[0]->ne[1] & 0xff) << 48;\n"
    "        const uintptr_t outs = (uintptr_t) (cgraph->nodes[cgraph->n_nodes - 1]->ne[1] & 0xff) << 56;\n"
    "        return (const void *) (((uintptr_t) cgraph->nodes[0]) ^ rows ^ outs);\n"
    "    }\n"
    "#endif\n"
    "    return cgraph->nodes[0];\n"
    "}",
)

PER_SHAPE_FEATURE = Patch(
    "graphs-per-shape-feature", CUDA,
    "    #ifdef GGML_CUDA_USE_GRAPHS\n"
    "        features.push_back({ \"USE_GRAPHS\", \"1\" });\n"
    "    #endif\n",
    "    #ifdef GGML_CUDA_USE_GRAPHS\n"
    "        features.push_back({ \"USE_GRAPHS\", \"1\" });\n"
    f"        features.push_back({{ \"{GRAPHS_PER_SHAPE}\", \"1\" }});  // {MARK} graphs-per-shape-feature\n"
    "    #endif\n",
)

PATCHES = (PER_SHAPE_KEY, PER_SHAPE_FEATURE)


def apply(text: str, patch: Patch) -> str:
    """``text`` with ``patch`` applied; unchanged if it already is (its whole new text is there);
    PatchError if its anchor is not there exactly once, which includes a file an older version of
    the patch changed."""
    if patch.new in text:
        return text
    count = text.count(patch.old)
    if count != 1:
        stale = " (patched by another version of it: start from the source archive)" if f"{MARK} {patch.name}\n" in text else ""
        raise PatchError(f"{patch.path}: the text patch {patch.name!r} replaces was found {count} times"
                         f"{stale or ' (a llama.cpp other than the pinned one?)'}")
    return text.replace(patch.old, patch.new)


def apply_all(root: Path, patches: tuple[Patch, ...] = PATCHES) -> list[str]:
    """Applies every patch under ``root`` (llama-cpp-python's source); the names it changed."""
    changed = []
    for p in patches:
        path = root / p.path
        if not path.is_file():
            raise PatchError(f"{path}: not found (not llama-cpp-python's source?)")
        before = path.read_text(encoding="utf-8")
        after = apply(before, p)
        if after != before:
            path.write_text(after, encoding="utf-8")
            changed.append(p.name)
    return changed


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: llama_cpp_patches.py LLAMA_CPP_PYTHON_SOURCE", file=sys.stderr)
        return 2
    try:
        changed = apply_all(Path(argv[0]))
    except PatchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"llama.cpp patches: {', '.join(changed) if changed else 'already applied'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
