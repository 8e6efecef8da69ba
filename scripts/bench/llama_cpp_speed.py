"""Single-stream speed of llama.cpp on a GGUF file, for the engine benchmark.

Usage: python llama_cpp_speed.py MODEL.gguf THREADS
Prints one JSON line: decode and prompt-processing tokens/s, measured the way
the engine benchmark measures Levee (greedy decode of 128 tokens after a short
prompt; best of three passes over a ~500-token prompt).
"""

import json
import sys
import time

import llama_cpp


def main() -> None:
    path, threads = sys.argv[1], int(sys.argv[2])
    llm = llama_cpp.Llama(
        model_path=path,
        n_threads=threads,
        n_threads_batch=threads,
        n_ctx=2048,
        n_batch=512,
        verbose=False,
    )
    short = llm.tokenize(b"Write a long story about the sea.", add_bos=False, special=True)
    llm.reset()
    llm.eval(short)
    steps = 128
    started = time.perf_counter()
    for _ in range(steps):
        token = llm.sample(top_k=1, temp=0.0)
        llm.eval([token])
    decode = steps / (time.perf_counter() - started)

    long = llm.tokenize(("The quick brown fox jumps over the lazy dog. " * 50).encode(), add_bos=False, special=True)
    best = float("inf")
    for _ in range(3):
        llm.reset()
        started = time.perf_counter()
        llm.eval(long)
        best = min(best, time.perf_counter() - started)
    print(json.dumps({
        "version": llama_cpp.__version__,
        "threads": threads,
        "decode_tps": decode,
        "prompt_tps": len(long) / best,
        "prompt_tokens": len(long),
    }))


if __name__ == "__main__":
    main()
