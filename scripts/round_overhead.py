"""Per-round orchestration + gRPC overhead through the real services on
loopback: wall time of a round minus the draft's and the target's reported
compute. A tiny random-weight target (on --device) and the model-free
prompt-lookup drafter keep compute small, so what is left is the overhead a
round pays on top of any model. Each draft mode runs under each variant:
`stream`, the defaults (one VerifyStream per session, draft events batched);
`unary`, a unary Verify call per round; `single-events`, draft streams sending
one message per drafted token. Part of scripts/gpu_check.sh; runs on CPU.

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
# variant -> (the suffix of its result keys (the defaults have none), VerifyStream on, draft events batched)
VARIANTS = {"stream": ("", True, True), "unary": ("@unary-verify", False, True),
            "single-events": ("@single-events", True, False)}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


@contextlib.contextmanager
def in_process(target: Path, root: Path, device: str, verify_stream: bool, batch_events: bool) -> Iterator[Any]:
    """The three services on one asyncio loop in this process (tests/stack.py)."""
    from draft_service.config import DrafterSpec
    from tests.stack import start_stack

    stack = start_stack(target, None, root / "cache", drafters=[DrafterSpec(name="lookup", kind="prompt-lookup")],
                        target_overrides={"device": device, "backend": "eager"},  # float32 (the stack's dtype)
                        orchestrator_overrides={"target_verify_stream": verify_stream,
                                                "draft_batch_events": batch_events})
    try:
        yield lambda **kw: stack.generate(**kw)["stats"]  # the draft hosts one drafter: the default
    finally:
        stack.close()


@contextlib.contextmanager
def processes(target: Path, root: Path, device: str, verify_stream: bool, batch_events: bool) -> Iterator[Any]:
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
                         "--target-verify-stream", "on" if verify_stream else "off",
                         "--draft-batch-events", "on" if batch_events else "off"],
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
    p.add_argument("--variants", "--transports", dest="variants", default="stream,unary",
                   help="variants to measure, in order: stream (the defaults), unary (unary Verify), "
                        "single-events (one draft message per drafted token)")
    p.add_argument("--out", type=Path, default=Path("overhead-out"))
    a = p.parse_args()

    from tests.tiny import build_tiny_model

    root = Path(tempfile.mkdtemp())
    target = build_tiny_model(root / "target", chars="abcdefghijklmnopqrstuvwxyz .,:!?\n", seed=1)
    from specdec_app.bench import alternating, machine_meta

    res: dict[str, Any] = {"device": a.device, "processes": a.processes, "command": " ".join(sys.argv),
                           "date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine_meta()}
    prompt = "the cat sat on the mat. the cat sat on the mat. the cat sat on the mat. " * 3
    variants = [t for t in a.variants.split(",") if t]
    keys: list[str] = []
    with contextlib.ExitStack() as up:
        # every variant's stack is up at once and the requests alternate between
        # them, so a change in the machine's speed falls on all of them alike
        gens = {v: up.enter_context((processes if a.processes else in_process)(target, root, a.device, *VARIANTS[v][1:]))
                for v in variants}
        for name, mode, gamma, draft_mode in RUNS:
            kw = dict(prompt=prompt, mode=mode, gamma=gamma, draft_mode=draft_mode)
            acc: dict[str, dict[str, list[float]]] = {v: {"per_round": [], "p50": [], "p99": [], "rounds": []}
                                                      for v in variants}
            for v in variants:
                gens[v](max_new_tokens=8, **kw)  # warm-up
            for v in alternating(variants, a.requests):
                s = gens[v](max_new_tokens=a.max_new_tokens, **kw)
                if s.rounds:
                    acc[v]["per_round"].append(s.overhead_ms / s.rounds)
                    acc[v]["p50"].append(s.round_overhead_p50_ms)
                    acc[v]["p99"].append(s.round_overhead_p99_ms)
                    acc[v]["rounds"].append(s.rounds)
            for v in variants:
                x = acc[v]
                key = name + VARIANTS[v][0]
                keys.append(key)
                res[key] = {"rounds": int(sum(x["rounds"])), "variant": v,
                            "round_overhead_p50_ms": round(statistics.median(x["p50"]), 3),
                            "round_overhead_p99_ms": round(statistics.median(x["p99"]), 3),
                            "overhead_ms_per_round_p50": round(pct(x["per_round"], 0.5), 3),
                            "overhead_ms_per_round_p99": round(pct(x["per_round"], 0.99), 3),
                            "overhead_ms_per_round_mean": round(statistics.fmean(x["per_round"]), 3)}
                print(f"[overhead] {key}: {res[key]}", flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "round_overhead.json").write_text(json.dumps(res, indent=2))
    where = "three `specdec serve` processes" if a.processes else "the three services on one event loop"
    md = [f"Per-round overhead on loopback ({where}), device {a.device}, {a.requests} requests × "
          f"{a.max_new_tokens} tokens, every variant up at once and the requests alternating between them. Per round: wall time minus the target's compute and queueing minus the "
          "draft compute the round waited for (GenerationStats.round_overhead_p50_ms / _p99_ms, median over "
          "requests); per request: (total − exposed draft − target) / rounds, p50 and p99 over requests. "
          f"Command: `{res['command']}`", "",
          f"Machine: {res['machine']['cpu']}, ISA {res['machine']['isa']}, "
          f"flags {' '.join(res['machine']['isa_flags']) or 'none'}.", "",
          "| run | variant | rounds | round p50 ms | round p99 ms | request p50 ms/round | request p99 ms/round | mean |",
          "|---|---|---|---|---|---|---|---|"]
    for key in keys:
        r = res[key]
        md.append(f"| {key.split('@')[0]} | {r['variant']} | {r['rounds']} | {r['round_overhead_p50_ms']} | "
                  f"{r['round_overhead_p99_ms']} | {r['overhead_ms_per_round_p50']} | "
                  f"{r['overhead_ms_per_round_p99']} | {r['overhead_ms_per_round_mean']} |")
    (a.out / "round_overhead.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
