//! The host's embedding model: int8 all-MiniLM-L6-v2 (ONNX) through
//! fastembed, with ONNX Runtime loaded from a shared library at start.
//!
//! One thread owns the model. Calls that arrive while it is busy are
//! embedded together in the next batch, so concurrent lookups share the
//! cost of a forward pass.

use super::Embedder;
use fastembed::{InitOptionsUserDefined, Pooling, TextEmbedding, TokenizerFiles, UserDefinedEmbeddingModel};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, mpsc};

/// Most texts embedded in one batch.
const MAX_BATCH: usize = 32;
/// Tokens of a text the model reads (the rest is cut).
const MAX_TOKENS: usize = 256;
/// Bytes of a text kept for embedding: well past what `MAX_TOKENS` tokens
/// span, so the cut changes nothing the model reads but bounds the copy.
const MAX_TEXT_BYTES: usize = MAX_TOKENS * 16;
/// Texts waiting for the embedding thread; past this, `embed` fails at once
/// rather than queueing work nobody may wait for.
const QUEUE_DEPTH: usize = 128;

/// Files the model folder must hold.
pub const FILES: [&str; 6] = [
    "model.onnx",
    "tokenizer.json",
    "config.json",
    "special_tokens_map.json",
    "tokenizer_config.json",
    "libonnxruntime.so",
];

/// Why the embedding model could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum EmbeddingError {
    /// A file is missing.
    #[error("embedding model: {0} is missing (scripts/setup.sh fetches it)")]
    Missing(PathBuf),
    /// A file could not be read.
    #[error("embedding model: cannot read {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// ONNX Runtime or the model failed to load.
    #[error("embedding model: {0}")]
    Load(String),
}

struct Job {
    text: String,
    reply: mpsc::Sender<Result<Vec<f32>, String>>,
}

/// The loaded model, behind its own thread.
pub struct MiniLm {
    jobs: mpsc::SyncSender<Job>,
}

fn read(dir: &Path, name: &str) -> Result<Vec<u8>, EmbeddingError> {
    let path = dir.join(name);
    std::fs::read(&path).map_err(|source| EmbeddingError::Read { path, source })
}

fn unit(mut v: Vec<f32>) -> Vec<f32> {
    let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt();
    if norm > 0.0 {
        v.iter_mut().for_each(|x| *x /= norm);
    }
    v
}

/// ONNX Runtime allows one environment per process, so the model is loaded
/// once and shared by every server in the process (tests start several).
static LOADED: Mutex<Option<(PathBuf, Arc<MiniLm>)>> = Mutex::new(None);

impl MiniLm {
    /// The model of `dir`, loaded on first use and shared afterwards.
    pub fn shared(dir: &Path, threads: usize) -> Result<Arc<MiniLm>, EmbeddingError> {
        let mut loaded = LOADED.lock().unwrap_or_else(|p| p.into_inner());
        match &*loaded {
            Some((path, model)) if path == dir => Ok(model.clone()),
            Some((path, _)) => Err(EmbeddingError::Load(format!(
                "{} is already loaded in this process; ONNX Runtime allows one model folder per process, not also {}",
                path.display(),
                dir.display()
            ))),
            None => {
                let model = Arc::new(MiniLm::load(dir, threads)?);
                *loaded = Some((dir.to_path_buf(), model.clone()));
                Ok(model)
            }
        }
    }

    /// Loads the model from `dir` (see [`FILES`]) with `threads` ONNX Runtime threads.
    pub fn load(dir: &Path, threads: usize) -> Result<Self, EmbeddingError> {
        for name in FILES {
            if !dir.join(name).is_file() {
                return Err(EmbeddingError::Missing(dir.join(name)));
            }
        }
        let environment = ort::init_from(dir.join("libonnxruntime.so"))
            .map_err(|e| EmbeddingError::Load(format!("cannot load ONNX Runtime from {}: {e}", dir.display())))?
            .with_name("levee-embeddings")
            .build()
            .map_err(|e| EmbeddingError::Load(format!("ONNX Runtime environment: {e}")))?;
        let files = TokenizerFiles {
            tokenizer_file: read(dir, "tokenizer.json")?,
            config_file: read(dir, "config.json")?,
            special_tokens_map_file: read(dir, "special_tokens_map.json")?,
            tokenizer_config_file: read(dir, "tokenizer_config.json")?,
        };
        let model = UserDefinedEmbeddingModel::new(read(dir, "model.onnx")?, files).with_pooling(Pooling::Mean);
        let options = InitOptionsUserDefined::new()
            .with_environment(environment)
            .with_intra_threads(threads.max(1))
            .with_max_length(MAX_TOKENS);
        let mut embedding = TextEmbedding::try_new_from_user_defined(model, options)
            .map_err(|e| EmbeddingError::Load(format!("{}: {e}", dir.join("model.onnx").display())))?;
        let (jobs, queue) = mpsc::sync_channel::<Job>(QUEUE_DEPTH);
        std::thread::Builder::new()
            .name("levee-embeddings".into())
            .spawn(move || {
                while let Ok(first) = queue.recv() {
                    let mut batch = vec![first];
                    while batch.len() < MAX_BATCH {
                        match queue.try_recv() {
                            Ok(job) => batch.push(job),
                            Err(_) => break,
                        }
                    }
                    let texts: Vec<&str> = batch.iter().map(|j| j.text.as_str()).collect();
                    match embedding.embed(&texts, Some(batch.len())) {
                        Ok(vectors) => {
                            for (job, vector) in batch.iter().zip(vectors) {
                                let _ = job.reply.send(Ok(unit(vector)));
                            }
                        }
                        Err(e) => {
                            for job in &batch {
                                let _ = job.reply.send(Err(format!("embedding failed: {e}")));
                            }
                        }
                    }
                }
            })
            .map_err(|e| EmbeddingError::Load(format!("cannot start the embedding thread: {e}")))?;
        Ok(Self { jobs })
    }
}

impl Embedder for MiniLm {
    fn embed(&self, text: &str) -> Result<Vec<f32>, String> {
        let (reply, answer) = mpsc::channel();
        let mut cut = text.len().min(MAX_TEXT_BYTES);
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        self.jobs.try_send(Job { text: text[..cut].to_string(), reply }).map_err(|e| match e {
            mpsc::TrySendError::Full(_) => format!("the embedding queue is full ({QUEUE_DEPTH} texts waiting)"),
            mpsc::TrySendError::Disconnected(_) => "the embedding thread has stopped".to_string(),
        })?;
        answer.recv().map_err(|_| "the embedding thread has stopped".to_string())?
    }
}
