#!/usr/bin/env bash
# Starts Levee with ./levee.toml if present (or built-in defaults); extra
# arguments go to `levee serve`, e.g. `scripts/serve.sh --listen 0.0.0.0:8000`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
scripts/setup.sh
exec cargo run --release -p levee -- serve "$@"
