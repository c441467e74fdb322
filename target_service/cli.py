"""The target service's flags and config builder.

``specdec serve target`` parses them unprefixed; ``specdec up`` adds the same
flags as ``--target-*`` and builds the child's command line with
:meth:`FlagSet.argv`, so each flag is defined here once.
"""

from __future__ import annotations

import argparse
from typing import Any

from specdec.memory import DEFAULT_MMAP_THRESHOLD
from specdec.models import DEFAULT_TARGET
from specdec.service_cli import FlagSet, cli_error, serve_command, server_tls, validated
from target_service.config import TargetServiceConfig

SERVICE = "target"


def add_arguments(p: argparse._ActionsContainer, prefix: str = "") -> FlagSet:
    """The target's model, numerics, batching and admission flags."""
    f = FlagSet(p, prefix)
    f.add("model", dest="target_model", default=DEFAULT_TARGET,
          help="target model spec: built-in name, .gguf file, local HF dir or hub id")
    f.add("dtype", dest="target_dtype", default="auto", choices=["auto", "bfloat16", "float32", "float16"],
          help="target dtype; auto = calibrated at start-up on CPU (bf16 on CUDA)")
    f.add("backend", dest="target_backend", default="auto",
          choices=["auto", "eager", "packed", "bf16w", "kquant", "kquant-a8", "int4", "int4-q8"],
          help="target compute backend: eager; packed (every linear prepacked for oneDNN, CPU); "
               "bf16w (bfloat16 linear weights, float32 activations, AVX2 kernel); "
               "kquant (the GGUF's own Q4_K/Q6_K codes, bf16 activations, our kernel; CPU); "
               "kquant-a8 (the same codes, int8 activations per 16 elements, exact int32 sums); "
               "int4 (Q4_K on torch's int4 kernel, 6-bit tensors bf16); "
               "int4-q8 (LOSSY: int4 with 6-bit tensors requantized to int8); auto = calibrated at start-up "
               "(a quantized pair only within the fidelity bound of bf16 eager's, docs/benchmarks.md)")
    f.add("gguf", dest="target_gguf", default=None,
          help="the GGUF a local HF model directory was converted from: the quantized backends read its "
               "blocks (a built-in name or a .gguf model spec finds its own file)")
    f.add("calibrate", dest="target_calibrate", default="on", choices=["on", "off"],
          help="time the target's forward cost t(k) at start-up (cached per machine and model); "
               "off with dtype/backend auto takes bf16 eager untimed")
    f.add("device", dest="target_device", default="auto", help="auto | cpu | cuda | cuda:N")
    f.add("threads", dest="target_threads", type=int, default=0, help="torch CPU threads (0 = all)")
    f.add("kv-budget-tokens", dest="target_kv_budget", type=int, default=65_536,
          help="target: tokens held in KV caches (LRU eviction of idle sessions past it)")
    f.add("kv-budget-bytes", dest="target_kv_budget_bytes", type=int, default=0,
          help="target: the KV budget in bytes (K+V of all layers); > 0 replaces --kv-budget-tokens")
    f.add("prefill-chunk-tokens", dest="target_prefill_chunk", type=int, default=256,
          help="target: prompts longer than this are prefilled this many tokens per forward pass, "
               "other sessions' verify rounds running between the chunks (0 = one pass per prompt)")
    f.add("prefill-share", dest="target_prefill_share", type=float, default=1.5,
          help="target: while other sessions decode, each prefill chunk is cut to cost about this many of their "
               "decode steps (measured online), so their streams keep their pace; 0 = --prefill-chunk-tokens always")
    f.add("prefix-cache", dest="target_prefix_cache", choices=("on", "off"), default="on",
          help="target: keep prompts and finished sessions' tokens with their KV; a prompt that starts with "
               "stored tokens prefills only the rest")
    f.add("prefix-cache-entries", dest="target_prefix_entries", type=int, default=64,
          help="target: stored prefixes at most (their KV also counts in the KV budget)")
    f.add("max-batch-size", dest="max_batch_size", type=int, default=16,
          help="target: calls from different sessions per forward pass (1 = unbatched)")
    f.add("batch-window-ms", dest="batch_window_ms", type=float, default=2.0,
          help="target: longest wait for more calls to batch after the oldest queued one")
    f.add("batch-regroup-ms", dest="batch_regroup_ms", type=float, default=25.0,
          help="target: after a forward pass, longest wait for the sessions it served to send their "
               "next call, so streams in lockstep share one batch (at most 10%% of the pass; 0 = off)")
    f.add("max-batch-tokens", dest="max_batch_tokens", type=int, default=512,
          help="target: padded input tokens per forward pass (rows x longest input)")
    f.add("max-queue", dest="max_queue", type=int, default=256, help="pending model calls before RESOURCE_EXHAUSTED")
    f.add("max-sessions", dest="target_max_sessions", type=int, default=64,
          help="target: sessions (KV caches) held at once")
    f.add("session-ttl", dest="target_session_ttl", type=float, default=600.0,
          help="target: idle sessions are released after this many seconds")
    f.add("kv-protect-active", dest="target_kv_protect", type=float, default=10.0,
          help="target: a new session never evicts one used within this many seconds (it gets "
               "RESOURCE_EXHAUSTED instead; 0 = plain LRU eviction)")
    f.add("memory-trim-interval", dest="target_memory_trim", type=float, default=1.0,
          help="target: between batches, at most every this many seconds, free heap memory goes back to the "
               "system (malloc_trim; without it RSS follows the peak of the KV copies, not the KV held); < 0 = never")
    f.add("memory-mmap-threshold", dest="target_mmap_threshold", type=int, default=DEFAULT_MMAP_THRESHOLD,
          help="target: allocations of at least this many bytes get pages of their own, returned to the system "
               "when freed (mallopt M_MMAP_THRESHOLD), so RSS follows the KV and activations that are live; "
               "0 = glibc's dynamic threshold")
    f.add("max-span", dest="target_max_span", type=int, default=32, help="target: longest drafted span a Verify accepts")
    p.set_defaults(target_flags=f)  # the parsed args carry the flag set, to name flags in errors
    return f


# config fields named in validation errors → the dest of the flag that sets them
_FIELD_DESTS = {"max_sessions": "target_max_sessions", "session_ttl_s": "target_session_ttl",
                "kv_protect_active_s": "target_kv_protect", "max_span": "target_max_span",
                "max_batch_size": "max_batch_size", "max_batch_tokens": "max_batch_tokens",
                "max_batch_kv_tokens": "target_kv_budget", "batch_window_ms": "batch_window_ms",
                "regroup_ms": "batch_regroup_ms", "kv_budget_tokens": "target_kv_budget",
                "kv_budget_bytes": "target_kv_budget_bytes", "prefill_chunk_tokens": "target_prefill_chunk",
                "prefix_cache_entries": "target_prefix_entries", "prefill_share": "target_prefill_share",
                "memory_mmap_threshold_bytes": "target_mmap_threshold"}


def config_from_args(a: argparse.Namespace, port: int) -> TargetServiceConfig:
    """The validated config; a bad value stops here with one line naming the flag
    as the user typed it."""
    cfg = TargetServiceConfig(
        model=a.target_model, host=a.host, port=port, dtype=a.target_dtype, device=a.target_device,
        backend=a.target_backend, gguf=a.target_gguf, calibrate=a.target_calibrate == "on",
        threads=a.target_threads, cache_dir=a.cache_dir, kv_budget_tokens=a.target_kv_budget,
        kv_budget_bytes=a.target_kv_budget_bytes, prefill_chunk_tokens=a.target_prefill_chunk,
        prefill_share=a.target_prefill_share, prefix_cache=a.target_prefix_cache == "on", prefix_cache_entries=a.target_prefix_entries,
        metrics_port=a.metrics_port, metrics_host=a.metrics_host, health_port=a.health_port,
        tls=server_tls(a),
        max_batch_size=a.max_batch_size, batch_window_ms=a.batch_window_ms, batch_regroup_ms=a.batch_regroup_ms,
        max_batch_tokens=a.max_batch_tokens, max_queue=a.max_queue,
        max_sessions=a.target_max_sessions, session_ttl_s=a.target_session_ttl,
        kv_protect_active_s=a.target_kv_protect, max_span=a.target_max_span,
        memory_trim_interval_s=a.target_memory_trim, memory_mmap_threshold_bytes=a.target_mmap_threshold,
    )
    validated(cfg, a, _FIELD_DESTS, "target_flags")
    from target_service.calibration import resolve_pairs
    from target_service.loading import pick_device

    try:  # a pair this machine cannot run stops here, with one line, before anything loads
        resolve_pairs(cfg.dtype, cfg.backend, pick_device(cfg.device), need_file=False)
    except ValueError as e:
        raise cli_error(str(e)) from None
    return cfg


def add_serve_command(sub: Any) -> None:
    """``specdec serve target``."""
    serve_command(sub, SERVICE, "the target model: sessions, verification, batching", add_arguments,
                          "target_service.server", config_from_args)
