//! Custom metrics that plugins set, exported on `/metrics` as
//! `levee_plugin_<name>{plugin="…"}`.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;

#[derive(Debug, Clone, Copy)]
enum Value {
    Counter(u64),
    Gauge(f64),
}

/// Counters and gauges by (metric name, plugin), so one name's series are adjacent.
#[derive(Default)]
pub struct PluginMetrics {
    values: Mutex<BTreeMap<(String, String), Value>>,
}

/// Longest metric name a plugin may use.
const MAX_NAME: usize = 64;
/// Most metrics one plugin may create; more are dropped with a refusal.
const MAX_PER_PLUGIN: usize = 256;

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
        if existing.is_none() && values.keys().filter(|(_, p)| p == plugin).count() >= MAX_PER_PLUGIN {
            return Err(format!("plugin {plugin} already has {MAX_PER_PLUGIN} metrics"));
        }
        values.insert(key, f(existing));
        Ok(())
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

    /// Prometheus text exposition of every plugin metric.
    pub fn render(&self, out: &mut String) {
        let values = self.values.lock().unwrap_or_else(|p| p.into_inner());
        let mut last = String::new();
        for ((name, plugin), value) in values.iter() {
            let full = format!("levee_plugin_{name}");
            let (kind, number) = match value {
                Value::Counter(n) => ("counter", *n as f64),
                Value::Gauge(g) => ("gauge", *g),
            };
            if full != last {
                let _ = writeln!(out, "# TYPE {full} {kind}");
                last = full.clone();
            }
            let _ = writeln!(out, "{full}{{plugin=\"{plugin}\"}} {number}");
        }
    }
}
