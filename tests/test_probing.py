"""AUTO's probing and the draft's catch-up prefill: when a request that
decodes plainly tries speculation (orchestrator/probing.py: value of
information and the probe budget), what the catch-up costs, and that
exploration costs a request at most a few percent (simulated through the
reference CPU's costs)."""

from __future__ import annotations

import random

import pytest

from orchestrator.costs import CostModel
from orchestrator.policy import AdaptiveConfig, AdaptivePolicy, PolicyFactory, RoundObservation
from orchestrator.probing import ProbeBudget, beta_grid, expected_saving


# ------------------------------------------------ the draft's catch-up prefill
KQ_CURVE = {1: 30.0, 2: 32.0, 4: 40.0, 6: 50.0, 8: 60.0, 16: 110.0}


def _policy_with_alpha(alpha: float, draft_token_ms: float = 13.0) -> AdaptivePolicy:
    factory = PolicyFactory()
    factory.set_cost_priors(verify_curve=KQ_CURVE, draft_token_ms={"d": draft_token_ms})
    policy = factory.make("auto", 0, "d")
    assert isinstance(policy, AdaptivePolicy)
    rng = random.Random(1)
    for _ in range(40):  # this request's acceptance is known
        g = 3
        acc = 0
        while acc < g and rng.random() < alpha:
            acc += 1
        policy.observe(RoundObservation(gamma=g, accepted=acc, draft_ms=g * draft_token_ms,
                                        draft_compute_ms=g * draft_token_ms, verify_ms=40.0,
                                        verify_compute_ms=40.0, tokens_in_pass=g + 1))
    return policy


@pytest.mark.parametrize("alpha,remaining,speculates", [
    (0.95, 400, True),   # saves far more than the 741-token catch-up costs
    (0.6, 120, False),   # a small gain per token cannot earn the catch-up back
    (0.95, 3, False),    # too few tokens left to earn it back
])
def test_speculation_must_earn_back_the_drafts_catch_up(alpha: float, remaining: int, speculates: bool) -> None:
    policy = _policy_with_alpha(alpha)
    policy.set_outlook(0, remaining)
    assert policy.next_gamma() > 0  # with nothing to catch up, every case speculates
    policy.set_outlook(741, remaining)
    assert (policy.next_gamma() > 0) == speculates


def test_a_probe_runs_only_when_what_it_may_reveal_is_worth_its_cost() -> None:
    """A probe is worth its expected extra time only through the chance that
    the request's α is high enough to pay over the tokens left. A fresh
    request (no evidence of its own) probes when there is nothing to catch up
    and not when the draft would first need 741 tokens for a 100-token rest;
    one whose 40 rounds showed α ≈ 0.2 never probes (its posterior has no
    upper tail), unless the value rule is off (negative control)."""
    for catchup, probes in ((0, True), (741, False)):
        factory = PolicyFactory()
        factory.set_cost_priors(verify_curve=KQ_CURVE, draft_token_ms={"d": 13.0})
        policy = factory.make("auto", 0, "d")
        policy.set_outlook(catchup, 100)  # type: ignore[attr-defined]
        assert (policy.next_gamma() > 0) == probes, catchup
    for value_rule, probes in ((True, False), (False, True)):
        policy = _policy_with_alpha(0.2)
        policy.cfg.probe_value = value_rule
        policy.set_outlook(0, 100)
        gammas = [policy.next_gamma() for _ in range(64)]
        assert (max(gammas) > 0) == probes, value_rule


def _probing_cost(length: int, budget_share: float, catchup_token_ms: float = 0.0,
                  value_rule: bool = False) -> tuple[float, float, int]:
    """A request of ``length`` tokens where the pair never pays (every probe
    rejected; unary drafting, so the draft falls a token behind with every
    plain round and a probe first takes those in). Returns the worst, over
    the request, of the probes' extra time so far (catch-up, the probe's
    draft and verify, less the token the round adds) over the default budget's
    limit then (≤ 1: within it); their extra time at the end as a share of
    target-only time; and the probes run. ``catchup_token_ms``: the draft's
    measured catch-up per token (default: the cost model's prior, 0.15 × 13
    ms). ``value_rule`` off: the budget alone decides."""
    policy = _policy_with_alpha(0.05)
    policy.cfg.probe_budget_share = budget_share
    policy.cfg.probe_value = value_rule
    policy.budget = ProbeBudget(budget_share, policy.cfg.probe_horizon_tokens)
    if catchup_token_ms:  # a round that fed 500 tokens: 4 drafted at 13 ms, the rest catch-up
        policy.costs.observe(RoundObservation(gamma=4, accepted=0, draft_ms=52.0 + 500 * catchup_token_ms,
                                              draft_compute_ms=52.0 + 500 * catchup_token_ms, verify_ms=40.0,
                                              verify_compute_ms=40.0, tokens_in_pass=5, fed_tokens=500))
    step = policy.round_ms(0)
    limit = ProbeBudget(AdaptiveConfig().probe_budget_share, policy.cfg.probe_horizon_tokens)  # the default budget
    behind, spent, worst, probes = 0, 0.0, 0.0, 0
    for generated in range(1, length):
        policy.set_outlook(behind, length - generated, generated)
        gamma = policy.next_gamma()
        if gamma > 0:
            spent += (policy.costs.catchup_ms(behind) or 0.0) + policy.round_ms(gamma) - step
            probes += 1
            policy.observe(RoundObservation(gamma=gamma, accepted=0, draft_ms=13.0 * gamma,
                                            draft_compute_ms=13.0 * gamma, verify_ms=32.0,
                                            verify_compute_ms=32.0, tokens_in_pass=gamma + 1))
            behind = 0
        behind += 1
        worst = max(worst, spent / limit.limit_ms(generated, length - generated, step))
    return worst, spent / (length * step), probes


@pytest.mark.parametrize("length", [40, 128, 400])
def test_probing_stays_within_its_budget(length: int) -> None:
    """Whatever the request's length (it is not known in advance:
    max_new_tokens is only a cap), the probes together cost at most
    ``probe_budget_share`` (3 %) of target-only time of max(the tokens so
    far, min(128, the request's cap)) at every point: each is charged its
    extra time should it be rejected, an upper bound. Here the budget alone
    decides (the value rule, on by default, runs no probe at all: 40 rounds
    showed α ≈ 0.05). The schedule alone (probes after 8, 16, 32 … plain
    rounds, each catching the draft up) costs more than the budget: the
    negative control. With a draft whose catch-up is cheap (0.1 ms per
    token), probes are cheap and more of them run, the more the longer the
    request (the budget grows with the time spent)."""
    share = AdaptiveConfig().probe_budget_share
    worst, total, probes = _probing_cost(length, share)
    assert worst <= 1.0 and total <= share and probes >= 1, (worst, total, probes)
    assert _probing_cost(length, share, value_rule=True)[2] == 0
    unbudgeted, unbudgeted_total, more = _probing_cost(length, float("inf"))
    assert more > probes and unbudgeted > 1.0, (unbudgeted, more)
    cheap, _, cheap_probes = _probing_cost(length, share, catchup_token_ms=0.1)
    assert cheap <= 1.0 and cheap_probes >= 1 + length // 100, (cheap, cheap_probes)


def test_the_cost_model_learns_the_catch_up_apart_from_the_per_token_cost() -> None:
    costs = CostModel()
    costs.set_prior(KQ_CURVE, draft_token_ms=13.0)
    assert costs.catchup_ms(100) == pytest.approx(100 * CostModel.CATCHUP_PRIOR_RATIO * 13.0)
    # a first round that fed the prompt: 4 drafted tokens + 500 prompt tokens at 2 ms
    costs.observe(RoundObservation(gamma=4, accepted=3, draft_ms=1052.0, draft_compute_ms=1052.0,
                                   verify_ms=40.0, verify_compute_ms=40.0, tokens_in_pass=5, fed_tokens=500))
    assert costs.catchup_ms(100) == pytest.approx(200.0)
    assert costs.draft_ms(4) == pytest.approx(52.0)  # the per-token cost is not inflated by the catch-up


def test_a_probe_is_never_cut_short_by_the_confidence_stop() -> None:
    """While plain decoding wins, every probe drafts its token whatever the
    draft's confidence (a probe the confidence stop emptied would teach the
    policy nothing and keep it at γ = 0 for good); rounds that speculate keep
    their stop."""
    factory = PolicyFactory()
    factory.set_cost_priors(verify_curve={1: 45.0, 2: 76.0, 4: 74.0, 8: 130.0}, draft_token_ms={"d": 14.0})
    policy = factory.make("auto", 0, "d")
    probes = 0
    for _ in range(40):
        g = policy.next_gamma()
        if g > 0:
            probes += 1
            assert policy.stop_confidence() == 0.0
    assert probes >= 2
    fast = _policy_with_alpha(0.95)
    assert fast.next_gamma() > 0 and fast.stop_confidence() > 0.0


def _run_sometimes_empty_drafter(hit_rate: float, rounds: int = 300) -> tuple[AdaptivePolicy, list[int]]:
    """A model-free drafter (0.3 ms a token, 1.5 ms a call) whose spans, when
    it has one, are accepted at α = 0.9, but which finds nothing to propose
    with probability 1 − ``hit_rate`` (an empty span still costs the call)."""
    factory = PolicyFactory()
    factory.set_cost_priors(verify_curve=KQ_CURVE, draft_token_ms={"lookup": 0.3})
    policy = factory.make("auto", 0, "lookup")
    assert isinstance(policy, AdaptivePolicy)
    rng = random.Random(7)
    gammas = []
    for _ in range(rounds):
        g = policy.next_gamma()
        gammas.append(g)
        if g == 0:
            obs = RoundObservation(gamma=0, accepted=0, verify_ms=35.0, verify_compute_ms=35.0, tokens_in_pass=1)
        elif rng.random() >= hit_rate:  # nothing to propose
            obs = RoundObservation(gamma=0, accepted=0, draft_ms=1.5, draft_compute_ms=0.1, verify_ms=35.0,
                                   verify_compute_ms=35.0, tokens_in_pass=1, requested=g)
        else:
            acc = 0
            while acc < g and rng.random() < 0.9:
                acc += 1
            obs = RoundObservation(gamma=g, accepted=acc, draft_ms=1.5 + 0.3 * g, draft_compute_ms=0.3 * g,
                                   verify_ms=KQ_CURVE.get(g + 1, 45.0), verify_compute_ms=KQ_CURVE.get(g + 1, 45.0),
                                   tokens_in_pass=g + 1, requested=g)
        policy.observe(obs)
        factory.observe(obs, "lookup")  # the orchestrator's stats path
    return policy, gammas


def test_an_empty_span_counts_as_a_miss_so_a_drafter_is_priced_by_its_hit_rate() -> None:
    """A span the drafter left empty cost a call and yielded nothing: the
    policy's first-position acceptance is P(non-empty) x P(accepted), so a
    drafter that rarely has a proposal stops being asked (it cost every round
    a Propose call while the policy, counting only its hits, saw α = 0.9);
    one that usually has one keeps speculating. Negative control: counting
    only non-empty spans (the old rule) would put α₀ near 0.9 for both."""
    rare, rare_gammas = _run_sometimes_empty_drafter(0.03)
    assert rare.alphas()[0] < 0.3
    assert sum(g > 0 for g in rare_gammas[-100:]) <= 10  # only probes
    often, often_gammas = _run_sometimes_empty_drafter(0.9)
    assert 0.65 < often.alphas()[0] < 0.9
    assert sum(g > 0 for g in often_gammas[-100:]) >= 90


# ------------------------------------------------ plain rounds decoded ahead
def test_committed_plain_rounds_are_the_rounds_the_policy_would_have_chosen() -> None:
    """AUTO at a prose-like α stays at γ = 0 between probes. Committing, after
    each plain round, to the plain rounds up to the next probe (so the target
    can decode them ahead) leaves the sequence of choices exactly as it is
    without committing: the probes come at the same rounds. Negative control:
    committing one round more than offered moves a probe."""
    def choices(commit: bool, extra: int = 0) -> list[int]:
        policy = _policy_with_alpha(0.2)
        out: list[int] = []
        pending = 0
        while len(out) < 120:
            g = policy.next_gamma()
            out.append(g)
            if pending:
                pending -= 1
                assert g == 0
                continue
            if commit and g == 0:
                pending = policy.commit_plain_rounds(100)
                if extra and pending:
                    policy._committed += extra  # type: ignore[attr-defined]
                    pending += extra
        return out

    plain = choices(False)
    assert 0 < sum(g > 0 for g in plain) < 10  # a few probes in 120 rounds
    assert choices(True) == plain
    assert choices(True, extra=1) != plain
    policy = _policy_with_alpha(0.2)
    assert policy.next_gamma() == 0 and policy.commit_plain_rounds(3) == 3  # capped by the caller's limit
    assert policy.commit_plain_rounds(3) == 0  # nothing more while committed


def test_a_speculating_policy_commits_to_nothing() -> None:
    policy = _policy_with_alpha(0.95)
    assert policy.next_gamma() > 0
    assert policy.commit_plain_rounds(100) == 0


# ------------------------------------------- exploration must not cost a request
#: the reference CPU (measured through the services): the target's t(k) for k = 1..5 tokens
CPU_CURVE = {1: 38.0, 2: 45.0, 3: 56.0, 4: 73.0, 5: 86.0}
CPU_DRAFT_MS = 16.0  # the draft's compute per drafted token (13-20 ms measured)
CPU_CATCHUP_MS = 3.5  # the draft's prefill per committed token it takes in at once
PROMPT, LENGTH = 24, 128


def _simulate_request(factory: PolicyFactory, alpha: float, seed: int, length: int = LENGTH,
                      prompt: int = PROMPT, cfg: AdaptiveConfig | None = None) -> tuple[float, list[int]]:
    """One unary-drafting request of ``length`` greedy tokens through the
    reference CPU's costs, as orchestrator/decode.py drives the policy: the
    draft takes the prompt lazily at the request's first speculative round and,
    after plain rounds, the tokens committed meanwhile (catch-up prefill, the
    last committed token aside, which the first draft step takes in anyway);
    each drafted token is accepted with probability ``alpha`` (seeded). Every
    round also feeds the factory's shared statistics (the stats path). Returns
    the request's time over plain decoding's (``length`` target steps) and
    the γ chosen per round."""
    rng = random.Random(seed)
    policy = factory.make("auto", 0, "d")
    assert isinstance(policy, AdaptivePolicy)
    if cfg is not None:
        policy.cfg = cfg
        policy.budget = ProbeBudget(cfg.probe_budget_share, cfg.probe_horizon_tokens)
    generated, known, ms, continued, gammas = 0, 0, 0.0, False, []
    while generated < length:
        committed = prompt + generated
        policy.set_outlook(committed - known, length - generated, generated)
        g = min(policy.next_gamma(), length - generated - 1)
        gammas.append(g)
        if g > 0:
            fed = committed - known
            acc = 0
            while acc < g and rng.random() < alpha:
                acc += 1
            draft = CPU_DRAFT_MS * g + CPU_CATCHUP_MS * max(0, fed - 1)
            verify = CPU_CURVE[min(g + 1, 5)] + 13.0 * max(0, g - 4)
            obs = RoundObservation(gamma=g, accepted=acc, draft_ms=draft, draft_compute_ms=draft,
                                   verify_ms=verify, verify_compute_ms=verify, tokens_in_pass=g + 1,
                                   continued=continued, requested=g, fed_tokens=fed)
            known = committed + acc  # the draft holds what it drafted; the bonus token comes next round
            continued = acc == g
        else:
            acc = 0
            verify = CPU_CURVE[1]
            obs = RoundObservation(gamma=0, accepted=0, verify_ms=verify, verify_compute_ms=verify, tokens_in_pass=1)
            continued = False
            draft = 0.0
        ms += draft + verify
        policy.observe(obs)
        factory.observe(obs, "d")
        generated += acc + 1
    return ms / (length * CPU_CURVE[1]), gammas


def _cpu_factory(warm_alpha: float | None = None, seed: int = 100) -> PolicyFactory:
    """The shared statistics a request starts from: neutral (earlier traffic
    accepted as often as ``AcceptancePrior.default_alpha``, 0.6, says), or
    learnt from two earlier requests of acceptance ``warm_alpha``."""
    factory = PolicyFactory()
    factory.set_cost_priors(verify_curve=CPU_CURVE, draft_token_ms={"d": CPU_DRAFT_MS})
    rng = random.Random(seed)
    prior, costs = factory._shared("d")
    # an earlier request's first round: the draft took a 500-token prompt in
    costs.observe(RoundObservation(gamma=4, accepted=2, draft_ms=4 * CPU_DRAFT_MS + 500 * CPU_CATCHUP_MS,
                                   draft_compute_ms=4 * CPU_DRAFT_MS + 500 * CPU_CATCHUP_MS, verify_ms=CPU_CURVE[5],
                                   verify_compute_ms=CPU_CURVE[5], tokens_in_pass=5, fed_tokens=500))
    for _ in range(300):
        for state in (0, 1):
            acc = 0
            while acc < 4 and rng.random() < prior.default_alpha:
                acc += 1
            prior.update(4, acc, state)
    if warm_alpha is not None:
        for s in range(2):
            _simulate_request(factory, warm_alpha, seed + s)
    return factory


SEEDS = range(5)


@pytest.mark.parametrize("prompt", [16, 24])
@pytest.mark.parametrize("warm", [None, 0.9])
def test_code_discovers_speculation_early_and_gains(warm: float | None, prompt: int) -> None:
    """A request whose draft agrees 90 % of the time (code) starts from a
    neutral shared estimate that does not pay (α = 0.6 at 16 ms per drafted
    token, against a 38 ms step), or from one learnt on code: its first probe
    is worth its cost (P(α pays) x the saving over 128 tokens outweighs the
    prompt's catch-up), so it speculates from the first rounds and gains. A
    first probe the target rejects (1 in 10) leaves the posterior too low to
    probe on: that request decodes plainly, at the cost of the one probe."""
    runs = [_simulate_request(_cpu_factory(warm), 0.9, seed, prompt=prompt) for seed in SEEDS]
    for ratio, gammas in runs:
        assert any(g > 0 for g in gammas[:16]), gammas[:16]
        assert ratio <= 1.03, ratio
    ratios = sorted(r for r, _ in runs)
    assert sum(r < 0.9 for r in ratios) >= len(ratios) - 1, ratios
    assert sum(ratios) / len(ratios) < 0.91, ratios


@pytest.mark.parametrize("prompt", [16, 24, 32])
@pytest.mark.parametrize("warm", [None, 0.9])
def test_prose_pays_at_most_three_percent_for_exploring(warm: float | None, prompt: int) -> None:
    """A request whose draft agrees 35 % of the time (prose), from a neutral
    shared estimate or one learnt on code (which speculates by score from the
    start, the prose-2 case): its probes and the catch-up they pay cost at
    most 3 % over plain decoding, whatever the seed."""
    for seed in SEEDS:
        ratio, gammas = _simulate_request(_cpu_factory(warm), 0.35, seed, prompt=prompt)
        assert ratio <= 1.03, (seed, ratio, gammas)
        assert sum(g > 0 for g in gammas[8:]) <= 4, (seed, gammas)  # the request's own evidence ends it


def test_prose_exploration_without_the_value_rule_and_the_budget_costs_more() -> None:
    """Negative control for the test above: the same prose requests with the
    value-of-information rule off and an unbounded probe budget (the probe
    schedule alone, as before the budget) lose more than 3 %; the value rule
    with the budget alone bounds them."""
    loose = AdaptiveConfig(probe_value=False, probe_budget_share=float("inf"))
    for warm in (None, 0.9):
        ratios = [_simulate_request(_cpu_factory(warm), 0.35, seed, cfg=loose)[0] for seed in SEEDS]
        assert min(ratios) > 1.05, ratios
        budget_only = AdaptiveConfig(probe_value=False)
        ratios = [_simulate_request(_cpu_factory(warm), 0.35, seed, cfg=budget_only)[0] for seed in SEEDS]
        assert max(ratios) <= 1.04, ratios  # the probes within 3 %, rounds by score after a lucky probe aside


def test_the_requests_own_rounds_outweigh_the_shared_estimate_quickly() -> None:
    """Shared estimates learnt on code (α ≈ 0.9) make a prose request
    speculate by score; after a handful of rejected rounds of its own it
    decodes plainly (the level and per-position pseudo-counts are small)."""
    factory = _cpu_factory()
    prior = factory._shared("d")[0]
    rng = random.Random(3)
    for _ in range(300):
        for state in (0, 1):
            acc = 0
            while acc < 4 and rng.random() < 0.9:
                acc += 1
            prior.update(4, acc, state)
    policy = factory.make("auto", 0, "d")
    assert isinstance(policy, AdaptivePolicy)
    policy.set_outlook(1, 100, 20)
    assert policy.alphas()[0] > 0.8 and policy.next_gamma() > 0
    for _ in range(3):
        policy.observe(RoundObservation(gamma=2, accepted=0, draft_ms=32.0, draft_compute_ms=32.0, verify_ms=56.0,
                                        verify_compute_ms=56.0, tokens_in_pass=3))
    assert policy.alphas()[0] < 0.5 and policy.next_gamma() == 0


def test_the_value_of_a_probe_is_the_expected_saving_where_speculation_pays() -> None:
    """beta_grid is a discretised Beta density; expected_saving integrates
    the saving over it: nothing where no α pays, and more, with a higher
    chance of paying, the more of the posterior lies where α pays."""
    for a, b in ((2.4, 1.6), (0.8, 1.2), (30.0, 10.0)):
        grid = beta_grid(a, b)
        assert sum(w for _, w in grid) == pytest.approx(1.0)
        assert sum(x * w for x, w in grid) == pytest.approx(a / (a + b), abs=0.01)

    def rate(alphas: list[float]) -> float:  # γ = 1 at 61 ms against a 38 ms step
        return (1.0 + alphas[0]) / 61.0

    plain = 1.0 / 38.0  # speculation pays for α > 0.605
    assert expected_saving([(1.0, 99.0)], rate, plain, 100) == pytest.approx((0.0, 0.0), abs=1e-9)
    p_lo, v_lo = expected_saving([(2.0, 3.0)], rate, plain, 100)
    p_hi, v_hi = expected_saving([(9.0, 1.0)], rate, plain, 100)
    assert 0.0 < p_lo < 0.3 < 0.9 < p_hi and 0.0 < v_lo < v_hi
    assert v_hi == pytest.approx(100 * sum(w * max(0.0, 38.0 - 61.0 / (1 + x)) for x, w in beta_grid(9.0, 1.0)))
    assert expected_saving([(9.0, 1.0)], rate, plain, 0) == (0.0, 0.0)


def test_a_local_lookup_round_is_priced_at_the_verify_alone_even_after_fixed_rounds() -> None:
    """A fixed-γ request's lookup rounds reach the shared cost model of
    ``auto:lookup`` before any AUTO request made its local policy; that AUTO
    policy must still price a lookup round at the target's verify (a local
    lookup costs microseconds), not at the 20 ms/token default of a model
    drafter that made a span of α ≈ 1 look like a loss. Negative control: a
    model drafter's policy without a draft prior is priced at that default."""
    factory = PolicyFactory()
    factory.set_cost_priors(verify_curve=KQ_CURVE)
    for _ in range(8):  # a fixed-γ request's lookup rounds (their draft time is 0)
        factory.observe(RoundObservation(gamma=3, accepted=3, verify_ms=40.0, verify_compute_ms=40.0,
                                         tokens_in_pass=4), "auto:lookup")
    local = factory.make_local("auto:lookup")
    assert local.round_ms(2) - local.round_ms(0) < 0.1 + KQ_CURVE[4] - KQ_CURVE[1]
    model = factory.make("auto", 0, "model")
    assert model.round_ms(2) - model.round_ms(0) >= 2 * AdaptiveConfig().default_draft_token_ms
