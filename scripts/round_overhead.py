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
    from specdec.tiny import build_tiny_model
    from tests.stack import start_stack

    root = Path(tempfile.mkdtemp())
    target = build_tiny_model(root / "target", chars="abcdefghijklmnopqrstuvwxyz .,:!?\n", seed=1)
    stack = start_stack(target, None, root / "cache", drafters=[DrafterSpec(name="lookup", kind="prompt-lookup")],
                        target_overrides={"device": a.device, "backend": "eager"})  # float32 (the stack's dtype)
    res: dict[str, object] = {"device": a.device, "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M")}
    try:
        prompt = "the cat sat on the mat. the cat sat on the mat. the cat sat on the mat. " * 3
        for mode, gamma in (("off", 0), ("fixed", 4)):
            per_round, rounds = [], 0
            stack.generate(prompt=prompt, mode=mode, gamma=gamma, max_new_tokens=8)  # warm-up
            for _ in range(a.requests):
                out = stack.generate(prompt=prompt, mode=mode, gamma=gamma, max_new_tokens=a.max_new_tokens)
                s = out["stats"]
                if s.rounds:
                    per_round.append(s.overhead_ms / s.rounds)
                    rounds += s.rounds
            res[mode] = {"rounds": rounds, "overhead_ms_per_round_p50": round(pct(per_round, 0.5), 3),
                         "overhead_ms_per_round_p99": round(pct(per_round, 0.99), 3),
                         "overhead_ms_per_round_mean": round(statistics.fmean(per_round), 3)}
            print(f"[overhead] {mode}: {res[mode]}", flush=True)
    finally:
        stack.close()
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "round_overhead.json").write_text(json.dumps(res, indent=2))
    md = [f"Per-round overhead (wall − draft compute − target compute) on loopback, device {a.device}, "
          f"{a.requests} requests × {a.max_new_tokens} tokens. Command: `{res['command']}`", "",
          "| mode | rounds | p50 ms/round | p99 ms/round | mean |", "|---|---|---|---|---|"]
    for mode in ("off", "fixed"):
        r = res[mode]
        md.append(f"| {mode} | {r['rounds']} | {r['overhead_ms_per_round_p50']} | {r['overhead_ms_per_round_p99']} | "  # type: ignore[index]
                  f"{r['overhead_ms_per_round_mean']} |")  # type: ignore[index]
    (a.out / "round_overhead.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
