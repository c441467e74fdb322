"""The two ends of a draft stream's bookkeeping, without gRPC: the draft's
``DraftChain`` (what it keeps and drops on each commit) and the
orchestrator's ``ChainTracker`` (which streamed tokens it may verify). The
exactness rule they implement (docs/architecture.md, "Draft streams and
run-ahead"): a token is verified only if it was drafted on exactly the
committed prefix before it."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from draft_service.drafter import Proposal
from specdec.draft_chain import ChainPause, ChainToken, ChainTracker, DraftChain, StreamFault
from specdec.errors import InvalidArgument

Q = (np.array([0], dtype=np.int64), np.array([1.0], dtype=np.float32))


def proposal(ids: list[int], conf: list[float] | None = None) -> Proposal:
    return Proposal(ids, [Q] * len(ids), len(ids), conf if conf is not None else [0.9] * len(ids))


def chain(committed: list[int], until: int, **kw: object) -> DraftChain:
    return DraftChain(list(committed), max_span=16, max_context=64, vocab_size=100, draft_until=until, **kw)  # type: ignore[arg-type]


def draft(c: DraftChain, ids: list[int], conf: list[float] | None = None) -> list[ChainToken | ChainPause]:
    """Runs one step per token, as the servicer does for a model drafter."""
    events: list[ChainToken | ChainPause] = []
    for i, x in enumerate(ids):
        step = c.next_step(inline=False)
        assert step is not None and step.num_tokens == 1
        events += c.add(step, proposal([x], [conf[i]] if conf else None), 1.0)
    return events


# ------------------------------------------------------------- DraftChain
def test_a_commit_of_the_chains_own_tokens_keeps_the_rest_of_the_chain() -> None:
    c = chain([1, 2, 3], until=3 + 6)
    evs = draft(c, [10, 11, 12, 13])
    assert [(e.position, e.version, e.token_id) for e in evs if isinstance(e, ChainToken)] == [
        (3, 0, 10), (4, 0, 11), (5, 0, 12), (6, 0, 13)]
    # the target accepted 10 and its bonus was 11: the chain goes on under version 0
    c.commit(1, [10, 11], draft_until=5 + 6, min_confidence=0.0)
    assert c.version == 0 and c.tokens == [12, 13] and c.end == 7 and c.kept == 2
    assert draft(c, [14])[0].position == 7  # type: ignore[union-attr]


def test_any_other_commit_starts_a_new_chain_under_its_version() -> None:
    c = chain([1, 2, 3], until=9)
    draft(c, [10, 11, 12])
    c.commit(1, [10, 20], draft_until=11, min_confidence=0.0)  # 11 rejected, 20 recovered
    assert c.version == 1 and c.tokens == [] and c.committed == [1, 2, 3, 10, 20]
    ev = draft(c, [30])[0]
    assert isinstance(ev, ChainToken) and (ev.position, ev.version) == (5, 1)
    # a commit longer than the chain (the chain did not cover it) also restarts
    c.commit(2, [30, 31], draft_until=13, min_confidence=0.0)
    assert c.version == 2 and c.tokens == []


def test_a_step_that_ran_while_the_chain_was_dropped_is_discarded() -> None:
    c = chain([1, 2], until=8)
    step = c.next_step(inline=False)
    assert step is not None
    c.commit(1, [7], draft_until=8, min_confidence=0.0)  # arrives while the step runs
    assert c.add(step, proposal([10]), 1.0) == []  # drafted on [1, 2], not [1, 2, 7]
    assert c.tokens == []


def test_commits_out_of_order_or_outside_the_vocabulary_are_refused() -> None:
    c = chain([1], until=2)
    with pytest.raises(InvalidArgument, match="out of order"):
        c.commit(2, [5], draft_until=3, min_confidence=0.0)
    with pytest.raises(InvalidArgument, match="outside"):
        c.commit(1, [500], draft_until=3, min_confidence=0.0)
    with pytest.raises(InvalidArgument, match="min_confidence"):
        c.commit(1, [5], draft_until=3, min_confidence=float("nan"))
    with pytest.raises(InvalidArgument, match="at least one token"):
        chain([], until=1)


def test_credit_bounds_drafting_and_the_service_caps_it() -> None:
    c = chain([1, 2], until=4)
    draft(c, [10, 11])
    assert c.next_step(inline=False) is None  # out of credit: the draft waits
    c = DraftChain([1, 2], max_span=3, max_context=64, vocab_size=100, draft_until=100)
    assert c.next_step(inline=True).num_tokens == 3  # type: ignore[union-attr]
    draft(c, [10, 11, 12])
    paused = c.blocked()
    assert isinstance(paused, ChainPause) and paused.reason == "limit" and paused.position == 5
    assert c.blocked() is None  # told once


def test_a_low_confidence_token_past_the_committed_end_pauses_the_chain() -> None:
    c = chain([1, 2], until=10, min_confidence=0.5)
    evs = draft(c, [10, 11], conf=[0.1, 0.9])  # the first token is always drafted
    assert all(isinstance(e, ChainToken) for e in evs)
    evs = draft(c, [12], conf=[0.2])
    assert isinstance(evs[-1], ChainPause) and evs[-1].reason == "confidence" and evs[-1].position == 5
    assert c.next_step(inline=False) is None
    c.commit(1, [10, 11], draft_until=12, min_confidence=0.5)  # accepted: the chain resumes
    assert c.next_step(inline=False) is not None


def test_an_empty_proposal_pauses_until_the_next_commit() -> None:
    c = chain([1, 2], until=6)
    step = c.next_step(inline=True)
    assert step is not None
    evs = c.add(step, proposal([]), 0.1)
    assert evs == [ChainPause(2, 0, "no_draft", 0)]
    assert c.next_step(inline=True) is None
    c.commit(1, [3], draft_until=7, min_confidence=0.0)
    assert c.next_step(inline=True) is not None


# ----------------------------------------------------------- ChainTracker
def tok(position: int, version: int, token: int, conf: float = 0.9) -> ChainToken:
    return ChainToken(position, version, token, Q, conf, 1.0)


def test_the_tracker_hands_out_only_tokens_drafted_on_the_committed_prefix() -> None:
    t = ChainTracker()
    t.sent(0, 3)
    for i, x in enumerate([10, 11, 12, 13]):
        t.on_token(tok(3 + i, 0, x))
    committed = [1, 2, 3]
    span = t.span(committed, 2, 0.0)
    assert [x.token_id for x in span.tokens] == [10, 11] and span.post is not None and span.post.token_id == 12
    assert span.complete
    # accepted 10, bonus 11: the chain's tokens after it stay usable
    committed += [10, 11]
    t.sent(1, 5)
    assert [x.token_id for x in t.usable(committed) or []] == [12, 13]
    # 12 rejected, 40 recovered: nothing of version 0 is usable any more
    committed += [40]
    t.sent(2, 6)
    assert t.usable(committed) is None
    assert not t.span(committed, 2, 0.0).complete  # waits for the new chain
    t.on_token(tok(7, 0, 14))  # in flight from the old chain: extends it, still unusable
    assert t.usable(committed) is None
    t.on_token(tok(6, 2, 50))  # the new chain
    assert [x.token_id for x in t.usable(committed) or []] == [50]
    t.on_token(tok(8, 0, 15))  # a superseded version
    assert t.stale == 1


def test_a_confidence_stop_ends_the_span_and_becomes_the_post_candidate() -> None:
    t = ChainTracker()
    t.sent(0, 1)
    t.on_token(tok(1, 0, 10, conf=0.1))  # the first token is always in the span
    t.on_token(tok(2, 0, 11, conf=0.9))
    t.on_token(tok(3, 0, 12, conf=0.2))
    span = t.span([0], 4, 0.5)
    assert [x.token_id for x in span.tokens] == [10, 11] and span.post is not None
    assert span.post.token_id == 12 and span.complete


def test_a_pause_completes_a_short_span_and_a_stale_pause_does_not() -> None:
    t = ChainTracker()
    t.sent(0, 2)
    t.on_token(tok(2, 0, 10))
    assert not t.span([0, 1], 3, 0.0).complete
    t.on_pause(ChainPause(3, 0, "no_draft", 0))
    span = t.span([0, 1], 3, 0.0)
    assert span.complete and [x.token_id for x in span.tokens] == [10] and span.post is None
    t.sent(1, 4)  # a commit resumes the chain: a pause sent before the draft saw it does not count
    t.on_pause(ChainPause(3, 0, "no_draft", 0))
    assert t.paused_at == -1  # the commit voided the old pause, and this one predates it
    assert t.span([0, 1, 10, 20], 2, 0.0).complete is False


@pytest.mark.parametrize(
    "events,match",
    [
        ([tok(3, 0, 10), tok(5, 0, 11)], "position 5"),  # a gap in the chain
        ([tok(4, 0, 10)], "position 4"),  # not where the chain starts
        ([tok(3, 7, 10)], "never committed"),  # a version nobody sent
        ([tok(3, 0, 10), ChainPause(6, 0, "no_draft", 0)], "not at its chain's end"),
    ],
    ids=["gap", "wrong-start", "unknown-version", "bad-pause"],
)
def test_garbage_from_the_draft_is_a_fault(events: list[ChainToken | ChainPause], match: str) -> None:
    t = ChainTracker()
    t.sent(0, 3)
    with pytest.raises(StreamFault, match=match):
        for e in events:
            t.on_token(e) if isinstance(e, ChainToken) else t.on_pause(e)


def test_a_new_version_must_start_at_its_commits_length() -> None:
    t = ChainTracker()
    t.sent(0, 3)
    t.sent(1, 5)
    with pytest.raises(StreamFault, match="not at its committed length 5"):
        t.on_token(tok(4, 1, 10))


def test_a_chain_kept_across_a_confidence_pause_gives_the_next_round_a_span() -> None:
    """Both halves together: the draft pauses at a confidence stop, the round
    verifies the span and post-verifies the low-confidence token, and the
    target accepts all of it. The commit keeps the chain (it is exactly the
    chain) and resumes the draft; the next round must wait for the new
    tokens, not take the old pause as a complete, empty span (which ran the
    round target-only)."""
    c = chain([0], until=1 + 4, min_confidence=0.5)
    t = ChainTracker()
    t.sent(0, 1)

    def feed(events: list[ChainToken | ChainPause]) -> None:
        for e in events:
            t.on_token(e) if isinstance(e, ChainToken) else t.on_pause(e)

    feed(draft(c, [10, 11, 12], conf=[0.9, 0.9, 0.1]))  # 12 is a confidence stop: the draft pauses at 4
    assert t.paused_at == 4
    committed = [0]
    span = t.span(committed, 4, 0.5)
    assert [x.token_id for x in span.tokens] == [10, 11] and span.post is not None and span.post.token_id == 12
    assert span.complete
    committed += [10, 11, 12]  # span accepted, the post token too (next_is_post)
    c.commit(1, [10, 11, 12], draft_until=4 + 4, min_confidence=0.5)
    t.sent(1, len(committed))
    assert c.version == 0 and c.kept == 3 and c.paused == ""  # kept, and drafting again
    span = t.span(committed, 4, 0.5)
    assert span.tokens == [] and not span.complete  # waits for the resumed chain
    feed(draft(c, [13, 14, 15, 16]))
    span = t.span(committed, 4, 0.5)
    assert [x.token_id for x in span.tokens] == [13, 14, 15, 16] and span.complete


def test_a_pause_that_a_commit_does_not_resume_still_completes_the_span() -> None:
    """No tokens committed (a credit-only commit) and a no_draft pause: the
    draft stays paused, so the tracker must not wait for it."""
    t = ChainTracker()
    t.sent(0, 2)
    t.on_token(tok(2, 0, 10))
    t.on_pause(ChainPause(3, 0, "no_draft", 0))
    t.sent(1, 2)
    span = t.span([0, 1], 3, 0.0)
    assert span.complete and [x.token_id for x in span.tokens] == [10]


# ------------------------------------------- both ends against each other
@settings(max_examples=300, deadline=None)
@given(data=st.data(), gamma=st.integers(1, 4), min_conf=st.sampled_from([0.0, 0.5]),
       max_context=st.integers(6, 30), inline=st.booleans())
def test_the_two_ends_agree_under_any_interleaving(data: st.DataObject, gamma: int, min_conf: float,
                                                   max_context: int, inline: bool) -> None:
    """An honest draft (DraftChain) and the orchestrator (ChainTracker) with
    messages in flight both ways, delivered in any interleaving, the target
    accepting any prefix of each span and answering with a correction (never
    the rejected token), a bonus, or the post-verified token. Checked:

    - every token handed out for verification (span and post) was drafted on
      exactly the committed prefix plus the span's earlier tokens;
    - the tracker never takes honest traffic for a fault;
    - when nothing is in flight and the draft has nothing more to do, the
      span is complete (no stall), and a complete span that is empty means
      the draft really is paused at the committed end (not a stale pause:
      the round would run target-only while the draft drafts on)."""
    vocab = 6  # few ids: kept chains, rejections and repeats are all common
    committed = [1, 2]
    chain = DraftChain(list(committed), max_span=8, max_context=max_context, vocab_size=vocab,
                       draft_until=len(committed) + gamma + 1, min_confidence=min_conf)
    tracker = ChainTracker()
    tracker.sent(0, len(committed))
    to_tracker: list[ChainToken | ChainPause] = []
    to_draft: list[tuple[int, list[int], int]] = []
    drafted_on: dict[tuple[int, int], tuple[int, ...]] = {}
    version = 0

    def draft_step() -> bool:
        step = chain.next_step(inline)
        if step is None:
            blocked = chain.blocked()
            if blocked is not None:
                to_tracker.append(blocked)
            return blocked is not None
        n = step.num_tokens
        ids = data.draw(st.lists(st.integers(0, vocab - 1), min_size=n, max_size=n), "draft ids")
        conf = data.draw(st.lists(st.sampled_from([0.1, 0.9]), min_size=n, max_size=n), "confidences")
        for i, x in enumerate(ids):
            drafted_on[(chain.version, step.position + i)] = tuple(step.context + ids[:i])
        to_tracker.extend(chain.add(step, proposal(ids, conf), 1.0))
        return True

    def deliver_commit() -> None:
        v, ids, until = to_draft.pop(0)
        chain.commit(v, ids, until, min_conf)

    def deliver_event() -> None:
        ev = to_tracker.pop(0)
        tracker.on_token(ev) if isinstance(ev, ChainToken) else tracker.on_pause(ev)

    rounds = 0
    for _ in range(200):
        if rounds >= 12 or len(committed) + gamma + 2 > max_context:
            break
        quiet = not to_draft and not to_tracker
        span = tracker.span(committed, gamma, min_conf)
        if quiet and chain.next_step(inline) is None and chain.blocked() is None and not to_tracker:
            assert span.complete, "the draft is idle and nothing is in flight, yet the span waits"
        if span.complete and quiet and not span.tokens:
            assert chain.want() == 0 and chain.paused, "an empty span taken as complete while the draft drafts on"
        for i, t in enumerate(span.tokens + ([span.post] if span.post is not None else [])):
            want = tuple(committed + [x.token_id for x in span.tokens[:i]])
            assert drafted_on[(t.version, t.position)] == want, "verified a token drafted on another prefix"
        moves = ["draft"] + (["commit"] if to_draft else []) + (["event"] if to_tracker else [])
        moves += ["round"] if span.complete else []
        move = data.draw(st.sampled_from(moves), "move")
        if move == "draft":
            draft_step()
        elif move == "commit":
            deliver_commit()
        elif move == "event":
            deliver_event()
        else:
            ids = [t.token_id for t in span.tokens]
            accepted = data.draw(st.integers(0, len(ids)), "accepted")
            if accepted == len(ids) and span.post is not None and data.draw(st.booleans(), "post accepted"):
                nxt = span.post.token_id
            elif accepted < len(ids):
                nxt = data.draw(st.sampled_from([x for x in range(vocab) if x != ids[accepted]]), "correction")
            else:
                nxt = data.draw(st.integers(0, vocab - 1), "bonus")
            new = ids[:accepted] + [nxt]
            committed += new
            version += 1
            tracker.sent(version, len(committed))
            to_draft.append((version, new, len(committed) + gamma + 1))
            rounds += 1
