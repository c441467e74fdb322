"""Which fidelities calibration scores (target_service/calibration.py,
``choose``). Scoring one is a teacher-forced pass over the calibration
sample: on a CPU without native bf16 the bf16 eager reference alone took
about 3 minutes of a 10.8-minute first start. So only the fidelities that
decide the choice are scored: a quantized pair that would beat every
admissible pair, and the bound's reference (bf16 eager) when such a pair
needs it. The choice itself must be the same as scoring everything, and a
quantized pair outside the bound is still never chosen.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from target_service import calibration as cal

EAGER, BF16W, A8, KQ, INT4 = (("bfloat16", "eager"), ("bfloat16", "bf16w"), ("bfloat16", "kquant-a8"),
                              ("bfloat16", "kquant"), ("bfloat16", "int4"))
F32 = ("float32", "eager")
PAIRS = [EAGER, F32, BF16W, KQ, A8, INT4]  # the order eligible_pairs gives on a CPU


def curve(ms1: float) -> dict[int, float]:
    return {1: ms1, 2: ms1 * 1.1, 4: ms1 * 1.4, 8: ms1 * 2.0, 16: ms1 * 3.5}


def fid(kl: float, top1: float) -> dict[str, object]:
    return {"mean_kl": kl, "top1_agreement": top1, "positions": 1024, "p99_kl": 3e-3, "max_kl": 2e-2,
            "decisive_disagreements": 0}


# the AVX2 (Zen 3) machine's shape: bf16 eager slowest, a8 fastest, int4 slower than kquant
CURVES = {EAGER: curve(277), F32: curve(327), BF16W: curve(190), KQ: curve(74), A8: curve(49), INT4: curve(160)}
FIDS = {EAGER: fid(4.7e-4, 0.985), F32: fid(0.0, 1.0), BF16W: fid(4.2e-5, 0.998), KQ: fid(2.9e-5, 1.0),
        A8: fid(3.3e-4, 0.996), INT4: fid(2.7e-4, 0.985)}


class Machine:
    """Measures curves and scores fidelities from tables, recording calls."""

    def __init__(self, curves: dict, fids: dict) -> None:  # type: ignore[type-arg]
        self.curves, self.fids = curves, fids
        self.measured: list[tuple[str, str]] = []
        self.scored: list[tuple[str, str]] = []

    def measure(self, pair: tuple[str, str]) -> cal.Measured:
        self.measured.append(pair)
        return self.curves[pair], None

    def score(self, pair: tuple[str, str]) -> dict[str, object] | None:
        self.scored.append(pair)
        return self.fids.get(pair)

    def choose(self, cache: cal.CalibrationCache | None = None) -> cal.CalibrationResult:
        return cal.choose(PAIRS, self.measure, cache, fidelity_needed=True, measure_fidelity=self.score)


def choose_scoring_everything(fids: dict) -> tuple[str, str]:  # type: ignore[type-arg]
    """The choice when every pair's fidelity is known (the rule as before)."""
    res = cal.choose(PAIRS, lambda p: (CURVES[p], fids.get(p)), None, fidelity_needed=True)
    return res.dtype, res.backend


def test_only_the_fidelities_that_decide_the_choice_are_scored() -> None:
    m = Machine(CURVES, FIDS)
    res = m.choose()
    assert (res.dtype, res.backend) == A8 == choose_scoring_everything(FIDS)
    # a8 right after its curve (still loaded), then the reference; nothing else
    assert m.scored == [A8, EAGER]
    assert sorted(res.unscored) == ["bfloat16/int4", "bfloat16/kquant"] and not res.excluded
    assert set(res.fidelity) == {"bfloat16/kquant-a8", "bfloat16/eager"}
    assert m.measured.index(A8) < m.measured.index(KQ)  # the usually-fastest quantized pair first
    assert list(res.curves) == [cal.pair_key(p) for p in PAIRS]  # reported (and tie-broken) in the given order


@pytest.mark.parametrize("a8_fid,chosen,scored", [
    # negative controls: a8 outside the bound (KL above bf16 eager's; a decisive disagreement)
    # is not chosen, and the next fastest, kquant, is scored then and chosen
    (fid(5.2e-4, 0.996), KQ, [A8, EAGER, KQ]),
    ({**fid(3.3e-4, 0.996), "decisive_disagreements": 1}, KQ, [A8, EAGER, KQ]),
    # a8 cannot be scored (None): never chosen unscored
    (None, KQ, [A8, KQ, EAGER]),
])
def test_a_pair_outside_the_bound_falls_through_to_the_next_fastest(a8_fid, chosen, scored) -> None:  # type: ignore[no-untyped-def]
    fids = {**FIDS, A8: a8_fid}
    m = Machine(CURVES, fids)
    res = m.choose()
    assert (res.dtype, res.backend) == chosen == choose_scoring_everything(fids)
    assert m.scored == scored
    if a8_fid is not None:
        assert "bfloat16/kquant-a8" in res.excluded and "bfloat16/eager" in res.excluded["bfloat16/kquant-a8"]
    assert res.unscored == ["bfloat16/int4"]


def test_every_quantized_pair_outside_the_bound_leaves_the_fastest_plain_pair() -> None:
    """The negative control of the whole rule: all quantized pairs worse than
    bf16 eager, so all are scored and none is chosen."""
    fids = {**FIDS, A8: fid(9e-4, 0.99), KQ: fid(9e-4, 0.99), INT4: fid(9e-4, 0.99)}
    m = Machine(CURVES, fids)
    res = m.choose()
    assert (res.dtype, res.backend) == BF16W == choose_scoring_everything(fids)
    assert sorted(m.scored) == sorted([A8, EAGER, KQ, INT4, BF16W]) and not res.unscored
    assert set(res.excluded) == {"bfloat16/kquant-a8", "bfloat16/kquant", "bfloat16/int4"}


def test_no_fidelity_is_scored_when_no_quantized_pair_is_faster() -> None:
    curves = {**CURVES, A8: curve(400), KQ: curve(500), INT4: curve(600)}
    m = Machine(curves, FIDS)
    res = m.choose()
    # only the chosen pair's, reported with it (GetModelInfo, bench)
    assert (res.dtype, res.backend) == BF16W and m.scored == [BF16W] and list(res.fidelity) == ["bfloat16/bf16w"]
    assert sorted(res.unscored) == ["bfloat16/int4", "bfloat16/kquant", "bfloat16/kquant-a8"]


def test_the_cache_keeps_what_was_scored_and_scores_only_what_a_new_choice_needs(tmp_path: Path) -> None:
    m = Machine(CURVES, FIDS)
    first = m.choose(cal.CalibrationCache(tmp_path, {"cpu": "test"}))
    assert not first.cached
    again = Machine(CURVES, FIDS)
    res = again.choose(cal.CalibrationCache(tmp_path, {"cpu": "test"}))
    assert res.cached and again.measured == [] and again.scored == []
    assert (res.dtype, res.backend) == A8 and res.fidelity == first.fidelity
    # a cached curve without a fidelity (a start that did not need it) is not
    # timed again: only the fidelity is scored, once it decides the choice
    cache = cal.CalibrationCache(tmp_path, {"cpu": "other"})
    for p in PAIRS:
        cache.put(p, CURVES[p])
    third = Machine(CURVES, FIDS)
    res = third.choose(cal.CalibrationCache(tmp_path, {"cpu": "other"}))
    assert third.measured == [] and third.scored == [A8, EAGER] and (res.dtype, res.backend) == A8
    assert not res.cached
