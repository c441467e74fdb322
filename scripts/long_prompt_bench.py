#!/usr/bin/env python
"""Long prompts and prefix reuse (issue 26), against a stack it launches
(``specdec up``, default flags plus ``--up-args``; ``--tiny`` for the tests'
tiny random-weight models).

1. **TTFT against prompt length** (``--lengths``, default 250, 500, 1000,
   2000, 4000 tokens): prompts of exactly that many target tokens from a
   fixed corpus (scripts/longctx.py), each cold (no prefix shared with any
   earlier request), ``--repeats`` of each (the median is reported). TTFT is
   the client's (send to the first chunk with tokens); the server's
   ``GenerationStats.time_to_first_token_ms`` and ``prefill_ms`` beside it.
2. **Co-tenant gap**: one stream generating (mode OFF, ignore_eos), then a
   second client sends a ``--cotenant-prompt-tokens`` (4,000) prompt. The
   running stream's inter-chunk gaps: median (over the whole stream), the
   longest while the long prompt was being prefilled (its send to its first
   token) and overall, max/median (criterion: <= 3), and the long prompt's
   TTFT. The stream is cancelled a few chunks after the long prompt's first
   token.
3. **Prefix reuse**: (a) a chat whose first user turn holds a
   ``--chat-history-tokens`` (1,000) document: turn 1's TTFT, then turn 2 =
   turn 1's messages + its reply + a new user message: turn 2's TTFT over
   turn 1's (criterion: <= 15 %); (b) two requests sharing a
   ``--system-prompt-tokens`` (500) system prompt with different questions:
   the second's TTFT over the first's (criterion: <= 25 %). Each reports
   ``GenerationStats.cached_prompt_tokens`` (and the draft's) and the hit
   rate of the target's ``specdec_target_prefix_cache_*_tokens_total``
   counters over the part (None until the target exports them).

Writes long_prompt.json, long_prompt.md and ttft_vs_length.png,
cotenant_gaps.png, prefix_reuse.png into --out (service output in
OUT/logs/up.log); progress on stderr. The exit status is 0 when every part
ran (criteria are reported, not enforced: without a prefix cache they fail).

    .venv/bin/python scripts/long_prompt_bench.py --out bench-out/long-prompt
    .venv/bin/python scripts/long_prompt_bench.py --out bench-out/long-prompt-pc --up-args '--target-prefix-cache'
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from longctx import (  # noqa: E402  (scripts/longctx.py)
    Corpus, Launched, Progress, Timed, add_stack_arguments, fmt, launch, load_target_tokenizer, prefix_counters,
    prefix_delta, request, timed_generate, up_label, verdict_cell,
)
from specdec_app.bench import machine_meta, target_numerics  # noqa: E402
from specdec_app.bench_report import pyplot  # noqa: E402

GAP_RATIO_MAX, CHAT_RATIO_MAX, SYSTEM_RATIO_MAX = 3.0, 0.15, 0.25


def ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


# ------------------------------------------------------------------ parts
def ttft_sweep(a: argparse.Namespace, stub: Any, corpus: Corpus, say: Progress) -> list[dict[str, Any]]:
    rows = []
    variant = 100  # every request a fresh variant: cold
    for n in ints(a.lengths):
        runs = []
        for r in range(max(1, a.repeats)):
            variant += 1
            t = timed_generate(stub, request(a, max_new=a.max_new_tokens, prompt_ids=corpus.ids(n, variant)),
                               a.timeout_s)
            runs.append(t)
            say(f"ttft {n} tokens ({r + 1}/{a.repeats}): {t.code} client {fmt(t.ttft_ms)} ms, "
                f"server {fmt(t.stats.get('time_to_first_token_ms'))} ms, prefill {fmt(t.stats.get('prefill_ms'))} ms")
        ok = [t for t in runs if t.code == "OK" and t.ttft_ms is not None]
        rows.append({"prompt_tokens": n, "runs": [t.summary() for t in runs], "ok": len(ok) == len(runs),
                     "ttft_ms": statistics.median([t.ttft_ms for t in ok]) if ok else None,  # type: ignore[misc]
                     "server_ttft_ms": statistics.median([t.stats["time_to_first_token_ms"] for t in ok]) if ok else None,
                     "prefill_ms": statistics.median([t.stats["prefill_ms"] for t in ok]) if ok else None,
                     "cached_prompt_tokens": [t.stats.get("cached_prompt_tokens") for t in ok]})
    return rows


def cotenant(a: argparse.Namespace, stub: Any, corpus: Corpus, say: Progress) -> dict[str, Any]:
    """The running stream's gaps around a long prompt's prefill."""
    started, long_first = threading.Event(), threading.Event()
    live: dict[str, Timed] = {}  # the stream's Timed while it runs
    at_first: list[int] = []  # the stream's chunk count when the long prompt's first token came

    def stream_hook(t: Timed) -> bool:
        live["t"] = t
        if len(t.chunk_s) >= a.cotenant_lead_chunks:
            started.set()
        return long_first.is_set() and len(t.chunk_s) >= at_first[0] + a.cotenant_tail_chunks

    def long_hook(t: Timed) -> bool:
        if t.chunk_s and not long_first.is_set():
            at_first.append(len(live["t"].chunk_s) if "t" in live else 0)
            long_first.set()
        return False

    def run_stream() -> None:
        req = request(a, max_new=a.cotenant_stream_tokens, mode="off", prompt_ids=corpus.ids(a.cotenant_stream_prompt, 7))
        live["t"] = timed_generate(stub, req, a.timeout_s, stream_hook)
        started.set()  # a stream that ended early must not leave the long prompt waiting

    th = threading.Thread(target=run_stream, daemon=True)
    th.start()
    started.wait(a.timeout_s)
    say(f"cotenant: stream running; sending a {a.cotenant_prompt_tokens}-token prompt")
    long_req = request(a, max_new=a.max_new_tokens, prompt_ids=corpus.ids(a.cotenant_prompt_tokens, 8))
    sent = time.perf_counter()
    long_t = timed_generate(stub, long_req, a.timeout_s, long_hook)
    if not long_first.is_set():  # no token came: let the stream stop at its next chunk
        at_first.append(0)
        long_first.set()
    th.join(a.timeout_s)
    s = live["t"]
    pairs = list(zip(s.chunk_s, s.chunk_s[1:]))
    gaps = [b - x for x, b in pairs]
    rel_send = sent - s.sent_at
    rel_first = rel_send + (long_t.ttft_ms or 0) / 1e3
    during = [b - x for x, b in pairs if b >= rel_send and x <= rel_first]
    med = statistics.median(gaps) * 1e3 if gaps else None
    mx = max(gaps) * 1e3 if gaps else None
    mx_during = max(during) * 1e3 if during else None
    outlived = bool(s.chunk_s) and s.chunk_s[-1] >= rel_first
    ratio = mx / med if med and mx is not None else None
    say(f"cotenant: stream {s.code}, {len(s.chunk_s)} chunks, gap median {fmt(med, '.1f')} ms, "
        f"max {fmt(mx, '.1f')} ms (during the prefill {fmt(mx_during, '.1f')} ms); "
        f"long prompt {long_t.code}, TTFT {fmt(long_t.ttft_ms)} ms")
    return {"stream": s.summary(), "long_prompt": long_t.summary(), "long_prompt_tokens": a.cotenant_prompt_tokens,
            "gap_ms_median": med, "gap_ms_max": mx, "gap_ms_max_during_prefill": mx_during,
            "gap_ratio_max_over_median": ratio, "stream_outlived_prefill": outlived,
            "long_prompt_ttft_ms": long_t.ttft_ms, "long_prompt_sent_s": rel_send,
            "long_prompt_first_token_s": rel_first, "stream_chunk_s": s.chunk_s, "limit": GAP_RATIO_MAX,
            # the stream must still be running when the long prompt's first token comes, or the gaps miss it
            "pass": (ratio <= GAP_RATIO_MAX and outlived and long_t.code == "OK") if ratio is not None else None}


CHAT_QUESTIONS = [("What is this text about?", "And what did the keeper hear at night?"),
                  ("Summarise the text in one sentence.", "Who guides the ships through the banks?"),
                  ("Which places does the text describe?", "Why did the boats disappear?")]
SYSTEM_QUESTIONS = [("Where does the path along the river end?", "Why does the valley flood less today?"),
                    ("What did the miller write down?", "What do the pupils count every autumn?"),
                    ("How long is the walk to the sea?", "What sound does the horn make in fog?")]


def prefix_reuse(a: argparse.Namespace, st: Launched, stub: Any, corpus: Corpus, say: Progress) -> dict[str, Any]:
    """(a) chat turn 2 over turn 1, (b) the second of two requests sharing a system prompt over the
    first; ``a.repeats`` times each with fresh prompts (the median ratio counts)."""
    c = corpus.clean
    runs: dict[str, list[dict[str, Any]]] = {"chat": [], "system_prompt": []}
    cache: dict[str, dict[str, Any]] = {}
    before = prefix_counters(st.metrics())
    for r in range(max(1, a.repeats)):
        q1, q2 = CHAT_QUESTIONS[r % len(CHAT_QUESTIONS)]
        turn1 = [("system", c("You are a careful assistant. Answer briefly.")),
                 ("user", f"{corpus.text(a.chat_history_tokens, 201 + r)}\n\n{c(q1)}")]
        t1 = timed_generate(stub, request(a, max_new=a.reply_tokens, messages=turn1), a.timeout_s)
        turn2 = turn1 + [("assistant", t1.text), ("user", c(q2))]
        t2 = timed_generate(stub, request(a, max_new=a.reply_tokens, messages=turn2), a.timeout_s)
        runs["chat"].append(ratio_run(t1, t2))
        say(f"prefix chat ({r + 1}/{a.repeats}): turn 1 {t1.code} {fmt(t1.ttft_ms)} ms "
            f"({t1.stats.get('prompt_tokens')} tokens), turn 2 {t2.code} {fmt(t2.ttft_ms)} ms "
            f"({t2.stats.get('prompt_tokens')} tokens, {t2.stats.get('cached_prompt_tokens')} cached)")
    cache["chat"], before = prefix_delta(before, prefix_counters(st.metrics())), prefix_counters(st.metrics())
    for r in range(max(1, a.repeats)):
        system = corpus.text(a.system_prompt_tokens, 301 + r)
        s1, s2 = (timed_generate(stub, request(a, max_new=a.max_new_tokens, messages=[("system", system), ("user", c(q))]),
                                 a.timeout_s) for q in SYSTEM_QUESTIONS[r % len(SYSTEM_QUESTIONS)])
        runs["system_prompt"].append(ratio_run(s1, s2))
        say(f"prefix system prompt ({r + 1}/{a.repeats}): first {s1.code} {fmt(s1.ttft_ms)} ms, second {s2.code} "
            f"{fmt(s2.ttft_ms)} ms ({s2.stats.get('cached_prompt_tokens')} cached)")
    cache["system_prompt"] = prefix_delta(before, prefix_counters(st.metrics()))
    limits = {"chat": CHAT_RATIO_MAX, "system_prompt": SYSTEM_RATIO_MAX}
    return {k: ratio_part(v, limits[k], cache[k]) for k, v in runs.items()}


def ratio_run(first: Timed, second: Timed) -> dict[str, Any]:
    ok = first.code == second.code == "OK" and bool(first.ttft_ms) and second.ttft_ms is not None
    return {"first": first.summary(), "second": second.summary(),
            "ratio": second.ttft_ms / first.ttft_ms if ok else None}  # type: ignore[operator]


def ratio_part(runs: list[dict[str, Any]], limit: float, cache: dict[str, Any]) -> dict[str, Any]:
    """The median over the runs (None when one failed); the last run's requests as first/second."""
    ok = all(r["ratio"] is not None for r in runs)

    def med(xs: list[Any]) -> Any:
        return statistics.median(xs) if ok else None

    ratio = med([r["ratio"] for r in runs])
    last = runs[-1]
    return {"runs": runs, "first": last["first"], "second": last["second"], "ratio": ratio, "limit": limit,
            "first_ttft_ms": med([r["first"]["ttft_ms"] for r in runs]),
            "second_ttft_ms": med([r["second"]["ttft_ms"] for r in runs]),
            "second_cached_prompt_tokens": min(r["second"].get("cached_prompt_tokens", 0) for r in runs),
            "second_draft_cached_prompt_tokens": min(r["second"].get("draft_cached_prompt_tokens", 0) for r in runs),
            "prefix_cache": cache, "pass": ratio <= limit if ratio is not None else None}


# ----------------------------------------------------------------- report
def to_markdown(res: dict[str, Any]) -> str:
    m = res["meta"]
    lines = [f"# Long prompts and prefix reuse ({m['date']})", "",
             f"Target {m['target_model']} ({m.get('target_dtype', '?')}/{m.get('target_backend', '?')}), "
             f"mode {m['mode']}, `specdec up` {up_label(m['tiny'], m['up_args'])}; machine {m.get('cpu', '?')}, {m.get('cpus')} CPUs.", "",
             "## TTFT against prompt length (cold)", "",
             "| prompt tokens | TTFT ms (client) | TTFT ms (server) | prefill ms | runs OK |", "|---|---|---|---|---|"]
    for r in res["ttft"]:
        lines.append(f"| {r['prompt_tokens']} | {fmt(r['ttft_ms'])} | {fmt(r['server_ttft_ms'])} | "
                     f"{fmt(r['prefill_ms'])} | {'yes' if r['ok'] else 'NO'} |")
    c = res["cotenant"]
    lines += ["", f"## Co-tenant: a {c['long_prompt_tokens']}-token prompt while a stream generates (OFF)", "",
              "| gap median ms | gap max ms | max during the prefill ms | max / median | long prompt TTFT ms "
              f"| stream outlived the prefill | ≤ {GAP_RATIO_MAX:g}× |", "|---|---|---|---|---|---|---|",
              f"| {fmt(c['gap_ms_median'], '.1f')} | {fmt(c['gap_ms_max'], '.1f')} | "
              f"{fmt(c['gap_ms_max_during_prefill'], '.1f')} | {fmt(c['gap_ratio_max_over_median'], '.2f')} | "
              f"{fmt(c['long_prompt_ttft_ms'])} | {'yes' if c['stream_outlived_prefill'] else 'NO'} | "
              f"{verdict_cell(c['pass'])} |"]
    lines += ["", f"## Prefix reuse (median of {len(res['prefix']['chat']['runs'])} runs)", "",
              "| case | first TTFT ms | second TTFT ms | ratio | limit | cached prompt tokens (target / draft) "
              "| prefix-cache hit rate | verdict |", "|---|---|---|---|---|---|---|---|"]
    for name, p in (("chat turn 2 / turn 1", res["prefix"]["chat"]),
                    ("shared system prompt, 2nd / 1st", res["prefix"]["system_prompt"])):
        hr = p["prefix_cache"]["hit_rate"]
        lines.append(f"| {name} | {fmt(p['first_ttft_ms'])} | {fmt(p['second_ttft_ms'])} | {fmt(p['ratio'], '.2f')} | "
                     f"{p['limit']:.2f} | {p['second_cached_prompt_tokens']} / {p['second_draft_cached_prompt_tokens']} | "
                     f"{'not exported' if hr is None else f'{hr:.0%}'} | {verdict_cell(p['pass'])} |")
    return "\n".join(lines) + "\n"


def plots(res: dict[str, Any], out: Path) -> list[Path]:
    plt = pyplot()
    if plt is None:
        return []
    paths = []
    fig, ax = plt.subplots(figsize=(6, 4))
    rows = [r for r in res["ttft"] if r["ttft_ms"] is not None]
    ax.plot([r["prompt_tokens"] for r in rows], [r["ttft_ms"] for r in rows], "o-", label="client")
    ax.plot([r["prompt_tokens"] for r in rows], [r["server_ttft_ms"] for r in rows], "s--", label="server")
    ax.plot([r["prompt_tokens"] for r in rows], [r["prefill_ms"] for r in rows], "^:", label="target prefill compute")
    ax.set(xlabel="prompt tokens", ylabel="ms", title="time to first token (cold prompts)")
    ax.set_ylim(bottom=0)
    ax.legend()
    fig.tight_layout()
    paths.append(out / "ttft_vs_length.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    c = res["cotenant"]
    fig, ax = plt.subplots(figsize=(8, 4))
    ts = c["stream_chunk_s"]
    ax.plot(ts[1:], [(b - x) * 1e3 for x, b in zip(ts, ts[1:])], ".-", label="running stream's inter-chunk gap")
    ax.axvspan(c["long_prompt_sent_s"], c["long_prompt_first_token_s"], color="C1", alpha=0.2,
               label=f"{c['long_prompt_tokens']}-token prompt: send to first token")
    if c["gap_ms_median"]:
        ax.axhline(GAP_RATIO_MAX * c["gap_ms_median"], color="C3", ls="--", label=f"{GAP_RATIO_MAX:g}× median gap")
    ax.set(xlabel="seconds since the stream's request", ylabel="gap (ms)", title="co-tenant stream during a long prefill")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out / "cotenant_gaps.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    cases = [("chat", res["prefix"]["chat"]), ("system prompt", res["prefix"]["system_prompt"])]
    xs = range(len(cases))
    ax.bar([x - 0.2 for x in xs], [p["first_ttft_ms"] or 0 for _, p in cases], 0.4, label="first (cold)")
    ax.bar([x + 0.2 for x in xs], [p["second_ttft_ms"] or 0 for _, p in cases], 0.4, label="second (shared prefix)")
    ax.set_xticks(list(xs), [n for n, _ in cases])
    ax.set(ylabel="TTFT (ms)", title="prefix reuse")
    ax.legend()
    fig.tight_layout()
    paths.append(out / "prefix_reuse.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    add_stack_arguments(p)
    p.add_argument("--lengths", default="250,500,1000,2000,4000", help="TTFT sweep: prompt tokens (%(default)s)")
    p.add_argument("--repeats", type=int, default=2, help="cold runs per length; the median counts (%(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=8, help="tokens of each TTFT request (%(default)s)")
    p.add_argument("--cotenant-prompt-tokens", type=int, default=4000, help="%(default)s")
    p.add_argument("--cotenant-stream-prompt", type=int, default=64, help="the running stream's prompt tokens")
    p.add_argument("--cotenant-stream-tokens", type=int, default=2048,
                   help="the running stream's max_new_tokens (it is cancelled once the long prompt's first "
                        "token is in and --cotenant-tail-chunks more came) (%(default)s)")
    p.add_argument("--cotenant-lead-chunks", type=int, default=16,
                   help="the stream's chunks before the long prompt is sent (%(default)s)")
    p.add_argument("--cotenant-tail-chunks", type=int, default=16, help="%(default)s")
    p.add_argument("--chat-history-tokens", type=int, default=1000, help="turn 1's document (%(default)s)")
    p.add_argument("--reply-tokens", type=int, default=64, help="turn 1's reply (%(default)s)")
    p.add_argument("--system-prompt-tokens", type=int, default=500, help="%(default)s")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    import grpc

    from specdec.v1 import orchestrator_pb2_grpc

    a = parse_args(argv)
    say = Progress("long-prompt")
    with launch(a, say) as st:
        numerics = target_numerics(st.addresses["target"])
        corpus = Corpus(load_target_tokenizer(st), a.tiny)
        with grpc.insecure_channel(st.addresses["orchestrator"]) as ch:
            stub = orchestrator_pb2_grpc.OrchestratorStub(ch)
            for warm_req in (request(a, max_new=4, prompt_ids=corpus.ids(16, 1)),  # both prompt paths, untimed
                             request(a, max_new=4, messages=[("system", corpus.clean("Be brief.")),
                                                             ("user", corpus.text(16, 2))])):
                warm = timed_generate(stub, warm_req, a.timeout_s)
                say(f"warm-up: {warm.code} {warm.details}")
            before = prefix_counters(st.metrics())
            res: dict[str, Any] = {"ttft": ttft_sweep(a, stub, corpus, say)}
            res["ttft_prefix_cache"] = prefix_delta(before, prefix_counters(st.metrics()))
            res["cotenant"] = cotenant(a, stub, corpus, say)
            res["prefix"] = prefix_reuse(a, st, stub, corpus, say)
    res["meta"] = {"date": time.strftime("%Y-%m-%d %H:%M"), **machine_meta(), "target_model": st.target_model,
                   "target_dtype": numerics["dtype"], "target_backend": numerics["backend"], "mode": a.mode,
                   "tiny": a.tiny, "up_args": a.up_args, "command": " ".join(sys.argv)}
    res["criteria"] = {"cotenant_gap_ratio": res["cotenant"]["pass"], "chat_turn2_ratio": res["prefix"]["chat"]["pass"],
                       "system_prompt_ratio": res["prefix"]["system_prompt"]["pass"]}
    (a.out / "long_prompt.json").write_text(json.dumps(res, indent=1))
    md = to_markdown(res)
    (a.out / "long_prompt.md").write_text(md)
    for p in plots(res, a.out):
        say(f"wrote {p}")
    say(f"wrote {a.out / 'long_prompt.json'} and {a.out / 'long_prompt.md'}")
    print(md)
    ran = all(r["ok"] for r in res["ttft"]) and res["cotenant"]["long_prompt"]["code"] == "OK" and all(
        p[k]["code"] == "OK" for p in res["prefix"].values() for k in ("first", "second"))
    return 0 if ran else 1


if __name__ == "__main__":
    sys.exit(main())
