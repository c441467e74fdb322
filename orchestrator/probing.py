"""When a request that decodes plainly should try speculation (a *probe*).

A probe is a short speculative round (γ = ``probe_gamma``) run while plain
decoding scores best, or while the request has no acceptance evidence of its
own yet (its first speculative round, chosen from the shared estimates alone).
It costs its expected extra time over plain steps: the draft's catch-up
prefill of the committed tokens it has not seen, plus the round's draft and
verify, less the plain steps its expected tokens save. It is worth that only
through what it may reveal: that this request's acceptance α is high enough
for speculation to pay over the tokens it has left.

Value of information (``probe_value``): α of the request's first draft
position has a Beta posterior (the shared estimate as prior, this request's
counts as data). For α on a grid over that posterior, with every position's
mean scaled alike, speculating at its best γ saves ``1/s₀ − 1/s(α)`` ms per
token over plain decoding (0 where it does not pay). The probe's value is the
expectation of that saving over the remaining tokens,
E[(R · (1/s₀ − 1/s(α)))⁺] = P(speculation pays) × E[gain | it pays], i.e. the
value of learning α exactly (an optimistic bound on what one round teaches,
hence the ``value_margin``). A probe runs only while its value exceeds its
expected cost; once the request's own rounds have shown a low α, the
posterior's upper tail, and with it the value, vanishes.

Hard cap (``ProbeBudget``): all probes of a request together are charged
their extra time should the target reject them (catch-up + round − one
plain step, an upper bound), which may not exceed ``share`` of the plain time
of max(tokens generated so far, the request's horizon), the horizon being
min(``horizon_tokens``, the tokens the request may generate): a request that
runs its course pays at most ``share`` for exploring, and the first probe
can run at once, before the tokens that pay for it are generated (a request
that ends early, at EOS, pays at most ``share`` × ``horizon_tokens`` steps).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence


def beta_grid(a: float, b: float, points: int = 32) -> list[tuple[float, float]]:
    """(x, weight) pairs: the Beta(a, b) density at the midpoints of
    ``points`` equal cells of (0, 1), normalised to sum to 1."""
    a, b = max(a, 1e-3), max(b, 1e-3)
    xs = [(i + 0.5) / points for i in range(points)]
    dens = [x ** (a - 1.0) * (1.0 - x) ** (b - 1.0) for x in xs]
    total = sum(dens) or 1.0
    return [(x, d / total) for x, d in zip(xs, dens)]


def expected_saving(posterior: Sequence[tuple[float, float]], best_rate: Callable[[list[float]], float],
                    plain_rate: float, remaining: int, points: int = 32) -> tuple[float, float]:
    """(P(speculation pays), E[saved ms over ``remaining`` tokens, 0 where it
    does not pay]) under the Beta ``posterior`` [(a, b) per position].

    α of the first position runs over its posterior; the other positions keep
    their posterior means scaled by the same factor (a request of easier text
    is easier at every depth). ``best_rate(alphas)`` is the best tokens per ms
    of any γ ≥ 1 for those α; ``plain_rate`` that of plain decoding."""
    if remaining <= 0 or not posterior or plain_rate <= 0:
        return 0.0, 0.0
    means = [a / (a + b) for a, b in posterior]
    a0, b0 = posterior[0]
    plain_ms = 1.0 / plain_rate
    p_pays = value = 0.0
    for x, w in beta_grid(a0, b0, points):
        scale = x / max(means[0], 1e-9)
        rate = best_rate([min(0.995, m * scale) for m in means])
        if rate > plain_rate:
            p_pays += w
            value += w * remaining * (plain_ms - 1.0 / rate)
    return p_pays, value


@dataclass
class ProbeBudget:
    """A request's exploration account: probes are charged their extra ms
    should the target reject them (an upper bound), and together may cost
    at most ``share`` of the plain time of
    max(generated, min(generated + remaining, ``horizon_tokens``)) tokens."""

    share: float = 0.03
    horizon_tokens: int = 128
    spent_ms: float = 0.0
    probes: int = 0

    def limit_ms(self, generated: int, remaining: int, step_ms: float) -> float:
        horizon = min(max(0, generated) + max(0, remaining), self.horizon_tokens)
        return step_ms * self.share * max(generated, horizon)

    def fits(self, cost_ms: float, generated: int, remaining: int, step_ms: float) -> bool:
        return self.spent_ms + max(0.0, cost_ms) <= self.limit_ms(generated, remaining, step_ms)

    def charge(self, cost_ms: float) -> None:
        self.spent_ms += max(0.0, cost_ms)
        self.probes += 1
