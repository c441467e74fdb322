"""The rejection sampler and logits processing, tested against exact
distributions.

Statistical bound: every frequency comparison is a chi-square goodness-of-fit
test against the exactly computed distribution, rejected when p < 1e-4 (bins
with expected count < 5 merged). The RNGs are seeded, so each test is
deterministic; the bound states how unlikely a false failure would be for a
correct sampler under a fresh seed (1 in 10,000 per test). Each test states
the smallest bias it detects (``detectable_shift``: mass Δ moved between two
outcomes of probability p, found with probability 0.99) and has a negative
control: a plausibly wrong sampler, or the same counts against a distribution
they were not drawn from, that the same assertion must reject.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.optimize import brentq
from scipy.stats import chi2, chisquare, ncx2

from specdec.sampling import (
    SamplingConfig,
    VerifyResult,
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


def assert_detects(counts: np.ndarray, wrong: np.ndarray) -> None:
    """Negative control: ``counts`` tested against a distribution they were
    not drawn from must fail the same assertion."""
    with pytest.raises(AssertionError, match="chi-square|zero probability"):
        assert_matches(counts, wrong)


def detectable_shift(n: int, p: float, df: int, power: float = 0.99) -> float:
    """The smallest mass Δ moved between two outcomes of probability ``p``
    that the chi-square test at ``ALPHA`` with ``df`` degrees of freedom
    detects with probability ``power`` from ``n`` samples (noncentral
    chi-square with λ = n · 2Δ² / p)."""
    crit = chi2.ppf(1 - ALPHA, df)
    lam = brentq(lambda x: ncx2.sf(crit, df, x) - power, 1e-6, 1e5)
    return float(np.sqrt(lam * p / (2 * n)))


def test_stated_detectable_shifts() -> None:
    """The bounds quoted in the docstrings of this file and of the end-to-end
    tests (tests/test_e2e_tiny.py, tests/test_drafters_e2e.py,
    tests/test_faults.py) are what ``detectable_shift`` computes."""
    assert detectable_shift(20_000, 0.1, 9) == pytest.approx(0.0119, abs=5e-4)
    assert detectable_shift(30_000, 1 / 36, 35) == pytest.approx(0.0062, abs=3e-4)
    assert detectable_shift(5_000, 0.125, 7) == pytest.approx(0.0259, abs=5e-4)
    assert detectable_shift(20_000, 0.1, 7) == pytest.approx(0.0116, abs=5e-4)
    assert detectable_shift(2_500, 0.05, 30) == pytest.approx(0.028, abs=1e-3)
    assert detectable_shift(6_000, 1 / 6, 5) == pytest.approx(0.0263, abs=5e-4)
    assert detectable_shift(667, 1 / 6, 5) == pytest.approx(0.079, abs=1e-3)
    assert detectable_shift(2_500, 0.05, 40) == pytest.approx(0.029, abs=1e-3)
    assert detectable_shift(20_000, 1 / 20, 19) == pytest.approx(0.0093, abs=3e-4)  # the run-ahead PIT tests
    assert detectable_shift(40_000, 0.080, 35) == pytest.approx(0.0091, abs=3e-4)


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
    span is distributed as p_1 (accepted x or recovered token). 10 outcomes,
    n = 20,000: detects Δ = 0.0119 between two outcomes of probability 0.1."""
    counts, p1 = _first_token_counts(cfg, draft_kind, rejection_sample)
    assert_matches(counts, p1)


def _recover_from_p(draft_ids, draft_q, probs, gen):  # type: ignore[no-untyped-def]
    """A classic bug: accept x with min(1, p/q) but, on rejection, sample
    from p instead of the residual norm(max(0, p − q))."""
    from specdec.sampling import VerifyResult

    x = draft_ids[0]
    ids, q = draft_q[0]
    qx = float(q[list(ids).index(x)]) / float(q.sum())
    if float(torch.rand(1, generator=gen)) * qx < float(probs[0, x]):
        return VerifyResult(1, int(torch.multinomial(probs[1], 1, generator=gen)), True)
    return VerifyResult(0, int(torch.multinomial(probs[0], 1, generator=gen)), False)


@pytest.mark.parametrize("draft_kind", ["dense", "truncated"])
def test_negative_control_recovering_from_p_instead_of_the_residual_is_detected(draft_kind: str) -> None:
    """The same test with the recovery step wrong must fail."""
    counts, p1 = _first_token_counts(CONFIGS[0], draft_kind, _recover_from_p)
    assert_detects(counts, p1)


def _first_token_counts(cfg: SamplingConfig, draft_kind: str, verify) -> tuple[np.ndarray, np.ndarray]:  # type: ignore[no-untyped-def]
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
        res = verify([x], [q], p, gen)
        counts[x if res.num_accepted == 1 else res.next_token] += 1
    return counts, p[0].double().numpy()


def _two_token_joint(qs_used: list, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:  # type: ignore[type-arg]
    """Generates (t1, t2) by speculative rounds with fixed target rows p_1,
    p_2 (context-independent) and drafts sampled from q_1, q_2; ``qs_used``
    are the q the verifier is told. Returns (counts [V*V], exact p_1 ⊗ p_2)."""
    vocab = 6
    g = torch.Generator().manual_seed(5)
    p = process_logits(torch.randn(3, vocab, generator=g), SamplingConfig(temperature=1.0))
    q_logits = torch.randn(2, vocab, generator=g).numpy()
    qs = [draft_distribution(q_logits[i], SamplingConfig(temperature=1.0), 64) for i in range(2)]
    told = [qs[i] for i in qs_used]
    rng = np.random.default_rng(seed)
    gen = make_generator(seed + 1)
    joint = np.zeros((vocab, vocab))
    for _ in range(n):
        x = [sample_sparse(*qs[0], rng), sample_sparse(*qs[1], rng)]
        res = rejection_sample(x, told, p, gen)
        if res.num_accepted == 0:  # t1 recovered; t2 comes from the next round, one drafted token from q_2
            t1 = res.next_token
            x2 = sample_sparse(*qs[1], rng)
            r2 = rejection_sample([x2], [told[1]], p[1:3], gen)
            t2 = x2 if r2.num_accepted else r2.next_token
        elif res.num_accepted == 1:
            t1, t2 = x[0], res.next_token
        else:
            t1, t2 = x
        joint[t1, t2] += 1
    expected = np.outer(p[0].double().numpy(), p[1].double().numpy())
    return joint.ravel(), expected.ravel()


def test_two_position_span_joint_distribution() -> None:
    """The pair (t1, t2) committed by speculative rounds (a γ=2 span, and a
    second round when the first rejects at once) follows the joint
    p_1(t1) · p_2(t2) exactly: 36 outcomes, n = 30,000, chi-square at
    p < 1e-4; detects a shift of 0.0062 of mass between two outcomes of
    probability 1/36 with probability 0.99 (noncentral chi-square,
    λ = n · 2Δ² / p = 82 at 35 degrees of freedom)."""
    counts, expected = _two_token_joint([0, 1], 30_000, seed=7)
    assert_matches(counts, expected)


def test_negative_control_verifying_against_the_wrong_q_is_detected() -> None:
    """The same rounds, but each drafted token verified against the other
    position's q (not the one it was sampled from): the joint test must fail."""
    counts, expected = _two_token_joint([1, 0], 30_000, seed=7)
    with pytest.raises(AssertionError, match="chi-square"):
        assert_matches(counts, expected)


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
    # 8 outcomes, n = 5,000: detects Δ = 0.0259 between two outcomes of probability 0.125
    assert_matches(bonus, p[2].double().numpy())
    assert_detects(bonus, p[1].double().numpy())  # control: a bonus from the last drafted row


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
    assert_detects(counts, np.array([0.25, 0.25, 0.25, 0.25, 0, 0, 0, 0]))  # control: uniform over p's support


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
    assert_detects(rec, p[0].double().numpy())  # control: recovering from p, x not removed


def test_zero_probability_draft_token_is_always_rejected() -> None:
    p = torch.tensor([[0.0, 1.0, 0.0], [1 / 3] * 3])
    q = (np.array([0, 2]), np.array([0.5, 0.5], dtype=np.float32))
    gen = make_generator(0)
    for _ in range(200):
        res = rejection_sample([0], [q], p, gen)
        assert (res.num_accepted, res.next_token) == (0, 1)


def _greedy_reference(draft: list[int], argmax: list[int]) -> tuple[int, int, bool]:
    """Greedy verification written out another way: the accepted prefix is
    the length of the agreeing prefix (numpy), the next token the argmax
    there."""
    agree = np.asarray(draft, dtype=np.int64) == np.asarray(argmax[: len(draft)], dtype=np.int64)
    n = len(draft) if agree.all() else int(np.argmin(agree))
    return n, argmax[n], n == len(draft)


def test_greedy_verify_matches_an_independent_reference() -> None:
    rng = np.random.default_rng(0)
    for _ in range(2000):
        gamma = int(rng.integers(0, 9))
        argmax = rng.integers(0, 4, size=gamma + 1).tolist()  # small alphabet: many partial agreements
        draft = [a if rng.random() < 0.7 else int(rng.integers(0, 4)) for a in argmax[:gamma]]
        r = greedy_verify(draft, argmax)
        assert (r.num_accepted, r.next_token, r.is_bonus) == _greedy_reference(draft, argmax), (draft, argmax)


def test_a_drafted_token_outside_its_q_is_refused() -> None:
    """q(x) = 0 means x was not sampled from q: the pure function raises
    instead of accepting it, also when the target gives x no probability
    (docs/design.md rule 7)."""
    p = torch.tensor([[0.0, 1.0, 0.0], [1 / 3] * 3])
    for q in [(np.array([1, 2]), np.array([0.5, 0.5], dtype=np.float32)),  # x = 0 not in the support
              (np.array([0, 1]), np.array([0.0, 1.0], dtype=np.float32))]:  # x = 0 with probability 0
        with pytest.raises(ValueError, match="not sampled from q"):
            rejection_sample([0], [q], p, make_generator(0))


def test_q_is_renormalised_before_use() -> None:
    """A q whose mass is off by a factor is used as q / Σq, the distribution
    the draft's sampler actually draws from (sample_sparse scales by the
    cdf's end). p(0) = 0.2 and q = [0.2, 0.3] (normalised [0.4, 0.6]): x = 0
    is accepted with probability 0.2 / 0.4 = 0.5, not min(1, 0.2 / 0.2) = 1,
    and a rejection recovers from norm(max(0, p − q/Σq)) = token 1 only.
    n = 4000: the acceptance rate's 6-sigma band is ±0.05."""
    p = torch.tensor([[0.2, 0.8], [0.5, 0.5]])
    q = (np.array([0, 1]), np.array([0.2, 0.3], dtype=np.float32))
    gen = make_generator(5)
    accepted = recovered_other = 0
    n = 4000
    for _ in range(n):
        r = rejection_sample([0], [q], p, gen)
        if r.num_accepted:
            accepted += 1
        else:
            recovered_other += r.next_token == 1
    assert abs(accepted / n - 0.5) < 0.05
    assert abs(accepted / n - 1.0) > 0.4  # control: without renormalising, x would always be accepted
    assert recovered_other == n - accepted
    # the same as sending the normalised q (same generator stream, same results)
    qn = (q[0], q[1] / q[1].sum())
    g1, g2 = make_generator(9), make_generator(9)
    assert [rejection_sample([0], [q], p, g1) for _ in range(200)] == [rejection_sample([0], [qn], p, g2) for _ in range(200)]


def test_greedy_verify_cases() -> None:
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
    # ≤ 8 outcomes, n = 20,000: detects Δ = 0.0116 between two outcomes of probability 0.1
    assert_matches(counts, dense)
    # control: q without its truncation (top-k, top-p, max_support) must be rejected
    assert_detects(counts, torch.softmax(torch.tensor(logits) / 0.8, -1).numpy())
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


# ------------------------------------------------------------- post-verify
def _post_verify_joint(
    post_kind: str, n: int, seed: int, told_q_prefix_shift: int = 0, post_row_off_by_one: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """Generates (t1, t2) by PEARL-style rounds against a context-dependent
    target: p_1 for the first token and p_2(· | t1) for the second, drafts
    from q_1 and q_2(· | prefix). Round one verifies a γ=1 span x0 ~ q_1 plus
    a post token x ~ q_2(· | x0) (drafted on the span's prefix) against rows
    [p_1, p_2(· | x0)]; when x0 is rejected, t1 is the recovered token and
    round two is γ=0 with a post token x ~ q_2(· | t1) checked against
    p_2(· | t1). ``post_kind``: "sampled" (x from a dense q, sent) or
    "onehot" (x the draft's argmax, q one-hot). Returns (counts [V*V],
    exact p_1(t1) · p_2(t2 | t1)).

    Wrong variants (negative controls): ``told_q_prefix_shift`` tells the
    verifier the post q of another prefix (not the q x was sampled from);
    ``post_row_off_by_one`` checks the γ=1 round's post token against row
    γ−1 (p_1) instead of row γ.
    """
    vocab = 6
    g = torch.Generator().manual_seed(11)
    t_logits = torch.randn(1 + vocab, vocab, generator=g) * 0.5  # row 0: p_1; row 1 + t: p_2(· | t)
    p = process_logits(t_logits, SamplingConfig(temperature=1.0))
    d_logits = (t_logits + torch.randn(1 + vocab, vocab, generator=g)).numpy()
    qs = [draft_distribution(d_logits[i], SamplingConfig(temperature=1.0), 64) for i in range(1 + vocab)]
    p1, p2 = p[0], p[1:]
    span_rows = [torch.stack([p1, p1 if post_row_off_by_one else p2[t]]) for t in range(vocab)]
    rng = np.random.default_rng(seed)
    gen = make_generator(seed + 1)

    def draft_post(prefix: int) -> tuple[int, tuple[int, tuple[np.ndarray, np.ndarray] | None]]:
        """The drafted post token on ``prefix`` and the (x, q) the verifier is told."""
        if post_kind == "onehot":
            x = int(np.argmax(d_logits[1 + prefix]))
            return x, (x, None)
        x = sample_sparse(*qs[1 + prefix], rng)
        return x, (x, qs[1 + (prefix + told_q_prefix_shift) % vocab])

    joint = np.zeros((vocab, vocab))
    for _ in range(n):
        x0 = sample_sparse(*qs[0], rng)
        _, post = draft_post(x0)
        res = rejection_sample([x0], [qs[0]], span_rows[x0], gen, post=post)
        if res.num_accepted:
            t1, t2 = x0, res.next_token
        else:
            t1 = res.next_token
            _, post = draft_post(t1)
            t2 = rejection_sample([], [], p2[t1][None], gen, post=post).next_token
        joint[t1, t2] += 1
    expected = (p1[:, None] * p2).double().numpy()
    return joint.ravel(), expected.ravel()


@pytest.mark.parametrize("post_kind", ["sampled", "onehot"])
def test_post_verify_joint_distribution(post_kind: str) -> None:
    """Post-verify is exact: the post token is a drafted token at position γ,
    drafted on exactly the prefix row γ conditions on, so accepting it with
    min(1, p/q) or else sampling norm(max(0, p − q)) emits p_γ exactly, as an
    independent bonus would. The pair (t1, t2) from a γ=1 span + post token
    (and γ=0 + post token after a rejection) follows p_1(t1) · p_2(t2 | t1):
    36 outcomes, n = 40,000, chi-square at p < 1e-4; detects a shift of
    0.0091 of mass between outcomes of the largest probability (0.080) with
    probability 0.99 (λ = n · 2Δ² / p = 82 at 35 degrees of freedom)."""
    counts, expected = _post_verify_joint(post_kind, 40_000, seed=21)
    assert expected.max() == pytest.approx(0.080, abs=1e-3)
    assert detectable_shift(40_000, expected.max(), 35) == pytest.approx(0.0091, abs=2e-4)
    assert_matches(counts, expected)


def test_negative_control_post_verify_against_the_wrong_q_is_detected() -> None:
    """The same rounds, but the post token verified against the q drafted on
    another prefix (not the one it was sampled from): the joint test must
    fail, at a tenth of the samples."""
    counts, expected = _post_verify_joint("sampled", 4_000, seed=21, told_q_prefix_shift=1)
    assert_detects(counts, expected)


@pytest.mark.parametrize("post_kind", ["sampled", "onehot"])
def test_negative_control_post_verify_against_row_gamma_minus_one_is_detected(post_kind: str) -> None:
    """The same rounds, but the γ=1 round's post token checked against the
    last drafted token's row (p_1, off by one) instead of row γ: detected."""
    counts, expected = _post_verify_joint(post_kind, 4_000, seed=21, post_row_off_by_one=True)
    assert_detects(counts, expected)


def test_post_token_is_ignored_when_the_span_is_rejected() -> None:
    """A rejection inside the span returns the recovered token as without a
    post token, from the same RNG draws (the post token consumes none)."""
    p = torch.tensor([[0.0, 1.0, 0.0], [1 / 3] * 3])  # drafted 0 has p = 0: always rejected
    q = (np.array([0, 2]), np.array([0.5, 0.5], dtype=np.float32))
    post = (2, (np.array([2]), np.array([1.0], dtype=np.float32)))
    g1, g2 = make_generator(3), make_generator(3)
    for _ in range(50):
        with_post = rejection_sample([0], [q], p, g1, post=post)
        assert with_post == rejection_sample([0], [q], p, g2)
        assert with_post == VerifyResult(0, 1, False, False)
    assert torch.equal(g1.get_state(), g2.get_state())


def test_post_token_flags_and_its_q_checks() -> None:
    """All accepted: a post token with p(x) = q(x) = 1 is always accepted
    (is_post, not is_bonus); one outside p's support is always rejected and
    the next token is the residual sample at the bonus position (is_bonus);
    γ = 0 checks it against row 0; a post token outside its q is refused."""
    p = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    sure = (2, (np.array([2]), np.array([1.0], dtype=np.float32)))
    never = (1, (np.array([1, 2]), np.array([0.5, 0.5], dtype=np.float32)))
    gen = make_generator(0)
    for _ in range(20):
        assert rejection_sample([0], [None], p, gen, post=sure) == VerifyResult(1, 2, False, True)
        assert rejection_sample([0], [None], p, gen, post=never) == VerifyResult(1, 2, True, False)
        assert rejection_sample([0], [None], p, gen, post=(1, None)) == VerifyResult(1, 2, True, False)
        assert rejection_sample([], [], p[1:], gen, post=(2, None)) == VerifyResult(0, 2, False, True)
    with pytest.raises(ValueError, match="post position .* not sampled from q"):
        rejection_sample([0], [None], p, gen, post=(0, (np.array([1, 2]), np.array([0.5, 0.5], dtype=np.float32))))


def test_greedy_verify_post_token_cases() -> None:
    """The greedy post token is accepted iff it is the argmax at the bonus
    position; the next token is that argmax either way."""
    assert greedy_verify([1, 2], [1, 2, 9], post_id=9) == VerifyResult(2, 9, False, True)
    assert greedy_verify([1, 2], [1, 2, 9], post_id=4) == VerifyResult(2, 9, True, False)
    assert greedy_verify([1, 5], [1, 2, 9], post_id=9) == VerifyResult(1, 2, False, False)  # span rejected: ignored
    assert greedy_verify([], [7], post_id=7) == VerifyResult(0, 7, False, True)
    assert greedy_verify([1, 2], [1, 2, 9]) == VerifyResult(2, 9, True, False)


def test_session_streams_derive_from_one_helper() -> None:
    """specdec.sampling.rng_stream: offset 0 is the seed's own stream for
    both services (the draft's numpy generator, the target's torch one),
    other offsets are independent streams, and stream n of seed s is not
    stream 0 of seed s + n."""
    from specdec.sampling import session_generator, session_rng

    assert np.array_equal(session_rng(7, 0).random(8), np.random.default_rng(7).random(8))
    assert np.array_equal(session_rng(7, 3).random(8), np.random.default_rng([7, 3]).random(8))
    draws = lambda g: torch.rand(8, generator=g)  # noqa: E731
    assert torch.equal(draws(session_generator(7, 0)), draws(make_generator(7)))
    assert torch.equal(draws(session_generator(7, 3)), draws(session_generator(7, 3)))
    assert not torch.equal(draws(session_generator(7, 3)), draws(session_generator(7, 0)))
    assert not torch.equal(draws(session_generator(7, 3)), draws(make_generator(10)))
    assert not np.array_equal(session_rng(7, 3).random(8), session_rng(10, 0).random(8))


def test_row_argmax_and_logit_gaps_match_torch_on_ties_and_infinities() -> None:
    """The engine's greedy choice and logit gaps (numpy on CPU) are torch's
    argmax (first index on ties) and top-1 minus top-2, bit for bit."""
    from specdec.sampling import argmax_rows, logit_gaps

    g = torch.Generator().manual_seed(3)
    rows = torch.randn(6, 151_936, generator=g) * 4
    rows[1, 10] = rows[1, 99_000] = rows[1].max() + 1  # a tie for the top: the first index, gap 0
    rows[2] = float("-inf")
    rows[2, 5], rows[2, 7] = 2.5, 1.0  # all but two masked (a grammar): the gap is between the two
    rows[3] = torch.round(rows[3])  # many ties below the top
    rows[4, :] = 0.0
    rows[4, 150_000] = 1e-7  # a gap at float32's resolution
    want_ids = torch.argmax(rows, dim=-1).tolist()
    top2 = torch.topk(rows, 2, dim=-1).values
    want_gaps = (top2[:, 0] - top2[:, 1]).tolist()
    assert argmax_rows(rows) == want_ids and want_ids[1] == 10 and want_ids[2] == 5
    assert logit_gaps(rows) == want_gaps and want_gaps[1] == 0.0 and want_gaps[2] == 1.5
    # a strided view (the last rows of a longer pass) gives the same as its copy
    assert argmax_rows(rows[::2]) == want_ids[::2] and logit_gaps(rows[::2]) == want_gaps[::2]
    # negative control: a row changed after the fact changes the answer
    rows[0, want_ids[0]] -= 100.0
    assert argmax_rows(rows)[0] != want_ids[0]
