"""Draft-length policies: how many tokens to draft in the next round.

A policy sees only what is known before the round's verification (past
acceptance, measured costs, the target's reported load), so the choice of γ
never affects exactness (docs/design.md, rule 5).

- ``FixedPolicy``: always γ.
- ``HeuristicPolicy``: Hugging Face assisted generation's schedule, +2 after a
  fully accepted span, −1 otherwise (a baseline).
- ``AdaptivePolicy``: per round, the γ ∈ {0 … γ_max} that maximises expected
  committed tokens per second, E(γ) / T(γ), from live per-position acceptance
  estimates and a live cost model; γ = 0 is plain target decoding, with
  periodic probes so a request can return to speculation.
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence


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


class CostModel:
    """Live, process-wide estimates of what a round costs (ms):

    - the target's forward pass F(x) = A + b·x for x tokens in the pass,
      fitted by exponentially weighted least squares on (tokens in the
      forward pass, its compute time) as the target reports them, so it
      follows the target's current speed; the slope is shrunk towards
      ``verify_slope_ms`` until the data has spread in x;
    - B, the rows the target batches into one pass (exponentially weighted
      mean of what it reports), and the per-call network time;
    - t_draft(γ) = rtt + γ·t_token, where rtt is the Propose call's wall time
      minus the draft's compute (so queueing at a busy draft service counts)
      and t_token = Σ compute / Σ γ (exponentially weighted ratio estimator;
      ``draft_token_ms`` before any data);
    - over a draft stream, the round waits only for the part of drafting that
      did not overlap the previous verify: t_draft(γ) = e·γ·t_token, where the
      exposure e = Σ wait / Σ compute is measured apart for rounds that start
      after a rejection (the draft starts the span then) and rounds that
      continue a fully accepted one (run-ahead drafted it during the verify).

    ``verify_ms(k)`` is a request's share of a verify pass of its k tokens:
    A/B + b·k + network. Alone on the target (B = 1) that is the pass itself;
    under load the fixed cost A is shared by the batch while every drafted
    token still costs b for everyone, so long spans stop paying and the
    policy shortens speculation or turns it off (issue: speculation must
    never lower throughput).
    """

    #: pseudo-observations of the prior curve at each k (a live mean at k
    #: outweighs the prior there after a few passes)
    PRIOR_STRENGTH = 2.0

    def __init__(self, halflife: float = 64.0, verify_slope_ms: float = 8.0, draft_token_ms: float = 20.0) -> None:
        self._w = 0.5 ** (1.0 / halflife)
        self.verify_slope_ms = verify_slope_ms
        self.draft_token_ms = draft_token_ms
        self._verify = _WeightedLine()
        # the target's measured t(k) (GetModelInfo.forward_cost) and the live
        # per-k means that replace it: (weight, weighted sum of ms) per k
        self._prior: dict[int, float] = {}
        self._live: dict[int, list[float]] = {}
        self._ratio = [0.0, 0.0]  # weighted (Σ observed / prior, Σ weight): the prior's level correction
        self._draft_prior_ms = 0.0
        self._rows = 0.0
        self._net = 0.0
        self._verify_n = 0.0
        self._draft_compute = 0.0
        self._draft_tokens = 0.0
        self._draft_rtt = 0.0
        self._draft_n = 0.0
        # streamed rounds, per start state: weighted (Σ wait, Σ compute); starts at e = 1
        self._exposure = [[self.EXPOSURE_PRIOR_MS, self.EXPOSURE_PRIOR_MS] for _ in (0, 1)]
        self._lock = threading.Lock()

    #: pseudo-milliseconds of fully exposed drafting the exposure estimates start from
    EXPOSURE_PRIOR_MS = 50.0

    def set_prior(self, verify_curve: dict[int, float] | None = None, draft_token_ms: float = 0.0) -> None:
        """Starts from measured costs: the target's t(k) (ms for a forward
        pass of k tokens, any shape of curve) and the draft's compute per
        token. Live measurements replace them as rounds are observed."""
        with self._lock:
            if verify_curve:
                self._prior = {int(k): float(v) for k, v in verify_curve.items() if v > 0}
            if draft_token_ms > 0:
                self._draft_prior_ms = float(draft_token_ms)

    @property
    def has_prior(self) -> bool:
        return bool(self._prior)

    def observe(self, obs: RoundObservation) -> None:
        w = self._w
        with self._lock:
            if obs.verify_ms > 0:
                compute = obs.verify_compute_ms if obs.verify_compute_ms > 0 else obs.verify_ms
                x = obs.batch_tokens if obs.batch_tokens > 0 else obs.tokens_in_pass
                self._verify.add(x, compute, w)
                if self._prior:
                    for cell in self._live.values():
                        cell[0] *= w
                        cell[1] *= w
                    cell = self._live.setdefault(int(x), [0.0, 0.0])
                    cell[0] += 1.0
                    cell[1] += compute
                    ref = _interpolate(self._prior, x)
                    if ref > 0:
                        self._ratio = [self._ratio[0] * w + compute / ref, self._ratio[1] * w + 1.0]
                self._rows = self._rows * w + max(1, obs.batch_size)
                self._net = self._net * w + max(0.0, obs.verify_ms - compute - obs.verify_queue_ms)
                self._verify_n = self._verify_n * w + 1.0
            if obs.gamma > 0 and obs.streamed and obs.draft_compute_ms > 0:
                self._draft_compute = self._draft_compute * w + obs.draft_compute_ms
                self._draft_tokens = self._draft_tokens * w + obs.gamma
                cell = self._exposure[1 if obs.continued else 0]
                cell[0] = cell[0] * w + obs.draft_ms
                cell[1] = cell[1] * w + obs.draft_compute_ms
            elif obs.gamma > 0 and obs.draft_ms > 0:
                compute = obs.draft_compute_ms if obs.draft_compute_ms > 0 else obs.draft_ms
                self._draft_compute = self._draft_compute * w + compute
                self._draft_tokens = self._draft_tokens * w + obs.gamma
                self._draft_rtt = self._draft_rtt * w + max(0.0, obs.draft_ms - compute)
                self._draft_n = self._draft_n * w + 1.0

    def forward_ms(self, x: float) -> float | None:
        """The target's forward pass of x tokens (alone): with a prior curve,
        the live mean at x blended with the prior (scaled by the live level
        correction) by their weights; else the live line fit. None before
        any prior or data."""
        with self._lock:
            return self._forward_ms(x)

    def _forward_ms(self, x: float) -> float | None:
        if self._prior:
            scale = self._ratio[0] / self._ratio[1] if self._ratio[1] > 1e-9 else 1.0
            base = scale * _interpolate(self._prior, x)
            cell = self._live.get(int(x)) if float(x).is_integer() else None
            if cell is None or cell[0] < 1e-9:
                return base
            return (cell[1] + self.PRIOR_STRENGTH * base) / (cell[0] + self.PRIOR_STRENGTH)
        fit = self._verify.fit(self.verify_slope_ms)
        if fit is None:
            return None
        return fit[0] + fit[1] * x

    def verify_ms(self, k: int) -> float | None:
        with self._lock:
            if self._prior:
                # a request's share of a pass: the fixed part (a 1-token
                # step) is shared by the B rows of a batch, the tokens it adds
                # beyond one are its own
                one, own = self._forward_ms(1), self._forward_ms(k)
                assert one is not None and own is not None
                rows = max(1.0, self._rows / self._verify_n) if self._verify_n > 1e-9 else 1.0
                net = self._net / self._verify_n if self._verify_n > 1e-9 else 0.0
                return one / rows + max(0.0, own - one) + net
            fit = self._verify.fit(self.verify_slope_ms)
            if fit is None:
                return None
            a, b = fit
            rows = max(1.0, self._rows / self._verify_n)
            return max(0.0, a) / rows + b * k + self._net / self._verify_n

    def exposure(self, continued: bool) -> float:
        """Over a draft stream: the share of a span's draft compute the round
        waits for (1 = none hidden; below 1 when run-ahead drafted it while
        the target verified; above 1 when the stream adds latency)."""
        with self._lock:
            wait, compute = self._exposure[1 if continued else 0]
            return wait / compute if compute > 1e-9 else 1.0

    def _per_token(self) -> float | None:
        if self._draft_tokens > 1e-9:
            return self._draft_compute / self._draft_tokens
        if self._draft_prior_ms > 0:
            return self._draft_prior_ms
        return None

    def marginal_token_ms(self, k: int = 1, streamed: bool = False, continued: bool = False) -> float | None:
        """What one more drafted token adds to a round whose verify pass has
        k tokens: its draft compute (over a stream, the exposed share of it)
        plus t(k+1) − t(k) (the line fit's slope without a prior curve). None
        before any draft cost is known."""
        scale = self.exposure(continued) if streamed else 1.0
        with self._lock:
            per_token = self._per_token()
            if per_token is None:
                return None
            per_token *= scale
            if self._prior:
                hi, lo = self._forward_ms(k + 1), self._forward_ms(k)
                assert hi is not None and lo is not None
                return per_token + max(0.0, hi - lo)
            fit = self._verify.fit(self.verify_slope_ms)
            if fit is None:
                return None
            return per_token + fit[1]

    def draft_ms(self, gamma: int, streamed: bool = False, continued: bool = False) -> float | None:
        """The draft time a round of γ waits for (unary: the Propose call;
        streamed: the exposed share of the span's compute)."""
        if streamed:
            scale = self.exposure(continued)
            with self._lock:
                per_token = self._per_token()
            return None if per_token is None else scale * per_token * gamma
        with self._lock:
            per_token = self._per_token()
            if per_token is None:
                return None
            rtt = self._draft_rtt / self._draft_n if self._draft_n > 1e-9 else 0.0
            return rtt + per_token * gamma


def _interpolate(curve: dict[int, float], x: float) -> float:
    """Piecewise-linear t(x) through the measured points; the last
    segment's slope past the largest x, flat below the smallest."""
    ks = sorted(curve)
    if x <= ks[0]:
        return curve[ks[0]]
    for lo, hi in zip(ks, ks[1:]):
        if x <= hi:
            return curve[lo] + (curve[hi] - curve[lo]) * (x - lo) / (hi - lo)
    if len(ks) == 1:
        return curve[ks[0]]
    lo, hi = ks[-2], ks[-1]
    return curve[hi] + max(0.0, (curve[hi] - curve[lo]) / (hi - lo)) * (x - hi)


@dataclass
class _WeightedLine:
    """y ≈ a + b·x, exponentially weighted least squares (sufficient statistics)."""

    n: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0

    def add(self, x: float, y: float, w: float) -> None:
        self.n = self.n * w + 1.0
        self.sx = self.sx * w + x
        self.sy = self.sy * w + y
        self.sxx = self.sxx * w + x * x
        self.sxy = self.sxy * w + x * y

    def fit(self, prior_slope: float, strength: float = 4.0) -> tuple[float, float] | None:
        """(intercept, slope); the slope is shrunk towards ``prior_slope``
        with ``strength`` units of x-variance, so a policy that keeps one γ
        (no spread in x) still has a sensible slope."""
        if self.n < 1e-9:
            return None
        mean_x, mean_y = self.sx / self.n, self.sy / self.n
        sxx_c = self.sxx - self.n * mean_x * mean_x
        sxy_c = self.sxy - self.n * mean_x * mean_y
        slope = max(0.0, (sxy_c + strength * prior_slope) / (max(sxx_c, 0.0) + strength))
        return mean_y - slope * mean_x, slope


@dataclass
class AdaptiveConfig:
    gamma_max: int = 8
    prior_strength: float = 4.0  # pseudo-observations of the prior mean, per position
    level_prior_strength: float = 16.0  # pseudo-tokens at level 1 (the shared estimates) in the request's level
    probe_every: int = 8  # rounds at γ = 0 before probing speculation again (doubles up to 64)
    probe_gamma: int = 1
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
        self._probe_every = self.cfg.probe_every
        self._spec_rounds = 0
        self.last_scores: dict[int, float] = {}

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
        st = self._state if state is None else state
        s = self.cfg.prior_strength
        shared = self.prior.alphas(state=st)
        level = self.level()
        acc, tried = self._acc[st], self._tried[st]
        out = []
        for i in range(self.cfg.gamma_max):
            p = min(0.995, max(0.005, level * (shared[i] if i < len(shared) else shared[-1])))
            a = acc[i] + s * p
            b = (tried[i] - acc[i]) + s * (1.0 - p)
            out.append(self._rng.betavariate(max(a, 1e-3), max(b, 1e-3)) if sample else a / (a + b))
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
        alphas = self.alphas(sample)
        return {g: expected_tokens(alphas, g) / max(self.round_ms(g), 1e-6) for g in range(self.cfg.gamma_max + 1)}

    # ---------------------------------------------------------------- policy
    def next_gamma(self) -> int:
        if self.allow is not None and not self.allow():
            return 0
        scores = self.scores(sample=self.cfg.thompson)
        self.last_scores = scores
        best = max(range(1, self.cfg.gamma_max + 1), key=lambda g: scores[g])
        if scores[best] >= scores[0] * self.cfg.min_gain:
            self._zero_rounds = 0
            self._probe_every = self.cfg.probe_every
            self._spec_rounds += 1
            if self.cfg.explore_every and self._spec_rounds % self.cfg.explore_every == 0:
                step = 1 if (self._spec_rounds // self.cfg.explore_every) % 2 else -1
                return min(self.cfg.gamma_max, max(1, best + step))
            return best
        self._zero_rounds += 1
        if self._zero_rounds >= self._probe_every:
            # probe: a short span refreshes α; back off if it keeps losing
            self._zero_rounds = 0
            self._probe_every = min(64, self._probe_every * 2)
            return min(self.cfg.probe_gamma, self.cfg.gamma_max)
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
        if scale <= 0 or not self.last_scores:
            return 0.0
        planned = max(self.last_scores, key=lambda g: self.last_scores[g])
        m = self.costs.marginal_token_ms(planned + 1, self.streamed, self._state == CONTINUED)
        if m is None:
            m = self.cfg.default_draft_token_ms + self.cfg.default_verify_slope_ms
        return min(self.cfg.confidence_max, scale * max(self.last_scores.values()) * m)

    def observe(self, obs: RoundObservation) -> None:
        if self.update_shared:
            self.costs.observe(obs)
            if obs.gamma > 0:
                self.prior.update(obs.gamma, obs.accepted, CONTINUED if obs.continued else FRESH)
        state, self._state = self._state, (CONTINUED if 0 < obs.gamma == obs.accepted else FRESH)
        if obs.gamma <= 0:
            return
        acc, tried = self._acc[state], self._tried[state]
        shared = self.prior.alphas(state=state)
        for i in range(min(obs.gamma, self.cfg.gamma_max)):
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
        if obs.gamma > 0:
            prior.update(obs.gamma, obs.accepted, CONTINUED if obs.continued else FRESH)

