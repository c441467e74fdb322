"""llguidance against xgrammar on the target's vocabulary (Qwen2.5, 151,936
logits): correctness first (every token of a valid output must be allowed by
each library's mask at its position, and the mask must forbid something),
then compile time per grammar and the cost of one next-token mask, stepping
through the valid output token by token. Both on one thread.

    pip install -e '.[grammar-bench]'    # xgrammar (llguidance is a runtime dependency)
    .venv/bin/python scripts/grammar_bench.py --out bench-out/grammar

Writes grammar_bench.json, grammar_bench.md and grammar_bench.png into --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

NESTED = {"type": "object", "properties": {
    "name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}},
    "matrix": {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}},
    "owner": {"type": "object", "properties": {"id": {"type": "integer"}, "emails": {
        "type": "array", "items": {"type": "string"}}}, "required": ["id", "emails"]},
}, "required": ["name", "tags", "matrix", "owner"]}
ENUMS = {"type": "object", "properties": {
    "color": {"enum": ["red", "green", "blue", "cyan", "magenta", "yellow", "black", "white"]},
    "size": {"enum": ["xs", "s", "m", "l", "xl", "xxl"]},
    "status": {"enum": ["draft", "review", "approved", "rejected", "archived"]},
    "flags": {"type": "array", "items": {"enum": ["new", "sale", "limited", "eco"]}},
}, "required": ["color", "size", "status", "flags"]}
DATE = r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
CASES: list[tuple[str, str, str, str]] = [  # (name, kind, source, a valid output)
    ("nested-arrays", "json_schema", json.dumps(NESTED), json.dumps(
        {"name": "specdec", "tags": ["fast", "exact"], "matrix": [[1, 2], [3, 4, 5]],
         "owner": {"id": 7, "emails": ["a@example.com"]}})),
    ("enum-heavy", "json_schema", json.dumps(ENUMS), json.dumps(
        {"color": "magenta", "size": "xl", "status": "approved", "flags": ["sale", "eco"]})),
    ("json-object", "json_object", "", json.dumps({"k": [1, {"v": None}], "s": "text"})),
    ("date-regex", "regex", DATE, "2026-12-01"),
]


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab: int, eos: list[int]) -> None:
        from specdec.grammar import GrammarCompiler

        self.compiler = GrammarCompiler(tokenizer, vocab, eos, max_cached=0)

    def compile(self, kind: str, source: str) -> Any:
        from specdec.grammar import GrammarSpec

        return self.compiler.state(GrammarSpec(kind, source), 0)

    @staticmethod
    def mask(state: Any) -> np.ndarray:
        return state.allowed()

    @staticmethod
    def advance(state: Any, token: int) -> bool:
        return bool(state.advance(token))


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab: int, eos: list[int]) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.vocab = vocab
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=eos)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)

    def compile(self, kind: str, source: str) -> Any:
        if kind == "json_schema":
            cg = self.compiler.compile_json_schema(source)
        elif kind == "json_object":
            cg = self.compiler.compile_builtin_json_grammar()
        else:
            cg = self.compiler.compile_regex(source)
        return self.xgr.GrammarMatcher(cg), self.xgr.allocate_token_bitmask(1, self.vocab)

    def mask(self, state: Any) -> np.ndarray:
        matcher, bitmask = state
        matcher.fill_next_token_bitmask(bitmask)
        bits = bitmask.numpy().view(np.uint8)[0]
        return np.unpackbits(bits, bitorder="little")[: self.vocab].astype(bool)

    @staticmethod
    def advance(state: Any, token: int) -> bool:
        return bool(state[0].accept_token(token))


def run(lib: Any, tokenizer: Any, repeats: int) -> list[dict[str, Any]]:
    out = []
    for name, kind, source, text in CASES:
        tokens = tokenizer(text, add_special_tokens=False)["input_ids"]
        compile_ms, mask_ms, ok = [], [], True
        for _ in range(repeats):
            t0 = time.perf_counter()
            state = lib.compile(kind, source)
            compile_ms.append((time.perf_counter() - t0) * 1e3)
            for t in tokens:
                t0 = time.perf_counter()
                m = lib.mask(state)
                mask_ms.append((time.perf_counter() - t0) * 1e3)
                ok = ok and bool(m[t]) and not bool(m.all())
                ok = lib.advance(state, t) and ok
        out.append({"library": lib.name, "grammar": name, "tokens": len(tokens), "correct": ok,
                    "compile_ms_median": statistics.median(compile_ms),
                    "mask_ms_median": statistics.median(mask_ms), "mask_ms_p90": sorted(mask_ms)[int(0.9 * (len(mask_ms) - 1))]})
        print(json.dumps(out[-1]), flush=True)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("bench-out/grammar"))
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct", help="whose tokenizer (a model spec)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--libraries", default="llguidance,xgrammar")
    a = p.parse_args()
    import torch
    from transformers import AutoConfig, AutoTokenizer

    from specdec.models import default_cache_dir, resolve

    torch.set_num_threads(1)
    hf = resolve(a.model, default_cache_dir()).hf_dir
    tokenizer = AutoTokenizer.from_pretrained(str(hf))
    vocab = int(AutoConfig.from_pretrained(str(hf)).vocab_size)
    eos = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    libs = {"llguidance": Llguidance, "xgrammar": Xgrammar}
    rows = []
    for name in a.libraries.split(","):
        t0 = time.perf_counter()
        lib = libs[name](tokenizer, vocab, eos)
        print(f"{name}: tokenizer set-up {(time.perf_counter() - t0) * 1e3:.0f} ms", flush=True)
        rows += run(lib, tokenizer, a.repeats)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "grammar_bench.json").write_text(json.dumps({"vocab_size": vocab, "model": a.model, "rows": rows},
                                                         indent=1))
    lines = [f"# Grammar libraries on {a.model} ({vocab} logits), one thread", "",
             "| library | grammar | correct | compile ms (median) | mask ms/token (median) | p90 |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['library']} | {r['grammar']} | {'yes' if r['correct'] else 'NO'} | {r['compile_ms_median']:.1f} "
              f"| {r['mask_ms_median']:.3f} | {r['mask_ms_p90']:.3f} |" for r in rows]
    (a.out / "grammar_bench.md").write_text("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    names = [c[0] for c in CASES]
    x = np.arange(len(names))
    for i, lib in enumerate(sorted({r["library"] for r in rows})):
        mine = {r["grammar"]: r for r in rows if r["library"] == lib}
        axes[0].bar(x + 0.4 * i, [mine[n]["compile_ms_median"] for n in names], 0.4, label=lib)
        axes[1].bar(x + 0.4 * i, [mine[n]["mask_ms_median"] for n in names], 0.4, label=lib)
    for ax, title in zip(axes, ("compile (ms)", "next-token mask (ms)")):
        ax.set_xticks(x + 0.2, names, rotation=15)
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(a.out / "grammar_bench.png", dpi=120)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
