#!/usr/bin/env bash
# Prepares the CUDA checks for a GPU machine that has no Rust toolchain and
# no network: builds the CUDA test and benchmark binaries of levee-gpu here
# (no GPU needed), strips them, and lays out the ignored folder .device/ for
# the two device calls described at the top of scripts/gpu/run.sh:
#
#   .device/part1/  the first part of the default model            (call 1)
#   .device/part2/  the rest of the model, its sha256, the binaries,
#                   and the `gguf` Python wheel for the PyTorch side (call 2)
#
# A call may carry 64 MiB in all, working tree included, so the model (98 MB)
# is split across the two calls and each part is checked here.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
out="$root/.device"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-/tmp/levee-cuda-target}"
limit=$((60 << 20))   # per call, leaving room for the working tree

"$root/scripts/fetch-model.sh"
model="$root/models/SmolLM2-135M-Instruct.Q4_1.gguf"

rm -rf "$out/part1" "$out/part2"
mkdir -p "$out/part1" "$out/part2/bin" "$out/part2/whl"

# Paths of the executables cargo built, from its JSON messages.
executables() {
    python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        print(m["executable"])'
}

cd "$root"
test_bin="$(nice -n 10 cargo test -p levee-gpu --test cuda --no-run --message-format=json | executables | tail -n 1)"
bench_bin="$(nice -n 10 cargo bench -p levee-gpu --bench cuda --no-run --message-format=json | executables | tail -n 1)"
[[ -x "$test_bin" && -x "$bench_bin" ]] || { echo "cargo built no test or bench executable" >&2; exit 1; }
cp "$test_bin" "$out/part2/bin/cuda-test"
cp "$bench_bin" "$out/part2/bin/cuda-bench"
strip "$out/part2/bin/cuda-test" "$out/part2/bin/cuda-bench"

# The model: 56 MiB travel in call 1, the rest in call 2.
(cd "$out" && split -b 56m -a 1 "$model" part1/model.part-)
mv "$out/part1/model.part-b" "$out/part2/"
(cd "$(dirname "$model")" && sha256sum "$(basename "$model")") >"$out/part2/model.sha256"

python3 -m pip download --quiet --no-deps --only-binary=:all: gguf -d "$out/part2/whl"

tree_bytes="$(git -C "$root" ls-files -z --cached --others --exclude-standard | (cd "$root" && xargs -0 du -cb 2>/dev/null) | tail -n 1 | cut -f1)"
for part in part1 part2; do
    bytes="$(du -cb "$out/$part" | tail -n 1 | cut -f1)"
    total=$((bytes + tree_bytes))
    printf '%s: %d MiB (+ %d KiB of working tree)\n' "$part" $((bytes >> 20)) $((tree_bytes >> 10))
    if ((total > limit)); then
        echo "$part is over the $((limit >> 20)) MiB a device call may carry" >&2
        exit 1
    fi
done
ls -l "$out/part1" "$out/part2" "$out/part2/bin" "$out/part2/whl"
echo "ready: see the top of scripts/gpu/run.sh for the two device calls"
