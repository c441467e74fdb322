"""The kquant kernel and its blocks: GGUF K-quant blocks decoded exactly,
repacked for the kquant kernel and torch's int4 kernel, the kernels against
float64 on the exact dequantization (bf16 and 8-bit activations, extreme
codes included), each row's output independent of the rows beside it, and
the same bits on both kernel builds.

Real block data comes from the default target's GGUF when it is prepared
(the real-model test prepares it), synthetic blocks from random bytes and
from tests/gguf_tiny.py's quantizers.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec.models.gguf_blocks import decode
from target_service import kquant, quant
from tests.gguf_tiny import quantize_q4_k, quantize_q6_k
from tests.quant_blocks import BUILDS, extreme_blocks, gguf_dequantize, needs_kernel, random_blocks, real_tensor


# ------------------------------------------------------------------ decoding
@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_decode_random_blocks_is_ggufs_dequantization(kind: str) -> None:
    raw = random_blocks(kind, 12, 512, seed=3)
    b = decode(raw, kind, 12, 512)
    assert np.array_equal(b.dequantize(), gguf_dequantize(raw, kind, 12, 512))


@pytest.mark.parametrize("name,kind", [("blk.0.attn_k.weight", "Q4_K"), ("blk.0.attn_v.weight", "Q6_K")])
def test_decode_real_blocks_is_ggufs_dequantization(name: str, kind: str) -> None:
    t = real_tensor(name)
    assert t.kind == kind
    b = decode(t.data, t.kind, t.n, t.k)
    assert np.array_equal(b.dequantize(), gguf_dequantize(t.data, t.kind, t.n, t.k))


@pytest.mark.parametrize("quantize,kind", [(quantize_q4_k, "Q4_K"), (quantize_q6_k, "Q6_K")])
def test_test_quantizers_write_valid_blocks(quantize, kind: str) -> None:  # type: ignore[no-untyped-def]
    w = np.random.default_rng(0).standard_normal((8, 512)).astype(np.float32)
    raw = quantize(w)
    deq = gguf_dequantize(raw, kind, 8, 512)
    assert np.array_equal(decode(raw, kind, 8, 512).dequantize(), deq)
    assert np.abs(deq - w).mean() < (0.15 if kind == "Q4_K" else 0.05) * np.abs(w).mean()


def test_decode_refuses_a_wrong_size() -> None:
    with pytest.raises(ValueError, match="should hold"):
        decode(random_blocks("Q4_K", 4, 256, 0)[:, :-1], "Q4_K", 4, 256)


# -------------------------------------------------------------- the kernels
def reference(x: torch.Tensor, w: np.ndarray, bias: torch.Tensor | None = None) -> torch.Tensor:
    """float64 product of the bf16-rounded input and the exact dequantization."""
    y = x.to(torch.bfloat16).double() @ torch.from_numpy(w).double().T
    return y if bias is None else y + bias.double()


@needs_kernel
@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_kquant_matches_the_exact_dequantization(build: str, kind: str) -> None:
    n, k = 44, 768  # N not a multiple of 8: a padded last group
    raw = random_blocks(kind, n, k, seed=7)
    b = decode(raw, kind, n, k)
    bias = torch.randn(n)
    lin = kquant.KQuantLinear(b, bias, build)
    x = torch.randn(5, k)
    ref = reference(x, b.dequantize(), bias)
    y = lin(x).double()
    assert y.shape == (5, n)
    # float32 sums of 768 products (the code offset of the AVX-512 build costs
    # about 4 of float32's 24 bits): far below the bf16 rounding of the input
    assert (y - ref).abs().max() <= 1e-5 * ref.abs().max()
    # negative control: the same check catches one code moved by half its range
    # (on an input weighted so that it shows)
    x[:, 0] = 50.0
    y = lin(x).double()
    bad = b.codes.copy()
    bad[0, 0] = bad[0, 0] ^ 8 if kind == "Q4_K" else (bad[0, 0] + 48) % 64 - 32
    wrong = reference(x, type(b)(b.kind, bad, b.scale, b.minimum, b.group).dequantize(), bias)
    assert (y - reference(x, b.dequantize(), bias)).abs().max() <= 1e-5 * ref.abs().max()
    assert (y - wrong).abs().max() > 1e-5 * ref.abs().max()


@needs_kernel
@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("name", ["blk.0.attn_q.weight", "blk.0.ffn_down.weight"])
def test_kquant_on_real_blocks(build: str, name: str) -> None:
    t = real_tensor(name)
    b = decode(t.data, t.kind, t.n, t.k)
    x = torch.randn(3, t.k)
    ref = reference(x, b.dequantize())
    y = kquant.KQuantLinear(b, None, build)(x).double()
    assert (y - ref).abs().max() <= 1e-5 * ref.abs().max()


@needs_kernel
@pytest.mark.parametrize("acts", kquant.ACTS)
@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_kquant_rows_are_independent_of_the_rows_beside_them(build: str, kind: str, acts: str) -> None:
    """Every row count from 1 to 20 (one, two and three groups of rows, every
    tile), two thread counts: each row bit for bit as computed alone (bf16
    and 8-bit activations)."""
    n, k = 40, 512
    lin = kquant.KQuantLinear(decode(random_blocks(kind, n, k, seed=11), kind, n, k), torch.randn(n), build, acts)
    x = torch.randn(20, k)
    kquant._library(build)[0].kq_set_threads(1)  # type: ignore[union-attr]
    alone = torch.cat([lin(x[i:i + 1]) for i in range(20)])
    kquant._library(build)[0].kq_set_threads(2)  # type: ignore[union-attr]
    for m in range(1, 21):
        assert torch.equal(lin(x[:m]), alone[:m]), f"{m} rows"
    assert torch.equal(torch.cat([lin(x[:7]), lin(x[7:])]), alone)


@needs_kernel
@pytest.mark.parametrize("acts", kquant.ACTS)
@pytest.mark.parametrize("build", BUILDS)
def test_kquant_prefetch_distance_changes_no_bit(build: str, acts: str) -> None:
    """The software-prefetch distance that calibration chooses per machine
    is timing only: every distance gives the same bits (Q4_K and Q6_K, 1-9
    rows), and the setting reads back as set."""
    lins = [kquant.KQuantLinear(decode(random_blocks(kind, 40, 1024, seed=13), kind, 40, 1024), None, build, acts)
            for kind in ("Q4_K", "Q6_K")]
    x = torch.randn(9, 1024)
    before = kquant.prefetch(build)
    try:
        kquant.set_prefetch(kquant.DEFAULT_PREFETCH, build)
        want = [lin(x[:m]) for lin in lins for m in (1, 4, 9)]
        for ahead in (0, 1, 16, 64):
            assert kquant.set_prefetch(ahead, build) == ahead
            assert kquant.prefetch(build) == ahead
            got = [lin(x[:m]) for lin in lins for m in (1, 4, 9)]
            assert all(torch.equal(g, w) for g, w in zip(got, want)), f"prefetch {ahead}"
        assert kquant.set_prefetch(99, build) == 64  # clamped
    finally:
        kquant.set_prefetch(before, build)


def quantize_a8(x: torch.Tensor) -> torch.Tensor:
    """The a8 kernel's input, in float64: each lane of 16 consecutive
    elements as int8 codes round(x · 127 / max|x|) (half to even) times its
    float32 scale max|x| / 127."""
    m, k = x.shape
    lanes = x.float().reshape(m, k // 16, 16)
    amax = lanes.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    codes = torch.round(lanes * inv).clamp(-127, 127)
    return (codes.double() * (amax / 127.0).double()).reshape(m, k)


@needs_kernel
@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_kquant_a8_is_the_exact_product_of_its_quantized_input(build: str, kind: str) -> None:
    """kquant-a8: the int32 sums are exact, so the output is the float64
    product of the lane-quantized input and the exact dequantization up to
    float32 rounding of the per-lane scaling (far below the 8-bit rounding of
    the input, which the same check catches as a negative control)."""
    n, k = 44, 768
    b = decode(random_blocks(kind, n, k, seed=7), kind, n, k)
    bias = torch.randn(n)
    w = torch.from_numpy(b.dequantize()).double()
    x = torch.randn(5, k)
    x[1, 16:32] = 0.0  # a lane of zeros (scale 0)
    x[2, :16] *= 1e3  # an outlier lane beside ordinary ones
    y = kquant.KQuantLinear(b, bias, build, acts="a8")(x).double()
    ref = quantize_a8(x) @ w.T + bias.double()
    tol = 1e-5 * ref.abs().max()
    assert (y - ref).abs().max() <= tol
    # negative control: the unquantized input's product is farther away than the bound
    assert (y - (x.double() @ w.T + bias.double())).abs().max() > 10 * tol
    # and one code moved by half its range is caught
    bad = b.codes.copy()
    bad[0, 0] = bad[0, 0] ^ 8 if kind == "Q4_K" else (bad[0, 0] + 48) % 64 - 32
    xw = x.clone()
    xw[:, 0] = 50.0
    yw = kquant.KQuantLinear(b, bias, build, acts="a8")(xw).double()
    wrong = quantize_a8(xw) @ torch.from_numpy(type(b)(b.kind, bad, b.scale, b.minimum, b.group).dequantize()).double().T
    assert (yw - (quantize_a8(xw) @ w.T + bias.double())).abs().max() <= tol
    assert (yw - (wrong + bias.double())).abs().max() > tol


@needs_kernel
@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_kquant_a8_extreme_codes_and_activations_do_not_saturate(build: str, kind: str) -> None:
    """The AVX2 build adds two vpmaddubsw pair sums as int16 before widening:
    at the largest codes (Q6_K: 63 stored) and activations (±127 in every
    lane) each int16 sum is ±2·2·63·127 = ±32004, the most it can be, and
    the output is still the exact product of the quantized input (a
    saturated sum would be off by at least one whole code product, far
    outside the bound)."""
    n, k = 16, 512
    b = decode(extreme_blocks(kind, n, k), kind, n, k)
    top = {"Q4_K": 15, "Q6_K": 31}[kind]
    assert (b.codes == top).all()
    w = torch.from_numpy(b.dequantize()).double()
    x = torch.ones(4, k)
    x[1] = -1.0  # every code -127
    x[2, ::2] = -1.0  # alternating signs within every pair
    x[3] = torch.linspace(-1.0, 1.0, k)
    # rows 0 and 1: every lane's max is every element, so every code is ±127
    lin = kquant.KQuantLinear(b, None, build, acts="a8")
    y = lin(x).double()
    ref = quantize_a8(x) @ w.T
    tol = 1e-6 * ref.abs().max()  # float32 rounding of the per-lane scaling
    assert (y - ref).abs().max() <= tol
    # the bound is finer than one weight times one activation code step, the
    # least a lost or saturated integer term would move an output
    assert tol < float(w.abs().min()) / 127.0
    alone = torch.cat([lin(x[i:i + 1]) for i in range(4)])
    assert torch.equal(alone, y.float())


@needs_kernel
@pytest.mark.parametrize("name", ["blk.0.attn_q.weight", "blk.0.ffn_down.weight"])
def test_kquant_a8_on_real_blocks_is_the_same_on_both_builds(name: str) -> None:
    """On the real file's blocks: the exact product of the quantized input,
    and bit for bit the same on the AVX-512 VNNI and the AVX2 build (integer
    sums, then the same float32 operations in the same order)."""
    t = real_tensor(name)
    b = decode(t.data, t.kind, t.n, t.k)
    x = torch.randn(3, t.k, generator=torch.Generator().manual_seed(5))
    ref = quantize_a8(x) @ torch.from_numpy(b.dequantize()).double().T
    outs = [kquant.KQuantLinear(b, None, build, acts="a8")(x) for build in BUILDS]
    assert (outs[0].double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    for y in outs[1:]:
        assert torch.equal(y, outs[0])


def test_int4_pack_maps_q4_k_exactly_up_to_bf16_scales() -> None:
    """ATen's w = (q − 8)·S + Z with S = d·sc and Z = 8·S − dmin·m: the same
    weight as the file's up to the bf16 rounding of S and Z."""
    if not quant.int4_supported(torch.device("cpu"))[0]:
        pytest.skip("ATen's int4 kernel has no vectorised path here")
    n, k = 64, 512
    b = decode(random_blocks("Q4_K", n, k, seed=5), "Q4_K", n, k)
    packed, sz = quant.int4_pack(b)
    lin = quant.Int4Linear(k, n, packed, sz, None)
    x = torch.randn(4, k)
    s = sz[..., 0].float().repeat_interleave(32, 0).T.numpy()
    z = sz[..., 1].float().repeat_interleave(32, 0).T.numpy()
    w_bf16_scales = (b.codes.astype(np.float32) - 8) * s + z
    ref = reference(x, w_bf16_scales)
    y = lin(x).double()
    assert (y - ref).abs().max() <= 2e-2 * ref.abs().max()  # bf16 output rounding
    assert np.abs(w_bf16_scales - b.dequantize()).max() <= 2 ** -7 * np.abs(b.dequantize()).max()
    alone = torch.cat([lin(x[i:i + 1]) for i in range(4)])
    assert torch.equal(lin(x), alone)
