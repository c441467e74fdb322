"""scripts/bench_topology.py's report: summaries, the markdown tables and the
PNG plots (pure functions of the result rows)."""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any, Sequence

from specdec_app.bench_report import pyplot

MODES = ("off", "unary", "stream", "run-ahead")


def geomean(xs: Sequence[float]) -> float:
    xs = [x for x in xs if x > 0]
    return math.exp(statistics.fmean(math.log(x) for x in xs)) if xs else 0.0


def points(rows: list[dict[str, Any]]) -> list[tuple[str, float]]:
    """(topology, RTT) in run order."""
    return list(dict.fromkeys((r["topology"], r["rtt_ms"]) for r in rows))


def summary(rows: list[dict[str, Any]]) -> dict[tuple[str, float], dict[str, float]]:
    """Per (topology, RTT): geometric means over prompts of tokens/s per mode
    and of each speedup."""
    out: dict[tuple[str, float], dict[str, float]] = {}
    for key in points(rows):
        sel = [r for r in rows if (r["topology"], r["rtt_ms"]) == key]
        s: dict[str, float] = {}
        for mode in MODES:
            m = [r for r in sel if r["mode"] == mode]
            s[f"{mode} tok/s"] = geomean([r["tokens_per_second"] for r in m])
            if mode != "off":
                s[f"{mode}/off"] = geomean([r["speedup_vs_off"] for r in m])
            if mode in ("stream", "run-ahead"):
                s[f"{mode}/unary"] = geomean([r["speedup_vs_unary"] or 0.0 for r in m])
        out[key] = s
    return out


COLUMNS = ("prompt | mode | tok/s | wall ms | rounds | accept | mean acc. len | draft ms | verify ms | "
           "draft hidden ms | post-verified | round overhead p50 / p99 ms | overhead ms | vs OFF | vs unary | identical")


def _md_row(r: dict[str, Any]) -> str:
    ident = "yes" if r["identical_to_off"] else f"**NO** ({r['mismatched_runs']}/{r['runs']} runs)"
    vs_unary = f"{r['speedup_vs_unary']:.2f}×" if r["speedup_vs_unary"] is not None else ""
    return (f"| {r['prompt']} | {r['mode']} | {r['tokens_per_second']:.2f} | {r['wall_ms']:.0f} | {r['rounds']} | "
            f"{r['acceptance_rate']:.2f} | {r['mean_accepted_length']:.2f} | {r['draft_ms']:.0f} | "
            f"{r['verify_ms']:.0f} | {r['draft_hidden_ms']:.0f} | {r['post_verified']} | "
            f"{r['round_overhead_p50_ms']:.1f} / {r.get('round_overhead_p99_ms', 0.0):.1f} | {r['overhead_ms']:.0f} | {r['speedup_vs_off']:.2f}× | {vs_unary} | "
            f"{ident} |")


def mismatches(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if not r["identical_to_off"]]


def to_markdown(res: dict[str, Any]) -> str:
    rows = res["rows"]
    meta = res["meta"]
    spec = f"FIXED γ={meta['gamma']}" if meta["policy"] == "fixed" else "AUTO"
    lines = ["# Draft modes across topologies", "",
             (f"Run {meta['date']} on {meta['cpu']} ({meta['cpus']} CPUs; CPU siblings: {meta['cpu_siblings']}); "
              f"greedy, {meta['max_new_tokens']} new tokens (ignore_eos), speculation {spec}, best of "
              f"{meta['repeats']} per mode. Command: `{meta['command']}`"), ""]
    for name, t in res["topologies"].items():
        n = t["target_numerics"]
        lines.append(f"- {name}: target {n['dtype']}/{n['backend']} on {n['device']}, cpus {t['cpus']}, "
                     f"threads {t['threads'] or 'default'}")
    bad = mismatches(rows)
    lines += ["", "## Greedy identity", ""]
    if bad:
        lines.append(f"**{len(bad)} configuration(s) differ from OFF:**")
        lines.append("")
        for r in bad:
            d = r.get("divergence") or {}
            lines.append(f"- **{r['topology']} RTT {r['rtt_ms']:g} ms, {r['prompt']}, {r['mode']}**: "
                         f"{r['mismatched_runs']}/{r['runs']} runs; first at token {d.get('position')} "
                         f"(OFF top-1/top-2 logit gap {d.get('reference_top2_logit_gap')})")
    else:
        n = sum(r["runs"] for r in rows if r["mode"] != "off")
        lines.append(f"Every speculative run produced OFF's tokens ({n} runs).")
    summ = summary(rows)
    keys = list(next(iter(summ.values())).keys()) if summ else []
    lines += ["", "## Summary (geometric mean over prompts)", "",
              "| topology | RTT ms | measured added RTT ms (target/draft) | " + " | ".join(keys) + " |",
              "|---" * (len(keys) + 3) + "|"]
    for (topo, rtt), s in summ.items():
        m = next(r["measured_rtt_ms"] for r in rows if (r["topology"], r["rtt_ms"]) == (topo, rtt))
        added = f"{m['target_added']:.2f} / {m['draft_added']:.2f}" if "target_added" in m else "direct"
        lines.append(f"| {topo} | {rtt:g} | {added} | " + " | ".join(
            f"{v:.2f}" if k.endswith("tok/s") else f"{v:.2f}×" for k, v in s.items()) + " |")
    for topo, rtt in points(rows):
        lines += ["", f"## {topo}, RTT {rtt:g} ms", "", f"| {COLUMNS} |", "|---" * (COLUMNS.count("|") + 1) + "|"]
        lines += [_md_row(r) for r in rows if (r["topology"], r["rtt_ms"]) == (topo, rtt)]
    return "\n".join(lines) + "\n"


def plots(res: dict[str, Any], out: Path) -> list[Path]:
    """Pinned: tokens/s per mode against RTT (one panel per prompt), and
    stream / run-ahead over unary against RTT."""
    rows = [r for r in res["rows"] if r["topology"] == "pinned"]
    rtts = sorted({r["rtt_ms"] for r in rows})
    if len(rtts) < 1:
        return []
    plt = pyplot()
    if plt is None:
        return []
    prompts = list(dict.fromkeys(r["prompt"] for r in rows))
    paths = []

    def value(prompt: str, mode: str, rtt: float, key: str) -> float:
        return next((float(r[key] or 0.0) for r in rows if (r["prompt"], r["mode"], r["rtt_ms"]) == (prompt, mode, rtt)),
                    math.nan)

    cols = min(3, len(prompts))
    nrows = math.ceil(len(prompts) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.5 * nrows), squeeze=False)
    for i, prompt in enumerate(prompts):
        ax = axes[i // cols][i % cols]
        for j, mode in enumerate(MODES):
            ax.plot(rtts, [value(prompt, mode, t, "tokens_per_second") for t in rtts], marker="o",
                    color=f"C{j}", ls="--" if mode == "off" else "-", label=mode)
        ax.set_title(prompt, fontsize=9)
        ax.set_xlabel("added RTT per link (ms)")
        ax.set_ylabel("tokens/s")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)
    for k in range(len(prompts), nrows * cols):
        axes[k // cols][k % cols].set_visible(False)
    fig.suptitle("pinned (a core each): tokens/s per draft mode", fontsize=9)
    fig.tight_layout()
    paths.append(out / "pinned_tokens_per_s_vs_rtt.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for j, mode in enumerate(("run-ahead", "stream")):
        style = "-" if mode == "run-ahead" else ":"
        for prompt in prompts:
            ax.plot(rtts, [value(prompt, mode, t, "speedup_vs_unary") for t in rtts], style, color=f"C{j}",
                    lw=0.8, alpha=0.5)
        ax.plot(rtts, [geomean([value(p, mode, t, "speedup_vs_unary") for p in prompts]) for t in rtts], style,
                color=f"C{j}", lw=2.2, marker="o", label=f"{mode} / unary (geomean; thin: per prompt)")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xlabel("added RTT per link (ms)")
    ax.set_ylabel("speedup over unary")
    ax.set_title("pinned: run-ahead and stream against unary drafting", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(out / "pinned_speedup_over_unary_vs_rtt.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths
