//! Levee's inference engine: a Llama-family model served with continuous
//! batching over a paged KV cache. The engine knows nothing about HTTP or Wasm.
//!
//! ```no_run
//! use levee_gpu::{Engine, EngineConfig, GenerationRequest, Model, TokenEvent};
//!
//! let model = Model::load("models/SmolLM2-135M-Instruct.Q4_1.gguf")?;
//! let engine = Engine::start(model, EngineConfig::default())?;
//! let prompt = engine.tokenizer().encode("The capital of France is");
//! let mut stream = engine.submit(GenerationRequest::new(prompt, 16))?;
//! while let Some(event) = stream.blocking_next() {
//!     match event? {
//!         TokenEvent::Token(t) => print!("{}", t.text),
//!         TokenEvent::Finished(done) => println!(" [{}]", done.reason.as_str()),
//!     }
//! }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

#![deny(missing_docs)]

pub mod backend;
mod batcher;
pub mod engine;
pub mod kv;
pub mod model;
pub mod request;
pub mod sampling;
pub mod stats;

pub use backend::BackendKind;
pub use engine::{Engine, EngineConfig, EngineError, EngineHandle, ModelInfo};
pub use kv::KvBudget;
pub use model::{ChatMessage, Model, ModelError, Tokenizer};
pub use request::{
    Completion, FinishReason, GeneratedToken, GenerationRequest, Timing, TokenEvent, TokenStream, Usage,
};
pub use sampling::{Logprobs, SamplingParams};
pub use stats::EngineStats;
