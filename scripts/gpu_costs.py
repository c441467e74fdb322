"""Target cost curves on an accelerator with real-architecture models built
from their configs with random weights (no weights travel: the lent GPU
machine has no network). Part of ``scripts/gpu_check.sh``; runs on CPU too
(``--device cpu --layers 2``) so CI checks that it works.

For each model config (Qwen2.5-Coder-1.5B target, 0.5B draft) in bf16:
- t(k), one forward of k = 1..16 new tokens behind a KV cache of --kv tokens,
  eager, with CUDA events;
- the same with the forward captured in a CUDA graph (static KV cache),
  replayed per k: what launch overhead costs at batch 1;
- batched decoding: B = 1..32 sessions × k tokens in one forward (eager).

Writes gpu_costs.json, gpu_costs.md and gpu_costs.png into --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# Architecture of the default models (their config.json, weights not needed)
CONFIGS = {
    "qwen2.5-coder-1.5b": dict(
        hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
        num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1000000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=False,
    ),
    "qwen2.5-coder-0.5b": dict(
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1000000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=True,
    ),
}


def build(name: str, layers: int, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = dict(CONFIGS[name])
    if layers:
        cfg["num_hidden_layers"] = layers
    config = Qwen2Config(**cfg)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


class Timer:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __call__(self, fn, reps: int) -> float:  # type: ignore[no-untyped-def]
        fn()
        times = []
        for _ in range(reps):
            if self.cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                torch.cuda.synchronize()
                times.append(a.elapsed_time(b))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1000)
        return statistics.median(times)


@torch.inference_mode()
def eager_curve(model, device, ks, kv, batch, reps, timer):  # type: ignore[no-untyped-def]
    from transformers import DynamicCache

    vocab = model.config.vocab_size
    cache = DynamicCache(config=model.config)
    model(input_ids=torch.randint(0, vocab, (batch, kv), device=device), cache=cache, use_cache=True, logits_to_keep=1)
    out = {}
    for k in ks:
        ids = torch.randint(0, vocab, (batch, k), device=device)

        def step() -> None:
            model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=k)
            cache.crop(kv - cache.get_seq_length())

        out[k] = round(timer(step, reps), 3)
    return out


@torch.inference_mode()
def graph_curve(model, device, ks, kv, reps, timer):  # type: ignore[no-untyped-def]
    """Batch 1, StaticCache, one CUDA graph per k (captured once, replayed):
    the verify forward without launch overhead."""
    from transformers import StaticCache

    vocab = model.config.vocab_size
    out = {}
    for k in ks:
        cache = StaticCache(config=model.config, max_cache_len=kv + 32)
        model(input_ids=torch.randint(0, vocab, (1, kv), device=device), cache=cache, use_cache=True,
              cache_position=torch.arange(kv, device=device), logits_to_keep=1)
        ids = torch.randint(0, vocab, (1, k), device=device)
        pos = torch.arange(kv, kv + k, device=device)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                model(input_ids=ids, cache=cache, use_cache=True, cache_position=pos, logits_to_keep=k)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            model(input_ids=ids, cache=cache, use_cache=True, cache_position=pos, logits_to_keep=k)
        out[k] = round(timer(graph.replay, reps), 3)
        del graph, cache
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--models", default="qwen2.5-coder-1.5b,qwen2.5-coder-0.5b")
    p.add_argument("--layers", type=int, default=0, help="override num_hidden_layers (0 = the real depth)")
    p.add_argument("--ks", default=",".join(str(k) for k in range(1, 17)))
    p.add_argument("--batches", default="1,2,4,8,16,32")
    p.add_argument("--batch-ks", default="1,5")
    p.add_argument("--kv", type=int, default=200)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--no-graphs", action="store_true")
    p.add_argument("--out", type=Path, default=Path("gpu-out"))
    a = p.parse_args()
    device = torch.device(a.device)
    dtype = getattr(torch, a.dtype)
    ks = [int(k) for k in a.ks.split(",")]
    timer = Timer(device)
    a.out.mkdir(parents=True, exist_ok=True)
    res: dict[str, object] = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                              "torch": torch.__version__, "dtype": a.dtype, "kv_tokens": a.kv, "models": {},
                              "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M")}
    for name in a.models.split(","):
        t0 = time.perf_counter()
        model = build(name, a.layers, dtype, device)
        row: dict[str, object] = {"params_m": round(sum(x.numel() for x in model.parameters()) / 1e6, 1)}
        row["eager_ms"] = eager_curve(model, device, ks, a.kv, 1, a.reps, timer)
        print(f"[gpu-costs] {name} eager: {row['eager_ms']}", flush=True)
        if device.type == "cuda" and not a.no_graphs:
            try:
                row["cuda_graph_ms"] = graph_curve(model, device, ks, a.kv, a.reps, timer)
                print(f"[gpu-costs] {name} cuda graph: {row['cuda_graph_ms']}", flush=True)
            except Exception as e:  # report, keep the eager figures
                row["cuda_graph_error"] = repr(e)[:500]
                print(f"[gpu-costs] {name} cuda graph failed: {e!r}", flush=True)
        batched: dict[str, dict[int, float]] = {}
        for k in (int(x) for x in a.batch_ks.split(",")):
            batched[str(k)] = {b: eager_curve(model, device, [k], a.kv, b, max(3, a.reps // 2), timer)[k]
                               for b in (int(x) for x in a.batches.split(","))}
        row["batched_eager_ms"] = batched
        print(f"[gpu-costs] {name} batched (k -> B -> ms): {batched}", flush=True)
        row["seconds"] = round(time.perf_counter() - t0, 1)
        res["models"][name] = row  # type: ignore[index]
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    (a.out / "gpu_costs.json").write_text(json.dumps(res, indent=2))
    (a.out / "gpu_costs.md").write_text(to_markdown(res))
    plot(res, a.out / "gpu_costs.png")
    print(to_markdown(res))
    return 0


def to_markdown(res: dict) -> str:  # type: ignore[type-arg]
    lines = [f"Device {res['device']}, torch {res['torch']}, {res['dtype']}, KV {res['kv_tokens']} tokens. "
             f"Command: `{res['command']}`", ""]
    for name, r in res["models"].items():
        ks = sorted(int(k) for k in r["eager_ms"])
        lines += [f"**{name}** ({r['params_m']} M parameters, random weights), ms per forward of k tokens:", "",
                  "| path | " + " | ".join(f"k={k}" for k in ks) + " |", "|---" * (len(ks) + 1) + "|"]
        for path in ("eager_ms", "cuda_graph_ms"):
            if path in r:
                cur = {int(k): v for k, v in r[path].items()}
                lines.append(f"| {path[:-3]} | " + " | ".join(f"{cur[k]:.2f}" for k in ks) + " |")
        for k, row in r["batched_eager_ms"].items():
            bs = sorted(int(b) for b in row)
            lines += ["", f"Batched, {k} token(s) per session: " + ", ".join(f"B={b}: {row[b] if b in row else row[str(b)]:.2f} ms" for b in bs)]
        lines.append("")
    return "\n".join(lines)


def plot(res: dict, path: Path) -> None:  # type: ignore[type-arg]
    from specdec_app.bench_report import plot_curves

    series, styles = {}, {}
    for name, r in res["models"].items():
        for key, style in (("eager_ms", "-"), ("cuda_graph_ms", "--")):
            if key in r:
                label = f"{name} {key[:-3]}"
                series[label] = {int(k): v for k, v in r[key].items()}
                styles[label] = style
    plot_curves(series, path, str(res["device"]), styles)


if __name__ == "__main__":
    raise SystemExit(main())
