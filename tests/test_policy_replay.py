"""scripts/policy_replay.py's replay with a measured verify curve: the
costs it charges a round and how it reads a `specdec bench` results file."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from orchestrator.policy import FixedPolicy
from tests.stack import load_script


@pytest.fixture(scope="module")
def replay_mod():  # type: ignore[no-untyped-def]
    return load_script("policy_replay")


def test_a_measured_curve_prices_each_pass_by_interpolation(replay_mod, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    curve = {1: 100.0, 4: 130.0, 8: 400.0}
    costs = replay_mod.Costs(curve=curve, noise=0.0, draft_token=10.0, draft_rtt=0.0, overhead=5.0)
    rng = random.Random(0)
    assert costs.verify(1, rng) == 100.0 and costs.verify(4, rng) == 130.0
    assert costs.verify(6, rng) == pytest.approx(265.0)  # between the points: linear
    assert costs.verify_a == 100.0  # the target-only step the speedups are against
    # a bench results file or a plain mapping
    (tmp_path / "r.json").write_text(json.dumps({"numerics": {"forward_cost_ms": {"1": 100, "4": 130, "8": 400}}}))
    (tmp_path / "c.json").write_text(json.dumps({"1": 100, "4": 130, "8": 400}))
    assert replay_mod.load_curve(str(tmp_path / "r.json")) == curve == replay_mod.load_curve(str(tmp_path / "c.json"))
    # FIXED γ = 3 over a trace whose draft always agrees for 3 tokens: every
    # round drafts 3 (30 ms), verifies 4 tokens (130 ms) and pays 5 ms, and
    # commits 4 tokens; 12 positions take 3 rounds
    trace = {"target": [7] * 12, "runs": [3] * 12, "confidence": [[1.0] * 16] * 12}
    r = replay_mod.replay_one(trace, FixedPolicy(3), costs, rng)
    assert r["gammas"] == [3, 3, 3] and r["accepted"] == [3, 3, 3]
    assert r["tok_s"] == pytest.approx(12 / (3 * (30 + 130 + 5)) * 1e3)
    # without a curve: the reference line a + b·(k − 1)
    line = replay_mod.Costs(noise=0.0)
    assert line.verify(4, rng) == pytest.approx(215.0 + 13.0 * 3)
