"""``specdec.v1.GenerateResponse`` chunks -> OpenAI response bodies and
stream chunks, and gRPC status codes -> HTTP statuses. Plain Python, no HTTP.

Status mapping (what OpenAI's clients retry: 408, 409, 429 and 5xx):
INVALID_ARGUMENT, OUT_OF_RANGE, FAILED_PRECONDITION -> 400;
UNAUTHENTICATED -> 401; PERMISSION_DENIED -> 403; NOT_FOUND -> 404;
RESOURCE_EXHAUSTED -> 429; DEADLINE_EXCEEDED -> 504; UNAVAILABLE and
CANCELLED -> 503; anything else -> 500.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Sequence

import grpc

from gateway.requests import ApiError, Parsed
from specdec.v1 import common_pb2
from specdec.v1 import orchestrator_pb2 as pb

HTTP_STATUS: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.CANCELLED: (503, "service_unavailable_error"),
}

FINISH = {pb.FINISH_REASON_EOS: "stop", pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length",
          pb.FINISH_REASON_CONTEXT_LENGTH: "length", pb.FINISH_REASON_GRAMMAR_DEAD_END: "stop"}
# why a "stop" was not EOS or a stop string (vLLM's choice field of that name)
STOP_REASON = {pb.FINISH_REASON_GRAMMAR_DEAD_END: "grammar_dead_end"}


def api_error(code: grpc.StatusCode, details: str) -> ApiError:
    """The HTTP error a gRPC status becomes (module doc)."""
    status, type_ = HTTP_STATUS.get(code, (500, "server_error"))
    return ApiError(status, details or code.name, None, type_, code.name.lower())


def _text(b: bytes) -> str:
    return b.decode("utf-8", errors="replace")


def chat_logprobs(lps: Sequence[common_pb2.TokenLogprobs]) -> dict[str, Any]:
    def entry(t: common_pb2.TokenLogprob) -> dict[str, Any]:
        return {"token": _text(t.token), "logprob": t.logprob, "bytes": list(t.token)}

    return {"content": [{**entry(lp.chosen), "top_logprobs": [entry(t) for t in lp.top]} for lp in lps],
            "refusal": None}


def completion_logprobs(lps: Sequence[common_pb2.TokenLogprobs], offset: int) -> dict[str, Any]:
    """The legacy completions shape; ``offset``: characters of text before these tokens."""
    tokens = [_text(lp.chosen.token) for lp in lps]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": [lp.chosen.logprob for lp in lps],
            "top_logprobs": [{_text(t.token): t.logprob for t in lp.top} for lp in lps], "text_offset": offsets}


def usage(stats: pb.GenerationStats) -> dict[str, int]:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.generated_tokens,
            "total_tokens": stats.prompt_tokens + stats.generated_tokens}


def speculation(stats: pb.GenerationStats) -> dict[str, Any]:
    """The extension field ``speculation`` on final responses."""
    return {"policy": stats.policy, "drafter": stats.drafter, "draft_tokens": stats.draft_tokens,
            "accepted_tokens": stats.accepted_tokens, "acceptance_rate": stats.acceptance_rate,
            "mean_accepted_length": stats.mean_accepted_length, "tokens_per_second": stats.tokens_per_second}


@dataclass
class Formatter:
    """Builds one request's response: :meth:`chunk` per streamed gRPC chunk
    (stream chunks), :meth:`complete` from all of them (the JSON body)."""

    parsed: Parsed
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    text_chars: int = 0  # completions logprobs: text offset so far

    def __post_init__(self) -> None:
        self.id = self.id or ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex

    @property
    def chat(self) -> bool:
        return self.parsed.kind == "chat"

    def _envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        obj = ("chat.completion.chunk" if self.parsed.stream else "chat.completion") if self.chat else "text_completion"
        out: dict[str, Any] = {"id": self.id, "object": obj, "created": self.created, "model": self.parsed.model,
                               "choices": choices}
        if self.chat:
            out["system_fingerprint"] = None
        return out

    def _logprobs(self, lps: Sequence[common_pb2.TokenLogprobs]) -> dict[str, Any] | None:
        if not self.parsed.logprobs:
            return None
        if self.chat:
            return chat_logprobs(lps)
        out = completion_logprobs(lps, self.text_chars)
        self.text_chars += sum(len(t) for t in out["tokens"])
        return out

    def first(self) -> list[dict[str, Any]]:
        """Stream chunks sent before any token (chat: the assistant role)."""
        if not self.chat:
            return []
        return [self._stream_chunk({"role": "assistant", "content": ""}, None, None)]

    def _stream_chunk(self, delta: dict[str, Any] | str, logprobs: Any, finish: str | None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "logprobs": logprobs, "finish_reason": finish}
        if self.chat:
            choice["delta"] = delta
        else:
            choice["text"] = delta
        out = self._envelope([choice])
        if self.parsed.include_usage:
            out["usage"] = None
        return out

    def chunk(self, msg: pb.GenerateResponse) -> list[dict[str, Any]]:
        """The stream chunks of one gRPC chunk (the last one adds the finish
        and, with include_usage, a usage chunk)."""
        out = []
        if msg.text or msg.token_ids:
            delta: dict[str, Any] | str = {"content": msg.text} if self.chat else msg.text
            out.append(self._stream_chunk(delta, self._logprobs(msg.logprobs), None))
        if msg.finish_reason:
            final = self._stream_chunk({} if self.chat else "", None, FINISH.get(msg.finish_reason, "stop"))
            if msg.finish_reason in STOP_REASON:
                final["choices"][0]["stop_reason"] = STOP_REASON[msg.finish_reason]
            final.setdefault("speculation", speculation(msg.stats))
            out.append(final)
            if self.parsed.include_usage:
                out.append({**self._envelope([]), "usage": usage(msg.stats)})
        return out

    def complete(self, msgs: Sequence[pb.GenerateResponse]) -> dict[str, Any]:
        """The non-streamed response body from all of a request's gRPC chunks."""
        text = "".join(m.text for m in msgs)
        lps = [lp for m in msgs for lp in m.logprobs]
        last = msgs[-1]
        choice: dict[str, Any] = {"index": 0, "logprobs": self._logprobs(lps),
                                  "finish_reason": FINISH.get(last.finish_reason, "stop")}
        if last.finish_reason in STOP_REASON:
            choice["stop_reason"] = STOP_REASON[last.finish_reason]
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text, "refusal": None}
        else:
            choice["text"] = text
        return {**self._envelope([choice]), "usage": usage(last.stats), "speculation": speculation(last.stats)}
