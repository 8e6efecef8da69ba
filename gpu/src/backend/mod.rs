//! The seam between scheduling and arithmetic. The batcher decides which
//! tokens of which sequences run in a step; a [`Backend`] runs them through
//! the model, writing keys and values into its own paged KV storage at the
//! slots the sequences' block tables name, and returns logits.
//!
//! The CPU backend lives in [`cpu`]; the CUDA backend in [`cuda`] implements
//! the same trait over device memory. [`start`] picks one of them for a
//! [`BackendKind`] and sizes the KV cache for it.

pub mod cpu;
pub mod cuda;

use std::fmt;
use std::str::FromStr;

use crate::kv::{KV_ELEM_BYTES, KvBudget, KvLayout};
use crate::model::Model;
use crate::sampling::argmax;

/// A backend that failed to start or to run a step.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// Worker threads could not be started.
    #[error("cannot start {threads} compute threads: {reason}")]
    Threads {
        /// Threads asked for.
        threads: usize,
        /// Why the pool failed.
        reason: String,
    },
    /// The KV storage could not be allocated.
    #[error("cannot allocate {bytes} bytes of KV cache; lower the KV budget")]
    KvAlloc {
        /// Bytes asked for.
        bytes: usize,
    },
    /// The KV budget holds not even one block.
    #[error("KV budget {budget} holds no block of {block_size} positions")]
    KvTooSmall {
        /// The budget, as configured.
        budget: String,
        /// Positions per block.
        block_size: usize,
    },
    /// A step referred to memory it does not own (a scheduler bug, reported instead of crashing).
    #[error("invalid step: {0}")]
    InvalidStep(String),
    /// `--device cuda` was asked for and no CUDA device can be used.
    #[error("device cuda was asked for, but no CUDA device can be used: {0} (use --device cpu or auto)")]
    NoCudaDevice(String),
    /// The model has a shape the CUDA kernels do not handle.
    #[error("the CUDA backend cannot run this model: {0}")]
    Unsupported(String),
    /// A CUDA call (driver, NVRTC or cuBLAS) failed.
    #[error("CUDA {what} failed: {reason}")]
    Cuda {
        /// What was being done.
        what: String,
        /// The error CUDA reported.
        reason: String,
    },
}

/// The new tokens of one sequence in a step.
#[derive(Debug, Clone, Copy)]
pub struct SeqChunk<'a> {
    /// Tokens to run, in order.
    pub tokens: &'a [u32],
    /// Position of `tokens[0]` in the sequence; earlier positions are cached.
    pub start_pos: usize,
    /// KV blocks of the sequence, covering at least `start_pos + tokens.len()` positions.
    pub block_table: &'a [u32],
    /// Whether the logits after the last token are wanted (it completes the sequence's known tokens).
    pub wants_logits: bool,
}

/// One step's work: chunks of several sequences run together.
#[derive(Debug, Default)]
pub struct StepBatch<'a> {
    /// The sequences in this step.
    pub seqs: Vec<SeqChunk<'a>>,
}

impl StepBatch<'_> {
    /// Tokens in the step.
    pub fn token_count(&self) -> usize {
        self.seqs.iter().map(|s| s.tokens.len()).sum()
    }

    /// Sequences whose logits are wanted.
    pub fn logits_count(&self) -> usize {
        self.seqs.iter().filter(|s| s.wants_logits).count()
    }

    /// Checks the step against a backend's limits: positions within the
    /// model's context, block tables covering them with blocks of the pool,
    /// token ids within the vocabulary, and no logits asked of an empty chunk.
    pub fn validate(&self, layout: &KvLayout, positions: usize, vocab: usize) -> Result<(), BackendError> {
        for s in &self.seqs {
            if s.wants_logits && s.tokens.is_empty() {
                return Err(BackendError::InvalidStep("a chunk without tokens cannot have logits".into()));
            }
            let end = s.start_pos + s.tokens.len();
            if end > positions {
                return Err(BackendError::InvalidStep(format!(
                    "position {end} is past the model's context of {positions}"
                )));
            }
            if s.block_table.len() * layout.block_size < end
                || s.block_table.iter().any(|&b| b as usize >= layout.num_blocks)
            {
                return Err(BackendError::InvalidStep(format!("block table does not cover {end} positions")));
            }
            if let Some(t) = s.tokens.iter().find(|&&t| t as usize >= vocab) {
                return Err(BackendError::InvalidStep(format!("token id {t} is outside the vocabulary")));
            }
        }
        Ok(())
    }
}

/// Runs model steps over a paged KV cache.
pub trait Backend: Send {
    /// Short name for logs and stats (`cpu`, `cuda:0`).
    fn name(&self) -> String;

    /// Runs one step. On return `logits` holds `vocab_size` values for each
    /// chunk with `wants_logits`, in batch order.
    fn forward(&mut self, batch: &StepBatch<'_>, logits: &mut Vec<f32>) -> Result<(), BackendError>;

    /// Whether [`Backend::forward_greedy`] picks tokens where the logits
    /// live, so that only token ids come back (cheaper than
    /// [`Backend::forward`] when every sequence decodes greedily).
    fn has_device_greedy(&self) -> bool {
        false
    }

    /// Runs one step and writes into `tokens` the greedy choice (the largest
    /// logit, the lowest id on ties) for each chunk with `wants_logits`, in
    /// batch order. The default runs [`Backend::forward`] and picks on the host.
    fn forward_greedy(&mut self, batch: &StepBatch<'_>, tokens: &mut Vec<u32>) -> Result<(), BackendError> {
        let mut logits = Vec::new();
        self.forward(batch, &mut logits)?;
        let vocab = logits.len() / batch.logits_count().max(1);
        tokens.clear();
        if vocab > 0 {
            tokens.extend(logits.chunks_exact(vocab).map(argmax));
        }
        Ok(())
    }
}

/// Which backend to run (`--device`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BackendKind {
    /// The portable CPU backend.
    Cpu,
    /// The CUDA backend on device 0; starting fails with
    /// [`BackendError::NoCudaDevice`] when no device can be used.
    Cuda,
    /// CUDA when a driver, a device and the CUDA libraries are present, else the CPU.
    #[default]
    Auto,
}

impl BackendKind {
    /// The spelling `--device` takes (`cpu`, `cuda`, `auto`).
    pub fn as_str(self) -> &'static str {
        match self {
            BackendKind::Cpu => "cpu",
            BackendKind::Cuda => "cuda",
            BackendKind::Auto => "auto",
        }
    }
}

impl fmt::Display for BackendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A `--device` value that names no backend.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown device {0:?}: expected cpu, cuda or auto")]
pub struct UnknownDevice(pub String);

impl FromStr for BackendKind {
    type Err = UnknownDevice;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "cpu" => Ok(BackendKind::Cpu),
            "cuda" | "gpu" => Ok(BackendKind::Cuda),
            "auto" => Ok(BackendKind::Auto),
            _ => Err(UnknownDevice(s.to_string())),
        }
    }
}

/// What [`start`] needs beyond the model.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BackendOptions {
    /// Which backend.
    pub kind: BackendKind,
    /// CPU compute threads (0: one per core).
    pub threads: usize,
    /// KV cache memory.
    pub kv_budget: KvBudget,
    /// On CUDA, when set, the KV cache takes this fraction (0 to 1] of the
    /// device memory still free once weights and workspace are allocated,
    /// instead of `kv_budget`.
    pub kv_device_fraction: Option<f32>,
    /// Token positions per KV block.
    pub block_size: usize,
    /// Most tokens in one step (sizes the CUDA workspace up front).
    pub max_batch_tokens: usize,
    /// Most sequences in one step (sizes the CUDA logits buffer up front).
    pub max_seqs: usize,
}

/// A started backend and the KV geometry it holds.
pub struct Started {
    /// The backend.
    pub backend: Box<dyn Backend>,
    /// The KV cache it allocated.
    pub layout: KvLayout,
    /// Which backend was chosen and why, for the start-up log
    /// (`cuda: --device auto found 1 CUDA device`).
    pub choice: String,
}

/// Picks and builds the backend `options.kind` names for `model`, sizes its
/// KV cache and allocates it. `Auto` takes CUDA when [`cuda::probe`] finds a
/// usable device and falls back to the CPU otherwise, saying why in
/// [`Started::choice`].
pub fn start(model: &Model, options: &BackendOptions) -> Result<Started, BackendError> {
    let use_cuda = match options.kind {
        BackendKind::Cpu => Err("--device cpu".to_string()),
        BackendKind::Cuda => match cuda::probe() {
            Ok(found) => Ok(format!("--device cuda: {found}")),
            Err(reason) => return Err(BackendError::NoCudaDevice(reason)),
        },
        BackendKind::Auto => cuda::probe()
            .map(|found| format!("--device auto: {found}"))
            .map_err(|reason| format!("--device auto: {reason}, so the CPU backend runs")),
    };
    match use_cuda {
        Ok(why) => {
            let started = cuda::start(model, options)?;
            Ok(Started { choice: format!("cuda ({why})"), ..started })
        }
        Err(why) => {
            let layout = kv_layout(model, options.block_size, options.kv_budget, KV_ELEM_BYTES)?;
            let backend = Box::new(cpu::CpuBackend::new(model, &layout, options.threads)?);
            Ok(Started { backend, layout, choice: format!("cpu ({why})") })
        }
    }
}

/// The KV layout `budget` allows, or an error saying it holds no block.
pub(crate) fn kv_layout(
    model: &Model,
    block_size: usize,
    budget: KvBudget,
    elem_bytes: usize,
) -> Result<KvLayout, BackendError> {
    KvLayout::with_elem_bytes(&model.config, block_size, budget, elem_bytes)
        .ok_or_else(|| BackendError::KvTooSmall { budget: format!("{budget:?}"), block_size })
}

/// Builds the backend `kind` for `model` with KV storage for `layout`
/// (`Auto` resolves as in [`start`]).
pub fn create(
    kind: BackendKind,
    model: &Model,
    layout: &KvLayout,
    threads: usize,
) -> Result<Box<dyn Backend>, BackendError> {
    let cuda = match kind {
        BackendKind::Cpu => false,
        BackendKind::Cuda => {
            cuda::probe().map_err(BackendError::NoCudaDevice)?;
            true
        }
        BackendKind::Auto => cuda::probe().is_ok(),
    };
    if cuda {
        let options = cuda::CudaOptions::default();
        Ok(Box::new(cuda::CudaBackend::new(model, layout, &options)?))
    } else {
        Ok(Box::new(cpu::CpuBackend::new(model, layout, threads)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_names_parse_and_unknown_ones_are_named_in_the_error() {
        assert_eq!("cpu".parse(), Ok(BackendKind::Cpu));
        assert_eq!("CUDA".parse(), Ok(BackendKind::Cuda));
        assert_eq!(" auto ".parse(), Ok(BackendKind::Auto));
        let err = "tpu".parse::<BackendKind>().unwrap_err();
        assert_eq!(err.to_string(), "unknown device \"tpu\": expected cpu, cuda or auto");
        for kind in [BackendKind::Cpu, BackendKind::Cuda, BackendKind::Auto] {
            assert_eq!(kind.as_str().parse(), Ok(kind));
        }
        assert_eq!(BackendKind::default(), BackendKind::Auto);
    }
}
