"""Hugging Face transformers' universal assisted generation (UAG) as a
reference for specdec's different-tokenizer drafter: the same target and
draft models, the same prompts (benchmarks/prompts.jsonl), greedy, on the same
machine, in one process with no services.

For each prompt: target-only ``model.generate`` and assisted
``model.generate(..., assistant_model=draft, tokenizer=target_tok,
assistant_tokenizer=draft_tok)``; tokens/s, speedup and whether the assisted
output equals the target-only output. Writes one JSON file.

    flock -x /tmp/specdec-bench.lock .venv/bin/python scripts/bench_hf_uag.py \\
        --out bench-out/hf-uag.json --max-new-tokens 96

Models default to specdec's built-ins (resolved from the cache, prepared on
first use); ``--target`` / ``--assistant`` take any model spec or HF directory.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from specdec.models import DEFAULT_TARGET  # noqa: E402 (after the sys.path line)


def _hf_dir(spec: str, cache: Path) -> str:
    p = Path(spec).expanduser()
    if p.is_dir():
        return str(p)
    from specdec.models import resolve

    return str(resolve(spec, cache).hf_dir)


def _prompt_ids(tok: Any, prompt: dict[str, Any]) -> list[int]:
    if prompt.get("chat"):
        text = tok.apply_chat_template([{"role": "user", "content": prompt["prompt"]}], add_generation_prompt=True,
                                       tokenize=False)
        return list(tok(text, add_special_tokens=False)["input_ids"])
    return list(tok(prompt["prompt"])["input_ids"])


def _timed_generate(model: Any, ids: list[int], max_new: int, **kw: Any) -> tuple[list[int], float]:
    import torch

    x = torch.tensor([ids])
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, do_sample=False, **kw)
    wall = time.perf_counter() - t0
    return out[0, len(ids):].tolist(), wall


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=DEFAULT_TARGET)
    ap.add_argument("--assistant", default="smollm2-135m-instruct")
    ap.add_argument("--prompts", type=Path, default=REPO / "benchmarks" / "prompts.jsonl")
    ap.add_argument("--only", action="append", help="prompt id(s) to run")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    ap.add_argument("--cache-dir", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=Path("bench-out/hf-uag.json"))
    a = ap.parse_args(argv)

    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdec.models import default_cache_dir

    if a.threads:
        torch.set_num_threads(a.threads)
    cache = a.cache_dir or default_cache_dir()
    dtype = getattr(torch, a.dtype)
    tdir, adir = _hf_dir(a.target, cache), _hf_dir(a.assistant, cache)
    target_tok, assistant_tok = AutoTokenizer.from_pretrained(tdir), AutoTokenizer.from_pretrained(adir)
    target = AutoModelForCausalLM.from_pretrained(tdir, dtype=dtype).eval()
    assistant = AutoModelForCausalLM.from_pretrained(adir, dtype=dtype).eval()
    prompts = [json.loads(line) for line in a.prompts.read_text().splitlines() if line.strip()]
    if a.only:
        prompts = [p for p in prompts if p["id"] in a.only]
    _timed_generate(target, [1, 2, 3], 2)  # warm-up
    _timed_generate(target, [1, 2, 3], 2, assistant_model=assistant, tokenizer=target_tok,
                    assistant_tokenizer=assistant_tok)
    rows = []
    for p in prompts:
        ids = _prompt_ids(target_tok, p)
        ref, t_ref = _timed_generate(target, ids, a.max_new_tokens)
        got, t_uag = _timed_generate(target, ids, a.max_new_tokens, assistant_model=assistant,
                                     tokenizer=target_tok, assistant_tokenizer=assistant_tok)
        row = {
            "prompt": p["id"], "category": p["category"], "prompt_tokens": len(ids),
            "target_tokens": len(ref), "target_tok_s": len(ref) / t_ref,
            "uag_tokens": len(got), "uag_tok_s": len(got) / t_uag,
            "speedup": (len(got) / t_uag) / (len(ref) / t_ref),
            "identical": got == ref,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M"), "machine": platform.machine(), "threads": torch.get_num_threads(),
        "torch": torch.__version__, "transformers": transformers.__version__, "dtype": a.dtype,
        "target": a.target, "assistant": a.assistant, "max_new_tokens": a.max_new_tokens,
        "command": " ".join(sys.argv),
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
