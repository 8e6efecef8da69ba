//! Custom metrics that plugins set, exported on `/metrics` as
//! `levee_plugin_<name>{plugin="…"}`.

use std::collections::BTreeMap;
use std::sync::Mutex;

/// One plugin series' value.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Value {
    Counter(u64),
    Gauge(f64),
}

/// Counters and gauges by (metric name, plugin), so one name's series are
/// adjacent; each plugin within its own number of series.
#[derive(Default)]
pub struct PluginMetrics {
    pub(crate) values: Mutex<BTreeMap<(String, String), Value>>,
    /// Series each plugin holds, and the most it may (its `metric-series`).
    series: Mutex<std::collections::HashMap<String, (usize, usize)>>,
}

/// Longest metric name a plugin may use.
const MAX_NAME: usize = 64;
/// Most metrics a plugin may create unless its entry says otherwise; more
/// are dropped with a refusal.
pub const DEFAULT_SERIES: usize = 256;

fn valid(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_NAME
        && name.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        && !name.starts_with(|c: char| c.is_ascii_digit())
}

impl PluginMetrics {
    fn update(&self, plugin: &str, name: &str, f: impl FnOnce(Option<Value>) -> Value) -> Result<(), String> {
        if !valid(name) {
            return Err(format!(
                "metric name {name:?} must be 1-{MAX_NAME} characters of [a-z0-9_], not starting with a digit"
            ));
        }
        let mut values = self.values.lock().unwrap_or_else(|p| p.into_inner());
        let key = (name.to_string(), plugin.to_string());
        let existing = values.get(&key).copied();
        if existing.is_none() {
            let mut series = self.series.lock().unwrap_or_else(|p| p.into_inner());
            let (held, max) = series.entry(plugin.to_string()).or_insert((0, DEFAULT_SERIES));
            if *held >= *max {
                return Err(format!("plugin {plugin} already has {max} metrics (its metric-series)"));
            }
            *held += 1;
        }
        values.insert(key, f(existing));
        Ok(())
    }

    /// Sets how many series `plugin` may hold (on every load of it).
    pub fn set_max_series(&self, plugin: &str, max: usize) {
        self.series.lock().unwrap_or_else(|p| p.into_inner()).entry(plugin.to_string()).or_insert((0, max)).1 = max;
    }

    /// Adds `delta` to counter `name` of `plugin`.
    pub fn counter_add(&self, plugin: &str, name: &str, delta: u64) -> Result<(), String> {
        self.update(plugin, name, |v| match v {
            Some(Value::Counter(n)) => Value::Counter(n.saturating_add(delta)),
            _ => Value::Counter(delta),
        })
    }

    /// Sets gauge `name` of `plugin`.
    pub fn gauge_set(&self, plugin: &str, name: &str, value: f64) -> Result<(), String> {
        self.update(plugin, name, |_| Value::Gauge(value))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_plugin_creates_series_within_its_own_bound() {
        let metrics = PluginMetrics::default();
        metrics.set_max_series("flood", 3);
        for i in 0..3 {
            metrics.counter_add("flood", &format!("m{i}"), 1).unwrap();
        }
        assert!(metrics.counter_add("flood", "m3", 1).unwrap_err().contains("metric-series"));
        // Updating a series it has is not a new one; another plugin has its own bound.
        metrics.counter_add("flood", "m0", 1).unwrap();
        for i in 0..10 {
            metrics.gauge_set("innocent", &format!("g{i}"), 1.0).unwrap();
        }
        let values = metrics.values.lock().unwrap();
        assert!(matches!(values.get(&("m0".to_string(), "flood".to_string())), Some(Value::Counter(2))));
        assert!(!values.contains_key(&("m3".to_string(), "flood".to_string())));
        assert_eq!(values.keys().filter(|(_, plugin)| plugin == "innocent").count(), 10);
    }
}
