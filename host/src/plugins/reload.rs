//! The reloader: an actor that owns the chain's configuration, rebuilds the
//! chain when a component changes on disk or an admin asks, and swaps it in
//! atomically. Compilation and `init` happen here, off the request path.
//!
//! A reload recompiles only the plugins whose bytes changed; the others keep
//! their loaded version (and warm instances). If any plugin fails to compile
//! or `init`, the whole reload is rejected and the old chain keeps serving.

use super::chain::{Chain, Policies};
use super::instance::LoadedPlugin;
use super::runtime::{PluginError, PluginRuntime, version_of};
use super::stats::PluginStats;
use crate::config::{PluginConfig, PluginRuntimeConfig};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime};
use tokio::sync::{mpsc, oneshot};

/// What a reload did, plugin by plugin.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ReloadReport {
    /// `(name, version)` of every plugin now serving.
    pub versions: Vec<(String, String)>,
    /// Names of the plugins that were recompiled.
    pub reloaded: Vec<String>,
}

type Reply = oneshot::Sender<Result<ReloadReport, String>>;

/// Asks the reloader for a reload.
#[derive(Clone)]
pub struct ReloadHandle {
    requests: mpsc::Sender<Reply>,
}

impl ReloadHandle {
    /// Reloads now; the error names the plugin that was rejected.
    pub async fn reload(&self) -> Result<ReloadReport, String> {
        let (reply, answer) = oneshot::channel();
        self.requests.send(reply).await.map_err(|_| "the plugin reloader has stopped".to_string())?;
        answer.await.map_err(|_| "the plugin reloader has stopped".to_string())?
    }
}

/// A file's identity for change detection.
type Fingerprint = Option<(SystemTime, u64)>;

fn fingerprint(config: &PluginConfig) -> Fingerprint {
    let meta = std::fs::metadata(&config.path).ok()?;
    Some((meta.modified().ok()?, meta.len()))
}

struct Reloader {
    runtime: Arc<PluginRuntime>,
    configs: Vec<PluginConfig>,
    policies: Arc<Policies>,
    stats: HashMap<String, Arc<PluginStats>>,
    seen: Vec<Fingerprint>,
}

impl Reloader {
    fn stats_for(&mut self, name: &str) -> Arc<PluginStats> {
        self.stats.entry(name.to_string()).or_default().clone()
    }

    /// Builds a chain from the files on disk, reusing loaded versions whose
    /// bytes did not change.
    async fn build(&mut self, current: Option<&Chain>) -> Result<(Chain, Vec<String>), PluginError> {
        let mut plugins = Vec::with_capacity(self.configs.len());
        let mut reloaded = Vec::new();
        for config in self.configs.clone() {
            let bytes = self.runtime.read(&config).await?;
            let version = version_of(&bytes);
            let existing = current
                .into_iter()
                .flat_map(|c| c.plugins())
                .find(|p| p.name.as_ref() == config.name && p.version == version);
            if let Some(plugin) = existing {
                plugins.push(plugin.clone());
                continue;
            }
            let stats = self.stats_for(&config.name);
            let plugin: LoadedPlugin = self.runtime.load(&config, bytes, stats).await?;
            tracing::info!(plugin = config.name, version = plugin.version, hooks = ?plugin.manifest.hooks, "plugin loaded");
            reloaded.push(config.name.clone());
            plugins.push(Arc::new(plugin));
        }
        Ok((Chain::new(plugins), reloaded))
    }

    async fn reload(&mut self) -> Result<ReloadReport, String> {
        self.seen = self.configs.iter().map(fingerprint).collect();
        let current = self.policies.snapshot();
        match self.build(Some(&current)).await {
            Ok((chain, reloaded)) => {
                let versions = chain.plugins().iter().map(|p| (p.name.to_string(), p.version.clone())).collect();
                if !reloaded.is_empty() {
                    self.policies.swap(chain);
                    // Only now, with every new version serving: a reload that
                    // failed part-way leaves the old versions and their quarantines.
                    for name in &reloaded {
                        if self.stats_for(name).reset_quarantine() {
                            tracing::info!(plugin = name, "quarantine lifted: a new version was loaded");
                        }
                    }
                }
                Ok(ReloadReport { versions, reloaded })
            }
            Err(error) => {
                tracing::error!("plugin reload rejected, the previous version keeps serving: {error}");
                Err(error.to_string())
            }
        }
    }

    fn changed_on_disk(&self) -> bool {
        self.configs.iter().zip(&self.seen).any(|(config, seen)| fingerprint(config) != *seen)
    }

    async fn run(mut self, mut requests: mpsc::Receiver<Reply>, watch: Option<Duration>) {
        let mut ticker = watch.map(tokio::time::interval);
        loop {
            let tick = async {
                match ticker.as_mut() {
                    Some(t) => t.tick().await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                request = requests.recv() => match request {
                    Some(reply) => {
                        let _ = reply.send(self.reload().await);
                    }
                    None => return,
                },
                _ = tick => {
                    if self.changed_on_disk() {
                        let _ = self.reload().await;
                    }
                }
            }
        }
    }
}

/// The running plugin system: the current chain and the reloader's handle.
pub struct PluginSystem {
    /// The current chain.
    pub policies: Arc<Policies>,
    /// Reload on demand.
    pub reloader: ReloadHandle,
}

impl PluginSystem {
    /// Loads every plugin of `configs` (failing if any cannot be loaded) and
    /// starts the reloader, which watches the files when `settings.watch` is set.
    pub async fn start(
        runtime: Arc<PluginRuntime>,
        settings: &PluginRuntimeConfig,
        configs: Vec<PluginConfig>,
    ) -> Result<Self, PluginError> {
        let mut reloader = Reloader {
            runtime,
            seen: configs.iter().map(fingerprint).collect(),
            configs,
            policies: Arc::new(Policies::new(Chain::new(Vec::new()))),
            stats: HashMap::new(),
        };
        let (chain, _) = reloader.build(None).await?;
        reloader.policies.swap(chain);
        let policies = reloader.policies.clone();
        let (tx, rx) = mpsc::channel(8);
        let watch = settings.watch.then(|| Duration::from_millis(settings.watch_interval_ms.max(10)));
        tokio::spawn(reloader.run(rx, watch));
        Ok(Self { policies, reloader: ReloadHandle { requests: tx } })
    }
}
