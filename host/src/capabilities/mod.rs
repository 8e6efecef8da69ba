//! The host capabilities that plugins import: key-value, token buckets,
//! embeddings, vectors and custom metrics.
//!
//! Each capability is shared by every instance of every plugin; keys are
//! namespaced by plugin name before they reach a store, and each plugin's
//! local state lives in stores of its own, within its own bounds
//! ([`PluginBounds`]). With
//! `[shared-state] backend = "redis"`, key-value, buckets and vector inserts
//! go through Redis so that replicas share them; searches stay local, over
//! an index that follows the other replicas' inserts.

pub mod bucket;
pub mod embeddings;
pub mod kv;
pub mod metrics;
pub mod shared;
pub mod vectors;

use shared::{Failure, SharedState, VectorEntry};
use std::sync::Arc;

/// Turns text into unit-length vectors (the semantic cache's model).
pub trait Embedder: Send + Sync {
    /// Embeds `text` for plugin `owner`, waiting at most `max_wait` for the
    /// model to take it (texts are served fairly between owners).
    fn embed(&self, owner: &str, text: &str, max_wait: std::time::Duration) -> Result<Vec<f32>, String>;
}

/// What one plugin may hold in the host's stores (its `[[plugins]]`
/// entry): its stores are its own, so no plugin's activity can evict or
/// reset another's state.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PluginBounds {
    /// Key-value bytes (keys, values and 64 bytes an entry).
    pub kv_bytes: u64,
    /// Token buckets.
    pub buckets: u64,
    /// Vector namespaces held at once.
    pub vector_namespaces: usize,
    /// Bytes of all its vector namespaces together.
    pub vector_bytes: usize,
}

impl Default for PluginBounds {
    fn default() -> Self {
        Self { kv_bytes: 64 << 20, buckets: 100_000, vector_namespaces: 64, vector_bytes: 256 << 20 }
    }
}

/// One store per plugin, made on first use with the plugin's bound (and
/// made anew, empty, when the bound changes).
struct PerPlugin<T> {
    stores: std::sync::Mutex<std::collections::HashMap<String, (u64, Arc<T>)>>,
}

impl<T> Default for PerPlugin<T> {
    fn default() -> Self {
        Self { stores: Default::default() }
    }
}

impl<T> PerPlugin<T> {
    fn get(&self, plugin: &str, bound: u64, make: impl FnOnce(u64) -> T) -> Arc<T> {
        let mut stores = self.stores.lock().unwrap_or_else(|p| p.into_inner());
        match stores.get(plugin) {
            Some((b, store)) if *b == bound => store.clone(),
            _ => {
                let store = Arc::new(make(bound));
                stores.insert(plugin.to_string(), (bound, store.clone()));
                store
            }
        }
    }
}

/// Everything plugins can call, shared by all of them; keys arrive as
/// `plugin:key`, and each plugin's key-value entries and buckets live in
/// stores of its own.
pub struct Capabilities {
    kv: PerPlugin<kv::LocalKv>,
    buckets: PerPlugin<bucket::LocalBuckets>,
    bounds: std::sync::RwLock<std::collections::HashMap<String, PluginBounds>>,
    /// Vector stores by namespace.
    pub vectors: vectors::LocalVectors,
    /// Custom metrics by plugin.
    pub metrics: metrics::PluginMetrics,
    /// The embedding model, when one is configured.
    pub embedder: Option<Arc<dyn Embedder>>,
    /// Redis, when replicas share state.
    pub shared: Option<Arc<SharedState>>,
}

impl Capabilities {
    /// In-process stores with default bounds and no embedding model.
    pub fn local() -> Self {
        Self {
            kv: PerPlugin::default(),
            buckets: PerPlugin::default(),
            bounds: Default::default(),
            vectors: vectors::LocalVectors::new(vectors::Bounds::default()),
            metrics: metrics::PluginMetrics::default(),
            embedder: None,
            shared: None,
        }
    }

    /// Starts indexing the other replicas' vector entries and watching for
    /// Redis to come back after an outage (with Redis only); both stop when
    /// the capabilities are dropped.
    pub fn start_sharing(self: &Arc<Self>) {
        if let Some(shared) = self.shared.clone() {
            let caps = Arc::downgrade(self);
            tokio::spawn(async move { shared.follow_vectors(caps).await });
            let shared = self.shared.clone();
            let caps = Arc::downgrade(self);
            tokio::spawn(async move {
                if let Some(shared) = shared {
                    shared.probe_while(|| caps.strong_count() > 0).await;
                }
            });
        }
    }

    /// Sets `plugin`'s bounds (on every load of it).
    pub fn set_plugin_bounds(&self, plugin: &str, bounds: PluginBounds) {
        self.bounds.write().unwrap_or_else(|p| p.into_inner()).insert(plugin.to_string(), bounds);
        self.vectors.set_owner_bounds(plugin, bounds.vector_namespaces, bounds.vector_bytes);
    }

    /// The bounds of the plugin that owns `key` (`plugin:…`).
    fn bounds_of<'k>(&self, key: &'k str) -> (&'k str, PluginBounds) {
        let plugin = vectors::owner(key);
        let bounds = self.bounds.read().unwrap_or_else(|p| p.into_inner()).get(plugin).copied().unwrap_or_default();
        (plugin, bounds)
    }

    /// The local key-value store of the plugin that owns `key`.
    pub fn local_kv(&self, key: &str) -> Arc<kv::LocalKv> {
        let (plugin, bounds) = self.bounds_of(key);
        self.kv.get(plugin, bounds.kv_bytes, kv::LocalKv::new)
    }

    fn local_buckets(&self, key: &str) -> Arc<bucket::LocalBuckets> {
        let (plugin, bounds) = self.bounds_of(key);
        self.buckets.get(plugin, bounds.buckets, bucket::LocalBuckets::new)
    }

    /// Applies the outage rule: `Ok` means "serve it locally".
    fn on_failure(&self, shared: &SharedState, failure: Failure) -> Result<(), String> {
        match failure {
            Failure::Refused(message) => Err(message),
            Failure::Outage(message) => match shared.rule {
                crate::config::RedisErrorRule::Open => {
                    shared.stats.fallbacks.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    Ok(())
                }
                crate::config::RedisErrorRule::Closed => {
                    shared.stats.refusals.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    Err(format!("shared state unavailable: {message}"))
                }
            },
        }
    }

    /// The live value of `key`.
    pub async fn kv_get(&self, key: &str) -> Result<Option<Vec<u8>>, String> {
        if let Some(shared) = &self.shared {
            match shared.kv_get(key).await {
                Ok(value) => return Ok(value),
                Err(failure) => self.on_failure(shared, failure)?,
            }
        }
        Ok(self.local_kv(key).get(key))
    }

    /// Stores `value` for `ttl_ms` (0 = no expiry).
    pub async fn kv_set(&self, key: &str, value: Vec<u8>, ttl_ms: u64) -> Result<(), String> {
        let (plugin, bounds) = self.bounds_of(key);
        let bytes = kv::entry_bytes(key, &value);
        if bytes as u64 > bounds.kv_bytes {
            return Err(format!(
                "a key-value entry of {bytes} bytes is more than plugin {plugin}'s kv-max-bytes of {}",
                bounds.kv_bytes
            ));
        }
        if let Some(shared) = &self.shared {
            match shared.kv_set(key, &value, ttl_ms).await {
                Ok(()) => return Ok(()),
                Err(failure) => self.on_failure(shared, failure)?,
            }
        }
        self.local_kv(key).set(key, value, ttl_ms);
        Ok(())
    }

    /// Adds `delta` to the integer at `key` atomically; a new key gets `ttl_ms`.
    pub async fn kv_incr(&self, key: &str, delta: i64, ttl_ms: u64) -> Result<i64, String> {
        if let Some(shared) = &self.shared {
            match shared.kv_incr(key, delta, ttl_ms).await {
                Ok(value) => return Ok(value),
                Err(failure) => self.on_failure(shared, failure)?,
            }
        }
        self.local_kv(key).incr(key, delta, ttl_ms)
    }

    /// Removes `key`.
    pub async fn kv_delete(&self, key: &str) -> Result<(), String> {
        if let Some(shared) = &self.shared {
            match shared.kv_delete(key).await {
                Ok(()) => return Ok(()),
                Err(failure) => self.on_failure(shared, failure)?,
            }
        }
        self.local_kv(key).delete(key);
        Ok(())
    }

    /// Takes `cost` tokens from bucket `key` atomically (a negative cost refunds).
    pub async fn take(&self, key: &str, capacity: f64, refill_per_sec: f64, cost: f64) -> Result<bucket::Take, String> {
        bucket::check(capacity, refill_per_sec, cost)?;
        if let Some(shared) = &self.shared {
            match shared.take(key, capacity, refill_per_sec, cost).await {
                Ok(take) => return Ok(take),
                Err(failure) => self.on_failure(shared, failure)?,
            }
        }
        self.local_buckets(key).take(key, capacity, refill_per_sec, cost)
    }

    /// Stores `vector` with `payload` for `ttl_ms` here and, with Redis, for every replica.
    pub async fn vector_insert(
        &self,
        namespace: &str,
        vector: &[f32],
        payload: Vec<u8>,
        ttl_ms: u64,
    ) -> Result<(), String> {
        if let Some(shared) = &self.shared {
            let entry = VectorEntry {
                namespace: namespace.to_string(),
                vector: vector.to_vec(),
                payload: payload.clone(),
                expires_unix_ms: if ttl_ms > 0 { shared::unix_ms().saturating_add(ttl_ms) } else { 0 },
                origin: shared.replica.clone(),
            };
            if let Err(failure) = shared.publish_vector(&entry).await {
                self.on_failure(shared, failure)?;
            }
        }
        self.vectors.insert(namespace, vector, payload, ttl_ms)
    }
}
