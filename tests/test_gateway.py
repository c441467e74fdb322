"""The OpenAI-compatible gateway against a real tiny stack on loopback,
driven by the official ``openai`` client (the PyPI package): chat and
completions, streamed and not, logprobs, refused parameters, cancelled
streams and requests, bearer tokens passed through, and the gRPC -> HTTP
status mapping."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import time
from typing import Any

import grpc
import httpx
import jsonschema
import openai
import pytest

from gateway.responses import HTTP_STATUS, api_error
from tests.stack import LoopThread, Stack, free_port, make_request, start_gateway, start_stack

TOKEN = "gateway-test-token-0123456789"
OTHER = "gateway-other-token-0123456789"
MESSAGES = [("user", "hello there")]


@pytest.fixture(scope="module")
def stack(json_models, tmp_path_factory: pytest.TempPathFactory) -> Stack:  # type: ignore[no-untyped-def]
    """A tiny pair that can write JSON, with bearer tokens and two streams per client."""
    tokens = tmp_path_factory.mktemp("gw-auth") / "tokens"
    tokens.write_text(f"alice:{TOKEN}\nbob:{OTHER}\n")
    s = start_stack(json_models.target, json_models.draft, json_models.cache_dir,
                    orchestrator_overrides={"auth_tokens_file": tokens, "max_streams_per_client": 2})
    yield s
    s.close()


@pytest.fixture(scope="module", params=["asyncio", "uvloop"])
def gateway(stack: Stack, request: pytest.FixtureRequest) -> Any:
    """The gateway on the stack's asyncio loop, and on a uvloop loop of its
    own (what ``specdec serve gateway`` runs on when uvloop is installed):
    every gateway test runs on both."""
    if request.param == "asyncio":
        gw = start_gateway(stack)
        yield gw
        stack.loop.run(gw.stop(0))
        return
    import uvloop

    from gateway.config import GatewayConfig
    from gateway.server import event_loop_runner

    assert event_loop_runner(GatewayConfig()) is uvloop.run  # "auto" picks it
    assert event_loop_runner(GatewayConfig(event_loop="asyncio")) is asyncio.run
    loop = LoopThread(uvloop.new_event_loop)
    gw = start_gateway(stack, loop)
    assert isinstance(gw.task.get_loop(), uvloop.Loop)
    gw.loop_thread = loop
    yield gw
    loop.run(gw.stop(0))
    loop.close()


def _run(gw: Any, stack: Stack, coro: Any) -> Any:
    return getattr(gw, "loop_thread", stack.loop).run(coro)


def client(gw: Any, token: str = TOKEN) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key=token, max_retries=0, timeout=60)


def _grpc(stack: Stack, **fields: Any) -> dict[str, Any]:
    chunks = list(stack.orch_stub().Generate(make_request(**fields), timeout=60,
                                             metadata=[("authorization", f"Bearer {TOKEN}")]))
    return {"text": "".join(c.text for c in chunks), "token_ids": [t for c in chunks for t in c.token_ids],
            "stats": chunks[-1].stats, "logprobs": [lp for c in chunks for lp in c.logprobs]}


SPEC = {"speculation": {"mode": "fixed", "num_draft_tokens": 4}}


def test_chat_completion_equals_grpc_and_reports_usage(stack: Stack, gateway: Any) -> None:
    ref = _grpc(stack, messages=MESSAGES, max_new_tokens=20, ignore_eos=False)
    r = client(gateway).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello there"}],
                                                max_tokens=20, temperature=0, extra_body=SPEC)
    assert r.object == "chat.completion" and r.model == "tiny" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref["text"]
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens == len(ref["token_ids"]) and r.usage.prompt_tokens == ref["stats"].prompt_tokens
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.model_extra["speculation"]["draft_tokens"] > 0  # it ran speculatively
    stack.assert_clean()


def test_chat_stream_with_usage(stack: Stack, gateway: Any) -> None:
    ref = _grpc(stack, messages=MESSAGES, max_new_tokens=24)
    chunks = list(client(gateway).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hello there"}], max_completion_tokens=24, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_body={**SPEC, "ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref["text"]
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1  # streamed, not one block
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finals] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert all(c.usage is None for c in chunks[:-1])
    stack.assert_clean()


@pytest.mark.parametrize("stream", [False, True])
def test_completions(stack: Stack, gateway: Any, stream: bool) -> None:
    ref = _grpc(stack, prompt="the quick", max_new_tokens=16)
    r = client(gateway).completions.create(model="tiny", prompt="the quick", max_tokens=16, temperature=0,
                                           stream=stream, extra_body={**SPEC, "ignore_eos": True})
    if stream:
        chunks = list(r)
        assert all(c.object == "text_completion" for c in chunks)
        assert "".join(c.choices[0].text for c in chunks) == ref["text"]
        assert chunks[-1].choices[0].finish_reason == "length"
    else:
        assert r.object == "text_completion" and r.choices[0].text == ref["text"]
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 16
    stack.assert_clean()


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_counts_the_tokens_up_to_it(stack: Stack, gateway: Any, stream: bool) -> None:
    """usage.completion_tokens counts the tokens up to the one that completed
    the stop string, not those a speculative round produced past it."""
    full = _grpc(stack, prompt="the quick", max_new_tokens=40)
    stop = full["text"][9:12]
    ref = _grpc(stack, prompt="the quick", max_new_tokens=40, stop=[stop])
    tok = stack.orchestrator.servicer.tokenizer
    n = next(k for k in range(1, 41) if stop in tok.decode(full["token_ids"][:k], skip_special_tokens=True))
    assert len(ref["token_ids"]) == n and ref["stats"].generated_tokens == n
    r = client(gateway).completions.create(model="tiny", prompt="the quick", max_tokens=40, temperature=0, stop=stop,
                                           stream=stream, stream_options={"include_usage": True} if stream else None,
                                           extra_body={"speculation": {"mode": "fixed", "num_draft_tokens": 8}, "ignore_eos": True})
    if stream:
        chunks = list(r)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == ref["text"]
        usage = chunks[-1].usage
    else:
        assert r.choices[0].text == ref["text"] and r.choices[0].finish_reason == "stop"
        usage = r.usage
    assert usage.completion_tokens == n
    stack.assert_clean()


def test_chat_logprobs_are_the_targets(stack: Stack, gateway: Any) -> None:
    """The logprobs and top-3 are what the gRPC API returns for the same request."""
    ref = _grpc(stack, messages=MESSAGES, max_new_tokens=12, top_logprobs=3)
    r = client(gateway).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello there"}],
                                                max_tokens=12, temperature=0, logprobs=True, top_logprobs=3,
                                                extra_body={**SPEC, "ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 12 == len(ref["logprobs"])
    for got, want in zip(content, ref["logprobs"]):
        assert got.logprob == pytest.approx(want.chosen.logprob, abs=1e-6)
        assert bytes(got.bytes) == want.chosen.token and got.token == want.chosen.token.decode()
        assert [t.logprob for t in got.top_logprobs] == pytest.approx([t.logprob for t in want.top], abs=1e-6)
        assert len(got.top_logprobs) == 3 and got.top_logprobs[0].token == got.token  # greedy: the argmax
    assert "".join(t.token for t in content) == r.choices[0].message.content
    legacy = client(gateway).completions.create(model="tiny", prompt="the quick", max_tokens=5, temperature=0,
                                                logprobs=2, extra_body={"ignore_eos": True})
    lp = legacy.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    assert all(len(t) == 2 and max(t.values()) <= 0 for t in lp.top_logprobs)
    stack.assert_clean()


SCHEMA = {"type": "object", "properties": {
    "name": {"enum": ["ada", "bob", "cy"]},
    "scores": {"type": "array", "items": {"enum": [1, 2, 3]}, "maxItems": 3},
    "ok": {"type": "boolean"},
}, "required": ["name", "scores", "ok"], "additionalProperties": False}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_json_schema_response_parses_and_validates(stack: Stack, gateway: Any, seed: int) -> None:
    """response_format json_schema, sampled at temperature 1 with speculation:
    the content parses and validates against the schema."""
    r = client(gateway).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "give me json"}], max_tokens=80, seed=seed,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}},
        extra_body=SPEC)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    r = client(gateway).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "a date"}], max_tokens=20, temperature=0,
        extra_body={**SPEC, "structured_output": {"regex": r"\d{4}-\d{2}-\d{2}"}})
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", r.choices[0].message.content)
    stack.assert_clean()


@pytest.mark.parametrize("kwargs,param", [
    ({"n": 2}, "n"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"frequency_penalty": 1.0}, "frequency_penalty"),
    ({"logit_bias": {"1": 5}}, "logit_bias"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}, "tools"),
    ({"extra_body": {"guided_json": {}}}, "guided_json"),
    ({"extra_body": {"speculation": {"gamma": 3}}}, "speculation.gamma"),
    ({"temperature": 3.0}, "temperature"),
    ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema"),
])
def test_unsupported_parameters_get_400_naming_them(stack: Stack, gateway: Any, kwargs: dict, param: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(openai.BadRequestError) as e:
        client(gateway).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                                max_tokens=2, **kwargs)
    assert e.value.status_code == 400
    assert e.value.body["param"] == param and param.split(".")[-1] in e.value.body["message"]
    assert e.value.body["type"] == "invalid_request_error"
    stack.assert_clean()


def test_grpc_errors_map_to_http_statuses(stack: Stack, gateway: Any) -> None:
    """Real errors from the orchestrator arrive with the status OpenAI's clients expect."""
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "x"}]}
    with pytest.raises(openai.BadRequestError, match="exceeds the limit"):  # INVALID_ARGUMENT
        client(gateway).chat.completions.create(**chat, max_tokens=100_000)
    with pytest.raises(openai.AuthenticationError):  # UNAUTHENTICATED: the token passes through
        client(gateway, "not-a-valid-token-0123456789").chat.completions.create(**chat, max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client(gateway).chat.completions.create(**{**chat, "model": "gpt-4o"}, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="structured output"):  # the grammar's compile error
        client(gateway).chat.completions.create(**chat, max_tokens=2, extra_body={"structured_output": {"regex": "([a"}})
    held = [client(gateway).chat.completions.create(**chat, max_tokens=400, stream=True,
                                                    extra_body={"ignore_eos": True}) for _ in range(2)]
    for h in held:
        next(iter(h))  # alice's two stream slots are taken
    with pytest.raises(openai.RateLimitError):  # RESOURCE_EXHAUSTED
        client(gateway).chat.completions.create(**chat, max_tokens=2)
    assert client(gateway, OTHER).chat.completions.create(**chat, max_tokens=2).choices  # bob is unaffected
    for h in held:
        h.close()
    stack.assert_clean()
    loop = getattr(gateway, "loop_thread", None)
    fast = start_gateway(stack, loop, request_timeout_s=0.05)
    try:
        with pytest.raises(openai.APIStatusError) as e:  # DEADLINE_EXCEEDED
            client(fast).chat.completions.create(**chat, max_tokens=400, extra_body={"ignore_eos": True})
        assert e.value.status_code == 504
    finally:
        _run(gateway, stack, fast.stop(0))
    dead = start_gateway(stack, loop, orchestrator_address=f"127.0.0.1:{free_port()}")
    try:
        with pytest.raises(openai.InternalServerError) as e:  # UNAVAILABLE
            client(dead).chat.completions.create(**chat, max_tokens=2)
        assert e.value.status_code == 503
        assert httpx.get(f"{dead.url}/ready").status_code == 503
    finally:
        _run(gateway, stack, dead.stop(0))
    stack.assert_clean()


def test_status_table() -> None:
    """Every mapped code, and the fallback: the statuses OpenAI's clients retry
    (429, 5xx) are exactly the transient ones."""
    want = {"INVALID_ARGUMENT": 400, "OUT_OF_RANGE": 400, "FAILED_PRECONDITION": 400, "UNAUTHENTICATED": 401,
            "PERMISSION_DENIED": 403, "NOT_FOUND": 404, "RESOURCE_EXHAUSTED": 429, "DEADLINE_EXCEEDED": 504,
            "UNAVAILABLE": 503, "CANCELLED": 503}
    assert {c.name: s for c, (s, _) in HTTP_STATUS.items()} == want
    for code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DATA_LOSS,
                 grpc.StatusCode.UNIMPLEMENTED):
        assert api_error(code, "x").status == 500
    e = api_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many")
    assert e.body() == {"error": {"message": "too many", "type": "rate_limit_error", "param": None,
                                  "code": "resource_exhausted"}}


def test_sse_events_are_one_data_line_of_the_same_json() -> None:
    """The gateway yields its SSE events pre-encoded (orjson): each is one
    ``data:`` line (newlines and CR in the text escaped; U+2028 and non-ASCII
    kept as UTF-8, which SSE does not split on) whose JSON means what
    ``json.dumps`` made. Negative control: a raw newline would split the event."""
    from gateway.app import _DONE, _sse

    for obj in ({"choices": [{"text": "a\nb\r\nc\rd \u2028 é ☃ \x00\t\"\\", "logprob": -0.1234567890123}]},
                {"error": {"message": "m", "param": None}}, {}, {"n": 2**63, "f": 1e-7}):
        event = _sse(obj)
        assert event.startswith(b"data: ") and event.endswith(b"\n\n")
        line = event[len(b"data: "):-2]
        assert b"\n" not in line and b"\r" not in line
        assert json.loads(line) == obj == json.loads(json.dumps(obj))
    assert _sse({"t": "é"}) == 'data: {"t":"é"}\n\n'.encode()
    assert _DONE == b"data: [DONE]\n\n"
    raw = 'data: {"t":"a\nb"}\n\n'.encode()  # what an encoder that kept newlines would send
    assert raw.split(b"\n\n")[0].count(b"\n") == 1 and _sse({"t": "a\nb"}) != raw
    assert _sse({"t": "a\nb"}).count(b"\n") == 2


def orchestrator_count(stack: Stack, code: str) -> float:
    return stack.orchestrator.servicer.metrics.requests.labels("NONE", code)._value.get()


def assert_one_more_cancelled(stack: Stack, before: float) -> None:
    """The orchestrator counts one more CANCELLED request than ``before`` (within 10 s)."""
    deadline = time.monotonic() + 10
    while orchestrator_count(stack, "CANCELLED") == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert orchestrator_count(stack, "CANCELLED") == before + 1


def test_a_cancelled_stream_frees_its_sessions(stack: Stack, gateway: Any) -> None:
    """Closing the HTTP response mid-stream cancels the Generate call: the
    orchestrator counts it CANCELLED and both services release the sessions."""
    before = orchestrator_count(stack, "CANCELLED")
    stream = client(gateway).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "a long one"}], max_tokens=400, temperature=0,
        stream=True, extra_body={**SPEC, "ignore_eos": True})
    it = iter(stream)
    for _ in range(3):
        next(it)
    assert stack.target_sessions() == 1
    stream.close()
    stack.assert_clean()
    assert_one_more_cancelled(stack, before)


def test_a_client_gone_before_the_response_cancels_generate(stack: Stack, gateway: Any) -> None:
    """A client that disconnects while a non-streamed response is being
    generated cancels the Generate call (the orchestrator counts it CANCELLED,
    the sessions are released), and the gateway goes on serving."""
    import socket
    from urllib.parse import urlsplit

    before = orchestrator_count(stack, "CANCELLED")
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "a long one"}], "max_tokens": 400,
                       "temperature": 0, "ignore_eos": True, **SPEC}).encode()
    u = urlsplit(gateway.url)
    with socket.create_connection((u.hostname, u.port), timeout=30) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer " + TOKEN.encode() + b"\r\nContent-Length: " + str(len(body)).encode()
                  + b"\r\n\r\n" + body)
        deadline = time.monotonic() + 30
        while stack.target_sessions() == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert stack.target_sessions() == 1
    stack.assert_clean()
    assert_one_more_cancelled(stack, before)
    out = client(gateway).completions.create(model="tiny", prompt="hi", max_tokens=2, temperature=0)
    assert out.usage.completion_tokens == 2


def test_models_health_ready_and_bad_bodies(stack: Stack, gateway: Any) -> None:
    models = client(gateway).models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert client(gateway).models.retrieve("tiny").id == "tiny"
    assert httpx.get(f"{gateway.url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{gateway.url}/ready").status_code == 200
    r = httpx.post(f"{gateway.url}/v1/chat/completions", content=b"{not json")
    assert r.status_code == 400 and r.json()["error"]["param"] == "body"
    r = httpx.post(f"{gateway.url}/v1/completions", content=b"x" * (5 << 20))
    assert r.status_code == 413
    r = httpx.post(f"{gateway.url}/v1/completions", json={"prompt": ["a", "b"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    stack.assert_clean()


def test_curl_shows_the_sse_stream(stack: Stack, gateway: Any) -> None:
    """The docs' `curl -N` call: one `data:` event per chunk, then `data: [DONE]`."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True,
            "ignore_eos": True}
    out = subprocess.run(["curl", "-sN", f"{gateway.url}/v1/chat/completions", "-H", f"Authorization: Bearer {TOKEN}",
                          "-H", "Content-Type: application/json", "-d", json.dumps(body)],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    events = [line[len("data: "):] for line in out.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert len(chunks) >= 3 and all(c["object"] == "chat.completion.chunk" for c in chunks)
    stack.assert_clean()



def test_specdec_up_starts_the_gateway_on_8000() -> None:
    """`specdec up` runs the gateway on 127.0.0.1:8000 by default, wired to its
    orchestrator and named after the target; --gateway-port changes it, 0 drops it."""
    from gateway.cli import config_from_args
    from specdec_app.cli import build_parser
    from specdec_app.up import child_commands

    cmds, _ = child_commands(build_parser().parse_args(["up", "--gateway-request-timeout", "30"]), "/tmp/c")
    argv = cmds["gateway"][cmds["gateway"].index("serve"):]
    a = build_parser().parse_args(argv)
    cfg = config_from_args(a, a.port)
    assert (cfg.host, cfg.port, cfg.orchestrator_address) == ("127.0.0.1", 8000, "127.0.0.1:50051")
    assert cfg.served_model_names == ["qwen2.5-coder-1.5b-instruct"] and cfg.request_timeout_s == 30
    other, _ = child_commands(build_parser().parse_args(["up", "--gateway-port", "8080", "--target-model",
                                                         "smollm2-135m-instruct"]), "/tmp/c")
    b = build_parser().parse_args(other["gateway"][other["gateway"].index("serve"):])
    assert b.port == 8080 and config_from_args(b, b.port).served_model_names == ["smollm2-135m-instruct"]
    none, _ = child_commands(build_parser().parse_args(["up", "--gateway-port", "0"]), "/tmp/c")
    assert "gateway" not in none


def test_accepted_connections_have_tcp_nodelay() -> None:
    """The gateway's listening socket makes asyncio set TCP_NODELAY on every
    connection it accepts. Without it (a socket made with proto 0), each
    keep-alive response waited out the client's delayed ACK: 40 ms a request."""
    import asyncio
    import socket

    from gateway.server import _bind

    async def run() -> int:
        accepted: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                sock = transport.get_extra_info("socket")
                accepted.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        listener = _bind("127.0.0.1", 0)
        server = await asyncio.get_running_loop().create_server(Probe, sock=listener)
        try:
            port = listener.getsockname()[1]
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            nodelay = await asyncio.wait_for(accepted, 10)
            writer.close()
            return nodelay
        finally:
            server.close()
            await server.wait_closed()

    assert asyncio.run(run()) != 0
