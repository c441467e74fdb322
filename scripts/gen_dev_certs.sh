#!/usr/bin/env bash
# Development certificates for specdec (openssl only). NOT for production:
# the CA key sits next to the certificates.
#
#   bash scripts/gen_dev_certs.sh [OUT_DIR] [NAMESPACE ...]
#
# OUT_DIR (default ./certs) receives:
#   ca.crt, ca.key        a development CA (10 years)
#   <svc>.crt, <svc>.key  one certificate per service (2 years), svc in
#                         orchestrator, draft, target, gateway: CN
#                         specdec-<svc> (its identity under mutual TLS: target
#                         and draft accept only specdec-orchestrator as a
#                         client), usable as server AND client certificate,
#                         SANs: localhost, 127.0.0.1, ::1, specdec-internal
#                         (the name the manifests verify pods dialled by IP
#                         against) and, for the service and its headless
#                         variant (specdec-<svc>[-headless]): the bare name,
#                         <name>.<ns>, <name>.<ns>.svc,
#                         <name>.<ns>.svc.cluster.local and the pod wildcard
#                         *.<name>.<ns>.svc.cluster.local, for every NAMESPACE
#                         (default: specdec default)
#   client.crt, client.key   a client certificate (CN specdec-client), for
#                         clients of an mTLS endpoint (not accepted by target
#                         or draft)
# Kubernetes layout (docs/security.md): one Secret per service,
# specdec-tls-<svc> with tls.crt=<svc>.crt, tls.key=<svc>.key, ca.crt=ca.crt,
# mounted at /etc/specdec/tls/.
set -euo pipefail

out="${1:-certs}"
shift || true
namespaces=("$@")
[ ${#namespaces[@]} -gt 0 ] || namespaces=(specdec default)
command -v openssl >/dev/null || { echo "gen_dev_certs.sh: openssl is required" >&2; exit 1; }
mkdir -p "$out"
cd "$out"
umask 077

local_sans="DNS:localhost,IP:127.0.0.1,IP:::1,DNS:specdec-internal"
service_sans() {  # the DNS SANs of one service's names in every namespace
  local out=""
  for name in "$1" "$1-headless"; do
    out+=",DNS:$name"
    for ns in "${namespaces[@]}"; do
      out+=",DNS:$name.$ns,DNS:$name.$ns.svc,DNS:$name.$ns.svc.cluster.local,DNS:*.$name.$ns.svc.cluster.local"
    done
  done
  echo "$out"
}

openssl req -x509 -newkey rsa:2048 -nodes -sha256 -days 3650 \
  -keyout ca.key -out ca.crt -subj "/CN=specdec dev CA" \
  -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null

issue() {  # name CN extendedKeyUsage SANs
  local name="$1" cn="$2" eku="$3" san="$4"
  openssl req -newkey rsa:2048 -nodes -sha256 -keyout "$name.key" -out "$name.csr" -subj "/CN=$cn" 2>/dev/null
  {
    echo "basicConstraints=critical,CA:FALSE"
    echo "keyUsage=critical,digitalSignature,keyEncipherment"
    echo "extendedKeyUsage=$eku"
    [ -z "$san" ] || echo "subjectAltName=$san"
  } > "$name.ext"
  openssl x509 -req -in "$name.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -sha256 -days 730 \
    -extfile "$name.ext" -out "$name.crt" 2>/dev/null
  rm -f "$name.csr" "$name.ext"
}

for svc in orchestrator draft target gateway; do
  issue "$svc" "specdec-$svc" "serverAuth,clientAuth" "$local_sans$(service_sans "specdec-$svc")"
done
issue client specdec-client "clientAuth" ""
rm -f ca.srl
chmod 600 ./*.key
chmod 644 ./*.crt
echo "gen_dev_certs.sh: wrote ca.crt {orchestrator,draft,target,gateway,client}.{crt,key} (+ ca.key) to $(pwd)"
