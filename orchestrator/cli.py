"""The orchestrator's flags and config builder.

``specdec serve orchestrator`` takes all of them; ``specdec up`` adds the
speculation flags (:func:`add_speculation_arguments`) and builds the child's
command line with :meth:`FlagSet.argv`, wiring the addresses itself.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from orchestrator.config import OrchestratorConfig, RoutingConfig
from specdec.models import DEFAULT_TARGET
from specdec.service_cli import (
    DEFAULT_PORTS,
    FlagSet,
    cli_error,
    client_tls,
    serve_command,
    server_tls,
)

SERVICE = "orchestrator"


def add_speculation_arguments(p: argparse._ActionsContainer) -> FlagSet:
    """The speculation defaults (``specdec serve orchestrator`` and ``specdec up``)."""
    f = FlagSet(p)
    f.add("num-draft-tokens", type=int, default=4, help="default γ (FIXED and HEURISTIC's start)")
    f.add("speculation-max-streams", type=int, default=-1,
          help="AUTO speculates only while at most this many streams are active "
               "(-1 = 1 for a CPU target, unlimited on accelerators; 0 = unlimited)")
    f.add("confidence-stop-scale", type=float, default=1.0,
          help="AUTO's draft confidence early stop: scale × (tokens/ms) × (ms per drafted token), "
               "capped at 0.4; 0 = no early stop")
    f.add("draft-mode", default="unary", choices=["unary", "stream", "run-ahead"],
          help="how requests reach the draft (a request's speculation.draft_mode wins): a Propose call per "
               "round (fastest with draft and target on shared cores), one Session stream per request, or "
               "the stream drafting ahead while the target verifies (for draft and target on their own "
               "cores or machines; docs/architecture.md, docs/benchmarks.md)")
    f.add("run-ahead-tokens", type=int, default=8,
          help="run-ahead: at most this many tokens drafted past the round's span (and at most γ + 1)")
    f.add("decode-ahead", type=int, default=16,
          help="OFF (no drafter): the target decodes up to this many plain steps ahead on its Verify stream, "
               "overlapping each token's round trip with the next step (the same tokens); 0 = off")
    f.add("target-verify-stream", default="on", choices=["on", "off"],
          help="Verify over one stream per session instead of a unary call per round (same answers, "
               "less per-round overhead; a target without the stream method gets unary calls)")
    f.add("draft-prefill-overlap", default="auto", choices=["auto", "on", "off"],
          help="unary: the draft takes the prompt in while the target prefills it (in the background; the "
               "first token never waits for it); auto = on unless draft and target both run on CPU, where "
               "they share the cores")
    f.add("local-lookup", default="on", choices=["on", "off"],
          help="requests drafting with auto: prompt lookup in the orchestrator first (no draft call; rounds "
               "priced at the target's verify cost), the model drafter for the other rounds (unary drafting)")
    f.add("draft-context-window", type=int, default=64,
          help="unary drafting: a draft catch-up of more than this many tokens takes in the sequence's first "
               "--draft-context-sink tokens and the last this many instead (a bounded draft prefill; "
               "acceptance only, never the output); 0 = the whole context")
    f.add("draft-context-sink", type=int, default=4,
          help="with --draft-context-window: the sequence's first tokens the draft always keeps")
    f.add("draft-batch-events", default="on", choices=["on", "off"],
          help="draft streams send every ready drafted token in one message instead of one message per "
               "token (same tokens, fewer wake-ups per round)")
    return f


def check_speculation_args(a: argparse.Namespace) -> None:
    """Out-of-range speculation flags stop here with one line."""
    if a.speculation_max_streams < -1:
        raise cli_error("--speculation-max-streams must be -1 (auto), 0 (unlimited) or a positive count")
    if not 0.0 <= a.confidence_stop_scale <= 100.0:
        raise cli_error(f"--confidence-stop-scale must be in [0, 100], got {a.confidence_stop_scale}")
    if not 0 <= a.decode_ahead <= 64:
        raise cli_error("--decode-ahead must be in [0, 64]")
    if a.run_ahead_tokens < 1:
        raise cli_error("--run-ahead-tokens must be at least 1")
    if a.draft_context_window < 0 or a.draft_context_sink < 0:
        raise cli_error("--draft-context-window and --draft-context-sink must be 0 or more")


def add_arguments(p: argparse._ActionsContainer) -> None:
    """Everything ``specdec serve orchestrator`` takes besides the common server flags."""
    p.add_argument("--model", dest="target_model", default=DEFAULT_TARGET,
                   help="the target's model spec, whose tokenizer the orchestrator uses")
    p.add_argument("--target-address", default=f"127.0.0.1:{DEFAULT_PORTS['target']}",
                   help="comma-separated target replicas: host:port, dns:///name:port (re-resolved; a headless "
                        "Service), file:///path (one host:port per line, re-read)")
    p.add_argument("--draft-address", default=f"127.0.0.1:{DEFAULT_PORTS['draft']}",
                   help="comma-separated draft replicas (same forms as --target-address); '' = no draft")
    p.add_argument("--discovery-interval", type=float, default=5.0,
                   help="seconds between re-resolutions of dns:/// and file:// addresses")
    p.add_argument("--replica-backoff", type=float, default=2.0,
                   help="seconds a replica that failed a call gets no new sessions (doubles per failure, max 30)")
    p.add_argument("--target-load-factor", type=float, default=1.25,
                   help="bounded-load hashing: a target replica takes at most this × the mean sessions")
    add_speculation_arguments(p)
    p.add_argument("--default-max-new-tokens", type=int, default=256)
    p.add_argument("--min-confidence", type=float, default=0.0,
                   help="fixed draft confidence early stop for AUTO (0 = the adaptive policy's derived threshold)")
    p.add_argument("--upstream-ca", type=Path, default=None,
                   help="CA that signs the draft/target certificates; enables TLS to them")
    p.add_argument("--upstream-cert", type=Path, default=None, help="client certificate for mutual TLS to draft/target")
    p.add_argument("--upstream-key", type=Path, default=None, help="key of --upstream-cert")
    p.add_argument("--upstream-server-name", default="", help="name checked against the draft/target certificates")
    p.add_argument("--auth-tokens-file", type=Path, default=None,
                   help="bearer tokens ('token' or 'name:token[:scopes]' per line); reloaded on change or SIGHUP")
    p.add_argument("--auth-protect-health", action="store_true", help="require a token for health and reflection too")
    p.add_argument("--allow-plaintext-tokens", action="store_true",
                   help="with --auth-tokens-file and no --tls-cert on a non-loopback --host: accept tokens in "
                        "plaintext anyway (a mesh or proxy encrypts the hop; logged as a warning). Refused without it")
    p.add_argument("--max-streams-per-client", type=int, default=0,
                   help="concurrent Generate calls per client identity (token name, else peer); 0 = unlimited")


def config_from_args(a: argparse.Namespace, port: int) -> OrchestratorConfig:
    from orchestrator.routing import (
        parse_addresses,  # imports the decode loop (torch): only when serving
    )

    try:
        targets, drafts = parse_addresses(a.target_address), parse_addresses(a.draft_address)
    except ValueError as e:
        raise cli_error(f"--target-address/--draft-address: {e}") from None
    if not targets:
        raise cli_error("--target-address: at least one target is required")
    if a.target_load_factor < 1.0:
        raise cli_error("--target-load-factor must be at least 1")
    if not 0.0 <= a.min_confidence < 1.0:
        raise cli_error(f"--min-confidence must be in [0, 1), got {a.min_confidence}")
    check_speculation_args(a)
    cfg = OrchestratorConfig(
        target_addresses=targets, draft_addresses=drafts, tokenizer=a.target_model,
        host=a.host, port=port, cache_dir=a.cache_dir, default_num_draft_tokens=a.num_draft_tokens,
        default_max_new_tokens=a.default_max_new_tokens, metrics_port=a.metrics_port,
        metrics_host=a.metrics_host, min_confidence=a.min_confidence, health_port=a.health_port,
        confidence_stop_scale=a.confidence_stop_scale,
        speculation_max_streams=a.speculation_max_streams,
        draft_mode=a.draft_mode, run_ahead_tokens=a.run_ahead_tokens, decode_ahead=a.decode_ahead,
        target_verify_stream=a.target_verify_stream == "on",
        draft_batch_events=a.draft_batch_events == "on", draft_prefill_overlap=a.draft_prefill_overlap,
        local_lookup=a.local_lookup == "on",
        draft_context_window=a.draft_context_window, draft_context_sink=a.draft_context_sink,
        routing=RoutingConfig(discovery_interval_s=a.discovery_interval, backoff_s=a.replica_backoff,
                              target_load_factor=a.target_load_factor),
        tls=server_tls(a),
        upstream_tls=client_tls(a.upstream_ca, a.upstream_cert, a.upstream_key, a.upstream_server_name),
        auth_tokens_file=a.auth_tokens_file, auth_protect_health=a.auth_protect_health,
        max_streams_per_client=a.max_streams_per_client, allow_plaintext_tokens=a.allow_plaintext_tokens,
    )
    try:
        cfg.check_token_transport()  # refused here with a one-line error; start() logs the warning
    except ValueError as e:
        raise cli_error(str(e)) from None
    return cfg


def add_serve_command(sub: Any) -> None:
    """``specdec serve orchestrator``."""
    serve_command(sub, SERVICE, "the public Generate API: the draft → verify loop, routing, streaming",
                          add_arguments, "orchestrator.server", config_from_args)
