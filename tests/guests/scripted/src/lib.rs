//! Answers each hook as its configuration says, so one component can play
//! many roles in a chain test, and exercises the host imports:
//!
//! ```json
//! { "hooks": ["admit", "lookup", "coalesce-key", "shape", "completed", "scale"],
//!   "admit": { "allow": 3 } | { "reject": { "status": 429, "retry_after": 2, "message": "…" } },
//!   "bucket": { "capacity": 5, "refill": 0.5 },
//!   "lookup": { "hit": "cached text", "similarity": 0.97 } | { "hit_bytes": 1048576 },
//!   "coalesce_key": "key",
//!   "shape": { "max_tokens": 8, "truncate": 100, "route": "small", "floor": 0.8, "label": "capped",
//!              "shed": { "status": 503, "retry_after": 1, "message": "…" } },
//!   "scale": { "desired": 3, "reason": "…" },
//!   "count": true,
//!   "log": { "lines": 1000, "text": "a line\nwith a forged one" } }
//! ```
//!
//! With `log`, every call writes `lines` log lines of `text`. With
//! `"init_spin_ms": N`, `init` spins N milliseconds (by the host clock)
//! before answering, and with `"call_spin_ms": N` every hook call does. With `"fault_every": N`, every Nth hook call (counted
//! in the host key `faults`) traps. With `"kv_set_bytes": N`, every call
//! stores a new N-byte value; with `"bucket_flood": N`, every call takes
//! from N new token buckets; with `"vector_flood": N`, every call inserts
//! into N new vector namespaces. With `"embed": N`, every call embeds N
//! texts (`embed_text`, default "hello world") and counts the failures in
//! the host key `embed_errors`. With `"hold_bytes": N`, every call keeps
//! N more bytes of the instance's memory for as long as it lives.
//!
//! With `bucket`, `admit` takes one token from the host's bucket of the
//! request's tenant. With `count`, every call adds one to the host key
//! `calls:<hook>` and to the plugin counter `calls_<hook>`.

use levee_plugin_sdk::serde_json::Value;
use levee_plugin_sdk::{
    Admission, CacheHit, Hook, Load, LookupResult, Policy, Rejection, Request, Response, ScaleDecision, ScaleSignals,
    Shaping, Usage, export, host,
};

thread_local! {
    /// What `hold_bytes` keeps.
    static HELD: std::cell::RefCell<Vec<Vec<u8>>> = const { std::cell::RefCell::new(Vec::new()) };
}

struct Scripted {
    config: Value,
    hooks: Vec<Hook>,
}

fn hook_named(name: &str) -> Result<Hook, String> {
    Ok(match name {
        "admit" => Hook::Admit,
        "lookup" => Hook::Lookup,
        "coalesce-key" => Hook::CoalesceKey,
        "shape" => Hook::Shape,
        "completed" => Hook::Completed,
        "scale" => Hook::Scale,
        other => return Err(format!("unknown hook {other:?}")),
    })
}

fn rejection(value: &Value) -> Rejection {
    Rejection {
        status: value["status"].as_u64().unwrap_or(429) as u16,
        retry_after_secs: value["retry_after"].as_u64().map(|s| s as u32),
        message: value["message"].as_str().unwrap_or("refused by script").to_string(),
    }
}

impl Scripted {
    fn count(&self, hook: &str) {
        if let Some(ms) = self.config["call_spin_ms"].as_u64() {
            let until = host::now_ms() + ms;
            while host::now_ms() < until {}
        }
        if let Some(bytes) = self.config["kv_set_bytes"].as_u64() {
            let n = host::kv_incr("sets", 1, 0).unwrap_or(0);
            let _ = host::kv_set(&format!("big:{n}"), &vec![7u8; bytes as usize], 0);
        }
        for i in 0..self.config["bucket_flood"].as_u64().unwrap_or(0) {
            let n = host::kv_incr("buckets", 1, 0).unwrap_or(0);
            let _ = host::token_bucket(&format!("flood:{n}:{i}"), 1.0, 0.0, 1.0);
        }
        for i in 0..self.config["vector_flood"].as_u64().unwrap_or(0) {
            let n = host::kv_incr("namespaces", 1, 0).unwrap_or(0);
            let _ = host::vector_insert(&format!("flood:{n}:{i}"), &[1.0, 0.0], b"x", 0);
        }
        for _ in 0..self.config["embed"].as_u64().unwrap_or(0) {
            if host::embed(self.config["embed_text"].as_str().unwrap_or("hello world")).is_err() {
                let _ = host::kv_incr("embed_errors", 1, 0);
            }
        }
        if let Some(bytes) = self.config["hold_bytes"].as_u64() {
            HELD.with(|held| held.borrow_mut().push(vec![1u8; bytes as usize]));
        }
        if let Some(every) = self.config["fault_every"].as_i64().filter(|n| *n > 0) {
            let n = host::kv_incr("faults", 1, 0).unwrap_or(0);
            if n % every == 0 {
                panic!("scripted fault on call {n}");
            }
        }
        let log = &self.config["log"];
        for _ in 0..log["lines"].as_u64().unwrap_or(0) {
            host::log(host::Level::Info, log["text"].as_str().unwrap_or(""));
        }
        if self.config["count"].as_bool() == Some(true) {
            let _ = host::kv_incr(&format!("calls:{hook}"), 1, 0);
            host::counter_add(&format!("calls_{}", hook.replace('-', "_")), 1);
        }
    }
}

impl Policy for Scripted {
    // The real list is read from the configuration; see `hooks`.
    const HOOKS: &'static [Hook] = &[];

    fn init(config: &str) -> Result<Self, String> {
        let config: Value = levee_plugin_sdk::serde_json::from_str(config).map_err(|e| e.to_string())?;
        if let Some(ms) = config["init_spin_ms"].as_u64() {
            let until = host::now_ms() + ms;
            while host::now_ms() < until {}
        }
        let hooks = config["hooks"]
            .as_array()
            .ok_or("config field `hooks` (a list of hook names) is required")?
            .iter()
            .map(|h| hook_named(h.as_str().unwrap_or("")))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Scripted { config, hooks })
    }

    fn hooks(&self) -> Vec<Hook> {
        self.hooks.clone()
    }

    fn admit(&mut self, request: &Request, _load: &Load) -> Admission {
        self.count("admit");
        let bucket = &self.config["bucket"];
        if bucket.is_object() {
            let capacity = bucket["capacity"].as_f64().unwrap_or(1.0);
            let refill = bucket["refill"].as_f64().unwrap_or(0.0);
            return match host::token_bucket(&format!("tenant:{}", request.tenant), capacity, refill, 1.0) {
                Ok(state) if state.allowed => Admission::Allow(None),
                Ok(state) => Admission::Reject(Rejection {
                    status: 429,
                    retry_after_secs: Some(state.retry_after_secs.ceil() as u32),
                    message: format!("tenant {} is over its limit", request.tenant),
                }),
                Err(message) => Admission::Reject(Rejection { status: 503, retry_after_secs: Some(1), message }),
            };
        }
        let admit = &self.config["admit"];
        if admit["reject"].is_object() {
            return Admission::Reject(rejection(&admit["reject"]));
        }
        Admission::Allow(admit["allow"].as_i64().map(|p| p as i32))
    }

    fn lookup(&mut self, _request: &Request) -> LookupResult {
        self.count("lookup");
        let lookup = &self.config["lookup"];
        let generated = lookup["hit_bytes"].as_u64().map(|n| "x".repeat(n as usize));
        match lookup["hit"].as_str().or(generated.as_deref()) {
            Some(text) => LookupResult::Hit(CacheHit {
                response: levee_plugin_sdk::Response {
                    choices: vec![levee_plugin_sdk::Choice {
                        text: text.to_string(),
                        finish_reason: "stop".to_string(),
                    }],
                    completion_tokens: 1,
                },
                similarity: lookup["similarity"].as_f64().unwrap_or(1.0) as f32,
            }),
            None => LookupResult::Miss,
        }
    }

    fn coalesce_key(&mut self, _request: &Request) -> Option<String> {
        self.count("coalesce-key");
        self.config["coalesce_key"].as_str().map(str::to_string)
    }

    fn shape(&mut self, _request: &Request, _load: &Load) -> Shaping {
        self.count("shape");
        let shape = &self.config["shape"];
        Shaping {
            max_tokens: shape["max_tokens"].as_u64().map(|n| n as u32),
            truncate_prompt_tokens: shape["truncate"].as_u64().map(|n| n as u32),
            route_model: shape["route"].as_str().map(str::to_string),
            cache_min_similarity: shape["floor"].as_f64().map(|f| f as f32),
            shed: shape["shed"].is_object().then(|| rejection(&shape["shed"])),
            label: shape["label"].as_str().map(str::to_string),
        }
    }

    fn completed(&mut self, _request: &Request, _response: &Response, _usage: &Usage) {
        self.count("completed");
    }

    fn scale(&mut self, signals: &ScaleSignals) -> ScaleDecision {
        self.count("scale");
        let scale = &self.config["scale"];
        ScaleDecision {
            desired_replicas: scale["desired"].as_u64().map(|n| n as u32).unwrap_or(signals.replicas),
            reason: scale["reason"].as_str().unwrap_or("scripted").to_string(),
        }
    }
}

export!(Scripted);
