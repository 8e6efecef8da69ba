//! x86-64 versions of the kernels in [`super::kernels`]: AVX2 + FMA, and
//! AVX-512 VNNI on 256-bit vectors. The quantized dot products are written
//! once (`quant_dots!`) and compiled for each instruction set.

/// The quantized dot products, stamped out once per instruction set: each
/// expansion site provides `bytedot` and the helpers of [`avx2`].
macro_rules! quant_dots {
    ($features:literal) => {
        #[target_feature(enable = $features)]
        pub unsafe fn dot_q4<const N: usize>(w: Q4Row<'_>, a: [ActRow<'_>; N], out: &mut [f32; N]) {
            let nb = w.qs.len();
            let mut acc = [_mm256_setzero_ps(); N];
            let mut mins = [_mm256_setzero_ps(); N];
            let mut b = 0;
            while b + 8 <= nb {
                let mut wv = [_mm256_setzero_si256(); 8];
                for j in 0..8 {
                    wv[j] = unpack_q4(&w.qs[b + j]);
                }
                let dw = load_f32x8(&w.d[b..]);
                let mw = load_f32x8(&w.m[b..]);
                for n in 0..N {
                    mins[n] = _mm256_fmadd_ps(mw, load_f32x8(&a[n].s[b..]), mins[n]);
                    let mut p = [_mm256_setzero_si256(); 8];
                    for j in 0..8 {
                        p[j] = bytedot(wv[j], load_i8(&a[n].qs[b + j]));
                    }
                    let scale = _mm256_mul_ps(dw, load_f32x8(&a[n].d[b..]));
                    acc[n] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum8(&p)), scale, acc[n]);
                }
                b += 8;
            }
            let mut tail = [0f32; N];
            for b in b..nb {
                let wv = unpack_q4(&w.qs[b]);
                for n in 0..N {
                    let p = bytedot(wv, load_i8(&a[n].qs[b]));
                    let s = _mm_add_epi32(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1));
                    let s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
                    let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 1));
                    tail[n] += _mm_cvtsi128_si32(s) as f32 * (w.d[b] * a[n].d[b]) + w.m[b] * a[n].s[b];
                }
            }
            for n in 0..N {
                out[n] = hsum(acc[n]) + hsum(mins[n]) + tail[n];
            }
        }

        #[target_feature(enable = $features)]
        pub unsafe fn dot_q8<const N: usize>(w: Q8Row<'_>, a: [ActRow<'_>; N], out: &mut [f32; N]) {
            let nb = w.qs.len();
            let mut acc = [_mm256_setzero_ps(); N];
            let mut b = 0;
            while b + 8 <= nb {
                let mut wabs = [_mm256_setzero_si256(); 8];
                let mut wv = [_mm256_setzero_si256(); 8];
                for j in 0..8 {
                    wv[j] = load_i8(&w.qs[b + j]);
                    wabs[j] = _mm256_sign_epi8(wv[j], wv[j]);
                }
                let dw = load_f32x8(&w.d[b..]);
                for n in 0..N {
                    let mut p = [_mm256_setzero_si256(); 8];
                    for j in 0..8 {
                        let signed = _mm256_sign_epi8(load_i8(&a[n].qs[b + j]), wv[j]);
                        p[j] = bytedot(wabs[j], signed);
                    }
                    let scale = _mm256_mul_ps(dw, load_f32x8(&a[n].d[b..]));
                    acc[n] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum8(&p)), scale, acc[n]);
                }
                b += 8;
            }
            let mut tail = [0f32; N];
            for b in b..nb {
                let wv = load_i8(&w.qs[b]);
                let wabs = _mm256_sign_epi8(wv, wv);
                for n in 0..N {
                    let p = bytedot(wabs, _mm256_sign_epi8(load_i8(&a[n].qs[b]), wv));
                    let s = _mm_add_epi32(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1));
                    let s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
                    let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 1));
                    tail[n] += _mm_cvtsi128_si32(s) as f32 * (w.d[b] * a[n].d[b]);
                }
            }
            for n in 0..N {
                out[n] = hsum(acc[n]) + tail[n];
            }
        }

        #[target_feature(enable = $features)]
        pub unsafe fn dot_q4x8<const N: usize>(w: Q4x8Group<'_>, a: [ActRow<'_>; N], out: &mut [[f32; 8]; N]) {
            let low = _mm256_set1_epi8(0x0f);
            let mut acc = [_mm256_setzero_ps(); N];
            let mut mins = [_mm256_setzero_ps(); N];
            for b in 0..w.qs.len() {
                let mut lo = [_mm256_setzero_si256(); 4];
                let mut hi = [_mm256_setzero_si256(); 4];
                for v in 0..4 {
                    // SAFETY: 32 readable bytes.
                    let q = unsafe { _mm256_loadu_si256(w.qs[b][v].as_ptr().cast()) };
                    lo[v] = _mm256_and_si256(q, low);
                    hi[v] = _mm256_and_si256(_mm256_srli_epi16(q, 4), low);
                }
                let dw = load_f32x8(&w.d[b]);
                let mw = load_f32x8(&w.m[b]);
                for n in 0..N {
                    let q = &a[n].qs[b];
                    let group = |k: usize| {
                        _mm256_set1_epi32(i32::from_le_bytes([
                            q[4 * k] as u8,
                            q[4 * k + 1] as u8,
                            q[4 * k + 2] as u8,
                            q[4 * k + 3] as u8,
                        ]))
                    };
                    let mut isum = _mm256_setzero_si256();
                    for v in 0..4 {
                        isum = _mm256_add_epi32(isum, bytedot(lo[v], group(v)));
                        isum = _mm256_add_epi32(isum, bytedot(hi[v], group(4 + v)));
                    }
                    acc[n] =
                        _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(dw, _mm256_set1_ps(a[n].d[b])), acc[n]);
                    mins[n] = _mm256_fmadd_ps(mw, _mm256_set1_ps(a[n].s[b]), mins[n]);
                }
            }
            for n in 0..N {
                // SAFETY: `out[n]` is 8 writable floats.
                unsafe { _mm256_storeu_ps(out[n].as_mut_ptr(), _mm256_add_ps(acc[n], mins[n])) };
            }
        }

        #[target_feature(enable = $features)]
        pub unsafe fn dot_q8x8<const N: usize>(w: Q8x8Group<'_>, a: [ActRow<'_>; N], out: &mut [[f32; 8]; N]) {
            let mut acc = [_mm256_setzero_ps(); N];
            for b in 0..w.qs.len() {
                let mut wv = [_mm256_setzero_si256(); 8];
                let mut wabs = [_mm256_setzero_si256(); 8];
                for v in 0..8 {
                    // SAFETY: 32 readable bytes.
                    wv[v] = unsafe { _mm256_loadu_si256(w.qs[b][v].as_ptr().cast()) };
                    wabs[v] = _mm256_sign_epi8(wv[v], wv[v]);
                }
                let dw = load_f32x8(&w.d[b]);
                for n in 0..N {
                    let q = &a[n].qs[b];
                    let mut isum = _mm256_setzero_si256();
                    for v in 0..8 {
                        let g = _mm256_set1_epi32(i32::from_le_bytes([
                            q[4 * v] as u8,
                            q[4 * v + 1] as u8,
                            q[4 * v + 2] as u8,
                            q[4 * v + 3] as u8,
                        ]));
                        isum = _mm256_add_epi32(isum, bytedot(wabs[v], _mm256_sign_epi8(g, wv[v])));
                    }
                    acc[n] =
                        _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(dw, _mm256_set1_ps(a[n].d[b])), acc[n]);
                }
            }
            for n in 0..N {
                // SAFETY: `out[n]` is 8 writable floats.
                unsafe { _mm256_storeu_ps(out[n].as_mut_ptr(), acc[n]) };
            }
        }
    };
}

pub mod avx2 {
    use std::arch::x86_64::*;

    use super::super::kernels::{ActRow, Q4Row, Q4x8Group, Q8Row, Q8x8Group};
    use super::super::packed::{QActs, round_half};

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    /// Sums of each of eight vectors of eight `i32`, in order.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub fn sum8(p: &[__m256i; 8]) -> __m256i {
        let h01 = _mm256_hadd_epi32(p[0], p[1]);
        let h23 = _mm256_hadd_epi32(p[2], p[3]);
        let h45 = _mm256_hadd_epi32(p[4], p[5]);
        let h67 = _mm256_hadd_epi32(p[6], p[7]);
        let lo4 = _mm256_hadd_epi32(h01, h23);
        let hi4 = _mm256_hadd_epi32(h45, h67);
        _mm256_add_epi32(_mm256_permute2x128_si256(lo4, hi4, 0x20), _mm256_permute2x128_si256(lo4, hi4, 0x31))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub fn unpack_q4(q: &[u8; 16]) -> __m256i {
        // SAFETY: 16 readable bytes; unaligned loads are allowed.
        let q = unsafe { _mm_loadu_si128(q.as_ptr().cast()) };
        let low = _mm_set1_epi8(0x0f);
        _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), low), _mm_and_si128(q, low))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub fn load_i8(q: &[i8; 32]) -> __m256i {
        // SAFETY: 32 readable bytes.
        unsafe { _mm256_loadu_si256(q.as_ptr().cast()) }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub fn load_f32x8(x: &[f32]) -> __m256 {
        assert!(x.len() >= 8);
        // SAFETY: checked above.
        unsafe { _mm256_loadu_ps(x.as_ptr()) }
    }

    quant_dots!("avx2,fma");

    /// `u8 x i8` products of 32 bytes, summed in groups of four.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub fn bytedot(u: __m256i, s: __m256i) -> __m256i {
        _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1))
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn quantize_rows(x: &[f32], out: &mut QActs) {
        let sign = _mm256_set1_ps(-0.0);
        let perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        for (i, block) in x.chunks_exact(32).enumerate() {
            let v = [load_f32x8(block), load_f32x8(&block[8..]), load_f32x8(&block[16..]), load_f32x8(&block[24..])];
            let m = _mm256_max_ps(
                _mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])),
            );
            let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
            let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
            let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
            let d = amax / 127.0;
            let id = _mm256_set1_ps(if d != 0.0 { 1.0 / d } else { 0.0 });
            const ROUND: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
            let r = [
                _mm256_round_ps::<ROUND>(_mm256_mul_ps(v[0], id)),
                _mm256_round_ps::<ROUND>(_mm256_mul_ps(v[1], id)),
                _mm256_round_ps::<ROUND>(_mm256_mul_ps(v[2], id)),
                _mm256_round_ps::<ROUND>(_mm256_mul_ps(v[3], id)),
            ];
            // Rounded values are small integers: their float sum is exact.
            let sum = hsum(_mm256_add_ps(_mm256_add_ps(r[0], r[1]), _mm256_add_ps(r[2], r[3])));
            let i01 = _mm256_packs_epi32(_mm256_cvtps_epi32(r[0]), _mm256_cvtps_epi32(r[1]));
            let i23 = _mm256_packs_epi32(_mm256_cvtps_epi32(r[2]), _mm256_cvtps_epi32(r[3]));
            let q = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(i01, i23), perm);
            // SAFETY: `qs[i]` is 32 writable bytes.
            unsafe { _mm256_storeu_si256(out.qs[i].as_mut_ptr().cast(), q) };
            out.d[i] = round_half(d);
            out.s[i] = round_half(sum * d);
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let mut acc0 = _mm256_setzero_ps();
        let mut acc1 = _mm256_setzero_ps();
        let mut i = 0;
        while i + 16 <= n {
            // SAFETY: `i + 16 <= n` keeps both loads inside the slices.
            unsafe {
                acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a.as_ptr().add(i)), _mm256_loadu_ps(b.as_ptr().add(i)), acc0);
                acc1 = _mm256_fmadd_ps(
                    _mm256_loadu_ps(a.as_ptr().add(i + 8)),
                    _mm256_loadu_ps(b.as_ptr().add(i + 8)),
                    acc1,
                );
            }
            i += 16;
        }
        let mut sum = hsum(_mm256_add_ps(acc0, acc1));
        while i < n {
            sum += a[i] * b[i];
            i += 1;
        }
        sum
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
        let n = x.len().min(y.len());
        let va = _mm256_set1_ps(alpha);
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: `i + 8 <= n` keeps both accesses inside the slices.
            unsafe {
                let p = y.as_mut_ptr().add(i);
                _mm256_storeu_ps(p, _mm256_fmadd_ps(va, _mm256_loadu_ps(x.as_ptr().add(i)), _mm256_loadu_ps(p)));
            }
            i += 8;
        }
        while i < n {
            y[i] += alpha * x[i];
            i += 1;
        }
    }
}

pub mod vnni {
    use std::arch::x86_64::*;

    use super::super::kernels::{ActRow, Q4Row, Q4x8Group, Q8Row, Q8x8Group};
    use super::avx2::{hsum, load_f32x8, load_i8, sum8, unpack_q4};

    quant_dots!("avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni");

    /// `u8 x i8` products of 32 bytes, summed in groups of four (one instruction).
    #[inline]
    #[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni")]
    fn bytedot(u: __m256i, s: __m256i) -> __m256i {
        _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s)
    }
}
