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
    # replay fixed γ, the heuristic and the adaptive policy on them (seconds);
    # requests end at their first EOS, as they do in the services
    .venv/bin/python scripts/policy_replay.py replay bench-out/traces.json
    # AUTO without a confidence early stop (0), with its derived one (-1) and
    # with a fixed threshold (0.2)
    .venv/bin/python scripts/policy_replay.py replay bench-out/traces.json --min-confidence 0 \
        --min-confidence -1 --min-confidence 0.2
    # with this machine's measured verify curve (a `specdec bench` results.json)
    .venv/bin/python scripts/policy_replay.py replay bench-out/traces.json \
        --curve docs/bench/avx2-auto-12-r2/results.json --draft-token-ms 25 --overhead-ms 6

This is a tuning tool; the numbers that count come from ``specdec bench``.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from specdec.models import DEFAULT_DRAFT, DEFAULT_TARGET  # noqa: E402 (after the sys.path line)

MAX_SPAN = 16


# ----------------------------------------------------------------- collect
def collect(a: argparse.Namespace) -> None:
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    from draft_service.export import ensure_onnx
    from draft_service.onnx_model import OnnxCausalLM
    from orchestrator.draft_window import plan_feed
    from specdec.models import default_cache_dir, resolve

    cache = default_cache_dir()
    tgt = resolve(a.target, cache)
    drf = resolve(a.draft, cache)
    tok = AutoTokenizer.from_pretrained(str(tgt.hf_dir))
    model = AutoModelForCausalLM.from_pretrained(str(tgt.hf_dir), dtype=torch.bfloat16).eval()
    draft = OnnxCausalLM(ensure_onnx(drf.hf_dir, cache, a.precision, "cpu"), execution="cpu")
    prompts = [json.loads(line) for line in Path(a.prompts).read_text().splitlines() if line.strip()]
    span = a.max_span
    known: dict[str, list[int]] = {}  # --reuse-target: the target's greedy tokens of an earlier collect
    if a.reuse_target:
        for t in json.loads(Path(a.reuse_target).read_text())["traces"]:
            known[t["id"]] = t["target"] + t.get("target_tail", [])
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
        gen: list[int] = list(known.get(p["id"], []))
        if len(gen) < a.max_new_tokens + span:  # too short to reuse (an earlier, shorter collect): run the target
            gen = []
        cache_kv = DynamicCache(config=model.config)
        feed = ids
        with torch.inference_mode():
            for _ in range(a.max_new_tokens + span - len(gen)):
                logits = model(input_ids=torch.tensor([feed]), past_key_values=cache_kv, use_cache=True, logits_to_keep=1).logits[0, -1]
                nxt = int(torch.argmax(logits))
                gen.append(nxt)
                feed = [nxt]
        # draft greedy runs from every position; with --draft-window the draft
        # takes in the prompt as the orchestrator's context window would send it
        state = draft.new_state()
        last = draft.forward(state, plan_feed(ids, 0, 0, a.draft_window, a.draft_sink).tokens)[-1]
        runs, confs = [], []
        for i in range(a.max_new_tokens):
            base = state.length
            drafted, conf = [], []
            logits = last
            for _ in range(span):
                x = logits.astype(np.float64)
                t = int(np.argmax(x))
                conf.append(float(1.0 / np.exp(x - x.max()).sum()))
                drafted.append(t)
                logits = draft.forward(state, [t])[-1]
            state.crop(base)
            n = 0
            while n < span and drafted[n] == gen[i + n]:
                n += 1
            runs.append(n)
            confs.append(conf)
            last = draft.forward(state, [gen[i]])[-1]
        out.append({"id": p["id"], "category": p["category"], "prompt_tokens": len(ids), "target": gen[: a.max_new_tokens],
                    "target_tail": gen[a.max_new_tokens:], "runs": runs, "confidence": confs,
                    "draft_window": a.draft_window, "draft_sink": a.draft_sink})
        print(json.dumps({"prompt": p["id"], "s": round(time.perf_counter() - t0, 1),
                          "mean_run": round(sum(runs) / len(runs), 2),
                          "first_accepted": round(sum(r > 0 for r in runs) / len(runs), 3)}), flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"traces": out, "max_span": span}))


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
    curve: dict[int, float] | None = None  # a measured t_verify(k) (--curve): used instead of a + b·(k−1)

    def __post_init__(self) -> None:
        self._model: Any = None
        if self.curve:
            from orchestrator.costs import CostModel

            self._model = CostModel()
            self._model.set_prior(self.curve, self.draft_token)
            self.verify_a = self.curve[min(self.curve)]

    def verify(self, k: int, rng: random.Random) -> float:
        mean = self._model.forward_ms(k) if self._model is not None else self.verify_a + self.verify_b * (k - 1)
        return mean * (1 + rng.gauss(0, self.noise))

    def draft(self, gamma: int, rng: random.Random) -> tuple[float, float]:
        compute = self.draft_token * gamma * (1 + rng.gauss(0, self.noise))
        return compute + self.draft_rtt, compute


EOS_IDS = (151643, 151645)  # Qwen2.5 <|endoftext|>, <|im_end|>


def trace_length(trace: dict[str, Any]) -> int:
    """Positions a request really generates: up to and including the first
    EOS (the services stop there), else the whole trace."""
    for i, t in enumerate(trace["target"]):
        if t in EOS_IDS:
            return min(i + 1, len(trace["runs"]))
    return len(trace["runs"])


def replay_one(trace: dict[str, Any], policy: Any, costs: Costs, rng: random.Random, sink: Any = None,
               min_confidence: float = 0.0) -> dict[str, Any]:
    """``min_confidence`` < 0: the policy's own threshold (``stop_confidence()``)."""
    from orchestrator.policy import RoundObservation

    runs, confs, n = trace["runs"], trace["confidence"], trace_length(trace)
    pos, ms, gammas, accs, continued = 0, 0.0, [], [], False
    while pos < n:
        g = min(policy.next_gamma(), n - pos)
        tau = policy.stop_confidence() if min_confidence < 0 else min_confidence
        if g > 0 and tau > 0:
            c = confs[pos]
            g2 = 1
            while g2 < g and c[g2] >= tau:
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


def load_curve(path: str) -> dict[int, float]:
    """t_verify(k) in ms from a JSON file: `specdec bench`'s results.json (the
    target's calibrated ``numerics.forward_cost_ms``) or a plain {k: ms}."""
    data = json.loads(Path(path).read_text())
    if isinstance(data, dict) and "numerics" in data:
        data = data["numerics"]["forward_cost_ms"]
    return {int(k): float(v) for k, v in data.items()}


def replay(a: argparse.Namespace) -> dict[str, Any]:
    from orchestrator.policy import AdaptiveConfig, PolicyFactory

    traces = [t for f in a.traces for t in json.loads(Path(f).read_text())["traces"] if not a.only or t["id"] in a.only]
    # in the benchmark's order (the shared estimates carry from one prompt to the next)
    order = [json.loads(line)["id"] for line in (REPO / "benchmarks" / "prompts.jsonl").read_text().splitlines() if line.strip()]
    traces.sort(key=lambda t: order.index(t["id"]) if t["id"] in order else len(order))
    curve = load_curve(a.curve) if a.curve else None
    costs = Costs(curve=curve, **({"draft_token": a.draft_token_ms} if a.draft_token_ms else {}),
                  **({"overhead": a.overhead_ms} if a.overhead_ms is not None else {}))
    overrides = json.loads(a.adaptive) if a.adaptive else {}
    results: dict[str, dict[str, float]] = {}
    for seed in range(a.seeds):
        rng = random.Random(seed)
        factory = PolicyFactory(default_gamma=4, gamma_max=16, adaptive=AdaptiveConfig(gamma_max=16, **overrides))
        if curve:  # as the services do: the policy starts from the measured costs
            factory.set_cost_priors(curve, {"draft": costs.draft_token})
        configs = [("fixed", g, 0.0) for g in (1, 2, 3, 4, 6, 8)] + [("heuristic", 0, 0.0)]
        configs += [("auto", 0, float(tau)) for tau in a.min_confidence]
        for t in traces:
            n = trace_length(t)
            base_ms = n * (costs.verify_a + costs.overhead)
            for mode, g, tau in configs:
                pol = factory.make({"auto": "adaptive"}.get(mode, mode), g, "draft")
                r = replay_one(t, pol, costs, rng, sink=lambda o: factory.observe(o, "draft"), min_confidence=tau)
                key = f"{mode}{g or ''}" + (f"@{tau:g}" if mode == "auto" and tau else "")
                results.setdefault(t["id"], {}).setdefault(key, 0.0)
                results[t["id"]][key] += r["tok_s"] / (n / base_ms * 1e3) / a.seeds
                if a.verbose and seed == 0 and mode == "auto":
                    print(t["id"], r["gammas"][:40], r["accepted"][:40])
    for pid, row in results.items():
        print(f"{pid:12s} " + " ".join(f"{k}={v:.2f}" for k, v in row.items()))
    # per category: geometric mean over its prompts, each AUTO variant against
    # the best fixed γ (chosen in hindsight) and the heuristic
    cats: dict[str, dict[str, list[float]]] = {}
    for t in traces:
        for k, v in results[t["id"]].items():
            cats.setdefault(t["category"], {}).setdefault(k, []).append(v)
    worst: dict[str, float] = {}
    for cat, d in cats.items():
        g = {k: math.exp(sum(map(math.log, v)) / len(v)) for k, v in d.items()}
        best = max(v for k, v in g.items() if k.startswith("fixed"))
        autos = {k: v for k, v in g.items() if k.startswith("auto")}
        for k, v in autos.items():
            worst[k] = min(worst.get(k, 9.0), v / best)
        print(f"{cat:16s} best fixed={best:.2f} heur={g['heuristic']:.2f} "
              + " ".join(f"{k}={v:.2f}({v / best - 1:+.0%}/{v / g['heuristic'] - 1:+.0%})" for k, v in autos.items()))
    print("worst AUTO / best fixed: " + " ".join(f"{k}={v:.3f}" for k, v in worst.items()))
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("collect")
    c.add_argument("--target", default=DEFAULT_TARGET)
    c.add_argument("--draft", default=DEFAULT_DRAFT)
    c.add_argument("--precision", default="int4")
    c.add_argument("--prompts", default=str(REPO / "benchmarks" / "prompts.jsonl"))
    c.add_argument("--only", action="append")
    c.add_argument("--max-new-tokens", type=int, default=96)
    c.add_argument("--out", default="bench-out/traces.json")
    c.add_argument("--max-span", type=int, default=MAX_SPAN, help="draft tokens tried from every position")
    c.add_argument("--draft-window", type=int, default=0,
                   help="the orchestrator's --draft-context-window: the draft takes in the prompt's first "
                        "--draft-sink tokens and its last this many (0 = the whole prompt)")
    c.add_argument("--draft-sink", type=int, default=4)
    c.add_argument("--reuse-target", default="", help="a traces.json of the same prompts: its target tokens "
                   "instead of running the target again")
    r = sub.add_parser("replay")
    r.add_argument("traces", nargs="+")
    r.add_argument("--only", action="append")
    r.add_argument("--seeds", type=int, default=5)
    r.add_argument("--adaptive", default="", help="JSON overrides of AdaptiveConfig")
    r.add_argument("--min-confidence", type=float, action="append",
                   help="AUTO's draft confidence stop (repeatable; -1 = the policy's derived threshold; default 0)")
    r.add_argument("--verbose", action="store_true")
    r.add_argument("--curve", default="", help="the target's measured t_verify(k): a `specdec bench` results.json "
                   "or a JSON {k: ms} (default: the reference CPU's line a + b·(k−1))")
    r.add_argument("--draft-token-ms", type=float, default=0.0, help="the draft's ms per token (default 21)")
    r.add_argument("--overhead-ms", type=float, default=None, help="per-round overhead in ms (default 20)")
    a = ap.parse_args()
    if a.cmd == "replay" and not a.min_confidence:
        a.min_confidence = [0.0]
    collect(a) if a.cmd == "collect" else replay(a)


if __name__ == "__main__":
    main()
