"""Tiny random-weight models for tests: real code paths on real (small) models.

A character-level tokenizer (id 0 = ``<|endoftext|>``, then one token per
character) and a small ``Qwen2ForCausalLM`` with peaked random weights. A
*correlated* draft is built from a base model's weights plus Gaussian noise,
so acceptance between the two is high but not perfect.

Everything is deterministic given the arguments.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import torch

EOS_TOKEN = "<|endoftext|>"
LM_HEAD_GAIN = 8.0  # logits std ≈ init_std * LM_HEAD_GAIN (post-norm hidden state has RMS 1)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'][0] }}:{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)


def _byte_to_unicode() -> dict[int, str]:
    """The GPT-2 / Qwen byte-level alphabet: byte -> printable unicode char."""
    from draft_service.vocab_map import byte_decoder

    return {b: ch for ch, b in byte_decoder().items()}


def build_tiny_tokenizer(
    chars: str, merges: Sequence[tuple[str, str]] = ()
) -> "PreTrainedTokenizerFast":  # type: ignore[name-defined] # noqa: F821
    """Character-level fast tokenizer: id 0 = ``<|endoftext|>`` (eos, pad),
    id i+1 = ``chars[i]``; ``decode`` concatenates characters exactly.
    ``merges``: BPE merges (a, b) in priority order; each adds the token a+b
    (ids len(chars)+1 onwards), so two tokenizers over the same characters can
    have partly overlapping vocabularies.

    It is a byte-level BPE with no merges (the Qwen2 tokenizer family's
    format), so ``AutoTokenizer`` — which always rebuilds a ``qwen2`` model's
    tokenizer as ``Qwen2Tokenizer`` — loads it with identical behaviour.
    ``chars`` must be distinct ASCII characters (one byte each).
    """
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if not chars or len(set(chars)) != len(chars):
        raise ValueError("chars must be non-empty and distinct")
    if any(ord(c) > 127 for c in chars):
        raise ValueError("chars must be ASCII (one byte per token)")
    b2u = _byte_to_unicode()
    vocab = {EOS_TOKEN: 0}
    for i, c in enumerate(chars):
        vocab[b2u[ord(c)]] = i + 1
    enc = [("".join(b2u[ord(c)] for c in a), "".join(b2u[ord(c)] for c in b)) for a, b in merges]
    for a, b in enc:
        if a not in vocab or b not in vocab or a + b in vocab:
            raise ValueError(f"merge {a!r}+{b!r}: both parts must be tokens and the result new")
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=enc, ignore_merges=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS_TOKEN])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(
    out_dir: Path | str,
    *,
    chars: str,
    seed: int,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    init_std: float = 0.5,
    base_dir: Path | str | None = None,
    noise: float = 0.0,
    eos_token_id: int = 0,
    max_position_embeddings: int = 512,
    merges: Sequence[tuple[str, str]] = (),
) -> Path:
    """Builds and saves a tiny Qwen2 causal LM (float32 safetensors, untied head).

    vocab_size = len(chars) + 1 + len(merges). Weights are N(0, init_std) for matrices (a
    large std so next-token distributions are peaked, with clear top-1/top-2
    gaps, yet sampling stays non-trivial); norms are 1, biases small. With
    ``base_dir``, copies that model's weights (shapes must match) and adds
    Gaussian noise of std ``noise * std(matrix)`` to every matrix: a
    correlated draft. When the base has another vocabulary (other chars or
    merges), the embedding and LM-head rows are matched by token string:
    shared tokens copy the base's rows, the others get fresh random rows.
    Returns ``out_dir``.
    """
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    out = Path(out_dir)
    vocab_size = len(chars) + 1 + len(merges)
    head_dim = hidden_size // num_heads
    linear_outs = {hidden_size, num_kv_heads * head_dim, intermediate_size}
    if vocab_size in linear_outs:
        # onnxruntime-genai's builder takes every Linear with out_features ==
        # vocab_size for the LM head; such a model would export wrongly.
        raise ValueError(
            f"vocab_size {vocab_size} equals a Linear width {sorted(linear_outs)}; add or drop a char"
        )
    out.mkdir(parents=True, exist_ok=True)
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=eos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id,
        torch_dtype="float32",
    )
    gen = torch.Generator().manual_seed(int(seed))
    with torch.device("cpu"):
        model = Qwen2ForCausalLM(config).to(torch.float32).eval()
    base_state: dict[str, torch.Tensor] | None = None
    row_map: list[tuple[int, int]] = []  # (new id, base id) for shared token strings
    tokenizer = build_tiny_tokenizer(chars, merges)
    if base_dir is not None:
        from transformers import AutoTokenizer

        base_state = Qwen2ForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32).state_dict()
        base_vocab = AutoTokenizer.from_pretrained(str(base_dir)).get_vocab()
        row_map = [(i, base_vocab[t]) for t, i in tokenizer.get_vocab().items() if t in base_vocab]
    vocab_rows = {"model.embed_tokens.weight", "lm_head.weight"}
    with torch.no_grad():
        state = model.state_dict()
        for name in sorted(state):
            t = state[name]
            if base_state is not None and name in vocab_rows and name in base_state and base_state[name].shape != t.shape:
                std = init_std if name.startswith("model.") else init_std * LM_HEAD_GAIN / t.shape[-1] ** 0.5
                new = torch.randn(t.shape, generator=gen) * std
                for i, j in row_map:
                    new[i] = base_state[name][j]
                if noise > 0:
                    new += torch.randn(t.shape, generator=gen) * (noise * float(new.std()))
            elif base_state is not None:
                if name not in base_state or base_state[name].shape != t.shape:
                    raise ValueError(f"base model mismatch at {name}")
                new = base_state[name].clone()
                if t.dim() >= 2 and noise > 0:
                    # noise relative to the tensor's own scale
                    new += torch.randn(t.shape, generator=gen) * (noise * float(new.std()))
            elif name.endswith("norm.weight") or "layernorm" in name:
                new = torch.ones_like(t)
            elif name.endswith(".bias"):
                new = torch.randn(t.shape, generator=gen) * 0.02
            else:
                # scale matrices by 1/sqrt(fan_in) so activations stay O(1),
                # then let init_std set how peaked the logits are
                fan_in = t.shape[-1]
                std = init_std * (LM_HEAD_GAIN if name.startswith("lm_head") else 1.0) / fan_in**0.5
                if name.endswith("embed_tokens.weight"):
                    std = init_std
                new = torch.randn(t.shape, generator=gen) * std
            t.copy_(new)
    model.generation_config = GenerationConfig(
        eos_token_id=eos_token_id, pad_token_id=eos_token_id, bos_token_id=eos_token_id, do_sample=False
    )
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    # keep the vocabulary spec next to the weights for humans
    (out / "tiny.json").write_text(json.dumps({"chars": chars, "merges": list(merges), "seed": seed, "noise": noise}))
    return out


def build_tiny_pair(root: Path | str, *, chars: str, draft_noise: float = 0.15) -> tuple[Path, Path]:
    """tests/conftest.py's tiny target (seed 1) and its correlated draft (seed
    11, ``draft_noise``) under ``root``: the pair the scripts' tiny stacks run
    (their ONNX export is the tests' own, so a shared cache directory hits it)."""
    target = build_tiny_model(Path(root) / "target", chars=chars, seed=1)
    return target, build_tiny_model(Path(root) / "draft", chars=chars, seed=11, base_dir=target, noise=draft_noise)
