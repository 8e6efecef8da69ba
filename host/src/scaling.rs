//! Scaling out: the scale ticker, the fleet view and the decision.
//!
//! Once per `scaling.interval-ms` the ticker measures this replica (queue,
//! KV, latency percentiles, arrival and completion rates, the capacity seen
//! while saturated) and, with Redis, publishes that report under the fleet
//! hash and reads every other replica's. One replica at a time holds the
//! scaling lease; it builds the fleet-wide scale signals, calls the chain's
//! `scale` hook and publishes the decision, which every replica then serves
//! at `GET /v1/scaling` and as `levee_desired_replicas`. Without Redis (or
//! while it is unreachable) each replica decides for itself from its own
//! load. The leader also runs the optional command actuator.

use crate::config::ScalingConfig;
use crate::plugins::Policies;
use crate::plugins::bindings::{Load, ScaleSignals};
use crate::state::fleet::FleetBoard;
use crate::state::{RedisState, unix_ms};
use crate::telemetry::Telemetry;
use levee_gpu::EngineHandle;
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The load figures a replica reports and the fleet combines: queues and
/// running sequences add up, KV usage and tail latencies take the worst
/// replica, medians the mean.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct LoadFigures {
    /// Requests waiting for the engine.
    pub queue_depth: u32,
    /// Prompt tokens waiting.
    pub queued_tokens: u64,
    /// Sequences running.
    pub running: u32,
    /// KV cache in use, 0–1.
    pub kv_usage: f32,
    /// Median latency over the recent window, ms.
    pub latency_p50_ms: f32,
    /// 95th percentile latency, ms.
    pub latency_p95_ms: f32,
    /// 99th percentile latency, ms.
    pub latency_p99_ms: f32,
    /// Median time to first token, ms.
    pub ttft_p50_ms: f32,
    /// 95th percentile time to first token, ms.
    pub ttft_p95_ms: f32,
    /// Generated tokens per second.
    pub tokens_per_second: f32,
}

impl From<&Load> for LoadFigures {
    fn from(l: &Load) -> Self {
        Self {
            queue_depth: l.queue_depth,
            queued_tokens: l.queued_tokens,
            running: l.running,
            kv_usage: l.kv_usage,
            latency_p50_ms: l.latency_p50_ms,
            latency_p95_ms: l.latency_p95_ms,
            latency_p99_ms: l.latency_p99_ms,
            ttft_p50_ms: l.ttft_p50_ms,
            ttft_p95_ms: l.ttft_p95_ms,
            tokens_per_second: l.tokens_per_second,
        }
    }
}

impl LoadFigures {
    /// The WIT load record of `replicas` replicas.
    pub fn to_wit(&self, replicas: u32) -> Load {
        Load {
            queue_depth: self.queue_depth,
            queued_tokens: self.queued_tokens,
            running: self.running,
            kv_usage: self.kv_usage,
            latency_p50_ms: self.latency_p50_ms,
            latency_p95_ms: self.latency_p95_ms,
            latency_p99_ms: self.latency_p99_ms,
            ttft_p50_ms: self.ttft_p50_ms,
            ttft_p95_ms: self.ttft_p95_ms,
            tokens_per_second: self.tokens_per_second,
            replicas,
        }
    }

    /// The fleet's figures from its replicas' (`serving` counts for the medians).
    fn combine<'a>(all: impl Iterator<Item = &'a LoadFigures> + Clone, serving: &[&LoadFigures]) -> Self {
        let n = serving.len().max(1) as f32;
        let max = |f: fn(&LoadFigures) -> f32| all.clone().map(f).fold(0.0f32, f32::max);
        let mean = |f: fn(&LoadFigures) -> f32| serving.iter().map(|l| f(l)).sum::<f32>() / n;
        Self {
            // Saturating: the figures come from other processes through Redis.
            queue_depth: all.clone().fold(0u32, |a, l| a.saturating_add(l.queue_depth)),
            queued_tokens: all.clone().fold(0, |a, l| a.saturating_add(l.queued_tokens)),
            running: all.clone().fold(0u32, |a, l| a.saturating_add(l.running)),
            kv_usage: max(|l| l.kv_usage),
            latency_p50_ms: mean(|l| l.latency_p50_ms),
            latency_p95_ms: max(|l| l.latency_p95_ms),
            latency_p99_ms: max(|l| l.latency_p99_ms),
            ttft_p50_ms: mean(|l| l.ttft_p50_ms),
            ttft_p95_ms: max(|l| l.ttft_p95_ms),
            tokens_per_second: all.clone().map(|l| l.tokens_per_second).sum(),
        }
    }
}

/// One replica's load as it publishes it for the fleet view.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ReplicaReport {
    /// Who.
    pub replica: String,
    /// When, Unix ms.
    pub at_ms: u64,
    /// Shutting down: not counted as serving.
    pub draining: bool,
    /// Its engine's load.
    #[serde(flatten)]
    pub load: LoadFigures,
    /// Requests arriving per second over the scaling window.
    pub arrival_rate: f32,
    /// Requests completed per second over the scaling window.
    pub completion_rate: f32,
    /// Highest completion rate seen while requests were queued (0 = never saturated).
    pub capacity: f32,
}

/// The scale signals, as JSON for `/v1/scaling` and the fleet.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Signals {
    /// The fleet's load (this replica's alone without Redis).
    #[serde(flatten)]
    pub load: LoadFigures,
    /// Change of the queue depth per second over the window.
    pub queue_trend: f32,
    /// Requests arriving per second, fleet-wide.
    pub arrival_rate: f32,
    /// Change of the arrival rate per second over the window.
    pub arrival_trend: f32,
    /// Measured requests per second one replica completes when saturated (0 = not measured yet).
    pub throughput_per_replica: f32,
    /// Replicas serving.
    pub replicas: u32,
    /// Replicas reported but not ready.
    pub warming_replicas: u32,
    /// Configured warm-up time of a new replica, seconds.
    pub warmup_secs: f32,
    /// The desired count of the previous decision.
    pub current_desired: u32,
    /// Seconds since the desired count last changed.
    pub secs_since_change: f32,
}

impl Signals {
    /// The WIT record the `scale` hook takes.
    pub fn to_wit(&self) -> ScaleSignals {
        ScaleSignals {
            load: self.load.to_wit(self.replicas),
            queue_trend: self.queue_trend,
            arrival_rate: self.arrival_rate,
            arrival_trend: self.arrival_trend,
            throughput_per_replica: self.throughput_per_replica,
            replicas: self.replicas,
            warming_replicas: self.warming_replicas,
            warmup_secs: self.warmup_secs,
            current_desired: self.current_desired,
            secs_since_change: self.secs_since_change,
        }
    }
}

/// The decision every replica serves at `/v1/scaling` (KEDA's metrics-api
/// scaler reads `desiredReplicas`).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Decision {
    /// Replicas the fleet should have.
    pub desired_replicas: u32,
    /// Why, from the plugin.
    pub reason: String,
    /// The plugin that decided, if any owns scaling.
    pub plugin: Option<String>,
    /// The replica that decided.
    pub decided_by: String,
    /// When, Unix ms.
    pub decided_at_ms: u64,
    /// When the desired count last changed, Unix ms.
    pub changed_at_ms: u64,
    /// Sequence number of the decision (one per leader tick).
    pub tick: u64,
    /// Whether the signals are the fleet's (Redis) or this replica's alone.
    pub fleet: bool,
    /// The signals the decision was made on.
    pub signals: Signals,
}

/// Fits a line through `(seconds, value)` samples; its slope per second.
pub fn slope(samples: &[(f64, f64)]) -> f64 {
    let n = samples.len() as f64;
    if samples.len() < 2 {
        return 0.0;
    }
    let (mx, my) = samples.iter().fold((0.0, 0.0), |(x, y), s| (x + s.0 / n, y + s.1 / n));
    let (num, den) =
        samples.iter().fold((0.0, 0.0), |(num, den), s| (num + (s.0 - mx) * (s.1 - my), den + (s.0 - mx) * (s.0 - mx)));
    if den > 0.0 { num / den } else { 0.0 }
}

/// Combines the replicas' reports into fleet signals (draining replicas do
/// not count as serving, but their queues still need draining).
pub fn combine(reports: &[ReplicaReport]) -> Signals {
    let serving: Vec<&ReplicaReport> = reports.iter().filter(|r| !r.draining).collect();
    let serving_load: Vec<&LoadFigures> = serving.iter().map(|r| &r.load).collect();
    let capacities: Vec<f32> = serving.iter().map(|r| r.capacity).filter(|c| *c > 0.0).collect();
    Signals {
        load: LoadFigures::combine(reports.iter().map(|r| &r.load), &serving_load),
        arrival_rate: reports.iter().map(|r| r.arrival_rate).sum(),
        throughput_per_replica: if capacities.is_empty() {
            0.0
        } else {
            capacities.iter().sum::<f32>() / capacities.len() as f32
        },
        replicas: serving.len() as u32,
        ..Signals::default()
    }
}

/// The rates and trends of one replica (or the fleet) over the window.
#[derive(Default)]
struct Rates {
    /// (when, arrivals total, completions total) per tick.
    counts: VecDeque<(Instant, u64, u64)>,
    /// (when, fleet queue depth, fleet arrival rate) per tick.
    trend: VecDeque<(Instant, f64, f64)>,
    /// (when, completion rate) at ticks with requests queued.
    saturated: VecDeque<(Instant, f32)>,
}

/// How long a saturated throughput sample counts as this replica's capacity.
const CAPACITY_MEMORY: Duration = Duration::from_secs(600);

impl Rates {
    fn rate(&mut self, now: Instant, arrivals: u64, completions: u64, window: Duration) -> (f32, f32) {
        self.counts.push_back((now, arrivals, completions));
        while self.counts.len() > 2 && self.counts.front().is_some_and(|c| now.duration_since(c.0) > window) {
            self.counts.pop_front();
        }
        let Some(&(at, a0, c0)) = self.counts.front() else { return (0.0, 0.0) };
        let secs = now.duration_since(at).as_secs_f32();
        if secs <= 0.0 {
            return (0.0, 0.0);
        }
        (arrivals.saturating_sub(a0) as f32 / secs, completions.saturating_sub(c0) as f32 / secs)
    }

    fn capacity(&mut self, now: Instant, queued: bool, completion_rate: f32) -> f32 {
        if queued && completion_rate > 0.0 {
            self.saturated.push_back((now, completion_rate));
        }
        while self.saturated.front().is_some_and(|s| now.duration_since(s.0) > CAPACITY_MEMORY) {
            self.saturated.pop_front();
        }
        self.saturated.iter().map(|s| s.1).fold(0.0, f32::max)
    }

    fn trends(&mut self, now: Instant, queue: f64, arrivals: f64, window: Duration) -> (f32, f32) {
        self.trend.push_back((now, queue, arrivals));
        while self.trend.front().is_some_and(|s| now.duration_since(s.0) > window) {
            self.trend.pop_front();
        }
        let Some(&(first, _, _)) = self.trend.front() else { return (0.0, 0.0) };
        let at = |s: &(Instant, f64, f64)| s.0.duration_since(first).as_secs_f64();
        let queue: Vec<(f64, f64)> = self.trend.iter().map(|s| (at(s), s.1)).collect();
        let arrivals: Vec<(f64, f64)> = self.trend.iter().map(|s| (at(s), s.2)).collect();
        (slope(&queue) as f32, slope(&arrivals) as f32)
    }
}

/// When the actuator last ran, and for which count.
#[derive(Default)]
struct Actuator {
    last_run: Option<Instant>,
    last_count: Option<u32>,
}

/// The scale ticker's state: the latest decision and what produced it.
pub struct Scaler {
    config: ScalingConfig,
    replica: String,
    fleet: Option<FleetBoard>,
    decision: Mutex<Option<Decision>>,
    rates: Mutex<Rates>,
    actuator: Mutex<Actuator>,
    leader: AtomicBool,
    /// Ticks run.
    pub ticks: AtomicU64,
    /// Commands the actuator ran.
    pub actuator_runs: AtomicU64,
    /// Actuator commands that failed (could not start, non-zero exit, timed out).
    pub actuator_failures: Arc<AtomicU64>,
}

/// What the ticker reads from the rest of the server.
pub struct Sources {
    /// The engine, for its stats.
    pub engine: EngineHandle,
    /// Request telemetry (arrivals, completions, percentiles).
    pub telemetry: Arc<Telemetry>,
    /// The chain, for the `scale` hook.
    pub policies: Arc<Policies>,
}

impl Scaler {
    /// A scaler for this replica, sharing the fleet view through `shared` when given.
    pub fn new(config: ScalingConfig, shared: Option<Arc<RedisState>>) -> Self {
        let fleet = shared.map(FleetBoard::new);
        let replica = fleet.as_ref().map(|f| f.replica().to_string()).unwrap_or_else(|| "local".to_string());
        Self {
            config,
            replica,
            fleet,
            decision: Mutex::new(None),
            rates: Mutex::new(Rates::default()),
            actuator: Mutex::new(Actuator::default()),
            leader: AtomicBool::new(false),
            ticks: AtomicU64::new(0),
            actuator_runs: AtomicU64::new(0),
            actuator_failures: Arc::new(AtomicU64::new(0)),
        }
    }

    /// The latest decision, if a tick has made or read one.
    pub fn decision(&self) -> Option<Decision> {
        self.decision.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Whether this replica decided the latest tick.
    pub fn is_leader(&self) -> bool {
        self.leader.load(Ordering::Relaxed)
    }

    /// Runs the ticker. `draining` is read every tick: `Some(true)` while
    /// the server drains, `None` once it is gone (the ticker then stops).
    pub async fn run(self: Arc<Self>, sources: Sources, draining: impl Fn() -> Option<bool> + Send + 'static) {
        let mut interval = tokio::time::interval(Duration::from_millis(self.config.interval_ms));
        interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            interval.tick().await;
            let Some(drain) = draining() else { return };
            self.tick(&sources, drain).await;
        }
    }

    /// This replica's report now.
    fn report(&self, sources: &Sources, draining: bool) -> ReplicaReport {
        let stats = sources.engine.stats();
        let load = sources.telemetry.load(&stats);
        let counters = &sources.telemetry.counters;
        let now = Instant::now();
        let window = Duration::from_secs_f64(self.config.window_secs);
        let mut rates = self.rates.lock().unwrap_or_else(|p| p.into_inner());
        let (arrival_rate, completion_rate) = rates.rate(
            now,
            counters.arrivals.load(Ordering::Relaxed),
            counters.completions.load(Ordering::Relaxed),
            window,
        );
        let capacity = rates.capacity(now, load.queue_depth > 0, completion_rate);
        ReplicaReport {
            replica: self.replica.clone(),
            at_ms: unix_ms(),
            draining,
            load: LoadFigures::from(&load),
            arrival_rate,
            completion_rate,
            capacity,
        }
    }

    /// One tick: measure, share, decide (or read the leader's decision).
    pub async fn tick(&self, sources: &Sources, draining: bool) {
        self.ticks.fetch_add(1, Ordering::Relaxed);
        let report = self.report(sources, draining);
        let fleet = match &self.fleet {
            Some(board) => self.exchange(board, &report, draining).await,
            None => None,
        };
        let (reports, leader, previous) = match fleet {
            Some(view) => (view.reports, view.leader, view.decision),
            None => (vec![report], !draining, self.decision()),
        };
        self.leader.store(leader, Ordering::Relaxed);
        if !leader {
            if let Some(decision) = previous {
                *self.decision.lock().unwrap_or_else(|p| p.into_inner()) = Some(decision);
            }
            return;
        }
        let decision = self.decide(sources, &reports, previous, self.fleet.is_some()).await;
        if let Some(board) = &self.fleet
            && let Ok(json) = serde_json::to_string(&decision)
        {
            board.publish_decision(&json, self.config.interval_ms.saturating_mul(60).max(60_000)).await;
        }
        self.actuate(decision.desired_replicas);
        *self.decision.lock().unwrap_or_else(|p| p.into_inner()) = Some(decision);
    }

    async fn decide(
        &self,
        sources: &Sources,
        reports: &[ReplicaReport],
        previous: Option<Decision>,
        fleet: bool,
    ) -> Decision {
        let mut signals = combine(reports);
        let now = Instant::now();
        let window = Duration::from_secs_f64(self.config.window_secs);
        let (queue_trend, arrival_trend) = self.rates.lock().unwrap_or_else(|p| p.into_inner()).trends(
            now,
            f64::from(signals.load.queue_depth),
            f64::from(signals.arrival_rate),
            window,
        );
        let now_ms = unix_ms();
        let (current, changed_at_ms, tick) = match &previous {
            Some(p) => (p.desired_replicas, p.changed_at_ms, p.tick.saturating_add(1)),
            None => (signals.replicas.max(1), now_ms, 1),
        };
        signals.queue_trend = queue_trend;
        signals.arrival_trend = arrival_trend;
        signals.warmup_secs = self.config.warmup_secs as f32;
        signals.current_desired = current;
        signals.secs_since_change = now_ms.saturating_sub(changed_at_ms) as f32 / 1000.0;
        let chain = sources.policies.snapshot();
        let (desired, reason, plugin) = match chain.scale(&signals.to_wit()).await {
            Some((plugin, decision)) => (decision.desired_replicas, decision.reason, Some(plugin)),
            None => (current, "no scale plugin owns scaling: holding".to_string(), None),
        };
        Decision {
            desired_replicas: desired,
            reason,
            plugin,
            decided_by: self.replica.clone(),
            decided_at_ms: now_ms,
            changed_at_ms: if desired != current { now_ms } else { changed_at_ms },
            tick,
            fleet,
            signals,
        }
    }

    /// Publishes `report`, reads the fleet, takes or renews the lease and
    /// reads the last decision, in one round trip. `None` when Redis is
    /// unreachable (the replica then decides alone).
    async fn exchange(&self, board: &FleetBoard, report: &ReplicaReport, draining: bool) -> Option<FleetView> {
        let json = serde_json::to_string(report).ok()?;
        let exchanged = board.exchange(&json, self.config.interval_ms.saturating_mul(3), draining).await?;
        let now = unix_ms();
        let stale_ms = self.config.interval_ms.saturating_mul(3).max(1000);
        let mut reports = Vec::new();
        let mut stale = Vec::new();
        for (replica, json) in exchanged.reports {
            match serde_json::from_str::<ReplicaReport>(&json) {
                Ok(r) if now.saturating_sub(r.at_ms) <= stale_ms => reports.push(r),
                _ => stale.push(replica),
            }
        }
        reports.sort_by(|a, b| a.replica.cmp(&b.replica));
        if exchanged.leader && !stale.is_empty() {
            board.prune(&stale).await;
        }
        let decision = exchanged.decision.and_then(|d| serde_json::from_str(&d).ok());
        Some(FleetView { reports, leader: exchanged.leader, decision })
    }

    /// Removes this replica from the fleet and gives up the lease (on shutdown).
    pub async fn leave(&self) {
        if let Some(board) = &self.fleet {
            board.leave().await;
        }
    }

    /// Runs the actuator command for `desired` when it changed and the
    /// minimum interval has passed.
    fn actuate(&self, desired: u32) {
        let Some(actuator) = &self.config.actuator else { return };
        let mut state = self.actuator.lock().unwrap_or_else(|p| p.into_inner());
        if state.last_count == Some(desired) {
            return;
        }
        let min_interval = Duration::from_secs_f64(actuator.min_interval_secs);
        if state.last_run.is_some_and(|at| at.elapsed() < min_interval) {
            return;
        }
        state.last_run = Some(Instant::now());
        state.last_count = Some(desired);
        drop(state);
        self.actuator_runs.fetch_add(1, Ordering::Relaxed);
        let count = desired.to_string();
        let args: Vec<String> = actuator.command.iter().map(|a| a.replace("{replicas}", &count)).collect();
        let timeout = Duration::from_secs_f64(actuator.timeout_secs);
        let failed = self.actuator_failures.clone();
        tokio::spawn(async move {
            let Some((program, rest)) = args.split_first() else { return };
            let child = tokio::process::Command::new(program)
                .args(rest)
                .env("LEVEE_DESIRED_REPLICAS", &count)
                .kill_on_drop(true)
                .stdout(std::process::Stdio::null())
                .spawn();
            let outcome = match child {
                Ok(mut child) => match tokio::time::timeout(timeout, child.wait()).await {
                    Ok(Ok(status)) if status.success() => Ok(()),
                    Ok(Ok(status)) => Err(format!("exited with {status}")),
                    Ok(Err(e)) => Err(e.to_string()),
                    Err(_) => Err(format!("did not finish within {} s", timeout.as_secs_f64())),
                },
                Err(e) => Err(format!("cannot start: {e}")),
            };
            match outcome {
                Ok(()) => tracing::info!(replicas = count, "scaling actuator ran"),
                Err(why) => {
                    failed.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(replicas = count, "scaling actuator {program:?} failed: {why}");
                }
            }
        });
    }
}

struct FleetView {
    reports: Vec<ReplicaReport>,
    leader: bool,
    decision: Option<Decision>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slope_of_a_line_and_of_noise() {
        let line: Vec<(f64, f64)> = (0..10).map(|t| (t as f64, 3.0 + 2.0 * t as f64)).collect();
        assert!((slope(&line) - 2.0).abs() < 1e-9);
        assert_eq!(slope(&[(0.0, 5.0)]), 0.0);
        assert_eq!(slope(&[(1.0, 5.0), (1.0, 7.0)]), 0.0);
    }

    #[test]
    fn the_fleet_sums_queues_and_takes_the_worst_latency() {
        let report = |name: &str, queue: u32, p95: f32, draining: bool, capacity: f32| ReplicaReport {
            replica: name.into(),
            load: LoadFigures { queue_depth: queue, latency_p95_ms: p95, ..LoadFigures::default() },
            arrival_rate: 2.0,
            draining,
            capacity,
            ..ReplicaReport::default()
        };
        let signals = combine(&[
            report("a", 3, 900.0, false, 4.0),
            report("b", 5, 1500.0, false, 0.0),
            report("c", 1, 300.0, true, 8.0),
        ]);
        assert_eq!(signals.load.queue_depth, 9);
        assert_eq!(signals.load.latency_p95_ms, 1500.0);
        assert_eq!(signals.replicas, 2, "a draining replica does not count as serving");
        assert_eq!(signals.arrival_rate, 6.0);
        assert_eq!(signals.throughput_per_replica, 4.0, "only measured capacities of serving replicas");
    }

    #[test]
    fn capacity_is_measured_only_while_saturated() {
        let mut rates = Rates::default();
        let t0 = Instant::now();
        assert_eq!(rates.capacity(t0, false, 9.0), 0.0);
        assert_eq!(rates.capacity(t0, true, 4.0), 4.0);
        assert_eq!(rates.capacity(t0 + Duration::from_secs(1), false, 1.0), 4.0);
        assert_eq!(rates.capacity(t0 + CAPACITY_MEMORY + Duration::from_secs(2), false, 1.0), 0.0);
    }
}
