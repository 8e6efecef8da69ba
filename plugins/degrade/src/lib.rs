//! Degradation: as the load snapshot passes configured levels (queue depth,
//! queued tokens, KV usage, p95 latency, time to first token), the plugin
//! steps through configured actions: cap max tokens, truncate long prompts
//! (keeping the end), route to a lighter model, accept cache entries below
//! the normal threshold, shed the least urgent requests with 503.
//!
//! It steps up as soon as a higher level's signal is reached, and down one
//! level at a time, only when every signal of the current level is below
//! `exit-ratio` of its threshold and the level has been held `hold-secs`.
//! The level lives in the host's key-value store, so every instance (and,
//! with Redis, every replica) degrades together and a reload keeps it.

#[path = "../../shared/config_json.rs"]
mod config_json;
mod levels;
#[cfg(test)]
mod tests;

use levee_plugin_sdk::host::{self, Level as LogLevel};
use levee_plugin_sdk::{Hook, Load, Policy, Request, Shaping, export};
use levels::Config;
use serde::{Deserialize, Serialize};

/// Host key of the shared level.
const STATE_KEY: &str = "level";

/// The shared level and when it was entered.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
struct State {
    /// 0 = normal; n = the n-th configured level.
    level: usize,
    /// Host ms when `level` was entered.
    since_ms: u64,
}

/// The degradation policy.
pub struct Degrade {
    config: Config,
    /// This instance's copy of the state, used when the host store fails.
    state: State,
}

impl Policy for Degrade {
    const HOOKS: &'static [Hook] = &[Hook::Shape];

    fn init(json: &str) -> Result<Self, String> {
        let config: Config = config_json::parse("degrade", json)?;
        config.validate()?;
        Ok(Self { config, state: State::default() })
    }

    fn shape(&mut self, request: &Request, load: &Load) -> Shaping {
        let now = host::now_ms();
        let state = self.load_state();
        let next = self.step(state, load, now);
        if next != state {
            self.store_state(next);
        }
        self.state = next;
        host::gauge_set("level", next.level as f64);

        let shaping = self.config.shaping(next.level, request);
        for (counter, applied) in [
            ("capped", shaping.max_tokens.is_some()),
            ("truncated", shaping.truncate_prompt_tokens.is_some()),
            ("routed", shaping.route_model.is_some()),
            ("cache_floor", shaping.cache_min_similarity.is_some()),
            ("shed", shaping.shed.is_some()),
        ] {
            if applied {
                host::counter_add(counter, 1);
            }
        }
        shaping
    }
}

impl Degrade {
    /// The level after seeing `load` at `now`.
    fn step(&self, state: State, load: &Load, now: u64) -> State {
        let current = state.level.min(self.config.levels.len());
        let (pressure, why) = self.config.pressure(load);
        if pressure > current {
            host::counter_add("level_ups", 1);
            host::log(
                LogLevel::Info,
                &format!(
                    "degrade: level {current} -> {pressure} ({}): {}",
                    self.name(pressure),
                    why.unwrap_or_default()
                ),
            );
            return State { level: pressure, since_ms: now };
        }
        if current == 0 || pressure == current {
            return State { level: current, ..state };
        }
        let held_secs = now.saturating_sub(state.since_ms) as f64 / 1000.0;
        let cleared = self.config.levels[current - 1].enter.cleared(load, self.config.exit_ratio);
        if !cleared || held_secs < self.config.hold_secs {
            return State { level: current, ..state };
        }
        host::counter_add("level_downs", 1);
        host::log(
            LogLevel::Info,
            &format!(
                "degrade: level {current} -> {} ({}): signals below {} of level {current}'s thresholds for {held_secs:.0} s",
                current - 1,
                self.name(current - 1),
                self.config.exit_ratio
            ),
        );
        State { level: current - 1, since_ms: now }
    }

    fn name(&self, level: usize) -> &str {
        match level {
            0 => "normal",
            n => self.config.levels.get(n - 1).map_or("?", |l| l.name.as_str()),
        }
    }

    fn load_state(&self) -> State {
        match host::kv_get(STATE_KEY) {
            Ok(Some(bytes)) => serde_json::from_slice(&bytes).unwrap_or_default(),
            Ok(None) => State::default(),
            Err(_) => {
                host::counter_add("store_errors", 1);
                self.state
            }
        }
    }

    fn store_state(&self, state: State) {
        let stored =
            serde_json::to_vec(&state).map_err(|e| e.to_string()).and_then(|bytes| host::kv_set(STATE_KEY, &bytes, 0));
        if stored.is_err() {
            host::counter_add("store_errors", 1);
        }
    }
}

export!(Degrade);
