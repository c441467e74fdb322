"""int4 weight-only matmul against bf16 ``F.linear`` over the linear layers of
the 1.5B target (Qwen2.5-Coder-1.5B shapes, random weights). Part of
``scripts/gpu_check.sh``; runs on CPU too (``--device cpu --layers 1 --vocab
512``) so CI checks that it works.

Kernels, group 32, bf16 activations, ``w = (q - 8) * scale + zero`` with
scales_and_zeros [K/32, N, 2] bf16:
- CUDA (tinygemm): ``torch.ops.aten._convert_weight_to_int4pack`` of uint8
  [N, K/2] (two 4-bit values a byte, the even column in the high nibble) and
  ``torch.ops.aten._weight_int4pack_mm``;
- CPU: ``_convert_weight_to_int4pack_for_cpu`` of int32 [N, K] and
  ``_weight_int4pack_mm_for_cpu``.

For rows M = 1, 2, 4, 8, 16: ms for one pass over every linear layer (28 ×
q, k, v, o, gate, up, down, then lm_head 151936 × 1536; distinct weights, so
the pass streams them from memory as a decode step does), int4 and bf16,
eager and (CUDA) replayed from one CUDA graph. Checks on each distinct shape:
the int4 product against float32 with the dequantized weight (the packing is
right), and row invariance (each of 8 rows computed alone bit-identical to
the same row among the 8), int4 and bf16.

When the int4 ops are missing or fail on the device, the int4 part is skipped
with its reason printed and in the JSON; bf16 is still measured.

Writes gpu_int4.json, gpu_int4.md and gpu_int4.png into --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_costs import CONFIGS, Timer  # noqa: E402

REL_ERR_OK = 2e-2  # int4 product vs float32 with the dequantized weight: bf16 output rounding, not a wrong layout


@dataclass
class Int4Ops:
    """The pack and matmul ops for one device."""

    pack: Callable[[torch.Tensor], torch.Tensor]  # int32 [N, K] in 0..15 → packed weight
    mm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (x, packed, scales_and_zeros) → y
    names: tuple[str, str]


def int4_ops(device: torch.device, op: str, group: int, inner_k_tiles: int) -> Int4Ops:
    """The device's int4 ops (``op`` "auto", or an aten op name for the matmul,
    its pack op by the same naming); raises AttributeError when missing."""
    mm_name = op if op != "auto" else ("_weight_int4pack_mm" if device.type == "cuda" else "_weight_int4pack_mm_for_cpu")
    pack_name = mm_name.replace("_weight_int4pack_mm", "_convert_weight_to_int4pack")
    mm_op, pack_op = getattr(torch.ops.aten, mm_name), getattr(torch.ops.aten, pack_name)
    if pack_name.endswith("_for_cpu"):
        def pack(q: torch.Tensor) -> torch.Tensor:
            return pack_op(q.to(torch.int32).contiguous(), inner_k_tiles)
    else:
        def pack(q: torch.Tensor) -> torch.Tensor:
            return pack_op(((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8).contiguous(), inner_k_tiles)
    return Int4Ops(pack=pack, mm=lambda x, w, sz: mm_op(x, w, group, sz), names=(pack_name, mm_name))


@dataclass
class Linear:
    name: str
    n: int
    k: int
    bf16: torch.Tensor  # [N, K]
    q: torch.Tensor | None = None  # int32 [N, K], 0..15 (kept for the distinct shapes' checks only)
    packed: torch.Tensor | None = None
    sz: torch.Tensor | None = None  # [K/g, N, 2] bf16


def target_shapes(layers: int, vocab: int) -> list[tuple[str, int, int]]:
    """(name, N, K) of every linear layer of the 1.5B target, in forward order."""
    c = CONFIGS["qwen2.5-coder-1.5b"]
    h, inter = int(c["hidden_size"]), int(c["intermediate_size"])
    kv = int(c["num_key_value_heads"]) * h // int(c["num_attention_heads"])
    per_layer = [("q", h, h), ("k", kv, h), ("v", kv, h), ("o", h, h), ("gate", inter, h), ("up", inter, h),
                 ("down", h, inter)]
    shapes = [(f"{i}.{n}", rows, cols) for i in range(layers) for n, rows, cols in per_layer]
    return shapes + [("lm_head", vocab, h)]


def dequantized(lin: Linear, group: int) -> torch.Tensor:
    assert lin.q is not None and lin.sz is not None
    scale = lin.sz[..., 0].float().repeat_interleave(group, 0).T
    zero = lin.sz[..., 1].float().repeat_interleave(group, 0).T
    return (lin.q.float() - 8) * scale + zero


def build(shapes: list[tuple[str, int, int]], device: torch.device, group: int, ops: Int4Ops | None) -> list[Linear]:
    torch.manual_seed(0)
    out, seen = [], set()
    for name, n, k in shapes:
        lin = Linear(name, n, k, (torch.randn(n, k, device=device) * 0.02).to(torch.bfloat16))
        if ops is not None:
            q = torch.randint(0, 16, (n, k), dtype=torch.int32, device=device)
            scale = torch.rand(k // group, n, device=device) * 0.004 + 0.001
            zero = torch.randn(k // group, n, device=device) * 0.01
            lin.sz = torch.stack([scale, zero], -1).to(torch.bfloat16).contiguous()
            lin.packed = ops.pack(q)
            if (n, k) not in seen:
                lin.q = q
        seen.add((n, k))
        out.append(lin)
    return out


def checks(lins: list[Linear], ops: Int4Ops | None, group: int, device: torch.device) -> dict[str, Any]:
    """Per distinct shape: the int4 product's error against the dequantized
    float32 product, and how many of 8 rows are bit-identical alone and among 8."""
    torch.manual_seed(1)
    res: dict[str, Any] = {}
    done = set()
    for lin in lins:
        if (lin.n, lin.k) in done:
            continue
        done.add((lin.n, lin.k))
        x = torch.randn(8, lin.k, device=device).to(torch.bfloat16)
        row: dict[str, Any] = {"layer": lin.name}
        paths: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"bf16": lambda a: F.linear(a, lin.bf16)}
        if ops is not None and lin.packed is not None:
            paths["int4"] = lambda a: ops.mm(a, lin.packed, lin.sz)
            ref = x.float() @ dequantized(lin, group).T
            y = paths["int4"](x).float()
            row["int4_rel_err_vs_dequant"] = float((y - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
        for path, fn in paths.items():
            among = fn(x)
            row[f"{path}_rows_identical_alone_vs_among_8"] = sum(bool(torch.equal(fn(x[i:i + 1])[0], among[i]))
                                                                 for i in range(8))
        res[f"{lin.n}x{lin.k}"] = row
    return res


def graph_ms(run: Callable[[], None], reps: int, timer: Timer) -> float:
    """The pass captured once in a CUDA graph and replayed: no launch overhead."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    ms = timer(graph.replay, reps)
    del graph
    return ms


@torch.inference_mode()
def measure(lins: list[Linear], ops: Int4Ops | None, rows: list[int], reps: int, device: torch.device) -> dict[str, Any]:
    timer = Timer(device)
    out: dict[str, Any] = {}
    for m in rows:
        xs = {k: torch.randn(m, k, device=device).to(torch.bfloat16) for k in {lin.k for lin in lins}}

        def bf16_pass() -> None:
            for lin in lins:
                F.linear(xs[lin.k], lin.bf16)

        def int4_pass() -> None:
            assert ops is not None
            for lin in lins:
                ops.mm(xs[lin.k], lin.packed, lin.sz)

        passes = {"bf16": bf16_pass, **({"int4": int4_pass} if ops is not None else {})}
        for path, run in passes.items():
            out.setdefault(f"{path}_eager_ms", {})[m] = round(timer(run, reps), 4)
            if device.type == "cuda":
                try:
                    out.setdefault(f"{path}_graph_ms", {})[m] = round(graph_ms(run, reps, timer), 4)
                except Exception as e:  # report, keep the eager figure
                    out[f"{path}_graph_error"] = repr(e)[:300]
        print(f"[gpu-int4] M={m}: " + ", ".join(f"{k} {v[m]:.3f} ms" for k, v in out.items() if isinstance(v, dict) and m in v),
              flush=True)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--vocab", type=int, default=151936, help="lm_head rows")
    p.add_argument("--rows", default="1,2,4,8,16", help="activation rows M per pass")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--group", type=int, default=32)
    p.add_argument("--inner-k-tiles", type=int, default=8)
    p.add_argument("--int4-op", default="auto",
                   help="aten int4 matmul op (auto: _weight_int4pack_mm on CUDA, _weight_int4pack_mm_for_cpu on CPU)")
    p.add_argument("--out", type=Path, default=Path("gpu-out"))
    a = p.parse_args()
    device = torch.device(a.device)
    a.out.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                           "torch": torch.__version__, "group": a.group, "layers": a.layers, "vocab": a.vocab,
                           "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M")}
    ops: Int4Ops | None = None
    try:
        ops = int4_ops(device, a.int4_op, a.group, a.inner_k_tiles)
        probe = ops.pack(torch.randint(0, 16, (16, 256), dtype=torch.int32, device=device))  # the CPU op wants N % 16 == 0
        ops.mm(torch.zeros(1, 256, dtype=torch.bfloat16, device=device), probe,
               torch.ones(256 // a.group, 16, 2, dtype=torch.bfloat16, device=device))
        res["int4_ops"] = list(ops.names)
    except Exception as e:  # missing op (AttributeError) or no kernel for this device/build
        ops = None
        res["int4_skipped"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        print(f"[gpu-int4] int4 part skipped ({res['int4_skipped']}); measuring bf16 only", flush=True)
    t0 = time.perf_counter()
    lins = build(target_shapes(a.layers, a.vocab), device, a.group, ops)
    res["linears"] = len(lins)
    res["weight_mb"] = {"bf16": round(sum(x.bf16.numel() * 2 for x in lins) / 2**20, 1)}
    if ops is not None:
        res["weight_mb"]["int4"] = round(sum(x.packed.numel() * x.packed.element_size() + x.sz.numel() * 2
                                             for x in lins if x.packed is not None and x.sz is not None) / 2**20, 1)
    res["checks"] = checks(lins, ops, a.group, device)
    for lin in lins:
        lin.q = None
    res["pass"] = measure(lins, ops, [int(m) for m in a.rows.split(",")], a.reps, device)
    res["seconds"] = round(time.perf_counter() - t0, 1)
    (a.out / "gpu_int4.json").write_text(json.dumps(res, indent=2))
    md = to_markdown(res)
    (a.out / "gpu_int4.md").write_text(md)
    from specdec_app.bench_report import plot_curves

    plot_curves({k[:-3]: v for k, v in res["pass"].items() if k.endswith("_ms")}, a.out / "gpu_int4.png",
                f"{res['device']}: one pass over {res['linears']} linear layers")
    print(md)
    return 0


def to_markdown(res: dict[str, Any]) -> str:
    lines = [f"Device {res['device']}, torch {res['torch']}, {res['linears']} linear layers of the 1.5B target "
             f"(random weights; {res['weight_mb']} MiB), group {res['group']}. Command: `{res['command']}`", ""]
    if "int4_skipped" in res:
        lines += [f"int4 skipped: {res['int4_skipped']}", ""]
    else:
        lines += [f"int4 ops: {', '.join(res['int4_ops'])}", ""]
    ms = {k: v for k, v in res["pass"].items() if k.endswith("_ms")}
    rows = sorted({int(m) for v in ms.values() for m in v})
    lines += ["ms for one pass over every linear layer, M activation rows:", "",
              "| path | " + " | ".join(f"M={m}" for m in rows) + " |", "|---" * (len(rows) + 1) + "|"]
    lines += [f"| {k[:-3]} | " + " | ".join(f"{v[m]:.3f}" if m in v else "" for m in rows) + " |" for k, v in ms.items()]
    lines += ["", "Checks per distinct shape (N x K): int4 max error against the dequantized float32 product "
              f"(relative to the largest output; < {REL_ERR_OK} means the packing is right), and rows of 8 "
              "bit-identical computed alone and among 8:", "",
              "| shape | int4 rel. error | int4 rows identical | bf16 rows identical |", "|---|---|---|---|"]
    for shape, c in res["checks"].items():
        err = c.get("int4_rel_err_vs_dequant")
        int4 = ("", "") if err is None else (f"{err:.2e}" + ("" if err < REL_ERR_OK else " (WRONG)"),
                                             f"{c['int4_rows_identical_alone_vs_among_8']}/8")
        lines.append(f"| {shape} | {int4[0]} | {int4[1]} | {c['bf16_rows_identical_alone_vs_among_8']}/8 |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
