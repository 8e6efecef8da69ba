//! Building the kernels: the model's shape becomes preprocessor constants
//! (so that per-lane arrays live in registers), NVRTC compiles the source
//! for the device's architecture, and the driver loads the result.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction};
use cudarc::nvrtc::{CompileOptions, compile_ptx_with_opts};

use super::Precision;
use crate::backend::BackendError;
use crate::model::ModelConfig;

/// The kernels' source, compiled at start-up.
pub const SOURCE: &str = include_str!("kernels.cu");

/// Widest head the attention kernel takes (eight elements per lane).
const MAX_HEAD_DIM: usize = 256;
/// Most query heads per key/value head the attention kernel takes.
const MAX_GROUP: usize = 16;
/// Static shared memory the attention kernel may use for merging warps.
const ATTN_SHARED_BYTES: usize = 32 << 10;

/// The model-dependent constants the kernels are compiled with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelShape {
    /// Width of one head.
    pub head_dim: usize,
    /// Query heads per key/value head.
    pub group: usize,
    /// Warps per attention block.
    pub attn_warps: usize,
    /// Whether 16-bit values are IEEE half rather than bfloat16.
    pub f16: bool,
}

impl KernelShape {
    /// The shape for `config`, or why the kernels cannot run it.
    pub fn new(config: &ModelConfig, precision: Precision) -> Result<KernelShape, BackendError> {
        let (hd, group) = (config.head_dim, config.n_heads / config.n_kv_heads.max(1));
        if hd == 0 || !hd.is_multiple_of(32) || hd > MAX_HEAD_DIM {
            return Err(BackendError::Unsupported(format!(
                "head width {hd} (the attention kernel takes multiples of 32 up to {MAX_HEAD_DIM})"
            )));
        }
        if group == 0 || group > MAX_GROUP || !config.n_heads.is_multiple_of(config.n_kv_heads) {
            return Err(BackendError::Unsupported(format!(
                "{} query heads over {} key/value heads (at most {MAX_GROUP} per key/value head)",
                config.n_heads, config.n_kv_heads
            )));
        }
        // As many warps as the merge buffer (m, l and a head per warp and query head) allows.
        let per_warp = group * (hd + 2) * 4;
        let attn_warps = [8, 4, 2, 1].into_iter().find(|w| w * per_warp <= ATTN_SHARED_BYTES).unwrap_or(1);
        Ok(KernelShape { head_dim: hd, group, attn_warps, f16: precision == Precision::F16 })
    }

    /// NVRTC options for a device of compute capability `major.minor`.
    pub fn options(&self, (major, minor): (i32, i32)) -> Vec<String> {
        vec![
            format!("--gpu-architecture=compute_{major}{minor}"),
            format!("-DHEAD_DIM={}", self.head_dim),
            format!("-DGROUP={}", self.group),
            format!("-DATTN_WARPS={}", self.attn_warps),
            format!("-DLEVEE_F16={}", u8::from(self.f16)),
            // Exact division and square root, as the CPU backend computes.
            "--prec-div=true".into(),
            "--prec-sqrt=true".into(),
        ]
    }
}

/// The compiled kernels.
pub struct Kernels {
    /// Embedding gather.
    pub embed: CudaFunction,
    /// RMSNorm to 16-bit.
    pub rms_norm: CudaFunction,
    /// Bias, RoPE and KV store.
    pub rope_store_kv: CudaFunction,
    /// Paged attention.
    pub attention: CudaFunction,
    /// SwiGLU.
    pub swiglu: CudaFunction,
    /// Greedy choice per logits row.
    pub argmax_rows: CudaFunction,
}

/// Compiles [`SOURCE`] for `shape` and loads it on `ctx`'s device.
pub fn load(ctx: &Arc<CudaContext>, shape: &KernelShape) -> Result<Kernels, BackendError> {
    let cc = ctx.compute_capability().map_err(|e| cuda_err("reading the compute capability", e))?;
    let ptx = compile(shape, cc)?;
    let module = ctx.load_module(ptx).map_err(|e| cuda_err("loading the compiled kernels", e))?;
    let f = |name: &str| module.load_function(name).map_err(|e| cuda_err(&format!("finding kernel {name}"), e));
    Ok(Kernels {
        embed: f("embed")?,
        rms_norm: f("rms_norm")?,
        rope_store_kv: f("rope_store_kv")?,
        attention: f("attention")?,
        swiglu: f("swiglu")?,
        argmax_rows: f("argmax_rows")?,
    })
}

/// Compiles [`SOURCE`] to PTX for compute capability `cc` (needs only
/// libnvrtc, no device).
pub fn compile(shape: &KernelShape, cc: (i32, i32)) -> Result<cudarc::nvrtc::Ptx, BackendError> {
    let options =
        CompileOptions { options: shape.options(cc), name: Some("levee_kernels.cu".into()), ..Default::default() };
    compile_ptx_with_opts(SOURCE, options).map_err(|e| match e {
        cudarc::nvrtc::CompileError::CompileError { log, .. } => BackendError::Cuda {
            what: "compiling the kernels with NVRTC".into(),
            reason: log.to_string_lossy().into_owned(),
        },
        other => cuda_err("compiling the kernels with NVRTC", other),
    })
}

/// A CUDA error, saying what was being done.
pub fn cuda_err(what: &str, e: impl std::fmt::Display) -> BackendError {
    BackendError::Cuda { what: what.to_string(), reason: e.to_string() }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::RopeStyle;

    fn config(n_heads: usize, n_kv_heads: usize, head_dim: usize) -> ModelConfig {
        ModelConfig {
            architecture: "llama".into(),
            n_layers: 2,
            hidden: n_heads * head_dim,
            n_heads,
            n_kv_heads,
            head_dim,
            ffn_hidden: 64,
            vocab_size: 100,
            rms_eps: 1e-5,
            rope_theta: 10_000.0,
            rope_style: RopeStyle::Interleaved,
            max_context: 64,
        }
    }

    #[test]
    fn options_carry_the_model_shape_and_the_device_architecture() {
        // SmolLM2-135M: 9 query heads over 3 key/value heads of 64.
        let shape = KernelShape::new(&config(9, 3, 64), Precision::Bf16).expect("supported");
        assert_eq!(shape, KernelShape { head_dim: 64, group: 3, attn_warps: 8, f16: false });
        let opts = shape.options((9, 0));
        for want in ["--gpu-architecture=compute_90", "-DHEAD_DIM=64", "-DGROUP=3", "-DATTN_WARPS=8", "-DLEVEE_F16=0"] {
            assert!(opts.iter().any(|o| o == want), "{want} missing from {opts:?}");
        }
        assert!(
            KernelShape::new(&config(8, 8, 128), Precision::F16)
                .expect("supported")
                .options((8, 6))
                .contains(&"-DLEVEE_F16=1".to_string())
        );
    }

    #[test]
    fn wide_groups_get_fewer_warps_and_odd_heads_are_refused() {
        let wide = KernelShape::new(&config(64, 4, 256), Precision::Bf16).expect("supported");
        assert_eq!(wide.group, 16);
        assert!(wide.attn_warps * wide.group * (wide.head_dim + 2) * 4 <= ATTN_SHARED_BYTES);
        assert_eq!(wide.attn_warps, 1);
        let err = KernelShape::new(&config(4, 4, 80), Precision::Bf16).unwrap_err().to_string();
        assert!(err.contains("head width 80"), "{err}");
        assert!(KernelShape::new(&config(64, 2, 64), Precision::Bf16).is_err(), "32 heads per group is too many");
    }

    /// Runs only where libnvrtc can be loaded (no device is needed).
    #[test]
    fn kernels_compile_with_nvrtc_when_it_is_present() {
        // SAFETY: only tries to open the library.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            println!("skipping: libnvrtc could not be loaded (set LD_LIBRARY_PATH to its folder to run this)");
            return;
        }
        for precision in [Precision::Bf16, Precision::F16] {
            for (heads, kv, hd) in [(9, 3, 64), (32, 8, 128), (14, 2, 64)] {
                let shape = KernelShape::new(&config(heads, kv, hd), precision).expect("supported");
                if let Err(e) = compile(&shape, (9, 0)) {
                    panic!("{shape:?}: {e}");
                }
            }
        }
    }
}
