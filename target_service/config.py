"""Typed configuration of the target service (built by the CLI, never from
environment reads at import time)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specdec.memory import DEFAULT_MMAP_THRESHOLD, check_mmap_threshold
from specdec.models import DEFAULT_TARGET
from specdec.tls import TlsServerConfig
from target_service.batching import BatchLimits


@dataclass
class TargetServiceConfig:
    model: str = DEFAULT_TARGET  # a model spec (see specdec.models.resolve)
    host: str = "127.0.0.1"
    port: int = 50053  # 0 = pick a free port
    # auto = measured at start-up (target_service/calibration.py): on CPU the
    # (dtype, backend) pair with the best expected throughput under AUTO, on
    # CUDA bf16 (fp16 where bf16 is unsupported). Explicit values win.
    dtype: str = "auto"  # auto | bfloat16 | float32 | float16
    backend: str = "auto"  # auto | eager | packed | bf16w | kquant | kquant-a8 | int4 | int4-q8 (target_service/backends.py)
    # the GGUF a local HF model directory was converted from, for the
    # quantized backends (a built-in or a .gguf spec finds its own file)
    gguf: str | None = None
    calibrate: bool = True  # time t(k) at start-up (cached per machine and model)
    calibration_budget_s: float = 30.0  # per pair; past it each remaining k is timed once
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    threads: int = 0  # torch intra-op threads on CPU; 0 = all cores
    cache_dir: Path | None = None  # model cache; None = specdec.models.default_cache_dir()
    max_sessions: int = 64
    kv_budget_tokens: int = 65_536  # total tokens held in KV caches; LRU eviction past it
    # the same budget in bytes (K+V over all layers); > 0 replaces kv_budget_tokens
    kv_budget_bytes: int = 0
    # prompts longer than this are prefilled this many tokens per forward, with
    # other sessions' verify rounds between the chunks (0 = one forward per prompt;
    # docs/design.md, "Chunked prefill", says why 256)
    prefill_chunk_tokens: int = 256
    # while other sessions decode, a chunk is cut to cost about this many of their
    # decode steps, measured online, so their streams keep their pace (0 = fixed chunks)
    prefill_share: float = 1.5
    # keep prompts and released sessions' tokens with their KV, and start a new
    # prompt from the longest stored prefix (target_service/prefix_cache.py)
    prefix_cache: bool = True
    prefix_cache_entries: int = 64  # stored prefixes at most (their tokens also count in the KV budget)
    # a new session never evicts one used within this many seconds; it gets
    # RESOURCE_EXHAUSTED instead (admission control; 0 = plain LRU eviction)
    kv_protect_active_s: float = 10.0
    max_context_tokens: int = 0  # 0 = the model's max_position_embeddings
    # between batches, at most this often, glibc's free heap pages go back to the
    # system (malloc_trim; specdec/memory.py says why); < 0 = never
    memory_trim_interval_s: float = 1.0
    # allocations of at least this many bytes get pages of their own, returned to the
    # system when freed (mallopt M_MMAP_THRESHOLD; specdec/memory.py); 0 = glibc's dynamic threshold
    memory_mmap_threshold_bytes: int = DEFAULT_MMAP_THRESHOLD
    max_span: int = 32  # longest drafted span accepted by Verify
    max_draft_support: int = 4096  # largest sparse q accepted per position
    session_ttl_s: float = 600.0  # idle sessions are reaped after this
    max_queue: int = 256  # pending model jobs (queued + running) before RESOURCE_EXHAUSTED
    # Batched verification (target_service/batching.py): concurrent calls from
    # different sessions share one forward pass. max_batch_size 1 = unbatched.
    max_batch_size: int = 16  # rows (sessions) per forward pass
    batch_window_ms: float = 2.0  # longest wait for more calls after the oldest queued one
    # after a forward, longest wait for the sessions it served to send their next
    # call (capped at 10 % of that forward's time): lockstep streams stay in one batch
    batch_regroup_ms: float = 25.0
    max_batch_tokens: int = 512  # padded input tokens per forward pass (rows × longest input)
    max_message_bytes: int = 8 * 1024 * 1024
    warmup: bool = True
    metrics_port: int = 0  # Prometheus /metrics HTTP port; 0 = off
    metrics_host: str = "127.0.0.1"
    health_port: int = 0  # plaintext port serving only grpc.health.v1 (kubelet probes when TLS is on); 0 = off
    tls: TlsServerConfig | None = None  # None = plaintext; client_ca set = mutual TLS

    def validate(self) -> None:
        """ValueError naming the first bad value (batching limits included)."""
        if self.max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {self.max_sessions}")
        if not self.session_ttl_s > 0:
            raise ValueError(f"session_ttl_s must be > 0, got {self.session_ttl_s}")
        if not self.kv_protect_active_s >= 0:
            raise ValueError(f"kv_protect_active_s must be >= 0, got {self.kv_protect_active_s}")
        if self.kv_budget_tokens < 1 or self.kv_budget_bytes < 0:
            raise ValueError(f"kv_budget_tokens must be >= 1 and kv_budget_bytes >= 0, got "
                             f"{self.kv_budget_tokens} and {self.kv_budget_bytes}")
        if self.prefix_cache_entries < 1:
            raise ValueError(f"prefix_cache_entries must be >= 1, got {self.prefix_cache_entries}")
        if not self.prefill_share >= 0:
            raise ValueError(f"prefill_share must be >= 0 (0 = fixed chunks), got {self.prefill_share}")
        if self.prefill_chunk_tokens < 0:
            raise ValueError(f"prefill_chunk_tokens must be >= 0 (0 = off), got {self.prefill_chunk_tokens}")
        if not 1 <= self.max_span <= 1024:
            raise ValueError(f"max_span must be in [1, 1024], got {self.max_span}")
        check_mmap_threshold(self.memory_mmap_threshold_bytes)
        self.batch_limits()

    def batch_limits(self) -> BatchLimits:
        """The batch scheduler's limits (validated: ValueError names a bad value)."""
        limits = BatchLimits(
            max_batch_size=self.max_batch_size,
            max_batch_tokens=self.max_batch_tokens,
            max_batch_kv_tokens=self.kv_budget_tokens,
            batch_window_ms=self.batch_window_ms,
            regroup_ms=self.batch_regroup_ms,
        )
        limits.validate()
        return limits
