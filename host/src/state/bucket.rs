//! Local token buckets: an atomic take per call, refilled continuously.

use moka::sync::Cache;
use std::time::{Duration, Instant};

/// The outcome of one take, as plugins see it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Take {
    /// Whether `cost` tokens were taken.
    pub allowed: bool,
    /// Tokens left.
    pub remaining: f64,
    /// Seconds until `cost` tokens are available (0 when allowed).
    pub retry_after_secs: f64,
}

/// One bucket's state: tokens at `at`.
#[derive(Debug, Clone, Copy)]
pub struct Bucket {
    tokens: f64,
    at: Instant,
}

impl Bucket {
    /// A full bucket.
    pub fn full(capacity: f64, now: Instant) -> Self {
        Self { tokens: capacity, at: now }
    }

    /// Refills to `now`, then takes `cost` if that many tokens are there.
    /// A negative cost is a refund, capped at `capacity`.
    pub fn take(self, capacity: f64, refill_per_sec: f64, cost: f64, now: Instant) -> (Self, Take) {
        let elapsed = now.saturating_duration_since(self.at).as_secs_f64();
        let tokens = (self.tokens + elapsed * refill_per_sec).min(capacity);
        if cost <= tokens {
            let left = (tokens - cost).min(capacity);
            (Self { tokens: left, at: now }, Take { allowed: true, remaining: left, retry_after_secs: 0.0 })
        } else {
            let wait = if refill_per_sec > 0.0 { (cost - tokens) / refill_per_sec } else { f64::INFINITY };
            (Self { tokens, at: now }, Take { allowed: false, remaining: tokens, retry_after_secs: wait })
        }
    }
}

/// Refuses arguments no bucket can honour.
pub fn check(capacity: f64, refill_per_sec: f64, cost: f64) -> Result<(), String> {
    let valid = capacity.is_finite() && capacity >= 0.0 && refill_per_sec.is_finite() && refill_per_sec >= 0.0;
    if !valid || !cost.is_finite() {
        return Err(format!(
            "token-bucket: capacity and refill-per-sec must be finite and ≥ 0, cost finite; got {capacity}, {refill_per_sec}, {cost}"
        ));
    }
    Ok(())
}

/// Buckets by key, kept while used (idle ones are dropped after an hour,
/// by which time any sane bucket has refilled).
pub struct LocalBuckets {
    buckets: Cache<String, Bucket>,
}

impl LocalBuckets {
    /// At most `max_buckets` buckets.
    pub fn new(max_buckets: u64) -> Self {
        Self {
            buckets: Cache::builder()
                .eviction_policy(moka::policy::EvictionPolicy::lru())
                .max_capacity(max_buckets)
                .time_to_idle(Duration::from_secs(3600))
                .build(),
        }
    }

    /// Takes `cost` from bucket `key` atomically.
    pub fn take(&self, key: &str, capacity: f64, refill_per_sec: f64, cost: f64) -> Result<Take, String> {
        check(capacity, refill_per_sec, cost)?;
        let now = Instant::now();
        let mut outcome = None;
        self.buckets.entry(key.to_string()).and_upsert_with(|current| {
            let bucket = current.map(|e| e.into_value()).unwrap_or_else(|| Bucket::full(capacity, now));
            let (bucket, take) = bucket.take(capacity, refill_per_sec, cost, now);
            outcome = Some(take);
            bucket
        });
        outcome.ok_or_else(|| "token-bucket: no outcome".to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refills_and_reports_retry_after() {
        let t0 = Instant::now();
        let (b, take) = Bucket::full(2.0, t0).take(2.0, 1.0, 2.0, t0);
        assert!(take.allowed);
        let (b, take) = b.take(2.0, 1.0, 1.0, t0);
        assert!(!take.allowed);
        assert!((take.retry_after_secs - 1.0).abs() < 1e-9);
        let (_, take) = b.take(2.0, 1.0, 1.0, t0 + Duration::from_millis(1000));
        assert!(take.allowed);
    }

    #[test]
    fn concurrent_takes_never_overdraw() {
        let buckets = std::sync::Arc::new(LocalBuckets::new(10));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let buckets = buckets.clone();
                std::thread::spawn(move || {
                    (0..100).filter(|_| buckets.take("k", 50.0, 0.0, 1.0).unwrap().allowed).count()
                })
            })
            .collect();
        let allowed: usize = threads.into_iter().map(|t| t.join().unwrap()).sum();
        assert_eq!(allowed, 50);
    }
}
