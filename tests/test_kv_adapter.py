"""target_service/kv_adapter.py against the installed transformers release,
with the tiny Qwen2 target: what the engine relies on of DynamicCache
(lengths, rolling back by a count of tokens, lazily initialised layers
written directly, batching eligibility, compaction of views). A release
that changes any of these fails here rather than in the engine's
numerics."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from target_service import kv_adapter as kv

PROMPT = [3, 5, 7, 9, 11, 13, 2, 4]


@pytest.fixture(scope="module")
def model(tiny_models) -> Any:  # type: ignore[no-untyped-def]
    return AutoModelForCausalLM.from_pretrained(tiny_models.target, dtype=torch.float32).eval()


@torch.inference_mode()
def forward(model: Any, cache: Any, ids: list[int]) -> torch.Tensor:
    kwarg = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
    out = model(input_ids=torch.tensor([ids]), use_cache=True, **{kwarg: cache})
    return out.logits[0].float()


def test_a_new_cache_is_empty_and_grows_by_the_tokens_fed(model: Any) -> None:
    cache = kv.new_cache(model.config)
    assert kv.length(cache) == 0
    assert kv.num_layers(cache) == model.config.num_hidden_layers
    with pytest.raises(ValueError, match="holds no tokens"):
        kv.layer_kv(cache, 0)
    forward(model, cache, PROMPT)
    assert kv.length(cache) == len(PROMPT)
    keys, values = kv.layer_kv(cache, 0)
    assert keys.shape[0] == 1 and keys.shape[2] == len(PROMPT) and values.shape[2] == len(PROMPT)


def test_drop_last_removes_that_many_tokens_from_the_end(model: Any) -> None:
    """The rollback after a verify: the kept prefix is untouched, and the
    model continues from it exactly as from a cache that never held the
    dropped tokens. A count of 0 or less does nothing (it is not a length:
    transformers reads a positive crop as a length before 5.18 and refuses it
    since)."""
    cache, ref = kv.new_cache(model.config), kv.new_cache(model.config)
    forward(model, cache, PROMPT + [20, 21, 22])
    forward(model, ref, PROMPT)
    before = kv.layer_kv(cache, 1)[0].clone()
    kv.drop_last(cache, 0)
    kv.drop_last(cache, -2)
    assert kv.length(cache) == len(PROMPT) + 3
    kv.drop_last(cache, 3)
    assert kv.length(cache) == len(PROMPT)
    assert torch.equal(kv.layer_kv(cache, 1)[0], before[:, :, : len(PROMPT)])
    assert torch.allclose(forward(model, cache, [30]), forward(model, ref, [30]), atol=1e-6)


def test_layers_written_directly_on_a_fresh_cache_are_lazily_initialised(model: Any) -> None:
    """The batched forward builds a cache by writing tensors into layers that
    were never updated (and hands sessions back views of it): the model then
    continues from them as from the cache they were copied from."""
    src = kv.new_cache(model.config)
    forward(model, src, PROMPT)
    padded = kv.new_cache(model.config)
    for li in range(kv.num_layers(src)):
        k, v = kv.layer_kv(src, li)
        big_k = torch.cat([k, k], dim=0)  # a batch of two; the session is row 1
        big_v = torch.cat([v, v], dim=0)
        kv.set_layer_kv(padded, li, big_k[1:2], big_v[1:2])
    assert kv.length(padded) == len(PROMPT)
    assert torch.allclose(forward(model, padded, [30, 31]), forward(model, src, [30, 31]), atol=1e-6)


def test_compact_gives_each_layer_its_own_storage(model: Any) -> None:
    cache = kv.new_cache(model.config)
    big = torch.zeros((4, model.config.num_key_value_heads, 16, model.config.hidden_size // model.config.num_attention_heads))
    for li in range(kv.num_layers(cache)):
        kv.set_layer_kv(cache, li, big[2:3, :, 3:9], big[1:2, :, 3:9])
    assert kv.layer_kv(cache, 0)[0].untyped_storage().nbytes() == big.untyped_storage().nbytes()
    kv.compact(cache)
    keys, values = kv.layer_kv(cache, 0)
    assert keys.is_contiguous() and keys.untyped_storage().nbytes() == keys.numel() * keys.element_size()
    assert values.untyped_storage().data_ptr() != big.untyped_storage().data_ptr()
    assert kv.length(cache) == 6


def test_only_plain_full_attention_layers_are_batchable(model: Any) -> None:
    assert kv.batchable(kv.new_cache(model.config))
    sliding = Qwen2Config(num_hidden_layers=2, use_sliding_window=True, sliding_window=4,
                          layer_types=["sliding_attention", "full_attention"])
    assert not kv.batchable(kv.new_cache(sliding))
