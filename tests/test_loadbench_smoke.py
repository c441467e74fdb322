"""`specdec loadbench` on tiny models: concurrent streams through the real
services, with speculation on and off, write JSON, markdown and PNG plots
with sane values (not timings)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from specdec_app import loadbench
from tests.stack import start_stack


def test_loadbench_writes_results(tiny_models, onnx_cache_dir: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    stack = start_stack(tiny_models.target, tiny_models.draft, onnx_cache_dir,
                        target_overrides={"max_batch_size": 8, "batch_window_ms": 2.0, "metrics_port": 0})
    try:
        prompts = tmp_path / "prompts.jsonl"
        prompts.write_text("".join(json.dumps({"id": str(i), "category": "x", "chat": False, "prompt": p}) + "\n"
                                   for i, p in enumerate(["def f(x):", "hello there", "a b c"])))
        p = argparse.ArgumentParser()
        loadbench.add_arguments(p)
        out = tmp_path / "out"
        args = p.parse_args(["--address", stack.address, "--streams", "1,4", "--modes", "auto,off",
                             "--requests-per-stream", "2", "--repeats", "2", "--max-new-tokens", "12", "--prompts", str(prompts),
                             "--pids", f"services={os.getpid()}", "--rss-interval-s", "0.05",
                             "--label", "batch≤8", "--out", str(out)])
        assert loadbench.main(args) == 0
        res = json.loads((out / "results.json").read_text())
        rows = res["rows"]
        assert [(r["streams"], r["mode"]) for r in rows] == [(1, "auto"), (1, "off"), (4, "auto"), (4, "off")]
        for r in rows:
            assert r["config"] == "batch≤8"
            # 2 requests per stream, 2 repeats (ABBA) pooled into one row
            assert r["requests"] == r["ok"] == 2 * 2 * r["streams"] and r["errors"] == {}
            assert len(r["throughput_reps"]) == 2 and all(t > 0 for t in r["throughput_reps"])
            assert len(r["vs_off_reps"]) == 2
            assert r["tokens"] == 12 * r["requests"]  # ignore_eos: every request runs to max_new_tokens
            assert r["throughput_tok_s"] > 0 and r["vs_off"] > 0
            assert 0 < r["ttft_ms_p50"] <= r["ttft_ms_p99"]
            assert 0 < r["tpot_ms_p50"] <= r["tpot_ms_p99"]
            assert r["rss_peak_mb"]["services"] > 10
        assert [r["vs_off"] for r in rows if r["mode"] == "off"] == [1.0, 1.0]
        assert all(r["vs_off_reps"] == [1.0, 1.0] for r in rows if r["mode"] == "off")
        series = res["rss"]["batch≤8"]["services"]
        assert len(series) >= 2 and all(mb > 10 for _, mb in series)
        md = (out / "results.md").read_text()
        assert md.count("| batch≤8 |") == 4
        for png in ("throughput_latency.png", "rss.png"):
            assert (out / png).stat().st_size > 1000, png
        stack.wait_no_sessions()
    finally:
        stack.close()


def test_percentile_and_child_pids() -> None:
    assert loadbench.percentile([], 50) is None
    assert loadbench.percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert loadbench.percentile([float(i) for i in range(1, 101)], 99) == 99.0
    assert loadbench.percentile([5.0], 99) == 5.0
    assert loadbench.rss_mb(os.getpid()) > 10
    assert loadbench.child_service_pids(os.getpid()) == {}  # pytest started no `specdec serve` children
