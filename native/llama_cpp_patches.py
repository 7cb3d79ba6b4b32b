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
# faster on one machine. The key only picks a slot of the map: llama.cpp's node-by-node
# property check still guards every replay, so two graphs that
# share a slot (row counts mod 256, or pointers that use bits 48-63) cost a rebuild, never a
# wrong result. An empty graph, or a 32-bit build, keeps llama.cpp's own key. A graph that ends
# in the outputs' argmax or top k (OUTPUT_ARGMAX) counts its outputs by their length.
PER_SHAPE_KEY = Patch(
    "graphs-per-shape", CUDA,
    "static const void * ggml_cuda_graph_get_key(ggml_cgraph * cgraph) {\n"
    "    return cgraph->nodes[0];\n"
    "}",
    f"static const void * ggml_cuda_graph_get_key(ggml_cgraph * cgraph) {{  // {MARK} graphs-per-shape\n"
    "#if UINTPTR_MAX > 0xffffffffu\n"
    "    if (cgraph->n_nodes > 0) {\n"
    "        const uintptr_t rows = (uintptr_t) (cgraph->nodes[0]->ne[1] & 0xff) << 48;\n"
    "        const ggml_tensor * last = cgraph->nodes[cgraph->n_nodes - 1];  // logits, their argmax or top k\n"
    "        const int dim = last->op == GGML_OP_ARGMAX ? 0 : last->op == GGML_OP_GET_ROWS ? 2 : 1;\n"
    "        const uintptr_t outs = (uintptr_t) (last->ne[dim] & 0xff) << 56;\n"
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


# Output argmax: while a context has it on, a decode takes each output row's argmax where the
# logits are (one ggml_argmax over all rows, on the GPU for a target whose output layer is there)
# and copies back one token id per row instead of the rows' logits. Greedy verification needs
# only those ids. On an H200 a 1.5B suffix step spent 0.42 ms of 5.3 reading and scanning
# ~11 rows of 152k logits on the host; llama.cpp's own backend sampler costs a view, an argmax
# and a device-to-host copy per row, and its greedy picks made that step slower (5.80 ms).
LLAMA_H = "vendor/llama.cpp/include/llama.h"
CPARAMS = "vendor/llama.cpp/src/llama-cparams.h"
GRAPH_H = "vendor/llama.cpp/src/llama-graph.h"
GRAPH_CPP = "vendor/llama.cpp/src/llama-graph.cpp"
MODEL_CPP = "vendor/llama.cpp/src/llama-model.cpp"
CONTEXT_H = "vendor/llama.cpp/src/llama-context.h"
CONTEXT_CPP = "vendor/llama.cpp/src/llama-context.cpp"
ARGMAX_API = ("llama_set_output_argmax", "llama_get_argmax_ith")  # edgespec.llama.rows binds these
TOPK_API = ("llama_set_output_topk", "llama_get_topk_ith")


def _after(name: str, path: str, anchor: str, added: str) -> Patch:
    """A patch that keeps ``anchor`` and adds ``added`` (marked) after it."""
    return Patch(name, path, anchor, anchor + added.replace("@MARK", f"{MARK} {name}"))


def _before(name: str, path: str, anchor: str, added: str) -> Patch:
    """A patch that keeps ``anchor`` and adds ``added`` (marked) before it."""
    return Patch(name, path, anchor, added.replace("@MARK", f"{MARK} {name}") + anchor)


OUTPUT_ARGMAX = (
    _after("argmax-api", LLAMA_H,
           "    LLAMA_API float * llama_get_logits_ith(struct llama_context * ctx, int32_t i);\n", """
    // @MARK
    // While on, a decode copies back each output row's argmax instead of its logits
    // (llama_get_logits_ith then reads nothing new). Off by default.
    LLAMA_API void llama_set_output_argmax(struct llama_context * ctx, bool on);
    // The argmax of the ith token's logits (indices as llama_get_logits_ith); LLAMA_TOKEN_NULL
    // for an invalid id or with output argmax off.
    LLAMA_API llama_token llama_get_argmax_ith(struct llama_context * ctx, int32_t i);
    // While k > 0, a decode copies back each output row's k largest logits and their token ids
    // (in no order) instead of its logits; 0 (the default) turns it off.
    LLAMA_API void llama_set_output_topk(struct llama_context * ctx, int32_t k);
    // The ith token's top k (indices as llama_get_logits_ith) into ids[k] and logits[k]; returns
    // k, or -1 for an invalid id or with output top-k off.
    LLAMA_API int32_t llama_get_topk_ith(struct llama_context * ctx, int32_t i, llama_token * ids, float * logits);
"""),
    _after("argmax-cparams", CPARAMS, "    bool causal_attn;\n",
           "    bool output_argmax = false; // @MARK\n    int32_t output_topk = 0;\n"),
    _before("argmax-reuse", GRAPH_H,
            "            cparams.causal_attn             == other.cparams.causal_attn             &&\n",
            "            cparams.output_argmax           == other.cparams.output_argmax           && // @MARK\n"
            "            cparams.output_topk             == other.cparams.output_topk             &&\n"),
    _after("argmax-result", GRAPH_H,
           "    ggml_tensor * t_h_nextn     = nullptr; // [n_embd, n_outputs] hidden state before final output norm\n",
           "    ggml_tensor * t_argmax      = nullptr; // [n_outputs] I32, with output argmax on (@MARK)\n"
           "    ggml_tensor * t_topk        = nullptr; // [k, n_outputs] I32 and\n"
           "    ggml_tensor * t_topk_logits = nullptr; // [1, k, n_outputs] F32, with output top-k on\n"),
    _after("argmax-reset", GRAPH_CPP, "    t_h_nextn     = nullptr;\n",
           "    t_argmax      = nullptr; // @MARK\n    t_topk        = nullptr;\n    t_topk_logits = nullptr;\n"),
    _after("argmax-output", GRAPH_CPP,
           "void llm_graph_result::set_outputs(const llm_graph_params & params) {\n", """\
    if (t_argmax != nullptr) { // @MARK
        ggml_set_output(t_argmax);
    }
    if (t_topk != nullptr) {
        ggml_set_output(t_topk);
        ggml_set_output(t_topk_logits);
    }
"""),
    _after("argmax-graph", MODEL_CPP, "    llm->build_sampling();\n", """
    // @MARK: one argmax over every output row, where the logits are
    if (params.cparams.output_argmax && llm->res->t_logits && params.n_outputs > 0) {
        llm->res->t_argmax = ggml_argmax(llm->ctx0, llm->res->t_logits);
        ggml_build_forward_expand(llm->gf, llm->res->t_argmax);
    }
    // one top k over every output row, and those logits gathered row by row
    if (params.cparams.output_topk > 0 && !params.cparams.output_argmax && llm->res->t_logits && params.n_outputs > 0) {
        ggml_tensor * logits = llm->res->t_logits; // [n_vocab, n_outputs], contiguous
        const int k = (int) std::min<int64_t>(params.cparams.output_topk, logits->ne[0]);
        llm->res->t_topk = ggml_top_k(llm->ctx0, logits, k);
        llm->res->t_topk_logits = ggml_get_rows(llm->ctx0,
                ggml_reshape_3d(llm->ctx0, logits, 1, logits->ne[0], logits->ne[1]), llm->res->t_topk);
        ggml_build_forward_expand(llm->gf, llm->res->t_topk_logits);
    }
"""),
    _after("argmax-context", CONTEXT_H, "    float * get_logits_ith(int32_t i);\n", """\
    void        set_output_argmax(bool on); // @MARK
    llama_token get_argmax_ith(int32_t i);
    std::vector<llama_token> output_argmax;  // one per output row, in the logits' row order
    void        set_output_topk(int32_t k);
    int32_t     get_topk_ith(int32_t i, llama_token * ids, float * logits);
    std::vector<llama_token> output_topk_ids;    // k per output row, in the logits' row order
    std::vector<float>       output_topk_logits;
    int32_t                  output_topk_k = 0;  // entries per row in those, 0: off
"""),
    _after("argmax-reserve", CONTEXT_CPP, """\
    // reserve output buffer
    if (output_reserve(n_outputs_all) < n_outputs_all) {
        LLAMA_LOG_ERROR("%s: could not reserve space for batch with %d outputs\\n", __func__, n_outputs_all);
        return -2;
    };
""", """\
    output_argmax.assign(cparams.output_argmax ? n_outputs_all : 0, LLAMA_TOKEN_NULL); // @MARK
    {
        const bool topk = cparams.output_topk > 0 && !cparams.output_argmax;
        output_topk_k = topk ? (int32_t) std::min<int64_t>(cparams.output_topk, n_vocab) : 0;
        const size_t n_topk = (size_t) n_outputs_all * output_topk_k;
        output_topk_ids.assign(n_topk, LLAMA_TOKEN_NULL);
        output_topk_logits.assign(n_topk, 0.0f);
    }
"""),
    Patch("argmax-extract", CONTEXT_CPP,
          "        if (logits.data && t_logits && n_outputs > 0 && needs_raw_logits(ubatch, sampling.samplers)) {\n",
          f"""\
        if (res->t_argmax && n_outputs > 0) {{ // {MARK} argmax-extract
            GGML_ASSERT(n_outputs_prev + n_outputs <= (int64_t) output_argmax.size());
            ggml_backend_t backend_am = ggml_backend_sched_get_tensor_backend(sched.get(), res->t_argmax);
            GGML_ASSERT(backend_am != nullptr);
            ggml_backend_tensor_get_async(backend_am, res->t_argmax, output_argmax.data() + n_outputs_prev, 0,
                                          n_outputs*sizeof(llama_token));
        }}
        if (res->t_topk && n_outputs > 0) {{
            const int64_t k = res->t_topk->ne[0];
            GGML_ASSERT((n_outputs_prev + n_outputs)*k <= (int64_t) output_topk_ids.size());
            ggml_backend_t backend_tk = ggml_backend_sched_get_tensor_backend(sched.get(), res->t_topk);
            ggml_backend_t backend_tl = ggml_backend_sched_get_tensor_backend(sched.get(), res->t_topk_logits);
            GGML_ASSERT(backend_tk != nullptr && backend_tl != nullptr);
            ggml_backend_tensor_get_async(backend_tk, res->t_topk, output_topk_ids.data() + n_outputs_prev*k, 0,
                                          n_outputs*k*sizeof(llama_token));
            ggml_backend_tensor_get_async(backend_tl, res->t_topk_logits, output_topk_logits.data() + n_outputs_prev*k, 0,
                                          n_outputs*k*sizeof(float));
        }}
        if (logits.data && t_logits && !res->t_argmax && !res->t_topk && n_outputs > 0 && needs_raw_logits(ubatch, sampling.samplers)) {{
"""),
    _before("argmax-reorder", CONTEXT_CPP, """\
        if (!sampling.samplers.empty()) {
            assert(sampling.logits.size > 0);
""", """\
        if (!output_argmax.empty()) { // @MARK
            std::swap(output_argmax[i0], output_argmax[i1]);
        }
        if (!output_topk_ids.empty()) {
            const size_t k = output_topk_k;
            std::swap_ranges(output_topk_ids.begin() + i0*k, output_topk_ids.begin() + (i0 + 1)*k, output_topk_ids.begin() + i1*k);
            std::swap_ranges(output_topk_logits.begin() + i0*k, output_topk_logits.begin() + (i0 + 1)*k, output_topk_logits.begin() + i1*k);
        }

"""),
    _before("argmax-methods", CONTEXT_CPP, "float * llama_context::get_embeddings() {\n", """\
void llama_context::set_output_argmax(bool on) { // @MARK
    if (cparams.output_argmax != on) {
        cparams.output_argmax = on;
        sched_need_reserve = true;
    }
}

void llama_context::set_output_topk(int32_t k) {
    k = std::max<int32_t>(k, 0);
    if (cparams.output_topk != k) {
        cparams.output_topk = k;
        sched_need_reserve = true;
    }
}

int32_t llama_context::get_topk_ith(int32_t i, llama_token * ids, float * logits) {
    output_reorder();
    try {
        if (output_topk_k <= 0) {
            throw std::runtime_error("output top-k is off");
        }
        const int64_t j = output_resolve_row(i);
        const size_t k = output_topk_k;
        if ((size_t) (j + 1)*k > output_topk_ids.size()) {
            throw std::runtime_error("no top k for this row");
        }
        std::copy_n(output_topk_ids.begin() + j*k, k, ids);
        std::copy_n(output_topk_logits.begin() + j*k, k, logits);
        return (int32_t) k;
    } catch (const std::exception & err) {
        LLAMA_LOG_ERROR("%s: invalid top-k id %d, reason: %s\\n", __func__, i, err.what());
        return -1;
    }
}

llama_token llama_context::get_argmax_ith(int32_t i) {
    output_reorder();
    try {
        if (!cparams.output_argmax) {
            throw std::runtime_error("output argmax is off");
        }
        const int64_t j = output_resolve_row(i);
        if (j >= (int64_t) output_argmax.size()) {
            throw std::runtime_error("no argmax for this row");
        }
        return output_argmax[j];
    } catch (const std::exception & err) {
        LLAMA_LOG_ERROR("%s: invalid argmax id %d, reason: %s\\n", __func__, i, err.what());
        return LLAMA_TOKEN_NULL;
    }
}

"""),
    _before("argmax-c-api", CONTEXT_CPP, "float * llama_get_embeddings(llama_context * ctx) {\n", """\
void llama_set_output_argmax(llama_context * ctx, bool on) { // @MARK
    ctx->set_output_argmax(on);
}

llama_token llama_get_argmax_ith(llama_context * ctx, int32_t i) {
    ctx->synchronize();

    return ctx->get_argmax_ith(i);
}

void llama_set_output_topk(llama_context * ctx, int32_t k) {
    ctx->set_output_topk(k);
}

int32_t llama_get_topk_ith(llama_context * ctx, int32_t i, llama_token * ids, float * logits) {
    ctx->synchronize();

    return ctx->get_topk_ith(i, ids, logits);
}

"""),
)

# Graphs by size: a verifier alternates batch sizes (one token, then a draft), and each change
# rebuilt llama.cpp's graph and its scheduler's allocation: 0.65-0.74 ms of host time a decode
# on an H200 with the 1.5B, against 0.08-0.16 ms reusing it (benchmarks/device/graph_timing.py).
# With LLAMA_GRAPH_SIZES=1,2,3,5,... a batch of one sequence and a listed number of tokens is
# decoded in that size's own scheduler and graph, kept between decodes (a scheduler rewrites a
# graph's inputs to its own copies, so one graph cannot move to another scheduler); every other
# batch (a prompt chunk, a draft tree) in the scheduler llama.cpp reserved. Each kept scheduler
# then holds at most its size's compute buffer. Off unless the variable is set (edgespec sets it
# for a drafted target on the GPU); any event that resets the graphs drops them.
GRAPHS_BY_SIZE = (
    _after("sizes-members", CONTEXT_H, "    llm_graph_result * gf_res_prev_active = nullptr;\n", """\
    // @MARK: batch sizes whose graphs are kept, each size's scheduler and graph result (the last
    // slot: every other batch's, the scheduler llama.cpp reserved), and the active pair's slot
    std::vector<uint32_t> graph_sizes; // env: LLAMA_GRAPH_SIZES
    std::vector<std::pair<ggml_backend_sched_ptr, llm_graph_result_ptr>> gf_res_sizes;
    std::vector<bool> gf_res_sizes_built; // whether a slot's scheduler holds its result's graph
    size_t graph_slot = 0;
"""),
    _after("sizes-methods", CONTEXT_H, "    llm_graph_result * get_gf_res_prev();\n", """\
    llm_graph_result * gf_res_by_size(const llama_ubatch & ubatch); // @MARK
"""),
    _before("sizes-env", CONTEXT_CPP,
            "    // ref: https://github.com/ggml-org/llama.cpp/pull/17046#discussion_r2503085732\n", """\
    if (const char * sizes = getenv("LLAMA_GRAPH_SIZES")) { // @MARK
        for (const char * s = sizes; *s; ) {
            char * end = nullptr;
            const long n = strtol(s, &end, 10);
            if (end == s) {
                break;
            }
            if (n > 0 && n <= (long) cparams.n_ubatch) {
                graph_sizes.push_back((uint32_t) n);
            }
            s = *end == ',' ? end + 1 : end;
        }
    }

"""),
    Patch("sizes-use", CONTEXT_CPP,
          "    auto * res = get_gf_res_prev();\n    auto * gf  = res->get_gf();\n\n    // the new graph parameters\n",
          f"    auto * res = gf_res_by_size(ubatch); // {MARK} sizes-use\n"
          "    auto * gf  = res->get_gf();\n\n    // the new graph parameters\n"),
    _after("sizes-drop-reserve", CONTEXT_CPP,
           "    gf_res_reserve.reset(new llm_graph_result(max_nodes));\n    gf_res_prev_active = nullptr;\n",
           "    gf_res_sizes.clear(); // @MARK\n"),
    Patch("sizes-drop-memory", CONTEXT_CPP,
          "        gf_res_prev_active = nullptr;\n\n        if (!mctx->apply()) {\n",
          f"        gf_res_prev_active = nullptr;\n        gf_res_sizes.clear(); // {MARK} sizes-drop-memory\n\n"
          "        if (!mctx->apply()) {\n"),
    _after("sizes-drop-graph-reserve", CONTEXT_CPP, """\
    // when the scheduler is reset, we cannot reuse old graphs, so we reset the previous graph results
    for (auto & res : gf_res_prev) {
        if (res) {
            res->reset();
        }
    }
    gf_res_prev_active = nullptr;
""", "    gf_res_sizes.clear(); // @MARK\n"),
    _before("sizes-impl", CONTEXT_CPP,
            "// pack sampler outputs into as few sequences as possible before using sequences without samplers\n", """\
// @MARK: the graph result to decode this batch in, with its scheduler made the context's: its
// size's slot (a batch of one sequence with outputs), or the last one. The active pair moves back
// to its slot, noting whether its scheduler still holds its graph; a slot used for the first
// time gets a new scheduler; process_ubatch reuses the graph where it fits the batch.
llm_graph_result * llama_context::gf_res_by_size(const llama_ubatch & ubatch) {
    if (graph_sizes.empty() || graph_reuse_disable || cparams.pipeline_parallel) {
        return get_gf_res_prev();
    }
    const size_t other = graph_sizes.size();
    if (gf_res_sizes.empty()) { // after a reset: the active pair is the last slot's
        gf_res_sizes.resize(other + 1);
        gf_res_sizes_built.assign(other + 1, false);
        graph_slot = other;
    }
    size_t slot = other;
    if (n_outputs > 0 && ubatch.n_seqs_unq == 1) {
        slot = std::find(graph_sizes.begin(), graph_sizes.end(), ubatch.n_tokens) - graph_sizes.begin();
    }
    if (slot != graph_slot) {
        auto & active = gf_res_prev[1];
        if (!active) {
            active.reset(new llm_graph_result(gf_res_reserve->get_max_nodes()));
        }
        auto & want = gf_res_sizes[slot];
        if (!want.first) {
            const size_t max_nodes = gf_res_reserve->get_max_nodes();
            want.first.reset(ggml_backend_sched_new(backend_ptrs.data(), backend_buft.data(), backend_ptrs.size(),
                                                    max_nodes, false, cparams.op_offload));
            want.second.reset(new llm_graph_result(max_nodes));
        }
        gf_res_sizes_built[graph_slot] = gf_res_prev_active != nullptr && gf_res_prev_active == active.get();
        std::swap(gf_res_sizes[graph_slot].first, sched);
        std::swap(gf_res_sizes[graph_slot].second, active);
        std::swap(want.first, sched);
        std::swap(want.second, active);
        gf_res_prev_active = gf_res_sizes_built[slot] ? active.get() : nullptr;
        graph_slot = slot;
    }
    return get_gf_res_prev();
}

"""),
)

# The top k of many rows in one radix select: CUDA's ggml_top_k takes each row on its own (a cub
# top-k per row, or where the CUDA toolkit's cub has none, as here with CUDA 13.0, a sort of every
# row), which cost 0.7-0.8 ms of a sampled verification on an H200. llama.cpp carries a radix
# select over all rows at once (4 histogram passes of 8 bits, then a gather), built for HIP
# only; these patches build it for CUDA too and use it for rows longer than 1024.
TOPK = "vendor/llama.cpp/ggml/src/ggml-cuda/top-k.cu"
TOPK_ROWS = (
    Patch("topk-radix-build", TOPK,
          "#if !defined(GGML_CUDA_USE_CUB) && defined(GGML_USE_HIP)\n\nstatic __device__",
          f"#if 1  // {MARK} topk-radix-build (llama.cpp: HIP without cub only)\n\nstatic __device__"),
    _after("topk-radix-use", TOPK, "    ggml_cuda_pool & pool  = ctx.pool();\n", """\
    // @MARK: every row in one radix select (GGML_CUDA_TOPK_PER_ROW=1: llama.cpp's way, to compare)
    static const bool per_row = getenv("GGML_CUDA_TOPK_PER_ROW") != nullptr;
    if (ncols > 1024 && !per_row) {
        top_k_radix_cuda(pool, src0_d, dst_d, ncols, nrows, k, stream);
        return;
    }
"""),
)

PATCHES = (PER_SHAPE_KEY, PER_SHAPE_FEATURE) + OUTPUT_ARGMAX + GRAPHS_BY_SIZE + TOPK_ROWS


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
