"""A typed Python client for the public ``specdec.v1.Orchestrator`` API,
blocking (:class:`Client`) and asyncio (:class:`AsyncClient`).

    from specdec_app.client import Client

    with Client("127.0.0.1:50051") as c:
        for delta in c.stream("def fib(n):", max_new_tokens=64):
            print(delta.text, end="", flush=True)
        result = c.generate([("user", "Explain decorators")], temperature=0.7, seed=1)
        print(result.text, result.finish_reason, result.stats.acceptance_rate)

TLS: ``tls_ca`` (the server's CA) turns TLS on; ``tls_cert``/``tls_key``
present a client certificate. ``token`` sends ``authorization: Bearer
<token>``; over plaintext to anything but loopback it is refused
(ValueError) unless ``allow_plaintext_tokens=True`` (docs/security.md). Errors are :class:`grpc.RpcError` with the server's status code
and message (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, UNAUTHENTICATED, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Iterator, Sequence, Union

from specdec.auth import bearer_metadata
from specdec.tls import TlsClientConfig, aio_channel, sync_channel
from specdec.v1 import common_pb2, orchestrator_pb2, orchestrator_pb2_grpc

Prompt = Union[str, Sequence[int], Sequence[tuple[str, str]]]
"""Text, token ids, or chat messages as (role, content) pairs."""

MODES = {"auto": orchestrator_pb2.SPECULATION_MODE_AUTO, "off": orchestrator_pb2.SPECULATION_MODE_OFF,
         "fixed": orchestrator_pb2.SPECULATION_MODE_FIXED, "heuristic": orchestrator_pb2.SPECULATION_MODE_HEURISTIC}


@dataclass(frozen=True)
class Delta:
    """One streamed chunk: new text (whole UTF-8 characters) and token ids."""

    text: str
    token_ids: list[int]


@dataclass(frozen=True)
class Result:
    """A finished generation: the whole text and ids, why it ended
    (``FINISH_REASON_EOS``, ``_LENGTH``, ``_STOP``, ``_CONTEXT_LENGTH``) and
    the request's stats (a ``specdec.v1.GenerationStats``)."""

    text: str
    token_ids: list[int]
    finish_reason: str
    stats: Any = field(repr=False)


def build_request(
    prompt: Prompt,
    *,
    max_new_tokens: int = 0,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    stop: Sequence[str] = (),
    mode: str = "auto",
    num_draft_tokens: int = 0,
    drafter: str = "",
    ignore_eos: bool = False,
) -> orchestrator_pb2.GenerateRequest:
    """The ``GenerateRequest`` for these arguments (``max_new_tokens`` 0 =
    the server's default)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    req = orchestrator_pb2.GenerateRequest(
        max_new_tokens=max_new_tokens, stop=list(stop), ignore_eos=ignore_eos,
        sampling=common_pb2.SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k),
        speculation=orchestrator_pb2.SpeculationConfig(mode=MODES[mode], num_draft_tokens=num_draft_tokens,
                                                       drafter=drafter),
    )
    if seed is not None:
        req.sampling.seed = seed
    if isinstance(prompt, str):
        req.prompt = prompt
    elif prompt and all(isinstance(m, (tuple, list)) for m in prompt):
        for role, content in prompt:  # type: ignore[misc]
            req.messages.append(orchestrator_pb2.ChatMessage(role=role, content=content))
    else:
        req.prompt_token_ids.extend(int(t) for t in prompt)  # type: ignore[union-attr]
    return req


class _Collector:
    def __init__(self) -> None:
        self.text: list[str] = []
        self.ids: list[int] = []
        self.last: orchestrator_pb2.GenerateResponse | None = None

    def add(self, chunk: orchestrator_pb2.GenerateResponse) -> Delta:
        self.text.append(chunk.text)
        self.ids.extend(chunk.token_ids)
        self.last = chunk
        return Delta(chunk.text, list(chunk.token_ids))

    def result(self) -> Result:
        if self.last is None:
            raise RuntimeError("the stream ended without a final chunk")
        return Result("".join(self.text), self.ids, orchestrator_pb2.FinishReason.Name(self.last.finish_reason),
                      self.last.stats)


def _tls(tls_ca: str | Path | None, tls_cert: str | Path | None, tls_key: str | Path | None,
         server_name: str) -> TlsClientConfig | None:
    if tls_ca is None:
        if tls_cert is not None or tls_key is not None:
            raise ValueError("a client certificate needs tls_ca (the server's CA) too")
        return None
    return TlsClientConfig(Path(tls_ca), Path(tls_cert) if tls_cert else None, Path(tls_key) if tls_key else None,
                           server_name=server_name)


def _metadata(token: str | None, address: str, tls: TlsClientConfig | None,
              allow_plaintext: bool) -> list[tuple[str, str]] | None:
    return bearer_metadata(token, address, encrypted=tls is not None, allow_plaintext=allow_plaintext)


class Client:
    """Blocking client. One channel; use as a context manager or ``close()``."""

    def __init__(self, address: str = "127.0.0.1:50051", *, token: str | None = None,
                 tls_ca: str | Path | None = None, tls_cert: str | Path | None = None,
                 tls_key: str | Path | None = None, server_name: str = "", timeout: float = 600.0,
                 allow_plaintext_tokens: bool = False) -> None:
        tls = _tls(tls_ca, tls_cert, tls_key, server_name)
        self._metadata = _metadata(token, address, tls, allow_plaintext_tokens)  # before any channel exists
        self._channel = sync_channel(address, tls)
        self._stub = orchestrator_pb2_grpc.OrchestratorStub(self._channel)
        self.timeout = timeout

    def stream(self, prompt: Prompt, *, timeout: float | None = None, **kwargs: Any) -> Iterator[Delta]:
        """Yields text deltas as they are committed; ``result()`` of
        :meth:`generate` has the stats. Keyword arguments: :func:`build_request`."""
        for chunk in self._call(prompt, timeout, kwargs):
            yield Delta(chunk.text, list(chunk.token_ids))

    def generate(self, prompt: Prompt, *, timeout: float | None = None, **kwargs: Any) -> Result:
        """The whole generation with its stats."""
        c = _Collector()
        for chunk in self._call(prompt, timeout, kwargs):
            c.add(chunk)
        return c.result()

    def _call(self, prompt: Prompt, timeout: float | None, kwargs: dict[str, Any]) -> Iterator[Any]:
        req = build_request(prompt, **kwargs)
        call = self._stub.Generate(req, timeout=timeout or self.timeout, metadata=self._metadata)
        try:
            yield from call
        finally:
            call.cancel()  # a consumer that stops early frees the server's sessions at once

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient:
    """asyncio client. One channel; ``async with`` or ``await close()``."""

    def __init__(self, address: str = "127.0.0.1:50051", *, token: str | None = None,
                 tls_ca: str | Path | None = None, tls_cert: str | Path | None = None,
                 tls_key: str | Path | None = None, server_name: str = "", timeout: float = 600.0,
                 allow_plaintext_tokens: bool = False) -> None:
        tls = _tls(tls_ca, tls_cert, tls_key, server_name)
        self._metadata = _metadata(token, address, tls, allow_plaintext_tokens)  # before any channel exists
        self._channel = aio_channel(address, tls)
        self._stub = orchestrator_pb2_grpc.OrchestratorStub(self._channel)
        self.timeout = timeout

    async def stream(self, prompt: Prompt, *, timeout: float | None = None, **kwargs: Any) -> AsyncIterator[Delta]:
        async for chunk in self._call(prompt, timeout, kwargs):
            yield Delta(chunk.text, list(chunk.token_ids))

    async def generate(self, prompt: Prompt, *, timeout: float | None = None, **kwargs: Any) -> Result:
        c = _Collector()
        async for chunk in self._call(prompt, timeout, kwargs):
            c.add(chunk)
        return c.result()

    async def _call(self, prompt: Prompt, timeout: float | None, kwargs: dict[str, Any]) -> AsyncIterator[Any]:
        req = build_request(prompt, **kwargs)
        call = self._stub.Generate(req, timeout=timeout or self.timeout, metadata=self._metadata)
        try:
            async for chunk in call:
                yield chunk
        finally:
            call.cancel()

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


__all__ = ["AsyncClient", "Client", "Delta", "Result", "build_request"]
