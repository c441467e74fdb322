"""A 512-token prefill in-process on the default target (kquant-a8), whole and in chunks of 64 and 256
(TargetEngine prefill_chunk_tokens), best of 3 each: .venv/bin/python docs/bench/prefill-zen4/prefill_time.py"""
import time, sys, statistics
from specdec.models import default_cache_dir, resolve
from specdec.sampling import SamplingConfig
from target_service.engine import TargetEngine
r = resolve("qwen2.5-coder-1.5b-instruct", default_cache_dir())
res = {}
for chunk in (0, 64, 256):
    eng = TargetEngine(r.hf_dir, dtype="bfloat16", backend="kquant-a8", model_name=r.name, gguf_path=r.gguf_path,
                       prefill_chunk_tokens=chunk)
    ts = []
    for rep in range(3):
        ids = [1000 + (rep * 7919 + j * 31) % 50000 for j in range(512)]
        t = time.perf_counter(); out = eng.prefill(ids, SamplingConfig(), True); ts.append(time.perf_counter() - t)
        eng.release(out.session_id) if hasattr(eng, "release") else None
    res[chunk] = ts
    print("chunk", chunk, "512-token prefill s", [round(x, 2) for x in ts], "ms/token best", round(min(ts) / 512 * 1e3, 2), flush=True)
    del eng
