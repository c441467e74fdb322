"""Structured output on the target: the grammar's mask on every row a
Verify (or Prefill) scores. Plain Python on the model thread.

For a span x_1..x_γ the row that scores x_i conditions on the committed
prefix plus x_1..x_{i-1}, so its mask is the grammar state after those
tokens: the state advances along the span while the masks are computed and
is rolled back to the committed prefix afterwards. A drafted token the
grammar does not allow has p = 0 under its row's mask, so it is rejected
(greedy: it is not the masked argmax) and no later row is used; its later
rows keep the last mask. Masked rows are exactly what target-only decoding
samples from (docs/design.md rule 10).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from specdec.grammar import GrammarState


@dataclass(frozen=True)
class MaskedRows:
    logits: torch.Tensor  # [γ+1, V]: -inf where the grammar forbids the token
    dead_row: int | None  # the first used row that allows no token (a dead end), if any


def mask_rows(state: GrammarState, logits: torch.Tensor, draft_ids: Sequence[int]) -> MaskedRows:
    """``logits`` [γ+1, V] of one span (row i scores draft_ids[i], row γ the
    bonus) masked by the grammar; ``state`` is left where it was. A dead row
    gets zeros instead of -inf everywhere (so that sampling code sees a
    proper distribution; its token is never used)."""
    masks = np.empty((logits.shape[0], state.vocab_size), dtype=bool)
    advanced = 0
    dead: int | None = None
    try:
        for i in range(logits.shape[0]):
            masks[i] = state.allowed()
            if not masks[i].any():
                dead = i
                masks[i + 1:] = masks[i]
                break
            if i == len(draft_ids) or not masks[i, draft_ids[i]] or not state.advance(draft_ids[i]):
                masks[i + 1:] = masks[i]  # x_i is rejected here: later rows are never used
                break
            advanced += 1
    finally:
        state.rollback(advanced)
    out = logits.masked_fill(~torch.from_numpy(masks[:, : logits.shape[1]]), float("-inf"))
    if dead is not None:
        out[dead] = 0.0
    return MaskedRows(out, dead)
