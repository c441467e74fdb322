#!/usr/bin/env python
"""Chaos soak (issue 25): real servers on loopback, hostile input and killed
processes under concurrent load.

It starts, as separate ``specdec serve`` processes on tiny random-weight
models (tests/tiny.py), one draft service (the model drafter, prompt-lookup
and auto), two target replicas and one orchestrator pointing at both targets
and the draft. ``--streams`` client tasks (default 32) then send requests
for ``--duration`` seconds (default 300), each drawn at random from:

- healthy greedy and sampled requests over several prompts, lengths, modes
  (OFF, AUTO, FIXED γ, HEURISTIC), drafters (default, the model drafter,
  prompt-lookup, auto) and draft modes (unary, stream, run-ahead);
- poison requests: sampling values at the float edges (subnormal and tiny
  temperatures, 1e308, NaN, inf, top_p at the next float below 0 and above
  1, top_k -1 and vocabulary + 1), unknown drafters, out-of-range token ids,
  and garbage bytes sent raw to the orchestrator, target and draft methods;
- client cancels mid-stream and short deadlines.

Meanwhile a chaos task SIGKILLs the draft service and one target replica and
restarts each on the same port (schedule: ``--kills``).

Verdicts (each one PASS or FAIL in the JSON and the markdown; the exit
status is 1 when one fails):

- ``poison_invalid_argument``: every poison request got INVALID_ARGUMENT
  (a temperature below the server's floor may instead be served as greedy:
  then its tokens must equal the greedy reference);
- ``healthy_streams_complete``: every healthy stream finished with all its
  tokens, or failed with UNAVAILABLE while no target replica was alive
  (docs/design.md section 5: "no target replica left");
- ``cancels_and_deadlines``: cancelled and short-deadline calls ended with
  CANCELLED / DEADLINE_EXCEEDED (or OK when they finished first);
- ``greedy_identical_to_target_only``: every greedy stream (those that
  overlapped a draft or target kill included) equals its target-only
  reference, computed with mode OFF before any fault;
- ``sessions_return_to_zero``: afterwards every service's session gauges
  (``specdec_target_active_sessions``, ``specdec_draft_active_sessions``,
  ``specdec_active_streams``, ``specdec_orchestrator_upstream_sessions``)
  read zero;
- ``rss_growth``: each process's RSS grows < ``--rss-limit`` (5 %) from
  warm-up (the largest sample in its first ``--warmup`` seconds) to its end;
- ``metrics_invalid_argument``: the orchestrator's ``specdec_requests_total``
  counts exactly the poison requests it answered INVALID_ARGUMENT under that
  code;
- ``poison_marks_no_replica_failed``: a poison burst sent before any kill
  leaves ``specdec_orchestrator_upstream_failures_total`` unchanged and
  every replica ``available``;
- ``replicas_recovered``: at the end every replica is ``available`` again.

Usage: ``python scripts/chaos_soak.py --out /tmp/soak`` (writes
``chaos_soak.json``, ``chaos_soak.md`` and the services' logs under
``logs/``). tests/test_chaos_soak.py runs a short version.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import struct
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import grpc  # noqa: E402

from specdec.v1 import orchestrator_pb2 as pb, orchestrator_pb2_grpc  # noqa: E402
from specdec_app.loadbench import rss_mb as proc_rss_mb  # noqa: E402
from scripts.chaos_cases import (  # noqa: E402,F401
    CHARS, DRAFT_NOISE, LENGTHS, MODEL_FREE_DRAFTERS, PROMPTS, VOCAB, Case, Result, S, f32_next, healthy_case,
    poison_cases,
)
from scripts.chaos_procs import Life, RssSampler, Service, rss_mb  # noqa: E402,F401
from tests.stack import free_port, make_request, scrape_metrics, wait_serving  # noqa: E402

# -------------------------------------------------------------------- soak
class Soak:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.out = Path(a.out)
        self.t0 = time.monotonic()
        self.results: list[Result] = []
        self.events: list[dict[str, Any]] = []  # kills and restarts
        self.refs: dict[tuple[str, int], list[int]] = {}
        self.poison_probe: dict[str, Any] = {}
        self.stop_at = 0.0
        self.poison_on = False

    def now(self) -> float:
        return time.monotonic() - self.t0

    # ............................................................ set-up
    def build_models(self) -> tuple[Path, Path]:
        if self.a.target_model and self.a.draft_model:
            return Path(self.a.target_model), Path(self.a.draft_model)
        from tests.tiny import build_tiny_pair

        return build_tiny_pair(self.out / "models", chars=CHARS, draft_noise=DRAFT_NOISE)

    def make_services(self, target: Path, draft: Path) -> None:
        logs = self.out / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        cache = str(Path(self.a.cache_dir or self.out / "cache"))
        common = ["--cache-dir", cache]
        # one numerics for both replicas, as a pool is deployed: left to calibrate, two replicas of the
        # tiny model can time eager and packed differently and choose apart, and a session is then only
        # rebuilt on a replica of its own numerics (orchestrator/routing.py), so a killed replica's
        # streams ended UNAVAILABLE with the other one alive
        t_args = [*common, "--model", str(target), "--dtype", "float32", "--backend", "eager", "--threads", "1"]
        self.draft = Service("draft", "draft", [*common, "--model", str(draft), "--precision", "fp32", "--threads", "1",
                                                "--drafters", "qwen2.5-coder-0.5b,prompt-lookup,auto",
                                                "--target-tokenizer", str(target)], logs)
        self.targets = [Service("target-a", "target", t_args, logs), Service("target-b", "target", t_args, logs)]
        self.orch = Service("orchestrator", "orchestrator", [
            *common, "--model", str(target), "--target-address", ",".join(t.address for t in self.targets),
            "--draft-address", self.draft.address, "--speculation-max-streams", "0"], logs)
        self.services = [self.draft, *self.targets, self.orch]
        # the draft service names a --model drafter after the model's directory
        self.drafters = ["", draft.name, *MODEL_FREE_DRAFTERS]

    def start_services(self) -> None:
        for s in (self.draft, *self.targets):
            s.start(self.t0)
        for s in (self.draft, *self.targets):
            s.wait_ready(self.t0)
        self.orch.start(self.t0)
        self.orch.wait_ready(self.t0)

    # ........................................................... calls
    async def generate(self, stub: Any, req: pb.GenerateRequest, timeout: float,
                       cancel_after: int = 0) -> tuple[str, list[int], str]:
        """(code name, token ids, details)."""
        ids: list[int] = []
        call = stub.Generate(req, timeout=timeout)
        try:
            n = 0
            async for chunk in call:
                ids.extend(chunk.token_ids)
                n += 1
                if cancel_after and n >= cancel_after:
                    call.cancel()
                    return "CANCELLED", ids, "client cancel"
            return "OK", ids, ""
        except grpc.aio.AioRpcError as e:
            return e.code().name, ids, (e.details() or "")[:300]
        except asyncio.CancelledError:
            return "CANCELLED", ids, "cancelled"

    async def raw_call(self, case: Case) -> tuple[str, str]:
        svc = {"orchestrator": self.orch, "target": self.targets[1], "draft": self.draft}[case.service]
        if case.service == "target" and not self.targets[1].alive_at(self.now()):
            svc = self.targets[0]
        path = {"orchestrator": "/specdec.v1.Orchestrator/Generate", "target": "/specdec.v1.Target/Prefill",
                "draft": "/specdec.v1.Draft/Propose"}[case.service]
        async with grpc.aio.insecure_channel(svc.address) as ch:
            try:
                if case.service == "orchestrator":
                    async for _ in ch.unary_stream(path)(case.raw, timeout=30):
                        pass
                else:
                    await ch.unary_unary(path)(case.raw, timeout=30)
                return "OK", ""
            except grpc.aio.AioRpcError as e:
                return e.code().name, (e.details() or "")[:300]

    async def run_case(self, stub: Any, case: Case, worker: int) -> Result:
        start = self.now()
        ids: list[int] = []
        if case.kind == "garbage":
            code, details = await self.raw_call(case)
        else:
            assert case.req is not None
            code, ids, details = await self.generate(stub, case.req, case.timeout, case.cancel_after)
        end = self.now()
        r = Result(case.kind, case.label, worker, round(start, 3), round(end, 3), code, len(ids), reason=details)
        r.overlaps = [e["name"] for e in self.events if e["kill"] <= end and (e.get("ready") or 1e18) + 1.0 >= start]
        self.judge(case, r, ids)
        self.results.append(r)
        return r

    def judge(self, case: Case, r: Result, ids: list[int]) -> None:
        def fail(why: str) -> None:
            r.verdict, r.reason = "fail", f"{why}; {r.reason}".strip("; ")

        if case.kind in ("greedy", "sampled"):
            n = case.key[1] if case.key else 0
            if r.code == "OK":
                if len(ids) != n:
                    fail(f"{len(ids)} tokens, wanted {n}")
                elif case.kind == "greedy" and case.key is not None and ids != self.refs[case.key]:
                    fail("greedy output differs from target-only")
            elif r.code == "UNAVAILABLE" and not any(t.alive_during(r.start, r.end) for t in self.targets) and \
                    not any(t.alive_at(r.end) for t in self.targets):
                r.verdict = "ok"  # documented: no target replica left
            else:
                fail(f"healthy stream ended {r.code}")
        elif case.kind == "poison":
            if r.code != "INVALID_ARGUMENT":
                fail(f"poison got {r.code}, wanted INVALID_ARGUMENT")
        elif case.kind == "edge":
            if r.code == "OK":
                if case.key is not None and ids != self.refs[case.key]:
                    fail("tiny temperature served but not as greedy")
            elif r.code != "INVALID_ARGUMENT":
                fail(f"tiny temperature got {r.code}, wanted INVALID_ARGUMENT or greedy output")
        elif case.kind == "garbage":
            if r.code != "INVALID_ARGUMENT":
                svc = {"orchestrator": [self.orch], "target": self.targets, "draft": [self.draft]}[case.service]
                if r.code == "UNAVAILABLE" and not all(s.alive_during(r.start, r.end) for s in svc):
                    r.verdict = "void"
                else:
                    fail(f"garbage got {r.code}, wanted INVALID_ARGUMENT")
        elif case.kind == "cancel":
            if r.code not in ("CANCELLED", "OK"):
                fail(f"cancelled call ended {r.code}")
        elif case.kind == "deadline":
            if r.code not in ("DEADLINE_EXCEEDED", "OK"):
                fail(f"short-deadline call ended {r.code}")

    def draw(self, rng: random.Random) -> Case:
        x = rng.random()
        if self.poison_on and x < 0.08:
            return rng.choice(poison_cases(rng))
        if x < 0.14:
            c = healthy_case(rng, drafters=self.drafters, greedy=rng.random() < 0.5)
            req = c.req
            assert req is not None
            req.max_new_tokens = 400
            return Case("cancel", c.label, req, timeout=120, cancel_after=rng.randint(1, 4))
        if x < 0.20:
            c = healthy_case(rng, drafters=self.drafters, greedy=True)
            assert c.req is not None
            c.req.max_new_tokens = 200
            return Case("deadline", c.label, c.req, timeout=rng.uniform(0.05, 0.5))
        return healthy_case(rng, drafters=self.drafters, greedy=x < 0.65)

    async def worker(self, stub: Any, i: int) -> None:
        rng = random.Random(self.a.seed * 1000 + i)
        while self.now() < self.stop_at:
            await self.run_case(stub, self.draw(rng), i)

    # .......................................................... chaos
    async def kill_restart(self, stub: Any, svc: Service, down_s: float) -> None:
        ev: dict[str, Any] = {"name": f"{svc.name}#{sum(e['service'] == svc.name for e in self.events) + 1}",
                              "service": svc.name, "kill": round(self.now(), 3)}
        self.events.append(ev)
        svc.kill(self.t0)
        print(f"[{self.now():7.1f}s] chaos: SIGKILL {svc.name} (pid {svc.lives[-1].pid})", flush=True)
        # every poison case once more while the service is down (a fault must not turn poison into OK)
        burst = asyncio.create_task(self.poison_burst(stub))
        await asyncio.sleep(down_s)
        ev["restart"] = round(self.now(), 3)
        svc.start(self.t0)
        await asyncio.to_thread(svc.wait_ready, self.t0)
        ev["ready"] = round(self.now(), 3)
        await burst
        print(f"[{self.now():7.1f}s] chaos: {svc.name} restarted on port {svc.port} "
              f"(serving after {ev['ready'] - ev['restart']:.1f}s)", flush=True)

    async def chaos(self, stub: Any) -> None:
        d = self.a.duration
        for spec in self.a.kills.split(","):
            if not spec:
                continue
            who, frac = spec.split("@")
            at = self.load_start + float(frac) * d
            await asyncio.sleep(max(0.0, at - self.now()))
            if self.now() >= self.stop_at - 3:
                break
            svc = {"draft": self.draft, "target": self.targets[0]}[who]
            await self.kill_restart(stub, svc, self.a.down_seconds)

    async def poison_burst(self, stub: Any) -> list[Result]:
        return [await self.run_case(stub, c, -1) for c in poison_cases(random.Random(self.a.seed))]

    async def probe_poison(self, stub: Any) -> None:
        """Every poison case once, before any kill; upstream failures must not move."""
        before = await asyncio.to_thread(self.orch.metrics)
        rs = await self.poison_burst(stub)
        after = await asyncio.to_thread(self.orch.metrics)

        def failures(m: dict[Any, float]) -> dict[str, float]:
            return {dict(k[1]).get("replica", "?") + "/" + dict(k[1]).get("service", "?"): v
                    for k, v in m.items() if k[0] == "specdec_orchestrator_upstream_failures_total"}

        def unavailable(m: dict[Any, float]) -> dict[str, float]:
            return {dict(k[1])["service"]: v for k, v in m.items()
                    if k[0] == "specdec_orchestrator_upstream_replicas" and dict(k[1]).get("state") == "unavailable"}

        self.poison_probe = {"cases": len(rs), "codes": dict(Counter(r.code for r in rs)),
                             "upstream_failures_before": failures(before), "upstream_failures_after": failures(after),
                             "replicas_unavailable_after": unavailable(after)}
        self.poison_on = True

    async def progress(self) -> None:
        while True:
            await asyncio.sleep(self.a.progress_every)
            print(self.progress_line(await asyncio.to_thread(self.sessions)), flush=True)

    def progress_line(self, sess: dict[str, Any]) -> str:
        done = Counter(r.kind for r in self.results if r.verdict == "ok")
        bad = Counter(f"{r.kind}:{r.code}" for r in self.results if r.verdict == "fail")
        return (f"[{self.now():7.1f}s] as expected {sum(done.values())} "
                f"({', '.join(f'{k} {v}' for k, v in sorted(done.items()))})"
                f" | failures {dict(bad) or 0} | sessions {sess}")

    def sessions(self) -> dict[str, Any]:
        """Every session gauge now ("down" for a process that is not running)."""
        out: dict[str, Any] = {}
        for s in (self.draft, *self.targets, self.orch):
            try:
                m = s.metrics()
            except Exception:
                out[s.name] = "down"
                continue
            if s.kind == "orchestrator":
                out["orch_streams"] = m.get(("specdec_active_streams", ()), 0.0)
                for k, v in m.items():
                    if k[0] == "specdec_orchestrator_upstream_sessions":
                        lab = dict(k[1])
                        name = {t.address: t.name for t in [self.draft, *self.targets]}.get(lab.get("replica", ""), "?")
                        out[f"orch->{name}"] = out.get(f"orch->{name}", 0.0) + v
            else:
                out[s.name] = m.get((f"specdec_{s.kind}_active_sessions", ()), 0.0)
        return out

    async def settle(self, timeout_s: float) -> tuple[bool, dict[str, Any], float]:
        t = time.monotonic()
        sess: dict[str, Any] = {}
        while time.monotonic() - t < timeout_s:
            sess = await asyncio.to_thread(self.sessions)
            if all(v == 0 for v in sess.values()):
                return True, sess, time.monotonic() - t
            await asyncio.sleep(0.5)
        return False, sess, time.monotonic() - t

    async def replicas_state(self, timeout_s: float) -> tuple[bool, dict[str, float], float]:
        t = time.monotonic()
        state: dict[str, float] = {}
        while time.monotonic() - t < timeout_s:
            m = await asyncio.to_thread(self.orch.metrics)
            state = {f"{dict(k[1])['service']}/{dict(k[1])['state']}": v for k, v in m.items()
                     if k[0] == "specdec_orchestrator_upstream_replicas"}
            if state and all(v == 0 for k, v in state.items() if k.endswith("/unavailable")):
                return True, state, time.monotonic() - t
            await asyncio.sleep(0.5)
        return False, state, time.monotonic() - t

    # ........................................................... main
    async def load(self) -> dict[str, Any]:
        async with grpc.aio.insecure_channel(self.orch.address) as ch:
            stub = orchestrator_pb2_grpc.OrchestratorStub(ch)
            for p in PROMPTS:  # target-only references, before any fault
                for n in LENGTHS:
                    code, ids, det = await self.generate(stub, make_request(prompt=p, max_new_tokens=n, mode="off"), 120)
                    assert code == "OK" and len(ids) == n, f"reference {p!r}/{n}: {code} {det}"
                    self.refs[(p, n)] = ids
            self.load_start = self.now()
            self.stop_at = self.load_start + self.a.duration
            print(f"[{self.now():7.1f}s] references done; {self.a.streams} streams for {self.a.duration:.0f}s", flush=True)
            prog = asyncio.create_task(self.progress())
            workers = [asyncio.create_task(self.worker(stub, i)) for i in range(self.a.streams)]
            await asyncio.sleep(self.a.warmup)
            self.warm_at = self.now()
            await self.probe_poison(stub)
            print(f"[{self.now():7.1f}s] poison probe: {self.poison_probe['codes']}", flush=True)
            await self.chaos(stub)
            await asyncio.gather(*workers)
            prog.cancel()
            self.load_end = self.now()
        print(f"[{self.now():7.1f}s] load done; waiting for sessions to drain", flush=True)
        ok, sess, waited = await self.settle(self.a.settle_timeout)
        rec_ok, state, rec_waited = await self.replicas_state(self.a.settle_timeout)
        m = await asyncio.to_thread(self.orch.metrics)
        return {"sessions_zero": ok, "sessions_after": sess, "sessions_wait_s": round(waited, 1),
                "replicas_ok": rec_ok, "replicas_after": state, "replicas_wait_s": round(rec_waited, 1),
                "orch_metrics": m}

    def rss_report(self, sampler: RssSampler) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for (name, life), series in sorted(sampler.series.items()):
            svc = next(s for s in self.services if s.name == name)
            lf = svc.lives[life]
            assert lf.ready is not None
            warm_end = max(lf.ready, self.load_start) + self.a.warmup
            warm = [mb for t, mb in series if t <= warm_end and t >= self.load_start]
            after = [mb for t, mb in series if t > warm_end]
            end = lf.ended if lf.ended is not None else series[-1][0]
            entry: dict[str, Any] = {"pid": lf.pid, "samples": len(series), "lived_s": round(end - lf.ready, 1)}
            # judged: a full warm-up window under load, then at least 10 s more under load
            if warm and sum(warm_end < t <= self.load_end for t, _ in series) >= 10:
                base, peak = max(warm), max(after)
                entry.update(baseline_mb=base, peak_after_mb=peak, final_mb=after[-1],
                             growth=round(peak / base - 1, 4), judged=True)
            else:
                entry.update(judged=False, why="no full warm-up window under load in this life")
            out[f"{name}#{life}"] = entry
        return out

    def run(self) -> int:
        self.out.mkdir(parents=True, exist_ok=True)
        target, draft = self.build_models()
        self.make_services(target, draft)
        sampler = RssSampler(self.services, self.t0)
        try:
            self.start_services()
            print(f"[{self.now():7.1f}s] services up: draft {self.draft.address}, targets "
                  f"{', '.join(t.address for t in self.targets)}, orchestrator {self.orch.address}", flush=True)
            sampler.start()
            end = asyncio.run(self.load())
        finally:
            sampler.stop()
            for s in reversed(self.services):
                s.stop(self.t0)
        report = self.report(end, self.rss_report(sampler))
        (self.out / "chaos_soak.json").write_text(json.dumps(report, indent=1))
        (self.out / "chaos_soak.md").write_text(markdown(report))
        print(markdown(report, brief=True), flush=True)
        print(f"wrote {self.out / 'chaos_soak.json'} and {self.out / 'chaos_soak.md'}", flush=True)
        return 0 if all(v["pass"] for v in report["verdicts"].values()) else 1

    def report(self, end: dict[str, Any], rss: dict[str, Any]) -> dict[str, Any]:
        rs = self.results
        fails = [r for r in rs if r.verdict == "fail"]

        def failed(*kinds: str) -> list[Result]:
            return [r for r in fails if r.kind in kinds]

        def examples(lst: list[Result], n: int = 8) -> list[dict[str, Any]]:
            return [r.__dict__ for r in lst[:n]]

        om = end.pop("orch_metrics")
        inv_metric = sum(v for k, v in om.items() if k[0] == "specdec_requests_total"
                         and dict(k[1]).get("code") == "INVALID_ARGUMENT")
        via_orch = [r for r in rs if r.kind != "garbage" or r.label.startswith("garbage->orchestrator")]
        inv_seen = sum(r.code == "INVALID_ARGUMENT" for r in via_orch)
        inv_poison = sum(r.code == "INVALID_ARGUMENT" for r in via_orch if r.kind in ("poison", "edge", "garbage"))
        greedy = [r for r in rs if r.kind == "greedy" and r.code == "OK"]
        greedy_bad = [r for r in greedy if r.verdict == "fail" and "differs" in r.reason]
        survived_draft = [r for r in greedy if any(o.startswith("draft") for o in r.overlaps)]
        survived_target = [r for r in greedy if any(o.startswith("target") for o in r.overlaps)]
        pp = self.poison_probe
        probe_ok = (pp.get("upstream_failures_before") == pp.get("upstream_failures_after")
                    and not any(pp.get("replicas_unavailable_after", {}).values()))
        rss_bad = {k: v for k, v in rss.items() if v.get("judged") and v["growth"] >= self.a.rss_limit}
        verdicts = {
            "poison_invalid_argument": {"pass": not failed("poison", "edge", "garbage"),
                                        "detail": f"{sum(r.kind in ('poison', 'edge', 'garbage') for r in rs)} sent, "
                                                  f"{len(failed('poison', 'edge', 'garbage'))} wrong",
                                        "examples": examples(failed("poison", "edge", "garbage"))},
            "healthy_streams_complete": {"pass": not [r for r in failed("greedy", "sampled") if "differs" not in r.reason],
                                         "detail": f"{sum(r.kind in ('greedy', 'sampled') for r in rs)} healthy, "
                                                   f"{len(failed('greedy', 'sampled')) - len(greedy_bad)} failed",
                                         "examples": examples([r for r in failed("greedy", "sampled")
                                                               if "differs" not in r.reason])},
            "cancels_and_deadlines": {"pass": not failed("cancel", "deadline"),
                                      "detail": f"{sum(r.kind in ('cancel', 'deadline') for r in rs)} sent, "
                                                f"{len(failed('cancel', 'deadline'))} wrong",
                                      "examples": examples(failed("cancel", "deadline"))},
            "greedy_identical_to_target_only": {
                "pass": not greedy_bad and bool(greedy),
                "detail": f"{len(greedy)} greedy streams completed ({len(survived_draft)} overlapped a draft kill, "
                          f"{len(survived_target)} a target kill); {len(greedy_bad)} differ",
                "examples": examples(greedy_bad)},
            "sessions_return_to_zero": {"pass": end["sessions_zero"],
                                        "detail": f"{end['sessions_after']} after {end['sessions_wait_s']}s"},
            "rss_growth": {"pass": not rss_bad and any(v.get("judged") for v in rss.values()),
                           "detail": ", ".join(f"{k} {v['growth'] * 100:+.1f}%" for k, v in rss.items() if v.get("judged"))
                                     + f" (limit {self.a.rss_limit * 100:.0f}%)"},
            "metrics_invalid_argument": {"pass": inv_metric == inv_seen == inv_poison > 0,
                                         "detail": f"specdec_requests_total{{code=INVALID_ARGUMENT}} = {inv_metric:.0f}; "
                                                   f"the client saw {inv_seen} from the orchestrator, "
                                                   f"{inv_poison} of them poison"},
            "poison_marks_no_replica_failed": {"pass": probe_ok, "detail": json.dumps(pp)},
            "replicas_recovered": {"pass": end["replicas_ok"],
                                   "detail": f"{end['replicas_after']} after {end['replicas_wait_s']}s"},
        }
        return {
            "args": vars(self.a), "machine": machine(), "load_seconds": round(self.load_end - self.load_start, 1),
            "warm_at_s": round(self.warm_at, 1), "events": self.events,
            "counts": {"by_kind": dict(Counter(r.kind for r in rs)),
                       "by_kind_code": dict(Counter(f"{r.kind}:{r.code}" for r in rs)),
                       "failures_by_kind_code": dict(Counter(f"{r.kind}:{r.code}" for r in fails)),
                       "void": sum(r.verdict == "void" for r in rs)},
            "failure_reasons": dict(Counter(f"{r.kind}:{r.code}: {r.reason[:160]}" for r in fails).most_common(20)),
            "orchestrator_requests_total": {f"{dict(k[1]).get('code')}/{dict(k[1]).get('finish_reason')}": v
                                            for k, v in om.items() if k[0] == "specdec_requests_total"},
            "orchestrator_upstream_failures": {f"{dict(k[1]).get('service')}/{dict(k[1]).get('replica')}": v
                                               for k, v in om.items()
                                               if k[0] == "specdec_orchestrator_upstream_failures_total"},
            "orchestrator_rebuilds": om.get(("specdec_target_session_rebuilds_total", ()), 0.0),
            "orchestrator_draft_failures": om.get(("specdec_draft_failures_total", ()), 0.0),
            "poison_probe": pp, "sessions_after": end["sessions_after"], "rss": rss,
            "verdicts": verdicts,
            "lives": {s.name: [lf.__dict__ for lf in s.lives] for s in self.services},
        }


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"platform": platform.platform(), "python": platform.python_version(),
                            "cpus": os.cpu_count()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and "cpu" not in info:
                info["cpu"] = line.split(":", 1)[1].strip()
            if line.startswith("flags") and "flags" not in info:
                fl = set(line.split(":", 1)[1].split())
                info["flags"] = sorted(fl & {"avx", "avx2", "avx512f", "avx512_bf16", "amx_bf16", "fma", "f16c"})
    except OSError:
        pass
    return info


def markdown(rep: dict[str, Any], brief: bool = False) -> str:
    a = rep["args"]
    lines = [f"# Chaos soak: {a['streams']} streams, {rep['load_seconds']:.0f} s", ""]
    lines += ["| verdict | result | detail |", "|---|---|---|"]
    for k, v in rep["verdicts"].items():
        detail = v["detail"] if len(v["detail"]) < 400 else v["detail"][:400] + "…"
        lines.append(f"| {k} | {'PASS' if v['pass'] else '**FAIL**'} | {detail} |")
    lines.append("")
    if brief:
        return "\n".join(lines)
    lines += [f"Machine: {rep['machine'].get('cpu', '?')}, {rep['machine'].get('cpus')} CPUs, "
              f"flags {' '.join(rep['machine'].get('flags', []))}.", ""]
    lines += ["## Requests", "", "| kind:code | count |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in sorted(rep["counts"]["by_kind_code"].items())]
    lines += ["", "## Chaos events (seconds from start)", "", "| event | killed | restarted | serving |", "|---|---|---|---|"]
    lines += [f"| {e['name']} | {e['kill']} | {e.get('restart', '')} | {e.get('ready', '')} |" for e in rep["events"]]
    if rep["failure_reasons"]:
        lines += ["", "## Failures (most common)", "", "| count | kind:code: reason |", "|---|---|"]
        lines += [f"| {v} | {k.replace('|', '/')} |" for k, v in rep["failure_reasons"].items()]
    lines += ["", "## RSS (MiB)", "", "| process#life | warm-up max | peak after | growth |", "|---|---|---|---|"]
    for k, v in rep["rss"].items():
        if v.get("judged"):
            lines.append(f"| {k} | {v['baseline_mb']} | {v['peak_after_mb']} | {v['growth'] * 100:+.1f}% |")
        else:
            lines.append(f"| {k} | – | – | not judged ({v['lived_s']} s alive) |")
    lines += ["", "## Orchestrator metrics at the end", "",
              f"- `specdec_requests_total` by code/finish_reason: {rep['orchestrator_requests_total']}",
              f"- `specdec_orchestrator_upstream_failures_total`: {rep['orchestrator_upstream_failures']}",
              f"- session rebuilds {rep['orchestrator_rebuilds']:.0f}, draft failures "
              f"{rep['orchestrator_draft_failures']:.0f}", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--streams", type=int, default=32, help="concurrent client streams")
    p.add_argument("--duration", type=float, default=300.0, help="seconds of load")
    p.add_argument("--warmup", type=float, default=30.0,
                   help="seconds of healthy load before poison and kills; also the RSS baseline window")
    p.add_argument("--kills", default="draft@0.3,target@0.55,draft@0.8",
                   help="chaos schedule: service@fraction-of-duration (draft, target = target-a)")
    p.add_argument("--down-seconds", type=float, default=2.0, help="how long a killed service stays down")
    p.add_argument("--settle-timeout", type=float, default=60.0,
                   help="seconds to wait after the load for sessions to drain and replicas to recover")
    p.add_argument("--rss-limit", type=float, default=0.05, help="largest RSS growth after warm-up (fraction)")
    p.add_argument("--progress-every", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="output directory (JSON, markdown, logs, models)")
    p.add_argument("--cache-dir", default="", help="model/ONNX cache (default OUT/cache)")
    p.add_argument("--target-model", default="", help="tiny target dir (default: built under OUT/models)")
    p.add_argument("--draft-model", default="", help="tiny draft dir (default: built under OUT/models)")
    a = p.parse_args(argv)
    return Soak(a).run()


if __name__ == "__main__":
    sys.exit(main())
