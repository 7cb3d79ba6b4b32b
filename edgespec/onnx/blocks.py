"""GGUF weight blocks -> the block-quantized layout of onnxruntime's MatMulNBits.

onnxruntime dequantizes a weight as ``(q - zero_point) * scale`` per block of ``block`` values
along a row, with ``q`` of 4 or 8 bits and the zero point ``2**(bits-1)`` unless given. Every
ggml block format below maps onto that without requantizing; formats with a per-block minimum
(Q4_1, Q5_1, Q4_K, Q5_K) also carry an additive ``offset`` per block, which the graph adds as a
small correction term (a float zero point would do it too, but onnxruntime's CPU kernel has no
fast path for one: ~100x slower, as measured in issue #13).

Mapping per format (value -> stored q):

* Q8_0: ``d*x``, x int8                 -> 8-bit, block 32, q = x + 128
* Q5_0: ``d*(x-16)``, x in [0, 32)      -> 8-bit, block 32, q = x + 112
* Q4_0: ``d*(x-8)``, x in [0, 16)       -> 4-bit, block 32, q = x
* Q4_1 / Q5_1: ``d*x + m``              -> 4- / 8-bit, block 32, zero point 0 / 128, offset m
* Q4_K / Q5_K: ``d*sc*x - dmin*mn``     -> 4- / 8-bit, block 32, offset -dmin*mn
* Q6_K: ``d*sc*(x-32)``                 -> 8-bit, block 16, q = x + 96

The products ``d*sc`` and ``dmin*mn`` (fp16 times a 6-bit integer) are exact in float32, so
:func:`dequantize` reproduces ggml's own dequantization bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgespec.errors import UnsupportedModel

QK_K = 256


@dataclass
class QuantWeight:
    """A [n, k] weight as blocks along k: ``w = (q - zero) * scales (+ offsets)`` per block.

    ``q`` is unpacked (one uint8 per value); :func:`pack` gives MatMulNBits' byte layout.
    """

    q: np.ndarray  # [n, k] uint8, values < 2**bits
    scales: np.ndarray  # [n, k // block] float32
    bits: int
    block: int
    zeros: np.ndarray | None = None  # [n, k // block] uint8; None: 2**(bits-1)
    offsets: np.ndarray | None = None  # [n, k // block] float32 added to every value of a block

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape

    @property
    def nbytes(self) -> int:
        """Bytes of the packed form (what the graph stores)."""
        n, k = self.q.shape
        extra = sum(a.nbytes for a in (self.zeros, self.offsets) if a is not None)
        return n * k * self.bits // 8 + self.scales.nbytes + extra


def dequantize(w: QuantWeight) -> np.ndarray:
    """[n, k] float32 values, computed the way onnxruntime and ggml do."""
    n, k = w.q.shape
    zero = w.zeros if w.zeros is not None else np.full(w.scales.shape, 1 << (w.bits - 1), np.uint8)
    q = w.q.reshape(n, -1, w.block).astype(np.float32) - zero[..., None].astype(np.float32)
    out = q * w.scales[..., None]
    if w.offsets is not None:
        out = out + w.offsets[..., None]
    return out.reshape(n, k)


def pack(w: QuantWeight) -> tuple[np.ndarray, np.ndarray | None]:
    """MatMulNBits' B [n, k/block, block*bits/8] and packed zero points (4-bit: two a byte)."""
    n, k = w.q.shape
    q = w.q.reshape(n, k // w.block, w.block)
    if w.bits == 8:
        return q, w.zeros
    b = q[..., 0::2] | (q[..., 1::2] << 4)
    zeros = None
    if w.zeros is not None:
        z = w.zeros if w.zeros.shape[1] % 2 == 0 else np.pad(w.zeros, ((0, 0), (0, 1)))
        zeros = z[:, 0::2] | (z[:, 1::2] << 4)
    return b.astype(np.uint8), zeros


# -- decoding ggml blocks ---------------------------------------------------------------------
def _f16(raw: np.ndarray) -> np.ndarray:
    """[..., 2] uint8 -> [...] float32 (exact)."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _nibbles32(qs: np.ndarray) -> np.ndarray:
    """Blocks of 32 as 16 bytes (low nibbles: values 0-15, high: 16-31) -> [..., 32]."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits32(qh: np.ndarray) -> np.ndarray:
    """[..., 4] bytes of a little-endian uint32 -> [..., 32] bit j of the word (0 or 1)."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


def _q8_0(b: np.ndarray) -> QuantWeight:
    x = b[..., 2:].view(np.int8).astype(np.int16) + 128
    return QuantWeight(x.astype(np.uint8), _f16(b[..., 0:2]), 8, 32)


def _q5_0(b: np.ndarray) -> QuantWeight:
    x = _nibbles32(b[..., 6:]) | (_high_bits32(b[..., 2:6]) << 4)
    return QuantWeight(x + 112, _f16(b[..., 0:2]), 8, 32)


def _q4_0(b: np.ndarray) -> QuantWeight:
    return QuantWeight(_nibbles32(b[..., 2:]), _f16(b[..., 0:2]), 4, 32)


def _q4_1(b: np.ndarray) -> QuantWeight:
    d, m = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    return QuantWeight(_nibbles32(b[..., 4:]), d, 4, 32, np.zeros(d.shape, np.uint8), m)


def _q5_1(b: np.ndarray) -> QuantWeight:
    d, m = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    x = _nibbles32(b[..., 8:]) | (_high_bits32(b[..., 4:8]) << 4)
    return QuantWeight(x + 128, d, 8, 32, None, m)


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 packed bytes of Q4_K/Q5_K -> 8 six-bit scales and 8 six-bit minimums."""
    s = s.astype(np.uint8)
    lo_sc, lo_m, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([lo_sc & 63, (hi & 0x0F) | ((lo_sc >> 6) << 4)], axis=-1)
    mn = np.concatenate([lo_m & 63, (hi >> 4) | ((lo_m >> 6) << 4)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _k_low_nibbles(qs: np.ndarray) -> np.ndarray:
    """128 bytes -> 256 values: each 32-byte chunk gives 32 low nibbles, then 32 high ones."""
    qs = qs.reshape(*qs.shape[:-1], 4, 32)
    return np.stack([qs & 0x0F, qs >> 4], axis=-2).reshape(*qs.shape[:-2], QK_K)


def _k_minimums(b: np.ndarray, x: np.ndarray, bits: int, bias: int) -> QuantWeight:
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, mn = _k_scales(b[..., 4:16])
    shape = (*x.shape[:-2], x.shape[-2] * 8)  # [n, k/32]
    scales = (d[..., None] * sc).reshape(shape)
    offsets = -(dmin[..., None] * mn).reshape(shape)
    q = (x.astype(np.uint16) + bias).astype(np.uint8).reshape(*x.shape[:-2], -1)
    zeros = np.zeros(shape, np.uint8) if bits == 4 else None
    return QuantWeight(q, scales, bits, 32, zeros, offsets)


def _q4_k(b: np.ndarray) -> QuantWeight:
    return _k_minimums(b, _k_low_nibbles(b[..., 16:144]), 4, 0)


def _q5_k(b: np.ndarray) -> QuantWeight:
    qh = np.unpackbits(b[..., 16:48], axis=-1, bitorder="little").reshape(*b.shape[:-1], 32, 8)
    high = np.moveaxis(qh, -1, -2).reshape(*b.shape[:-1], QK_K)  # bit j of byte l -> value 32j+l
    return _k_minimums(b, _k_low_nibbles(b[..., 48:176]) | (high << 4), 8, 128)


def _q6_k(b: np.ndarray) -> QuantWeight:
    ql = b[..., 0:128].reshape(*b.shape[:-1], 2, 64)
    qh = b[..., 128:192].reshape(*b.shape[:-1], 2, 32)
    lo = np.concatenate([ql[..., :32] & 0x0F, ql[..., 32:] & 0x0F, ql[..., :32] >> 4, ql[..., 32:] >> 4], -1)
    hi = np.concatenate([(qh >> s) & 3 for s in (0, 2, 4, 6)], -1)
    x = (lo | (hi << 4)).reshape(*b.shape[:-1], QK_K)
    sc = b[..., 192:208].view(np.int8).astype(np.float32)
    scales = (_f16(b[..., 208:210])[..., None] * sc).reshape(*b.shape[:-2], -1)
    return QuantWeight((x + 96).reshape(*b.shape[:-2], -1), scales, 8, 16)


#: ggml type name -> (elements per block, bytes per block, decoder of [n, blocks, bytes]).
DECODERS = {
    "Q8_0": (32, 34, _q8_0), "Q5_0": (32, 22, _q5_0), "Q5_1": (32, 24, _q5_1),
    "Q4_0": (32, 18, _q4_0), "Q4_1": (32, 20, _q4_1), "Q4_K": (QK_K, 144, _q4_k),
    "Q5_K": (QK_K, 176, _q5_k), "Q6_K": (QK_K, 210, _q6_k),
}
FLOATS = {"F32": np.float32, "F16": np.float16}


def decode(type_name: str, raw: np.ndarray, n: int, k: int) -> QuantWeight | np.ndarray:
    """One GGUF tensor's bytes -> a QuantWeight [n, k], or float32 [n, k] for float tensors.

    Raises:
        UnsupportedModel: the tensor's format has no exact mapping here.
    """
    if type_name in FLOATS:
        return raw.view(FLOATS[type_name]).reshape(n, k).astype(np.float32)
    if type_name == "BF16":
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(n, k)
    if type_name not in DECODERS:
        raise UnsupportedModel(f"tensor format {type_name} cannot be converted exactly; "
                               f"supported: {', '.join([*DECODERS, *FLOATS, 'BF16'])}")
    per_block, size, fn = DECODERS[type_name]
    w = fn(raw.reshape(n, k // per_block, size))
    w.q = w.q.reshape(n, k)
    return w


def requantize4(w: QuantWeight, block: int = 32, rows: int = 4096) -> QuantWeight:
    """Round-to-nearest asymmetric 4-bit blocks of ``w``'s values (the `--bits 4` graphs).

    Works ``rows`` rows at a time: the float32 values of a whole output matrix would be 4x
    the model's own bytes.
    """
    parts = [_requantize4_rows(dequantize(_rows(w, r, r + rows)), block) for r in range(0, w.shape[0], rows)]
    return QuantWeight(np.concatenate([p.q for p in parts]), np.concatenate([p.scales for p in parts]),
                       4, block, np.concatenate([p.zeros for p in parts]))


def _rows(w: QuantWeight, start: int, stop: int) -> QuantWeight:
    def part(a):
        return None if a is None else a[start:stop]

    return QuantWeight(w.q[start:stop], w.scales[start:stop], w.bits, w.block, part(w.zeros), part(w.offsets))


def _requantize4_rows(w: np.ndarray, block: int) -> QuantWeight:
    n, k = w.shape
    blocks = w.reshape(n, k // block, block)
    lo = np.minimum(blocks.min(-1), 0.0)
    hi = np.maximum(blocks.max(-1), 0.0)
    scales = np.where(hi > lo, (hi - lo) / 15.0, 1.0).astype(np.float32)
    zeros = np.clip(np.rint(-lo / scales), 0, 15).astype(np.uint8)
    q = np.clip(np.rint(blocks / scales[..., None]) + zeros[..., None], 0, 15).astype(np.uint8)
    return QuantWeight(q.reshape(n, k), scales, 4, block, zeros)
