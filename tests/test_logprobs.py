"""Logprobs: the target's log-probability of every emitted token and its
top-n, from the distribution the token was drawn from (after temperature,
top-k and top-p; the raw logits for greedy), the same whether the token came
from a plain decoding step or from verifying a drafted span. Through the
engine and through real services on loopback with tiny real models."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdec.sampling import SamplingConfig, processed_logits
from specdec.v1 import orchestrator_pb2 as pb
from tests.stack import Stack, start_stack

PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def stack(tiny_models, onnx_cache_dir: Path) -> Stack:  # type: ignore[no-untyped-def]
    s = start_stack(tiny_models.target, tiny_models.draft, onnx_cache_dir)
    yield s
    s.close()


def reference(model_dir: Path, prompt_ids: list[int], generated: list[int], cfg: SamplingConfig) -> torch.Tensor:
    """log p(· | prefix) at every generated position, from one forward pass
    of the target over the whole sequence: [len(generated), V]."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + generated])).logits[0, len(prompt_ids) - 1 : -1]
    return torch.log_softmax(processed_logits(logits, cfg), dim=-1)


def flat(result: dict) -> list[pb.TokenLogprobs]:  # type: ignore[type-arg]
    return [lp for c in result["chunks"] for lp in c.logprobs]


@pytest.mark.parametrize("mode,gamma,draft_mode", [("fixed", 4, "unary"), ("auto", 0, "unary"), ("fixed", 3, "run-ahead")])
def test_greedy_logprobs_are_the_same_in_off_and_speculative_modes(
    stack: Stack, tiny_models, mode: str, gamma: int, draft_mode: str,  # type: ignore[no-untyped-def]
) -> None:
    """Greedy: the tokens and their logprobs (log-softmax of the raw logits)
    and top-5 are the target's own, whichever mode verified them; and they
    equal a plain forward pass of the target over the sequence."""
    off = stack.generate(prompt=PROMPT, mode="off", max_new_tokens=30, top_logprobs=5)
    spec = stack.generate(prompt=PROMPT, mode=mode, gamma=gamma, max_new_tokens=30, top_logprobs=5,
                          draft_mode=draft_mode)
    if mode == "fixed":  # tokens came from verified spans (AUTO's γ follows measured costs: it may draft little)
        assert spec["stats"].accepted_tokens > 0
    assert spec["token_ids"] == off["token_ids"]
    a, b = flat(off), flat(spec)
    assert [x.chosen.token_id for x in a] == off["token_ids"] and len(b) == len(a) == 30
    for x, y in zip(a, b):
        assert y.chosen.logprob == pytest.approx(x.chosen.logprob, abs=1e-5)
        assert [t.token_id for t in y.top] == [t.token_id for t in x.top]
        assert [t.logprob for t in y.top] == pytest.approx([t.logprob for t in x.top], abs=1e-5)
    prompt_ids = list(AutoTokenizer.from_pretrained(str(tiny_models.target))(PROMPT)["input_ids"])
    ref = reference(tiny_models.target, prompt_ids, off["token_ids"], SamplingConfig())
    for i, x in enumerate(b):
        assert x.chosen.logprob == pytest.approx(float(ref[i, x.chosen.token_id]), abs=1e-4)
        assert x.top[0].token_id == x.chosen.token_id  # greedy: the argmax
        top = torch.topk(ref[i], 5)
        assert [t.token_id for t in x.top] == top.indices.tolist()
    stack.wait_no_sessions()


@pytest.mark.parametrize("cfg", [SamplingConfig(temperature=0.8, top_k=5, seed=3),
                                 SamplingConfig(temperature=1.2, top_p=0.7, seed=4)], ids=["t0.8-k5", "t1.2-p0.7"])
def test_sampled_logprobs_are_after_temperature_and_truncation(stack: Stack, tiny_models, cfg: SamplingConfig) -> None:  # type: ignore[no-untyped-def]
    """Sampled through speculation: each token's logprob is its log-probability
    under the target's processed distribution (temperature, top-k, top-p),
    as a forward pass of the target over the sequence gives it; the top list
    holds only tokens inside the truncation."""
    r = stack.generate(prompt=PROMPT, mode="fixed", gamma=3, max_new_tokens=30, temperature=cfg.temperature,
                       top_k=cfg.top_k, top_p=cfg.top_p if cfg.top_p < 1 else 0.0, seed=cfg.seed, top_logprobs=20)
    assert 0 < r["stats"].accepted_tokens < r["stats"].draft_tokens
    lps = flat(r)
    assert [x.chosen.token_id for x in lps] == r["token_ids"]
    prompt_ids = list(AutoTokenizer.from_pretrained(str(tiny_models.target))(PROMPT)["input_ids"])
    ref = reference(tiny_models.target, prompt_ids, r["token_ids"], cfg)
    for i, x in enumerate(lps):
        assert x.chosen.logprob == pytest.approx(float(ref[i, x.chosen.token_id]), abs=1e-4)
        support = int(torch.isfinite(ref[i]).sum())
        assert len(x.top) == min(20, support)
        assert (cfg.top_k == 0 or support <= cfg.top_k) and support < ref.shape[1]  # truncated
        assert x.chosen.token_id in [t.token_id for t in x.top]
        assert sum(torch.tensor([t.logprob for t in x.top]).exp()) == pytest.approx(
            float(ref[i].exp()[torch.isfinite(ref[i])].topk(min(20, support)).values.sum()), abs=1e-4)


def test_logprobs_carry_token_bytes_and_are_off_by_default(stack: Stack, tiny_models) -> None:  # type: ignore[no-untyped-def]
    tok = AutoTokenizer.from_pretrained(str(tiny_models.target))
    r = stack.generate(prompt=PROMPT, mode="fixed", max_new_tokens=8, top_logprobs=2)
    for x in flat(r):
        assert x.chosen.token == tok.decode([x.chosen.token_id]).encode()
        assert all(t.token == tok.decode([t.token_id]).encode() for t in x.top)
    assert b"".join(x.chosen.token for x in flat(r)).decode() == r["text"]
    plain = stack.generate(prompt=PROMPT, mode="fixed", max_new_tokens=8)
    assert not flat(plain)
    zero = stack.generate(prompt=PROMPT, mode="fixed", max_new_tokens=8, top_logprobs=0)
    assert len(flat(zero)) == 8 and all(not x.top for x in flat(zero))


@pytest.mark.parametrize("fields,message", [({"top_logprobs": 21}, "top_logprobs must be in"),
                                            ({"top_logprobs": 3, "return_logprobs": False}, "needs return_logprobs")])
def test_bad_logprobs_requests_are_invalid_argument(stack: Stack, fields: dict, message: str) -> None:  # type: ignore[type-arg]
    from tests.stack import make_request

    req = make_request(prompt=PROMPT)
    for k, v in fields.items():
        setattr(req, k, v)
    with pytest.raises(grpc.RpcError) as e:
        list(stack.orch_stub().Generate(req, timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in e.value.details()
    stack.assert_clean()
