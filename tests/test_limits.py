"""Honest finish reasons and request limits (tiny model, context 512 tokens,
one character per token): reaching the model's context is its own finish
reason, the prompt size limit follows the context, chat roles are checked."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from specdec.v1 import orchestrator_pb2 as pb
from tests.stack import Stack, start_stack


@pytest.fixture(scope="module")
def stack(tiny_models, onnx_cache_dir: Path) -> Stack:  # type: ignore[no-untyped-def]
    st = start_stack(tiny_models.target, tiny_models.draft, onnx_cache_dir)
    yield st
    st.close()


def test_reaching_the_context_is_its_own_finish_reason(stack: Stack) -> None:
    ctx = stack.orchestrator.servicer.limits.max_context
    prompt = "ab" * 240  # 480 tokens of a 512-token context
    r = stack.generate(prompt=prompt, mode="fixed", gamma=4, max_new_tokens=100)
    assert r["finish_reason"] == pb.FINISH_REASON_CONTEXT_LENGTH
    assert len(r["token_ids"]) == ctx - 480 - 1
    short = stack.generate(prompt=prompt, mode="off", max_new_tokens=5)
    assert short["finish_reason"] == pb.FINISH_REASON_LENGTH  # max_new_tokens fits: the ordinary reason
    with pytest.raises(grpc.RpcError) as e:
        stack.generate(prompt="a" * (ctx - 1), max_new_tokens=5)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "context" in (e.value.details() or "")


def test_the_prompt_size_limit_follows_the_context(stack: Stack) -> None:
    servicer = stack.orchestrator.servicer
    limit = servicer.max_prompt_chars
    assert limit == servicer.cfg.max_prompt_chars_per_context_token * servicer.limits.max_context < servicer.cfg.max_prompt_chars
    for fields in ({"prompt": "a" * (limit + 1)}, {"messages": [("user", "a" * (limit + 1))]}):
        with pytest.raises(grpc.RpcError) as e:
            stack.generate(max_new_tokens=2, **fields)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"exceed" in (e.value.details() or "") and str(limit) in (e.value.details() or "")


@pytest.mark.parametrize("role", ["system", "user", "assistant", "tool"])
def test_known_chat_roles_are_accepted(stack: Stack, role: str) -> None:
    msgs = [("user", "hi")] if role != "user" else []
    r = stack.generate(messages=msgs + [(role, "hello")], max_new_tokens=2, mode="off")
    assert len(r["token_ids"]) == 2


@pytest.mark.parametrize("role", ["admin", "User", "function\x00", "x" * 100])
def test_unknown_chat_roles_are_invalid_argument(stack: Stack, role: str) -> None:
    with pytest.raises(grpc.RpcError) as e:
        stack.generate(messages=[(role, "hello")], max_new_tokens=2)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "role" in (e.value.details() or "")
    stack.wait_no_sessions()
