"""The draft's context window (orchestrator/draft_window.py): what a unary
Propose sends the draft when its catch-up is longer than the window, that
the draft's sequence is always the committed tokens less one range after
the sink, and, through real services on loopback, that a request drafting
from a window gives the target's own greedy tokens while the draft takes in
a bounded context."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

import numpy as np
import pytest

from orchestrator.draft_window import plan_feed
from tests.stack import start_stack

if TYPE_CHECKING:
    from tests.conftest import TinyModels, TinyOnnx


def test_a_short_catch_up_or_no_window_sends_every_token_the_draft_lacks() -> None:
    seq = list(range(100, 160))
    assert plan_feed(seq, 0, 0, 0, 4).tokens == seq  # window off: the whole prompt
    f = plan_feed(seq, 50, 0, 16, 4)  # 10 behind, within the window
    assert (f.base, f.tokens, f.skip) == (50, seq[50:], 0)
    f = plan_feed(seq[:20], 0, 0, 16, 4)  # a prompt no longer than sink + window: nothing to leave out
    assert (f.base, f.tokens, f.skip) == (0, seq[:20], 0)


def test_a_long_prompt_gives_the_draft_its_sink_and_last_window() -> None:
    seq = list(range(1000, 1300))
    f = plan_feed(seq, 0, 0, 32, 4)
    assert f.base == 0 and f.tokens == seq[:4] + seq[-32:] and f.skip == 300 - 36 and f.draft_len() == 36
    # the next rounds append what was committed since, in the draft's coordinates
    seq2 = seq + [7, 8, 9]
    g = plan_feed(seq2, 300, f.skip, 32, 4)
    assert (g.base, g.tokens, g.skip) == (36, [7, 8, 9], f.skip)
    # a rollback inside the window (the draft had taken in a rejected span): the base follows the committed length
    assert plan_feed(seq2, 302, f.skip, 32, 4).base == 38


def test_a_long_catch_up_after_plain_rounds_keeps_the_sink_and_takes_the_last_window() -> None:
    seq = list(range(500))
    f = plan_feed(seq, 200, 120, 32, 4)  # the draft holds seq[:4] + seq[124:200] (80 tokens); 300 behind
    assert f.base == 4 and f.tokens == seq[-32:] and f.skip == 500 - 36
    # with no sink the draft keeps nothing and takes the window alone
    f0 = plan_feed(seq, 200, 0, 32, 0)
    assert f0.base == 0 and f0.tokens == seq[-32:] and f0.skip == 468


@pytest.mark.parametrize("window,sink", [(8, 0), (8, 3), (16, 4), (5, 10)])
def test_the_drafts_sequence_is_always_the_committed_tokens_less_one_range(window: int, sink: int) -> None:
    """Random rounds: commits of 1-40 tokens, rejected drafted tokens the
    draft took in and must drop, plain stretches it skips. Each Propose's
    feed applied to the draft's sequence (keep ``base``, append ``tokens``)
    leaves it equal to committed[:sink] + committed[sink + skip:], ending
    with the committed tail; and a catch-up never exceeds window + sink."""
    rng = random.Random(window * 100 + sink)
    committed = [rng.randrange(1000) for _ in range(rng.randrange(1, 80))]
    draft: list[int] = []
    known = skip = 0
    for _ in range(400):
        f = plan_feed(committed, known, skip, window, sink)
        assert f.base <= len(draft) and len(f.tokens) <= max(window + sink, len(committed) - known)
        if len(committed) - known > window + sink:
            assert len(f.tokens) <= window + sink
        draft = draft[: f.base] + f.tokens
        known, skip = f.base + len(f.tokens) + f.skip, f.skip
        assert known == len(committed)
        want = committed[:sink] + committed[sink + skip:] if skip else committed
        assert draft == want
        # the draft drafts a span and takes part of it in; the committed tokens then move on
        drafted = [rng.randrange(1000) for _ in range(rng.randrange(0, 5))]
        taken = rng.randrange(0, len(drafted) + 1)
        draft += drafted[:taken]
        committed += drafted[: rng.randrange(0, taken + 1)]
        committed += [rng.randrange(1000) for _ in range(rng.choice((1, 1, 2, 9, 40)))]


# ------------------------------------------------------------ through the services
def prompt(n: int, seed: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(1, 34, size=n)]


@pytest.mark.parametrize("window", [12, 0])
def test_a_windowed_draft_gives_the_targets_greedy_tokens_and_takes_in_a_bounded_context(
    tiny_models: TinyModels, tiny_onnx: TinyOnnx, window: int
) -> None:
    """A 300-token prompt, fixed γ = 3, greedy: the tokens are the
    target-only ones with a window of 12 (+ a sink of 2) and without. The
    draft's prefix cache then holds the draft's own sequence: with the
    window, sink + window + what the rounds added (< 60 tokens); without it
    (control), the whole prompt and more."""
    stack = start_stack(tiny_models.target, tiny_models.draft, tiny_onnx.cache_dir,
                        draft_overrides={"warmup": False},
                        orchestrator_overrides={"draft_context_window": window, "draft_context_sink": 2})
    try:
        ids = prompt(300, 8)
        ref = stack.generate(prompt_token_ids=ids, mode="off", max_new_tokens=24)
        got = stack.generate(prompt_token_ids=ids, mode="fixed", gamma=3, max_new_tokens=24)
        assert got["token_ids"] == ref["token_ids"]
        stats = got["stats"]
        assert stats.draft_tokens > 0 and stats.draft_failures == 0
        stack.wait_no_sessions()
        prefixes = stack.draft.sessions.prefixes
        assert prefixes is not None
        held = max(e.cache.length for e in prefixes.entries())
        if window:
            assert held <= 2 + 12 + 24 + 3
        else:
            assert held >= 300
    finally:
        stack.close()


def test_the_window_flags_reach_the_orchestrator_through_specdec_up() -> None:
    from orchestrator.cli import config_from_args as orch_config
    from specdec_app.cli import build_parser
    from specdec_app.up import child_commands

    cfg = orch_config(build_parser().parse_args(["serve", "orchestrator"]), 1)
    assert (cfg.draft_context_window, cfg.draft_context_sink) == (64, 4)
    a = build_parser().parse_args(["up", "--draft-context-window", "0", "--draft-context-sink", "8"])
    cmds, _ = child_commands(a, "/tmp/cache")
    served = build_parser().parse_args(cmds["orchestrator"][cmds["orchestrator"].index("serve"):])
    cfg = orch_config(served, 1)
    assert (cfg.draft_context_window, cfg.draft_context_sink) == (0, 8)
    with pytest.raises(SystemExit, match="specdec: --draft-context-window and --draft-context-sink must be 0 or more"):
        orch_config(build_parser().parse_args(["serve", "orchestrator", "--draft-context-window", "-1"]), 1)
