"""The chaos soak's requests (scripts/chaos_soak.py): healthy greedy and
sampled cases on the tiny models' vocabulary, and the poison catalogue (the
sampling parameters' float edges, bad ids, unknown drafters)."""

from __future__ import annotations

import random
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import grpc  # noqa: E402

from specdec.v1 import orchestrator_pb2 as pb  # noqa: E402
from tests.stack import make_request  # noqa: E402

#: tests/conftest.py's tiny vocabulary (TINY_CHARS; vocab 34 with <|endoftext|>)
CHARS = "abcdefghijklmnopqrstuvwxyz .,:!?\n"
VOCAB = len(CHARS) + 1
DRAFT_NOISE = 0.15
MODEL_FREE_DRAFTERS = ["prompt-lookup", "auto"]  # besides "" (the default) and the model drafter
PROMPTS = [
    "the quick brown fox", "hello world! hello world! hello", "a, b, c, d, e, f, g",
    "spec dec: draft, verify, accept.", "abc abc abc abc abc", "lossless speculative decoding",
    "kill the draft and see", "zz top zz top zz",
]
LENGTHS = (16, 32, 48)
S = grpc.StatusCode


def f32_next(x: float, toward: float) -> float:
    """The float32 next to ``x`` in the direction of ``toward`` (sampling fields are float32)."""
    bits = struct.unpack("<i", struct.pack("<f", x))[0]
    if x == 0.0:
        return struct.unpack("<f", struct.pack("<i", 1 if toward > 0 else -2147483647))[0]
    step = 1 if (toward > x) == (x > 0) else -1
    return struct.unpack("<f", struct.pack("<i", bits + step))[0]


# ----------------------------------------------------------------- requests
@dataclass
class Case:
    kind: str  # greedy | sampled | poison | edge | garbage | cancel | deadline
    label: str
    req: pb.GenerateRequest | None = None
    raw: bytes | None = None
    service: str = "orchestrator"  # where garbage goes
    key: tuple[str, int] | None = None  # greedy reference
    timeout: float = 120.0
    cancel_after: int = 0


@dataclass
class Result:
    kind: str
    label: str
    worker: int
    start: float
    end: float
    code: str
    tokens: int = 0
    verdict: str = "ok"  # ok | fail | void (a direct call to a service the chaos task had killed)
    reason: str = ""
    overlaps: list[str] = field(default_factory=list)  # kill events the call overlapped


def healthy_case(rng: random.Random, greedy: bool, drafters: list[str]) -> Case:
    prompt, n = rng.choice(PROMPTS), rng.choice(LENGTHS)
    mode = rng.choice(["off", "auto", "auto", "fixed", "fixed", "heuristic"])
    drafter = rng.choice(drafters)
    draft_mode = rng.choice(["", "unary", "stream", "run-ahead"])
    gamma = rng.choice([1, 2, 4, 8])
    label = f"{mode}{gamma if mode == 'fixed' else ''}/{drafter or 'default'}/{draft_mode or 'default'}"
    if greedy:
        req = make_request(prompt=prompt, max_new_tokens=n, mode=mode, gamma=gamma, drafter=drafter,
                           draft_mode=draft_mode)
        return Case("greedy", label, req, key=(prompt, n))
    temp = rng.choice([0.5, 0.8, 1.0, 1.3])
    top_p = rng.choice([0.0, 0.9, 1.0])
    top_k = rng.choice([0, 1, 5, VOCAB])  # 0 = off, 1, the vocabulary size: all valid
    req = make_request(prompt=prompt, max_new_tokens=n, mode=mode, gamma=gamma, drafter=drafter,
                       draft_mode=draft_mode, temperature=temp, top_p=top_p, top_k=top_k, seed=rng.randrange(2**32))
    return Case("sampled", f"{label}/T{temp}/p{top_p}/k{top_k}", req, key=(prompt, n))


def poison_cases(rng: random.Random) -> list[Case]:
    """Every poison request once (fresh garbage bytes each call)."""
    nan, inf = float("nan"), float("inf")
    below0, above1 = f32_next(0.0, -1.0), f32_next(1.0, 2.0)
    out: list[Case] = []
    # temperatures below any sane floor: rejected, or served as greedy (the "edge" kind)
    for t in (1e-39, 1e-38, 1.4e-45, 1e-30):
        out.append(Case("edge", f"temperature={t:g}", make_request(prompt="the quick brown fox", max_new_tokens=16,
                                                                   mode="off", temperature=t),
                        key=("the quick brown fox", 16)))
    for t in (1e-39, 1.4e-45):  # the same with speculation
        out.append(Case("edge", f"temperature={t:g}/auto", make_request(prompt="the quick brown fox",
                                                                        max_new_tokens=16, mode="auto", temperature=t),
                        key=("the quick brown fox", 16)))
    bad_sampling: list[tuple[str, dict[str, Any]]] = [
        ("temperature=1e308", {"temperature": 1e308}), ("temperature=nan", {"temperature": nan}),
        ("temperature=inf", {"temperature": inf}), ("temperature=-inf", {"temperature": -inf}),
        ("temperature=-1e-39", {"temperature": -1e-39}), ("temperature=100.00001", {"temperature": 100.00001}),
        ("temperature=3e38", {"temperature": 3e38}),
        ("top_p=nextbelow(0)", {"temperature": 1.0, "top_p": below0}),
        ("top_p=nextabove(1)", {"temperature": 1.0, "top_p": above1}),
        ("top_p=nan", {"temperature": 1.0, "top_p": nan}), ("top_p=inf", {"temperature": 1.0, "top_p": inf}),
        ("top_k=-1", {"temperature": 1.0, "top_k": -1}), (f"top_k={VOCAB + 1}", {"temperature": 1.0, "top_k": VOCAB + 1}),
        ("top_k=-2^31", {"temperature": 1.0, "top_k": -(2**31)}),
    ]
    for label, kw in bad_sampling:
        mode = rng.choice(["off", "auto", "fixed"])
        out.append(Case("poison", f"{label}/{mode}", make_request(prompt="hello world!", max_new_tokens=16, mode=mode,
                                                                  **kw)))
    out.append(Case("poison", "drafter=unknown", make_request(prompt="hello", mode="auto", drafter="no-such-drafter")))
    out.append(Case("poison", "drafter=garbage-name", make_request(prompt="hello", mode="fixed",
                                                                   drafter="\u00e9\u00e9/../x" * 20)))
    for ids in ([VOCAB], [10**6], [-1], [1, 2, 2**31 - 1]):
        out.append(Case("poison", f"prompt_token_ids={ids[-1]}", make_request(prompt_token_ids=ids, mode="auto")))
    # garbage: tag 0x07 is field 0 with wire type 7, which no parser accepts, then random bytes
    for service, n in (("orchestrator", 64), ("orchestrator", 4096), ("target", 64), ("draft", 64)):
        out.append(Case("garbage", f"garbage->{service}/{n}B", raw=b"\x07" + rng.randbytes(n), service=service))
    return out
