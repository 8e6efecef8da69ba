//! Write Levee traffic policies as WebAssembly components.
//!
//! A policy is a struct, an `impl` of [`Policy`], and one [`export!`] line.
//! Every hook has a default, so a plugin implements only the hooks it needs
//! and lists them in [`Policy::HOOKS`]; the host never calls the others.
//!
//! ```
//! use levee_plugin_sdk::{export, Admission, Hook, Load, Policy, Rejection, Request};
//!
//! /// Refuses prompts longer than a configured number of tokens.
//! struct MaxPrompt {
//!     limit: u32,
//! }
//!
//! impl Policy for MaxPrompt {
//!     const HOOKS: &'static [Hook] = &[Hook::Admit];
//!
//!     fn init(config: &str) -> Result<Self, String> {
//!         let config: levee_plugin_sdk::serde_json::Value =
//!             levee_plugin_sdk::serde_json::from_str(config).map_err(|e| e.to_string())?;
//!         let limit = config["limit"].as_u64().ok_or("config field `limit` (integer) is required")?;
//!         Ok(Self { limit: limit as u32 })
//!     }
//!
//!     fn admit(&mut self, request: &Request, _load: &Load) -> Admission {
//!         if request.prompt_tokens > self.limit {
//!             return Admission::Reject(Rejection {
//!                 status: 400,
//!                 retry_after_secs: None,
//!                 message: format!("prompt has {} tokens; the limit is {}", request.prompt_tokens, self.limit),
//!             });
//!         }
//!         Admission::Allow(None)
//!     }
//! }
//!
//! export!(MaxPrompt);
//!
//! // The native test harness runs the same policy on the host target.
//! let mut harness = levee_plugin_sdk::testing::Harness::<MaxPrompt>::new(r#"{"limit": 4}"#).unwrap();
//! let short = levee_plugin_sdk::testing::request("hi", 2);
//! let long = levee_plugin_sdk::testing::request("a much longer prompt", 9);
//! assert!(matches!(harness.admit(&short, &Default::default()), Admission::Allow(None)));
//! assert!(matches!(harness.admit(&long, &Default::default()), Admission::Reject(r) if r.status == 400));
//! ```
//!
//! Build a plugin with `cargo build --release --target wasm32-wasip2`; the
//! `.wasm` in `target/wasm32-wasip2/release/` is a component the host loads
//! directly.
//!
//! A plugin's own memory belongs to one instance: the host keeps several
//! instances of a plugin and replaces them on reload or after a fault. State
//! that must be shared or must last goes through [`host`]'s key-value,
//! token-bucket and vector imports.

#![deny(missing_docs)]

pub mod host;
pub mod testing;

/// The bindings generated from `wit/policy.wit`. Plugin authors use the
/// re-exported types at the crate root and [`host`] instead.
#[doc(hidden)]
#[allow(missing_docs)]
pub mod bindings {
    wit_bindgen::generate!({
        path: "../wit",
        world: "plugin",
        pub_export_macro: true,
        export_macro_name: "__export_plugin_world",
        default_bindings_module: "levee_plugin_sdk::bindings",
    });
}

pub use bindings::levee::policy::types::{
    Admission, CacheHit, Choice, Hook, Load, LookupResult, Manifest, Rejection, Request, Response, Route,
    ScaleDecision, ScaleSignals, Shaping, Usage,
};
pub use serde_json;
pub use wit_bindgen;

/// A traffic policy. Each hook has a default that decides nothing, so a
/// policy overrides only what it needs and names those hooks in
/// [`Policy::HOOKS`].
pub trait Policy: Sized + 'static {
    /// The hooks the host should call.
    const HOOKS: &'static [Hook];

    /// Builds the policy from its configuration table (JSON). An error
    /// refuses the plugin, at start or on reload, with this message.
    fn init(config: &str) -> Result<Self, String>;

    /// The hooks this instance declares in its manifest: [`Policy::HOOKS`]
    /// unless the policy chooses them from its configuration.
    fn hooks(&self) -> Vec<Hook> {
        Self::HOOKS.to_vec()
    }

    /// Admission control: allow (optionally at another priority) or reject.
    fn admit(&mut self, _request: &Request, _load: &Load) -> Admission {
        Admission::Allow(None)
    }

    /// Cache lookup: a hit is served instead of generating.
    fn lookup(&mut self, _request: &Request) -> LookupResult {
        LookupResult::Miss
    }

    /// A key under which identical in-flight requests share one generation.
    fn coalesce_key(&mut self, _request: &Request) -> Option<String> {
        None
    }

    /// Degradation under load; see [`no_shaping`] for the neutral answer.
    fn shape(&mut self, _request: &Request, _load: &Load) -> Shaping {
        no_shaping()
    }

    /// Called after the response was sent: cache fill, token accounting.
    fn completed(&mut self, _request: &Request, _response: &Response, _usage: &Usage) {}

    /// Autoscaling: the desired number of replicas and why.
    fn scale(&mut self, signals: &ScaleSignals) -> ScaleDecision {
        ScaleDecision {
            desired_replicas: signals.current_desired.max(1),
            reason: "this policy does not scale".to_string(),
        }
    }
}

/// A `shape` answer that changes nothing.
pub fn no_shaping() -> Shaping {
    Shaping {
        max_tokens: None,
        truncate_prompt_tokens: None,
        route_model: None,
        cache_min_similarity: None,
        shed: None,
        label: None,
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

/// Exports a [`Policy`] as the plugin's component: `export!(MyPolicy);`.
///
/// The policy is created by `init` and kept for the life of the instance.
#[rustfmt::skip]
#[macro_export]
macro_rules! export {
    ($policy:ty) => {
        const _: () = {
            use $crate::bindings::levee::policy::types as __types;

            ::std::thread_local! {
                static __LEVEE_POLICY: ::std::cell::RefCell<::std::option::Option<$policy>> =
                    const { ::std::cell::RefCell::new(::std::option::Option::None) };
            }

            fn __with<R>(f: impl FnOnce(&mut $policy) -> R) -> R {
                __LEVEE_POLICY.with_borrow_mut(|policy| match policy {
                    ::std::option::Option::Some(policy) => f(policy),
                    ::std::option::Option::None => panic!("levee: a hook was called before init"),
                })
            }

            struct __LeveeExport;

            impl $crate::bindings::Guest for __LeveeExport {
                fn init(
                    config: ::std::string::String,
                ) -> ::std::result::Result<__types::Manifest, ::std::string::String> {
                    let policy = <$policy as $crate::Policy>::init(&config)?;
                    let hooks = $crate::Policy::hooks(&policy);
                    __LEVEE_POLICY.with_borrow_mut(|slot| *slot = ::std::option::Option::Some(policy));
                    ::std::result::Result::Ok(__types::Manifest {
                        name: ::std::string::String::from(env!("CARGO_PKG_NAME")),
                        version: ::std::string::String::from(env!("CARGO_PKG_VERSION")),
                        hooks,
                    })
                }
                fn admit(request: __types::Request, load: __types::Load) -> __types::Admission {
                    __with(|p| $crate::Policy::admit(p, &request, &load))
                }
                fn lookup(request: __types::Request) -> __types::LookupResult {
                    __with(|p| $crate::Policy::lookup(p, &request))
                }
                fn coalesce_key(request: __types::Request) -> ::std::option::Option<::std::string::String> {
                    __with(|p| $crate::Policy::coalesce_key(p, &request))
                }
                fn shape(request: __types::Request, load: __types::Load) -> __types::Shaping {
                    __with(|p| $crate::Policy::shape(p, &request, &load))
                }
                fn completed(request: __types::Request, response: __types::Response, usage: __types::Usage) {
                    __with(|p| $crate::Policy::completed(p, &request, &response, &usage))
                }
                fn scale(signals: __types::ScaleSignals) -> __types::ScaleDecision {
                    __with(|p| $crate::Policy::scale(p, &signals))
                }
            }

            $crate::bindings::__export_plugin_world!(__LeveeExport with_types_in $crate::bindings);
        };
    };
}
