//! The Wasm engine behind every plugin: compilation, the pooling allocator,
//! the epoch ticker that drives deadlines, and the linker with the host
//! capabilities (and an empty WASI) that plugins import.

use super::bindings::{Plugin, PluginPre};
use super::instance::{CallSettings, LoadedPlugin};
use super::state::PluginState;
use super::stats::PluginStats;
use crate::capabilities::Capabilities;
use crate::config::{PluginConfig, PluginRuntimeConfig};
use sha2::{Digest, Sha256};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use wasmtime::component::{Component, HasSelf, Linker};
use wasmtime::{Engine, InstanceAllocationStrategy, PoolingAllocationConfig};

/// Why a plugin version could not be loaded. The previous version, if any,
/// keeps serving.
#[derive(Debug, thiserror::Error)]
pub enum PluginError {
    /// The component file could not be read.
    #[error("plugin {name}: cannot read {path}: {source}")]
    Read {
        /// Plugin name.
        name: String,
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The file is not a valid component, or not of the `levee:policy` world.
    #[error("plugin {name}: {path} is not a loadable levee:policy@0.1.0 component: {message}")]
    Compile {
        /// Plugin name.
        name: String,
        /// The file.
        path: PathBuf,
        /// The compiler's or linker's message.
        message: String,
    },
    /// Instantiation or `init` failed.
    #[error("plugin {name}: init failed: {message}")]
    Init {
        /// Plugin name.
        name: String,
        /// The plugin's own message, or the fault.
        message: String,
    },
    /// The Wasm engine could not be set up.
    #[error("plugin runtime: {0}")]
    Engine(String),
}

/// Compiles and instantiates plugins; one per process.
pub struct PluginRuntime {
    engine: Engine,
    linker: Linker<PluginState>,
    caps: Arc<Capabilities>,
    settings: PluginRuntimeConfig,
    exec: Executor,
}

/// The threads plugin code runs on, apart from the server's async workers:
/// a plugin that spends its whole budget computing, at full concurrency,
/// takes these threads' time, not the time of requests that never call it.
/// The operating system shares the cores between the two, and the server's
/// mostly idle workers are scheduled first when they wake.
pub struct Executor {
    runtime: Option<tokio::runtime::Runtime>,
}

impl Executor {
    /// `threads` workers named `levee-plugin`.
    pub fn new(threads: usize) -> std::io::Result<Self> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads.max(1))
            .thread_name("levee-plugin")
            .enable_all()
            .build()?;
        Ok(Self { runtime: Some(runtime) })
    }

    /// Where plugin work is spawned.
    pub fn handle(&self) -> tokio::runtime::Handle {
        match &self.runtime {
            Some(runtime) => runtime.handle().clone(),
            None => unreachable!("the executor's runtime lives until it is dropped"),
        }
    }
}

impl Drop for Executor {
    fn drop(&mut self) {
        // Dropped from async code too (a reload, a test): do not block.
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

/// A component's version: the first 16 hex digits of its SHA-256.
pub fn version_of(bytes: &[u8]) -> String {
    let digest = Sha256::digest(bytes);
    digest.iter().take(8).map(|b| format!("{b:02x}")).collect()
}

impl PluginRuntime {
    /// Sets up the engine (async, component model, epoch interruption,
    /// pooling allocator sized from `settings`) and starts the epoch ticker.
    pub fn new(settings: &PluginRuntimeConfig, caps: Arc<Capabilities>) -> Result<Self, PluginError> {
        let engine_error = |e: wasmtime::Error| PluginError::Engine(format!("{e:#}"));
        let instances = settings.max_instances;
        let mut pool = PoolingAllocationConfig::default();
        pool.total_component_instances(instances)
            .total_core_instances(instances * 4)
            .total_memories(instances * 2)
            .total_tables(instances * 4)
            .total_stacks(instances)
            .max_memory_size((settings.max_memory_mib as usize) << 20);
        let mut config = wasmtime::Config::new();
        config
            .wasm_component_model(true)
            // A reload compiles on one core, leaving the others to the requests in flight.
            .parallel_compilation(false)
            .epoch_interruption(true)
            .allocation_strategy(InstanceAllocationStrategy::Pooling(pool));
        let engine = Engine::new(&config).map_err(engine_error)?;

        let mut linker = Linker::new(&engine);
        wasmtime_wasi::p2::add_to_linker_async(&mut linker).map_err(engine_error)?;
        Plugin::add_to_linker::<PluginState, HasSelf<PluginState>>(&mut linker, |state| state).map_err(engine_error)?;

        spawn_epoch_ticker(&engine, Duration::from_micros(settings.epoch_tick_us))
            .map_err(|e| PluginError::Engine(format!("cannot start the epoch ticker: {e}")))?;
        let threads = match settings.threads {
            0 => std::thread::available_parallelism().map_or(2, |n| n.get()),
            n => n,
        };
        let exec =
            Executor::new(threads).map_err(|e| PluginError::Engine(format!("cannot start the plugin threads: {e}")))?;
        Ok(Self { engine, linker, caps, settings: settings.clone(), exec })
    }

    /// The shared host capabilities.
    pub fn capabilities(&self) -> &Arc<Capabilities> {
        &self.caps
    }

    /// Reads a plugin's component file.
    pub async fn read(&self, config: &PluginConfig) -> Result<Vec<u8>, PluginError> {
        tokio::fs::read(&config.path).await.map_err(|source| PluginError::Read {
            name: config.name.clone(),
            path: config.path.clone(),
            source,
        })
    }

    /// Compiles `bytes` (off the async threads), links it, and starts a
    /// first instance through `init`.
    pub async fn load(
        &self,
        config: &PluginConfig,
        bytes: Vec<u8>,
        stats: Arc<PluginStats>,
    ) -> Result<LoadedPlugin, PluginError> {
        let version = version_of(&bytes);
        let compile_error =
            |message: String| PluginError::Compile { name: config.name.clone(), path: config.path.clone(), message };
        let engine = self.engine.clone();
        let component = tokio::task::spawn_blocking(move || Component::new(&engine, &bytes))
            .await
            .map_err(|e| compile_error(e.to_string()))?
            .map_err(|e| compile_error(format!("{e:#}")))?;
        let pre = self.linker.instantiate_pre(&component).map_err(|e| compile_error(format!("{e:#}")))?;
        let pre = PluginPre::new(pre).map_err(|e| compile_error(format!("{e:#}")))?;
        let settings = CallSettings {
            budget: Duration::from_secs_f64(config.time_budget_ms / 1000.0),
            init_budget: Duration::from_secs_f64(self.settings.init_budget_ms / 1000.0),
            memory_bytes: (config.memory_mib as usize) << 20,
            // Idle instances hold the plugin's permits: never all of them.
            max_idle: self.settings.idle_instances.min(config.max_instances.saturating_sub(1).max(1)),
            quarantine_after: self.settings.quarantine_after,
            max_hit_bytes: self.settings.max_hit_bytes,
            max_instances: config.max_instances,
            host_wait: Duration::from_millis(self.settings.host_wait_ms),
            memory_total_bytes: (config.memory_total_mib() as usize) << 20,
        };
        self.caps.set_plugin_bounds(&config.name, config.bounds());
        let exec = self.exec.handle();
        LoadedPlugin::start(
            config.clone(),
            version,
            pre,
            (self.engine.clone(), exec),
            self.caps.clone(),
            settings,
            stats,
        )
        .await
        .map_err(|message| PluginError::Init { name: config.name.clone(), message })
    }
}

/// Advances the engine's epoch every `tick` until the engine is dropped.
fn spawn_epoch_ticker(engine: &Engine, tick: Duration) -> std::io::Result<()> {
    let weak = engine.weak();
    std::thread::Builder::new()
        .name("levee-epoch".into())
        .spawn(move || {
            while let Some(engine) = weak.upgrade() {
                engine.increment_epoch();
                drop(engine);
                std::thread::sleep(tick);
            }
        })
        .map(drop)
}
