"""Typed configuration of the draft service (built by the CLI or tests; no
environment reads at import time)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from specdec.grpc_util import DEFAULT_MAX_MESSAGE_BYTES
from specdec.memory import DEFAULT_MMAP_THRESHOLD, check_mmap_threshold
from specdec.tls import TlsServerConfig


DRAFTER_KINDS = ("onnx", "tli", "prompt-lookup", "auto")
# onnxruntime's intra-op workers between ops and between runs: "on" spins in
# both (it holds a core between runs, ~100 % of one core while idle), "run"
# spins within a run and stops when it returns (session.force_spinning_stop),
# "off" sleeps between ops (a wake-up per op: ~3-4 ms more per 0.5B token)
SPIN_MODES = ("on", "run", "off")


def check_spin(spin: str) -> None:
    """ValueError unless ``spin`` is one of SPIN_MODES (the config's and the
    ONNX model's check, one message)."""
    if spin not in SPIN_MODES:
        raise ValueError(f"spin must be one of {', '.join(SPIN_MODES)}, got {spin!r}")


@dataclass
class DrafterSpec:
    """One hosted drafter.

    kind: ``onnx`` (a draft model sharing the target's tokenizer), ``tli`` (a
    draft model with another tokenizer, token-level intersection; needs
    ``DraftServiceConfig.target_tokenizer``), ``prompt-lookup`` (no model;
    ``model`` is ignored) or ``auto`` (prompt lookup while it matches well,
    else the hosted model drafter named by ``fallback``).
    """

    name: str  # the name clients select with CreateDraftSessionRequest.drafter
    model: str = ""  # a model spec for specdec.models.resolve, or a local HF directory
    precision: str = "int4"  # ONNX export precision: int4 | int8 | fp32 (fp16/bf16 on cuda)
    onnx_dir: Path | None = None  # a ready export (holds model.onnx); skips resolve + export
    kind: str = "onnx"
    lookbehind_tokens: int = 8  # tli: draft tokens re-tokenized behind the end each round
    min_ngram: int = 1  # prompt-lookup: shortest suffix matched
    max_ngram: int = 4  # prompt-lookup: longest suffix matched (tried first)
    fallback: str = ""  # auto: name of the hosted onnx/tli drafter used when prompt lookup is not matching


@dataclass
class DraftServiceConfig:
    drafters: list[DrafterSpec] = field(default_factory=list)
    default_drafter: str | None = None  # None = the first drafter
    # The target's tokenizer (model spec or HF directory): the vocabulary that
    # tli and prompt-lookup drafters propose in, and report in GetModelInfo.
    target_tokenizer: str | None = None
    host: str = "127.0.0.1"
    port: int = 50052  # 0 = pick a free port
    max_sessions: int = 256
    max_span: int = 16  # largest num_tokens (γ) per Propose
    max_support: int = 64  # largest sparse q per drafted position (top-K truncation)
    intra_op_threads: int = 0  # onnxruntime intra-op threads; 0 = onnxruntime's default (all cores)
    spin: str = "on"  # onnxruntime workers' spin-wait, one of SPIN_MODES
    execution: str = "auto"  # auto | cpu | cuda
    cache_dir: Path | None = None  # model + ONNX cache; None = specdec.models.default_cache_dir()
    session_ttl_s: float = 600.0  # idle sessions are reaped after this
    max_cache_tokens: int = 0  # per-session KV limit; 0 = the model's context length (capped at the KV budget)
    # A catch-up prefill (a new session's prompt, a long delta) runs at most this many
    # context tokens per forward, each chunk its own model-worker job, so other sessions'
    # calls run between the chunks and a cancelled call stops within one (0 = all at once).
    prefill_chunk_tokens: int = 128
    # The KV budget over all sessions and stored prefixes (draft_service/draft_kv.py):
    # in tokens, or in bytes when kv_budget_bytes > 0.
    kv_budget_tokens: int = 65_536
    kv_budget_bytes: int = 0
    kv_protect_active_s: float = 10.0  # a session used within this is never evicted for the budget (0 = plain LRU)
    prefix_cache: bool = True  # released sessions' KV is reused by new sessions sharing a prefix
    prefix_cache_entries: int = 64  # stored prefixes at most (they also count in the KV budget)
    max_queue: int = 256  # pending model jobs before RESOURCE_EXHAUSTED
    # glibc's mmap threshold (specdec/memory.py): the KV buffers (grown by doubling) and
    # logits get pages of their own, untouched capacity is never resident, and a freed
    # buffer leaves RSS at once; 0 = glibc's dynamic threshold
    memory_mmap_threshold_bytes: int = DEFAULT_MMAP_THRESHOLD
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    warmup: bool = True
    metrics_port: int = 0  # Prometheus /metrics HTTP port; 0 = off
    metrics_host: str = "127.0.0.1"
    health_port: int = 0  # plaintext port serving only grpc.health.v1 (kubelet probes when TLS is on); 0 = off
    tls: TlsServerConfig | None = None  # None = plaintext; client_ca set = mutual TLS

    def resolved_cache_dir(self) -> Path:
        if self.cache_dir is not None:
            return Path(self.cache_dir).expanduser()
        from specdec.models import default_cache_dir

        return default_cache_dir()

    def validate(self) -> None:
        if not self.drafters:
            raise ValueError("the draft service needs at least one drafter")
        names = [d.name for d in self.drafters]
        if len(set(names)) != len(names):
            raise ValueError(f"drafter names must be unique: {names}")
        for d in self.drafters:
            if d.kind not in DRAFTER_KINDS:
                raise ValueError(f"drafter {d.name!r}: kind must be one of {DRAFTER_KINDS}, got {d.kind!r}")
            if d.kind == "auto":
                fb = next((x for x in self.drafters if x.name == d.fallback), None)
                if fb is None or fb.kind not in ("onnx", "tli"):
                    raise ValueError(f"drafter {d.name!r} (auto): fallback must name a hosted onnx or tli drafter")
            if d.kind in ("onnx", "tli") and not d.model and d.onnx_dir is None:
                raise ValueError(f"drafter {d.name!r} ({d.kind}) needs a model")
            if d.kind == "tli" and not self.target_tokenizer:
                raise ValueError(f"drafter {d.name!r} (tli) needs target_tokenizer")
            if d.kind in ("prompt-lookup", "auto") and not 1 <= d.min_ngram <= d.max_ngram:
                raise ValueError(f"drafter {d.name!r}: need 1 <= min_ngram <= max_ngram")
            if d.lookbehind_tokens < 0:
                raise ValueError(f"drafter {d.name!r}: lookbehind_tokens must be >= 0")
        if self.default_drafter is not None and self.default_drafter not in names:
            raise ValueError(f"default_drafter {self.default_drafter!r} is not one of {names}")
        if self.max_span < 1 or self.max_support < 1 or self.max_sessions < 1:
            raise ValueError("max_span, max_support and max_sessions must be >= 1")
        if self.kv_budget_tokens < 1 and self.kv_budget_bytes < 1:
            raise ValueError("kv_budget_tokens (or kv_budget_bytes) must be >= 1")
        if self.kv_budget_bytes < 0 or self.kv_protect_active_s < 0 or self.prefix_cache_entries < 1:
            raise ValueError("kv_budget_bytes and kv_protect_active_s must be >= 0, prefix_cache_entries >= 1")
        if self.prefill_chunk_tokens < 0:
            raise ValueError("prefill_chunk_tokens must be >= 0")
        check_mmap_threshold(self.memory_mmap_threshold_bytes)
        if self.execution not in ("auto", "cpu", "cuda"):
            raise ValueError(f"execution must be auto, cpu or cuda, got {self.execution!r}")
        check_spin(self.spin)

    @property
    def default_name(self) -> str:
        return self.default_drafter or self.drafters[0].name
