//! Per-plugin counters: calls, faults by kind, latency, shadow decisions and
//! quarantine. They outlive reloads: a plugin's name keeps its history.

use super::bindings::Hook;
use crate::metrics::{HOOK_BUCKETS, Histogram};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

/// Why a plugin call failed. A plugin's decision is never a fault; these are.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Fault {
    /// The guest trapped (panic, unreachable, out-of-bounds access, …).
    #[error("trapped: {0}")]
    Trap(String),
    /// The call ran past its time budget and was cut.
    #[error("ran past its time budget of {0:?}")]
    Deadline(Duration),
    /// The guest tried to grow its memory past the cap.
    #[error("tried to grow its memory past the cap of {0} MiB")]
    OverMemory(u64),
    /// The decision broke the contract (e.g. a reject with status 200).
    #[error("returned a malformed decision: {0}")]
    Malformed(String),
    /// A new instance could not be created or its `init` failed.
    #[error("could not start an instance: {0}")]
    Instantiate(String),
    /// The plugin is quarantined and was not called.
    #[error("is quarantined after repeated faults")]
    Quarantined,
    /// The host had no room for another instance (every plugin's instances
    /// together fill the pooling allocator): not the plugin's doing, so not
    /// counted against it.
    #[error("could not be called: {0}")]
    HostBusy(String),
}

/// Calls over which a plugin's fault rate is judged: half or more faulty quarantines it.
pub const RATE_WINDOW: u32 = 20;

/// Fault kinds that are counted (quarantine is a state, not a fault).
pub const FAULT_KINDS: [&str; 5] = ["trap", "deadline", "over-memory", "malformed", "instantiate"];

impl Fault {
    /// Index into [`FAULT_KINDS`], or `None` for what is not the plugin's
    /// fault ([`Fault::Quarantined`], [`Fault::HostBusy`]).
    pub fn kind(&self) -> Option<usize> {
        match self {
            Fault::Trap(_) => Some(0),
            Fault::Deadline(_) => Some(1),
            Fault::OverMemory(_) => Some(2),
            Fault::Malformed(_) => Some(3),
            Fault::Instantiate(_) => Some(4),
            Fault::Quarantined | Fault::HostBusy(_) => None,
        }
    }
}

/// Counters of one plugin.
pub struct PluginStats {
    calls: [AtomicU64; 6],
    hook_faults: [AtomicU64; 6],
    faults: [AtomicU64; 5],
    latency: [Histogram; 6],
    shadow_overrides: AtomicU64,
    consecutive_faults: AtomicU32,
    /// Outcomes of the last calls, newest in bit 0 (1 = fault), and how many are in.
    recent: std::sync::Mutex<(u64, u32)>,
    quarantined: AtomicBool,
    /// The plugin's log rate and the lines it dropped.
    pub logs: super::logs::LogLimit,
    /// The rate of host warnings about the plugin's faults.
    pub fault_logs: super::logs::LogLimit,
    /// Time its calls spent in the embedding model, microseconds.
    host_wait_us: AtomicU64,
}

impl Default for PluginStats {
    fn default() -> Self {
        Self {
            calls: Default::default(),
            hook_faults: Default::default(),
            faults: Default::default(),
            latency: std::array::from_fn(|_| Histogram::new(HOOK_BUCKETS)),
            shadow_overrides: AtomicU64::new(0),
            consecutive_faults: AtomicU32::new(0),
            recent: std::sync::Mutex::new((0, 0)),
            quarantined: AtomicBool::new(false),
            logs: Default::default(),
            fault_logs: super::logs::LogLimit::with_rate(5.0),
            host_wait_us: AtomicU64::new(0),
        }
    }
}

impl PluginStats {
    /// Records one call of `hook` that took `elapsed`. Returns true when this
    /// fault tipped the plugin into quarantine (never unless `may_quarantine`).
    /// The plugin is quarantined after `quarantine_after` faults in a row,
    /// or when half or more of its last [`RATE_WINDOW`] calls faulted (a
    /// plugin that faults every other call never has a long run).
    pub fn record(
        &self,
        hook: Hook,
        elapsed: Duration,
        fault: Option<&Fault>,
        quarantine_after: u32,
        may_quarantine: bool,
    ) -> bool {
        let h = hook.index();
        self.calls[h].fetch_add(1, Ordering::Relaxed);
        self.latency[h].observe(elapsed.as_secs_f64());
        let kind = fault.and_then(Fault::kind);
        // One lock for the window and the verdict, so that a lift of the
        // quarantine is never undone by a call judged just before it.
        let mut recent = self.recent.lock().unwrap_or_else(|p| p.into_inner());
        let mask = (1u64 << RATE_WINDOW) - 1;
        recent.0 = ((recent.0 << 1) | u64::from(kind.is_some())) & mask;
        recent.1 = (recent.1 + 1).min(RATE_WINDOW);
        let faulty_share = recent.1 == RATE_WINDOW && recent.0.count_ones() * 2 >= RATE_WINDOW;
        match kind {
            None => {
                self.consecutive_faults.store(0, Ordering::Relaxed);
                false
            }
            Some(kind) => {
                self.hook_faults[h].fetch_add(1, Ordering::Relaxed);
                self.faults[kind].fetch_add(1, Ordering::Relaxed);
                let run = self.consecutive_faults.fetch_add(1, Ordering::Relaxed) + 1;
                may_quarantine
                    && (run >= quarantine_after || faulty_share)
                    && !self.quarantined.swap(true, Ordering::Relaxed)
            }
        }
    }

    /// Counts a fault of making an instance in the background (no call was made).
    pub fn record_instance_fault(&self, fault: &Fault, _elapsed: Duration) {
        if let Some(kind) = fault.kind() {
            self.faults[kind].fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Counts time a call spent in a host capability that is not charged to its budget (the embedding model).
    pub fn record_host_wait(&self, waited: Duration) {
        self.host_wait_us.fetch_add(waited.as_micros() as u64, Ordering::Relaxed);
    }

    /// Time calls spent in host capabilities not charged to their budgets.
    pub fn host_wait(&self) -> Duration {
        Duration::from_micros(self.host_wait_us.load(Ordering::Relaxed))
    }

    /// Counts a shadow-mode decision that would have changed the outcome.
    pub fn record_shadow_override(&self) {
        self.shadow_overrides.fetch_add(1, Ordering::Relaxed);
    }

    /// Lifts quarantine (a new version was loaded, or an operator said so)
    /// and forgets the recent faults; returns whether it was quarantined.
    pub fn reset_quarantine(&self) -> bool {
        let mut recent = self.recent.lock().unwrap_or_else(|p| p.into_inner());
        *recent = (0, 0);
        self.consecutive_faults.store(0, Ordering::Relaxed);
        self.quarantined.swap(false, Ordering::Relaxed)
    }

    /// Whether the plugin is quarantined.
    pub fn quarantined(&self) -> bool {
        self.quarantined.load(Ordering::Relaxed)
    }

    /// Calls of `hook`.
    pub fn calls(&self, hook: Hook) -> u64 {
        self.calls[hook.index()].load(Ordering::Relaxed)
    }

    /// Calls over all hooks.
    pub fn total_calls(&self) -> u64 {
        self.calls.iter().map(|c| c.load(Ordering::Relaxed)).sum()
    }

    /// Faults of `hook`.
    pub fn hook_faults(&self, hook: Hook) -> u64 {
        self.hook_faults[hook.index()].load(Ordering::Relaxed)
    }

    /// Faults by kind, in [`FAULT_KINDS`] order.
    pub fn faults_by_kind(&self) -> [u64; 5] {
        std::array::from_fn(|i| self.faults[i].load(Ordering::Relaxed))
    }

    /// Faults over all kinds.
    pub fn total_faults(&self) -> u64 {
        self.faults_by_kind().iter().sum()
    }

    /// Shadow decisions that were not applied.
    pub fn shadow_overrides(&self) -> u64 {
        self.shadow_overrides.load(Ordering::Relaxed)
    }

    /// Latency histogram of `hook`.
    pub fn latency(&self, hook: Hook) -> &Histogram {
        &self.latency[hook.index()]
    }
}
