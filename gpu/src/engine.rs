//! The engine as the host sees it: [`Engine::start`] loads the backend and
//! spawns the step loop on its own thread; an [`EngineHandle`] submits
//! requests, reads stats and tokenizes, from any thread.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use crate::backend::{self, BackendError, BackendKind, BackendOptions};
use crate::batcher::{self, Command, Submitted};
use crate::kv::{KvBudget, KvLayout};
use crate::model::{ChatMessage, Model, ModelConfig, Tokenizer};
use crate::request::{GenerationRequest, TokenStream};
use crate::stats::{EngineStats, SharedStats};

/// How the engine schedules and how much memory it may use.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineConfig {
    /// Which backend runs the model (`--device`): CUDA when asked, or by
    /// default when a device is usable, else the CPU.
    pub backend: BackendKind,
    /// Compute threads of the CPU backend; 0 uses every core.
    pub threads: usize,
    /// KV cache memory.
    pub kv_budget: KvBudget,
    /// On the CUDA backend: when set, the KV cache takes this fraction, in
    /// (0, 1], of the device memory still free once weights and workspace are
    /// allocated, and `kv_budget` is ignored. The CPU backend ignores it.
    pub kv_device_fraction: Option<f32>,
    /// Token positions per KV block.
    pub block_size: usize,
    /// Most tokens (prefill and decode together) in one step.
    pub max_batch_tokens: usize,
    /// Most tokens of one prompt in one step (longer prompts are chunked).
    pub prefill_chunk: usize,
    /// Most sequences running at once.
    pub max_running: usize,
    /// Most requests waiting to be admitted; more are refused with `QueueFull`.
    pub max_queue_requests: usize,
    /// Most prompt tokens waiting to be admitted; more are refused with `QueueFull`.
    pub max_queued_tokens: usize,
    /// A request not admitted within this time fails with `QueueTimeout`.
    pub queue_timeout: Duration,
    /// Longest prompt plus generation; `None` uses the model's context length.
    pub max_context: Option<usize>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            backend: BackendKind::Auto,
            threads: 0,
            kv_budget: KvBudget::Bytes(512 << 20),
            kv_device_fraction: None,
            block_size: 16,
            max_batch_tokens: 512,
            prefill_chunk: 256,
            max_running: 64,
            max_queue_requests: 1024,
            max_queued_tokens: 1 << 20,
            queue_timeout: Duration::from_secs(60),
            max_context: None,
        }
    }
}

/// Why the engine refused or failed a request.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EngineError {
    /// The waiting queue is full; retry later.
    #[error("the engine's queue is full ({requests} requests, {tokens} prompt tokens waiting); retry later")]
    QueueFull {
        /// Requests waiting.
        requests: usize,
        /// Prompt tokens waiting.
        tokens: usize,
    },
    /// The request waited longer than the queue timeout.
    #[error("the request waited {waited:?} in the queue without being admitted (limit {limit:?})")]
    QueueTimeout {
        /// Time waited.
        waited: Duration,
        /// The configured limit.
        limit: Duration,
    },
    /// The request was aborted before it finished.
    #[error("the request was aborted: {0}")]
    Aborted(String),
    /// The request cannot run as given.
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// The engine's step loop has stopped.
    #[error("the engine has stopped")]
    Stopped,
    /// The backend failed while running the request.
    #[error("the backend failed: {0}")]
    Backend(String),
    /// The engine could not start.
    #[error("the engine cannot start: {0}")]
    Start(String),
}

impl From<BackendError> for EngineError {
    fn from(e: BackendError) -> Self {
        EngineError::Start(e.to_string())
    }
}

/// Requests and tokens accepted but not yet picked up by the step loop.
#[derive(Debug, Default)]
pub(crate) struct QueueCounts {
    pub requests: usize,
    pub tokens: usize,
}

/// State shared by every handle and the step loop.
pub(crate) struct Shared {
    pub queue: Mutex<QueueCounts>,
    pub stats: SharedStats,
    pub next_id: AtomicU64,
}

impl Shared {
    /// Removes a request from the waiting counts.
    pub fn dequeue(&self, tokens: usize) {
        let mut q = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        q.requests = q.requests.saturating_sub(1);
        q.tokens = q.tokens.saturating_sub(tokens);
    }
}

/// Starts engines.
pub struct Engine;

impl Engine {
    /// Builds the backend for `model` and starts the step loop on a dedicated
    /// thread. The loop ends once every handle is dropped and its work is done.
    pub fn start(model: Model, config: EngineConfig) -> Result<EngineHandle, EngineError> {
        let threads = if config.threads == 0 {
            std::thread::available_parallelism().map_or(1, |n| n.get())
        } else {
            config.threads
        };
        if config.max_batch_tokens == 0 || config.prefill_chunk == 0 || config.max_running == 0 {
            return Err(EngineError::Start(
                "max_batch_tokens, prefill_chunk and max_running must be at least 1".into(),
            ));
        }
        if let Some(f) = config.kv_device_fraction
            && !(f > 0.0 && f <= 1.0)
        {
            return Err(EngineError::Start(format!("kv_device_fraction must be in (0, 1], got {f}")));
        }
        let options = BackendOptions {
            kind: config.backend,
            threads,
            kv_budget: config.kv_budget,
            kv_device_fraction: config.kv_device_fraction,
            block_size: config.block_size,
            max_batch_tokens: config.max_batch_tokens,
            max_seqs: config.max_running,
        };
        let backend::Started { backend, layout, choice } = backend::start(&model, &options)?;
        // Advertise only what one sequence can hold: a context longer than
        // the whole KV cache would accept requests that can never run.
        let kv_tokens = layout.num_blocks * layout.block_size;
        let max_context =
            config.max_context.unwrap_or(model.config.max_context).min(model.config.max_context).min(kv_tokens);
        let shared = Arc::new(Shared {
            queue: Mutex::new(QueueCounts::default()),
            stats: SharedStats::new(layout),
            next_id: AtomicU64::new(1),
        });
        let tokenizer = Arc::new(model.tokenizer);
        let (tx, rx) = mpsc::channel();
        let info = Arc::new(ModelInfo {
            config: model.config,
            source: model.source,
            chat_template: model.chat_template,
            backend: backend.name(),
            device_choice: choice,
        });
        let loop_state = batcher::Batcher::new(
            backend,
            config.clone(),
            layout,
            tokenizer.clone(),
            shared.clone(),
            info.config.vocab_size,
            max_context,
        );
        std::thread::Builder::new()
            .name("levee-engine".into())
            .spawn(move || loop_state.run(rx))
            .map_err(|e| EngineError::Start(format!("cannot spawn the engine thread: {e}")))?;
        Ok(EngineHandle { tx, shared, tokenizer, info, config: Arc::new(config), layout, max_context })
    }
}

/// Facts about the loaded model.
pub struct ModelInfo {
    /// Shape and hyper-parameters.
    pub config: ModelConfig,
    /// Where it was loaded from.
    pub source: String,
    /// Chat template.
    pub chat_template: crate::model::ChatTemplate,
    /// Backend description (`cpu (Avx2, 8 threads)`, `cuda:0 (NVIDIA H200, sm_90, 143771 MiB, bf16)`).
    pub backend: String,
    /// Which backend `--device` chose and why (`cpu (--device auto: no CUDA
    /// driver (libcuda.so could not be loaded), so the CPU backend runs)`), for the start-up log.
    pub device_choice: String,
}

/// A cheap, cloneable handle to a running engine.
#[derive(Clone)]
pub struct EngineHandle {
    tx: mpsc::Sender<Command>,
    shared: Arc<Shared>,
    tokenizer: Arc<Tokenizer>,
    info: Arc<ModelInfo>,
    config: Arc<EngineConfig>,
    layout: KvLayout,
    max_context: usize,
}

impl EngineHandle {
    /// Queues a request. Refuses at once, with a distinct error, what can
    /// never run or what the queue has no room for.
    pub fn submit(&self, request: GenerationRequest) -> Result<TokenStream, EngineError> {
        self.validate(&request)?;
        {
            let mut q = self.shared.queue.lock().unwrap_or_else(|e| e.into_inner());
            if q.requests + 1 > self.config.max_queue_requests
                || q.tokens + request.prompt.len() > self.config.max_queued_tokens
            {
                return Err(EngineError::QueueFull { requests: q.requests, tokens: q.tokens });
            }
            if q.requests == 0 {
                self.shared.stats.work_arrived();
            }
            q.requests += 1;
            q.tokens += request.prompt.len();
        }
        let id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
        let (events, rx) = tokio::sync::mpsc::unbounded_channel();
        let prompt_len = request.prompt.len();
        let submitted = Submitted { id, request, events, at: Instant::now() };
        if self.tx.send(Command::Submit(Box::new(submitted))).is_err() {
            self.shared.dequeue(prompt_len);
            return Err(EngineError::Stopped);
        }
        Ok(TokenStream::new(id, rx))
    }

    fn validate(&self, r: &GenerationRequest) -> Result<(), EngineError> {
        let invalid = |m: String| Err(EngineError::InvalidRequest(m));
        if r.prompt.is_empty() {
            return invalid("the prompt is empty".into());
        }
        if r.max_tokens == 0 {
            return invalid("max_tokens must be at least 1".into());
        }
        if r.prompt.len() > self.config.max_queued_tokens {
            return invalid(format!(
                "the prompt has {} tokens; the queue holds at most {} prompt tokens",
                r.prompt.len(),
                self.config.max_queued_tokens
            ));
        }
        let vocab = self.info.config.vocab_size;
        if let Some(t) = r.prompt.iter().find(|&&t| t as usize >= vocab) {
            return invalid(format!("prompt token id {t} is outside the vocabulary of {vocab}"));
        }
        let total = r.prompt.len().saturating_add(r.max_tokens);
        if total > self.max_context {
            return invalid(format!(
                "prompt ({} tokens) plus max_tokens ({}) is {total}, more than the context of {} tokens",
                r.prompt.len(),
                r.max_tokens,
                self.max_context
            ));
        }
        if self.layout.blocks_for(total) > self.layout.num_blocks {
            return invalid(format!(
                "prompt plus max_tokens ({total} tokens) needs more KV memory than the whole cache holds ({} tokens)",
                self.layout.num_blocks * self.layout.block_size
            ));
        }
        r.sampling.validate().map_err(EngineError::InvalidRequest)
    }

    /// Stops the engine now: every request in flight or waiting ends with
    /// [`EngineError::Aborted`], and later submissions fail with
    /// [`EngineError::Stopped`]. (To drain instead, stop submitting and wait
    /// for the streams; the loop also ends once every handle is dropped and
    /// its work is done.)
    pub fn shutdown(&self) {
        let _ = self.tx.send(Command::Shutdown);
    }

    /// Current load figures; cheap (atomic reads).
    pub fn stats(&self) -> EngineStats {
        let q = self.shared.queue.lock().map(|q| (q.requests, q.tokens)).unwrap_or((0, 0));
        self.shared.stats.snapshot(q.0, q.1)
    }

    /// The model's tokenizer.
    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.tokenizer
    }

    /// Renders a conversation with the model's chat template.
    pub fn render_chat(&self, messages: &[ChatMessage]) -> Result<String, crate::model::ChatError> {
        self.info.chat_template.render(messages)
    }

    /// Facts about the loaded model.
    pub fn model(&self) -> &ModelInfo {
        &self.info
    }

    /// Longest prompt plus generation this engine accepts.
    pub fn max_context(&self) -> usize {
        self.max_context
    }

    /// The configuration the engine runs with.
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }
}
