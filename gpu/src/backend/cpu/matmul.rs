//! Matrix products `x · Wᵀ` for a batch of token rows, spread over the
//! thread pool by output rows so that each weight row is read once per step
//! whatever the batch size.

use rayon::prelude::*;

use super::kernels::{self, ActRow, Isa, Q4Row, Q4x8Group, Q8Row, Q8x8Group};
use super::packed::{Matrix, Packed, QActs, QK};

/// Reused buffers of the matrix products (no allocation once warm).
#[derive(Debug, Default)]
pub struct MatmulScratch {
    qa: QActs,
    out_t: Vec<f32>,
}

/// Computes `out[t][..] = concat(parts)ᵀ · x[t]` for `tokens` rows of `x`.
///
/// Every part must have `x`'s row width as its column count; `out` holds
/// `tokens` rows of the parts' summed row counts. Must run inside the
/// backend's thread pool.
pub fn matmul(isa: Isa, parts: &[&Matrix], x: &[f32], tokens: usize, s: &mut MatmulScratch, out: &mut [f32]) {
    let cols = parts[0].cols;
    let total: usize = parts.iter().map(|p| p.rows).sum();
    debug_assert!(parts.iter().all(|p| p.cols == cols));
    debug_assert_eq!(x.len(), tokens * cols);
    debug_assert_eq!(out.len(), tokens * total);
    if parts.iter().any(|p| p.wants_quantized_input()) {
        kernels::quantize_rows(isa, x, &mut s.qa);
    }
    let threads = rayon::current_num_threads().max(1);
    // Multiples of 8 so that interleaved row groups never straddle two tasks.
    let chunk_rows = (total / (threads * 8)).next_multiple_of(8).max(8);
    let qa = &s.qa;
    let run = |first: usize, dst: &mut [f32]| rows_into(isa, parts, x, qa, tokens, first, dst);
    if tokens == 1 {
        out.par_chunks_mut(chunk_rows).enumerate().for_each(|(i, dst)| run(i * chunk_rows, dst));
        return;
    }
    s.out_t.resize(total * tokens, 0.0);
    s.out_t.par_chunks_mut(chunk_rows * tokens).enumerate().for_each(|(i, dst)| run(i * chunk_rows, dst));
    for (t, row) in out.chunks_exact_mut(total).enumerate() {
        for (r, o) in row.iter_mut().enumerate() {
            *o = s.out_t[r * tokens + t];
        }
    }
}

/// Fills `dst` (rows `first..`, each `tokens` wide) with dot products.
fn rows_into(isa: Isa, parts: &[&Matrix], x: &[f32], qa: &QActs, tokens: usize, first: usize, dst: &mut [f32]) {
    let cols = parts[0].cols;
    let nb = cols / QK;
    let act = |t: usize| qa.row(t, nb);
    let rows = dst.len() / tokens;
    let mut i = 0;
    while i < rows {
        let mut r = first + i;
        let mut part = parts[0];
        for p in parts {
            part = p;
            if r < p.rows {
                break;
            }
            r -= p.rows;
        }
        let out = &mut dst[i * tokens..];
        let blocks = r * nb..(r + 1) * nb;
        match &part.data {
            Packed::Q4x8(w) => {
                let groups = (r / 8) * nb..(r / 8 + 1) * nb;
                let group = Q4x8Group { d: &w.d[groups.clone()], m: &w.m[groups.clone()], qs: &w.qs[groups] };
                i += by_groups(
                    r,
                    rows - i,
                    tokens,
                    out,
                    &act,
                    |a, o| kernels::dot_q4x8(isa, group, a, o),
                    |a, o| kernels::dot_q4x8(isa, group, a, o),
                    |a, o| kernels::dot_q4x8(Isa::Portable, group, a, o),
                );
                continue;
            }
            Packed::Q8x8(w) => {
                let groups = (r / 8) * nb..(r / 8 + 1) * nb;
                let group = Q8x8Group { d: &w.d[groups.clone()], qs: &w.qs[groups] };
                i += by_groups(
                    r,
                    rows - i,
                    tokens,
                    out,
                    &act,
                    |a, o| kernels::dot_q8x8(isa, group, a, o),
                    |a, o| kernels::dot_q8x8(isa, group, a, o),
                    |a, o| kernels::dot_q8x8(Isa::Portable, group, a, o),
                );
                continue;
            }
            Packed::Q4(w) => {
                let row = Q4Row { d: &w.d[blocks.clone()], m: &w.m[blocks.clone()], qs: &w.qs[blocks] };
                by_fours(
                    &mut out[..tokens],
                    &act,
                    |a4, o| kernels::dot_q4(isa, row, a4, o),
                    |a1, o| kernels::dot_q4(isa, row, a1, o),
                );
            }
            Packed::Q8(w) => {
                let row = Q8Row { d: &w.d[blocks.clone()], qs: &w.qs[blocks] };
                by_fours(
                    &mut out[..tokens],
                    &act,
                    |a4, o| kernels::dot_q8(isa, row, a4, o),
                    |a1, o| kernels::dot_q8(isa, row, a1, o),
                );
            }
            Packed::F32(w) => {
                let w = &w[r * cols..(r + 1) * cols];
                for (t, o) in out[..tokens].iter_mut().enumerate() {
                    *o = kernels::dot_f32(isa, w, &x[t * cols..(t + 1) * cols]);
                }
            }
        }
        i += 1;
    }
}

/// Runs an interleaved group of eight rows (the one holding row `r`) over
/// all tokens, four at a time, writing rows `r..r + 8` of `out`; returns the
/// rows written. A group cut by a task boundary (possible only when a part
/// before this one has a row count that is not a multiple of 8) is computed
/// row by row through `single`.
#[allow(clippy::too_many_arguments)]
fn by_groups<'a>(
    r: usize,
    rows_left: usize,
    tokens: usize,
    out: &mut [f32],
    act: &impl Fn(usize) -> ActRow<'a>,
    four: impl Fn([ActRow<'a>; 4], &mut [[f32; 8]; 4]),
    one: impl Fn([ActRow<'a>; 1], &mut [[f32; 8]; 1]),
    single: impl Fn([ActRow<'a>; 1], &mut [[f32; 8]; 1]),
) -> usize {
    if !r.is_multiple_of(8) || rows_left < 8 {
        for (t, o) in out[..tokens].iter_mut().enumerate() {
            let mut all = [[0f32; 8]; 1];
            single([act(t)], &mut all);
            *o = all[0][r % 8];
        }
        return 1;
    }
    let mut put = |t: usize, o: &[f32; 8]| {
        for (k, v) in o.iter().enumerate() {
            out[k * tokens + t] = *v;
        }
    };
    let mut t = 0;
    while t + 4 <= tokens {
        let mut o = [[0f32; 8]; 4];
        four([act(t), act(t + 1), act(t + 2), act(t + 3)], &mut o);
        for (k, o) in o.iter().enumerate() {
            put(t + k, o);
        }
        t += 4;
    }
    for t in t..tokens {
        let mut o = [[0f32; 8]; 1];
        one([act(t)], &mut o);
        put(t, &o[0]);
    }
    8
}

/// Runs a row's dot products four tokens at a time, then one at a time.
fn by_fours<'a>(
    out: &mut [f32],
    act: &impl Fn(usize) -> ActRow<'a>,
    four: impl Fn([ActRow<'a>; 4], &mut [f32; 4]),
    one: impl Fn([ActRow<'a>; 1], &mut [f32; 1]),
) {
    let tokens = out.len();
    let mut t = 0;
    while t + 4 <= tokens {
        let mut o = [0f32; 4];
        four([act(t), act(t + 1), act(t + 2), act(t + 3)], &mut o);
        out[t..t + 4].copy_from_slice(&o);
        t += 4;
    }
    for (t, slot) in out.iter_mut().enumerate().skip(t) {
        let mut o = [0f32; 1];
        one([act(t)], &mut o);
        *slot = o[0];
    }
}
