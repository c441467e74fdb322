"""Pure sampling functions: logits processing and exact speculative verification.

Vocabulary (after vLLM's rejection sampler):
- *accepted*: a drafted token the target keeps;
- *recovered*: the token sampled from norm(max(0, p - q)) at the first rejection;
- *bonus*: the token sampled from p_{γ+1} when every drafted token is accepted;
- *post*: (PEARL-style post-verify) a token drafted at the bonus position, on
  the span's prefix; when every drafted token is accepted it is verified
  against p_{γ+1} like a drafted token instead of sampling the bonus.

Shapes use: γ = drafted tokens in the span, V = target vocabulary size,
K = support size of one sparse draft distribution.

Exactness (Leviathan et al. 2022; Chen et al. 2023): with p_i the *processed*
target distribution (temperature → top-k → top-p, exactly as plain sampling
applies it through :func:`process_logits`) and q_i the exact distribution the
drafter sampled x_i from, the committed tokens are distributed exactly as
target-only sampling. Greedy (temperature 0) reduces to argmax matching.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from specdec.errors import Internal, InvalidArgument

MAX_TOP_K = 1 << 20
#: temperatures in (0, TEMPERATURE_FLOOR) are greedy (as vLLM treats those
#: below 1e-5): logits / T would overflow float32 to inf, and the softmax of
#: inf is NaN (docs/reliability.md, "Error classification")
TEMPERATURE_FLOOR = 1e-5


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        if 0.0 < self.temperature < TEMPERATURE_FLOOR:
            object.__setattr__(self, "temperature", 0.0)  # greedy; -0.0 and NaN are left to validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def from_proto(cls, msg: object) -> "SamplingConfig":
        """Builds and validates from a ``specdec.v1.SamplingParams`` (or None)."""
        if msg is None:
            return cls()
        temperature = float(getattr(msg, "temperature", 0.0))
        top_p = float(getattr(msg, "top_p", 0.0)) or 1.0
        top_k = int(getattr(msg, "top_k", 0))
        seed = int(msg.seed) if msg.HasField("seed") else None  # type: ignore[attr-defined]
        cfg = cls(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidArgument(
                f"sampling.temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}"
            )
        if self.temperature > 100:
            raise InvalidArgument(f"sampling.temperature must be <= 100, got {self.temperature}")
        if not math.isfinite(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise InvalidArgument(f"sampling.top_p must be in (0, 1] (0 = unset), got {self.top_p}")
        if self.top_k < 0 or self.top_k > MAX_TOP_K:
            raise InvalidArgument(f"sampling.top_k must be in [0, {MAX_TOP_K}] (0 = disabled), got {self.top_k}")


def processed_logits(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """The logits of the distribution plain sampling draws from, -inf outside
    its support: logits [k, V] (any float dtype) -> [k, V] float32.

    Order and semantics follow Hugging Face ``generate``: temperature, then
    top-k (ties at the k-th value kept), then top-p (smallest set whose mass
    reaches top_p; the top token always kept). A greedy config gives the raw
    logits (temperature 1, no truncation): the distribution logprobs report.
    """
    if cfg.greedy:
        return logits.float()
    x = logits.float() / cfg.temperature
    if bool(torch.isnan(x).any()) or bool(torch.isposinf(x).any()):
        # the model's own fault (T >= TEMPERATURE_FLOOR keeps finite logits finite): never sampled from
        raise Internal("the model produced non-finite logits; the sampler refused them")
    vocab = x.shape[-1]
    if 0 < cfg.top_k < vocab:
        kth = torch.topk(x, cfg.top_k, dim=-1).values[..., -1:]  # [k, 1]
        x = x.masked_fill(x < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sorted_x, sorted_idx = torch.sort(x, dim=-1, descending=False)  # [k, V]
        cum = sorted_x.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cum <= (1.0 - cfg.top_p)
        remove_sorted[..., -1] = False  # keep at least the top token
        remove = remove_sorted.scatter(-1, sorted_idx, remove_sorted)
        x = x.masked_fill(remove, float("-inf"))
    return x


def process_logits(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Turns raw logits into the distribution plain sampling draws from
    (:func:`processed_logits`, softmaxed): [k, V] -> probs [k, V] float32.
    Not for greedy configs."""
    return processed_logits(logits, cfg).softmax(dim=-1)


MAX_TOP_LOGPROBS = 20  # OpenAI's limit


@dataclass(frozen=True)
class TokenLogprob:
    """An emitted token's log-probability and the ``top`` most likely tokens
    at its position as (id, logprob), most likely first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


def token_logprobs(
    logits: torch.Tensor, cfg: SamplingConfig, tokens: Sequence[int], top_n: int
) -> list[TokenLogprob]:
    """Logprobs of ``tokens`` (one per row of ``logits`` [k, V]) under the
    distribution each was drawn from (:func:`processed_logits`: after
    temperature, top-k and top-p; the raw logits for greedy), with the
    ``top_n`` most likely tokens of each row (fewer where the support is
    smaller). A token outside the support gets -inf (it cannot be emitted)."""
    if not tokens:
        return []
    lp = torch.log_softmax(processed_logits(logits, cfg), dim=-1)  # [k, V]
    rows = lp[: len(tokens)]
    chosen = rows.gather(1, torch.as_tensor(list(tokens), dtype=torch.long)[:, None])[:, 0].tolist()
    top: list[list[tuple[int, float]]] = [[] for _ in tokens]
    if top_n > 0:
        vals, ids = torch.topk(rows, min(top_n, rows.shape[-1]), dim=-1)
        for i, (v, t) in enumerate(zip(vals.tolist(), ids.tolist())):
            top[i] = [(int(a), float(b)) for a, b in zip(t, v) if b != float("-inf")]
    return [TokenLogprob(int(t), float(c), tp) for t, c, tp in zip(tokens, chosen, top)]


def _cpu_rows(logits: torch.Tensor) -> np.ndarray | None:
    """[k, V] float32 logits on the CPU as a numpy view (None elsewhere):
    numpy's SIMD reductions take ~10 µs over a 152k vocabulary where
    torch's CPU argmax and topk take ~270 µs on one thread
    (docs/benchmarks.md, "Where a quantized step's time goes")."""
    if logits.device.type != "cpu":
        return None
    return logits.detach().float().contiguous().numpy()


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """The argmax of each row of [k, V] logits (the first on ties, NaN
    counting as the largest, as ``torch.argmax``)."""
    rows = _cpu_rows(logits)
    if rows is None:
        return torch.argmax(logits, dim=-1).tolist()
    return np.argmax(rows, axis=-1).tolist()


def logit_gaps(logits: torch.Tensor) -> list[float]:
    """Top-1 minus top-2 raw logit per row. logits: [k, V] -> k floats."""
    rows = _cpu_rows(logits)
    if rows is None or rows.shape[-1] < 2:
        top2 = torch.topk(logits.float(), 2, dim=-1).values  # [k, 2]
        return (top2[:, 0] - top2[:, 1]).tolist()
    gaps = []
    for row in rows:
        i = int(np.argmax(row))
        rest = row.copy()
        rest[i] = -np.inf
        gaps.append(float(row[i] - rest.max()))  # in float32, as torch subtracts its top 2
    return gaps


SparseQ = tuple[np.ndarray, np.ndarray]  # (ids [K], probs [K]): one sparse draft distribution


def one_hot_q(ids: Sequence[int]) -> list[SparseQ]:
    """q of a model-free proposal (prompt lookup): each token with
    probability 1, which the verifier treats as docs/design.md rule 3."""
    return [(np.array([x], dtype=np.int32), np.ones(1, dtype=np.float32)) for x in ids]


@dataclass(frozen=True)
class VerifyResult:
    num_accepted: int  # accepted drafted tokens (a prefix of the span)
    next_token: int  # recovered (rejection), bonus or post token (all accepted)
    # every drafted token accepted and the next token drawn by the target at
    # the bonus position (plain bonus, or the residual after rejecting the post token)
    is_bonus: bool
    is_post: bool = False  # the next token is the post token, accepted


def greedy_verify(
    draft_ids: Sequence[int], target_argmax: Sequence[int], post_id: int | None = None
) -> VerifyResult:
    """draft_ids: γ ids; target_argmax: γ+1 argmax ids of the target logits;
    post_id: an optional token drafted at the bonus position.

    The post token is accepted iff it equals the argmax at the bonus position;
    the next token is that argmax either way, so greedy output does not
    depend on it (only ``is_post`` does).
    """
    n = 0
    for d, t in zip(draft_ids, target_argmax):
        if d != t:
            return VerifyResult(n, int(t), False)
        n += 1
    nxt = int(target_argmax[n])
    is_post = post_id is not None and int(post_id) == nxt
    return VerifyResult(n, nxt, not is_post, is_post)


def sparse_q_dense(
    ids: Sequence[int] | np.ndarray, probs: Sequence[float] | np.ndarray, vocab: int
) -> torch.Tensor:
    """One sparse draft distribution -> dense [V] float32 tensor."""
    q = torch.zeros(vocab, dtype=torch.float32)
    q[torch.as_tensor(np.asarray(ids, dtype=np.int64))] = torch.as_tensor(
        np.asarray(probs, dtype=np.float32)
    )
    return q


def normalised_q(sparse: SparseQ, where: str) -> SparseQ:
    """q / Σq (ids [K], probs [K] float64): the distribution the draft's
    sampler draws from (docs/design.md rule 2: float32 sums are 1 only up to
    rounding). ValueError when q has no mass."""
    ids = np.asarray(sparse[0])
    probs = np.asarray(sparse[1], dtype=np.float64)
    total_q = float(probs.sum())
    if not total_q > 0.0:
        raise ValueError(f"draft q at {where} has no probability mass")
    return ids, probs / total_q


def accept_or_recover(
    x: int, sparse: SparseQ | None, p: torch.Tensor, generator: torch.Generator, where: str
) -> tuple[bool, int]:
    """One drafted token scored against the target row that conditions on
    exactly the prefix x was drafted on (the standard speculative step).

    x:         the drafted id, sampled from ``sparse``.
    sparse:    q as (ids [K], probs [K]), renormalised here; None = one-hot q.
    p:         [V] processed target probabilities at x's position.
    generator: the request's RNG: one uniform, then (on rejection) one
               multinomial draw.
    where:     x's position, for error messages ("position 2", "the post position").

    Returns (True, x) with probability min(1, p(x)/q(x)), else (False, t)
    with t ~ norm(max(0, p − q)). For x ~ q the returned token is then
    distributed exactly as p: P(t) = min(q(t), p(t)) + max(0, p(t) − q(t)).

    Raises ValueError for q(x) ≤ 0: x cannot have been sampled from q
    (docs/design.md rule 7), and accepting it could commit a token the
    target gives probability 0.
    """
    vocab = p.shape[-1]
    if sparse is None:
        q_x = 1.0
    else:
        sparse = normalised_q(sparse, where)
        ids, probs = sparse
        hit = np.nonzero(ids == x)[0]
        q_x = float(probs[hit[0]]) if hit.size else 0.0
    if q_x <= 0.0:
        raise ValueError(f"drafted token {x} at {where} has q(x) = {q_x}: it was not sampled from q")
    p_x = float(p[x])
    u = float(torch.rand((), generator=generator))
    # Accept with probability min(1, p(x)/q(x)).
    if u * q_x < p_x:
        return True, x
    # Rejected: recover from norm(max(0, p - q)).
    q = (
        torch.nn.functional.one_hot(torch.tensor(x), vocab).float()
        if sparse is None
        else sparse_q_dense(sparse[0], sparse[1], vocab)
    )
    residual = torch.clamp(p - q, min=0.0)
    total = float(residual.sum())
    if total <= 0.0:  # p == q up to rounding: rejection had ~zero mass
        residual, total = p, float(p.sum())
    return False, int(torch.multinomial(residual / total, 1, generator=generator))


def rejection_sample(
    draft_ids: Sequence[int],
    draft_q: Sequence[SparseQ | None],
    target_probs: torch.Tensor,
    generator: torch.Generator,
    post: tuple[int, SparseQ | None] | None = None,
) -> VerifyResult:
    """Exact speculative verification of one span.

    draft_ids:    γ drafted ids.
    draft_q:      γ sparse distributions (ids [K], probs [K]); None = one-hot q.
                  Each is renormalised before use (docs/design.md rule 2: the
                  draft's sampler draws from q / Σq; float32 sums are 1 only up
                  to rounding).
    target_probs: [γ+1, V] processed target probabilities (``process_logits``);
                  row i scores draft_ids[i], row γ gives the bonus.
    generator:    the request's RNG (CPU torch.Generator).
    post:         optional (x, q): a token drafted at the bonus position on the
                  span's prefix, and the q it was sampled from (None = one-hot).
                  Ignored unless every drafted token is accepted; then it is
                  verified against row γ by :func:`accept_or_recover` instead
                  of sampling the bonus from row γ. Exact: x is a drafted token
                  at position γ, drafted on exactly the prefix row γ
                  conditions on, so the standard accept/residual step emits a
                  token distributed as p_γ, as the bonus would be.

    Raises ValueError for a drafted (or post) token with q(x) ≤ 0
    (see :func:`accept_or_recover`).
    """
    gamma = len(draft_ids)
    p_all = target_probs.float().cpu()
    for i in range(gamma):
        accepted, token = accept_or_recover(int(draft_ids[i]), draft_q[i], p_all[i], generator, f"position {i}")
        if not accepted:
            return VerifyResult(i, token, False)
    if post is not None:
        accepted, token = accept_or_recover(int(post[0]), post[1], p_all[gamma], generator, "the post position")
        return VerifyResult(gamma, token, not accepted, accepted)
    bonus = int(torch.multinomial(p_all[gamma], 1, generator=generator))
    return VerifyResult(gamma, bonus, True)


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """probs: [V] processed distribution -> one sampled id."""
    return int(torch.multinomial(probs.float().cpu(), 1, generator=generator))


def make_generator(seed: int | None) -> torch.Generator:
    g = torch.Generator(device="cpu")
    if seed is None:
        g.seed()
    else:
        g.manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)
    return g


def rng_stream(seed: int, offset: int) -> np.random.SeedSequence:
    """Stream ``offset`` of a request's ``seed`` (docs/design.md rule 6): 0 is
    the seed's own stream, any other offset an independent stream of the
    same seed. The one derivation both services use: the draft counts its
    sessions in the offset, the target the committed length at a rebuild."""
    seed = int(seed) & 0xFFFF_FFFF_FFFF_FFFF
    return np.random.SeedSequence(seed if offset == 0 else [seed, int(offset)])


def session_generator(seed: int | None, offset: int = 0) -> torch.Generator:
    """The target's generator for stream ``offset`` of ``seed`` (None:
    unseeded). Offset 0 seeds torch with the seed itself, so a seeded
    session's draws are those of ``make_generator(seed)``."""
    if seed is None or offset == 0:
        return make_generator(seed)
    return make_generator(int(rng_stream(seed, offset).generate_state(1, np.uint64)[0]))


def session_rng(seed: int | None, offset: int = 0) -> np.random.Generator:
    """The draft's numpy generator for stream ``offset`` of ``seed`` (None:
    unseeded)."""
    return np.random.default_rng(None if seed is None else rng_stream(seed, offset))


# ---------------------------------------------------------------------------
# Draft side (numpy: the draft runs on onnxruntime and returns numpy logits)
# ---------------------------------------------------------------------------


def draft_distribution(
    logits: np.ndarray, cfg: SamplingConfig, max_support: int
) -> tuple[np.ndarray, np.ndarray]:
    """The sparse distribution a drafter samples one position from.

    logits: [V] raw draft logits -> (ids [K] int32, probs [K] float32, sum 1).
    Greedy: one-hot on the argmax. Sampling: temperature, then top-k with
    k = min(top_k or V, max_support), then top-p; renormalised. The returned q
    is exactly what :func:`sample_sparse` draws from, which keeps verification
    exact whatever truncation the drafter applies.
    """
    if cfg.greedy:
        return np.array([int(np.argmax(logits))], dtype=np.int32), np.ones(1, dtype=np.float32)
    x = logits.astype(np.float64) / cfg.temperature
    k = min(cfg.top_k or x.shape[-1], max_support, x.shape[-1])
    ids = np.argpartition(-x, k - 1)[:k] if k < x.shape[-1] else np.arange(x.shape[-1])
    ids = ids[np.argsort(-x[ids], kind="stable")]
    z = x[ids] - x[ids[0]]
    probs = np.exp(z)
    probs /= probs.sum()
    if cfg.top_p < 1.0:
        cum = np.cumsum(probs)
        # keep the smallest prefix whose mass reaches top_p (at least one)
        keep = int(np.searchsorted(cum, cfg.top_p, side="left")) + 1
        ids, probs = ids[:keep], probs[:keep]
        probs = probs / probs.sum()
    keep = probs > 0  # -inf logits (a grammar's mask) have no mass and stay off the wire
    ids, probs = ids[keep], probs[keep]
    probs32 = probs.astype(np.float32)
    probs32 /= probs32.sum(dtype=np.float32)
    return ids.astype(np.int32), probs32


def sample_sparse(ids: np.ndarray, probs: np.ndarray, rng: np.random.Generator) -> int:
    """Draws one id from a sparse distribution (the same q that is sent)."""
    if ids.shape[0] == 1:
        return int(ids[0])
    cdf = np.cumsum(probs.astype(np.float64))
    j = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    return int(ids[min(j, ids.shape[0] - 1)])
