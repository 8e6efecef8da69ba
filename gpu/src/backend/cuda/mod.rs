//! The CUDA backend: the same step as the CPU backend, on an NVIDIA GPU.
//!
//! cudarc loads the driver, NVRTC and cuBLAS at run time, so the crate builds
//! and runs where CUDA is absent; [`probe`] says whether a device can be
//! used. At start the weights are dequantized to bf16 (or f16) on the
//! device, the kernels in `kernels.cu` are compiled for the device with
//! NVRTC, and workspace for the largest step is allocated. A step then packs
//! its bookkeeping into one upload, runs eight launches per layer (RMSNorm,
//! fused QKV product, RoPE + KV store, paged attention, output product with
//! the residual add folded into cuBLAS's `beta`, RMSNorm, fused gate/up
//! product, SwiGLU, down product likewise) and brings back either the logits
//! or, for greedy steps, only the chosen token ids.
//!
//! Keys and values live on the device as 16-bit values in the same paged
//! layout as the CPU's: per layer, slot `block * block_size + offset`, then
//! `n_kv_heads * head_dim` elements. CUDA graphs are not used yet.

pub mod compile;
mod device;
pub mod meta;
pub mod sizing;
mod weights;

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::time::Duration;

use cudarc::driver::{CudaEvent, CudaFunction, LaunchArgs, LaunchConfig, PushKernelArg};

use self::compile::{KernelShape, Kernels, cuda_err};
use self::device::{Buf, Gpu};
use self::meta::StepMeta;
use self::weights::DeviceWeights;
use super::{Backend, BackendError, BackendOptions, Started, StepBatch};
use crate::kv::{KvBudget, KvLayout};
use crate::model::{Model, ModelConfig, RopeStyle};

/// Bytes one stored key or value element takes on the device.
pub const KV_ELEM_BYTES: usize = 2;

/// The 16-bit type weights, activations and KV are kept in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Precision {
    /// bfloat16: the range of `f32`, 8 bits of mantissa.
    #[default]
    Bf16,
    /// IEEE half: 11 bits of mantissa, values up to 65504.
    F16,
}

/// How to start the CUDA backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaOptions {
    /// Device index.
    pub ordinal: usize,
    /// Element type on the device.
    pub precision: Precision,
    /// Tokens per step the workspace is sized for at start (it grows if a step is larger).
    pub max_batch_tokens: usize,
    /// Logits rows per step the workspace is sized for at start.
    pub max_seqs: usize,
}

impl Default for CudaOptions {
    fn default() -> Self {
        CudaOptions { ordinal: 0, precision: Precision::Bf16, max_batch_tokens: 512, max_seqs: 64 }
    }
}

/// Whether a CUDA device can be used: the driver library loads and reports
/// a device, and cuBLAS and NVRTC load. `Ok` says what was found, `Err` why not.
pub fn probe() -> Result<String, String> {
    catch_unwind(probe_libraries)
        .unwrap_or_else(|_| Err("the CUDA driver library failed while probing (is it older than CUDA 13?)".into()))
}

fn probe_libraries() -> Result<String, String> {
    // SAFETY: each check only tries to open a shared library.
    let (driver, blas, nvrtc) = unsafe {
        (
            cudarc::driver::sys::is_culib_present(),
            cudarc::cublas::sys::is_culib_present(),
            cudarc::nvrtc::sys::is_culib_present(),
        )
    };
    if !driver {
        return Err("no CUDA driver (libcuda.so could not be loaded)".into());
    }
    let count = cudarc::driver::CudaContext::device_count()
        .map_err(|e| format!("the CUDA driver reports no usable device ({e})"))?;
    if count < 1 {
        return Err("the CUDA driver found no device".into());
    }
    let missing = |lib: &str| {
        format!("{count} CUDA device(s) found but {lib} could not be loaded; add its folder to LD_LIBRARY_PATH")
    };
    if !blas {
        return Err(missing("libcublas"));
    }
    if !nvrtc {
        return Err(missing("libnvrtc"));
    }
    Ok(format!("{count} CUDA device(s) found"))
}

/// Starts the CUDA backend for [`super::start`]: loads weights and kernels,
/// then sizes the KV cache from the budget, or from the configured fraction
/// of the device memory still free, and allocates it.
pub(crate) fn start(model: &Model, options: &BackendOptions) -> Result<Started, BackendError> {
    let cuda = CudaOptions {
        max_batch_tokens: options.max_batch_tokens,
        max_seqs: options.max_seqs,
        ..CudaOptions::default()
    };
    let mut backend = CudaBackend::load(model, &cuda)?;
    let budget = match options.kv_device_fraction {
        Some(fraction) => {
            let free = backend.gpu.free_memory()?;
            let bytes = sizing::kv_bytes_from_free(free, fraction).map_err(BackendError::InvalidStep)?;
            KvBudget::Bytes(bytes)
        }
        None => options.kv_budget,
    };
    let layout = super::kv_layout(model, options.block_size, budget, KV_ELEM_BYTES)?;
    backend.allocate_kv(&layout)?;
    Ok(Started { backend: Box::new(backend), layout, choice: String::new() })
}

/// Activations of one step, kept from step to step and grown only when a
/// step is larger than any before.
#[derive(Default)]
struct Workspace {
    x: Buf<f32>,
    h: Buf<u16>,
    qkv: Buf<f32>,
    attn: Buf<u16>,
    gate_up: Buf<f32>,
    act: Buf<u16>,
    last: Buf<u16>,
    logits: Buf<f32>,
    picked: Buf<u32>,
    meta: Buf<i32>,
}

impl Workspace {
    fn reserve(&mut self, gpu: &Gpu, c: &ModelConfig, tokens: usize, rows: usize) -> Result<(), BackendError> {
        let (hid, qw, kvw, ff) = (c.hidden, c.q_width(), c.kv_width(), c.ffn_hidden);
        self.x.ensure(gpu, tokens * hid)?;
        self.h.ensure(gpu, tokens * hid)?;
        self.qkv.ensure(gpu, tokens * (qw + 2 * kvw))?;
        self.attn.ensure(gpu, tokens * qw)?;
        self.gate_up.ensure(gpu, tokens * 2 * ff)?;
        self.act.ensure(gpu, tokens * ff)?;
        self.last.ensure(gpu, rows * hid)?;
        self.logits.ensure(gpu, rows * c.vocab_size)?;
        self.picked.ensure(gpu, rows)
    }
}

/// One kernel argument, held until the launch that reads it.
enum Arg {
    I32(i32),
    F32(f32),
    Ptr(u64),
}

impl Arg {
    fn push<'a>(&'a self, b: &mut LaunchArgs<'a>) {
        match self {
            Arg::I32(v) => b.arg(v),
            Arg::F32(v) => b.arg(v),
            Arg::Ptr(v) => b.arg(v),
        };
    }
}

impl From<i32> for Arg {
    fn from(v: i32) -> Arg {
        Arg::I32(v)
    }
}

impl From<f32> for Arg {
    fn from(v: f32) -> Arg {
        Arg::F32(v)
    }
}

impl From<u64> for Arg {
    fn from(v: u64) -> Arg {
        Arg::Ptr(v)
    }
}

/// Launches `f` on the step's stream.
fn launch(
    gpu: &Gpu,
    f: &CudaFunction,
    name: &str,
    grid: (u32, u32),
    block: u32,
    args: &[Arg],
) -> Result<(), BackendError> {
    let mut b = gpu.stream.launch_builder(f);
    for a in args {
        a.push(&mut b);
    }
    let cfg = LaunchConfig { grid_dim: (grid.0, grid.1, 1), block_dim: (block, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: each call site passes the arguments its kernel declares, in
    // order and type, pointing into buffers sized for the step by `Workspace::reserve`.
    unsafe { b.launch(cfg) }.map(|_| ()).map_err(|e| cuda_err(&format!("launching {name}"), e))
}

/// Runs a Llama-family decoder on an NVIDIA GPU.
pub struct CudaBackend {
    gpu: Gpu,
    kernels: Kernels,
    shape: KernelShape,
    precision: Precision,
    ordinal: usize,
    device: String,
    config: ModelConfig,
    weights: DeviceWeights,
    cos: Buf<f32>,
    sin: Buf<f32>,
    layout: KvLayout,
    k_cache: Buf<u16>,
    v_cache: Buf<u16>,
    ws: Workspace,
    meta: StepMeta,
    started: CudaEvent,
    ended: CudaEvent,
    device_time: Option<Duration>,
}

impl CudaBackend {
    /// Loads `model` onto the device and allocates KV storage for `layout`.
    pub fn new(model: &Model, layout: &KvLayout, options: &CudaOptions) -> Result<CudaBackend, BackendError> {
        let mut backend = CudaBackend::load(model, options)?;
        backend.allocate_kv(layout)?;
        Ok(backend)
    }

    /// Opens the device, compiles the kernels, uploads the weights and the
    /// RoPE table and reserves workspace; the KV cache comes later.
    fn load(model: &Model, options: &CudaOptions) -> Result<CudaBackend, BackendError> {
        probe().map_err(BackendError::NoCudaDevice)?;
        // cudarc reports a missing driver symbol by panicking; make it an error.
        catch_unwind(AssertUnwindSafe(|| CudaBackend::load_unguarded(model, options))).unwrap_or_else(|p| {
            let reason = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "unknown panic".into());
            Err(cuda_err("starting the backend", reason))
        })
    }

    fn load_unguarded(model: &Model, options: &CudaOptions) -> Result<CudaBackend, BackendError> {
        let c = &model.config;
        let shape = KernelShape::new(c, options.precision)?;
        let gpu = Gpu::open(options.ordinal, shape.f16)?;
        let kernels = compile::load(&gpu.ctx, &shape)?;
        let weights = DeviceWeights::upload(&gpu, model, shape.f16)?;
        let (cos, sin) = rope_table(c);
        let mut ws = Workspace::default();
        ws.reserve(&gpu, c, options.max_batch_tokens.max(1), options.max_seqs.max(1))?;
        Ok(CudaBackend {
            device: gpu.describe(),
            cos: Buf::from_host(&gpu, &cos)?,
            sin: Buf::from_host(&gpu, &sin)?,
            started: gpu.event()?,
            ended: gpu.event()?,
            kernels,
            shape,
            precision: options.precision,
            ordinal: options.ordinal,
            config: c.clone(),
            weights,
            layout: KvLayout { block_size: 1, num_blocks: 0, block_bytes: 0 },
            k_cache: Buf::default(),
            v_cache: Buf::default(),
            ws,
            meta: StepMeta::default(),
            device_time: None,
            gpu,
        })
    }

    /// Allocates keys and values for every block of `layout`, all layers.
    fn allocate_kv(&mut self, layout: &KvLayout) -> Result<(), BackendError> {
        let c = &self.config;
        let elems = c.n_layers * layout.num_blocks * layout.block_size * c.kv_width();
        let bytes = 2 * elems * KV_ELEM_BYTES;
        let free = self.gpu.free_memory()?;
        if bytes > free {
            return Err(BackendError::KvAlloc { bytes });
        }
        self.k_cache = Buf::zeros(&self.gpu, elems).map_err(|_| BackendError::KvAlloc { bytes })?;
        self.v_cache = Buf::zeros(&self.gpu, elems).map_err(|_| BackendError::KvAlloc { bytes })?;
        self.layout = *layout;
        Ok(())
    }

    /// Device time (first launch to last, by CUDA events) of the last step.
    pub fn last_step_device_time(&self) -> Option<Duration> {
        self.device_time
    }

    /// Bytes of weights every step reads, whatever its batch.
    pub fn weight_bytes_per_step(&self) -> usize {
        self.weights.bytes_per_step()
    }

    /// Bytes of weights held on the device.
    pub fn weight_bytes(&self) -> usize {
        self.weights.device_bytes()
    }

    /// The KV geometry this backend holds.
    pub fn layout(&self) -> KvLayout {
        self.layout
    }

    /// Device memory free now, in bytes.
    pub fn free_memory(&self) -> Result<usize, BackendError> {
        self.gpu.free_memory()
    }

    /// Device-to-device copy bandwidth in bytes/s (read plus written),
    /// measured now over a copy of `bytes`.
    pub fn copy_bandwidth(&self, bytes: usize) -> Result<f64, BackendError> {
        self.gpu.copy_bandwidth(bytes)
    }

    /// Runs the step up to the logits of the wanted rows, on the device;
    /// returns the number of rows.
    fn run(&mut self, batch: &StepBatch<'_>, greedy: bool) -> Result<usize, BackendError> {
        batch.validate(&self.layout, self.config.max_context, self.config.vocab_size)?;
        if self.k_cache.len == 0 {
            return Err(BackendError::InvalidStep("the CUDA backend has no KV cache yet".into()));
        }
        self.gpu.ctx.bind_to_thread().map_err(|e| cuda_err("binding the context", e))?;
        self.meta.pack(batch);
        let (n, rows) = (self.meta.tokens, self.meta.rows);
        if n == 0 {
            // Nothing to run; the events still bracket the (empty) step for `finish`.
            self.started.record(&self.gpu.stream).map_err(|e| cuda_err("recording an event", e))?;
            self.ended.record(&self.gpu.stream).map_err(|e| cuda_err("recording an event", e))?;
            return Ok(0);
        }
        self.ws.reserve(&self.gpu, &self.config, n, rows)?;
        self.ws.meta.upload(&self.gpu, &self.meta.data)?;
        let m = &self.meta;
        let at = |offset: usize| self.ws.meta.ptr + (offset * size_of::<i32>()) as u64;
        let (ids, pos, seq, starts, wanted, tables) =
            (at(m.ids_at), at(m.pos_at), at(m.seq_at), at(m.table_start_at), at(m.rows_at), at(m.tables_at));

        let (g, k, c, w, ws) = (&self.gpu, &self.kernels, &self.config, &self.weights, &self.ws);
        let (hid, qw, kvw, ff) = (c.hidden, c.q_width(), c.kv_width(), c.ffn_hidden);
        let (hid_i, eps) = (hid as i32, c.rms_eps);
        let (heads, kv_heads, bs) = (c.n_heads as i32, c.n_kv_heads as i32, self.layout.block_size as i32);
        let neox = i32::from(c.rope_style == RopeStyle::Neox);
        let scale = 1.0 / (c.head_dim as f32).sqrt();
        let layer_bytes = (self.layout.num_blocks * self.layout.block_size * kvw * KV_ELEM_BYTES) as u64;
        let nt = n as u32;

        self.started.record(&g.stream).map_err(|e| cuda_err("recording an event", e))?;
        launch(g, &k.embed, "embed", (nt, 1), 256, &[ids.into(), w.embed.ptr.into(), ws.x.ptr.into(), hid_i.into()])?;
        for (l, lw) in w.layers.iter().enumerate() {
            let (kc, vc) = (self.k_cache.ptr + l as u64 * layer_bytes, self.v_cache.ptr + l as u64 * layer_bytes);
            let norm = |weight: u64| {
                let args = [ws.x.ptr.into(), 0u64.into(), weight.into(), ws.h.ptr.into(), hid_i.into(), eps.into()];
                launch(g, &k.rms_norm, "rms_norm", (nt, 1), 256, &args)
            };
            norm(lw.attn_norm.ptr)?;
            // SAFETY (every gemm below): the workspace holds n rows of each operand.
            unsafe { g.gemm(lw.qkv.ptr, ws.h.ptr, ws.qkv.ptr, n, qw + 2 * kvw, hid, 0.0)? };
            let bias = lw.qkv_bias.as_ref().map_or(0, |b| b.ptr);
            let args = [
                ws.qkv.ptr.into(),
                bias.into(),
                pos.into(),
                seq.into(),
                starts.into(),
                tables.into(),
                self.cos.ptr.into(),
                self.sin.ptr.into(),
                kc.into(),
                vc.into(),
                heads.into(),
                kv_heads.into(),
                bs.into(),
                neox.into(),
            ];
            launch(g, &k.rope_store_kv, "rope_store_kv", (nt, 1), 128, &args)?;
            let args = [
                ws.qkv.ptr.into(),
                pos.into(),
                seq.into(),
                starts.into(),
                tables.into(),
                kc.into(),
                vc.into(),
                ws.attn.ptr.into(),
                heads.into(),
                kv_heads.into(),
                bs.into(),
                scale.into(),
            ];
            let block = (self.shape.attn_warps * 32) as u32;
            launch(g, &k.attention, "attention", (nt, c.n_kv_heads as u32), block, &args)?;
            // The residual add is cuBLAS's beta = 1 into x.
            unsafe { g.gemm(lw.wo.ptr, ws.attn.ptr, ws.x.ptr, n, hid, qw, 1.0)? };
            norm(lw.ffn_norm.ptr)?;
            unsafe { g.gemm(lw.gate_up.ptr, ws.h.ptr, ws.gate_up.ptr, n, 2 * ff, hid, 0.0)? };
            let args = [ws.gate_up.ptr.into(), ws.act.ptr.into(), (ff as i32).into(), (n as i32).into()];
            launch(g, &k.swiglu, "swiglu", ((n * ff).div_ceil(256) as u32, 1), 256, &args)?;
            unsafe { g.gemm(lw.down.ptr, ws.act.ptr, ws.x.ptr, n, hid, ff, 1.0)? };
        }
        if rows > 0 {
            let args = [
                ws.x.ptr.into(),
                wanted.into(),
                w.output_norm.ptr.into(),
                ws.last.ptr.into(),
                hid_i.into(),
                eps.into(),
            ];
            launch(g, &k.rms_norm, "rms_norm", (rows as u32, 1), 256, &args)?;
            unsafe { g.gemm(w.lm_head().ptr, ws.last.ptr, ws.logits.ptr, rows, c.vocab_size, hid, 0.0)? };
            if greedy {
                let args = [ws.logits.ptr.into(), (c.vocab_size as i32).into(), ws.picked.ptr.into()];
                launch(g, &k.argmax_rows, "argmax_rows", (rows as u32, 1), 1024, &args)?;
            }
        }
        self.ended.record(&g.stream).map_err(|e| cuda_err("recording an event", e))?;
        Ok(rows)
    }

    /// Waits for the step and reads its device time.
    fn finish(&mut self) -> Result<(), BackendError> {
        self.ended.synchronize().map_err(|e| cuda_err("running a step", e))?;
        let ms = self.started.elapsed_ms(&self.ended).map_err(|e| cuda_err("timing a step", e))?;
        self.device_time = Some(Duration::from_secs_f64(f64::from(ms.max(0.0)) / 1e3));
        Ok(())
    }
}

/// Cosine and sine of every rotary angle, by position, computed as the CPU
/// backend computes them (so that both rotate by the same `f32` values).
fn rope_table(c: &ModelConfig) -> (Vec<f32>, Vec<f32>) {
    let half = c.head_dim / 2;
    let inv: Vec<f32> = (0..half).map(|i| 1.0 / c.rope_theta.powf((2 * i) as f32 / c.head_dim as f32)).collect();
    let mut cos = Vec::with_capacity(c.max_context * half);
    let mut sin = Vec::with_capacity(c.max_context * half);
    for p in 0..c.max_context {
        for f in &inv {
            let a = p as f32 * f;
            cos.push(a.cos());
            sin.push(a.sin());
        }
    }
    (cos, sin)
}

impl Backend for CudaBackend {
    fn name(&self) -> String {
        let p = match self.precision {
            Precision::Bf16 => "bf16",
            Precision::F16 => "f16",
        };
        format!("cuda:{} ({}, {p})", self.ordinal, self.device)
    }

    fn forward(&mut self, batch: &StepBatch<'_>, logits: &mut Vec<f32>) -> Result<(), BackendError> {
        let rows = self.run(batch, false)?;
        logits.resize(rows * self.config.vocab_size, 0.0);
        if rows > 0 {
            self.ws.logits.download(&self.gpu, logits)?;
        }
        self.finish()
    }

    fn has_device_greedy(&self) -> bool {
        true
    }

    fn forward_greedy(&mut self, batch: &StepBatch<'_>, tokens: &mut Vec<u32>) -> Result<(), BackendError> {
        let rows = self.run(batch, true)?;
        tokens.resize(rows, 0);
        if rows > 0 {
            self.ws.picked.download(&self.gpu, tokens)?;
        }
        self.finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probing_never_panics_and_explains_a_missing_device() {
        match probe() {
            Ok(found) => assert!(found.contains("CUDA device"), "{found}"),
            Err(reason) => assert!(!reason.is_empty()),
        }
    }
}
