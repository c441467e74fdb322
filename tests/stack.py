"""Real services on loopback for tests: target, draft and orchestrator on
port 0, run on an asyncio loop in a background thread (or the draft in a
separate process, for kill tests). Tests talk to them with ordinary sync
gRPC stubs, as a client would."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Awaitable, Callable, Coroutine, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from draft_service.config import DraftServiceConfig, DrafterSpec
from orchestrator.config import OrchestratorConfig
from specdec.tls import TlsClientConfig, TlsServerConfig, sync_channel
from specdec.v1 import draft_pb2_grpc, orchestrator_pb2 as pb, orchestrator_pb2_grpc, target_pb2_grpc
from target_service.config import TargetServiceConfig

T = TypeVar("T")
REPO = Path(__file__).resolve().parent.parent


def load_script(name: str) -> ModuleType:
    """scripts/<name>.py imported as the module ``name`` (scripts is no package)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


class LoopThread:
    """An asyncio loop on a daemon thread (``factory``: another loop, e.g. uvloop's)."""

    def __init__(self, factory: Callable[[], asyncio.AbstractEventLoop] = asyncio.new_event_loop) -> None:
        self.loop = factory()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = 600) -> T:
        fut: Future[T] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return fut.result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_serving(
    address: str,
    timeout_s: float = 300,
    proc: subprocess.Popen[bytes] | None = None,
    tls: TlsClientConfig | None = None,
) -> None:
    deadline = time.monotonic() + timeout_s
    with sync_channel(address, tls) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"service process exited with {proc.returncode}")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.3)
    raise TimeoutError(f"{address} did not become SERVING")


@dataclass
class Stack:
    """target + draft + orchestrator; ``draft_proc`` when the draft is a subprocess."""

    loop: LoopThread
    target: Any
    draft: Any | None
    orchestrator: Any
    draft_proc: subprocess.Popen[bytes] | None = None
    channels: list[grpc.Channel] = field(default_factory=list)
    tls: TlsClientConfig | None = None  # what test clients use (CA + client certificate) when TLS is on

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.orchestrator.port}"

    def channel(self, address: str | None = None, **opts: Any) -> grpc.Channel:
        ch = sync_channel(address or self.address, self.tls, list(opts.items()))
        self.channels.append(ch)
        return ch

    def orch_stub(self) -> orchestrator_pb2_grpc.OrchestratorStub:
        return orchestrator_pb2_grpc.OrchestratorStub(self.channel())

    def target_stub(self) -> target_pb2_grpc.TargetStub:
        return target_pb2_grpc.TargetStub(self.channel(f"127.0.0.1:{self.target.port}"))

    def draft_stub(self) -> draft_pb2_grpc.DraftStub:
        assert self.draft is not None
        return draft_pb2_grpc.DraftStub(self.channel(f"127.0.0.1:{self.draft.port}"))

    def generate(self, stub: Any | None = None, timeout: float = 300, **fields: Any) -> dict[str, Any]:
        """Runs one Generate call; returns text, token_ids, finish_reason, stats."""
        req = make_request(**fields)
        chunks = list((stub or self.orch_stub()).Generate(req, timeout=timeout))
        last = chunks[-1]
        return {
            "text": "".join(c.text for c in chunks),
            "token_ids": [t for c in chunks for t in c.token_ids],
            "finish_reason": last.finish_reason,
            "stats": last.stats,
            "chunks": chunks,
        }

    def target_sessions(self) -> int:
        return self.target.engine.num_sessions

    def draft_sessions(self) -> int:
        return len(self.draft.sessions) if self.draft is not None else 0

    def wait_no_sessions(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.target_sessions() == 0 and self.draft_sessions() == 0:
                return
            time.sleep(0.05)
        raise AssertionError(
            f"sessions leaked: target={self.target_sessions()} draft={self.draft_sessions()}"
        )

    def ports(self) -> list[int]:
        return [s.port for s in (self.orchestrator, self.target, self.draft) if s is not None]

    def health(self, port: int, service: str = "") -> int:
        """The health status of the server on ``port`` (an open method: no token needed)."""
        stub = health_pb2_grpc.HealthStub(self.channel(f"127.0.0.1:{port}"))
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status

    def active_streams(self) -> int:
        return self.orchestrator.servicer.active

    def assert_clean(self, timeout_s: float = 10.0) -> None:
        """Every server SERVING, no session left in either model service and no
        Generate stream (nor per-client call slot) left in the orchestrator."""
        for port in self.ports():
            assert self.health(port) == health_pb2.HealthCheckResponse.SERVING, port
        self.wait_no_sessions(timeout_s)
        deadline = time.monotonic() + timeout_s
        guard = self.orchestrator.guard
        while self.active_streams() or (guard is not None and guard.active):
            assert time.monotonic() < deadline, f"streams left: {self.active_streams()}, {guard and dict(guard.active)}"
            time.sleep(0.02)

    def close(self) -> None:
        for ch in self.channels:
            ch.close()
        self.loop.run(self.orchestrator.stop(0))
        if self.draft is not None:
            self.loop.run(self.draft.stop(0))
        self.loop.run(self.target.stop(0))
        if self.draft_proc is not None and self.draft_proc.poll() is None:
            self.draft_proc.kill()
            self.draft_proc.wait()
        self.loop.close()


def make_request(
    *,
    prompt: str = "",
    prompt_token_ids: list[int] | None = None,
    messages: list[tuple[str, str]] | None = None,
    max_new_tokens: int = 16,
    temperature: float = 0.0,
    top_p: float = 0.0,
    top_k: int = 0,
    seed: int | None = None,
    mode: str = "fixed",
    gamma: int = 4,
    drafter: str = "",
    stop: list[str] | None = None,
    ignore_eos: bool = True,
    min_confidence: float = 0.0,
    draft_mode: str = "",
    top_logprobs: int | None = None,
) -> pb.GenerateRequest:
    modes = {"auto": pb.SPECULATION_MODE_AUTO, "off": pb.SPECULATION_MODE_OFF, "fixed": pb.SPECULATION_MODE_FIXED,
             "heuristic": pb.SPECULATION_MODE_HEURISTIC}
    req = pb.GenerateRequest(
        prompt=prompt,
        prompt_token_ids=prompt_token_ids or [],
        max_new_tokens=max_new_tokens,
        stop=stop or [],
        ignore_eos=ignore_eos,
        speculation=pb.SpeculationConfig(mode=modes[mode], num_draft_tokens=gamma, drafter=drafter,
                                         min_confidence=min_confidence, draft_mode=draft_mode),
    )
    if top_logprobs is not None:
        req.return_logprobs, req.top_logprobs = True, top_logprobs
    req.sampling.temperature = temperature
    req.sampling.top_p = top_p
    req.sampling.top_k = top_k
    if seed is not None:
        req.sampling.seed = seed
    for role, content in messages or []:
        req.messages.append(pb.ChatMessage(role=role, content=content))
    return req


def start_stack(
    target_dir: Path,
    draft_dir: Path | None,
    cache_dir: Path,
    *,
    target_dtype: str = "float32",
    draft_precision: str = "fp32",
    draft_subprocess: bool = False,
    target_overrides: dict[str, Any] | None = None,
    orchestrator_overrides: dict[str, Any] | None = None,
    draft_overrides: dict[str, Any] | None = None,
    draft_name: str = "tiny-draft",
    drafters: list[DrafterSpec] | None = None,
    default_drafter: str | None = None,
    target_tokenizer: str | None = None,
    tls_dir: Path | None = None,
    interpose: Callable[[str, str], Awaitable[tuple[str, str]]] | None = None,
) -> Stack:
    """``drafters`` (optional) replaces the single ``draft_dir`` drafter: the
    in-process draft service hosts all of them; ``target_tokenizer`` is what
    tli / prompt-lookup drafters propose in (default: ``target_dir``).
    ``tls_dir`` (scripts/gen_dev_certs.sh output) turns TLS on everywhere:
    mutual TLS to draft and target (each with its own certificate, accepting
    only the orchestrator's), server TLS on the orchestrator; the stack's
    test clients present the orchestrator's certificate.
    ``interpose(target_address, draft_address)`` runs on the stack's loop
    before the orchestrator starts and returns the addresses it should use
    instead (fault proxies, tests/faults.py)."""
    from draft_service.server import start as start_draft
    from orchestrator.server import start as start_orch
    from target_service.server import start as start_target

    draft_tls = client_tls = None
    if tls_dir is not None:
        def service_tls(name: str, client_ca: bool = True) -> TlsServerConfig:
            return TlsServerConfig(tls_dir / f"{name}.crt", tls_dir / f"{name}.key",
                                   tls_dir / "ca.crt" if client_ca else None)

        draft_tls = service_tls("draft")
        client_tls = TlsClientConfig(tls_dir / "ca.crt", tls_dir / "orchestrator.crt", tls_dir / "orchestrator.key")
        target_overrides = {"tls": service_tls("target"), **(target_overrides or {})}
        orchestrator_overrides = {"tls": service_tls("orchestrator", client_ca=False), "upstream_tls": client_tls,
                                  **(orchestrator_overrides or {})}
    loop = LoopThread()
    tcfg = TargetServiceConfig(model=str(target_dir), port=0, dtype=target_dtype, cache_dir=cache_dir,
                               **(target_overrides or {}))
    target = loop.run(start_target(tcfg))
    draft = None
    proc = None
    draft_addr = ""
    if draft_dir is not None and draft_subprocess:
        sp = start_service_process("draft", draft_dir, cache_dir, precision=draft_precision)
        proc, draft_addr = sp.proc, sp.address
        sp.wait_serving()
    elif draft_dir is not None or drafters:
        dcfg = DraftServiceConfig(
            drafters=drafters or [DrafterSpec(name=draft_name, model=str(draft_dir), precision=draft_precision)],
            default_drafter=default_drafter, target_tokenizer=target_tokenizer or str(target_dir),
            port=0, cache_dir=cache_dir, tls=draft_tls, **(draft_overrides or {}),
        )
        draft = loop.run(start_draft(dcfg))
        draft_addr = f"127.0.0.1:{draft.port}"
    target_addr = f"127.0.0.1:{target.port}"
    if interpose is not None:
        target_addr, draft_addr = loop.run(interpose(target_addr, draft_addr))
    ocfg = OrchestratorConfig(target_addresses=[target_addr],
                              draft_addresses=[draft_addr] if draft_addr else [],
                              tokenizer=str(target_dir), port=0, cache_dir=cache_dir,
                              # tests exercise speculation under concurrency: no load gate
                              **{"speculation_max_streams": 0, **(orchestrator_overrides or {})})
    orch = loop.run(start_orch(ocfg))
    stack = Stack(loop, target, draft, orch, proc, tls=client_tls)
    if draft_addr:  # wait until the orchestrator attached the draft
        deadline = time.monotonic() + 60
        while orch.servicer.draft is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert orch.servicer.draft is not None, "draft was not attached"
    return stack


def scrape_metrics(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """A Prometheus /metrics endpoint as {(sample name, sorted labels): value}."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            out[(smp.name, tuple(sorted(smp.labels.items())))] = smp.value
    return out


def kill(proc: subprocess.Popen[bytes]) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@dataclass
class ServiceProcess:
    """A ``specdec serve target|draft`` subprocess on loopback with its /metrics port."""

    service: str
    proc: subprocess.Popen[bytes]
    port: int
    metrics_port: int

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def wait_serving(self, timeout_s: float = 300) -> None:
        wait_serving(self.address, timeout_s, proc=self.proc)

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        return scrape_metrics(self.metrics_port)

    def calls(self, method: str) -> float:
        """Model calls served so far (``specdec_{service}_calls_total{method=...}``)."""
        return self.metrics().get((f"specdec_{self.service}_calls_total", (("method", method),)), 0.0)

    def kill(self) -> None:
        if self.proc.poll() is None:
            kill(self.proc)


def start_service_process(
    service: str, model_dir: Path, cache_dir: Path, *, precision: str = "fp32", dtype: str = "float32",
    drain_timeout_s: float = 30.0, backend: str = "",
) -> ServiceProcess:
    """Starts ``specdec serve target|draft`` for a tiny model (one thread; the
    draft hosts only its model drafter). Call ``wait_serving()`` before use.
    ``backend`` pins a target's backend ("" = calibrated at start-up)."""
    port, metrics_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "specdec_app.cli", "serve", service, "--model", str(model_dir), "--port", str(port),
           "--cache-dir", str(cache_dir), "--log-level", "warning", "--threads", "1",
           "--metrics-port", str(metrics_port), "--drain-timeout", str(drain_timeout_s)]
    if service == "draft":
        cmd += ["--precision", precision, "--drafters", "qwen2.5-coder-0.5b"]
    else:
        cmd += ["--dtype", dtype] + (["--backend", backend] if backend else [])
    proc = subprocess.Popen(cmd, cwd=REPO, start_new_session=True)
    return ServiceProcess(service, proc, port, metrics_port)


def start_gateway(stack: Stack, loop: LoopThread | None = None, **overrides: Any) -> Any:
    """The HTTP gateway on port 0 in front of ``stack``'s orchestrator, on
    ``loop`` (default the stack's); stop it with ``loop.run(gw.stop(0))``."""
    from gateway.config import GatewayConfig
    from gateway.server import start

    cfg = GatewayConfig(**{"orchestrator_address": stack.address, "port": 0, "served_model_names": ["tiny"],
                           **overrides})
    return (loop or stack.loop).run(start(cfg))
