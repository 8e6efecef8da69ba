//! What flows into and out of the engine: a [`GenerationRequest`] in, a
//! [`TokenStream`] of [`TokenEvent`]s out.

use std::time::Duration;

use tokio::sync::mpsc;

use crate::engine::EngineError;
use crate::sampling::{Logprobs, SamplingParams};

/// One generation, as the host submits it.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerationRequest {
    /// Prompt token ids (already rendered and tokenized).
    pub prompt: Vec<u32>,
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Scheduling priority: lower runs first (vLLM's convention); 0 by default.
    pub priority: i32,
    /// Sampling and stop rules.
    pub sampling: SamplingParams,
}

impl GenerationRequest {
    /// A greedy request at default priority.
    pub fn new(prompt: Vec<u32>, max_tokens: usize) -> GenerationRequest {
        GenerationRequest { prompt, max_tokens, priority: 0, sampling: SamplingParams::default() }
    }
}

/// One generated token. Every sampled token gets one, so a stream's token
/// count equals `Usage::completion_tokens`.
#[derive(Debug, Clone, PartialEq)]
pub struct GeneratedToken {
    /// Token id.
    pub id: u32,
    /// Text this token adds. May be empty while a multi-byte character or a
    /// possible stop string is incomplete; the held text comes with a later
    /// token (a matched stop string is never sent). An end-of-sequence or
    /// stop token carries only text still held back, usually none.
    pub text: String,
    /// Log-probabilities, when the request asked for them.
    pub logprobs: Option<Logprobs>,
}

/// Why a generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// End-of-sequence token, a stop token or a stop string.
    Stop,
    /// `max_tokens` reached, or the model's context is full.
    Length,
}

impl FinishReason {
    /// The OpenAI spelling (`stop`, `length`).
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// Token counts of a finished generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    /// Tokens in the prompt.
    pub prompt_tokens: usize,
    /// Tokens generated (a final stop token included).
    pub completion_tokens: usize,
}

/// Latencies of a finished generation.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Timing {
    /// From submission to first admission.
    pub queued: Duration,
    /// From submission to the first generated token.
    pub time_to_first_token: Duration,
    /// Mean time between generated tokens after the first.
    pub time_per_output_token: Duration,
    /// From submission to the end.
    pub total: Duration,
    /// Times the sequence was preempted and recomputed.
    pub preemptions: u32,
}

/// The end of a generation.
#[derive(Debug, Clone, PartialEq)]
pub struct Completion {
    /// Why it ended.
    pub reason: FinishReason,
    /// Token counts.
    pub usage: Usage,
    /// Latencies.
    pub timing: Timing,
}

/// What the engine sends for a request: tokens, then one `Finished`.
#[derive(Debug, Clone, PartialEq)]
pub enum TokenEvent {
    /// A generated token.
    Token(GeneratedToken),
    /// The generation ended normally; nothing follows.
    Finished(Completion),
}

/// The events of one request. Dropping it aborts the generation within one
/// engine step and frees its KV blocks.
#[derive(Debug)]
pub struct TokenStream {
    id: u64,
    rx: mpsc::UnboundedReceiver<Result<TokenEvent, EngineError>>,
}

impl TokenStream {
    pub(crate) fn new(id: u64, rx: mpsc::UnboundedReceiver<Result<TokenEvent, EngineError>>) -> TokenStream {
        TokenStream { id, rx }
    }

    /// The engine's id for this request.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The next event; `None` after `Finished` or an error.
    pub async fn next(&mut self) -> Option<Result<TokenEvent, EngineError>> {
        self.rx.recv().await
    }

    /// The next event, blocking the thread (not for use inside an async runtime).
    pub fn blocking_next(&mut self) -> Option<Result<TokenEvent, EngineError>> {
        self.rx.blocking_recv()
    }

    /// The underlying channel, e.g. to wrap as a `Stream`.
    pub fn into_inner(self) -> mpsc::UnboundedReceiver<Result<TokenEvent, EngineError>> {
        self.rx
    }

    /// Waits for the whole generation: its tokens and how it ended.
    pub fn blocking_collect(mut self) -> Result<(Vec<GeneratedToken>, Completion), EngineError> {
        let mut tokens = Vec::new();
        while let Some(event) = self.blocking_next() {
            match event? {
                TokenEvent::Token(t) => tokens.push(t),
                TokenEvent::Finished(c) => return Ok((tokens, c)),
            }
        }
        Err(EngineError::Stopped)
    }
}
