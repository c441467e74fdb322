"""``specdec bench`` results beside llama.cpp's on the same GGUF files and
prompts (``scripts/bench_llamacpp.sh``): one table per prompt and by category
(geometric mean) of specdec OFF / AUTO and llama.cpp target-only /
speculative tok/s, with the ratios to llama.cpp target-only.

    python -m specdec_app.bench_compare bench-out/results.json bench-out/llamacpp/llamacpp.json --out bench-out

writes vs_llamacpp.json, vs_llamacpp.md and vs_llamacpp.png (``specdec bench
--llamacpp FILE`` writes them after its run).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from specdec_app.bench_report import bar_groups, geomean

LLAMA_TARGET_ONLY = "llama.cpp target-only"
# (column key in a `specdec bench` row, the same after the first token)
SPECDEC_KEYS = {"OFF": ("baseline_tok_s", "baseline_decode_tok_s"), "fastest OFF": ("fastest_off_tok_s", None)}
SPEC_KEYS = ("spec_tok_s", "spec_decode_tok_s")


def merge(spec: dict[str, Any], llama: dict[str, Any], mode: str = "auto") -> list[dict[str, Any]]:
    """One row per prompt in both results: ``tok_s`` and ``decode_tok_s``
    ({column: value}) and ``ratios`` (the fastest OFF, or this stack's OFF
    when the run measured no other, and each specdec column of ``mode``, over
    llama.cpp target-only; whole request)."""
    by_prompt: dict[str, dict[str, Any]] = {}
    spec_rows = [r for r in spec["rows"] if r["mode"] == mode]
    drafters = list(dict.fromkeys(r["drafter"] for r in spec_rows))
    for r in spec["rows"]:
        row = by_prompt.setdefault(r["prompt"], {"prompt": r["prompt"], "category": r["category"],
                                                 "tok_s": {}, "decode_tok_s": {}})
        for name, (key, decode_key) in SPECDEC_KEYS.items():
            if key in r:
                row["tok_s"][f"specdec {name}"] = r[key]
                if decode_key:
                    row["decode_tok_s"][f"specdec {name}"] = r[decode_key]
        if r["mode"] == mode:
            name = f"specdec {mode.upper()}" + (f" ({r['drafter']})" if len(drafters) > 1 else "")
            row["tok_s"][name], row["decode_tok_s"][name] = r[SPEC_KEYS[0]], r[SPEC_KEYS[1]]
            for key, col in (("off_vs_llamacpp_paired", "OFF"), ("spec_vs_llamacpp_paired", name.removeprefix("specdec "))):
                if r.get(key) is not None:  # decode, paired by pass (`specdec bench --llamacpp-bin`)
                    row.setdefault("paired", {})[f"{col} ÷ llama.cpp target-only"] = r[key]
    merged = []
    llama_rows: dict[str, list[dict[str, Any]]] = {}
    for r in llama["rows"]:
        llama_rows.setdefault(r["prompt"], []).append(r)
    for prompt, row in by_prompt.items():
        if prompt not in llama_rows:
            continue
        for r in llama_rows[prompt]:
            name = LLAMA_TARGET_ONLY if r["config"] == "target-only" else f"llama.cpp {r['config']}"
            row["tok_s"][name], row["decode_tok_s"][name] = r["tok_s"], r["decode_tok_s"]
        base = row["tok_s"].get(LLAMA_TARGET_ONLY)
        off = "specdec fastest OFF" if "specdec fastest OFF" in row["tok_s"] else "specdec OFF"
        over = [off] + [k for k in row["tok_s"] if k.startswith(f"specdec {mode.upper()}")]
        row["ratios"] = {f"{k.removeprefix('specdec ')} ÷ llama.cpp target-only": row["tok_s"][k] / base
                         for k in over if base and k in row["tok_s"]}
        merged.append(row)
    return merged


def category_means(rows: list[dict[str, Any]], field: str) -> dict[str, dict[str, float]]:
    """{category: {column: geometric mean over the category's prompts}}."""
    acc: dict[str, dict[str, list[float]]] = {}
    for r in rows:
        for col, v in r[field].items():
            acc.setdefault(r["category"], {}).setdefault(col, []).append(v)
    return {c: {col: geomean(vs) for col, vs in cols.items()} for c, cols in sorted(acc.items())}


def _columns(rows: list[dict[str, Any]], field: str) -> list[str]:
    return list(dict.fromkeys(col for r in rows for col in r[field]))


def _table(first: list[str], keyed: list[tuple[list[str], dict[str, float]]], cols: list[str], fmt: str) -> list[str]:
    lines = ["| " + " | ".join(first + cols) + " |", "|---" * (len(first) + len(cols)) + "|"]
    for names, values in keyed:
        lines.append("| " + " | ".join(names + [format(values[c], fmt) if c in values else "" for c in cols]) + " |")
    return lines


def to_markdown(rows: list[dict[str, Any]], spec_meta: dict[str, Any], llama_meta: dict[str, Any]) -> str:
    lines = [f"specdec: {spec_meta.get('date', '?')}, {spec_meta.get('cpu', '?')}, target numerics "
             f"{spec_meta.get('target_dtype', '?')}/{spec_meta.get('target_backend', '?')}, "
             f"{spec_meta.get('max_new_tokens', '?')} new tokens. llama.cpp {llama_meta.get('llama_cpp_version', '?')}: "
             f"{llama_meta.get('date', '?')}, {llama_meta.get('threads', '?')} threads, "
             f"{llama_meta.get('max_new_tokens', '?')} new tokens.", ""]
    if llama_meta.get("interleaved"):
        lines += ["llama.cpp ran in the same run, interleaved with specdec prompt by prompt (`specdec bench "
                  "--llamacpp-bin`): each prompt's requests went round every configuration, forwards then "
                  "backwards, the fastest run of each kept.", ""]
    if spec_meta.get("max_new_tokens") != llama_meta.get("max_new_tokens"):
        lines += ["**The two runs asked for different token counts: not comparable.**", ""]
    for field, what in (("tok_s", "tok/s over the whole request (prefill included)"),
                        ("decode_tok_s", "decode tok/s (after the first token)")):
        cols = _columns(rows, field)
        lines += [f"{what}, per prompt:", ""]
        lines += _table(["prompt", "category"], [([r["prompt"], r["category"]], r[field]) for r in rows], cols, ".2f")
        lines += ["", f"{what}, by category (geometric mean):", ""]
        lines += _table(["category"], [([c], v) for c, v in category_means(rows, field).items()], cols, ".2f")
        lines.append("")
    cols = _columns(rows, "ratios")
    if cols:
        lines += ["Ratios to llama.cpp target-only (whole request), per prompt:", ""]
        lines += _table(["prompt", "category"], [([r["prompt"], r["category"]], r["ratios"]) for r in rows], cols, ".2f")
        lines += ["", "Ratios to llama.cpp target-only, by category (geometric mean):", ""]
        lines += _table(["category"], [([c], v) for c, v in category_means(rows, "ratios").items()], cols, ".2f")
    paired = [r for r in rows if r.get("paired")]
    cols = _columns(paired, "paired")
    if cols:
        lines += ["", "Decode ratios to llama.cpp target-only paired by pass (each prompt: the median over its passes "
                  "of the ratio within a pass, whose runs ran next to each other), per prompt:", ""]
        lines += _table(["prompt", "category"], [([r["prompt"], r["category"]], r["paired"]) for r in paired], cols, ".2f")
        lines += ["", "The same, by category (geometric mean):", ""]
        lines += _table(["category"], [([c], v) for c, v in category_means(paired, "paired").items()], cols, ".2f")
    return "\n".join(lines) + "\n"


def write(spec: dict[str, Any], llama: dict[str, Any], out: Path, mode: str = "auto") -> list[Path]:
    """vs_llamacpp.json / .md / .png in ``out``; the paths written."""
    rows = merge(spec, llama, mode)
    out.mkdir(parents=True, exist_ok=True)
    by_category = {f: category_means([r for r in rows if f in r], f) for f in ("tok_s", "decode_tok_s", "ratios", "paired")}
    res = {"rows": rows, "by_category": by_category,
           "specdec_meta": spec.get("meta", {}), "llamacpp_meta": llama.get("meta", {}), "mode": mode}
    paths = [out / "vs_llamacpp.json", out / "vs_llamacpp.md"]
    paths[0].write_text(json.dumps(res, indent=2))
    paths[1].write_text(to_markdown(rows, res["specdec_meta"], res["llamacpp_meta"]))
    groups = [r["prompt"] for r in rows]
    series = {c: [r["tok_s"].get(c) for r in rows] for c in _columns(rows, "tok_s")}
    if rows and bar_groups(groups, series, out / "vs_llamacpp.png", "tok/s (whole request)",
                           "specdec and llama.cpp on the same GGUF files"):
        paths.append(out / "vs_llamacpp.png")
    return paths


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("specdec_results", type=Path, help="results.json of `specdec bench --out DIR`")
    p.add_argument("llamacpp_results", type=Path, help="llamacpp.json of scripts/bench_llamacpp.sh")
    p.add_argument("--out", type=Path, default=None, help="where to write (default: beside the specdec results)")
    p.add_argument("--mode", default="auto", help="the specdec speculative mode to compare (default auto)")
    a = p.parse_args(argv)
    paths = write(json.loads(a.specdec_results.read_text()), json.loads(a.llamacpp_results.read_text()),
                  a.out or a.specdec_results.parent, a.mode)
    for path in paths:
        print(f"wrote {path}")
    sys.stdout.write(paths[1].read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
