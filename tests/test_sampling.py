"""The rejection sampler and logits processing, tested against exact
distributions.

Statistical bound: every frequency comparison is a chi-square goodness-of-fit
test against the exactly computed distribution, rejected when p < 1e-4 (bins
with expected count < 5 merged). The RNGs are seeded, so each test is
deterministic; the bound states how unlikely a false failure would be for a
correct sampler under a fresh seed (1 in 10,000 per test).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specdec.sampling import (
    SamplingConfig,
    draft_distribution,
    greedy_verify,
    make_generator,
    process_logits,
    rejection_sample,
    sample_sparse,
)
from specdec.errors import InvalidArgument

ALPHA = 1e-4


def assert_matches(counts: np.ndarray, probs: np.ndarray) -> None:
    n = counts.sum()
    probs = probs / probs.sum()
    expected = probs * n
    order = np.argsort(-expected)
    exp_s, cnt_s = expected[order], counts[order]
    assert cnt_s[exp_s == 0].sum() == 0, "sampled a token with zero probability"
    keep = exp_s >= 5
    e = np.append(exp_s[keep], exp_s[~keep].sum())
    c = np.append(cnt_s[keep], cnt_s[~keep].sum())
    if e[-1] == 0:
        e, c = e[:-1], c[:-1]
    if len(e) < 2:
        return
    stat, pvalue = chisquare(c, e * c.sum() / e.sum())
    assert pvalue > ALPHA, f"chi-square p={pvalue:.2e}: counts {c.tolist()} vs expected {np.round(e, 1).tolist()}"


def hf_reference(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Hugging Face's own warpers, for comparison with process_logits."""
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    x = TemperatureLogitsWarper(cfg.temperature)(None, logits.clone().float())
    if cfg.top_k:
        x = TopKLogitsWarper(cfg.top_k)(None, x)
    if cfg.top_p < 1.0:
        x = TopPLogitsWarper(cfg.top_p)(None, x)
    return x.softmax(-1)


CONFIGS = [
    SamplingConfig(temperature=1.0),
    SamplingConfig(temperature=0.7, top_k=4),
    SamplingConfig(temperature=1.3, top_p=0.8),
    SamplingConfig(temperature=0.9, top_k=6, top_p=0.9),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
def test_process_logits_equals_hf_warpers(cfg: SamplingConfig) -> None:
    torch.manual_seed(0)
    logits = torch.randn(5, 50) * 3
    ours = process_logits(logits, cfg)
    ref = hf_reference(logits, cfg)
    torch.testing.assert_close(ours, ref, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
@pytest.mark.parametrize("draft_kind", ["dense", "truncated", "onehot"])
def test_first_committed_token_has_target_distribution(cfg: SamplingConfig, draft_kind: str) -> None:
    """Whatever q the drafter sampled from, the first committed token of a
    span is distributed as p_1 (accepted x or recovered token)."""
    vocab, n = 10, 20_000
    g = torch.Generator().manual_seed(1)
    target_logits = torch.randn(2, vocab, generator=g) * 2
    p = process_logits(target_logits, cfg)  # [2, V]
    draft_logits = (target_logits[0] + torch.randn(vocab, generator=g)).numpy()
    dcfg = SamplingConfig(temperature=1.0, top_k=3 if draft_kind == "truncated" else 0)
    ids, probs = draft_distribution(draft_logits, dcfg, max_support=64)
    rng = np.random.default_rng(2)
    gen = make_generator(3)
    counts = np.zeros(vocab)
    for _ in range(n):
        if draft_kind == "onehot":
            x = int(rng.integers(vocab))
            q = None
        else:
            x = sample_sparse(ids, probs, rng)
            q = (ids, probs)
        res = rejection_sample([x], [q], p, gen)
        counts[x if res.num_accepted == 1 else res.next_token] += 1
    assert_matches(counts, p[0].double().numpy())


def test_two_position_span_joint_distribution() -> None:
    """With fixed rows, the pair (t1, t2) committed from a γ=2 span follows
    p_1(t1) · p_2(t2 | t1 accepted); the second token is the bonus/recovered
    of row 2 only when t1 was the drafted token."""
    vocab, n = 6, 30_000
    g = torch.Generator().manual_seed(5)
    p = process_logits(torch.randn(3, vocab, generator=g), SamplingConfig(temperature=1.0))
    q_logits = torch.randn(2, vocab, generator=g).numpy()
    cfg = SamplingConfig(temperature=1.0)
    qs = [draft_distribution(q_logits[i], cfg, 64) for i in range(2)]
    rng = np.random.default_rng(7)
    gen = make_generator(8)
    second = np.zeros(vocab)
    for _ in range(n):
        x = [sample_sparse(*qs[0], rng), sample_sparse(*qs[1], rng)]
        res = rejection_sample(x, qs, p, gen)
        if res.num_accepted >= 1:
            t2 = x[1] if res.num_accepted == 2 else res.next_token
            second[t2] += 1
    # Given t1 was committed through acceptance, t2 ~ p_2 (the rows are fixed).
    assert_matches(second, p[1].double().numpy())


def test_p_equals_q_always_accepts_and_bonus_from_last_row() -> None:
    vocab = 8
    logits = torch.randn(3, vocab)
    cfg = SamplingConfig(temperature=1.0)
    p = process_logits(logits, cfg)
    gen = make_generator(0)
    rng = np.random.default_rng(0)
    bonus = np.zeros(vocab)
    for _ in range(5000):
        qs = [draft_distribution(logits[i].numpy(), cfg, 64) for i in range(2)]
        x = [sample_sparse(*q, rng) for q in qs]
        res = rejection_sample(x, qs, p, gen)
        assert res.num_accepted == 2 and res.is_bonus
        bonus[res.next_token] += 1
    assert_matches(bonus, p[2].double().numpy())


def test_disjoint_support_always_rejects_and_recovers_from_p() -> None:
    vocab = 8
    p = torch.zeros(2, vocab)
    p[0, :4] = torch.tensor([0.1, 0.2, 0.3, 0.4])
    p[1, 0] = 1.0
    q = (np.array([6, 7]), np.array([0.5, 0.5], dtype=np.float32))
    gen = make_generator(0)
    counts = np.zeros(vocab)
    for i in range(4000):
        res = rejection_sample([6 + i % 2], [q], p, gen)
        assert res.num_accepted == 0 and not res.is_bonus
        counts[res.next_token] += 1
    assert_matches(counts, p[0].double().numpy())


def test_onehot_q_accepts_with_probability_p_and_recovers_without_x() -> None:
    vocab = 5
    p = torch.tensor([[0.5, 0.2, 0.2, 0.1, 0.0], [0.2] * 5])
    gen = make_generator(4)
    accepted = 0
    rec = np.zeros(vocab)
    n = 20_000
    for _ in range(n):
        res = rejection_sample([0], [None], p, gen)
        if res.num_accepted:
            accepted += 1
        else:
            rec[res.next_token] += 1
    # acceptance ~ Binomial(n, 0.5): 4.5 sigma band
    assert abs(accepted / n - 0.5) < 4.5 * np.sqrt(0.25 / n)
    assert rec[0] == 0  # the drafted token is removed from the residual
    assert_matches(rec, np.array([0.0, 0.4, 0.4, 0.2, 0.0]))


def test_zero_probability_draft_token_is_always_rejected() -> None:
    p = torch.tensor([[0.0, 1.0, 0.0], [1 / 3] * 3])
    q = (np.array([0, 2]), np.array([0.5, 0.5], dtype=np.float32))
    gen = make_generator(0)
    for _ in range(200):
        res = rejection_sample([0], [q], p, gen)
        assert (res.num_accepted, res.next_token) == (0, 1)


def test_greedy_verify_cases() -> None:
    assert greedy_verify([1, 2, 3], [1, 2, 3, 9]) == greedy_verify([1, 2, 3], [1, 2, 3, 9])
    r = greedy_verify([1, 2, 3], [1, 2, 3, 9])
    assert (r.num_accepted, r.next_token, r.is_bonus) == (3, 9, True)
    r = greedy_verify([5, 2, 3], [1, 2, 3, 9])
    assert (r.num_accepted, r.next_token, r.is_bonus) == (0, 1, False)
    r = greedy_verify([1, 7], [1, 2, 3])
    assert (r.num_accepted, r.next_token, r.is_bonus) == (1, 2, False)
    r = greedy_verify([], [4])
    assert (r.num_accepted, r.next_token, r.is_bonus) == (0, 4, True)


def test_draft_distribution_is_what_sample_sparse_draws() -> None:
    rng = np.random.default_rng(0)
    logits = rng.normal(size=40) * 2
    cfg = SamplingConfig(temperature=0.8, top_k=10, top_p=0.9)
    ids, probs = draft_distribution(logits, cfg, max_support=8)
    assert len(ids) <= 8 and abs(float(probs.sum()) - 1) < 1e-6 and (probs > 0).all()
    counts = np.zeros(40)
    for _ in range(20_000):
        counts[sample_sparse(ids, probs, rng)] += 1
    dense = np.zeros(40)
    dense[ids] = probs
    assert_matches(counts, dense)
    gid, gp = draft_distribution(logits, SamplingConfig(), 8)
    assert gid.tolist() == [int(np.argmax(logits))] and gp.tolist() == [1.0]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -1.0},
        {"temperature": float("nan")},
        {"temperature": float("inf")},
        {"top_p": 1.5},
        {"top_p": -0.1},
        {"top_p": float("nan")},
        {"top_k": -1},
    ],
)
def test_invalid_sampling_values_are_rejected(kwargs: dict) -> None:
    with pytest.raises(InvalidArgument):
        SamplingConfig(**kwargs).validate()
