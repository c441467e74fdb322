"""Microseconds per decoder-layer call of a tiny quantized Qwen2 on the
kquant backend, for each decoder-layer path of target_service/fastlayers.py
(interleaved rounds, best of each): ``fused`` (fast_forward: one C call per
small op, the kernel's linear layers from Python) and ``two-calls``
(layer_forward: kq_layer_pre and kq_layer_post around the cache update).
The layer is called as the model calls it, with a 1-row (or --t-row)
input over a cache of --context tokens (layer 0 of the cache cut back after each
call). Measures Python and dispatch overhead: run it alone on the machine.

    .venv/bin/python scripts/layer_call_bench.py --out /tmp/layer-bench.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--t", type=int, default=1, help="rows per call")
    p.add_argument("--context", type=int, default=100)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", type=Path)
    a = p.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from target_service import fastlayers, kv_adapter, quant
    from tests.conftest import TINY_CHARS
    from tests.gguf_tiny import quantize_tiny_model
    from tests.tiny import build_tiny_model

    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="layer-bench-"))
    hf = build_tiny_model(root / "hf", chars=TINY_CHARS, seed=23, hidden_size=256, intermediate_size=512,
                          num_heads=4, num_kv_heads=2)
    gguf = quantize_tiny_model(hf, root / "model.gguf")
    m = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32).eval()
    m.set_attn_implementation("sdpa")
    with torch.inference_mode():
        quant.apply_quant(m, "kquant", gguf)
        ids = torch.randint(1, 30, (1, a.context), generator=torch.Generator().manual_seed(1))
        cache = kv_adapter.new_cache(m.config)
        m(input_ids=ids, cache=cache)
        layer = m.model.layers[0]
        x = torch.randn(1, a.t, m.config.hidden_size)
        pos = torch.arange(a.context, a.context + a.t)[None]
        pe = m.model.rotary_emb(x, pos)
        modes = {"fused": False, "two-calls": True}
        best: dict[str, float] = {}
        outs = {}
        for _ in range(a.rounds):
            for mode, two in modes.items():
                fastlayers.uninstall(m)
                fastlayers.install(m, two_calls=two)
                for i in range(a.calls + 50):
                    if i == 50:
                        t0 = time.perf_counter()
                    outs[mode] = layer(x, attention_mask=None, position_ids=pos, cache=cache, use_cache=True,
                                       position_embeddings=pe)
                    cache.layers[0].crop(-a.t)
                us = (time.perf_counter() - t0) / a.calls * 1e6
                best[mode] = min(best.get(mode, us), us)
        assert torch.equal(outs["fused"], outs["two-calls"])
    result = {"model": "tiny Qwen2 (hidden 256, MLP 512, 4 heads, 2 KV heads), kquant", "t": a.t,
              "context": a.context, "torch": torch.__version__, "us_per_layer_call": {k: round(v, 1) for k, v in best.items()}}
    print(json.dumps(result))
    if a.out:
        a.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
