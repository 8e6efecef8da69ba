#!/usr/bin/env bash
# Everything Levee needs before it builds, serves or tests; safe to run again.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

# Plugins and test guests are WebAssembly components.
if command -v rustup >/dev/null 2>&1; then
  if ! rustup target list --installed | grep -qx wasm32-wasip2; then
    rustup target add wasm32-wasip2
  fi
else
  echo "setup: rustup not found; make sure the wasm32-wasip2 target is installed" >&2
fi

# The default model, and the embedding model behind the semantic cache.
scripts/fetch-model.sh
scripts/fetch-embeddings.sh

# The OpenAI Python client, used by the compatibility test, and the
# validators of the Kubernetes manifests in deploy/.
if ! python3 -c "import openai" >/dev/null 2>&1; then
  python3 -m pip install --quiet --disable-pip-version-check openai
fi
if ! python3 -c "import kubernetes_validate, cloudcoil.models.keda" >/dev/null 2>&1; then
  python3 -m pip install --quiet --disable-pip-version-check \
    "kubernetes-validate==1.37.0" "cloudcoil.models.keda==2.16.1.0"
fi

# Redis: the shared-state tests start their own redis-server on loopback.
if ! command -v redis-server >/dev/null 2>&1; then
  sudo=""
  if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
  $sudo apt-get update -qq
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
  # The package starts a system-wide server; Levee's tests bring their own.
  $sudo service redis-server stop >/dev/null 2>&1 || true
fi
