//! The process's own stores: each plugin's key-value entries, token buckets
//! and vector namespaces live in stores of their own, within the plugin's
//! own bounds, so that no plugin's activity can evict or reset another's.

use super::bucket::{LocalBuckets, Take};
use super::kv::{self, LocalKv};
use super::vectors::{self, LocalVectors};
use super::{Failure, Pending, Store, VectorEntry};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};

/// What one plugin may hold in the host's stores (its `[[plugins]]` entry).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PluginBounds {
    /// Key-value bytes (keys, values and 64 bytes an entry).
    pub kv_bytes: u64,
    /// Largest single key-value entry, bytes (with Redis too).
    pub kv_value_bytes: u64,
    /// Token buckets.
    pub buckets: u64,
    /// Vector namespaces held at once.
    pub vector_namespaces: usize,
    /// Bytes of all its vector namespaces together.
    pub vector_bytes: usize,
    /// Custom metric series it may create.
    pub metric_series: usize,
}

impl Default for PluginBounds {
    fn default() -> Self {
        Self {
            kv_bytes: 64 << 20,
            kv_value_bytes: 1 << 20,
            buckets: 100_000,
            vector_namespaces: 64,
            vector_bytes: 256 << 20,
            metric_series: crate::capabilities::metrics::DEFAULT_SERIES,
        }
    }
}

/// One store per plugin, made on first use with the plugin's bound (and
/// made anew, empty, when the bound changes).
struct PerPlugin<T> {
    stores: Mutex<HashMap<String, (u64, Arc<T>)>>,
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

/// The local stores of every plugin; keys arrive as `plugin:key`.
pub struct LocalStore {
    kv: PerPlugin<LocalKv>,
    buckets: PerPlugin<LocalBuckets>,
    bounds: RwLock<HashMap<String, PluginBounds>>,
    /// Vector namespaces (searches always run here, also with Redis).
    pub vectors: LocalVectors,
}

impl Default for LocalStore {
    fn default() -> Self {
        Self {
            kv: PerPlugin::default(),
            buckets: PerPlugin::default(),
            bounds: Default::default(),
            vectors: LocalVectors::new(vectors::Bounds::default()),
        }
    }
}

fn ready<'a, T: Send + 'a>(outcome: Result<T, String>) -> Pending<'a, T> {
    Box::pin(std::future::ready(outcome.map_err(Failure::Refused)))
}

impl LocalStore {
    /// Sets `plugin`'s bounds (on every load of it).
    pub fn set_plugin_bounds(&self, plugin: &str, bounds: PluginBounds) {
        self.bounds.write().unwrap_or_else(|p| p.into_inner()).insert(plugin.to_string(), bounds);
        self.vectors.set_owner_bounds(plugin, bounds.vector_namespaces, bounds.vector_bytes);
    }

    /// The plugins that have bounds set (every plugin loaded so far).
    pub fn plugins(&self) -> Vec<String> {
        self.bounds.read().unwrap_or_else(|p| p.into_inner()).keys().cloned().collect()
    }

    /// The bounds of the plugin that owns `key` (`plugin:…`).
    pub fn bounds_of<'k>(&self, key: &'k str) -> (&'k str, PluginBounds) {
        let plugin = vectors::owner(key);
        let bounds = self.bounds.read().unwrap_or_else(|p| p.into_inner()).get(plugin).copied().unwrap_or_default();
        (plugin, bounds)
    }

    /// The key-value store of the plugin that owns `key`.
    pub fn kv(&self, key: &str) -> Arc<LocalKv> {
        let (plugin, bounds) = self.bounds_of(key);
        self.kv.get(plugin, bounds.kv_bytes, LocalKv::new)
    }

    fn buckets(&self, key: &str) -> Arc<LocalBuckets> {
        let (plugin, bounds) = self.bounds_of(key);
        self.buckets.get(plugin, bounds.buckets, LocalBuckets::new)
    }

    /// Checks a key-value entry against its plugin's bounds, for either backend.
    pub fn check_kv_entry(&self, key: &str, value: &[u8]) -> Result<(), String> {
        let (plugin, bounds) = self.bounds_of(key);
        let bytes = kv::entry_bytes(key, value) as u64;
        let max = bounds.kv_value_bytes.min(bounds.kv_bytes);
        if bytes > max {
            return Err(format!(
                "a key-value entry of {bytes} bytes is more than plugin {plugin}'s largest entry of {max} bytes \
                 (kv-max-value-bytes, within kv-max-bytes)"
            ));
        }
        Ok(())
    }
}

impl Store for LocalStore {
    fn kv_get<'a>(&'a self, key: &'a str) -> Pending<'a, Option<Vec<u8>>> {
        ready(Ok(self.kv(key).get(key)))
    }

    fn kv_set<'a>(&'a self, key: &'a str, value: &'a [u8], ttl_ms: u64) -> Pending<'a, ()> {
        ready(self.check_kv_entry(key, value).map(|()| self.kv(key).set(key, value.to_vec(), ttl_ms)))
    }

    fn kv_incr<'a>(&'a self, key: &'a str, delta: i64, ttl_ms: u64) -> Pending<'a, i64> {
        ready(self.kv(key).incr(key, delta, ttl_ms))
    }

    fn kv_delete<'a>(&'a self, key: &'a str) -> Pending<'a, ()> {
        self.kv(key).delete(key);
        ready(Ok(()))
    }

    fn take<'a>(&'a self, key: &'a str, capacity: f64, refill_per_sec: f64, cost: f64) -> Pending<'a, Take> {
        ready(self.buckets(key).take(key, capacity, refill_per_sec, cost))
    }

    fn vector_insert<'a>(&'a self, entry: &'a VectorEntry) -> Pending<'a, ()> {
        let ttl_ms = match entry.expires_unix_ms {
            0 => 0,
            at => at.saturating_sub(super::unix_ms()).max(1),
        };
        ready(self.vectors.insert(&entry.namespace, &entry.vector, entry.payload.clone(), ttl_ms))
    }

    fn is_local(&self) -> bool {
        true
    }
}
