#!/usr/bin/env bash
# Validates the Kubernetes manifests under deploy/kubernetes/ (tools/check_manifests.py): the
# built-in kinds with kubernetes-validate (the Kubernetes API's schemas, strict), InferencePool,
# HTTPRoute and Gateway with the JSON schemas vendored in deploy/kubernetes/schemas/ (made from
# the published CRDs), the endpoint picker's configuration inside its ConfigMap, and the
# objects' references to each other; then a self-test that known breakages are rejected.
# kubernetes-validate is installed into target/manifest-venv when missing.
#
#   scripts/check-manifests.sh [--kubernetes-version 1.37.0]
#
# Exit codes: 0 valid; 1 a manifest is invalid (each error is printed); 3 the validator cannot
# be installed here (the reason is printed).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${MANIFEST_VENV:-target/manifest-venv}
PKG=${VALIDATOR_PKG:-kubernetes-validate==1.37.0}
if ! "$VENV/bin/python" -c "import kubernetes_validate, jsonschema, yaml" 2>/dev/null; then
  log=$VENV-install.log
  if ! python3 -m venv "$VENV" >"$log" 2>&1; then
    echo "check-manifests: cannot install the validator: python3 -m venv failed ($(tail -1 "$log"))" >&2
    exit 3
  fi
  if ! "$VENV/bin/pip" install --disable-pip-version-check "$PKG" >>"$log" 2>&1; then
    echo "check-manifests: cannot install the validator: pip install $PKG failed ($(grep -E '^ERROR' "$log" | tail -1 || true)); full log in $log" >&2
    exit 3
  fi
fi
exec "$VENV/bin/python" tools/check_manifests.py --self-test "$@"
