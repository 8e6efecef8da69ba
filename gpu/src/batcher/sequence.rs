//! One request inside the engine: its tokens, how many are in the KV cache,
//! its blocks, its sampler, and the text it has streamed so far (incremental
//! detokenization with stop strings held back until they can be ruled out).

use std::time::Instant;

use tokio::sync::mpsc::UnboundedSender;

use crate::engine::EngineError;
use crate::kv::BlockTable;
use crate::model::{Decoder, Tokenizer};
use crate::request::{Completion, FinishReason, GeneratedToken, Timing, TokenEvent, Usage};
use crate::sampling::{Logprobs, Sampler};

/// Where a sequence's events go.
pub(crate) type Events = UnboundedSender<Result<TokenEvent, EngineError>>;

/// A request being served.
pub(crate) struct Sequence {
    pub priority: i32,
    /// Order of arrival at the step loop (ties between equal priorities).
    pub arrival: u64,
    /// Order of the latest admission (preemption picks the most recent).
    pub admitted: u64,
    /// Prompt then generated tokens.
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    pub max_tokens: usize,
    /// Longest the sequence may grow (the context limit).
    pub max_len: usize,
    /// Tokens whose keys and values are in the cache.
    pub computed: usize,
    /// Tokens to run in the step being planned (0: not in it).
    pub planned: usize,
    pub table: BlockTable,
    pub submitted: Instant,
    pub first_admitted: Option<Instant>,
    /// When it was last preempted, if it waits again after running.
    pub preempted_at: Option<Instant>,
    pub preemptions: u32,
    sampler: Sampler,
    decoder: Decoder,
    eos: Option<u32>,
    held: String,
    first_token: Option<Instant>,
    events: Events,
}

/// How a sequence is set up.
pub(crate) struct NewSequence {
    pub priority: i32,
    pub arrival: u64,
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub max_len: usize,
    pub sampler: Sampler,
    pub eos: Option<u32>,
    pub submitted: Instant,
    pub events: Events,
}

impl Sequence {
    pub fn new(n: NewSequence) -> Sequence {
        Sequence {
            priority: n.priority,
            arrival: n.arrival,
            admitted: 0,
            prompt_len: n.prompt.len(),
            tokens: n.prompt,
            max_tokens: n.max_tokens,
            max_len: n.max_len,
            computed: 0,
            planned: 0,
            table: BlockTable::default(),
            submitted: n.submitted,
            first_admitted: None,
            preempted_at: None,
            preemptions: 0,
            sampler: n.sampler,
            decoder: Decoder::default(),
            eos: n.eos,
            held: String::new(),
            first_token: None,
            events: n.events,
        }
    }

    /// Tokens not yet in the cache.
    pub fn pending(&self) -> usize {
        self.tokens.len() - self.computed
    }

    /// Whether its receiver is gone (the client left).
    pub fn is_abandoned(&self) -> bool {
        self.events.is_closed()
    }

    /// Tokens generated so far.
    pub fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    /// Whether the next token is simply the largest logit (a backend may pick it).
    pub fn is_plain_greedy(&self) -> bool {
        self.sampler.is_plain_greedy()
    }

    /// Samples the next token from `logits`, streams its text, and says
    /// whether the sequence has finished.
    pub fn accept(&mut self, tokenizer: &Tokenizer, logits: &mut [f32]) -> Option<FinishReason> {
        let (id, logprobs) = self.sampler.sample(logits);
        self.push(tokenizer, id, logprobs)
    }

    /// Takes `id`, picked by the backend for a plain greedy sequence, as
    /// [`Sequence::accept`] takes a sampled token.
    pub fn accept_picked(&mut self, tokenizer: &Tokenizer, id: u32) -> Option<FinishReason> {
        self.sampler.record(id);
        self.push(tokenizer, id, None)
    }

    fn push(&mut self, tokenizer: &Tokenizer, id: u32, logprobs: Option<Logprobs>) -> Option<FinishReason> {
        self.tokens.push(id);
        let now = Instant::now();
        self.first_token.get_or_insert(now);
        if (Some(id) == self.eos && !self.sampler.params().ignore_eos)
            || self.sampler.params().stop_token_ids.contains(&id)
        {
            // The stop token's own text is never shown; text held back for a
            // stop string that did not complete is released with it.
            self.decoder.finish(&mut self.held);
            let text = std::mem::take(&mut self.held);
            self.send(Ok(TokenEvent::Token(GeneratedToken { id, text, logprobs })));
            return Some(FinishReason::Stop);
        }
        self.decoder.push(tokenizer, id, &mut self.held);
        let stops = &self.sampler.params().stop;
        let hit = stops.iter().filter_map(|s| self.held.find(s.as_str())).min();
        if let Some(at) = hit {
            self.held.truncate(at);
            let text = std::mem::take(&mut self.held);
            self.send(Ok(TokenEvent::Token(GeneratedToken { id, text, logprobs })));
            return Some(FinishReason::Stop);
        }
        let finished = self.generated() >= self.max_tokens || self.tokens.len() >= self.max_len;
        let text = if finished {
            self.decoder.finish(&mut self.held);
            std::mem::take(&mut self.held)
        } else {
            let keep = held_back(&self.held, stops);
            let text = self.held[..self.held.len() - keep].to_string();
            self.held.drain(..self.held.len() - keep);
            text
        };
        self.send(Ok(TokenEvent::Token(GeneratedToken { id, text, logprobs })));
        finished.then_some(FinishReason::Length)
    }

    /// Sends the final event.
    pub fn finish(self, reason: FinishReason) {
        let now = Instant::now();
        let first = self.first_token.unwrap_or(now);
        let after_first = self.generated().saturating_sub(1).max(1) as u32;
        let timing = Timing {
            queued: self.first_admitted.unwrap_or(now) - self.submitted,
            time_to_first_token: first - self.submitted,
            time_per_output_token: (now - first) / after_first,
            total: now - self.submitted,
            preemptions: self.preemptions,
        };
        let usage = Usage { prompt_tokens: self.prompt_len, completion_tokens: self.generated() };
        self.send(Ok(TokenEvent::Finished(Completion { reason, usage, timing })));
    }

    /// Sends an error as the final event.
    pub fn fail(self, error: EngineError) {
        self.send(Err(error));
    }

    fn send(&self, event: Result<TokenEvent, EngineError>) {
        // A closed receiver is noticed (and the sequence aborted) at the next step.
        let _ = self.events.send(event);
    }
}

/// Bytes at the end of `text` that could still grow into a stop string.
fn held_back(text: &str, stops: &[String]) -> usize {
    let mut keep = 0;
    for s in stops {
        for k in (keep + 1..s.len()).rev() {
            if s.is_char_boundary(k) && text.ends_with(&s[..k]) {
                keep = k;
                break;
            }
        }
    }
    keep
}

#[cfg(test)]
mod tests {
    use super::held_back;

    #[test]
    fn holds_back_only_what_may_start_a_stop_string() {
        let stops = vec!["\n\nUser:".to_string(), "END".to_string()];
        assert_eq!(held_back("hello\n\nUs", &stops), 4);
        assert_eq!(held_back("hello E", &stops), 1);
        assert_eq!(held_back("hello", &stops), 0);
    }
}
