"""The offline GPU check's scripts run (on CPU, at toy sizes): CI cannot
reach a GPU, but it can make sure the script a lent device machine runs is
not broken (scripts/gpu_check.sh)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.stack import REPO


def test_gpu_cost_script_measures_real_architectures_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "gpu"
    subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_costs.py"), "--device", "cpu", "--layers", "1",
                    "--models", "qwen2.5-coder-0.5b", "--ks", "1,2,4", "--batches", "1,2", "--batch-ks", "1",
                    "--kv", "8", "--reps", "1", "--dtype", "float32", "--out", str(out)],
                   check=True, capture_output=True, timeout=300, cwd=REPO)
    res = json.loads((out / "gpu_costs.json").read_text())
    row = res["models"]["qwen2.5-coder-0.5b"]
    assert sorted(int(k) for k in row["eager_ms"]) == [1, 2, 4] and all(v > 0 for v in row["eager_ms"].values())
    assert set(row["batched_eager_ms"]["1"]) == {"1", "2"}
    assert row["params_m"] > 100  # the real 151,936 x 896 embedding is there: real architecture, one layer
    assert (out / "gpu_costs.md").read_text().startswith("Device cpu")


def test_round_overhead_script_reports_per_round_overhead(tmp_path: Path) -> None:
    out = tmp_path / "overhead"
    subprocess.run([sys.executable, str(REPO / "scripts" / "round_overhead.py"), "--device", "cpu", "--requests", "3",
                    "--max-new-tokens", "12", "--variants", "stream,unary,single-events", "--out", str(out)],
                   check=True, capture_output=True, timeout=300, cwd=REPO)
    res = json.loads((out / "round_overhead.json").read_text())
    assert res["machine"]["isa"] and "isa_flags" in res["machine"]
    for run in ("off", "fixed-unary", "fixed-stream", "fixed-run-ahead"):  # every draft mode
        for key, variant in ((run, "stream"), (run + "@unary-verify", "unary"), (run + "@single-events", "single-events")):
            assert res[key]["variant"] == variant
            assert res[key]["rounds"] > 0 and res[key]["overhead_ms_per_round_p50"] >= 0
            assert 0 < res[key]["round_overhead_p50_ms"] <= res[key]["round_overhead_p99_ms"]
