"""``specdec up``: target, draft, orchestrator and the HTTP gateway as local
child processes.

Each child's command line is ``specdec serve <service>`` plus the flags that
service's own ``cli`` module defines (:meth:`FlagSet.argv`); this module adds
only the wiring between them (ports, addresses, TLS files, metrics ports).
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from draft_service import cli as draft_cli
from gateway import cli as gateway_cli
from orchestrator import cli as orchestrator_cli
from specdec.service_cli import DEFAULT_PORTS, FlagSet, add_common_flags, client_tls
from target_service import cli as target_cli

SERVE = [sys.executable, "-m", "specdec_app.cli", "serve"]


def add_up_command(sub: Any) -> None:
    up = sub.add_parser("up", help="run target, draft, orchestrator and the HTTP gateway locally; Ctrl-C stops all")
    common = add_common_flags(up)
    up.add_argument("--port", type=int, default=DEFAULT_PORTS["orchestrator"], help="orchestrator port")
    up.add_argument("--target-port", type=int, default=DEFAULT_PORTS["target"])
    up.add_argument("--draft-port", type=int, default=DEFAULT_PORTS["draft"])
    up.add_argument("--gateway-port", type=int, default=DEFAULT_PORTS["gateway"],
                    help="the OpenAI-compatible HTTP gateway's port on 127.0.0.1 (0 = no gateway)")
    target = target_cli.add_arguments(up, "target-")
    draft = draft_cli.add_arguments(up, "draft-", spin_default="run")
    speculation = orchestrator_cli.add_speculation_arguments(up)
    gateway = gateway_cli.add_arguments(up, "gateway-")
    up.add_argument("--metrics-port", type=int, default=9464,
                    help="orchestrator /metrics port; draft, target and gateway use the next three (0 = off)")
    up.add_argument("--no-draft", action="store_true", help="run without a draft service (target-only)")
    up.add_argument("--ready-timeout", type=float, default=1800.0)
    up.add_argument("--ready-file", default=None, help="write service addresses as JSON here once all are SERVING")
    up.add_argument("--tls-dir", type=Path, default=None,
                    help="serve TLS (mutual TLS between services) with the certificates scripts/gen_dev_certs.sh "
                         "wrote here (default: plaintext)")
    up.add_argument("--auth-tokens-file", type=Path, default=None,
                    help="require bearer tokens from this file on the public API (default: no authentication)")
    up.set_defaults(func=cmd_up, up_flags={"common": common, "target": target, "draft": draft,
                                           "orchestrator": speculation, "gateway": gateway})


def child_commands(a: argparse.Namespace, cache: str) -> tuple[dict[str, list[str]], Any]:
    """Each child's argv (service flags from the service's FlagSet, plus the
    wiring), and the client TLS config for health checks (None = plaintext)."""
    flags: dict[str, FlagSet] = a.up_flags
    common = flags["common"].argv(a) + ["--cache-dir", cache]
    tport, dport, oport = a.target_port, a.draft_port, a.port

    def metrics(offset: int) -> list[str]:
        return ["--metrics-port", str(a.metrics_port + offset if a.metrics_port else 0)]

    cmds = {
        "target": SERVE + ["target", "--port", str(tport)] + flags["target"].argv(a) + metrics(2) + common,
        "orchestrator": SERVE + ["orchestrator", "--port", str(oport), "--target-address", f"127.0.0.1:{tport}",
                                 "--draft-address", "" if a.no_draft else f"127.0.0.1:{dport}",
                                 "--model", a.target_model] + flags["orchestrator"].argv(a) + metrics(0) + common,
    }
    if a.gateway_port:
        cmds["gateway"] = (SERVE + ["gateway", "--port", str(a.gateway_port), "--orchestrator-address",
                                    f"127.0.0.1:{oport}", "--served-model-name", a.gateway_served_model_name
                                    or a.target_model] + flags["gateway"].argv(a) + metrics(3) + common)
    if not a.no_draft:
        cmds["draft"] = (SERVE + ["draft", "--port", str(dport), "--target-tokenizer", a.target_model]
                         + flags["draft"].argv(a) + metrics(1) + common)
    tls = None
    if a.tls_dir is not None:  # the layout scripts/gen_dev_certs.sh writes
        d = Path(a.tls_dir)

        def identity(name: str) -> list[str]:  # each service serves its own certificate
            return ["--tls-cert", str(d / f"{name}.crt"), "--tls-key", str(d / f"{name}.key")]

        for name in ("target", "draft"):
            if name in cmds:  # mutual TLS: only the orchestrator's certificate may call them
                cmds[name] += identity(name) + ["--tls-client-ca", str(d / "ca.crt")]
        cmds["orchestrator"] += identity("orchestrator") + [
            "--upstream-ca", str(d / "ca.crt"), "--upstream-cert", str(d / "orchestrator.crt"),
            "--upstream-key", str(d / "orchestrator.key")]
        if "gateway" in cmds:
            cmds["gateway"] += ["--orchestrator-ca", str(d / "ca.crt")]
        tls = client_tls(d / "ca.crt", d / "client.crt", d / "client.key")
    if a.auth_tokens_file is not None:
        cmds["orchestrator"] += ["--auth-tokens-file", str(a.auth_tokens_file)]
    return cmds, tls


def wait_healthy(address: str, timeout_s: float, procs: list[subprocess.Popen[bytes]], tls: Any = None) -> bool:
    """True once ``address`` answers SERVING; False on timeout or when a process in ``procs`` exits."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from specdec.tls import sync_channel

    deadline = time.monotonic() + timeout_s
    with sync_channel(address, tls) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in procs):
                return False
            try:
                r = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return True
            except grpc.RpcError:
                pass
            time.sleep(1.0)
    return False


def wait_http_ready(url: str, timeout_s: float, procs: list[subprocess.Popen[bytes]]) -> bool:
    """True once ``url`` answers 200; False on timeout or when a process in ``procs`` exits."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            return False
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    return False


def prepare_models(a: argparse.Namespace, cache: Path) -> None:
    """Assemble/convert the target and export the hosted draft models once, up
    front, so that the services do not race to write the same files."""
    from draft_service.export import ensure_onnx
    from draft_service.onnx_model import resolve_execution
    from specdec.models import prepare, resolve

    print(f"specdec: preparing models in {cache} (first run assembles, converts and exports; later runs reuse the cache)",
          flush=True)
    exports = [] if a.no_draft else draft_cli.models_to_export(a)
    prepare([a.target_model] + [m for m, _ in exports], cache)
    for model, precision in exports:
        ensure_onnx(resolve(model, cache).hf_dir, cache, precision, resolve_execution(a.draft_execution))


def cmd_up(a: argparse.Namespace) -> int:
    """Starts target, draft and orchestrator as child processes."""
    from specdec.models import default_cache_dir

    cache = str(a.cache_dir or default_cache_dir())
    # bad flags stop here, before any child starts
    target_cli.config_from_args(a, a.target_port)
    orchestrator_cli.check_speculation_args(a)
    if not a.no_draft:
        draft_cli.config_from_args(a, a.draft_port)
    cmds, tls = child_commands(a, cache)
    procs: dict[str, subprocess.Popen[bytes]] = {}

    def _interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    # Ctrl-C, and SIGTERM from a supervisor, stop all three (SIGINT is ignored
    # by default in background jobs, so install both explicitly).
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    prepare_models(a, Path(cache))
    ports = {"target": a.target_port, "draft": a.draft_port, "orchestrator": a.port, "gateway": a.gateway_port}
    try:
        # One at a time: the draft measures its cost per token at warm-up and
        # the target calibrates its numerics (docs/architecture.md); on a
        # shared CPU each must have the cores to itself to measure anything.
        for name in ("draft", "target", "orchestrator", "gateway"):
            if name not in cmds:
                continue
            procs[name] = subprocess.Popen(cmds[name], start_new_session=True)
            address = f"127.0.0.1:{ports[name]}"
            ready = (wait_http_ready(f"http://{address}/ready", a.ready_timeout, list(procs.values()))
                     if name == "gateway" else wait_healthy(address, a.ready_timeout, list(procs.values()), tls))
            if not ready:
                print(f"specdec: {name} did not become healthy", file=sys.stderr, flush=True)
                return 1
            print(f"specdec: {name:<12} SERVING on 127.0.0.1:{ports[name]}", flush=True)
        hint = f" --tls-ca {Path(a.tls_dir) / 'ca.crt'}" if a.tls_dir is not None else ""
        hint += " --token-file FILE" if a.auth_tokens_file is not None else ""
        print(f"specdec: ready. Try: specdec generate \"def fib(n):\" --address 127.0.0.1:{a.port}{hint}", flush=True)
        if "gateway" in cmds:
            print(f"specdec: OpenAI-compatible API on http://127.0.0.1:{a.gateway_port}/v1", flush=True)
        if a.ready_file:
            Path(a.ready_file).write_text(json.dumps({k: f"127.0.0.1:{v}" for k, v in ports.items() if k in procs}))
        while all(p.poll() is None for p in procs.values()):
            time.sleep(1.0)
        print("specdec: a service exited; stopping the others", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("\nspecdec: stopping", flush=True)
        return 0
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(timeout=a.drain_timeout + 20)
            except subprocess.TimeoutExpired:
                p.kill()
