//! Position-dependent parts of a step: RMSNorm, rotary embeddings, writing
//! keys and values into paged storage, and causal attention over it.

use std::cell::RefCell;

use rayon::prelude::*;

use super::kernels::{self, Isa};
use crate::model::RopeStyle;

/// `out = x / rms(x) * weight`, row by row.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let n = weight.len();
    for (xr, or) in x.chunks_exact(n).zip(out.chunks_exact_mut(n)) {
        let m = (xr.iter().map(|v| v * v).sum::<f32>() / n as f32 + eps).sqrt();
        for ((o, v), w) in or.iter_mut().zip(xr).zip(weight) {
            *o = v / m * w;
        }
    }
}

/// Cosine and sine of every rotary angle, by position.
#[derive(Debug)]
pub struct RopeTable {
    half: usize,
    style: RopeStyle,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl RopeTable {
    /// Angles for positions `0..positions` of heads `head_dim` wide.
    pub fn new(head_dim: usize, theta: f32, style: RopeStyle, positions: usize) -> RopeTable {
        let half = head_dim / 2;
        let inv: Vec<f32> = (0..half).map(|i| 1.0 / theta.powf((2 * i) as f32 / head_dim as f32)).collect();
        let mut cos = Vec::with_capacity(positions * half);
        let mut sin = Vec::with_capacity(positions * half);
        for p in 0..positions {
            for f in &inv {
                let a = p as f32 * f;
                cos.push(a.cos());
                sin.push(a.sin());
            }
        }
        RopeTable { half, style, cos, sin }
    }

    /// Positions the table covers.
    pub fn positions(&self) -> usize {
        self.cos.len() / self.half.max(1)
    }

    /// Rotates every head in `heads` (a run of `head_dim`-wide heads) for position `pos`.
    pub fn apply(&self, heads: &mut [f32], pos: usize) {
        let (c, s) = (&self.cos[pos * self.half..][..self.half], &self.sin[pos * self.half..][..self.half]);
        for h in heads.chunks_exact_mut(2 * self.half) {
            match self.style {
                RopeStyle::Interleaved => {
                    for i in 0..self.half {
                        let (a, b) = (h[2 * i], h[2 * i + 1]);
                        h[2 * i] = a * c[i] - b * s[i];
                        h[2 * i + 1] = a * s[i] + b * c[i];
                    }
                }
                RopeStyle::Neox => {
                    for i in 0..self.half {
                        let (a, b) = (h[i], h[i + self.half]);
                        h[i] = a * c[i] - b * s[i];
                        h[i + self.half] = a * s[i] + b * c[i];
                    }
                }
            }
        }
    }
}

/// Where one token of the step sits: its position and its sequence's blocks.
#[derive(Debug, Clone, Copy)]
pub struct TokenSlot<'a> {
    /// Position in the sequence.
    pub pos: usize,
    /// The sequence's block table.
    pub blocks: &'a [u32],
}

/// Shape of the attention computation.
#[derive(Debug, Clone, Copy)]
pub struct AttnShape {
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads.
    pub n_kv_heads: usize,
    /// Width of a head.
    pub head_dim: usize,
    /// Positions per KV block.
    pub block_size: usize,
}

impl AttnShape {
    fn kv_width(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    /// Offset in a layer's storage of position `pos` of a sequence.
    pub fn slot(&self, blocks: &[u32], pos: usize) -> usize {
        (blocks[pos / self.block_size] as usize * self.block_size + pos % self.block_size) * self.kv_width()
    }
}

thread_local! {
    static SCORES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Causal attention of every token's query heads over its sequence's cached
/// keys and values (positions `0..=pos`), written into `out`.
pub fn attend(isa: Isa, shape: AttnShape, q: &[f32], slots: &[TokenSlot<'_>], k: &[f32], v: &[f32], out: &mut [f32]) {
    let hd = shape.head_dim;
    let group = shape.n_heads / shape.n_kv_heads;
    let scale = 1.0 / (hd as f32).sqrt();
    let q_width = shape.n_heads * hd;
    out.par_chunks_mut(hd).enumerate().for_each(|(i, o)| {
        let (t, h) = (i / shape.n_heads, i % shape.n_heads);
        let slot = slots[t];
        let qh = &q[t * q_width + h * hd..][..hd];
        let kv_off = (h / group) * hd;
        SCORES.with_borrow_mut(|scores| {
            scores.clear();
            let mut max = f32::NEG_INFINITY;
            for p in 0..=slot.pos {
                let at = shape.slot(slot.blocks, p) + kv_off;
                let s = kernels::dot_f32(isa, qh, &k[at..at + hd]) * scale;
                max = max.max(s);
                scores.push(s);
            }
            for s in scores.iter_mut() {
                *s = (*s - max).exp();
            }
            let sum = kernels::sum_f32(scores);
            o.fill(0.0);
            for (p, s) in scores.iter().enumerate() {
                let at = shape.slot(slot.blocks, p) + kv_off;
                kernels::axpy(isa, s / sum, &v[at..at + hd], o);
            }
        });
    });
}
