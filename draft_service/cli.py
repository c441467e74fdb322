"""The draft service's flags and config builder.

``specdec serve draft`` parses them unprefixed; ``specdec up`` adds the model
flags as ``--draft-*`` (``--drafters`` and ``--default-drafter`` keep their
names) and builds the child's command line with :meth:`FlagSet.argv`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from draft_service.config import SPIN_MODES, DrafterSpec, DraftServiceConfig
from specdec.memory import DEFAULT_MMAP_THRESHOLD
from specdec.models import DEFAULT_DRAFT, DEFAULT_TARGET
from specdec.service_cli import FlagSet, cli_error, serve_command, server_tls, validated

SERVICE = "draft"

# Built-in drafter names (requests choose one with speculation.drafter).
MODEL_DRAFTER = "qwen2.5-coder-0.5b"  # the same-tokenizer model drafter (--draft-model)
TLI_DRAFTER = "smollm2-135m"  # the different-tokenizer drafter (token-level intersection)
PROMPT_LOOKUP_DRAFTER = "prompt-lookup"  # model-free n-gram drafter
AUTO_DRAFTER = "auto"  # prompt lookup while it matches well, else the model drafter
BUILTIN_DRAFTERS = (MODEL_DRAFTER, TLI_DRAFTER, PROMPT_LOOKUP_DRAFTER, AUTO_DRAFTER)
DEFAULT_DRAFTERS = ",".join(BUILTIN_DRAFTERS)
DEFAULT_TLI_MODEL = "smollm2-135m-instruct"
PRECISIONS = ["int4", "int8", "fp32", "fp16"]


def add_arguments(p: argparse._ActionsContainer, prefix: str = "", *, spin_default: str = "on") -> FlagSet:
    """The draft's model, runtime and drafter flags. ``spin_default``: ``specdec up``
    shares its cores with the target, where workers spinning between runs slow
    the target's next verify (docs/benchmarks.md), so it passes "run" (spin
    within a draft run only); a draft pod spins."""
    f = FlagSet(p, prefix)
    f.add("model", dest="draft_model", default=DEFAULT_DRAFT, help="draft model spec")
    f.add("precision", dest="draft_precision", default="int4", choices=PRECISIONS,
          help="ONNX export precision of the draft")
    f.add("execution", dest="draft_execution", default="auto", choices=["auto", "cpu", "cuda"],
          help="draft execution provider")
    f.add("threads", dest="draft_threads", type=int, default=0, help="onnxruntime intra-op threads (0 = all)")
    f.add("spin", dest="draft_spin", default=spin_default, choices=list(SPIN_MODES),
          help="onnxruntime worker spin-waiting (on: also between runs, a core held while idle; run: within "
               "a run only, nothing spins while the target verifies; off: a wake-up per op, ~15 %% slower)")
    f.add("drafters", prefixed=False, default=DEFAULT_DRAFTERS,
          help=f"comma-separated drafters the draft service hosts (built-ins: {DEFAULT_DRAFTERS}; "
               f"{AUTO_DRAFTER}: prompt lookup while it matches well, else the model drafter)")
    f.add("default-drafter", prefixed=False, default=None,
          help=f"drafter for requests that name none (default: {AUTO_DRAFTER} when hosted, else {MODEL_DRAFTER}, "
               "else the first; docs/drafters.md has the measurements behind it)")
    f.add("tli-model", dest="tli_model", default=DEFAULT_TLI_MODEL,
          help=f"model of the {TLI_DRAFTER} (different-tokenizer) drafter")
    f.add("tli-precision", dest="tli_precision", default="int4", choices=PRECISIONS,
          help=f"ONNX export precision of the {TLI_DRAFTER} drafter")
    f.add("kv-budget-tokens", dest="draft_kv_budget", type=int, default=65_536,
          help="draft: KV tokens over all draft sessions and stored prefixes (idle sessions are evicted, "
               "else RESOURCE_EXHAUSTED: the round runs target-only)")
    f.add("kv-budget-bytes", dest="draft_kv_budget_bytes", type=int, default=0,
          help="draft: the KV budget in bytes (K+V of all layers); > 0 replaces --kv-budget-tokens")
    f.add("kv-protect-active", dest="draft_kv_protect", type=float, default=10.0,
          help="draft: seconds a used session is protected from eviction for the KV budget (0 = plain LRU)")
    f.add("max-cache-tokens", dest="draft_max_cache", type=int, default=0,
          help="draft: one session's KV limit (0 = the model's context length, capped at the KV budget); on CUDA "
               "each session's buffer is preallocated at this size and counted whole in the budget")
    f.add("prefill-chunk-tokens", dest="draft_prefill_chunk", type=int, default=128,
          help="draft: a catch-up prefill (a new session's prompt) runs at most this many tokens per forward, "
               "each chunk its own job, so other sessions' draft calls run between them and a cancelled call "
               "stops within a chunk (0 = the whole context in one forward)")
    f.add("prefix-cache", dest="draft_prefix_cache", action=argparse.BooleanOptionalAction, default=True,
          help="draft: start new sessions from the KV of released ones sharing a prefix (chat turns, "
               "system prompts)")
    f.add("memory-mmap-threshold", dest="draft_mmap_threshold", type=int, default=DEFAULT_MMAP_THRESHOLD,
          help="draft: allocations of at least this many bytes get pages of their own, returned to the system "
               "when freed (mallopt M_MMAP_THRESHOLD): KV capacity not yet written is never resident; "
               "0 = glibc's dynamic threshold")
    p.set_defaults(draft_flags=f)  # the parsed args carry the flag set, to name flags in errors
    return f


def drafter_names(a: argparse.Namespace) -> list[str]:
    """The hosted drafters named by --drafters (a bad list stops here)."""
    names = [n.strip() for n in str(a.drafters).split(",") if n.strip()]
    unknown = [n for n in names if n not in BUILTIN_DRAFTERS]
    if unknown or not names:
        raise cli_error(f"--drafters: unknown or empty {unknown or names}; built-ins: {DEFAULT_DRAFTERS}")
    if AUTO_DRAFTER in names and MODEL_DRAFTER not in names and TLI_DRAFTER not in names:
        raise cli_error(f"--drafters: {AUTO_DRAFTER} needs {MODEL_DRAFTER} or {TLI_DRAFTER} as its fallback")
    return names


def models_to_export(a: argparse.Namespace) -> list[tuple[str, str]]:
    """(model spec, ONNX precision) of each hosted model drafter."""
    names = drafter_names(a)
    return ([(a.draft_model, a.draft_precision)] if MODEL_DRAFTER in names else []) + (
        [(a.tli_model, a.tli_precision)] if TLI_DRAFTER in names else [])


def config_from_args(a: argparse.Namespace, port: int) -> DraftServiceConfig:
    # the model drafter keeps its built-in name on the default model, else the model's name
    model_name = MODEL_DRAFTER if a.draft_model == DEFAULT_DRAFT else Path(a.draft_model).name or a.draft_model
    names = drafter_names(a)
    specs = []
    for n in names:
        if n == MODEL_DRAFTER:
            specs.append(DrafterSpec(name=model_name, model=a.draft_model, precision=a.draft_precision))
        elif n == TLI_DRAFTER:
            specs.append(DrafterSpec(name=TLI_DRAFTER, model=a.tli_model, precision=a.tli_precision, kind="tli"))
        elif n == AUTO_DRAFTER:
            fallback = model_name if MODEL_DRAFTER in names else TLI_DRAFTER
            specs.append(DrafterSpec(name=AUTO_DRAFTER, kind="auto", fallback=fallback))
        else:
            specs.append(DrafterSpec(name=PROMPT_LOOKUP_DRAFTER, kind="prompt-lookup"))
    hosted = [d.name for d in specs]
    if a.default_drafter is not None:
        default = model_name if a.default_drafter == MODEL_DRAFTER and model_name in hosted else a.default_drafter
    else:  # auto, then the model drafter, then the first (docs/drafters.md has the measurements behind it)
        default = AUTO_DRAFTER if AUTO_DRAFTER in hosted else model_name if model_name in hosted else hosted[0]
    return validated(DraftServiceConfig(
        host=a.host, port=port, drafters=specs, default_drafter=default,
        target_tokenizer=getattr(a, "target_tokenizer", None) or DEFAULT_TARGET,  # `specdec up` wires it itself
        intra_op_threads=a.draft_threads, execution=a.draft_execution, cache_dir=a.cache_dir,
        spin=a.draft_spin, metrics_port=a.metrics_port, metrics_host=a.metrics_host,
        health_port=a.health_port, tls=server_tls(a), max_queue=a.max_queue,
        kv_budget_tokens=a.draft_kv_budget, kv_budget_bytes=a.draft_kv_budget_bytes,
        kv_protect_active_s=a.draft_kv_protect, prefix_cache=a.draft_prefix_cache, max_cache_tokens=a.draft_max_cache,
        prefill_chunk_tokens=a.draft_prefill_chunk, memory_mmap_threshold_bytes=a.draft_mmap_threshold,
    ), a, _FIELD_DESTS, "draft_flags")


# config fields named in validation errors → the dest of the flag that sets them
_FIELD_DESTS = {"kv_budget_tokens": "draft_kv_budget", "kv_budget_bytes": "draft_kv_budget_bytes",
                "kv_protect_active_s": "draft_kv_protect", "prefill_chunk_tokens": "draft_prefill_chunk",
                "memory_mmap_threshold_bytes": "draft_mmap_threshold", "default_drafter": "default_drafter"}


def add_serve_arguments(g: argparse._ActionsContainer) -> None:
    """``specdec serve draft`` only: the flags ``specdec up`` wires itself or leaves at their defaults."""
    add_arguments(g)
    g.add_argument("--target-tokenizer", default=None,
                   help=f"the target's tokenizer (model spec) that {TLI_DRAFTER} and {PROMPT_LOOKUP_DRAFTER} "
                        f"propose in (default {DEFAULT_TARGET})")
    g.add_argument("--max-queue", type=int, default=256, help="pending model calls before RESOURCE_EXHAUSTED")


def add_serve_command(sub: Any) -> None:
    """``specdec serve draft``."""
    serve_command(sub, SERVICE, "the drafters: draft sessions, Propose and Session streams",
                          add_serve_arguments, "draft_service.server", config_from_args)
