// Levee's CUDA kernels, compiled at start-up with NVRTC (see compile.rs).
//
// The host defines, per model:
//   HEAD_DIM    width of one attention head (a multiple of 32, at most 256)
//   GROUP       query heads per key/value head (grouped-query attention)
//   ATTN_WARPS  warps per attention block
//   LEVEE_F16   1: weights, activations and KV are IEEE half; 0: bfloat16
//
// No CUDA header is included, so the source compiles wherever NVRTC does.
// Layouts mirror the CPU backend: the residual stream is f32, row-major, one
// row per token; a fused projection row is [q | k | v] (or [gate | up]); the
// KV cache of a layer holds, for each slot (block * block_size + offset),
// n_kv_heads * HEAD_DIM contiguous elements.

typedef unsigned short wt;       // one 16-bit element (bf16 or f16)
typedef unsigned long long u64;  // offsets: a cache can pass 2^31 elements

#define DPL (HEAD_DIM / 32)  // head elements per lane
#define FULL_MASK 0xffffffffu
#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float wt_to_f32(wt v) {
#if LEVEE_F16
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v));
    return f;
#else
    return __uint_as_float(((unsigned int)v) << 16);
#endif
}

__device__ __forceinline__ wt f32_to_wt(float f) {
#if LEVEE_F16
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
#else
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (wt)((u >> 16) | 0x40u);  // NaN stays NaN
    }
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
    return (wt)(u >> 16);
#endif
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) {
        v += __shfl_xor_sync(FULL_MASK, v, o);
    }
    return v;
}

// Sum over the block (blockDim.x a multiple of 32); every thread gets it.
__device__ float block_sum(float v) {
    __shared__ float part[32];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    v = warp_sum(v);
    if (lane == 0) {
        part[warp] = v;
    }
    __syncthreads();
    if (warp == 0) {
        v = lane < (int)(blockDim.x >> 5) ? part[lane] : 0.0f;
        v = warp_sum(v);
        if (lane == 0) {
            part[0] = v;
        }
    }
    __syncthreads();
    return part[0];
}

// x[t] = table[ids[t]] for every token t (one block per token).
extern "C" __global__ void embed(const int* __restrict__ ids, const wt* __restrict__ table, float* __restrict__ x,
                                 int hidden) {
    const int t = blockIdx.x;
    const wt* row = table + (u64)ids[t] * hidden;
    float* out = x + (u64)t * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        out[i] = wt_to_f32(row[i]);
    }
}

// out[r] = x[src] / rms(x[src]) * w, src = rows ? rows[r] : r (one block per
// output row). The CPU backend's formula: v / sqrt(mean(v^2) + eps) * w.
extern "C" __global__ void rms_norm(const float* __restrict__ x, const int* __restrict__ rows,
                                    const float* __restrict__ w, wt* __restrict__ out, int hidden, float eps) {
    const int r = blockIdx.x;
    const int src = rows ? rows[r] : r;
    const float* xr = x + (u64)src * hidden;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        ss += xr[i] * xr[i];
    }
    ss = block_sum(ss);
    const float m = sqrtf(ss / (float)hidden + eps);
    wt* o = out + (u64)r * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        o[i] = f32_to_wt(xr[i] / m * w[i]);
    }
}

// The KV slot of position p of the sequence whose block table is bt.
__device__ __forceinline__ u64 kv_slot(const int* bt, int p, int block_size) {
    return (u64)bt[p / block_size] * block_size + p % block_size;
}

// For every token (one block each): adds the optional q/k/v bias, rotates
// the query heads in place and the key heads into the cache, and stores the
// values. qkv rows are [q (n_heads*D) | k (n_kv_heads*D) | v (n_kv_heads*D)].
// Pairs are (2i, 2i+1) when neox == 0 (GGUF Llama), (i, i+D/2) otherwise;
// angles come from the host's table, as on the CPU.
extern "C" __global__ void rope_store_kv(float* __restrict__ qkv, const float* __restrict__ bias,
                                         const int* __restrict__ pos, const int* __restrict__ seq_of_tok,
                                         const int* __restrict__ bt_offset, const int* __restrict__ block_tables,
                                         const float* __restrict__ cos_t, const float* __restrict__ sin_t,
                                         wt* __restrict__ k_cache, wt* __restrict__ v_cache, int n_heads,
                                         int n_kv_heads, int block_size, int neox) {
    const int t = blockIdx.x;
    const int half = HEAD_DIM / 2;
    const int qw = n_heads * HEAD_DIM;
    const int kvw = n_kv_heads * HEAD_DIM;
    float* row = qkv + (u64)t * (qw + 2 * kvw);
    const int p = pos[t];
    const u64 slot = kv_slot(block_tables + bt_offset[seq_of_tok[t]], p, block_size);
    wt* kdst = k_cache + slot * kvw;
    wt* vdst = v_cache + slot * kvw;
    const float* c = cos_t + (u64)p * half;
    const float* s = sin_t + (u64)p * half;
    const int pairs = (n_heads + n_kv_heads) * half;
    for (int j = threadIdx.x; j < pairs; j += blockDim.x) {
        const int h = j / half;
        const int i = j % half;
        const int base = h < n_heads ? h * HEAD_DIM : qw + (h - n_heads) * HEAD_DIM;
        const int ia = neox ? base + i : base + 2 * i;
        const int ib = neox ? base + i + half : base + 2 * i + 1;
        float a = row[ia];
        float b = row[ib];
        if (bias) {
            a += bias[ia];
            b += bias[ib];
        }
        const float ra = a * c[i] - b * s[i];
        const float rb = a * s[i] + b * c[i];
        if (h < n_heads) {
            row[ia] = ra;
            row[ib] = rb;
        } else {
            kdst[ia - qw] = f32_to_wt(ra);
            kdst[ib - qw] = f32_to_wt(rb);
        }
    }
    for (int j = threadIdx.x; j < kvw; j += blockDim.x) {
        float v = row[qw + kvw + j];
        if (bias) {
            v += bias[qw + kvw + j];
        }
        vdst[j] = f32_to_wt(v);
    }
}

// Causal attention over the paged cache, for decode and prefill tokens alike.
// Grid (tokens, n_kv_heads); block ATTN_WARPS warps. Token t at position p
// attends to positions 0..=p of its own sequence (its chunk's keys are
// already stored by rope_store_kv). The GROUP query heads sharing key/value
// head kvh (heads kvh*GROUP ..) are handled together, so each key and value
// row is read once per block. Warp w takes positions w, w+ATTN_WARPS, ..
// with an online softmax; lane l holds head elements l*DPL .. l*DPL+DPL-1;
// the warps' partial results are merged through shared memory at the end.
extern "C" __global__ void attention(const float* __restrict__ qkv, const int* __restrict__ pos,
                                     const int* __restrict__ seq_of_tok, const int* __restrict__ bt_offset,
                                     const int* __restrict__ block_tables, const wt* __restrict__ k_cache,
                                     const wt* __restrict__ v_cache, wt* __restrict__ out, int n_heads,
                                     int n_kv_heads, int block_size, float scale) {
    __shared__ float sm_m[ATTN_WARPS][GROUP];
    __shared__ float sm_l[ATTN_WARPS][GROUP];
    __shared__ float sm_acc[ATTN_WARPS][GROUP][HEAD_DIM];

    const int t = blockIdx.x;
    const int kvh = blockIdx.y;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int qw = n_heads * HEAD_DIM;
    const int kvw = n_kv_heads * HEAD_DIM;
    const float* qrow = qkv + (u64)t * (qw + 2 * kvw);
    const int p_end = pos[t] + 1;
    const int* bt = block_tables + bt_offset[seq_of_tok[t]];
    const int head_off = kvh * HEAD_DIM + lane * DPL;

    float q[GROUP][DPL];
    float acc[GROUP][DPL];
    float m[GROUP];
    float l[GROUP];
#pragma unroll
    for (int g = 0; g < GROUP; g++) {
        const float* qh = qrow + (kvh * GROUP + g) * HEAD_DIM + lane * DPL;
#pragma unroll
        for (int d = 0; d < DPL; d++) {
            q[g][d] = qh[d] * scale;
            acc[g][d] = 0.0f;
        }
        m[g] = NEG_INF;
        l[g] = 0.0f;
    }

    for (int p = warp; p < p_end; p += ATTN_WARPS) {
        const u64 at = kv_slot(bt, p, block_size) * kvw + head_off;
        float k[DPL];
        float v[DPL];
#pragma unroll
        for (int d = 0; d < DPL; d++) {
            k[d] = wt_to_f32(k_cache[at + d]);
            v[d] = wt_to_f32(v_cache[at + d]);
        }
#pragma unroll
        for (int g = 0; g < GROUP; g++) {
            float s = 0.0f;
#pragma unroll
            for (int d = 0; d < DPL; d++) {
                s += q[g][d] * k[d];
            }
            s = warp_sum(s);
            const float mn = fmaxf(m[g], s);
            const float corr = expf(m[g] - mn);
            const float e = expf(s - mn);
            l[g] = l[g] * corr + e;
#pragma unroll
            for (int d = 0; d < DPL; d++) {
                acc[g][d] = acc[g][d] * corr + e * v[d];
            }
            m[g] = mn;
        }
    }

#pragma unroll
    for (int g = 0; g < GROUP; g++) {
        if (lane == 0) {
            sm_m[warp][g] = m[g];
            sm_l[warp][g] = l[g];
        }
#pragma unroll
        for (int d = 0; d < DPL; d++) {
            sm_acc[warp][g][lane * DPL + d] = acc[g][d];
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < GROUP * HEAD_DIM; i += blockDim.x) {
        const int g = i / HEAD_DIM;
        const int d = i % HEAD_DIM;
        float mx = NEG_INF;
        for (int w = 0; w < ATTN_WARPS; w++) {
            mx = fmaxf(mx, sm_m[w][g]);
        }
        float sum = 0.0f;
        float o = 0.0f;
        for (int w = 0; w < ATTN_WARPS; w++) {
            // A warp that saw no position (short contexts) holds m = -inf, l = 0.
            const float f = sm_m[w][g] == NEG_INF ? 0.0f : expf(sm_m[w][g] - mx);
            sum += sm_l[w][g] * f;
            o += sm_acc[w][g][d] * f;
        }
        out[(u64)t * qw + (kvh * GROUP + g) * HEAD_DIM + d] = f32_to_wt(o / sum);
    }
}

// act[t, j] = silu(gate[t, j]) * up[t, j], gate_up rows being [gate | up].
extern "C" __global__ void swiglu(const float* __restrict__ gate_up, wt* __restrict__ act, int ff, int n) {
    const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (u64)n * ff) {
        return;
    }
    const u64 t = i / ff;
    const u64 j = i % ff;
    const float g = gate_up[t * 2 * ff + j];
    const float u = gate_up[t * 2 * ff + ff + j];
    act[i] = f32_to_wt(g / (1.0f + expf(-g)) * u);
}

// Keeps the larger value, the lower index on ties (NaN never wins).
__device__ __forceinline__ void arg_better(float& best, int& bi, float v, int i) {
    if (v > best || (v == best && i < bi)) {
        best = v;
        bi = i;
    }
}

// out[r] = the index of the largest of the vocab logits of row r, the lowest
// on ties, 0 when no value beats -inf (as the host's argmax). One block per row.
extern "C" __global__ void argmax_rows(const float* __restrict__ logits, int vocab, unsigned int* __restrict__ out) {
    __shared__ float sb[32];
    __shared__ int si[32];
    const float* r = logits + (u64)blockIdx.x * vocab;
    float best = NEG_INF;
    int bi = 0x7fffffff;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        if (r[i] > best) {
            best = r[i];
            bi = i;
        }
    }
    for (int o = 16; o > 0; o >>= 1) {
        arg_better(best, bi, __shfl_xor_sync(FULL_MASK, best, o), __shfl_xor_sync(FULL_MASK, bi, o));
    }
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    if (lane == 0) {
        sb[warp] = best;
        si[warp] = bi;
    }
    __syncthreads();
    if (warp == 0) {
        const bool has = lane < (int)(blockDim.x >> 5);
        best = has ? sb[lane] : NEG_INF;
        bi = has ? si[lane] : 0x7fffffff;
        for (int o = 16; o > 0; o >>= 1) {
            arg_better(best, bi, __shfl_xor_sync(FULL_MASK, best, o), __shfl_xor_sync(FULL_MASK, bi, o));
        }
        if (lane == 0) {
            out[blockIdx.x] = bi == 0x7fffffff ? 0u : (unsigned int)bi;
        }
    }
}
