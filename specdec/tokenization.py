"""Tokenizer helpers shared by the services: fingerprints, EOS ids, and the
id -> bytes table of a fast tokenizer (byte-level BPE, SentencePiece byte
fallback, added tokens), used for token-level intersection and logprobs."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import numpy as np

_SPM_SPACE = "\u2581"  # ▁


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


def byte_decoder() -> dict[str, int]:
    """The GPT-2 byte-level table, inverted: printable unicode char -> byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _backend_json(tokenizer: Any) -> dict[str, Any]:
    """The ``tokenizers`` serialisation of an HF fast tokenizer (or of a raw
    ``tokenizers.Tokenizer``)."""
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None) or tokenizer
    to_str = getattr(backend, "to_str", None)
    if to_str is None:
        raise ValueError(f"{type(tokenizer).__name__} is not a fast (tokenizers-backed) tokenizer")
    return dict(json.loads(to_str()))


def _is_byte_level(spec: dict[str, Any]) -> bool:
    def has(node: Any) -> bool:
        if not isinstance(node, dict):
            return False
        if node.get("type") == "ByteLevel":
            return True
        return any(has(x) for x in node.get("decoders", []) or node.get("pretokenizers", []) or [])

    return has(spec.get("decoder")) or has(spec.get("pre_tokenizer"))


@dataclass(frozen=True)
class TokenTable:
    """Per token id: the bytes it stands for and whether it is a special added token.

    ``data``: all bytes concatenated; token i is ``data[offsets[i]:offsets[i+1]]``.
    ``special``: bool [N]. N = the tokenizer's largest id + 1.
    """

    data: bytes
    offsets: np.ndarray  # int64 [N + 1]
    special: np.ndarray  # bool [N]

    def __len__(self) -> int:
        return int(self.special.shape[0])

    def get(self, i: int) -> bytes:
        if not 0 <= i < len(self):
            return b""
        return self.data[int(self.offsets[i]) : int(self.offsets[i + 1])]

    def to_list(self) -> list[bytes]:
        o = self.offsets.tolist()
        return [self.data[o[i] : o[i + 1]] for i in range(len(self))]


def token_table(tokenizer: Any) -> TokenTable:
    """Builds the id -> bytes table of an HF fast tokenizer (see module doc)."""
    spec = _backend_json(tokenizer)
    vocab: dict[str, int] = dict(tokenizer.get_vocab())
    added: dict[int, tuple[str, bool]] = {}
    for t in spec.get("added_tokens", []) or []:
        added[int(t["id"])] = (str(t["content"]), bool(t.get("special", False)))
    byte_level = _is_byte_level(spec)
    b2 = byte_decoder()
    size = max(list(vocab.values()) + list(added) + [-1]) + 1
    parts: list[bytes] = [b""] * size
    special = np.zeros(size, dtype=bool)
    for tok, i in vocab.items():
        if i in added:
            continue
        if byte_level:
            try:
                parts[i] = bytes(b2[c] for c in tok)
                continue
            except KeyError:
                pass  # not a byte-level string (e.g. an unlisted added token): literal text
        if len(tok) == 6 and tok.startswith("<0x") and tok.endswith(">"):
            try:
                parts[i] = bytes([int(tok[3:5], 16)])
                continue
            except ValueError:
                pass
        parts[i] = tok.replace(_SPM_SPACE, " ").encode("utf-8")
    for i, (content, is_special) in added.items():
        parts[i] = content.encode("utf-8")
        special[i] = is_special
    offsets = np.zeros(size + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(p) for p in parts])
    return TokenTable(b"".join(parts), offsets, special)
