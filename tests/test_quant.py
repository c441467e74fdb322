"""The quantized target served: a tiny quantized model whose steps and
verifies agree and whose greedy output through the services is the same in
every speculation mode, fidelity and the choice rule, and the quantized
embedding. The kernel itself: tests/test_kquant_kernel.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from target_service import kquant, quant
from tests.quant_blocks import gguf_dequantize, needs_kernel, real_tensor


# ------------------------------------------- a tiny quantized model, served
QUANT_PROMPTS = ["hello world, this is", "the quick brown fox", "abc abc abc abc"]


@pytest.fixture(scope="module")
def quant_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny Qwen2 with K-quant linear layers: (HF dir holding the exact
    float32 dequantization, its GGUF). Dims are multiples of 256."""
    from tests.conftest import TINY_CHARS
    from tests.gguf_tiny import quantize_tiny_model
    from tests.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("quant-model")
    hf = build_tiny_model(root / "hf", chars=TINY_CHARS, seed=21, hidden_size=256, intermediate_size=512,
                          num_heads=4, num_kv_heads=2)
    return hf, quantize_tiny_model(hf, root / "model.gguf")


@needs_kernel
@pytest.mark.parametrize("backend", ["kquant", "kquant-a8", "int4"])
def test_quantized_engine_steps_and_verify_agree(quant_model: tuple[Path, Path], backend: str) -> None:
    """Greedy decoding one token at a time and verifying the same tokens as
    one drafted span (every row count from 1 to 8) give the same tokens, and
    the bonus token is the next greedy token: one computation for a session
    whatever the rows of the pass."""
    from specdec.sampling import SamplingConfig
    from target_service.engine import TargetEngine

    if backend == "int4" and not quant.int4_supported(torch.device("cpu"))[0]:
        pytest.skip("ATen's int4 kernel has no vectorised path here")
    hf, gguf = quant_model
    eng = TargetEngine(hf, dtype="bfloat16", backend=backend, gguf_path=gguf)
    assert sum(isinstance(m, (kquant.KQuantLinear, quant.Int4Linear)) for m in eng.model.modules()) >= 10
    prompt = [3, 9, 14, 2, 7, 1]
    pre = eng.prefill(prompt, SamplingConfig(), sample_next=True)
    first = pre.next_token
    assert first is not None
    greedy, cache_len, new = [], len(prompt), [first]
    for _ in range(12):
        out = eng.verify(pre.session_id, cache_len, new, [], [])
        cache_len += len(new)
        new = [out.result.next_token]
        greedy.append(out.result.next_token)
    eng.release(pre.session_id)
    for k in range(1, 9):
        pre = eng.prefill(prompt, SamplingConfig(), sample_next=True)
        assert pre.next_token == first
        sid = pre.session_id
        out = eng.verify(sid, len(prompt), [first], greedy[:k], [None] * k)
        assert out.result.num_accepted == k, k
        assert out.result.next_token == greedy[k]
        eng.release(sid)


@needs_kernel
def test_quantized_target_greedy_is_the_same_in_every_mode(quant_model: tuple[Path, Path], onnx_cache_dir: Path) -> None:
    """Through real services: the kquant target's greedy output with the
    model drafter (its own float32 dequantization on ONNX Runtime) and with
    prompt lookup, FIXED and AUTO, equals its target-only output; the
    target reports the numerics it runs."""
    from draft_service.config import DrafterSpec
    from specdec.v1 import common_pb2
    from tests.stack import start_stack

    hf, gguf = quant_model
    stack = start_stack(hf, None, onnx_cache_dir, target_dtype="bfloat16",
                        target_overrides={"backend": "kquant", "gguf": str(gguf)},
                        drafters=[DrafterSpec(name="self", model=str(hf), precision="fp32"),
                                  DrafterSpec(name="prompt-lookup", kind="prompt-lookup")],
                        default_drafter="self")
    try:
        info = stack.target_stub().GetModelInfo(common_pb2.ModelInfoRequest(), timeout=30)
        assert (info.dtype, info.backend, info.numerics_chosen_by) == ("bfloat16", "kquant", "flags")
        for prompt in QUANT_PROMPTS:
            off = stack.generate(prompt=prompt, mode="off", max_new_tokens=32)
            for drafter in ("self", "prompt-lookup"):
                for mode, gamma in (("fixed", 4), ("auto", 0)):
                    spec = stack.generate(prompt=prompt, mode=mode, gamma=gamma, drafter=drafter, max_new_tokens=32)
                    assert spec["token_ids"] == off["token_ids"], (prompt, drafter, mode)
            fixed = stack.generate(prompt=prompt, mode="fixed", gamma=4, drafter="self", max_new_tokens=32)
            assert fixed["stats"].accepted_tokens > 0
        stack.wait_no_sessions()
    finally:
        stack.close()


# ------------------------------------------------- fidelity and the choice rule
FLAT = {1: 30.0, 2: 32.0, 4: 36.0, 8: 48.0, 16: 80.0}
SLOW = {k: 3 * v for k, v in FLAT.items()}
BF16_FID = {"mean_kl": 5e-4, "top1_agreement": 0.987, "positions": 256, "p99_kl": 3e-3, "max_kl": 2e-2}


def fid(kl: float, top1: float) -> dict[str, float]:
    return {**BF16_FID, "mean_kl": kl, "top1_agreement": top1}


@pytest.mark.parametrize("quant_fid,chosen", [
    (fid(3e-5, 0.998), ("bfloat16", "kquant")),   # within the bound: the fastest wins
    (fid(6e-4, 0.990), ("bfloat16", "packed")),   # mean KL above the bf16 pair's: never chosen by auto
    (fid(1e-4, 0.975), ("bfloat16", "packed")),   # top-1 agreement too far below
    (None, ("bfloat16", "packed")),               # not measured: not admissible
    # over 256 positions one flip is 0.39 points: up to two flips below are the sample's resolution...
    (fid(3e-5, 0.987 - 2 / 256), ("bfloat16", "kquant")),
    (fid(3e-5, 0.987 - 3 / 256), ("bfloat16", "packed")),  # ...three are not
    ({**fid(3e-5, 0.990), "decisive_disagreements": 1}, ("bfloat16", "packed")),  # more decisive ones than bf16
])
def test_auto_chooses_a_quantized_pair_only_within_the_fidelity_bound(quant_fid, chosen) -> None:  # type: ignore[no-untyped-def]
    from target_service import calibration as cal
    from target_service import fidelity

    # over 2,048 positions (specdec fidelity) the tolerance is TOP1_BOUND itself
    assert fidelity.top1_tolerance(2048) == fidelity.TOP1_BOUND and fidelity.top1_tolerance(256) == 2 / 256

    pairs = [("bfloat16", "packed"), ("bfloat16", "kquant")]
    measured = {("bfloat16", "packed"): (SLOW, BF16_FID), ("bfloat16", "kquant"): (FLAT, quant_fid)}
    res = cal.choose(pairs, lambda p: measured[p], None, fidelity_needed=True)
    assert (res.dtype, res.backend) == chosen
    assert res.scores["bfloat16/kquant"] > res.scores["bfloat16/packed"]  # it is the fastest either way
    assert ("bfloat16/kquant" in res.excluded) == (chosen != ("bfloat16", "kquant"))
    assert "bfloat16/packed" not in res.excluded


EAGER_FID = {**BF16_FID, "mean_kl": 5.1e-4, "top1_agreement": 0.9878, "decisive_disagreements": 0}
BF16W_FID = {**BF16_FID, "mean_kl": 4.1e-5, "top1_agreement": 0.9976, "decisive_disagreements": 0}


@pytest.mark.parametrize("a8_fid,with_eager,chosen", [
    # as faithful as transformers' bf16 (bf16 eager) and faster: auto may choose it, though bf16w is closer
    (fid(3.2e-4, 0.9917), True, ("bfloat16", "kquant-a8")),
    (fid(5.0e-4, 0.9880), True, ("bfloat16", "kquant-a8")),
    # negative controls: a mean KL above bf16 eager's, a top-1 more than the tolerance below it,
    # or a decisive disagreement bf16 eager does not make: never chosen
    (fid(5.2e-4, 0.9917), True, ("bfloat16", "bf16w")),
    (fid(3.2e-4, 0.9878 - 3 / 256), True, ("bfloat16", "bf16w")),
    ({**fid(3.2e-4, 0.9917), "decisive_disagreements": 1}, True, ("bfloat16", "bf16w")),
    # bf16 eager not measured: the stricter bound of the most faithful bf16 pair measured (bf16w)
    (fid(3.2e-4, 0.9917), False, ("bfloat16", "bf16w")),
])
def test_the_fidelity_bound_is_bf16_eager_s(a8_fid, with_eager, chosen) -> None:  # type: ignore[no-untyped-def]
    from target_service import calibration as cal

    pairs = [("bfloat16", "eager"), ("bfloat16", "bf16w"), ("bfloat16", "kquant-a8")]
    measured = {("bfloat16", "eager"): (SLOW, EAGER_FID if with_eager else None),
                ("bfloat16", "bf16w"): ({k: 2 * v for k, v in FLAT.items()}, BF16W_FID),
                ("bfloat16", "kquant-a8"): (FLAT, a8_fid)}
    res = cal.choose(pairs, lambda p: measured[p], None, fidelity_needed=True)
    assert (res.dtype, res.backend) == chosen
    assert ("bfloat16/kquant-a8" in res.excluded) == (chosen != ("bfloat16", "kquant-a8"))
    if chosen != ("bfloat16", "kquant-a8"):
        ref = "bfloat16/eager" if with_eager else "bfloat16/bf16w"
        assert ref in res.excluded["bfloat16/kquant-a8"]


def test_explicit_quantized_flags_win_without_a_fidelity_check(quant_model: tuple[Path, Path]) -> None:
    from target_service import calibration as cal

    hf, gguf = quant_model
    cpu = torch.device("cpu")
    if kquant.available()[0]:
        assert cal.resolve_pairs("auto", "kquant", cpu, gguf) == ([("bfloat16", "kquant")], "flags")
    if quant.int4_supported(cpu)[0]:
        assert cal.resolve_pairs("bfloat16", "int4-q8", cpu, gguf) == ([("bfloat16", "int4-q8")], "flags")
    with pytest.raises(ValueError, match="bfloat16 activations"):
        cal.resolve_pairs("float32", "kquant", cpu, gguf)
    with pytest.raises(ValueError, match="no GGUF"):
        cal.resolve_pairs("auto", "kquant", cpu, None)
    auto, how = cal.resolve_pairs("auto", "auto", cpu, gguf)
    assert ("bfloat16", "int4-q8") not in auto  # lossy: explicit only
    if kquant.available()[0]:
        assert ("bfloat16", "kquant-a8") in auto  # a candidate; chosen only within the fidelity bound
    assert how == "calibration"
    if kquant.available()[0]:
        assert cal.resolve_pairs("auto", "kquant-a8", cpu, gguf) == ([("bfloat16", "kquant-a8")], "flags")


def test_fidelity_is_zero_for_the_reference_and_catches_a_perturbed_model(tiny_models) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from target_service import fidelity

    tok = AutoTokenizer.from_pretrained(str(tiny_models.target))
    ids, digest = fidelity.corpus_ids(tok, 96)
    ref_model = AutoModelForCausalLM.from_pretrained(str(tiny_models.target), dtype=torch.float32).eval()
    ref = fidelity.reference_logprobs(fidelity.model_forward(ref_model), ids, 48)
    same = fidelity.compare(fidelity.model_forward(ref_model), ids, ref, 48, digest)
    assert same.positions == 96 and same.mean_kl == 0.0 and same.top1_agreement == 1.0
    noisy = AutoModelForCausalLM.from_pretrained(str(tiny_models.draft), dtype=torch.float32).eval()
    off = fidelity.compare(fidelity.model_forward(noisy), ids, ref, 48, digest)
    assert off.mean_kl > 1e-3 and off.top1_agreement < 1.0
    assert not fidelity.within_bound(off, same) and fidelity.within_bound(same, off)


@needs_kernel
def test_calibration_measures_fidelity_and_reports_it(quant_model: tuple[Path, Path], tmp_path: Path) -> None:
    """Auto calibration with a GGUF: the fidelities that decide the choice
    against float32/eager are scored and cached, and the chosen pair is
    admissible (tests/test_calibration_fidelity_plan.py: which are scored)."""
    from target_service import calibration as cal

    hf, gguf = quant_model
    res, model = cal.calibrate(hf, "auto", "auto", torch.device("cpu"), tmp_path, "tiny-quant", budget_s=5,
                               gguf_path=gguf)
    assert "bfloat16/kquant" in res.curves
    choice = f"{res.dtype}/{res.backend}"
    assert choice not in res.excluded
    quantized = [k for k in res.curves if k.split("/")[1] in quant.QUANT_BACKENDS]
    for key in quantized:  # each scored, or slower than the choice
        assert (key in res.fidelity) != (key in res.unscored), key
        if key in res.unscored:
            assert res.scores[key] <= res.scores[choice]
    for key, f in res.fidelity.items():
        assert key in quantized or key in ("bfloat16/eager", choice)  # no other plain pair is scored
        if key in quantized and key not in res.excluded:
            assert float(f["top1_agreement"]) > 0.9
    if res.backend in quant.QUANT_BACKENDS:
        assert {choice, "bfloat16/eager"} <= set(res.fidelity)
    # the kquant pairs chose their prefetch distance by timing, and it is cached with the curve
    assert res.tuning["bfloat16/kquant"]["prefetch"] in (kquant.DEFAULT_PREFETCH, 0)
    assert set(res.tuning["bfloat16/kquant"]["ms"]) == {str(kquant.DEFAULT_PREFETCH), "0"}
    assert "float32/eager" not in res.tuning
    kquant.set_prefetch(7)  # whatever is in force before a cached start
    again, _ = cal.calibrate(hf, "auto", "auto", torch.device("cpu"), tmp_path, "tiny-quant", budget_s=5,
                             gguf_path=gguf)
    assert again.cached and again.fidelity == res.fidelity and again.tuning == res.tuning
    chosen = again.tuning.get(f"{again.dtype}/{again.backend}", {})
    assert kquant.prefetch() == chosen.get("prefetch", kquant.DEFAULT_PREFETCH if again.backend in
                                           cal.KQUANT_BACKENDS else 7)
    kquant.set_prefetch(kquant.DEFAULT_PREFETCH)


@needs_kernel
def test_fused_projections_compute_the_same_logits(quant_model: tuple[Path, Path]) -> None:
    """q/k(/v) and gate/up as one kernel call each: bit-identical logits to
    one call per layer, for a prompt and for 1- to 5-token passes."""
    from transformers import AutoModelForCausalLM

    hf, gguf = quant_model
    models = []
    for fuse in (True, False):
        m = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32).eval()
        with torch.inference_mode():
            counts = quant.apply_quant(m, "kquant", gguf, fuse=fuse)
        assert (counts.get("fused_calls", 0) > 0) == fuse
        models.append(m)
    assert sum(isinstance(x, kquant.FusedSlice) for x in models[0].modules()) >= 8
    ids = torch.randint(1, 30, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        for k in (24, 1, 2, 5):
            a, b = (m(input_ids=ids[:, :k]).logits for m in models)
            assert torch.equal(a, b), k


# ------------------------------------------------- the embedding, as stored
def test_quantized_embedding_is_the_checkpoints_embedding_bit_for_bit(quant_model: tuple[Path, Path],
                                                                      tmp_path: Path) -> None:
    """The quantized backends keep the input embedding as the file's Q4_K
    rows and dequantize on lookup: every row equals the float32 checkpoint's
    exactly (repeated ids, any batch shape), so the logits are unchanged;
    ids out of range raise. Negative control: the weights the tiny model was
    built with (before quantization) differ from those rows."""
    from transformers import AutoModelForCausalLM

    hf, gguf_path = quant_model
    ref = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32).eval()
    table = ref.get_input_embeddings().weight.detach().clone()
    m = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32).eval()
    with torch.inference_mode():
        quant.apply_quant(m, "kquant", gguf_path)
    emb = m.get_input_embeddings()
    assert isinstance(emb, quant.QuantEmbedding) and emb.kind == "Q4_K"
    assert emb.rows.base is None and not isinstance(emb.rows, np.memmap)  # its own pages, not the file's
    n = table.shape[0]
    all_ids = torch.arange(n).reshape(1, n)
    with torch.inference_mode():
        assert torch.equal(emb(all_ids)[0], table)
        ids = torch.tensor([[5, 5, 0, n - 1], [7, 5, 7, 1]])
        out = emb(ids)
        assert out.shape == (2, 4, table.shape[1]) and out.dtype == torch.float32
        assert torch.equal(out, table[ids])
        with pytest.raises(IndexError):
            emb(torch.tensor([[n]]))
    # negative control: the unquantized weights the model was built from
    from tests.conftest import TINY_CHARS
    from tests.tiny import build_tiny_model

    raw = build_tiny_model(tmp_path / "hf", chars=TINY_CHARS, seed=21, hidden_size=256, intermediate_size=512,
                           num_heads=4, num_kv_heads=2)
    orig = AutoModelForCausalLM.from_pretrained(str(raw), dtype=torch.float32).get_input_embeddings().weight
    with torch.inference_mode():
        assert not torch.equal(emb(all_ids)[0], orig.detach())


def test_a_file_without_token_embd_keeps_the_checkpoints_embedding(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from tests.conftest import TINY_CHARS
    from tests.gguf_tiny import quantize_tiny_model
    from tests.tiny import build_tiny_model

    hf = build_tiny_model(tmp_path / "hf", chars=TINY_CHARS, seed=4, hidden_size=256, intermediate_size=512,
                          num_heads=4, num_kv_heads=2)
    path = quantize_tiny_model(hf, tmp_path / "m.gguf", embedding=None)
    m = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32).eval()
    with torch.inference_mode():
        quant.apply_quant(m, "kquant" if kquant.available()[0] else "int4", path)
    assert type(m.get_input_embeddings()) is torch.nn.Embedding


def test_real_embedding_rows_are_the_float32_dequantization() -> None:
    """The default target's token_embd (Q4_K, 151,936 rows): a lookup of a
    sample of ids equals gguf's float32 dequantization of those rows, the
    values the converted checkpoint holds."""
    t = real_tensor("token_embd.weight")
    emb = quant.QuantEmbedding(t)
    ids = torch.tensor([[0, 1, 151_935, 42, 42, 100_000, 7_777]])
    rows = np.asarray(t.data).reshape(t.n, -1)
    want = gguf_dequantize(rows[ids[0].numpy()], t.kind, ids.shape[1], t.k)
    with torch.inference_mode():
        assert np.array_equal(emb(ids)[0].numpy(), want)
    assert emb.nbytes == t.n * t.k // 256 * 144
