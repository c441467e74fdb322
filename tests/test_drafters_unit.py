"""Unit tests (no gRPC, no models) for the issue-4 drafters' pure parts:
the byte-level vocabulary map, the re-tokenized draft context and the
prompt-lookup n-gram index."""

from __future__ import annotations

import numpy as np
import pytest

from draft_service.drafter import Drafter, DraftRequest, Proposal
from draft_service.prompt_lookup import AutoDrafter, NgramIndex, PromptLookupDrafter
from draft_service.tli import RetokenizedContext, render_text, utf8_complete_prefix
from draft_service.vocab_map import TokenTable, build_vocab_map, token_table
from specdec.sampling import SamplingConfig
from tests.tiny import build_tiny_tokenizer

CHARS = "abcdefghijklmnopqrstuvwxyz .,:!?\n"
TARGET_MERGES = [("t", "h"), ("th", "e"), ("i", "n"), (" ", "t"), ("e", "r")]
DRAFT_MERGES = [("t", "h"), ("a", "n"), ("e", "r"), ("o", "u"), (" ", "a")]


def _table(parts: list[bytes], special: list[bool] | None = None) -> TokenTable:
    offsets = np.zeros(len(parts) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(p) for p in parts])
    return TokenTable(b"".join(parts), offsets, np.array(special or [False] * len(parts), dtype=bool))


# ------------------------------------------------------------------ vocab map
def test_vocab_map_intersects_by_bytes_and_kind() -> None:
    target = build_tiny_tokenizer(CHARS, TARGET_MERGES)
    draft = build_tiny_tokenizer(CHARS + "XYZ", DRAFT_MERGES)
    tt, dt = token_table(target), token_table(draft)
    assert tt.get(0) == b"<|endoftext|>" and bool(tt.special[0])
    assert tt.get(target.get_vocab()["Ġt"]) == b" t"  # byte-level: Ġ is the space byte
    vm = build_vocab_map(dt, tt, len(draft), len(target))
    # EOS (special <-> special), the 33 shared characters, "th" and "er"
    assert vm.size == 1 + len(CHARS) + 2
    dv, tv = draft.get_vocab(), target.get_vocab()
    assert vm.draft_to_target[dv["th"]] == tv["th"] and vm.draft_to_target[dv["er"]] == tv["er"]
    for only_draft in ("X", "an", "ou", "Ġa"):
        assert vm.draft_to_target[dv[only_draft]] == -1
    for only_target in ("the", "in", "Ġt"):
        assert vm.target_to_draft[tv[only_target]] == -1
    # a bijection on the intersection
    mapped = vm.draft_to_target[vm.draft_to_target >= 0]
    assert len(set(mapped.tolist())) == mapped.size
    assert all(vm.target_to_draft[t] == d for d, t in enumerate(vm.draft_to_target) if t >= 0)


def test_vocab_map_special_tokens_never_match_plain_text_and_is_injective() -> None:
    target = _table([b"<s>", b"a", b"b", b"ab", b"a"], [True, False, False, False, False])  # id 4 duplicates "a"
    draft = _table([b"<s>", b"ab", b"a", b"<s>"], [False, False, False, True])
    vm = build_vocab_map(draft, target, 5, 6)  # logits larger than the tables: padding rows
    assert vm.draft_to_target.tolist() == [-1, 3, 1, 0, -1]
    assert vm.target_to_draft.tolist() == [3, 2, -1, 1, -1, -1]


def test_sentencepiece_style_token_strings() -> None:
    from tokenizers import Tokenizer, models

    vocab = {"<unk>": 0, "▁the": 1, "<0x41>": 2, "x": 3}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))

    class Wrapper:  # the two methods token_table needs from an HF tokenizer
        backend_tokenizer = tok

        def get_vocab(self) -> dict[str, int]:
            return tok.get_vocab()

    t = token_table(Wrapper())
    assert [t.get(i) for i in range(4)] == [b"<unk>", b" the", b"A", b"x"]


# ------------------------------------------------------------ draft context
def test_utf8_rendering_holds_back_incomplete_characters() -> None:
    e_acute = "é".encode()  # c3 a9
    snake = "🐍".encode()  # 4 bytes
    assert utf8_complete_prefix(b"ab" + e_acute[:1]) == 2
    assert utf8_complete_prefix(b"ab" + snake[:3]) == 2
    assert utf8_complete_prefix(b"ab" + snake) == 6
    assert render_text(b"x" + snake[:2]) == b"x"
    assert render_text(b"\xffok") == "\ufffdok".encode()


def _char_tokenizer() -> tuple[TokenTable, object]:
    """A draft that tokenizes text into single characters (ids = code points < 512)."""
    parts = [chr(i).encode() for i in range(512)]
    return _table(parts), (lambda s: [ord(c) for c in s])


def test_retokenized_context_rebuilds_exact_text_across_split_characters() -> None:
    # target tokens: ASCII words, and "é" split over two tokens (ids 2, 3)
    target = _table([b"ca", b"f", b"\xc3", b"\xa9", b" ok", b"<|im_end|>"], [False] * 5 + [True])
    draft, tokenize = _char_tokenizer()
    ctx = RetokenizedContext(target, draft, tokenize, lookbehind=2)  # type: ignore[arg-type]
    committed = [0, 1, 2]
    ids = ctx.update(committed)
    assert "".join(chr(i) for i in ids) == "caf"  # the half character is held back
    committed += [3, 4, 5]
    ids = ctx.update(committed)
    assert "".join(chr(i) for i in ids) == "café ok<|im_end|>"  # special token: its text
    # a rolled-back sequence (session rebuilt with other tokens) re-tokenizes correctly
    ids = ctx.update([0, 4])
    assert "".join(chr(i) for i in ids) == "ca ok"


def test_retokenized_context_incremental_equals_full(tmp_path: object) -> None:
    """With real BPE tokenizers (merges across token boundaries), the
    windowed re-tokenization equals re-tokenizing the whole text, and the
    text always equals the target's own decoding."""
    from draft_service.tli import hf_tokenize_fn

    target = build_tiny_tokenizer(CHARS, TARGET_MERGES)
    draft = build_tiny_tokenizer(CHARS + "XYZ", DRAFT_MERGES)
    tokenize = hf_tokenize_fn(draft)
    rng = np.random.default_rng(0)
    text = "the thinner theorist in the other tower, an outer thing: three!\n" * 3
    committed: list[int] = []
    ctx = RetokenizedContext(token_table(target), token_table(draft), tokenize, lookbehind=4)
    all_ids = target(text, add_special_tokens=False)["input_ids"]
    i = 0
    while i < len(all_ids):
        step = int(rng.integers(1, 4))
        committed += all_ids[i : i + step]
        i += step
        ids = ctx.update(committed)
        want_text = target.decode(committed)
        assert draft.decode(ids) == want_text
        assert ids == tokenize(want_text)
    assert ctx.invertible
    assert ctx.retokenized_tokens < 3 * len(ctx.draft_ids)  # windowed, not the whole text each round


# ------------------------------------------------------------- prompt lookup
def test_ngram_index_longest_most_recent_match() -> None:
    idx = NgramIndex(1, 4)
    idx.sync([1, 2, 3, 4, 9, 1, 2, 3, 5, 7, 1, 2, 3])
    # suffix [1,2,3]: 4-gram [x,1,2,3] never followed by more; 3-gram most recent at e=8 -> [5, 7, 1]
    assert idx.lookup(3) == (3, [5, 7, 1])
    assert idx.lookup(10) == (3, [5, 7, 1, 2, 3])  # capped at the end of the sequence
    idx.sync([1, 2, 3, 4, 9, 1, 2, 3, 5, 7, 1, 2, 3, 4])
    assert idx.lookup(2) == (4, [9, 1])  # [1,2,3,4] occurred at the start
    idx.sync([8, 8])  # divergent: re-indexed from scratch
    assert idx.lookup(4) == (1, [8])
    idx.sync([8, 8, 6])
    assert idx.lookup(4) == (0, [])


def test_prompt_lookup_proposals_on_an_edit_prompt() -> None:
    """A rename edit: the model rewrites code from the prompt; after each
    committed edit the drafter proposes exactly the next span of the original."""
    words = "def stats ( lst ) : total = sum ( lst ) ; return total / len ( lst )".split()
    vocab = {w: i + 1 for i, w in enumerate(sorted(set(words + ["numbers", "PROMPT", "ANSWER"])))}
    enc = lambda s: [vocab[w] for w in s.split()]  # noqa: E731
    prompt = enc("PROMPT def stats ( lst ) : total = sum ( lst ) ; return total / len ( lst ) ANSWER")
    d = PromptLookupDrafter("pl", len(vocab) + 1)
    state = d.new_state()
    cfg, rng = SamplingConfig(), np.random.default_rng(0)

    def propose(generated: str, gamma: int = 8) -> list[int]:
        p = d.propose(state, prompt + enc(generated), gamma, cfg, rng)
        assert all(len(ids) == 1 and probs.tolist() == [1.0] for ids, probs in p.q)
        assert p.confidence == [1.0] * len(p.token_ids)
        return p.token_ids

    assert propose("def") == enc("stats ( lst ) : total = sum")
    assert propose("def stats (", 3) == enc("lst ) :")
    # after the edit ("numbers" is new): the 1-gram "numbers" has no earlier occurrence
    assert propose("def stats ( numbers") == []
    # the 2-gram ") :" occurs in the prompt: continue from there
    assert propose("def stats ( numbers ) :") == enc("total = sum ( lst ) ; return")
    assert propose("def stats ( numbers ) : total = sum ( numbers ) ; return", 4) == enc("total / len (")
    assert state.hits == 4 and state.misses == 1


class _ModelStub(Drafter):
    """Stands in for a model drafter: always proposes [99]."""

    name = "stub"
    vocab_size = 100
    max_context_tokens = 1000

    def new_state(self) -> list[int]:
        return []

    def draft(self, state: list[int], req: DraftRequest) -> Proposal:
        state.append(len(req.committed))
        return Proposal([99], [(np.array([99], dtype=np.int32), np.ones(1, dtype=np.float32))], 1, [0.5])


def test_auto_drafter_uses_prompt_lookup_while_it_matches() -> None:
    auto = AutoDrafter("auto", PromptLookupDrafter("pl", 100), _ModelStub(), min_ngram=2, threshold=0.5, decay=0.5)
    state = auto.new_state()
    cfg, rng = SamplingConfig(), np.random.default_rng(0)
    seq = [1, 2, 3, 4, 5, 6, 7, 1, 2]
    p = auto.propose(state, seq, 3, cfg, rng)
    assert p.token_ids == [3, 4, 5] and state.used_lookup == 1  # 2-gram [1, 2] matched
    p = auto.propose(state, seq + [8], 3, cfg, rng)  # the target committed 8, not 3: a miss
    assert p.token_ids == [99] and state.score == 0.5  # no match for [2, 8]: the model drafts
    seq2 = seq + [8, 1, 2]
    p = auto.propose(state, seq2, 3, cfg, rng)  # [1, 2] matches again (score 0.5 >= threshold)
    assert p.token_ids == [8, 1, 2]
    p = auto.propose(state, seq2 + [5, 1, 2], 3, cfg, rng)  # miss: score 0.25; [1, 2] matches, model drafts
    assert p.token_ids == [99] and state.score == 0.25
    p = auto.propose(state, seq2 + [5, 1, 2, 5], 3, cfg, rng)  # the skipped candidate (5) hit: 0.625
    assert state.score == pytest.approx(0.625)
    assert p.token_ids == [1, 2, 5]  # back to prompt lookup ([1, 2, 5] matched)
    p = auto.propose(state, [1, 2, 3, 4, 3], 3, cfg, rng)  # a rebuilt session: only the 1-gram [3] matches
    assert p.token_ids == [99]  # below min_ngram
    assert (state.used_lookup, state.used_model) == (3, 3)


@pytest.mark.parametrize("argv, hosted, default", [
    # the defaults: all four built-ins hosted, auto serving requests that name none
    ([], ["qwen2.5-coder-0.5b", "smollm2-135m", "prompt-lookup", "auto"], "auto"),
    # auto wherever it is listed; without it the model drafter; without both, the first hosted
    (["--drafters", "prompt-lookup,auto,qwen2.5-coder-0.5b"], ["prompt-lookup", "auto", "qwen2.5-coder-0.5b"], "auto"),
    (["--drafters", "prompt-lookup,qwen2.5-coder-0.5b"], ["prompt-lookup", "qwen2.5-coder-0.5b"],
     "qwen2.5-coder-0.5b"),
    (["--drafters", "smollm2-135m,prompt-lookup"], ["smollm2-135m", "prompt-lookup"], "smollm2-135m"),
    # an explicit choice always wins
    (["--default-drafter", "prompt-lookup"], ["qwen2.5-coder-0.5b", "smollm2-135m", "prompt-lookup", "auto"],
     "prompt-lookup"),
])
def test_draft_service_default_drafter(argv: list[str], hosted: list[str], default: str) -> None:
    from draft_service.cli import config_from_args
    from specdec_app.cli import build_parser

    cfg = config_from_args(build_parser().parse_args(["serve", "draft", *argv]), 0)
    assert [d.name for d in cfg.drafters] == hosted
    assert cfg.default_name == default
    if "auto" in hosted:  # auto falls back to the same-tokenizer model drafter when it is hosted
        assert next(d for d in cfg.drafters if d.name == "auto").fallback == "qwen2.5-coder-0.5b"


def test_draft_service_refuses_an_unknown_default_drafter() -> None:
    from draft_service.cli import config_from_args
    from specdec_app.cli import build_parser

    # checked with the flags, before anything loads, and the message names the flag
    with pytest.raises(SystemExit, match="specdec: --default-drafter 'prompt-lookup' is not one of"):
        config_from_args(build_parser().parse_args(
            ["serve", "draft", "--drafters", "qwen2.5-coder-0.5b", "--default-drafter", "prompt-lookup"]), 0)


def test_top_probability_is_the_softmax_maximum_in_float32() -> None:
    """The confidence stop's estimate: float32 exp with a float64 sum agrees
    with the float64 softmax to 1e-6 over a 152k vocabulary, masked (-inf)
    entries included; a one-hot row is 1 and a flat row 1/V."""
    from draft_service.drafter import top_probability

    rng = np.random.default_rng(0)
    x = (rng.standard_normal(151_936) * 4).astype(np.float32)
    x[:100] = -np.inf
    y = x.astype(np.float64)
    exact = 1.0 / np.exp(y - y.max()).sum()
    assert abs(top_probability(x) - exact) < 1e-6 * exact
    one_hot = np.full(1000, -np.inf, dtype=np.float32)
    one_hot[7] = 3.0
    assert top_probability(one_hot) == 1.0
    assert abs(top_probability(np.zeros(4096, dtype=np.float32)) - 1 / 4096) < 1e-9
