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


def eos_token_ids(*values: object) -> list[int]:
    """Sorted, de-duplicated union of ``eos_token_id``-style values: an int, a
    list/tuple of ints, or anything else (``None``), which adds nothing."""
    ids: set[int] = set()
    for val in values:
        if isinstance(val, int):
            ids.add(val)
        elif isinstance(val, (list, tuple)):
            ids.update(int(v) for v in val)
    return sorted(ids)
