#!/usr/bin/env python3
"""The PyTorch side of Levee's CUDA benchmark: the same Llama-family model,
from the same GGUF file, run in plain PyTorch.

Weights are read with the `gguf` package and dequantized to bf16 (the
precision Levee's CUDA backend keeps them in). The forward pass is written
here from the model's definition: RMSNorm, interleaved RoPE (GGUF stores Q
and K rows permuted for adjacent pairs, as Levee reads them), grouped-query
attention through scaled_dot_product_attention, SwiGLU, tied or separate LM
head. Decoding is greedy over a static KV cache at batch 1, 16, 64 and 256,
each decode step captured once in a CUDA graph and replayed (eager steps are
timed too, and the faster is reported).

Prints lines the run script puts beside Levee's:
  TORCH decode batch=B tokens_per_s=X mode=graph|eager
  TORCH greedy_ids=...   (first 16 tokens at batch 1, to compare with Levee's)

Usage: torch_reference.py --model FILE --prompt-ids 1,2,3 [--steps 64]
"""

import argparse
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

try:
    import gguf
except ImportError:
    sys.exit("the gguf package is missing: install its wheel (scripts/gpu/prepare.sh fetches it)")

BATCHES = (1, 16, 64, 256)
WARMUP = 4


def field(reader, key, default=None):
    """A scalar or string metadata value of the GGUF file."""
    f = reader.fields.get(key)
    if f is None:
        return default
    part = f.parts[f.data[0]]
    if f.types and f.types[0] == gguf.GGUFValueType.STRING:
        return bytes(part).decode()
    return part.tolist()[0]


def load(path, device):
    """Config and bf16 weights of a llama-architecture GGUF file."""
    r = gguf.GGUFReader(path)
    arch = field(r, "general.architecture")
    if arch not in ("llama", "mistral"):
        sys.exit(f"{path}: architecture {arch} is not handled here (llama, mistral are)")
    k = lambda name, default=None: field(r, f"{arch}.{name}", default)  # noqa: E731
    cfg = {
        "layers": k("block_count"),
        "hidden": k("embedding_length"),
        "heads": k("attention.head_count"),
        "kv_heads": k("attention.head_count_kv", k("attention.head_count")),
        "eps": float(k("attention.layer_norm_rms_epsilon", 1e-5)),
        "theta": float(k("rope.freq_base", 10000.0)),
    }
    cfg["head_dim"] = k("attention.key_length", cfg["hidden"] // cfg["heads"])
    tensors = {}
    for t in r.tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type)
        cols = int(t.shape[0])
        values = np.ascontiguousarray(values.reshape(-1, cols) if len(t.shape) > 1 else values.reshape(-1))
        tensors[t.name] = torch.from_numpy(values.astype(np.float32)).to(device=device, dtype=torch.bfloat16)
    cfg["vocab"] = tensors["token_embd.weight"].shape[0]
    return cfg, tensors


class Model:
    """A Llama decoder over a static KV cache of `max_len` positions for `batch` sequences."""

    def __init__(self, cfg, w, batch, max_len, device):
        self.c, self.w = cfg, w
        L, kvh, d = cfg["layers"], cfg["kv_heads"], cfg["head_dim"]
        self.k = torch.zeros(L, batch, kvh, max_len, d, dtype=torch.bfloat16, device=device)
        self.v = torch.zeros_like(self.k)
        half = d // 2
        inv = 1.0 / (cfg["theta"] ** (torch.arange(half, dtype=torch.float32, device=device) * 2 / d))
        angles = torch.arange(max_len, dtype=torch.float32, device=device)[:, None] * inv[None, :]
        self.cos, self.sin = angles.cos(), angles.sin()
        self.qkv = [torch.cat([w[f"blk.{i}.attn_q.weight"], w[f"blk.{i}.attn_k.weight"], w[f"blk.{i}.attn_v.weight"]])
                    for i in range(L)]
        self.gate_up = [torch.cat([w[f"blk.{i}.ffn_gate.weight"], w[f"blk.{i}.ffn_up.weight"]]) for i in range(L)]
        self.head = w.get("output.weight", w["token_embd.weight"])
        self.positions = torch.arange(max_len, device=device)

    def norm(self, x, weight):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.c["eps"]) * weight.float()).to(torch.bfloat16)

    def rope(self, x, pos):
        # x: [B, H, T, D]; adjacent pairs (2i, 2i+1) rotate together.
        c, s = self.cos[pos][None, None], self.sin[pos][None, None]  # [1, 1, T, D/2]
        a, b = x.float().unflatten(-1, (-1, 2)).unbind(-1)
        return torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2).to(torch.bfloat16)

    def forward(self, tokens, pos, mask):
        """tokens [B, T] at positions pos [T] (shared by the batch); mask [T, max_len] boolean, True = attend."""
        c = self.c
        B, T = tokens.shape
        H, KV, D = c["heads"], c["kv_heads"], c["head_dim"]
        x = self.w["token_embd.weight"][tokens]
        for i in range(c["layers"]):
            h = self.norm(x, self.w[f"blk.{i}.attn_norm.weight"])
            q, k, v = (h @ self.qkv[i].T).split([H * D, KV * D, KV * D], dim=-1)
            q = self.rope(q.view(B, T, H, D).transpose(1, 2), pos)
            k = self.rope(k.view(B, T, KV, D).transpose(1, 2), pos)
            self.k[i].index_copy_(2, pos, k)
            self.v[i].index_copy_(2, pos, v.view(B, T, KV, D).transpose(1, 2))
            a = F.scaled_dot_product_attention(q, self.k[i], self.v[i], attn_mask=mask[None, None], enable_gqa=True)
            x = x + a.transpose(1, 2).reshape(B, T, H * D) @ self.w[f"blk.{i}.attn_output.weight"].T
            h = self.norm(x, self.w[f"blk.{i}.ffn_norm.weight"])
            g, u = (h @ self.gate_up[i].T).chunk(2, dim=-1)
            x = x + (F.silu(g) * u) @ self.w[f"blk.{i}.ffn_down.weight"].T
        return self.norm(x[:, -1], self.w["output_norm.weight"]) @ self.head.T


def decode(cfg, w, prompt, batch, steps, device, graphs):
    """Greedy tokens/s of `steps` decode steps after prefilling `batch` copies of `prompt`."""
    # Room for the warm-up steps run before a graph is captured too.
    max_len = len(prompt) + WARMUP + steps + 4
    m = Model(cfg, w, batch, max_len, device)
    causal = m.positions[None, :] <= m.positions[:, None]  # [max_len, max_len]
    p = len(prompt)
    tokens = torch.tensor([prompt] * batch, device=device)
    with torch.inference_mode():
        first = m.forward(tokens, m.positions[:p], causal[:p]).argmax(-1)
        # Static inputs of one decode step, updated on the device: the token and its position.
        tok = first[:, None].clone()
        pos = torch.tensor([p], device=device)

        def step():
            nxt = m.forward(tok, pos, causal[pos]).argmax(-1)
            tok.copy_(nxt[:, None])
            pos.add_(1)

        run = step
        if graphs:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # kernels and cuBLAS warmed up outside the graph
                    step()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()  # recorded, not run
            run = graph.replay
        for _ in range(WARMUP):
            run()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            run()
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
    return batch * steps / elapsed


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt-ids", required=True, help="comma-separated token ids (Levee's tokenization)")
    ap.add_argument("--steps", type=int, default=64)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("PyTorch sees no CUDA device")
    device = torch.device("cuda")
    prompt = [int(t) for t in args.prompt_ids.split(",")]
    t0 = time.perf_counter()
    cfg, w = load(args.model, device)
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}; weights loaded in {time.perf_counter() - t0:.1f} s: {cfg}")
    # Greedy ids at batch 1, eager, from the first token on (no graph: each step's id is read).
    m = Model(cfg, w, 1, len(prompt) + 17, device)
    causal = m.positions[None, :] <= m.positions[:, None]
    ids, seq = [], list(prompt)
    with torch.inference_mode():
        logits = m.forward(torch.tensor([seq], device=device), m.positions[: len(seq)], causal[: len(seq)])
        for _ in range(16):
            ids.append(int(logits.argmax(-1)[0]))
            pos = torch.tensor([len(seq)], device=device)
            seq.append(ids[-1])
            logits = m.forward(torch.tensor([[ids[-1]]], device=device), pos, causal[pos])
    print("TORCH greedy_ids=" + ",".join(map(str, ids)))
    del m
    for b in BATCHES:
        best = None
        for graphs in (False, True):
            try:
                tps = decode(cfg, w, prompt, b, args.steps, device, graphs)
            except Exception as e:  # a failed capture leaves the eager figure
                print(f"batch {b}: {'graph' if graphs else 'eager'} mode failed: {e}")
                continue
            print(f"batch {b}: {'graph' if graphs else 'eager'} {tps:.1f} tokens/s")
            if best is None or tps > best[0]:
                best = (tps, "graph" if graphs else "eager")
            torch.cuda.empty_cache()
        if best:
            print(f"TORCH decode batch={b} tokens_per_s={best[0]:.1f} mode={best[1]}")


if __name__ == "__main__":
    main()
