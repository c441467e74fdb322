"""``specdec bench``: target-only versus speculative decoding, side by side in
one run, through the real services.

For each prompt it runs SPECULATION_MODE_OFF (the baseline: target-only
decoding through the same services) and SPECULATION_MODE_FIXED for each γ,
greedy, and reports: speedup, acceptance, mean accepted length, the measured
draft/target cost ratio c, the Leviathan bound for that α and c, the
per-round time split, and every greedy divergence from the baseline with the
baseline's top-1/top-2 logit gap at that position. It also measures the
target's verify-cost curve t_verify(k) through the Target service.

Writes ``results.json``, ``results.md`` and PNG plots into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_PROMPTS = Path(__file__).resolve().parent.parent / "benchmarks" / "prompts.jsonl"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default="127.0.0.1:50051", help="orchestrator address")
    p.add_argument("--target-address", default="127.0.0.1:50053", help="target address (for the cost curve)")
    p.add_argument("--launch", action="store_true", help="start `specdec up` for the run and stop it after")
    p.add_argument("--target-dtype", default="bfloat16", choices=["bfloat16", "float32"], help="with --launch")
    p.add_argument("--target-model", default=None, help="with --launch")
    p.add_argument("--draft-model", default=None, help="with --launch")
    p.add_argument("--prompts", type=Path, default=REPO_PROMPTS)
    p.add_argument("--only", action="append", help="prompt id(s) to run")
    p.add_argument("--gammas", default="4", help="comma-separated fixed γ values")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--out", type=Path, default=Path("bench-out"))
    p.add_argument("--no-cost-curve", action="store_true")
    p.add_argument("--cache-dir", type=Path, default=None)
    p.add_argument("--up-args", default="", help="extra flags for `specdec up` with --launch (one string)")


def leviathan(alpha: float, gamma: int, c: float) -> tuple[float, float]:
    """(expected tokens per round, speedup bound) for per-token acceptance α."""
    if alpha >= 1.0:
        e = gamma + 1.0
    else:
        e = (1 - alpha ** (gamma + 1)) / (1 - alpha)
    return e, e / (gamma * c + 1)


def alpha_from_mean(mean_len: float, gamma: int) -> float:
    """Solves E(γ) = (1 - α^(γ+1)) / (1 - α) for α by bisection."""
    lo, hi = 0.0, 1.0
    target = min(max(mean_len, 1.0), gamma + 1.0)
    for _ in range(60):
        mid = (lo + hi) / 2
        if leviathan(mid, gamma, 0.0)[0] < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _generate(stub: Any, prompt: dict[str, Any], mode: str, gamma: int, max_new: int) -> dict[str, Any]:
    from specdec.v1 import orchestrator_pb2 as pb

    modes = {"off": pb.SPECULATION_MODE_OFF, "fixed": pb.SPECULATION_MODE_FIXED}
    req = pb.GenerateRequest(
        max_new_tokens=max_new,
        return_logit_gaps=True,
        speculation=pb.SpeculationConfig(mode=modes[mode], num_draft_tokens=gamma),
    )
    if prompt.get("chat"):
        req.messages.append(pb.ChatMessage(role="user", content=prompt["prompt"]))
    else:
        req.prompt = prompt["prompt"]
    ids: list[int] = []
    gaps: list[float] = []
    text = []
    last = None
    t0 = time.perf_counter()
    for chunk in stub.Generate(req, timeout=3600):
        ids.extend(chunk.token_ids)
        gaps.extend(chunk.logit_gaps)
        text.append(chunk.text)
        last = chunk
    wall = time.perf_counter() - t0
    assert last is not None
    s = last.stats
    return {
        "mode": mode,
        "gamma": gamma,
        "token_ids": ids,
        "logit_gaps": gaps,
        "text": "".join(text),
        "wall_s": wall,
        "tokens": len(ids),
        "tokens_per_second": len(ids) / wall if wall > 0 else 0.0,
        "ttft_ms": s.time_to_first_token_ms,
        "rounds": s.rounds,
        "draft_tokens": s.draft_tokens,
        "accepted_tokens": s.accepted_tokens,
        "acceptance_rate": s.acceptance_rate,
        "mean_accepted_length": s.mean_accepted_length,
        "draft_ms": s.draft_ms,
        "verify_ms": s.verify_ms,
        "overhead_ms": s.overhead_ms,
        "draft_failures": s.draft_failures,
    }


def cost_curve(target_address: str, ks: range = range(1, 9), reps: int = 5, ctx: int = 200) -> dict[int, float]:
    """Median compute ms of one Verify of k tokens at a KV cache of ``ctx``
    tokens, through the Target service (draft ids are arbitrary: all rejected
    rows are rolled back, so each call sees the same cache)."""
    import grpc

    from specdec.v1 import common_pb2, target_pb2, target_pb2_grpc

    out: dict[int, float] = {}
    with grpc.insecure_channel(target_address) as ch:
        stub = target_pb2_grpc.TargetStub(ch)
        info = stub.GetModelInfo(common_pb2.ModelInfoRequest())
        ids = [(i * 7919) % min(info.vocab_size, 30000) + 100 for i in range(ctx)]
        pre = stub.Prefill(target_pb2.PrefillRequest(token_ids=ids, sample_next_token=True), timeout=600)
        sid, cache_len, nxt = pre.session_id, pre.cache_len, pre.next_token_id
        try:
            for k in ks:
                times = []
                for _ in range(reps):
                    # new token + (k-1) drafted tokens = k tokens in the pass
                    r = stub.Verify(
                        target_pb2.VerifyRequest(
                            session_id=sid, cache_len=cache_len, new_token_ids=[nxt],
                            draft_token_ids=[7] * (k - 1),
                        ),
                        timeout=600,
                    )
                    times.append(r.timings.compute_ms)
                    # roll the committed token back out by rebuilding the expected state
                    cache_len, nxt = r.cache_len, r.next_token_id
                out[k] = statistics.median(times)
        finally:
            stub.Release(common_pb2.ReleaseRequest(session_id=sid))
    return out


def _divergence(ref: dict[str, Any], run: dict[str, Any]) -> dict[str, Any] | None:
    a, b = ref["token_ids"], run["token_ids"]
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            gap = ref["logit_gaps"][i] if i < len(ref["logit_gaps"]) else float("nan")
            return {"position": i, "reference_token": x, "speculative_token": y, "reference_top2_logit_gap": gap}
    if len(a) != len(b):
        n = min(len(a), len(b))
        return {"position": n, "reference_token": a[n] if n < len(a) else None,
                "speculative_token": b[n] if n < len(b) else None, "reference_top2_logit_gap": None}
    return None


def run_bench(a: argparse.Namespace, orch: str, target: str) -> dict[str, Any]:
    import grpc

    from specdec.v1 import orchestrator_pb2_grpc

    prompts = [json.loads(line) for line in a.prompts.read_text().splitlines() if line.strip()]
    if a.only:
        prompts = [p for p in prompts if p["id"] in a.only]
    gammas = [int(g) for g in str(a.gammas).split(",") if g]
    rows: list[dict[str, Any]] = []
    with grpc.insecure_channel(orch) as ch:
        stub = orchestrator_pb2_grpc.OrchestratorStub(ch)
        _generate(stub, {"prompt": "hello", "chat": False}, "fixed", 2, 4)  # warm-up
        for prompt in prompts:
            ref = _generate(stub, prompt, "off", 0, a.max_new_tokens)
            t_target = ref["verify_ms"] / max(1, ref["rounds"] + 1)  # prefill counted as one step
            for g in gammas:
                run = _generate(stub, prompt, "fixed", g, a.max_new_tokens)
                t_draft_tok = run["draft_ms"] / max(1, run["draft_tokens"])
                c = t_draft_tok / t_target if t_target > 0 else float("nan")
                alpha = alpha_from_mean(run["mean_accepted_length"], g)
                _, bound = leviathan(alpha, g, c)
                rounds = max(1, run["rounds"])
                row = {
                    "prompt": prompt["id"], "category": prompt["category"], "gamma": g,
                    "tokens": run["tokens"], "baseline_tokens": ref["tokens"],
                    "baseline_tok_s": ref["tokens_per_second"], "spec_tok_s": run["tokens_per_second"],
                    "speedup": run["tokens_per_second"] / ref["tokens_per_second"] if ref["tokens_per_second"] else 0.0,
                    "acceptance_rate": run["acceptance_rate"], "alpha": alpha,
                    "mean_accepted_length": run["mean_accepted_length"], "c": c,
                    "leviathan_bound": bound,
                    "t_target_step_ms": t_target, "t_draft_token_ms": t_draft_tok,
                    "round_draft_ms": run["draft_ms"] / rounds, "round_verify_ms": run["verify_ms"] / rounds,
                    "round_overhead_ms": run["overhead_ms"] / rounds,
                    "identical": run["token_ids"] == ref["token_ids"],
                    "divergence": _divergence(ref, run),
                    "draft_failures": run["draft_failures"],
                    "baseline_text": ref["text"], "spec_text": run["text"],
                }
                rows.append(row)
                print(_md_row(row), flush=True)
    curve = {} if a.no_cost_curve else cost_curve(target)
    return {"rows": rows, "verify_cost_ms": curve, "max_new_tokens": a.max_new_tokens, "gammas": gammas}


HEADER = (
    "| prompt | category | γ | speedup | baseline tok/s | spec tok/s | α (accept rate) | α (from E) | mean accepted | c | bound | "
    "round split draft/verify/overhead ms | identical |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def _md_row(r: dict[str, Any]) -> str:
    div = r["divergence"]
    ident = "yes" if r["identical"] else (
        f"no: pos {div['position']}, gap {div['reference_top2_logit_gap']:.3f}" if div and div["reference_top2_logit_gap"] is not None else "no"
    )
    return (
        f"| {r['prompt']} | {r['category']} | {r['gamma']} | {r['speedup']:.2f}× | {r['baseline_tok_s']:.2f} | "
        f"{r['spec_tok_s']:.2f} | {r['acceptance_rate']:.2f} | {r['alpha']:.2f} | {r['mean_accepted_length']:.2f} | "
        f"{r['c']:.3f} | {r['leviathan_bound']:.2f}× | {r['round_draft_ms']:.0f}/{r['round_verify_ms']:.0f}/"
        f"{r['round_overhead_ms']:.0f} | {ident} |"
    )


def to_markdown(res: dict[str, Any], meta: dict[str, Any]) -> str:
    lines = [f"Run: {meta}", "", HEADER] + [_md_row(r) for r in res["rows"]]
    if res["rows"]:
        by_gamma: dict[int, list[float]] = {}
        for r in res["rows"]:
            by_gamma.setdefault(r["gamma"], []).append(r["speedup"])
        lines += ["", "Geometric-mean speedup: " + ", ".join(
            f"γ={g}: {math.exp(statistics.fmean(math.log(max(s, 1e-9)) for s in v)):.2f}×" for g, v in by_gamma.items())]
    if res["verify_cost_ms"]:
        ks = sorted(res["verify_cost_ms"])
        lines += ["", "Target verify cost through the service (median compute ms, KV cache 200 tokens):", "",
                  "| k | " + " | ".join(str(k) for k in ks) + " |", "|---" * (len(ks) + 1) + "|",
                  "| ms | " + " | ".join(f"{res['verify_cost_ms'][k]:.0f}" for k in ks) + " |"]
    return "\n".join(lines) + "\n"


def plots(res: dict[str, Any], out: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plots (pip install '.[bench]')", file=sys.stderr)
        return []
    paths = []
    rows = res["rows"]
    if rows:
        fig, ax = plt.subplots(figsize=(9, 4))
        labels = [f"{r['prompt']}\nγ={r['gamma']}" for r in rows]
        x = range(len(rows))
        ax.bar([i - 0.2 for i in x], [r["speedup"] for r in rows], width=0.4, label="measured speedup")
        ax.bar([i + 0.2 for i in x], [r["leviathan_bound"] for r in rows], width=0.4, label="Leviathan bound (α, c)")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(list(x), labels, fontsize=7)
        ax.set_ylabel("× target-only")
        ax.legend()
        fig.tight_layout()
        paths.append(out / "speedup.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    if res["verify_cost_ms"]:
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ks = sorted(res["verify_cost_ms"])
        ax.plot(ks, [res["verify_cost_ms"][k] for k in ks], marker="o")
        ax.set_xlabel("tokens per verify pass (k)")
        ax.set_ylabel("compute ms")
        ax.set_title("target t_verify(k)")
        ax.set_ylim(bottom=0)
        fig.tight_layout()
        paths.append(out / "verify_cost.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


def main(a: argparse.Namespace) -> int:
    a.out.mkdir(parents=True, exist_ok=True)
    proc = None
    orch, target = a.address, a.target_address
    if a.launch:
        ready = Path(tempfile.mkdtemp()) / "ready.json"
        cmd = [sys.executable, "-m", "specdec.cli", "up", "--ready-file", str(ready),
               "--target-dtype", a.target_dtype, "--port", "50061", "--target-port", "50063", "--draft-port", "50062"]
        if a.target_model:
            cmd += ["--target-model", a.target_model]
        if a.draft_model:
            cmd += ["--draft-model", a.draft_model]
        if a.cache_dir:
            cmd += ["--cache-dir", str(a.cache_dir)]
        cmd += shlex.split(a.up_args)
        proc = subprocess.Popen(cmd)
        while not ready.exists():
            if proc.poll() is not None:
                print("specdec up failed", file=sys.stderr)
                return 1
            time.sleep(1)
        addrs = json.loads(ready.read_text())
        orch, target = addrs["orchestrator"], addrs["target"]
    try:
        res = run_bench(a, orch, target)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)
    import platform

    import torch

    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": platform.machine(), "cpus": __import__("os").cpu_count(),
            "torch": torch.__version__, "target_dtype": a.target_dtype, "max_new_tokens": a.max_new_tokens,
            "command": " ".join(sys.argv)}
    res["meta"] = meta
    (a.out / "results.json").write_text(json.dumps(res, indent=2))
    md = to_markdown(res, meta)
    (a.out / "results.md").write_text(md)
    for p in plots(res, a.out):
        print(f"wrote {p}")
    print(md)
    return 0
