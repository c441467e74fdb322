"""What the HTTP gateway adds over calling the orchestrator's gRPC Generate
directly, side by side: the same requests alternate between the two paths
against one stack (a tiny random-weight target, target-only decoding, so
model time is small and equal on both paths). The gateway runs as its own
process (`specdec serve gateway`), as deployed; the stack runs in this
process (tests/stack.py).

- per request: a 1-token non-streamed completion, wall time from the
  client's send to the full response (gRPC: the stream's end);
- per streamed chunk: a --tokens-token streamed completion (one chunk per
  token), (HTTP wall - gRPC wall) / chunks, paired by iteration.

    .venv/bin/python scripts/gateway_overhead.py --out bench-out/gateway --requests 300

Writes gateway_overhead.json, gateway_overhead.md and gateway_overhead.png into --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def summary(xs: list[float]) -> dict[str, float]:
    return {"p50": statistics.median(xs), "p90": pct(xs, 0.9), "p99": pct(xs, 0.99), "mean": statistics.fmean(xs)}


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("bench-out/gateway"))
    p.add_argument("--requests", type=int, default=300, help="requests per path and kind")
    p.add_argument("--tokens", type=int, default=64, help="tokens (chunks) of each streamed request")
    p.add_argument("--warmup", type=int, default=20)
    a = p.parse_args()

    import httpx

    from tests.stack import free_port, make_request, start_stack
    from tests.tiny import build_tiny_model
    from specdec.v1 import orchestrator_pb2 as pb

    root = Path(tempfile.mkdtemp(prefix="gateway-overhead-"))
    target = build_tiny_model(root / "target", chars="abcdefghijklmnopqrstuvwxyz .,:!?\n", seed=1)
    stack = start_stack(target, None, root / "cache", target_overrides={"backend": "eager"})
    port = free_port()
    gw = subprocess.Popen([sys.executable, "-m", "specdec_app.cli", "serve", "gateway", "--port", str(port),
                           "--orchestrator-address", stack.address, "--served-model-name", "tiny",
                           "--log-level", "warning"])
    url = f"http://127.0.0.1:{port}"
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
        http = httpx.Client(base_url=url, timeout=60)
        prompt = "the quick brown fox"

        def grpc_call(tokens: int) -> None:
            req = make_request(prompt=prompt, max_new_tokens=tokens, mode="off")
            chunks = list(stub.Generate(req, timeout=60))
            assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH

        def http_call(tokens: int, stream: bool) -> None:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": stream,
                    "ignore_eos": True, "speculation": {"mode": "off"}}
            if not stream:
                r = http.post("/v1/completions", json=body)
                assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == tokens
                return
            with http.stream("POST", "/v1/completions", json=body) as r:
                events = [line for line in r.iter_lines() if line.startswith("data: ")]
            assert r.status_code == 200 and events[-1] == "data: [DONE]"

        for _ in range(a.warmup):
            grpc_call(1), http_call(1, False), grpc_call(a.tokens), http_call(a.tokens, True)
        rows: dict[str, list[float]] = {"grpc_request": [], "http_request": [], "grpc_stream": [], "http_stream": []}
        for i in range(a.requests):  # alternate which path goes first
            pair = [("grpc_request", lambda: grpc_call(1)), ("http_request", lambda: http_call(1, False))]
            streams = [("grpc_stream", lambda: grpc_call(a.tokens)), ("http_stream", lambda: http_call(a.tokens, True))]
            for name, fn in (pair if i % 2 == 0 else pair[::-1]) + (streams if i % 2 == 0 else streams[::-1]):
                rows[name].append(timed(fn))
        http.close()
    finally:
        gw.terminate()
        gw.wait(timeout=30)
        stack.close()

    per_request = [h - g for h, g in zip(rows["http_request"], rows["grpc_request"])]
    per_chunk = [(h - g) / a.tokens for h, g in zip(rows["http_stream"], rows["grpc_stream"])]
    result = {
        "requests": a.requests, "tokens_per_stream": a.tokens,
        "machine": {"python": sys.version.split()[0], "cpus": __import__("os").cpu_count()},
        "ms": {k: summary(v) for k, v in rows.items()},
        "gateway_added_ms_per_request": summary(per_request),
        "gateway_added_ms_per_chunk": summary(per_chunk),
        "raw_ms": rows,
    }
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "gateway_overhead.json").write_text(json.dumps(result, indent=1))
    lines = ["# Gateway overhead over direct gRPC", "",
             f"{a.requests} requests per path and kind, alternating; streams of {a.tokens} chunks.", "",
             "| path | kind | p50 ms | p90 ms | p99 ms |", "|---|---|---|---|---|"]
    for k, v in result["ms"].items():
        path, kind = k.split("_")
        lines.append(f"| {path} | {'1-token request' if kind == 'request' else f'{a.tokens}-chunk stream'} "
                     f"| {v['p50']:.2f} | {v['p90']:.2f} | {v['p99']:.2f} |")
    r, c = result["gateway_added_ms_per_request"], result["gateway_added_ms_per_chunk"]
    lines += ["", f"Added by the gateway (paired): **{r['p50']:.2f} ms p50 per request**, "
                  f"**{c['p50']:.3f} ms p50 per streamed chunk** (p90 {r['p90']:.2f} / {c['p90']:.3f})."]
    (a.out / "gateway_overhead.md").write_text("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    axes[0].boxplot([rows["grpc_request"], rows["http_request"]], tick_labels=["gRPC", "HTTP gateway"], showfliers=False)
    axes[0].set_title("1-token request (ms)")
    axes[1].boxplot([rows["grpc_stream"], rows["http_stream"]], tick_labels=["gRPC", "HTTP gateway (SSE)"],
                    showfliers=False)
    axes[1].set_title(f"{a.tokens}-chunk stream (ms)")
    fig.suptitle(f"gateway adds {r['p50']:.2f} ms/request, {c['p50']:.3f} ms/chunk (p50)")
    fig.tight_layout()
    fig.savefig(a.out / "gateway_overhead.png", dpi=120)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
