"""End to end through real gRPC services on loopback with tiny real models:
a 2-layer Qwen2 target (transformers, float32) and drafts exported to ONNX
(onnxruntime). Exactness, rollback, failure handling and isolation."""

from __future__ import annotations

import itertools
import threading
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from specdec.sampling import SamplingConfig, process_logits
from specdec.v1 import orchestrator_pb2 as pb
from tests.stack import Stack, free_port, kill, make_request, scrape_metrics as _scrape, start_stack
from tests.test_sampling import assert_detects, assert_matches

@pytest.fixture(scope="module")
def stack(tiny_models, onnx_cache_dir: Path) -> Stack:  # type: ignore[no-untyped-def]
    s = start_stack(tiny_models.target, tiny_models.draft, onnx_cache_dir,
                    orchestrator_overrides={"metrics_port": free_port()},
                    target_overrides={"metrics_port": free_port()})
    yield s
    s.close()


@pytest.fixture(scope="module")
def far_stack(tiny_models, onnx_cache_dir: Path) -> Stack:  # type: ignore[no-untyped-def]
    s = start_stack(tiny_models.target, tiny_models.uncorrelated, onnx_cache_dir)
    yield s
    s.close()


PROMPTS = ["hello world", "the quick brown fox", "a, b, c."]


# ------------------------------------------------------------ greedy equality
@pytest.mark.parametrize("gamma", [1, 2, 4, 8])
@pytest.mark.parametrize("draft_mode", ["unary", "stream", "run-ahead"])
def test_greedy_speculative_equals_off(stack: Stack, far_stack: Stack, gamma: int, draft_mode: str) -> None:
    """Greedy output is the target's own in every draft mode: a Propose call
    per round, one draft stream per request, and the stream running ahead
    (with post-verify at the bonus position)."""
    for st in (stack, far_stack):
        for prompt in PROMPTS:
            off = st.generate(prompt=prompt, mode="off", max_new_tokens=40)
            spec = st.generate(prompt=prompt, mode="fixed", gamma=gamma, max_new_tokens=40, draft_mode=draft_mode)
            assert spec["stats"].draft_mode == draft_mode
            assert spec["token_ids"] == off["token_ids"], (prompt, gamma)
            assert spec["text"] == off["text"]
            assert len(spec["token_ids"]) == 40
            assert spec["finish_reason"] == pb.FINISH_REASON_LENGTH
            assert spec["stats"].draft_tokens > 0
            assert off["stats"].draft_tokens == 0
    st_stats = stack.generate(prompt=PROMPTS[0], gamma=gamma, max_new_tokens=40)["stats"]
    assert st_stats.accepted_tokens > 0  # the correlated draft is often right
    stack.wait_no_sessions()
    far_stack.wait_no_sessions()


@pytest.mark.parametrize("mode", ["auto", "heuristic"])
def test_adaptive_policies_leave_greedy_output_unchanged(stack: Stack, far_stack: Stack, mode: str) -> None:
    for st in (stack, far_stack):
        for prompt in PROMPTS:
            off = st.generate(prompt=prompt, mode="off", max_new_tokens=48)
            r = st.generate(prompt=prompt, mode=mode, gamma=0, max_new_tokens=48)
            assert r["token_ids"] == off["token_ids"], (mode, prompt)
            assert r["stats"].policy == ("adaptive" if mode == "auto" else "heuristic")
    if mode == "heuristic":  # AUTO's γ follows measured costs: test_auto_speculates_where_it_pays
        trajectory = list(stack.generate(prompt=PROMPTS[1], mode=mode, max_new_tokens=48)["stats"].gamma_trajectory)
        assert len(set(trajectory)) > 1  # the policy actually varied γ



def test_metrics_count_a_known_generation(stack: Stack) -> None:
    port = stack.orchestrator.servicer.metrics_port
    assert port
    before = _scrape(port)
    r = stack.generate(prompt="metrics", mode="fixed", gamma=3, max_new_tokens=20)
    after = _scrape(port)
    s = r["stats"]

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    drafter = s.drafter
    assert drafter
    assert delta("specdec_spec_decode_num_draft_tokens_total", drafter=drafter) == s.draft_tokens
    assert delta("specdec_spec_decode_num_accepted_tokens_total", drafter=drafter) == s.accepted_tokens
    assert delta("specdec_spec_decode_num_drafts_total", drafter=drafter) == sum(1 for g in s.gamma_trajectory if g)
    per_pos = sum(delta("specdec_spec_decode_num_accepted_tokens_per_pos_total", drafter=drafter, position=str(i))
                  for i in range(3))
    assert per_pos == s.accepted_tokens
    assert delta("specdec_rounds_total") == s.rounds
    assert delta("specdec_generated_tokens_total") == 20
    assert delta("specdec_requests_total", finish_reason="FINISH_REASON_LENGTH", code="OK") == 1
    assert delta("specdec_round_seconds_count") == s.rounds
    assert after[("specdec_active_streams", ())] == 0
    assert delta("specdec_spec_decode_num_draft_tokens_stopped_total", drafter=drafter) == 0  # no early stop asked
    target_metrics = _scrape(stack.target.metrics_port)  # the target's own registry
    assert target_metrics[("specdec_target_active_sessions", ())] == 0
    assert target_metrics[("specdec_target_calls_total", (("method", "verify"),))] >= s.rounds


def test_confidence_early_stop_shortens_spans_not_output(stack: Stack) -> None:
    """A request's min_confidence makes the drafter end a span before any
    token it is less sure of (after the first): spans get shorter, the
    tokens the policy asked for but did not get are counted, and greedy
    output is still the target's."""
    port = stack.orchestrator.servicer.metrics_port
    off = stack.generate(prompt="confidence", mode="off", max_new_tokens=24)
    before = _scrape(port)
    r = stack.generate(prompt="confidence", mode="fixed", gamma=4, max_new_tokens=24, min_confidence=0.999)
    after = _scrape(port)
    s = r["stats"]
    assert r["token_ids"] == off["token_ids"]
    # the tiny random draft is never 99.9 % sure: one token per span
    assert set(s.gamma_trajectory) == {1}
    generated, asked = 1, 0  # the prefill commits the first token
    for g, acc in zip(s.gamma_trajectory, s.accepted_per_round):
        asked += min(4, 24 - generated - 1)
        generated += acc + 1
    key = ("specdec_spec_decode_num_draft_tokens_stopped_total", (("drafter", s.drafter),))
    assert after.get(key, 0.0) - before.get(key, 0.0) == asked - s.draft_tokens > 0
    full = stack.generate(prompt="confidence", mode="fixed", gamma=4, max_new_tokens=24)["stats"]
    assert max(full.gamma_trajectory) == 4


def test_partial_acceptance_keeps_both_caches_right(far_stack: Stack) -> None:
    """An uncorrelated draft is rejected mid-span often; both KV caches roll
    back each time and the output still equals target-only decoding."""
    off = far_stack.generate(prompt="kv cache", mode="off", max_new_tokens=64)
    spec = far_stack.generate(prompt="kv cache", mode="fixed", gamma=4, max_new_tokens=64)
    per_round = list(spec["stats"].accepted_per_round)
    gammas = list(spec["stats"].gamma_trajectory)
    assert any(0 < a < g for a, g in zip(per_round, gammas)) or any(a == 0 for a in per_round)
    assert spec["token_ids"] == off["token_ids"]


def test_stats_are_consistent(stack: Stack) -> None:
    r = stack.generate(prompt="stats", mode="fixed", gamma=4, max_new_tokens=30)
    s = r["stats"]
    assert s.generated_tokens == len(r["token_ids"]) == 30
    assert s.rounds == len(s.gamma_trajectory) == len(s.accepted_per_round)
    assert s.accepted_tokens == sum(s.accepted_per_round)
    assert s.draft_tokens == sum(s.gamma_trajectory)
    assert 0 <= s.acceptance_rate <= 1
    assert s.mean_accepted_length == pytest.approx((s.accepted_tokens + s.rounds) / s.rounds)
    assert s.time_to_first_token_ms > 0 and s.tokens_per_second > 0
    assert s.verify_ms > 0 and s.draft_ms > 0
    assert 0 < s.prefill_ms < s.verify_ms  # the prompt's prefill, reported apart from the rounds
    assert s.prefill_ms <= s.time_to_first_token_ms


# --------------------------------------------------------- sampled exactness
@pytest.fixture(scope="module")
def small_stack(tiny_models, onnx_cache_dir: Path) -> tuple[Stack, Path]:  # type: ignore[no-untyped-def]
    s = start_stack(tiny_models.small_target, tiny_models.small_draft, onnx_cache_dir)
    yield s, tiny_models.small_target
    s.close()


def exact_sequence_distribution(model_dir: Path, prompt: list[int], length: int, cfg: SamplingConfig) -> dict[tuple[int, ...], float]:
    """P(t_1..t_L | prompt) under plain sampling, by enumeration."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    vocab = model.config.vocab_size
    dist: dict[tuple[int, ...], float] = {}
    with torch.no_grad():
        for seq in itertools.product(range(vocab), repeat=length):
            ids = torch.tensor([prompt + list(seq[:-1])])
            logits = model(ids).logits[0, len(prompt) - 1 :]  # [L, V]
            probs = process_logits(logits, cfg).double()
            dist[seq] = float(np.prod([probs[i, t].item() for i, t in enumerate(seq)]))
    return dist


PIT_BINS = 20


def pit_counts(
    model_dir: Path, prompt: list[int], sequences: list[list[int]], cfg: SamplingConfig, seed: int = 0
) -> np.ndarray:
    """Randomized probability integral transform of every generated token
    under the target's exact conditional distribution at its position, in
    ``PIT_BINS`` equal bins. With tokens ranked by decreasing probability,
    u = P(tokens ranked before t) + V · p(t), V ~ U(0, 1): u is exactly
    uniform when t ~ p(· | prefix), and the u of one sequence are
    independent (Rosenblatt: each is uniform given everything before it), so
    every generated token of every request is one i.i.d. uniform sample. A
    sampler that favours the most likely tokens fills the first bins, one
    that flattens p the last ones. ``p`` is computed by one forward pass per
    sequence (float64 after ``process_logits``)."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    rng = np.random.default_rng(seed)
    counts = np.zeros(PIT_BINS)
    with torch.no_grad():
        for seq in sequences:
            ids = torch.tensor([prompt + seq[:-1]])
            logits = model(ids).logits[0, len(prompt) - 1 :]  # [L, V]
            probs = process_logits(logits, cfg).double().numpy()
            for j, t in enumerate(seq):
                p = probs[j]
                order = np.lexsort((np.arange(p.shape[0]), -p))  # decreasing p, ties by id
                rank = int(np.nonzero(order == t)[0][0])
                u = float(p[order[:rank]].sum()) + rng.random() * float(p[t])
                counts[min(PIT_BINS - 1, int(u * PIT_BINS))] += 1
    return counts


def sample_sequences(
    stack: Stack, prompt: list[int], n: int, length: int, cfg: SamplingConfig, threads: int = 4, **spec: object
) -> tuple[list[list[int]], list[pb.GenerationStats]]:
    """``n`` seeded generations of ``length`` tokens through the services,
    ``threads`` at a time (the target batches them)."""
    from concurrent.futures import ThreadPoolExecutor

    stub = stack.orch_stub()

    def one(seed: int) -> tuple[list[int], pb.GenerationStats]:
        r = stack.generate(stub, prompt_token_ids=prompt, max_new_tokens=length, temperature=cfg.temperature,
                           top_p=cfg.top_p, top_k=cfg.top_k, seed=seed, **spec)
        return r["token_ids"], r["stats"]

    with ThreadPoolExecutor(threads) as pool:
        out = list(pool.map(one, range(n)))
    return [o[0] for o in out], [o[1] for o in out]


def control_config(cfg: SamplingConfig) -> SamplingConfig:
    """The sampling settings of a negative control: with truncation (top-k,
    top-p), the same temperature without it (a sampler that dropped the
    truncation); without, a 25 % higher temperature (one applied twice or
    not at all)."""
    if cfg.top_k or cfg.top_p < 1.0:
        return SamplingConfig(temperature=cfg.temperature)
    return SamplingConfig(temperature=cfg.temperature * 1.25)


@pytest.mark.parametrize(
    "cfg",
    [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.8, top_k=3, top_p=0.9)],
    ids=["t1", "t0.8-k3-p0.9"],
)
@pytest.mark.statistical
def test_sampled_sequences_match_exact_target_distribution(small_stack: tuple[Stack, Path], cfg: SamplingConfig) -> None:
    """3-token continuations sampled through the services with γ=2 follow the
    exactly enumerated target distribution (216 outcomes; chi-square,
    p < 1e-4 fails; each request has its own seed, so the test is
    deterministic). Power: a shift of 0.028 of mass between two outcomes of
    probability 0.05 is detected with probability 0.99 (λ = n · 2Δ² / p = 78
    at ≈ 30 degrees of freedom after merging); tests/test_faults.py has the
    focused 36-outcome test. Negative control: the same counts must reject
    the distribution without the truncation, or at a 25 % higher temperature
    (``control_config``)."""
    stack, target_dir = small_stack
    prompt = [1, 2, 3]
    length, n = 3, 2500
    exact = exact_sequence_distribution(target_dir, prompt, length, cfg)
    outcomes = sorted(exact)
    index = {s: i for i, s in enumerate(outcomes)}
    counts = np.zeros(len(outcomes))
    stub = stack.orch_stub()
    drafted = accepted = 0
    for seed in range(n):
        r = stack.generate(
            stub, prompt_token_ids=prompt, max_new_tokens=length, temperature=cfg.temperature,
            top_p=cfg.top_p, top_k=cfg.top_k, seed=seed, mode="fixed", gamma=2,
        )
        counts[index[tuple(r["token_ids"])]] += 1
        drafted += r["stats"].draft_tokens
        accepted += r["stats"].accepted_tokens
    assert drafted > 0 and accepted > 0
    if cfg.top_k == 0:  # the untruncated case exercises rejections (recovered tokens) too
        assert accepted < drafted
    assert_matches(counts, np.array([exact[s] for s in outcomes]))
    # negative control: the same counts against the distribution of a sampler
    # that lost its truncation or its temperature must fail
    wrong = exact_sequence_distribution(target_dir, prompt, length, control_config(cfg))
    assert_detects(counts, np.array([wrong[s] for s in outcomes]))
    stack.wait_no_sessions()


# 400 requests × 50 tokens = 20,000 uniform samples in 20 bins: a shift of
# 0.0093 of probability mass between two bins is detected with probability
# 0.99 (chi-square at p < 1e-4, 19 degrees of freedom; detectable_shift).
PIT_REQUESTS, PIT_LENGTH = 400, 50


@pytest.mark.statistical
def test_run_ahead_sampling_has_the_targets_distribution_at_every_position(stack: Stack, tiny_models) -> None:  # type: ignore[no-untyped-def]
    """Long sampled generations with run-ahead on (the draft drafts past each
    span while the target verifies it; chains that survive a round are
    verified later; the token at the bonus position is post-verified): every
    generated token, at every position, follows the target's exact
    conditional distribution (randomized PIT, ``pit_counts``). Power: a shift
    of 0.0093 of mass between two of the 20 PIT bins (the most likely tokens
    fill the first) is detected with probability 0.99. The run must have
    post-verified tokens, kept run-ahead chains and rejections. Negative
    control: the same tokens scored against the sampler at a 25 % higher
    temperature must fail."""
    cfg = SamplingConfig(temperature=1.0)
    prompt = [5, 6, 7]
    seqs, stats = sample_sequences(stack, prompt, PIT_REQUESTS, PIT_LENGTH, cfg, mode="fixed", gamma=3,
                                   draft_mode="run-ahead")
    assert all(s.draft_mode == "run-ahead" and s.draft_failures == 0 for s in stats)
    assert sum(s.post_verified for s in stats) > 100  # the post-verify case is exercised
    assert sum(s.draft_hidden_ms for s in stats) > 0  # run-ahead tokens were verified
    assert 0 < sum(s.accepted_tokens for s in stats) < sum(s.draft_tokens for s in stats)
    counts = pit_counts(tiny_models.target, prompt, seqs, cfg)
    assert_matches(counts, np.full(PIT_BINS, 1 / PIT_BINS))
    assert_detects(pit_counts(tiny_models.target, prompt, seqs, control_config(cfg)), np.full(PIT_BINS, 1 / PIT_BINS))
    stack.wait_no_sessions()


def test_seeded_speculative_sampling_is_reproducible(stack: Stack) -> None:
    a = stack.generate(prompt="seed", temperature=1.0, seed=7, max_new_tokens=20)
    b = stack.generate(prompt="seed", temperature=1.0, seed=7, max_new_tokens=20)
    assert a["token_ids"] == b["token_ids"]


# ------------------------------------------------------------- concurrency
def test_concurrent_requests_do_not_interfere(stack: Stack) -> None:
    cases = [(p, mode, g) for p in PROMPTS for mode, g in (("off", 0), ("fixed", 2), ("fixed", 5))]
    expected = {p: stack.generate(prompt=p, mode="off", max_new_tokens=24)["token_ids"] for p in PROMPTS}
    sampled_ref = stack.generate(prompt="zz", temperature=1.0, seed=3, max_new_tokens=24)["token_ids"]
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def worker(i: int, p: str, mode: str, g: int) -> None:
        try:
            results[i] = stack.generate(prompt=p, mode=mode, gamma=g or 4, max_new_tokens=24)["token_ids"]
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    def sampled_worker() -> None:
        try:
            results[-1] = stack.generate(prompt="zz", temperature=1.0, seed=3, max_new_tokens=24)["token_ids"]
        except BaseException as e:  # pragma: no cover
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i, *c)) for i, c in enumerate(cases)]
    threads.append(threading.Thread(target=sampled_worker))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i, (p, _, _) in enumerate(cases):
        assert results[i] == expected[p]
    assert results[-1] == sampled_ref  # a seeded request is unaffected by its neighbours
    stack.wait_no_sessions()


# ---------------------------------------------------------------- failures
@pytest.mark.parametrize("draft_mode", ["unary", "run-ahead"])
def test_draft_killed_mid_request_finishes_with_same_output(tiny_models, onnx_cache_dir: Path, draft_mode: str) -> None:  # type: ignore[no-untyped-def]
    """The draft process is killed in the middle of a request (over unary
    calls, or mid-stream with run-ahead): the request finishes target-only
    with the same tokens."""
    st = start_stack(tiny_models.target, tiny_models.draft, onnx_cache_dir, draft_subprocess=True,
                     orchestrator_overrides={"draft_timeout_s": 2.0})
    try:
        off = st.generate(prompt="failover", mode="off", max_new_tokens=60)
        stream = st.orch_stub().Generate(
            make_request(prompt="failover", mode="fixed", gamma=2, max_new_tokens=60, draft_mode=draft_mode),
            timeout=120,
        )
        chunks = [next(stream)]  # first token: the draft is in use
        chunks.append(next(stream))
        assert st.draft_proc is not None
        kill(st.draft_proc)
        chunks += list(stream)
        ids = [t for c in chunks for t in c.token_ids]
        assert ids == off["token_ids"]
        stats = chunks[-1].stats
        assert stats.draft_failures >= 1
        assert stats.draft_tokens > 0  # speculation ran before the kill
        assert st.target_sessions() == 0 or st.wait_no_sessions() is None
    finally:
        st.close()


def test_an_unknown_drafter_is_refused_while_the_draft_is_down(tiny_models, onnx_cache_dir: Path) -> None:  # type: ignore[no-untyped-def]
    """With the draft process killed, a request naming a drafter the draft
    never hosted still gets INVALID_ARGUMENT (served target-only, a typo would
    look valid exactly while the draft is down), in every draft mode; the
    hosted drafter's name and the default are served target-only, unchanged."""
    st = start_stack(tiny_models.target, tiny_models.draft, onnx_cache_dir, draft_subprocess=True,
                     orchestrator_overrides={"draft_timeout_s": 2.0})
    try:
        off = st.generate(prompt="draft down", mode="off", max_new_tokens=12)["token_ids"]
        hosted = st.orchestrator.servicer.default_drafter
        assert hosted
        assert st.draft_proc is not None
        kill(st.draft_proc)
        for draft_mode in ("unary", "stream", "run-ahead"):
            with pytest.raises(grpc.RpcError) as e:
                st.generate(prompt="draft down", mode="auto", drafter="no-such-drafter", draft_mode=draft_mode,
                            max_new_tokens=12, timeout=60)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (draft_mode, e.value.details())
            assert "no-such-drafter" in (e.value.details() or "")
            for name in ("", hosted):
                r = st.generate(prompt="draft down", mode="fixed", drafter=name, draft_mode=draft_mode,
                                max_new_tokens=12, timeout=60)
                assert r["token_ids"] == off and r["stats"].draft_tokens == 0
        st.wait_no_sessions()
    finally:
        st.close()


def test_target_session_lost_is_rebuilt(stack: Stack) -> None:
    """Evicting every target session mid-stream: the orchestrator rebuilds
    from its tokens and the output is unchanged."""
    off = stack.generate(prompt="rebuild me", mode="off", max_new_tokens=40)
    stream = stack.orch_stub().Generate(
        make_request(
            prompt="rebuild me", mode="fixed", gamma=3, max_new_tokens=40),
        timeout=120,
    )
    chunks = [next(stream), next(stream)]
    engine = stack.target.engine
    stack.loop.run(stack.target.worker.run(lambda: [engine.release(s) for s in engine.kv.session_ids()]))
    chunks += list(stream)
    assert [t for c in chunks for t in c.token_ids] == off["token_ids"]
    assert chunks[-1].stats.target_rebuilds >= 1
    stack.wait_no_sessions()


def test_client_cancel_releases_sessions(stack: Stack) -> None:
    req = make_request(prompt="cancel", max_new_tokens=400)
    call = stack.orch_stub().Generate(req, timeout=120)
    next(call)
    assert stack.target_sessions() >= 1
    call.cancel()
    stack.wait_no_sessions()


def test_cancelled_streams_are_logged_without_touching_the_finished_call(stack: Stack) -> None:
    """Many Generate calls cancelled after their first chunk, in a row: every
    session is released and the server still answers. (The access log used to
    read a cancelled call's peer and auth context after grpc had finished the
    call; that crashed the test process with a segfault in about one of three
    runs of this file. The identity is now read when the call starts. The
    race is timing-dependent: this test did not reproduce it on demand.)"""
    for i in range(12):
        call = stack.orch_stub().Generate(make_request(prompt=f"cancel {i}", max_new_tokens=400), timeout=120)
        next(call)
        call.cancel()
    stack.wait_no_sessions()
    out = stack.generate(prompt="after the cancels", max_new_tokens=4, mode="off")
    assert len(out["token_ids"]) == 4


def test_deadline_exceeded_releases_sessions(stack: Stack) -> None:
    with pytest.raises(grpc.RpcError) as e:
        stack.generate(prompt="deadline", max_new_tokens=2000, timeout=0.3)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    stack.wait_no_sessions()


def test_stop_strings_and_eos(stack: Stack) -> None:
    full = stack.generate(prompt="stop test", mode="off", max_new_tokens=40)["text"]
    assert len(full) > 6
    stop = full[5:7]
    r = stack.generate(prompt="stop test", max_new_tokens=40, stop=[stop])
    assert r["finish_reason"] == pb.FINISH_REASON_STOP
    assert r["text"] == full[: full.index(stop)]
    assert stop not in r["text"]
    # EOS (id 0) ends generation unless ignore_eos; forcing it via a prompt of
    # ids is model-dependent, so check the finish reason is one of the two.
    r = stack.generate(prompt="eos", max_new_tokens=40, ignore_eos=False)
    assert r["finish_reason"] in (pb.FINISH_REASON_EOS, pb.FINISH_REASON_LENGTH)
    if r["finish_reason"] == pb.FINISH_REASON_EOS:
        assert r["token_ids"][-1] == 0


@pytest.mark.parametrize("mode,padding", [("off", 0), ("fixed", 0), ("fixed", 4)], ids=["off", "fixed", "long-stops"])
def test_a_stop_string_ends_token_ids_and_counts_at_the_token_that_completes_it(
    stack: Stack, tiny_models, mode: str, padding: int  # type: ignore[no-untyped-def]
) -> None:
    """With a stop string, token_ids (and stats.generated_tokens) end at the
    token whose text completed the stop string: the tokens a speculative
    round produced past it are not returned, so the ids decode to the text
    plus the stop string, as in vLLM. The text ends before the stop.
    ``long-stops`` adds four 256-character stops (the matcher is then built
    off the event loop)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_models.target))
    full = stack.generate(prompt="stop test", mode="off", max_new_tokens=40)
    text = full["text"]
    stop = text[9:12]
    cut = text.index(stop)
    n = next(k for k in range(1, 41) if stop in tok.decode(full["token_ids"][:k], skip_special_tokens=True))
    stops = [stop, "never-seen"] + ["\u2603" * 256] * padding
    r = stack.generate(prompt="stop test", mode=mode, gamma=8, max_new_tokens=40, stop=stops)
    assert r["finish_reason"] == pb.FINISH_REASON_STOP
    assert r["text"] == text[:cut]
    assert r["token_ids"] == full["token_ids"][:n]
    assert r["stats"].generated_tokens == n
    assert tok.decode(r["token_ids"], skip_special_tokens=True) == text[: cut + len(stop)]


def test_chat_messages_use_the_chat_template(stack: Stack) -> None:
    r = stack.generate(messages=[("user", "hi there")], mode="off", max_new_tokens=8)
    assert len(r["token_ids"]) == 8
    assert r["stats"].prompt_tokens > len("hi there")


# Bad input (statuses, no leaks, servers still healthy): tests/test_bad_input_corpus.py


def test_health_and_reflection(stack: Stack) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    for port, name in ((stack.orchestrator.port, "specdec.v1.Orchestrator"),
                       (stack.target.port, "specdec.v1.Target"),
                       (stack.draft.port, "specdec.v1.Draft")):
        ch = stack.channel(f"127.0.0.1:{port}")
        h = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=name))
        assert h.status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        resp = next(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
        names = {s.name for s in resp.list_services_response.service}
        assert name in names and "grpc.health.v1.Health" in names
