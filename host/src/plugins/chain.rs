//! The policy chain: the configured plugins in order, and the rules that
//! compose their decisions.
//!
//! - `admit`: the first reject wins; the first priority set wins.
//! - `lookup`: the first hit wins.
//! - `coalesce-key`: the first key wins.
//! - `shape`: answers merge conservatively (smallest caps, first route,
//!   lowest cache floor); any shed refuses the request.
//! - `completed`: every plugin that declared it is called.
//! - `scale`: the first enforcing plugin that declared it owns the decision.
//!
//! A plugin in shadow mode is called like any other, but its decisions are
//! only counted (and logged at debug level), never applied. A fault, or a
//! quarantined plugin, is answered by the plugin's `on-fault` rule: `open`
//! carries on as if it had decided nothing, `closed` refuses the request.

use super::bindings::{
    Admission, CacheHit, Hook, Load, LookupResult, Request, Response, ScaleDecision, ScaleSignals, Shaping, Usage,
};
use super::instance::LoadedPlugin;
use super::stats::Fault;
use crate::config::{Mode, OnFault};
use arc_swap::ArcSwap;
use std::future::Future;
use std::sync::Arc;

/// A request refused by the chain: a plugin's reject or shed, or a fault
/// under `on-fault = closed`.
#[derive(Debug, Clone, PartialEq)]
pub struct Refusal {
    /// The plugin that refused.
    pub plugin: String,
    /// HTTP status.
    pub status: u16,
    /// Seconds for `Retry-After`.
    pub retry_after_secs: Option<u32>,
    /// Message for the client.
    pub message: String,
}

impl Refusal {
    fn fault(plugin: &LoadedPlugin, fault: &Fault) -> Self {
        Self {
            plugin: plugin.name.to_string(),
            status: 503,
            retry_after_secs: Some(1),
            message: format!("policy plugin `{}` {fault}; the request is refused (on-fault = closed)", plugin.name),
        }
    }
}

/// A cache hit and the plugin that served it.
#[derive(Debug, Clone)]
pub struct ServedHit {
    /// The plugin.
    pub plugin: String,
    /// What it returned.
    pub hit: CacheHit,
}

/// One immutable version of the whole chain. A request takes one snapshot
/// and makes every hook call on it, so it is answered by exactly one
/// version of each plugin even while a reload swaps the chain.
pub struct Chain {
    plugins: Vec<Arc<LoadedPlugin>>,
}

impl Chain {
    /// A chain of `plugins`, called in this order.
    pub fn new(plugins: Vec<Arc<LoadedPlugin>>) -> Self {
        Self { plugins }
    }

    /// The plugins, in order.
    pub fn plugins(&self) -> &[Arc<LoadedPlugin>] {
        &self.plugins
    }

    /// Whether any plugin declared `hook`.
    pub fn declares(&self, hook: Hook) -> bool {
        self.plugins.iter().any(|p| p.declares(hook))
    }

    fn participants(&self, hook: Hook) -> impl Iterator<Item = &Arc<LoadedPlugin>> {
        self.plugins.iter().filter(move |p| p.declares(hook))
    }

    /// Calls a hook on `plugin` under its quarantine and fault rules:
    /// `Ok(Some)` is a decision, `Ok(None)` means carry on without one.
    async fn guarded<'p, T, F>(
        plugin: &'p LoadedPlugin,
        call: impl FnOnce(&'p LoadedPlugin) -> F,
    ) -> Result<Option<T>, Refusal>
    where
        F: Future<Output = Result<T, Fault>>,
    {
        let outcome = if plugin.stats.quarantined() { Err(Fault::Quarantined) } else { call(plugin).await };
        match outcome {
            Ok(value) => Ok(Some(value)),
            Err(fault) => match plugin.on_fault() {
                OnFault::Open => Ok(None),
                OnFault::Closed => Err(Refusal::fault(plugin, &fault)),
            },
        }
    }

    /// Applies a decision unless the plugin is in shadow mode, where a
    /// decision that would have changed the outcome is only counted.
    fn applies(plugin: &LoadedPlugin, changes_outcome: bool, hook: Hook) -> bool {
        if plugin.mode() == Mode::Enforce {
            return true;
        }
        if changes_outcome {
            plugin.stats.record_shadow_override();
            tracing::debug!(plugin = &*plugin.name, hook = hook.name(), "shadow decision not applied");
        }
        false
    }

    /// `admit` through the chain: the priority to run at (when a plugin set
    /// one), or the refusal of the first plugin that rejected.
    pub async fn admit(&self, request: &Arc<Request>, load: &Load) -> Result<Option<i32>, Refusal> {
        let mut priority = None;
        for plugin in self.participants(Hook::Admit) {
            let Some(admission) = Self::guarded(plugin, |p| p.admit(request, load)).await? else { continue };
            let changes = !matches!(admission, Admission::Allow(None));
            if !Self::applies(plugin, changes, Hook::Admit) {
                continue;
            }
            match admission {
                Admission::Reject(r) => {
                    return Err(Refusal {
                        plugin: plugin.name.to_string(),
                        status: r.status,
                        retry_after_secs: r.retry_after_secs,
                        message: r.message,
                    });
                }
                Admission::Allow(p) => priority = priority.or(p),
            }
        }
        Ok(priority)
    }

    /// `lookup` through the chain: the first hit.
    pub async fn lookup(&self, request: &Arc<Request>) -> Result<Option<ServedHit>, Refusal> {
        for plugin in self.participants(Hook::Lookup) {
            let Some(LookupResult::Hit(hit)) = Self::guarded(plugin, |p| p.lookup(request)).await? else { continue };
            if Self::applies(plugin, true, Hook::Lookup) {
                return Ok(Some(ServedHit { plugin: plugin.name.to_string(), hit }));
            }
        }
        Ok(None)
    }

    /// `coalesce-key` through the chain: the first key.
    pub async fn coalesce_key(&self, request: &Arc<Request>) -> Result<Option<String>, Refusal> {
        for plugin in self.participants(Hook::CoalesceKey) {
            let Some(Some(key)) = Self::guarded(plugin, |p| p.coalesce_key(request)).await? else { continue };
            if Self::applies(plugin, true, Hook::CoalesceKey) {
                return Ok(Some(key));
            }
        }
        Ok(None)
    }

    /// `shape` through the chain, merged; a shed is a refusal.
    pub async fn shape(&self, request: &Arc<Request>, load: &Load) -> Result<Shaping, Refusal> {
        let mut merged = Shaping::none();
        let mut labels = Vec::new();
        for plugin in self.participants(Hook::Shape) {
            let Some(shaping) = Self::guarded(plugin, |p| p.shape(request, load)).await? else { continue };
            if !Self::applies(plugin, shaping != Shaping::none(), Hook::Shape) {
                continue;
            }
            if let Some(shed) = shaping.shed {
                return Err(Refusal {
                    plugin: plugin.name.to_string(),
                    status: shed.status,
                    retry_after_secs: shed.retry_after_secs,
                    message: shed.message,
                });
            }
            merged.max_tokens = min_some(merged.max_tokens, shaping.max_tokens);
            merged.truncate_prompt_tokens = min_some(merged.truncate_prompt_tokens, shaping.truncate_prompt_tokens);
            merged.route_model = merged.route_model.or(shaping.route_model);
            merged.cache_min_similarity = match (merged.cache_min_similarity, shaping.cache_min_similarity) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            labels.extend(shaping.label);
        }
        if !labels.is_empty() {
            merged.label = Some(labels.join(","));
        }
        Ok(merged)
    }

    /// `completed` on every plugin that declared it; faults are counted and
    /// logged, nothing is refused (the response is already sent).
    pub async fn completed(&self, request: &Arc<Request>, response: &Response, usage: &Usage) {
        for plugin in self.participants(Hook::Completed) {
            if !plugin.stats.quarantined() {
                let _ = plugin.completed(request, response, usage).await;
            }
        }
    }

    /// `scale` on every plugin that declared it; the decision of the first
    /// enforcing one, or `None` when no plugin owns scaling (or it faulted).
    pub async fn scale(&self, signals: &ScaleSignals) -> Option<(String, ScaleDecision)> {
        let mut owner = None;
        for plugin in self.participants(Hook::Scale) {
            if plugin.stats.quarantined() {
                continue;
            }
            let Ok(decision) = plugin.scale(signals).await else { continue };
            if Self::applies(plugin, owner.is_none(), Hook::Scale) && owner.is_none() {
                owner = Some((plugin.name.to_string(), decision));
            }
        }
        owner
    }
}

fn min_some(a: Option<u32>, b: Option<u32>) -> Option<u32> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// The current chain, swapped atomically by reloads.
pub struct Policies {
    current: ArcSwap<Chain>,
}

impl Policies {
    /// Starts with `chain`.
    pub fn new(chain: Chain) -> Self {
        Self { current: ArcSwap::from_pointee(chain) }
    }

    /// The chain to use for one whole request.
    pub fn snapshot(&self) -> Arc<Chain> {
        self.current.load_full()
    }

    /// Replaces the chain; requests holding the old snapshot finish on it.
    pub fn swap(&self, chain: Chain) {
        self.current.store(Arc::new(chain));
    }
}
