//! Coalescing: gives requests that would produce the same output one key, so
//! the host runs one generation and fans its stream out to all of them.
//!
//! Two requests share a key only when they ask the same model for the same
//! prompt with the same deterministic sampling settings. A sampled request
//! (temperature > 0 without a seed) would get different text each time, so it
//! never gets a key unless the configuration says `coalesce-sampled = true`.
//!
//! The plugin keeps no state: the key is a 128-bit hash of the settings that
//! decide the output, so every instance and replica computes the same key.

use fingerprint::Fingerprint;
use levee_plugin_sdk::{Hook, Policy, Request, Route, export, host};
use serde::Deserialize;

#[path = "../../shared/config_json.rs"]
#[allow(dead_code)] // this plugin has no ranges to check
mod config_json;
#[path = "../../shared/fingerprint.rs"]
mod fingerprint;

/// The plugin's configuration (its `[plugins.config]` table).
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub struct Config {
    /// Also coalesce sampled requests (temperature > 0 without a seed); they
    /// then all receive the same sampled text.
    pub coalesce_sampled: bool,
    /// Share generations only within one tenant.
    pub per_tenant: bool,
    /// Requests whose prompt has more tokens than this are not coalesced
    /// (0 = no limit).
    pub max_prompt_tokens: u32,
}

/// The coalescing policy.
pub struct Coalesce {
    config: Config,
}

impl Policy for Coalesce {
    const HOOKS: &'static [Hook] = &[Hook::CoalesceKey];

    fn init(json: &str) -> Result<Self, String> {
        let config: Config = config_json::parse("coalesce", json)?;
        Ok(Self { config })
    }

    fn coalesce_key(&mut self, request: &Request) -> Option<String> {
        if is_sampled(request) && !self.config.coalesce_sampled {
            host::counter_add("skipped_sampled", 1);
            return None;
        }
        if self.config.max_prompt_tokens > 0 && request.prompt_tokens > self.config.max_prompt_tokens {
            host::counter_add("skipped_long", 1);
            return None;
        }
        host::counter_add("keyed", 1);
        Some(key(request, self.config.per_tenant))
    }
}

/// Whether two runs of `request` can produce different text.
fn is_sampled(request: &Request) -> bool {
    request.temperature > 0.0 && request.seed.is_none()
}

/// The coalescing key of `request`: `v1:` and a 128-bit fingerprint of
/// every field that decides the generated text.
pub fn key(request: &Request, per_tenant: bool) -> String {
    let mut hash = Fingerprint::new();
    hash.field(request.model.as_bytes());
    hash.field(match request.route {
        Route::Completions => b"completions",
        Route::Chat => b"chat",
    });
    hash.field(request.prompt.as_bytes());
    hash.field(&request.max_tokens.to_le_bytes());
    hash.field(&request.temperature.to_bits().to_le_bytes());
    hash.field(&request.top_p.to_bits().to_le_bytes());
    match request.seed {
        Some(seed) => hash.field(&seed.to_le_bytes()),
        None => hash.field(b"no-seed"),
    };
    hash.field(&request.n.to_le_bytes());
    hash.field(&(request.stop.len() as u64).to_le_bytes());
    for stop in &request.stop {
        hash.field(stop.as_bytes());
    }
    if per_tenant {
        hash.field(request.tenant.as_bytes());
    }
    format!("v1:{}", hash.hex())
}

export!(Coalesce);

#[cfg(test)]
mod tests {
    use super::*;
    use levee_plugin_sdk::testing::{self, Harness};

    fn harness(config: &str) -> Harness<Coalesce> {
        Harness::new(config).expect("valid configuration")
    }

    #[test]
    fn identical_greedy_requests_share_a_key() {
        let mut plugin = harness("{}");
        assert!(plugin.declares(Hook::CoalesceKey));
        let first = testing::request("What is the capital of France?", 8);
        let mut second = first.clone();
        second.id = "another-request".into();
        second.tenant = "another-tenant".into();
        let key = plugin.coalesce_key(&first).expect("greedy requests are coalesced");
        assert_eq!(plugin.coalesce_key(&second), Some(key));
        assert_eq!(testing::counter("keyed"), 2);
    }

    #[test]
    fn anything_that_changes_the_output_changes_the_key() {
        let mut plugin = harness("{}");
        let base = testing::request("What is the capital of France?", 8);
        let key = plugin.coalesce_key(&base);
        let variants: [fn(&mut Request); 8] = [
            |r| r.model = "other-model".into(),
            |r| r.route = Route::Chat,
            |r| r.prompt.push('!'),
            |r| r.max_tokens = 17,
            |r| r.top_p = 0.9,
            |r| r.seed = Some(7),
            |r| r.n = 2,
            |r| r.stop = vec!["\n".into()],
        ];
        for change in variants {
            let mut other = base.clone();
            change(&mut other);
            assert_ne!(plugin.coalesce_key(&other), key, "{other:?}");
        }
    }

    #[test]
    fn sampled_requests_are_never_coalesced_by_default() {
        let mut plugin = harness("{}");
        let mut sampled = testing::request("Write a poem", 3);
        sampled.temperature = 0.8;
        assert_eq!(plugin.coalesce_key(&sampled), None);
        assert_eq!(testing::counter("skipped_sampled"), 1);

        // A seed makes sampling reproducible, so seeded requests can share.
        sampled.seed = Some(42);
        assert!(plugin.coalesce_key(&sampled).is_some());
    }

    #[test]
    fn sampled_requests_are_coalesced_when_configured() {
        let mut plugin = harness(r#"{"coalesce-sampled": true}"#);
        let mut sampled = testing::request("Write a poem", 3);
        sampled.temperature = 0.8;
        let key = plugin.coalesce_key(&sampled);
        assert!(key.is_some());
        assert_eq!(plugin.coalesce_key(&sampled.clone()), key);
    }

    #[test]
    fn per_tenant_keeps_tenants_apart_and_long_prompts_are_skipped() {
        let mut plugin = harness(r#"{"per-tenant": true, "max-prompt-tokens": 100}"#);
        let first = testing::request("hello", 1);
        let mut second = first.clone();
        second.tenant = "someone-else".into();
        assert_ne!(plugin.coalesce_key(&first), plugin.coalesce_key(&second));
        assert_eq!(plugin.coalesce_key(&testing::request("long", 101)), None);
        assert_eq!(testing::counter("skipped_long"), 1);
    }

    #[test]
    fn unknown_or_mistyped_fields_are_refused() {
        let error = Harness::<Coalesce>::new(r#"{"coalesce-sampling": true}"#).err().expect("refused");
        assert!(error.contains("coalesce-sampling"), "{error}");
        let error = Harness::<Coalesce>::new(r#"{"max-prompt-tokens": -1}"#).err().expect("refused");
        assert!(error.contains("`max-prompt-tokens`") && error.contains("-1"), "{error}");
    }
}
