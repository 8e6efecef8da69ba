#!/usr/bin/env bash
# Runs Levee's CUDA checks on a GPU machine: the CUDA tests, the CUDA
# benchmark and the PyTorch comparison, every log under "$OUT".
#
# Prepared here with `scripts/gpu/prepare.sh` (builds the binaries, splits the
# model into .device/part1 and .device/part2, each under the 64 MiB a call
# may carry). Then two `run` calls of the device tool, the second issued at
# once (the machine goes back after 30 s idle, and with it part 1):
#
#   call 1: command   ls -l .device/part1
#           carry     [".device/part1"]
#           timeout_s 60
#   call 2: command   bash scripts/gpu/run.sh
#           carry     [".device/part2"]
#           timeout_s 570
#
# Files back (under $OUT): nvidia-smi.txt, cuda-tests.log, cuda-bench.log,
# torch.log, summary.md.
# Stages: tests <= 200 s, benchmark <= 150 s, PyTorch <= 150 s (about 8 min at most).
set -uo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
dev="$root/.device"
out="${OUT:-$root/.device/out}"
mkdir -p "$out"

fail() {
    echo "run.sh: $*" | tee -a "$out/summary.md" >&2
    exit 1
}

# Fail fast where there is no GPU.
command -v nvidia-smi >/dev/null || fail "no GPU here: nvidia-smi is not installed (this script runs on the device machine)"
nvidia-smi >"$out/nvidia-smi.txt" 2>&1 || fail "no GPU here: nvidia-smi failed: $(tail -n 3 "$out/nvidia-smi.txt")"
head -n 15 "$out/nvidia-smi.txt"

for f in "$dev/part1/model.part-a" "$dev/part2/model.part-b" "$dev/part2/model.sha256" \
    "$dev/part2/bin/cuda-test" "$dev/part2/bin/cuda-bench"; do
    [[ -f "$f" ]] || fail "$f is missing: run scripts/gpu/prepare.sh here, then call 1 (part1) and call 2 (part2) in one warm session"
done
model_dir=/tmp/levee-model
mkdir -p "$model_dir"
cat "$dev/part1/model.part-a" "$dev/part2/model.part-b" >"$model_dir/SmolLM2-135M-Instruct.Q4_1.gguf"
(cd "$model_dir" && sha256sum -c "$dev/part2/model.sha256") || fail "the model's halves do not join into the original file"
export LEVEE_MODEL="$model_dir/SmolLM2-135M-Instruct.Q4_1.gguf"

# cuBLAS and NVRTC: the toolkit's folder, else the wheels PyTorch brought.
libdirs=""
for lib in libcublas.so.13 libnvrtc.so.13; do
    found="$(find /usr/local/cuda/lib64 /usr/local/cuda/targets /usr/lib/x86_64-linux-gnu -name "$lib" 2>/dev/null | head -n 1)"
    if [[ -z "$found" ]]; then
        site="$(python3 -c 'import site; print(" ".join(site.getsitepackages()))' 2>/dev/null)"
        found="$(find $site -path '*nvidia*' -name "$lib" 2>/dev/null | head -n 1)"
    fi
    [[ -n "$found" ]] || fail "$lib not found on this machine"
    libdirs="$libdirs:$(dirname "$found")"
done
export LD_LIBRARY_PATH="${libdirs#:}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"

status=0
echo "== CUDA tests"
timeout 200 "$dev/part2/bin/cuda-test" --nocapture --test-threads 1 2>&1 | tee "$out/cuda-tests.log"
tests_rc=${PIPESTATUS[0]}
((tests_rc == 0)) || status=1

echo "== CUDA benchmark"
timeout 150 "$dev/part2/bin/cuda-bench" 2>&1 | tee "$out/cuda-bench.log"
bench_rc=${PIPESTATUS[0]}
((bench_rc == 0)) || status=1

echo "== PyTorch on the same weights"
prompt_ids="$(sed -n 's/^LEVEE prompt_ids=//p' "$out/cuda-bench.log" | head -n 1)"
torch_rc=1
if [[ -n "$prompt_ids" ]]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$dev"/part2/whl/*.whl &&
        PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 timeout 150 python3 "$root/scripts/gpu/torch_reference.py" \
            --model "$LEVEE_MODEL" --prompt-ids "$prompt_ids" 2>&1 | tee "$out/torch.log"
    torch_rc=${PIPESTATUS[0]}
else
    echo "the benchmark printed no prompt ids; PyTorch skipped" | tee "$out/torch.log"
fi
((torch_rc == 0)) || status=1

{
    echo "# Levee CUDA run"
    echo
    echo "exit codes: tests $tests_rc, benchmark $bench_rc, pytorch $torch_rc"
    grep -E "^test result|teacher-forced top-1|free-running greedy|batched == unbatched" "$out/cuda-tests.log" || true
    echo
    grep -E "^\| |^backend|bandwidth|time to first token|engine," "$out/cuda-bench.log" || true
    echo
    echo "| batch | Levee tokens/s | PyTorch tokens/s | Levee / PyTorch |"
    echo "|---|---|---|---|"
    for b in 1 16 64 256; do
        l="$(sed -n "s/^LEVEE decode batch=$b tokens_per_s=\([0-9.]*\).*/\1/p" "$out/cuda-bench.log")"
        t="$(sed -n "s/^TORCH decode batch=$b tokens_per_s=\([0-9.]*\).*/\1/p" "$out/torch.log" 2>/dev/null)"
        r="$(python3 -c "print(f'{float(\"$l\") / float(\"$t\"):.2f}x')" 2>/dev/null || echo n/a)"
        echo "| $b | ${l:-n/a} | ${t:-n/a} | $r |"
    done
    echo
    echo "greedy ids at batch 1, Levee:   $(sed -n 's/^LEVEE greedy_ids=//p' "$out/cuda-bench.log")"
    echo "greedy ids at batch 1, PyTorch: $(sed -n 's/^TORCH greedy_ids=//p' "$out/torch.log" 2>/dev/null)"
} >>"$out/summary.md"
cat "$out/summary.md"
exit $status
