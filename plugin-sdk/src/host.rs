//! The host's capabilities, as a plugin calls them.
//!
//! Inside the Levee host these are the component's imports. On a native
//! target (a plugin's `cargo test`) they are served by the in-memory fakes of
//! [`crate::testing`], so the same policy code runs in both places.

pub use crate::bindings::levee::policy::ratelimit::BucketState;
pub use crate::bindings::levee::policy::runtime::Level;
pub use crate::bindings::levee::policy::vectors::Match;

#[cfg(target_arch = "wasm32")]
mod imports {
    pub use crate::bindings::levee::policy::embeddings::embed;
    pub use crate::bindings::levee::policy::kv::{delete as kv_delete, get as kv_get, incr as kv_incr, set as kv_set};
    pub use crate::bindings::levee::policy::metrics::{counter_add, gauge_set};
    pub use crate::bindings::levee::policy::ratelimit::token_bucket;
    pub use crate::bindings::levee::policy::runtime::{log, now_ms};
    pub use crate::bindings::levee::policy::vectors::{insert as vector_insert, search as vector_search};
}

#[cfg(not(target_arch = "wasm32"))]
use crate::testing::fake as imports;

/// Writes a line to the host log, tagged with the plugin's name.
pub fn log(level: Level, message: &str) {
    imports::log(level, message)
}

/// Milliseconds since the Unix epoch, by the host's clock.
pub fn now_ms() -> u64 {
    imports::now_ms()
}

/// The value stored under `key`, if present and not expired.
pub fn kv_get(key: &str) -> Result<Option<Vec<u8>>, String> {
    imports::kv_get(key)
}

/// Stores `value` under `key` for `ttl_ms` milliseconds (0 = no expiry).
pub fn kv_set(key: &str, value: &[u8], ttl_ms: u64) -> Result<(), String> {
    imports::kv_set(key, value, ttl_ms)
}

/// Atomically adds `delta` to the integer under `key` and returns the new value.
pub fn kv_incr(key: &str, delta: i64, ttl_ms: u64) -> Result<i64, String> {
    imports::kv_incr(key, delta, ttl_ms)
}

/// Removes `key`.
pub fn kv_delete(key: &str) -> Result<(), String> {
    imports::kv_delete(key)
}

/// Takes `cost` tokens from the bucket `key` (negative cost refunds).
pub fn token_bucket(key: &str, capacity: f64, refill_per_sec: f64, cost: f64) -> Result<BucketState, String> {
    imports::token_bucket(key, capacity, refill_per_sec, cost)
}

/// A unit-length embedding of `text` from the host's embedding model.
pub fn embed(text: &str) -> Result<Vec<f32>, String> {
    imports::embed(text)
}

/// Stores `vector` with `payload` in `namespace` for `ttl_ms` milliseconds (0 = no expiry).
pub fn vector_insert(namespace: &str, vector: &[f32], payload: &[u8], ttl_ms: u64) -> Result<(), String> {
    imports::vector_insert(namespace, vector, payload, ttl_ms)
}

/// The `k` nearest entries of `namespace` with score ≥ `min_score`, best first.
pub fn vector_search(namespace: &str, vector: &[f32], k: u32, min_score: f32) -> Result<Vec<Match>, String> {
    imports::vector_search(namespace, vector, k, min_score)
}

/// Adds `delta` to the plugin's counter `name` on `/metrics`.
pub fn counter_add(name: &str, delta: u64) {
    imports::counter_add(name, delta)
}

/// Sets the plugin's gauge `name` on `/metrics`.
pub fn gauge_set(name: &str, value: f64) {
    imports::gauge_set(name, value)
}
