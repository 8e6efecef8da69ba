//! The host capabilities that plugins import: key-value, token buckets,
//! embeddings, vectors and custom metrics.
//!
//! Each capability is shared by every instance of every plugin; keys are
//! namespaced by plugin name before they reach a store, and each plugin's
//! state is held within its own bounds ([`PluginBounds`]) by the state
//! layer ([`crate::state`]), locally or, with `[shared-state] backend =
//! "redis"`, in Redis so that replicas share it (searches stay local, over
//! an index that follows the other replicas' inserts).

pub mod embeddings;
pub mod metrics;

pub use crate::state::PluginBounds;
use crate::state::{State, Take, VectorEntry, kv::LocalKv, vectors::LocalVectors};
use std::future::Future;
use std::sync::Arc;

/// Turns text into unit-length vectors (the semantic cache's model).
pub trait Embedder: Send + Sync {
    /// Embeds `text` for plugin `owner`, waiting at most `max_wait` for the
    /// model to take it (texts are served fairly between owners).
    fn embed(&self, owner: &str, text: &str, max_wait: std::time::Duration) -> Result<Vec<f32>, String>;
}

/// Everything plugins can call, shared by all of them; keys arrive as
/// `plugin:key`.
pub struct Capabilities {
    /// The plugins' state, local and (when configured) in Redis.
    pub state: Arc<State>,
    /// Custom metrics by plugin.
    pub metrics: metrics::PluginMetrics,
    /// The embedding model, when one is configured.
    pub embedder: Option<Arc<dyn Embedder>>,
    /// The runtime Redis connections live on (set when sharing starts).
    home: std::sync::OnceLock<tokio::runtime::Handle>,
}

impl Capabilities {
    /// In-process stores with default bounds and no embedding model.
    pub fn local() -> Self {
        Self::new(State::local())
    }

    /// Capabilities over `state`, with no embedding model.
    pub fn new(state: State) -> Self {
        Self::over(Arc::new(state))
    }

    /// Capabilities over `state`, shared with its other users.
    pub fn over(state: Arc<State>) -> Self {
        Self { state, metrics: metrics::PluginMetrics::default(), embedder: None, home: std::sync::OnceLock::new() }
    }

    /// Starts indexing the other replicas' vector entries and watching for
    /// Redis to come back after an outage (with Redis only); both stop when
    /// the state is dropped.
    pub fn start_sharing(&self) {
        if let Some(redis) = self.state.redis.clone() {
            if let Ok(home) = tokio::runtime::Handle::try_current() {
                let _ = self.home.set(home);
            }
            let state = Arc::downgrade(&self.state);
            let follower = redis.clone();
            tokio::spawn(async move { follower.follow_vectors(state).await });
            let state = Arc::downgrade(&self.state);
            tokio::spawn(async move { redis.probe_while(|| state.strong_count() > 0).await });
        }
    }

    /// Sets `plugin`'s bounds (on every load of it).
    pub fn set_plugin_bounds(&self, plugin: &str, bounds: PluginBounds) {
        self.state.local.set_plugin_bounds(plugin, bounds);
        self.metrics.set_max_series(plugin, bounds.metric_series);
    }

    /// The local key-value store of the plugin that owns `key`.
    pub fn local_kv(&self, key: &str) -> Arc<LocalKv> {
        self.state.local.kv(key)
    }

    /// The vector index (searches run here, also with Redis).
    pub fn vectors(&self) -> &LocalVectors {
        &self.state.local.vectors
    }

    /// Whether a call of the shared state can run right here: always
    /// without Redis, and with it on the runtime its connections live on.
    fn at_home(&self) -> bool {
        self.home.get().is_none_or(|home| tokio::runtime::Handle::try_current().is_ok_and(|h| h.id() == home.id()))
    }

    /// Runs a call of the shared state on the runtime its Redis connections
    /// live on. A plugin call that moved to the plugin threads would
    /// otherwise reconnect Redis there, and every later Redis call would
    /// depend on threads that busy plugins fill.
    async fn go_home<T: Send + 'static>(
        &self,
        work: impl FnOnce(Arc<State>) -> std::pin::Pin<Box<dyn Future<Output = Result<T, String>> + Send>>,
    ) -> Result<T, String> {
        let work = work(self.state.clone());
        match self.home.get() {
            Some(home) => home.spawn(work).await.map_err(|e| format!("shared state: {e}"))?,
            None => work.await,
        }
    }

    /// The live value of `key`.
    pub async fn kv_get(&self, key: &str) -> Result<Option<Vec<u8>>, String> {
        if self.at_home() {
            return self.state.kv_get(key).await;
        }
        let key = key.to_string();
        self.go_home(|state| Box::pin(async move { state.kv_get(&key).await })).await
    }

    /// Stores `value` for `ttl_ms` (0 = no expiry), within the plugin's
    /// largest entry with either backend.
    pub async fn kv_set(&self, key: &str, value: Vec<u8>, ttl_ms: u64) -> Result<(), String> {
        self.state.local.check_kv_entry(key, &value)?;
        if self.at_home() {
            return self.state.kv_set(key, &value, ttl_ms).await;
        }
        let key = key.to_string();
        self.go_home(|state| Box::pin(async move { state.kv_set(&key, &value, ttl_ms).await })).await
    }

    /// Adds `delta` to the integer at `key` atomically; a new key gets `ttl_ms`.
    pub async fn kv_incr(&self, key: &str, delta: i64, ttl_ms: u64) -> Result<i64, String> {
        if self.at_home() {
            return self.state.kv_incr(key, delta, ttl_ms).await;
        }
        let key = key.to_string();
        self.go_home(|state| Box::pin(async move { state.kv_incr(&key, delta, ttl_ms).await })).await
    }

    /// Removes `key`.
    pub async fn kv_delete(&self, key: &str) -> Result<(), String> {
        if self.at_home() {
            return self.state.kv_delete(key).await;
        }
        let key = key.to_string();
        self.go_home(|state| Box::pin(async move { state.kv_delete(&key).await })).await
    }

    /// Takes `cost` tokens from bucket `key` atomically (a negative cost refunds).
    pub async fn take(&self, key: &str, capacity: f64, refill_per_sec: f64, cost: f64) -> Result<Take, String> {
        if self.at_home() {
            return self.state.take(key, capacity, refill_per_sec, cost).await;
        }
        let key = key.to_string();
        self.go_home(|state| Box::pin(async move { state.take(&key, capacity, refill_per_sec, cost).await })).await
    }

    /// Stores `vector` with `payload` for `ttl_ms` here and, with Redis, for every replica.
    pub async fn vector_insert(
        &self,
        namespace: &str,
        vector: &[f32],
        payload: Vec<u8>,
        ttl_ms: u64,
    ) -> Result<(), String> {
        let entry = VectorEntry {
            namespace: namespace.to_string(),
            vector: vector.to_vec(),
            payload,
            expires_unix_ms: if ttl_ms > 0 { crate::state::unix_ms().saturating_add(ttl_ms) } else { 0 },
            origin: self.state.redis.as_ref().map_or_else(String::new, |r| r.replica.clone()),
        };
        if self.at_home() {
            return self.state.vector_insert(&entry).await;
        }
        self.go_home(|state| Box::pin(async move { state.vector_insert(&entry).await })).await
    }
}
