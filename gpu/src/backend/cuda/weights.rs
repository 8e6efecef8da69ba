//! The model's weights on the device: every matrix dequantized from its
//! file type to bf16 (or f16) at load, projections that read the same input
//! fused into one matrix (`[q; k; v]`, `[gate; up]`) so that each is one
//! cuBLAS call, norms and biases kept in `f32`.

use rayon::prelude::*;

use super::device::{Buf, Gpu};
use crate::backend::BackendError;
use crate::model::{Model, Tensor};

/// One transformer block on the device.
pub struct LayerWeights {
    /// RMSNorm before attention.
    pub attn_norm: Buf<f32>,
    /// `[q; k; v]` projection rows.
    pub qkv: Buf<u16>,
    /// `[q | k | v]` biases, when the model has them.
    pub qkv_bias: Option<Buf<f32>>,
    /// Attention output projection.
    pub wo: Buf<u16>,
    /// RMSNorm before the feed-forward block.
    pub ffn_norm: Buf<f32>,
    /// `[gate; up]` projection rows.
    pub gate_up: Buf<u16>,
    /// Down projection.
    pub down: Buf<u16>,
}

/// All weights on the device.
pub struct DeviceWeights {
    /// Token embedding table (also the LM head when tied).
    pub embed: Buf<u16>,
    /// Separate LM head, if any.
    pub head: Option<Buf<u16>>,
    /// Final RMSNorm.
    pub output_norm: Buf<f32>,
    /// Transformer blocks.
    pub layers: Vec<LayerWeights>,
}

impl DeviceWeights {
    /// Dequantizes and uploads `model`'s weights, one layer at a time (so
    /// that host memory holds one layer's conversion at once).
    pub fn upload(gpu: &Gpu, model: &Model, f16: bool) -> Result<DeviceWeights, BackendError> {
        let w = &model.weights;
        let matrix = |parts: &[&Tensor]| Buf::from_host(gpu, &to_16(parts, f16));
        let vector = |t: &Tensor| Buf::from_host(gpu, &t.to_f32());
        let mut layers = Vec::with_capacity(w.layers.len());
        for l in &w.layers {
            let qkv_bias = match &l.qkv_bias {
                Some(b) => Some(Buf::from_host(gpu, &b.iter().flat_map(Tensor::to_f32).collect::<Vec<f32>>())?),
                None => None,
            };
            layers.push(LayerWeights {
                attn_norm: vector(&l.attn_norm)?,
                qkv: matrix(&[&l.wq, &l.wk, &l.wv])?,
                qkv_bias,
                wo: matrix(&[&l.wo])?,
                ffn_norm: vector(&l.ffn_norm)?,
                gate_up: matrix(&[&l.w_gate, &l.w_up])?,
                down: matrix(&[&l.w_down])?,
            });
        }
        Ok(DeviceWeights {
            embed: matrix(&[&w.token_embd])?,
            head: w.output.as_ref().map(|t| matrix(&[t])).transpose()?,
            output_norm: vector(&w.output_norm)?,
            layers,
        })
    }

    /// The LM head: its own matrix, or the embedding table when tied.
    pub fn lm_head(&self) -> &Buf<u16> {
        self.head.as_ref().unwrap_or(&self.embed)
    }

    /// Bytes a step reads whatever its batch: every layer's weights, the
    /// final norm and the LM head (embedding rows gathered for the step's
    /// tokens are left out: a few kilobytes).
    pub fn bytes_per_step(&self) -> usize {
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                l.attn_norm.bytes()
                    + l.qkv.bytes()
                    + l.qkv_bias.as_ref().map_or(0, Buf::bytes)
                    + l.wo.bytes()
                    + l.ffn_norm.bytes()
                    + l.gate_up.bytes()
                    + l.down.bytes()
            })
            .sum();
        layers + self.output_norm.bytes() + self.lm_head().bytes()
    }

    /// Bytes held on the device.
    pub fn device_bytes(&self) -> usize {
        self.bytes_per_step() + if self.head.is_some() { self.embed.bytes() } else { 0 }
    }
}

/// The rows of `parts`, one after the other, as 16-bit values (bf16, or f16
/// when `f16`), converted row by row in parallel.
pub fn to_16(parts: &[&Tensor], f16: bool) -> Vec<u16> {
    let total: usize = parts.iter().map(|t| t.rows * t.cols).sum();
    let mut out = vec![0u16; total];
    let mut rest = out.as_mut_slice();
    for t in parts {
        let (mine, tail) = rest.split_at_mut(t.rows * t.cols);
        rest = tail;
        mine.par_chunks_mut(t.cols.max(1)).enumerate().for_each_init(
            || vec![0f32; t.cols],
            |row, (r, o)| {
                t.dtype.dequantize_row(t.row(r), row);
                for (o, &v) in o.iter_mut().zip(row.iter()) {
                    *o = if f16 { half::f16::from_f32(v).to_bits() } else { half::bf16::from_f32(v).to_bits() };
                }
            },
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::DType;

    fn f32_tensor(rows: usize, cols: usize, values: &[f32]) -> Tensor {
        Tensor {
            name: "t".into(),
            dtype: DType::F32,
            rows,
            cols,
            data: values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        }
    }

    #[test]
    fn fused_rows_follow_each_other_and_round_to_nearest() {
        let a = f32_tensor(1, 2, &[1.0, -2.0]);
        let b = f32_tensor(2, 2, &[0.5, 3.0, 1.0 + 1.0 / 256.0, 65504.0]);
        let bf = to_16(&[&a, &b], false);
        assert_eq!(bf.len(), 6);
        assert_eq!(bf[..4], [0x3f80, 0xc000, 0x3f00, 0x4040]);
        // 1 + 2^-8 is halfway between two bf16 values: ties go to even (1.0).
        assert_eq!(bf[4], 0x3f80);
        let h = to_16(&[&b], true);
        assert_eq!(h, [0x3800, 0x4200, 0x3c04, 0x7bff]);
    }
}
