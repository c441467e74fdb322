"""SessionStore semantics with a fake drafter (no model): committed-sequence
bookkeeping, error codes, session limit and idle reaping."""

from __future__ import annotations

import numpy as np
import pytest

from draft_service.drafter import Drafter, DraftRequest, Proposal
from draft_service.sessions import SessionStore
from specdec.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from specdec.sampling import SamplingConfig


class EchoDrafter(Drafter):
    """Proposes the last committed token repeated; records what it was given."""

    name = "echo"
    vocab_size = 10

    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    def new_state(self) -> list[int]:
        return []

    def draft(self, state: list[int], req: DraftRequest) -> Proposal:
        self.calls.append(list(req.committed))
        x = req.committed[-1]
        q = (np.array([x], dtype=np.int32), np.ones(1, dtype=np.float32))
        return Proposal([x] * req.num_tokens, [q] * req.num_tokens)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_echo_drafter_implements_the_interface() -> None:
    d: Drafter = EchoDrafter()
    assert d.name == "echo" and not d.inline


def test_committed_is_base_prefix_plus_new_tokens() -> None:
    store = SessionStore(max_sessions=4, ttl_s=60, max_span=8)
    d = EchoDrafter()
    s = store.create(d, SamplingConfig())
    r = store.propose(s.id, 0, [1, 2, 3], 2)
    assert r.committed_len == 3 and r.proposal.token_ids == [3, 3]
    r = store.propose(s.id, 3, [4], 1)
    assert d.calls[-1] == [1, 2, 3, 4] and r.committed_len == 4
    r = store.propose(s.id, 2, [7, 8], 1)  # rewrite behind the end
    assert d.calls[-1] == [1, 2, 7, 8]
    r = store.propose(s.id, 4, [], 1)  # nothing new
    assert d.calls[-1] == [1, 2, 7, 8]


def test_errors() -> None:
    store = SessionStore(max_sessions=4, ttl_s=60, max_span=8)
    d = EchoDrafter()
    s = store.create(d, SamplingConfig())
    with pytest.raises(InvalidArgument, match="empty"):
        store.propose(s.id, 0, [], 1)
    store.propose(s.id, 0, [1, 2], 1)
    with pytest.raises(FailedPrecondition):
        store.propose(s.id, 3, [1], 1)
    with pytest.raises(InvalidArgument):
        store.propose(s.id, 2, [10], 1)  # id == vocab_size
    with pytest.raises(InvalidArgument):
        store.propose(s.id, 2, [-1], 1)
    for bad in (0, 9):
        with pytest.raises(InvalidArgument, match="num_tokens"):
            store.propose(s.id, 2, [1], bad)
    with pytest.raises(NotFound):
        store.propose("nope", 0, [1], 1)
    # a failed call leaves the committed tokens as they were
    assert store.get(s.id).committed == [1, 2]
    store.release(s.id)
    with pytest.raises(NotFound):
        store.release(s.id)


def test_session_limit_and_idle_reaping() -> None:
    clock = Clock()
    store = SessionStore(max_sessions=2, ttl_s=10, max_span=8, clock=clock)
    d = EchoDrafter()
    a = store.create(d, SamplingConfig())
    clock.t = 5
    b = store.create(d, SamplingConfig())
    with pytest.raises(ResourceExhausted):
        store.create(d, SamplingConfig())
    clock.t = 12  # a idle for 12 s > ttl; b for 7 s
    c = store.create(d, SamplingConfig())  # a full store reaps before refusing
    assert len(store) == 2 and store.reaped_total == 1
    with pytest.raises(NotFound):
        store.get(a.id)  # a was the one reaped
    clock.t = 16
    store.propose(b.id, 0, [1], 1)  # use keeps b alive
    clock.t = 24
    assert store.reap() == 1 and len(store) == 1
    with pytest.raises(NotFound):
        store.get(c.id)
    assert store.get(b.id).id == b.id


def test_seeded_sessions_share_a_stream_unseeded_do_not() -> None:
    store = SessionStore(max_sessions=4, ttl_s=60, max_span=8)
    d = EchoDrafter()
    a = store.create(d, SamplingConfig(temperature=1.0, seed=5))
    b = store.create(d, SamplingConfig(temperature=1.0, seed=5))
    c = store.create(d, SamplingConfig(temperature=1.0))
    x, y, z = (s.rng.random(4).tolist() for s in (a, b, c))
    assert x == y != z
