"""The ``specdec`` command line: a thin layer that builds each service's typed
config from flags and hands it down."""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"
DEFAULT_PORTS = {"orchestrator": 50051, "draft": 50052, "target": 50053}


# ----------------------------------------------------------------- serve
def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 in containers)")
    p.add_argument("--cache-dir", type=Path, default=None, help="model cache (default $SPECDEC_CACHE_DIR or ~/.cache/specdec)")
    p.add_argument("--log-level", default="info")
    p.add_argument("--metrics-host", default="127.0.0.1", help="bind address of the Prometheus /metrics endpoint")
    p.add_argument("--health-port", type=int, default=0,
                   help="also serve grpc.health.v1 alone, in plaintext, on this port (Kubernetes gRPC probes "
                        "when the service port uses TLS); 0 = off")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM: seconds to keep serving open sessions/streams (health NOT_SERVING, "
                        "new ones refused) before stopping")


def _add_target_flags(p: argparse.ArgumentParser, prefix: str = "") -> None:
    p.add_argument(f"--{prefix}model", dest="target_model", default=DEFAULT_TARGET,
                   help="target model spec: built-in name, .gguf file, local HF dir or hub id")
    _add_numerics_flags(p, prefix)
    p.add_argument(f"--{prefix}device", dest="target_device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument(f"--{prefix}threads", dest="target_threads", type=int, default=0, help="torch CPU threads (0 = all)")
    p.add_argument(f"--{prefix}kv-budget-tokens", dest="target_kv_budget", type=int, default=65_536)
    _add_batch_flags(p, prefix)


def _add_numerics_flags(p: argparse._ActionsContainer, prefix: str = "") -> None:
    """The target's dtype and compute backend (``serve target`` and ``up``)."""
    p.add_argument(f"--{prefix}dtype", dest="target_dtype", default="auto",
                   choices=["auto", "bfloat16", "float32", "float16"],
                   help="target dtype; auto = calibrated at start-up on CPU (bf16 on CUDA)")
    p.add_argument(f"--{prefix}backend", dest="target_backend", default="auto", choices=["auto", "eager", "packed", "bf16w"],
                   help="target compute backend: eager; packed (every linear prepacked for oneDNN, CPU); "
                        "bf16w (bfloat16 linear weights, float32 activations, AVX2 kernel); auto = calibrated at start-up")
    p.add_argument(f"--{prefix}calibrate", dest="target_calibrate", default="on", choices=["on", "off"],
                   help="time the target's forward cost t(k) at start-up (cached per machine and model); "
                        "off with dtype/backend auto takes bf16 eager untimed")


def _add_batch_flags(p: argparse._ActionsContainer, prefix: str = "") -> None:
    """Target batching and admission flags (``specdec serve target`` and ``specdec up``)."""
    p.add_argument(f"--{prefix}max-batch-size", dest="max_batch_size", type=int, default=16,
                   help="target: calls from different sessions per forward pass (1 = unbatched)")
    p.add_argument(f"--{prefix}batch-window-ms", dest="batch_window_ms", type=float, default=2.0,
                   help="target: longest wait for more calls to batch after the oldest queued one")
    p.add_argument(f"--{prefix}batch-regroup-ms", dest="batch_regroup_ms", type=float, default=25.0,
                   help="target: after a forward pass, longest wait for the sessions it served to send their "
                        "next call, so streams in lockstep share one batch (at most 10%% of the pass; 0 = off)")
    p.add_argument(f"--{prefix}max-batch-tokens", dest="max_batch_tokens", type=int, default=512,
                   help="target: padded input tokens per forward pass (rows x longest input)")
    p.add_argument(f"--{prefix}max-queue", dest="max_queue", type=int, default=256,
                   help="pending model calls before RESOURCE_EXHAUSTED")
    p.add_argument(f"--{prefix}max-sessions", dest="target_max_sessions", type=int, default=64,
                   help="target: sessions (KV caches) held at once")
    p.add_argument(f"--{prefix}session-ttl", dest="target_session_ttl", type=float, default=600.0,
                   help="target: idle sessions are released after this many seconds")
    p.add_argument(f"--{prefix}kv-protect-active", dest="target_kv_protect", type=float, default=10.0,
                   help="target: a new session never evicts one used within this many seconds (it gets "
                        "RESOURCE_EXHAUSTED instead; 0 = plain LRU eviction)")
    p.add_argument(f"--{prefix}max-span", dest="target_max_span", type=int, default=32,
                   help="target: longest drafted span a Verify accepts")


def _add_speculation_flags(p: argparse._ActionsContainer) -> None:
    """The orchestrator's speculation defaults (``specdec serve orchestrator`` and ``specdec up``)."""
    p.add_argument("--num-draft-tokens", type=int, default=4, help="default γ (FIXED and HEURISTIC's start)")
    p.add_argument("--speculation-max-streams", type=int, default=-1,
                   help="AUTO speculates only while at most this many streams are active "
                        "(-1 = 1 for a CPU target, unlimited on accelerators; 0 = unlimited)")
    p.add_argument("--confidence-stop-scale", type=float, default=1.0,
                   help="AUTO's draft confidence early stop: scale × (tokens/ms) × (ms per drafted token), "
                        "capped at 0.4; 0 = no early stop")
    p.add_argument("--draft-mode", default="unary", choices=["unary", "stream", "run-ahead"],
                   help="how requests reach the draft (a request's speculation.draft_mode wins): a Propose call per "
                        "round (fastest with draft and target on shared cores), one Session stream per request, or "
                        "the stream drafting ahead while the target verifies (for draft and target on their own "
                        "cores or machines; docs/architecture.md, docs/benchmarks.md)")
    p.add_argument("--run-ahead-tokens", type=int, default=8,
                   help="run-ahead: at most this many tokens drafted past the round's span (and at most γ + 1)")


def _add_draft_flags(p: argparse.ArgumentParser, prefix: str = "") -> None:
    p.add_argument(f"--{prefix}model", dest="draft_model", default=DEFAULT_DRAFT, help="draft model spec")
    p.add_argument(f"--{prefix}precision", dest="draft_precision", default="int4", choices=["int4", "int8", "fp32", "fp16"],
                   help="ONNX export precision of the draft")
    p.add_argument(f"--{prefix}execution", dest="draft_execution", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument(f"--{prefix}threads", dest="draft_threads", type=int, default=0, help="onnxruntime intra-op threads (0 = all)")
    # `specdec up` runs draft and target on the same cores, where the draft's
    # spinning workers slow the target's next verify (docs/benchmarks.md);
    # `specdec serve draft` (its own pod) keeps spinning on.
    p.add_argument(f"--{prefix}spin", dest="draft_spin", default="off", choices=["on", "off"],
                   help="onnxruntime worker spin-waiting (on: lower draft latency; off, the default here: "
                        "frees CPU for the co-located target)")
    _add_drafter_choice_flags(p, prefix)


# Built-in drafter names (requests choose one with speculation.drafter).
MODEL_DRAFTER = "qwen2.5-coder-0.5b"  # the same-tokenizer model drafter (--draft-model)
TLI_DRAFTER = "smollm2-135m"  # the different-tokenizer drafter (token-level intersection)
PROMPT_LOOKUP_DRAFTER = "prompt-lookup"  # model-free n-gram drafter
AUTO_DRAFTER = "auto"  # optional: prompt lookup while it matches well, else the model drafter
DEFAULT_DRAFTERS = f"{MODEL_DRAFTER},{TLI_DRAFTER},{PROMPT_LOOKUP_DRAFTER}"
DEFAULT_TLI_MODEL = "smollm2-135m-instruct"


def _add_drafter_choice_flags(p: argparse._ActionsContainer, prefix: str = "") -> None:
    p.add_argument("--drafters", default=DEFAULT_DRAFTERS,
                   help=f"comma-separated drafters the draft service hosts (built-ins: {DEFAULT_DRAFTERS}; "
                        f"optional: {AUTO_DRAFTER}, prompt lookup while it matches well, else the model drafter)")
    p.add_argument("--default-drafter", default=None,
                   help=f"drafter for requests that name none (default: {MODEL_DRAFTER} when hosted, else the first)")
    p.add_argument(f"--{prefix}tli-model", dest="tli_model", default=DEFAULT_TLI_MODEL,
                   help=f"model of the {TLI_DRAFTER} (different-tokenizer) drafter")
    p.add_argument(f"--{prefix}tli-precision", dest="tli_precision", default="int4",
                   choices=["int4", "int8", "fp32", "fp16"], help=f"ONNX export precision of the {TLI_DRAFTER} drafter")


def _drafter_names(a: argparse.Namespace) -> list[str]:
    names = [n.strip() for n in str(a.drafters).split(",") if n.strip()]
    unknown = [n for n in names if n not in (MODEL_DRAFTER, TLI_DRAFTER, PROMPT_LOOKUP_DRAFTER, AUTO_DRAFTER)]
    if unknown or not names:
        raise SystemExit(f"specdec: --drafters: unknown or empty {unknown or names}; "
                         f"built-ins: {DEFAULT_DRAFTERS},{AUTO_DRAFTER}")
    if AUTO_DRAFTER in names and MODEL_DRAFTER not in names and TLI_DRAFTER not in names:
        raise SystemExit(f"specdec: --drafters: {AUTO_DRAFTER} needs {MODEL_DRAFTER} or {TLI_DRAFTER} as its fallback")
    return names


def _add_tls_server_flags(p: argparse._ActionsContainer) -> None:
    p.add_argument("--tls-cert", type=Path, default=None, help="server certificate (PEM); with --tls-key serves TLS")
    p.add_argument("--tls-key", type=Path, default=None, help="server private key (PEM)")
    p.add_argument("--tls-client-ca", type=Path, default=None,
                   help="require client certificates signed by this CA (mutual TLS)")


def _server_tls(a: argparse.Namespace) -> Any:
    from specdec.tls import server_tls

    try:
        return server_tls(getattr(a, "tls_cert", None), getattr(a, "tls_key", None), getattr(a, "tls_client_ca", None))
    except ValueError as e:
        raise SystemExit(f"specdec: {e}") from None


def _client_tls(ca: Any, cert: Any = None, key: Any = None, server_name: str = "") -> Any:
    from specdec.tls import client_tls

    try:
        return client_tls(ca, cert, key, server_name)
    except ValueError as e:
        raise SystemExit(f"specdec: {e}") from None


def target_config(a: argparse.Namespace, port: int) -> Any:
    from target_service.config import TargetServiceConfig

    cfg = TargetServiceConfig(
        model=a.target_model, host=a.host, port=port, dtype=a.target_dtype, device=a.target_device,
        backend=a.target_backend, calibrate=a.target_calibrate == "on",
        threads=a.target_threads, cache_dir=a.cache_dir, kv_budget_tokens=a.target_kv_budget,
        metrics_port=a.metrics_port, metrics_host=a.metrics_host, health_port=a.health_port,
        tls=_server_tls(a),
        max_batch_size=a.max_batch_size, batch_window_ms=a.batch_window_ms, batch_regroup_ms=a.batch_regroup_ms,
        max_batch_tokens=a.max_batch_tokens, max_queue=a.max_queue,
        max_sessions=a.target_max_sessions, session_ttl_s=a.target_session_ttl,
        kv_protect_active_s=a.target_kv_protect, max_span=a.target_max_span,
    )
    try:
        cfg.validate()
    except ValueError as e:
        # name the flags the user typed, not the config fields behind them
        prefix = "target-" if getattr(a, "cmd", "") == "up" else ""
        msg = str(e)
        for field_name, flag in _BATCH_FLAGS.items():
            msg = re.sub(rf"\b{field_name}\b", f"--{prefix}{flag}", msg)
        raise SystemExit(f"specdec: {msg}") from None
    from target_service.calibration import resolve_pairs
    from target_service.engine import pick_device

    try:  # a pair this machine cannot run stops here, with one line, before anything loads
        resolve_pairs(cfg.dtype, cfg.backend, pick_device(cfg.device))
    except ValueError as e:
        raise SystemExit(f"specdec: {e}") from None
    return cfg


_BATCH_FLAGS = {"max_sessions": "max-sessions", "session_ttl_s": "session-ttl",
                "kv_protect_active_s": "kv-protect-active", "max_span": "max-span",
                "max_batch_size": "max-batch-size", "max_batch_tokens": "max-batch-tokens",
                "max_batch_kv_tokens": "kv-budget-tokens", "batch_window_ms": "batch-window-ms",
                "regroup_ms": "batch-regroup-ms"}


def draft_config(a: argparse.Namespace, port: int) -> Any:
    from draft_service.config import DraftServiceConfig, DrafterSpec

    # the model drafter keeps its built-in name on the default model, else the model's name
    model_name = MODEL_DRAFTER if a.draft_model == DEFAULT_DRAFT else Path(a.draft_model).name or a.draft_model
    specs = []
    for n in _drafter_names(a):
        if n == MODEL_DRAFTER:
            specs.append(DrafterSpec(name=model_name, model=a.draft_model, precision=a.draft_precision))
        elif n == TLI_DRAFTER:
            specs.append(DrafterSpec(name=TLI_DRAFTER, model=a.tli_model, precision=a.tli_precision, kind="tli"))
        elif n == AUTO_DRAFTER:
            fallback = model_name if MODEL_DRAFTER in _drafter_names(a) else TLI_DRAFTER
            specs.append(DrafterSpec(name=AUTO_DRAFTER, kind="auto", fallback=fallback))
        else:
            specs.append(DrafterSpec(name=PROMPT_LOOKUP_DRAFTER, kind="prompt-lookup"))
    names = [d.name for d in specs]
    default = a.default_drafter or MODEL_DRAFTER
    default = model_name if default == MODEL_DRAFTER and model_name in names else default
    if a.default_drafter is None and default not in names:
        default = names[0]
    return DraftServiceConfig(
        host=a.host, port=port, drafters=specs, default_drafter=default,
        target_tokenizer=getattr(a, "target_tokenizer", None) or DEFAULT_TARGET,
        intra_op_threads=a.draft_threads, execution=a.draft_execution, cache_dir=a.cache_dir,
        allow_spinning=a.draft_spin == "on", metrics_port=a.metrics_port, metrics_host=a.metrics_host,
        health_port=a.health_port,
        tls=_server_tls(a),
        max_queue=a.max_queue,
    )


def _check_confidence_stop_scale(scale: float) -> None:
    if not 0.0 <= scale <= 100.0:
        raise SystemExit(f"specdec: --confidence-stop-scale must be in [0, 100], got {scale}")


def orchestrator_config(a: argparse.Namespace, port: int) -> Any:
    from orchestrator.config import OrchestratorConfig, RoutingConfig
    from orchestrator.routing import parse_addresses

    try:
        targets, drafts = parse_addresses(a.target_address), parse_addresses(a.draft_address)
    except ValueError as e:
        raise SystemExit(f"specdec: --target-address/--draft-address: {e}") from None
    if not targets:
        raise SystemExit("specdec: --target-address: at least one target is required")
    if a.target_load_factor < 1.0:
        raise SystemExit("specdec: --target-load-factor must be at least 1")
    if a.speculation_max_streams < -1:
        raise SystemExit("specdec: --speculation-max-streams must be -1 (auto), 0 (unlimited) or a positive count")
    if not 0.0 <= a.min_confidence < 1.0:
        raise SystemExit(f"specdec: --min-confidence must be in [0, 1), got {a.min_confidence}")
    if a.run_ahead_tokens < 1:
        raise SystemExit("specdec: --run-ahead-tokens must be at least 1")
    _check_confidence_stop_scale(a.confidence_stop_scale)
    return OrchestratorConfig(
        target_addresses=targets, draft_addresses=drafts, tokenizer=a.target_model,
        host=a.host, port=port, cache_dir=a.cache_dir, default_num_draft_tokens=a.num_draft_tokens,
        default_max_new_tokens=a.default_max_new_tokens, metrics_port=a.metrics_port,
        metrics_host=a.metrics_host, min_confidence=a.min_confidence, health_port=a.health_port,
        confidence_stop_scale=a.confidence_stop_scale,
        speculation_max_streams=a.speculation_max_streams,
        draft_mode=a.draft_mode, run_ahead_tokens=a.run_ahead_tokens,
        routing=RoutingConfig(discovery_interval_s=a.discovery_interval, backoff_s=a.replica_backoff,
                              target_load_factor=a.target_load_factor),
        tls=_server_tls(a),
        upstream_tls=_client_tls(a.upstream_ca, a.upstream_cert, a.upstream_key, a.upstream_server_name),
        auth_tokens_file=a.auth_tokens_file, auth_protect_health=a.auth_protect_health,
        max_streams_per_client=a.max_streams_per_client,
    )


async def _serve_forever(start: Any, config: Any, drain_timeout_s: float) -> None:
    server = await start(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if hasattr(server, "reload"):  # SIGHUP re-reads the auth tokens file
        loop.add_signal_handler(signal.SIGHUP, server.reload)
    await stop.wait()
    # Health goes NOT_SERVING first and new sessions/streams are refused; open
    # ones are served until they end (up to --drain-timeout); then in-flight
    # calls get a grace period.
    await server.drain(drain_timeout_s)
    await server.stop(grace=10.0)


def cmd_serve(a: argparse.Namespace) -> int:
    from specdec.logging_util import setup_logging

    setup_logging(a.log_level, a.service)
    port = a.port if a.port is not None else DEFAULT_PORTS[a.service]
    a.target_model = a.model or DEFAULT_TARGET
    a.draft_model = a.model or DEFAULT_DRAFT
    a.target_threads = a.draft_threads = a.threads
    if a.service == "target":
        from target_service.server import start

        config = target_config(a, port)
    elif a.service == "draft":
        from draft_service.server import start  # type: ignore[no-redef]

        config = draft_config(a, port)
    else:
        from orchestrator.server import start  # type: ignore[no-redef]

        config = orchestrator_config(a, port)
    asyncio.run(_serve_forever(start, config, a.drain_timeout))
    return 0


# -------------------------------------------------------------------- up
def _wait_healthy(address: str, timeout_s: float, procs: list[subprocess.Popen[bytes]], tls: Any = None) -> bool:
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


def cmd_up(a: argparse.Namespace) -> int:
    """Starts target, draft and orchestrator as child processes."""
    from specdec.models import default_cache_dir

    cache = str(a.cache_dir or default_cache_dir())
    target_config(a, a.target_port)  # bad target flags stop here, before any child starts
    _check_confidence_stop_scale(a.confidence_stop_scale)
    base = [sys.executable, "-m", "specdec.cli", "serve"]
    common = ["--host", a.host, "--cache-dir", cache, "--log-level", a.log_level, "--drain-timeout", str(a.drain_timeout)]
    tport, dport, oport = a.target_port, a.draft_port, a.port
    cmds = {
        "target": base + ["target", "--port", str(tport), "--model", a.target_model, "--dtype", a.target_dtype,
                          "--backend", a.target_backend, "--calibrate", a.target_calibrate,
                          "--device", a.target_device, "--threads", str(a.target_threads),
                          "--kv-budget-tokens", str(a.target_kv_budget),
                          "--max-batch-size", str(a.max_batch_size), "--batch-window-ms", str(a.batch_window_ms),
                          "--batch-regroup-ms", str(a.batch_regroup_ms),
                          "--max-batch-tokens", str(a.max_batch_tokens), "--max-queue", str(a.max_queue),
                          "--max-sessions", str(a.target_max_sessions), "--session-ttl", str(a.target_session_ttl),
                          "--kv-protect-active", str(a.target_kv_protect), "--max-span", str(a.target_max_span),
                          "--metrics-port", str(a.metrics_port + 2 if a.metrics_port else 0)] + common,
        "orchestrator": base + ["orchestrator", "--port", str(oport), "--target-address", f"127.0.0.1:{tport}",
                                "--draft-address", "" if a.no_draft else f"127.0.0.1:{dport}",
                                "--model", a.target_model, "--num-draft-tokens", str(a.num_draft_tokens),
                                "--speculation-max-streams", str(a.speculation_max_streams),
                                "--confidence-stop-scale", str(a.confidence_stop_scale),
                                "--draft-mode", a.draft_mode, "--run-ahead-tokens", str(a.run_ahead_tokens),
                                "--metrics-port", str(a.metrics_port)] + common,
    }
    if not a.no_draft:
        cmds["draft"] = base + ["draft", "--port", str(dport), "--model", a.draft_model,
                                "--precision", a.draft_precision, "--execution", a.draft_execution,
                                "--threads", str(a.draft_threads), "--spin", a.draft_spin,
                                "--metrics-port", str(a.metrics_port + 1 if a.metrics_port else 0),
                                "--drafters", ",".join(_drafter_names(a)), "--tli-model", a.tli_model,
                                "--tli-precision", a.tli_precision, "--target-tokenizer", a.target_model]
        if a.default_drafter:
            cmds["draft"] += ["--default-drafter", a.default_drafter]
        cmds["draft"] += common
    tls = None
    if a.tls_dir is not None:  # the layout scripts/gen_dev_certs.sh writes
        d = Path(a.tls_dir)
        server = ["--tls-cert", str(d / "server.crt"), "--tls-key", str(d / "server.key")]
        for name in ("target", "draft"):
            if name in cmds:
                cmds[name] += server + ["--tls-client-ca", str(d / "ca.crt")]
        cmds["orchestrator"] += server + ["--upstream-ca", str(d / "ca.crt"), "--upstream-cert",
                                          str(d / "client.crt"), "--upstream-key", str(d / "client.key")]
        tls = _client_tls(d / "ca.crt", d / "client.crt", d / "client.key")
    if a.auth_tokens_file is not None:
        cmds["orchestrator"] += ["--auth-tokens-file", str(a.auth_tokens_file)]
    procs: dict[str, subprocess.Popen[bytes]] = {}

    def _interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    # Ctrl-C, and SIGTERM from a supervisor, stop all three (SIGINT is ignored
    # by default in background jobs, so install both explicitly).
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    # Models are prepared once up front, so that the services do not race to
    # assemble or convert the same files.
    from specdec.models import prepare

    print(f"specdec: preparing models in {cache} (first run assembles, converts and exports; later runs reuse the cache)", flush=True)
    drafters = [] if a.no_draft else _drafter_names(a)
    exports = ([(a.draft_model, a.draft_precision)] if MODEL_DRAFTER in drafters else []) + (
        [(a.tli_model, a.tli_precision)] if TLI_DRAFTER in drafters else [])
    prepare([a.target_model] + [m for m, _ in exports], Path(cache))
    if exports:
        from draft_service.export import ensure_onnx
        from draft_service.onnx_model import resolve_execution
        from specdec.models import resolve

        for model, precision in exports:
            ensure_onnx(resolve(model, Path(cache)).hf_dir, Path(cache), precision,
                        resolve_execution(a.draft_execution))
    try:
        ports = {"target": tport, "draft": dport, "orchestrator": oport}
        # One at a time: the draft measures its cost per token at warm-up and
        # the target calibrates its numerics (docs/architecture.md); on a
        # shared CPU each must have the cores to itself to measure anything.
        for name in ("draft", "target", "orchestrator"):
            if name not in cmds:
                continue
            procs[name] = subprocess.Popen(cmds[name], start_new_session=True)
            ok = _wait_healthy(f"127.0.0.1:{ports[name]}", a.ready_timeout, list(procs.values()), tls)
            if not ok:
                print(f"specdec: {name} did not become healthy", file=sys.stderr, flush=True)
                return 1
            print(f"specdec: {name:<12} SERVING on 127.0.0.1:{ports[name]}", flush=True)
        hint = f" --tls-ca {Path(a.tls_dir) / 'ca.crt'}" if a.tls_dir is not None else ""
        hint += " --token-file FILE" if a.auth_tokens_file is not None else ""
        print(f"specdec: ready. Try: specdec generate \"def fib(n):\" --address 127.0.0.1:{oport}{hint}", flush=True)
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


# -------------------------------------------------------------- generate
def build_request(a: argparse.Namespace) -> Any:
    from specdec.bench import speculation_config
    from specdec.v1 import common_pb2
    from specdec.v1 import orchestrator_pb2 as pb

    req = pb.GenerateRequest(
        max_new_tokens=a.max_new_tokens,
        stop=a.stop or [],
        ignore_eos=a.ignore_eos,
        speculation=speculation_config(a.mode, a.num_draft_tokens, a.drafter, a.min_confidence),
        sampling=common_pb2.SamplingParams(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k),
    )
    if a.seed is not None:
        req.sampling.seed = a.seed
    if a.chat:
        req.messages.append(pb.ChatMessage(role="user", content=a.prompt))
    else:
        req.prompt = a.prompt
    return req


def cmd_generate(a: argparse.Namespace) -> int:
    import grpc
    from google.protobuf.json_format import MessageToDict

    from specdec.v1 import orchestrator_pb2_grpc

    req = build_request(a)
    text: list[str] = []
    ids: list[int] = []
    last = None
    from specdec.tls import sync_channel

    tls = _client_tls(a.tls_ca, a.tls_cert, a.tls_key)
    metadata = None
    if a.token_file is not None:
        token = Path(a.token_file).read_text().strip()
        metadata = [("authorization", f"Bearer {token}")]
    with sync_channel(a.address, tls) as ch:
        stub = orchestrator_pb2_grpc.OrchestratorStub(ch)
        try:
            for chunk in stub.Generate(req, timeout=a.timeout, metadata=metadata):
                text.append(chunk.text)
                ids.extend(chunk.token_ids)
                last = chunk
                if not a.json:
                    print(chunk.text, end="", flush=True)
        except grpc.RpcError as e:
            print(f"\nerror: {e.code().name}: {e.details()}", file=sys.stderr)
            return 2
    assert last is not None
    stats = MessageToDict(last.stats, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    finish = last.finish_reason
    from specdec.v1 import orchestrator_pb2 as pb

    finish_name = pb.FinishReason.Name(finish)
    if a.json:
        print(json.dumps({"text": "".join(text), "token_ids": ids, "finish_reason": finish_name, "stats": stats}))
    else:
        s = last.stats
        print("\n" + "-" * 60)
        print(f"finish_reason={finish_name} tokens={s.generated_tokens} prompt_tokens={s.prompt_tokens}")
        print(f"tokens/s={s.tokens_per_second:.2f} ttft_ms={s.time_to_first_token_ms:.0f} total_ms={s.total_ms:.0f}")
        print(f"policy={s.policy or 'off'} drafter={s.drafter or '-'} "
              f"rounds={s.rounds} drafted={s.draft_tokens} accepted={s.accepted_tokens} "
              f"acceptance={s.acceptance_rate:.3f} mean_accepted_length={s.mean_accepted_length:.2f}")
        print(f"time split: draft={s.draft_ms:.0f}ms verify={s.verify_ms:.0f}ms overhead={s.overhead_ms:.0f}ms")
    return 0


def cmd_health(a: argparse.Namespace) -> int:
    """Exit 0 when the server answers SERVING within --timeout (for exec probes
    where the kubelet's plaintext gRPC probe cannot reach a TLS port)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from specdec.tls import sync_channel

    tls = _client_tls(a.tls_ca, a.tls_cert, a.tls_key, a.tls_server_name)
    with sync_channel(a.address, tls) as ch:
        try:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=a.service), timeout=a.timeout)
        except grpc.RpcError as e:
            print(f"{a.address}: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
    print(f"{a.address}: {name}")
    return 0 if r.status == health_pb2.HealthCheckResponse.SERVING else 1


# --------------------------------------------------------------- models
def cmd_models(a: argparse.Namespace) -> int:
    from specdec.logging_util import setup_logging
    from specdec.models import default_cache_dir, prepare, resolve

    setup_logging(a.log_level)
    cache = Path(a.cache_dir or default_cache_dir())
    names = a.models or [DEFAULT_TARGET, DEFAULT_DRAFT]
    for m in prepare(names, cache):
        print(f"{m.name}: {m.hf_dir}")
    if a.export_draft:
        from draft_service.export import ensure_onnx

        for name in a.export_draft:
            print(f"{name} onnx: {ensure_onnx(resolve(name, cache).hf_dir, cache, a.precision, 'cpu')}")
    return 0


def cmd_bench(a: argparse.Namespace) -> int:
    from specdec.bench import main as bench_main

    return bench_main(a)


def cmd_loadbench(a: argparse.Namespace) -> int:
    from specdec.loadbench import main as loadbench_main

    return loadbench_main(a)


# ------------------------------------------------------------------ main
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specdec", description="Lossless speculative decoding as gRPC services.")
    sub = p.add_subparsers(dest="cmd", required=True)

    up = sub.add_parser("up", help="run target, draft and orchestrator locally; Ctrl-C stops all")
    _add_common(up)
    up.add_argument("--port", type=int, default=DEFAULT_PORTS["orchestrator"], help="orchestrator port")
    up.add_argument("--target-port", type=int, default=DEFAULT_PORTS["target"])
    up.add_argument("--draft-port", type=int, default=DEFAULT_PORTS["draft"])
    _add_target_flags(up, "target-")
    _add_draft_flags(up, "draft-")
    _add_speculation_flags(up)
    up.add_argument("--metrics-port", type=int, default=9464,
                    help="orchestrator /metrics port; draft and target use the next two (0 = off)")
    up.add_argument("--no-draft", action="store_true", help="run without a draft service (target-only)")
    up.add_argument("--ready-timeout", type=float, default=1800.0)
    up.add_argument("--ready-file", default=None, help="write service addresses as JSON here once all are SERVING")
    up.add_argument("--tls-dir", type=Path, default=None,
                    help="serve TLS (mutual TLS between services) with the certificates scripts/gen_dev_certs.sh "
                         "wrote here (default: plaintext)")
    up.add_argument("--auth-tokens-file", type=Path, default=None,
                    help="require bearer tokens from this file on the public API (default: no authentication)")
    up.set_defaults(func=cmd_up)

    serve = sub.add_parser("serve", help="run one service (for containers)")
    serve.add_argument("service", choices=["target", "draft", "orchestrator"])
    _add_common(serve)
    serve.add_argument("--port", type=int, default=None, help="default: orchestrator 50051, draft 50052, target 50053")
    serve.add_argument("--metrics-port", type=int, default=0, help="Prometheus /metrics port (0 = off)")
    _add_tls_server_flags(serve.add_argument_group("transport security (all services; default plaintext)"))
    m = serve.add_argument_group("model (target and draft)")
    m.add_argument("--model", default=None, help=f"model spec (target default {DEFAULT_TARGET}, draft default {DEFAULT_DRAFT})")
    m.add_argument("--threads", type=int, default=0, help="CPU threads for the model (0 = all)")
    _add_numerics_flags(m)
    m.add_argument("--device", dest="target_device", default="auto", help="target device: auto | cpu | cuda | cuda:N")
    m.add_argument("--kv-budget-tokens", dest="target_kv_budget", type=int, default=65_536, help="target KV budget")
    _add_batch_flags(m)
    m.add_argument("--precision", dest="draft_precision", default="int4", choices=["int4", "int8", "fp32", "fp16"], help="draft ONNX precision")
    m.add_argument("--execution", dest="draft_execution", default="auto", choices=["auto", "cpu", "cuda"], help="draft execution provider")
    m.add_argument("--spin", dest="draft_spin", default="on", choices=["on", "off"], help="draft onnxruntime spin-waiting")
    _add_drafter_choice_flags(m)
    m.add_argument("--target-tokenizer", default=None,
                   help=f"draft: the target's tokenizer (model spec) that {TLI_DRAFTER} and {PROMPT_LOOKUP_DRAFTER} "
                        f"propose in (default {DEFAULT_TARGET})")
    o = serve.add_argument_group("orchestrator")
    o.add_argument("--target-address", default=f"127.0.0.1:{DEFAULT_PORTS['target']}",
                   help="comma-separated target replicas: host:port, dns:///name:port (re-resolved; a headless "
                        "Service), file:///path (one host:port per line, re-read)")
    o.add_argument("--draft-address", default=f"127.0.0.1:{DEFAULT_PORTS['draft']}",
                   help="comma-separated draft replicas (same forms as --target-address); '' = no draft")
    o.add_argument("--discovery-interval", type=float, default=5.0,
                   help="seconds between re-resolutions of dns:/// and file:// addresses")
    o.add_argument("--replica-backoff", type=float, default=2.0,
                   help="seconds a replica that failed a call gets no new sessions (doubles per failure, max 30)")
    o.add_argument("--target-load-factor", type=float, default=1.25,
                   help="bounded-load hashing: a target replica takes at most this × the mean sessions")
    _add_speculation_flags(o)
    o.add_argument("--default-max-new-tokens", type=int, default=256)
    o.add_argument("--min-confidence", type=float, default=0.0,
                   help="fixed draft confidence early stop for AUTO (0 = the adaptive policy's derived threshold)")
    o.add_argument("--upstream-ca", type=Path, default=None,
                   help="CA that signs the draft/target certificates; enables TLS to them")
    o.add_argument("--upstream-cert", type=Path, default=None, help="client certificate for mutual TLS to draft/target")
    o.add_argument("--upstream-key", type=Path, default=None, help="key of --upstream-cert")
    o.add_argument("--upstream-server-name", default="", help="name checked against the draft/target certificates")
    o.add_argument("--auth-tokens-file", type=Path, default=None,
                   help="bearer tokens ('token' or 'name:token[:scopes]' per line); reloaded on change or SIGHUP")
    o.add_argument("--auth-protect-health", action="store_true",
                   help="require a token for health and reflection too")
    o.add_argument("--max-streams-per-client", type=int, default=0,
                   help="concurrent Generate calls per client identity (token name, else peer); 0 = unlimited")
    serve.set_defaults(func=cmd_serve)

    gen = sub.add_parser("generate", help="stream a generation from the orchestrator, then print its stats")
    gen.add_argument("prompt")
    gen.add_argument("--address", default=f"127.0.0.1:{DEFAULT_PORTS['orchestrator']}")
    gen.add_argument("--chat", action="store_true", help="send the prompt as a user message (chat template)")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--mode", choices=["auto", "off", "fixed", "heuristic"], default="auto", help="speculation mode")
    gen.add_argument("--min-confidence", type=float, default=0.0, help="draft confidence early stop (0 = server default)")
    gen.add_argument("--num-draft-tokens", type=int, default=0, help="γ (0 = server default)")
    gen.add_argument("--drafter", default="", help="drafter name (default: the draft service's default)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--timeout", type=float, default=600.0, help="deadline in seconds")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    gen.add_argument("--tls-ca", type=Path, default=None, help="CA of the orchestrator certificate; enables TLS")
    gen.add_argument("--tls-cert", type=Path, default=None, help="client certificate (when the server wants one)")
    gen.add_argument("--tls-key", type=Path, default=None, help="key of --tls-cert")
    gen.add_argument("--token-file", type=Path, default=None, help="file holding the bearer token")
    gen.set_defaults(func=cmd_generate)

    hc = sub.add_parser("health", help="check a service's gRPC health (exit 0 when SERVING)")
    hc.add_argument("--address", default=f"127.0.0.1:{DEFAULT_PORTS['orchestrator']}")
    hc.add_argument("--service", default="", help="service name to check ('' = the whole server)")
    hc.add_argument("--timeout", type=float, default=5.0)
    hc.add_argument("--tls-ca", type=Path, default=None, help="CA of the server certificate; enables TLS")
    hc.add_argument("--tls-cert", type=Path, default=None, help="client certificate (mutual TLS)")
    hc.add_argument("--tls-key", type=Path, default=None, help="key of --tls-cert")
    hc.add_argument("--tls-server-name", default="", help="name checked against the server certificate")
    hc.set_defaults(func=cmd_health)

    models = sub.add_parser("models", help="prepare (assemble, verify, convert) models into the cache")
    models.add_argument("action", choices=["prepare"])
    models.add_argument("models", nargs="*", help=f"model specs (default: {DEFAULT_TARGET} {DEFAULT_DRAFT})")
    models.add_argument("--export-draft", action="append", help="also export this model to ONNX (repeatable)")
    models.add_argument("--precision", default="int4", choices=["int4", "int8", "fp32", "fp16"])
    _add_common(models)
    models.set_defaults(func=cmd_models)

    bench = sub.add_parser("bench", help="target-only vs speculative through the running services")
    from specdec.bench import add_arguments

    add_arguments(bench)
    bench.set_defaults(func=cmd_bench)

    load = sub.add_parser("loadbench", help="throughput and latency under 1..32 concurrent streams (batching, speculation on/off)")
    from specdec.loadbench import add_arguments as add_load_arguments

    add_load_arguments(load)
    load.set_defaults(func=cmd_loadbench)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
