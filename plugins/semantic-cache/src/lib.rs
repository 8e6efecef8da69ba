//! Semantic cache: serves a stored response when a new prompt means the same
//! as one answered before.
//!
//! `lookup` embeds the prompt with the host's model and searches the host's
//! vector store; `completed` stores the fresh response under the same
//! embedding. The namespace holds the model and every sampling setting that
//! changes the output, so a response is only served to requests that would
//! have been generated the same way. Entries live in the host's vector store
//! (shared by instances and, with Redis, by replicas); instance memory only
//! keeps the embeddings of requests in flight, to avoid embedding twice.

#[path = "../../shared/config_json.rs"]
mod config_json;
#[path = "../../shared/fingerprint.rs"]
mod fingerprint;
mod rules;
#[cfg(test)]
mod tests;

use fingerprint::Fingerprint;
use levee_plugin_sdk::host::{self, Level};
use levee_plugin_sdk::{CacheHit, Choice, Hook, LookupResult, Policy, Request, Response, Usage, export};
use rules::{Config, Controls};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;

/// Embeddings of requests between `lookup` and `completed` kept at most.
const IN_FLIGHT_EMBEDDINGS: usize = 512;

/// The semantic-cache policy.
pub struct SemanticCache {
    config: Config,
    /// Embeddings computed in `lookup`, by request id, with the prompt's
    /// fingerprint so that a reused id never picks up another prompt's vector.
    embeddings: HashMap<String, (String, Vec<f32>)>,
    /// Whether this instance already logged a host failure.
    logged_error: bool,
}

/// What is stored with each vector.
#[derive(Debug, Serialize, Deserialize)]
struct Entry {
    /// The generated choices: text and finish reason.
    choices: Vec<(String, String)>,
    /// Completion tokens over all choices.
    completion_tokens: u32,
    /// The max tokens the response was generated with.
    max_tokens: u32,
}

impl Entry {
    /// Whether this response is what `request` would have generated: the
    /// same length limit, or every choice ended before any limit could cut it.
    fn serves(&self, request: &Request) -> bool {
        let ended_by_stop = self.choices.iter().all(|(_, finish)| finish == "stop");
        let per_choice = self.completion_tokens.div_ceil(request.n.max(1));
        self.max_tokens == request.max_tokens || (ended_by_stop && per_choice <= request.max_tokens)
    }

    fn response(&self) -> Response {
        Response {
            choices: self
                .choices
                .iter()
                .map(|(text, finish)| Choice { text: text.clone(), finish_reason: finish.clone() })
                .collect(),
            completion_tokens: self.completion_tokens,
        }
    }
}

impl Policy for SemanticCache {
    const HOOKS: &'static [Hook] = &[Hook::Lookup, Hook::Completed];

    fn init(json: &str) -> Result<Self, String> {
        let config: Config = config_json::parse("semantic-cache", json)?;
        config.validate()?;
        Ok(Self { config, embeddings: HashMap::new(), logged_error: false })
    }

    fn lookup(&mut self, request: &Request) -> LookupResult {
        let settings = self.config.settings(request);
        let controls = Controls::of(request);
        if !settings.cache {
            host::counter_add("skipped", 1);
            return LookupResult::Miss;
        }
        if controls.no_cache || controls.no_store {
            host::counter_add("bypassed", 1);
            return LookupResult::Miss;
        }
        // Under degradation the host may accept entries below the normal threshold.
        let threshold = request.min_similarity.map_or(settings.threshold, |floor| floor.min(settings.threshold));
        let Some(vector) = self.embed(request) else { return LookupResult::Miss };
        let found = host::vector_search(
            &namespace(request, self.config.per_tenant),
            &vector,
            self.config.candidates,
            threshold,
        );
        self.remember(request, vector);
        let matches = match found {
            Ok(matches) => matches,
            Err(error) => {
                self.note_error("vector search", &error);
                return LookupResult::Miss;
            }
        };
        let usable = matches.iter().find_map(|m| {
            let entry: Entry = serde_json::from_slice(&m.payload).ok()?;
            entry.serves(request).then_some((m.score, entry))
        });
        match usable {
            Some((score, entry)) => {
                host::counter_add("hits", 1);
                if score < settings.threshold {
                    host::counter_add("hits_below_threshold", 1);
                }
                host::gauge_set("similarity", f64::from(score));
                LookupResult::Hit(CacheHit { response: entry.response(), similarity: score.clamp(0.0, 1.0) })
            }
            None => {
                host::counter_add("misses", 1);
                LookupResult::Miss
            }
        }
    }

    fn completed(&mut self, request: &Request, response: &Response, usage: &Usage) {
        let remembered = self.embeddings.remove(&request.id);
        // Served from a cache, shared from another request's generation (that
        // one stores it) or failed: nothing new to store.
        if usage.cached || usage.coalesced || usage.error_status != 0 || response.choices.is_empty() {
            return;
        }
        let settings = self.config.settings(request);
        let controls = Controls::of(request);
        if !settings.cache || controls.no_store {
            return;
        }
        let ttl_ms = match controls.ttl_secs {
            Some(0) => return,
            Some(secs) => secs.min(self.config.max_ttl_secs).saturating_mul(1000),
            None => settings.ttl_ms,
        };
        let vector = match remembered {
            Some((prompt, vector)) if prompt == prompt_fingerprint(request) => vector,
            _ => match self.embed(request) {
                Some(vector) => vector,
                None => return,
            },
        };
        let entry = Entry {
            choices: response.choices.iter().map(|c| (c.text.clone(), c.finish_reason.clone())).collect(),
            completion_tokens: response.completion_tokens,
            max_tokens: request.max_tokens,
        };
        let Ok(payload) = serde_json::to_vec(&entry) else { return };
        match host::vector_insert(&namespace(request, self.config.per_tenant), &vector, &payload, ttl_ms) {
            Ok(()) => host::counter_add("stores", 1),
            Err(error) => self.note_error("vector insert", &error),
        }
    }
}

impl SemanticCache {
    fn embed(&mut self, request: &Request) -> Option<Vec<f32>> {
        match host::embed(&request.prompt) {
            Ok(vector) if !vector.is_empty() => Some(vector),
            Ok(_) => {
                self.note_error("embed", "the embedding is empty");
                None
            }
            Err(error) => {
                self.note_error("embed", &error);
                None
            }
        }
    }

    fn remember(&mut self, request: &Request, vector: Vec<f32>) {
        // A request whose `completed` never came leaves an entry; start over
        // rather than grow without bound (this map is only a shortcut).
        if self.embeddings.len() >= IN_FLIGHT_EMBEDDINGS {
            self.embeddings.clear();
        }
        self.embeddings.insert(request.id.clone(), (prompt_fingerprint(request), vector));
    }

    fn note_error(&mut self, call: &str, error: &str) {
        host::counter_add("errors", 1);
        if !self.logged_error {
            self.logged_error = true;
            host::log(Level::Warn, &format!("semantic-cache: {call} failed (counted in errors from now on): {error}"));
        }
    }
}

/// The vector namespace of `request`: its model and a fingerprint of the
/// sampling settings that change the output (and of the tenant, with
/// `per_tenant`). Max tokens is not part of it; [`Entry::serves`] checks it
/// instead, so that responses that ended on their own serve requests with
/// any larger limit.
fn namespace(request: &Request, per_tenant: bool) -> String {
    let mut settings = Fingerprint::new();
    settings
        .field(&request.temperature.to_bits().to_le_bytes())
        .field(&request.top_p.to_bits().to_le_bytes())
        .field(&request.seed.map_or([0xff; 9], |seed| {
            let mut bytes = [0; 9];
            bytes[1..].copy_from_slice(&seed.to_le_bytes());
            bytes
        }))
        .field(&request.n.to_le_bytes())
        .field(&(request.stop.len() as u64).to_le_bytes());
    for stop in &request.stop {
        settings.field(stop.as_bytes());
    }
    if per_tenant {
        settings.field(request.tenant.as_bytes());
    }
    format!("{}:{}", request.model, settings.hex())
}

fn prompt_fingerprint(request: &Request) -> String {
    Fingerprint::new().field(request.prompt.as_bytes()).hex()
}

export!(SemanticCache);
