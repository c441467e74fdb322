"""Disaggregated-topology benchmark: how the orchestrator's draft modes
(unary, stream, run-ahead) fare when draft and target are separate machines
with a network between them, against target-only decoding (OFF).

It launches the services itself, each as its own ``specdec serve`` process:

* ``pinned``: the draft on one CPU (``taskset -c 0``, one thread), the target
  on another (``taskset -c 1``, one thread); the orchestrator and the delay
  proxies unpinned. Each service on its own core behaves like a separate
  machine: a draft that runs while the target verifies (run-ahead) costs the
  target nothing, as it would across a network. Between the orchestrator and
  each service sits a delay proxy (``python -m specdec_app.delay_proxy``) adding
  each RTT of ``--rtts`` (default 0, 2, 10 ms): the link between machines.
  The proxies are there at RTT 0 too, so the RTT is the only thing that
  changes along the sweep. Target and draft are launched once; only the
  proxies and the orchestrator are restarted per RTT.
* ``colocated``: both services unpinned with their default threads, sharing
  every core (the draft spin-waiting within a run only, as ``specdec up`` runs it), the
  orchestrator connected directly (RTT 0): one machine.

For each topology × RTT, prompt and draft mode it runs greedy generation of
``--max-new-tokens`` tokens (ignore_eos) with OFF (SpeculationConfig mode
OFF) and with speculation (FIXED ``--gamma`` or AUTO, ``--policy``) under each
``draft_mode``, going round the modes (``--repeats`` times, alternating
direction; the fastest run of each is kept), and records tokens/s, wall ms,
rounds, acceptance, mean accepted length, draft/verify ms, the draft compute
run-ahead hid (draft_hidden_ms), post-verified rounds, the p50 per-round
overhead, total overhead and the token ids. Every speculative run's tokens
must equal OFF's (greedy identity); a mismatch is reported loudly, with
OFF's top-1/top-2 logit gap where it diverged (as `specdec bench`), and makes
the exit status 1. Speedups: each mode over OFF in the same topology and RTT,
and stream and run-ahead over unary.

Each delay proxy's real added round trip is measured (gRPC health Check
through the proxy minus direct, minimum of 20) and recorded beside the
nominal RTT (the proxy's timers add about 1 ms, see specdec_app/delay_proxy.py).

Writes results.json, results.md and PNG plots (with matplotlib) into --out;
service logs go to --out/logs.

    .venv/bin/python scripts/bench_topology.py                    # everything, real models (long)
    .venv/bin/python scripts/bench_topology.py --topologies pinned --rtts 0,10 --only py-complete
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from specdec_app.bench import (
    REPO_PROMPTS,
    _divergence,
    alternating,
    machine_meta,
    speculation_config,
    target_numerics,
)
from draft_service.cli import MODEL_DRAFTER
from specdec.models import DEFAULT_DRAFT, DEFAULT_TARGET
from specdec_app.up import wait_healthy
from topology_report import MODES, mismatches, plots, to_markdown  # scripts/topology_report.py

SPEC_MODES = MODES[1:]
TOPOLOGIES = ("pinned", "colocated")
# one code-completion, one code-edit and one prose prompt of benchmarks/prompts.jsonl
DEFAULT_PROMPTS = ("py-complete", "py-edit", "prose")
# GenerationStats fields kept per run (besides the client's own wall clock and token ids)
STATS = ("rounds", "acceptance_rate", "mean_accepted_length", "draft_ms", "verify_ms", "prefill_ms",
         "draft_hidden_ms", "post_verified", "round_overhead_p50_ms",
         "round_overhead_p99_ms", "overhead_ms", "round_trip_ms",
         "draft_tokens", "accepted_tokens", "draft_failures", "time_to_first_token_ms", "draft_mode", "policy",
         "drafter")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--topologies", default=",".join(TOPOLOGIES), help="comma-separated: pinned, colocated (%(default)s)")
    p.add_argument("--rtts", default="0,2,10", help="pinned: comma-separated added round-trip times in ms (%(default)s)")
    p.add_argument("--gamma", type=int, default=4, help="γ of FIXED speculation (%(default)s)")
    p.add_argument("--policy", default="fixed", choices=["fixed", "auto"],
                   help="speculation of the draft modes: FIXED γ, or AUTO (adaptive γ, server default cap) (%(default)s)")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs per mode, round-robin over the modes; the fastest is kept (%(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="%(default)s")
    p.add_argument("--prompts", type=Path, default=REPO_PROMPTS, help="JSONL prompt set, as `specdec bench` (%(default)s)")
    p.add_argument("--only", action="append",
                   help=f"prompt id to run, repeatable (default: {', '.join(DEFAULT_PROMPTS)})")
    p.add_argument("--out", type=Path, default=REPO / "docs" / "bench" / "topology", help="%(default)s")
    p.add_argument("--target-model", default=DEFAULT_TARGET,
                   help="target model spec, `specdec serve target --model` (%(default)s)")
    p.add_argument("--draft-model", default=DEFAULT_DRAFT,
                   help="draft model spec, `specdec serve draft --model` (%(default)s)")
    p.add_argument("--target-dtype", default="auto", choices=["auto", "bfloat16", "float32", "float16"], help="%(default)s")
    p.add_argument("--target-backend", default="auto", choices=["auto", "eager", "packed", "bf16w"], help="%(default)s")
    p.add_argument("--target-calibrate", default="on", choices=["on", "off"], help="%(default)s")
    p.add_argument("--draft-precision", default="int4", choices=["int4", "int8", "fp32", "fp16"], help="%(default)s")
    p.add_argument("--draft-cpu", type=int, default=0, help="pinned: the draft's CPU (%(default)s)")
    p.add_argument("--target-cpu", type=int, default=1, help="pinned: the target's CPU (%(default)s)")
    p.add_argument("--cache-dir", type=Path, default=None, help="model cache (default: the services' own default)")
    p.add_argument("--ready-timeout", type=float, default=1800.0,
                   help="seconds for a service to become SERVING (%(default)s)")
    p.add_argument("--timeout", type=float, default=1800.0, help="deadline of one Generate call in s (%(default)s)")
    p.add_argument("--orchestrator-args", default="",
                   help="extra flags for `specdec serve orchestrator`, one string (e.g. '--run-ahead-tokens 8')")
    p.add_argument("--log-level", default="warning", help="the services' log level; logs in OUT/logs (%(default)s)")
    return p.parse_args(argv)


# ------------------------------------------------------------- processes
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Children:
    """Every process the benchmark started, by name; ``stop`` ends them
    (SIGTERM to the process group, SIGKILL after ``grace_s``)."""

    logs: Path
    procs: dict[str, subprocess.Popen[Any]] = field(default_factory=dict)

    def start(self, name: str, cmd: list[str], capture_stdout: bool = False) -> subprocess.Popen[Any]:
        self.logs.mkdir(parents=True, exist_ok=True)
        log = open(self.logs / f"{name}.log", "a")  # noqa: SIM115 - the child holds it
        log.write(f"\n$ {' '.join(cmd)}\n")
        log.flush()
        proc = subprocess.Popen(cmd, cwd=REPO, start_new_session=True, stderr=log,
                                stdout=subprocess.PIPE if capture_stdout else log, text=True)
        log.close()
        self.procs[name] = proc
        return proc

    def stop(self, *names: str, grace_s: float = 20.0) -> None:
        procs = [(n, self.procs.pop(n)) for n in names if n in self.procs]
        for _, p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
        for _, p in procs:
            try:
                p.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            if p.stdout is not None:
                p.stdout.close()

    def stop_all(self) -> None:
        self.stop(*list(self.procs))

    def log_tail(self, name: str, lines: int = 30) -> str:
        path = self.logs / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


def _serve(a: argparse.Namespace, service: str, port: int) -> list[str]:
    cmd = [sys.executable, "-m", "specdec_app.cli", "serve", service, "--port", str(port),
           "--log-level", a.log_level, "--drain-timeout", "1"]
    if a.cache_dir is not None:
        cmd += ["--cache-dir", str(a.cache_dir)]
    return cmd


def target_cmd(a: argparse.Namespace, port: int, threads: int) -> list[str]:
    return _serve(a, "target", port) + ["--model", a.target_model, "--threads", str(threads),
                                        "--dtype", a.target_dtype, "--backend", a.target_backend,
                                        "--calibrate", a.target_calibrate]


def draft_cmd(a: argparse.Namespace, port: int, threads: int, spin: str) -> list[str]:
    # only the model drafter: the other built-ins would load models this bench never asks for
    return _serve(a, "draft", port) + ["--model", a.draft_model, "--threads", str(threads), "--spin", spin,
                                       "--precision", a.draft_precision, "--drafters", MODEL_DRAFTER,
                                       "--target-tokenizer", a.target_model]


def orchestrator_cmd(a: argparse.Namespace, port: int, target: str, draft: str) -> list[str]:
    return _serve(a, "orchestrator", port) + [
        "--target-address", target, "--draft-address", draft, "--model", a.target_model,
        "--num-draft-tokens", str(a.gamma)] + shlex.split(a.orchestrator_args)


def pinned(cpu: int, cmd: list[str]) -> list[str]:
    return ["taskset", "-c", str(cpu)] + cmd


def launch_service(children: Children, name: str, cmd: list[str], port: int, timeout_s: float) -> str:
    """Starts ``cmd`` and waits until it is SERVING (grpc health); its address."""
    address = f"127.0.0.1:{port}"
    print(f"[topology] starting {name}: {' '.join(cmd)}", flush=True)
    t0 = time.monotonic()
    proc = children.start(name, cmd)
    if not wait_healthy(address, timeout_s, [proc]):
        raise SystemExit(f"bench_topology: {name} did not become SERVING; its log ends:\n{children.log_tail(name)}")
    print(f"[topology] {name} SERVING on {address} after {time.monotonic() - t0:.0f} s", flush=True)
    return address


def launch_proxy(children: Children, name: str, upstream: str, rtt_ms: float) -> str:
    """A ``python -m specdec_app.delay_proxy`` process; its address (the JSON line it prints)."""
    cmd = [sys.executable, "-m", "specdec_app.delay_proxy", "--listen", "127.0.0.1:0", "--upstream", upstream,
           "--rtt-ms", str(rtt_ms)]
    proc = children.start(name, cmd, capture_stdout=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        raise SystemExit(f"bench_topology: {name} did not start; its log ends:\n{children.log_tail(name)}")
    return str(json.loads(line)["address"])


def probe_rtt_ms(address: str, n: int = 20) -> float:
    """Minimum wall ms of a gRPC health Check to ``address`` (after a first call)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        stub.Check(health_pb2.HealthCheckRequest(), timeout=30)
        best = math.inf
        for _ in range(n):
            t0 = time.perf_counter()
            stub.Check(health_pb2.HealthCheckRequest(), timeout=30)
            best = min(best, (time.perf_counter() - t0) * 1000)
    return best


# ---------------------------------------------------------------- generate
def load_prompts(a: argparse.Namespace) -> list[dict[str, Any]]:
    prompts = [json.loads(line) for line in a.prompts.read_text().splitlines() if line.strip()]
    only = a.only or [p for p in DEFAULT_PROMPTS if any(q["id"] == p for q in prompts)] or [prompts[0]["id"]]
    unknown = sorted(set(only) - {p["id"] for p in prompts})
    if unknown:
        raise SystemExit(f"bench_topology: no prompt {', '.join(unknown)} in {a.prompts}")
    return [p for p in prompts if p["id"] in only]


def request(a: argparse.Namespace, prompt: dict[str, Any], mode: str, max_new: int) -> Any:
    from specdec.v1 import orchestrator_pb2 as pb

    if mode == "off":
        spec = speculation_config("off")
    else:
        spec = speculation_config(a.policy, a.gamma if a.policy == "fixed" else 0)
        spec.draft_mode = mode
    req = pb.GenerateRequest(max_new_tokens=max_new, ignore_eos=True, return_logit_gaps=True, speculation=spec)
    if prompt.get("chat"):
        req.messages.append(pb.ChatMessage(role="user", content=prompt["prompt"]))
    else:
        req.prompt = prompt["prompt"]
    return req


def generate(stub: Any, a: argparse.Namespace, prompt: dict[str, Any], mode: str, max_new: int) -> dict[str, Any]:
    """One greedy generation; the client's wall clock and the server's stats."""
    ids: list[int] = []
    gaps: list[float] = []
    last = None
    t0 = time.perf_counter()
    for chunk in stub.Generate(request(a, prompt, mode, max_new), timeout=a.timeout):
        ids.extend(chunk.token_ids)
        gaps.extend(chunk.logit_gaps)
        last = chunk
    wall = time.perf_counter() - t0
    assert last is not None
    s = last.stats
    run: dict[str, Any] = {"mode": mode, "tokens": len(ids), "wall_ms": wall * 1000,
                           "tokens_per_second": len(ids) / wall if wall > 0 else 0.0}
    run.update({k: getattr(s, k) for k in STATS})
    run["token_ids"] = ids
    run["logit_gaps"] = gaps
    return run


def warm_up(stub: Any, a: argparse.Namespace, deadline_s: float = 120.0) -> None:
    """A short run in every mode; waits (retrying) until the orchestrator
    reaches both services and speculative runs actually draft."""
    import grpc

    hello = {"prompt": "def add(a, b):", "chat": False}
    a = argparse.Namespace(**{**vars(a), "policy": "fixed"})  # AUTO may choose not to draft so short a prompt
    end = time.monotonic() + deadline_s
    for mode in MODES:
        while True:
            try:
                run = generate(stub, a, hello, mode, 8)
                if mode == "off" or run["draft_tokens"] > 0:
                    break
                why = f"no tokens drafted (draft_failures={run['draft_failures']})"
            except grpc.RpcError as e:
                why = f"{e.code().name}: {e.details()}"
            if time.monotonic() > end:
                raise SystemExit(f"bench_topology: warm-up in mode {mode} failed: {why}")
            time.sleep(2.0)


def run_point(a: argparse.Namespace, topology: str, rtt_ms: float, orchestrator: str,
              prompts: list[dict[str, Any]], rtt_measured: dict[str, float]) -> list[dict[str, Any]]:
    """Every prompt × mode through one orchestrator; one row per (prompt, mode)."""
    import grpc

    from specdec.v1 import orchestrator_pb2_grpc

    rows: list[dict[str, Any]] = []
    with grpc.insecure_channel(orchestrator) as ch:
        stub = orchestrator_pb2_grpc.OrchestratorStub(ch)
        warm_up(stub, a)
        for prompt in prompts:
            best: dict[str, dict[str, Any]] = {}
            every: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
            for n, mode in enumerate(alternating(MODES, a.repeats), 1):
                run = generate(stub, a, prompt, mode, a.max_new_tokens)
                every[mode].append(run)
                if mode not in best or run["tokens_per_second"] > best[mode]["tokens_per_second"]:
                    best[mode] = run
                print(f"[topology] {topology} rtt={rtt_ms:g}ms {prompt['id']} {mode:<9} "
                      f"({n}/{len(MODES) * max(1, a.repeats)}): {run['tokens_per_second']:6.2f} tok/s, "
                      f"{run['rounds']} rounds, accept {run['acceptance_rate']:.2f}, "
                      f"hidden {run['draft_hidden_ms']:.0f} ms, overhead p50 {run['round_overhead_p50_ms']:.1f} ms",
                      flush=True)
            rows += point_rows(topology, rtt_ms, prompt, best, every, rtt_measured)
    return rows


def point_rows(topology: str, rtt_ms: float, prompt: dict[str, Any], best: dict[str, dict[str, Any]],
               every: dict[str, list[dict[str, Any]]], rtt_measured: dict[str, float]) -> list[dict[str, Any]]:
    """The kept run of each mode with its greedy identity and speedups."""
    off, unary = best["off"], best["unary"]
    rows = []
    for mode in MODES:
        run = best[mode]
        row = {"topology": topology, "rtt_ms": rtt_ms, "prompt": prompt["id"], "category": prompt.get("category", ""),
               "runs": len(every[mode]), **{k: v for k, v in run.items() if k != "logit_gaps"},
               "speedup_vs_off": run["tokens_per_second"] / off["tokens_per_second"] if off["tokens_per_second"] else 0.0,
               "speedup_vs_unary": (run["tokens_per_second"] / unary["tokens_per_second"]
                                    if mode in ("stream", "run-ahead") and unary["tokens_per_second"] else None),
               "measured_rtt_ms": rtt_measured}
        if mode != "off":
            # every run of the mode (not only the kept one) against the kept OFF run
            diverged = [d for r in every[mode] if (d := _divergence(off, r)) is not None]
            row["identical_to_off"] = not diverged
            row["divergence"] = diverged[0] if diverged else None
            row["mismatched_runs"] = len(diverged)
            row["requested_draft_mode"] = mode
            if run["draft_mode"] and run["draft_mode"] != mode:
                print(f"[topology] WARNING: asked for draft_mode {mode}, the server ran {run['draft_mode']}",
                      file=sys.stderr, flush=True)
            if run["draft_failures"]:
                print(f"[topology] WARNING: {prompt['id']} {mode}: {run['draft_failures']} rounds fell back "
                      "to target-only (draft failures)", file=sys.stderr, flush=True)
            if diverged:
                d = diverged[0]
                print(f"\n!!!!! [topology] GREEDY MISMATCH: {topology} rtt={rtt_ms:g}ms {prompt['id']} {mode}: "
                      f"{len(diverged)}/{len(every[mode])} runs differ from OFF, first at token {d['position']} "
                      f"(OFF {d['reference_token']}, {mode} {d['speculative_token']}, OFF top-1/top-2 logit gap "
                      f"{d['reference_top2_logit_gap']}) !!!!!\n", file=sys.stderr, flush=True)
        else:
            # OFF's own repeats must agree too (greedy is deterministic)
            row["identical_to_off"] = all(r["token_ids"] == off["token_ids"] for r in every["off"])
            row["mismatched_runs"] = sum(r["token_ids"] != off["token_ids"] for r in every["off"])
            if not row["identical_to_off"]:
                print(f"\n!!!!! [topology] OFF NOT DETERMINISTIC: {topology} rtt={rtt_ms:g}ms {prompt['id']} !!!!!\n",
                      file=sys.stderr, flush=True)
        rows.append(row)
    return rows


# --------------------------------------------------------------- topologies
def run_pinned(a: argparse.Namespace, children: Children, prompts: list[dict[str, Any]], rtts: list[float],
               res: dict[str, Any]) -> None:
    dport, tport = free_port(), free_port()
    draft = launch_service(children, "draft", pinned(a.draft_cpu, draft_cmd(a, dport, 1, "on")), dport, a.ready_timeout)
    target = launch_service(children, "target", pinned(a.target_cpu, target_cmd(a, tport, 1)), tport, a.ready_timeout)
    res["topologies"]["pinned"] = {"target_numerics": target_numerics(target),
                                   "cpus": {"draft": a.draft_cpu, "target": a.target_cpu}, "threads": 1}
    try:
        for rtt in rtts:
            print(f"[topology] pinned, RTT {rtt:g} ms: delay proxies and orchestrator", flush=True)
            tproxy = launch_proxy(children, "target-proxy", target, rtt)
            dproxy = launch_proxy(children, "draft-proxy", draft, rtt)
            measured = {"target_direct": probe_rtt_ms(target), "target_proxy": probe_rtt_ms(tproxy),
                        "draft_direct": probe_rtt_ms(draft), "draft_proxy": probe_rtt_ms(dproxy)}
            measured["target_added"] = measured["target_proxy"] - measured["target_direct"]
            measured["draft_added"] = measured["draft_proxy"] - measured["draft_direct"]
            print(f"[topology] measured added RTT: target {measured['target_added']:.2f} ms, "
                  f"draft {measured['draft_added']:.2f} ms (nominal {rtt:g})", flush=True)
            oport = free_port()
            try:
                orch = launch_service(children, "orchestrator", orchestrator_cmd(a, oport, tproxy, dproxy), oport,
                                      a.ready_timeout)
                res["rows"] += run_point(a, "pinned", rtt, orch, prompts, measured)
            finally:
                children.stop("orchestrator", "target-proxy", "draft-proxy")
            write_outputs(a, res)  # partial results survive a later failure
    finally:
        children.stop("draft", "target")


def run_colocated(a: argparse.Namespace, children: Children, prompts: list[dict[str, Any]], res: dict[str, Any]) -> None:
    dport, tport, oport = free_port(), free_port(), free_port()
    try:
        # one at a time, as `specdec up` does: each measures itself at start-up on the shared cores
        draft = launch_service(children, "draft", draft_cmd(a, dport, 0, "run"), dport, a.ready_timeout)
        target = launch_service(children, "target", target_cmd(a, tport, 0), tport, a.ready_timeout)
        res["topologies"]["colocated"] = {"target_numerics": target_numerics(target), "cpus": "all", "threads": 0}
        measured = {"target_direct": probe_rtt_ms(target), "draft_direct": probe_rtt_ms(draft)}
        orch = launch_service(children, "orchestrator", orchestrator_cmd(a, oport, target, draft), oport, a.ready_timeout)
        res["rows"] += run_point(a, "colocated", 0.0, orch, prompts, measured)
        write_outputs(a, res)
    finally:
        children.stop("orchestrator", "draft", "target")


def write_outputs(a: argparse.Namespace, res: dict[str, Any]) -> None:
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "results.json").write_text(json.dumps(res, indent=2))
    if res["rows"]:
        (a.out / "results.md").write_text(to_markdown(res))


def cpu_topology() -> dict[str, Any]:
    """lscpu's summary and each CPU's hyperthread siblings: "pinned" means
    separate machines only when the two CPUs are not siblings of one core."""
    out: dict[str, Any] = {}
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        text = subprocess.run(["lscpu"], check=False, capture_output=True, text=True, timeout=10).stdout
        keep = ("Model name", "CPU(s)", "Thread(s) per core", "Core(s) per socket", "Socket(s)", "L2 cache",
                "L3 cache", "Hypervisor vendor", "Flags")
        for line in text.splitlines():
            k, _, v = line.partition(":")
            if k.strip() in keep:
                out[k.strip()] = v.split() if k.strip() == "Flags" else v.strip()
    siblings = {}
    for cpu in range(os.cpu_count() or 0):
        path = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
        with contextlib.suppress(OSError):
            siblings[cpu] = path.read_text().strip()
    return {"lscpu": out, "thread_siblings": siblings}


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    topologies = [t.strip() for t in a.topologies.split(",") if t.strip()]
    if not topologies or set(topologies) - set(TOPOLOGIES):
        raise SystemExit(f"bench_topology: --topologies: choose from {', '.join(TOPOLOGIES)}")
    rtts = [float(x) for x in a.rtts.split(",") if x.strip()]
    if any(t < 0 for t in rtts) or ("pinned" in topologies and not rtts):
        raise SystemExit("bench_topology: --rtts: non-negative milliseconds, at least one")
    cpus = os.sched_getaffinity(0)
    if "pinned" in topologies and (a.draft_cpu == a.target_cpu or not {a.draft_cpu, a.target_cpu} <= cpus):
        raise SystemExit(f"bench_topology: pinned needs two different CPUs of {sorted(cpus)} "
                         f"(--draft-cpu {a.draft_cpu}, --target-cpu {a.target_cpu})")
    prompts = load_prompts(a)
    topo = cpu_topology()
    res: dict[str, Any] = {
        "meta": {"date": time.strftime("%Y-%m-%d %H:%M"), **machine_meta(), **topo,
                 "cpu_siblings": "; ".join(f"{k}: {v}" for k, v in topo["thread_siblings"].items()),
                 "max_new_tokens": a.max_new_tokens, "gamma": a.gamma, "policy": a.policy, "repeats": a.repeats,
                 "target_model": a.target_model, "draft_model": a.draft_model, "prompts": [p["id"] for p in prompts],
                 "rtts_ms": rtts, "command": " ".join([Path(sys.argv[0]).name] + list(argv or sys.argv[1:]))},
        "topologies": {}, "rows": [],
    }
    print(f"[topology] {', '.join(topologies)}; RTTs {rtts} ms; prompts {', '.join(p['id'] for p in prompts)}; "
          f"modes {', '.join(MODES)}; {a.repeats} repeat(s); out {a.out}", flush=True)

    def _interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _interrupt)  # a supervisor's SIGTERM stops the children too
    children = Children(a.out / "logs")
    try:
        for t in topologies:
            if t == "pinned":
                run_pinned(a, children, prompts, rtts, res)
            else:
                run_colocated(a, children, prompts, res)
    except KeyboardInterrupt:
        print("\n[topology] interrupted; stopping the services", file=sys.stderr, flush=True)
        return 130
    finally:
        children.stop_all()
        write_outputs(a, res)
    for p in plots(res, a.out):
        print(f"[topology] wrote {p}")
    print(f"[topology] wrote {a.out / 'results.json'} and {a.out / 'results.md'}")
    print(to_markdown(res))
    bad = mismatches(res["rows"])
    if bad:
        print(f"!!!!! [topology] {len(bad)} configuration(s) NOT identical to OFF: see 'Greedy identity' in "
              f"{a.out / 'results.md'} !!!!!", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
