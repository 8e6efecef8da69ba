//! The degradation levels: their configuration, when a level is entered and
//! left, and the actions a level applies to a request.

use crate::config_json::invalid;
use levee_plugin_sdk::{Load, Rejection, Request, Shaping};
use serde::Deserialize;

const PLUGIN: &str = "degrade";

/// The plugin's configuration (its `[plugins.config]` table).
#[derive(Debug, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct Config {
    /// The levels, mildest first. Level n applies its own actions and those
    /// of every level before it.
    pub levels: Vec<Level>,
    /// A level is left only when every signal it watches is below this
    /// fraction of its threshold.
    #[serde(default = "default_exit_ratio")]
    pub exit_ratio: f64,
    /// Seconds a level is held at least before stepping down from it.
    #[serde(default = "default_hold_secs")]
    pub hold_secs: f64,
}

fn default_exit_ratio() -> f64 {
    0.8
}

fn default_hold_secs() -> f64 {
    10.0
}

/// One level: when it is entered and what it does.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct Level {
    /// Name reported in `x-levee-degraded` and in logs.
    pub name: String,
    /// The level is entered when any of these signals reaches its value.
    pub enter: Thresholds,
    /// Cap on max tokens.
    pub max_tokens: Option<u32>,
    /// Keep only this many prompt tokens (the end of the prompt).
    pub truncate_prompt_tokens: Option<u32>,
    /// Serve with this lighter model.
    pub route_model: Option<String>,
    /// Let the cache answer with entries down to this similarity.
    pub cache_min_similarity: Option<f32>,
    /// Refuse requests whose priority is this or higher (lower runs first,
    /// so these are the least urgent) with 503.
    pub shed_priority_at_least: Option<i32>,
    /// `Retry-After` of a shed request, seconds.
    #[serde(default = "default_retry_after_secs")]
    pub retry_after_secs: u32,
}

fn default_retry_after_secs() -> u32 {
    5
}

/// Load thresholds; a missing one is not watched.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct Thresholds {
    /// Requests waiting for the engine.
    pub queue_depth: Option<u32>,
    /// Prompt tokens of the waiting requests.
    pub queued_tokens: Option<u64>,
    /// Fraction of KV cache blocks in use (0–1].
    pub kv_usage: Option<f32>,
    /// p95 end-to-end latency, ms.
    pub latency_p95_ms: Option<f32>,
    /// p95 time to first token, ms.
    pub ttft_p95_ms: Option<f32>,
}

impl Thresholds {
    /// `(signal name, measured, threshold)` for each watched signal.
    fn watched(&self, load: &Load) -> Vec<(&'static str, f64, f64)> {
        let mut watched = Vec::new();
        if let Some(limit) = self.queue_depth {
            watched.push(("queue depth", f64::from(load.queue_depth), f64::from(limit)));
        }
        if let Some(limit) = self.queued_tokens {
            watched.push(("queued tokens", load.queued_tokens as f64, limit as f64));
        }
        if let Some(limit) = self.kv_usage {
            watched.push(("KV usage", f64::from(load.kv_usage), f64::from(limit)));
        }
        if let Some(limit) = self.latency_p95_ms {
            watched.push(("p95 latency ms", f64::from(load.latency_p95_ms), f64::from(limit)));
        }
        if let Some(limit) = self.ttft_p95_ms {
            watched.push(("p95 time to first token ms", f64::from(load.ttft_p95_ms), f64::from(limit)));
        }
        watched
    }

    /// The first watched signal at or over its threshold, described.
    pub fn reached(&self, load: &Load) -> Option<String> {
        self.watched(load)
            .into_iter()
            .find(|(_, measured, limit)| measured >= limit)
            .map(|(name, measured, limit)| format!("{name} {} ≥ {}", figure(measured), figure(limit)))
    }

    /// Whether every watched signal is below `ratio` × its threshold.
    pub fn cleared(&self, load: &Load, ratio: f64) -> bool {
        self.watched(load).into_iter().all(|(_, measured, limit)| measured < limit * ratio)
    }
}

/// A measurement as an operator would write it: whole numbers plain,
/// fractions (KV usage) to two decimals.
fn figure(value: f64) -> String {
    if value.fract() == 0.0 { format!("{value:.0}") } else { format!("{value:.2}") }
}

impl Config {
    /// Refuses levels that could never apply or never act.
    pub fn validate(&self) -> Result<(), String> {
        if self.levels.is_empty() {
            return Err(invalid(PLUGIN, "levels", "a list of at least one level", "an empty list"));
        }
        if !(self.exit_ratio > 0.0 && self.exit_ratio < 1.0) {
            return Err(invalid(PLUGIN, "exit-ratio", "in (0, 1)", self.exit_ratio));
        }
        if !(self.hold_secs.is_finite() && self.hold_secs >= 0.0) {
            return Err(invalid(PLUGIN, "hold-secs", "a number ≥ 0", self.hold_secs));
        }
        for (index, level) in self.levels.iter().enumerate() {
            let at = |field: &str| format!("levels[{index}].{field}");
            // The name is the `x-levee-degraded` label: a short header-safe token.
            let token = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ':');
            if level.name.is_empty() || level.name.len() > 64 || !level.name.chars().all(token) {
                return Err(invalid(PLUGIN, &at("name"), "1-64 letters, digits or -_.:", &level.name));
            }
            if self.levels[..index].iter().any(|l| l.name == level.name) {
                return Err(invalid(PLUGIN, &at("name"), "unique", &level.name));
            }
            let enter = &level.enter;
            let watched = [
                enter.queue_depth.is_some(),
                enter.queued_tokens.is_some(),
                enter.kv_usage.is_some(),
                enter.latency_p95_ms.is_some(),
                enter.ttft_p95_ms.is_some(),
            ];
            if !watched.contains(&true) {
                return Err(invalid(PLUGIN, &at("enter"), "a table with at least one threshold", "none"));
            }
            if let Some(kv) = enter.kv_usage
                && !(kv > 0.0 && kv <= 1.0)
            {
                return Err(invalid(PLUGIN, &at("enter.kv-usage"), "in (0, 1]", kv));
            }
            for (field, value) in
                [("enter.latency-p95-ms", enter.latency_p95_ms), ("enter.ttft-p95-ms", enter.ttft_p95_ms)]
            {
                if let Some(ms) = value
                    && !(ms.is_finite() && ms > 0.0)
                {
                    return Err(invalid(PLUGIN, &at(field), "a positive number", ms));
                }
            }
            let acts = level.max_tokens.is_some()
                || level.truncate_prompt_tokens.is_some()
                || level.route_model.is_some()
                || level.cache_min_similarity.is_some()
                || level.shed_priority_at_least.is_some();
            if !acts {
                let rule = "given at least one action (max-tokens, truncate-prompt-tokens, route-model, \
                            cache-min-similarity, shed-priority-at-least)";
                return Err(invalid(PLUGIN, &at("name"), rule, &level.name));
            }
            if level.max_tokens == Some(0) {
                return Err(invalid(PLUGIN, &at("max-tokens"), "at least 1", 0));
            }
            if level.truncate_prompt_tokens == Some(0) {
                return Err(invalid(PLUGIN, &at("truncate-prompt-tokens"), "at least 1", 0));
            }
            if let Some(similarity) = level.cache_min_similarity
                && !(similarity > 0.0 && similarity <= 1.0)
            {
                return Err(invalid(PLUGIN, &at("cache-min-similarity"), "in (0, 1]", similarity));
            }
            if level.retry_after_secs == 0 {
                return Err(invalid(PLUGIN, &at("retry-after-secs"), "at least 1", 0));
            }
        }
        Ok(())
    }

    /// The highest level (1-based; 0 = normal) whose entry signal is
    /// reached, with the reason.
    pub fn pressure(&self, load: &Load) -> (usize, Option<String>) {
        self.levels
            .iter()
            .enumerate()
            .rev()
            .find_map(|(index, level)| level.enter.reached(load).map(|why| (index + 1, Some(why))))
            .unwrap_or((0, None))
    }

    /// What level `level` (1-based) does to `request`: the actions of the
    /// levels up to it, a later level's setting replacing an earlier one's.
    /// Actions that would change nothing are left out.
    pub fn shaping(&self, level: usize, request: &Request) -> Shaping {
        let mut shaping = levee_plugin_sdk::no_shaping();
        let active = &self.levels[..level.min(self.levels.len())];
        let Some(top) = active.last() else { return shaping };
        if let Some(cap) = active.iter().rev().find_map(|l| l.max_tokens)
            && request.max_tokens > cap
        {
            shaping.max_tokens = Some(cap);
        }
        if let Some(keep) = active.iter().rev().find_map(|l| l.truncate_prompt_tokens)
            && request.prompt_tokens > keep
        {
            shaping.truncate_prompt_tokens = Some(keep);
        }
        if let Some(model) = active.iter().rev().find_map(|l| l.route_model.as_ref())
            && *model != request.model
        {
            shaping.route_model = Some(model.clone());
        }
        shaping.cache_min_similarity = active.iter().rev().find_map(|l| l.cache_min_similarity);
        if let Some(shedding) = active.iter().rev().find(|l| l.shed_priority_at_least.is_some())
            && let Some(least_urgent) = shedding.shed_priority_at_least
            && request.priority >= least_urgent
        {
            shaping.shed = Some(Rejection {
                status: 503,
                retry_after_secs: Some(shedding.retry_after_secs),
                message: format!(
                    "the server is overloaded ({}); requests at priority {least_urgent} or later are refused for now",
                    top.name
                ),
            });
        }
        let changed = shaping.max_tokens.is_some()
            || shaping.truncate_prompt_tokens.is_some()
            || shaping.route_model.is_some()
            || shaping.cache_min_similarity.is_some()
            || shaping.shed.is_some();
        if changed {
            shaping.label = Some(top.name.clone());
        }
        shaping
    }
}
