"""A misbehaving service for fault tests: a real gRPC server on loopback that
forwards every call of ``specdec.v1.Draft`` or ``specdec.v1.Target`` to the
real service and lets a test rewrite requests and responses on the way
(corrupt q, out-of-vocabulary ids, a wrong cache length, dropped sessions,
an impostor drafter).

    proxy = await FaultyProxy.start("specdec.v1.Draft", real_address)
    proxy.on_response["Propose"] = lambda req, resp: ...  # mutate or replace
    proxy.on_event["Session"] = lambda event: ...  # a streamed event: mutate, replace, or None to drop
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

import grpc
from google.protobuf import message_factory

from specdec.v1 import draft_pb2, target_pb2

_DESCRIPTORS = {
    "specdec.v1.Draft": draft_pb2.DESCRIPTOR.services_by_name["Draft"],
    "specdec.v1.Target": target_pb2.DESCRIPTOR.services_by_name["Target"],
}

Hook = Callable[[Any, Any], Any]  # may return an awaitable


async def _maybe(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


@dataclass
class FaultyProxy:
    service: str
    upstream: grpc.aio.Channel
    server: grpc.aio.Server
    port: int
    # method -> hook(request, context) returning the request to forward (or raising grpc aborts);
    # for a streaming method, applied to each request on the stream
    on_request: dict[str, Hook] = field(default_factory=dict)
    # method -> hook(request, response) returning the response to send back
    on_response: dict[str, Hook] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    # streaming method -> hook(event) returning the event to send on (None drops it; may be awaitable)
    on_event: dict[str, Hook] = field(default_factory=dict)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @classmethod
    async def start(cls, service: str, upstream_address: str, omit: tuple[str, ...] = ()) -> "FaultyProxy":
        """``omit``: methods the proxy does not serve (UNIMPLEMENTED, as an older server)."""
        desc = _DESCRIPTORS[service]
        upstream = grpc.aio.insecure_channel(upstream_address)
        server = grpc.aio.server()
        port = server.add_insecure_port("127.0.0.1:0")
        proxy = cls(service, upstream, server, port)
        handlers = {}
        for m in desc.methods:
            if m.name in omit:
                continue
            req_cls = message_factory.GetMessageClass(m.input_type)
            resp_cls = message_factory.GetMessageClass(m.output_type)
            make = grpc.stream_stream_rpc_method_handler if m.client_streaming else grpc.unary_unary_rpc_method_handler
            forwarder = proxy._stream_forwarder if m.client_streaming else proxy._forwarder
            handlers[m.name] = make(
                forwarder(m.name, req_cls, resp_cls),
                request_deserializer=req_cls.FromString,
                response_serializer=resp_cls.SerializeToString,
            )
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(service, handlers)])
        from grpc_health.v1 import health, health_pb2, health_pb2_grpc

        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        for name in ("", service):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        await server.start()
        return proxy

    def _forwarder(self, name: str, req_cls: Any, resp_cls: Any) -> Callable[[Any, Any], Any]:
        call = self.upstream.unary_unary(f"/{self.service}/{name}", request_serializer=req_cls.SerializeToString,
                                         response_deserializer=resp_cls.FromString)

        async def forward(request: Any, context: grpc.aio.ServicerContext) -> Any:
            self.calls[name] = self.calls.get(name, 0) + 1
            if name in self.on_request:
                request = await _maybe(self.on_request[name](request, context))
            try:
                response = await call(request, timeout=context.time_remaining())
            except grpc.aio.AioRpcError as e:
                await context.abort(e.code(), e.details() or "")
            if name in self.on_response:
                response = await _maybe(self.on_response[name](request, response))
            return response

        return forward

    def _stream_forwarder(self, name: str, req_cls: Any, resp_cls: Any) -> Callable[[Any, Any], Any]:
        call_upstream = self.upstream.stream_stream(f"/{self.service}/{name}",
                                                    request_serializer=req_cls.SerializeToString,
                                                    response_deserializer=resp_cls.FromString)

        async def forward(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            self.calls[name] = self.calls.get(name, 0) + 1
            if name in self.on_request:  # each streamed request through the hook
                hook = self.on_request[name]

                async def rewritten() -> Any:
                    async for request in requests:
                        yield await _maybe(hook(request, context))

                call = call_upstream(rewritten())
            else:
                call = call_upstream(requests)
            try:
                async for event in call:
                    if name in self.on_event:
                        event = await _maybe(self.on_event[name](event))
                        if event is None:
                            continue
                    yield event
            except grpc.aio.AioRpcError as e:
                await context.abort(e.code(), e.details() or "")
            finally:
                call.cancel()

        return forward

    async def stop(self) -> None:
        await self.server.stop(0)
        await self.upstream.close()
