"""Block data for the quantized-target tests: random, extreme and real
K-quant blocks, gguf's own dequantization, and which kernel builds run on
this CPU."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from target_service import kquant, quant

REAL_GGUF = Path.home() / ".cache" / "specdec" / "gguf" / "qwen2.5-coder-1.5b-instruct.gguf"
BUILDS = [b for b in ("avx512bf16", "avx2") if b == "avx2" or kquant.isa() == "avx512bf16"]
needs_kernel = pytest.mark.skipif(kquant.isa() is None or not kquant.available()[0],
                                  reason="kquant kernel unavailable (needs AVX2+FMA and a C compiler)")


def random_blocks(kind: str, n: int, k: int, seed: int) -> np.ndarray:
    """Random K-quant blocks: random codes and scales, finite float16 d."""
    rng = np.random.default_rng(seed)
    per = {"Q4_K": 144, "Q6_K": 210}[kind]
    b = rng.integers(0, 256, size=(n * k // 256, per), dtype=np.uint8)
    return with_d(b, kind, (rng.random((b.shape[0], 2)) * 0.01 + 1e-4)).reshape(n, -1)


def with_d(b: np.ndarray, kind: str, d: np.ndarray) -> np.ndarray:
    """Blocks b (one a row) with their float16 d (Q4_K: d, dmin) set from
    d [blocks][2] (Q6_K uses the first column)."""
    raw = d.astype(np.float16).view(np.uint8)
    if kind == "Q4_K":
        b[:, 0:4] = raw.reshape(-1, 4)
    else:
        b[:, 208:210] = raw[:, 0:2]
    return b


def gguf_dequantize(raw: np.ndarray, kind: str, n: int, k: int) -> np.ndarray:
    import gguf

    return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).reshape(n, k)


def real_tensor(name: str) -> quant.GgufTensor:
    if not REAL_GGUF.is_file():
        pytest.skip("the default target's GGUF is not prepared (specdec models prepare)")
    return quant.GgufFile(REAL_GGUF).get(name)


def extreme_blocks(kind: str, n: int, k: int) -> np.ndarray:
    """Blocks whose every code and sub-block scale is the largest its format
    holds (Q4_K: codes 15, scales and mins 63; Q6_K: codes 31, i.e. 63 as
    the kernel stores them, scales 127), d = dmin = 2^-10."""
    per = {"Q4_K": 144, "Q6_K": 210}[kind]
    b = np.full((n * k // 256, per), 0xFF, dtype=np.uint8)
    if kind == "Q6_K":
        b[:, 192:208] = 127
    return with_d(b, kind, np.full((b.shape[0], 2), 2.0 ** -10)).reshape(n, -1)
