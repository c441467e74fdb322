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
    forward(model, cache, PROMPT + [15, 16, 17])
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


def _plain_cache(config: Any) -> Any:
    """transformers' own cache, whose layers concatenate on every update: the reference."""
    return kv.DynamicCache(config=config)


def test_appends_write_in_place_and_give_the_concatenating_caches_logits(model: Any) -> None:
    """A session's layers append into their own buffer: one allocation for
    the prompt and its headroom, then no other while the appends fit. The
    logits equal transformers' concatenating cache exactly, before and after
    a rollback whose rejected tokens the next append overwrites."""
    grow, ref = kv.new_cache(model.config), _plain_cache(model.config)
    assert all(isinstance(layer, kv.GrowingLayer) for layer in grow.layers)
    assert not any(isinstance(layer, kv.GrowingLayer) for layer in ref.layers)
    assert torch.equal(forward(model, grow, PROMPT), forward(model, ref, PROMPT))
    base = kv.layer_kv(grow, 0)[0].data_ptr()
    buffers = {base}
    for step in range(6):
        assert torch.equal(forward(model, grow, [1 + (7 * step) % 20]), forward(model, ref, [1 + (7 * step) % 20]))
        buffers.add(kv.layer_kv(grow, 0)[0].data_ptr())
    assert buffers == {base}  # 14 tokens of a 72-token buffer: every append in place
    forward(model, grow, [6, 8, 10])  # a verify's drafted tokens, then two rejected
    forward(model, ref, [6, 8, 10])
    kv.drop_last(grow, 2)
    kv.drop_last(ref, 2)
    assert kv.layer_kv(grow, 0)[0].data_ptr() == base
    assert torch.equal(forward(model, grow, [12, 14]), forward(model, ref, [12, 14]))
    assert kv.length(grow) == kv.length(ref) == len(PROMPT) + 6 + 1 + 2


def test_a_layer_that_outgrows_its_buffer_moves_once_and_keeps_its_tokens(model: Any) -> None:
    grow, ref = kv.new_cache(model.config), _plain_cache(model.config)
    forward(model, grow, PROMPT)
    forward(model, ref, PROMPT)
    first = kv.layer_kv(grow, 1)[0].data_ptr()
    room = len(PROMPT) + kv.headroom(len(PROMPT))  # the buffer's tokens; the layer never fills it
    long = [1 + (3 * i) % 20 for i in range(room - len(PROMPT))]
    assert torch.equal(forward(model, grow, long), forward(model, ref, long))
    moved = kv.layer_kv(grow, 1)[0]
    assert moved.data_ptr() != first
    assert moved.untyped_storage().nbytes() == (room + kv.headroom(room)) * moved[0, :, :1].numel() * moved.element_size()
    assert torch.equal(kv.layer_kv(grow, 1)[0], kv.layer_kv(ref, 1)[0])


def test_keys_set_from_outside_are_never_written_into(model: Any) -> None:
    """A prefix-cache hit hands a session views of an entry's tensors; the
    session's next append must move them into a buffer of its own, or it
    would overwrite the entry (and every other session sharing it)."""
    src = kv.new_cache(model.config)
    forward(model, src, PROMPT + [15, 16, 17])
    entry = [tuple(kv.owned(t) for t in kv.layer_kv(src, li)) for li in range(kv.num_layers(src))]
    # owned() copies a growing layer's tensors (they never fill their buffer): an entry shares nothing with src
    assert entry[0][0].untyped_storage().data_ptr() != kv.layer_kv(src, 0)[0].untyped_storage().data_ptr()
    saved = [(k.clone(), v.clone()) for k, v in entry]
    hit = kv.new_cache(model.config)
    for li, (k, v) in enumerate(entry):
        kv.set_layer_kv(hit, li, k[:, :, : len(PROMPT)], v[:, :, : len(PROMPT)])  # a hit on the prompt alone
    ref = _plain_cache(model.config)
    forward(model, ref, PROMPT)
    assert torch.equal(forward(model, hit, [18, 19]), forward(model, ref, [18, 19]))
    assert all(torch.equal(k, sk) and torch.equal(v, sv) for (k, v), (sk, sv) in zip(entry, saved))


def test_a_layer_set_from_outside_after_its_own_appends_is_not_written_into(model: Any) -> None:
    """The append that follows an append writes without re-checking, but
    only while the layer holds the very views the last one left: keys set
    from outside in between (a prefix hit replacing a session's layers) are
    moved into a buffer of the layer's own, never written into."""
    grow = kv.new_cache(model.config)
    forward(model, grow, PROMPT)
    forward(model, grow, [3])  # the layers now hold the views their last append left
    src = kv.new_cache(model.config)
    forward(model, src, PROMPT + [15])
    outside = [tuple(kv.owned(t) for t in kv.layer_kv(src, li)) for li in range(kv.num_layers(src))]
    saved = [(k.clone(), v.clone()) for k, v in outside]
    for li, (k, v) in enumerate(outside):
        kv.set_layer_kv(grow, li, k[:, :, : len(PROMPT)], v[:, :, : len(PROMPT)])
    ref = _plain_cache(model.config)
    forward(model, ref, PROMPT)
    assert torch.equal(forward(model, grow, [18, 19]), forward(model, ref, [18, 19]))
    assert all(torch.equal(k, sk) and torch.equal(v, sv) for (k, v), (sk, sv) in zip(outside, saved))
    assert torch.equal(forward(model, grow, [4]), forward(model, ref, [4]))  # and appends on as before
