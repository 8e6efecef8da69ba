//! Inner loops of the CPU backend: activation quantization and dot products
//! between packed weight rows and quantized activations (AVX2 versions picked
//! at run time on x86-64, portable versions elsewhere), plus the `f32`
//! helpers attention needs.
//!
//! Integer products are exact. Per-block scales multiply eight blocks' sums
//! at once, so a row's result depends only on its own data: the same token
//! gets the same logits whatever else shares its batch.

use super::packed::{QActs, QK, quantize_block};
#[cfg(target_arch = "x86_64")]
use super::x86;

/// Which instruction set the kernels use, chosen once at start-up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    /// AVX-512 VNNI on 256-bit vectors (one instruction per 32 byte products, 32 registers).
    Avx512Vnni,
    /// AVX2 + FMA.
    Avx2,
    /// Plain Rust.
    Portable,
}

impl Isa {
    /// The best instruction set this CPU offers.
    pub fn detect() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            if !(has!("avx2") && has!("fma")) {
                return Isa::Portable;
            }
            if has!("avx512f") && has!("avx512bw") && has!("avx512vl") && has!("avx512vnni") {
                return Isa::Avx512Vnni;
            }
            return Isa::Avx2;
        }
        #[allow(unreachable_code)]
        Isa::Portable
    }
}

/// One 4-bit weight row.
#[derive(Clone, Copy)]
pub struct Q4Row<'a> {
    /// Block scales.
    pub d: &'a [f32],
    /// Block minimums.
    pub m: &'a [f32],
    /// Packed nibbles.
    pub qs: &'a [[u8; 16]],
}

/// One group of eight interleaved 4-bit weight rows.
#[derive(Clone, Copy)]
pub struct Q4x8Group<'a> {
    /// Scales of the eight rows, per block.
    pub d: &'a [[f32; 8]],
    /// Minimums of the eight rows, per block.
    pub m: &'a [[f32; 8]],
    /// Interleaved nibbles, per block.
    pub qs: &'a [[[u8; 32]; 4]],
}

/// One group of eight interleaved 8-bit weight rows.
#[derive(Clone, Copy)]
pub struct Q8x8Group<'a> {
    /// Scales of the eight rows, per block.
    pub d: &'a [[f32; 8]],
    /// Interleaved values, per block.
    pub qs: &'a [[[i8; 32]; 8]],
}

/// One 8-bit weight row.
#[derive(Clone, Copy)]
pub struct Q8Row<'a> {
    /// Block scales.
    pub d: &'a [f32],
    /// Values.
    pub qs: &'a [[i8; 32]],
}

/// One quantized activation row.
#[derive(Clone, Copy)]
pub struct ActRow<'a> {
    /// Block scales.
    pub d: &'a [f32],
    /// Block scale times block sum.
    pub s: &'a [f32],
    /// Values.
    pub qs: &'a [[i8; 32]],
}

impl QActs {
    /// Row `t` of activations `nb` blocks wide.
    pub fn row(&self, t: usize, nb: usize) -> ActRow<'_> {
        let r = t * nb..(t + 1) * nb;
        ActRow { d: &self.d[r.clone()], s: &self.s[r.clone()], qs: &self.qs[r] }
    }
}

/// Quantizes `x` (rows of whole blocks) into `out`, reusing its storage.
pub fn quantize_rows(isa: Isa, x: &[f32], out: &mut QActs) {
    let n = x.len() / QK;
    out.d.resize(n, 0.0);
    out.s.resize(n, 0.0);
    out.qs.resize(n, [0; 32]);
    #[cfg(target_arch = "x86_64")]
    if isa != Isa::Portable {
        // SAFETY: every ISA but `Portable` is only chosen when the CPU reports AVX2 and FMA.
        unsafe { x86::avx2::quantize_rows(x, out) };
        return;
    }
    let _ = isa;
    for (i, block) in x.chunks_exact(QK).enumerate() {
        let (d, s, qs) = quantize_block(block);
        out.d[i] = d;
        out.s[i] = s;
        out.qs[i] = qs;
    }
}

/// Dot products of one 4-bit row with `N` activation rows.
#[inline]
pub fn dot_q4<const N: usize>(isa: Isa, w: Q4Row<'_>, a: [ActRow<'_>; N], out: &mut [f32; N]) {
    #[cfg(target_arch = "x86_64")]
    match isa {
        // SAFETY: each ISA is only chosen when the CPU reports its features.
        Isa::Avx512Vnni => return unsafe { x86::vnni::dot_q4(w, a, out) },
        // SAFETY: as above.
        Isa::Avx2 => return unsafe { x86::avx2::dot_q4(w, a, out) },
        Isa::Portable => {}
    }
    let _ = isa;
    for (o, a) in out.iter_mut().zip(a) {
        let mut sum = 0f32;
        for b in 0..w.qs.len() {
            let (q, x) = (&w.qs[b], &a.qs[b]);
            let sumi: i32 =
                (0..16).map(|j| (q[j] & 0x0f) as i32 * x[j] as i32 + (q[j] >> 4) as i32 * x[j + 16] as i32).sum();
            sum += sumi as f32 * (w.d[b] * a.d[b]) + w.m[b] * a.s[b];
        }
        *o = sum;
    }
}

/// Dot products of eight interleaved 4-bit rows with `N` activation rows:
/// `out[n][r]` is row `r` times activation row `n`.
#[inline]
pub fn dot_q4x8<const N: usize>(isa: Isa, w: Q4x8Group<'_>, a: [ActRow<'_>; N], out: &mut [[f32; 8]; N]) {
    #[cfg(target_arch = "x86_64")]
    match isa {
        // SAFETY: each ISA is only chosen when the CPU reports its features.
        Isa::Avx512Vnni => return unsafe { x86::vnni::dot_q4x8(w, a, out) },
        // SAFETY: as above.
        Isa::Avx2 => return unsafe { x86::avx2::dot_q4x8(w, a, out) },
        Isa::Portable => {}
    }
    let _ = isa;
    for (o, a) in out.iter_mut().zip(a) {
        for (r, o) in o.iter_mut().enumerate() {
            let mut sum = 0f32;
            let mut mins = 0f32;
            for b in 0..w.qs.len() {
                let mut sumi = 0i32;
                for v in 0..4 {
                    for i in 0..4 {
                        let q = w.qs[b][v][4 * r + i];
                        sumi += (q & 0x0f) as i32 * a.qs[b][4 * v + i] as i32
                            + (q >> 4) as i32 * a.qs[b][16 + 4 * v + i] as i32;
                    }
                }
                sum += sumi as f32 * (w.d[b][r] * a.d[b]);
                mins += w.m[b][r] * a.s[b];
            }
            *o = sum + mins;
        }
    }
}

/// Dot products of eight interleaved 8-bit rows with `N` activation rows.
#[inline]
pub fn dot_q8x8<const N: usize>(isa: Isa, w: Q8x8Group<'_>, a: [ActRow<'_>; N], out: &mut [[f32; 8]; N]) {
    #[cfg(target_arch = "x86_64")]
    match isa {
        // SAFETY: each ISA is only chosen when the CPU reports its features.
        Isa::Avx512Vnni => return unsafe { x86::vnni::dot_q8x8(w, a, out) },
        // SAFETY: as above.
        Isa::Avx2 => return unsafe { x86::avx2::dot_q8x8(w, a, out) },
        Isa::Portable => {}
    }
    let _ = isa;
    for (o, a) in out.iter_mut().zip(a) {
        for (r, o) in o.iter_mut().enumerate() {
            let mut sum = 0f32;
            for b in 0..w.qs.len() {
                let mut sumi = 0i32;
                for v in 0..8 {
                    for i in 0..4 {
                        sumi += w.qs[b][v][4 * r + i] as i32 * a.qs[b][4 * v + i] as i32;
                    }
                }
                sum += sumi as f32 * (w.d[b][r] * a.d[b]);
            }
            *o = sum;
        }
    }
}

/// Dot products of one 8-bit row with `N` activation rows.
#[inline]
pub fn dot_q8<const N: usize>(isa: Isa, w: Q8Row<'_>, a: [ActRow<'_>; N], out: &mut [f32; N]) {
    #[cfg(target_arch = "x86_64")]
    match isa {
        // SAFETY: each ISA is only chosen when the CPU reports its features.
        Isa::Avx512Vnni => return unsafe { x86::vnni::dot_q8(w, a, out) },
        // SAFETY: as above.
        Isa::Avx2 => return unsafe { x86::avx2::dot_q8(w, a, out) },
        Isa::Portable => {}
    }
    let _ = isa;
    for (o, a) in out.iter_mut().zip(a) {
        let mut sum = 0f32;
        for b in 0..w.qs.len() {
            let sumi: i32 = w.qs[b].iter().zip(&a.qs[b]).map(|(&x, &y)| x as i32 * y as i32).sum();
            sum += sumi as f32 * (w.d[b] * a.d[b]);
        }
        *o = sum;
    }
}

/// Dot product of two `f32` slices of equal length.
#[inline]
pub fn dot_f32(isa: Isa, a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if isa != Isa::Portable {
        // SAFETY: every ISA but `Portable` is only chosen when the CPU reports AVX2 and FMA.
        return unsafe { x86::avx2::dot_f32(a, b) };
    }
    let _ = isa;
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// `y += alpha * x`.
#[inline]
pub fn axpy(isa: Isa, alpha: f32, x: &[f32], y: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if isa != Isa::Portable {
        // SAFETY: every ISA but `Portable` is only chosen when the CPU reports AVX2 and FMA.
        unsafe { x86::avx2::axpy(alpha, x, y) };
        return;
    }
    let _ = isa;
    for (y, x) in y.iter_mut().zip(x) {
        *y += alpha * x;
    }
}

/// Sum of `x` in a fixed order: four 8-lane accumulators over whole runs of
/// 32, reduced pairwise, then the tail in sequence.
pub fn sum_f32(x: &[f32]) -> f32 {
    let runs = x.chunks_exact(32);
    let tail = runs.remainder();
    let mut acc = [[0f32; 8]; 4];
    for run in runs {
        for (a, part) in acc.iter_mut().zip(run.chunks_exact(8)) {
            for (a, v) in a.iter_mut().zip(part) {
                *a += v;
            }
        }
    }
    let mut v = [0f32; 8];
    for i in 0..8 {
        v[i] = (acc[0][i] + acc[1][i]) + (acc[2][i] + acc[3][i]);
    }
    let t0 = [v[0] + v[4], v[1] + v[5], v[2] + v[6], v[3] + v[7]];
    let mut sum = (t0[0] + t0[1]) + (t0[2] + t0[3]);
    for v in tail {
        sum += v;
    }
    sum
}

#[cfg(test)]
mod tests {
    use super::super::packed::{Matrix, Packed, quantize_block};
    use super::*;
    use crate::model::{DType, Tensor};

    /// A Q4_1 tensor of `rows x cols` with varied scales and nibbles.
    fn q4_tensor(rows: usize, cols: usize) -> Tensor {
        let mut data = Vec::new();
        for i in 0..rows * cols / 32 {
            data.extend_from_slice(&super::super::packed::f32_to_f16(0.01 + (i % 7) as f32 * 0.003).to_le_bytes());
            data.extend_from_slice(&super::super::packed::f32_to_f16(-0.05 + (i % 5) as f32 * 0.01).to_le_bytes());
            data.extend((0..16).map(|j| ((i * 31 + j * 17) % 256) as u8));
        }
        Tensor { name: "w".into(), dtype: DType::Q4_1, rows, cols, data }
    }

    #[test]
    fn simd_and_portable_kernels_agree_with_a_float_reference() {
        let (rows, cols) = (3, 32 * 19);
        let t = q4_tensor(rows, cols);
        let m = Matrix::pack(&t);
        let x: Vec<f32> = (0..2 * cols).map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0).collect();
        let Packed::Q4(w) = &m.data else { panic!("packed as Q4") };
        let nb = cols / 32;
        let dense = t.to_f32();
        let mut isas = vec![Isa::detect(), Isa::Portable];
        if isas[0] == Isa::Avx512Vnni {
            isas.push(Isa::Avx2);
        }
        for isa in isas {
            let mut acts = QActs::default();
            quantize_rows(isa, &x, &mut acts);
            for r in 0..rows {
                let row = Q4Row { d: &w.d[r * nb..][..nb], m: &w.m[r * nb..][..nb], qs: &w.qs[r * nb..][..nb] };
                let mut two = [0f32; 2];
                dot_q4(isa, row, [acts.row(0, nb), acts.row(1, nb)], &mut two);
                let mut one = [0f32; 1];
                dot_q4(isa, row, [acts.row(1, nb)], &mut one);
                assert_eq!(one[0], two[1], "a row's result does not depend on its batch");
                for t in 0..2 {
                    let exact: f32 =
                        dense[r * cols..(r + 1) * cols].iter().zip(&x[t * cols..]).map(|(a, b)| a * b).sum();
                    assert!((two[t] - exact).abs() < 0.02 * exact.abs().max(1.0), "{isa:?}: {} vs {exact}", two[t]);
                }
            }
        }
        // Sixteen rows pack as two interleaved groups of eight.
        let t16 = q4_tensor(16, cols);
        let m16 = Matrix::pack(&t16);
        let Packed::Q4x8(g) = &m16.data else { panic!("packed as Q4x8") };
        let dense = t16.to_f32();
        let mut row = vec![0f32; cols];
        m16.row_to_f32(11, &mut row);
        assert_eq!(row, dense[11 * cols..12 * cols]);
        let mut isas = vec![Isa::detect(), Isa::Portable];
        if isas[0] == Isa::Avx512Vnni {
            isas.push(Isa::Avx2);
        }
        for isa in isas {
            let mut acts = QActs::default();
            quantize_rows(isa, &x, &mut acts);
            let group = Q4x8Group { d: &g.d[nb..2 * nb], m: &g.m[nb..2 * nb], qs: &g.qs[nb..2 * nb] };
            let mut two = [[0f32; 8]; 2];
            dot_q4x8(isa, group, [acts.row(0, nb), acts.row(1, nb)], &mut two);
            let mut one = [[0f32; 8]; 1];
            dot_q4x8(isa, group, [acts.row(1, nb)], &mut one);
            assert_eq!(one[0], two[1], "a row's result does not depend on its batch");
            for t in 0..2 {
                for (r, got) in two[t].iter().enumerate() {
                    let row = 8 + r;
                    let exact: f32 =
                        dense[row * cols..(row + 1) * cols].iter().zip(&x[t * cols..]).map(|(a, b)| a * b).sum();
                    assert!((got - exact).abs() < 0.02 * exact.abs().max(1.0), "{isa:?} row {row}: {got} vs {exact}");
                }
            }
        }
        // Q8_0 rows interleave too.
        let mut data = Vec::new();
        for i in 0..16 * cols / 32 {
            data.extend_from_slice(&super::super::packed::f32_to_f16(0.004 + (i % 3) as f32 * 0.001).to_le_bytes());
            data.extend((0..32).map(|j| ((i * 13 + j * 29) % 256) as u8));
        }
        let t8 = Tensor { name: "e".into(), dtype: DType::Q8_0, rows: 16, cols, data };
        let m8 = Matrix::pack(&t8);
        let Packed::Q8x8(g8) = &m8.data else { panic!("packed as Q8x8") };
        let dense8 = t8.to_f32();
        m8.row_to_f32(5, &mut row);
        assert_eq!(row, dense8[5 * cols..6 * cols]);
        for isa in [Isa::detect(), Isa::Avx2, Isa::Portable] {
            if isa == Isa::Avx2 && Isa::detect() == Isa::Portable {
                continue;
            }
            let mut acts = QActs::default();
            quantize_rows(isa, &x, &mut acts);
            let group = Q8x8Group { d: &g8.d[..nb], qs: &g8.qs[..nb] };
            let mut o = [[0f32; 8]; 1];
            dot_q8x8(isa, group, [acts.row(1, nb)], &mut o);
            for r in 0..8 {
                let exact: f32 = dense8[r * cols..(r + 1) * cols].iter().zip(&x[cols..]).map(|(a, b)| a * b).sum();
                assert!(
                    (o[0][r] - exact).abs() < 0.02 * exact.abs().max(1.0),
                    "{isa:?} q8 row {r}: {} vs {exact}",
                    o[0][r]
                );
            }
        }
        let (d, s, qs) = quantize_block(&x[..32]);
        assert!(d > 0.0 && qs.iter().any(|&q| q == 127 || q == -127));
        assert!((s - d * qs.iter().map(|&q| q as f32).sum::<f32>()).abs() < 1e-2);
    }
}
