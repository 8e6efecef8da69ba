//! Shared set-up for the engine's integration tests: the default model,
//! loaded once per test binary.

#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use levee_gpu::Model;
use levee_gpu::backend::{Backend, SeqChunk, StepBatch};
use levee_gpu::kv::{BlockPool, BlockTable, KvLayout};

/// Path of the default model, fetched by `scripts/fetch-model.sh`, or
/// `LEVEE_MODEL` when set (test binaries run on another machine, see
/// `scripts/gpu/run.sh`).
pub fn model_path() -> PathBuf {
    match std::env::var_os("LEVEE_MODEL") {
        Some(p) => PathBuf::from(p),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/SmolLM2-135M-Instruct.Q4_1.gguf"),
    }
}

/// Loads the default model, failing with the command that fetches it.
pub fn load_model() -> Model {
    let path = model_path();
    assert!(path.exists(), "{} is missing: run scripts/fetch-model.sh first", path.display());
    match Model::load(&path) {
        Ok(m) => m,
        Err(e) => panic!("cannot load the default model: {e}"),
    }
}

/// The default model's tokenizer, shared by a test binary.
pub fn shared_model() -> Arc<Model> {
    static MODEL: OnceLock<Arc<Model>> = OnceLock::new();
    MODEL.get_or_init(|| Arc::new(load_model())).clone()
}

/// An engine configuration sized for tests on a small machine, on the CPU
/// backend (whose results do not depend on the batch; `tests/cuda.rs` covers CUDA).
pub fn small_config() -> levee_gpu::EngineConfig {
    levee_gpu::EngineConfig {
        backend: levee_gpu::BackendKind::Cpu,
        threads: 2,
        kv_budget: levee_gpu::KvBudget::Blocks(256),
        ..levee_gpu::EngineConfig::default()
    }
}

/// Prompts of different lengths, for batching tests.
pub fn prompts(n: usize) -> Vec<String> {
    let subjects = [
        "The capital of France is",
        "Once upon a time, in a small village by the sea, there lived",
        "The three primary colors are",
        "def fibonacci(n):",
        "Water boils at",
        "The quick brown fox",
        "In 1969, astronauts",
        "A good breakfast includes",
        "The largest planet in our solar system is",
        "To make a cup of tea, first",
        "Photosynthesis is the process by which plants",
        "My favourite book is",
        "The speed of light is approximately",
        "Here is a list of fruits: apple, banana,",
        "The history of the Roman Empire began when",
        "Machine learning is",
    ];
    (0..n).map(|i| subjects[i % subjects.len()].repeat(1 + i / subjects.len())).collect()
}

/// The best token of `logits` and its margin over the second best.
pub fn top2(logits: &[f32]) -> (u32, f32) {
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.select_nth_unstable_by(1, |&a, &b| logits[b].total_cmp(&logits[a]));
    let (a, b) = if logits[order[0]] >= logits[order[1]] { (order[0], order[1]) } else { (order[1], order[0]) };
    (a as u32, logits[a] - logits[b])
}

/// A backend's choice (top-1 and its top-2 margin) after each of `steps`
/// prefixes: the prompt, then the prompt plus each token of `forced`. All
/// prompts run batched in every step; with `forced` empty, the backend feeds
/// its own greedy tokens (free-running).
pub fn forced_choices(
    backend: &mut dyn Backend,
    layout: &KvLayout,
    vocab: usize,
    prompts: &[Vec<u32>],
    forced: &[Vec<u32>],
    steps: usize,
) -> Vec<Vec<(u32, f32)>> {
    let mut pool = BlockPool::new(layout.num_blocks);
    let mut seqs: Vec<Vec<u32>> = prompts.to_vec();
    let tables: Vec<BlockTable> = prompts
        .iter()
        .map(|p| {
            let mut t = BlockTable::default();
            assert!(t.reserve(layout, &mut pool, p.len() + steps), "the test layout holds every prompt");
            t
        })
        .collect();
    let mut out = vec![Vec::new(); prompts.len()];
    let mut logits = Vec::new();
    for step in 0..steps {
        let chunks = seqs
            .iter()
            .zip(prompts)
            .zip(&tables)
            .map(|((s, p), t)| {
                let (start, end) = if step == 0 { (0, p.len()) } else { (p.len() + step - 1, p.len() + step) };
                SeqChunk { tokens: &s[start..end], start_pos: start, block_table: t.blocks(), wants_logits: true }
            })
            .collect();
        backend.forward(&StepBatch { seqs: chunks }, &mut logits).expect("forward");
        for (i, row) in logits.chunks_exact(vocab).enumerate() {
            let pick = top2(row);
            out[i].push(pick);
            seqs[i].push(forced.get(i).map_or(pick.0, |f| f[step]));
        }
    }
    out
}
