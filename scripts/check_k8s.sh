#!/usr/bin/env bash
# Renders every kustomization under k8s/ (base, overlays, monitoring) and the
# plain manifests in k8s/jobs/, and validates them offline against the
# Kubernetes OpenAPI schemas (kubernetes-validate --strict: unknown fields
# fail). Then checks both security forms: k8s/base and every overlay built on
# it (dev-cpu, prod-gpu) render TLS with per-service secrets, mutual TLS that
# accepts only the orchestrator's identity, bearer tokens and the four
# NetworkPolicies; k8s/overlays/dev-insecure (the explicit open form) renders
# none of them and says so in an annotation. Skips, saying so, where kubectl
# is missing.
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
# the secure default and the explicit insecure form
secure() {  # rendered file: fails unless TLS, mTLS identities, tokens and policies are all there
  local f="$1" what="$2"
  for needle in "secretName: specdec-tls-target" "secretName: specdec-tls-draft" \
                "secretName: specdec-tls-orchestrator" "secretName: specdec-tls-gateway" \
                "secretName: specdec-auth" "--auth-tokens-file=/etc/specdec/auth/tokens" \
                "--tls-client-ca=/etc/specdec/tls/ca.crt" "--orchestrator-ca=/etc/specdec/tls/ca.crt" \
                "--upstream-ca=/etc/specdec/tls/ca.crt"; do
    grep -qF -- "$needle" "$f" || { echo "[check_k8s] $what: not secure: '$needle' missing" >&2; exit 1; }
  done
  [ "$(grep -c -- '--tls-client-allow=specdec-orchestrator' "$f")" -eq 2 ] \
    || { echo "[check_k8s] $what: target and draft must accept only specdec-orchestrator" >&2; exit 1; }
  [ "$(grep -c '^kind: NetworkPolicy' "$f")" -eq 4 ] \
    || { echo "[check_k8s] $what: expected 4 NetworkPolicies" >&2; exit 1; }
  ! grep -q -- '--allow-plaintext-tokens' "$f" \
    || { echo "[check_k8s] $what: --allow-plaintext-tokens belongs to dev-insecure only" >&2; exit 1; }
  echo "[check_k8s] $what: secure (TLS, mTLS identities, tokens, NetworkPolicies)"
}
for dir in k8s/base k8s/overlays/*; do
  name=$(echo "$dir" | tr / _)
  if [ "$dir" = k8s/overlays/dev-insecure ]; then
    f="$out/$name.yaml"
    ! grep -qE -- '--tls-(cert|client-ca)|--auth-tokens-file|^kind: NetworkPolicy' "$f" \
      || { echo "[check_k8s] $dir: expected the open form" >&2; exit 1; }
    grep -q 'specdec.io/security: insecure-dev-only' "$f" \
      || { echo "[check_k8s] $dir: must be annotated specdec.io/security: insecure-dev-only" >&2; exit 1; }
    echo "[check_k8s] $dir: the explicit insecure development form"
  else
    secure "$out/$name.yaml" "$dir"
  fi
done
for f in k8s/jobs/*.yaml; do
  "$VALIDATE" --strict --quiet --kubernetes-version "$KUBE_VERSION" "$f"
  echo "[check_k8s] $f valid"
done
echo "[check_k8s] ok ($n kustomizations, Kubernetes $KUBE_VERSION schemas)"
