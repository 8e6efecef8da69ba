//! Rate limiting: per-tenant and per-tier limits on requests per minute and
//! tokens per minute, kept in the host's token buckets so that every instance
//! and (with the Redis backend) every replica enforces one limit together.
//!
//! A request reserves its worst case at admission, prompt tokens + max
//! tokens × n, so concurrent requests cannot overshoot a token budget; the
//! unused part is refunded in `completed`. The reservation is recorded in the
//! host's key-value store under the request id, so any instance can refund it
//! and a request this plugin never admitted refunds nothing.

#[path = "../../shared/config_json.rs"]
mod config_json;
mod limits;
#[cfg(test)]
mod tests;

use levee_plugin_sdk::host::{self, Level};
use levee_plugin_sdk::{Admission, Hook, Load, Policy, Rejection, Request, Response, Usage, export};
use limits::{Bucket, Config, Measure, StoreErrorRule};

/// The rate-limiting policy.
pub struct RateLimit {
    config: Config,
    /// Whether this instance already logged a store failure (they are counted
    /// in `store_errors`; one log line per instance is enough).
    logged_store_error: bool,
}

impl Policy for RateLimit {
    const HOOKS: &'static [Hook] = &[Hook::Admit, Hook::Completed];

    fn init(json: &str) -> Result<Self, String> {
        let config: Config = config_json::parse("rate-limit", json)?;
        config.validate()?;
        Ok(Self { config, logged_store_error: false })
    }

    fn hooks(&self) -> Vec<Hook> {
        // Refunds are only needed when some token budget is configured.
        if self.config.limits_tokens() { vec![Hook::Admit, Hook::Completed] } else { vec![Hook::Admit] }
    }

    fn admit(&mut self, request: &Request, _load: &Load) -> Admission {
        let tier = request.tier.as_deref();
        let buckets = self.config.buckets(&request.tenant, tier);
        let reservation = reservation(request);
        if let Some(bucket) = buckets.iter().find(|b| b.measure == Measure::Tokens && reservation as f64 > b.per_minute)
        {
            host::counter_add("rejected_oversized", 1);
            return Admission::Reject(Rejection {
                status: 400,
                retry_after_secs: None,
                message: format!(
                    "this request reserves {reservation} tokens (prompt {} + max_tokens {} × n {}), more than \
                     the {} tokens per minute allowed to {}; lower max_tokens",
                    request.prompt_tokens, request.max_tokens, request.n, bucket.per_minute, bucket.owner
                ),
            });
        }

        let mut taken: Vec<(&Bucket, f64)> = Vec::with_capacity(buckets.len());
        for bucket in &buckets {
            let cost = match bucket.measure {
                Measure::Requests => 1.0,
                Measure::Tokens => reservation as f64,
            };
            match host::token_bucket(&bucket.key, bucket.per_minute, bucket.refill_per_sec(), cost) {
                Ok(state) if state.allowed => taken.push((bucket, cost)),
                Ok(state) => {
                    self.give_back(&taken);
                    return self.over_limit(bucket, state.retry_after_secs);
                }
                Err(error) => {
                    self.give_back(&taken);
                    return self.store_failed(&error);
                }
            }
        }

        if buckets.iter().any(|b| b.measure == Measure::Tokens) {
            let key = reservation_key(request);
            if let Err(error) = host::kv_incr(&key, reservation as i64, self.config.reservation_ttl_ms()) {
                // The tokens stay taken; only the refund of this request is lost.
                self.note_store_error(&error);
            }
            host::counter_add("reserved_tokens", reservation);
        }
        host::counter_add("admitted", 1);
        match self.config.priority(&request.tenant, tier) {
            // The tier's priority is the most urgent its requests get; a client
            // may still ask to run later (a positive priority) within it.
            Some(priority) => Admission::Allow(Some(priority.saturating_add(request.priority.max(0)))),
            None => Admission::Allow(None),
        }
    }

    fn completed(&mut self, request: &Request, _response: &Response, usage: &Usage) {
        let key = reservation_key(request);
        let stored = match host::kv_get(&key) {
            Ok(Some(bytes)) => String::from_utf8_lossy(&bytes).parse::<i64>().unwrap_or(0),
            Ok(None) => return,
            Err(error) => return self.note_store_error(&error),
        };
        // Several prompt records may share one request id; each releases its own part.
        let reserved = stored.min(reservation(request) as i64).max(0);
        match host::kv_incr(&key, -reserved, 0) {
            Ok(left) if left <= 0 => {
                let _ = host::kv_delete(&key);
            }
            Ok(_) => {}
            Err(error) => return self.note_store_error(&error),
        }
        // A cache hit generated nothing, so its whole reservation comes back.
        let used = if usage.cached { 0 } else { i64::from(usage.prompt_tokens) + i64::from(usage.completion_tokens) };
        let refund = reserved - used;
        if refund <= 0 {
            return;
        }
        let buckets = self.config.buckets(&request.tenant, request.tier.as_deref());
        for bucket in buckets.iter().filter(|b| b.measure == Measure::Tokens) {
            if let Err(error) =
                host::token_bucket(&bucket.key, bucket.per_minute, bucket.refill_per_sec(), -(refund as f64))
            {
                self.note_store_error(&error);
            }
        }
        host::counter_add("refunded_tokens", refund as u64);
    }
}

impl RateLimit {
    /// Returns what a refused request had already taken from other buckets.
    fn give_back(&mut self, taken: &[(&Bucket, f64)]) {
        for (bucket, cost) in taken {
            if let Err(error) = host::token_bucket(&bucket.key, bucket.per_minute, bucket.refill_per_sec(), -cost) {
                self.note_store_error(&error);
            }
        }
    }

    fn over_limit(&self, bucket: &Bucket, retry_after_secs: f64) -> Admission {
        let (counter, unit) = match bucket.measure {
            Measure::Requests => ("rejected_requests", "requests"),
            Measure::Tokens => ("rejected_tokens", "tokens"),
        };
        host::counter_add(counter, 1);
        let retry = retry_after(retry_after_secs);
        Admission::Reject(Rejection {
            status: 429,
            retry_after_secs: Some(retry),
            message: format!(
                "rate limit of {} {unit} per minute reached for {}; retry in {retry} s",
                bucket.per_minute, bucket.owner
            ),
        })
    }

    fn store_failed(&mut self, error: &str) -> Admission {
        self.note_store_error(error);
        match self.config.on_store_error {
            StoreErrorRule::Allow => Admission::Allow(None),
            StoreErrorRule::Reject => Admission::Reject(Rejection {
                status: 503,
                retry_after_secs: Some(1),
                message: "rate limits are unavailable; retry shortly".to_string(),
            }),
        }
    }

    fn note_store_error(&mut self, error: &str) {
        host::counter_add("store_errors", 1);
        if !self.logged_store_error {
            self.logged_store_error = true;
            host::log(Level::Warn, &format!("rate-limit store failed (counted in store_errors from now on): {error}"));
        }
    }
}

/// Tokens a request may use at most: prompt + max tokens for each choice.
fn reservation(request: &Request) -> u64 {
    u64::from(request.prompt_tokens) + u64::from(request.max_tokens) * u64::from(request.n.max(1))
}

fn reservation_key(request: &Request) -> String {
    format!("reserved:{}:{}", request.tenant, request.id)
}

/// Whole seconds to wait, rounded up and at least 1 (a `Retry-After: 0`
/// would invite an immediate retry that fails again). A microsecond of slack
/// keeps floating-point noise (6.000000000000001) from adding a second.
fn retry_after(secs: f64) -> u32 {
    if secs.is_finite() { (secs - 1e-6).ceil().clamp(1.0, f64::from(u32::MAX)) as u32 } else { u32::MAX }
}

export!(RateLimit);
