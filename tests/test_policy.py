"""Draft-length policies against synthetic acceptance streams and cost models
whose optimal γ is known analytically."""

from __future__ import annotations

import random
from typing import Any
from collections import Counter

import pytest

from orchestrator.costs import CostModel
from orchestrator.policy import (
    AcceptancePrior,
    AdaptiveConfig,
    AdaptivePolicy,
    HeuristicPolicy,
    PolicyFactory,
    RoundObservation,
    expected_tokens,
    optimal_gamma,
)


def simulate_round(rng: random.Random, alpha: float, gamma: int, t_step: float, c: float, slope: float,
                   rtt: float) -> RoundObservation:
    accepted = 0
    while accepted < gamma and rng.random() < alpha:
        accepted += 1
    noise = lambda: rng.uniform(0.95, 1.05)  # noqa: E731
    verify = (t_step * (1 + slope * gamma) + rtt) * noise()
    draft = (c * t_step * gamma + rtt) * noise() if gamma else 0.0
    return RoundObservation(gamma=gamma, accepted=accepted, draft_ms=draft, verify_ms=verify,
                            verify_compute_ms=verify - rtt, tokens_in_pass=gamma + 1)


def throughput(alpha: float, gamma: int, t_step: float, c: float, slope: float, rtt: float) -> float:
    t = t_step * (1 + slope * gamma) + rtt + ((c * t_step * gamma + rtt) if gamma else 0.0)
    return expected_tokens([alpha] * 16, gamma) / t


def analytic_best(alpha: float, t_step: float, c: float, slope: float, rtt: float, gmax: int) -> int:
    return max(range(gmax + 1), key=lambda g: throughput(alpha, g, t_step, c, slope, rtt))


SETTINGS = [
    # (α, c, verify slope per extra token, rtt ms)
    (0.9, 0.05, 0.02, 1.0),
    (0.8, 0.1, 0.04, 2.0),
    (0.6, 0.1, 0.04, 2.0),
    (0.5, 0.25, 0.05, 5.0),
    (0.95, 0.02, 0.01, 0.5),
]


@pytest.mark.parametrize("alpha,c,slope,rtt", SETTINGS)
def test_adaptive_converges_to_the_analytic_optimum(alpha: float, c: float, slope: float, rtt: float) -> None:
    rng = random.Random(0)
    t_step, gmax = 200.0, 8
    best = analytic_best(alpha, t_step, c, slope, rtt, gmax)
    assert best > 0
    prior, costs = AcceptancePrior(), CostModel(verify_slope_ms=8.0, draft_token_ms=20.0)
    chosen: list[int] = []
    for _request in range(6):  # several requests share the prior and the cost model
        policy = AdaptivePolicy(prior, costs, AdaptiveConfig(gamma_max=gmax))
        for _ in range(80):
            g = policy.next_gamma()
            chosen.append(g)
            policy.observe(simulate_round(rng, alpha, g, t_step, c, slope, rtt))
    tail = Counter(chosen[-150:])
    mode = tail.most_common(1)[0][0]
    # the policy's choice reaches ≥ 95% of the best achievable throughput
    # (the "within 5% of the best fixed γ" target) …
    assert throughput(alpha, mode, t_step, c, slope, rtt) >= 0.95 * throughput(alpha, best, t_step, c, slope, rtt), (mode, best)
    # … and is near the analytic optimum (the optimum sits on a flat plateau)
    assert abs(mode - best) <= 2, (mode, best, tail)


@pytest.mark.parametrize("alpha,c", [(0.05, 0.3), (0.1, 0.5), (0.0, 0.2)])
def test_adaptive_drops_to_plain_decoding_when_speculation_cannot_pay(alpha: float, c: float) -> None:
    rng = random.Random(1)
    assert optimal_gamma(alpha, c, 8, verify_slope=0.05) == 0
    prior, costs = AcceptancePrior(), CostModel()
    policy = AdaptivePolicy(prior, costs, AdaptiveConfig(gamma_max=8))
    chosen = []
    for _ in range(300):
        g = policy.next_gamma()
        chosen.append(g)
        policy.observe(simulate_round(rng, alpha, g, 200.0, c, 0.05, 2.0))
    tail = chosen[-200:]
    assert tail.count(0) / len(tail) > 0.85  # plain decoding, apart from sparse probes
    assert any(g > 0 for g in tail)  # it keeps probing so a request can come back


def test_adaptive_returns_to_speculation_when_acceptance_recovers() -> None:
    rng = random.Random(2)
    prior, costs = AcceptancePrior(), CostModel()
    policy = AdaptivePolicy(prior, costs, AdaptiveConfig(gamma_max=8, prior_strength=2.0))
    for _ in range(200):  # hard text: α ≈ 0
        g = policy.next_gamma()
        policy.observe(simulate_round(rng, 0.02, g, 200.0, 0.1, 0.04, 2.0))
    # per-request counts decay through fresh evidence: feed easy text
    later = []
    for _ in range(400):
        g = policy.next_gamma()
        later.append(g)
        policy.observe(simulate_round(rng, 0.95, g, 200.0, 0.1, 0.04, 2.0))
    assert sum(1 for g in later[-100:] if g >= 3) > 80


def test_load_on_the_target_shortens_speculation() -> None:
    """When verifying more tokens gets expensive (compute-bound target under
    load), the best γ falls, and the policy follows the measured costs."""
    rng = random.Random(3)
    light = analytic_best(0.7, 200.0, 0.1, 0.02, 1.0, 8)
    heavy = analytic_best(0.7, 200.0, 0.1, 0.6, 1.0, 8)
    assert heavy < light
    for slope, want in ((0.02, light), (0.6, heavy)):
        prior, costs = AcceptancePrior(), CostModel()
        chosen = []
        for _ in range(4):
            policy = AdaptivePolicy(prior, costs, AdaptiveConfig(gamma_max=8))
            for _ in range(100):
                g = policy.next_gamma()
                chosen.append(g)
                policy.observe(simulate_round(rng, 0.7, g, 200.0, 0.1, slope, 1.0))
        mode = Counter(chosen[-150:]).most_common(1)[0][0]
        assert throughput(0.7, mode, 200.0, 0.1, slope, 1.0) >= 0.95 * throughput(0.7, want, 200.0, 0.1, slope, 1.0)
        assert abs(mode - want) <= 2, (slope, mode, want)


def test_heuristic_schedule() -> None:
    h = HeuristicPolicy(gamma=4, gamma_max=10)
    h.observe(RoundObservation(gamma=4, accepted=4))
    assert h.next_gamma() == 6
    h.observe(RoundObservation(gamma=6, accepted=2))
    assert h.next_gamma() == 5
    for _ in range(10):
        h.observe(RoundObservation(gamma=h.next_gamma(), accepted=0))
    assert h.next_gamma() == 1
    for _ in range(10):
        h.observe(RoundObservation(gamma=h.next_gamma(), accepted=h.next_gamma()))
    assert h.next_gamma() == 10


def test_expected_tokens_matches_leviathan() -> None:
    for alpha in (0.3, 0.7, 0.9):
        for g in range(0, 9):
            assert expected_tokens([alpha] * 9, g) == pytest.approx((1 - alpha ** (g + 1)) / (1 - alpha))


def test_factory_modes() -> None:
    f = PolicyFactory(default_gamma=4)
    assert f.make("off", 0, "d").next_gamma() == 0
    assert f.make("fixed", 0, "d").next_gamma() == 4
    assert f.make("fixed", 7, "d").next_gamma() == 7
    assert f.make("heuristic", 0, "d").name == "heuristic"
    a = f.make("adaptive", 0, "d")
    b = f.make("adaptive", 0, "d")
    assert a.name == "adaptive" and a.prior is b.prior and a.costs is b.costs  # type: ignore[attr-defined]
    assert f.make("adaptive", 0, "other").prior is not a.prior  # type: ignore[attr-defined]


def test_every_round_feeds_the_shared_statistics() -> None:
    """Rounds of fixed-γ requests warm the prior an adaptive request starts from."""
    f = PolicyFactory(default_gamma=4)
    cold = f.make("adaptive", 0, "d").alphas()[0]  # type: ignore[attr-defined]
    for _ in range(50):
        f.observe(RoundObservation(gamma=4, accepted=4, draft_ms=80.0, verify_ms=250.0, tokens_in_pass=5), "d")
    warm = f.make("adaptive", 0, "d")
    assert warm.alphas()[0] > cold + 0.2  # type: ignore[attr-defined]
    assert warm.costs.verify_ms(5) == pytest.approx(250.0, rel=0.05)  # type: ignore[attr-defined]
    assert warm.next_gamma() >= 4


def _runs_text(rng: random.Random, n: int) -> list[int]:
    """Agreement runs as greedy drafting sees them: L[i] = how many draft
    tokens from position i match the target. Runs come in two kinds (a
    mixture, so acceptance is not memoryless): short ones (new wording) and
    long ones (copied code); inside a run L counts down by one per token."""
    out: list[int] = []
    while len(out) < n:
        length = rng.choice([0, 0, 1, 2]) if rng.random() < 0.6 else rng.randint(15, 40)
        out.extend(range(length, -1, -1))
    return out[:n]


def _replay(runs: list[int], policy: object, factory: PolicyFactory | None = None, t_step: float = 200.0,
            t_draft: float = 20.0) -> float:
    pos, ms, continued = 0, 0.0, False
    while pos < len(runs):
        g = min(policy.next_gamma(), len(runs) - pos)  # type: ignore[attr-defined]
        acc = min(g, runs[pos])
        verify = t_step * (1 + 0.03 * g)
        obs = RoundObservation(gamma=g, accepted=acc, draft_ms=t_draft * g, draft_compute_ms=t_draft * g,
                               verify_ms=verify, verify_compute_ms=verify, tokens_in_pass=g + 1, continued=continued)
        policy.observe(obs)  # type: ignore[attr-defined]
        if factory is not None:  # the orchestrator's stats path
            factory.observe(obs, "d")
        continued = 0 < g == acc
        ms += verify + t_draft * g
        pos += acc + 1
    return len(runs) / ms


def test_adaptive_learns_that_runs_continue() -> None:
    """On text whose agreement comes in runs (short new wording, long copied
    spans), a span that was fully accepted predicts a long continuation. The
    policy keeps FRESH and CONTINUED statistics apart, so it drafts short
    after a rejection and long inside a run: within 5% of the best fixed γ
    chosen in hindsight."""
    from orchestrator.policy import FixedPolicy

    rng = random.Random(4)
    texts = [_runs_text(rng, 400) for _ in range(4)]
    factory = PolicyFactory(default_gamma=4, gamma_max=16, adaptive=AdaptiveConfig(gamma_max=16))
    for t in texts[:2]:  # warm the shared statistics, as earlier traffic would
        _replay(t, factory.make("adaptive", 0, "d"), factory)
    auto = [_replay(t, factory.make("adaptive", 0, "d"), factory) for t in texts[2:]]
    fixed = {g: [_replay(t, FixedPolicy(g)) for t in texts[2:]] for g in (1, 2, 3, 4, 6, 8)}
    best = max(sum(v) for v in fixed.values())
    assert sum(auto) >= 0.95 * best, (sum(auto), {g: round(sum(v), 4) for g, v in fixed.items()})
    policy = factory.make("adaptive", 0, "d")
    fresh, cont = policy.alphas(state=0), policy.alphas(state=1)  # type: ignore[attr-defined]
    # the first drafted token: inside a run it is almost surely accepted, after
    # a rejection it starts a new run, which is short more often than not
    assert cont[0] > fresh[0] + 0.1, (cont[:3], fresh[:3])


@pytest.mark.parametrize("rows,expect_speculation", [(1, True), (8, False)])
def test_batched_target_load_turns_speculation_down(rows: int, expect_speculation: bool) -> None:
    """The target batches ``rows`` requests into one pass costing
    F = 200 ms + 6 ms per token. Each request's share of a pass is
    A/B + b·k: alone (B = 1) speculation at α = 0.6 pays (E(2)/T(2) beats
    plain decoding by ~1.5×); at B = 8 the fixed cost is shared, drafted
    tokens still cost everyone 6 ms each plus 20 ms of drafting, and plain
    decoding gives ≥ 15% more tokens per second than any γ > 0."""
    rng = random.Random(5)
    prior, costs = AcceptancePrior(), CostModel()
    chosen: list[int] = []
    for _ in range(3):
        policy = AdaptivePolicy(prior, costs, AdaptiveConfig(gamma_max=8))
        for _ in range(150):
            g = policy.next_gamma()
            chosen.append(g)
            accepted = 0
            while accepted < g and rng.random() < 0.6:
                accepted += 1
            batch_tokens = rows * (g + 1)  # the other rows draft alike
            compute = (200.0 + 6.0 * batch_tokens) * rng.uniform(0.97, 1.03)
            policy.observe(RoundObservation(gamma=g, accepted=accepted, draft_ms=20.0 * g + 1.0, draft_compute_ms=20.0 * g,
                                            verify_ms=compute + 2.0, verify_compute_ms=compute, tokens_in_pass=g + 1,
                                            batch_size=rows, batch_tokens=batch_tokens))
    tail = chosen[-200:]
    speculating = sum(1 for g in tail if g > 0) / len(tail)
    # (γ = 0 rounds are interleaved with probes and Thompson exploration)
    assert (speculating > 0.9) if expect_speculation else (speculating < 0.25), (rows, Counter(tail))


def _trained_policy(alpha: float, cfg: AdaptiveConfig, rounds: int = 120) -> AdaptivePolicy:
    rng = random.Random(7)
    policy = AdaptivePolicy(AcceptancePrior(), CostModel(verify_slope_ms=8.0, draft_token_ms=20.0), cfg)
    for _ in range(rounds):
        g = policy.next_gamma()
        policy.observe(simulate_round(rng, alpha, g, t_step=200.0, c=0.1, slope=0.05, rtt=2.0))
    policy.next_gamma()  # scores for the round about to be drafted
    return policy


@pytest.mark.parametrize("alpha", [0.5, 0.7])
def test_confidence_stop_is_the_break_even_acceptance_of_one_more_token(alpha: float) -> None:
    """The derived threshold τ is the acceptance probability at which drafting
    one more token leaves expected tokens per ms unchanged: a token accepted
    with probability above τ raises the round's E/T, below τ lowers it."""
    policy = _trained_policy(alpha, AdaptiveConfig(gamma_max=8, confidence_max=0.99))
    tau = policy.stop_confidence()
    scores = policy.scores()
    g = max(range(1, 9), key=lambda k: scores[k])
    e, t = expected_tokens(policy.alphas(), g), policy.round_ms(g)
    m = policy.costs.marginal_token_ms()
    assert m is not None and 0.0 < tau < 0.99
    assert (e + 1.05 * tau) / (t + m) > e / t > (e + 0.95 * tau) / (t + m)


def test_confidence_stop_rises_with_the_rounds_yield_is_capped_and_can_be_turned_off() -> None:
    low = _trained_policy(0.5, AdaptiveConfig(gamma_max=8, confidence_max=0.99)).stop_confidence()
    high = _trained_policy(0.95, AdaptiveConfig(gamma_max=8, confidence_max=0.99)).stop_confidence()
    assert 0.0 < low < high  # a round that yields more per ms makes a doubtful token cost more
    assert _trained_policy(0.95, AdaptiveConfig(gamma_max=8)).stop_confidence() == pytest.approx(0.4)  # the cap
    assert _trained_policy(0.95, AdaptiveConfig(gamma_max=8, confidence_scale=0.0)).stop_confidence() == 0.0
    assert HeuristicPolicy().stop_confidence() == 0.0
    assert PolicyFactory().make("fixed", 4, "d").stop_confidence() == 0.0


def test_cli_hands_the_confidence_stop_to_the_orchestrator_and_refuses_bad_values() -> None:
    from orchestrator.servicer import OrchestratorServicer
    from orchestrator.cli import config_from_args as orchestrator_config
    from specdec_app.cli import build_parser
    from specdec_app.up import cmd_up

    def config(*flags: str) -> Any:
        a = build_parser().parse_args(["serve", "orchestrator", *flags])
        return orchestrator_config(a, 0)

    assert config().confidence_stop_scale == 1.0 and config().min_confidence == 0.0
    cfg = config("--confidence-stop-scale", "0.5", "--min-confidence", "0.3")
    assert (cfg.confidence_stop_scale, cfg.min_confidence) == (0.5, 0.3)
    servicer = OrchestratorServicer(cfg, None, None, None, None)  # type: ignore[arg-type]
    assert servicer.policies.adaptive.confidence_scale == 0.5
    for flags in (["--confidence-stop-scale", "-1"], ["--min-confidence", "1.0"], ["--min-confidence", "-0.1"]):
        with pytest.raises(SystemExit, match="specdec: --(confidence-stop-scale|min-confidence) must be in"):
            config(*flags)
    with pytest.raises(SystemExit, match="specdec: --confidence-stop-scale must be in"):
        cmd_up(build_parser().parse_args(["up", "--confidence-stop-scale", "-2"]))


# ------------------------------------------------- measured cost priors
FLAT_CURVE = {1: 381.0, 2: 411.0, 4: 476.0, 8: 553.0, 16: 745.0}  # float32 packed, AVX2 (docs/benchmarks.md)
STEEP_CURVE = {1: 240.0, 2: 404.0, 4: 807.0, 8: 1434.0, 16: 2676.0}  # bf16 eager, AVX2


def test_cost_prior_is_the_measured_curve_until_live_rounds_replace_it() -> None:
    costs = CostModel()
    assert costs.verify_ms(3) is None  # cold: no prior, no data
    costs.set_prior({1: 100.0, 2: 300.0, 4: 310.0, 8: 330.0}, draft_token_ms=12.0)
    # not a line: a line through any two points misses the others
    assert costs.verify_ms(1) == pytest.approx(100.0)
    assert costs.verify_ms(3) == pytest.approx(305.0)
    assert costs.verify_ms(8) == pytest.approx(330.0)
    assert costs.draft_ms(4) == pytest.approx(48.0)
    assert costs.marginal_token_ms(1) == pytest.approx(12.0 + 200.0)
    assert costs.marginal_token_ms(4) == pytest.approx(12.0 + 5.0)
    for i in range(40):  # the machine is slower than calibrated at k = 3, as calibrated at k = 1
        costs.observe(RoundObservation(gamma=2, accepted=1, draft_ms=30.0, draft_compute_ms=30.0,
                                       verify_ms=500.0, verify_compute_ms=500.0, tokens_in_pass=3))
        costs.observe(RoundObservation(gamma=0, accepted=0, verify_ms=100.0, verify_compute_ms=100.0, tokens_in_pass=1))
    assert costs.verify_ms(3) == pytest.approx(500.0, rel=0.05)
    assert costs.verify_ms(1) == pytest.approx(100.0, rel=0.05)
    # unobserved k follow the prior's shape, scaled by the live level (not a line through k=1 and k=3)
    assert 330.0 < costs.verify_ms(8) < 600.0
    assert costs.draft_ms(4) == pytest.approx(60.0)  # live draft cost replaced the prior


@pytest.mark.parametrize("curve, lo, hi", [(FLAT_CURVE, 2, 8), (STEEP_CURVE, 0, 0)])
def test_first_round_of_a_fresh_server_chooses_gamma_from_the_measured_curve(curve: dict[int, float], lo: int, hi: int) -> None:
    """No round observed yet: a flat verify curve already speculates, a
    steep one (verify of k tokens costs k steps) decodes plainly."""
    factory = PolicyFactory()
    factory.set_cost_priors(verify_curve=curve, draft_token_ms={"d": 24.0})
    policy = factory.make("auto", 0, "d")
    assert lo <= policy.next_gamma() <= hi
    assert factory.costs["d"].has_prior
    # a drafter first seen after the priors were set starts from them too
    other = factory.make("auto", 0, "other")
    assert factory.costs["other"].verify_ms(1) == pytest.approx(curve[1])
    assert other.next_gamma() >= 0


def _streamed_round(gamma: int, accepted: int, continued: bool, wait_ms: float, compute_ms: float) -> RoundObservation:
    return RoundObservation(gamma=gamma, accepted=accepted, draft_ms=wait_ms, draft_compute_ms=compute_ms,
                            verify_ms=300.0, verify_compute_ms=300.0, tokens_in_pass=gamma + 1,
                            continued=continued, streamed=True)


def test_the_cost_model_learns_how_much_drafting_a_stream_hides() -> None:
    """Over a draft stream a round waits only for the drafting that did not
    overlap the previous verify. Rounds that continue a fully accepted span
    (run-ahead drafted them during the verify) wait little, rounds after a
    rejection wait for all of it: the exposed share is learnt apart for the
    two, and the draft cost of a round of γ follows it."""
    costs = CostModel()
    for _ in range(200):
        costs.observe(_streamed_round(4, 4, continued=True, wait_ms=20.0, compute_ms=200.0))
        costs.observe(_streamed_round(4, 1, continued=False, wait_ms=210.0, compute_ms=200.0))
    assert costs.exposure(continued=True) == pytest.approx(0.1, abs=0.02)
    assert costs.exposure(continued=False) == pytest.approx(1.05, abs=0.05)
    assert costs.draft_ms(4, streamed=True, continued=True) == pytest.approx(0.1 * 200, rel=0.2)
    assert costs.draft_ms(4, streamed=True, continued=False) == pytest.approx(1.05 * 200, rel=0.1)
    # a unary round pays its Propose call in full, whatever the state
    assert costs.draft_ms(4) == pytest.approx(200.0, rel=0.1)
    m_hidden = costs.marginal_token_ms(5, streamed=True, continued=True)
    m_unary = costs.marginal_token_ms(5)
    assert m_hidden is not None and m_unary is not None and m_hidden < m_unary


def test_hidden_drafting_lets_gamma_grow_and_low_acceptance_still_turns_speculation_off() -> None:
    """With drafting hidden behind verification, AUTO over a stream drafts
    longer spans inside a run of agreement than AUTO over unary calls (same
    acceptance, same costs); at an acceptance too low to pay, both go to
    γ = 0."""
    def policy(streamed: bool, alpha: float) -> AdaptivePolicy:
        costs = CostModel()
        costs.set_prior({1: 300.0, 2: 310.0, 4: 330.0, 8: 400.0, 16: 600.0}, draft_token_ms=60.0)
        for _ in range(100):
            costs.observe(_streamed_round(4, 4, continued=True, wait_ms=5.0, compute_ms=240.0))
            costs.observe(_streamed_round(4, 2, continued=False, wait_ms=250.0, compute_ms=240.0))
        prior = AcceptancePrior(default_alpha=alpha)
        rng = random.Random(0)
        for _ in range(400):  # spans of 16, each token accepted with probability α, in both start states
            for state in (0, 1):
                accepted = 0
                while accepted < 16 and rng.random() < alpha:
                    accepted += 1
                prior.update(16, accepted, state)
        p = AdaptivePolicy(prior, costs, AdaptiveConfig(gamma_max=16), streamed=streamed)
        p._state = 1  # the next round continues a fully accepted span  # type: ignore[attr-defined]
        return p

    hidden, unary = policy(True, 0.85).next_gamma(), policy(False, 0.85).next_gamma()
    assert hidden > unary >= 1, (hidden, unary)
    assert policy(True, 0.02).next_gamma() == 0
    assert policy(False, 0.02).next_gamma() == 0
