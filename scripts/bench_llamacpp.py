"""llama.cpp on the same GGUF files, prompts and token counts as `specdec
bench` (issue 24). Run through scripts/bench_llamacpp.sh, which builds
llama.cpp once and passes --bin.

1. ``llama-bench``, the target alone: prefill (pp) and decode (tg) tok/s.
2. ``llama-server`` on loopback, the target alone, on every prompt of the
   set: the prompt's token ids exactly as specdec renders them (the target's
   tokenizer; chat prompts through its chat template), greedy,
   --max-new-tokens, stopping at end of sequence as specdec does; a streamed
   ``/completion``: tok/s over the whole request (prefill included), decode
   tok/s after the first token, TTFT (all timed here, as `specdec bench`
   times its requests), the generated ids and text.
3. llama.cpp's own speculation with the draft GGUF, for each --n-max:
   ``llama-server`` with the draft (``--spec-type draft-simple``), the same
   requests, acceptance from its timings, greedy identity to step 2; and
   ``llama-speculative-simple`` (the rendered prompt as text; its own
   timers: the prompt's encoding and the decode after it), acceptance.

The servers run side by side and each prompt's requests go round them in
alternating order (ABBA over --repeats), the fastest run of each kept, as
`specdec bench` does. Writes llamacpp.json, llamacpp.md and llamacpp.png into
--out; `specdec bench --llamacpp FILE` or `python -m specdec_app.bench_compare`
put them in one table with specdec's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from specdec_app.bench import REPO_PROMPTS, alternating, machine_meta  # noqa: E402
from specdec_app.bench_report import bar_groups  # noqa: E402
from specdec_app.llamacpp import (  # noqa: E402  (re-exported: tests/test_bench_llamacpp.py)
    TARGET_ONLY, complete, model_files, read_stream, render, server)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from specdec.models.spec import DEFAULT_DRAFT, DEFAULT_TARGET

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bin", type=Path, required=True, help="llama.cpp's bin directory")
    p.add_argument("--llama-cpp-version", default="", help="recorded in the JSON")
    p.add_argument("--target-model", default=DEFAULT_TARGET, help="as `specdec up`: a built-in name or a .gguf path")
    p.add_argument("--draft-model", default=DEFAULT_DRAFT, help="as `specdec up`: a built-in name or a .gguf path")
    p.add_argument("--cache-dir", type=Path, default=None)
    p.add_argument("--prompts", type=Path, default=REPO_PROMPTS)
    p.add_argument("--only", action="append", help="prompt id(s) to run")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2, help="target and draft threads (-t, -tb, -td, -tbd)")
    p.add_argument("--n-max", default="4", help="comma-separated draft lengths (--spec-draft-n-max)")
    p.add_argument("--repeats", type=int, default=1, help="runs per configuration (the fastest is kept)")
    p.add_argument("--runners", default="server,simple",
                   help="speculation through: server (llama-server with the draft), simple (llama-speculative-simple)")
    p.add_argument("--bench-prompt", type=int, default=512, help="llama-bench -p (0 skips llama-bench)")
    p.add_argument("--bench-gen", type=int, default=128, help="llama-bench -n")
    p.add_argument("--bench-reps", type=int, default=5, help="llama-bench -r")
    p.add_argument("--ctx", type=int, default=4096, help="context size (-c) of every llama.cpp process")
    p.add_argument("--out", type=Path, default=Path("bench-out") / "llamacpp")
    return p.parse_args(argv)


SIMPLE_PATTERNS = {
    "encoded_tokens": r"encoded\s+(\d+) tokens", "encode_s": r"encoded\s+\d+ tokens in\s+([\d.]+) seconds",
    "tokens": r"decoded\s+(\d+) tokens", "decode_s": r"decoded\s+\d+ tokens in\s+([\d.]+) seconds",
    "draft_tokens": r"n_drafted\s*=\s*(\d+)", "accepted_tokens": r"n_accept\s*=\s*(\d+)",
}


def parse_simple(log: str) -> dict[str, Any]:
    """llama-speculative-simple's summary: prompt (its own tokenization) and decoded tokens, the
    encode and decode seconds, drafted and accepted tokens."""
    out: dict[str, Any] = {}
    for key, pat in SIMPLE_PATTERNS.items():
        m = re.search(pat, log)
        if m is None:
            raise ValueError(f"llama-speculative-simple printed no {key!r} ({pat})")
        out[key] = float(m.group(1)) if key.endswith("_s") else int(m.group(1))
    n, enc, dec = out["tokens"], out["encode_s"], out["decode_s"]
    out.update(wall_s=enc + dec, ttft_ms=enc * 1e3, tok_s=n / (enc + dec) if enc + dec > 0 else 0.0,
               decode_tok_s=n / dec if dec > 0 else 0.0,
               acceptance_rate=out["accepted_tokens"] / out["draft_tokens"] if out["draft_tokens"] else None)
    return out


def run_simple(a: argparse.Namespace, target: Path, draft: Path, text: str, n_max: int, log: Path) -> dict[str, Any]:
    # -p, not -f: a prompt file loses its final newline (the chat template's, after "assistant")
    cmd = [str(a.bin / "llama-speculative-simple"), "-m", str(target), "-md", str(draft), "--spec-type", "draft-simple",
           "--spec-draft-n-max", str(n_max), "-t", str(a.threads), "-td", str(a.threads), "--temp", "0",
           "-n", str(a.max_new_tokens), "-c", str(a.ctx), "-p", text]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    log.write_text(r.stdout + r.stderr)
    if r.returncode != 0:
        raise SystemExit(f"llama-speculative-simple failed ({r.returncode}); see {log}")
    return parse_simple(r.stderr + r.stdout)


def llama_bench(a: argparse.Namespace, target: Path) -> list[dict[str, Any]]:
    cmd = [str(a.bin / "llama-bench"), "-m", str(target), "-t", str(a.threads), "-p", str(a.bench_prompt),
           "-n", str(a.bench_gen), "-r", str(a.bench_reps), "-o", "json"]
    print(f"[llama.cpp] {' '.join(cmd)}", flush=True)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, check=True)
    return [{"test": f"pp{x['n_prompt']}" if x["n_prompt"] else f"tg{x['n_gen']}", "avg_tok_s": x["avg_ts"],
             "stddev_tok_s": x["stddev_ts"], "threads": x.get("n_threads"), "model_type": x.get("model_type"),
             "cpu_info": x.get("cpu_info"), "build_commit": x.get("build_commit")} for x in json.loads(r.stdout)]


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def run_prompts(a: argparse.Namespace, prompts: list[dict[str, Any]], target: Path, draft: Path, tok: Any) -> list[dict[str, Any]]:
    n_maxes = [int(x) for x in a.n_max.split(",") if x]
    runners = {x.strip() for x in a.runners.split(",") if x.strip()}
    base = [str(a.bin / "llama-server"), "-m", str(target), "-t", str(a.threads), "-tb", str(a.threads),
            "-c", str(a.ctx), "-np", "1", "--no-webui"]
    cmds = {TARGET_ONLY: base}
    if "server" in runners:
        for n in n_maxes:
            cmds[f"server spec n_max={n}"] = base + ["-md", str(draft), "--spec-type", "draft-simple",
                                                      "--spec-draft-n-max", str(n), "-td", str(a.threads),
                                                      "-tbd", str(a.threads)]
    rows: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        ports = {}
        for label, cmd in cmds.items():
            print(f"[llama.cpp] {label}: {' '.join(cmd)}", flush=True)
            ports[label] = stack.enter_context(server(cmd, a.out / f"server-{label.replace(' ', '_')}.log"))
            complete(ports[label], render(tok, {"prompt": "hello", "chat": False})[1], 4)  # warm-up
        for prompt in prompts:
            text, ids = render(tok, prompt)
            best: dict[str, dict[str, Any]] = {}
            for label in alternating(list(cmds), a.repeats):
                run = complete(ports[label], ids, a.max_new_tokens)
                if label not in best or run["tok_s"] > best[label]["tok_s"]:
                    best[label] = run
            if "simple" in runners:
                for n in n_maxes:
                    label = f"spec-simple n_max={n}"
                    for _ in range(max(1, a.repeats)):
                        run = run_simple(a, target, draft, text, n, a.out / f"simple-{prompt['id']}-{n}.log")
                        if label not in best or run["tok_s"] > best[label]["tok_s"]:
                            best[label] = run
            ref = best[TARGET_ONLY]["token_ids"]
            for label, run in best.items():
                ids_out = run.get("token_ids")
                row = {"prompt": prompt["id"], "category": prompt["category"], "config": label,
                       "prompt_tokens": len(ids), **run,
                       "identical_to_target_only": None if ids_out is None else ids_out == ref,
                       "divergence_position": None if ids_out is None else first_divergence(ref, ids_out)}
                rows.append(row)
                print(md_row(row), flush=True)
    return rows


HEADER = ("| prompt | category | llama.cpp | tokens | tok/s | decode tok/s | TTFT ms | accepted/drafted | "
          "identical to target-only |\n|---|---|---|---|---|---|---|---|---|")


def md_row(r: dict[str, Any]) -> str:
    acc = (f"{r['accepted_tokens']}/{r['draft_tokens']} ({r['acceptance_rate']:.0%})"
           if r.get("acceptance_rate") is not None else "")
    same = {None: "", True: "yes"}.get(r["identical_to_target_only"], f"no: pos {r['divergence_position']}")
    return (f"| {r['prompt']} | {r['category']} | {r['config']} | {r['tokens']} | {r['tok_s']:.2f} | "
            f"{r['decode_tok_s']:.2f} | {r['ttft_ms']:.0f} | {acc} | {same} |")


def to_markdown(res: dict[str, Any]) -> str:
    m = res["meta"]
    lines = [f"llama.cpp {m['llama_cpp_version']} ({m['llama_cpp_build']}), {m['threads']} threads, "
             f"{m['max_new_tokens']} new tokens, greedy; target {m['target_gguf']}, draft {m['draft_gguf']}; "
             f"{m['cpu']} ({m['isa']}), {m['date']}. Command: `{m['command']}`", ""]
    if res["llama_bench"]:
        lines += ["llama-bench, the target alone:", "", "| test | tok/s |", "|---|---|"]
        lines += [f"| {b['test']} | {b['avg_tok_s']:.2f} ± {b['stddev_tok_s']:.2f} |" for b in res["llama_bench"]]
        lines.append("")
    lines += ["tok/s: tokens over the whole request (prefill included), as `specdec bench`; decode tok/s: after "
              "the first token. spec-simple times itself (prompt encoding + decode, model loading left out).", "",
              HEADER] + [md_row(r) for r in res["rows"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoTokenizer

    from specdec.models import default_cache_dir

    a = parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    cache = a.cache_dir or default_cache_dir()
    target, hf_dir = model_files(a.target_model, cache)
    draft, _ = model_files(a.draft_model, cache)
    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    prompts = [json.loads(line) for line in a.prompts.read_text().splitlines() if line.strip()]
    prompts = [p for p in prompts if not a.only or p["id"] in a.only]
    version = subprocess.run([str(a.bin / "llama-server"), "--version"], capture_output=True, text=True, timeout=60)
    found = re.search(r"version: (.+)", version.stdout + version.stderr)
    build = found.group(1).strip() if found else "version unknown"
    bench = llama_bench(a, target) if a.bench_prompt else []
    rows = run_prompts(a, prompts, target, draft, tok)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), **machine_meta(), "llama_cpp_version": a.llama_cpp_version,
            "llama_cpp_build": build, "bin": str(a.bin), "target_gguf": str(target), "draft_gguf": str(draft),
            "threads": a.threads, "max_new_tokens": a.max_new_tokens, "n_max": a.n_max, "repeats": a.repeats,
            "command": " ".join(sys.argv)}
    res = {"meta": meta, "llama_bench": bench, "rows": rows}
    (a.out / "llamacpp.json").write_text(json.dumps(res, indent=2))
    md = to_markdown(res)
    (a.out / "llamacpp.md").write_text(md)
    configs = list(dict.fromkeys(r["config"] for r in rows))
    groups = list(dict.fromkeys(r["prompt"] for r in rows))
    tok_s = {(r["prompt"], r["config"]): r["tok_s"] for r in rows}
    if bar_groups(groups, {c: [tok_s.get((g, c)) for g in groups] for c in configs}, a.out / "llamacpp.png",
                  "tok/s (whole request)", f"llama.cpp {a.llama_cpp_version}, {a.threads} threads"):
        print(f"wrote {a.out / 'llamacpp.png'}")
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
