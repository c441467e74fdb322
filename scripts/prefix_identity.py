"""Greedy output with and without prefix-cache hits, on the benchmark
prompts, with the real target under the numerics given (default
``bfloat16/kquant``, the GGUF's own blocks; its per-row result does not
depend on the number of rows). Issue 26: "greedy output is identical with and
without cache hits, and with and without chunking".

For each prompt (chat-templated as the bench does), three runs of
``--max-new-tokens`` greedy tokens through the target engine's own loop:

- ``cold``: no prefix cache, the prompt in one forward;
- ``shared``: the cache primed by another request that shares the prompt's
  first half (a system prompt or document shared between requests), so
  the prompt starts from that entry;
- ``next-turn``: the cache primed by this very prompt and its reply (as the
  next turn of a chat would find it), so all of the prompt but its last token
  is a hit;
- ``chunked``: no cache, the prompt in chunks of ``--chunk`` tokens.

    .venv/bin/python scripts/prefix_identity.py --out bench-out/prefix-identity

Writes prefix_identity.json and prefix_identity.md into --out: per prompt and
run, the tokens taken from the cache, whether the tokens equal ``cold``'s,
and at a divergence its position and the cold run's top-2 logit gap there.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("bench-out/prefix-identity"))
    p.add_argument("--model", default="")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--backend", default="kquant")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--only", action="append")
    a = p.parse_args()

    from transformers import AutoTokenizer

    from specdec.models import DEFAULT_TARGET, default_cache_dir, resolve
    from specdec.sampling import SamplingConfig
    from specdec_app.bench import REPO_PROMPTS
    from scripts.bench_llamacpp import render
    from target_service.engine import TargetEngine

    resolved = resolve(a.model or DEFAULT_TARGET, default_cache_dir())
    tok = AutoTokenizer.from_pretrained(str(resolved.hf_dir))
    common: dict[str, Any] = dict(dtype=a.dtype, backend=a.backend, model_name=resolved.name,
                                  gguf_path=resolved.gguf_path)
    cold_engine = TargetEngine(resolved.hf_dir, prefix_cache=False, prefill_chunk_tokens=0, **common)
    model = cold_engine.model  # one set of weights for every engine

    def engine(**kw: Any) -> TargetEngine:
        return TargetEngine(resolved.hf_dir, model=model, **{**common, **kw})

    def run(e: TargetEngine, ids: list[int]) -> tuple[list[int], list[float], int, str]:
        out = e.prefill(ids, SamplingConfig(), True)
        assert out.next_token is not None
        tokens, gaps, n = [out.next_token], [out.logit_gap], out.cache_len
        while len(tokens) < a.max_new_tokens:
            v = e.verify(out.session_id, n, [tokens[-1]], [], [])
            tokens.append(v.result.next_token)
            gaps.append(v.logit_gaps[-1] if v.logit_gaps else 0.0)
            n = v.cache_len
        return tokens, gaps, out.cached_tokens, out.session_id

    rows: list[dict[str, Any]] = []
    prompts = [json.loads(line) for line in REPO_PROMPTS.read_text().splitlines() if line.strip()]
    for pr in prompts:
        if a.only and pr["id"] not in a.only:
            continue
        _, ids = render(tok, pr)  # as the orchestrator renders it
        cold, gaps, _, sid = run(cold_engine, ids)
        cold_engine.release(sid)
        row: dict[str, Any] = {"prompt": pr["id"], "prompt_tokens": len(ids)}
        half = len(ids) // 2
        shared = engine(prefix_cache=True, prefill_chunk_tokens=0, prefix_cache_min_tokens=1)
        _, _, _, sid = run(shared, ids[:half] + tok(" unrelated tail", add_special_tokens=False)["input_ids"])
        shared.release(sid)
        turn = engine(prefix_cache=True, prefill_chunk_tokens=0, prefix_cache_min_tokens=1)
        _, _, _, sid = run(turn, ids)
        turn.release(sid)
        chunked = engine(prefix_cache=False, prefill_chunk_tokens=a.chunk)
        for name, e in (("shared", shared), ("next-turn", turn), ("chunked", chunked)):
            got, _, cached, sid = run(e, ids)
            e.release(sid)
            diverged = next((i for i, (x, y) in enumerate(zip(got, cold)) if x != y), None)
            row[name] = {"cached_prompt_tokens": cached, "identical": diverged is None,
                         "diverged_at": diverged, "cold_gap_there": None if diverged is None else round(gaps[diverged], 4)}
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)

    a.out.mkdir(parents=True, exist_ok=True)
    result = {"model": resolved.name, "numerics": f"{a.dtype}/{a.backend}", "max_new_tokens": a.max_new_tokens,
              "chunk": a.chunk, "rows": rows}
    (a.out / "prefix_identity.json").write_text(json.dumps(result, indent=1))
    lines = [f"# Greedy output with and without prefix-cache hits ({result['numerics']}, {a.max_new_tokens} tokens)",
             "", "| prompt | tokens | shared: cached / identical | next turn: cached / identical | chunked "
             f"({a.chunk}): identical |", "|---|---|---|---|---|"]

    def cell(r: dict[str, Any]) -> str:
        return "yes" if r["identical"] else f"no (at {r['diverged_at']}, gap {r['cold_gap_there']})"

    for r in rows:
        lines.append(f"| {r['prompt']} | {r['prompt_tokens']} | {r['shared']['cached_prompt_tokens']} / "
                     f"{cell(r['shared'])} | {r['next-turn']['cached_prompt_tokens']} / {cell(r['next-turn'])} "
                     f"| {cell(r['chunked'])} |")
    same = sum(r[k]["identical"] for r in rows for k in ("shared", "next-turn", "chunked"))
    lines += ["", f"Identical to the cold run: {same} of {3 * len(rows)}."]
    (a.out / "prefix_identity.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
