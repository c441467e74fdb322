"""GGUF quantized blocks, read as integers and scales (not as dequantized floats).

A quantized GGUF tensor is a row-major ``[N, K]`` matrix (N output features,
K input features, K a multiple of the block size) stored block by block along
K. This module decodes those blocks into the integer codes and per-group
scales they hold, exactly, so that a backend can hand them to a weight-only
integer kernel without ever forming a float copy of the weight. Plain numpy;
no torch, no gRPC.

Formats (ggml's ``ggml-common.h``; the dequantization formulas are those of
``gguf.quants``, which the tests compare against):

``Q4_K`` (144-byte super-blocks of 256 weights: ``d``, ``dmin`` as float16,
12 bytes of packed 6-bit sub-block scales and mins, 128 bytes of 4-bit codes)
    weight = (d · sc_j) · q − (dmin · m_j), q ∈ 0..15, one (sc_j, m_j) per
    32 weights. Decoded to ``codes`` [N, K] uint8, ``scale`` = d · sc_j and
    ``minimum`` = dmin · m_j, both [N, K/32] float32. Both products are exact
    in float32 (an 11-bit mantissa times a 6-bit integer).
``Q6_K`` (210-byte super-blocks of 256: 128 bytes of low nibbles, 64 bytes of
high 2-bit pairs, 16 int8 sub-block scales, ``d`` float16)
    weight = (d · sc_j) · (q − 32), q ∈ 0..63, one sc_j per 16 weights.
    Decoded to ``codes`` [N, K] int8 (q − 32, in −32..31) and ``scale`` =
    d · sc_j [N, K/16] float32 (exact: 11 bits times 8).
``Q8_0`` (34-byte blocks of 32: ``d`` float16, 32 int8 codes)
    weight = d · q. ``codes`` int8 [N, K], ``scale`` [N, K/32].
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

QK_K = 256

#: bytes per block and weights per block, by ggml type name
BLOCK_BYTES = {"Q4_K": 144, "Q6_K": 210, "Q8_0": 34}
BLOCK_WEIGHTS = {"Q4_K": QK_K, "Q6_K": QK_K, "Q8_0": 32}
#: weights sharing one scale, by type
GROUP = {"Q4_K": 32, "Q6_K": 16, "Q8_0": 32}


@dataclass(frozen=True)
class Blocks:
    """The integer form of one quantized tensor.

    ``weight[n, k] = scale[n, k // group] * codes[n, k] - minimum[n, k // group]``
    (``minimum`` is None for symmetric formats), computed in float32.
    """

    kind: str  # ggml type name: Q4_K, Q6_K, Q8_0
    codes: np.ndarray  # [N, K]: uint8 0..15 (Q4_K) or int8 (Q6_K: q - 32; Q8_0)
    scale: np.ndarray  # [N, K // group] float32
    minimum: np.ndarray | None  # [N, K // group] float32 (Q4_K), else None
    group: int
    # the super-block fields the scales are products of (K-quants): d and
    # dmin [N, K/256] float32, the integer sub-block scales and mins
    # [N, K/256, 8 or 16] (Q4_K: uint8 0..63; Q6_K: int8; no mins)
    d: np.ndarray | None = None
    dmin: np.ndarray | None = None
    sub_scale: np.ndarray | None = None
    sub_min: np.ndarray | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.codes.shape[0]), int(self.codes.shape[1])

    def dequantize(self) -> np.ndarray:
        """The float32 weight [N, K], by the same formula as ``gguf.quants``."""
        n, k = self.shape
        s = np.repeat(self.scale, self.group, axis=1)
        w = s * self.codes.astype(np.float32)
        if self.minimum is not None:
            w -= np.repeat(self.minimum, self.group, axis=1)
        return w.reshape(n, k)


def _as_blocks(raw: np.ndarray, kind: str, n: int, k: int) -> np.ndarray:
    """``raw`` (the tensor's bytes, any shape) as [N · K / block, block bytes] uint8."""
    per = BLOCK_WEIGHTS[kind]
    if k % per:
        raise ValueError(f"{kind} tensor with K={k} not a multiple of its block of {per}")
    b = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    want = n * (k // per) * BLOCK_BYTES[kind]
    if b.size != want:
        raise ValueError(f"{kind} tensor [{n}, {k}] should hold {want} bytes, has {b.size}")
    return b.reshape(n * (k // per), BLOCK_BYTES[kind])


def q4_k_scale_min(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit (scale, min) pairs of each Q4_K super-block from its 12
    packed bytes ([B, 12] uint8 → two [B, 8] uint8)."""
    s = packed.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def decode_q4_k(raw: np.ndarray, n: int, k: int) -> Blocks:
    b = _as_blocks(raw, "Q4_K", n, k)
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32)  # [B, 1]
    dmin = b[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, mn = q4_k_scale_min(b[:, 4:16])
    qs = b[:, 16:144].reshape(-1, 4, 1, 32)  # 4 chunks of 64 weights: low nibbles, then high
    codes = ((qs >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F).reshape(n, k)
    scale = (d * sc.astype(np.float32)).reshape(n, k // 32)
    minimum = (dmin * mn.astype(np.float32)).reshape(n, k // 32)
    kb = k // QK_K
    return Blocks("Q4_K", np.ascontiguousarray(codes), scale, minimum, 32,
                  d=d.reshape(n, kb), dmin=dmin.reshape(n, kb), sub_scale=sc.reshape(n, kb, 8),
                  sub_min=mn.reshape(n, kb, 8))


def decode_q6_k(raw: np.ndarray, n: int, k: int) -> Blocks:
    b = _as_blocks(raw, "Q6_K", n, k)
    ql = b[:, 0:128].reshape(-1, 2, 1, 64)  # 2 halves of 128 weights
    qh = b[:, 128:192].reshape(-1, 2, 1, 32)
    sci = b[:, 192:208].copy().view(np.int8)  # [B, 16]
    sc = sci.astype(np.float32)
    d = b[:, 208:210].copy().view(np.float16).astype(np.float32)
    lo = (ql >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F  # [B, 2, 2, 64]
    lo = lo.reshape(-1, 2, 4, 32)
    hi = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 0x03  # [B, 2, 4, 32]
    q = (lo | (hi << 4)).astype(np.int8) - np.int8(32)
    scale = (d * sc).reshape(n, k // 16)
    kb = k // QK_K
    return Blocks("Q6_K", np.ascontiguousarray(q.reshape(n, k)), scale, None, 16,
                  d=d.reshape(n, kb), sub_scale=sci.reshape(n, kb, 16))


def decode_q8_0(raw: np.ndarray, n: int, k: int) -> Blocks:
    b = _as_blocks(raw, "Q8_0", n, k)
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32)
    codes = b[:, 2:34].copy().view(np.int8).reshape(n, k)
    return Blocks("Q8_0", codes, d.reshape(n, k // 32), None, 32)


DECODERS = {"Q4_K": decode_q4_k, "Q6_K": decode_q6_k, "Q8_0": decode_q8_0}


def decode(raw: np.ndarray, kind: str, n: int, k: int) -> Blocks:
    """The integer form of a quantized [N, K] tensor of ggml type ``kind``."""
    try:
        return DECODERS[kind](raw, n, k)
    except KeyError:
        raise ValueError(f"no integer decoding for GGUF type {kind}; decodable: {', '.join(DECODERS)}") from None
