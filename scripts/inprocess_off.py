"""Target-only decoding in-process, for comparison with OFF through the
services (issue 13 item 4): the same model, numerics and prompt, greedy,
with Hugging Face ``generate()`` on the converted model and with the
target engine's own step loop (prefill, then 1-token verifies).

    .venv/bin/python scripts/inprocess_off.py --dtype bfloat16 --backend bf16w --only py-complete
    # and OFF through a running stack (`specdec up`), interleaved with the in-process paths
    .venv/bin/python scripts/inprocess_off.py --only py-complete --services 127.0.0.1:50051 --repeats 3

Prints one JSON line per prompt: tokens/s of each path (the best of
--repeats, the paths taking turns so a slow spell of the machine hits each),
the time to the first token, and with --services the ratio of OFF through
the services to the engine's own loop. Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specdec.models import DEFAULT_TARGET  # noqa: E402 (after the sys.path line)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_TARGET)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--backend", default="bf16w")
    p.add_argument("--only", action="append")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--services", default="", help="orchestrator address: also time OFF through the services")
    p.add_argument("--repeats", type=int, default=1)
    a = p.parse_args()

    from transformers import AutoTokenizer

    from specdec_app.bench import REPO_PROMPTS
    from specdec.models import default_cache_dir, resolve
    from specdec.sampling import SamplingConfig
    from target_service.engine import TargetEngine

    resolved = resolve(a.model, default_cache_dir())
    tok = AutoTokenizer.from_pretrained(str(resolved.hf_dir))
    engine = TargetEngine(resolved.hf_dir, dtype=a.dtype, backend=a.backend, model_name=resolved.name,
                          gguf_path=resolved.gguf_path)
    client = None
    if a.services:
        from specdec_app.client import Client

        client = Client(a.services)
    prompts = [json.loads(line) for line in REPO_PROMPTS.read_text().splitlines() if line.strip()]
    for pr in prompts:
        if a.only and pr["id"] not in a.only:
            continue
        text = tok.apply_chat_template([{"role": "user", "content": pr["prompt"]}], add_generation_prompt=True,
                                       tokenize=False) if pr.get("chat") else pr["prompt"]
        ids = tok(text, add_special_tokens=False)["input_ids"]
        best: dict[str, float] = {}
        same = True
        for rep in range(a.repeats):
            order = ["engine", "hf"] + (["services"] if a.services else [])
            for path in order if rep % 2 == 0 else order[::-1]:
                t0 = time.perf_counter()
                if path == "engine":  # the engine's loop: what the service runs for OFF, without gRPC
                    out = engine.prefill(ids, SamplingConfig(), True)
                    ttft = time.perf_counter() - t0
                    sid, n, nxt = out.session_id, out.cache_len, out.next_token
                    tokens = [nxt]
                    while len(tokens) < a.max_new_tokens:
                        v = engine.verify(sid, n, [nxt], [], [])
                        n, nxt = v.cache_len, v.result.next_token
                        tokens.append(nxt)
                    engine.release(sid)
                elif path == "hf":  # Hugging Face generate() on the same converted model
                    with torch.inference_mode():
                        hf = engine.model.generate(torch.tensor([ids]), max_new_tokens=a.max_new_tokens,
                                                   do_sample=False, min_new_tokens=a.max_new_tokens, pad_token_id=0)
                    same = same and hf[0, len(ids):].tolist()[: len(tokens)] == tokens
                else:  # OFF through the orchestrator, the same prompt ids
                    assert client is not None
                    res = client.generate(ids, mode="off", max_new_tokens=a.max_new_tokens)
                    # the service stops at EOS, the loops above do not: compare and count what it made
                    same = same and res.token_ids == tokens[: len(res.token_ids)]
                made = len(res.token_ids) if path == "services" else a.max_new_tokens
                rate = made / (time.perf_counter() - t0)
                best[path] = max(best.get(path, 0.0), rate)
        row = {"prompt": pr["id"], "dtype": a.dtype, "backend": a.backend, "prompt_tokens": len(ids),
               "engine_tok_s": round(best["engine"], 3), "engine_ttft_ms": round(ttft * 1e3, 1),
               "hf_generate_tok_s": round(best["hf"], 3), "same_tokens": same, "repeats": a.repeats}
        if a.services:
            row["services_off_tok_s"] = round(best["services"], 3)
            row["services_vs_engine"] = round(best["services"] / best["engine"], 3)
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
