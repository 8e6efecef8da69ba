//! The scaling decision of one tick, as a pure function of the
//! configuration, the fleet's signals, what the controller remembers from
//! earlier ticks and the time. `plugins/README.md` describes the same steps
//! for operators with the same numbering; keep the two in agreement.

use crate::settings::Config;
use levee_plugin_sdk::{ScaleDecision, ScaleSignals};
use serde::{Deserialize, Serialize};

/// What the controller carries from one tick to the next.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Memory {
    /// When the current run of pressure began (host ms), while under pressure.
    pub pressure_since_ms: Option<u64>,
    /// When the need first fell below the desired count, while it stays there.
    pub low_since_ms: Option<u64>,
    /// The highest need seen since `low_since_ms`.
    pub low_peak: u32,
}

/// A tick's result: the decision, what to remember, and figures to export.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// The answer for the host.
    pub decision: ScaleDecision,
    /// Memory for the next tick.
    pub memory: Memory,
    /// Replicas the predicted arrivals need, when throughput is known.
    pub needed: Option<u32>,
    /// Arrivals predicted one warm-up and one stabilization time ahead, req/s.
    pub predicted_rate: f64,
}

/// Decides the desired replica count for one tick.
pub fn decide(config: &Config, signals: &ScaleSignals, memory: &Memory, now_ms: u64) -> Outcome {
    let (min, max) = (config.min_replicas, config.max_replicas);
    let current = if signals.current_desired > 0 { signals.current_desired } else { signals.replicas.max(1) };
    let demand = Demand::new(config, signals);
    let outcome = |desired: u32, reason: String, memory: Memory| Outcome {
        decision: ScaleDecision { desired_replicas: desired, reason },
        memory,
        needed: demand.needed,
        predicted_rate: demand.predicted,
    };

    // 1. Bounds first.
    if current < min {
        return outcome(min, format!("scale up {current} -> {min}: below min-replicas {min}"), Memory::default());
    }
    if current > max {
        return outcome(max, format!("scale down {current} -> {max}: above max-replicas {max}"), Memory::default());
    }

    // 2. Pressure: any reason to add replicas.
    let mut pressure = Vec::new();
    let queue_growing = finite(signals.queue_trend) > 0.0;
    let load = &signals.load;
    if queue_growing && finite(load.latency_p95_ms) > config.target_latency_p95_ms {
        pressure.push(format!(
            "queue growing {:+.1}/s and p95 latency {:.0} ms > target {:.0} ms",
            signals.queue_trend, load.latency_p95_ms, config.target_latency_p95_ms
        ));
    }
    if queue_growing && finite(load.ttft_p95_ms) > config.target_ttft_p95_ms {
        pressure.push(format!(
            "queue growing {:+.1}/s and p95 time to first token {:.0} ms > target {:.0} ms",
            signals.queue_trend, load.ttft_p95_ms, config.target_ttft_p95_ms
        ));
    }
    if finite(load.kv_usage) >= config.max_kv_usage {
        pressure.push(format!("KV cache {:.0}% used ≥ {:.0}%", load.kv_usage * 100.0, config.max_kv_usage * 100.0));
    }
    let overloaded = !pressure.is_empty();
    if let Some(needed) = demand.needed
        && needed > current
    {
        pressure.push(demand.explain());
    }

    if !pressure.is_empty() {
        let why = pressure.join("; ");
        let since = memory.pressure_since_ms.unwrap_or(now_ms);
        let held = now_ms.saturating_sub(since) as f64 / 1000.0;
        let waiting = Memory { pressure_since_ms: Some(since), low_since_ms: None, low_peak: 0 };
        // 2.1 Replicas already on their way count as added.
        let ready_or_warming = signals.replicas.saturating_add(signals.warming_replicas);
        let in_flight = signals.warming_replicas.saturating_add(current.saturating_sub(ready_or_warming));
        if in_flight > 0 {
            let reason =
                format!("hold at {current}: {in_flight} replica(s) still warming, adding none until ready ({why})");
            return outcome(current, reason, waiting);
        }
        // 2.2 Pressure must last: a short spike is absorbed by the queue.
        if held < config.scale_up_stabilization_secs {
            let reason = format!(
                "hold at {current}: pressure for {held:.0} s of the {:.0} s needed to scale up ({why})",
                config.scale_up_stabilization_secs
            );
            return outcome(current, reason, waiting);
        }
        // 2.3 Size the step from the predicted need; overload adds at least one.
        let mut target = demand.needed.unwrap_or(current);
        if overloaded {
            target = target.max(current.saturating_add(1));
        }
        if config.max_scale_up_step > 0 {
            target = target.min(current.saturating_add(config.max_scale_up_step));
        }
        let target = target.min(max);
        if target <= current {
            return outcome(current, format!("hold at {current}: at max-replicas {max} ({why})"), waiting);
        }
        let reason = format!("scale up {current} -> {target}: {why}; pressure held {held:.0} s");
        return outcome(target, reason, Memory::default());
    }

    // 3. No pressure: maybe fewer replicas, slowly (3.1 to 3.3).
    let Some(needed) = demand.needed else {
        let reason = format!("hold at {current}: no pressure; throughput per replica not measured, so no scale-down");
        return outcome(current, reason, Memory::default());
    };
    if needed >= current {
        let reason = if current == max && demand.beyond_max() {
            format!("hold at {current}: at max-replicas {max} ({})", demand.explain())
        } else {
            format!("hold at {current}: steady, {}", demand.explain())
        };
        return outcome(current, reason, Memory::default());
    }
    let since = memory.low_since_ms.unwrap_or(now_ms);
    let peak = if memory.low_since_ms.is_some() { memory.low_peak.max(needed) } else { needed };
    let low_for = now_ms.saturating_sub(since) as f64 / 1000.0;
    let low = Memory { pressure_since_ms: None, low_since_ms: Some(since), low_peak: peak };
    if low_for < config.scale_down_stabilization_secs {
        let reason = format!(
            "hold at {current}: need at most {peak} for {low_for:.0} s of the {:.0} s stabilization window ({})",
            config.scale_down_stabilization_secs,
            demand.explain()
        );
        return outcome(current, reason, low);
    }
    let since_change = finite(signals.secs_since_change);
    if since_change < config.scale_down_cooldown_secs {
        let reason = format!(
            "hold at {current}: need at most {peak} for {low_for:.0} s, but the last change was {since_change:.0} s \
             ago (cooldown {:.0} s)",
            config.scale_down_cooldown_secs
        );
        return outcome(current, reason, low);
    }
    let target = peak.max(current.saturating_sub(config.max_scale_down_step)).max(min);
    let reason = format!(
        "scale down {current} -> {target}: need at most {peak} for {low_for:.0} s (window {:.0} s), last change \
         {since_change:.0} s ago (cooldown {:.0} s), at most {} fewer per step",
        config.scale_down_stabilization_secs, config.scale_down_cooldown_secs, config.max_scale_down_step
    );
    outcome(target, reason, Memory::default())
}

/// The predicted arrival rate and the replicas it needs.
struct Demand {
    rate: f64,
    trend: f64,
    horizon: f64,
    predicted: f64,
    capacity: Option<f64>,
    utilization: f64,
    /// Replicas the prediction needs before the bounds apply.
    unbounded: Option<f64>,
    /// The same, within `[min, max]`.
    needed: Option<u32>,
    bounds: (u32, u32),
}

impl Demand {
    fn new(config: &Config, signals: &ScaleSignals) -> Self {
        let rate = finite(signals.arrival_rate).max(0.0);
        let trend = finite(signals.arrival_trend);
        // A replica ordered when pressure first shows serves after the
        // stabilization time and its warm-up: plan for the rate then, never
        // for less than now.
        let horizon = finite(signals.warmup_secs).max(0.0) + config.scale_up_stabilization_secs;
        let predicted = (rate + trend * horizon).max(rate);
        let measured = finite(signals.throughput_per_replica);
        let capacity = if measured > 0.0 {
            Some(measured)
        } else {
            (config.replica_throughput > 0.0).then_some(config.replica_throughput)
        };
        let bounds = (config.min_replicas, config.max_replicas);
        let unbounded = capacity.map(|c| (predicted / (c * config.target_utilization)).ceil());
        let needed = unbounded.map(|n| (n.min(f64::from(u32::MAX)) as u32).clamp(bounds.0, bounds.1));
        Self {
            rate,
            trend,
            horizon,
            predicted,
            capacity,
            utilization: config.target_utilization,
            unbounded,
            needed,
            bounds,
        }
    }

    /// Whether the prediction needs more than `max-replicas`.
    fn beyond_max(&self) -> bool {
        self.unbounded.is_some_and(|n| n > f64::from(self.bounds.1))
    }

    fn explain(&self) -> String {
        let unbounded = self.unbounded.unwrap_or(0.0);
        let bound = if unbounded > f64::from(self.bounds.1) {
            format!(", capped at max-replicas {}", self.bounds.1)
        } else if unbounded < f64::from(self.bounds.0) {
            format!(", raised to min-replicas {}", self.bounds.0)
        } else {
            String::new()
        };
        format!(
            "arrivals {:.1} req/s, trend {:+.2}/s, predict {:.1} req/s in {:.0} s; at {:.1} req/s per replica × {:.2} \
             utilization that needs {unbounded:.0}{bound}",
            self.rate,
            self.trend,
            self.predicted,
            self.horizon,
            self.capacity.unwrap_or(0.0),
            self.utilization,
        )
    }
}

/// A signal as f64; one that is not a finite number counts as 0.
fn finite(value: f32) -> f64 {
    if value.is_finite() { f64::from(value) } else { 0.0 }
}
