"""Offline replay of draft-length policies on real acceptance traces.

Greedy speculative decoding is deterministic: at every position i of the
target's greedy output, a greedy drafter proposes the same continuation
whatever the policy, and a span of γ tokens from i is accepted up to
``min(γ, L_i)``, where ``L_i`` is how many of the draft's tokens agree with the
target's from i. So one pass that records ``L_i`` for every position (and the
draft's confidence per drafted token) lets any policy be replayed exactly for
acceptance; round costs come from a cost model (the target's measured
t_verify(k) curve and the draft's per-token time), with noise.

    # record traces with the real default pair (minutes; no timing involved)
    .venv/bin/python scripts/policy_replay.py collect --out bench-out/traces.json
    # replay fixed γ, the heuristic and the adaptive policy on them (seconds)
    .venv/bin/python scripts/policy_replay.py replay bench-out/traces.json

This is a tuning tool; the numbers that count come from ``specdec bench``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MAX_SPAN = 16


# ----------------------------------------------------------------- collect
def collect(a: argparse.Namespace) -> None:
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    from draft_service.export import ensure_onnx
    from draft_service.onnx_model import OnnxCausalLM
    from specdec.models import default_cache_dir, resolve

    cache = default_cache_dir()
    tgt = resolve(a.target, cache)
    drf = resolve(a.draft, cache)
    tok = AutoTokenizer.from_pretrained(str(tgt.hf_dir))
    model = AutoModelForCausalLM.from_pretrained(str(tgt.hf_dir), dtype=torch.bfloat16).eval()
    draft = OnnxCausalLM(ensure_onnx(drf.hf_dir, cache, a.precision, "cpu"), execution="cpu")
    prompts = [json.loads(line) for line in Path(a.prompts).read_text().splitlines() if line.strip()]
    out: list[dict[str, Any]] = []
    for p in prompts:
        if a.only and p["id"] not in a.only:
            continue
        if p.get("chat"):
            text = tok.apply_chat_template([{"role": "user", "content": p["prompt"]}], add_generation_prompt=True, tokenize=False)
            ids = list(tok(text, add_special_tokens=False)["input_ids"])
        else:
            ids = list(tok(p["prompt"])["input_ids"])
        t0 = time.perf_counter()
        # target greedy
        gen: list[int] = []
        cache_kv = DynamicCache(config=model.config)
        feed = ids
        with torch.inference_mode():
            for _ in range(a.max_new_tokens + MAX_SPAN):
                logits = model(input_ids=torch.tensor([feed]), past_key_values=cache_kv, use_cache=True, logits_to_keep=1).logits[0, -1]
                nxt = int(torch.argmax(logits))
                gen.append(nxt)
                feed = [nxt]
        # draft greedy runs from every position
        state = draft.new_state()
        last = draft.forward(state, ids)[-1]
        runs, confs = [], []
        for i in range(a.max_new_tokens):
            base = state.length
            drafted, conf = [], []
            logits = last
            for _ in range(MAX_SPAN):
                x = logits.astype(np.float64)
                t = int(np.argmax(x))
                conf.append(float(1.0 / np.exp(x - x.max()).sum()))
                drafted.append(t)
                logits = draft.forward(state, [t])[-1]
            state.crop(base)
            n = 0
            while n < MAX_SPAN and drafted[n] == gen[i + n]:
                n += 1
            runs.append(n)
            confs.append(conf)
            last = draft.forward(state, [gen[i]])[-1]
        out.append({"id": p["id"], "category": p["category"], "prompt_tokens": len(ids), "target": gen[: a.max_new_tokens],
                    "runs": runs, "confidence": confs})
        print(json.dumps({"prompt": p["id"], "s": round(time.perf_counter() - t0, 1),
                          "mean_run": round(sum(runs) / len(runs), 2)}), flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"traces": out, "max_span": MAX_SPAN}))


# ------------------------------------------------------------------ replay
@dataclass
class Costs:
    """Round costs (ms) on the reference CPU (docs/benchmarks.md): the bf16
    1.5B target's t_verify(k) ≈ a + b·(k−1); the int4 0.5B draft's per-token
    time; per-call network + orchestration overhead."""

    verify_a: float = 215.0
    verify_b: float = 13.0
    draft_token: float = 21.0
    draft_rtt: float = 2.0
    overhead: float = 20.0
    noise: float = 0.06

    def verify(self, k: int, rng: random.Random) -> float:
        return (self.verify_a + self.verify_b * (k - 1)) * (1 + rng.gauss(0, self.noise))

    def draft(self, gamma: int, rng: random.Random) -> tuple[float, float]:
        compute = self.draft_token * gamma * (1 + rng.gauss(0, self.noise))
        return compute + self.draft_rtt, compute


def replay_one(trace: dict[str, Any], policy: Any, costs: Costs, rng: random.Random, sink: Any = None,
               min_confidence: float = 0.0) -> dict[str, Any]:
    from orchestrator.policy import RoundObservation

    runs, confs, n = trace["runs"], trace["confidence"], len(trace["runs"])
    pos, ms, gammas, accs, continued = 0, 0.0, [], [], False
    while pos < n:
        g = min(policy.next_gamma(), n - pos)
        if g > 0 and min_confidence > 0:
            c = confs[pos]
            g2 = 1
            while g2 < g and c[g2] >= min_confidence:
                g2 += 1
            g = g2
        acc = min(g, runs[pos])
        d_ms, d_comp = costs.draft(g, rng) if g else (0.0, 0.0)
        v = costs.verify(g + 1, rng)
        obs = RoundObservation(gamma=g, accepted=acc, draft_ms=d_ms, draft_compute_ms=d_comp, verify_ms=v + 1.0,
                               verify_compute_ms=v, tokens_in_pass=g + 1, continued=continued)
        continued = 0 < g == acc
        policy.observe(obs)
        if sink is not None:
            sink(obs)
        ms += d_ms + v + costs.overhead
        gammas.append(g)
        accs.append(acc)
        pos += acc + 1
    return {"tok_s": n / ms * 1e3, "gammas": gammas, "accepted": accs}


def replay(a: argparse.Namespace) -> dict[str, Any]:
    from orchestrator.policy import AdaptiveConfig, PolicyFactory

    data = json.loads(Path(a.traces).read_text())
    traces = [t for t in data["traces"] if not a.only or t["id"] in a.only]
    costs = Costs()
    overrides = json.loads(a.adaptive) if a.adaptive else {}
    results: dict[str, dict[str, float]] = {}
    for seed in range(a.seeds):
        rng = random.Random(seed)
        factory = PolicyFactory(default_gamma=4, gamma_max=16, adaptive=AdaptiveConfig(gamma_max=16, **overrides))
        configs = [("fixed", g) for g in (1, 2, 3, 4, 6, 8)] + [("auto", 0), ("heuristic", 0)]
        for t in traces:
            base_ms = len(t["runs"]) * (costs.verify_a + costs.overhead)
            for mode, g in configs:
                pol = factory.make({"auto": "adaptive"}.get(mode, mode), g, "draft")
                r = replay_one(t, pol, costs, rng, sink=lambda o: factory.observe(o, "draft"))
                key = f"{mode}{g or ''}"
                results.setdefault(t["id"], {}).setdefault(key, 0.0)
                results[t["id"]][key] += r["tok_s"] / (len(t["runs"]) / base_ms * 1e3) / a.seeds
                if a.verbose and seed == 0 and mode == "auto":
                    print(t["id"], r["gammas"][:40], r["accepted"][:40])
    worst = 1e9
    for pid, row in results.items():
        best_fixed = max(v for k, v in row.items() if k.startswith("fixed"))
        auto = row["auto"]
        worst = min(worst, auto / best_fixed)
        print(f"{pid:12s} " + " ".join(f"{k}={v:.2f}" for k, v in row.items())
              + f"  auto/best={auto / best_fixed:.3f} auto/heur={auto / row['heuristic']:.3f}")
    print(f"worst auto/best_fixed = {worst:.3f}")
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("collect")
    c.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    c.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    c.add_argument("--precision", default="int4")
    c.add_argument("--prompts", default=str(REPO / "benchmarks" / "prompts.jsonl"))
    c.add_argument("--only", action="append")
    c.add_argument("--max-new-tokens", type=int, default=96)
    c.add_argument("--out", default="bench-out/traces.json")
    r = sub.add_parser("replay")
    r.add_argument("traces")
    r.add_argument("--only", action="append")
    r.add_argument("--seeds", type=int, default=5)
    r.add_argument("--adaptive", default="", help="JSON overrides of AdaptiveConfig")
    r.add_argument("--verbose", action="store_true")
    a = ap.parse_args()
    collect(a) if a.cmd == "collect" else replay(a)


if __name__ == "__main__":
    main()
