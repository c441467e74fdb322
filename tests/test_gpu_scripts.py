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


def run_int4(out: Path, *extra: str) -> dict:  # type: ignore[type-arg]
    subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_int4.py"), "--device", "cpu", "--layers", "1",
                    "--vocab", "512", "--rows", "1,2", "--reps", "1", "--out", str(out), *extra],
                   check=True, capture_output=True, timeout=300, cwd=REPO)
    return json.loads((out / "gpu_int4.json").read_text())  # type: ignore[no-any-return]


def test_int4_script_measures_both_paths_and_checks_the_packing_on_cpu(tmp_path: Path) -> None:
    res = run_int4(tmp_path / "int4")
    assert res["int4_ops"] == ["_convert_weight_to_int4pack_for_cpu", "_weight_int4pack_mm_for_cpu"]
    assert res["linears"] == 8  # q, k, v, o, gate, up, down of one layer + lm_head
    for path in ("int4_eager_ms", "bf16_eager_ms"):
        assert set(res["pass"][path]) == {"1", "2"} and all(v > 0 for v in res["pass"][path].values())
    # the five distinct shapes of the real 1.5B target's layer (k and v share one), lm_head 512 x 1536
    assert set(res["checks"]) == {"1536x1536", "256x1536", "8960x1536", "1536x8960", "512x1536"}
    for c in res["checks"].values():
        assert c["int4_rel_err_vs_dequant"] < 2e-2  # the dequantized weight is the one the kernel used
    assert res["weight_mb"]["int4"] < res["weight_mb"]["bf16"] / 3
    md = (tmp_path / "int4" / "gpu_int4.md").read_text()
    assert "int4 ops: _convert_weight_to_int4pack_for_cpu" in md
    c = res["checks"]["8960x1536"]
    assert (f"| 8960x1536 | {c['int4_rel_err_vs_dequant']:.2e} | {c['int4_rows_identical_alone_vs_among_8']}/8 | "
            f"{c['bf16_rows_identical_alone_vs_among_8']}/8 |") in md
    assert (tmp_path / "int4" / "gpu_int4.png").stat().st_size > 1000


def test_int4_script_skips_int4_with_its_reason_when_the_kernel_is_missing(tmp_path: Path) -> None:
    # the CUDA op exists in a CPU build of torch but has no CPU kernel: the probe fails, bf16 still runs
    res = run_int4(tmp_path / "skip", "--int4-op", "_weight_int4pack_mm")
    assert "int4_ops" not in res and res["int4_skipped"]
    assert set(res["pass"]) == {"bf16_eager_ms"}
    assert "int4 skipped: " in (tmp_path / "skip" / "gpu_int4.md").read_text()
