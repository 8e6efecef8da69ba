//! The autoscaler's configuration: bounds, targets and the time windows of
//! the controller, with their defaults and limits.

use crate::config_json::invalid;
use serde::Deserialize;

const PLUGIN: &str = "autoscale";

/// The plugin's configuration (its `[plugins.config]` table).
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub struct Config {
    /// Fewest replicas the fleet may have (≥ 1).
    pub min_replicas: u32,
    /// Most replicas the fleet may have (≥ `min-replicas`).
    pub max_replicas: u32,
    /// Fraction of a replica's measured throughput to plan for (0 < u ≤ 1).
    pub target_utilization: f64,
    /// p95 end-to-end latency above which a growing queue is pressure, ms.
    pub target_latency_p95_ms: f64,
    /// p95 time to first token above which a growing queue is pressure, ms.
    pub target_ttft_p95_ms: f64,
    /// KV cache usage at or above which the fleet is under pressure (0–1].
    pub max_kv_usage: f64,
    /// Requests per second one replica completes, used until the host has
    /// measured `throughput-per-replica` (0 = unknown).
    pub replica_throughput: f64,
    /// Seconds pressure must last before replicas are added.
    pub scale_up_stabilization_secs: f64,
    /// Most replicas added by one decision (0 = no limit).
    pub max_scale_up_step: u32,
    /// Seconds the need must stay below the desired count before removing.
    pub scale_down_stabilization_secs: f64,
    /// Seconds since the last change (up or down) before removing.
    pub scale_down_cooldown_secs: f64,
    /// Most replicas removed by one decision (≥ 1).
    pub max_scale_down_step: u32,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            min_replicas: 1,
            max_replicas: 10,
            target_utilization: 0.8,
            target_latency_p95_ms: 5000.0,
            target_ttft_p95_ms: 1000.0,
            max_kv_usage: 0.9,
            replica_throughput: 0.0,
            scale_up_stabilization_secs: 15.0,
            max_scale_up_step: 0,
            scale_down_stabilization_secs: 300.0,
            scale_down_cooldown_secs: 120.0,
            max_scale_down_step: 1,
        }
    }
}

impl Config {
    /// Refuses values the controller cannot work with, naming the field.
    pub fn validate(&self) -> Result<(), String> {
        if self.min_replicas < 1 {
            return Err(invalid(PLUGIN, "min-replicas", "at least 1", self.min_replicas));
        }
        if self.max_replicas < self.min_replicas {
            let rule = format!("at least min-replicas ({})", self.min_replicas);
            return Err(invalid(PLUGIN, "max-replicas", &rule, self.max_replicas));
        }
        if !(self.target_utilization > 0.0 && self.target_utilization <= 1.0) {
            return Err(invalid(PLUGIN, "target-utilization", "in (0, 1]", self.target_utilization));
        }
        if !(self.max_kv_usage > 0.0 && self.max_kv_usage <= 1.0) {
            return Err(invalid(PLUGIN, "max-kv-usage", "in (0, 1]", self.max_kv_usage));
        }
        positive("target-latency-p95-ms", self.target_latency_p95_ms)?;
        positive("target-ttft-p95-ms", self.target_ttft_p95_ms)?;
        at_least_zero("replica-throughput", self.replica_throughput)?;
        at_least_zero("scale-up-stabilization-secs", self.scale_up_stabilization_secs)?;
        at_least_zero("scale-down-stabilization-secs", self.scale_down_stabilization_secs)?;
        at_least_zero("scale-down-cooldown-secs", self.scale_down_cooldown_secs)?;
        if self.max_scale_down_step < 1 {
            return Err(invalid(PLUGIN, "max-scale-down-step", "at least 1", self.max_scale_down_step));
        }
        Ok(())
    }
}

fn positive(field: &str, value: f64) -> Result<(), String> {
    if value.is_finite() && value > 0.0 { Ok(()) } else { Err(invalid(PLUGIN, field, "a positive number", value)) }
}

fn at_least_zero(field: &str, value: f64) -> Result<(), String> {
    if value.is_finite() && value >= 0.0 { Ok(()) } else { Err(invalid(PLUGIN, field, "a number ≥ 0", value)) }
}
