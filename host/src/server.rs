//! The HTTP server as a whole: the API and admin routers together, the
//! plugin runtime's metrics, and graceful shutdown on SIGTERM or Ctrl-C.

use crate::admin::{self, AdminState};
use crate::api::{self, App};
use crate::capabilities::Capabilities;
use crate::capabilities::embeddings::MiniLm;
use crate::coalesce::{Flights, Remote};
use crate::config::Config;
use crate::listener::Serving;
use crate::pipeline::Pipeline;
use crate::plugins::{PluginError, PluginRuntime, PluginSystem};
use crate::scaling::{Scaler, Sources};
use crate::state::{RedisState, State};
use crate::telemetry::Telemetry;
use crate::tenancy::Tenancy;
pub use axum::Router;
use levee_gpu::{Engine, EngineConfig, EngineError, KvBudget, Model, ModelError};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// Why the server could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The model file is missing or unusable.
    #[error("model {path}: {source}")]
    Model {
        /// The configured path.
        path: std::path::PathBuf,
        /// Why.
        source: ModelError,
    },
    /// The model file does not exist.
    #[error("model file {0} does not exist; run scripts/setup.sh to fetch the default model, or pass --model")]
    MissingModel(std::path::PathBuf),
    /// The engine could not start.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// A plugin could not be loaded.
    #[error(transparent)]
    Plugins(#[from] PluginError),
    /// The embedding model could not be loaded.
    #[error(transparent)]
    Embeddings(#[from] crate::capabilities::embeddings::EmbeddingError),
    /// The shared-state settings are unusable.
    #[error("{0}")]
    SharedState(String),
}

/// A started server, not yet listening.
pub struct Levee {
    /// The API's state.
    pub app: Arc<App>,
    /// The admin routes' state.
    pub admin: AdminState,
    /// The plugin system (chain and reloader).
    pub plugins: PluginSystem,
}

impl Levee {
    /// Loads the model, starts the engine and the plugin chain from `config`.
    pub async fn start(config: &Config) -> Result<Self, StartError> {
        let path = config.model.path.clone();
        if !path.exists() {
            return Err(StartError::MissingModel(path));
        }
        let load_path = path.clone();
        let model = tokio::task::spawn_blocking(move || Model::load(&load_path))
            .await
            .map_err(|e| StartError::Engine(EngineError::Start(e.to_string())))?
            .map_err(|source| StartError::Model { path, source })?;
        let engine = Engine::start(model, engine_config(config))?;
        let name = config.model.served_name();
        tracing::info!(model = name, backend = engine.model().backend, context = engine.max_context(), "model loaded");
        tracing::info!("device: {}", engine.model().device_choice);

        let state = if config.shared_state.backend == crate::config::StateBackend::Redis {
            let redis = RedisState::new(&config.shared_state).map_err(StartError::SharedState)?;
            match redis.kv_get("levee:ping").await {
                Ok(_) => tracing::info!(url = config.shared_state.redis_url, "shared state in redis"),
                Err(e) => tracing::warn!(url = config.shared_state.redis_url, "redis not reachable at start: {e:?}"),
            }
            State::shared(Arc::new(redis))
        } else {
            State::local()
        };
        let mut caps = Capabilities::new(state);
        let embeddings = match &config.embeddings.path {
            Some(path) => Some(path.clone()),
            None => Some(std::path::PathBuf::from("models/minilm")).filter(|p| p.exists()),
        };
        match embeddings {
            Some(path) => {
                let threads = config.embeddings.threads;
                let model = tokio::task::spawn_blocking(move || MiniLm::shared(&path, threads))
                    .await
                    .map_err(|e| StartError::Engine(EngineError::Start(e.to_string())))??;
                caps.embedder = Some(model);
                tracing::info!("embedding model loaded");
            }
            None => tracing::info!("no embedding model (models/minilm is absent): plugins' embed calls will fail"),
        }
        let caps = Arc::new(caps);
        caps.start_sharing();
        let runtime = Arc::new(PluginRuntime::new(&config.plugin_runtime, caps.clone())?);
        let plugins = PluginSystem::start(runtime, &config.plugin_runtime, config.plugins.clone()).await?;
        tracing::info!(plugins = config.plugins.len(), "plugin chain loaded");

        let pipeline = Pipeline {
            engine,
            policies: plugins.policies.clone(),
            flights: Arc::new(match &caps.state.redis {
                Some(shared) if config.shared_state.coalesce_across_replicas => Flights::across_replicas(Remote::new(
                    shared.clone(),
                    Duration::from_millis(config.shared_state.follow_timeout_ms),
                )),
                _ => Flights::default(),
            }),
            telemetry: Arc::new(Telemetry::default()),
            model: name,
        };
        let scaler = Arc::new(Scaler::new(config.scaling.clone(), caps.state.redis.clone()));
        let sources = Sources {
            engine: pipeline.engine.clone(),
            telemetry: pipeline.telemetry.clone(),
            policies: pipeline.policies.clone(),
        };
        let app =
            Arc::new(App::new(pipeline, Tenancy::new(&config.api_keys), config.server.clone(), caps, scaler.clone()));
        let weak = Arc::downgrade(&app);
        tokio::spawn(scaler.run(sources, move || weak.upgrade().map(|app| app.draining.load(Ordering::Relaxed))));
        let admin = AdminState {
            policies: plugins.policies.clone(),
            reloader: plugins.reloader.clone(),
            token: config.admin.token.as_deref().map(Arc::from),
        };
        Ok(Self { app, admin, plugins })
    }

    /// The router for everything.
    pub fn router(&self) -> Router {
        router(self.app.clone(), self.admin.clone())
    }

    /// How the listener treats connections, from `[server]`, with `grace`
    /// for requests in flight after the signal.
    pub fn serving(&self, grace: Duration) -> Serving {
        let limits = &self.app.limits;
        Serving {
            header_read_timeout: Duration::from_secs_f64(limits.header_read_timeout_secs),
            write_timeout: Duration::from_secs_f64(limits.write_timeout_secs),
            max_connections: limits.max_connections,
            grace,
            stats: self.app.connections.clone(),
        }
    }
}

/// The engine settings from the configuration.
pub fn engine_config(config: &Config) -> EngineConfig {
    let e = &config.engine;
    EngineConfig {
        backend: e.device.parse().unwrap_or_default(),
        kv_device_fraction: e.kv_device_fraction,
        threads: e.threads,
        kv_budget: KvBudget::Bytes(e.kv_memory_mib << 20),
        block_size: e.block_size,
        max_batch_tokens: e.max_batch_tokens,
        prefill_chunk: e.prefill_chunk,
        max_running: e.max_running,
        max_queue_requests: e.max_queue_requests,
        max_queued_tokens: e.max_queued_tokens,
        queue_timeout: Duration::from_secs_f64(e.queue_timeout_secs),
        max_context: e.max_context,
    }
}

/// The whole router: the API and the admin routes, with OpenAI-shaped
/// 404 and 405 answers.
pub fn router(app: Arc<App>, admin: AdminState) -> Router {
    api::router(app).merge(admin::router(admin)).fallback(api::no_route).method_not_allowed_fallback(api::wrong_method)
}

/// Resolves when SIGTERM or Ctrl-C arrives.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
    tracing::info!("shutdown signal received; finishing in-flight requests");
}
