#!/usr/bin/env python
"""In-process probe of the target's memory under a multi-turn chat load
(issue 26's soak, without gRPC, tokenizer or draft): ``--chats`` sessions in
lockstep, each turn a prefill of the whole conversation (prefix-cache hits)
and ``--reply-tokens`` batched verify rounds with ``--gamma`` drafted tokens
(random, so mostly rejected: every round rolls back), then a release (the
session becomes a prefix entry).

After every turn it prints the process's RSS, the bytes of the KV tensors
actually referenced (unique storages of the sessions' caches and the prefix
cache's entries), what the KV manager counts, and glibc's heap figures
(mallinfo2: bytes in use, free bytes kept in the heap, mmapped bytes),
then trims the heap (malloc_trim) and prints the RSS left after it
(``rss_after_trim_mib``: what RSS minus KV is once the heap's free pages are
gone; this per-turn trim also shapes the next turn's untrimmed figure).

    PYTHONPATH=. .venv/bin/python scripts/kv_rss_probe.py --turns 8 --user-turn-tokens 150 --reply-tokens 8
    ... --memory-trim-interval -1   # without malloc_trim: the heap keeps what was freed
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specdec.memory import heap_info, release_free_memory, rss_bytes  # noqa: E402
from specdec.sampling import SamplingConfig  # noqa: E402
from target_service.calls import PrefillCall, VerifyCall  # noqa: E402
from target_service.engine import PrefillOutcome, TargetEngine, VerifyOutcome  # noqa: E402
from tests.tiny import build_tiny_model  # noqa: E402

CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 .,;:!?-_()[]{}<>=+*/'\"ABCDEFGHIJKLMNOPQRST"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chats", type=int, default=16)
    p.add_argument("--turns", type=int, default=12)
    p.add_argument("--system-prompts", type=int, default=3)
    p.add_argument("--system-prompt-tokens", type=int, default=300)
    p.add_argument("--user-turn-tokens", type=int, default=48)
    p.add_argument("--reply-tokens", type=int, default=16)
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--layers", type=int, default=28, help="KV geometry of Qwen2.5-1.5B: 28 layers, 2 KV heads of 128")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--memory-trim-interval", type=float, default=1.0,
                   help="the engine's malloc_trim pacing (< 0 = never: the state before it)")
    p.add_argument("--json", type=Path, default=None, help="write the per-turn figures here")
    a = p.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="kv-rss-probe-"))
    model_dir = build_tiny_model(tmp / "m", chars=CHARS, seed=3, num_layers=a.layers, hidden_size=256, num_heads=2,
                                 num_kv_heads=2, intermediate_size=128, max_position_embeddings=8192)
    eng = TargetEngine(model_dir, dtype=a.dtype, prefix_cache=True, max_sessions=64, kv_budget_tokens=65_536,
                       protect_active_s=10.0, memory_trim_interval_s=a.memory_trim_interval)
    vocab = eng.vocab_size
    rnd = random.Random(0)
    systems = [[rnd.randrange(1, vocab) for _ in range(a.system_prompt_tokens)] for _ in range(a.system_prompts)]
    convs = [list(systems[i % a.system_prompts]) for i in range(a.chats)]
    cfg = SamplingConfig()
    rows = []
    t0 = time.monotonic()
    for turn in range(a.turns):
        for c in convs:
            c.extend(rnd.randrange(1, vocab) for _ in range(a.user_turn_tokens))
        outs = eng.run_batch([PrefillCall(list(c), cfg, True) for c in convs])
        state = []
        for (o, _), c in zip(outs, convs):
            assert isinstance(o, PrefillOutcome), o
            state.append([o.session_id, o.cache_len, o.next_token])
        for _ in range(a.reply_tokens):
            calls = [VerifyCall(sid, n, [tok], [rnd.randrange(1, vocab) for _ in range(a.gamma)], [None] * a.gamma)
                     for sid, n, tok in state]
            for st, (o, _) in zip(state, eng.run_batch(calls)):
                assert isinstance(o, VerifyOutcome), o
                st[1], st[2] = o.cache_len, o.result.next_token
        for st, c in zip(state, convs):
            c[:] = list(eng.kv.get(st[0]).tokens)  # the next turn starts with this one's prompt and reply
        for st in state:
            eng.release(st[0])
        eng.run_batch([])  # the model thread stores the released sessions before its next batch
        row = {"turn": turn + 1, "s": round(time.monotonic() - t0, 1), "history": len(convs[0]),
               "rss_mib": rss_bytes() / 2**20, "referenced_kv_mib": eng.referenced_kv_bytes() / 2**20,
               "counted_kv_mib": eng.kv.used_bytes / 2**20, "prefix_entries": eng.prefix.num_entries if eng.prefix else 0,
               "trims": eng.trim.trims, "trim_s": round(eng.trim.seconds, 3),
               **{k: v / 2**20 for k, v in heap_info().items()}}
        release_free_memory()  # what the heap still holds once every free page is handed back
        row["rss_after_trim_mib"] = rss_bytes() / 2**20
        rows.append(row)
        print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
