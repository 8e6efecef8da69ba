//! Unit tests of the autoscaler through the SDK's native harness, driven by
//! recorded signal sequences (one `ScaleSignals` per one-second tick).
//!
//! A recording fixes what the fleet measured (arrivals, queue, latency);
//! the fleet's own fields (replicas, warming, current desired count, time
//! since the last change) come from a small fleet model that follows the
//! plugin's decisions, the way the host and Kubernetes would.

use super::*;
use levee_plugin_sdk::testing::{self, Harness};
use levee_plugin_sdk::{Load, ScaleDecision, ScaleSignals};

/// Completed requests per second of one replica in every recording.
const PER_REPLICA: f32 = 10.0;
const WARMUP_SECS: f32 = 30.0;

/// One tick of a recording: arrivals per second, their trend, and the load.
fn tick(arrival_rate: f32, arrival_trend: f32, queue_depth: u32, queue_trend: f32, p95_ms: f32) -> ScaleSignals {
    let load = Load {
        queue_depth,
        latency_p50_ms: p95_ms / 2.0,
        latency_p95_ms: p95_ms,
        ttft_p95_ms: p95_ms / 10.0,
        ..Load::default()
    };
    ScaleSignals {
        queue_trend,
        arrival_rate,
        arrival_trend,
        throughput_per_replica: PER_REPLICA,
        warmup_secs: WARMUP_SECS,
        ..testing::signals(load)
    }
}

/// Two minutes at 6 req/s with a 5-second burst of 30 req/s at t = 30 s.
fn short_spike() -> Vec<ScaleSignals> {
    (0..120)
        .map(|t| match t {
            30 => tick(30.0, 24.0, 24, 24.0, 9000.0),
            31..=34 => tick(30.0, 0.0, 24 * (t - 29), 24.0, 9000.0),
            35 => tick(6.0, -24.0, 100, -10.0, 9000.0),
            36..=45 => tick(6.0, 0.0, 100 - 10 * (t - 35), -10.0, 6000.0),
            _ => tick(6.0, 0.0, 0, 0.0, 800.0),
        })
        .collect()
}

/// Three minutes of arrivals rising steadily from 6 to 51 req/s (two
/// replicas have 56 s of headroom: a decision needs 15 s, a warm-up 30 s).
fn sustained_ramp() -> Vec<ScaleSignals> {
    (0..180).map(|t| tick(6.0 + 0.25 * t as f32, 0.25, 2, 0.0, 900.0)).collect()
}

/// Fifteen minutes of arrivals falling from 45 to 5 req/s over the first 400 s.
fn slow_decline() -> Vec<ScaleSignals> {
    (0..900)
        .map(|t| {
            let rate = (45.0 - 0.1 * t as f32).max(5.0);
            tick(rate, if t < 400 { -0.1 } else { 0.0 }, 0, 0.0, 700.0)
        })
        .collect()
}

/// The replicas as the host and the orchestrator see them.
struct Fleet {
    ready: u32,
    /// When each warming replica becomes ready (fake clock, ms).
    warming: Vec<u64>,
    desired: u32,
    last_change_ms: u64,
}

/// What happened at one tick.
struct Step {
    at_secs: u64,
    signals: ScaleSignals,
    decision: ScaleDecision,
}

impl Fleet {
    fn new(replicas: u32) -> Self {
        Self { ready: replicas, warming: Vec::new(), desired: replicas, last_change_ms: testing::clock_ms() }
    }

    /// Plays `recording` one second per tick; returns every step.
    fn play(&mut self, plugin: &mut Harness<Autoscale>, recording: &[ScaleSignals]) -> Vec<Step> {
        recording.iter().map(|recorded| self.step(plugin, recorded)).collect()
    }

    fn step(&mut self, plugin: &mut Harness<Autoscale>, recorded: &ScaleSignals) -> Step {
        let now = testing::clock_ms();
        let warmed = self.warming.iter().filter(|&&at| at <= now).count() as u32;
        self.warming.retain(|&at| at > now);
        self.ready += warmed;
        let mut signals = *recorded;
        signals.replicas = self.ready;
        signals.load.replicas = self.ready;
        signals.warming_replicas = self.warming.len() as u32;
        signals.current_desired = self.desired;
        signals.secs_since_change = (now - self.last_change_ms) as f32 / 1000.0;
        let decision = plugin.scale(&signals);
        let desired = decision.desired_replicas;
        if desired > self.desired {
            let ready_at = now + (WARMUP_SECS * 1000.0) as u64;
            self.warming.extend((self.desired..desired).map(|_| ready_at));
        } else if desired < self.desired {
            for _ in desired..self.desired {
                if self.warming.pop().is_none() {
                    self.ready -= 1;
                }
            }
        }
        if desired != self.desired {
            self.desired = desired;
            self.last_change_ms = now;
        }
        testing::advance_clock(1000);
        Step { at_secs: (now - testing::START_MS) / 1000, signals, decision }
    }
}

fn harness(config: &str) -> Harness<Autoscale> {
    Harness::new(config).expect("valid configuration")
}

/// Every decision names its action and the count it keeps or moves to.
fn assert_explained(steps: &[Step]) {
    for step in steps {
        let (from, to) = (step.signals.current_desired, step.decision.desired_replicas);
        let action = match to.cmp(&from) {
            std::cmp::Ordering::Greater => format!("scale up {from} -> {to}: "),
            std::cmp::Ordering::Less => format!("scale down {from} -> {to}: "),
            std::cmp::Ordering::Equal => format!("hold at {to}: "),
        };
        let reason = &step.decision.reason;
        assert!(reason.starts_with(&action) && reason.len() > action.len() + 10, "at {} s: {reason}", step.at_secs);
    }
}

fn changes(steps: &[Step]) -> Vec<&Step> {
    steps.iter().filter(|s| s.decision.desired_replicas != s.signals.current_desired).collect()
}

#[test]
fn a_short_spike_is_absorbed_without_scaling() {
    let mut plugin = harness("{}");
    assert!(plugin.declares(Hook::Scale));
    let steps = Fleet::new(1).play(&mut plugin, &short_spike());
    assert_explained(&steps);
    assert!(changes(&steps).is_empty(), "{:?}", changes(&steps).first().map(|s| &s.decision.reason));
    let during = &steps[33].decision.reason;
    assert!(during.starts_with("hold at 1: pressure for 3 s of the 15 s needed"), "{during}");
    assert!(during.contains("p95 latency 9000 ms > target 5000 ms"), "{during}");
    assert!(steps[60].decision.reason.starts_with("hold at 1: steady"), "{}", steps[60].decision.reason);
    assert_eq!(testing::counter("scale_ups"), 0);
}

#[test]
fn a_sustained_ramp_is_met_ahead_of_time_without_adding_while_warming() {
    let mut plugin = harness("{}");
    let steps = Fleet::new(2).play(&mut plugin, &sustained_ramp());
    assert_explained(&steps);
    let ups = changes(&steps);
    assert!(ups.len() >= 3, "the ramp needs several steps up, got {}", ups.len());
    let first = ups[0];
    assert_eq!(first.at_secs, 15, "after the 15 s stabilization: {}", first.decision.reason);
    // 9.75 req/s now, 21 in 15 + 30 s: three replicas at 8 req/s each (10 × 0.8).
    assert!(first.decision.reason.starts_with("scale up 2 -> 3: arrivals 9."), "{}", first.decision.reason);
    assert!(first.decision.reason.contains("predict 21.0 req/s in 45 s"), "{}", first.decision.reason);
    assert!(first.decision.reason.contains("needs 3"), "{}", first.decision.reason);
    for step in &steps {
        let ready_capacity = step.signals.replicas as f32 * PER_REPLICA;
        assert!(
            step.signals.arrival_rate <= ready_capacity,
            "at {} s {} req/s arrive but {} ready replicas complete {}",
            step.at_secs,
            step.signals.arrival_rate,
            step.signals.replicas,
            ready_capacity
        );
        if step.signals.warming_replicas > 0 {
            assert!(step.decision.desired_replicas <= step.signals.current_desired, "added while warming");
            let reason = &step.decision.reason;
            assert!(reason.contains("still warming") || reason.contains(": steady,"), "{reason}");
        }
    }
    assert_eq!(testing::counter("scale_ups"), ups.len() as u64);
    assert_eq!(testing::gauge("desired_replicas"), Some(f64::from(steps[179].decision.desired_replicas)));
}

#[test]
fn a_slow_decline_scales_down_one_step_per_window_and_cooldown() {
    let config = r#"{"scale-down-stabilization-secs": 60, "scale-down-cooldown-secs": 90, "min-replicas": 2}"#;
    let mut plugin = harness(config);
    let steps = Fleet::new(6).play(&mut plugin, &slow_decline());
    assert_explained(&steps);
    let downs = changes(&steps);
    assert!(downs.len() >= 3, "{} steps down", downs.len());
    let mut last = 0;
    for step in &downs {
        let (from, to) = (step.signals.current_desired, step.decision.desired_replicas);
        assert_eq!(to, from - 1, "one replica at a time: {}", step.decision.reason);
        assert!(step.at_secs >= last + 90, "cooldown between steps: {} s after {} s", step.at_secs, last);
        assert!(step.decision.reason.starts_with(&format!("scale down {from} -> {to}: need at most")));
        // Never below what the arrivals of the moment need at full throughput.
        assert!(to as f32 * PER_REPLICA >= step.signals.arrival_rate, "{}", step.decision.reason);
        last = step.at_secs;
    }
    // The need (6 at 45 req/s) drops to 5 at 50 s; a scale-down waits out the window, then the cooldown.
    assert!(downs[0].at_secs >= 60 + 50, "first step at {} s", downs[0].at_secs);
    assert!(steps.iter().all(|s| s.decision.desired_replicas >= 2), "never below min-replicas");
    assert_eq!(steps[899].decision.desired_replicas, 2);
    let waiting = &steps[downs[0].at_secs as usize + 30].decision.reason;
    assert!(waiting.contains("of the 60 s stabilization window") || waiting.contains("cooldown 90 s"), "{waiting}");
}

#[test]
fn a_ramp_past_max_replicas_stops_at_the_maximum() {
    let mut plugin = harness(r#"{"max-replicas": 4}"#);
    let steps = Fleet::new(2).play(&mut plugin, &sustained_ramp());
    assert_explained(&steps);
    assert!(steps.iter().all(|s| s.decision.desired_replicas <= 4));
    assert_eq!(steps[179].decision.desired_replicas, 4);
    let last = &steps[179].decision.reason;
    assert!(last.starts_with("hold at 4: at max-replicas 4 (arrivals"), "{last}");
}

#[test]
fn bounds_hold_whatever_the_signals_say() {
    let mut plugin = harness(r#"{"min-replicas": 2, "max-replicas": 3, "scale-up-stabilization-secs": 0}"#);
    let mut below = tick(1.0, 0.0, 0, 0.0, 100.0);
    below.current_desired = 1;
    let decision = plugin.scale(&below);
    assert_eq!(decision.desired_replicas, 2);
    assert_eq!(decision.reason, "scale up 1 -> 2: below min-replicas 2");

    let mut above = tick(1.0, 0.0, 0, 0.0, 100.0);
    above.current_desired = 7;
    above.replicas = 7;
    assert_eq!(plugin.scale(&above).desired_replicas, 3);

    let mut flood = tick(500.0, 50.0, 400, 40.0, 60_000.0);
    flood.replicas = 3;
    flood.current_desired = 3;
    let decision = plugin.scale(&flood);
    assert_eq!(decision.desired_replicas, 3);
    assert!(decision.reason.starts_with("hold at 3: at max-replicas 3"), "{}", decision.reason);
}

#[test]
fn latency_or_kv_pressure_adds_one_replica_when_throughput_is_unknown() {
    let mut plugin = harness(r#"{"scale-up-stabilization-secs": 2}"#);
    let mut signals = tick(8.0, 0.0, 30, 3.0, 800.0);
    signals.throughput_per_replica = 0.0;
    signals.load.ttft_p95_ms = 2500.0;
    let decisions: Vec<ScaleDecision> = (0..3)
        .map(|_| {
            let decision = plugin.scale(&signals);
            testing::advance_clock(1000);
            decision
        })
        .collect();
    assert_eq!(decisions[1].desired_replicas, 1, "{}", decisions[1].reason);
    assert_eq!(decisions[2].desired_replicas, 2, "{}", decisions[2].reason);
    assert!(decisions[2].reason.contains("time to first token 2500 ms > target 1000 ms"), "{}", decisions[2].reason);

    // KV usage near the limit is pressure on its own, even with a steady queue.
    let mut full = tick(8.0, 0.0, 0, 0.0, 800.0);
    full.throughput_per_replica = 0.0;
    full.load.kv_usage = 0.95;
    full.current_desired = 2;
    full.replicas = 2;
    let decision = plugin.scale(&full);
    assert!(decision.reason.contains("KV cache 95% used ≥ 90%"), "{}", decision.reason);

    // Without a throughput figure the need is unknown, so nothing is removed.
    let mut quiet = tick(0.0, 0.0, 0, 0.0, 100.0);
    quiet.throughput_per_replica = 0.0;
    quiet.current_desired = 2;
    quiet.replicas = 2;
    assert!(plugin.scale(&quiet).reason.contains("not measured, so no scale-down"));
}

#[test]
fn the_controller_memory_survives_a_new_instance() {
    let mut first = harness("{}");
    let mut signals = tick(6.0, 0.0, 20, 5.0, 9000.0);
    for _ in 0..10 {
        first.scale(&signals);
        testing::advance_clock(1000);
    }
    // A reload replaces the instance; the pressure clock lives in the host.
    let mut second = harness("{}");
    for _ in 0..5 {
        second.scale(&signals);
        testing::advance_clock(1000);
    }
    signals.current_desired = 1;
    let decision = second.scale(&signals);
    assert_eq!(decision.desired_replicas, 2, "{}", decision.reason);
    assert!(decision.reason.ends_with("pressure held 15 s"), "{}", decision.reason);
}

#[test]
fn invalid_configuration_names_the_field_and_the_limit() {
    let error = Harness::<Autoscale>::new(r#"{"min-replicas": 4, "max-replicas": 2}"#).err().expect("refused");
    assert!(error.contains("`max-replicas` must be at least min-replicas (4), got 2"), "{error}");
    let error = Harness::<Autoscale>::new(r#"{"target-utilization": 1.5}"#).err().expect("refused");
    assert!(error.contains("`target-utilization` must be in (0, 1], got 1.5"), "{error}");
    let error = Harness::<Autoscale>::new(r#"{"max-replicas": "many"}"#).err().expect("refused");
    assert!(error.contains("`max-replicas`"), "{error}");
    assert!(Harness::<Autoscale>::new(r#"{"warmup-secs": 30}"#).is_err(), "warm-up comes from the host's signals");
}
