"""The gateway's HTTP routes (Starlette; SSE by sse-starlette) and their
calls to ``specdec.v1.Orchestrator/Generate`` over one gRPC channel.

- ``POST /v1/chat/completions``, ``POST /v1/completions``: JSON, or SSE with
  ``stream`` (``data: {chunk}`` events, then ``data: [DONE]``). A streamed
  response starts when the first tokens arrive, so an error before any token
  (bad input, no capacity, authentication) is an HTTP status; one after
  that is an ``error`` event ending the stream.
- ``GET /v1/models``, ``GET /v1/models/{model}``: the served model names.
- ``GET /health``: the process is up (liveness). ``GET /ready``: the
  orchestrator answers SERVING and the gateway is not draining (readiness).

A client that disconnects cancels its Generate call (the orchestrator then
releases the sessions). The ``Authorization`` header is passed on as gRPC
metadata: the orchestrator's bearer-token check applies unchanged. One
access-log line per request (logger ``specdec.gateway.access``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, TypeVar

import grpc
import orjson
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from sse_starlette.sse import EventSourceResponse
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.config import GatewayConfig
from gateway.requests import ApiError, parse
from gateway.responses import Formatter, api_error
from specdec.logging_util import log
from specdec.v1 import orchestrator_pb2 as pb
from specdec.v1 import orchestrator_pb2_grpc

access_logger = logging.getLogger("specdec.gateway.access")
T = TypeVar("T")
_DONE = b"data: [DONE]\n\n"


def _sse(obj: Any) -> bytes:
    """One SSE ``data:`` event, already encoded: sse-starlette sends bytes as
    they are (a dict event would be rebuilt as a ``ServerSentEvent`` and split
    on newlines per chunk). orjson's compact UTF-8 JSON escapes every control
    character (newline and CR included), so the event is one ``data:`` line;
    non-ASCII (U+2028 too, which is no SSE line break) stays as UTF-8."""
    return b"data: " + orjson.dumps(obj) + b"\n\n"


class _Json(JSONResponse):
    """A JSON response encoded by orjson (Starlette's documented way to swap
    the encoder): the same compact UTF-8 JSON as ``JSONResponse``, faster; a
    non-finite float becomes ``null`` where ``JSONResponse`` raised."""

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


class _Gone(Exception):
    """The HTTP client disconnected."""


@dataclass
class _Access:
    route: str
    started: float
    status: int = 200
    grpc_code: str = ""
    model: str = ""
    stream: bool = False
    user: str = ""
    tokens: int = 0
    error: str = ""


@dataclass
class GatewayMetrics:
    registry: CollectorRegistry
    requests: Counter  # by route and HTTP status
    latency: Histogram  # by route
    active: Gauge  # requests being served (the HPA's input)

    @classmethod
    def create(cls) -> "GatewayMetrics":
        r = CollectorRegistry()
        return cls(
            r,
            Counter("specdec_gateway_requests", "HTTP requests by route and status", ["route", "status"], registry=r),
            Histogram("specdec_gateway_request_seconds", "request wall time (streams: to the last chunk)", ["route"],
                      registry=r),
            Gauge("specdec_gateway_active_requests", "requests being served", registry=r),
        )


class Gateway:
    """The routes over one orchestrator channel."""

    def __init__(self, config: GatewayConfig, channel: grpc.aio.Channel) -> None:
        self.cfg = config
        self.stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
        self.health_stub = health_pb2_grpc.HealthStub(channel)
        self.draining = False
        self.active = 0  # requests being served
        self.created = int(time.time())
        self.metrics = GatewayMetrics.create()
        self.metrics.active.set_function(lambda: self.active)
        self.token_refusal, self.token_warning = config.plaintext_tokens()
        self._counted: dict[tuple[str, int], Any] = {}  # (route, status) -> its Counter child
        self._timed: dict[str, Any] = {}  # route -> its Histogram child

    def app(self) -> Starlette:
        return Starlette(routes=[
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completion, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.model, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/ready", self.ready, methods=["GET"]),
        ])

    async def chat(self, request: Request) -> Response:
        return await self.generate(request, "chat")

    async def completion(self, request: Request) -> Response:
        return await self.generate(request, "completion")

    # ------------------------------------------------------------ small routes
    def _model_card(self, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "specdec"}

    async def models(self, request: Request) -> Response:
        return _Json({"object": "list", "data": [self._model_card(m) for m in self.cfg.served_model_names]})

    async def model(self, request: Request) -> Response:
        name = request.path_params["model"]
        if name not in self.cfg.served_model_names:
            e = ApiError(404, f"The model `{name}` does not exist.", "model", "not_found_error", "model_not_found")
            return _Json(e.body(), status_code=404)
        return _Json(self._model_card(name))

    async def health(self, request: Request) -> Response:
        return _Json({"status": "ok"})

    async def ready(self, request: Request) -> Response:
        if self.draining:
            return _Json({"status": "draining"}, status_code=503)
        try:
            r = await self.health_stub.Check(health_pb2.HealthCheckRequest(), timeout=self.cfg.ready_timeout_s)
            serving = r.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError as e:
            return _Json({"status": "orchestrator unreachable", "error": e.code().name}, status_code=503)
        return _Json({"status": "ready" if serving else "orchestrator not serving"},
                            status_code=200 if serving else 503)

    # -------------------------------------------------------------- generation
    async def _body(self, request: Request) -> Any:
        """The JSON body, at most ``max_body_bytes`` (else 413)."""
        chunks, size = [], 0
        async for part in request.stream():
            size += len(part)
            if size > self.cfg.max_body_bytes:
                raise ApiError(413, f"request body exceeds {self.cfg.max_body_bytes} bytes", "body")
            chunks.append(part)
        try:
            return orjson.loads(b"".join(chunks))
        except (ValueError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}", "body") from None

    @staticmethod
    async def _until_disconnect(request: Request, work: Awaitable[T]) -> T:
        """``work``, or :class:`_Gone` as soon as the client disconnects
        (``work`` is cancelled then). ``work`` runs in the request's own task;
        the one task this adds watches for the disconnect and cancels it (a
        task for ``work`` and ``asyncio.wait`` cost a task, a future and their
        callbacks more per request)."""
        this = asyncio.current_task()
        assert this is not None
        gone = False

        async def watch() -> None:
            nonlocal gone
            try:
                while (await request.receive())["type"] != "http.disconnect":
                    pass
            except Exception:  # a receive that fails ends the request as a disconnect does
                pass
            gone = True
            this.cancel()

        watcher = asyncio.ensure_future(watch())
        try:
            return await work
        except asyncio.CancelledError:
            # ours (the watcher's) unless someone else cancelled this task too
            uncancel = getattr(this, "uncancel", None)  # Python 3.11+
            if gone and (uncancel is None or uncancel() == 0):
                raise _Gone() from None
            raise
        finally:
            watcher.cancel()

    async def generate(self, request: Request, kind: str) -> Response:
        rec = _Access(route=request.scope["path"], started=time.perf_counter())
        call = None
        self.active += 1
        streaming = False
        try:
            if self.draining:
                raise ApiError(503, "the gateway is shutting down; retry", None, "service_unavailable_error")
            parsed = parse(kind, await self._body(request), self.cfg.served_model_names)
            rec.model, rec.stream, rec.user = parsed.model, parsed.stream, parsed.user
            metadata = []
            if "authorization" in request.headers:
                if self.token_refusal:  # never pass a bearer token on over plaintext
                    raise ApiError(403, self.token_refusal, None, "permission_error", "plaintext_token")
                metadata = [("authorization", request.headers["authorization"])]
            call = self.stub.Generate(parsed.request, timeout=self.cfg.request_timeout_s, metadata=metadata)
            fmt = Formatter(parsed)
            if parsed.stream:
                first = await self._until_disconnect(request, self._read(call))
                streaming = True
                return EventSourceResponse(self._events(call, fmt, first, rec), ping=15, sep="\n",
                                           headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            msgs = await self._until_disconnect(request, self._read_all(call))
            rec.tokens = sum(len(m.token_ids) for m in msgs)
            return _Json(fmt.complete(msgs))
        except ApiError as e:
            rec.status, rec.error = e.status, e.message[:200]
            return _Json(e.body(), status_code=e.status)
        except grpc.RpcError as e:
            err = api_error(e.code(), e.details() or "")
            rec.status, rec.grpc_code, rec.error = err.status, e.code().name, err.message[:200]
            return _Json(err.body(), status_code=err.status)
        except (_Gone, ClientDisconnect):
            rec.status, rec.grpc_code = 499, "CANCELLED"  # no response reaches the client
            return Response(status_code=499)
        finally:
            if not streaming:
                if call is not None:
                    call.cancel()  # no-op once it finished
                self._done(rec)

    @staticmethod
    async def _read(call: Any) -> pb.GenerateResponse | None:
        msg = await call.read()
        return None if msg is grpc.aio.EOF else msg

    async def _read_all(self, call: Any) -> list[pb.GenerateResponse]:
        msgs = []
        while (msg := await self._read(call)) is not None:
            msgs.append(msg)
        if not msgs:
            raise ApiError(502, "the orchestrator ended the stream without a response", None, "server_error")
        return msgs

    async def _events(self, call: Any, fmt: Formatter, first: pb.GenerateResponse | None,
                      rec: _Access) -> AsyncIterator[bytes]:
        """The SSE events of a streamed response (the generator is cancelled
        when the client disconnects: the Generate call is cancelled with it)."""
        try:
            head = b"".join(_sse(chunk) for chunk in fmt.first())
            msg = first
            while msg is not None:  # one write per gRPC chunk (the last one's finish and usage events together)
                rec.tokens += len(msg.token_ids)
                if events := head + b"".join(_sse(chunk) for chunk in fmt.chunk(msg)):
                    yield events
                    head = b""
                msg = await self._read(call)
            yield head + _DONE
        except grpc.RpcError as e:
            err = api_error(e.code(), e.details() or "")
            rec.grpc_code, rec.error = e.code().name, err.message[:200]
            yield head + _sse(err.body()) + _DONE
        except asyncio.CancelledError:
            rec.grpc_code = rec.grpc_code or "CANCELLED"
            raise
        finally:
            call.cancel()
            self._done(rec)

    def _done(self, rec: _Access) -> None:
        self.active -= 1
        wall = time.perf_counter() - rec.started
        key = (rec.route, rec.status)
        if (counted := self._counted.get(key)) is None:  # labels() builds its key each call: once per route/status
            counted = self._counted[key] = self.metrics.requests.labels(rec.route, str(rec.status))
        if (timed := self._timed.get(rec.route)) is None:
            timed = self._timed[rec.route] = self.metrics.latency.labels(rec.route)
        counted.inc()
        timed.observe(wall)
        if not access_logger.isEnabledFor(logging.INFO):
            return
        fields: dict[str, Any] = {"route": rec.route, "status": rec.status, "duration_ms": round(wall * 1e3, 1),
                                  "model": rec.model, "stream": rec.stream, "completion_tokens": rec.tokens}
        if rec.user:
            fields["user"] = rec.user[:128]
        if rec.grpc_code:
            fields["grpc_code"] = rec.grpc_code
        if rec.error:
            fields["error"] = rec.error
        log(access_logger, logging.INFO, "request", **fields)

