//! `PluginState`: the data of one plugin instance's store — its memory cap,
//! its deadline, an empty WASI context, and the host capabilities it imports.

use super::bindings::{embeddings, kv, metrics, ratelimit, runtime, types, vectors};
use crate::capabilities::Capabilities;
use std::sync::Arc;
use std::time::Instant;
use wasmtime::component::ResourceTable;
use wasmtime::{ResourceLimiter, StoreLimits, StoreLimitsBuilder};
use wasmtime_wasi::{WasiCtx, WasiCtxView, WasiView};

/// The memory cap of one instance, which remembers that it refused growth so
/// that the resulting trap is reported as over-memory, not as a plain trap.
pub struct MemoryCap {
    limits: StoreLimits,
    /// Set when a growth past the cap was refused.
    pub exceeded: bool,
}

impl MemoryCap {
    /// A cap of `bytes` of linear memory, trapping on a refused growth.
    pub fn new(bytes: usize) -> Self {
        let limits = StoreLimitsBuilder::new().memory_size(bytes).trap_on_grow_failure(true).build();
        Self { limits, exceeded: false }
    }
}

impl ResourceLimiter for MemoryCap {
    fn memory_growing(&mut self, current: usize, desired: usize, maximum: Option<usize>) -> wasmtime::Result<bool> {
        let verdict = self.limits.memory_growing(current, desired, maximum);
        if !matches!(verdict, Ok(true)) {
            self.exceeded = true;
        }
        verdict
    }

    fn table_growing(&mut self, current: usize, desired: usize, maximum: Option<usize>) -> wasmtime::Result<bool> {
        self.limits.table_growing(current, desired, maximum)
    }
}

/// Longest key or vector namespace a plugin may use, bytes.
pub const MAX_KEY_BYTES: usize = 1024;

/// The store data of one plugin instance.
pub struct PluginState {
    /// The plugin's name: its namespace in the shared stores and its tag in logs.
    pub plugin: Arc<str>,
    /// Memory cap.
    pub cap: MemoryCap,
    /// When the current call must be done.
    pub deadline: Instant,
    caps: Arc<Capabilities>,
    stats: Arc<super::stats::PluginStats>,
    wasi: WasiCtx,
    table: ResourceTable,
}

impl PluginState {
    /// State for an instance of `plugin` capped at `memory_bytes`; `stats`
    /// are the plugin's (its log rate among them).
    pub fn new(
        plugin: Arc<str>,
        memory_bytes: usize,
        caps: Arc<Capabilities>,
        stats: Arc<super::stats::PluginStats>,
    ) -> Self {
        Self {
            plugin,
            cap: MemoryCap::new(memory_bytes),
            deadline: Instant::now(),
            caps,
            stats,
            // Nothing is granted: no files, no network, no environment, no stdio.
            wasi: WasiCtx::builder().build(),
            table: ResourceTable::new(),
        }
    }

    /// `key` in the plugin's namespace; keys (and namespace names) are at
    /// most [`MAX_KEY_BYTES`], so that a plugin cannot fill the host's
    /// memory with the keys themselves.
    fn key(&self, key: &str) -> Result<String, String> {
        if key.len() > MAX_KEY_BYTES {
            return Err(format!("keys and namespaces must be at most {MAX_KEY_BYTES} bytes, got {}", key.len()));
        }
        Ok(format!("{}:{key}", self.plugin))
    }
}

impl WasiView for PluginState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView { ctx: &mut self.wasi, table: &mut self.table }
    }
}

impl types::Host for PluginState {}

impl runtime::Host for PluginState {
    async fn log(&mut self, level: runtime::Level, message: String) {
        use super::logs::{Verdict, one_line};
        let plugin = &*self.plugin;
        match self.stats.logs.admit() {
            Verdict::Write => {}
            Verdict::Drop => return,
            Verdict::DropAndWarn(n) => {
                tracing::warn!(plugin, "plugin log over its rate: {n} lines dropped");
                return;
            }
        }
        let message = one_line(&message);
        match level {
            runtime::Level::Trace => tracing::trace!(plugin, "{message}"),
            runtime::Level::Debug => tracing::debug!(plugin, "{message}"),
            runtime::Level::Info => tracing::info!(plugin, "{message}"),
            runtime::Level::Warn => tracing::warn!(plugin, "{message}"),
            runtime::Level::Error => tracing::error!(plugin, "{message}"),
        }
    }

    async fn now_ms(&mut self) -> u64 {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
    }
}

impl kv::Host for PluginState {
    async fn get(&mut self, key: String) -> Result<Option<Vec<u8>>, String> {
        self.caps.kv_get(&self.key(&key)?).await
    }

    async fn set(&mut self, key: String, value: Vec<u8>, ttl_ms: u64) -> Result<(), String> {
        self.caps.kv_set(&self.key(&key)?, value, ttl_ms).await
    }

    async fn incr(&mut self, key: String, delta: i64, ttl_ms: u64) -> Result<i64, String> {
        self.caps.kv_incr(&self.key(&key)?, delta, ttl_ms).await
    }

    async fn delete(&mut self, key: String) -> Result<(), String> {
        self.caps.kv_delete(&self.key(&key)?).await
    }
}

impl ratelimit::Host for PluginState {
    async fn token_bucket(
        &mut self,
        key: String,
        capacity: f64,
        refill_per_sec: f64,
        cost: f64,
    ) -> Result<ratelimit::BucketState, String> {
        let take = self.caps.take(&self.key(&key)?, capacity, refill_per_sec, cost).await?;
        Ok(ratelimit::BucketState {
            allowed: take.allowed,
            remaining: take.remaining,
            retry_after_secs: take.retry_after_secs,
        })
    }
}

impl embeddings::Host for PluginState {
    async fn embed(&mut self, text: String) -> Result<Vec<f32>, String> {
        let Some(embedder) = self.caps.embedder.clone() else {
            return Err("no embedding model is configured on this host".to_string());
        };
        tokio::task::spawn_blocking(move || embedder.embed(&text))
            .await
            .map_err(|e| format!("embedding failed: {e}"))?
    }
}

impl vectors::Host for PluginState {
    async fn insert(
        &mut self,
        namespace: String,
        vector: Vec<f32>,
        payload: Vec<u8>,
        ttl_ms: u64,
    ) -> Result<(), String> {
        self.caps.vector_insert(&self.key(&namespace)?, &vector, payload, ttl_ms).await
    }

    async fn search(
        &mut self,
        namespace: String,
        vector: Vec<f32>,
        k: u32,
        min_score: f32,
    ) -> Result<Vec<vectors::Match>, String> {
        let hits = self.caps.vectors.search(&self.key(&namespace)?, &vector, k, min_score)?;
        Ok(hits.into_iter().map(|h| vectors::Match { score: h.score, payload: h.payload }).collect())
    }
}

impl PluginState {
    /// Logs a host warning about this plugin under its log rate, so that a
    /// plugin cannot make the host write without bound either.
    fn warn_limited(&self, message: &str) {
        use super::logs::{Verdict, one_line};
        match self.stats.logs.admit() {
            Verdict::Write => tracing::warn!(plugin = &*self.plugin, "{}", one_line(message)),
            Verdict::Drop => {}
            Verdict::DropAndWarn(n) => {
                tracing::warn!(plugin = &*self.plugin, "plugin log over its rate: {n} lines dropped")
            }
        }
    }
}

impl metrics::Host for PluginState {
    async fn counter_add(&mut self, name: String, delta: u64) {
        if let Err(message) = self.caps.metrics.counter_add(&self.plugin, &name, delta) {
            self.warn_limited(&format!("metric refused: {message}"));
        }
    }

    async fn gauge_set(&mut self, name: String, value: f64) {
        if let Err(message) = self.caps.metrics.gauge_set(&self.plugin, &name, value) {
            self.warn_limited(&format!("metric refused: {message}"));
        }
    }
}
