"""Draft throughput micro-benchmark (not a test): tokens/s of greedy drafting
with one ``OnnxDrafter`` on an exported model.

    python -m draft_service.bench <onnx_dir> [--threads 2] [--tokens 128] [--gamma 8] [--spin on|run|off]
    python -m draft_service.bench --prompt-lookup [--context 2000]

Prints one JSON line: prefill ms, draft tok/s (every drafted token accepted,
so the cache only grows), and the drafted ids (to compare precisions).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from draft_service.config import SPIN_MODES
from draft_service.drafter import OnnxDrafter
from draft_service.onnx_model import OnnxCausalLM
from specdec.sampling import SamplingConfig


def bench(
    onnx_dir: str,
    *,
    threads: int = 2,
    prompt: list[int] | None = None,
    tokens: int = 128,
    gamma: int = 8,
    kv_mode: str = "auto",
    temperature: float = 0.0,
    spin: str = "on",
) -> dict[str, object]:
    model = OnnxCausalLM(onnx_dir, execution="cpu", intra_op_threads=threads, kv_mode=kv_mode, spin=spin)
    drafter = OnnxDrafter("bench", model)
    cfg = SamplingConfig(temperature=temperature)
    rng = np.random.default_rng(0)
    committed = list(prompt or [int(x) for x in np.random.default_rng(1).integers(100, 20000, 100)])
    # warm-up on a throwaway state
    drafter.propose(drafter.new_state(), committed[:8], 4, cfg, rng)
    state = drafter.new_state()
    t0 = time.perf_counter()
    first = drafter.propose(state, committed, 1, cfg, rng)
    prefill_ms = (time.perf_counter() - t0) * 1e3
    committed = committed + first.token_ids
    drafted: list[int] = list(first.token_ids)
    t0 = time.perf_counter()
    n = 0
    while n < tokens:
        p = drafter.propose(state, committed, gamma, cfg, rng)
        committed = committed + p.token_ids  # all accepted; the last one is fed next round
        drafted += p.token_ids
        n += len(p.token_ids)
    elapsed = time.perf_counter() - t0
    return {
        "onnx_dir": onnx_dir,
        "threads": threads,
        "kv_mode": kv_mode,
        "spin": spin,
        "prompt_tokens": len(committed) - len(drafted),
        "prefill_ms": round(prefill_ms, 1),
        "draft_tok_s": round(n / elapsed, 1),
        "ms_per_token": round(elapsed / n * 1e3, 2),
        "drafted": drafted,
    }


def bench_prompt_lookup(context: int = 2000, calls: int = 500, vocab: int = 500) -> dict[str, object]:
    """Per-call latency of the prompt-lookup drafter: a ``context``-token
    sequence, one new committed token per call, γ = 8 (µs per call)."""
    from draft_service.prompt_lookup import PromptLookupDrafter

    rng = np.random.default_rng(1)
    seq = [int(x) for x in rng.integers(0, vocab, context + calls)]
    d = PromptLookupDrafter("pl", vocab)
    state = d.new_state()
    cfg, r = SamplingConfig(), np.random.default_rng(0)
    d.propose(state, seq[:context], 8, cfg, r)
    t0 = time.perf_counter()
    for n in range(context, context + calls):
        d.propose(state, seq[: n + 1], 8, cfg, r)
    return {"drafter": "prompt-lookup", "context_tokens": context, "calls": calls,
            "us_per_call": round((time.perf_counter() - t0) / calls * 1e6, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("onnx_dir", nargs="?")
    ap.add_argument("--prompt-lookup", action="store_true", help="time the prompt-lookup drafter instead")
    ap.add_argument("--context", type=int, default=2000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--gamma", type=int, default=8)
    ap.add_argument("--kv-mode", default="auto")
    ap.add_argument("--spin", default="on", choices=list(SPIN_MODES), help="onnxruntime spin-waiting (config.SPIN_MODES)")
    a = ap.parse_args()
    if a.prompt_lookup:
        print(json.dumps(bench_prompt_lookup(a.context)))
        return
    if not a.onnx_dir:
        ap.error("onnx_dir is required (or --prompt-lookup)")
    print(json.dumps(bench(a.onnx_dir, threads=a.threads, tokens=a.tokens, gamma=a.gamma, kv_mode=a.kv_mode,
                           spin=a.spin)))


if __name__ == "__main__":
    main()
