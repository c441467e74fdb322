"""Where one decoding step of the real target goes, in-process: the engine's
own 1-token (and k-token) verify after a prompt, split into the linear
layers of the decoder (our kernel, timed around each call), the rest of each
decoder layer (transformers' eager ops), the LM head, and the rest (the final
norm, the greedy choice and logit gaps, the engine's bookkeeping), plus the torch profiler's
top eager ops. The split is what says whether a faster matmul or fewer small
ops is the next gain (issue 24).

    .venv/bin/python scripts/step_breakdown.py --backend kquant --out docs/bench/step-breakdown-zen4
    .venv/bin/python scripts/step_breakdown.py --backend kquant-a8 --k 1,8 --out /tmp/sb

Writes results.json, results.md and breakdown.png into --out. Run it alone
on the machine: the figures are times.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--backend", default="kquant")
    p.add_argument("--prompt-tokens", type=int, default=100)
    p.add_argument("--k", default="1", help="comma-separated rows per verify (1 = a plain step)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--layers", default="stack,two-calls",
                   help="comma-separated decoder-layer paths to compare in one process, interleaved: stack "
                        "(target_service/fast_stack.py: the two-call layers in one C call, the kquant default; "
                        "no hooks on the layers, so the step is split into the LM head and the rest only), two-calls "
                        "(target_service/fastlayers.py's layer_forward, the kquant default: two C calls per "
                        "layer, whose linear layers the hooks cannot see), fused (fast_forward: a C call per small "
                        "op, the linear layers from Python), fused-sdpa (the same with the model's SDPA) and/or "
                        "eager (transformers' forward)")
    p.add_argument("--linear-hooks", action=argparse.BooleanOptionalAction, default=True,
                   help="time the linear layers (hooks on each call: a few microseconds each, on the paths "
                        "that call them from Python)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; each (layers, k) keeps its best")
    p.add_argument("--paired-steps", type=int, default=0,
                   help="then this many steps per k alternating, step by step, between the stack loop and "
                        "transformers' loop over the same two-call layers (no hooks on either): the median of each "
                        "and of the ratio of neighbouring steps, which the VM's drift between rounds does not move")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile

    from specdec.models import default_cache_dir, resolve
    from specdec.sampling import SamplingConfig
    from target_service.backends import cpu_info
    from target_service.engine import TargetEngine

    r = resolve(a.model, default_cache_dir())
    eng = TargetEngine(r.hf_dir, dtype=a.dtype, backend=a.backend, model_name=r.name, gguf_path=r.gguf_path)
    times: dict[str, float] = collections.defaultdict(float)

    def timed(mod: torch.nn.Module, name: str) -> list:  # type: ignore[type-arg]
        # hooks, not a wrapped forward: the layers' forward is switched below (--layers)
        start: list[float] = [0.0]

        def pre(*_):  # type: ignore[no-untyped-def]
            start[0] = time.perf_counter()

        def post(*_):  # type: ignore[no-untyped-def]
            times[name] += time.perf_counter() - start[0]

        return [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]

    linear_types = {"KQuantLinear", "Int4Linear", "PackedLinear", "Bf16WeightLinear", "Linear"}
    layer_hooks = []  # removed for the stack path (fast_stack steps aside for a hooked layer)
    for name, mod in eng.model.named_modules():
        kind = type(mod).__name__
        if kind == "Qwen2DecoderLayer" or kind.endswith("DecoderLayer"):
            layer_hooks.append((mod, "decoder layers"))
        elif name.endswith("lm_head"):
            timed(mod, "lm head")
        elif a.linear_hooks and kind in linear_types and not any(c for c in mod.children()):
            layer_hooks.append((mod, "linear layers"))

    out = eng.prefill(list(range(1000, 1000 + a.prompt_tokens)), SamplingConfig(), True)
    state = {"n": out.cache_len, "next": out.next_token}

    def step(k: int) -> None:
        v = eng.verify(out.session_id, state["n"], [state["next"]], [5] * (k - 1), [None] * (k - 1))
        state["n"], state["next"] = v.cache_len, v.result.next_token

    from target_service import fastlayers

    handles: list = []  # type: ignore[type-arg]

    def set_layers(mode: str) -> None:
        fastlayers.uninstall(eng.model)
        for h in handles:
            h.remove()
        handles.clear()
        if mode != "stack":
            for mod, name in layer_hooks:
                handles.extend(timed(mod, name))
        if mode in ("fused", "fused-sdpa"):
            fastlayers.install(eng.model, c_attention=mode == "fused", two_calls=False)
        elif mode in ("two-calls", "stack"):
            fastlayers.install(eng.model)
        elif mode != "eager":
            raise SystemExit(f"unknown --layers {mode!r}")

    modes = [x for x in a.layers.split(",") if x]
    ks = [int(x) for x in a.k.split(",") if x]
    bests: dict[tuple[str, int], dict[str, float]] = {}
    # rounds of every (layers, k), interleaved: the VM's slow spells hit
    # every variant alike; each keeps the best of its --rounds runs
    for _ in range(a.rounds):
        for mode in modes:
            set_layers(mode)
            for k in ks:
                for _ in range(5):
                    step(k)
                times.clear()
                t0 = time.perf_counter()
                for _ in range(a.steps):
                    step(k)
                run = {"step": (time.perf_counter() - t0) / a.steps * 1e3}
                run.update({key: v / a.steps * 1e3 for key, v in times.items()})
                if (mode, k) not in bests or run["step"] < bests[(mode, k)]["step"]:
                    bests[(mode, k)] = run
    rows = []
    for mode, k in [(m, k) for m in modes for k in ks]:
        set_layers(mode)
        best = bests[(mode, k)]
        row = {
            "layers": mode,
            "k": k,
            "step_ms": round(best["step"], 2),
            "linear_ms": round(best.get("linear layers", 0.0), 2),
            "layers_other_ms": round(best.get("decoder layers", 0.0) - best.get("linear layers", 0.0), 2),
            "decoder_layers_ms": round(best.get("decoder layers", 0.0), 2),
        }
        if mode in ("two-calls", "stack") or not a.linear_hooks:  # the linear layers run inside the C calls, unseen
            row["linear_ms"] = row["layers_other_ms"] = None
        row["lm_head_ms"] = round(best.get("lm head", 0.0), 2)
        # the final norm, the greedy choice, logit gaps, the engine's own bookkeeping
        row["outside_layers_ms"] = round(best["step"] - best.get("decoder layers", 0.0) - best.get("lm head", 0.0), 2)
        if mode == "stack":  # the layers are not timed on their own: the step less the LM head
            row["decoder_layers_ms"] = row["outside_layers_ms"] = None
            row["layers_and_rest_ms"] = round(best["step"] - best.get("lm head", 0.0), 2)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(10):
                step(k)
        ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:12]
        row["top_eager_ops"] = [
            {"op": e.key, "ms_per_step": round(e.self_cpu_time_total / 1e3 / 10, 3), "calls_per_step": e.count // 10}
            for e in ops
        ]
        rows.append(row)
        print(json.dumps({key: v for key, v in row.items() if key != "top_eager_ops"}), flush=True)

    paired = []
    if a.paired_steps > 0:
        import statistics

        from target_service import fast_stack

        set_layers("stack")
        for k in ks:
            ms: dict[bool, list[float]] = {True: [], False: []}
            for i in range(2 * a.paired_steps):
                on = (i % 2 == 0) == ((i // 2) % 2 == 0)  # ABBA
                fast_stack.ENABLED = on
                t0 = time.perf_counter()
                step(k)
                ms[on].append((time.perf_counter() - t0) * 1e3)
            fast_stack.ENABLED = True
            pair = {"k": k, "steps": a.paired_steps, "stack_ms": round(statistics.median(ms[True]), 2),
                    "transformers_loop_ms": round(statistics.median(ms[False]), 2),
                    "paired_ratio": round(statistics.median(x / y for x, y in zip(ms[True], ms[False])), 4)}
            paired.append(pair)
            print(json.dumps(pair), flush=True)

    info = cpu_info()
    result = {"model": r.name, "dtype": a.dtype, "backend": a.backend, "prompt_tokens": a.prompt_tokens,
              "cpu": info.model, "flags": sorted(f for f in info.flags if f.startswith(("avx", "amx", "fma"))),
              "torch": torch.__version__, "rows": rows, "paired": paired}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    md = [f"# One decoding step, {r.name} {a.dtype}/{a.backend}, {a.prompt_tokens}-token context", "",
          f"CPU: {info.model}; torch {torch.__version__}", "",
          "| layers | k | step ms | decoder layers | linear layers | rest of the decoder layers | LM head | the rest |",
          "|---|---|---|---|---|---|---|---|"]
    md += [f"| {x['layers']} | {x['k']} | {x['step_ms']} | {x['decoder_layers_ms'] or '-'} | {x['linear_ms'] or '-'} | "
           f"{x['layers_other_ms'] or '-'} | {x['lm_head_ms']} | {x['outside_layers_ms'] or '-'} |" for x in rows]
    if any(x["layers"] == "stack" for x in rows):
        md += ["", "stack: the layers and the rest together (the step less the LM head): "
               + ", ".join(f"k = {x['k']} {x['layers_and_rest_ms']} ms" for x in rows if x["layers"] == "stack")]
    if paired:
        md += ["", "The stack loop against transformers' loop over the same two-call layers, step by step in turn "
               "(ABBA), medians:", "", "| k | steps each | stack ms | transformers' loop ms | paired ratio |",
               "|---|---|---|---|---|"]
        md += [f"| {x['k']} | {x['steps']} | {x['stack_ms']} | {x['transformers_loop_ms']} | {x['paired_ratio']} |"
               for x in paired]
    for x in rows:
        md += ["", f"Top eager ops, {x['layers']} layers, k = {x['k']} (self CPU, per step):", "", "| op | ms | calls |", "|---|---|---|"]
        md += [f"| `{o['op']}` | {o['ms_per_step']} | {o['calls_per_step']} |" for o in x["top_eager_ops"]]
    (a.out / "results.md").write_text("\n".join(md) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(rows)), 3.5))
        labels = [f"{x['layers']} k={x['k']}" for x in rows]
        bottom = [0.0] * len(rows)
        for key, label in (("linear_ms", "linear layers"), ("layers_other_ms", "rest of the layers"),
                           ("decoder_layers_ms", "decoder layers (not split)"),
                           ("lm_head_ms", "LM head"), ("outside_layers_ms", "the rest")):
            if key == "decoder_layers_ms":  # only where the split is not known
                vals = [(x[key] if x[key] is not None else x.get("layers_and_rest_ms", 0.0))
                        if x["linear_ms"] is None else 0.0 for x in rows]
            else:
                vals = [x[key] or 0.0 for x in rows]
            ax.bar(labels, vals, bottom=bottom, label=label)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_ylabel("ms per step")
        ax.set_title(f"{a.dtype}/{a.backend}: one step")
        ax.legend()
        fig.tight_layout()
        fig.savefig(a.out / "breakdown.png", dpi=120)
    except ImportError:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
