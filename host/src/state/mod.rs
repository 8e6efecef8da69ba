//! State: everything Levee keeps beyond one request, in one place.
//!
//! - The plugins' stores: key-value, token buckets and vectors, behind one
//!   trait ([`Store`]) with two implementations: [`LocalStore`] (this
//!   process, each plugin in stores of its own within its own bounds) and
//!   [`RedisState`] (shared by every replica that names the same Redis).
//! - [`State`], which serves each call from Redis when it is configured and
//!   applies the outage rule (`shared-state.on-redis-error`) in one place.
//! - The other things replicas share through Redis: coalesced generations
//!   ([`flights`]) and the fleet's reports, scaling lease and decision
//!   ([`fleet`]).
//! - The Prometheus series of all of it ([`State::render`]).

pub mod bucket;
pub mod fleet;
pub mod flights;
pub mod kv;
pub mod local;
pub mod redis;
pub mod vectors;

pub use bucket::Take;
pub use local::{LocalStore, PluginBounds};
pub use redis::{RedisState, VectorEntry, unix_ms};

use crate::config::RedisErrorRule;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// Why a store call did not succeed.
#[derive(Debug, Clone, PartialEq)]
pub enum Failure {
    /// The store could not be reached in time; the outage rule applies.
    Outage(String),
    /// The store answered with an error (a value that is not an integer, a
    /// bound exceeded): it goes back to the caller as it is.
    Refused(String),
}

/// A store call in progress.
pub type Pending<'a, T> = Pin<Box<dyn Future<Output = Result<T, Failure>> + Send + 'a>>;

/// What a state backend does for plugins. Keys and namespaces arrive
/// already prefixed with the plugin's name (`plugin:key`).
pub trait Store: Send + Sync {
    /// The live value of `key`.
    fn kv_get<'a>(&'a self, key: &'a str) -> Pending<'a, Option<Vec<u8>>>;
    /// Stores `value` for `ttl_ms` (0 = no expiry).
    fn kv_set<'a>(&'a self, key: &'a str, value: &'a [u8], ttl_ms: u64) -> Pending<'a, ()>;
    /// Adds `delta` to the integer at `key` atomically; a new key gets `ttl_ms`.
    fn kv_incr<'a>(&'a self, key: &'a str, delta: i64, ttl_ms: u64) -> Pending<'a, i64>;
    /// Removes `key`.
    fn kv_delete<'a>(&'a self, key: &'a str) -> Pending<'a, ()>;
    /// Takes `cost` tokens from bucket `key` atomically (a negative cost refunds).
    fn take<'a>(&'a self, key: &'a str, capacity: f64, refill_per_sec: f64, cost: f64) -> Pending<'a, Take>;
    /// Stores a vector entry where searches will find it.
    fn vector_insert<'a>(&'a self, entry: &'a VectorEntry) -> Pending<'a, ()>;
    /// Whether this is the process's own store.
    fn is_local(&self) -> bool {
        false
    }
}

/// Counters of the outage rule, for `/metrics`.
#[derive(Debug, Default)]
pub struct RuleStats {
    /// Calls served by the local stores because Redis was unreachable.
    pub fallbacks: AtomicU64,
    /// Calls failed because Redis was unreachable and the rule is `closed`.
    pub refusals: AtomicU64,
}

/// The plugins' state: the local stores, and Redis when replicas share state.
pub struct State {
    /// This process's stores (searches always run here).
    pub local: LocalStore,
    /// Redis, when replicas share state.
    pub redis: Option<Arc<RedisState>>,
    /// What the outage rule did.
    pub rule_stats: RuleStats,
}

impl State {
    /// Local stores only.
    pub fn local() -> Self {
        Self { local: LocalStore::default(), redis: None, rule_stats: RuleStats::default() }
    }

    /// Local stores, and `redis` for what replicas share.
    pub fn shared(redis: Arc<RedisState>) -> Self {
        Self { redis: Some(redis), ..Self::local() }
    }

    /// Runs `op` against Redis when it is configured and against the local
    /// stores otherwise, or when Redis is unreachable and the rule is
    /// `open`. This is the one place the outage rule is applied.
    async fn serve<'a, T>(&'a self, op: impl Fn(&'a dyn Store) -> Pending<'a, T>) -> Result<T, String> {
        if let Some(redis) = &self.redis {
            match op(redis.as_ref()).await {
                Ok(value) => return Ok(value),
                Err(Failure::Refused(message)) => return Err(message),
                Err(Failure::Outage(message)) => match redis.rule {
                    RedisErrorRule::Open => {
                        self.rule_stats.fallbacks.fetch_add(1, Ordering::Relaxed);
                    }
                    RedisErrorRule::Closed => {
                        self.rule_stats.refusals.fetch_add(1, Ordering::Relaxed);
                        return Err(format!("shared state unavailable: {message}"));
                    }
                },
            }
        }
        op(&self.local).await.map_err(|failure| match failure {
            Failure::Outage(message) | Failure::Refused(message) => message,
        })
    }

    /// See [`Store::kv_get`].
    pub async fn kv_get(&self, key: &str) -> Result<Option<Vec<u8>>, String> {
        self.serve(|store| store.kv_get(key)).await
    }

    /// See [`Store::kv_set`].
    pub async fn kv_set(&self, key: &str, value: &[u8], ttl_ms: u64) -> Result<(), String> {
        self.serve(|store| store.kv_set(key, value, ttl_ms)).await
    }

    /// See [`Store::kv_incr`].
    pub async fn kv_incr(&self, key: &str, delta: i64, ttl_ms: u64) -> Result<i64, String> {
        self.serve(|store| store.kv_incr(key, delta, ttl_ms)).await
    }

    /// See [`Store::kv_delete`].
    pub async fn kv_delete(&self, key: &str) -> Result<(), String> {
        self.serve(|store| store.kv_delete(key)).await
    }

    /// See [`Store::take`]; the bucket's numbers are checked here, once for either backend.
    pub async fn take(&self, key: &str, capacity: f64, refill_per_sec: f64, cost: f64) -> Result<Take, String> {
        bucket::check(capacity, refill_per_sec, cost)?;
        self.serve(|store| store.take(key, capacity, refill_per_sec, cost)).await
    }

    /// Publishes `entry` for every other replica (with Redis) and indexes it
    /// here. An entry this replica would refuse (its plugin's bounds, its
    /// dimensions) is never published; when Redis is unreachable the rule
    /// decides: `open` indexes it here only, `closed` fails the call and
    /// indexes nothing, so replicas do not drift apart.
    pub async fn vector_insert(&self, entry: &VectorEntry) -> Result<(), String> {
        self.local.vectors.check(&entry.namespace, &entry.vector, entry.payload.len())?;
        if self.redis.is_some() {
            self.serve(|store| match store.is_local() {
                // Falling back: indexed below.
                true => Box::pin(std::future::ready(Ok(()))),
                false => store.vector_insert(entry),
            })
            .await?;
        }
        self.local.vector_insert(entry).await.map_err(|failure| match failure {
            Failure::Outage(message) | Failure::Refused(message) => message,
        })
    }
}
