"""``specdec loadbench``: throughput and latency under concurrent load.

A bounded, closed-loop load generator: for each number of concurrent streams
(default 1, 2, 4, 8, 16, 32), each stream sends ``--requests-per-stream``
Generate calls back to back (greedy, ``ignore_eos``, ``--max-new-tokens``
each; no new request starts after ``--max-duration-s``), for each speculation
mode (default AUTO and OFF), ``--repeats`` times in ABBA order (AUTO, OFF,
OFF, AUTO, ...) so slow drift on a shared machine does not favour a mode. With ``--launch`` it starts the stack (``specdec
up``) once per target batching configuration (``--batch-configs``, pairs of
max_batch_size:batch_window_ms; 1:0 = unbatched), so batching on and off and
several windows are measured against each other; otherwise it measures the
running services once.

Reports per point: throughput (generated tokens/s over the point's wall
time), time to first token and per-token latency (per request: (last token
time − first token time) / (tokens − 1)) at p50 and p99, errors by status
code, the target's mean forward batch size (from its /metrics, when
reachable), and each service's RSS over time (VmRSS from /proc/<pid>/status).
Writes ``results.json``, ``results.md`` and PNG plots into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdec_app.bench import (
    REPO_PROMPTS,
    alternating,
    launched_stack,
    machine_meta,
    speculation_config,
    target_numerics,
)
from specdec_app.bench_report import pyplot


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default="127.0.0.1:50051", help="orchestrator address (without --launch)")
    p.add_argument("--launch", action="store_true",
                   help="start `specdec up` for each --batch-configs entry and stop it after")
    p.add_argument("--batch-configs", default="1:0,16:2",
                   help="with --launch: comma-separated max_batch_size:batch_window_ms[:batch_regroup_ms] "
                        "(1:0 = unbatched; regroup omitted = the target's default)")
    p.add_argument("--streams", default="1,2,4,8,16,32", help="comma-separated concurrent stream counts")
    p.add_argument("--modes", default="auto,off", help="comma-separated speculation modes: auto, off, fixed, heuristic")
    p.add_argument("--gamma", type=int, default=0, help="num_draft_tokens sent with the request (0 = server default)")
    p.add_argument("--requests-per-stream", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2,
                   help="runs of each mode per stream count, in ABBA order; rows pool them, "
                        "'vs off' shows the pooled ratio and the range of the back-to-back pairs")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--warmup-tokens", type=int, default=16,
                   help="before each stream count, that many streams run once with this many tokens, untimed (0 = off)")
    p.add_argument("--max-duration-s", type=float, default=600.0, help="per point: no new request starts after this")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="deadline of one request")
    p.add_argument("--prompts", type=Path, default=REPO_PROMPTS)
    p.add_argument("--pids", default="", help="without --launch: service=pid pairs to sample RSS from, e.g. target=123,draft=456")
    p.add_argument("--target-metrics", default="", help="target /metrics URL (batch sizes); --launch sets it")
    p.add_argument("--rss-interval-s", type=float, default=0.5)
    p.add_argument("--label", default="running", help="without --launch: name of the measured configuration")
    p.add_argument("--out", type=Path, default=Path("loadbench-out"))
    p.add_argument("--target-dtype", default="auto", choices=["auto", "bfloat16", "float32"], help="with --launch")
    p.add_argument("--target-backend", default="auto", choices=["auto", "eager", "packed", "bf16w"], help="with --launch")
    p.add_argument("--target-model", default=None, help="with --launch")
    p.add_argument("--draft-model", default=None, help="with --launch")
    p.add_argument("--cache-dir", type=Path, default=None, help="with --launch")
    p.add_argument("--up-args", default="", help="extra flags for `specdec up` with --launch (one string)")


# ------------------------------------------------------------------- RSS
def rss_mb(pid: int) -> float | None:
    """Resident set size of ``pid`` in MiB (VmRSS), None when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    except (OSError, ValueError, IndexError):
        return None
    return None


class RssSampler:
    """Samples each service's RSS every ``interval`` seconds on a thread."""

    def __init__(self, pids: dict[str, int], interval: float = 0.5) -> None:
        self.pids = pids
        self.interval = interval
        self.t0 = time.monotonic()
        self.series: dict[str, list[tuple[float, float]]] = {k: [] for k in pids}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "RssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def sample(self) -> None:
        t = round(time.monotonic() - self.t0, 3)
        for name, pid in self.pids.items():
            mb = rss_mb(pid)
            if mb is not None:
                self.series[name].append((t, round(mb, 1)))

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def peak_since(self, t: float) -> dict[str, float]:
        return {k: max((mb for ts, mb in v if ts >= t), default=0.0) for k, v in self.series.items()}


def child_service_pids(up_pid: int) -> dict[str, int]:
    """The target/draft/orchestrator processes started by ``specdec up``."""
    out: dict[str, int] = {}
    try:
        kids = Path(f"/proc/{up_pid}/task/{up_pid}/children").read_text().split()
    except OSError:
        return out
    for k in kids:
        try:
            argv = Path(f"/proc/{k}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        words = [w.decode(errors="replace") for w in argv]
        if "serve" in words:
            i = words.index("serve")
            if i + 1 < len(words):
                out[words[i + 1]] = int(k)
    return out


# ------------------------------------------------------------------ load
@dataclass
class RequestResult:
    ok: bool
    code: str  # "OK" or the gRPC status name
    tokens: int = 0
    ttft_ms: float = 0.0
    tpot_ms: float | None = None  # per-token latency after the first token
    wall_ms: float = 0.0


def _one_request(stub: Any, prompt: dict[str, Any], mode: str, gamma: int, max_new: int, timeout: float) -> RequestResult:
    import grpc

    from specdec.v1 import orchestrator_pb2 as pb

    req = pb.GenerateRequest(max_new_tokens=max_new, ignore_eos=True, speculation=speculation_config(mode, gamma))
    if prompt.get("chat"):
        req.messages.append(pb.ChatMessage(role="user", content=prompt["prompt"]))
    else:
        req.prompt = prompt["prompt"]
    t0 = time.perf_counter()
    first = last = None
    tokens = 0
    try:
        for chunk in stub.Generate(req, timeout=timeout):
            if chunk.token_ids:
                now = time.perf_counter()
                first = first if first is not None else now
                last = now
                tokens += len(chunk.token_ids)
    except grpc.RpcError as e:
        return RequestResult(False, e.code().name, tokens, wall_ms=(time.perf_counter() - t0) * 1e3)
    end = time.perf_counter()
    if first is None:
        return RequestResult(True, "OK", 0, wall_ms=(end - t0) * 1e3)
    # tokens of the first chunk arrive together: spread the rest over the remaining tokens
    tpot = (last - first) * 1e3 / (tokens - 1) if tokens > 1 and last is not None else None
    return RequestResult(True, "OK", tokens, (first - t0) * 1e3, tpot, (end - t0) * 1e3)


def percentile(xs: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]); None for no data."""
    if not xs:
        return None
    s = sorted(xs)
    k = max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))
    return s[k]


def run_point(address: str, prompts: list[dict[str, Any]], streams: int, mode: str,
              a: argparse.Namespace) -> tuple[list[RequestResult], float]:
    """``streams`` closed-loop clients, ``a.requests_per_stream`` requests
    each: every request's result and the wall time of the whole point."""
    import grpc

    from specdec.v1 import orchestrator_pb2_grpc

    results: list[RequestResult] = []
    lock = threading.Lock()
    stop_at = time.monotonic() + a.max_duration_s
    with grpc.insecure_channel(address) as ch:
        stub = orchestrator_pb2_grpc.OrchestratorStub(ch)

        def client(i: int) -> None:
            for k in range(a.requests_per_stream):
                if time.monotonic() > stop_at:
                    return
                r = _one_request(stub, prompts[(i + k * streams) % len(prompts)], mode, a.gamma,
                                 a.max_new_tokens, a.timeout_s)
                with lock:
                    results.append(r)

        t0 = time.perf_counter()
        threads = [threading.Thread(target=client, args=(i,)) for i in range(streams)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
    return results, wall


def summarise(streams: int, mode: str, runs: list[tuple[list[RequestResult], float]]) -> dict[str, Any]:
    """One row from the repeats of a point: throughput is all tokens over all
    wall time, latency percentiles over the pooled requests, and each
    repeat's own throughput (its spread is the run-to-run noise)."""
    results = [r for rs, _ in runs for r in rs]
    wall = sum(w for _, w in runs)
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_ms for r in ok if r.tokens]
    tpot = [r.tpot_ms for r in ok if r.tpot_ms is not None]
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.code] = errors.get(r.code, 0) + 1
    tokens = sum(r.tokens for r in ok)
    return {
        "streams": streams, "mode": mode, "requests": len(results), "ok": len(ok), "errors": errors,
        "tokens": tokens, "wall_s": wall, "throughput_tok_s": tokens / wall if wall > 0 else 0.0,
        "throughput_reps": [sum(r.tokens for r in rs if r.ok) / w if w > 0 else 0.0 for rs, w in runs],
        "ttft_ms_p50": percentile(ttft, 50), "ttft_ms_p99": percentile(ttft, 99),
        "tpot_ms_p50": percentile(tpot, 50), "tpot_ms_p99": percentile(tpot, 99),
    }


def _scrape_batch(url: str) -> tuple[float, float] | None:
    """(sum, count) of the target's batch-size histogram, None when unreachable."""
    if not url:
        return None
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = urllib.request.urlopen(url, timeout=5).read().decode()
    except OSError:
        return None
    total = count = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "specdec_target_batch_size_sum":
                total = s.value
            elif s.name == "specdec_target_batch_size_count":
                count = s.value
    return total, count


def run_config(address: str, label: str, pids: dict[str, int], metrics_url: str, prompts: list[dict[str, Any]],
               a: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, list[tuple[float, float]]]]:
    streams = [int(s) for s in str(a.streams).split(",") if s.strip()]
    modes = [m.strip() for m in str(a.modes).split(",") if m.strip()]
    rows: list[dict[str, Any]] = []
    with RssSampler(pids, a.rss_interval_s) as rss:
        # warm-up: one short request per mode (not measured)
        for m in modes:
            _one_request_stub(address, prompts[0], m, a)
        for n in streams:
            if a.warmup_tokens > 0:
                # untimed: the same concurrency once, so new batch shapes and
                # allocations are paid before either mode is measured (else
                # whichever mode runs first at a stream count pays them)
                warm = argparse.Namespace(**{**vars(a), "requests_per_stream": 1, "max_new_tokens": a.warmup_tokens})
                run_point(address, prompts, n, "off", warm)
            runs: dict[str, list[tuple[list[RequestResult], float]]] = {m: [] for m in modes}
            batch = {m: [0.0, 0.0] for m in modes}  # batch-size histogram sum, count
            t_start = time.monotonic() - rss.t0
            for m in alternating(modes, a.repeats):  # ABBA order
                before = _scrape_batch(metrics_url)
                runs[m].append(run_point(address, prompts, n, m, a))
                after = _scrape_batch(metrics_url)
                rss.sample()
                if before and after:
                    batch[m][0] += after[0] - before[0]
                    batch[m][1] += after[1] - before[1]
            for m in modes:
                row = summarise(n, m, runs[m])
                row["config"] = label
                row["mean_batch_size"] = batch[m][0] / batch[m][1] if batch[m][1] > 0 else None
                row["rss_peak_mb"] = rss.peak_since(t_start)
                rows.append(row)
                print(_md_row(row), flush=True)
    return rows, rss.series


def _one_request_stub(address: str, prompt: dict[str, Any], mode: str, a: argparse.Namespace) -> None:
    import grpc

    from specdec.v1 import orchestrator_pb2_grpc

    with grpc.insecure_channel(address) as ch:
        _one_request(orchestrator_pb2_grpc.OrchestratorStub(ch), prompt, mode, a.gamma, 4, a.timeout_s)


# -------------------------------------------------------------- launching
def _parse_batch_configs(spec: str) -> list[tuple[int, float, float | None]]:
    """``size:window_ms[:regroup_ms]`` items (regroup omitted = the server default)."""
    out: list[tuple[int, float, float | None]] = []
    for item in spec.split(","):
        if not item.strip():
            continue
        size, _, rest = item.partition(":")
        window, _, regroup = rest.partition(":")
        out.append((int(size), float(window or 0), float(regroup) if regroup else None))
    if not out:
        raise SystemExit("specdec loadbench: --batch-configs is empty")
    return out


def config_label(max_batch: int, window_ms: float, regroup_ms: float | None = None) -> str:
    if max_batch == 1:
        return "unbatched"
    label = f"batch≤{max_batch}, window {window_ms:g} ms"
    return label if regroup_ms is None else f"{label}, regroup {regroup_ms:g} ms"


# --------------------------------------------------------------- reporting
HEADER = ("| config | mode | streams | requests (errors) | tokens/s | vs off | TTFT p50 / p99 ms | per-token p50 / p99 ms "
          "| mean batch | RSS peak MiB |\n|---|---|---|---|---|---|---|---|---|---|")


def _f(x: float | None, fmt: str = ".0f") -> str:
    return "–" if x is None else format(x, fmt)


def _md_row(r: dict[str, Any]) -> str:
    errs = sum(r["errors"].values())
    rss = ", ".join(f"{k} {v:.0f}" for k, v in sorted(r.get("rss_peak_mb", {}).items()))
    return (f"| {r['config']} | {r['mode']} | {r['streams']} | {r['requests']} ({errs}) | {r['throughput_tok_s']:.2f} | "
            f"{_vs_off(r)} | {_f(r['ttft_ms_p50'])} / {_f(r['ttft_ms_p99'])} | "
            f"{_f(r['tpot_ms_p50'])} / {_f(r['tpot_ms_p99'])} | {_f(r.get('mean_batch_size'), '.2f')} | {rss or '–'} |")


def _vs_off(r: dict[str, Any]) -> str:
    reps = r.get("vs_off_reps") or []
    if len(reps) < 2:
        return _f(r.get("vs_off"), ".2f")
    return f"{_f(r.get('vs_off'), '.2f')} ({min(reps):.2f}–{max(reps):.2f})"


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Speculative throughput over target-only at the same config and streams."""
    off = {(r["config"], r["streams"]): r for r in rows if r["mode"] == "off"}
    for r in rows:
        base = off.get((r["config"], r["streams"]))
        r["vs_off"] = r["throughput_tok_s"] / base["throughput_tok_s"] if base and base["throughput_tok_s"] else None
        # repeat i of this mode against repeat i of OFF (run back to back)
        pairs = zip(r.get("throughput_reps", []), base.get("throughput_reps", []) if base else [])
        r["vs_off_reps"] = [x / y for x, y in pairs if y > 0]


def to_markdown(res: dict[str, Any]) -> str:
    lines = [f"Run: {res['meta']}", "", HEADER] + [_md_row(r) for r in res["rows"]]
    return "\n".join(lines) + "\n"


def plots(res: dict[str, Any], out: Path) -> list[Path]:
    plt = pyplot()
    if plt is None:
        return []
    rows = res["rows"]
    series = sorted({(r["config"], r["mode"]) for r in rows})
    paths = []
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for i, (cfg, mode) in enumerate(series):
        pts = sorted((r["streams"], r) for r in rows if r["config"] == cfg and r["mode"] == mode)
        xs = [n for n, _ in pts]
        style = dict(marker="o", color=f"C{i % 10}", ls="-" if mode != "off" else "--", label=f"{cfg}, {mode}")
        axes[0].plot(xs, [r["throughput_tok_s"] for _, r in pts], **style)
        axes[1].plot(xs, [r["tpot_ms_p99"] or float("nan") for _, r in pts], **style)
        axes[2].plot(xs, [r["ttft_ms_p99"] or float("nan") for _, r in pts], **style)
    for ax, title in zip(axes, ("throughput (tokens/s)", "per-token latency p99 (ms)", "time to first token p99 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams")
        ax.set_title(title)
        ax.set_ylim(bottom=0)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    paths.append(out / "throughput_latency.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(8, 4))
    for i, (cfg, by_service) in enumerate(sorted(res["rss"].items())):
        for j, (svc, pts) in enumerate(sorted(by_service.items())):
            if pts:
                ax.plot([t for t, _ in pts], [mb for _, mb in pts], color=f"C{(3 * i + j) % 10}", label=f"{cfg}: {svc}")
    ax.set_xlabel("seconds since the configuration started")
    ax.set_ylabel("RSS (MiB)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(out / "rss.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def main(a: argparse.Namespace) -> int:

    a.out.mkdir(parents=True, exist_ok=True)
    prompts = [json.loads(line) for line in a.prompts.read_text().splitlines() if line.strip()]
    if not prompts:
        raise SystemExit("specdec loadbench: no prompts")
    rows: list[dict[str, Any]] = []
    rss: dict[str, dict[str, list[tuple[float, float]]]] = {}
    numerics: dict[str, Any] = {}
    if a.launch:
        for max_batch, window, regroup in _parse_batch_configs(a.batch_configs):
            label = config_label(max_batch, window, regroup)
            extra = ["--metrics-port", "9474", "--target-max-batch-size", str(max_batch),
                     "--target-batch-window-ms", str(window)]
            if regroup is not None:
                extra += ["--target-batch-regroup-ms", str(regroup)]
            with launched_stack(a, extra, base_port=50071) as (proc, addrs):  # target metrics on 9474 + 2
                numerics = target_numerics(addrs["target"])
                got, series = run_config(addrs["orchestrator"], label, child_service_pids(proc.pid),
                                         a.target_metrics or "http://127.0.0.1:9476/metrics", prompts, a)
            rows += got
            rss[label] = series
    else:
        pids = {k: int(v) for k, _, v in (p.partition("=") for p in a.pids.split(",") if p.strip())}
        got, series = run_config(a.address, a.label, pids, a.target_metrics, prompts, a)
        rows += got
        rss[a.label] = series
    add_ratios(rows)
    res = {
        "rows": rows, "rss": rss,
        "meta": {"date": time.strftime("%Y-%m-%d %H:%M"), **machine_meta(),
                 "target_dtype": numerics.get("dtype", ""), "target_backend": numerics.get("backend", ""),
                 "max_new_tokens": a.max_new_tokens, "requests_per_stream": a.requests_per_stream,
                 "repeats": a.repeats,
                 "command": " ".join(sys.argv)},
    }
    (a.out / "results.json").write_text(json.dumps(res, indent=2))
    md = to_markdown(res)
    (a.out / "results.md").write_text(md)
    for p in plots(res, a.out):
        print(f"wrote {p}")
    print(md)
    return 0

