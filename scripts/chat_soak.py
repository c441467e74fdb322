#!/usr/bin/env python
"""Chat soak (issue 26): ``--chats`` (16) concurrent multi-turn chats for
``--duration-s`` (300) against a stack it launches (``specdec up``, default
flags plus ``--up-args``; ``--tiny`` for the tests' tiny random-weight models).

The chats share ``--system-prompts`` (3) system prompts of
``--system-prompt-tokens`` each. Every turn sends the whole conversation
(system prompt, earlier user turns and replies) plus a new user turn of
``--user-turn-tokens`` from a fixed corpus; the reply (``--reply-tokens``,
ignore_eos) is appended for the next turn. A chat whose next turn would pass
``--max-history-tokens`` starts over with the same system prompt.

Sampled every ``--sample-interval-s``: each service process's RSS (psutil
when installed, else /proc's VmRSS) and, from the target's /metrics, KV
usage against its budget (``specdec_target_kv_used_tokens`` /
``specdec_target_kv_budget_tokens``; None while the target does not export
them), active sessions, evictions and the prefix-cache counters.

Verdicts (PASS / FAIL / not measured in the JSON and the markdown; the exit
status is 1 when one FAILs):

- ``streams_complete``: every request finished OK (finish reason LENGTH or EOS);
- ``no_active_session_lost``: no request's ``GenerationStats.target_rebuilds``
  is > 0, and the orchestrator's ``specdec_target_session_rebuilds_total``
  did not grow (a target session evicted mid-request is rebuilt);
- ``kv_within_budget``: the KV gauge never passed the budget gauge (not
  measured when the target exports neither);
- ``rss_growth``: each service's RSS level grew < ``--rss-limit`` (5 %) from
  the end of the warm-up to the end of the run: the median of the last
  ``--level-window-s`` (60 s) of each. The peaks (warm-up, after) are
  reported beside it: they include transient buffers (a batched verify's
  logits, a prefill chunk's activations) that come and go with the batch
  of the moment, so one sample says little about growth.

Warm-up: a long-running server lives with its KV budget full (the prefix
cache keeps entries until room is needed), so RSS is judged from that state
on, not while the caches are still filling. The chats run from the start;
the warm-up ends ``--level-window-s`` after the first sample, at least
``--warmup-s`` in, where the target's KV gauge holds ``--warmup-kv-fill``
(95 %) of its budget (so the baseline level is taken with the budget full),
or at ``--warmup-max-s`` (the report then says the budget was not reached).
The measured ``--duration-s`` follows. ``--kv-budget-tokens`` (24,576 by
default, for target and draft; 0 = the services' own 65,536) sets a budget
this machine fills in a few minutes: at 65,536 tokens the 2-core VM needs
most of an hour to get there. The JSON also has each service's RssAnon and
RssFile (Linux), to tell heap growth from file pages (weights) paged in.

Writes chat_soak.json, chat_soak.md and chat_soak.png (RSS and KV usage
over time) into --out; service output in OUT/logs/up.log; progress on stderr.

    .venv/bin/python scripts/chat_soak.py --out bench-out/chat-soak
    .venv/bin/python scripts/chat_soak.py --out bench-out/chat-soak-fixed --warmup-kv-fill 0 --warmup-s 60
    .venv/bin/python scripts/chat_soak.py --out bench-out/chat-soak-pc --up-args '--target-prefix-cache'
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from longctx import (  # noqa: E402  (scripts/longctx.py)
    ACTIVE_SESSIONS, EVICTIONS, KV_BUDGET, KV_USED, Corpus, Launched, Progress, add_stack_arguments, fmt, launch,
    load_target_tokenizer, metric, prefix_counters, prefix_delta, request, timed_generate, up_label, verdict_cell,
)
from specdec_app.bench import machine_meta  # noqa: E402
from specdec_app.bench_report import pyplot  # noqa: E402
from specdec_app.loadbench import RssSampler, percentile  # noqa: E402

REBUILDS = "specdec_target_session_rebuilds_total"  # the orchestrator's


def mib(nbytes: float | None) -> float | None:
    return None if nbytes is None else round(nbytes / 2**20, 1)


def proc_rss_kinds(pid: int) -> tuple[int | None, int | None]:
    """(RssAnon, RssFile) of ``pid`` in MiB from /proc (None where unreadable)."""
    got: dict[str, int] = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, val = line.partition(":")
            if key in ("RssAnon", "RssFile"):
                got[key] = int(val.split()[0]) // 1024
    except (OSError, ValueError):
        pass
    return got.get("RssAnon"), got.get("RssFile")


class Soak:
    def __init__(self, a: argparse.Namespace, st: Launched, corpus: Corpus, say: Progress) -> None:
        self.a, self.st, self.corpus, self.say = a, st, corpus, say
        self.results: list[dict[str, Any]] = []
        self.samples: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()  # ends the sampling threads
        self.done = threading.Event()  # ends the chats (after their request in flight)
        self.warm_end_s: float | None = None
        self.filled_at: float | None = None
        self.warm_end_why = ""
        self.proc_series: dict[str, list[tuple[float, int | None, int | None]]] = {k: [] for k in st.pids}
        self.t0 = time.monotonic()
        self.systems = [corpus.text(a.system_prompt_tokens, 400 + k) for k in range(a.system_prompts)]

    def now(self) -> float:
        return time.monotonic() - self.t0

    def chat(self, stub: Any, i: int) -> None:
        a = self.a
        system = self.systems[i % len(self.systems)]
        conv, turn, variant = 0, 0, 1000 * (i + 1)
        msgs: list[tuple[str, str]] = []
        while not self.done.is_set():
            if turn == 0:
                msgs = [("system", system)]
            variant += 1
            msgs.append(("user", self.corpus.text(a.user_turn_tokens, variant)))
            start = self.now()
            t = timed_generate(stub, request(a, max_new=a.reply_tokens, messages=msgs), a.timeout_s)
            r = {"chat": i, "conversation": conv, "turn": turn, "start_s": round(start, 3), "end_s": round(self.now(), 3),
                 **t.summary()}
            with self.lock:
                self.results.append(r)
            ok = t.code == "OK" and t.finish_reason in ("LENGTH", "EOS")
            history = int(t.stats.get("prompt_tokens", 0)) + len(t.token_ids)
            if ok and history + a.user_turn_tokens + a.reply_tokens + 16 <= a.max_history_tokens:
                msgs.append(("assistant", t.text))
                turn += 1
            else:  # start over (after a failure too: the verdict counts it)
                conv, turn = conv + 1, 0

    def sampler(self) -> None:
        while not self.stop.is_set():
            m, d = self.st.metrics(), self.st.metrics("draft")
            t = round(self.now(), 2)
            self.samples.append({"t": t, "kv_used_tokens": metric(m, KV_USED),
                                 "kv_budget_tokens": metric(m, KV_BUDGET),
                                 "kv_used_mb": mib(metric(m, "specdec_target_kv_used_bytes")),
                                 "draft_kv_used_tokens": metric(d, "specdec_draft_kv_used_tokens"),
                                 "draft_kv_used_mb": mib(metric(d, "specdec_draft_kv_used_bytes")),
                                 "active_sessions": metric(m, ACTIVE_SESSIONS), "evictions": metric(m, EVICTIONS),
                                 **prefix_counters(m)})
            for name, pid in self.st.pids.items():
                anon, file = proc_rss_kinds(pid)
                self.proc_series[name].append((t, anon, file))
            self.control(t, self.samples[-1])
            self.stop.wait(self.a.sample_interval_s)

    def control(self, t: float, sample: dict[str, Any]) -> None:
        """Ends the warm-up (see the module doc), then the run."""
        a = self.a
        if self.warm_end_s is None:
            used, budget = sample["kv_used_tokens"], sample["kv_budget_tokens"]
            if a.warmup_kv_fill <= 0:
                why = "fixed --warmup-s" if t >= a.warmup_s else ""
            else:
                if (self.filled_at is None and t >= a.warmup_s and used is not None and budget
                        and used >= a.warmup_kv_fill * budget):
                    self.filled_at = t  # the baseline window starts with the budget full
                    self.say(f"KV at {fmt(used)} of {fmt(budget)} tokens at {t:.0f} s")
                why = (f"KV reached {a.warmup_kv_fill:.0%} of its budget at {self.filled_at:.0f} s, then "
                       f"{a.level_window_s:.0f} s" if self.filled_at is not None
                       and t >= self.filled_at + a.level_window_s else "")
            if not why and t >= a.warmup_max_s:
                why = f"--warmup-max-s reached with KV at {fmt(used)} of {fmt(budget)} tokens"
            if why:
                self.warm_end_s, self.warm_end_why = t, why
                self.say(f"warm-up over at {t:.0f} s ({why}); {a.duration_s:.0f} s measured from here")
        elif t >= self.warm_end_s + a.duration_s:
            self.done.set()

    def progress(self) -> None:
        while not self.stop.wait(self.a.progress_every_s):
            with self.lock:
                rs = list(self.results)
            last = self.samples[-1] if self.samples else {}
            self.say(f"{len(rs)} requests, {sum(r['code'] != 'OK' for r in rs)} not OK, "
                     f"{sum(r.get('target_rebuilds', 0) for r in rs)} rebuilds; KV {fmt(last.get('kv_used_tokens'))}"
                     f"/{fmt(last.get('kv_budget_tokens'))}, sessions {fmt(last.get('active_sessions'))}")

    def run(self) -> dict[str, Any]:
        import grpc

        from specdec.v1 import orchestrator_pb2_grpc

        a = self.a
        rebuilds_before = metric(self.st.metrics("orchestrator"), REBUILDS)
        prefix_before = prefix_counters(self.st.metrics())
        with grpc.insecure_channel(self.st.addresses["orchestrator"]) as ch:
            stub = orchestrator_pb2_grpc.OrchestratorStub(ch)
            self.t0 = time.monotonic()
            with RssSampler(self.st.pids, a.sample_interval_s) as rss:
                aux = [threading.Thread(target=f, daemon=True) for f in (self.sampler, self.progress)]
                chats = [threading.Thread(target=self.chat, args=(stub, i), daemon=True)
                         for i in range(a.chats)]
                for th in aux + chats:
                    th.start()
                for th in chats:
                    th.join()
                load_s = self.now()
                self.stop.set()
                for th in aux:
                    th.join(10)
        rebuilds_after = metric(self.st.metrics("orchestrator"), REBUILDS)
        return {"load_seconds": round(load_s, 1), "rss_series": rss.series,
                "warmup_end_s": self.warm_end_s, "warmup_end_why": self.warm_end_why,
                "rss_kinds_series": self.proc_series,
                "rss_t0_offset_s": round(rss.t0 - self.t0, 3),
                "orchestrator_rebuilds": None if rebuilds_after is None else rebuilds_after - (rebuilds_before or 0.0),
                "prefix_cache": prefix_delta(prefix_before, prefix_counters(self.st.metrics()))}


def rss_report(series: dict[str, list[tuple[float, float]]], offset: float, warm_s: float | None,
               limit: float, kinds: dict[str, list[tuple[float, int | None, int | None]]] | None = None,
               window_s: float = 60.0) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, pts in sorted(series.items()):
        warm = [(t + offset, mb) for t, mb in pts if warm_s is not None and t + offset <= warm_s]
        after = [(t + offset, mb) for t, mb in pts if warm_s is not None and t + offset > warm_s]
        if warm and after:
            base = round(statistics.median(mb for t, mb in warm if t > warm[-1][0] - window_s), 1)
            level = round(statistics.median(mb for t, mb in after if t > after[-1][0] - window_s), 1)
            peak_w, peak_a = max(mb for _, mb in warm), max(mb for _, mb in after)
            out[name] = {"samples": len(pts), "warmup_level_mb": base, "final_level_mb": level,
                         "growth": round(level / base - 1, 4), "pass": level / base - 1 < limit,
                         "warmup_peak_mb": peak_w, "peak_after_mb": peak_a, "final_mb": pts[-1][1],
                         "peak_growth": round(peak_a / peak_w - 1, 4)}
            for i, kind in ((1, "anon"), (2, "file")):  # the same window split, by page kind
                ks = [(p[0], p[i]) for p in (kinds or {}).get(name, []) if p[i] is not None]
                w = [v for t, v in ks if t <= warm_s]
                f = [v for t, v in ks if t > warm_s]
                if w and f:
                    out[name][f"{kind}_warmup_peak_mb"], out[name][f"{kind}_peak_after_mb"] = max(w), max(f)
        else:
            out[name] = {"samples": len(pts), "pass": None, "why": "no samples in the warm-up window or after it"}
    return out


def code_finish(r: dict[str, Any]) -> str:
    return f"{r['code']}/{r['finish_reason'] or '-'}"


def report(a: argparse.Namespace, soak: Soak, end: dict[str, Any]) -> dict[str, Any]:
    rs = soak.results
    bad = [r for r in rs if r["code"] != "OK" or r["finish_reason"] not in ("LENGTH", "EOS")]
    rebuilt = [r for r in rs if r.get("target_rebuilds", 0) > 0]
    kv = [(s["kv_used_tokens"], s["kv_budget_tokens"]) for s in soak.samples
          if s["kv_used_tokens"] is not None and s["kv_budget_tokens"] is not None]
    rss = rss_report(end["rss_series"], end["rss_t0_offset_s"], end["warmup_end_s"], a.rss_limit,
                     end["rss_kinds_series"], a.level_window_s)
    orch_rb = end["orchestrator_rebuilds"]
    judged = [v["pass"] for v in rss.values() if v["pass"] is not None]
    verdicts = {
        "streams_complete": {"pass": bool(rs) and not bad,
                             "detail": f"{len(rs)} requests, {len(bad)} not OK: "
                                       f"{dict(Counter(code_finish(r) for r in bad))}",
                             "examples": bad[:8]},
        "no_active_session_lost": {
            "pass": not rebuilt and not orch_rb,
            "detail": f"{len(rebuilt)} requests with target_rebuilds > 0; orchestrator "
                      f"{REBUILDS} grew by {fmt(orch_rb)}", "examples": rebuilt[:8]},
        "kv_within_budget": {
            "pass": all(u <= b for u, b in kv) if kv else None,
            "detail": (f"peak {max(u for u, _ in kv):.0f} of {max(b for _, b in kv):.0f} tokens over {len(kv)} samples"
                       if kv else f"the target exports no {KV_USED} / {KV_BUDGET}")},
        "rss_growth": {"pass": all(judged) if judged else None,
                       "detail": ", ".join(f"{k} {v['growth'] * 100:+.1f}%" for k, v in rss.items() if v["pass"] is not None)
                                 + f" (median of the last {a.level_window_s:.0f} s of warm-up and of the run; "
                                   f"limit {a.rss_limit * 100:.0f}%; warm-up {fmt(end['warmup_end_s'])} s: "
                                   f"{end['warmup_end_why']})"},
    }
    ttft = [r["ttft_ms"] for r in rs if r["ttft_ms"] is not None]
    prompt = sum(int(r.get("prompt_tokens", 0)) for r in rs)
    cached = sum(int(r.get("cached_prompt_tokens", 0)) for r in rs)
    return {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()},
        "meta": {"date": time.strftime("%Y-%m-%d %H:%M"), **machine_meta(), "target_model": soak.st.target_model,
                 "pids": soak.st.pids, "command": " ".join(sys.argv)},
        "load_seconds": end["load_seconds"], "warmup_end_s": end["warmup_end_s"],
        "warmup_end_why": end["warmup_end_why"], "verdicts": verdicts,
        "requests": {"total": len(rs), "by_code": dict(Counter(code_finish(r) for r in rs)),
                     "max_turn": max((r["turn"] for r in rs), default=0),
                     "conversations": sum(1 + max((r["conversation"] for r in rs if r["chat"] == i), default=0)
                                          for i in range(a.chats)),
                     "ttft_ms_p50": percentile(ttft, 50), "ttft_ms_p99": percentile(ttft, 99),
                     "prompt_tokens": prompt, "cached_prompt_tokens": cached,
                     "cached_share": cached / prompt if prompt else None},
        "prefix_cache": end["prefix_cache"], "rss": rss, "samples": soak.samples,
        "rss_series": end["rss_series"], "rss_t0_offset_s": end["rss_t0_offset_s"],
        "rss_kinds_series": end["rss_kinds_series"], "results": rs,
    }


def markdown(rep: dict[str, Any]) -> str:
    a, q = rep["args"], rep["requests"]
    lines = [f"# Chat soak: {a['chats']} chats, {rep['load_seconds']:.0f} s ({rep['meta']['date']})", "",
             f"Target {rep['meta']['target_model']}, mode {a['mode']}, `specdec up` {up_label(a['tiny'], a['up_args'])}; "
             f"{a['system_prompts']} system prompts of {a['system_prompt_tokens']} tokens, user turns of "
             f"{a['user_turn_tokens']}, replies of {a['reply_tokens']}, history up to {a['max_history_tokens']}. "
             f"Warm-up until {fmt(rep['warmup_end_s'])} s ({rep['warmup_end_why']}), then {a['duration_s']:.0f} s "
             "measured.", "",
             "| verdict | result | detail |", "|---|---|---|"]
    lines += [f"| {k} | {verdict_cell(v['pass'])} | {v['detail'][:400]} |" for k, v in rep["verdicts"].items()]
    pc = rep["prefix_cache"]
    lines += ["", "## Requests", "",
              f"{q['total']} requests in {q['conversations']} conversations (deepest turn {q['max_turn']}); "
              f"by code/finish: {q['by_code']}; TTFT p50 {fmt(q['ttft_ms_p50'])} ms, p99 {fmt(q['ttft_ms_p99'])} ms; "
              f"cached prompt tokens {q['cached_prompt_tokens']} of {q['prompt_tokens']}"
              f" ({fmt(q['cached_share'] and q['cached_share'] * 100, '.1f')} %); target prefix-cache hit rate "
              f"{'not exported' if pc['hit_rate'] is None else format(pc['hit_rate'], '.1%')}.", "",
              "## RSS (MiB)", "",
              "| service | level at warm-up's end | level at the end | growth | peak: warm-up → after | "
              "RssAnon peak: warm-up → after | RssFile peak: warm-up → after |", "|---|---|---|---|---|---|---|"]
    for k, v in rep["rss"].items():
        if v["pass"] is None:
            lines.append(f"| {k} | – | – | – | not judged ({v['samples']} samples) |")
        else:
            lines.append(f"| {k} | {v['warmup_level_mb']} | {v['final_level_mb']} | {v['growth'] * 100:+.1f}% | "
                         f"{v['warmup_peak_mb']} → {v['peak_after_mb']} ({v['peak_growth'] * 100:+.1f}%) | "
                         f"{fmt(v.get('anon_warmup_peak_mb'))} → "
                         f"{fmt(v.get('anon_peak_after_mb'))} | {fmt(v.get('file_warmup_peak_mb'))} → "
                         f"{fmt(v.get('file_peak_after_mb'))} |")
    return "\n".join(lines) + "\n"


def plot(rep: dict[str, Any], out: Path) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    off = rep["rss_t0_offset_s"]
    for name, pts in sorted(rep["rss_series"].items()):
        ax1.plot([t + off for t, _ in pts], [mb for _, mb in pts], label=name)
    warm = rep["warmup_end_s"] or 0.0
    for ax in (ax1, ax2):
        ax.axvline(warm, color="grey", ls=":", label="end of warm-up")
        ax.set_xlabel("seconds of load")
    ax1.set(ylabel="RSS (MiB)", title="RSS per service")
    ax1.legend(fontsize=8)
    s = rep["samples"]
    ts = [x["t"] for x in s]
    if any(x["kv_used_tokens"] is not None for x in s):
        ax2.plot(ts, [x["kv_used_tokens"] for x in s], label="KV used (tokens)")
        ax2.plot(ts, [x["kv_budget_tokens"] for x in s], ls="--", label="KV budget (tokens)")
        if any(x.get("draft_kv_used_tokens") is not None for x in s):
            ax2.plot(ts, [x.get("draft_kv_used_tokens") for x in s], label="draft KV used (tokens)")
        ax2.set(ylabel="tokens", title="target KV usage")
    else:
        ax2.plot(ts, [x["active_sessions"] for x in s], label="active sessions (no KV gauge exported)")
        ax2.set(ylabel="sessions", title="target sessions")
    ax2.set_ylim(bottom=0)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    path = out / "chat_soak.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    add_stack_arguments(p)
    p.add_argument("--chats", type=int, default=16, help="concurrent chats (%(default)s)")
    p.add_argument("--duration-s", type=float, default=300.0, help="seconds of load (%(default)s)")
    p.add_argument("--system-prompts", type=int, default=3, help="distinct system prompts the chats share (%(default)s)")
    p.add_argument("--system-prompt-tokens", type=int, default=300, help="%(default)s")
    p.add_argument("--user-turn-tokens", type=int, default=48, help="%(default)s")
    p.add_argument("--reply-tokens", type=int, default=48, help="%(default)s")
    p.add_argument("--max-history-tokens", type=int, default=1200,
                   help="a chat whose next turn would pass this starts over (%(default)s: 16 chats at the cap "
                        "hold 19,200 tokens, inside the default --kv-budget-tokens)")
    p.add_argument("--sample-interval-s", type=float, default=1.0, help="RSS and metrics sampling (%(default)s)")
    p.add_argument("--warmup-s", type=float, default=60.0, help="shortest warm-up (%(default)s s)")
    p.add_argument("--warmup-kv-fill", type=float, default=0.95,
                   help="the warm-up lasts until the target's KV holds this share of its budget (%(default)s; "
                        "0 = just --warmup-s)")
    p.add_argument("--warmup-max-s", type=float, default=600.0, help="longest warm-up (%(default)s s)")
    p.add_argument("--kv-budget-tokens", type=int, default=24_576,
                   help="KV budget of target and draft, passed to `specdec up` (%(default)s; 0 = theirs)")
    p.add_argument("--rss-limit", type=float, default=0.05, help="largest RSS growth after warm-up (%(default)s)")
    p.add_argument("--level-window-s", type=float, default=60.0,
                   help="the RSS level: the median over this many seconds (%(default)s)")
    p.add_argument("--progress-every-s", type=float, default=15.0)
    a = p.parse_args(argv)
    if a.chats < 1 or a.system_prompts < 1 or a.duration_s <= 0:
        p.error("--chats and --system-prompts must be >= 1, --duration-s > 0")
    if not 0 <= a.warmup_kv_fill <= 1 or a.warmup_s < 0 or a.warmup_max_s < a.warmup_s or a.kv_budget_tokens < 0:
        p.error("--warmup-kv-fill in [0, 1], 0 <= --warmup-s <= --warmup-max-s, --kv-budget-tokens >= 0")
    if a.kv_budget_tokens:
        a.up_args = (f"--target-kv-budget-tokens {a.kv_budget_tokens} --draft-kv-budget-tokens {a.kv_budget_tokens} "
                     + a.up_args).strip()
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    say = Progress("chat-soak")
    with launch(a, say) as st:
        corpus = Corpus(load_target_tokenizer(st), a.tiny)
        soak = Soak(a, st, corpus, say)
        say(f"{a.chats} chats for {a.duration_s:.0f} s")
        end = soak.run()
    rep = report(a, soak, end)
    (a.out / "chat_soak.json").write_text(json.dumps(rep, indent=1))
    md = markdown(rep)
    (a.out / "chat_soak.md").write_text(md)
    png = plot(rep, a.out)
    say(f"wrote {a.out / 'chat_soak.json'}, {a.out / 'chat_soak.md'}" + (f", {png}" if png else ""))
    print(md)
    return 1 if any(v["pass"] is False for v in rep["verdicts"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
