//! The host capabilities that plugins import: key-value, token buckets,
//! embeddings, vectors and custom metrics.
//!
//! Each capability is shared by every instance of every plugin; keys are
//! namespaced by plugin name before they reach a store.

pub mod bucket;
pub mod embeddings;
pub mod kv;
pub mod metrics;
pub mod vectors;

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
        }
    }
}
