"""What the HTTP gateway adds over calling the orchestrator's gRPC Generate
directly, side by side: the same requests alternate between the paths
against one stack (a tiny random-weight target, target-only decoding, so
model time is small and equal on every path). The gateway runs as its own
process (`specdec serve gateway`), as deployed; the stack runs in this
process (tests/stack.py).

Three paths, their order rotating through all six permutations from one
iteration to the next:

- grpc: the orchestrator's Generate over a sync gRPC stub;
- httpx: the gateway through ``httpx.Client`` (keep-alive), the measure of
  issue 27 and of every earlier run;
- lean: the gateway through the standard library's ``http.client``
  (keep-alive), a second view: httpx spends about 0.9 ms more CPU per request
  in the measuring process than the gRPC stub does, and this measuring
  process also runs the stack, so httpx's own cost is charged to the gateway
  in the first view.

Two kinds, each its own block of --requests iterations per round:

- per request: a 1-token non-streamed completion, wall time from the
  client's send to the full response (gRPC: the stream's end); added =
  HTTP wall - gRPC wall, paired by iteration;
- per streamed chunk: a --tokens-token streamed completion (one chunk per
  token); added = (HTTP wall - gRPC wall) / chunks, paired by iteration.

Each round reports the p50 of the paired differences. The pooled p50 over
all rounds comes with a 95% bootstrap interval (pairs resampled). Wall
times on a small shared VM drift from one run to the next; the gateway
process's own CPU time is steadier. It is read from /proc/<pid>/stat
(utime + stime, all threads, 10 ms ticks) before and after each block:
CPU per request = the block's CPU / HTTP requests in it; CPU per chunk =
the stream block's CPU / HTTP streams / chunks (the stream's fixed cost
included, so an upper bound on the per-chunk work). The measuring thread's
own CPU per call (``time.thread_time``) is recorded per path too.

    .venv/bin/python scripts/gateway_overhead.py --out bench-out/gateway --rounds 4 --requests 150

Writes gateway_overhead.json, gateway_overhead.md and gateway_overhead.png into --out.
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PATHS = ("grpc", "httpx", "lean")
VIEWS = {"httpx": "httpx (issue 27's measure)", "lean": "http.client (lean client)"}
BOUND_MS = {"request": 2.0, "chunk": 0.2}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def summary(xs: list[float]) -> dict[str, float]:
    return {"p50": statistics.median(xs), "p90": pct(xs, 0.9), "p99": pct(xs, 0.99), "mean": statistics.fmean(xs)}


def median_ci(xs: list[float], seed: int, n: int = 2000) -> tuple[float, float]:
    """95% bootstrap interval of the median of ``xs``."""
    import numpy as np

    a = np.asarray(xs)
    meds = np.median(a[np.random.default_rng(seed).integers(0, len(a), (n, len(a)))], axis=1)
    return float(np.percentile(meds, 2.5)), float(np.percentile(meds, 97.5))


def cpu_s(pid: int) -> float:
    """utime + stime of process ``pid`` (all its threads, the exited ones too), in seconds."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def added(rows: dict[str, list[float]], view: str, per: int) -> list[float]:
    return [(h - g) / per for h, g in zip(rows[view], rows["grpc"])]


def stat(xs: list[float], seed: int) -> dict[str, Any]:
    lo, hi = median_ci(xs, seed)
    return {**summary(xs), "p50_ci95": [lo, hi]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("bench-out/gateway"))
    p.add_argument("--rounds", type=int, default=4, help="rounds, each a request block and a stream block")
    p.add_argument("--requests", type=int, default=150, help="iterations per block (each: one call per path)")
    p.add_argument("--tokens", type=int, default=64, help="tokens (chunks) of each streamed request")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--seed", type=int, default=0, help="of the bootstrap")
    a = p.parse_args()

    import httpx

    from specdec.v1 import orchestrator_pb2 as pb
    from specdec_app.bench import machine_meta
    from tests.stack import free_port, make_request, start_stack
    from tests.tiny import build_tiny_model

    root = Path(tempfile.mkdtemp(prefix="gateway-overhead-"))
    target = build_tiny_model(root / "target", chars="abcdefghijklmnopqrstuvwxyz .,:!?\n", seed=1)
    stack = start_stack(target, None, root / "cache", target_overrides={"backend": "eager"})
    port = free_port()
    gw = subprocess.Popen([sys.executable, "-m", "specdec_app.cli", "serve", "gateway", "--port", str(port),
                           "--orchestrator-address", stack.address, "--served-model-name", "tiny",
                           "--log-level", "warning"])
    url = f"http://127.0.0.1:{port}"
    kinds = {"request": 1, "stream": a.tokens}
    rounds: list[dict[str, Any]] = []
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or gw.poll() is not None:
                raise SystemExit("the gateway did not become ready")
            time.sleep(0.2)
        stub = stack.orch_stub()
        hx = httpx.Client(base_url=url, timeout=60)
        lean = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        prompt = "the quick brown fox"

        def body(tokens: int) -> dict[str, Any]:
            return {"model": "tiny", "prompt": prompt, "max_tokens": tokens, "temperature": 0,
                    "stream": tokens > 1, "ignore_eos": True, "speculation": {"mode": "off"}}

        def check(status: int, text: str, tokens: int) -> None:
            """The response of either HTTP client: its usage, or its SSE events ending in [DONE]."""
            if tokens == 1:
                assert status == 200 and json.loads(text)["usage"]["completion_tokens"] == 1, text
            else:
                events = [line for line in text.splitlines() if line.startswith("data: ")]
                assert status == 200 and events[-1] == "data: [DONE]" and len(events) > tokens // 2, text

        def grpc_call(tokens: int) -> None:
            req = make_request(prompt=prompt, max_new_tokens=tokens, mode="off")
            chunks = list(stub.Generate(req, timeout=60))
            assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH

        def httpx_call(tokens: int) -> None:
            if tokens == 1:
                r = hx.post("/v1/completions", json=body(tokens))
                return check(r.status_code, r.text, tokens)
            with hx.stream("POST", "/v1/completions", json=body(tokens)) as r:
                text = "\n".join(r.iter_lines())
            check(r.status_code, text, tokens)

        def lean_call(tokens: int) -> None:
            lean.request("POST", "/v1/completions", body=json.dumps(body(tokens)),
                         headers={"Content-Type": "application/json"})
            r = lean.getresponse()
            check(r.status, r.read().decode(), tokens)

        calls: dict[str, Callable[[int], None]] = {"grpc": grpc_call, "httpx": httpx_call, "lean": lean_call}
        for _ in range(a.warmup):
            for fn in calls.values():
                fn(1)
                fn(a.tokens)
        orders = list(itertools.permutations(PATHS))
        for rnd in range(a.rounds):
            out: dict[str, Any] = {"round": rnd + 1, "started": time.strftime("%H:%M:%S"), "wall_ms": {},
                                   "client_cpu_ms": {}, "gateway_cpu_ms": {}}
            for kind, tokens in kinds.items():
                wall: dict[str, list[float]] = {k: [] for k in PATHS}
                own: dict[str, list[float]] = {k: [] for k in PATHS}
                cpu0 = cpu_s(gw.pid)
                for i in range(a.requests):
                    for path in orders[i % len(orders)]:
                        c0, t0 = time.thread_time(), time.perf_counter()
                        calls[path](tokens)
                        wall[path].append((time.perf_counter() - t0) * 1e3)
                        own[path].append((time.thread_time() - c0) * 1e3)
                http_calls = a.requests * (len(PATHS) - 1)
                out["gateway_cpu_ms"][kind] = (cpu_s(gw.pid) - cpu0) * 1e3 / http_calls
                out["wall_ms"][kind] = wall
                out["client_cpu_ms"][kind] = {k: statistics.median(v) for k, v in own.items()}
            out["gateway_cpu_ms"]["chunk"] = out["gateway_cpu_ms"]["stream"] / a.tokens
            out["added_ms"] = {view: {"request": stat(added(out["wall_ms"]["request"], view, 1), a.seed),
                                      "chunk": stat(added(out["wall_ms"]["stream"], view, a.tokens), a.seed)}
                               for view in VIEWS}
            rounds.append(out)
            r, c = out["added_ms"]["httpx"]["request"]["p50"], out["added_ms"]["httpx"]["chunk"]["p50"]
            print(f"round {rnd + 1}: +{r:.2f} ms/request, +{c:.3f} ms/chunk (httpx); gateway CPU "
                  f"{out['gateway_cpu_ms']['request']:.2f} ms/request, {out['gateway_cpu_ms']['chunk']:.3f} ms/chunk",
                  flush=True)
        hx.close()
        lean.close()
    finally:
        gw.terminate()
        gw.wait(timeout=30)
        stack.close()
    result = report(a, rounds, machine_meta())
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "gateway_overhead.json").write_text(json.dumps(result, indent=1))
    lines = table(a, result)
    (a.out / "gateway_overhead.md").write_text("\n".join(lines) + "\n")
    plot(a, result, a.out / "gateway_overhead.png")
    print("\n".join(lines))
    return 0


def report(a: argparse.Namespace, rounds: list[dict[str, Any]], machine: dict[str, Any]) -> dict[str, Any]:
    """The JSON: per round, pooled over rounds, and the bounds' verdicts."""
    pooled_wall = {kind: {k: [x for r in rounds for x in r["wall_ms"][kind][k]] for k in PATHS}
                   for kind in ("request", "stream")}
    pooled = {view: {"request": stat(added(pooled_wall["request"], view, 1), a.seed),
                     "chunk": stat(added(pooled_wall["stream"], view, a.tokens), a.seed)} for view in VIEWS}
    holds = {view: {kind: [r["added_ms"][view][kind]["p50"] <= BOUND_MS[kind] for r in rounds] for kind in BOUND_MS}
             for view in VIEWS}
    cpu = {kind: [r["gateway_cpu_ms"][kind] for r in rounds] for kind in ("request", "chunk")}
    return {
        "rounds": a.rounds, "requests": a.requests, "tokens_per_stream": a.tokens, "bounds_ms": BOUND_MS,
        "machine": {**machine, "python": sys.version.split()[0]},
        "ms": {f"{k}_{kind}": summary(pooled_wall[kind][k]) for kind in ("request", "stream") for k in PATHS},
        "gateway_added_ms_per_request": pooled["httpx"]["request"],
        "gateway_added_ms_per_chunk": pooled["httpx"]["chunk"],
        "lean_client_added_ms_per_request": pooled["lean"]["request"],
        "lean_client_added_ms_per_chunk": pooled["lean"]["chunk"],
        "gateway_cpu_ms": {kind: {"per_round": v, "median": statistics.median(v), "min": min(v), "max": max(v)}
                           for kind, v in cpu.items()},
        "bound_holds_in_every_round": {view: {kind: all(v) for kind, v in h.items()} for view, h in holds.items()},
        "per_round": [{k: v for k, v in r.items() if k != "wall_ms"} for r in rounds],
        "raw_ms": [r["wall_ms"] for r in rounds],
    }


def table(a: argparse.Namespace, res: dict[str, Any]) -> list[str]:
    def ci(s: dict[str, Any], digits: int) -> str:
        return f"{s['p50']:.{digits}f} ({s['p50_ci95'][0]:.{digits}f}–{s['p50_ci95'][1]:.{digits}f})"

    lines = ["# Gateway overhead over direct gRPC", "",
             f"{res['rounds']} rounds × {res['requests']} iterations per kind, each iteration one call per path "
             f"(gRPC, httpx, http.client) in rotating order; streams of {a.tokens} chunks. Added = HTTP − gRPC "
             "wall, paired by iteration: p50 (95% bootstrap interval). Gateway CPU: the gateway process's "
             "utime+stime per HTTP request, and per chunk of a stream (its fixed cost included).", "",
             "| round | started | per request, httpx | per request, http.client | per chunk, httpx "
             "| per chunk, http.client | gateway CPU ms/request | gateway CPU ms/chunk |",
             "|---|---|---|---|---|---|---|---|"]
    for r in res["per_round"]:
        ad = r["added_ms"]
        lines.append(f"| {r['round']} | {r['started']} | {ci(ad['httpx']['request'], 2)} "
                     f"| {ci(ad['lean']['request'], 2)} "
                     f"| {ci(ad['httpx']['chunk'], 3)} | {ci(ad['lean']['chunk'], 3)} "
                     f"| {r['gateway_cpu_ms']['request']:.2f} | {r['gateway_cpu_ms']['chunk']:.3f} |")
    cpu = res["gateway_cpu_ms"]
    lines.append(f"| pooled | | {ci(res['gateway_added_ms_per_request'], 2)} "
                 f"| {ci(res['lean_client_added_ms_per_request'], 2)} "
                 f"| {ci(res['gateway_added_ms_per_chunk'], 3)} | {ci(res['lean_client_added_ms_per_chunk'], 3)} "
                 f"| {cpu['request']['median']:.2f} (median) | {cpu['chunk']['median']:.3f} (median) |")
    lines += ["", "| path | kind | p50 ms | p90 ms | p99 ms | measuring thread's CPU ms per call (median of rounds) |",
              "|---|---|---|---|---|---|"]
    for key, v in res["ms"].items():
        path, kind = key.split("_")
        own = statistics.median(r["client_cpu_ms"][kind][path] for r in res["per_round"])
        lines.append(f"| {path} | {'1-token request' if kind == 'request' else f'{a.tokens}-chunk stream'} "
                     f"| {v['p50']:.2f} | {v['p90']:.2f} | {v['p99']:.2f} | {own:.2f} |")
    lines.append("")
    for view, name in VIEWS.items():
        h = res["bound_holds_in_every_round"][view]
        verdict = {kind: "holds" if ok else "does not hold" for kind, ok in h.items()}
        lines.append(f"- {name}: ≤ {BOUND_MS['request']} ms p50 per request {verdict['request']} in every round; "
                     f"≤ {BOUND_MS['chunk']} ms p50 per chunk {verdict['chunk']} in every round.")
    return lines


def plot(a: argparse.Namespace, res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rounds = [r["round"] for r in res["per_round"]]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    pooled = {"httpx": "gateway_added_ms_per", "lean": "lean_client_added_ms_per"}
    for ax, kind, unit in ((axes[0][0], "request", "ms per request"), (axes[0][1], "chunk", "ms per chunk")):
        for off, (view, name) in zip((-0.15, 0.15), VIEWS.items()):
            s = [r["added_ms"][view][kind] for r in res["per_round"]] + [res[f"{pooled[view]}_{kind}"]]
            ax.errorbar([x + off for x in rounds + [len(rounds) + 1]], [v["p50"] for v in s], fmt="o", capsize=3,
                        label=name,
                        yerr=[[v["p50"] - v["p50_ci95"][0] for v in s], [v["p50_ci95"][1] - v["p50"] for v in s]])
        ax.axhline(BOUND_MS[kind], color="red", linestyle="--", label="issue 27's bound")
        ax.set_title(f"added p50, {unit} (95% bootstrap)")
        ax.set_xticks(rounds + [len(rounds) + 1], [str(r) for r in rounds] + ["pooled"])
        ax.set_xlabel("round")
        ax.legend(fontsize=7)
    for ax, kind, unit in ((axes[1][0], "request", "per HTTP request"), (axes[1][1], "chunk", "per streamed chunk")):
        ax.bar(rounds, res["gateway_cpu_ms"][kind]["per_round"], color="gray")
        ax.set_title(f"gateway process CPU ms {unit}")
        ax.set_xticks(rounds)
        ax.set_xlabel("round")
    r, c = res["gateway_added_ms_per_request"], res["gateway_added_ms_per_chunk"]
    fig.suptitle(f"gateway adds {r['p50']:.2f} ms/request, {c['p50']:.3f} ms/chunk (p50 pooled, httpx)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
