//! The rate limiter's configuration, and how it resolves to the buckets and
//! priority of one request (tenant settings over tier settings over the
//! defaults).

use crate::config_json::invalid;
use serde::Deserialize;
use std::collections::BTreeMap;

const PLUGIN: &str = "rate-limit";

/// The plugin's configuration (its `[plugins.config]` table).
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub struct Config {
    /// Requests per minute for each tenant without a more specific setting.
    pub requests_per_minute: Option<f64>,
    /// Tokens (prompt + max tokens, refunded down to what was used) per
    /// minute for each tenant without a more specific setting.
    pub tokens_per_minute: Option<f64>,
    /// Priority for requests whose tenant and tier set none.
    pub default_priority: Option<i32>,
    /// Settings per tier (the `tier` of the tenant's API key).
    pub tiers: BTreeMap<String, TierConfig>,
    /// Settings per tenant, over those of its tier.
    pub tenants: BTreeMap<String, TenantConfig>,
    /// How long a token reservation waits for its `completed` refund.
    pub reservation_ttl_secs: Option<u64>,
    /// What to do when the host's store fails: `allow` or `reject` (503).
    pub on_store_error: StoreErrorRule,
}

/// A tier: the limits of each of its tenants, limits for the whole tier,
/// and the priority its requests run at.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub struct TierConfig {
    /// Requests per minute for each tenant of the tier.
    pub requests_per_minute: Option<f64>,
    /// Tokens per minute for each tenant of the tier.
    pub tokens_per_minute: Option<f64>,
    /// Requests per minute for all tenants of the tier together.
    pub tier_requests_per_minute: Option<f64>,
    /// Tokens per minute for all tenants of the tier together.
    pub tier_tokens_per_minute: Option<f64>,
    /// Priority of the tier's requests (lower runs first).
    pub priority: Option<i32>,
}

/// One tenant's own settings.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub struct TenantConfig {
    /// Requests per minute for this tenant.
    pub requests_per_minute: Option<f64>,
    /// Tokens per minute for this tenant.
    pub tokens_per_minute: Option<f64>,
    /// Priority of this tenant's requests (lower runs first).
    pub priority: Option<i32>,
}

/// The answer when the host's key-value or bucket store fails.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum StoreErrorRule {
    /// Admit the request unlimited (the host already falls back to its
    /// local store when Redis is down, so this is rarely reached).
    #[default]
    Allow,
    /// Refuse with 503 and `Retry-After: 1`.
    Reject,
}

/// What a bucket counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Measure {
    /// One per request.
    Requests,
    /// Prompt tokens + max tokens per request.
    Tokens,
}

/// One token bucket a request must take from.
#[derive(Debug, Clone, PartialEq)]
pub struct Bucket {
    /// Host key of the bucket.
    pub key: String,
    /// What it counts.
    pub measure: Measure,
    /// Whose bucket it is, for messages: `tenant acme` or `tier free`.
    pub owner: String,
    /// The per-minute limit: the bucket's capacity; it refills a sixtieth of
    /// it per second.
    pub per_minute: f64,
}

impl Bucket {
    /// Tokens the bucket gains per second.
    pub fn refill_per_sec(&self) -> f64 {
        self.per_minute / 60.0
    }
}

impl Config {
    /// Refuses limits that are not positive numbers.
    pub fn validate(&self) -> Result<(), String> {
        check_rate("requests-per-minute", self.requests_per_minute)?;
        check_rate("tokens-per-minute", self.tokens_per_minute)?;
        if self.reservation_ttl_secs == Some(0) {
            return Err(invalid(PLUGIN, "reservation-ttl-secs", "at least 1", 0));
        }
        for (name, tier) in &self.tiers {
            check_rate(&format!("tiers.{name}.requests-per-minute"), tier.requests_per_minute)?;
            check_rate(&format!("tiers.{name}.tokens-per-minute"), tier.tokens_per_minute)?;
            check_rate(&format!("tiers.{name}.tier-requests-per-minute"), tier.tier_requests_per_minute)?;
            check_rate(&format!("tiers.{name}.tier-tokens-per-minute"), tier.tier_tokens_per_minute)?;
        }
        for (name, tenant) in &self.tenants {
            check_rate(&format!("tenants.{name}.requests-per-minute"), tenant.requests_per_minute)?;
            check_rate(&format!("tenants.{name}.tokens-per-minute"), tenant.tokens_per_minute)?;
        }
        Ok(())
    }

    /// Whether any token limit is configured (and `completed` must refund).
    pub fn limits_tokens(&self) -> bool {
        self.tokens_per_minute.is_some()
            || self.tiers.values().any(|t| t.tokens_per_minute.is_some() || t.tier_tokens_per_minute.is_some())
            || self.tenants.values().any(|t| t.tokens_per_minute.is_some())
    }

    /// The buckets a request of `tenant` in `tier` takes from, tenant first.
    pub fn buckets(&self, tenant: &str, tier: Option<&str>) -> Vec<Bucket> {
        let tenant_config = self.tenants.get(tenant);
        let tier_config = tier.and_then(|name| self.tiers.get(name).map(|config| (name, config)));
        let tenant_owner = format!("tenant {tenant}");
        let mut buckets = Vec::new();
        let requests = tenant_config
            .and_then(|t| t.requests_per_minute)
            .or(tier_config.and_then(|(_, t)| t.requests_per_minute))
            .or(self.requests_per_minute);
        let tokens = tenant_config
            .and_then(|t| t.tokens_per_minute)
            .or(tier_config.and_then(|(_, t)| t.tokens_per_minute))
            .or(self.tokens_per_minute);
        if let Some(per_minute) = requests {
            buckets.push(bucket("rpm:tenant", tenant, Measure::Requests, &tenant_owner, per_minute));
        }
        if let Some(per_minute) = tokens {
            buckets.push(bucket("tpm:tenant", tenant, Measure::Tokens, &tenant_owner, per_minute));
        }
        if let Some((name, config)) = tier_config {
            let owner = format!("tier {name}");
            if let Some(per_minute) = config.tier_requests_per_minute {
                buckets.push(bucket("rpm:tier", name, Measure::Requests, &owner, per_minute));
            }
            if let Some(per_minute) = config.tier_tokens_per_minute {
                buckets.push(bucket("tpm:tier", name, Measure::Tokens, &owner, per_minute));
            }
        }
        buckets
    }

    /// The priority the tenant's settings give its requests, if any.
    pub fn priority(&self, tenant: &str, tier: Option<&str>) -> Option<i32> {
        self.tenants
            .get(tenant)
            .and_then(|t| t.priority)
            .or(tier.and_then(|name| self.tiers.get(name)).and_then(|t| t.priority))
            .or(self.default_priority)
    }

    /// Reservation lifetime in milliseconds.
    pub fn reservation_ttl_ms(&self) -> u64 {
        self.reservation_ttl_secs.unwrap_or(600).saturating_mul(1000)
    }
}

fn bucket(kind: &str, name: &str, measure: Measure, owner: &str, per_minute: f64) -> Bucket {
    Bucket { key: format!("{kind}:{name}"), measure, owner: owner.to_string(), per_minute }
}

/// A per-minute limit must let at least one request (or token) through.
fn check_rate(field: &str, value: Option<f64>) -> Result<(), String> {
    match value {
        Some(rate) if !(rate.is_finite() && rate >= 1.0) => Err(invalid(PLUGIN, field, "a number ≥ 1", rate)),
        _ => Ok(()),
    }
}
