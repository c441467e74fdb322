#!/usr/bin/env python
"""The same-process reference a user would otherwise pick: Hugging Face
transformers `generate()` target-only and assisted generation
(`assistant_model=`), on the same pair, prompts, machine and dtype as
`specdec bench`. Greedy. Writes JSON and prints a markdown table.

    .venv/bin/python scripts/bench_hf.py --out bench-out/hf.json
    .venv/bin/python scripts/bench_hf.py --assistant smollm2-135m-instruct --universal   # different tokenizer
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from specdec.models import DEFAULT_DRAFT, DEFAULT_TARGET  # noqa: E402 (after the sys.path line)


def main() -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdec.models import default_cache_dir, resolve

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--assistant", default=DEFAULT_DRAFT)
    p.add_argument("--universal", action="store_true", help="the assistant has another tokenizer (assistant_tokenizer=)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--prompts", type=Path, default=REPO / "benchmarks" / "prompts.jsonl")
    p.add_argument("--only", action="append")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--num-assistant-tokens", type=int, default=4)
    p.add_argument("--schedule", default="heuristic", choices=["heuristic", "constant"],
                   help="transformers' num_assistant_tokens_schedule")
    p.add_argument("--out", type=Path, default=REPO / "bench-out" / "hf.json")
    a = p.parse_args()

    dtype = getattr(torch, a.dtype)
    cache = default_cache_dir()
    tdir = resolve(a.target, cache).hf_dir
    adir = resolve(a.assistant, cache).hf_dir
    tok = AutoTokenizer.from_pretrained(str(tdir))
    atok = AutoTokenizer.from_pretrained(str(adir)) if a.universal else None
    target = AutoModelForCausalLM.from_pretrained(str(tdir), dtype=dtype).eval()
    assistant = AutoModelForCausalLM.from_pretrained(str(adir), dtype=dtype).eval()
    prompts = [json.loads(x) for x in a.prompts.read_text().splitlines() if x.strip()]
    if a.only:
        prompts = [q for q in prompts if q["id"] in a.only]

    def encode(q: dict) -> torch.Tensor:
        text = (tok.apply_chat_template([{"role": "user", "content": q["prompt"]}], add_generation_prompt=True,
                                        tokenize=False) if q.get("chat") else q["prompt"])
        return tok(text, return_tensors="pt", add_special_tokens=not q.get("chat")).input_ids

    def run(ids: torch.Tensor, assisted: bool) -> tuple[list[int], float]:
        kw = dict(max_new_tokens=a.max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id or tok.eos_token_id)
        if assisted:
            assistant.generation_config.num_assistant_tokens = a.num_assistant_tokens
            assistant.generation_config.num_assistant_tokens_schedule = a.schedule
            kw["assistant_model"] = assistant
            if a.universal:
                kw.update(tokenizer=tok, assistant_tokenizer=atok)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = target.generate(ids, **kw)
        dt = time.perf_counter() - t0
        return out[0, ids.shape[1]:].tolist(), dt

    run(encode({"prompt": "hello"}), False)  # warm-up
    rows = []
    print("| prompt | category | target-only tok/s | assisted tok/s | speedup | identical |\n|---|---|---|---|---|---|")
    for q in prompts:
        ids = encode(q)
        base, t_base = run(ids, False)
        spec, t_spec = run(ids, True)
        row = {"prompt": q["id"], "category": q["category"], "tokens": len(base),
               "target_only_tok_s": len(base) / t_base, "assisted_tok_s": len(spec) / t_spec,
               "speedup": (len(spec) / t_spec) / (len(base) / t_base), "identical": base == spec}
        rows.append(row)
        print(f"| {q['id']} | {q['category']} | {row['target_only_tok_s']:.2f} | {row['assisted_tok_s']:.2f} | "
              f"{row['speedup']:.2f}× | {'yes' if row['identical'] else 'no'} |", flush=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()}, "torch_threads": torch.get_num_threads(),
                                 "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
