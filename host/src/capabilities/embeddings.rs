//! The host's embedding model: int8 all-MiniLM-L6-v2 (ONNX) through
//! fastembed, with ONNX Runtime loaded from a shared library at start.
//!
//! One thread owns the model. Calls that arrive while it is busy are
//! embedded together in the next batch, so concurrent lookups share the
//! cost of a forward pass. Each plugin has its own queue and a batch takes
//! from them in turn, so one plugin's flood does not delay another's text
//! by more than one text per batch.

use super::Embedder;
use fastembed::{InitOptionsUserDefined, Pooling, TextEmbedding, TokenizerFiles, UserDefinedEmbeddingModel};
use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, mpsc};
use std::time::{Duration, Instant};

/// Most texts embedded in one batch.
const MAX_BATCH: usize = 32;
/// Tokens of a text the model reads (the rest is cut).
const MAX_TOKENS: usize = 256;
/// Bytes of a text kept for embedding: well past what `MAX_TOKENS` tokens
/// span, so the cut changes nothing the model reads but bounds the copy.
const MAX_TEXT_BYTES: usize = MAX_TOKENS * 16;
/// Texts one plugin may have waiting; past this, its `embed` fails at once
/// rather than queueing work nobody may wait for. There is no bound shared
/// by all plugins, which one plugin's flood could fill for the others.
const OWNER_QUEUE_DEPTH: usize = 64;
/// Slack past a caller's wait before its text is dropped unembedded, so
/// that a text arriving at an idle model is always taken.
const GIVE_UP_TOLERANCE: Duration = Duration::from_millis(5);
/// How long a caller waits for a started text to be embedded, past its
/// own wait for the model: a batch is a few milliseconds; this only keeps a
/// wedged model from holding a thread forever.
const COMPUTE_GRACE: Duration = Duration::from_secs(10);

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
    /// When it was queued, and by when it must have been started.
    queued: Instant,
    give_up: Instant,
    reply: mpsc::Sender<Result<Vec<f32>, String>>,
}

/// Texts waiting for the model, one queue per plugin, served in turn: a
/// plugin that floods the model waits behind itself, not in front of others.
#[derive(Default)]
struct FairQueue {
    by_owner: HashMap<String, VecDeque<Job>>,
    /// Owners with work, in the order they are next served.
    turn: VecDeque<String>,
    waiting: usize,
    stopped: bool,
}

impl FairQueue {
    fn push(&mut self, owner: &str, job: Job) -> Result<(), String> {
        if self.stopped {
            return Err("the embedding thread has stopped".to_string());
        }
        let queue = self.by_owner.entry(owner.to_string()).or_default();
        if queue.len() >= OWNER_QUEUE_DEPTH {
            return Err(format!("this plugin already has {OWNER_QUEUE_DEPTH} texts waiting for the embedding model"));
        }
        if queue.is_empty() {
            self.turn.push_back(owner.to_string());
        }
        queue.push_back(job);
        self.waiting += 1;
        Ok(())
    }

    /// The next batch: one text per owner in turn, up to [`MAX_BATCH`];
    /// texts whose caller has stopped waiting are answered, not embedded.
    fn batch(&mut self, now: Instant) -> Vec<Job> {
        let mut batch = Vec::new();
        while batch.len() < MAX_BATCH {
            let Some(owner) = self.turn.pop_front() else { break };
            let Some(queue) = self.by_owner.get_mut(&owner) else { continue };
            let Some(job) = queue.pop_front() else { continue };
            self.waiting -= 1;
            if queue.is_empty() {
                self.by_owner.remove(&owner);
            } else {
                self.turn.push_back(owner);
            }
            if job.give_up < now {
                let waited = now.duration_since(job.queued);
                let _ = job.reply.send(Err(format!("the embedding model was busy for {waited:?}; try again later")));
                continue;
            }
            batch.push(job);
        }
        batch
    }
}

struct Queue {
    jobs: Mutex<FairQueue>,
    ready: Condvar,
}

/// The loaded model, behind its own thread.
pub struct MiniLm {
    queue: Arc<Queue>,
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
        let queue = Arc::new(Queue { jobs: Mutex::new(FairQueue::default()), ready: Condvar::new() });
        let worker = queue.clone();
        std::thread::Builder::new()
            .name("levee-embeddings".into())
            .spawn(move || {
                loop {
                    let batch = {
                        let mut jobs = worker.jobs.lock().unwrap_or_else(|p| p.into_inner());
                        while jobs.waiting == 0 {
                            jobs = worker.ready.wait(jobs).unwrap_or_else(|p| p.into_inner());
                        }
                        jobs.batch(Instant::now())
                    };
                    if batch.is_empty() {
                        continue;
                    }
                    let texts: Vec<&str> = batch.iter().map(|j| j.text.as_str()).collect();
                    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        embedding.embed(&texts, Some(batch.len()))
                    }));
                    match outcome {
                        Ok(Ok(vectors)) => {
                            for (job, vector) in batch.iter().zip(vectors) {
                                let _ = job.reply.send(Ok(unit(vector)));
                            }
                        }
                        Ok(Err(e)) => {
                            for job in &batch {
                                let _ = job.reply.send(Err(format!("embedding failed: {e}")));
                            }
                        }
                        Err(_) => {
                            let mut jobs = worker.jobs.lock().unwrap_or_else(|p| p.into_inner());
                            jobs.stopped = true;
                            // Answer everyone still waiting, not only this batch.
                            let queued = jobs.by_owner.drain().flat_map(|(_, q)| q);
                            for job in batch.iter().chain(queued.collect::<Vec<_>>().iter()) {
                                let message = "the embedding model failed; embeddings are off until restart";
                                let _ = job.reply.send(Err(message.to_string()));
                            }
                            jobs.turn.clear();
                            jobs.waiting = 0;
                            tracing::error!("the embedding model panicked; embeddings are off until restart");
                            return;
                        }
                    }
                }
            })
            .map_err(|e| EmbeddingError::Load(format!("cannot start the embedding thread: {e}")))?;
        Ok(Self { queue })
    }
}

impl Embedder for MiniLm {
    fn embed(&self, owner: &str, text: &str, max_wait: Duration) -> Result<Vec<f32>, String> {
        let (reply, answer) = mpsc::channel();
        let mut cut = text.len().min(MAX_TEXT_BYTES);
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        let queued = Instant::now();
        // A text that finds the model idle is never refused, however small its wait.
        let give_up = queued + max_wait + GIVE_UP_TOLERANCE;
        let job = Job { text: text[..cut].to_string(), queued, give_up, reply };
        self.queue.jobs.lock().unwrap_or_else(|p| p.into_inner()).push(owner, job)?;
        self.queue.ready.notify_one();
        match answer.recv_timeout(max_wait + COMPUTE_GRACE) {
            Ok(result) => result,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                Err(format!("the embedding model did not answer within {:?}", max_wait + COMPUTE_GRACE))
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => Err("the embedding thread has stopped".to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(give_up_in: Duration) -> (Job, mpsc::Receiver<Result<Vec<f32>, String>>) {
        let (reply, answer) = mpsc::channel();
        let now = Instant::now();
        (Job { text: String::new(), queued: now, give_up: now + give_up_in, reply }, answer)
    }

    #[test]
    fn a_batch_takes_from_each_plugin_in_turn() {
        let mut queue = FairQueue::default();
        let mut answers = Vec::new();
        for i in 0..40 {
            let (j, a) = job(Duration::from_secs(60));
            answers.push(a);
            queue.push("flood", Job { text: format!("flood {i}"), ..j }).unwrap();
        }
        let (j, _a) = job(Duration::from_secs(60));
        queue.push("innocent", Job { text: "hello world".into(), ..j }).unwrap();
        let batch = queue.batch(Instant::now());
        assert_eq!(batch.len(), MAX_BATCH);
        // The innocent text is second, behind one of the flood's, not 41st.
        assert_eq!(batch[1].text, "hello world");
        assert_eq!(queue.waiting, 40 - (MAX_BATCH - 1));
    }

    #[test]
    fn one_plugin_cannot_fill_the_whole_queue() {
        let mut queue = FairQueue::default();
        let mut keep = Vec::new();
        for _ in 0..OWNER_QUEUE_DEPTH {
            let (j, a) = job(Duration::from_secs(60));
            keep.push(a);
            queue.push("flood", j).unwrap();
        }
        let (j, _a) = job(Duration::from_secs(60));
        assert!(queue.push("flood", j).unwrap_err().contains("64 texts waiting"));
        let (j, _b) = job(Duration::from_secs(60));
        queue.push("innocent", j).unwrap();
    }

    #[test]
    fn texts_nobody_waits_for_any_more_are_answered_not_embedded() {
        let mut queue = FairQueue::default();
        let (j, answer) = job(Duration::ZERO);
        queue.push("p", j).unwrap();
        std::thread::sleep(Duration::from_millis(2));
        assert!(queue.batch(Instant::now()).is_empty());
        assert!(answer.recv().unwrap().unwrap_err().contains("busy"));
        assert_eq!(queue.waiting, 0);
        assert!(queue.by_owner.is_empty() && queue.turn.is_empty());
    }
}
