//! Load figures the step loop publishes and any thread reads: queue depth,
//! running sequences, KV usage, throughput, step time, preemptions.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crate::kv::KvLayout;

/// A snapshot of the engine's load.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct EngineStats {
    /// Requests waiting to be admitted (preempted ones included).
    pub queue_depth: usize,
    /// Prompt tokens of the requests waiting to be admitted (preempted ones excluded).
    pub queued_tokens: usize,
    /// Sequences admitted and not finished.
    pub running: usize,
    /// KV blocks in use.
    pub kv_used_blocks: usize,
    /// KV blocks free.
    pub kv_free_blocks: usize,
    /// Bytes of one KV block.
    pub kv_block_bytes: usize,
    /// Token positions of one KV block.
    pub kv_block_size: usize,
    /// Used fraction of the KV cache, 0 to 1.
    pub kv_usage: f32,
    /// Prompt tokens processed per second, over the last few seconds.
    pub prefill_tokens_per_s: f64,
    /// Tokens generated per second, over the last few seconds.
    pub decode_tokens_per_s: f64,
    /// Duration of the last step.
    pub step_time: Duration,
    /// Steps run.
    pub steps: u64,
    /// Preemptions so far.
    pub preemptions: u64,
    /// Tokens generated so far.
    pub generated_tokens: u64,
    /// Sequences admitted for the first time so far.
    pub sequences_started: u64,
    /// Time since the engine last showed progress: a step that ran tokens
    /// or moved sequences, or work arriving at an idle engine, whichever is
    /// later. With work held, a long one is evidence of a stall.
    pub since_progress: Duration,
    /// A step is running now (its sequences may already have left the queue).
    pub stepping: bool,
}

/// Window over which tokens/s figures are averaged.
const RATE_WINDOW: Duration = Duration::from_secs(5);

/// The atomics behind [`EngineStats`].
pub(crate) struct SharedStats {
    layout: KvLayout,
    preempted_waiting: AtomicUsize,
    running: AtomicUsize,
    kv_used: AtomicUsize,
    prefill_tps: AtomicU64,
    decode_tps: AtomicU64,
    step_ns: AtomicU64,
    steps: AtomicU64,
    preemptions: AtomicU64,
    generated: AtomicU64,
    started: AtomicU64,
    /// When the stats were created; `progress` counts nanoseconds from it.
    epoch: Instant,
    progress: AtomicU64,
    stepping: AtomicBool,
}

/// What the step loop reports after a step.
pub(crate) struct StepReport {
    pub preempted_waiting: usize,
    pub running: usize,
    pub kv_used: usize,
    pub prefill_tokens: u64,
    pub decode_tokens: u64,
    pub preemptions: u64,
    pub started: u64,
    pub elapsed: Duration,
}

impl SharedStats {
    pub fn new(layout: KvLayout) -> SharedStats {
        SharedStats {
            layout,
            preempted_waiting: AtomicUsize::new(0),
            running: AtomicUsize::new(0),
            kv_used: AtomicUsize::new(0),
            prefill_tps: AtomicU64::new(0),
            decode_tps: AtomicU64::new(0),
            step_ns: AtomicU64::new(0),
            steps: AtomicU64::new(0),
            preemptions: AtomicU64::new(0),
            generated: AtomicU64::new(0),
            started: AtomicU64::new(0),
            epoch: Instant::now(),
            progress: AtomicU64::new(0),
            stepping: AtomicBool::new(false),
        }
    }

    /// Marks progress now (a step ended, or work arrived while idle).
    fn progressed(&self) {
        let now = self.epoch.elapsed().as_nanos() as u64;
        self.progress.fetch_max(now, Ordering::Relaxed);
    }

    /// A step is about to run its batch.
    pub fn step_started(&self) {
        self.stepping.store(true, Ordering::Relaxed);
    }

    /// Work arrived: a stall is measured from now at the earliest.
    pub fn work_arrived(&self) {
        if self.running.load(Ordering::Relaxed) == 0 && self.preempted_waiting.load(Ordering::Relaxed) == 0 {
            self.progressed();
        }
    }

    pub fn snapshot(&self, queued_requests: usize, queued_tokens: usize) -> EngineStats {
        let used = self.kv_used.load(Ordering::Relaxed);
        let total = self.layout.num_blocks;
        EngineStats {
            queue_depth: queued_requests + self.preempted_waiting.load(Ordering::Relaxed),
            queued_tokens,
            running: self.running.load(Ordering::Relaxed),
            kv_used_blocks: used,
            kv_free_blocks: total - used.min(total),
            kv_block_bytes: self.layout.block_bytes,
            kv_block_size: self.layout.block_size,
            kv_usage: used as f32 / total.max(1) as f32,
            prefill_tokens_per_s: f64::from_bits(self.prefill_tps.load(Ordering::Relaxed)),
            decode_tokens_per_s: f64::from_bits(self.decode_tps.load(Ordering::Relaxed)),
            step_time: Duration::from_nanos(self.step_ns.load(Ordering::Relaxed)),
            steps: self.steps.load(Ordering::Relaxed),
            preemptions: self.preemptions.load(Ordering::Relaxed),
            generated_tokens: self.generated.load(Ordering::Relaxed),
            sequences_started: self.started.load(Ordering::Relaxed),
            since_progress: self
                .epoch
                .elapsed()
                .saturating_sub(Duration::from_nanos(self.progress.load(Ordering::Relaxed))),
            stepping: self.stepping.load(Ordering::Relaxed),
        }
    }
}

/// Step history for the tokens/s figures; owned by the step loop.
#[derive(Default)]
pub(crate) struct RateWindow {
    steps: VecDeque<(Instant, u64, u64)>,
}

impl RateWindow {
    /// Records a step and publishes everything in `r`.
    pub fn publish(&mut self, shared: &SharedStats, r: StepReport) {
        let now = Instant::now();
        self.steps.push_back((now, r.prefill_tokens, r.decode_tokens));
        while self.steps.front().is_some_and(|s| now - s.0 > RATE_WINDOW) {
            self.steps.pop_front();
        }
        let span = self.steps.front().map_or(Duration::ZERO, |s| now - s.0) + r.elapsed;
        let (p, d) = self.steps.iter().fold((0, 0), |a, s| (a.0 + s.1, a.1 + s.2));
        let secs = span.as_secs_f64().max(1e-6);
        let o = Ordering::Relaxed;
        shared.prefill_tps.store((p as f64 / secs).to_bits(), o);
        shared.decode_tps.store((d as f64 / secs).to_bits(), o);
        shared.preempted_waiting.store(r.preempted_waiting, o);
        shared.running.store(r.running, o);
        shared.kv_used.store(r.kv_used, o);
        shared.step_ns.store(r.elapsed.as_nanos() as u64, o);
        shared.steps.fetch_add(1, o);
        shared.preemptions.fetch_add(r.preemptions, o);
        shared.generated.fetch_add(r.decode_tokens, o);
        shared.started.fetch_add(r.started, o);
        shared.stepping.store(false, o);
        // A step that could run nothing is no progress.
        if r.prefill_tokens + r.decode_tokens + r.started + r.preemptions > 0 {
            shared.progressed();
        }
    }

    /// Publishes an idle engine (no steps running).
    pub fn idle(&mut self, shared: &SharedStats) {
        self.steps.clear();
        shared.prefill_tps.store(0f64.to_bits(), Ordering::Relaxed);
        shared.decode_tps.store(0f64.to_bits(), Ordering::Relaxed);
    }
}
