"""Hugging Face hub models: ``snapshot_download`` into ``<cache>/hub``. Needs
network; nothing default depends on it."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from specdec.logging_util import log
from specdec.models.spec import BUILTINS, ModelError, ResolvedModel

logger = logging.getLogger("specdec.models")

#: Files worth fetching for a transformers causal LM (skips .bin/.pt/.gguf/onnx duplicates and
#: remote code, which specdec never trusts).
HUB_ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


def resolve_hub(repo_id: str, cache_dir: Path, *, progress: bool) -> ResolvedModel:
    """``snapshot_download`` a hub repo into ``<cache>/hub``. Needs network."""
    offline_hint = (
        f"If this machine is offline, use a built-in model ({', '.join(BUILTINS)}), "
        "a local Hugging Face model directory (with config.json), or a .gguf file path."
    )
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:  # pragma: no cover - huggingface_hub ships with transformers
        raise ModelError(f"cannot fetch hub model {repo_id!r}: huggingface_hub is not installed. {offline_hint}") from e
    log(logger, logging.INFO, "fetching model from the Hugging Face hub", repo_id=repo_id)
    t0 = time.monotonic()
    kwargs: dict[str, Any] = {}
    if not progress:
        from tqdm.auto import tqdm

        class _Silent(tqdm):  # type: ignore[misc,valid-type]
            def __init__(self, *args: Any, **kw: Any) -> None:
                kw["disable"] = True
                super().__init__(*args, **kw)

        kwargs["tqdm_class"] = _Silent
    try:
        path = snapshot_download(
            repo_id=repo_id,
            cache_dir=str(cache_dir / "hub"),
            allow_patterns=HUB_ALLOW_PATTERNS,
            **kwargs,
        )
    except Exception as e:  # noqa: BLE001 - every failure gets the same actionable message
        raise ModelError(
            f"could not fetch {repo_id!r} from the Hugging Face hub ({type(e).__name__}: {e}). {offline_hint}"
        ) from e
    hf_dir = Path(path)
    if not (hf_dir / "config.json").is_file():
        raise ModelError(f"hub repo {repo_id!r} has no config.json; it is not a transformers model. {offline_hint}")
    log(logger, logging.INFO, "hub model fetched", repo_id=repo_id, hf_dir=str(hf_dir),
        elapsed_s=round(time.monotonic() - t0, 1))
    return ResolvedModel(name=repo_id, hf_dir=hf_dir, source="hub", sha256=None)
