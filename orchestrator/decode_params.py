"""What a request asks of the decoding loop (orchestrator/decode.py): its
parameters, the steps the loop yields, and the loop's per-token timeout
allowances. Plain data, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from orchestrator.lookup import LocalLookup
from orchestrator.policy import DraftLengthPolicy
from orchestrator.protocols import RoundSink, SessionOptions
from specdec.errors import InvalidArgument
from specdec.sampling import SamplingConfig, TokenLogprob

# a prefill's timeout grows by this much a prompt token (_prefill_timeout): beside one busy stream
# on 2 cores the target's chunks shrink to a few tokens and a 4,000-token prompt ran ~0.08 s a
# token (948 chunks in the 320 s the old 0.05 allowed, docs/bench/long-prompt-rerun)
PREFILL_S_PER_TOKEN = 0.12
# a draft call's timeout grows by this much a context token it must take in first (_draft_timeout):
# the 0.5B ONNX draft takes in ~2 ms a token on 2 cores (741 tokens in 1,383 ms), 5x margin
DRAFT_S_PER_TOKEN = 0.01

DRAFT_MODES = ("unary", "stream", "run-ahead")
MAX_REBUILDS_PER_ROUND = 2  # target session rebuilds (another replica each) before a round gives up


class UnknownDrafter(InvalidArgument):
    """The request named a drafter the draft service does not host."""


@dataclass(frozen=True)
class Step:
    """Tokens committed by one step (prefill or a verified round)."""

    token_ids: list[int]
    logit_gaps: list[float]
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token, with options.top_logprobs
    dead_end: bool = False  # structured output: the grammar allows no token after these; the sequence ends


@dataclass
class DecodeParams:
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingConfig
    policy: DraftLengthPolicy
    speculate: bool
    drafter: str = ""  # sent to the draft service ("" = its default)
    drafter_label: str = ""  # the drafter's name for stats and metrics
    # the drafters the draft service hosted when it attached: a name outside
    # them is still the client's error while no draft replica can check it
    hosted_drafters: frozenset[str] = frozenset()
    draft_timeout_s: float = 5.0
    draft_retry_after_rounds: int = 4
    target_timeout_s: float = 120.0
    release_timeout_s: float = 2.0
    deadline: float | None = None  # time.monotonic() by which the request must end
    min_confidence: float = 0.0  # draft-side confidence early stop; 0 = the policy's (``stop_confidence``)
    context_limited: bool = False  # max_new_tokens was cut to what the model's context holds
    sink: RoundSink | None = None
    # unary: a Propose call per round; stream: one Session stream, drafting the
    # span each round asks for; run-ahead: the stream keeps drafting up to
    # run_ahead_tokens past the span while the target verifies it
    draft_mode: str = "unary"
    run_ahead_tokens: int = 8
    # decode-ahead: a round without a drafter (OFF, or the draft turned off)
    # lets the target run this many plain steps ahead on its Verify stream
    decode_ahead: int = 0
    stop_token_ids: frozenset[int] = frozenset()  # ... which it ends after one of these (EOS)
    options: SessionOptions = field(default_factory=SessionOptions)  # kept by the target session (logprobs, grammar)
    draft_options: SessionOptions = field(default_factory=SessionOptions)  # kept by the draft session (grammar)
    # unary: the draft takes in the prompt (a Propose of one token, in the background) while the
    # target prefills it, for draft and target on different hardware; never awaited before the
    # first token, and rounds run target-only until it is done
    draft_prefill_overlap: bool = False
    # prompt lookup in the orchestrator (orchestrator/lookup.py; the ``auto`` drafter, unary
    # drafting): a round whose committed suffix has a trusted earlier match verifies its
    # continuation, with ``lookup_policy`` choosing the span, and counts under ``lookup_label``
    lookup: LocalLookup | None = None
    lookup_policy: DraftLengthPolicy | None = None
    lookup_label: str = ""
    max_lookup_tokens: int = 8  # the longest span a lookup round verifies
    # unary drafting: the draft's context window and sink (orchestrator/draft_window.py); 0 = whole context
    draft_window: int = 0
    draft_sink: int = 4
