"""Shared fixtures: tiny random-weight Qwen2 models (real code, small weights)
and their ONNX exports.

Models are built once per session into a temp dir (about 0.5 s each). ONNX
exports go to a cache that persists across runs in pytest's cache directory
(``.pytest_cache/d/specdec-onnx``); its keys hash the weight bytes, so a
changed tiny model is re-exported. A cold run exports in about 15 s.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.tiny import build_tiny_model

#: 33 characters -> vocab 34 (must not equal a Linear width: see build_tiny_model)
TINY_CHARS = "abcdefghijklmnopqrstuvwxyz .,:!?\n"
#: 5 characters -> vocab 6: small enough for statistical tests over the whole vocabulary
SMALL_CHARS = "abcde"
#: correlated draft noise: α ≈ 0.8 at temperature 1 against the tiny target
DRAFT_NOISE = 0.15


@dataclass(frozen=True)
class TinyModels:
    target: Path  # seed 1
    draft: Path  # target + noise DRAFT_NOISE: correlated
    uncorrelated: Path  # seed 2
    small_target: Path  # vocab 6, seed 5
    small_draft: Path  # small_target + noise 0.3
    chars: str = TINY_CHARS
    small_chars: str = SMALL_CHARS


@dataclass(frozen=True)
class TinyOnnx:
    """Builder exports (prune_lm_head: last-position logits only)."""

    draft_fp32: Path
    uncorrelated_fp32: Path
    small_draft_fp32: Path
    draft_int4: Path
    cache_dir: Path  # pass as DraftServiceConfig.cache_dir to hit these exports


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> TinyModels:
    root = tmp_path_factory.mktemp("tiny-models")
    target = build_tiny_model(root / "target", chars=TINY_CHARS, seed=1)
    small = build_tiny_model(root / "small-target", chars=SMALL_CHARS, seed=5)
    return TinyModels(
        target=target,
        draft=build_tiny_model(root / "draft", chars=TINY_CHARS, seed=11, base_dir=target, noise=DRAFT_NOISE),
        uncorrelated=build_tiny_model(root / "uncorrelated", chars=TINY_CHARS, seed=2),
        small_target=small,
        small_draft=build_tiny_model(root / "small-draft", chars=SMALL_CHARS, seed=6, base_dir=small, noise=0.3),
    )


@pytest.fixture(scope="session")
def onnx_cache_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = getattr(request.config, "cache", None)
    if cache is not None:
        return Path(cache.mkdir("specdec-onnx"))
    return tmp_path_factory.mktemp("specdec-onnx")


@pytest.fixture(scope="session")
def tiny_onnx(tiny_models: TinyModels, onnx_cache_dir: Path) -> TinyOnnx:
    from draft_service.export import ensure_onnx

    jobs = {
        "draft_fp32": (tiny_models.draft, "fp32"),
        "uncorrelated_fp32": (tiny_models.uncorrelated, "fp32"),
        "small_draft_fp32": (tiny_models.small_draft, "fp32"),
        "draft_int4": (tiny_models.draft, "int4"),
    }
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        futures = {k: pool.submit(ensure_onnx, d, onnx_cache_dir, p, "cpu") for k, (d, p) in jobs.items()}
        dirs = {k: f.result() for k, f in futures.items()}
    return TinyOnnx(cache_dir=onnx_cache_dir, **dirs)


#: characters for structured output tests: JSON punctuation, digits, '-' and text -> vocab 48
JSON_CHARS = 'abcdefghijklmnopqrstuvwxyz{}[]":,.- 0123456789\n'


@dataclass(frozen=True)
class JsonModels:
    """A tiny target that can write JSON (and chat), and a correlated draft exported to ONNX."""

    target: Path
    draft: Path
    draft_onnx: Path
    cache_dir: Path


@pytest.fixture(scope="session")
def json_models(tmp_path_factory: pytest.TempPathFactory, onnx_cache_dir: Path) -> JsonModels:
    from draft_service.export import ensure_onnx

    root = tmp_path_factory.mktemp("json-models")
    target = build_tiny_model(root / "target", chars=JSON_CHARS, seed=21)
    draft = build_tiny_model(root / "draft", chars=JSON_CHARS, seed=22, base_dir=target, noise=DRAFT_NOISE)
    return JsonModels(target, draft, ensure_onnx(draft, onnx_cache_dir, "fp32", "cpu"), onnx_cache_dir)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``long`` tests (the 5-minute chaos soak) run only when ``-m`` names
    them (``pytest -m long``, or ``-m soak`` for every soak test); a plain run
    skips them. Shorter ``soak`` tests run by default."""
    expr = config.getoption("markexpr") or ""
    if "long" in expr or "soak" in expr:
        return
    skip = pytest.mark.skip(reason="long test: run with -m long (or -m soak)")
    for item in items:
        if "long" in item.keywords:
            item.add_marker(skip)
