"""OnnxDrafter on tiny real models: greedy drafts equal transformers' greedy
continuation, KV rollback to the longest common prefix equals a fresh session,
and the q returned per position is exactly the distribution that was sampled
(chi-square on the sampled frequencies)."""

from __future__ import annotations

import copy
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import torch
from scipy import stats
from transformers import AutoModelForCausalLM

from draft_service.drafter import DraftLoop, DraftRequest, OnnxDrafter, Proposal
from draft_service.onnx_model import OnnxCausalLM
from draft_service.tli import Intersection
from specdec.errors import InvalidArgument
from specdec.sampling import SamplingConfig, draft_distribution

if TYPE_CHECKING:
    from tests.conftest import TinyModels, TinyOnnx

# Chi-square acceptance threshold. With fixed seeds the tests are deterministic;
# the bound says how unlikely a pass would be by chance if q were wrong (the
# negative controls below show the test has the power to notice).
P_MIN = 1e-4


def _chi2_p(observed: np.ndarray, probs: np.ndarray) -> float:
    """p-value of observed counts against a distribution (rescaled to the count)."""
    expected = probs.astype(np.float64) / float(np.sum(probs, dtype=np.float64)) * observed.sum()
    return float(stats.chisquare(observed, expected).pvalue)


def _drafter(onnx_dir: Path, max_support: int = 64, max_cache_tokens: int | None = None) -> OnnxDrafter:
    model = OnnxCausalLM(onnx_dir, execution="cpu", intra_op_threads=1, max_cache_tokens=max_cache_tokens)
    return OnnxDrafter("tiny", model, max_support=max_support)


@pytest.fixture(scope="module")
def drafter(tiny_onnx: TinyOnnx) -> OnnxDrafter:
    return _drafter(tiny_onnx.draft_fp32)


@pytest.fixture(scope="module")
def small_drafter(tiny_onnx: TinyOnnx) -> OnnxDrafter:
    return _drafter(tiny_onnx.small_draft_fp32)


def _assert_same(a: Proposal, b: Proposal) -> None:
    assert a.token_ids == b.token_ids
    assert len(a.q) == len(b.q) == len(a.token_ids)
    for (ia, pa), (ib, pb) in zip(a.q, b.q):
        np.testing.assert_array_equal(ia, ib)
        np.testing.assert_allclose(pa, pb, atol=1e-5)


def test_greedy_draft_equals_transformers_greedy(drafter: OnnxDrafter, tiny_models: TinyModels) -> None:
    committed = [int(x) for x in np.random.default_rng(1).integers(1, 34, 40)]
    p = drafter.propose(drafter.new_state(), committed, 12, SamplingConfig(), np.random.default_rng(0))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_models.draft), dtype=torch.float32)
    ref = model.generate(
        torch.tensor([committed]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0
    )[0, len(committed) :].tolist()
    assert p.token_ids == ref
    for x, (ids, probs) in zip(p.token_ids, p.q):  # greedy q is one-hot on the drafted token
        assert ids.tolist() == [x] and probs.tolist() == [1.0]


@pytest.mark.parametrize(
    "cfg",
    [SamplingConfig(), SamplingConfig(temperature=0.8, top_k=10, seed=3), SamplingConfig(temperature=1.3, top_p=0.9)],
    ids=["greedy", "topk", "topp"],
)
def test_rollback_equals_a_fresh_session(drafter: OnnxDrafter, cfg: SamplingConfig) -> None:
    """Rounds of: propose; the committed sequence then takes an accepted prefix
    of the draft plus a different token, or is rewritten further back (a
    re-tokenization), or stays the same. Each proposal must equal one from a
    fresh state fed the whole committed sequence, with the same RNG state."""
    plan = np.random.default_rng(42)
    state = drafter.new_state()
    committed = [int(x) for x in plan.integers(1, 34, 30)]
    rng = np.random.default_rng(7)
    for round_ in range(25):
        gamma = int(plan.integers(1, 9))
        fresh_rng = copy.deepcopy(rng)
        got = drafter.propose(state, committed, gamma, cfg, rng)
        want = drafter.propose(drafter.new_state(), committed, gamma, cfg, fresh_rng)
        _assert_same(got, want)
        assert state.cache.length == len(state.tokens) == len(committed) + gamma - 1
        kind = round_ % 4
        if kind == 0:  # k accepted, then a recovered token that differs
            k = int(plan.integers(0, gamma))
            committed = committed + got.token_ids[:k] + [(got.token_ids[k] % 33) + 1]
        elif kind == 1:  # all accepted + bonus
            committed = committed + got.token_ids + [int(plan.integers(1, 34))]
        elif kind == 2:  # rewrite a few tokens behind the end (re-tokenization)
            cut = len(committed) - int(plan.integers(1, 5))
            committed = committed[:cut] + [int(x) for x in plan.integers(1, 34, 3)]
        # kind 3: unchanged committed (LCP == len(committed): refeed the last token)


def test_q_is_exactly_what_was_sampled(small_drafter: OnnxDrafter) -> None:
    """First drafted token, vocab 6, temperature 1: the sampled frequencies over
    N draws match the q sent (chi-square, p > P_MIN), and q is identical across
    calls with the same context. 6 outcomes, N = 6,000: detects Δ = 0.026
    between two outcomes of probability 1/6 (tests/test_sampling.py
    ``detectable_shift``)."""
    n = 6000
    committed = [1, 2, 3, 4, 5, 1, 2]
    cfg = SamplingConfig(temperature=1.0)
    rng = np.random.default_rng(123)
    state = small_drafter.new_state()
    first = small_drafter.propose(state, committed, 1, cfg, rng)
    q_ids, q_probs = first.q[0]
    counts: Counter[int] = Counter()
    for _ in range(n):
        p = small_drafter.propose(state, committed, 1, cfg, rng)
        ids, probs = p.q[0]
        np.testing.assert_array_equal(ids, q_ids)
        np.testing.assert_allclose(probs, q_probs, atol=1e-6)
        counts[p.token_ids[0]] += 1
    assert set(counts) <= set(q_ids.tolist())
    assert len(q_ids) == 6 and abs(float(q_probs.sum()) - 1.0) < 1e-5
    observed = np.array([counts[int(i)] for i in q_ids], dtype=np.float64)
    assert _chi2_p(observed, q_probs) > P_MIN
    # negative control: the same frequencies reject a slightly different q
    logits = small_drafter.model.forward(small_drafter.model.new_state(), committed)[-1]
    wrong_ids, wrong_probs = draft_distribution(logits, SamplingConfig(temperature=1.25), 64)
    wrong = dict(zip(wrong_ids.tolist(), wrong_probs.astype(np.float64).tolist()))
    assert _chi2_p(observed, np.array([wrong[int(i)] for i in q_ids])) < P_MIN


def test_second_position_q_is_conditional_on_the_first(small_drafter: OnnxDrafter) -> None:
    """The second drafted token, among the draws whose first token was the
    most frequent x1, follows the q sent for it, and that q is the model's
    distribution after x1; the first position's q is rejected (negative
    control). The group holds at least 4000 / 6 = 667 draws (pigeonhole over
    six first tokens): 6 outcomes, detects Δ = 0.079 between two outcomes of
    probability 1/6 (tests/test_sampling.py ``detectable_shift``)."""
    n = 4000
    committed = [2, 4, 1, 3]
    cfg = SamplingConfig(temperature=2.5)  # a spread q, so frequencies carry information
    rng = np.random.default_rng(5)
    state = small_drafter.new_state()
    by_first: dict[int, list[Proposal]] = {}
    for _ in range(n):
        p = small_drafter.propose(state, committed, 2, cfg, rng)
        by_first.setdefault(p.token_ids[0], []).append(p)
    x1, group = max(by_first.items(), key=lambda kv: len(kv[1]))
    assert len(group) >= n // 6
    q_ids, q_probs = group[0].q[1]
    for p in group:
        np.testing.assert_allclose(p.q[1][1], q_probs, atol=1e-5)
    counts = Counter(p.token_ids[1] for p in group)
    observed = np.array([counts[int(i)] for i in q_ids], dtype=np.float64)
    assert _chi2_p(observed, q_probs) > P_MIN
    # negative control: the q of the first position (a drafter that did not
    # condition on x1) is rejected by the same frequencies
    first_ids, first_probs = group[0].q[0]
    first = dict(zip(first_ids.tolist(), first_probs.astype(np.float64).tolist()))
    assert _chi2_p(observed, np.array([first.get(int(i), 1e-12) for i in q_ids])) < P_MIN
    # and it is the model's distribution after x1
    logits = small_drafter.model.forward(small_drafter.model.new_state(), committed + [x1])[-1]
    ref_ids, ref_probs = draft_distribution(logits, cfg, 64)
    np.testing.assert_array_equal(ref_ids, q_ids)
    np.testing.assert_allclose(ref_probs, q_probs, atol=1e-5)


def test_truncation_top_k_top_p_and_max_support(tiny_onnx: TinyOnnx) -> None:
    d = _drafter(tiny_onnx.draft_fp32, max_support=4)
    rng = np.random.default_rng(0)
    committed = [5, 6, 7, 8]
    for cfg, limit in [
        (SamplingConfig(temperature=1.0), 4),  # max_support caps q
        (SamplingConfig(temperature=1.0, top_k=2), 2),
        (SamplingConfig(temperature=2.0, top_p=0.5), 4),
    ]:
        p = d.propose(d.new_state(), committed, 6, cfg, rng)
        for x, (ids, probs) in zip(p.token_ids, p.q):
            assert 1 <= len(ids) <= limit and x in ids.tolist()
            assert abs(float(probs.sum()) - 1.0) < 1e-5 and (probs > 0).all()
            assert ids.dtype == np.int32 and probs.dtype == np.float32


def test_truncated_q_is_what_was_sampled(small_drafter: OnnxDrafter) -> None:
    n = 4000
    committed = [3, 3, 1]
    cfg = SamplingConfig(temperature=1.5, top_k=3)
    rng = np.random.default_rng(9)
    state = small_drafter.new_state()
    counts: Counter[int] = Counter()
    q_ids = q_probs = None
    for _ in range(n):
        p = small_drafter.propose(state, committed, 1, cfg, rng)
        q_ids, q_probs = p.q[0]
        counts[p.token_ids[0]] += 1
    assert q_ids is not None and q_probs is not None and len(q_ids) == 3
    assert set(counts) <= set(q_ids.tolist())
    observed = np.array([counts[int(i)] for i in q_ids], dtype=np.float64)
    assert _chi2_p(observed, q_probs) > P_MIN


def test_context_limit_shortens_the_draft(tiny_onnx: TinyOnnx) -> None:
    d = _drafter(tiny_onnx.draft_fp32, max_cache_tokens=20)
    rng = np.random.default_rng(0)
    state = d.new_state()
    assert len(d.propose(state, list(range(1, 19)), 5, SamplingConfig(), rng).token_ids) == 3
    assert len(d.propose(state, list(range(1, 21)), 5, SamplingConfig(), rng).token_ids) == 1
    assert d.propose(state, list(range(1, 22)), 5, SamplingConfig(), rng).token_ids == []
    # still usable after hitting the limit
    assert len(d.propose(state, [1, 2, 3], 4, SamplingConfig(), rng).token_ids) == 4


def test_bad_calls(drafter: OnnxDrafter) -> None:
    rng = np.random.default_rng(0)
    with pytest.raises(InvalidArgument):
        drafter.propose(drafter.new_state(), [], 2, SamplingConfig(), rng)
    with pytest.raises(InvalidArgument):
        drafter.propose(drafter.new_state(), [1], 0, SamplingConfig(), rng)


def test_a_vocab_hook_restricts_and_maps_ids(drafter: OnnxDrafter) -> None:
    """The shared loop with a restriction to even draft ids, proposed as id // 2
    (the TLI hook's shape): greedy picks the argmax among the even ids, feeds
    the draft id back and sends q over the mapped ids."""
    even = np.arange(0, drafter.vocab_size, 2, dtype=np.int64)
    loop = DraftLoop(drafter.model, 8, Intersection(even, (even // 2).astype(np.int32)))
    committed = [int(x) for x in np.random.default_rng(3).integers(1, 34, 12)]
    state = drafter.new_state()
    p = loop.run(state, committed, DraftRequest(committed, 3, SamplingConfig(), np.random.default_rng(0)))
    fed = list(committed)
    for x, (ids, probs) in zip(p.token_ids, p.q):
        logits = drafter.model.forward(drafter.model.new_state(), fed)[-1]
        assert x == int(np.argmax(logits[even]))
        assert ids.tolist() == [x] and probs.tolist() == [1.0]
        fed.append(2 * x)
    assert len(p.token_ids) == 3 and state.tokens == fed[:-1]


def test_a_failed_step_resets_the_state(drafter: OnnxDrafter, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure inside the loop leaves an empty cache and token list, never
    a cache out of step with its tokens; the next call drafts as a fresh one."""
    committed = [int(x) for x in np.random.default_rng(4).integers(1, 34, 10)]
    cfg = SamplingConfig()
    state = drafter.new_state()
    drafter.propose(state, committed, 2, cfg, np.random.default_rng(0))
    forward = drafter.model.forward
    calls = iter(range(10))

    def failing(cache: Any, ids: list[int]) -> np.ndarray:
        if next(calls) == 1:  # the first drafted token's forward
            raise RuntimeError("boom")
        return forward(cache, ids)

    monkeypatch.setattr(drafter.model, "forward", failing)
    with pytest.raises(RuntimeError, match="boom"):
        drafter.propose(state, committed + [5], 3, cfg, np.random.default_rng(0))
    assert state.cache.length == 0 and state.tokens == []
    monkeypatch.undo()
    got = drafter.propose(state, committed + [5], 3, cfg, np.random.default_rng(0))
    _assert_same(got, drafter.propose(drafter.new_state(), committed + [5], 3, cfg, np.random.default_rng(0)))
