#!/usr/bin/env bash
# Builds llama.cpp (through llama-cpp-python 0.3.36, from its PyPI source
# package) into the ignored virtual environment .venv-bench, so that
# `cargo bench -p levee-gpu --bench engine` measures it on the same file in
# the same run. CPU only, tuned for this machine (GGML_NATIVE). Takes several
# minutes on two cores; does nothing when already installed.
set -euo pipefail
cd "$(dirname "$0")/../.."

VERSION=0.3.36
VENV=.venv-bench
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import llama_cpp, sys; sys.exit(llama_cpp.__version__ != '$VERSION')" 2>/dev/null; then
    echo "llama-cpp-python $VERSION is installed in $VENV"
    exit 0
fi
python3 -m venv "$VENV"
CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF" \
CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
    "$VENV/bin/pip" install --no-cache-dir "llama-cpp-python==$VERSION"
"$VENV/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__, 'installed in $VENV')"
