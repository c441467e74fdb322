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
import contextlib
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator, Sequence, TypeVar

from specdec_app.bench_report import md_row, plots, to_markdown

T = TypeVar("T")

REPO_PROMPTS = Path(__file__).resolve().parent.parent / "benchmarks" / "prompts.jsonl"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default="127.0.0.1:50051", help="orchestrator address")
    p.add_argument("--target-address", default="127.0.0.1:50053", help="target address (for the cost curve)")
    p.add_argument("--launch", action="store_true", help="start `specdec up` for the run and stop it after")
    p.add_argument("--target-dtype", default="auto", choices=["auto", "bfloat16", "float32"], help="with --launch")
    p.add_argument("--target-backend", default="auto",
                   choices=["auto", "eager", "packed", "bf16w", "kquant", "kquant-a8", "int4", "int4-q8"], help="with --launch")
    p.add_argument("--no-fastest-baseline", action="store_true",
                   help="with --launch: skip target-only runs under the target's other calibrated (dtype, backend) "
                        "pairs (by default each is launched target-only, and every speedup is also reported "
                        "against the fastest target-only configuration on this machine)")
    p.add_argument("--baseline-pairs", default="near",
                   help="with --launch: which other calibrated dtype/backend pairs run target-only: 'near' (those "
                        "whose measured 1-token step is within 1.25x of the fastest: the others cannot be the "
                        "fastest target-only configuration), 'all', or a comma-separated list")
    p.add_argument("--target-model", default=None, help="with --launch")
    p.add_argument("--draft-model", default=None, help="with --launch")
    p.add_argument("--prompts", type=Path, default=REPO_PROMPTS)
    p.add_argument("--only", action="append", help="prompt id(s) to run")
    p.add_argument("--gammas", default="4", help="comma-separated fixed γ values (SPECULATION_MODE_FIXED)")
    p.add_argument("--policies", default="",
                   help="comma-separated adaptive modes to run too: auto, heuristic, "
                        "auto-nostop (AUTO without its draft confidence early stop)")
    p.add_argument("--drafters", default="", help="comma-separated drafter names (default: the service default)")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs per configuration (the fastest is kept); the repeats of one prompt go round its "
                        "configurations in alternating order, so a slow spell of the machine hits one run of each")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--out", type=Path, default=Path("bench-out"))
    p.add_argument("--no-cost-curve", action="store_true")
    p.add_argument("--cache-dir", type=Path, default=None)
    p.add_argument("--up-args", default="", help="extra flags for `specdec up` with --launch (one string)")
    p.add_argument("--llamacpp", type=Path, default=None,
                   help="llamacpp.json of scripts/bench_llamacpp.sh: also write vs_llamacpp.{json,md,png} (one table)")
    p.add_argument("--llamacpp-bin", type=Path, default=None,
                   help="llama.cpp's bin directory (scripts/bench_llamacpp.sh builds it): run llama-server "
                        "target-only on the same GGUF file as one more configuration of every prompt, interleaved "
                        "with specdec's runs; writes llamacpp.json and vs_llamacpp.{json,md,png}")
    p.add_argument("--llamacpp-threads", type=int, default=2, help="llama.cpp's threads with --llamacpp-bin")
    p.add_argument("--llamacpp-model", type=Path, default=None,
                   help="the GGUF file llama.cpp serves with --llamacpp-bin (default: the target's own GGUF)")


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


# speculation mode names the benchmarks and `specdec generate` take → the
# request's SpeculationMode; "auto-nostop" is AUTO with a min_confidence no
# top probability is below (it is ≥ 1/vocab): AUTO without its early stop
MODES = {"off": "SPECULATION_MODE_OFF", "fixed": "SPECULATION_MODE_FIXED", "auto": "SPECULATION_MODE_AUTO",
         "heuristic": "SPECULATION_MODE_HEURISTIC", "auto-nostop": "SPECULATION_MODE_AUTO"}
NO_STOP_CONFIDENCE = 1e-7


def speculation_config(mode: str, gamma: int = 0, drafter: str = "", min_confidence: float = 0.0) -> Any:
    """The request's ``SpeculationConfig`` for one of ``MODES``."""
    from specdec.v1 import orchestrator_pb2 as pb

    if mode == "auto-nostop":
        min_confidence = NO_STOP_CONFIDENCE
    return pb.SpeculationConfig(mode=getattr(pb, MODES[mode]), num_draft_tokens=gamma, drafter=drafter,
                                min_confidence=min_confidence)


def decode_rate(tokens: int, wall_s: float, ttft_ms: float) -> float:
    """Tokens per second after the first token (the prompt's prefill left
    out): what speculation speeds up. 0 when there is nothing after it."""
    after = wall_s - ttft_ms / 1e3
    return (tokens - 1) / after if tokens > 1 and after > 0 else 0.0


def _generate(stub: Any, prompt: dict[str, Any], mode: str, gamma: int, max_new: int, drafter: str = "") -> dict[str, Any]:
    from specdec.v1 import orchestrator_pb2 as pb

    req = pb.GenerateRequest(
        max_new_tokens=max_new,
        return_logit_gaps=True,
        speculation=speculation_config(mode, gamma, drafter),
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
        "decode_tokens_per_second": decode_rate(len(ids), wall, s.time_to_first_token_ms),
        "ttft_ms": s.time_to_first_token_ms,
        "rounds": s.rounds,
        "draft_tokens": s.draft_tokens,
        "accepted_tokens": s.accepted_tokens,
        "acceptance_rate": s.acceptance_rate,
        "mean_accepted_length": s.mean_accepted_length,
        "draft_ms": s.draft_ms,
        "verify_ms": s.verify_ms,
        "prefill_ms": s.prefill_ms,
        "overhead_ms": s.overhead_ms,
        "draft_failures": s.draft_failures,
        "gamma_trajectory": list(s.gamma_trajectory),
        "accepted_per_round": list(s.accepted_per_round),
        "policy": s.policy,
        "drafter": s.drafter,
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
        vocab = min(info.vocab_size, 30_000)  # ordinary (non-special) ids for real tokenizers
        ids = [(i * 7919 + 100) % vocab for i in range(ctx)]
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
                            draft_token_ids=[7 % vocab] * (k - 1),
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


def acceptance_per_position(gammas: list[int], accepted: list[int], n: int = 8) -> list[float | None]:
    """P(drafted token i accepted | tokens before it accepted), from rounds."""
    out: list[float | None] = []
    for i in range(n):
        tried = sum(1 for g, a in zip(gammas, accepted) if g > i and a >= i)
        ok = sum(1 for g, a in zip(gammas, accepted) if g > i and a > i)
        out.append(ok / tried if tried else None)
    return out


def alternating(items: Sequence[T], repeats: int) -> Iterator[T]:
    """``items`` ``repeats`` times (at least once), forwards, then backwards,
    ... (ABBA for two items): a drift of a shared machine over the run falls
    on every item alike instead of on whichever runs first."""
    for rep in range(max(1, repeats)):
        yield from (items if rep % 2 == 0 else items[::-1])


LLAMACPP = ("llama.cpp", 0, "")  # the schedule's key of llama.cpp target-only (--llamacpp-bin)


def _best_of_rounds(
    stub: Any, prompt: dict[str, Any], schedule: list[tuple[str, int, str]], max_new: int, repeats: int,
    llama: Any = None, passes: dict[tuple[str, int, str], list[dict[str, Any]]] | None = None,
) -> dict[tuple[str, int, str], dict[str, Any]]:
    """Runs every (mode, γ, drafter) of ``schedule`` ``repeats`` times, going
    round the schedule forwards, then backwards, ...; keeps each one's
    fastest run. Interleaving (rather than back-to-back repeats) spreads a
    slow spell of a shared machine over all configurations. ``passes``, if
    given, receives every run of each configuration in order (run i of each
    was one pass round the schedule: see :func:`paired_ratio`)."""
    best: dict[tuple[str, int, str], dict[str, Any]] = {}
    for key in alternating(schedule, repeats):
        run = llama.run(prompt, max_new) if key == LLAMACPP else _generate(stub, prompt, key[0], key[1], max_new, key[2])
        if passes is not None:
            passes.setdefault(key, []).append(run)
        if key not in best or run["tokens_per_second"] > best[key]["tokens_per_second"]:
            best[key] = run
    return best


def paired_ratio(a: Sequence[dict[str, Any]], b: Sequence[dict[str, Any]], field: str, b_field: str | None = None) -> float | None:
    """The median over passes of a's ``field`` over b's (``b_field``, if b
    names it otherwise): the runs of one pass ran next to each other (ABBA),
    so each ratio shares the machine's state of its moment, where the ratio
    of two fastest runs can take them from different moments of a VM whose
    speed drifts. None without a pass where both ran."""
    ratios = [x[field] / y[b_field or field] for x, y in zip(a, b) if x[field] > 0 and y[b_field or field] > 0]
    return statistics.median(ratios) if ratios else None


def select_prompts(a: argparse.Namespace) -> list[dict[str, Any]]:
    """The prompt file's prompts, only those ``--only`` names (repeated or
    comma-separated); an id the file lacks is an error, not an empty run."""
    prompts = [json.loads(line) for line in a.prompts.read_text().splitlines() if line.strip()]
    wanted = [i.strip() for arg in a.only or [] for i in arg.split(",") if i.strip()]
    unknown = sorted(set(wanted) - {p["id"] for p in prompts})
    if unknown:
        raise SystemExit(f"specdec bench: --only {', '.join(unknown)}: not in {a.prompts} "
                         f"({', '.join(p['id'] for p in prompts)})")
    return [p for p in prompts if not wanted or p["id"] in wanted]


def run_bench(a: argparse.Namespace, orch: str, target: str, llama: Any = None) -> dict[str, Any]:
    """``llama``: a started ``specdec_app.llamacpp.Interleaved`` (one more
    configuration of every prompt) or None."""
    import grpc

    from specdec.v1 import orchestrator_pb2_grpc

    prompts = select_prompts(a)
    configs = [("fixed", int(g)) for g in str(a.gammas).split(",") if g]
    configs += [(p.strip(), 0) for p in str(a.policies).split(",") if p.strip()]
    unknown = sorted({m for m, _ in configs} - set(MODES))
    if unknown:
        raise SystemExit(f"specdec bench: unknown --policies {', '.join(unknown)} ({', '.join(MODES)})")
    drafters = [d.strip() for d in str(a.drafters).split(",") if d.strip()] or [""]
    rows: list[dict[str, Any]] = []
    llama_best: list[tuple[dict[str, Any], dict[str, Any], list[int]]] = []  # (prompt, fastest run, OFF's ids)
    with grpc.insecure_channel(orch) as ch:
        stub = orchestrator_pb2_grpc.OrchestratorStub(ch)
        for d in drafters:
            _generate(stub, {"prompt": "hello", "chat": False}, "fixed", 2, 4, d)  # warm-up
        for prompt in prompts:
            schedule = [("off", 0, "")] + [(mode, g, d) for d in drafters for mode, g in configs]
            schedule += [LLAMACPP] if llama is not None else []
            passes: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
            runs = _best_of_rounds(stub, prompt, schedule, a.max_new_tokens, a.repeats, llama, passes)
            ref = runs[("off", 0, "")]
            if llama is not None:
                llama_best.append((prompt, runs[LLAMACPP], ref["token_ids"]))
            t_target = (ref["verify_ms"] - ref["prefill_ms"]) / max(1, ref["rounds"])  # a plain step, prefill out
            for drafter in drafters:
                for mode, g in configs:
                    run = runs[(mode, g, drafter)]
                    t_draft_tok = run["draft_ms"] / max(1, run["draft_tokens"])
                    c = t_draft_tok / t_target if t_target > 0 else float("nan")
                    spec_rounds = [x for x in run["gamma_trajectory"] if x > 0]
                    g_eff = g or max(1, round(statistics.fmean(spec_rounds))) if spec_rounds else max(g, 1)
                    alpha = alpha_from_mean(run["mean_accepted_length"], g_eff)
                    _, bound = leviathan(alpha, g_eff, c)
                    rounds = max(1, run["rounds"])
                    row = {
                        "prompt": prompt["id"], "category": prompt["category"], "mode": mode, "gamma": g,
                        "drafter": run["drafter"] or drafter,
                        "tokens": run["tokens"], "baseline_tokens": ref["tokens"],
                        "baseline_tok_s": ref["tokens_per_second"], "spec_tok_s": run["tokens_per_second"],
                        "speedup": run["tokens_per_second"] / ref["tokens_per_second"] if ref["tokens_per_second"] else 0.0,
                        "baseline_ttft_ms": ref["ttft_ms"], "spec_ttft_ms": run["ttft_ms"],
                        "baseline_decode_tok_s": ref["decode_tokens_per_second"],
                        "spec_decode_tok_s": run["decode_tokens_per_second"],
                        "decode_speedup": (run["decode_tokens_per_second"] / ref["decode_tokens_per_second"]
                                           if ref["decode_tokens_per_second"] else 0.0),
                        "acceptance_rate": run["acceptance_rate"], "alpha": alpha,
                        "mean_accepted_length": run["mean_accepted_length"], "c": c,
                        "leviathan_bound": bound,
                        "t_target_step_ms": t_target, "t_draft_token_ms": t_draft_tok,
                        "round_draft_ms": run["draft_ms"] / rounds,
                        "round_verify_ms": (run["verify_ms"] - run["prefill_ms"]) / rounds,
                        "prefill_ms": run["prefill_ms"],
                        "round_overhead_ms": run["overhead_ms"] / rounds,
                        "identical": run["token_ids"] == ref["token_ids"],
                        "divergence": _divergence(ref, run),
                        "draft_failures": run["draft_failures"],
                        "gamma_trajectory": run["gamma_trajectory"],
                        "accepted_per_round": run["accepted_per_round"],
                        "acceptance_per_position": acceptance_per_position(run["gamma_trajectory"], run["accepted_per_round"]),
                        "baseline_text": ref["text"], "spec_text": run["text"],
                        "decode_speedup_paired": paired_ratio(passes[(mode, g, drafter)], passes[("off", 0, "")],
                                                              "decode_tokens_per_second"),
                    }
                    if llama is not None:  # decode tok/s over llama.cpp's of the same pass
                        row["off_vs_llamacpp_paired"] = paired_ratio(passes[("off", 0, "")], passes[LLAMACPP],
                                                                     "decode_tokens_per_second", "decode_tok_s")
                        row["spec_vs_llamacpp_paired"] = paired_ratio(passes[(mode, g, drafter)], passes[LLAMACPP],
                                                                      "decode_tokens_per_second", "decode_tok_s")
                    rows.append(row)
                    print(md_row(row), flush=True)
    curve = {} if a.no_cost_curve else cost_curve(target)
    res = {"rows": rows, "verify_cost_ms": curve, "max_new_tokens": a.max_new_tokens, "configs": configs}
    if llama is not None:
        res["llamacpp"] = llama.report(llama_best)
    return res


@contextlib.contextmanager
def launched_stack(
    a: argparse.Namespace, extra: Sequence[str] = (), base_port: int = 50061, log: Path | None = None
) -> Iterator[tuple["subprocess.Popen[bytes]", dict[str, str]]]:
    """Runs `specdec up` (orchestrator on ``base_port``, draft +1, target +2)
    with ``a``'s model flags, ``extra`` flags and ``a.up_args``; yields the
    process and the service addresses once all are SERVING, stops it after.
    ``log``: the stack's output goes to this file (appended) instead of ours."""
    ready = Path(tempfile.mkdtemp()) / "ready.json"
    cmd = [sys.executable, "-m", "specdec_app.cli", "up", "--ready-file", str(ready),
           "--port", str(base_port), "--draft-port", str(base_port + 1), "--target-port", str(base_port + 2)]
    if "--target-dtype" not in extra:
        cmd += ["--target-dtype", a.target_dtype, "--target-backend", getattr(a, "target_backend", "auto")]
    if a.target_model:
        cmd += ["--target-model", a.target_model]
    if a.draft_model:
        cmd += ["--draft-model", a.draft_model]
    if a.cache_dir:
        cmd += ["--cache-dir", str(a.cache_dir)]
    cmd += list(extra) + shlex.split(a.up_args)
    out = open(log, "ab") if log is not None else None  # noqa: SIM115 (the child holds it)
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT if out is not None else None)
    if out is not None:
        out.close()
    try:
        while not ready.exists():
            if proc.poll() is not None:
                raise SystemExit(f"specdec up failed{f' (its output: {log})' if log is not None else ''}")
            time.sleep(1)
        yield proc, json.loads(ready.read_text())
    finally:
        stop(proc, 60)


def stop(proc: "subprocess.Popen[bytes]", timeout_s: float) -> None:
    """SIGTERM, then SIGKILL after ``timeout_s``."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()


def target_numerics(target_address: str) -> dict[str, Any]:
    """The target's chosen numerics and calibration (GetModelInfo)."""
    import grpc

    from specdec.v1 import common_pb2, target_pb2_grpc

    with grpc.insecure_channel(target_address) as ch:
        info = target_pb2_grpc.TargetStub(ch).GetModelInfo(common_pb2.ModelInfoRequest(), timeout=30)

    def fid(f: Any) -> dict[str, Any] | None:
        if not f.positions:
            return None
        return {"positions": f.positions, "mean_kl": f.mean_kl, "p99_kl": f.p99_kl, "max_kl": f.max_kl,
                "top1_agreement": f.top1_agreement}

    return {
        "dtype": info.dtype, "backend": info.backend, "chosen_by": info.numerics_chosen_by, "cpu_isa": info.cpu_isa,
        "device": info.device, "forward_cost_ms": {p.tokens: p.ms for p in info.forward_cost},
        "fidelity": fid(info.fidelity),
        "calibrated": {f"{c.dtype}/{c.backend}": {"score_tok_s": c.score_tokens_per_s,
                                                  "forward_cost_ms": {p.tokens: p.ms for p in c.forward_cost},
                                                  "fidelity": fid(c.fidelity), "admissible": c.admissible}
                       for c in info.calibrated},
    }


def machine_meta() -> dict[str, Any]:
    """The machine the bench runs on (with --launch, the services' machine too)."""
    import os
    import platform

    import torch

    from target_service.backends import cpu_info

    cpu = cpu_info()
    return {"cpu": cpu.model, "isa": cpu.isa, "isa_flags": list(cpu.flags), "machine": platform.machine(),
            "cpus": os.cpu_count(), "torch": torch.__version__,
            "isa_env": {k: os.environ[k] for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
                        if k in os.environ}}


def off_baselines(a: argparse.Namespace, prompts: list[dict[str, Any]], pairs: Sequence[str]) -> dict[str, dict[str, float]]:
    """Target-only tokens/s per prompt under each (dtype, backend) in
    ``pairs``, each on its own launched target-only stack: what a user would
    run instead of speculation on this machine."""
    import grpc

    from specdec.v1 import orchestrator_pb2_grpc

    out: dict[str, dict[str, float]] = {}
    for key in pairs:
        dtype, backend = key.split("/")
        print(f"[bench] target-only baseline under {key}", flush=True)
        with launched_stack(a, ["--target-dtype", dtype, "--target-backend", backend, "--no-draft"], base_port=50071) as (_, addrs):
            with grpc.insecure_channel(addrs["orchestrator"]) as ch:
                stub = orchestrator_pb2_grpc.OrchestratorStub(ch)
                _generate(stub, {"prompt": "hello", "chat": False}, "off", 0, 4)  # warm-up
                out[key] = {}
                for prompt in prompts:
                    best = max(_generate(stub, prompt, "off", 0, a.max_new_tokens)["tokens_per_second"]
                               for _ in range(max(1, a.repeats)))
                    out[key][prompt["id"]] = best
                    print(f"[bench]   {prompt['id']}: {best:.2f} tok/s", flush=True)
    return out


def baseline_pairs(numerics: dict[str, Any], which: str) -> tuple[list[str], dict[str, str]]:
    """The calibrated pairs (other than the stack's own) to run target-only,
    and why the others were skipped."""
    chosen = f"{numerics['dtype']}/{numerics['backend']}"
    cal = {k: v for k, v in numerics["calibrated"].items()}
    others = [k for k in cal if k != chosen]
    if which == "all":
        return others, {}
    if which != "near":
        wanted = [k.strip() for k in which.split(",") if k.strip()]
        return [k for k in wanted if k != chosen], {k: "not asked for" for k in others if k not in wanted}
    step = {k: float(v["forward_cost_ms"].get(1, v["forward_cost_ms"].get("1", 0.0)) or 0.0) for k, v in cal.items()}
    fastest = min((s for s in step.values() if s > 0), default=0.0)
    keep = [k for k in others if step[k] <= 1.25 * fastest or fastest <= 0]
    return keep, {k: f"its 1-token step ({step[k]:.0f} ms) is > 1.25x the fastest ({fastest:.0f} ms)"
                  for k in others if k not in keep}


def add_fastest_baseline(res: dict[str, Any], baselines: dict[str, dict[str, float]]) -> None:
    """Every row's speedup against the fastest target-only run of its prompt
    on this machine: this stack's OFF or OFF under another (dtype, backend)."""
    chosen = f"{res['numerics']['dtype']}/{res['numerics']['backend']}"
    for r in res["rows"]:
        offs = {chosen: r["baseline_tok_s"], **{k: v[r["prompt"]] for k, v in baselines.items() if r["prompt"] in v}}
        best = max(offs, key=lambda k: offs[k])
        r["fastest_off"] = best
        r["fastest_off_tok_s"] = offs[best]
        r["speedup_vs_fastest_off"] = r["spec_tok_s"] / offs[best] if offs[best] else 0.0
    res["off_baselines"] = baselines


def _llama(a: argparse.Namespace) -> Any:
    """llama.cpp target-only for ``--llamacpp-bin`` (a context manager), or a null context."""
    if a.llamacpp_bin is None:
        return contextlib.nullcontext()
    from specdec.models import default_cache_dir, resolve
    from specdec.models.spec import DEFAULT_TARGET
    from specdec_app.llamacpp import Interleaved, model_files

    spec, cache = a.target_model or DEFAULT_TARGET, a.cache_dir or default_cache_dir()
    if a.llamacpp_model is None:
        gguf, hf_dir = model_files(spec, cache)
    else:
        gguf, hf_dir = a.llamacpp_model, resolve(spec, cache).hf_dir
    return Interleaved(a.llamacpp_bin, gguf, hf_dir, a.llamacpp_threads, a.out)


def main(a: argparse.Namespace) -> int:
    a.out.mkdir(parents=True, exist_ok=True)
    if a.launch:
        with launched_stack(a) as (_, addrs), _llama(a) as llama:
            numerics = target_numerics(addrs["target"])
            res = run_bench(a, addrs["orchestrator"], addrs["target"], llama)
        res["numerics"] = numerics
        others, skipped = baseline_pairs(numerics, a.baseline_pairs)
        res["baselines_skipped"] = skipped
        if others and not a.no_fastest_baseline:
            add_fastest_baseline(res, off_baselines(a, select_prompts(a), others))
    else:
        with _llama(a) as llama:
            res = run_bench(a, a.address, a.target_address, llama)
        res["numerics"] = target_numerics(a.target_address)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), **machine_meta(),
            "target_dtype": res["numerics"]["dtype"], "target_backend": res["numerics"]["backend"],
            "target_numerics_chosen_by": res["numerics"]["chosen_by"],
            "target_fidelity": res["numerics"].get("fidelity"), "max_new_tokens": a.max_new_tokens,
            "command": " ".join(sys.argv)}
    res["meta"] = meta
    (a.out / "results.json").write_text(json.dumps(res, indent=2))
    md = to_markdown(res, meta)
    (a.out / "results.md").write_text(md)
    for p in plots(res, a.out):
        print(f"wrote {p}")
    print(md)
    llama_res = res.get("llamacpp")
    if llama_res is not None:
        llama_res["meta"] = {**meta, **llama_res["meta"]}
        (a.out / "llamacpp.json").write_text(json.dumps(llama_res, indent=2))
    elif a.llamacpp:
        llama_res = json.loads(a.llamacpp.read_text())
    if llama_res is not None:
        from specdec_app.bench_compare import write

        for p in write(res, llama_res, a.out):
            print(f"wrote {p}")
    return 0
