//! A per-tenant token bucket over requests/second, the kind of check a rate
//! limiter makes on every request. Shared verbatim by the Wasm guest and its
//! native twin in the plugin benchmark.

use std::collections::HashMap;

/// Buckets by tenant.
pub struct Buckets {
    capacity: f64,
    refill_per_ms: f64,
    buckets: HashMap<String, (f64, u64)>,
}

impl Buckets {
    /// Buckets holding `capacity` tokens, refilled at `per_second`.
    pub fn new(capacity: f64, per_second: f64) -> Self {
        Self { capacity, refill_per_ms: per_second / 1000.0, buckets: HashMap::new() }
    }

    /// Takes `cost` from `tenant`'s bucket at `now_ms`; `Err(retry_after_secs)` when empty.
    pub fn take(&mut self, tenant: &str, cost: f64, now_ms: u64) -> Result<f64, u32> {
        let capacity = self.capacity;
        let entry = match self.buckets.get_mut(tenant) {
            Some(entry) => entry,
            None => self.buckets.entry(tenant.to_string()).or_insert((capacity, now_ms)),
        };
        let elapsed = now_ms.saturating_sub(entry.1) as f64;
        let tokens = (entry.0 + elapsed * self.refill_per_ms).min(capacity);
        entry.1 = now_ms;
        if tokens >= cost {
            entry.0 = tokens - cost;
            Ok(entry.0)
        } else {
            entry.0 = tokens;
            Err(((cost - tokens) / self.refill_per_ms / 1000.0).ceil() as u32)
        }
    }
}
