//! One request through the policy chain to the engine:
//! `admit` → `lookup` → `coalesce-key` → `shape` → engine, with `completed`
//! called off the response path once the response is out.
//!
//! The request holds one snapshot of the chain from start to finish, so a
//! reload in the middle never splits it between two plugin versions.

use crate::coalesce::{Flights, Subscription};
use crate::plugins::bindings::Route;
use crate::plugins::bindings::{self as wit, Hook};
use crate::plugins::{Chain, Policies, Refusal};
use crate::telemetry::Telemetry;
use crate::tenancy::Tenant;
use levee_gpu::{EngineError, EngineHandle, GenerationRequest, SamplingParams, TokenEvent, TokenStream};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

/// One prompt, rendered and tokenized.
#[derive(Debug, Clone)]
pub struct Prompt {
    /// The text the model sees.
    pub text: String,
    /// Its tokens.
    pub tokens: Vec<u32>,
}

/// A request that passed validation: what the pipeline takes.
#[derive(Debug, Clone)]
pub struct ValidRequest {
    /// Response id (`cmpl-…` or `chatcmpl-…`).
    pub id: String,
    /// Unix seconds.
    pub created: u64,
    /// Route.
    pub route: Route,
    /// Model name, as served.
    pub model: String,
    /// Prompts (one for chat).
    pub prompts: Vec<Prompt>,
    /// Most tokens to generate per choice.
    pub max_tokens: u32,
    /// Choices per prompt.
    pub n: u32,
    /// Sampling and stop rules.
    pub sampling: SamplingParams,
    /// Scheduling priority.
    pub priority: i32,
    /// SSE.
    pub stream: bool,
    /// Usage in the last SSE chunk.
    pub include_usage: bool,
    /// Who is asking.
    pub tenant: Tenant,
    /// Headers passed to policies.
    pub headers: Vec<(String, String)>,
}

/// Why a request did not get its generations.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PipelineError {
    /// A policy refused it.
    #[error("refused by policy: {0:?}")]
    Refused(Refusal),
    /// The engine could not take it.
    #[error(transparent)]
    Engine(#[from] EngineError),
}

/// Everything a request needs on its way to the engine.
pub struct Pipeline {
    /// The engine.
    pub engine: EngineHandle,
    /// The current policy chain.
    pub policies: Arc<Policies>,
    /// Generations shared by coalesced requests.
    pub flights: Arc<Flights>,
    /// Metrics and the load window.
    pub telemetry: Arc<Telemetry>,
    /// The served model's name.
    pub model: String,
}

/// A generation's events, from the engine directly or shared with others.
pub enum Live {
    /// This request's own generation.
    Own(TokenStream),
    /// A generation shared through coalescing (`leader` when this request started it).
    Shared {
        /// The shared events.
        subscription: Subscription,
        /// This request started the flight.
        leader: bool,
    },
}

impl Live {
    /// The next event; `None` after the last.
    pub async fn next(&mut self) -> Option<Result<TokenEvent, EngineError>> {
        match self {
            Live::Own(stream) => stream.next().await,
            Live::Shared { subscription, .. } => subscription.next().await,
        }
    }

    /// Whether this request's tokens count as generated here (not shared from another).
    pub fn generated_here(&self) -> bool {
        matches!(self, Live::Own(_) | Live::Shared { leader: true, .. })
    }
}

/// Where one choice comes from.
pub enum Source {
    /// A stored response.
    Cached(wit::Choice),
    /// A generation.
    Live(Live),
}

/// One choice of the response.
pub struct PlannedChoice {
    /// Index of the prompt it answers.
    pub prompt: usize,
    /// Its source.
    pub source: Source,
}

/// A request with every policy decision made and its generations started.
pub struct Plan {
    /// The validated request (prompts possibly truncated, caps applied).
    pub request: ValidRequest,
    /// The record policies saw, per prompt.
    pub records: Vec<Arc<wit::Request>>,
    /// The chain snapshot the request uses throughout.
    pub chain: Arc<Chain>,
    /// The choices, in response order (prompt-major, then `n`).
    pub choices: Vec<PlannedChoice>,
    /// `(plugin, similarity)` when a cache served the response.
    pub cache_hit: Option<(String, f32)>,
    /// Degradation applied, for `x-levee-degraded`.
    pub degraded: Option<String>,
    /// Some choice shares another request's generation.
    pub coalesced: bool,
    /// When the request arrived.
    pub started: Instant,
}

/// The first `n` choices of a cache hit, answering prompt `prompt`.
fn cached_choices(hit: wit::CacheHit, prompt: usize, n: u32) -> impl Iterator<Item = PlannedChoice> {
    hit.response.choices.into_iter().take(n as usize).map(move |c| PlannedChoice { prompt, source: Source::Cached(c) })
}

/// Whether the policy record describes everything that shapes this
/// request's answer. Log-probabilities, top-k, penalties, `ignore_eos` and
/// stop token ids are not in the record, so a cached answer could not honour
/// them: such requests are never looked up, and their record carries
/// `cache-control: no-store` so that no cache keeps their answer either.
fn recordable(sampling: &levee_gpu::SamplingParams) -> bool {
    sampling.logprobs.is_none()
        && sampling.top_k == 0
        && sampling.repetition_penalty == 1.0
        && sampling.frequency_penalty == 0.0
        && sampling.presence_penalty == 0.0
        && !sampling.ignore_eos
        && sampling.stop_token_ids.is_empty()
}

/// What a shared generation must agree on besides the plugin's key: every
/// sampling parameter and the exact prompt tokens (the record's prompt text
/// is a decoding of them). Stable across replicas of one build.
fn flight_fingerprint(sampling: &levee_gpu::SamplingParams, tokens: &[u32]) -> String {
    use sha2::{Digest, Sha256};
    let mut hash = Sha256::new();
    hash.update(format!("{sampling:?}").as_bytes());
    for t in tokens {
        hash.update(t.to_le_bytes());
    }
    hash.finalize().iter().take(8).map(|b| format!("{b:02x}")).collect()
}

fn record(request: &ValidRequest, prompt: usize) -> wit::Request {
    let p = &request.prompts[prompt];
    let mut headers = request.headers.clone();
    if !recordable(&request.sampling) {
        match headers.iter_mut().find(|(name, _)| name == "cache-control") {
            Some((_, value)) => value.push_str(", no-store"),
            None => headers.push(("cache-control".into(), "no-store".into())),
        }
    }
    wit::Request {
        id: request.id.clone(),
        tenant: request.tenant.name.clone(),
        tier: request.tenant.tier.clone(),
        model: request.model.clone(),
        route: request.route,
        prompt: p.text.clone(),
        prompt_tokens: p.tokens.len() as u32,
        max_tokens: request.max_tokens,
        temperature: request.sampling.temperature,
        top_p: request.sampling.top_p,
        seed: request.sampling.seed,
        n: request.n,
        stop: request.sampling.stop.clone(),
        priority: request.priority,
        stream: request.stream,
        headers,
        min_similarity: None,
    }
}

impl Pipeline {
    fn refused(&self, refusal: Refusal, counter: &std::sync::atomic::AtomicU64) -> PipelineError {
        counter.fetch_add(1, Ordering::Relaxed);
        PipelineError::Refused(refusal)
    }

    async fn lookup(
        &self,
        chain: &Chain,
        record: &Arc<wit::Request>,
        n: u32,
    ) -> Result<Option<(String, wit::CacheHit)>, PipelineError> {
        if !chain.declares(Hook::Lookup) {
            return Ok(None);
        }
        let counters = &self.telemetry.counters;
        match chain.lookup(record).await.map_err(PipelineError::Refused)? {
            Some(served) if served.hit.response.choices.len() >= n as usize => {
                counters.cache_hits.fetch_add(1, Ordering::Relaxed);
                Ok(Some((served.plugin, served.hit)))
            }
            _ => {
                counters.cache_misses.fetch_add(1, Ordering::Relaxed);
                Ok(None)
            }
        }
    }

    /// Runs the policy chain and starts the generations.
    pub async fn plan(&self, mut request: ValidRequest) -> Result<Plan, PipelineError> {
        let started = Instant::now();
        let chain = self.policies.snapshot();
        let load = self.telemetry.load(&self.engine.stats());
        let counters = &self.telemetry.counters;
        let mut records = Vec::with_capacity(request.prompts.len());
        let mut choices = Vec::new();
        let (mut cache_hit, mut degraded, mut coalesced) = (None, None, false);

        for prompt in 0..request.prompts.len() {
            let mut rec = Arc::new(record(&request, prompt));
            if let Some(priority) = chain.admit(&rec, &load).await.map_err(|r| self.refused(r, &counters.rejected))? {
                Arc::make_mut(&mut rec).priority = priority;
            }
            let lookup = recordable(&request.sampling);
            if lookup && let Some((plugin, hit)) = self.lookup(&chain, &rec, request.n).await? {
                cache_hit = Some((plugin, hit.similarity));
                choices.extend(cached_choices(hit, prompt, request.n));
                records.push(rec);
                continue;
            }
            let key = if request.n == 1 && chain.declares(Hook::CoalesceKey) {
                chain.coalesce_key(&rec).await.map_err(PipelineError::Refused)?
            } else {
                None
            };
            let shaping = chain.shape(&rec, &load).await.map_err(|r| self.refused(r, &counters.shed))?;
            let mut max_tokens = request.max_tokens;
            if let Some(cap) = shaping.max_tokens {
                max_tokens = max_tokens.min(cap);
                Arc::make_mut(&mut rec).max_tokens = max_tokens;
            }
            let mut tokens = request.prompts[prompt].tokens.clone();
            if let Some(keep) = shaping.truncate_prompt_tokens
                && (keep as usize) < tokens.len()
            {
                tokens.drain(..tokens.len() - keep as usize);
                Arc::make_mut(&mut rec).prompt_tokens = keep;
            }
            if let Some(model) = &shaping.route_model
                && *model != self.model
            {
                tracing::warn!(
                    model,
                    "a shape plugin routed to a model this server does not serve; serving the default"
                );
            }
            if shaping.label.is_some() {
                counters.degraded.fetch_add(1, Ordering::Relaxed);
                degraded = shaping.label.clone();
            }
            if let Some(floor) = shaping.cache_min_similarity
                && lookup
            {
                Arc::make_mut(&mut rec).min_similarity = Some(floor);
                if let Some((plugin, hit)) = self.lookup(&chain, &rec, request.n).await? {
                    cache_hit = Some((plugin, hit.similarity));
                    choices.extend(cached_choices(hit, prompt, request.n));
                    records.push(rec);
                    continue;
                }
            }
            for i in 0..request.n {
                let mut sampling = request.sampling.clone();
                if let Some(seed) = sampling.seed {
                    sampling.seed = Some(seed.wrapping_add(u64::from(i)));
                }
                let generation = GenerationRequest {
                    prompt: tokens.clone(),
                    max_tokens: max_tokens as usize,
                    priority: rec.priority,
                    sampling,
                };
                let live = match &key {
                    Some(key) => {
                        let flight_key = format!(
                            "{key}\u{1f}{max_tokens}\u{1f}{}",
                            flight_fingerprint(&generation.sampling, &tokens)
                        );
                        let (engine, telemetry) = (self.engine.clone(), self.telemetry.clone());
                        let start: crate::coalesce::Start = Box::new(move || {
                            telemetry.counters.generations.fetch_add(1, Ordering::Relaxed);
                            engine.submit(generation)
                        });
                        let (subscription, role) = self.flights.join(&flight_key, start).await?;
                        let leader = role == crate::coalesce::Role::Leader;
                        if !leader {
                            counters.coalesced.fetch_add(1, Ordering::Relaxed);
                            coalesced = true;
                        }
                        Live::Shared { subscription, leader }
                    }
                    None => {
                        counters.generations.fetch_add(1, Ordering::Relaxed);
                        Live::Own(self.engine.submit(generation)?)
                    }
                };
                choices.push(PlannedChoice { prompt, source: Source::Live(live) });
            }
            request.prompts[prompt].tokens = tokens;
            records.push(rec);
        }
        Ok(Plan { request, records, chain, choices, cache_hit, degraded, coalesced, started })
    }
}

/// What a finished response reports to `completed`, per prompt.
pub struct Finished {
    /// Prompt index.
    pub prompt: usize,
    /// Its choices' text and finish reasons.
    pub choices: Vec<wit::Choice>,
    /// Completion tokens over its choices.
    pub completion_tokens: u32,
    /// Time to the first token, ms.
    pub ttft_ms: f32,
}

/// Calls `completed` on the chain off the response path.
pub fn report_completed(
    plan_chain: Arc<Chain>,
    records: Vec<Arc<wit::Request>>,
    finished: Vec<Finished>,
    cached: bool,
    coalesced: bool,
    started: Instant,
) {
    if !plan_chain.declares(Hook::Completed) {
        return;
    }
    let total_ms = started.elapsed().as_secs_f32() * 1000.0;
    tokio::spawn(async move {
        for done in finished {
            let Some(record) = records.get(done.prompt) else { continue };
            let response = wit::Response { choices: done.choices, completion_tokens: done.completion_tokens };
            let usage = wit::Usage {
                prompt_tokens: record.prompt_tokens,
                completion_tokens: done.completion_tokens,
                ttft_ms: done.ttft_ms,
                total_ms,
                cached,
                coalesced,
                error_status: 0,
            };
            plan_chain.completed(record, &response, &usage).await;
        }
    });
}
