"""Target-only decoding in-process, for comparison with OFF through the
services (issue 13 item 4): the same model, numerics and prompt, greedy,
with Hugging Face ``generate()`` on the converted model and with the
target engine's own step loop (prefill, then 1-token verifies).

    .venv/bin/python scripts/inprocess_off.py --dtype bfloat16 --backend bf16w --only py-complete

Prints one JSON line per prompt: tokens/s of each path and the time to the
first token.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--backend", default="bf16w")
    p.add_argument("--only", action="append")
    p.add_argument("--max-new-tokens", type=int, default=128)
    a = p.parse_args()

    from transformers import AutoTokenizer

    from specdec.bench import REPO_PROMPTS
    from specdec.models import default_cache_dir, resolve
    from specdec.sampling import SamplingConfig
    from target_service.engine import TargetEngine

    resolved = resolve(a.model, default_cache_dir())
    tok = AutoTokenizer.from_pretrained(str(resolved.hf_dir))
    engine = TargetEngine(resolved.hf_dir, dtype=a.dtype, backend=a.backend, model_name=resolved.name)
    prompts = [json.loads(line) for line in REPO_PROMPTS.read_text().splitlines() if line.strip()]
    for pr in prompts:
        if a.only and pr["id"] not in a.only:
            continue
        text = tok.apply_chat_template([{"role": "user", "content": pr["prompt"]}], add_generation_prompt=True,
                                       tokenize=False) if pr.get("chat") else pr["prompt"]
        ids = tok(text, add_special_tokens=False)["input_ids"]
        # the engine's loop: what the service runs for OFF, without gRPC
        t0 = time.perf_counter()
        out = engine.prefill(ids, SamplingConfig(), True)
        ttft = time.perf_counter() - t0
        sid, n, nxt = out.session_id, out.cache_len, out.next_token
        tokens = [nxt]
        while len(tokens) < a.max_new_tokens:
            v = engine.verify(sid, n, [nxt], [], [])
            n, nxt = v.cache_len, v.result.next_token
            tokens.append(nxt)
        engine_s = time.perf_counter() - t0
        engine.release(sid)
        # Hugging Face generate() on the same converted model
        t0 = time.perf_counter()
        with torch.inference_mode():
            hf = engine.model.generate(torch.tensor([ids]), max_new_tokens=a.max_new_tokens, do_sample=False,
                                       min_new_tokens=a.max_new_tokens, pad_token_id=0)
        hf_s = time.perf_counter() - t0
        same = hf[0, len(ids):].tolist() == tokens
        print(json.dumps({"prompt": pr["id"], "dtype": a.dtype, "backend": a.backend, "prompt_tokens": len(ids),
                          "engine_tok_s": round(len(tokens) / engine_s, 3), "engine_ttft_ms": round(ttft * 1e3, 1),
                          "hf_generate_tok_s": round(a.max_new_tokens / hf_s, 3), "same_tokens": same}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
