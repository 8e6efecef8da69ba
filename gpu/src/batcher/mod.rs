//! The continuous batching loop: the engine's actor. It owns the backend,
//! the block pool and every sequence; each step it takes in new requests,
//! drops abandoned and timed-out ones, plans the step (see [`schedule`]),
//! runs it, streams the sampled tokens and retires finished sequences.

mod schedule;
mod sequence;

use std::sync::Arc;
use std::sync::mpsc::{Receiver, RecvTimeoutError, TryRecvError};
use std::time::{Duration, Instant, SystemTime};

use self::schedule::{Scheduler, Waiting};
use self::sequence::{Events, NewSequence, Sequence};
use crate::backend::{Backend, SeqChunk, StepBatch};
use crate::engine::{EngineConfig, EngineError, Shared};
use crate::kv::{BlockPool, KvLayout};
use crate::model::Tokenizer;
use crate::request::GenerationRequest;
use crate::sampling::Sampler;
use crate::stats::{RateWindow, StepReport};

/// A request on its way to the loop.
pub(crate) struct Submitted {
    pub id: u64,
    pub request: GenerationRequest,
    pub events: Events,
    pub at: Instant,
}

/// Messages to the loop.
pub(crate) enum Command {
    Submit(Box<Submitted>),
    /// Fail everything in flight with `Aborted` and stop.
    Shutdown,
}

/// The step loop's state.
pub(crate) struct Batcher {
    backend: Box<dyn Backend>,
    config: EngineConfig,
    layout: KvLayout,
    tokenizer: Arc<Tokenizer>,
    shared: Arc<Shared>,
    max_len: usize,
    vocab: usize,
    pool: BlockPool,
    running: Vec<Sequence>,
    waiting: Waiting,
    arrivals: u64,
    admissions: u64,
    logits: Vec<f32>,
    /// Tokens the backend picked, for steps where every sequence is plain greedy.
    picked: Vec<u32>,
    rates: RateWindow,
    seed_base: u64,
}

impl Batcher {
    pub fn new(
        backend: Box<dyn Backend>,
        config: EngineConfig,
        layout: KvLayout,
        tokenizer: Arc<Tokenizer>,
        shared: Arc<Shared>,
        vocab: usize,
        max_len: usize,
    ) -> Batcher {
        let seed_base = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
        Batcher {
            backend,
            max_len,
            config,
            layout,
            tokenizer,
            shared,
            vocab,
            pool: BlockPool::new(layout.num_blocks),
            running: Vec::new(),
            waiting: Waiting::new(),
            arrivals: 0,
            admissions: 0,
            logits: Vec::new(),
            picked: Vec::new(),
            rates: RateWindow::default(),
            seed_base,
        }
    }

    /// Runs until every handle is dropped and no work is left.
    pub fn run(mut self, rx: Receiver<Command>) {
        let mut connected = true;
        loop {
            if self.running.is_empty() && self.waiting.is_empty() {
                self.rates.idle(&self.shared.stats);
                if !connected {
                    return;
                }
                let keep_going = rx.recv().is_ok_and(|cmd| self.take(cmd));
                if !keep_going {
                    return;
                }
            }
            while connected {
                match rx.try_recv() {
                    Ok(cmd) => {
                        if !self.take(cmd) {
                            return;
                        }
                    }
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => connected = false,
                }
            }
            self.drop_abandoned();
            self.expire_waiting();
            if !self.step() {
                // Nothing could run (only waiting requests that do not fit
                // yet): wait for news instead of spinning.
                match rx.recv_timeout(Duration::from_millis(5)) {
                    Ok(cmd) => {
                        if !self.take(cmd) {
                            return;
                        }
                    }
                    Err(RecvTimeoutError::Timeout) => {}
                    Err(RecvTimeoutError::Disconnected) => connected = false,
                }
            }
        }
    }

    /// Takes in a command; returns `false` when the loop must stop.
    fn take(&mut self, cmd: Command) -> bool {
        let s = match cmd {
            Command::Submit(s) => s,
            Command::Shutdown => {
                self.abort_all();
                return false;
            }
        };
        self.arrivals += 1;
        let Submitted { id, request, events, at } = *s;
        let max_len = self.max_len;
        let sampler = Sampler::new(request.sampling, &request.prompt, self.seed_base ^ id.wrapping_mul(0x9e37_79b9));
        let seq = Sequence::new(NewSequence {
            priority: request.priority,
            arrival: self.arrivals,
            prompt: request.prompt,
            max_tokens: request.max_tokens,
            max_len,
            sampler,
            eos: self.tokenizer.eos(),
            submitted: at,
            events,
        });
        self.waiting.insert((seq.priority, seq.arrival), seq);
        true
    }

    fn abort_all(&mut self) {
        for mut s in std::mem::take(&mut self.running) {
            s.table.release(&mut self.pool);
            s.fail(EngineError::Aborted("the engine is shutting down".into()));
        }
        for (_, s) in std::mem::take(&mut self.waiting) {
            if s.first_admitted.is_none() {
                self.shared.dequeue(s.prompt_len);
            }
            s.fail(EngineError::Aborted("the engine is shutting down".into()));
        }
        self.rates.idle(&self.shared.stats);
    }

    /// Aborts sequences whose client has gone, freeing their blocks.
    fn drop_abandoned(&mut self) {
        let pool = &mut self.pool;
        self.running.retain_mut(|s| {
            let gone = s.is_abandoned();
            if gone {
                s.table.release(pool);
            }
            !gone
        });
        let shared = &self.shared;
        self.waiting.retain(|_, s| {
            let gone = s.is_abandoned();
            if gone && s.first_admitted.is_none() {
                shared.dequeue(s.prompt_len);
            }
            !gone
        });
    }

    /// Fails requests that waited too long: for their first admission, or,
    /// once preempted, to run again (higher-priority work may keep a
    /// preempted sequence waiting; its client gets an error, not silence).
    fn expire_waiting(&mut self) {
        let limit = self.config.queue_timeout;
        let now = Instant::now();
        let since = |s: &Sequence| match (s.first_admitted, s.preempted_at) {
            (None, _) => Some(s.submitted),
            (Some(_), preempted) => preempted,
        };
        let expired: Vec<(i32, u64)> =
            self.waiting.iter().filter(|(_, s)| since(s).is_some_and(|t| now - t > limit)).map(|(k, _)| *k).collect();
        for key in expired {
            if let Some(s) = self.waiting.remove(&key) {
                if s.first_admitted.is_none() {
                    self.shared.dequeue(s.prompt_len);
                }
                let waited = since(&s).map_or(Duration::ZERO, |t| now - t);
                s.fail(EngineError::QueueTimeout { waited, limit });
            }
        }
    }

    /// Plans and runs one step; returns whether any token ran.
    fn step(&mut self) -> bool {
        let started = Instant::now();
        let scheduled = Scheduler {
            config: &self.config,
            layout: &self.layout,
            pool: &mut self.pool,
            running: &mut self.running,
            waiting: &mut self.waiting,
            admissions: &mut self.admissions,
        }
        .plan();
        for s in &self.running {
            if s.first_admitted.is_some_and(|t| t >= started) {
                self.shared.dequeue(s.prompt_len);
            }
        }
        let mut prefill_tokens = 0u64;
        let batch = StepBatch {
            seqs: self
                .running
                .iter()
                .filter(|s| s.planned > 0)
                .map(|s| {
                    let end = s.computed + s.planned;
                    if s.computed < s.tokens.len() - 1 || s.generated() == 0 {
                        prefill_tokens += s.planned as u64;
                    }
                    SeqChunk {
                        tokens: &s.tokens[s.computed..end],
                        start_pos: s.computed,
                        block_table: s.table.blocks(),
                        wants_logits: end == s.tokens.len(),
                    }
                })
                .collect(),
        };
        if batch.seqs.is_empty() {
            self.publish(started, scheduled.preemptions, scheduled.started, 0, 0);
            return false;
        }
        self.shared.stats.step_started();
        // Only token ids need come back when every sequence sampling this step is plain greedy.
        let greedy = self.backend.has_device_greedy()
            && self
                .running
                .iter()
                .filter(|s| s.planned > 0 && s.computed + s.planned == s.tokens.len())
                .all(|s| s.is_plain_greedy());
        let result = if greedy {
            self.backend.forward_greedy(&batch, &mut self.picked)
        } else {
            self.backend.forward(&batch, &mut self.logits)
        };
        drop(batch);
        if let Err(e) = result {
            let message = e.to_string();
            for mut s in std::mem::take(&mut self.running) {
                s.table.release(&mut self.pool);
                s.fail(EngineError::Backend(message.clone()));
            }
            self.publish(started, scheduled.preemptions, scheduled.started, 0, 0);
            return true;
        }
        let mut row = 0;
        let mut sampled = 0u64;
        let mut i = 0;
        while i < self.running.len() {
            let s = &mut self.running[i];
            if s.planned == 0 {
                i += 1;
                continue;
            }
            s.computed += s.planned;
            s.planned = 0;
            if s.computed < s.tokens.len() {
                i += 1;
                continue;
            }
            let finished = if greedy {
                s.accept_picked(&self.tokenizer, self.picked[row])
            } else {
                s.accept(&self.tokenizer, &mut self.logits[row * self.vocab..(row + 1) * self.vocab])
            };
            row += 1;
            sampled += 1;
            match finished {
                Some(reason) => {
                    let mut s = self.running.remove(i);
                    s.table.release(&mut self.pool);
                    s.finish(reason);
                }
                None => i += 1,
            }
        }
        self.publish(started, scheduled.preemptions, scheduled.started, prefill_tokens, sampled);
        true
    }

    fn publish(&mut self, started: Instant, preemptions: u64, admitted: u64, prefill_tokens: u64, decode_tokens: u64) {
        let report = StepReport {
            preempted_waiting: self.waiting.values().filter(|s| s.first_admitted.is_some()).count(),
            running: self.running.len(),
            kv_used: self.pool.used(),
            prefill_tokens,
            decode_tokens,
            preemptions,
            started: admitted,
            elapsed: started.elapsed(),
        };
        self.rates.publish(&self.shared.stats, report);
    }
}
