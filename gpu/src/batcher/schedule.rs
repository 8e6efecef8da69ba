//! Planning one step: which sequences run, how many of their tokens, which
//! waiting requests are admitted, and who is preempted when KV blocks run out.
//!
//! Rules, in order of precedence:
//! - sequences are served by priority (lower value first), then decoding
//!   before prefilling, then by admission order;
//! - a running sequence that needs a block and finds none preempts the
//!   lowest-priority, most recently admitted running sequence (possibly
//!   itself), which frees its blocks and waits to be recomputed;
//! - a waiting request is admitted while the step's token budget, the running
//!   limit and free blocks (above a small watermark) allow; it may preempt
//!   running sequences of strictly lower priority, never equal or higher.

use std::collections::BTreeMap;

use super::sequence::Sequence;
use crate::engine::EngineConfig;
use crate::kv::{BlockPool, KvLayout};

/// Waiting sequences by (priority, arrival).
pub(crate) type Waiting = BTreeMap<(i32, u64), Sequence>;

/// What scheduling changed, for the stats.
#[derive(Debug, Default)]
pub(crate) struct Scheduled {
    pub preemptions: u64,
    pub started: u64,
}

/// Mutable engine state a plan is made over.
pub(crate) struct Scheduler<'a> {
    pub config: &'a EngineConfig,
    pub layout: &'a KvLayout,
    pub pool: &'a mut BlockPool,
    pub running: &'a mut Vec<Sequence>,
    pub waiting: &'a mut Waiting,
    pub admissions: &'a mut u64,
}

impl Scheduler<'_> {
    /// Plans the next step: sets `planned` on every running sequence.
    pub fn plan(mut self) -> Scheduled {
        let mut out = Scheduled::default();
        let mut budget = self.config.max_batch_tokens;
        self.running.sort_by_key(|s| (s.priority, s.pending() > 1, s.admitted));
        let mut i = 0;
        while i < self.running.len() {
            let s = &mut self.running[i];
            s.planned = 0;
            if budget == 0 {
                i += 1;
                continue;
            }
            let n = s.pending().min(budget).min(self.config.prefill_chunk);
            let target = s.computed + n;
            let mut preempted_self = false;
            while !self.running[i].table.reserve(self.layout, self.pool, target) {
                let Some(v) = victim(self.running) else { break };
                budget += self.preempt(v, &mut out);
                if v == i {
                    preempted_self = true;
                    break;
                }
                if v < i {
                    i -= 1;
                }
            }
            if preempted_self {
                continue;
            }
            self.running[i].planned = n;
            budget -= n;
            i += 1;
        }
        self.admit(&mut budget, &mut out);
        out
    }

    fn admit(&mut self, budget: &mut usize, out: &mut Scheduled) {
        // Keep a little room for running sequences to grow; an idle engine admits anything that fits.
        let watermark = self.layout.num_blocks / 100;
        while *budget > 0 && self.running.len() < self.config.max_running {
            let watermark = if self.running.is_empty() { 0 } else { watermark };
            let Some(mut entry) = self.waiting.first_entry() else { break };
            let head = entry.get_mut();
            let n = head.pending().min(*budget).min(self.config.prefill_chunk);
            let needed = head.table.shortfall(self.layout, head.computed + n);
            if self.pool.free() < needed + watermark {
                let priority = head.priority;
                // Preempt only when the lower-priority sequences together
                // free enough: losing their caches for nothing helps no one.
                let reclaimable: usize =
                    self.running.iter().filter(|s| s.priority > priority).map(|s| s.table.blocks().len()).sum();
                if self.pool.free() + reclaimable < needed + watermark {
                    break;
                }
                match victim(self.running) {
                    Some(v) if self.running[v].priority > priority => {
                        *budget += self.preempt(v, out);
                        continue;
                    }
                    _ => break,
                }
            }
            let mut s = entry.remove();
            if !s.table.reserve(self.layout, self.pool, s.computed + n) {
                self.waiting.insert((s.priority, s.arrival), s);
                break;
            }
            if s.first_admitted.is_none() {
                s.first_admitted = Some(std::time::Instant::now());
                out.started += 1;
            }
            s.preempted_at = None;
            *self.admissions += 1;
            s.admitted = *self.admissions;
            s.planned = n;
            *budget -= n;
            self.running.push(s);
        }
    }

    /// Moves running sequence `v` back to waiting, freeing its blocks;
    /// returns the tokens it had planned (refunded to the budget).
    fn preempt(&mut self, v: usize, out: &mut Scheduled) -> usize {
        let mut s = self.running.remove(v);
        let refund = s.planned;
        s.planned = 0;
        s.table.release(self.pool);
        s.computed = 0;
        s.preemptions += 1;
        s.preempted_at = Some(std::time::Instant::now());
        out.preemptions += 1;
        self.waiting.insert((s.priority, s.arrival), s);
        refund
    }
}

/// The running sequence to preempt: lowest priority, then most recently admitted.
fn victim(running: &[Sequence]) -> Option<usize> {
    running.iter().enumerate().max_by_key(|(_, s)| (s.priority, s.admitted)).map(|(i, _)| i)
}
