//! The semantic cache's configuration, the rules that adjust it per request
//! (by prompt text, route or model), and the per-request controls a client
//! sends in headers.

use crate::config_json::invalid;
use levee_plugin_sdk::{Request, Route};
use serde::Deserialize;

const PLUGIN: &str = "semantic-cache";

/// The plugin's configuration (its `[plugins.config]` table).
#[derive(Debug, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub struct Config {
    /// Lowest similarity (cosine, 0–1] a stored prompt needs to be served.
    pub threshold: f32,
    /// How long a stored response is kept, seconds.
    pub ttl_secs: u64,
    /// Largest TTL a client may ask for with `x-levee-cache-ttl`, seconds.
    pub max_ttl_secs: u64,
    /// Also cache requests sampled at temperature > 0.
    pub cache_sampled: bool,
    /// Prompts with more tokens than this are neither looked up nor stored
    /// (0 = no limit): the embedding model reads only the start of a long
    /// text, so long prompts that differ only near the end would match.
    pub max_prompt_tokens: u32,
    /// Stored entries compared per lookup (the nearest first).
    pub candidates: u32,
    /// Keep each tenant's entries apart (by default tenants share them).
    pub per_tenant: bool,
    /// Adjustments for some requests; the first rule that matches applies.
    pub rules: Vec<Rule>,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            threshold: 0.92,
            ttl_secs: 3600,
            max_ttl_secs: 86_400,
            cache_sampled: false,
            max_prompt_tokens: 256,
            candidates: 4,
            per_tenant: false,
            rules: Vec::new(),
        }
    }
}

/// A rule: which requests it matches, and what it changes for them.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct Rule {
    /// Matches prompts containing any of these (case-insensitive).
    #[serde(default)]
    pub prompt_contains: Vec<String>,
    /// Matches requests on this route: `chat` or `completions`.
    pub route: Option<RouteName>,
    /// Matches requests for this model.
    pub model: Option<String>,
    /// Similarity threshold for matching requests.
    pub threshold: Option<f32>,
    /// TTL for matching requests' responses, seconds.
    pub ttl_secs: Option<u64>,
    /// `false`: never cache matching requests.
    #[serde(default = "yes")]
    pub cache: bool,
}

fn yes() -> bool {
    true
}

/// A route, as a rule names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RouteName {
    /// `/v1/chat/completions`.
    Chat,
    /// `/v1/completions`.
    Completions,
}

impl Rule {
    fn matches(&self, request: &Request) -> bool {
        let route = match request.route {
            Route::Chat => RouteName::Chat,
            Route::Completions => RouteName::Completions,
        };
        let prompt_matches = self.prompt_contains.is_empty() || {
            let prompt = request.prompt.to_lowercase();
            self.prompt_contains.iter().any(|needle| prompt.contains(&needle.to_lowercase()))
        };
        prompt_matches
            && self.route.is_none_or(|r| r == route)
            && self.model.as_ref().is_none_or(|m| *m == request.model)
    }
}

/// What the configuration says for one request.
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    /// Whether the request may be cached at all.
    pub cache: bool,
    /// Its similarity threshold.
    pub threshold: f32,
    /// Its TTL, ms.
    pub ttl_ms: u64,
}

impl Config {
    /// Refuses values the cache cannot work with, naming the field.
    pub fn validate(&self) -> Result<(), String> {
        check_similarity("threshold", self.threshold)?;
        if self.ttl_secs == 0 {
            return Err(invalid(PLUGIN, "ttl-secs", "at least 1", 0));
        }
        if self.max_ttl_secs < self.ttl_secs {
            let rule = format!("at least ttl-secs ({})", self.ttl_secs);
            return Err(invalid(PLUGIN, "max-ttl-secs", &rule, self.max_ttl_secs));
        }
        if !(1..=64).contains(&self.candidates) {
            return Err(invalid(PLUGIN, "candidates", "between 1 and 64", self.candidates));
        }
        for (index, rule) in self.rules.iter().enumerate() {
            let at = |field: &str| format!("rules[{index}].{field}");
            if rule.prompt_contains.is_empty() && rule.route.is_none() && rule.model.is_none() {
                return Err(invalid(PLUGIN, &at("prompt-contains"), "set, or route or model", "none of them"));
            }
            if rule.prompt_contains.iter().any(|needle| needle.is_empty()) {
                return Err(invalid(PLUGIN, &at("prompt-contains"), "a list of non-empty strings", "\"\""));
            }
            if let Some(threshold) = rule.threshold {
                check_similarity(&at("threshold"), threshold)?;
            }
            if rule.ttl_secs == Some(0) {
                return Err(invalid(PLUGIN, &at("ttl-secs"), "at least 1", 0));
            }
        }
        Ok(())
    }

    /// The settings for `request`: the first matching rule over the defaults.
    pub fn settings(&self, request: &Request) -> Settings {
        let rule = self.rules.iter().find(|rule| rule.matches(request));
        let sampled = request.temperature > 0.0 && !self.cache_sampled;
        let long = self.max_prompt_tokens > 0 && request.prompt_tokens > self.max_prompt_tokens;
        Settings {
            cache: !sampled && !long && rule.is_none_or(|r| r.cache),
            threshold: rule.and_then(|r| r.threshold).unwrap_or(self.threshold),
            ttl_ms: rule.and_then(|r| r.ttl_secs).unwrap_or(self.ttl_secs).saturating_mul(1000),
        }
    }
}

fn check_similarity(field: &str, value: f32) -> Result<(), String> {
    if value > 0.0 && value <= 1.0 { Ok(()) } else { Err(invalid(PLUGIN, field, "in (0, 1]", value)) }
}

/// What the client asked of the cache for one request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Controls {
    /// `cache-control: no-cache`: do not serve from the cache (still store).
    pub no_cache: bool,
    /// `cache-control: no-store`: neither serve nor store.
    pub no_store: bool,
    /// `x-levee-cache-ttl: <seconds>`: keep the response this long (0 = do
    /// not store); capped by `max-ttl-secs`.
    pub ttl_secs: Option<u64>,
}

impl Controls {
    /// Reads the controls from the request's headers; values it cannot read
    /// are ignored.
    pub fn of(request: &Request) -> Self {
        let mut controls = Self::default();
        for (name, value) in &request.headers {
            match name.to_ascii_lowercase().as_str() {
                "cache-control" => {
                    for directive in value.split(',').map(|d| d.trim().to_ascii_lowercase()) {
                        match directive.as_str() {
                            "no-cache" => controls.no_cache = true,
                            "no-store" => controls.no_store = true,
                            _ => {}
                        }
                    }
                }
                "x-levee-cache-ttl" => controls.ttl_secs = value.trim().parse().ok(),
                _ => {}
            }
        }
        controls
    }
}
