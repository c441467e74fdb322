"""Structured output under lossless speculation: the target masks p with the
grammar at every verified position, the draft masks q the same way, and
target-only decoding applies the same mask, so constrained speculative output
is constrained target-only output: identical tokens under greedy, the exactly
enumerated constrained distribution under sampling. Through real services on
loopback with tiny real models, plus the sampler on the same models' exact
conditionals for the negative controls.

Statistics as in tests/test_sampling.py: chi-square against the exact
distribution at p < 1e-4, each test states the smallest bias it detects and
has a negative control that must fail.
"""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path
from typing import Callable

import grpc
import jsonschema
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from specdec.grammar import GrammarCompiler, GrammarSpec
from specdec.sampling import SamplingConfig, make_generator, processed_logits, rejection_sample
from specdec.v1 import orchestrator_pb2 as pb
from tests.stack import Stack, make_request, start_stack
from tests.test_sampling import assert_detects, assert_matches, detectable_shift

# the small model's vocabulary: 0 = EOS, 1..5 = "abcde"; this regex allows a
# product set of 3-token outputs: {b,d} x {a,c,e} x {b,c,e} (18 outcomes; at
# temperature 2, 12 of them have probability 0.01 or more)
REGEX = "[bd][ace][bce]"
ALLOWED = [(2, 4), (1, 3, 5), (2, 3, 5)]
PROMPT = [1, 2, 3]
CFG = SamplingConfig(temperature=2.0)


def grammar_request(kind: str, source: str = "", **fields: object) -> pb.GenerateRequest:
    req = make_request(**fields)  # type: ignore[arg-type]
    GrammarSpec(kind, source).to_proto(req.structured_output)
    return req


def run(stack: Stack, req: pb.GenerateRequest) -> dict:  # type: ignore[type-arg]
    chunks = list(stack.orch_stub().Generate(req, timeout=60))
    return {"text": "".join(c.text for c in chunks), "token_ids": [t for c in chunks for t in c.token_ids],
            "finish_reason": chunks[-1].finish_reason, "stats": chunks[-1].stats}


@pytest.fixture(scope="module")
def small_stack(tiny_models, onnx_cache_dir: Path) -> Stack:  # type: ignore[no-untyped-def]
    s = start_stack(tiny_models.small_target, tiny_models.small_draft, onnx_cache_dir)
    yield s
    s.close()


@pytest.fixture(scope="module")
def json_stack(json_models) -> Stack:  # type: ignore[no-untyped-def]
    s = start_stack(json_models.target, json_models.draft, json_models.cache_dir)
    yield s
    s.close()


# ------------------------------------------------------------ exact tables
def conditionals(model_dir: Path, prompt: list[int], length: int) -> dict[tuple[int, ...], torch.Tensor]:
    """Raw logits of the model after prompt + every prefix (up to ``length`` - 1
    tokens) over its whole vocabulary: {prefix: [V]}."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    vocab = model.config.vocab_size
    out = {}
    with torch.no_grad():
        for n in range(length):
            for prefix in itertools.product(range(vocab), repeat=n):
                out[prefix] = model(torch.tensor([prompt + list(prefix)])).logits[0, -1]
    return out


def dist(logits: torch.Tensor, allowed: tuple[int, ...] | None, cfg: SamplingConfig) -> torch.Tensor:
    """The distribution one position is drawn from: mask (None: none), then temperature/top-k/top-p."""
    if allowed is not None:
        keep = torch.zeros_like(logits, dtype=torch.bool)
        keep[list(allowed)] = True
        logits = logits.masked_fill(~keep, float("-inf"))
    return processed_logits(logits[None], cfg).softmax(-1)[0]


def exact(table: dict, cfg: SamplingConfig) -> dict[tuple[int, ...], float]:  # type: ignore[type-arg]
    """P(t_1 t_2 t_3) under constrained plain sampling (18 outcomes)."""
    out = {}
    for seq in itertools.product(*ALLOWED):
        out[seq] = float(np.prod([float(dist(table[seq[:i]], ALLOWED[i], cfg)[t]) for i, t in enumerate(seq)]))
    return out


def counts_of(samples: list[tuple[int, ...]], outcomes: list[tuple[int, ...]]) -> np.ndarray:
    index = {s: i for i, s in enumerate(outcomes)}
    counts = np.zeros(len(outcomes))
    for s in samples:
        assert s in index, f"{s} is outside the grammar"
        counts[index[s]] += 1
    return counts


# --------------------------------------------- the sampler on exact tables
def speculate(p_of: Callable[[tuple[int, ...]], torch.Tensor], q_of: Callable[[tuple[int, ...]], torch.Tensor],
              gamma: int, length: int, gen: torch.Generator) -> tuple[int, ...]:
    """One speculative generation of ``length`` tokens with the real
    rejection sampler: each round drafts min(γ, remaining - 1) tokens from q,
    verifies them against p rows (as the orchestrator's loop does)."""
    seq: tuple[int, ...] = ()
    while len(seq) < length:
        g = min(gamma, length - len(seq) - 1)
        drafted: list[int] = []
        qs = []
        for _ in range(g):
            q = q_of(seq + tuple(drafted))
            x = int(torch.multinomial(q, 1, generator=gen))
            ids = torch.nonzero(q > 0)[:, 0]
            qs.append((ids.numpy(), q[ids].numpy()))
            drafted.append(x)
        rows = torch.stack([p_of(seq + tuple(drafted[:i])) for i in range(g + 1)])
        res = rejection_sample(drafted, qs, rows, gen)
        seq = seq + tuple(drafted[: res.num_accepted]) + (res.next_token,)
    return seq[:length]


SAMPLER_N = 12_000


def test_stated_power() -> None:
    """The bounds in this file's docstrings."""
    assert detectable_shift(SAMPLER_N, 0.05, 12) == pytest.approx(0.0112, abs=5e-4)
    assert detectable_shift(E2E_N, 0.05, 12) == pytest.approx(0.0436, abs=1e-3)


@pytest.mark.statistical
def test_sampler_with_masked_p_has_the_constrained_distribution_and_unmasked_p_does_not(tiny_models) -> None:  # type: ignore[no-untyped-def]
    """The real rejection sampler on the small pair's exact conditionals,
    γ = 2, 12,000 generations per variant: with the grammar's mask on p it
    produces the enumerated constrained distribution whether q is masked (as
    the draft service drafts) or not (a draft that ignores the grammar: the
    first negative control, which must still pass). Verifying against the
    unmasked p (the second negative control) must fail: it emits tokens the
    grammar forbids, or a wrong distribution. Power: a shift of 0.0112 of
    mass between two outcomes of probability 0.05 (12 degrees of freedom, about
    the bins left after merging those expected below 5) is detected with
    probability 0.99."""
    p_table = conditionals(tiny_models.small_target, PROMPT, 3)
    q_table = conditionals(tiny_models.small_draft, PROMPT, 3)
    want = exact(p_table, CFG)
    outcomes = list(itertools.product(range(6), repeat=3))  # every output; those outside the grammar have 0
    probs = np.array([want.get(s, 0.0) for s in outcomes])
    assert probs.sum() == pytest.approx(1.0, abs=1e-4) and sum(p >= 0.01 for p in want.values()) >= 10

    def allowed(prefix: tuple[int, ...]) -> tuple[int, ...] | None:
        return ALLOWED[len(prefix)] if len(prefix) < 3 else None

    masked_p = lambda pre: dist(p_table[pre], allowed(pre), CFG)  # noqa: E731
    masked_q = lambda pre: dist(q_table[pre], allowed(pre), CFG)  # noqa: E731
    plain_q = lambda pre: dist(q_table[pre], None, CFG)  # noqa: E731
    plain_p = lambda pre: dist(p_table[pre], None, CFG)  # noqa: E731
    for seed, q_of in ((11, masked_q), (12, plain_q)):
        gen = make_generator(seed)
        samples = [speculate(masked_p, q_of, 2, 3, gen) for _ in range(SAMPLER_N)]
        assert_matches(counts_of(samples, outcomes), probs)
    gen = make_generator(13)
    wrong = [speculate(plain_p, masked_q, 2, 3, gen) for _ in range(SAMPLER_N)]
    assert_detects(counts_of(wrong, outcomes), probs)


E2E_N = 800


@pytest.mark.statistical
@pytest.mark.parametrize("draft_grammar", [True, False], ids=["masked-q", "unmasked-q"])
def test_sampled_constrained_output_has_the_constrained_distribution(
    small_stack: Stack, tiny_models, draft_grammar: bool,  # type: ignore[no-untyped-def]
) -> None:
    """Through the services (FIXED γ = 2, 800 seeded requests): every output
    matches the regex and the outputs follow the enumerated constrained
    distribution, with the draft masking q and with the draft not told the
    grammar (the orchestrator's draft_grammar off: unmasked q, the negative
    control that must still pass). Power: a shift of 0.044 of mass between
    two outcomes of probability 0.05 is detected with probability 0.99 (12
    degrees of freedom).
    Negative control: the same counts against the unmasked target's
    distribution over these 18 outputs must fail."""
    cfg = small_stack.orchestrator.servicer.cfg
    cfg.draft_grammar = draft_grammar
    try:
        table = conditionals(tiny_models.small_target, PROMPT, 3)
        want = exact(table, CFG)
        outcomes = sorted(want)
        samples, drafted, accepted = [], 0, 0
        for seed in range(E2E_N):
            r = run(small_stack, grammar_request("regex", REGEX, prompt_token_ids=PROMPT, max_new_tokens=3,
                                                 temperature=CFG.temperature, seed=seed, mode="fixed", gamma=2))
            samples.append(tuple(r["token_ids"]))
            drafted += r["stats"].draft_tokens
            accepted += r["stats"].accepted_tokens
        assert 0 < accepted < drafted
        counts = counts_of(samples, outcomes)
        assert_matches(counts, np.array([want[s] for s in outcomes]))
        plain = {s: float(np.prod([float(dist(table[s[:i]], None, CFG)[t]) for i, t in enumerate(s)])) for s in outcomes}
        assert_detects(counts, np.array([plain[s] for s in outcomes]))
        print(f"\nconstrained sampling, draft {'masked' if draft_grammar else 'unmasked'}: "
              f"acceptance {accepted / drafted:.3f}")
    finally:
        cfg.draft_grammar = True
    small_stack.wait_no_sessions()


# ------------------------------------------------------------------ greedy
SCHEMA = {"type": "object", "properties": {
    "kind": {"enum": ["cat", "dog", "bird"]},
    "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}, "maxItems": 3},
    "nested": {"type": "array", "items": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
               "maxItems": 2},
}, "required": ["kind", "tags", "nested"], "additionalProperties": False}
GRAMMARS = [
    ("json_schema", json.dumps(SCHEMA)),
    ("regex", r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"),
    ("lark", 'start: "[" item ("," item)* "]"\nitem: /[a-e]+/ | /[0-9]/'),
    ("json_object", ""),
]


@pytest.mark.parametrize("kind,source", GRAMMARS, ids=[g[0] for g in GRAMMARS])
@pytest.mark.parametrize("mode,gamma,draft_mode", [("fixed", 4, "unary"), ("auto", 0, "unary"),
                                                   ("fixed", 3, "run-ahead")])
def test_constrained_greedy_equals_constrained_off(json_stack: Stack, kind: str, source: str, mode: str, gamma: int,
                                                   draft_mode: str) -> None:
    """Greedy constrained speculative output is constrained OFF output token
    for token, and it matches the grammar."""
    fields = dict(prompt="the answer is ", max_new_tokens=60, ignore_eos=False)
    off = run(json_stack, grammar_request(kind, source, mode="off", **fields))
    spec = run(json_stack, grammar_request(kind, source, mode=mode, gamma=gamma, draft_mode=draft_mode, **fields))
    assert spec["token_ids"] == off["token_ids"] and spec["text"] == off["text"]
    if mode == "fixed":  # (AUTO's γ follows measured costs: it may draft little)
        assert spec["stats"].draft_tokens > 0 and spec["stats"].accepted_tokens > 0
    if kind == "json_schema":
        assert off["finish_reason"] == pb.FINISH_REASON_EOS  # the schema is finite: the grammar ends it
        jsonschema.validate(json.loads(off["text"]), SCHEMA)
    elif kind == "regex":
        assert re.fullmatch(source, off["text"]) and off["finish_reason"] == pb.FINISH_REASON_EOS
    elif kind == "json_object" and off["finish_reason"] == pb.FINISH_REASON_EOS:
        assert isinstance(json.loads(off["text"]), dict)
    json_stack.wait_no_sessions()


def test_unconstrained_output_differs(json_stack: Stack) -> None:
    """The grammar changes the output (else the tests above prove nothing)."""
    fields = dict(prompt="the answer is ", max_new_tokens=20, mode="off")
    plain = run(json_stack, make_request(**fields))  # type: ignore[arg-type]
    date = run(json_stack, grammar_request("regex", GRAMMARS[1][1], **fields))
    assert plain["text"] != date["text"] and not re.fullmatch(GRAMMARS[1][1], plain["text"])


# ------------------------------------------------------- errors, dead ends
@pytest.mark.parametrize("kind,source,message", [
    ("regex", "([a", "regex"),
    ("json_schema", "{not json", "json_schema"),
    ("json_schema", '{"type": "nope"}', "json_schema"),
    ("lark", "start: undefined_rule", "lark"),
])
def test_a_grammar_that_does_not_compile_is_invalid_argument(small_stack: Stack, kind: str, source: str,
                                                             message: str) -> None:
    with pytest.raises(grpc.RpcError) as e:
        run(small_stack, grammar_request(kind, source, prompt_token_ids=PROMPT, mode="fixed"))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "structured output" in e.value.details() and message in e.value.details()
    small_stack.assert_clean()


@pytest.mark.parametrize("mode", ["off", "fixed"])
def test_a_dead_end_ends_the_stream_with_its_finish_reason(small_stack: Stack, mode: str) -> None:
    """The small vocabulary has no 'x': after "ab" the grammar allows nothing."""
    r = run(small_stack, grammar_request("regex", "abx", prompt_token_ids=PROMPT, mode=mode, max_new_tokens=10))
    assert r["token_ids"] == [1, 2] and r["finish_reason"] == pb.FINISH_REASON_GRAMMAR_DEAD_END
    r = run(small_stack, grammar_request("regex", "xyz", prompt_token_ids=PROMPT, mode=mode))
    assert r["token_ids"] == [] and r["finish_reason"] == pb.FINISH_REASON_GRAMMAR_DEAD_END
    small_stack.assert_clean()


def test_compiled_grammars_are_cached_by_content_with_a_bound(tiny_models) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_models.small_target))
    c = GrammarCompiler(tok, 6, [0], max_cached=2)
    a, b = c.state(GrammarSpec("regex", "a+"), 0), c.state(GrammarSpec("regex", "a+"), 0)
    assert c.compiled == 1 and a.matcher is not b.matcher  # one compilation, independent states
    assert a.advance(1) and b.allowed()[1] and not a.advance(2)  # 'b' is not allowed after 'a' under a+
    c.state(GrammarSpec("regex", "b+"), 0)
    c.state(GrammarSpec("regex", "c+"), 0)
    assert c.cached == 2 and c.compiled == 3
    c.state(GrammarSpec("regex", "a+"), 0)  # evicted (least recently used): compiled again
    assert c.compiled == 4 and c.cached == 2
