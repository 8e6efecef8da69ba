//! Autoscaling: a feedback controller over the fleet's scale signals that
//! sets the desired replica count and explains each decision.
//!
//! It adds replicas when a growing queue comes with latency or time to
//! first token over target, when KV usage nears its limit, or when the
//! arrivals predicted one warm-up (plus that stabilization time) ahead need
//! more replicas than are desired;
//! the pressure must last a stabilization time, and nothing is added while
//! replicas are warming. It removes replicas one step at a time after the
//! need has stayed lower for a stabilization window and a cooldown. The
//! steps are in [`controller`]; `plugins/README.md` documents them.
//!
//! The controller's memory (when pressure began, how long the need has been
//! low) lives in the host's key-value store, so a reloaded or replaced
//! instance carries on where the last one stopped.

#[path = "../../shared/config_json.rs"]
mod config_json;
pub mod controller;
pub mod settings;
#[cfg(test)]
mod tests;

use controller::Memory;
use levee_plugin_sdk::host::{self, Level};
use levee_plugin_sdk::{Hook, Policy, ScaleDecision, ScaleSignals, export};
use settings::Config;

/// Host key of the controller's memory.
const MEMORY_KEY: &str = "controller";
/// The memory expires when no tick has written it for this long, so a
/// controller that comes back after a long pause starts afresh.
const MEMORY_TTL_MS: u64 = 3_600_000;

/// The autoscaling policy.
pub struct Autoscale {
    config: Config,
    /// This instance's copy of the memory, used when the host store fails.
    memory: Memory,
}

impl Policy for Autoscale {
    const HOOKS: &'static [Hook] = &[Hook::Scale];

    fn init(json: &str) -> Result<Self, String> {
        let config: Config = config_json::parse("autoscale", json)?;
        config.validate()?;
        Ok(Self { config, memory: Memory::default() })
    }

    fn scale(&mut self, signals: &ScaleSignals) -> ScaleDecision {
        let memory = self.load_memory();
        let outcome = controller::decide(&self.config, signals, &memory, host::now_ms());
        self.store_memory(outcome.memory);

        let desired = outcome.decision.desired_replicas;
        let current = if signals.current_desired > 0 { signals.current_desired } else { signals.replicas.max(1) };
        if desired > current {
            host::counter_add("scale_ups", 1);
        } else if desired < current {
            host::counter_add("scale_downs", 1);
        }
        if desired != current {
            host::log(Level::Info, &outcome.decision.reason);
        }
        host::gauge_set("desired_replicas", f64::from(desired));
        host::gauge_set("predicted_arrival_rate", outcome.predicted_rate);
        if let Some(needed) = outcome.needed {
            host::gauge_set("needed_replicas", f64::from(needed));
        }
        outcome.decision
    }
}

impl Autoscale {
    fn load_memory(&self) -> Memory {
        match host::kv_get(MEMORY_KEY) {
            Ok(Some(bytes)) => serde_json::from_slice(&bytes).unwrap_or_default(),
            Ok(None) => Memory::default(),
            Err(_) => {
                host::counter_add("store_errors", 1);
                self.memory.clone()
            }
        }
    }

    fn store_memory(&mut self, memory: Memory) {
        match serde_json::to_vec(&memory) {
            Ok(bytes) => {
                if host::kv_set(MEMORY_KEY, &bytes, MEMORY_TTL_MS).is_err() {
                    host::counter_add("store_errors", 1);
                }
            }
            Err(_) => host::counter_add("store_errors", 1),
        }
        self.memory = memory;
    }
}

export!(Autoscale);
