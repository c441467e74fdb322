"""What a draft LM head cut to its V most likely rows would save, and cost.

The 0.5B draft's int4 LM head (151,936 × 896) is a quarter of the bytes a
draft token reads. A drafter may propose from any distribution q it states
exactly, so drafting from the head's rows for V token ids (and the special
tokens) is still lossless: the verifier's rule takes q as it is, and a
token outside the rows simply has q = 0. What it costs is acceptance: at a
position where the target's token is outside the rows, the draft cannot
propose it. This script measures both sides, to say whether such a drafter
is worth building (issue 24; not built):

- one draft token through onnxruntime with the head's MatMulNBits cut to V
  rows (its codes and scales sliced, nothing else changed), interleaved
  with the full head, and the kept rows' logits compared bit for bit;
- the share of the target's tokens (a ``specdec bench`` run's outputs) that
  fall outside the V rows, for two orders of the rows: token id (BPE merge
  order) and frequency over the Python standard library's source (code and
  English, on every machine with Python, no download).

    .venv/bin/python scripts/draft_head_rows.py --texts docs/bench/vs-llamacpp-zen4-stack/results.json \\
        --out docs/bench/draft-head-rows-zen4

Writes results.json, results.md and head_rows.png into --out. Run it alone
on the machine: the figures are times.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))


def stdlib_ranking(tok, mb: float) -> list[int]:  # type: ignore[no-untyped-def]
    """Token ids by frequency over up to ``mb`` MB of the standard library's
    .py files (sorted paths, site-packages left out), most frequent first."""
    root = Path(sysconfig.get_paths()["stdlib"])
    counts: collections.Counter[int] = collections.Counter()
    budget = int(mb * 1e6)
    for p in sorted(root.rglob("*.py")):
        if "site-packages" in p.parts or budget <= 0:
            continue
        text = p.read_text(errors="ignore")
        budget -= len(text)
        counts.update(tok(text, add_special_tokens=False)["input_ids"])
    return [i for i, _ in counts.most_common()]


def head_rows(order: list[int], v: int, vocab: int, specials: list[int]) -> list[int]:
    """The first ``v`` ids of ``order``, then ids not in it by id, plus the specials."""
    seen = list(dict.fromkeys(order))
    if len(seen) < v:
        have = set(seen)
        seen += [i for i in range(vocab) if i not in have][: v - len(seen)]
    return sorted(set(seen[:v]) | set(specials))


def cut_head(src: Path, dst: Path, rows: list[int]) -> str:
    """src's model.onnx with the LM head's MatMulNBits cut to ``rows`` into dst; the node's name."""
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    m = onnx.load(str(src / "model.onnx"), load_external_data=True)
    inits = {i.name: i for i in m.graph.initializer}
    node = next(n for n in m.graph.node if n.op_type == "MatMulNBits" and "logits" in n.output)
    n = int(next(helper.get_attribute_value(a) for a in node.attribute if a.name == "N"))
    idx = np.asarray(rows)
    for name in node.input[1:]:
        if name in inits:
            a = numpy_helper.to_array(inits[name])
            if a.shape[0] != n:
                raise SystemExit(f"{name}: shape {a.shape}, expected {n} rows first")
            inits[name].CopyFrom(numpy_helper.from_array(np.ascontiguousarray(a[idx]), name))
    for a in node.attribute:
        if a.name == "N":
            a.i = len(rows)
    for o in m.graph.output:
        if o.name == "logits":
            o.type.tensor_type.shape.dim[-1].dim_value = len(rows)
    dst.mkdir(parents=True, exist_ok=True)
    onnx.save(m, str(dst / "model.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
              location="model.onnx.data")
    return node.name


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--cache-dir", type=Path, default=None, help="the model cache (default: specdec's)")
    p.add_argument("--rows", default="16384,32768,65536", help="comma-separated head sizes V")
    p.add_argument("--texts", type=Path, required=True, help="a `specdec bench` results.json (its outputs)")
    p.add_argument("--corpus-mb", type=float, default=16.0, help="standard-library source counted for the ranking")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--context", type=int, default=200)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()

    import numpy as np
    from transformers import AutoTokenizer

    import draft_floor as df
    from specdec_app.bench_report import pyplot
    from target_service.backends import cpu_info

    r, src, cfg = df.draft_export(a.model, a.cache_dir)
    tok = AutoTokenizer.from_pretrained(r.hf_dir)
    vocab = int(cfg["vocab_size"])
    specials = sorted(int(i) for i in tok.added_tokens_decoder)
    outputs = [tok(x["spec_text"], add_special_tokens=False)["input_ids"]
               for x in json.loads(a.texts.read_text())["rows"]]
    total = sum(len(o) for o in outputs)
    t0 = time.perf_counter()
    orders = {"token id": list(range(vocab)), "stdlib frequency": stdlib_ranking(tok, a.corpus_mb)}
    print(f"[head-rows] ranking over the standard library: {time.perf_counter() - t0:.0f} s", flush=True)
    sizes = [int(v) for v in a.rows.split(",") if v]
    outside: dict[str, dict[int, float]] = {}
    for name, order in orders.items():
        outside[name] = {}
        for v in sizes:
            kept = set(head_rows(order, v, vocab, specials))
            outside[name][v] = sum(1 for o in outputs for i in o if i not in kept) / max(1, total)
    print(json.dumps(outside), flush=True)

    # timing: the head's size is what counts, not which rows
    tmp = Path(tempfile.mkdtemp(prefix="head-rows-"))
    sessions = {"full": df.ort_session(src, a.threads, False)}
    ref = sessions["full"].run(["logits"], df.ort_feeds(sessions["full"], a.context, cfg))[0].reshape(-1)
    exact: dict[str, float] = {}
    # a control: the same export re-saved with every row (what re-saving alone changes)
    for v in sizes + [vocab]:
        rows = head_rows(orders["token id"], v, vocab, specials) if v < vocab else list(range(vocab))
        key = f"V={v}" if v < vocab else "full, re-saved"
        cut_head(src, tmp / str(v), rows)
        s = df.ort_session(tmp / str(v), a.threads, False)
        got = s.run(["logits"], df.ort_feeds(s, a.context, cfg))[0].reshape(-1)
        exact[key] = float(np.abs(got - ref[np.asarray(rows)]).max())
        sessions[key] = s
    feeds = {k: df.ort_feeds(s, a.context, cfg) for k, s in sessions.items()}
    ms: dict[str, list[float]] = {k: [] for k in sessions}
    for rnd in range(a.rounds):  # interleaved, forwards then backwards
        for k in list(sessions) if rnd % 2 == 0 else list(sessions)[::-1]:
            for _ in range(2):
                sessions[k].run(["logits"], feeds[k])
            t = time.perf_counter()
            for _ in range(10):
                sessions[k].run(["logits"], feeds[k])
            ms[k].append((time.perf_counter() - t) / 10 * 1e3)
    med = {k: round(statistics.median(v), 2) for k, v in ms.items()}
    print(json.dumps(med), flush=True)

    info = cpu_info()
    res = {"model": r.name, "cpu": info.model, "flags": sorted(f for f in info.flags if f.startswith(("avx", "fma"))),
           "threads": a.threads, "context": a.context, "rounds": a.rounds, "target_tokens": total,
           "texts": str(a.texts), "corpus_mb": a.corpus_mb, "specials": len(specials),
           "median_ms": med, "kept_rows_max_abs_diff": exact, "outside_share": outside,
           "command": "scripts/draft_head_rows.py " + " ".join(sys.argv[1:])}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "results.json").write_text(json.dumps(res, indent=2) + "\n")
    md = [f"# The draft's LM head cut to V rows: {r.name}, {a.threads} threads, {a.context} tokens of KV", "",
          f"{info.model} [{' '.join(res['flags'])}]. `{res['command']}`", "",
          "| head rows | ms per draft token (median) | kept rows' logits: max abs difference | target tokens outside, "
          "by id order | by stdlib frequency |", "|---|---|---|---|---|",
          f"| all {vocab}, the export as it is | {med['full']} | - | 0 | 0 |",
          f"| all {vocab}, re-saved | {med['full, re-saved']} | {exact['full, re-saved']:.3g} | 0 | 0 |"]
    md += [f"| {v} + {len(specials)} specials | {med[f'V={v}']} | {exact[f'V={v}']:.3g} | "
           f"{outside['token id'][v]:.1%} | {outside['stdlib frequency'][v]:.1%} |" for v in sizes]
    md += ["", f"Target tokens: {total}, the outputs in {a.texts}."]
    (a.out / "results.md").write_text("\n".join(md) + "\n")
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.bar(list(med), list(med.values()))
        ax.set_ylabel("ms per draft token")
        ax.set_title(f"{r.name}: LM head rows")
        fig.tight_layout()
        fig.savefig(a.out / "head_rows.png", dpi=120)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
