"""Getting the target model ready to serve: dtype and device selection,
compute threads, loading and conversion for a backend
(target_service/backends.py), and measuring its forward-pass cost curve
t(k) (target_service/calibration.py).
"""

from __future__ import annotations

import inspect
import logging
import time
from pathlib import Path
from typing import Callable, Sequence

import torch
from transformers import AutoModelForCausalLM

from specdec.logging_util import log
from target_service import kv_adapter as kv
from target_service.backends import apply_backend, load_dtype, set_backend_threads, set_compute_threads

logger = logging.getLogger("specdec.target")

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(_DTYPES)}") from None


def pick_device(spec: str) -> torch.device:
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(spec)


def set_threads(device: torch.device, threads: int, backend: str | None = None) -> None:
    """The compute threads on CPU (``--threads``; 0 = all cores). With
    ``backend`` (the model is loaded for it) they are divided between torch
    and the backend's kernel again, as :func:`apply_backend` divided them:
    bf16w and kquant keep torch on one thread, so the served cost is the
    calibrated one."""
    if device.type == "cpu":
        if threads > 0:
            torch.set_num_threads(threads)
        set_compute_threads(threads)
        if backend is not None:
            set_backend_threads(backend)


def load_model(
    hf_dir: Path, dtype: torch.dtype, backend: str, device: torch.device, name: str | None = None,
    gguf_path: Path | None = None,
) -> torch.nn.Module:
    """Loads the target in ``dtype`` onto ``device`` and converts it for
    ``backend`` (target_service.backends; the quantized backends build the
    linear layers from ``gguf_path``)."""
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=load_dtype(dtype, backend))
    model.to(device)
    model.eval()
    load_s = time.perf_counter() - t0
    with torch.inference_mode():
        model = apply_backend(model, backend, dtype, device, gguf_path)
    if device.type == "cpu":
        from target_service.attention import use_packed_gqa

        use_packed_gqa(model)  # verify passes without copying K/V per query head
    log(
        logger,
        logging.INFO,
        "target model loaded",
        model=name or str(hf_dir),
        dtype=str(dtype).removeprefix("torch."),
        backend=backend,
        device=str(device),
        load_s=round(load_s, 2),
        convert_s=round(time.perf_counter() - t0 - load_s, 2),
    )
    return model


def output_vocab_size(model: torch.nn.Module) -> int:
    """Rows of the LM head (the logits' width), whatever the backend made of it."""
    head = model.get_output_embeddings()
    out = getattr(head, "out_features", None)
    if out is None:
        out = head.weight.shape[0]
    return int(out)


@torch.inference_mode()
def measure_forward_curve(
    model: torch.nn.Module, device: torch.device, ks: Sequence[int], kv_tokens: int, budget_s: float = 30.0,
    tune: "Callable[[Callable[[int], None], Callable[[], None]], object] | None" = None,
) -> dict[int, float]:
    """t(k) in ms: one forward pass of k new tokens behind ``kv_tokens`` of
    KV cache, as a 1-token step or a (k-1)-token verify runs it (the LM head
    on the last k rows, the cache cropped back after every pass). ``tune``,
    when given, runs first with the same ``forward(k)`` and ``reset()``
    (a kernel setting chosen by timing, e.g. kquant's prefetch distance)."""
    from target_service.calibration import measure_curve

    vocab = output_vocab_size(model)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (1, kv_tokens), generator=gen).to(device)
    kwarg = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
    cache = kv.new_cache(model.config)
    model(input_ids=prompt, use_cache=True, logits_to_keep=1, **{kwarg: cache})
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def forward(k: int) -> None:
        ids = torch.randint(0, vocab, (1, k), generator=gen).to(device)
        model(input_ids=ids, use_cache=True, logits_to_keep=k, **{kwarg: cache})
        sync()

    def reset() -> None:
        kv.drop_last(cache, kv.length(cache) - kv_tokens)

    if tune is not None:
        tune(forward, reset)
    return measure_curve(forward, reset, ks, budget_s=budget_s)
