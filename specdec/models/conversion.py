"""GGUF -> float32 safetensors HF directory.

Conversion is slow and single-threaded (1.5B: about 1.5-2 min, 9 GB peak RSS).
It runs in a child ``python -m specdec.models`` process, so a service that
resolves its model at start-up does not keep the dequantization heap, while the
parent logs a heartbeat with the child's RSS. The output is written to a
temporary sibling directory and renamed into place after its
``specdec-complete.json`` marker is written.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

from specdec.fsutil import (
    fsync_tree,
    read_json,
    remove_stale_temps,
    temp_sibling,
    write_json_atomic,
)
from specdec.logging_util import log
from specdec.models.progress import logged_stage, peak_rss_mb, rss_mb, stderr_fd
from specdec.models.spec import ModelError

logger = logging.getLogger("specdec.models")

MARKER_NAME = "specdec-complete.json"
#: Bumped when the conversion output changes in a way old caches must not be reused for.
FORMAT_VERSION = 1


def hf_dir_is_complete(hf_dir: Path, sha256: str | None = None) -> bool:
    """True if ``hf_dir`` has a conversion marker (matching ``sha256`` and the format version)."""
    m = read_json(hf_dir / MARKER_NAME)
    if not m or m.get("format_version") != FORMAT_VERSION:
        return False
    return sha256 is None or m.get("sha256") == sha256


def _versions() -> dict[str, str]:
    from importlib import metadata

    out: dict[str, str] = {"python": sys.version.split()[0]}
    for dist in ("torch", "transformers", "gguf", "tokenizers", "safetensors", "accelerate"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


def _finalize_saved_files(d: Path, model_max_length: int | None) -> None:
    """Post-process a freshly saved directory.

    * ``tokenizer_config.json``: drop load-time kwargs that leak into it
      (``local_files_only``, ``is_local``) and replace the "unlimited"
      ``model_max_length`` with the model's context length.
    * Make every file world-readable per the umask (``save_pretrained`` writes
      safetensors as 0600 via a temp file, which breaks a cache shared between
      users/containers).
    """
    tc_path = d / "tokenizer_config.json"
    tc = read_json(tc_path)
    if tc is not None:
        for k in ("local_files_only", "is_local"):
            tc.pop(k, None)
        if model_max_length:
            tc["model_max_length"] = int(model_max_length)
        write_json_atomic(tc_path, tc)
    mask = os.umask(0)
    os.umask(mask)
    for p in d.rglob("*"):
        if p.is_file():
            os.chmod(p, 0o666 & ~mask)


def _fix_tokenizer_and_generation(
    tokenizer: Any, model: Any, eos_token: str | None, extra_eos_tokens: tuple[str, ...]
) -> dict[str, Any]:
    """Make eos/pad and generation_config consistent; returns a summary for the marker.

    ``eos_token`` (when given and in the vocabulary) becomes the tokenizer's eos;
    ``generation_config.eos_token_id`` lists it plus ``extra_eos_tokens``. A
    missing pad token falls back to the first extra eos (else eos).
    """
    vocab = tokenizer.get_vocab()
    if eos_token is not None:
        if eos_token not in vocab:
            raise ModelError(f"expected eos token {eos_token!r} not in the GGUF vocabulary")
        if tokenizer.eos_token != eos_token:
            log(logger, logging.INFO, "overriding tokenizer eos", was=tokenizer.eos_token, now=eos_token)
            tokenizer.eos_token = eos_token
    if tokenizer.eos_token_id is None:
        raise ModelError("converted tokenizer has no eos token")
    eos_ids: list[int] = [int(tokenizer.eos_token_id)]
    for t in extra_eos_tokens:
        if t in vocab and vocab[t] not in eos_ids:
            eos_ids.append(int(vocab[t]))
    if tokenizer.pad_token_id is None:
        pad = next((t for t in extra_eos_tokens if t in vocab), tokenizer.eos_token)
        tokenizer.pad_token = pad
    pad_id = int(tokenizer.pad_token_id)

    gc_ = model.generation_config
    gc_.eos_token_id = eos_ids if len(eos_ids) > 1 else eos_ids[0]
    gc_.pad_token_id = pad_id
    if getattr(tokenizer, "bos_token_id", None) is not None:
        gc_.bos_token_id = int(tokenizer.bos_token_id)
    model.config.eos_token_id = gc_.eos_token_id
    model.config.pad_token_id = pad_id
    return {"eos_token": tokenizer.eos_token, "eos_token_id": int(tokenizer.eos_token_id),
            "generation_eos_token_ids": eos_ids, "pad_token": tokenizer.pad_token, "pad_token_id": pad_id}


def _make_dense_serializable(model: Any) -> None:
    """Drop GGUF quantizer bookkeeping from a dequantized model so it can be saved.

    ``save_pretrained`` refuses a model whose ``hf_quantizer`` is set ("The model
    is quantized with gguf and is not serializable"). With
    ``GgufConfig(dequantize=True)`` transformers 5.24 already drops it in
    ``postprocess_model``; a default GGUF load keeps it. Either way the weights
    are plain dense tensors here (checked), so the quantizer and
    ``config.quantization_config`` can go.
    """
    import torch

    for pname, p in model.named_parameters():
        if type(p.data) is not torch.Tensor or not p.dtype.is_floating_point:
            raise ModelError(f"parameter {pname} is not a dense float tensor after the GGUF load "
                             f"({type(p.data).__name__}, {p.dtype}); refusing to save it")
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    for cfg in {id(c): c for c in (model.config, model.config.get_text_config(decoder=True))}.values():
        if "quantization_config" in cfg.__dict__:
            del cfg.quantization_config


#: Turn terminators a chat template may use; a user GGUF's generation_config also stops on these.
KNOWN_TURN_TERMINATORS = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<end_of_turn>", "<|end|>",
                          "<|endoftext|>")


def convert_gguf_to_hf(
    gguf_path: Path,
    hf_dir: Path,
    *,
    name: str,
    sha256: str,
    eos_token: str | None = None,
    extra_eos_tokens: tuple[str, ...] | None = None,
    source: str = "gguf",
    heartbeat_s: float = 10.0,
    isolate: bool = True,
    progress: bool = True,
) -> Path:
    """Dequantize ``gguf_path`` into a float32 safetensors HF directory at ``hf_dir``.

    The work (:func:`_convert_into`) writes into a temporary sibling directory,
    which is renamed to ``hf_dir`` only after ``specdec-complete.json`` is
    written. With ``isolate`` (default) it runs in a child process: the
    caller (often a service about to load the model) does not keep the several
    GB of heap the dequantization leaves behind, and the heartbeat keeps
    ticking even while the child sits in a long GIL-holding numpy call. An
    ``eos_token`` of ``None`` keeps the GGUF's eos; ``extra_eos_tokens`` of
    ``None`` means "turn terminators found in the chat template".
    """
    import importlib.util

    for dist in ("transformers", "accelerate", "gguf", "torch"):
        if importlib.util.find_spec(dist) is None:
            raise ModelError(f"converting a GGUF needs the {dist!r} package "
                             f"(transformers refuses GGUF loads without accelerate): pip install {dist}")
    gguf_path = Path(gguf_path)
    hf_dir = Path(hf_dir)
    hf_dir.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(hf_dir, logger)
    tmp = temp_sibling(hf_dir)
    t0 = time.monotonic()
    args = {"gguf_path": str(gguf_path), "out_dir": str(tmp), "name": name, "sha256": sha256,
            "eos_token": eos_token,
            "extra_eos_tokens": None if extra_eos_tokens is None else list(extra_eos_tokens),
            "source": source, "progress": progress}
    try:
        if isolate:
            marker = _run_isolated(args, heartbeat_s=heartbeat_s, name=name)
        else:
            marker = _convert_into(**args, heartbeat_s=heartbeat_s)
        fsync_tree(tmp)
        if hf_dir.exists():  # stale/incomplete leftover (callers hold the per-model lock)
            shutil.rmtree(hf_dir)
        os.replace(tmp, hf_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log(logger, logging.INFO, "converted GGUF to HF dir", name=name, hf_dir=str(hf_dir),
        elapsed_s=round(time.monotonic() - t0, 1), isolated=isolate, **marker.get("vocab", {}))
    return hf_dir


def _run_isolated(args: dict[str, Any], *, heartbeat_s: float, name: str) -> dict[str, Any]:
    """Run :func:`_convert_into` in a child ``python -m specdec.models`` process.

    A plain subprocess (not ``multiprocessing``): spawn would re-import the
    caller's ``__main__``, which deadlocks or recurses for scripts without a
    main guard. The child writes its result (marker or error) to a JSON file;
    the parent logs a heartbeat with the child's RSS while it waits.
    """
    result_path = Path(args["out_dir"] + ".result.json")
    with contextlib.suppress(FileNotFoundError):
        result_path.unlink()
    pkg_root = str(Path(__file__).resolve().parents[2])  # the directory holding specdec/
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH")) if p)
    if not args.get("progress", True):
        env["TQDM_DISABLE"] = "1"  # also silences bars that bypass transformers' switch (GGUF loader)
    level = logging.getLevelName(logger.getEffectiveLevel())
    cmd = [sys.executable, "-m", "specdec.models", "_convert", json.dumps(args), str(result_path), str(level)]
    out_fd = stderr_fd()
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=out_fd)
    log(logger, logging.INFO, "conversion started in child process", name=name, pid=proc.pid)
    try:
        while True:
            try:
                proc.wait(timeout=heartbeat_s)
                break
            except subprocess.TimeoutExpired:
                log(logger, logging.INFO, "converting: still working", name=name, pid=proc.pid,
                    elapsed_s=round(time.monotonic() - t0, 1), child_rss_mb=rss_mb(proc.pid))
    except BaseException:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        raise
    try:
        result = read_json(result_path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            result_path.unlink()
    code = proc.returncode
    if result is None:
        why = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
        hint = " (signal 9 usually means out of memory)" if code == -9 else ""
        raise ModelError(f"GGUF conversion of {name} died without a result: {why}{hint}")
    if result.get("ok") and code == 0:
        return dict(result["marker"])
    log(logger, logging.ERROR, "conversion failed in child process", name=name,
        error_type=result.get("type"), traceback=result.get("traceback"))
    raise ModelError(f"GGUF conversion of {name} failed: {result.get('type')}: {result.get('message')}")


def _convert_child_main(args_json: str, result_path: str, log_level: str) -> int:
    """Child-process entry point for :func:`_run_isolated`."""
    from specdec.logging_util import setup_logging

    setup_logging(log_level if log_level in logging.getLevelNamesMapping() else "INFO")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        marker = _convert_into(**json.loads(args_json), heartbeat_s=None)
        write_json_atomic(Path(result_path), {"ok": True, "marker": marker})
        return 0
    except BaseException as e:  # noqa: BLE001 - everything is reported to the parent
        import traceback

        write_json_atomic(Path(result_path), {"ok": False, "type": type(e).__name__,
                                               "message": str(e)[:4000],
                                               "traceback": traceback.format_exc()[-8000:]})
        return 1


@contextlib.contextmanager
def _hf_progress_bars(enabled: bool) -> Iterator[None]:
    """transformers' progress bars off for the block unless ``enabled`` (restored afterwards)."""
    from transformers.utils import logging as hf_logging

    bars_were_on = hf_logging.is_progress_bar_enabled()
    if not enabled:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if bars_were_on and not enabled:
            hf_logging.enable_progress_bar()


def _convert_into(
    *,
    gguf_path: str,
    out_dir: str,
    name: str,
    sha256: str,
    eos_token: str | None,
    extra_eos_tokens: list[str] | None,
    source: str,
    heartbeat_s: float | None,
    progress: bool = True,
) -> dict[str, Any]:
    """Load ``gguf_path`` dequantized (float32), save model + tokenizer + generation
    config into ``out_dir``, write the marker last, and return it.

    ``GgufConfig(dequantize=True)`` skips the hub kernel lookup and yields plain
    dense tensors; ``local_files_only`` keeps everything offline. The model is
    freed before the directory is post-processed to keep peak RSS down.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils.quantization_config import GgufConfig

    with _hf_progress_bars(progress):
        gpath = Path(gguf_path)
        out = Path(out_dir)
        fields = {"name": name}
        t_all = time.monotonic()
        with logged_stage("gguf-load-dequantize", heartbeat_s, **fields):
            t0 = time.monotonic()
            model = AutoModelForCausalLM.from_pretrained(
                str(gpath.parent), gguf_file=gpath.name, dtype=torch.float32,
                quantization_config=GgufConfig(dequantize=True), local_files_only=True,
            )
            model.eval()
            load_s = time.monotonic() - t0
        _make_dense_serializable(model)
        out_emb = model.get_output_embeddings()
        lm_head_rows = int(out_emb.weight.shape[0]) if out_emb is not None else None
        tied = bool(out_emb is not None
                    and out_emb.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr())
        n_params = sum(p.numel() for p in model.parameters())
        text_cfg = model.config.get_text_config(decoder=True)
        config_vocab = int(text_cfg.vocab_size)
        max_pos = getattr(text_cfg, "max_position_embeddings", None)

        with logged_stage("tokenizer-from-gguf", heartbeat_s, **fields):
            t0 = time.monotonic()
            tokenizer = AutoTokenizer.from_pretrained(str(gpath.parent), gguf_file=gpath.name,
                                                      local_files_only=True)
            tok_s = time.monotonic() - t0
        template = getattr(tokenizer, "chat_template", None)
        if not template:
            raise ModelError(f"{gpath.name}: the GGUF carries no chat template")
        if extra_eos_tokens is None:
            vocab = tokenizer.get_vocab()
            extra_eos_tokens = [t for t in KNOWN_TURN_TERMINATORS if t in vocab and t in str(template)]
        special = _fix_tokenizer_and_generation(tokenizer, model, eos_token, tuple(extra_eos_tokens))
        vocab_info = {"tokenizer_len": len(tokenizer), "config_vocab_size": config_vocab,
                      "lm_head_rows": lm_head_rows, "tied_embeddings": tied}
        if len(tokenizer) > config_vocab:
            raise ModelError(f"tokenizer has {len(tokenizer)} entries but the model only {config_vocab}")

        with logged_stage("save-safetensors", heartbeat_s, **fields):
            t0 = time.monotonic()
            model.save_pretrained(str(out), max_shard_size="2GB")
            tokenizer.save_pretrained(str(out))
            model.generation_config.save_pretrained(str(out))
            save_s = time.monotonic() - t0
        del model
        gc.collect()
        _finalize_saved_files(out, max_pos)

        marker = {
            "format_version": FORMAT_VERSION,
            "name": name,
            "source": source,
            "sha256": sha256,
            "gguf_file": gpath.name,
            "gguf_size": gpath.stat().st_size,
            "dtype": "float32",
            "num_parameters": n_params,
            "vocab": vocab_info,
            "special_tokens": special,
            "timings_s": {"load_dequantize": round(load_s, 1), "tokenizer": round(tok_s, 1),
                          "save": round(save_s, 1), "total": round(time.monotonic() - t_all, 1)},
            "peak_rss_mb": peak_rss_mb(),
            "versions": _versions(),
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        write_json_atomic(out / MARKER_NAME, marker)
        return marker
