"""Vocabulary mapping between a draft tokenizer and a target tokenizer, by
byte strings (token-level intersection, TLI; Timor et al. 2025).

Every token of each tokenizer is turned into the bytes it stands for:
- byte-level BPE vocabularies (GPT-2, Qwen, SmolLM2: the tokenizer's decoder
  is ``ByteLevel``): each character of the token string is one byte through
  the GPT-2 byte<->unicode table;
- SentencePiece-style vocabularies: ``▁`` is a space and ``<0xNN>`` (byte
  fallback) is the byte 0xNN;
- added tokens (special or not): their literal content, UTF-8 encoded.

Two tokens *intersect* when they have the same bytes and the same kind
(special added tokens only match special added tokens, so a chat-control
token never maps onto plain text). The map is made injective on both sides
(the lowest id wins), so a sampled draft id maps to exactly one target id and
a sparse q over draft ids stays a sparse q over target ids.

Shapes: V_d = draft logits size, V_t = target logits size (either may exceed
its tokenizer's length: padding rows map to nothing and have empty bytes).

The mapping is built once per tokenizer pair and cached under
``<cache_dir>/vocab_map/<key>.npz``; the key hashes both tokenizer
fingerprints (:func:`specdec.tokenization.tokenizer_fingerprint`) and
:data:`FORMAT_VERSION`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from specdec.logging_util import log
from specdec.tokenization import TokenTable, byte_decoder, token_table  # noqa: F401 (re-exported)

logger = logging.getLogger("specdec.draft.vocab_map")

FORMAT_VERSION = 1


@dataclass(frozen=True)
class VocabMap:
    """The token-level intersection of a draft and a target vocabulary.

    ``draft_to_target``: int64 [V_d], the target id of each draft id, or -1
    outside the intersection. ``target_to_draft``: int64 [V_t], the inverse.
    ``target``: the target's id -> bytes table (to rebuild text from committed
    target ids). ``draft``: the draft's id -> bytes table.
    """

    draft_to_target: np.ndarray
    target_to_draft: np.ndarray
    draft: TokenTable
    target: TokenTable

    @property
    def size(self) -> int:
        """Number of intersecting tokens."""
        return int((self.draft_to_target >= 0).sum())

    @property
    def draft_mask(self) -> np.ndarray:
        """bool [V_d]: draft ids inside the intersection."""
        return self.draft_to_target >= 0


def build_vocab_map(
    draft: TokenTable, target: TokenTable, draft_vocab_size: int, target_vocab_size: int
) -> VocabMap:
    """Intersects two token tables by (bytes, special). Empty-bytes tokens
    never intersect. Injective: among equal keys the lowest id wins."""
    if draft_vocab_size < 1 or target_vocab_size < 1:
        raise ValueError("vocabulary sizes must be >= 1")
    by_key: dict[tuple[bytes, bool], int] = {}
    tb = target.to_list()
    for i in range(min(len(target), target_vocab_size)):
        b = tb[i]
        if b:
            by_key.setdefault((b, bool(target.special[i])), i)
    d2t = np.full(draft_vocab_size, -1, dtype=np.int64)
    t2d = np.full(target_vocab_size, -1, dtype=np.int64)
    db = draft.to_list()
    for i in range(min(len(draft), draft_vocab_size)):
        b = db[i]
        if not b:
            continue
        t = by_key.get((b, bool(draft.special[i])))
        if t is not None and t2d[t] < 0:
            d2t[i] = t
            t2d[t] = i
    return VocabMap(d2t, t2d, draft, target)


def vocab_map_key(draft_fingerprint: str, target_fingerprint: str, draft_vocab_size: int, target_vocab_size: int) -> str:
    payload = json.dumps(
        [FORMAT_VERSION, draft_fingerprint, target_fingerprint, draft_vocab_size, target_vocab_size]
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:24]


def load_or_build_vocab_map(
    draft_tokenizer: Any,
    target_tokenizer: Any,
    draft_vocab_size: int,
    target_vocab_size: int,
    *,
    draft_fingerprint: str,
    target_fingerprint: str,
    cache_dir: Path | None,
) -> VocabMap:
    """The pair's :class:`VocabMap`, from ``<cache_dir>/vocab_map/<key>.npz``
    when present, else built and written there atomically. Token tables are
    cheap (< 1 s for 150k tokens) and rebuilt on each load; the cached part is
    the intersection itself."""
    draft_table = token_table(draft_tokenizer)
    target_table = token_table(target_tokenizer)
    path: Path | None = None
    if cache_dir is not None:
        key = vocab_map_key(draft_fingerprint, target_fingerprint, draft_vocab_size, target_vocab_size)
        path = Path(cache_dir).expanduser() / "vocab_map" / f"{key}.npz"
        if path.is_file():
            with np.load(path) as z:
                d2t, t2d = z["draft_to_target"], z["target_to_draft"]
            if d2t.shape == (draft_vocab_size,) and t2d.shape == (target_vocab_size,):
                vm = VocabMap(d2t.astype(np.int64), t2d.astype(np.int64), draft_table, target_table)
                log(logger, logging.INFO, "vocab map cached", path=str(path), intersection=vm.size)
                return vm
    started = time.perf_counter()
    vm = build_vocab_map(draft_table, target_table, draft_vocab_size, target_vocab_size)
    log(
        logger,
        logging.INFO,
        "vocab map built",
        intersection=vm.size,
        draft_vocab=draft_vocab_size,
        target_vocab=target_vocab_size,
        ms=round((time.perf_counter() - started) * 1e3, 1),
    )
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".vm.", suffix=".npz", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as fh:
                np.savez(fh, draft_to_target=vm.draft_to_target, target_to_draft=vm.target_to_draft)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return vm
