"""Typed configuration of the orchestrator (built by the CLI)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from specdec.models import DEFAULT_TARGET
from specdec.tls import TlsClientConfig, TlsServerConfig


@dataclass
class RoutingConfig:
    """How the orchestrator spreads sessions over target and draft replicas
    (see orchestrator/routing.py and docs/deploy.md)."""

    discovery_interval_s: float = 5.0  # re-resolve dns:/// and file:// entries this often
    health_interval_s: float = 2.0  # grpc.health.v1 Check of every replica this often
    health_timeout_s: float = 1.0
    backoff_s: float = 2.0  # a replica that failed a call gets no new sessions this long (doubling)
    max_backoff_s: float = 30.0
    target_load_factor: float = 1.25  # bounded-load hashing: a replica takes ≤ c × the mean sessions
    # a replica gone from discovery: its channel is closed once its sessions
    # ended (they fail over if it dies), or after this as a safety net
    close_removed_after_s: float = 600.0


@dataclass
class OrchestratorConfig:
    # host:port, dns:///name:port (re-resolved: a headless Service) or
    # file:///path (one address per line, re-read); see orchestrator/routing.py
    target_addresses: list[str] = field(default_factory=lambda: ["127.0.0.1:50053"])
    draft_addresses: list[str] = field(default_factory=lambda: ["127.0.0.1:50052"])  # [] = no draft (target-only)
    tokenizer: str = DEFAULT_TARGET  # model spec whose tokenizer is used
    host: str = "127.0.0.1"
    port: int = 50051  # 0 = pick a free port
    cache_dir: Path | None = None
    default_max_new_tokens: int = 256
    max_new_tokens_limit: int = 4096
    default_num_draft_tokens: int = 4  # γ for FIXED and HEURISTIC's start when the request leaves it 0 (AUTO: adaptive_gamma_max)
    max_num_draft_tokens: int = 16
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256
    max_prompt_chars: int = 1_000_000
    # ... and at most this many characters per token of the model's context
    # (tokenizing a prompt that cannot fit costs seconds of CPU before it is
    # refused; real text runs 2-5 characters per token)
    max_prompt_chars_per_context_token: int = 8
    max_concurrent_streams: int = 256
    draft_timeout_s: float = 5.0  # one Propose call; past it the round runs target-only
    draft_retry_after_rounds: int = 4  # rounds to wait before trying a failed draft again
    # How requests reach the draft (a request's speculation.draft_mode wins):
    # unary (a Propose call per round), stream (one Session stream per
    # request), run-ahead (the stream drafts past the span while the target
    # verifies it); docs/architecture.md "Draft streams and run-ahead". unary
    # measured fastest with draft and target on shared cores (docs/benchmarks.md)
    draft_mode: str = "unary"
    run_ahead_tokens: int = 8  # run-ahead: tokens the draft may draft past the round's span
    # Decode-ahead: a request decoding without a drafter (OFF) lets the target
    # run up to this many plain steps ahead on its Verify stream, so a token's
    # round trip overlaps the next step (the same tokens; docs/design.md).
    # 0 = off. Wasted steps at a stop string or a cancel: at most this many.
    decode_ahead: int = 16
    target_timeout_s: float = 120.0  # one Verify/Prefill call (bounded by the client deadline)
    # unary: the draft takes the prompt in while the target prefills it (a background Propose,
    # never awaited before the first token): "on", "off", or "auto" = on unless draft and
    # target both run on CPU (on one machine's cores the draft's prefill slows the target's)
    draft_prefill_overlap: str = "auto"
    # Prompt lookup in the orchestrator for requests that draft with ``auto``
    # (orchestrator/lookup.py): rounds whose committed suffix has a trusted
    # earlier match verify its continuation with no draft call, priced at the
    # target's verify cost alone; the model drafter serves the other rounds.
    # Unary drafting only. False: the draft service's ``auto`` decides alone.
    local_lookup: bool = True
    # Unary drafting: a catch-up of more than this many tokens (the prompt at
    # the first drafted round, the tokens since the last one after plain
    # rounds) gives the draft its first draft_context_sink tokens plus the
    # last draft_context_window committed ones instead of all of them
    # (orchestrator/draft_window.py): a bounded draft prefill, so trying the
    # drafter on a long prompt stays cheap. Acceptance only; 0 = off. 64:
    # docs/benchmarks.md "The draft's context window" (0.5B drafter, code:
    # 48 drafted as well as the whole prompt on completion and chat, 32 worse).
    draft_context_window: int = 64
    draft_context_sink: int = 4
    # Verify over one VerifyStream call per session instead of a unary call per
    # round (same answers; saves a call's set-up each round, docs/benchmarks.md);
    # a target without VerifyStream gets unary calls.
    target_verify_stream: bool = True
    # Ask draft streams for every ready event in one message (DraftOpen.batch_events)
    # instead of one message per drafted token; a draft that predates it sends
    # one per token either way.
    draft_batch_events: bool = True
    # Structured output: send the request's grammar to the draft too, so that
    # it drafts under the same mask (False: the draft proposes unmasked q;
    # output unchanged, acceptance lower).
    draft_grammar: bool = True
    release_timeout_s: float = 2.0
    max_message_bytes: int = 8 * 1024 * 1024
    metrics_port: int = 0  # Prometheus /metrics HTTP port; 0 = off (`specdec up` uses 9464)
    metrics_host: str = "127.0.0.1"
    health_port: int = 0  # plaintext port serving only grpc.health.v1 (kubelet probes when TLS is on); 0 = off
    adaptive_gamma_max: int = 16  # largest γ the adaptive policy considers (AUTO); ≤ max_num_draft_tokens
    # Draft confidence early stop for AUTO: a fixed threshold, or 0 = the
    # adaptive policy's own per-round threshold, derived from the measured
    # costs and scaled by confidence_stop_scale (0 = no early stop).
    min_confidence: float = 0.0
    confidence_stop_scale: float = 1.0
    # AUTO speculates only while at most this many streams are active; past it
    # rounds are plain decoding. -1 = from the target's device: 1 on CPU, where
    # draft and target share the cores (measured crossover, docs/benchmarks.md
    # "Load"), unlimited on accelerators, where the load-aware cost model
    # decides; 0 = unlimited.
    speculation_max_streams: int = -1
    speculation_hold_s: float = 5.0  # ... and only after the load has stayed under it this long
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    tls: TlsServerConfig | None = None  # public API TLS; None = plaintext
    upstream_tls: TlsClientConfig | None = None  # channels to draft/target; None = plaintext
    auth_tokens_file: Path | None = None  # bearer tokens for the public API; None = no authentication
    auth_protect_health: bool = False  # also require a token for health and reflection
    max_streams_per_client: int = 0  # concurrent Generate calls per client identity; 0 = unlimited
    # accept bearer tokens over plaintext off loopback (something else encrypts
    # the hop); without it such a config is refused (specdec.auth.check_token_transport)
    allow_plaintext_tokens: bool = False

    def check_token_transport(self) -> str:
        """ValueError when the public API would accept bearer tokens in
        plaintext off loopback without ``allow_plaintext_tokens``; the warning
        to log with it ("" when safe)."""
        if self.auth_tokens_file is None:
            return ""
        from specdec.auth import check_token_transport

        return check_token_transport("server", self.host, encrypted=self.tls is not None,
                                     allow_plaintext=self.allow_plaintext_tokens)
