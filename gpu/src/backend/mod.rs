//! The seam between scheduling and arithmetic. The batcher decides which
//! tokens of which sequences run in a step; a [`Backend`] runs them through
//! the model, writing keys and values into its own paged KV storage at the
//! slots the sequences' block tables name, and returns logits.
//!
//! The CPU backend lives in [`cpu`]; a CUDA backend implements the same trait
//! over device memory.

pub mod cpu;

use crate::kv::KvLayout;
use crate::model::Model;

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
    /// A step referred to memory it does not own (a scheduler bug, reported instead of crashing).
    #[error("invalid step: {0}")]
    InvalidStep(String),
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
}

/// Runs model steps over a paged KV cache.
pub trait Backend: Send {
    /// Short name for logs and stats (`cpu`, `cuda:0`).
    fn name(&self) -> String;

    /// Runs one step. On return `logits` holds `vocab_size` values for each
    /// chunk with `wants_logits`, in batch order.
    fn forward(&mut self, batch: &StepBatch<'_>, logits: &mut Vec<f32>) -> Result<(), BackendError>;
}

/// Which backend to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BackendKind {
    /// The portable CPU backend.
    #[default]
    Cpu,
}

/// Builds the backend `kind` for `model` with KV storage for `layout`.
pub fn create(
    kind: BackendKind,
    model: &Model,
    layout: &KvLayout,
    threads: usize,
) -> Result<Box<dyn Backend>, BackendError> {
    match kind {
        BackendKind::Cpu => Ok(Box::new(cpu::CpuBackend::new(model, layout, threads)?)),
    }
}
