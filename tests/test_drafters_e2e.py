"""Issue-4 drafters end to end through real gRPC services on loopback:
a different-tokenizer draft (token-level intersection) and model-free prompt
lookup, hosted next to a same-tokenizer ONNX draft (and an ``auto`` drafter:
prompt lookup while it matches, else the TLI draft) in one draft service and
chosen per request.

Tiny models: the target's tokenizer has characters plus the merges
th, the, in, " t", er; the TLI draft's tokenizer has the same characters plus
X, Y, Z and the merges th, an, er, ou, " a". So "the", "in" and " t" are
target tokens outside the intersection, and the draft has tokens the target
lacks. The TLI draft copies the target's weights for shared tokens (plus
noise), so it agrees with the target often enough to exercise acceptance.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest
from transformers import AutoTokenizer

from draft_service.config import DrafterSpec
from specdec.sampling import SamplingConfig
from tests.tiny import build_tiny_model
from specdec.tokenization import tokenizer_fingerprint
from specdec.v1 import common_pb2, draft_pb2
from tests.stack import Stack, start_stack
from tests.test_e2e_tiny import (
    PIT_BINS, PIT_LENGTH, PIT_REQUESTS, control_config, exact_sequence_distribution, pit_counts, sample_sequences,
)
from tests.test_sampling import assert_detects, assert_matches

CHARS = "abcdefghijklmnopqrstuvwxyz .,:!?\n"
TARGET_MERGES = [("t", "h"), ("th", "e"), ("i", "n"), (" ", "t"), ("e", "r")]
DRAFT_MERGES = [("t", "h"), ("a", "n"), ("e", "r"), ("o", "u"), (" ", "a")]
SMALL_CHARS = "abcde"
DRAFTERS = ("tiny-draft", "tli", "prompt-lookup", "auto")


@dataclass(frozen=True)
class TliModels:
    target: Path  # chars + TARGET_MERGES (vocab 39)
    same: Path  # same tokenizer as target, target + noise: an ordinary ONNX draft
    tli_draft: Path  # chars + XYZ + DRAFT_MERGES (vocab 42), rows of shared tokens from target + noise
    small_target: Path  # abcde + ab (vocab 7)
    small_tli_draft: Path  # abcde + ba, cd (vocab 8)


@pytest.fixture(scope="module")
def tli_models(tmp_path_factory: pytest.TempPathFactory) -> TliModels:
    root = tmp_path_factory.mktemp("tli-models")
    target = build_tiny_model(root / "target", chars=CHARS, merges=TARGET_MERGES, seed=21)
    small = build_tiny_model(root / "small-target", chars=SMALL_CHARS, merges=[("a", "b")], seed=25)
    return TliModels(
        target=target,
        same=build_tiny_model(root / "same", chars=CHARS, merges=TARGET_MERGES, seed=22, base_dir=target, noise=0.15),
        tli_draft=build_tiny_model(
            root / "tli-draft", chars=CHARS + "XYZ", merges=DRAFT_MERGES, seed=23, base_dir=target, noise=0.15
        ),
        small_target=small,
        small_tli_draft=build_tiny_model(
            root / "small-tli-draft", chars=SMALL_CHARS, merges=[("b", "a"), ("c", "d")], seed=26,
            base_dir=small, noise=0.3,
        ),
    )


@pytest.fixture(scope="module")
def multi_stack(tli_models: TliModels, onnx_cache_dir: Path) -> Stack:  # type: ignore[misc]
    drafters = [
        DrafterSpec(name="tiny-draft", model=str(tli_models.same), precision="fp32"),
        DrafterSpec(name="tli", model=str(tli_models.tli_draft), precision="fp32", kind="tli", lookbehind_tokens=4),
        DrafterSpec(name="prompt-lookup", kind="prompt-lookup"),
        DrafterSpec(name="auto", kind="auto", fallback="tli"),
    ]
    s = start_stack(tli_models.target, None, onnx_cache_dir, drafters=drafters)
    yield s
    s.close()


@pytest.fixture(scope="module")
def small_stack(tli_models: TliModels, onnx_cache_dir: Path) -> Stack:  # type: ignore[misc]
    drafters = [
        DrafterSpec(name="tli", model=str(tli_models.small_tli_draft), precision="fp32", kind="tli"),
        DrafterSpec(name="prompt-lookup", kind="prompt-lookup"),
        DrafterSpec(name="auto", kind="auto", fallback="tli"),
    ]
    s = start_stack(tli_models.small_target, None, onnx_cache_dir, drafters=drafters)
    yield s
    s.close()


PROMPTS = [
    "the thin winter, the other tower",
    "in the end: in the end: in the end:",
    "abc abc abc abc abc",
]


# ------------------------------------------------------------- model info
def test_every_drafter_reports_the_target_vocabulary(multi_stack: Stack, tli_models: TliModels) -> None:
    fp = tokenizer_fingerprint(AutoTokenizer.from_pretrained(str(tli_models.target)))
    stub = multi_stack.draft_stub()
    for name in ("", *DRAFTERS):
        info = stub.GetModelInfo(common_pb2.ModelInfoRequest(drafter=name))
        assert (info.vocab_size, info.tokenizer_fingerprint) == (39, fp), name
    assert multi_stack.draft.drafters["tli"].intersection == 1 + len(CHARS) + 2
    # `auto` reports its fallback's measured cost per token: the prior the orchestrator's
    # policy starts it from (without one it assumed a default that kept it from drafting)
    auto, tli = (stub.GetModelInfo(common_pb2.ModelInfoRequest(drafter=n)).forward_cost for n in ("auto", "tli"))
    assert len(tli) == 1 and tli[0].ms > 0
    assert [(p.tokens, p.ms) for p in auto] == [(p.tokens, p.ms) for p in tli]


def test_unknown_drafter_is_invalid_argument(multi_stack: Stack) -> None:
    stub = multi_stack.draft_stub()
    for call in (
        lambda: stub.GetModelInfo(common_pb2.ModelInfoRequest(drafter="smollm2")),
        lambda: stub.CreateSession(draft_pb2.CreateDraftSessionRequest(drafter="Prompt-Lookup")),
        lambda: multi_stack.generate(prompt="a", drafter="no-such-drafter"),
    ):
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
        assert "unknown drafter" in e.value.details()
    multi_stack.wait_no_sessions()


# ---------------------------------------------------------- greedy equality
@pytest.mark.parametrize("drafter", DRAFTERS)
def test_greedy_speculative_equals_off_for_every_drafter(multi_stack: Stack, drafter: str) -> None:
    servicer = multi_stack.draft.servicer
    before = servicer.proposals[drafter]
    drafted = accepted = 0
    for prompt in PROMPTS:
        off = multi_stack.generate(prompt=prompt, mode="off", max_new_tokens=40)
        for gamma, draft_mode in itertools.product((1, 3, 6), ("unary", "stream", "run-ahead")):
            spec = multi_stack.generate(prompt=prompt, mode="fixed", gamma=gamma, max_new_tokens=40, drafter=drafter,
                                        draft_mode=draft_mode)
            assert spec["token_ids"] == off["token_ids"], (drafter, prompt, gamma, draft_mode)
            assert spec["text"] == off["text"]
            drafted += spec["stats"].draft_tokens
            accepted += spec["stats"].accepted_tokens
    assert servicer.proposals[drafter] > before  # the request's drafter served it
    assert drafted > 0 and accepted > 0, (drafted, accepted)
    multi_stack.wait_no_sessions()


def flat_logprobs(result: dict) -> list:  # type: ignore[type-arg]
    return [lp for c in result["chunks"] for lp in c.logprobs]


def lookup_draft_tokens(stack: Stack) -> float:
    """Tokens the orchestrator drafted by its own prompt lookup (orchestrator/lookup.py)."""
    return stack.orchestrator.servicer.metrics.num_draft_tokens.labels("auto:lookup")._value.get()


def test_auto_with_local_lookup_is_greedy_identical_to_off(multi_stack: Stack) -> None:
    """The ``auto`` drafter: rounds whose committed suffix recurs verify the
    orchestrator's own prompt-lookup span (no Propose call), the others go
    to the draft service; the tokens are OFF's either way.

    Under FIXED the lookup span's length is fixed, so whether a round takes
    the local path depends on the committed tokens alone (the candidate and
    its trust), and the repeated prompts must take it. Under AUTO it also
    depends on the shared estimates and measured costs (other requests move
    them), so AUTO is held to identity only; whether its policy prices a
    lookup span as worth verifying is tests/test_lookup.py's."""
    before = lookup_draft_tokens(multi_stack)
    for prompt in PROMPTS:
        off = multi_stack.generate(prompt=prompt, mode="off", max_new_tokens=40)
        fixed = multi_stack.generate(prompt=prompt, mode="fixed", gamma=3, max_new_tokens=40, drafter="auto")
        assert fixed["token_ids"] == off["token_ids"], prompt
        assert fixed["text"] == off["text"]
    assert lookup_draft_tokens(multi_stack) > before  # the repeated prompts did take the local path
    for prompt in PROMPTS:
        off = multi_stack.generate(prompt=prompt, mode="off", max_new_tokens=40)
        spec = multi_stack.generate(prompt=prompt, mode="auto", max_new_tokens=40, drafter="auto")
        assert spec["token_ids"] == off["token_ids"], prompt
        assert spec["text"] == off["text"]
    multi_stack.wait_no_sessions()


@pytest.fixture
def fresh_auto_stack(tli_models: TliModels, onnx_cache_dir: Path) -> Stack:  # type: ignore[misc]
    """A stack of its own: the policies' shared estimates start from their
    priors (others' requests move them, and with them which rounds are plain)."""
    drafters = [
        DrafterSpec(name="tli", model=str(tli_models.tli_draft), precision="fp32", kind="tli", lookbehind_tokens=4),
        DrafterSpec(name="auto", kind="auto", fallback="tli"),
    ]
    s = start_stack(tli_models.target, None, onnx_cache_dir, drafters=drafters)
    yield s
    s.close()


def test_auto_lookup_inside_decode_ahead_is_greedy_identical_to_off(fresh_auto_stack: Stack) -> None:
    """AUTO with ``auto``: the plain rounds its policy commits to run ahead
    on the target, and the target verifies its own lookup
    spans inside the runs (target_service/self_lookup.py), the orchestrator
    counts them as lookup rounds, nothing is rebuilt, and the tokens are
    OFF's, with OFF's logprobs. Negative control: OFF's own runs
    (target-only) verify no span."""
    stack = fresh_auto_stack
    servicer = stack.target.servicer
    before = servicer.self_drafted_tokens  # type: ignore[union-attr]
    offs = {p: stack.generate(prompt=p, mode="off", max_new_tokens=64, top_logprobs=2) for p in PROMPTS}
    assert servicer.self_drafted_tokens == before  # type: ignore[union-attr]
    local = lookup_draft_tokens(stack)
    # which rounds are plain (and so run ahead) is the policy's choice from
    # measured costs: requests go on until runs have verified spans (at most 4 passes)
    for attempt in range(4):
        for prompt in PROMPTS:
            spec = stack.generate(prompt=prompt, mode="auto", max_new_tokens=64, drafter="auto", top_logprobs=2)
            assert spec["token_ids"] == offs[prompt]["token_ids"], (attempt, prompt)
            got, want = flat_logprobs(spec), flat_logprobs(offs[prompt])  # one per token, a span's included
            assert [x.chosen.token_id for x in got] == spec["token_ids"]
            assert [x.chosen.logprob for x in got] == pytest.approx([x.chosen.logprob for x in want], abs=1e-5)
            assert spec["stats"].target_rebuilds == 0
        if servicer.self_drafted_tokens > before:  # type: ignore[union-attr]
            break
    assert servicer.self_drafted_tokens > before  # type: ignore[union-attr]
    assert lookup_draft_tokens(stack) > local  # counted as lookup rounds
    stack.wait_no_sessions()


def test_tli_context_is_the_targets_text(multi_stack: Stack, tli_models: TliModels) -> None:
    """Target tokens outside the intersection ("the", "in", " t") reach the
    draft as their text, re-tokenized by the draft tokenizer, and proposals
    are target ids with q over target ids."""
    target_tok = AutoTokenizer.from_pretrained(str(tli_models.target))
    draft_tok = AutoTokenizer.from_pretrained(str(tli_models.tli_draft))
    loaded = multi_stack.draft.drafters["tli"]
    drafter = loaded.drafter
    text = "the thin winter in the tower"
    committed = target_tok(text, add_special_tokens=False)["input_ids"]
    outside = {target_tok.convert_tokens_to_ids(t) for t in ("the", "in", "Ġt")}
    assert outside & set(committed)  # the prompt does use target-only tokens

    def run() -> None:
        state = drafter.new_state()
        rng = np.random.default_rng(0)
        for cut in range(1, len(committed) + 1):  # grow the committed sequence token by token
            p = drafter.propose(state, committed[:cut], 3, SamplingConfig(temperature=1.0), rng)
            want = target_tok.decode(committed[:cut])
            assert draft_tok.decode(state.context.draft_ids) == want
            assert state.context.draft_ids == draft_tok(want, add_special_tokens=False)["input_ids"]
            assert state.tokens[: len(state.context.draft_ids) - 1] == state.context.draft_ids[:-1]
            for x, (ids, probs) in zip(p.token_ids, p.q):
                assert 0 <= x < 39 and x not in outside and x in ids.tolist()
                assert np.all(ids < 39) and abs(float(probs.sum()) - 1) < 1e-5
        assert unk not in state.context.draft_ids

    unk = draft_tok.unk_token_id
    multi_stack.loop.run(multi_stack.draft.worker.run(run))


# --------------------------------------------------------- sampled exactness
@pytest.mark.parametrize(
    "drafter,cfg,prompt",
    [
        ("tli", SamplingConfig(temperature=1.0), [1, 2, 3]),
        ("tli", SamplingConfig(temperature=0.8, top_k=3, top_p=0.9), [6, 3]),
        ("prompt-lookup", SamplingConfig(temperature=1.0), [1, 2, 3, 1, 2]),
    ],
    ids=["tli-t1", "tli-t0.8-k3-p0.9", "prompt-lookup-t1"],
)
@pytest.mark.statistical
def test_sampled_sequences_match_exact_target_distribution(
    small_stack: Stack, tli_models: TliModels, drafter: str, cfg: SamplingConfig, prompt: list[int]
) -> None:
    """3-token continuations sampled through the services with γ=2 follow the
    exactly enumerated target distribution (7³ = 343 outcomes, 2,500 seeded
    requests; cells with expected count < 5 pooled; chi-square, fails at
    p < 1e-4, the bound of tests/test_sampling.py). Power: a shift of 0.029 of
    mass between two outcomes of probability 0.05 is detected with
    probability 0.99 (≤ 40 degrees of freedom after pooling). Token 6 ("ab")
    is outside the TLI intersection; prompt-lookup proposes one-hot spans
    from the repeated prompt. Negative control: the same counts must reject
    the distribution without the truncation, or at a 25 % higher temperature
    (``control_config``)."""
    length, n = 3, 2500
    exact = exact_sequence_distribution(tli_models.small_target, prompt, length, cfg)
    outcomes = sorted(exact)
    index = {s: i for i, s in enumerate(outcomes)}
    counts = np.zeros(len(outcomes))
    stub = small_stack.orch_stub()
    drafted = accepted = 0
    for seed in range(n):
        r = small_stack.generate(
            stub, prompt_token_ids=prompt, max_new_tokens=length, temperature=cfg.temperature,
            top_p=cfg.top_p, top_k=cfg.top_k, seed=seed, mode="fixed", gamma=2, drafter=drafter,
        )
        counts[index[tuple(r["token_ids"])]] += 1
        drafted += r["stats"].draft_tokens
        accepted += r["stats"].accepted_tokens
    assert drafted > 0 and 0 < accepted < drafted  # acceptances and rejections both happen
    assert_matches(counts, np.array([exact[s] for s in outcomes]))
    # negative control: the same counts against the distribution of a sampler
    # that lost its truncation or its temperature must fail
    wrong = exact_sequence_distribution(tli_models.small_target, prompt, length, control_config(cfg))
    assert_detects(counts, np.array([wrong[s] for s in outcomes]))
    small_stack.wait_no_sessions()


@pytest.mark.statistical
def test_local_lookup_sampling_has_the_targets_distribution(small_stack: Stack, tli_models: TliModels) -> None:
    """The ``auto`` drafter at γ = 2 (FIXED, so that the local path runs
    whatever the policy would make of this random model), temperature 1: 3-token continuations
    of a prompt that repeats its bigrams, where the orchestrator verifies its own
    one-hot prompt-lookup spans in some rounds and the draft service serves
    the others, follow the exactly enumerated target distribution (7³ = 343
    outcomes, 2,500 seeded requests; chi-square at p < 1e-4 as above: a shift
    of 0.029 of mass between two outcomes of probability 0.05 is detected
    with probability 0.99). Negative control: the same counts must reject
    the distribution at a 25 % higher temperature."""
    # every bigram "1 x" occurs in the prompt, so whatever token comes first,
    # the committed suffix "1 x" has an earlier match and its continuation "1"
    # is a lookup span
    cfg, prompt, length, n = SamplingConfig(temperature=1.0), [1, 0, 1, 2, 1, 3, 1, 4, 1, 5, 1, 6, 1], 3, 2500
    exact = exact_sequence_distribution(tli_models.small_target, prompt, length, cfg)
    outcomes = sorted(exact)
    index = {s: i for i, s in enumerate(outcomes)}
    counts = np.zeros(len(outcomes))
    stub = small_stack.orch_stub()
    before = lookup_draft_tokens(small_stack)
    for seed in range(n):
        r = small_stack.generate(stub, prompt_token_ids=prompt, max_new_tokens=length, temperature=1.0, seed=seed,
                                 mode="fixed", gamma=2, drafter="auto")
        counts[index[tuple(r["token_ids"])]] += 1
    assert lookup_draft_tokens(small_stack) > before + n / 4  # the local path ran in many of the requests
    assert_matches(counts, np.array([exact[s] for s in outcomes]))
    wrong = exact_sequence_distribution(tli_models.small_target, prompt, length, control_config(cfg))
    assert_detects(counts, np.array([wrong[s] for s in outcomes]))
    small_stack.wait_no_sessions()


@pytest.mark.parametrize(
    "drafter,cfg,prompt",
    [
        ("tli", SamplingConfig(temperature=0.8, top_k=3, top_p=0.9), [6, 3]),
        ("prompt-lookup", SamplingConfig(temperature=1.0), [1, 2, 3, 1, 2, 3, 1, 2]),
    ],
    ids=["tli-t0.8-k3-p0.9", "prompt-lookup-t1"],
)
@pytest.mark.statistical
def test_run_ahead_sampling_has_the_targets_distribution_at_every_position(
    small_stack: Stack, tli_models: TliModels, drafter: str, cfg: SamplingConfig, prompt: list[int]
) -> None:
    """The cross-tokenizer and the prompt-lookup drafters over a draft stream
    with run-ahead: every generated token of 400 × 50-token requests follows
    the target's exact conditional distribution at its position (randomized
    PIT in 20 bins, tests/test_e2e_tiny.py ``pit_counts``). Power: a shift of
    0.0093 of mass between two PIT bins (the most likely tokens fill the
    first) is detected with probability 0.99. Negative control: the same
    tokens scored without the truncation, or at a 25 % higher temperature,
    must fail."""
    seqs, stats = sample_sequences(small_stack, prompt, PIT_REQUESTS, PIT_LENGTH, cfg, mode="fixed", gamma=3,
                                   drafter=drafter, draft_mode="run-ahead")
    assert all(s.draft_mode == "run-ahead" and s.draft_failures == 0 for s in stats)
    assert 0 < sum(s.accepted_tokens for s in stats) < sum(s.draft_tokens for s in stats)
    assert sum(s.post_verified for s in stats) > 0
    uniform = np.full(PIT_BINS, 1 / PIT_BINS)
    assert_matches(pit_counts(tli_models.small_target, prompt, seqs, cfg), uniform)
    assert_detects(pit_counts(tli_models.small_target, prompt, seqs, control_config(cfg)), uniform)
    small_stack.wait_no_sessions()
