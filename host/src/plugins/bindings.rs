//! The one `bindgen!` site for `wit/policy.wit`: host-side types of the
//! `levee:policy@0.1.0` world. Everything else in the host uses these
//! re-exports.

mod generated {
    wasmtime::component::bindgen!({
        path: "../wit",
        world: "plugin",
        imports: { default: async },
        exports: { default: async },
        additional_derives: [PartialEq],
    });
}

pub use generated::levee::policy::types::{
    Admission, CacheHit, Choice, Hook, Load, LookupResult, Manifest, Rejection, Request, Response, Route,
    ScaleDecision, ScaleSignals, Shaping, Usage,
};
pub use generated::levee::policy::{embeddings, kv, metrics, ratelimit, runtime, types, vectors};
pub use generated::{Plugin, PluginPre};

impl Hook {
    /// Every hook, in call order.
    pub const ALL: [Hook; 6] =
        [Hook::Admit, Hook::Lookup, Hook::CoalesceKey, Hook::Shape, Hook::Completed, Hook::Scale];

    /// The hook's name in the WIT world.
    pub fn name(self) -> &'static str {
        match self {
            Hook::Admit => "admit",
            Hook::Lookup => "lookup",
            Hook::CoalesceKey => "coalesce-key",
            Hook::Shape => "shape",
            Hook::Completed => "completed",
            Hook::Scale => "scale",
        }
    }

    /// Position in [`Hook::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }
}

impl Shaping {
    /// A shaping that changes nothing.
    pub fn none() -> Self {
        Shaping {
            max_tokens: None,
            truncate_prompt_tokens: None,
            route_model: None,
            cache_min_similarity: None,
            shed: None,
            label: None,
        }
    }
}

impl Default for Load {
    fn default() -> Self {
        Load {
            queue_depth: 0,
            queued_tokens: 0,
            running: 0,
            kv_usage: 0.0,
            latency_p50_ms: 0.0,
            latency_p95_ms: 0.0,
            latency_p99_ms: 0.0,
            ttft_p50_ms: 0.0,
            ttft_p95_ms: 0.0,
            tokens_per_second: 0.0,
            replicas: 1,
        }
    }
}
