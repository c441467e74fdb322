"""What one token of the model drafter costs, and how much of it a faster
kernel could take away (issue 24: speculation must pay against a ~35 ms
quantized target step, so the draft must cost far less than a step).

1. The exported ONNX draft, one token behind ``--context`` tokens of KV
   cache, through onnxruntime's own profiler: milliseconds per op type
   (MatMulNBits, GroupQueryAttention, norms, ...), ``--threads`` threads.
2. The same draft's linear layers (fused q/k/v, o, fused gate/up, down, the
   LM head) on the target's kquant-a8 kernel (target_service/kquant.c), one
   row: synthetic Q4_K blocks of the draft's shapes, K zero-padded to a
   multiple of 256 (the kernel's super-block); what moving the draft onto
   that kernel could save in its matrix products alone.

Both interleaved round by round (a slow spell of the VM hits both alike),
each keeping its median over ``--rounds`` rounds.

    .venv/bin/python scripts/draft_floor.py --out docs/bench/draft-floor-zen4

Writes results.json, results.md and draft_floor.png into --out. Run it
alone on the machine: the figures are times.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def draft_export(model: str, cache_dir: Path | None):  # type: ignore[no-untyped-def]
    """(the resolved model, its int4 CPU export's directory, its config.json) for ``model``."""
    from draft_service.export import ensure_onnx
    from specdec.models import default_cache_dir, resolve

    cache = cache_dir or default_cache_dir()
    r = resolve(model, cache)
    return r, ensure_onnx(Path(r.hf_dir), cache, "int4", "cpu"), json.loads((Path(r.hf_dir) / "config.json").read_text())


def ort_session(model_dir: Path, threads: int, profile: bool):  # type: ignore[no-untyped-def]
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.add_session_config_entry("session.intra_op.allow_spinning", "1")
    opts.add_session_config_entry("session.force_spinning_stop", "1")  # specdec up's --draft-spin run
    opts.log_severity_level = 3
    if profile:
        opts.enable_profiling = True
        opts.profile_file_prefix = os.path.join(tempfile.mkdtemp(prefix="draft-floor-"), "ort")
    return ort.InferenceSession(str(model_dir / "model.onnx"), sess_options=opts, providers=["CPUExecutionProvider"])


def ort_feeds(session, context: int, config: dict) -> dict:  # type: ignore[no-untyped-def]
    """One token's inputs behind ``context`` tokens of (random) KV cache."""
    import numpy as np

    feeds = {}
    rng = np.random.default_rng(0)
    heads = config.get("num_key_value_heads", config["num_attention_heads"])
    dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    for i in session.get_inputs():
        if i.name.startswith("past_key_values"):
            feeds[i.name] = (rng.standard_normal((1, heads, context, dim)) * 0.1).astype(np.float32)
    feeds["input_ids"] = np.array([[min(1000, config["vocab_size"] - 1)]], dtype=np.int64)
    names = {i.name for i in session.get_inputs()}
    if "attention_mask" in names:
        feeds["attention_mask"] = np.ones((1, context + 1), dtype=np.int64)
    if "position_ids" in names:
        feeds["position_ids"] = np.array([[context]], dtype=np.int64)
    return feeds


def op_profile(path: str, runs: int) -> dict[str, dict[str, float]]:
    """ms per run and calls per run of each op type in an onnxruntime profile."""
    events = json.load(open(path))
    ms: dict[str, float] = collections.defaultdict(float)
    calls: collections.Counter[str] = collections.Counter()
    for e in events:
        if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time"):
            op = e["args"].get("op_name", "?")
            ms[op] += e["dur"] / 1e3
            calls[op] += 1
    return {op: {"ms": round(v / runs, 3), "calls": calls[op] // runs}
            for op, v in sorted(ms.items(), key=lambda kv: -kv[1])}


def q4k_blocks(n: int, k: int, rng):  # type: ignore[no-untyped-def]
    """Synthetic Q4_K blocks [n, k]: random bytes in the file's block layout
    (finite float16 d and dmin), read by the project's own decoder."""
    import numpy as np

    from specdec.models import gguf_blocks

    raw = rng.integers(0, 256, size=(n * k // gguf_blocks.QK_K, gguf_blocks.BLOCK_BYTES["Q4_K"]), dtype=np.uint8)
    raw[:, 0:4] = (rng.random((raw.shape[0], 2)) * 1e-3 + 1e-4).astype(np.float16).view(np.uint8)
    return gguf_blocks.decode_q4_k(raw, n, k)


def draft_shapes(config: dict) -> list[tuple[int, int]]:
    """(N, K) of every linear layer of a Qwen2-shaped draft, q/k/v and
    gate/up fused as the target fuses them, K padded to a multiple of 256."""
    h, inter, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    heads, kv = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    dim = h // heads

    def pad(k: int) -> int:
        return -(-k // 256) * 256

    per_layer = [(h + 2 * kv * dim, pad(h)), (h, pad(heads * dim)), (2 * inter, pad(h)), (h, pad(inter))]
    return per_layer * layers + [(config["vocab_size"], pad(h))]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--context", type=int, default=200)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--passes", type=int, default=20, help="tokens timed per round and side")
    p.add_argument("--cache-dir", type=Path, default=None, help="the model cache (default: specdec's)")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()

    import numpy as np
    import torch

    from target_service import kquant
    from target_service.backends import cpu_info

    r, onnx_dir, config = draft_export(a.model, a.cache_dir)

    session = ort_session(onnx_dir, a.threads, profile=False)
    feeds = ort_feeds(session, a.context, config)
    kquant.set_threads(a.threads)
    rng = np.random.default_rng(0)
    layers = [kquant.KQuantLinear(q4k_blocks(n, k, rng), None, None, "a8") for n, k in draft_shapes(config)]
    packed_mb = sum(layer.nbytes for layer in layers) / 1e6
    inputs = {k: torch.randn(1, k) for k in {layer.in_features for layer in layers}}

    def ort_token() -> None:
        session.run(None, feeds)

    def kquant_token() -> None:
        for layer in layers:
            layer(inputs[layer.in_features])

    sides = {"onnxruntime draft, whole token": ort_token, "kquant-a8, the draft's linear layers": kquant_token}
    for fn in sides.values():  # warm-up
        for _ in range(3):
            fn()
    times: dict[str, list[float]] = {name: [] for name in sides}
    for rnd in range(a.rounds):
        for name, fn in sides.items():
            for _ in range(a.passes):
                t0 = time.perf_counter()
                fn()
                times[name].append((time.perf_counter() - t0) * 1e3)
        print(json.dumps({"round": rnd + 1, **{n: round(statistics.median(v[-a.passes:]), 2)
                                               for n, v in times.items()}}), flush=True)
    medians = {n: round(statistics.median(v), 2) for n, v in times.items()}

    prof = ort_session(onnx_dir, a.threads, profile=True)
    for _ in range(3):
        prof.run(None, feeds)
    for _ in range(a.passes):
        prof.run(None, feeds)
    ops = op_profile(prof.end_profiling(), a.passes + 3)

    ort_bytes = sum(f.stat().st_size for f in onnx_dir.iterdir() if f.name.startswith("model.onnx"))
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": f"{cpu_info().model}, {cpu_info().isa}",
        "torch": torch.__version__,
        "model": r.name,
        "onnx_dir": str(onnx_dir),
        "onnx_bytes": ort_bytes,
        "threads": a.threads,
        "context": a.context,
        "median_ms": medians,
        "kquant_packed_mb": round(packed_mb, 1),
        "kquant_gb_per_s": round(packed_mb / medians["kquant-a8, the draft's linear layers"], 1),
        "onnxruntime_ops_ms": ops,
        "command": " ".join(sys.argv),
    }
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [
        f"# One draft token of {r.name}, {a.threads} threads, {a.context} tokens of KV cache",
        "",
        f"{result['date']}, {result['machine']}, torch {result['torch']}. `{result['command']}`",
        "",
        "| what | median ms |",
        "|---|---|",
        *[f"| {n} | {v} |" for n, v in medians.items()],
        "",
        f"kquant-a8 over the draft's shapes: {packed_mb:.0f} MB of packed weights "
        f"({result['kquant_gb_per_s']} GB/s at one row).",
        "",
        "onnxruntime's profile of one token (a run of its own, slowed by the profiling: the shares are what "
        "counts), ms per token by op type:",
        "",
        "| op | ms | calls |",
        "|---|---|---|",
        *[f"| {op} | {v['ms']} | {v['calls']} |" for op, v in ops.items()],
        "",
    ]
    (a.out / "results.md").write_text("\n".join(lines))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.5, 3.2))
    # the profiled run's split (profiling slows it), scaled to the timed median
    whole = medians["onnxruntime draft, whole token"]
    total = sum(v["ms"] for v in ops.values()) or 1.0
    left = 0.0
    for op, v in list(ops.items())[:5]:
        ax.barh(["onnxruntime draft"], [v["ms"] / total * whole], left=left, label=op)
        left += v["ms"] / total * whole
    ax.barh(["kquant-a8 (linear layers only)"], [medians["kquant-a8, the draft's linear layers"]], color="grey")
    ax.set_xlabel("ms per draft token")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title(f"{r.name}: one token, {a.threads} threads")
    fig.tight_layout()
    fig.savefig(a.out / "draft_floor.png", dpi=120)
    print(json.dumps({"median_ms": medians, "kquant_gb_per_s": result["kquant_gb_per_s"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
