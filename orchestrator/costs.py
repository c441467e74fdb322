"""The live cost model of the adaptive policy (``CostModel``): what a round
costs in ms, fitted from the timings every verified round reports. The
target's forward pass is a line fit (or a measured prior curve corrected
live), the draft's cost a per-token ratio estimate, and over a draft stream
the share of drafting the round waits for (exposure) is learnt apart for
rounds that start a span and rounds run-ahead drafted during a verify.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from orchestrator.policy import RoundObservation


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
    - the draft's catch-up prefill per committed token it takes in at once
      (the prompt, or what was committed during rounds at γ = 0): from
      rounds that fed it ``CATCHUP_MIN_TOKENS`` or more, their compute minus
      γ·t_token over the tokens fed; ``CATCHUP_PRIOR_RATIO`` × t_token before
      any data. Those rounds do not count towards t_token;
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
        self._catchup = [0.0, 0.0]  # weighted (Σ catch-up ms, Σ tokens fed)
        # streamed rounds, per start state: weighted (Σ wait, Σ compute); starts at e = 1
        self._exposure = [[self.EXPOSURE_PRIOR_MS, self.EXPOSURE_PRIOR_MS] for _ in (0, 1)]
        self._lock = threading.Lock()

    #: pseudo-milliseconds of fully exposed drafting the exposure estimates start from
    EXPOSURE_PRIOR_MS = 50.0
    #: a round that fed the draft this many committed tokens measures its catch-up
    CATCHUP_MIN_TOKENS = 16
    #: catch-up prefill per token / drafting one token, before any measurement
    #: (the 0.5B ONNX draft: 741 tokens in 1,383 ms against 13 ms per drafted token)
    CATCHUP_PRIOR_RATIO = 0.15

    def catchup_ms(self, tokens: int) -> float | None:
        """What the draft needs to take in ``tokens`` committed tokens at once
        (None before any draft cost is known)."""
        with self._lock:
            if self._catchup[1] > 1e-9:
                return tokens * self._catchup[0] / self._catchup[1]
            per_token = self._per_token()
        return None if per_token is None else tokens * self.CATCHUP_PRIOR_RATIO * per_token

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
                per_token = self._per_token()
                if obs.fed_tokens >= self.CATCHUP_MIN_TOKENS and per_token is not None:
                    self._catchup = [self._catchup[0] * w + max(0.0, compute - obs.gamma * per_token),
                                     self._catchup[1] * w + obs.fed_tokens]
                    return
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
