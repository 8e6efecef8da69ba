//! Element types a weight file may hold, their block layouts, and conversion
//! of a row of any of them to `f32`.
//!
//! Layouts follow the GGUF (ggml) definitions: a quantized row is a run of
//! fixed-size blocks, each holding its own scale (and minimum) next to packed
//! integers.

/// Element type of a stored tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DType {
    /// 32-bit float.
    F32,
    /// IEEE half precision.
    F16,
    /// bfloat16.
    BF16,
    /// 4-bit, blocks of 32, scale only.
    Q4_0,
    /// 4-bit, blocks of 32, scale and minimum.
    Q4_1,
    /// 5-bit, blocks of 32, scale only.
    Q5_0,
    /// 5-bit, blocks of 32, scale and minimum.
    Q5_1,
    /// 8-bit, blocks of 32, scale only.
    Q8_0,
    /// 2-bit K-quant, super-blocks of 256.
    Q2K,
    /// 3-bit K-quant, super-blocks of 256.
    Q3K,
    /// 4-bit K-quant, super-blocks of 256.
    Q4K,
    /// 5-bit K-quant, super-blocks of 256.
    Q5K,
    /// 6-bit K-quant, super-blocks of 256.
    Q6K,
}

impl DType {
    /// Maps a ggml type id (as stored in GGUF) to a supported type.
    pub fn from_ggml(id: u32) -> Option<DType> {
        Some(match id {
            0 => DType::F32,
            1 => DType::F16,
            2 => DType::Q4_0,
            3 => DType::Q4_1,
            6 => DType::Q5_0,
            7 => DType::Q5_1,
            8 => DType::Q8_0,
            10 => DType::Q2K,
            11 => DType::Q3K,
            12 => DType::Q4K,
            13 => DType::Q5K,
            14 => DType::Q6K,
            30 => DType::BF16,
            _ => return None,
        })
    }

    /// Human name of a ggml type id, also for ids Levee cannot read.
    pub fn ggml_name(id: u32) -> &'static str {
        match id {
            0 => "F32",
            1 => "F16",
            2 => "Q4_0",
            3 => "Q4_1",
            6 => "Q5_0",
            7 => "Q5_1",
            8 => "Q8_0",
            9 => "Q8_1",
            10 => "Q2_K",
            11 => "Q3_K",
            12 => "Q4_K",
            13 => "Q5_K",
            14 => "Q6_K",
            15 => "Q8_K",
            16..=23 => "IQ-quant",
            30 => "BF16",
            _ => "unknown",
        }
    }

    /// Elements per block.
    pub fn block_elems(self) -> usize {
        match self {
            DType::F32 | DType::F16 | DType::BF16 => 1,
            DType::Q4_0 | DType::Q4_1 | DType::Q5_0 | DType::Q5_1 | DType::Q8_0 => 32,
            DType::Q2K | DType::Q3K | DType::Q4K | DType::Q5K | DType::Q6K => 256,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::Q4_0 => 18,
            DType::Q4_1 => 20,
            DType::Q5_0 => 22,
            DType::Q5_1 => 24,
            DType::Q8_0 => 34,
            DType::Q2K => 84,
            DType::Q3K => 110,
            DType::Q4K => 144,
            DType::Q5K => 176,
            DType::Q6K => 210,
        }
    }

    /// Bytes taken by `elems` elements, or `None` when `elems` is not a whole
    /// number of blocks.
    pub fn bytes_for(self, elems: usize) -> Option<usize> {
        if !elems.is_multiple_of(self.block_elems()) {
            return None;
        }
        (elems / self.block_elems()).checked_mul(self.block_bytes())
    }

    /// Writes the `f32` value of every element of one row.
    ///
    /// `src` must hold exactly `out.len()` elements of this type; the loaders
    /// check sizes before any row is converted.
    pub fn dequantize_row(self, src: &[u8], out: &mut [f32]) {
        match self {
            DType::F32 => {
                for (o, b) in out.iter_mut().zip(src.chunks_exact(4)) {
                    *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
            }
            DType::F16 => {
                for (o, b) in out.iter_mut().zip(src.chunks_exact(2)) {
                    *o = f16_to_f32(u16::from_le_bytes([b[0], b[1]]));
                }
            }
            DType::BF16 => {
                for (o, b) in out.iter_mut().zip(src.chunks_exact(2)) {
                    *o = f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16);
                }
            }
            _ => {
                let (be, bb) = (self.block_elems(), self.block_bytes());
                for (o, b) in out.chunks_exact_mut(be).zip(src.chunks_exact(bb)) {
                    match self {
                        DType::Q4_0 => dequant_q4_0(b, o),
                        DType::Q4_1 => dequant_q4_1(b, o),
                        DType::Q5_0 => dequant_q5_0(b, o),
                        DType::Q5_1 => dequant_q5_1(b, o),
                        DType::Q8_0 => dequant_q8_0(b, o),
                        DType::Q2K => dequant_q2k(b, o),
                        DType::Q3K => dequant_q3k(b, o),
                        DType::Q4K => dequant_q4k(b, o),
                        DType::Q5K => dequant_q5k(b, o),
                        DType::Q6K => dequant_q6k(b, o),
                        DType::F32 | DType::F16 | DType::BF16 => {}
                    }
                }
            }
        }
    }
}

/// Converts IEEE half-precision bits to `f32` (exact, subnormals included).
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h & 0x8000) as u32) << 16;
    let exp = ((h >> 10) & 0x1f) as u32;
    let man = (h & 0x3ff) as u32;
    let bits = match (exp, man) {
        (0, 0) => sign,
        (0, _) => {
            // Subnormal: normalise the mantissa.
            let mut e = 127 - 15 + 1;
            let mut m = man;
            while m & 0x400 == 0 {
                m <<= 1;
                e -= 1;
            }
            sign | ((e as u32) << 23) | ((m & 0x3ff) << 13)
        }
        (0x1f, _) => sign | 0x7f80_0000 | (man << 13),
        _ => sign | ((exp + 127 - 15) << 23) | (man << 13),
    };
    f32::from_bits(bits)
}

fn half(b: &[u8], at: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[at], b[at + 1]]))
}

fn dequant_q4_0(b: &[u8], out: &mut [f32]) {
    let d = half(b, 0);
    for j in 0..16 {
        let q = b[2 + j];
        out[j] = ((q & 0x0f) as i32 - 8) as f32 * d;
        out[j + 16] = ((q >> 4) as i32 - 8) as f32 * d;
    }
}

fn dequant_q4_1(b: &[u8], out: &mut [f32]) {
    let (d, m) = (half(b, 0), half(b, 2));
    for j in 0..16 {
        let q = b[4 + j];
        out[j] = (q & 0x0f) as f32 * d + m;
        out[j + 16] = (q >> 4) as f32 * d + m;
    }
}

fn dequant_q5_0(b: &[u8], out: &mut [f32]) {
    let d = half(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    for j in 0..16 {
        let q = b[6 + j];
        let h0 = ((qh >> j) << 4) & 0x10;
        let h1 = (qh >> (j + 12)) & 0x10;
        out[j] = (((q & 0x0f) as u32 | h0) as i32 - 16) as f32 * d;
        out[j + 16] = (((q >> 4) as u32 | h1) as i32 - 16) as f32 * d;
    }
}

fn dequant_q5_1(b: &[u8], out: &mut [f32]) {
    let (d, m) = (half(b, 0), half(b, 2));
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    for j in 0..16 {
        let q = b[8 + j];
        let h0 = ((qh >> j) << 4) & 0x10;
        let h1 = (qh >> (j + 12)) & 0x10;
        out[j] = ((q & 0x0f) as u32 | h0) as f32 * d + m;
        out[j + 16] = ((q >> 4) as u32 | h1) as f32 * d + m;
    }
}

fn dequant_q8_0(b: &[u8], out: &mut [f32]) {
    let d = half(b, 0);
    for j in 0..32 {
        out[j] = b[2 + j] as i8 as f32 * d;
    }
}

/// Q2_K: sixteen 4-bit scale/minimum pairs (bytes 0-15), 2-bit quants
/// (16-79), then the super-block scale and minimum scale as halves.
fn dequant_q2k(b: &[u8], out: &mut [f32]) {
    let (scales, qs) = (&b[0..16], &b[16..80]);
    let (d, dmin) = (half(b, 80), half(b, 82));
    for (half_block, (q, o)) in qs.chunks_exact(32).zip(out.chunks_exact_mut(128)).enumerate() {
        for (j, o) in o.chunks_exact_mut(32).enumerate() {
            let shift = 2 * j;
            for (part, o) in o.chunks_exact_mut(16).enumerate() {
                let sc = scales[half_block * 8 + j * 2 + part];
                let (dl, ml) = (d * (sc & 0x0f) as f32, dmin * (sc >> 4) as f32);
                for (l, o) in o.iter_mut().enumerate() {
                    *o = dl * ((q[part * 16 + l] >> shift) & 3) as f32 - ml;
                }
            }
        }
    }
}

/// Q3_K: high-bit mask (bytes 0-31), low 2 bits (32-95), sixteen 6-bit
/// scales packed in 12 bytes (96-107), then the super-block scale as a half.
fn dequant_q3k(b: &[u8], out: &mut [f32]) {
    let (hmask, qs, packed) = (&b[0..32], &b[32..96], &b[96..108]);
    let d = half(b, 108);
    // Scale `i`: low 4 bits from byte `i % 8` (low nibble for i < 8, high
    // nibble after), high 2 bits from byte `8 + i % 4` at bit `2 * (i / 4)`.
    let scale = |i: usize| {
        let low = if i < 8 { packed[i] & 0x0f } else { packed[i - 8] >> 4 };
        let high = (packed[8 + i % 4] >> (2 * (i / 4))) & 3;
        (low | (high << 4)) as i32 - 32
    };
    for (half_block, (q, o)) in qs.chunks_exact(32).zip(out.chunks_exact_mut(128)).enumerate() {
        for (j, o) in o.chunks_exact_mut(32).enumerate() {
            let (shift, bit) = (2 * j, 1u8 << (half_block * 4 + j));
            for (part, o) in o.chunks_exact_mut(16).enumerate() {
                let dl = d * scale(half_block * 8 + j * 2 + part) as f32;
                for (l, o) in o.iter_mut().enumerate() {
                    let at = part * 16 + l;
                    let low = ((q[at] >> shift) & 3) as i32;
                    let minus = if hmask[at] & bit != 0 { 0 } else { 4 };
                    *o = dl * (low - minus) as f32;
                }
            }
        }
    }
}

/// Scale and minimum `j` of a K-quant super-block, packed 6 bits each.
fn scale_min_k4(j: usize, s: &[u8]) -> (f32, f32) {
    if j < 4 {
        ((s[j] & 63) as f32, (s[j + 4] & 63) as f32)
    } else {
        (((s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4)) as f32, ((s[j + 4] >> 4) | ((s[j] >> 6) << 4)) as f32)
    }
}

fn dequant_q4k(b: &[u8], out: &mut [f32]) {
    let (d, dmin) = (half(b, 0), half(b, 2));
    let scales = &b[4..16];
    let qs = &b[16..144];
    for (chunk, (q, o)) in qs.chunks_exact(32).zip(out.chunks_exact_mut(64)).enumerate() {
        let (s1, m1) = scale_min_k4(2 * chunk, scales);
        let (s2, m2) = scale_min_k4(2 * chunk + 1, scales);
        for l in 0..32 {
            o[l] = d * s1 * (q[l] & 0x0f) as f32 - dmin * m1;
            o[l + 32] = d * s2 * (q[l] >> 4) as f32 - dmin * m2;
        }
    }
}

fn dequant_q5k(b: &[u8], out: &mut [f32]) {
    let (d, dmin) = (half(b, 0), half(b, 2));
    let scales = &b[4..16];
    let qh = &b[16..48];
    let qs = &b[48..176];
    for (chunk, (q, o)) in qs.chunks_exact(32).zip(out.chunks_exact_mut(64)).enumerate() {
        let (s1, m1) = scale_min_k4(2 * chunk, scales);
        let (s2, m2) = scale_min_k4(2 * chunk + 1, scales);
        let (u1, u2) = (1u8 << (2 * chunk), 2u8 << (2 * chunk));
        for l in 0..32 {
            let h1 = if qh[l] & u1 != 0 { 16 } else { 0 };
            let h2 = if qh[l] & u2 != 0 { 16 } else { 0 };
            o[l] = d * s1 * ((q[l] & 0x0f) + h1) as f32 - dmin * m1;
            o[l + 32] = d * s2 * ((q[l] >> 4) + h2) as f32 - dmin * m2;
        }
    }
}

fn dequant_q6k(b: &[u8], out: &mut [f32]) {
    let ql = &b[0..128];
    let qh = &b[128..192];
    let sc = &b[192..208];
    let d = half(b, 208);
    for n in 0..2 {
        let (ql, qh, sc) = (&ql[64 * n..], &qh[32 * n..], &sc[8 * n..]);
        let o = &mut out[128 * n..128 * (n + 1)];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0x0f) | ((qh[l] & 3) << 4)) as i32 - 32;
            let q2 = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
            o[l] = d * (sc[is] as i8) as f32 * q1 as f32;
            o[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
            o[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
            o[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_conversion_matches_known_values() {
        assert_eq!(f16_to_f32(0x3c00), 1.0);
        assert_eq!(f16_to_f32(0xc000), -2.0);
        assert_eq!(f16_to_f32(0x0001), 2f32.powi(-24));
        assert_eq!(f16_to_f32(0x7bff), 65504.0);
        assert!(f16_to_f32(0x7e00).is_nan());
    }

    #[test]
    fn q4_1_block_dequantizes_with_minimum() {
        let mut block = vec![0u8; 20];
        block[0..2].copy_from_slice(&0x3c00u16.to_le_bytes()); // d = 1
        block[2..4].copy_from_slice(&0xc000u16.to_le_bytes()); // m = -2
        block[4] = 0x53; // element 0 = 3, element 16 = 5
        let mut out = [0f32; 32];
        DType::Q4_1.dequantize_row(&block, &mut out);
        assert_eq!(out[0], 1.0);
        assert_eq!(out[16], 3.0);
        assert_eq!(out[1], -2.0);
    }
}
