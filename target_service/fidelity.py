"""Fidelity of the target's numerics: how far each (dtype, backend) pair's
next-token distributions are from the file's exact float32 dequantization,
by teacher forcing over text the models did not write. Plain Python, no gRPC.

The text is the Python Language Reference as CPython ships it
(``pydoc_data.topics``: English technical prose with code), topics in sorted
order, cut into windows of ``window`` tokens, each a fresh forward pass. The
reference is ``float32/eager``: the checkpoint is the GGUF's exact float32
dequantization (``specdec.models.conversion``), run in float32.

Per position: KL(p_ref ‖ p) in nats, whether the argmax agrees, and the
reference's top-2 logit gap (a disagreement at a near-tie means little).
``summarise`` gives the mean KL, the 99th percentile, the worst position and
the top-1 agreement.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

import torch

#: what a quantized pair's fidelity must reach for ``--target-dtype auto``
#: to choose it without being asked (docs/benchmarks.md, "Fidelity"), against
#: the reference bf16 pair, bf16 eager (transformers' own bf16 computation of
#: the same file: what ``auto`` admits without a check;
#: ``calibration.fidelity_reference``): its mean KL from the exact
#: dequantization at most KL_BOUND_FACTOR times the reference's; its top-1
#: agreement at most TOP1_BOUND below it, or TOP1_MIN_FLIPS positions' worth
#: where the sample is too small to resolve TOP1_BOUND (calibration scores 256
#: tokens: one position is 0.39 points, so a single near-tie flipped by the
#: last bit would otherwise exclude a pair whose mean KL is half the
#: reference's); and no more decisive disagreements (the reference's top-2
#: logit gap above 0.5) than the reference
KL_BOUND_FACTOR = 1.0
TOP1_BOUND = 0.002
TOP1_MIN_FLIPS = 2


def top1_tolerance(positions: int) -> float:
    """How far below the bf16 pair's top-1 agreement a quantized pair's may
    be, scored over ``positions`` tokens."""
    return max(TOP1_BOUND, TOP1_MIN_FLIPS / positions) if positions > 0 else TOP1_BOUND


def corpus_text() -> str:
    import pydoc_data.topics as topics

    return "\n\n".join(topics.topics[k] for k in sorted(topics.topics))


def corpus_ids(tokenizer: Any, tokens: int) -> tuple[list[int], str]:
    """The first ``tokens`` token ids of the corpus and a digest of them
    (figures are comparable only for the same digest)."""
    text = corpus_text()
    ids: list[int] = []
    chars = 6 * tokens + 1024  # tokenize only about as much as needed
    while True:
        ids = tokenizer(text[:chars], add_special_tokens=False, verbose=False)["input_ids"]
        if len(ids) > tokens + 8 or chars >= len(text):
            break
        chars *= 2
    ids = ids[:tokens]
    if len(ids) < tokens:
        raise ValueError(f"the fidelity corpus has only {len(ids)} tokens")
    return ids, hashlib.sha256(repr(ids).encode()).hexdigest()[:12]


Forward = Callable[[torch.Tensor], torch.Tensor]  # [1, T] ids -> [T, V] logits


def model_forward(model: torch.nn.Module) -> Forward:
    @torch.inference_mode()
    def fwd(ids: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids.to(next(model.parameters()).device), use_cache=False).logits[0].float().cpu()
    return fwd


def reference_logprobs(forward: Forward, ids: Sequence[int], window: int) -> list[torch.Tensor]:
    """log-softmax of the reference per window ([W, V] float32 each)."""
    out = []
    for s in range(0, len(ids), window):
        chunk = torch.tensor([list(ids[s:s + window])])
        out.append(torch.log_softmax(forward(chunk), dim=-1))
    return out


@dataclass
class Fidelity:
    positions: int
    mean_kl: float
    p99_kl: float
    max_kl: float
    max_kl_position: int
    top1_agreement: float
    # disagreements where the reference's top-2 logit gap exceeds 0.5
    decisive_disagreements: int
    corpus: str = ""  # digest of the ids

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def compare(forward: Forward, ids: Sequence[int], ref: Sequence[torch.Tensor], window: int,
            corpus: str = "") -> Fidelity:
    kls, agree, decisive = [], 0, 0
    for w, s in enumerate(range(0, len(ids), window)):
        chunk = torch.tensor([list(ids[s:s + window])])
        lq = torch.log_softmax(forward(chunk), dim=-1)
        lp = ref[w]
        kls.append((lp.exp() * (lp - lq)).sum(-1).clamp_min(0.0))
        same = lp.argmax(-1) == lq.argmax(-1)
        agree += int(same.sum())
        top2 = lp.topk(2, dim=-1).values
        decisive += int(((~same) & ((top2[:, 0] - top2[:, 1]) > 0.5)).sum())
    kl = torch.cat(kls).double()
    n = kl.numel()
    worst = int(kl.argmax())
    return Fidelity(
        positions=n,
        mean_kl=float(kl.mean()),
        p99_kl=float(kl.quantile(0.99)) if n > 1 else float(kl.max()),
        max_kl=float(kl.max()),
        max_kl_position=worst,
        top1_agreement=agree / n,
        decisive_disagreements=decisive,
        corpus=corpus,
    )


def within_bound(candidate: Fidelity | dict[str, Any], bf16: Fidelity | dict[str, Any]) -> bool:
    """Whether a quantized pair's fidelity is within the stated bound of the
    reference bf16 pair's (the rule ``--target-dtype auto`` applies)."""
    c = candidate if isinstance(candidate, dict) else candidate.to_dict()
    b = bf16 if isinstance(bf16, dict) else bf16.to_dict()
    if not (math.isfinite(c["mean_kl"]) and math.isfinite(b["mean_kl"])):
        return False
    positions = min(int(c.get("positions") or 0), int(b.get("positions") or 0))
    # a tiny epsilon: top-1 agreements are ratios of counts, and 2/256 below 1.0 must compare as equal
    top1_ok = c["top1_agreement"] >= b["top1_agreement"] - top1_tolerance(positions) - 1e-12
    decisive_ok = int(c.get("decisive_disagreements") or 0) <= int(b.get("decisive_disagreements") or 0)
    return c["mean_kl"] <= KL_BOUND_FACTOR * b["mean_kl"] and top1_ok and decisive_ok
