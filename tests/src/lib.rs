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
/// and enforcing, with a 64 MiB cap and a one-second budget: tests check
/// decisions, and a loaded CI machine must not turn them into deadline faults.
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
        time_budget_ms: 1000.0,
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

/// The default model, fetched by `scripts/setup.sh`.
pub fn model_path() -> PathBuf {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(path.exists(), "{} is missing: run scripts/setup.sh first", path.display());
    path
}

/// A configuration from TOML (plugins and all), serving the default model
/// on one thread with a small KV cache.
pub fn config(toml_text: &str) -> levee::config::Config {
    let mut config = match levee::config::Config::parse(toml_text) {
        Ok(config) => config,
        Err(e) => panic!("test configuration: {e}"),
    };
    config.model.path = model_path();
    config.embeddings.path = Some(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/minilm"));
    config.engine.threads = 1;
    config.engine.kv_memory_mib = 64;
    config
}

/// A Levee server on an ephemeral loopback port.
pub struct TestServer {
    /// `http://127.0.0.1:PORT`.
    pub base: String,
    /// The running server's parts.
    pub levee: levee::server::Levee,
}

impl TestServer {
    /// Starts everything `config` describes and serves it.
    pub async fn start(config: levee::config::Config) -> TestServer {
        let levee = match levee::server::Levee::start(&config).await {
            Ok(levee) => levee,
            Err(e) => panic!("server start: {e}"),
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind a loopback port");
        let base = format!("http://{}", listener.local_addr().expect("local address"));
        let router = levee.router();
        tokio::spawn(async move { levee::server::serve(listener, router, || {}, std::time::Duration::ZERO).await });
        TestServer { base, levee }
    }

    /// `base` + `path`.
    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// Sequences the engine has started so far.
    pub fn sequences_started(&self) -> u64 {
        self.levee.app.pipeline.engine.stats().sequences_started
    }
}

/// Serialises the tests that run the model, so that two engines never
/// share this machine's cores.
pub async fn exclusive() -> tokio::sync::MutexGuard<'static, ()> {
    static LOCK: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    LOCK.lock().await
}
