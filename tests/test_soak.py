"""Soak: 16 concurrent streams for 120 s through the orchestrator, speculation
on (AUTO) with a batching target, on tiny models. Bounded duration: the
load runs exactly SOAK_SECONDS (plus the requests in flight at the end).

Asserts: no request fails; every greedy output equals its target-only
reference; afterwards no session is left on the target or the draft and the
queues are empty; and the process RSS (all three services run in this
process) grows by less than RSS_GROWTH_LIMIT from the end of warm-up to the
end of the run."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from specdec_app.loadbench import rss_mb
from tests.stack import start_stack

SOAK_SECONDS = 120.0
WARMUP_SECONDS = 20.0  # RSS baseline: the largest sample in the first 20 s (caches, allocator pools warm)
STREAMS = 16
RSS_GROWTH_LIMIT = 0.15

PROMPTS = ["soak test one", "the quick brown fox", "a, b, c.", "zz top", "hello world!", "kv cache", "spec", "lossless"]


@pytest.mark.soak
def test_soak_16_streams_two_minutes(tiny_models, onnx_cache_dir: Path) -> None:  # type: ignore[no-untyped-def]
    st = start_stack(tiny_models.target, tiny_models.draft, onnx_cache_dir,
                     target_overrides={"max_batch_size": 16, "batch_window_ms": 2.0})
    try:
        lengths = (16, 32, 48)
        expected = {(p, n): st.generate(prompt=p, mode="off", max_new_tokens=n)["token_ids"]
                    for p in PROMPTS for n in lengths}
        errors: list[str] = []
        counts = [0] * STREAMS
        mismatches: list[tuple[str, int]] = []
        rss: list[tuple[float, float]] = []
        t0 = time.monotonic()
        deadline = t0 + SOAK_SECONDS
        done = threading.Event()

        def sampler() -> None:
            while not done.is_set():
                mb = rss_mb(os.getpid())
                if mb is not None:
                    rss.append((time.monotonic() - t0, mb))
                done.wait(1.0)

        def stream(i: int) -> None:
            k = 0
            while time.monotonic() < deadline:
                p, n = PROMPTS[(i + k) % len(PROMPTS)], lengths[(i + k) % len(lengths)]
                sampled = (i + k) % 4 == 3  # a quarter of the requests sample (seeded)
                try:
                    r = st.generate(prompt=p, mode="auto", max_new_tokens=n, timeout=60,
                                    temperature=0.9 if sampled else 0.0, seed=i * 1000 + k if sampled else None)
                except Exception as e:  # reported below
                    errors.append(f"stream {i} request {k}: {e!r}"[:300])
                    return
                if len(r["token_ids"]) != n:
                    errors.append(f"stream {i} request {k}: {len(r['token_ids'])} tokens, wanted {n}")
                if not sampled and r["token_ids"] != expected[(p, n)]:
                    mismatches.append((p, n))
                k += 1
                counts[i] = k

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(STREAMS)]
        mon = threading.Thread(target=sampler)
        mon.start()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        done.set()
        mon.join()
        assert not errors, errors[:5]
        assert not mismatches, mismatches[:5]
        assert min(counts) >= 5, counts  # every stream made progress all along
        st.wait_no_sessions(timeout_s=15)
        assert st.target.worker.pending == 0 and st.orchestrator.servicer.active == 0
        baseline = max(mb for t, mb in rss if t <= WARMUP_SECONDS)
        peak = max(mb for t, mb in rss if t > WARMUP_SECONDS)
        print(f"soak: {sum(counts)} requests, RSS {baseline:.0f} MiB after warm-up, peak {peak:.0f} MiB after")
        assert peak <= baseline * (1 + RSS_GROWTH_LIMIT), (baseline, peak)
    finally:
        st.close()
