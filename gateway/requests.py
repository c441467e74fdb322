"""OpenAI request bodies -> ``specdec.v1.GenerateRequest``: plain Python, no
HTTP. Every parameter the gateway cannot honour exactly is refused with 400
naming it (OpenAI's error shape, :class:`ApiError`); none is ignored.

Supported: ``model``, ``messages`` (chat) / ``prompt`` (completions),
``max_tokens`` / ``max_completion_tokens``, ``temperature`` (default 1, as
OpenAI's), ``top_p``, ``seed``, ``stop``, ``logprobs`` / ``top_logprobs``,
``response_format`` (``text``, ``json_object``, ``json_schema``), ``user``,
``stream``, ``stream_options.include_usage``; parameters at their neutral value (``n`` =
1, penalties 0, an empty ``logit_bias``, ``echo`` false, ``best_of`` 1, no
tools) are accepted. Extensions: ``speculation`` (``mode``,
``num_draft_tokens``, ``drafter``, ``draft_mode``, ``min_confidence``),
``structured_output`` (``regex``, ``lark`` or ``json_schema``), ``top_k`` and
``ignore_eos``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Callable

from specdec.v1 import orchestrator_pb2 as pb


class ApiError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, param: str | None = None, type_: str = "invalid_request_error",
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(param: str, message: str) -> ApiError:
    return ApiError(400, message, param)


MODES = {"auto": pb.SPECULATION_MODE_AUTO, "off": pb.SPECULATION_MODE_OFF, "fixed": pb.SPECULATION_MODE_FIXED,
         "heuristic": pb.SPECULATION_MODE_HEURISTIC}
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
# parameters accepted only at the value that changes nothing (anything else: 400)
NEUTRAL: dict[str, Callable[[Any], bool]] = {
    "n": lambda v: v == 1,
    "presence_penalty": lambda v: v == 0,
    "frequency_penalty": lambda v: v == 0,
    "logit_bias": lambda v: v == {},
    "tools": lambda v: v == [],
    "tool_choice": lambda v: v == "none",
    "functions": lambda v: v == [],
    "function_call": lambda v: v == "none",
    "parallel_tool_calls": lambda v: False,
    "store": lambda v: v is False,
    "echo": lambda v: v is False,
    "best_of": lambda v: v == 1,
    "suffix": lambda v: v == "",
    "modalities": lambda v: v == ["text"],
}
COMMON = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "logprobs", "user", "stream",
          "stream_options", "response_format", "structured_output", "speculation", "top_k", "ignore_eos", "n",
          "presence_penalty",
          "frequency_penalty", "logit_bias"}
CHAT_KEYS = COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "functions",
                      "function_call", "parallel_tool_calls", "store", "modalities"}
COMPLETION_KEYS = COMMON | {"prompt", "echo", "best_of", "suffix"}


@dataclass
class Parsed:
    """One request: the gRPC request and what the response needs."""

    kind: str  # "chat" | "completion"
    request: pb.GenerateRequest
    model: str
    stream: bool
    include_usage: bool
    logprobs: bool
    user: str = ""


def _number(body: dict[str, Any], key: str, lo: float, hi: float, *, integer: bool = False,
            lo_open: bool = False) -> float | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        raise bad(key, f"'{key}' must be {'an integer' if integer else 'a number'}, got {v!r}")
    if not math.isfinite(v) or v > hi or v < lo or (lo_open and v == lo):
        interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
        raise bad(key, f"'{key}' must be in {interval}, got {v!r}")
    return v


def _bool(body: dict[str, Any], key: str) -> bool:
    v = body.get(key)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise bad(key, f"'{key}' must be a boolean, got {v!r}")
    return v


def _string(v: Any, key: str) -> str:
    if not isinstance(v, str):
        raise bad(key, f"'{key}' must be a string, got {type(v).__name__}")
    return v


def _check_keys(body: dict[str, Any], allowed: set[str]) -> None:
    for key in body:
        if key not in allowed:
            raise bad(key, f"Unrecognized request argument supplied: {key}")
    for key, neutral in NEUTRAL.items():
        if key in allowed and body.get(key) is not None and not neutral(body[key]):
            raise bad(key, f"'{key}' = {body[key]!r} is not supported by this server (only the neutral value is)")


def _content(v: Any, where: str) -> str:
    """A message's content: a string, or a list of text parts."""
    if isinstance(v, str):
        return v
    if isinstance(v, list):
        parts = []
        for i, part in enumerate(v):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad(f"{where}[{i}]", "only text content parts ({\"type\": \"text\", \"text\": ...}) are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise bad(where, "message content must be a string or a list of text parts")


def _messages(body: dict[str, Any], req: pb.GenerateRequest) -> None:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "'messages' must be a non-empty list")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}]", "each message must be an object with 'role' and 'content'")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise bad(f"messages[{i}].role", f"role {role!r} is not supported (one of {', '.join(CHAT_ROLES)})")
        extra = {k for k in m if k not in ("role", "content") and m[k] is not None}
        if extra:
            raise bad(f"messages[{i}].{sorted(extra)[0]}", f"message field {sorted(extra)[0]!r} is not supported")
        req.messages.append(pb.ChatMessage(role=CHAT_ROLES[role], content=_content(m.get("content"), f"messages[{i}].content")))


def _prompt(body: dict[str, Any], req: pb.GenerateRequest) -> None:
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # one prompt in a list
    if isinstance(p, str):
        req.prompt = p
    elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        req.prompt_token_ids.extend(p)
    else:
        raise bad("prompt", "'prompt' must be a string, a list of token ids, or a list holding one of them "
                            "(several prompts per request are not supported)")


def _speculation(v: Any, req: pb.GenerateRequest) -> None:
    if v is None:
        return
    if not isinstance(v, dict):
        raise bad("speculation", "'speculation' must be an object")
    for key in v:
        if key not in ("mode", "num_draft_tokens", "drafter", "draft_mode", "min_confidence"):
            raise bad(f"speculation.{key}", f"unknown speculation field {key!r}")
    s = req.speculation
    mode = v.get("mode")
    if mode is not None:
        if mode not in MODES:
            raise bad("speculation.mode", f"speculation.mode must be one of {', '.join(MODES)}, got {mode!r}")
        s.mode = MODES[mode]
    gamma = _number(v, "num_draft_tokens", 0, 1 << 16, integer=True)
    s.num_draft_tokens = int(gamma or 0)
    s.drafter = _string(v.get("drafter") or "", "speculation.drafter")
    s.draft_mode = _string(v.get("draft_mode") or "", "speculation.draft_mode")
    s.min_confidence = float(_number(v, "min_confidence", 0.0, 1.0) or 0.0)


def _stop(v: Any, req: pb.GenerateRequest) -> None:
    if v is None:
        return
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad("stop", "'stop' must be a string or a list of strings")
    req.stop.extend(stops)


def parse(kind: str, body: Any, models: list[str]) -> Parsed:
    """Validates an OpenAI chat (``kind`` "chat") or completions request body
    (already decoded from JSON); raises :class:`ApiError`."""
    if not isinstance(body, dict):
        raise bad("body", "the request body must be a JSON object")
    _check_keys(body, CHAT_KEYS if kind == "chat" else COMPLETION_KEYS)
    model = body.get("model") or models[0]
    if model not in models:
        raise ApiError(404, f"The model `{model}` does not exist.", "model", "not_found_error", "model_not_found")
    req = pb.GenerateRequest()
    if kind == "chat":
        _messages(body, req)
        if body.get("max_tokens") is not None and body.get("max_completion_tokens") is not None:
            raise bad("max_tokens", "set one of 'max_tokens' and 'max_completion_tokens'")
        max_new = _number(body, "max_completion_tokens", 1, 1 << 31, integer=True)
    else:
        _prompt(body, req)
        max_new = None
    if max_new is None:
        max_new = _number(body, "max_tokens", 1, 1 << 31, integer=True)
    req.max_new_tokens = int(max_new or 0)
    temperature = _number(body, "temperature", 0.0, 2.0)
    req.sampling.temperature = 1.0 if temperature is None else float(temperature)
    req.sampling.top_p = float(_number(body, "top_p", 0.0, 1.0, lo_open=True) or 0.0)
    req.sampling.top_k = int(_number(body, "top_k", 0, 1 << 20, integer=True) or 0)
    seed = _number(body, "seed", -(1 << 63), (1 << 64) - 1, integer=True)
    if seed is not None:
        req.sampling.seed = int(seed) % (1 << 64)
    _stop(body.get("stop"), req)
    req.ignore_eos = _bool(body, "ignore_eos")
    _speculation(body.get("speculation"), req)
    if kind == "chat":
        logprobs = _bool(body, "logprobs")
        top = _number(body, "top_logprobs", 0, 20, integer=True)
        if top is not None and not logprobs:
            raise bad("top_logprobs", "'top_logprobs' needs 'logprobs': true")
    else:
        top = _number(body, "logprobs", 0, 20, integer=True)  # the legacy API: the number of top tokens
        logprobs = top is not None
    req.return_logprobs, req.top_logprobs = logprobs, int(top or 0)
    _response_format(body.get("response_format"), body.get("structured_output"), req)
    stream = _bool(body, "stream")
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not stream:
            raise bad("stream_options", "'stream_options' is only allowed when 'stream' is true")
        if not isinstance(opts, dict) or set(opts) - {"include_usage"}:
            raise bad("stream_options", "'stream_options' supports only 'include_usage'")
        include_usage = _bool(opts, "include_usage")
    user = body.get("user")
    return Parsed(kind, req, model, stream, include_usage, logprobs, _string(user, "user") if user else "")


def _response_format(v: Any, ext: Any, req: pb.GenerateRequest) -> None:
    """``response_format`` (text, json_object, json_schema) and the extension
    ``structured_output`` ({"regex": ...}, {"lark": ...} or {"json_schema": ...})."""
    g = req.structured_output
    if v is not None:
        if not isinstance(v, dict) or not isinstance(v.get("type"), str):
            raise bad("response_format", "'response_format' must be an object with a 'type'")
        if v["type"] == "json_object":
            g.json_object = True
        elif v["type"] == "json_schema":
            js = v.get("json_schema")
            if not isinstance(js, dict) or not isinstance(js.get("schema"), dict):
                raise bad("response_format.json_schema", "'json_schema' must be an object with a 'schema' object")
            g.json_schema = json.dumps(js["schema"])
        elif v["type"] != "text":
            raise bad("response_format", f"response_format type {v['type']!r} is not supported "
                                         "(text, json_object, json_schema)")
    if ext is None:
        return
    if req.HasField("structured_output"):
        raise bad("structured_output", "set one of 'response_format' (json) and 'structured_output'")
    if not isinstance(ext, dict) or len(ext) != 1 or next(iter(ext)) not in ("regex", "lark", "json_schema"):
        raise bad("structured_output", "'structured_output' must be one of {\"regex\": ...}, {\"lark\": ...}, "
                                       "{\"json_schema\": {...}}")
    kind, value = next(iter(ext.items()))
    if kind == "json_schema":
        if not isinstance(value, dict):
            raise bad("structured_output.json_schema", "'json_schema' must be an object")
        value = json.dumps(value)
    setattr(g, kind, _string(value, f"structured_output.{kind}"))
