"""`specdec bench` end to end on tiny models: it runs every configuration
through the real services and writes JSON, markdown and PNG plots."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specdec import bench
from tests.stack import start_stack


def test_bench_writes_json_markdown_and_plots(tiny_models, onnx_cache_dir: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    stack = start_stack(tiny_models.target, tiny_models.draft, onnx_cache_dir)
    try:
        prompts = tmp_path / "prompts.jsonl"
        prompts.write_text(
            json.dumps({"id": "a", "category": "code-completion", "chat": False, "prompt": "def f(x):"}) + "\n"
            + json.dumps({"id": "b", "category": "prose", "chat": True, "prompt": "tell me a story"}) + "\n"
        )
        p = argparse.ArgumentParser()
        bench.add_arguments(p)
        out = tmp_path / "out"
        args = p.parse_args(["--address", stack.address, "--target-address", f"127.0.0.1:{stack.target.port}",
                             "--prompts", str(prompts), "--gammas", "1,3", "--policies", "auto,heuristic",
                             "--max-new-tokens", "12", "--out", str(out)])
        assert bench.main(args) == 0
        res = json.loads((out / "results.json").read_text())
        assert len(res["rows"]) == 2 * 4
        for row in res["rows"]:
            assert row["identical"], row  # float32 tiny target: greedy identical in every mode
            assert row["speedup"] > 0 and 0 <= row["acceptance_rate"] <= 1
            assert row["leviathan_bound"] > 0
        assert sorted(int(k) for k in res["verify_cost_ms"]) == list(range(1, 9))
        md = (out / "results.md").read_text()
        assert "| code-completion |" in md and "auto" in md and "heuristic" in md
        for png in ("speedup.png", "speedup_vs_gamma.png", "gamma_trajectory_and_acceptance.png", "verify_cost.png"):
            assert (out / png).stat().st_size > 1000, png
    finally:
        stack.close()
