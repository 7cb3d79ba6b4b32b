"""The hyperparameter bounds llama.cpp asserts on while loading a model, checked beforehand.

llama.cpp (as vendored by llama-cpp-python 0.3.36) reads `{arch}.block_count`, the expert
counts and the head counts with ``GGML_ASSERT``: a file that breaks one aborts the whole process
(SIGABRT, exit 134) instead of failing the load.  What llama.cpp merely *throws* on (a missing
key, a wrong value type, an array of the wrong length) becomes a failed load and is left to it.
:func:`check_hparams` mirrors the asserts, each naming the llama.cpp source line it copies
(``src/llama-model.cpp`` unless said otherwise), and raises one
:class:`~edgespec.errors.InvalidGGUF` naming the key, its value and the bound.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from edgespec.errors import InvalidGGUF

#: llama-hparams.h: per-layer hyperparameters live in arrays of this size.
LLAMA_MAX_LAYERS = 512
#: llama-hparams.h: the most experts a mixture-of-experts layer may have.
LLAMA_MAX_EXPERTS = 1024
#: llama-model.cpp LLAMA_ROPE_SCALING_TYPES: any other `rope.scaling.type` asserts (line 1420).
ROPE_SCALING_TYPES = ("none", "linear", "yarn", "longrope")
#: Keys llama.cpp reads per layer (get_key_or_arr / get_arr into LLAMA_MAX_LAYERS arrays).
PER_LAYER_KEYS = ("attention.head_count", "attention.head_count_kv", "feed_forward_length",
                  "expert_used_count")
#: llama-model.cpp:1337: these architectures treat expert_count <= 1 as a dense model.
_DENSE_IF_ONE_EXPERT = ("hunyuan-dense", "hunyuan_vl")


class _Meta:
    """Typed views of one architecture's integer hyperparameters."""

    def __init__(self, path: str, metadata: dict[str, Any], arch: str):
        self.path, self.md, self.arch = path, metadata, arch

    def key(self, suffix: str) -> str:
        return f"{self.arch}.{suffix}"

    def values(self, suffix: str) -> list[int] | None:
        """The key's integer value(s) as llama.cpp's uint32 reads them, else None.

        Non-integer values are None: llama.cpp throws on a wrong type, a failed load, not an abort.
        """
        v = self.md.get(self.key(suffix))
        items = v if isinstance(v, list) else [v]
        if not items or not all(isinstance(x, int) and not isinstance(x, bool) for x in items):
            return None
        return [x & 0xFFFFFFFF for x in items]  # an int32 array element -1 is read as 2^32-1

    def value(self, suffix: str, default: int | None = None) -> int | None:
        """A scalar integer hyperparameter, or ``default`` when absent or not a scalar integer."""
        v = self.md.get(self.key(suffix))
        if isinstance(v, int) and not isinstance(v, bool):
            return v & 0xFFFFFFFF
        return default

    def fail(self, suffix: str, value: Any, bound: str) -> None:
        raise InvalidGGUF(self.path, f"{self.key(suffix)} is {value}, but llama.cpp requires "
                                     f"{bound}")


def _check_layers(m: _Meta) -> None:
    """llama-model.cpp:1328 n_layer_all in [1, LLAMA_MAX_LAYERS]; 1330 nextn <= n_layer_all;
    1354-1355 the vocoder's posnet/convnext counts <= n_layer_all."""
    n = m.value("block_count")
    if n is None:
        return  # missing or mistyped: llama.cpp throws "key not found" / "wrong type"
    if not 1 <= n <= LLAMA_MAX_LAYERS:
        m.fail("block_count", n, f"1 <= block_count <= {LLAMA_MAX_LAYERS} (LLAMA_MAX_LAYERS)")
    sub = ["nextn_predict_layers"]
    if m.arch == "wavtokenizer-dec":
        sub += ["posnet.block_count", "convnext.block_count"]
    for suffix in sub:
        k = m.value(suffix, 0)
        if k > n:
            m.fail(suffix, k, f"at most {m.key('block_count')} = {n}")


def _check_per_layer_arrays(m: _Meta) -> None:
    """Per-layer arrays are copied into LLAMA_MAX_LAYERS slots (llama-hparams.h)."""
    for suffix in PER_LAYER_KEYS:
        v = m.md.get(m.key(suffix))
        if isinstance(v, list) and len(v) > LLAMA_MAX_LAYERS:
            m.fail(suffix, f"an array of {len(v)} values",
                   f"at most {LLAMA_MAX_LAYERS} per-layer values (LLAMA_MAX_LAYERS)")


def _check_experts(m: _Meta) -> None:
    """llama-model.cpp:1361-1373, the expert counts and groups of a mixture of experts."""
    n_expert = m.value("expert_count", 0)
    used = max(m.values("expert_used_count") or [0])  # per layer: llama.cpp checks the max
    groups = m.value("expert_group_count", 0)
    if m.arch in _DENSE_IF_ONE_EXPERT and n_expert <= 1:
        n_expert = used = 0
    if n_expert > LLAMA_MAX_EXPERTS:
        m.fail("expert_count", n_expert, f"at most {LLAMA_MAX_EXPERTS} (LLAMA_MAX_EXPERTS)")
    if used > n_expert:
        m.fail("expert_used_count", used, f"at most {m.key('expert_count')} = {n_expert}")
    if n_expert == 0:
        if groups != 0:
            m.fail("expert_group_count", groups, "0 without experts")
        return
    if used == 0:
        m.fail("expert_used_count", used, f"more than 0 when {m.key('expert_count')} = {n_expert}")
    if groups >= n_expert:
        m.fail("expert_group_count", groups, f"less than {m.key('expert_count')} = {n_expert}")
    if groups > 1:
        if n_expert % groups:
            m.fail("expert_group_count", groups,
                   f"a divisor of {m.key('expert_count')} = {n_expert}")
        group_used = m.value("expert_group_used_count", 0)
        if not 0 < group_used < groups:
            m.fail("expert_group_used_count", group_used,
                   f"more than 0 and less than {m.key('expert_group_count')} = {groups}")


def _check_rope_scaling(m: _Meta) -> None:
    """llama-model.cpp:1420 asserts the scaling type is a known name."""
    v = m.md.get(m.key("rope.scaling.type"))
    if isinstance(v, str) and v not in ROPE_SCALING_TYPES:
        m.fail("rope.scaling.type", repr(v), f"one of {', '.join(ROPE_SCALING_TYPES)}")


def _check_heads(m: _Meta) -> None:
    """Every layer needs heads, and its KV heads must divide them: attention multiplies Q by K
    per head group, and ggml_mul_mat asserts the broadcast (ggml/src/ggml.c:3354)."""
    heads = m.values("attention.head_count")
    if heads is None:
        return
    if min(heads) == 0:
        m.fail("attention.head_count", _show(heads), "more than 0 on every layer")
    kv = m.values("attention.head_count_kv") or heads  # llama.cpp defaults KV heads to heads
    n = max(len(heads), len(kv))
    for il, (h, k) in enumerate(zip(heads * n if len(heads) == 1 else heads,
                                    kv * n if len(kv) == 1 else kv)):
        if k == 0 or h % k:
            m.fail("attention.head_count_kv", _show(kv),
                   f"a divisor of {m.key('attention.head_count')} = {h} (layer {il})")


def _head_dims(m: _Meta) -> tuple[int, int, int] | None:
    """(key head size, value head size, rope dimensions) as llama-model.cpp:1439-1448 derives them."""
    n_embd = m.value("embedding_length")
    heads = m.values("attention.head_count")
    if n_embd is None or not heads or heads[0] == 0:
        return None
    k = m.value("attention.key_length", n_embd // heads[0])
    v = m.value("attention.value_length", n_embd // heads[0])
    return k, v, m.value("rope.dimension_count", k)


def _check_uniform_head(m: _Meta) -> None:
    """models/qwen2.cpp:56-57, models/llama.cpp:102-103: one head size for K, V and rope."""
    dims = _head_dims(m)
    if dims is None:
        return
    k, v, rot = dims
    if v != k:
        m.fail("attention.value_length", v, f"the key head size {k}")
    if rot != k:
        m.fail("rope.dimension_count", rot, f"the key head size {k}")


def _check_q_width(m: _Meta) -> None:
    """qwen2's Q projection is embedding_length wide (models/qwen2.cpp load_arch_tensors), and
    the graph reshapes it to heads x head size: ggml_reshape_3d asserts they match (ggml.c:3758)."""
    dims = _head_dims(m)
    n_embd = m.value("embedding_length")
    if dims is None:
        return
    for h in set(m.values("attention.head_count") or []):
        if h * dims[0] != n_embd:
            m.fail("embedding_length", n_embd,
                   f"{m.key('attention.head_count')} {h} x head size {dims[0]} = {h * dims[0]}")


def _show(values: list[int]) -> str:
    return str(values[0]) if len(values) == 1 else f"{values[:8]}{'...' if len(values) > 8 else ''}"


Check = Callable[[_Meta], None]
#: Asserts in llama_model_base::load_hparams, reached by every architecture.
GENERIC_CHECKS: tuple[Check, ...] = (_check_layers, _check_per_layer_arrays, _check_experts,
                                     _check_rope_scaling)
#: Asserts in the graphs of the architectures edgespec ships models for (models/*.json).
ARCH_CHECKS: dict[str, tuple[Check, ...]] = {
    "llama": (_check_heads, _check_uniform_head),
    "qwen2": (_check_heads, _check_uniform_head, _check_q_width),
    "gemma3": (_check_heads,),
}


def check_hparams(path: str, metadata: dict[str, Any]) -> None:
    """Refuse hyperparameters llama.cpp would abort on; raises InvalidGGUF naming key and bound.

    Files without `general.architecture` are left to the caller, CLIP files alone: llama.cpp
    reads no hyperparameters from them (llama-model.cpp:1317).
    """
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str) or not arch or arch == "clip":
        return
    m = _Meta(path, metadata, arch)
    for check in GENERIC_CHECKS + ARCH_CHECKS.get(arch, ()):
        check(m)
