//! Weight matrices repacked for the CPU kernels, and quantized activations.
//!
//! Quantized data is kept as structure-of-arrays (scales apart from the
//! packed integers) so that the kernels can load eight blocks' scales at once.
//! 4-bit files (Q4_0, Q4_1) become [`Q4Rows`] with `f32` scale and minimum;
//! Q8_0 becomes [`Q8Rows`]; float files stay `f32`; other quantized types
//! (Q5_x, K-quants) are dequantized and requantized to Q8_0 at load.
//! Activations are quantized per row into [`QActs`] the way ggml does
//! (scale and sum in half precision).

use crate::model::{DType, Tensor, f16_to_f32};

/// Elements per quantized block.
pub const QK: usize = 32;

/// 4-bit rows: element `j` of block `b` is `d[b] * q + m[b]`, with `q` in the
/// low nibble of `qs[b][j]` for `j < 16` and the high nibble of `qs[b][j - 16]` after.
#[derive(Debug, Default)]
pub struct Q4Rows {
    /// Scales, one per block.
    pub d: Vec<f32>,
    /// Minimums, one per block.
    pub m: Vec<f32>,
    /// Packed nibbles, one array per block.
    pub qs: Vec<[u8; 16]>,
}

/// 4-bit rows interleaved by groups of eight, so that one vector instruction
/// advances eight rows at once (lane = row). For group `g` and block `b`
/// (index `g * blocks + b`), byte `4r + i` of `qs[..][v]` holds element
/// `4v + i` of row `r` in its low nibble and element `16 + 4v + i` in its high
/// nibble; `d` and `m` hold the eight rows' scales and minimums.
#[derive(Debug, Default)]
pub struct Q4x8Rows {
    /// Scales of the eight rows, per block.
    pub d: Vec<[f32; 8]>,
    /// Minimums of the eight rows, per block.
    pub m: Vec<[f32; 8]>,
    /// Interleaved nibbles, four vectors per block.
    pub qs: Vec<[[u8; 32]; 4]>,
}

impl Q4x8Rows {
    /// Interleaves `rows` (a multiple of 8) rows of `nb` blocks.
    fn interleave(rows: &Q4Rows, n_rows: usize, nb: usize) -> Q4x8Rows {
        let mut out = Q4x8Rows::default();
        for g in 0..n_rows / 8 {
            for b in 0..nb {
                let mut d = [0f32; 8];
                let mut m = [0f32; 8];
                let mut qs = [[0u8; 32]; 4];
                for r in 0..8 {
                    let at = (g * 8 + r) * nb + b;
                    d[r] = rows.d[at];
                    m[r] = rows.m[at];
                    let src = &rows.qs[at];
                    for (v, vec) in qs.iter_mut().enumerate() {
                        for i in 0..4 {
                            // Byte 4v + i of a row already pairs elements 4v + i and 16 + 4v + i.
                            vec[4 * r + i] = src[4 * v + i];
                        }
                    }
                }
                out.d.push(d);
                out.m.push(m);
                out.qs.push(qs);
            }
        }
        out
    }
}

/// 8-bit rows: element `j` of block `b` is `d[b] * qs[b][j]`.
#[derive(Debug, Default)]
pub struct Q8Rows {
    /// Scales, one per block.
    pub d: Vec<f32>,
    /// Quantized values, one array per block.
    pub qs: Vec<[i8; 32]>,
}

/// 8-bit rows interleaved by groups of eight (lane = row): for group `g` and
/// block `b` (index `g * blocks + b`), byte `4r + i` of `qs[..][v]` is element
/// `4v + i` of row `r`.
#[derive(Debug, Default)]
pub struct Q8x8Rows {
    /// Scales of the eight rows, per block.
    pub d: Vec<[f32; 8]>,
    /// Interleaved values, eight vectors per block.
    pub qs: Vec<[[i8; 32]; 8]>,
}

impl Q8x8Rows {
    /// Interleaves `n_rows` (a multiple of 8) rows of `nb` blocks.
    fn interleave(rows: &Q8Rows, n_rows: usize, nb: usize) -> Q8x8Rows {
        let mut out = Q8x8Rows::default();
        for g in 0..n_rows / 8 {
            for b in 0..nb {
                let mut d = [0f32; 8];
                let mut qs = [[0i8; 32]; 8];
                for r in 0..8 {
                    let at = (g * 8 + r) * nb + b;
                    d[r] = rows.d[at];
                    for (v, vec) in qs.iter_mut().enumerate() {
                        vec[4 * r..4 * r + 4].copy_from_slice(&rows.qs[at][4 * v..4 * v + 4]);
                    }
                }
                out.d.push(d);
                out.qs.push(qs);
            }
        }
        out
    }
}

/// Quantized activations: like [`Q8Rows`], plus `s[b] = d[b] * sum(qs[b])`
/// for the minimum term of 4-bit weights.
#[derive(Debug, Default)]
pub struct QActs {
    /// Scales, one per block.
    pub d: Vec<f32>,
    /// Scale times the sum of the block's values.
    pub s: Vec<f32>,
    /// Quantized values, one array per block.
    pub qs: Vec<[i8; 32]>,
}

/// Rows of a weight matrix in a kernel-ready format.
#[derive(Debug)]
pub enum Packed {
    /// 4-bit rows.
    Q4(Q4Rows),
    /// 4-bit rows interleaved by eight.
    Q4x8(Q4x8Rows),
    /// 8-bit rows.
    Q8(Q8Rows),
    /// 8-bit rows interleaved by eight.
    Q8x8(Q8x8Rows),
    /// Float rows.
    F32(Vec<f32>),
}

impl Packed {
    /// The interleaved form of 8-bit rows when the row count allows it.
    fn interleaved(self, rows: usize, nb: usize) -> Packed {
        match self {
            Packed::Q8(q) if rows.is_multiple_of(8) => Packed::Q8x8(Q8x8Rows::interleave(&q, rows, nb)),
            other => other,
        }
    }
}

/// A weight matrix, `rows x cols`, row-major.
#[derive(Debug)]
pub struct Matrix {
    /// Output features.
    pub rows: usize,
    /// Input features.
    pub cols: usize,
    /// The rows.
    pub data: Packed,
}

fn half_at(b: &[u8], at: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[at], b[at + 1]]))
}

impl Matrix {
    /// Repacks a stored tensor.
    pub fn pack(t: &Tensor) -> Matrix {
        let (rows, cols) = (t.rows, t.cols);
        let data = match t.dtype {
            DType::Q4_0 | DType::Q4_1 => {
                let mut out = Q4Rows::default();
                for b in t.data.chunks_exact(t.dtype.block_bytes()) {
                    let d = half_at(b, 0);
                    // Q4_0's `(q - 8) * d` is Q4_1's `q * d + m` with `m = -8d`.
                    let (m, qs) =
                        if t.dtype == DType::Q4_0 { (-8.0 * d, &b[2..18]) } else { (half_at(b, 2), &b[4..20]) };
                    let mut q = [0u8; 16];
                    q.copy_from_slice(qs);
                    out.d.push(d);
                    out.m.push(m);
                    out.qs.push(q);
                }
                if rows.is_multiple_of(8) {
                    Packed::Q4x8(Q4x8Rows::interleave(&out, rows, cols / QK))
                } else {
                    Packed::Q4(out)
                }
            }
            DType::Q8_0 => {
                let mut out = Q8Rows::default();
                for b in t.data.chunks_exact(34) {
                    let mut qs = [0i8; 32];
                    for (q, &x) in qs.iter_mut().zip(&b[2..34]) {
                        *q = x as i8;
                    }
                    out.d.push(half_at(b, 0));
                    out.qs.push(qs);
                }
                Packed::Q8(out).interleaved(rows, cols / QK)
            }
            DType::F32 | DType::F16 | DType::BF16 => Packed::F32(t.to_f32()),
            DType::Q5_0 | DType::Q5_1 | DType::Q2K | DType::Q3K | DType::Q4K | DType::Q5K | DType::Q6K => {
                let mut acts = QActs::default();
                let mut row = vec![0f32; cols];
                for r in 0..rows {
                    t.dtype.dequantize_row(t.row(r), &mut row);
                    for x in row.chunks_exact(QK) {
                        let (d, _, qs) = quantize_block(x);
                        acts.d.push(d);
                        acts.qs.push(qs);
                    }
                }
                Packed::Q8(Q8Rows { d: acts.d, qs: acts.qs }).interleaved(rows, cols / QK)
            }
        };
        Matrix { rows, cols, data }
    }

    /// Writes row `r` as `f32` (embedding lookups).
    pub fn row_to_f32(&self, r: usize, out: &mut [f32]) {
        let nb = self.cols / QK;
        let blocks = r * nb..(r + 1) * nb;
        match &self.data {
            Packed::Q4(w) => {
                for (o, b) in out.chunks_exact_mut(QK).zip(blocks) {
                    for j in 0..16 {
                        o[j] = (w.qs[b][j] & 0x0f) as f32 * w.d[b] + w.m[b];
                        o[j + 16] = (w.qs[b][j] >> 4) as f32 * w.d[b] + w.m[b];
                    }
                }
            }
            Packed::Q4x8(w) => {
                let (g, r) = (r / 8, r % 8);
                for (b, o) in out.chunks_exact_mut(QK).enumerate() {
                    let at = g * nb + b;
                    let (d, m) = (w.d[at][r], w.m[at][r]);
                    for v in 0..4 {
                        for i in 0..4 {
                            let q = w.qs[at][v][4 * r + i];
                            o[4 * v + i] = (q & 0x0f) as f32 * d + m;
                            o[16 + 4 * v + i] = (q >> 4) as f32 * d + m;
                        }
                    }
                }
            }
            Packed::Q8x8(w) => {
                let (g, r) = (r / 8, r % 8);
                for (b, o) in out.chunks_exact_mut(QK).enumerate() {
                    let at = g * nb + b;
                    for v in 0..8 {
                        for i in 0..4 {
                            o[4 * v + i] = w.qs[at][v][4 * r + i] as f32 * w.d[at][r];
                        }
                    }
                }
            }
            Packed::Q8(w) => {
                for (o, b) in out.chunks_exact_mut(QK).zip(blocks) {
                    for (o, &q) in o.iter_mut().zip(&w.qs[b]) {
                        *o = q as f32 * w.d[b];
                    }
                }
            }
            Packed::F32(v) => out.copy_from_slice(&v[r * self.cols..(r + 1) * self.cols]),
        }
    }

    /// Whether the kernels want quantized activations for this matrix.
    pub fn wants_quantized_input(&self) -> bool {
        !matches!(self.data, Packed::F32(_))
    }
}

/// Converts `f32` to IEEE half-precision bits, rounding to nearest even.
pub fn f32_to_f16(x: f32) -> u16 {
    let bits = x.to_bits();
    let sign = ((bits >> 16) & 0x8000) as u16;
    let exp = ((bits >> 23) & 0xff) as i32;
    let man = bits & 0x7f_ffff;
    if exp == 0xff {
        return sign | 0x7c00 | if man != 0 { 0x200 } else { 0 };
    }
    let e = exp - 127 + 15;
    if e >= 0x1f {
        return sign | 0x7c00;
    }
    if e <= 0 {
        if e < -10 {
            return sign;
        }
        let m = man | 0x80_0000;
        let shift = (14 - e) as u32;
        let (h, rem, halfway) = (m >> shift, m & ((1 << shift) - 1), 1 << (shift - 1));
        let round = rem > halfway || (rem == halfway && h & 1 == 1);
        return sign | (h + round as u32) as u16;
    }
    let h = ((e as u32) << 10) | (man >> 13);
    let rem = man & 0x1fff;
    let round = rem > 0x1000 || (rem == 0x1000 && h & 1 == 1);
    sign | (h + round as u32) as u16
}

/// `x` rounded to the nearest half-precision value.
pub fn round_half(x: f32) -> f32 {
    f16_to_f32(f32_to_f16(x))
}

/// Quantizes 32 values like ggml's Q8_1: (scale, scale times sum, values),
/// scale and sum rounded to half precision, values rounded to nearest even.
pub fn quantize_block(x: &[f32]) -> (f32, f32, [i8; 32]) {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let mut qs = [0i8; 32];
    let mut sum = 0i32;
    for (q, &v) in qs.iter_mut().zip(x) {
        let r = (v * id).round_ties_even() as i32;
        *q = r as i8;
        sum += r;
    }
    (round_half(d), round_half(sum as f32 * d), qs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn half_conversion_round_trips_and_rounds_to_even() {
        for h in [0x3c00u16, 0xc000, 0x0001, 0x03ff, 0x7bff, 0x3555] {
            assert_eq!(f32_to_f16(f16_to_f32(h)), h);
        }
        assert_eq!(f32_to_f16(1.0 + 2f32.powi(-11)), 0x3c00, "a tie rounds to the even neighbour");
        assert_eq!(f32_to_f16(1e6), 0x7c00);
    }
}
