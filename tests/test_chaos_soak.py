"""The chaos soak (scripts/chaos_soak.py, issue 25) against real servers on
loopback: a draft service, two target replicas and an orchestrator as
separate processes on the tiny models, under concurrent greedy, sampled and
poison requests, cancels and deadlines, while the draft and one target
replica are SIGKILLed and restarted.

``test_chaos_soak_short`` is the CI version (8 streams, 60 s of load);
``test_chaos_soak_five_minutes`` is the full one (32 streams, 300 s), marked
``soak`` (run with ``pytest -m soak``). Both assert every verdict of the
soak's JSON report, and that the soak really did what the verdicts are about
(kills happened and were survived, poison was sent, greedy streams ran
across a kill). The unit tests below check the soak's own judging, so a
verdict cannot pass by construction."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.stack import load_script


@pytest.fixture(scope="module")
def soak() -> ModuleType:
    return load_script("chaos_soak")


def run_soak(soak: ModuleType, out: Path, tiny_models: Any, cache: Path, *args: str) -> tuple[int, dict[str, Any]]:
    rc = soak.main(["--out", str(out), "--cache-dir", str(cache), "--target-model", str(tiny_models.target),
                    "--draft-model", str(tiny_models.draft), *args])
    return rc, json.loads((out / "chaos_soak.json").read_text())


def assert_soak(rc: int, rep: dict[str, Any], kills: set[str]) -> None:
    failed = {k: v for k, v in rep["verdicts"].items() if not v["pass"]}
    assert not failed, json.dumps(failed, indent=1)[:6000]
    assert rc == 0
    # the faults and the hostile input really happened
    assert {e["service"] for e in rep["events"]} == kills
    assert all(e.get("ready") for e in rep["events"]), rep["events"]
    by_kind = rep["counts"]["by_kind"]
    for kind in ("greedy", "sampled", "poison", "edge", "garbage", "cancel", "deadline"):
        assert by_kind.get(kind, 0) > 0, (kind, by_kind)
    detail = rep["verdicts"]["greedy_identical_to_target_only"]["detail"]
    overlapped = re.search(r"\((\d+) overlapped a draft kill, (\d+) a target kill\)", detail)
    assert overlapped and int(overlapped[1]) > 0 and int(overlapped[2]) > 0, detail
    assert rep["orchestrator_upstream_failures"], "the target kill must have counted against its replica"


def test_chaos_soak_short(soak: ModuleType, tiny_models, onnx_cache_dir: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    rc, rep = run_soak(soak, tmp_path / "soak", tiny_models, onnx_cache_dir, "--streams", "8", "--duration", "60",
                       "--warmup", "10", "--kills", "draft@0.2,target@0.45", "--settle-timeout", "45")
    assert_soak(rc, rep, {"draft", "target-a"})
    assert (tmp_path / "soak" / "chaos_soak.md").read_text().startswith("# Chaos soak: 8 streams")


@pytest.mark.soak
@pytest.mark.long
def test_chaos_soak_five_minutes(soak: ModuleType, tiny_models, onnx_cache_dir: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    rc, rep = run_soak(soak, tmp_path / "soak", tiny_models, onnx_cache_dir)
    assert_soak(rc, rep, {"draft", "target-a"})
    assert rep["args"]["streams"] == 32 and rep["load_seconds"] >= 300


# ------------------------------------------------ the soak's own judging
def test_f32_next_is_the_adjacent_float32(soak: ModuleType) -> None:
    def f32(x: float) -> float:
        return float(struct.unpack("<f", struct.pack("<f", x))[0])

    below0, above1 = soak.f32_next(0.0, -1.0), soak.f32_next(1.0, 2.0)
    assert below0 < 0 and f32(below0) == below0 and f32(below0 / 2) in (0.0, -0.0)
    assert above1 == 1.0 + 2.0**-23
    assert soak.f32_next(1.0, 0.0) == 1.0 - 2.0**-24


class _Svc:
    def __init__(self, alive: bool) -> None:
        self.alive = alive

    def alive_during(self, a: float, b: float) -> bool:
        return self.alive

    def alive_at(self, t: float) -> bool:
        return self.alive


def _judge(soak: ModuleType, kind: str, code: str, ids: list[int], targets_alive: bool = True,
           service: str = "orchestrator") -> str:
    s = soak.Soak.__new__(soak.Soak)
    s.refs = {("p", 3): [1, 2, 3]}
    s.targets = [_Svc(targets_alive), _Svc(targets_alive)]
    s.draft, s.orch = _Svc(True), _Svc(True)
    case = soak.Case(kind, "x", key=("p", 3), service=service)
    r = soak.Result(kind, "x", 0, 0.0, 1.0, code, len(ids))
    s.judge(case, r, ids)
    return str(r.verdict)


def test_judging_fails_what_the_issue_forbids(soak: ModuleType) -> None:
    assert _judge(soak, "greedy", "OK", [1, 2, 3]) == "ok"
    assert _judge(soak, "greedy", "OK", [1, 2, 4]) == "fail"  # differs from target-only
    assert _judge(soak, "sampled", "OK", [1, 2]) == "fail"  # short
    assert _judge(soak, "greedy", "UNAVAILABLE", []) == "fail"  # a peer was alive
    assert _judge(soak, "greedy", "UNAVAILABLE", [], targets_alive=False) == "ok"  # documented: no replica left
    assert _judge(soak, "greedy", "INTERNAL", [], targets_alive=False) == "fail"
    assert _judge(soak, "poison", "INVALID_ARGUMENT", []) == "ok"
    for code in ("UNAVAILABLE", "OK", "INTERNAL", "UNKNOWN"):
        assert _judge(soak, "poison", code, []) == "fail", code
        assert _judge(soak, "garbage", code, []) == "fail", code
    assert _judge(soak, "edge", "OK", [1, 2, 3]) == "ok"  # a tiny temperature served as greedy
    assert _judge(soak, "edge", "OK", [3, 2, 1]) == "fail"  # ... but not as greedy
    assert _judge(soak, "edge", "UNAVAILABLE", []) == "fail"
    assert _judge(soak, "cancel", "CANCELLED", []) == "ok"
    assert _judge(soak, "cancel", "UNAVAILABLE", []) == "fail"
    assert _judge(soak, "deadline", "DEADLINE_EXCEEDED", []) == "ok"
    assert _judge(soak, "deadline", "INTERNAL", []) == "fail"


def test_poison_cases_cover_the_issue(soak: ModuleType) -> None:
    import random

    cases = soak.poison_cases(random.Random(0))
    labels = " ".join(c.label for c in cases)
    for want in ("temperature=1e-39", "temperature=1.4e-45", "temperature=1e308", "temperature=nan", "temperature=inf",
                 "top_p=nextbelow(0)", "top_p=nextabove(1)", "top_k=-1", f"top_k={soak.VOCAB + 1}",
                 "drafter=unknown", f"prompt_token_ids={soak.VOCAB}", "garbage->orchestrator", "garbage->target",
                 "garbage->draft"):
        assert want in labels, want
    garbage = [c.raw for c in cases if c.kind == "garbage"]
    assert garbage and all(g is not None and g[0] == 0x07 for g in garbage)  # wire type 7: never parses
