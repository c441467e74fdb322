"""Per-round orchestration + gRPC overhead through the real services on
loopback: wall time of a round minus the draft's and the target's reported
compute. A tiny random-weight target (on --device) and the model-free
prompt-lookup drafter keep compute small, so what is left is the overhead a
round pays on top of any model. Part of scripts/gpu_check.sh; runs on CPU.

    .venv/bin/python scripts/round_overhead.py --device cpu --out bench-out/overhead

Writes round_overhead.json and round_overhead.md into --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


# (label, speculation mode, γ, draft_mode)
RUNS = [("off", "off", 0, ""), ("fixed-unary", "fixed", 4, "unary"), ("fixed-stream", "fixed", 4, "stream"),
        ("fixed-run-ahead", "fixed", 4, "run-ahead")]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--requests", type=int, default=20)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--out", type=Path, default=Path("overhead-out"))
    a = p.parse_args()

    from draft_service.config import DrafterSpec
    from tests.tiny import build_tiny_model
    from tests.stack import start_stack

    root = Path(tempfile.mkdtemp())
    target = build_tiny_model(root / "target", chars="abcdefghijklmnopqrstuvwxyz .,:!?\n", seed=1)
    stack = start_stack(target, None, root / "cache", drafters=[DrafterSpec(name="lookup", kind="prompt-lookup")],
                        target_overrides={"device": a.device, "backend": "eager"})  # float32 (the stack's dtype)
    res: dict[str, object] = {"device": a.device, "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M")}
    try:
        prompt = "the cat sat on the mat. the cat sat on the mat. the cat sat on the mat. " * 3
        for name, mode, gamma, draft_mode in RUNS:
            per_round, p50s, p99s, rounds = [], [], [], 0
            kw = dict(prompt=prompt, mode=mode, gamma=gamma, draft_mode=draft_mode)
            stack.generate(max_new_tokens=8, **kw)  # warm-up
            for _ in range(a.requests):
                out = stack.generate(max_new_tokens=a.max_new_tokens, **kw)
                s = out["stats"]
                if s.rounds:
                    per_round.append(s.overhead_ms / s.rounds)
                    p50s.append(s.round_overhead_p50_ms)
                    p99s.append(s.round_overhead_p99_ms)
                    rounds += s.rounds
            res[name] = {"rounds": rounds, "round_overhead_p50_ms": round(statistics.median(p50s), 3),
                         "round_overhead_p99_ms": round(statistics.median(p99s), 3),
                         "overhead_ms_per_round_p50": round(pct(per_round, 0.5), 3),
                         "overhead_ms_per_round_p99": round(pct(per_round, 0.99), 3),
                         "overhead_ms_per_round_mean": round(statistics.fmean(per_round), 3)}
            print(f"[overhead] {name}: {res[name]}", flush=True)
    finally:
        stack.close()
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "round_overhead.json").write_text(json.dumps(res, indent=2))
    md = [f"Per-round overhead on loopback, device {a.device}, {a.requests} requests × {a.max_new_tokens} tokens. "
          "Per round: wall time minus the target's compute and queueing minus the draft compute the round "
          "waited for (GenerationStats.round_overhead_p50_ms / _p99_ms, median over requests); per request: "
          f"(total − exposed draft − target) / rounds, p50 and p99 over requests. Command: `{res['command']}`", "",
          "| run | rounds | round p50 ms | round p99 ms | request p50 ms/round | request p99 ms/round | mean |",
          "|---|---|---|---|---|---|---|"]
    for name, *_ in RUNS:
        r = res[name]
        md.append(f"| {name} | {r['rounds']} | {r['round_overhead_p50_ms']} | {r['round_overhead_p99_ms']} | "  # type: ignore[index]
                  f"{r['overhead_ms_per_round_p50']} | {r['overhead_ms_per_round_p99']} | "  # type: ignore[index]
                  f"{r['overhead_ms_per_round_mean']} |")  # type: ignore[index]
    (a.out / "round_overhead.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
