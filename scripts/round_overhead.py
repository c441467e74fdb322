"""Per-round orchestration + gRPC overhead through the real services on
loopback: wall time of a round minus the draft's and the target's reported
compute. A tiny random-weight target (on --device) and the model-free
prompt-lookup drafter keep compute small, so what is left is the overhead a
round pays on top of any model. Each draft mode runs with the target reached
through one VerifyStream per session (the default) and through a unary Verify
call per round. Part of scripts/gpu_check.sh; runs on CPU.

    .venv/bin/python scripts/round_overhead.py --device cpu --out bench-out/overhead
    # the three services as separate processes (`specdec serve`), as deployed
    .venv/bin/python scripts/round_overhead.py --processes --out bench-out/overhead-procs

Writes round_overhead.json and round_overhead.md into --out.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


# (label, speculation mode, γ, draft_mode)
RUNS = [("off", "off", 0, ""), ("fixed-unary", "fixed", 4, "unary"), ("fixed-stream", "fixed", 4, "stream"),
        ("fixed-run-ahead", "fixed", 4, "run-ahead")]
# verify transport -> the suffix of its result keys (the default transport has none)
TRANSPORTS = {"stream": "", "unary": "@unary-verify"}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


@contextlib.contextmanager
def in_process(target: Path, root: Path, device: str, verify_stream: bool) -> Iterator[Any]:
    """The three services on one asyncio loop in this process (tests/stack.py)."""
    from draft_service.config import DrafterSpec
    from tests.stack import start_stack

    stack = start_stack(target, None, root / "cache", drafters=[DrafterSpec(name="lookup", kind="prompt-lookup")],
                        target_overrides={"device": device, "backend": "eager"},  # float32 (the stack's dtype)
                        orchestrator_overrides={"target_verify_stream": verify_stream})
    try:
        yield lambda **kw: stack.generate(**kw)["stats"]  # the draft hosts one drafter: the default
    finally:
        stack.close()


@contextlib.contextmanager
def processes(target: Path, root: Path, device: str, verify_stream: bool) -> Iterator[Any]:
    """``specdec serve target|draft|orchestrator`` as three processes, one thread each."""
    import grpc

    from specdec.v1 import orchestrator_pb2_grpc
    from tests.stack import free_port, kill, make_request, wait_serving

    ports = {s: free_port() for s in ("target", "draft", "orchestrator")}
    common = ["--cache-dir", str(root / "cache"), "--log-level", "warning"]
    args = {
        "target": ["--model", str(target), "--threads", "1", "--dtype", "float32", "--backend", "eager",
                   "--device", device],
        "draft": ["--model", str(target), "--drafters", "prompt-lookup", "--target-tokenizer", str(target)],
        "orchestrator": ["--model", str(target), "--target-address", f"127.0.0.1:{ports['target']}",
                         "--draft-address", f"127.0.0.1:{ports['draft']}",
                         "--target-verify-stream", "on" if verify_stream else "off"],
    }
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for service in ("target", "draft", "orchestrator"):
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "specdec_app.cli", "serve", service, "--port", str(ports[service]),
                 *args[service], *common], start_new_session=True))
            wait_serving(f"127.0.0.1:{ports[service]}", proc=procs[-1])
        channel = grpc.insecure_channel(f"127.0.0.1:{ports['orchestrator']}")
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)

        def generate(**kw: Any) -> Any:
            req = make_request(**kw)  # the draft hosts one drafter: the default
            stats = None
            for chunk in stub.Generate(req, timeout=300):
                if chunk.HasField("stats"):
                    stats = chunk.stats
            return stats

        yield generate
        channel.close()
    finally:
        for p in procs:
            kill(p)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--requests", type=int, default=20)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--processes", action="store_true", help="the services as separate processes (as deployed)")
    p.add_argument("--transports", default="stream,unary", help="verify transports to measure: stream, unary")
    p.add_argument("--out", type=Path, default=Path("overhead-out"))
    a = p.parse_args()

    from tests.tiny import build_tiny_model

    root = Path(tempfile.mkdtemp())
    target = build_tiny_model(root / "target", chars="abcdefghijklmnopqrstuvwxyz .,:!?\n", seed=1)
    res: dict[str, Any] = {"device": a.device, "processes": a.processes, "command": " ".join(sys.argv),
                           "date": time.strftime("%Y-%m-%d %H:%M")}
    prompt = "the cat sat on the mat. the cat sat on the mat. the cat sat on the mat. " * 3
    keys: list[str] = []
    for transport in [t for t in a.transports.split(",") if t]:
        suffix = TRANSPORTS[transport]
        with (processes if a.processes else in_process)(target, root, a.device, transport == "stream") as generate:
            for name, mode, gamma, draft_mode in RUNS:
                per_round, p50s, p99s, rounds = [], [], [], 0
                kw = dict(prompt=prompt, mode=mode, gamma=gamma, draft_mode=draft_mode)
                generate(max_new_tokens=8, **kw)  # warm-up
                for _ in range(a.requests):
                    s = generate(max_new_tokens=a.max_new_tokens, **kw)
                    if s.rounds:
                        per_round.append(s.overhead_ms / s.rounds)
                        p50s.append(s.round_overhead_p50_ms)
                        p99s.append(s.round_overhead_p99_ms)
                        rounds += s.rounds
                key = name + suffix
                keys.append(key)
                res[key] = {"rounds": rounds, "verify": transport,
                            "round_overhead_p50_ms": round(statistics.median(p50s), 3),
                            "round_overhead_p99_ms": round(statistics.median(p99s), 3),
                            "overhead_ms_per_round_p50": round(pct(per_round, 0.5), 3),
                            "overhead_ms_per_round_p99": round(pct(per_round, 0.99), 3),
                            "overhead_ms_per_round_mean": round(statistics.fmean(per_round), 3)}
                print(f"[overhead] {key}: {res[key]}", flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "round_overhead.json").write_text(json.dumps(res, indent=2))
    where = "three `specdec serve` processes" if a.processes else "the three services on one event loop"
    md = [f"Per-round overhead on loopback ({where}), device {a.device}, {a.requests} requests × "
          f"{a.max_new_tokens} tokens. Per round: wall time minus the target's compute and queueing minus the "
          "draft compute the round waited for (GenerationStats.round_overhead_p50_ms / _p99_ms, median over "
          "requests); per request: (total − exposed draft − target) / rounds, p50 and p99 over requests. "
          f"Command: `{res['command']}`", "",
          "| run | verify | rounds | round p50 ms | round p99 ms | request p50 ms/round | request p99 ms/round | mean |",
          "|---|---|---|---|---|---|---|---|"]
    for key in keys:
        r = res[key]
        md.append(f"| {key.split('@')[0]} | {r['verify']} | {r['rounds']} | {r['round_overhead_p50_ms']} | "
                  f"{r['round_overhead_p99_ms']} | {r['overhead_ms_per_round_p50']} | "
                  f"{r['overhead_ms_per_round_p99']} | {r['overhead_ms_per_round_mean']} |")
    (a.out / "round_overhead.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
