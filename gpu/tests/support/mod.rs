//! Shared set-up for the engine's integration tests: the default model,
//! loaded once per test binary.

#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use levee_gpu::Model;

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
