//! The CPU backend: quantized weights run quantized (AVX2 where available),
//! work spread over a dedicated thread pool, keys and values in paged `f32`
//! storage, and every buffer reused from step to step.

mod attention;
mod kernels;
mod matmul;
mod packed;
#[cfg(target_arch = "x86_64")]
mod x86;

use rayon::prelude::*;

use self::attention::{AttnShape, RopeTable, TokenSlot};
use self::kernels::Isa;
use self::matmul::MatmulScratch;
use self::packed::Matrix;
use super::{Backend, BackendError, StepBatch};
use crate::kv::KvLayout;
use crate::model::{Model, ModelConfig};

struct Layer {
    attn_norm: Vec<f32>,
    wq: Matrix,
    wk: Matrix,
    wv: Matrix,
    qkv_bias: Option<Vec<f32>>,
    wo: Matrix,
    ffn_norm: Vec<f32>,
    w_gate: Matrix,
    w_up: Matrix,
    w_down: Matrix,
}

struct Weights {
    embed: Matrix,
    lm_head: Option<Matrix>,
    output_norm: Vec<f32>,
    layers: Vec<Layer>,
}

#[derive(Default)]
struct Scratch {
    x: Vec<f32>,
    h: Vec<f32>,
    qkv: Vec<f32>,
    q: Vec<f32>,
    attn: Vec<f32>,
    proj: Vec<f32>,
    gate_up: Vec<f32>,
    act: Vec<f32>,
    last: Vec<f32>,
    last_norm: Vec<f32>,
    mm: MatmulScratch,
}

/// Runs a Llama-family decoder on the CPU.
pub struct CpuBackend {
    config: ModelConfig,
    isa: Isa,
    pool: rayon::ThreadPool,
    weights: Weights,
    rope: RopeTable,
    layout: KvLayout,
    k_cache: Vec<Vec<f32>>,
    v_cache: Vec<Vec<f32>>,
    scratch: Scratch,
}

impl CpuBackend {
    /// Repacks `model`'s weights and allocates KV storage for `layout`,
    /// computing on `threads` threads (0: one per core).
    pub fn new(model: &Model, layout: &KvLayout, threads: usize) -> Result<CpuBackend, BackendError> {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("levee-cpu-{i}"))
            .build()
            .map_err(|e| BackendError::Threads { threads, reason: e.to_string() })?;
        let c = &model.config;
        let w = &model.weights;
        let layers = pool.install(|| {
            w.layers
                .par_iter()
                .map(|l| Layer {
                    attn_norm: l.attn_norm.to_f32(),
                    wq: Matrix::pack(&l.wq),
                    wk: Matrix::pack(&l.wk),
                    wv: Matrix::pack(&l.wv),
                    qkv_bias: l.qkv_bias.as_ref().map(|b| b.iter().flat_map(|t| t.to_f32()).collect()),
                    wo: Matrix::pack(&l.wo),
                    ffn_norm: l.ffn_norm.to_f32(),
                    w_gate: Matrix::pack(&l.w_gate),
                    w_up: Matrix::pack(&l.w_up),
                    w_down: Matrix::pack(&l.w_down),
                })
                .collect()
        });
        let weights = Weights {
            embed: Matrix::pack(&w.token_embd),
            lm_head: w.output.as_ref().map(Matrix::pack),
            output_norm: w.output_norm.to_f32(),
            layers,
        };
        let per_layer = layout.num_blocks * layout.block_size * c.kv_width();
        let alloc = || {
            let mut v = Vec::new();
            v.try_reserve_exact(per_layer)
                .map_err(|_| BackendError::KvAlloc { bytes: layout.num_blocks * layout.block_bytes })?;
            v.resize(per_layer, 0f32);
            Ok::<_, BackendError>(v)
        };
        let k_cache = (0..c.n_layers).map(|_| alloc()).collect::<Result<Vec<_>, _>>()?;
        let v_cache = (0..c.n_layers).map(|_| alloc()).collect::<Result<Vec<_>, _>>()?;
        Ok(CpuBackend {
            config: c.clone(),
            isa: Isa::detect(),
            pool,
            weights,
            rope: RopeTable::new(c.head_dim, c.rope_theta, c.rope_style, c.max_context),
            layout: *layout,
            k_cache,
            v_cache,
            scratch: Scratch::default(),
        })
    }
}

impl Backend for CpuBackend {
    fn name(&self) -> String {
        format!("cpu ({:?}, {} threads)", self.isa, self.pool.current_num_threads())
    }

    fn forward(&mut self, batch: &StepBatch<'_>, logits: &mut Vec<f32>) -> Result<(), BackendError> {
        batch.validate(&self.layout, self.rope.positions(), self.config.vocab_size)?;
        let CpuBackend { config, isa, pool, weights, rope, layout, k_cache, v_cache, scratch } = self;
        let step = Step { c: config, isa: *isa, w: weights, rope, layout, batch };
        pool.install(|| step.run(k_cache, v_cache, scratch, logits));
        Ok(())
    }
}

struct Step<'a> {
    c: &'a ModelConfig,
    isa: Isa,
    w: &'a Weights,
    rope: &'a RopeTable,
    layout: &'a KvLayout,
    batch: &'a StepBatch<'a>,
}

impl Step<'_> {
    fn run(&self, k_cache: &mut [Vec<f32>], v_cache: &mut [Vec<f32>], s: &mut Scratch, logits: &mut Vec<f32>) {
        let c = self.c;
        let n = self.batch.token_count();
        let (hid, qw, kvw, ff) = (c.hidden, c.q_width(), c.kv_width(), c.ffn_hidden);
        let slots: Vec<TokenSlot<'_>> = self
            .batch
            .seqs
            .iter()
            .flat_map(|sq| {
                (0..sq.tokens.len()).map(move |i| TokenSlot { pos: sq.start_pos + i, blocks: sq.block_table })
            })
            .collect();
        let shape = AttnShape {
            n_heads: c.n_heads,
            n_kv_heads: c.n_kv_heads,
            head_dim: c.head_dim,
            block_size: self.layout.block_size,
        };
        s.x.resize(n * hid, 0.0);
        s.h.resize(n * hid, 0.0);
        s.qkv.resize(n * (qw + 2 * kvw), 0.0);
        s.q.resize(n * qw, 0.0);
        s.attn.resize(n * qw, 0.0);
        s.proj.resize(n * hid, 0.0);
        s.gate_up.resize(n * 2 * ff, 0.0);
        s.act.resize(n * ff, 0.0);

        let tokens = self.batch.seqs.iter().flat_map(|sq| sq.tokens.iter());
        for (row, &t) in s.x.chunks_exact_mut(hid).zip(tokens) {
            self.w.embed.row_to_f32(t as usize, row);
        }
        for (l, layer) in self.w.layers.iter().enumerate() {
            attention::rms_norm(&s.x, &layer.attn_norm, c.rms_eps, &mut s.h);
            matmul::matmul(self.isa, &[&layer.wq, &layer.wk, &layer.wv], &s.h, n, &mut s.mm, &mut s.qkv);
            let (kc, vc) = (&mut k_cache[l], &mut v_cache[l]);
            for (t, row) in s.qkv.chunks_exact_mut(qw + 2 * kvw).enumerate() {
                if let Some(b) = &layer.qkv_bias {
                    row.iter_mut().zip(b).for_each(|(x, b)| *x += b);
                }
                let slot = slots[t];
                let (q, kv) = row.split_at_mut(qw);
                self.rope.apply(q, slot.pos);
                self.rope.apply(&mut kv[..kvw], slot.pos);
                s.q[t * qw..(t + 1) * qw].copy_from_slice(q);
                let at = shape.slot(slot.blocks, slot.pos);
                kc[at..at + kvw].copy_from_slice(&kv[..kvw]);
                vc[at..at + kvw].copy_from_slice(&kv[kvw..]);
            }
            attention::attend(self.isa, shape, &s.q, &slots, kc, vc, &mut s.attn);
            matmul::matmul(self.isa, &[&layer.wo], &s.attn, n, &mut s.mm, &mut s.proj);
            s.x.iter_mut().zip(&s.proj).for_each(|(x, p)| *x += p);

            attention::rms_norm(&s.x, &layer.ffn_norm, c.rms_eps, &mut s.h);
            matmul::matmul(self.isa, &[&layer.w_gate, &layer.w_up], &s.h, n, &mut s.mm, &mut s.gate_up);
            s.act.par_chunks_mut(ff).zip(s.gate_up.par_chunks(2 * ff)).for_each(|(a, gu)| {
                let (g, u) = gu.split_at(ff);
                for ((a, &g), &u) in a.iter_mut().zip(g).zip(u) {
                    *a = g / (1.0 + (-g).exp()) * u;
                }
            });
            matmul::matmul(self.isa, &[&layer.w_down], &s.act, n, &mut s.mm, &mut s.proj);
            s.x.iter_mut().zip(&s.proj).for_each(|(x, p)| *x += p);
        }

        let wanted = self.batch.logits_count();
        s.last.clear();
        let mut end = 0;
        for sq in &self.batch.seqs {
            end += sq.tokens.len();
            if sq.wants_logits {
                s.last.extend_from_slice(&s.x[(end - 1) * hid..end * hid]);
            }
        }
        s.last_norm.resize(s.last.len(), 0.0);
        attention::rms_norm(&s.last, &self.w.output_norm, c.rms_eps, &mut s.last_norm);
        logits.resize(wanted * c.vocab_size, 0.0);
        if wanted > 0 {
            let head = self.w.lm_head.as_ref().unwrap_or(&self.w.embed);
            matmul::matmul(self.isa, &[head], &s.last_norm, wanted, &mut s.mm, logits);
        }
    }
}
