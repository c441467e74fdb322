#!/usr/bin/env bash
# Renders every kustomization under k8s/ (base, overlays, monitoring) and the
# plain manifests in k8s/jobs/, and validates them offline against the
# Kubernetes OpenAPI schemas (kubernetes-validate --strict: unknown fields
# fail). Skips, saying so, where kubectl is missing.
#   VENV=/path/to/venv bash scripts/check_k8s.sh
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
KUBE_VERSION=${KUBE_VERSION:-1.37.0}
if ! command -v kubectl >/dev/null 2>&1; then
  echo "[check_k8s] SKIPPED: kubectl not found (needed for 'kubectl kustomize')"
  exit 0
fi
VALIDATE="$VENV/bin/kubernetes-validate"
[ -x "$VALIDATE" ] || { echo "[check_k8s] $VALIDATE missing: pip install -e '.[dev]'" >&2; exit 1; }
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
n=0
for dir in k8s/base k8s/overlays/* k8s/monitoring; do
  [ -f "$dir/kustomization.yaml" ] || continue
  name=$(echo "$dir" | tr / _)
  kubectl kustomize "$dir" > "$out/$name.yaml"
  "$VALIDATE" --strict --quiet --kubernetes-version "$KUBE_VERSION" "$out/$name.yaml"
  echo "[check_k8s] $dir: $(grep -c '^kind:' "$out/$name.yaml") resources valid"
  n=$((n + 1))
done
for f in k8s/jobs/*.yaml; do
  "$VALIDATE" --strict --quiet --kubernetes-version "$KUBE_VERSION" "$f"
  echo "[check_k8s] $f valid"
done
echo "[check_k8s] ok ($n kustomizations, Kubernetes $KUBE_VERSION schemas)"
