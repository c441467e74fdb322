"""``specdec bench`` reporting: the markdown tables and the PNG plots."""

from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path
from typing import Any

HEADER = (
    "| prompt | category | drafter | mode | γ | speedup | baseline tok/s | spec tok/s | decode speedup | TTFT s off/spec | "
    "α (accept rate) | α (from E) | mean accepted | c | bound | "
    "round split draft/verify/overhead ms | identical |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def md_row(r: dict[str, Any]) -> str:
    div = r["divergence"]
    ident = "yes" if r["identical"] else (
        f"no: pos {div['position']}, gap {div['reference_top2_logit_gap']:.3f}" if div and div["reference_top2_logit_gap"] is not None else "no"
    )
    return (
        f"| {r['prompt']} | {r['category']} | {r['drafter']} | {r['mode']} | {r['gamma'] or 'adaptive'} | {r['speedup']:.2f}× | {r['baseline_tok_s']:.2f} | "
        f"{r['spec_tok_s']:.2f} | {r['decode_speedup']:.2f}× | "
        f"{r['baseline_ttft_ms'] / 1e3:.1f}/{r['spec_ttft_ms'] / 1e3:.1f} | {r['acceptance_rate']:.2f} | {r['alpha']:.2f} | {r['mean_accepted_length']:.2f} | "
        f"{r['c']:.3f} | {r['leviathan_bound']:.2f}× | {r['round_draft_ms']:.0f}/{r['round_verify_ms']:.0f}/"
        f"{r['round_overhead_ms']:.0f} | {ident} |"
    )


def fastest_table(rows: list[dict[str, Any]]) -> list[str]:
    """Markdown lines: each row against the fastest target-only configuration."""
    fastest = [r for r in rows if "speedup_vs_fastest_off" in r]
    if not fastest:
        return []
    lines = ["", "Against the fastest target-only configuration on this machine (OFF under every calibrated "
             "dtype/backend, each on its own stack):", "",
             "| prompt | drafter | mode | γ | spec tok/s | this stack's OFF | fastest OFF | fastest OFF tok/s | speedup vs fastest |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['prompt']} | {r['drafter']} | {r['mode']} | {r['gamma'] or 'adaptive'} | {r['spec_tok_s']:.2f} | "
              f"{r['baseline_tok_s']:.2f} | {r['fastest_off']} | {r['fastest_off_tok_s']:.2f} | "
              f"{r['speedup_vs_fastest_off']:.2f}× |" for r in fastest]
    return lines


def to_markdown(res: dict[str, Any], meta: dict[str, Any]) -> str:
    lines = [f"Run: {meta}", "",
             "speedup: tokens/s over the whole request (the prompt's prefill included) against OFF's; "
             "decode speedup: the same after the first token (prefill left out), what speculation changes.",
             "", HEADER] + [md_row(r) for r in res["rows"]] + fastest_table(res["rows"])
    for key, what in (("speedup", "Speedup"), ("decode_speedup", "Decode speedup (after the first token)"),
                      ("decode_speedup_paired", "Decode speedup paired by pass (each prompt: the median over its "
                       "passes of the ratio within a pass, whose runs ran next to each other)")):
        rows = [r for r in res["rows"] if r.get(key) is not None]
        if not rows:
            continue
        lines += ["", f"{what} over target-only by category (geometric mean over the category's prompts):", ""]
        table = category_table(rows, key)
        cats = sorted({c for c, _ in table})
        confs = sorted({k for _, k in table}, key=_conf_order)
        lines += ["| category | " + " | ".join(_conf_label(k) for k in confs) + " |",
                  "|---" * (len(confs) + 1) + "|"]
        for c in cats:
            lines.append(f"| {c} | " + " | ".join(
                f"{table[(c, k)]:.2f}×" if (c, k) in table else "" for k in confs) + " |")
    if res["verify_cost_ms"]:
        ks = sorted(res["verify_cost_ms"])
        lines += ["", "Target verify cost through the service (median compute ms, KV cache 200 tokens):", "",
                  "| k | " + " | ".join(str(k) for k in ks) + " |", "|---" * (len(ks) + 1) + "|",
                  "| ms | " + " | ".join(f"{res['verify_cost_ms'][k]:.0f}" for k in ks) + " |"]
    return "\n".join(lines) + "\n"


POLICY_LINES = {"auto": "--", "heuristic": ":", "auto-nostop": "-."}  # line styles in the γ-sweep plot


def _conf(r: dict[str, Any]) -> tuple[str, str, int]:
    return (r["drafter"], r["mode"], r["gamma"])


def _conf_order(k: tuple[str, str, int]) -> tuple[str, int, int]:
    return (k[0], {"fixed": 0, "heuristic": 1, "auto": 2}.get(k[1], 3), k[2])


def _conf_label(k: tuple[str, str, int]) -> str:
    name = f"γ={k[2]}" if k[1] == "fixed" else k[1]
    return f"{k[0]} {name}" if k[0] else name


def geomean(values: list[float]) -> float:
    """Geometric mean (values floored at 1e-9)."""
    return math.exp(statistics.fmean(math.log(max(x, 1e-9)) for x in values))


def category_table(rows: list[dict[str, Any]], key: str = "speedup") -> dict[tuple[str, tuple[str, str, int]], float]:
    acc: dict[tuple[str, tuple[str, str, int]], list[float]] = {}
    for r in rows:
        acc.setdefault((r["category"], _conf(r)), []).append(r[key])
    return {k: geomean(v) for k, v in acc.items()}


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend; None (with a hint) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plots (pip install '.[bench]')", file=sys.stderr)
        return None
    return plt


def plot_curves(series: dict[str, dict[int, float]], path: Path, title: str, styles: dict[str, str] | None = None) -> bool:
    """ms per forward pass against k, one line per series; False without matplotlib."""
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, curve in series.items():
        ks = sorted(int(k) for k in curve)
        ax.plot(ks, [curve[k] if k in curve else curve[str(k)] for k in ks],  # type: ignore[index]
                (styles or {}).get(label, "-"), marker="o", label=label)
    ax.set_xlabel("tokens in one forward pass (k)")
    ax.set_ylabel("ms")
    ax.set_ylim(bottom=0)
    return _save(plt, fig, ax, path, title)


def _save(plt: Any, fig: Any, ax: Any, path: Path, title: str) -> bool:
    """Title, legend, layout; writes ``path`` and closes the figure."""
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def bar_groups(groups: list[str], series: dict[str, list[float | None]], path: Path, ylabel: str, title: str) -> bool:
    """One group of bars per entry of ``groups``, one bar per series (None:
    no bar); False without matplotlib."""
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(groups) * max(1, len(series)) ** 0.5 + 2), 4.2))
    width = 0.8 / max(1, len(series))
    for j, (label, values) in enumerate(series.items()):
        xs = [i - 0.4 + width * (j + 0.5) for i, v in enumerate(values) if v is not None]
        ax.bar(xs, [v for v in values if v is not None], width=width, label=label)
    ax.set_xticks(range(len(groups)), groups, fontsize=7, rotation=45, ha="right")
    ax.set_ylabel(ylabel)
    return _save(plt, fig, ax, path, title)


def plots(res: dict[str, Any], out: Path) -> list[Path]:
    plt = pyplot()
    if plt is None:
        return []
    paths = []
    rows = res["rows"]
    if rows:
        fig, ax = plt.subplots(figsize=(9, 4))
        labels = [f"{r['prompt']}\n{_conf_label(_conf(r))}" for r in rows]
        x = range(len(rows))
        ax.bar([i - 0.2 for i in x], [r["speedup"] for r in rows], width=0.4, label="measured speedup")
        ax.bar([i + 0.2 for i in x], [r["leviathan_bound"] for r in rows], width=0.4, label="Leviathan bound (α, c)")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(list(x), labels, fontsize=7, rotation=45, ha="right")
        ax.set_ylabel("× target-only")
        ax.legend()
        fig.tight_layout()
        paths.append(out / "speedup.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    fixed = [r for r in rows if r["mode"] == "fixed"]
    if rows and len({r["gamma"] for r in fixed}) > 1:
        table = category_table(rows)
        fig, ax = plt.subplots(figsize=(7, 4.5))
        series = sorted({(c, k[0]) for (c, k) in table})
        for i, (cat, drafter) in enumerate(series):
            color = f"C{i % 10}"
            pts = sorted((k[2], v) for (c, k), v in table.items() if c == cat and k[0] == drafter and k[1] == "fixed")
            ax.plot([g for g, _ in pts], [v for _, v in pts], marker="o", color=color,
                    label=f"{cat} ({drafter})" if drafter else cat)
            for (c, k), v in table.items():
                if c == cat and k[0] == drafter and k[1] in POLICY_LINES:
                    ax.axhline(v, color=color, ls=POLICY_LINES[k[1]], lw=1)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xlabel("fixed γ (dashed: AUTO/adaptive, dotted: HF heuristic, dash-dot: AUTO without confidence stop)")
        ax.set_ylabel("speedup over target-only")
        ax.legend(fontsize=7)
        fig.tight_layout()
        paths.append(out / "speedup_vs_gamma.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    adaptive = [r for r in rows if r["mode"] == "auto"][:4]
    if adaptive:
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
        for r in adaptive:
            axes[0].plot(r["gamma_trajectory"], label=f"{r['prompt']}", drawstyle="steps-post")
        axes[0].set_xlabel("round")
        axes[0].set_ylabel("γ chosen (AUTO)")
        axes[0].legend(fontsize=7)
        for i, cat in enumerate(sorted({r["category"] for r in rows})):
            sel = [r for r in rows if r["category"] == cat and r["mode"] == "fixed" and r["gamma"] == max(x["gamma"] for x in fixed)] if fixed else []
            if sel:
                pos = sel[0]["acceptance_per_position"]
                axes[1].plot([j + 1 for j, v in enumerate(pos) if v is not None], [v for v in pos if v is not None],
                             marker="o", color=f"C{i}", label=cat)
        axes[1].set_xlabel("position in drafted span")
        axes[1].set_ylabel("P(accept | previous accepted)")
        axes[1].set_ylim(0, 1.05)
        axes[1].legend(fontsize=7)
        fig.tight_layout()
        paths.append(out / "gamma_trajectory_and_acceptance.png")
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
