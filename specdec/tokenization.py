"""Tokenizer helpers shared by the services."""

from __future__ import annotations

import hashlib
import json
from typing import Any


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 (hex) of the tokenizer's sorted token->id map (added tokens
    included). Two tokenizers with equal fingerprints map every token string
    to the same id, so token ids can cross between services unchanged."""
    vocab: dict[str, int] = tokenizer.get_vocab()
    items = sorted((str(tok), int(i)) for tok, i in vocab.items())
    payload = json.dumps(items, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()
