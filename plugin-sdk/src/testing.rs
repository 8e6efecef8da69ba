//! A native test harness: run a [`Policy`] under `cargo test` on the host
//! target, with the host's capabilities backed by in-memory fakes.
//!
//! The fakes live in a thread-local, so each test (each test thread) starts
//! from an empty store and a clock at [`START_MS`], and several harnesses in
//! one test share state the way instances of one plugin share the host's.
//! The clock moves only when a test calls [`advance_clock`].

use crate::{
    Admission, Hook, Load, LookupResult, Manifest, Policy, Request, Response, Route, ScaleDecision, ScaleSignals,
    Shaping, Usage,
};

/// The fake clock's reading when a test starts, in Unix milliseconds.
pub const START_MS: u64 = 1_700_000_000_000;

/// One policy instance, created by its `init`, with typed hook calls.
pub struct Harness<P: Policy> {
    policy: P,
    manifest: Manifest,
}

impl<P: Policy> Harness<P> {
    /// Calls `init` with `config` (JSON), as the host does.
    pub fn new(config: &str) -> Result<Self, String> {
        let policy = P::init(config)?;
        let manifest = Manifest {
            name: std::any::type_name::<P>().to_string(),
            version: "test".to_string(),
            hooks: policy.hooks(),
        };
        Ok(Self { policy, manifest })
    }

    /// The manifest the host would receive.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// Whether the host would call `hook`.
    pub fn declares(&self, hook: Hook) -> bool {
        self.manifest.hooks.contains(&hook)
    }

    /// The policy itself, for assertions on its state.
    pub fn policy(&mut self) -> &mut P {
        &mut self.policy
    }

    /// Calls `admit`.
    pub fn admit(&mut self, request: &Request, load: &Load) -> Admission {
        self.policy.admit(request, load)
    }

    /// Calls `lookup`.
    pub fn lookup(&mut self, request: &Request) -> LookupResult {
        self.policy.lookup(request)
    }

    /// Calls `coalesce-key`.
    pub fn coalesce_key(&mut self, request: &Request) -> Option<String> {
        self.policy.coalesce_key(request)
    }

    /// Calls `shape`.
    pub fn shape(&mut self, request: &Request, load: &Load) -> Shaping {
        self.policy.shape(request, load)
    }

    /// Calls `completed`.
    pub fn completed(&mut self, request: &Request, response: &Response, usage: &Usage) {
        self.policy.completed(request, response, usage)
    }

    /// Calls `scale`.
    pub fn scale(&mut self, signals: &ScaleSignals) -> ScaleDecision {
        self.policy.scale(signals)
    }
}

/// A completions request with `prompt` of `prompt_tokens` tokens, greedy,
/// 16 max tokens, tenant `test`, priority 0.
pub fn request(prompt: &str, prompt_tokens: u32) -> Request {
    Request {
        id: "req-test".to_string(),
        tenant: "test".to_string(),
        tier: None,
        model: "test-model".to_string(),
        route: Route::Completions,
        prompt: prompt.to_string(),
        prompt_tokens,
        max_tokens: 16,
        temperature: 0.0,
        top_p: 1.0,
        seed: None,
        n: 1,
        stop: Vec::new(),
        priority: 0,
        stream: false,
        headers: Vec::new(),
        min_similarity: None,
    }
}

/// Scale signals for one ready replica under `load`, nothing warming, a
/// 30-second warm-up and no trend.
pub fn signals(load: Load) -> ScaleSignals {
    ScaleSignals {
        load,
        queue_trend: 0.0,
        arrival_rate: 0.0,
        arrival_trend: 0.0,
        throughput_per_replica: 0.0,
        replicas: 1,
        warming_replicas: 0,
        warmup_secs: 30.0,
        current_desired: 1,
        secs_since_change: 0.0,
    }
}

/// A one-choice response with `text`, finished by `stop`.
pub fn response(text: &str, completion_tokens: u32) -> Response {
    Response {
        choices: vec![crate::Choice { text: text.to_string(), finish_reason: "stop".to_string() }],
        completion_tokens,
    }
}

/// Moves the fake clock forward by `ms`.
pub fn advance_clock(ms: u64) {
    fake::with(|host| host.clock_ms += ms);
}

/// The fake clock, in Unix milliseconds.
pub fn clock_ms() -> u64 {
    fake::with(|host| host.clock_ms)
}

/// The value of the plugin counter `name`.
pub fn counter(name: &str) -> u64 {
    fake::with(|host| host.counters.get(name).copied().unwrap_or(0))
}

/// The value of the plugin gauge `name`.
pub fn gauge(name: &str) -> Option<f64> {
    fake::with(|host| host.gauges.get(name).copied())
}

/// Every line the policy logged so far.
pub fn logs() -> Vec<String> {
    fake::with(|host| host.logs.clone())
}

/// Replaces the fake embedding model (by default a hashed bag of words:
/// texts that share words are similar, others are not).
pub fn set_embedder(embedder: impl Fn(&str) -> Vec<f32> + 'static) {
    fake::with(|host| host.embedder = Some(Box::new(embedder)));
}

/// Makes every host call that can fail return `Err(message)` (e.g. a
/// shared store that is down), or restores them with `None`.
pub fn fail_host_calls(message: Option<&str>) {
    fake::with(|host| host.failure = message.map(str::to_string));
}

#[doc(hidden)]
#[allow(missing_docs)]
pub mod fake {
    //! The in-memory host behind [`crate::host`] on native targets.

    use crate::host::{BucketState, Level, Match};
    use std::cell::RefCell;
    use std::collections::HashMap;

    const EMBEDDING_DIMS: usize = 64;

    /// A stored vector: the vector, its payload, and when it expires.
    type StoredVector = (Vec<f32>, Vec<u8>, Option<u64>);
    /// A replacement embedding model.
    pub(super) type Embedder = Box<dyn Fn(&str) -> Vec<f32>>;

    #[derive(Default)]
    pub(super) struct FakeHost {
        pub(super) clock_ms: u64,
        kv: HashMap<String, (Vec<u8>, Option<u64>)>,
        buckets: HashMap<String, (f64, u64)>,
        vectors: HashMap<String, Vec<StoredVector>>,
        pub(super) counters: HashMap<String, u64>,
        pub(super) gauges: HashMap<String, f64>,
        pub(super) logs: Vec<String>,
        pub(super) embedder: Option<Embedder>,
        pub(super) failure: Option<String>,
    }

    thread_local! {
        static HOST: RefCell<FakeHost> = RefCell::new(FakeHost { clock_ms: super::START_MS, ..FakeHost::default() });
    }

    pub(super) fn with<R>(f: impl FnOnce(&mut FakeHost) -> R) -> R {
        HOST.with_borrow_mut(f)
    }

    fn fallible<R>(f: impl FnOnce(&mut FakeHost) -> R) -> Result<R, String> {
        with(|host| match &host.failure {
            Some(message) => Err(message.clone()),
            None => Ok(f(host)),
        })
    }

    fn expiry(now: u64, ttl_ms: u64) -> Option<u64> {
        (ttl_ms > 0).then(|| now + ttl_ms)
    }

    fn live(now: u64, expires: Option<u64>) -> bool {
        expires.is_none_or(|at| at > now)
    }

    pub fn log(level: Level, message: &str) {
        with(|host| host.logs.push(format!("{level:?}: {message}")));
    }

    pub fn now_ms() -> u64 {
        with(|host| host.clock_ms)
    }

    pub fn kv_get(key: &str) -> Result<Option<Vec<u8>>, String> {
        fallible(|host| match host.kv.get(key) {
            Some((value, expires)) if live(host.clock_ms, *expires) => Some(value.clone()),
            _ => None,
        })
    }

    pub fn kv_set(key: &str, value: &[u8], ttl_ms: u64) -> Result<(), String> {
        fallible(|host| {
            let expires = expiry(host.clock_ms, ttl_ms);
            host.kv.insert(key.to_string(), (value.to_vec(), expires));
        })
    }

    pub fn kv_incr(key: &str, delta: i64, ttl_ms: u64) -> Result<i64, String> {
        let now = now_ms();
        let current = kv_get(key)?;
        let value = match current {
            Some(bytes) => {
                let text = String::from_utf8(bytes).map_err(|_| format!("value of `{key}` is not an integer"))?;
                text.parse::<i64>().map_err(|_| format!("value of `{key}` is not an integer"))?
            }
            None => 0,
        };
        let next = value.saturating_add(delta);
        fallible(|host| {
            let expires = match host.kv.get(key) {
                Some((_, expires)) if live(now, *expires) => *expires,
                _ => expiry(now, ttl_ms),
            };
            host.kv.insert(key.to_string(), (next.to_string().into_bytes(), expires));
            next
        })
    }

    pub fn kv_delete(key: &str) -> Result<(), String> {
        fallible(|host| {
            host.kv.remove(key);
        })
    }

    pub fn token_bucket(key: &str, capacity: f64, refill_per_sec: f64, cost: f64) -> Result<BucketState, String> {
        fallible(|host| {
            let now = host.clock_ms;
            let (tokens, last) = host.buckets.get(key).copied().unwrap_or((capacity, now));
            let elapsed = now.saturating_sub(last) as f64 / 1000.0;
            let tokens = (tokens + elapsed * refill_per_sec).min(capacity);
            let (tokens, state) = if cost <= tokens {
                let left = (tokens - cost).min(capacity);
                (left, BucketState { allowed: true, remaining: left, retry_after_secs: 0.0 })
            } else {
                let wait = if refill_per_sec > 0.0 { (cost - tokens) / refill_per_sec } else { f64::INFINITY };
                (tokens, BucketState { allowed: false, remaining: tokens, retry_after_secs: wait })
            };
            host.buckets.insert(key.to_string(), (tokens, now));
            state
        })
    }

    pub fn embed(text: &str) -> Result<Vec<f32>, String> {
        let custom = with(|host| host.embedder.take());
        let vector = match &custom {
            Some(embedder) => embedder(text),
            None => bag_of_words(text),
        };
        with(|host| host.embedder = custom);
        fallible(|_| vector)
    }

    /// Words hashed into a fixed number of buckets, normalised to unit length.
    fn bag_of_words(text: &str) -> Vec<f32> {
        let mut vector = vec![0.0f32; EMBEDDING_DIMS];
        for word in text.split(|c: char| !c.is_alphanumeric()).filter(|w| !w.is_empty()) {
            let hash = word
                .to_lowercase()
                .bytes()
                .fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3));
            vector[(hash % EMBEDDING_DIMS as u64) as usize] += 1.0;
        }
        let norm = vector.iter().map(|x| x * x).sum::<f32>().sqrt();
        if norm > 0.0 {
            vector.iter_mut().for_each(|x| *x /= norm);
        }
        vector
    }

    pub fn vector_insert(namespace: &str, vector: &[f32], payload: &[u8], ttl_ms: u64) -> Result<(), String> {
        fallible(|host| {
            let expires = expiry(host.clock_ms, ttl_ms);
            host.vectors.entry(namespace.to_string()).or_default().push((vector.to_vec(), payload.to_vec(), expires));
        })
    }

    pub fn vector_search(namespace: &str, vector: &[f32], k: u32, min_score: f32) -> Result<Vec<Match>, String> {
        fallible(|host| {
            let now = host.clock_ms;
            let mut matches: Vec<Match> = host
                .vectors
                .get(namespace)
                .into_iter()
                .flatten()
                .filter(|(_, _, expires)| live(now, *expires))
                .map(|(stored, payload, _)| Match {
                    score: stored.iter().zip(vector).map(|(a, b)| a * b).sum(),
                    payload: payload.clone(),
                })
                .filter(|m| m.score >= min_score)
                .collect();
            matches.sort_by(|a, b| b.score.total_cmp(&a.score));
            matches.truncate(k as usize);
            matches
        })
    }

    pub fn counter_add(name: &str, delta: u64) {
        with(|host| *host.counters.entry(name.to_string()).or_default() += delta);
    }

    pub fn gauge_set(name: &str, value: f64) {
        with(|host| {
            host.gauges.insert(name.to_string(), value);
        });
    }
}
