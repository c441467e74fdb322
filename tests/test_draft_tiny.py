"""tests.tiny (tiny test models) and specdec.tokenization."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.tiny import build_tiny_model, build_tiny_tokenizer
from specdec.tokenization import tokenizer_fingerprint

TINY_CHARS = "abcdefghijklmnopqrstuvwxyz .,:!?\n"  # as in conftest

if TYPE_CHECKING:
    from tests.conftest import TinyModels


def test_tokenizer_is_char_level_and_decodes_exactly(tiny_models: TinyModels) -> None:
    text = "hello world.\nok: yes!"
    for tok in (build_tiny_tokenizer(TINY_CHARS), AutoTokenizer.from_pretrained(str(tiny_models.target))):
        ids = tok(text)["input_ids"]
        assert ids == [TINY_CHARS.index(c) + 1 for c in text]
        assert tok.decode(ids) == text
        assert tok.eos_token_id == 0 and tok.convert_ids_to_tokens(0) == "<|endoftext|>"
        chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
        assert chat == "u:hi\na:"


def test_fingerprint_depends_on_the_token_map_only(tiny_models: TinyModels) -> None:
    a = tokenizer_fingerprint(AutoTokenizer.from_pretrained(str(tiny_models.target)))
    b = tokenizer_fingerprint(AutoTokenizer.from_pretrained(str(tiny_models.draft)))
    c = tokenizer_fingerprint(build_tiny_tokenizer(TINY_CHARS[::-1]))
    assert a == b != c and len(a) == 64


def test_build_is_deterministic_and_peaked(tmp_path: Path, tiny_models: TinyModels) -> None:
    again = build_tiny_model(tmp_path / "t", chars=TINY_CHARS, seed=1)
    assert (again / "model.safetensors").read_bytes() == (tiny_models.target / "model.safetensors").read_bytes()
    model = AutoModelForCausalLM.from_pretrained(str(again), dtype=torch.float32)
    assert model.config.vocab_size == len(TINY_CHARS) + 1 and not model.config.tie_word_embeddings
    ids = torch.tensor([[TINY_CHARS.index(c) + 1 for c in "the quick brown fox jumps over"]])
    with torch.no_grad():
        probs = model(ids).logits[0].softmax(-1)
    top = probs.max(-1).values
    # peaked but not degenerate: clear top-1 on average, sampling still has mass elsewhere
    assert 0.4 < float(top.mean()) < 0.95


def test_correlated_draft_agrees_more_than_uncorrelated(tiny_models: TinyModels) -> None:
    ids = torch.tensor([[TINY_CHARS.index(c) + 1 for c in "the quick brown fox jumps over the lazy dog"]])
    out = {}
    for name in ("target", "draft", "uncorrelated"):
        m = AutoModelForCausalLM.from_pretrained(str(getattr(tiny_models, name)), dtype=torch.float32)
        with torch.no_grad():
            out[name] = m(ids).logits[0].softmax(-1)
    alpha = {k: float(torch.minimum(out["target"], out[k]).sum(-1).mean()) for k in ("draft", "uncorrelated")}
    assert alpha["draft"] > 0.7 and alpha["uncorrelated"] < 0.3, alpha


def test_vocab_colliding_with_a_linear_width_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="Linear width"):
        build_tiny_model(tmp_path / "x", chars="abcdefghijklmnopqrstuvwxyz.,:!?", seed=1)  # vocab 32
