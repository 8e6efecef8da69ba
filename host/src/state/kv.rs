//! The local key-value store: bounded in bytes, with per-entry TTL and atomic increment.

use moka::Expiry;
use moka::sync::Cache;
use std::time::{Duration, Instant};

#[derive(Clone)]
struct Entry {
    value: Vec<u8>,
    expires_at: Option<Instant>,
}

struct EntryExpiry;

impl Expiry<String, Entry> for EntryExpiry {
    fn expire_after_create(&self, _key: &String, value: &Entry, created_at: Instant) -> Option<Duration> {
        value.expires_at.map(|at| at.saturating_duration_since(created_at))
    }

    fn expire_after_update(
        &self,
        _key: &String,
        value: &Entry,
        updated_at: Instant,
        _duration_until_expiry: Option<Duration>,
    ) -> Option<Duration> {
        value.expires_at.map(|at| at.saturating_duration_since(updated_at))
    }
}

/// An in-process key-value store, bounded in bytes (keys, values and what
/// each entry costs besides); one per plugin.
pub struct LocalKv {
    entries: Cache<String, Entry>,
}

/// What one entry costs besides its key and value.
const ENTRY_OVERHEAD: usize = 64;

/// The bytes `key` with `value` counts for against a bound.
pub fn entry_bytes(key: &str, value: &[u8]) -> usize {
    key.len() + value.len() + ENTRY_OVERHEAD
}

fn expiry(now: Instant, ttl_ms: u64) -> Option<Instant> {
    (ttl_ms > 0).then(|| now + Duration::from_millis(ttl_ms))
}

impl LocalKv {
    /// A store holding at most `max_bytes` (least recently used go first).
    pub fn new(max_bytes: u64) -> Self {
        let weigh = |key: &String, entry: &Entry| u32::try_from(entry_bytes(key, &entry.value)).unwrap_or(u32::MAX);
        Self {
            entries: Cache::builder()
                .eviction_policy(moka::policy::EvictionPolicy::lru())
                .max_capacity(max_bytes)
                .weigher(weigh)
                .expire_after(EntryExpiry)
                .build(),
        }
    }

    /// Bytes held (after pending evictions are applied).
    pub fn bytes(&self) -> u64 {
        self.entries.run_pending_tasks();
        self.entries.weighted_size()
    }

    /// The live value of `key`.
    pub fn get(&self, key: &str) -> Option<Vec<u8>> {
        let entry = self.entries.get(key)?;
        match entry.expires_at {
            Some(at) if at <= Instant::now() => None,
            _ => Some(entry.value),
        }
    }

    /// Stores `value` for `ttl_ms` milliseconds (0 = no expiry).
    pub fn set(&self, key: &str, value: Vec<u8>, ttl_ms: u64) {
        self.entries.insert(key.to_string(), Entry { value, expires_at: expiry(Instant::now(), ttl_ms) });
    }

    /// Adds `delta` to the integer at `key` atomically; a new key gets `ttl_ms`.
    pub fn incr(&self, key: &str, delta: i64, ttl_ms: u64) -> Result<i64, String> {
        let now = Instant::now();
        let mut outcome = Ok(0);
        self.entries.entry(key.to_string()).and_upsert_with(|current| {
            let live = current.map(|e| e.into_value()).filter(|e| e.expires_at.is_none_or(|at| at > now));
            let (value, expires_at) = match live {
                Some(entry) => match std::str::from_utf8(&entry.value).ok().and_then(|s| s.parse::<i64>().ok()) {
                    Some(value) => (value, entry.expires_at),
                    None => {
                        outcome = Err(format!("value of key `{key}` is not an integer"));
                        return entry;
                    }
                },
                None => (0, expiry(now, ttl_ms)),
            };
            let next = value.saturating_add(delta);
            outcome = Ok(next);
            Entry { value: next.to_string().into_bytes(), expires_at }
        });
        outcome
    }

    /// Removes `key`.
    pub fn delete(&self, key: &str) {
        self.entries.invalidate(key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn incr_is_atomic_across_threads() {
        let kv = std::sync::Arc::new(LocalKv::new(1 << 20));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let kv = kv.clone();
                std::thread::spawn(move || {
                    for _ in 0..1000 {
                        kv.incr("n", 1, 0).unwrap();
                    }
                })
            })
            .collect();
        threads.into_iter().for_each(|t| t.join().unwrap());
        assert_eq!(kv.get("n").unwrap(), b"4000");
    }

    #[test]
    fn values_expire_and_non_integers_refuse_incr() {
        let kv = LocalKv::new(1 << 20);
        kv.set("short", b"x".to_vec(), 1);
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(kv.get("short"), None);
        kv.set("text", b"abc".to_vec(), 0);
        assert!(kv.incr("text", 1, 0).unwrap_err().contains("not an integer"));
        assert_eq!(kv.get("text").unwrap(), b"abc");
    }
}
