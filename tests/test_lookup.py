"""Prompt lookup in the orchestrator (orchestrator/lookup.py): which
continuation a request's own tokens propose, when it is trusted, and when
plain rounds may run ahead. Plain Python, no services (the end-to-end
behaviour is in tests/test_drafters_e2e.py)."""

from __future__ import annotations

import numpy as np

from orchestrator.lookup import LocalLookup
from orchestrator.policy import LOCAL_DRAFT_TOKEN_MS, PolicyFactory
from specdec.sampling import one_hot_q


def test_the_most_recent_earlier_occurrence_of_the_longest_suffix_is_continued() -> None:
    lk = LocalLookup()
    #             0  1  2  3  4  5  6  7  8  9
    committed = [5, 6, 7, 8, 9, 5, 6, 7, 1, 2, 5, 6, 7]
    # suffix [5, 6, 7] (and [6, 7]) last occurred at 5..7, followed by 1, 2, 5, ...
    assert lk.candidate(committed, 3) == [1, 2, 5]
    assert lk.candidate(committed + [1], 8) == [2, 5, 6, 7, 1]  # up to the end of the sequence


def test_a_one_token_match_is_not_proposed() -> None:
    lk = LocalLookup()
    assert lk.candidate([1, 2, 3, 4, 2], 4) == []  # only "2" recurs
    assert lk.candidate([1, 2, 3, 4, 2, 3], 4) == [4, 2, 3]  # "2 3" recurs


def test_misses_take_trust_away_and_a_hit_gives_it_back() -> None:
    lk = LocalLookup()
    seq = [1, 2, 3, 1, 2]
    assert lk.candidate(seq, 2) == [3, 1]  # predicts 3 at position 5
    seq.append(9)  # the target committed 9: a miss (score 0.7)
    seq += [1, 2]
    assert lk.candidate(seq, 2) == [9, 1]  # still trusted; predicts 9 at position 8
    seq.append(4)  # a second miss: 0.49 < 0.5
    seq += [1, 2]
    assert lk.candidate(seq, 2) == []  # a match, but no longer trusted (it is still scored)
    assert not lk.trusted
    seq.append(4)  # the untrusted candidate's token was right: 0.64
    assert lk.candidate(seq, 2) != [] and lk.trusted
    assert (lk.hits, lk.scored) == (1, 3)


def test_lookup_goes_dormant_after_rounds_without_a_span() -> None:
    lk = LocalLookup(dormant_after=3)
    for _ in range(2):
        lk.note_round(False)
    assert not lk.dormant
    lk.note_round(False)
    assert lk.dormant
    lk.note_round(True)
    assert not lk.dormant and lk.idle == 0


def test_one_hot_q_is_what_the_verifier_reads_as_a_model_free_draft() -> None:
    q = one_hot_q([7, 3])
    assert [ids.tolist() for ids, _ in q] == [[7], [3]]
    assert all(p.dtype == np.float32 and p.tolist() == [1.0] for _, p in q)


def test_the_lookup_policy_prices_drafting_at_nothing() -> None:
    """The local policy's shared cost model starts from a verify curve and a
    draft cost of LOCAL_DRAFT_TOKEN_MS, not the 20 ms default of a model
    drafter: with a flat verify curve it drafts from the first round."""
    factory = PolicyFactory()
    factory.set_cost_priors({1: 40.0, 2: 41.0, 3: 42.0, 4: 43.0, 5: 44.0, 6: 45.0, 7: 46.0, 8: 47.0, 9: 48.0})
    policy = factory.make_local("auto:lookup")
    assert factory.draft_token_ms["auto:lookup"] == LOCAL_DRAFT_TOKEN_MS
    assert policy.costs.draft_ms(4, False, False) < 1.0
    assert policy.next_gamma() > 0
    # the model drafter's own label keeps its own costs
    model = factory.make("adaptive", 0, "auto")
    assert model.costs is not policy.costs


def test_rounds_promised_to_decode_ahead_verify_no_span() -> None:
    """Without lookup on the target: while lookup is dormant the target may
    decode a few plain rounds ahead; those rounds must stay plain (a span
    would stop the run in mid-step and put the target's session out of
    step), and lookup is asked again after them."""
    factory = PolicyFactory()
    factory.set_cost_priors({k: 40.0 + k for k in range(1, 10)})
    policy = factory.make_local("auto:lookup")
    lk = LocalLookup(dormant_after=3, on_target=False)
    assert lk.ahead_room(16) == 0  # not dormant: no plain rounds ahead
    for _ in range(3):
        lk.note_round(False)
    assert lk.ahead_room(16) == 3 and lk.ahead_room(2) == 2  # dormant: a few at a time
    seq = [1, 2, 3, 1, 2]  # "1 2" recurs: a trusted candidate every round
    assert lk.promised(2) == 2
    assert lk.next_span(seq, 4, policy) == []
    assert lk.promised(0) == 0  # the plain round inside the grant asks for nothing more: the promise stands
    assert lk.next_span(seq, 4, policy) == []
    assert lk.next_span(seq, 4, policy) != []


class _Committed:
    """A request policy that committed some plain rounds (commit_plain_rounds)."""

    def __init__(self, left: int) -> None:
        self.plain_rounds_left = left


def test_lookup_on_target_grants_every_committed_plain_round() -> None:
    """With lookup on the target every plain round the request's policy
    committed to runs ahead, dormant or not, with the lookup policy's span
    as the cap; a run that ended early (its steps verified spans) is
    granted the rounds still committed; the grant is a promise (no span
    from the orchestrator meanwhile); nothing committed, nothing granted."""
    factory = PolicyFactory()
    factory.set_cost_priors({k: 40.0 + k for k in range(1, 10)})
    lookup_policy = factory.make_local("auto:lookup")
    lk = LocalLookup()
    assert lk.ahead_room(16) == 16  # not dormant, still all of them
    n, cap = lk.grant(5, 16, _Committed(0), lookup_policy, 8)
    assert n == 5 and 1 <= cap <= 8
    assert lk.promised_rounds == 5
    assert lk.next_span([1, 2, 3, 1, 2], 4, lookup_policy) == []  # promised: plain
    n, cap = lk.grant(0, 16, _Committed(3), lookup_policy, 8)  # the run ended after fewer rounds
    assert n == 3 and cap >= 1 and lk.promised_rounds == 3
    assert lk.grant(0, 16, _Committed(0), lookup_policy, 8) == (0, 0)
    assert lk.grant(0, 2, _Committed(3), lookup_policy, 8)[0] == 2  # never past the room
    off = LocalLookup(on_target=False)
    assert off.grant(4, 4, _Committed(9), lookup_policy, 8) == (4, 0)  # plain runs: no own spans


def test_the_target_drafts_its_own_span_only_within_the_call_and_the_context() -> None:
    """target_service/self_lookup.py: a plain call with lookup allowed
    verifies the session's trusted continuation (one-hot q), at most
    ``lookup_tokens`` of it, never past the context; without a match it is
    the same plain call."""
    from types import SimpleNamespace

    from target_service.calls import VerifyCall
    from target_service.self_lookup import self_draft

    sess = SimpleNamespace(lookup=None, cache_len=7, tokens=[5, 6, 7, 8, 9, 5, 6])
    call = VerifyCall("s", 7, [7], [], [], lookup_tokens=2)
    out = self_draft(call, sess, max_span=16, max_context=100)
    assert out.draft_ids == [8, 9] and out.draft_q == [None, None] and out.self_drafted
    assert out.new_ids == [7] and out.cache_len == 7
    near_end = self_draft(call, SimpleNamespace(lookup=None, cache_len=7, tokens=list(sess.tokens)),
                          max_span=16, max_context=10)  # 7 cached + 1 new: room for 1 before the last position
    assert near_end.draft_ids == [8]
    none = self_draft(VerifyCall("s", 7, [1], [], [], lookup_tokens=2),
                      SimpleNamespace(lookup=None, cache_len=7, tokens=list(sess.tokens)), 16, 100)
    assert none.draft_ids == [] and not none.self_drafted
