//! Shared set-up for Levee's cross-crate tests and benchmarks: the paths of
//! the Wasm guests that `build.rs` compiled, and a plugin system over them.

use levee::capabilities::Capabilities;
use levee::config::{Mode, OnFault, PluginConfig, PluginRuntimeConfig};
use levee::plugins::{PluginError, PluginRuntime, PluginSystem};
use std::path::PathBuf;
use std::sync::Arc;

/// Paths of the built guests, one constant per crate.
pub mod guests {
    include!(concat!(env!("OUT_DIR"), "/guests.rs"));
}

/// A chain entry for `path` with a JSON `config` (an object), failing open
/// and enforcing, with a 10 ms budget and a 64 MiB cap.
pub fn plugin(name: &str, path: impl Into<PathBuf>, config: serde_json::Value) -> PluginConfig {
    let config: toml::Table = match serde_json::from_value(config) {
        Ok(table) => table,
        Err(e) => panic!("test plugin config must be a JSON object: {e}"),
    };
    PluginConfig {
        name: name.to_string(),
        path: path.into(),
        config,
        on_fault: OnFault::Open,
        mode: Mode::Enforce,
        time_budget_ms: 10.0,
        memory_mib: 64,
    }
}

/// Settings for tests: no file watching unless asked, few instances.
pub fn runtime_settings(watch: bool) -> PluginRuntimeConfig {
    PluginRuntimeConfig {
        watch,
        watch_interval_ms: 50,
        max_instances: 64,
        quarantine_after: 3,
        ..PluginRuntimeConfig::default()
    }
}

/// Starts a plugin system over `plugins` with fresh local capabilities.
pub async fn start(
    plugins: Vec<PluginConfig>,
    settings: PluginRuntimeConfig,
) -> Result<(PluginSystem, Arc<Capabilities>), PluginError> {
    let caps = Arc::new(Capabilities::local());
    let runtime = Arc::new(PluginRuntime::new(&settings, caps.clone())?);
    let system = PluginSystem::start(runtime, &settings, plugins).await?;
    Ok((system, caps))
}

/// A greedy completions request from `tenant` with `prompt`.
pub fn request(tenant: &str, prompt: &str) -> levee::plugins::bindings::Request {
    levee::plugins::bindings::Request {
        id: "req-1".to_string(),
        tenant: tenant.to_string(),
        tier: None,
        model: "SmolLM2-135M-Instruct".to_string(),
        route: levee::plugins::bindings::Route::Completions,
        prompt: prompt.to_string(),
        prompt_tokens: prompt.split_whitespace().count() as u32,
        max_tokens: 64,
        temperature: 0.0,
        top_p: 1.0,
        seed: None,
        n: 1,
        stop: Vec::new(),
        priority: 0,
        stream: false,
        headers: vec![("user-agent".to_string(), "levee-tests".to_string())],
        min_similarity: None,
    }
}

/// Scale signals of one replica under `load`.
pub fn signals(load: levee::plugins::bindings::Load) -> levee::plugins::bindings::ScaleSignals {
    levee::plugins::bindings::ScaleSignals {
        load,
        queue_trend: 0.0,
        arrival_rate: 0.0,
        arrival_trend: 0.0,
        throughput_per_replica: 0.0,
        replicas: 1,
        warming_replicas: 0,
        warmup_secs: 30.0,
        current_desired: 1,
        secs_since_change: 0.0,
    }
}
