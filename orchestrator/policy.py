"""Draft-length policies: how many tokens to draft in the next round.

A policy sees only what is known before the round's verification (past
acceptance, measured costs, the target's reported load), so the choice of γ
never affects exactness (docs/design.md, rule 5).

- ``FixedPolicy``: always γ.
- ``HeuristicPolicy``: Hugging Face assisted generation's schedule, +2 after a
  fully accepted span, −1 otherwise (a baseline).
- ``AdaptivePolicy``: per round, the γ ∈ {0 … γ_max} that maximises expected
  committed tokens per second, E(γ) / T(γ), from live per-position acceptance
  estimates and a live cost model (``CostModel``, orchestrator/costs.py);
  γ = 0 is plain target decoding, with periodic probes so a request can
  return to speculation.
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

from orchestrator.costs import CostModel
from orchestrator.probing import ProbeBudget, expected_saving


@dataclass(frozen=True)
class RoundObservation:
    """What one verified round tells a policy.

    gamma: drafted tokens sent for verification (may be < the γ asked for).
    accepted: drafted tokens accepted (a prefix).
    draft_ms: draft-side wall time of the Propose call (0 when γ = 0).
    draft_compute_ms: draft-side compute reported by the service.
    verify_ms: wall time of the Verify call as the orchestrator saw it.
    verify_compute_ms / verify_queue_ms: reported by the target.
    tokens_in_pass: tokens the target ran in the verify pass (new + drafted).
    queue_depth: jobs pending at the target when the call was admitted.
    batch_size / batch_tokens: rows and tokens of the target's forward pass
      that served this Verify (1 / tokens_in_pass when it ran alone; 0 when
      the target does not report them).
    continued: the previous round of this request drafted and had every
      drafted token accepted, so this round continues a run of agreement
      (see ``AcceptancePrior``).
    requested: the γ the policy asked for (``gamma`` is smaller when the
      drafter stopped the span early: confidence stop or context limit).
    streamed: the span came over a draft stream (``draft_ms`` is then the
      time the round waited for it, which run-ahead shortens below the
      span's draft compute when drafting overlapped the previous verify).
    fed_tokens: committed tokens the draft took in before drafting (unary
      Propose: its delta; the prompt on the first round, everything since
      the last speculative round after rounds at γ = 0): the draft's
      catch-up prefill is part of its compute.
    """

    gamma: int
    accepted: int
    draft_ms: float = 0.0
    draft_compute_ms: float = 0.0
    verify_ms: float = 0.0
    verify_compute_ms: float = 0.0
    verify_queue_ms: float = 0.0
    tokens_in_pass: int = 1
    queue_depth: int = 0
    continued: bool = False
    batch_size: int = 0
    batch_tokens: int = 0
    requested: int = 0
    streamed: bool = False
    fed_tokens: int = 0


def tried_positions(obs: RoundObservation) -> int:
    """Draft positions a round tried, for acceptance counting. A span the
    drafter left empty when asked for one (a model-free drafter that found no
    match, or a confidence stop before the first token) cost a draft call and
    yielded nothing: it counts as a rejection at the first position, so a
    drafter that is often empty is priced by its hit rate,
    P(first token accepted) = P(non-empty) x P(accepted | non-empty)."""
    if obs.gamma <= 0:
        return 1 if obs.requested > 0 else 0
    return obs.gamma


class DraftLengthPolicy(Protocol):
    name: str

    def next_gamma(self) -> int:
        """γ for the next round; 0 means a plain target decoding step."""

    def stop_confidence(self) -> float:
        """The draft-side early stop for the round just chosen: the drafter
        ends the span before a token whose top probability is below it
        (0 = draft all γ tokens)."""

    def observe(self, obs: RoundObservation) -> None:
        """Records the outcome of a verified round."""


@dataclass
class FixedPolicy:
    gamma: int
    name: str = "fixed"

    def next_gamma(self) -> int:
        return self.gamma

    def stop_confidence(self) -> float:
        return 0.0

    def observe(self, obs: RoundObservation) -> None:
        return None


@dataclass
class OffPolicy:
    name: str = "off"

    def next_gamma(self) -> int:
        return 0

    def stop_confidence(self) -> float:
        return 0.0

    def observe(self, obs: RoundObservation) -> None:
        return None


@dataclass
class HeuristicPolicy:
    """transformers' ``num_assistant_tokens_schedule="heuristic"``."""

    gamma: int = 4
    gamma_max: int = 16
    name: str = "heuristic"

    def next_gamma(self) -> int:
        return self.gamma

    def stop_confidence(self) -> float:
        return 0.0

    def observe(self, obs: RoundObservation) -> None:
        if obs.gamma == 0:
            return
        if obs.accepted == obs.gamma:
            self.gamma = min(self.gamma_max, self.gamma + 2)
        else:
            self.gamma = max(1, self.gamma - 1)


# --------------------------------------------------------------------------
# Adaptive policy
# --------------------------------------------------------------------------


def expected_tokens(alphas: Sequence[float], gamma: int) -> float:
    """E(γ) = 1 + Σ_{k=1..γ} Π_{i<=k} α_i: committed tokens per round when the
    i-th drafted token is accepted with probability α_i given its
    predecessors were (Leviathan et al.'s E(γ) when all α_i = α)."""
    e, run = 1.0, 1.0
    for k in range(gamma):
        run *= alphas[k]
        e += run
    return e


def rates(alphas: Sequence[float], round_ms: dict[int, float]) -> dict[int, float]:
    """Expected committed tokens per ms of a round of each γ in ``round_ms``."""
    return {g: expected_tokens(alphas, g) / max(ms, 1e-6) for g, ms in round_ms.items()}


FRESH, CONTINUED = 0, 1  # the acceptance state a round starts in


class AcceptancePrior:
    """Process-wide, per-drafter acceptance statistics shared across requests:
    exponentially decayed counts of (accepted, tried) per draft position, kept
    apart for the two states a round can start in. A draft agrees with the
    target in runs: a round that starts right after a rejection (FRESH) sees
    the start of a new run, while one that follows a fully accepted span
    (CONTINUED) is inside a run that has already lasted, and runs that last
    tend to go on (code being copied, boilerplate). New requests start from
    these; each request's own evidence then dominates."""

    def __init__(self, max_positions: int = 16, decay: float = 0.98, default_alpha: float = 0.6) -> None:
        self.max_positions = max_positions
        self.decay = decay
        self.default_alpha = default_alpha
        self._acc = [[0.0] * max_positions for _ in (FRESH, CONTINUED)]
        self._tried = [[0.0] * max_positions for _ in (FRESH, CONTINUED)]
        self._lock = threading.Lock()

    def update(self, gamma: int, accepted: int, state: int = FRESH) -> None:
        acc, tried = self._acc[state], self._tried[state]
        with self._lock:
            # every position decays on every update, so evidence from other
            # traffic fades at deep positions too, not only where it is renewed
            for i in range(self.max_positions):
                acc[i] *= self.decay
                tried[i] *= self.decay
            for i in range(min(gamma, self.max_positions)):
                if i > accepted:
                    break
                acc[i] += 1.0 if i < accepted else 0.0
                tried[i] += 1.0

    def pooled(self, strength: float = 2.0, state: int = FRESH) -> float:
        """Acceptance over all positions, smoothed towards ``default_alpha``."""
        with self._lock:
            return (sum(self._acc[state]) + strength * self.default_alpha) / (sum(self._tried[state]) + strength)

    def alphas(self, strength: float = 2.0, state: int = FRESH) -> list[float]:
        """Per-position α, smoothed towards the pooled α by ``strength``
        pseudo-counts (positions nobody tried yet get the pooled value)."""
        pooled = self.pooled(strength, state)
        acc, tried = self._acc[state], self._tried[state]
        with self._lock:
            return [(acc[i] + strength * pooled) / (tried[i] + strength) for i in range(self.max_positions)]


@dataclass
class AdaptiveConfig:
    gamma_max: int = 8
    prior_strength: float = 4.0  # pseudo-observations of the shared estimate, per position
    # pseudo-tokens at level 1 in the request's level: small, so that its own rounds soon outweigh others'
    level_prior_strength: float = 2.0
    probe_every: int = 8  # rounds at γ = 0 before probing speculation again (doubles up to 64)
    probe_gamma: int = 1
    # Probes (orchestrator/probing.py, unary drafting): a γ = probe_gamma round
    # runs only when its value of information exceeds probe_value_margin × its
    # expected extra time, within probe_budget_share of the plain time of
    # max(tokens so far, min(probe_horizon_tokens, the cap)); probe_value=False: budget only
    probe_budget_share: float = 0.03
    probe_horizon_tokens: int = 128
    probe_value_margin: float = 2.0
    probe_value: bool = True
    thompson: bool = False  # sample α from its posterior each round (exploration) instead of using the mean
    explore_every: int = 0  # every n-th speculative round tries a neighbouring γ (keeps the cost slope learnt)
    min_gain: float = 1.02  # speculate only when E/T beats plain decoding by this factor
    # Draft confidence early stop (``AdaptivePolicy.stop_confidence``): the
    # threshold is scale × (tokens/ms of the planned round) × (ms one more
    # drafted token costs), capped where the draft's top probability stops
    # being a calibrated acceptance estimate (docs/metrics.md); 0 = off.
    confidence_scale: float = 1.0
    confidence_max: float = 0.4
    # Priors for the cost model before any measurement (ms); the draft/target
    # cost ratio on the reference CPU is about 0.1.
    default_verify_ms: float = 200.0
    default_verify_slope_ms: float = 8.0
    default_draft_token_ms: float = 20.0


class AdaptivePolicy:
    """Chooses γ per round to maximise expected committed tokens per second.

    For each γ: E(γ) from per-position α (this request's counts, smoothed by
    the shared ``AcceptancePrior``) and T(γ) = t_draft(γ) + t_verify(γ + 1)
    from the shared ``CostModel`` (live timings, so load on the target raises
    t_verify and pushes γ down). γ = 0 means T = t_verify(1), E = 1.
    """

    name = "adaptive"

    def __init__(
        self,
        prior: AcceptancePrior,
        costs: CostModel,
        cfg: AdaptiveConfig | None = None,
        seed: int = 0,
        update_shared: bool = True,
        allow: Callable[[], bool] | None = None,
        streamed: bool = False,
    ) -> None:
        """``streamed``: the request drafts over a draft stream (the draft
        cost is its exposed share, see ``CostModel``).
        ``update_shared=False`` when something else (the orchestrator's
        stats path, which sees every request's rounds) feeds ``prior`` and
        ``costs``; the policy then only keeps this request's own counts.
        ``allow`` (the server's load gate) is asked before every round;
        while it says no, rounds are plain decoding (γ = 0)."""
        self.allow = allow
        self.streamed = streamed
        self.cfg = cfg or AdaptiveConfig()
        self.update_shared = update_shared
        self._rng = random.Random(seed)
        self.prior = prior
        self.costs = costs
        n = self.cfg.gamma_max
        self._acc = [[0.0] * n for _ in (FRESH, CONTINUED)]
        self._tried = [[0.0] * n for _ in (FRESH, CONTINUED)]
        self._state = FRESH  # the state the next round starts in
        self._level_acc = 0.0  # tokens accepted by this request
        self._level_expected = 0.0  # tokens the shared estimates predicted for the same rounds
        self._zero_rounds = 0
        self._committed = 0  # plain rounds still committed to (commit_plain_rounds)
        self._probe_every = self.cfg.probe_every
        self._spec_rounds = 0
        self.last_scores: dict[int, float] = {}
        self._probing = False  # the round just chosen is a probe
        self._probe_hit = False  # the last round was a probe, accepted in full
        self._catchup_tokens = 0  # committed tokens the draft must take in before it drafts again
        self._remaining = 0  # tokens the request may still generate (0 = unknown)
        self._generated = 0  # tokens the request has generated (0 = unknown: no probe budget)
        self.budget = ProbeBudget(self.cfg.probe_budget_share, self.cfg.probe_horizon_tokens)

    def set_outlook(self, catchup_tokens: int, remaining_tokens: int, generated_tokens: int = 0) -> None:
        """What the next round's choice must also weigh (unary drafting):
        the draft's catch-up prefill of ``catchup_tokens`` is paid once, by
        the first speculative round, and can only be earned back over the
        ``remaining_tokens`` the request may still generate; probes are
        budgeted against the ``generated_tokens`` so far."""
        self._catchup_tokens = max(0, int(catchup_tokens))
        self._remaining = max(0, int(remaining_tokens))
        self._generated = max(0, int(generated_tokens))

    def _catchup_pays(self, scores: dict[int, float], best: int) -> bool:
        """Speculating from now on saves (1/s₀ − 1/s_best) ms per token over
        the remaining tokens: it must save more than the catch-up costs."""
        if self._catchup_tokens <= 0 or self._remaining <= 0:
            return True
        cost = self.costs.catchup_ms(self._catchup_tokens)
        if cost is None or cost <= 0:
            return True
        saved = (1.0 / max(scores[0], 1e-9) - 1.0 / max(scores[best], 1e-9)) * self._remaining
        return saved > cost

    def _probe_pays(self, scores: dict[int, float]) -> bool:
        """Whether a probe may run now (orchestrator/probing.py): its value of
        information exceeds ``probe_value_margin`` × its expected extra time,
        and its extra time should the target reject it all (an upper bound:
        catch-up + round − one plain step) fits the request's probe budget,
        which it is then charged."""
        step = 1.0 / max(scores[0], 1e-9)  # ms per token at γ = 0
        gamma = min(self.cfg.probe_gamma, self.cfg.gamma_max)
        ms = {g: self.round_ms(g) for g in range(1, self.cfg.gamma_max + 1)}
        catchup = (self.costs.catchup_ms(self._catchup_tokens) or 0.0) if self._catchup_tokens > 0 else 0.0
        worst = catchup + ms[gamma] - step
        if self.cfg.probe_value and self._remaining > 0:
            expected = worst - (expected_tokens(self.alphas(), gamma) - 1.0) * step
            best = lambda al: max(rates(al, ms).values())  # noqa: E731
            _, value = expected_saving(self._posterior(), best, scores[0] * self.cfg.min_gain, self._remaining)
            if value <= self.cfg.probe_value_margin * max(0.0, expected):
                return False
        known = self._generated > 0 or self._remaining > 0
        if known and not self.budget.fits(worst, self._generated, self._remaining, step):
            return False
        self.budget.charge(worst)
        return True

    # -------------------------------------------------------------- estimates
    def alphas(self, sample: bool = False, state: int | None = None) -> list[float]:
        """Per-position acceptance P(token i accepted | tokens before it were)
        for a round starting in ``state`` (default: the next round's).

        Each (state, position) has a Beta posterior over this request's
        counts whose prior mean is the shared estimate for that state and
        position (``AcceptancePrior``: how acceptance varies with depth and
        with whether the round continues a run, across requests) scaled by
        this request's *level*: its accepted tokens over the tokens the
        shared estimates predicted for the same rounds, shrunk towards 1. So
        a request of easy text raises every position at once, also those it
        has not tried yet, and the span can grow as far as its text allows.
        With ``sample``, a Thompson draw instead of the mean, which explores
        exactly as much as the estimates are uncertain.
        """
        post = self._posterior(state)
        if sample:
            return [self._rng.betavariate(a, b) for a, b in post]
        return [a / (a + b) for a, b in post]

    def _posterior(self, state: int | None = None) -> list[tuple[float, float]]:
        """The Beta (a, b) of each position's α (see ``alphas``)."""
        st = self._state if state is None else state
        s = self.cfg.prior_strength
        shared = self.prior.alphas(state=st)
        level = self.level()
        acc, tried = self._acc[st], self._tried[st]
        out = []
        for i in range(self.cfg.gamma_max):
            p = min(0.995, max(0.005, level * (shared[i] if i < len(shared) else shared[-1])))
            out.append((max(acc[i] + s * p, 1e-3), max((tried[i] - acc[i]) + s * (1.0 - p), 1e-3)))
        return out

    def level(self) -> float:
        """This request's acceptance relative to the shared estimates
        (accepted / predicted), with ``level_prior_strength`` pseudo-tokens
        at 1."""
        sl = self.cfg.level_prior_strength
        return (self._level_acc + sl) / (self._level_expected + sl)

    def round_ms(self, gamma: int) -> float:
        c = self.cfg
        verify = self.costs.verify_ms(gamma + 1)
        if verify is None:
            verify = c.default_verify_ms + c.default_verify_slope_ms * gamma
        if gamma == 0:
            return verify
        draft = self.costs.draft_ms(gamma, self.streamed, self._state == CONTINUED)
        if draft is None:
            draft = c.default_draft_token_ms * gamma
        return verify + draft

    def scores(self, sample: bool = False) -> dict[int, float]:
        """Expected committed tokens per ms for each γ."""
        return rates(self.alphas(sample), {g: self.round_ms(g) for g in range(self.cfg.gamma_max + 1)})

    # ---------------------------------------------------------------- policy
    def commit_plain_rounds(self, limit: int) -> int:
        """After a round chosen as plain decoding (γ = 0, not a probe): the
        next rounds up to the next probe will be plain too, unless the cost
        estimates move (plain rounds teach nothing about acceptance). Commits
        to at most ``limit`` of them, so that the target may decode them
        ahead (orchestrator decode-ahead), and returns how many."""
        if self._probing or self._zero_rounds == 0 or self._committed:
            return 0
        self._committed = max(0, min(int(limit), self._probe_every - self._zero_rounds - 1))
        return self._committed

    @property
    def plain_rounds_left(self) -> int:
        """Plain rounds still committed to (a decode-ahead run that ended
        early may ask for them again)."""
        return self._committed

    def next_gamma(self) -> int:
        if self._committed:  # a plain round committed to by commit_plain_rounds
            self._committed -= 1
            self._zero_rounds += 1
            self._probing = False
            return 0
        if self.allow is not None and not self.allow():
            return 0
        scores = self.scores(sample=self.cfg.thompson)
        self.last_scores = scores
        self._probing = False
        best = max(range(1, self.cfg.gamma_max + 1), key=lambda g: scores[g])
        # before any own evidence (outlook known), a round speculating on shared estimates alone is a probe
        own = self._level_expected > 0 or self._remaining <= 0
        if own and scores[best] >= scores[0] * self.cfg.min_gain and self._catchup_pays(scores, best):
            self._zero_rounds = 0
            self._probe_every = self.cfg.probe_every
            self._spec_rounds += 1
            if self.cfg.explore_every and self._spec_rounds % self.cfg.explore_every == 0:
                step = 1 if (self._spec_rounds // self.cfg.explore_every) % 2 else -1
                return min(self.cfg.gamma_max, max(1, best + step))
            return best
        # a probe is due at the first round, after a probe accepted in full, and after probe_every plain rounds
        first = (not own and self._zero_rounds == 0) or self._probe_hit
        self._zero_rounds += 1
        if first or self._zero_rounds >= self._probe_every:
            # probe: a short span refreshes α; back off if it keeps losing
            self._zero_rounds = 0
            if not first:
                self._probe_every = min(64, self._probe_every * 2)
            if self._probe_pays(scores):
                self._probing = True
                return min(self.cfg.probe_gamma, self.cfg.gamma_max)
            if first:  # declined: a plain round like the others (commit_plain_rounds counts it)
                self._zero_rounds = 1
        return 0

    def stop_confidence(self) -> float:
        """The draft-side early stop for this round's span: the drafter stops
        before a token whose top probability p is below this threshold.

        A drafted token costs m ms more (its draft compute plus the verify
        pass's slope b) and, if the target accepts it (probability ≈ p given
        the span so far was accepted), saves a token; the round as planned
        yields r tokens per ms (the best score). So the token pays when
        p > r·m, scaled by ``AdaptiveConfig.confidence_scale`` (0 = off)."""
        scale = self.cfg.confidence_scale
        if scale <= 0 or not self.last_scores or self._probing:
            # a probe drafts its token whatever the draft's confidence: a probe
            # cut to nothing would teach the policy nothing, and it would stay
            # at γ = 0 for good
            return 0.0
        planned = max(self.last_scores, key=lambda g: self.last_scores[g])
        m = self.costs.marginal_token_ms(planned + 1, self.streamed, self._state == CONTINUED)
        if m is None:
            m = self.cfg.default_draft_token_ms + self.cfg.default_verify_slope_ms
        return min(self.cfg.confidence_max, scale * max(self.last_scores.values()) * m)

    def observe(self, obs: RoundObservation) -> None:
        tried_n = tried_positions(obs)
        if self.update_shared:
            self.costs.observe(obs)
            if tried_n > 0:
                self.prior.update(tried_n, obs.accepted, CONTINUED if obs.continued else FRESH)
        state, self._state = self._state, (CONTINUED if 0 < obs.gamma == obs.accepted else FRESH)
        self._probe_hit = self._probing and self._state == CONTINUED
        if tried_n <= 0:
            return
        acc, tried = self._acc[state], self._tried[state]
        shared = self.prior.alphas(state=state)
        for i in range(min(tried_n, self.cfg.gamma_max)):
            if i > obs.accepted:
                break
            tried[i] += 1.0
            self._level_expected += shared[min(i, len(shared) - 1)]
            if i < obs.accepted:
                acc[i] += 1.0
                self._level_acc += 1.0


def optimal_gamma(alpha: float, c: float, gamma_max: int, verify_slope: float = 0.0) -> int:
    """Analytic optimum of E(γ)/T(γ) for constant α, draft/target cost ratio c
    and a verify cost that grows by ``verify_slope`` (fraction of a target step)
    per extra token: argmax over γ of E(γ) / (1 + γ·(c + verify_slope)).
    Returns 0 when no γ beats plain decoding."""
    best, best_score = 0, 1.0
    for g in range(1, gamma_max + 1):
        e = (g + 1.0) if alpha >= 1.0 else (1 - alpha ** (g + 1)) / (1 - alpha)
        score = e / (1.0 + g * (c + verify_slope))
        if score > best_score + 1e-12:
            best, best_score = g, score
    return best


#: what a drafter run in the orchestrator costs per token before any round
#: is measured (a prompt-lookup span is a few dict look-ups: microseconds)
LOCAL_DRAFT_TOKEN_MS = 0.01


@dataclass
class PolicyFactory:
    """Builds one policy per request; holds the process-wide shared state
    (acceptance priors per drafter and the cost model)."""

    default_gamma: int = 4
    gamma_max: int = 8
    adaptive: AdaptiveConfig = field(default_factory=AdaptiveConfig)
    priors: dict[str, AcceptancePrior] = field(default_factory=dict)
    costs: dict[str, CostModel] = field(default_factory=dict)
    allow: Callable[[], bool] | None = None  # load gate handed to every adaptive policy
    # measured cost priors (set_cost_priors): the target's t(k), per-drafter ms/token
    verify_curve: dict[int, float] = field(default_factory=dict)
    draft_token_ms: dict[str, float] = field(default_factory=dict)
    _made: int = 0

    def make(self, mode: str, gamma: int, drafter: str, streamed: bool = False) -> DraftLengthPolicy:
        if mode == "off":
            return OffPolicy()
        if mode == "fixed":
            return FixedPolicy(gamma or self.default_gamma)
        if mode == "heuristic":
            return HeuristicPolicy(gamma=gamma or self.default_gamma, gamma_max=self.gamma_max)
        cfg = AdaptiveConfig(**{**self.adaptive.__dict__, "gamma_max": gamma or self.adaptive.gamma_max})
        prior, costs = self._shared(drafter)
        self._made += 1
        return AdaptivePolicy(prior, costs, cfg, seed=self._made, update_shared=False, allow=self.allow,
                              streamed=streamed)

    def make_local(self, label: str, gamma: int = 0) -> "AdaptivePolicy":
        """The adaptive policy of a drafter the orchestrator runs itself
        (prompt lookup, orchestrator/lookup.py), with its own shared
        acceptance estimates under ``label``: its drafting costs nothing
        measurable, so a round is priced at the target's verify cost."""
        if label not in self.draft_token_ms:
            # also the cost model a fixed-γ request's lookup rounds created
            # first (with no draft prior: it would price them as a model's)
            self.set_cost_priors(draft_token_ms={label: LOCAL_DRAFT_TOKEN_MS})
        policy = self.make("adaptive", gamma, label)
        assert isinstance(policy, AdaptivePolicy)
        return policy

    def set_cost_priors(self, verify_curve: dict[int, float] | None = None,
                        draft_token_ms: dict[str, float] | None = None) -> None:
        """Measured costs to start every drafter's cost model from: the
        target's t(k) (the same target serves every drafter) and each
        drafter's compute per token."""
        if verify_curve:
            self.verify_curve = dict(verify_curve)
        for name, ms in (draft_token_ms or {}).items():
            if ms > 0:
                self.draft_token_ms[name] = ms
        for name, costs in self.costs.items():
            costs.set_prior(self.verify_curve, self.draft_token_ms.get(name, 0.0))

    def _shared(self, drafter: str) -> tuple[AcceptancePrior, CostModel]:
        cfg = self.adaptive
        prior = self.priors.setdefault(drafter, AcceptancePrior(max_positions=max(16, cfg.gamma_max)))
        costs = self.costs.get(drafter)
        if costs is None:
            costs = CostModel(verify_slope_ms=cfg.default_verify_slope_ms, draft_token_ms=cfg.default_draft_token_ms)
            costs.set_prior(self.verify_curve, self.draft_token_ms.get(drafter, 0.0))
            self.costs[drafter] = costs
        return prior, costs

    def observe(self, obs: RoundObservation, drafter: str) -> None:
        """Every verified round of every request, whatever its policy, feeds
        the shared acceptance prior and cost model of its drafter, so
        adaptive requests start from what the server has already seen."""
        prior, costs = self._shared(drafter)
        costs.observe(obs)
        tried_n = tried_positions(obs)
        if tried_n > 0:
            prior.update(tried_n, obs.accepted, CONTINUED if obs.continued else FRESH)

