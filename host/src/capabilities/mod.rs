//! The host capabilities that plugins import: key-value, token buckets,
//! embeddings, vectors and custom metrics.
//!
//! Each capability is shared by every instance of every plugin; keys are
//! namespaced by plugin name before they reach a store. With
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
    /// Embeds `text`.
    fn embed(&self, text: &str) -> Result<Vec<f32>, String>;
}

/// Everything plugins can call, shared by all of them.
pub struct Capabilities {
    /// Key-value store with TTL and atomic increment.
    pub kv: kv::LocalKv,
    /// Token buckets.
    pub buckets: bucket::LocalBuckets,
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
            kv: kv::LocalKv::new(1_000_000),
            buckets: bucket::LocalBuckets::new(1_000_000),
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
        Ok(self.kv.get(key))
    }

    /// Stores `value` for `ttl_ms` (0 = no expiry).
    pub async fn kv_set(&self, key: &str, value: Vec<u8>, ttl_ms: u64) -> Result<(), String> {
        if let Some(shared) = &self.shared {
            match shared.kv_set(key, &value, ttl_ms).await {
                Ok(()) => return Ok(()),
                Err(failure) => self.on_failure(shared, failure)?,
            }
        }
        self.kv.set(key, value, ttl_ms);
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
        self.kv.incr(key, delta, ttl_ms)
    }

    /// Removes `key`.
    pub async fn kv_delete(&self, key: &str) -> Result<(), String> {
        if let Some(shared) = &self.shared {
            match shared.kv_delete(key).await {
                Ok(()) => return Ok(()),
                Err(failure) => self.on_failure(shared, failure)?,
            }
        }
        self.kv.delete(key);
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
        self.buckets.take(key, capacity, refill_per_sec, cost)
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
