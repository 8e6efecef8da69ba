//! `levee.toml`: one typed tree, deserialized with `deny_unknown_fields`.
//!
//! Sub-structs are handed to the parts that own them; relative paths in the
//! file are resolved against the file's own directory.

use serde::Deserialize;
use std::path::{Path, PathBuf};

/// The whole configuration.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default, rename_all = "kebab-case")]
pub struct Config {
    /// HTTP listener and request limits.
    pub server: ServerConfig,
    /// The model to serve.
    pub model: ModelConfig,
    /// Engine scheduling and memory.
    pub engine: EngineSection,
    /// API keys; when any are configured, every API request needs one.
    pub api_keys: Vec<ApiKey>,
    /// The embedding model behind the `embed` import.
    pub embeddings: EmbeddingsConfig,
    /// Admin API.
    pub admin: AdminConfig,
    /// Settings shared by every plugin.
    pub plugin_runtime: PluginRuntimeConfig,
    /// The policy chain, in call order.
    pub plugins: Vec<PluginConfig>,
    /// Where plugin state lives: this process alone, or Redis shared by replicas.
    pub shared_state: SharedStateConfig,
    /// The scale ticker and its outputs.
    pub scaling: ScalingConfig,
}

/// HTTP listener settings and limits on what one request may ask for.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default, rename_all = "kebab-case")]
pub struct ServerConfig {
    /// Address to listen on.
    pub listen: String,
    /// Largest request body, bytes (larger: 413).
    pub max_body_bytes: usize,
    /// On SIGTERM, how long in-flight requests may take to finish, seconds.
    pub shutdown_grace_secs: f64,
    /// Most choices (`n`) per request.
    pub max_n: u32,
    /// Most prompts in one completions request.
    pub max_prompts: usize,
    /// Most stop sequences per request.
    pub max_stop: usize,
    /// `max_tokens` of a chat request that does not say.
    pub default_chat_max_tokens: u32,
    /// `max_tokens` of a completions request that does not say (OpenAI's default).
    pub default_completion_max_tokens: u32,
    /// Longest wait for a request's headers, seconds, counted from when the
    /// connection starts waiting for a request: a new connection, or one kept
    /// alive after a response. Slow senders and idle keep-alive connections
    /// are closed after it.
    pub header_read_timeout_secs: f64,
    /// Longest pause between two pieces of a request body, seconds (then 408).
    pub body_read_timeout_secs: f64,
    /// Slowest average rate a body may arrive at, bytes per second, after
    /// its first `body-read-timeout-secs`.
    pub min_body_bytes_per_sec: u64,
    /// Longest a response may wait for the client to take more of it, seconds;
    /// then the connection is closed.
    pub write_timeout_secs: f64,
    /// Most open client connections; past it a connection gets 503 and is closed.
    pub max_connections: usize,
    /// Threads for CPU-heavy request work (parsing, chat templates,
    /// tokenizing), kept off the async workers; 0 = half the cores, at least 1.
    pub prepare_threads: usize,
    /// Requests that may wait for those threads; past it a request gets 503.
    pub prepare_queue: usize,
    /// `/ready` fails once the engine has held work this long, seconds,
    /// without taking a step (counted from when the work arrived).
    pub ready_stall_secs: f64,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:8000".to_string(),
            max_body_bytes: 4 << 20,
            shutdown_grace_secs: 30.0,
            max_n: 16,
            max_prompts: 32,
            max_stop: 16,
            default_chat_max_tokens: 512,
            default_completion_max_tokens: 16,
            header_read_timeout_secs: 15.0,
            body_read_timeout_secs: 15.0,
            min_body_bytes_per_sec: 16 << 10,
            write_timeout_secs: 30.0,
            max_connections: 4096,
            prepare_threads: 0,
            prepare_queue: 256,
            ready_stall_secs: 30.0,
        }
    }
}

/// The model to serve.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default, rename_all = "kebab-case")]
pub struct ModelConfig {
    /// GGUF file, or a directory with `config.json`, safetensors and `tokenizer.json`.
    pub path: PathBuf,
    /// Name clients use in `model`; the file's stem by default.
    pub name: Option<String>,
}

impl Default for ModelConfig {
    fn default() -> Self {
        Self { path: PathBuf::from("models/SmolLM2-135M-Instruct.Q4_1.gguf"), name: None }
    }
}

impl ModelConfig {
    /// The name clients use.
    pub fn served_name(&self) -> String {
        self.name.clone().unwrap_or_else(|| {
            let stem = self.path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
            // "SmolLM2-135M-Instruct.Q4_1" -> "SmolLM2-135M-Instruct"
            stem.split('.').next().unwrap_or(&stem).to_string()
        })
    }
}

/// Engine scheduling and memory.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default, rename_all = "kebab-case")]
pub struct EngineSection {
    /// `cpu`, `cuda` (fails at start without a usable GPU) or `auto` (CUDA when a GPU is usable, else the CPU).
    pub device: String,
    /// KV cache memory, MiB (the CPU backend; on CUDA when `kv-device-fraction` is not set).
    pub kv_memory_mib: usize,
    /// On CUDA: the KV cache takes this fraction of the device memory left after weights and workspace, (0, 1].
    pub kv_device_fraction: Option<f32>,
    /// Token positions per KV block.
    pub block_size: usize,
    /// Most tokens (prefill and decode) in one step.
    pub max_batch_tokens: usize,
    /// Most prompt tokens of one request in one step (longer prompts are chunked).
    pub prefill_chunk: usize,
    /// Most sequences running at once.
    pub max_running: usize,
    /// Most requests waiting for the engine (more: 429).
    pub max_queue_requests: usize,
    /// Most prompt tokens waiting for the engine (more: 429).
    pub max_queued_tokens: usize,
    /// A request not started within this many seconds fails with 504.
    pub queue_timeout_secs: f64,
    /// Compute threads; 0 uses every core.
    pub threads: usize,
    /// Longest prompt plus completion; the model's context by default.
    pub max_context: Option<usize>,
}

impl Default for EngineSection {
    fn default() -> Self {
        Self {
            device: "auto".to_string(),
            kv_memory_mib: 256,
            kv_device_fraction: None,
            block_size: 16,
            max_batch_tokens: 512,
            prefill_chunk: 256,
            max_running: 32,
            max_queue_requests: 256,
            max_queued_tokens: 1 << 18,
            queue_timeout_secs: 60.0,
            threads: 0,
            max_context: None,
        }
    }
}

/// The embedding model plugins reach through `embed`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default, rename_all = "kebab-case")]
pub struct EmbeddingsConfig {
    /// Folder with `model.onnx`, the tokenizer files and `libonnxruntime.so`.
    /// `None` (the default) uses `models/minilm` when it exists and runs
    /// without embeddings otherwise; a folder named here must exist.
    pub path: Option<PathBuf>,
    /// ONNX Runtime threads.
    pub threads: usize,
}

impl Default for EmbeddingsConfig {
    fn default() -> Self {
        Self { path: None, threads: 1 }
    }
}

/// One API key and whom it belongs to.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct ApiKey {
    /// The secret clients send as `Authorization: Bearer <key>`.
    pub key: String,
    /// Tenant the key belongs to (what plugins see as `request.tenant`).
    pub tenant: String,
    /// Tier of the tenant (e.g. `free`, `paid`), for plugins.
    #[serde(default)]
    pub tier: Option<String>,
}

/// Admin API settings.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default, rename_all = "kebab-case")]
pub struct AdminConfig {
    /// Bearer token for `/admin/*`. Without one, the admin API refuses every call.
    pub token: Option<String>,
}

/// Settings of the plugin runtime as a whole.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default, rename_all = "kebab-case")]
pub struct PluginRuntimeConfig {
    /// Reload a plugin when its `.wasm` file changes on disk.
    pub watch: bool,
    /// How often the watched files are checked, in milliseconds.
    pub watch_interval_ms: u64,
    /// Granularity of deadlines: the epoch ticks this often, in microseconds.
    pub epoch_tick_us: u64,
    /// Instances all plugins together may have at once (pooling allocator slots).
    pub max_instances: u32,
    /// Idle instances kept per plugin for reuse.
    pub idle_instances: usize,
    /// Largest memory cap any plugin may ask for, in MiB.
    pub max_memory_mib: u64,
    /// Consecutive faults after which a plugin is quarantined (skipped under its `on-fault` rule).
    pub quarantine_after: u32,
    /// Time budget for `init`, in milliseconds.
    pub init_budget_ms: f64,
    /// Most text a cache hit may carry (over all its choices), bytes; a
    /// larger hit is a malformed decision.
    pub max_hit_bytes: usize,
    /// Time one call may spend in the embedding model (waiting for its
    /// turn and embedding) without it counting against its time budget, in
    /// milliseconds; past it the model answers "busy".
    pub host_wait_ms: u64,
    /// Threads plugin code runs on, apart from the server's async workers
    /// (0: one per core).
    pub threads: usize,
}

impl Default for PluginRuntimeConfig {
    fn default() -> Self {
        Self {
            watch: true,
            watch_interval_ms: 500,
            epoch_tick_us: 500,
            max_instances: 256,
            idle_instances: 8,
            max_memory_mib: 256,
            quarantine_after: 5,
            init_budget_ms: 2000.0,
            // About a 32k-token context's worth of text.
            max_hit_bytes: 256 << 10,
            host_wait_ms: 1000,
            threads: 0,
        }
    }
}

/// Where the key-value, token-bucket and vector capabilities keep their state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum StateBackend {
    /// In this process only.
    #[default]
    Local,
    /// In Redis, shared by every replica that names the same server.
    Redis,
}

/// What a capability call does while Redis cannot be reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RedisErrorRule {
    /// Serve the call from this replica's local stores (limits become per replica).
    #[default]
    Open,
    /// Fail the call; the plugin applies its own rule for store errors.
    Closed,
}

/// State shared between replicas.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default, rename_all = "kebab-case")]
pub struct SharedStateConfig {
    /// `local` or `redis`.
    pub backend: StateBackend,
    /// Redis URL, `redis://host:port/db`.
    pub redis_url: String,
    /// Rule for calls made while Redis is unreachable.
    pub on_redis_error: RedisErrorRule,
    /// Longest wait for one Redis round trip, in milliseconds.
    pub timeout_ms: u64,
    /// After Redis failed, calls skip it for this long before trying again, in milliseconds.
    pub retry_interval_ms: u64,
    /// Prefix of every key Levee writes, so that deployments can share one Redis.
    pub key_prefix: String,
    /// Length the shared vector stream is trimmed to (approximately).
    pub vector_stream_max_entries: usize,
    /// Coalesce identical requests across replicas (one generation in the fleet).
    pub coalesce_across_replicas: bool,
    /// A replica following another's generation takes over after this long without progress, ms.
    pub follow_timeout_ms: u64,
}

impl Default for SharedStateConfig {
    fn default() -> Self {
        Self {
            backend: StateBackend::Local,
            redis_url: "redis://127.0.0.1:6379/0".to_string(),
            on_redis_error: RedisErrorRule::Open,
            timeout_ms: 50,
            retry_interval_ms: 1000,
            key_prefix: "levee:".to_string(),
            vector_stream_max_entries: 100_000,
            coalesce_across_replicas: true,
            follow_timeout_ms: 5000,
        }
    }
}

/// The scale ticker: how often it decides and what it tells the orchestrator.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default, rename_all = "kebab-case")]
pub struct ScalingConfig {
    /// Time between two scale decisions, in milliseconds.
    pub interval_ms: u64,
    /// Window of the arrival and completion rates and of the trends, in seconds.
    pub window_secs: f64,
    /// Time a new replica takes to become ready, in seconds (the autoscaler predicts this far ahead).
    pub warmup_secs: f64,
    /// A command run with the desired count when it changes (sites without Kubernetes).
    pub actuator: Option<ActuatorConfig>,
}

impl Default for ScalingConfig {
    fn default() -> Self {
        Self { interval_ms: 1000, window_secs: 30.0, warmup_secs: 60.0, actuator: None }
    }
}

/// The command actuator.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct ActuatorConfig {
    /// Program and arguments; `{replicas}` in any argument becomes the desired count
    /// (also passed as `LEVEE_DESIRED_REPLICAS`).
    pub command: Vec<String>,
    /// Least time between two runs, in seconds.
    #[serde(default = "default_actuator_interval")]
    pub min_interval_secs: f64,
    /// A run that takes longer is killed and counted as failed, in seconds.
    #[serde(default = "default_actuator_timeout")]
    pub timeout_secs: f64,
}

fn default_actuator_interval() -> f64 {
    30.0
}

fn default_actuator_timeout() -> f64 {
    60.0
}

/// What the host does when a plugin faults (trap, deadline, memory cap,
/// malformed decision) or is quarantined.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum OnFault {
    /// Carry on as if the plugin had decided nothing.
    #[default]
    Open,
    /// Refuse the request with 503.
    Closed,
}

/// Whether a plugin's decisions are applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Mode {
    /// Decisions are applied.
    #[default]
    Enforce,
    /// Decisions are counted and logged, never applied.
    Shadow,
}

/// One plugin of the chain.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct PluginConfig {
    /// Name used in logs, metrics and the admin API.
    pub name: String,
    /// Path of the component (`.wasm`).
    pub path: PathBuf,
    /// The plugin's own settings, passed to its `init` as JSON.
    #[serde(default)]
    pub config: toml::Table,
    /// Fault rule.
    #[serde(default)]
    pub on_fault: OnFault,
    /// Enforce or shadow.
    #[serde(default)]
    pub mode: Mode,
    /// Time budget of one hook call, in milliseconds.
    #[serde(default = "default_time_budget_ms")]
    pub time_budget_ms: f64,
    /// Memory cap of one instance, in MiB.
    #[serde(default = "default_memory_mib")]
    pub memory_mib: u64,
    /// Linear memory of all the plugin's instances together, in MiB
    /// (default: 512, or `memory-mib` when that is larger).
    #[serde(default)]
    pub memory_total_mib: Option<u64>,
    /// Most lines the plugin may log a second; the rest are dropped and counted.
    #[serde(default = "default_log_lines_per_sec")]
    pub log_lines_per_sec: f64,
    /// Most instances of this plugin alive at once (its share of
    /// `plugin-runtime.max-instances`); calls past it wait within their budget.
    #[serde(default = "default_plugin_instances")]
    pub max_instances: usize,
    /// Bytes of the plugin's key-value entries (keys, values and 64 bytes
    /// an entry); past it its least recently used entries go, and a single
    /// larger entry is refused.
    #[serde(default = "default_kv_max_bytes")]
    pub kv_max_bytes: u64,
    /// Largest single key-value entry (key, value and 64 bytes), with
    /// either backend: a larger `kv.set` is refused.
    #[serde(default = "default_kv_max_value_bytes")]
    pub kv_max_value_bytes: u64,
    /// Token buckets the plugin may hold (least recently used go first).
    #[serde(default = "default_max_buckets")]
    pub max_buckets: u64,
    /// Vector namespaces the plugin may hold (least recently used go first).
    #[serde(default = "default_vector_max_namespaces")]
    pub vector_max_namespaces: usize,
    /// Bytes of all the plugin's vector namespaces together.
    #[serde(default = "default_vector_max_bytes")]
    pub vector_max_bytes: usize,
    /// Custom metric series the plugin may create; more are refused.
    #[serde(default = "default_metric_series")]
    pub metric_series: usize,
}

fn default_metric_series() -> usize {
    crate::capabilities::metrics::DEFAULT_SERIES
}

fn default_kv_max_bytes() -> u64 {
    crate::state::PluginBounds::default().kv_bytes
}

fn default_kv_max_value_bytes() -> u64 {
    crate::state::PluginBounds::default().kv_value_bytes
}

fn default_max_buckets() -> u64 {
    crate::state::PluginBounds::default().buckets
}

fn default_vector_max_namespaces() -> usize {
    crate::state::PluginBounds::default().vector_namespaces
}

fn default_vector_max_bytes() -> usize {
    crate::state::PluginBounds::default().vector_bytes
}

impl PluginConfig {
    /// Linear memory all the plugin's instances may hold together, MiB.
    pub fn memory_total_mib(&self) -> u64 {
        self.memory_total_mib.unwrap_or(self.memory_mib.max(512))
    }

    /// What the plugin may hold in the host's stores.
    pub fn bounds(&self) -> crate::state::PluginBounds {
        crate::state::PluginBounds {
            kv_bytes: self.kv_max_bytes,
            kv_value_bytes: self.kv_max_value_bytes,
            buckets: self.max_buckets,
            vector_namespaces: self.vector_max_namespaces,
            vector_bytes: self.vector_max_bytes,
            metric_series: self.metric_series,
        }
    }
}

fn default_plugin_instances() -> usize {
    16
}

fn default_log_lines_per_sec() -> f64 {
    20.0
}

fn default_time_budget_ms() -> f64 {
    10.0
}

fn default_memory_mib() -> u64 {
    64
}

/// A configuration that cannot be used, with a message naming the field.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The file is not valid TOML or has unknown or mistyped fields.
    #[error("{path}: {message}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The parser's message, naming the field.
        message: String,
    },
    /// A value is out of its range.
    #[error("{0}")]
    Invalid(String),
}

impl Config {
    /// Reads and validates `path`; relative plugin paths are resolved against its directory.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text =
            std::fs::read_to_string(path).map_err(|source| ConfigError::Read { path: path.to_owned(), source })?;
        let mut config = Self::parse(&text).map_err(|e| match e {
            ConfigError::Parse { message, .. } => ConfigError::Parse { path: path.to_owned(), message },
            other => other,
        })?;
        let base = path.parent().unwrap_or(Path::new("."));
        if config.model.path.is_relative() && base.join(&config.model.path).exists() {
            config.model.path = base.join(&config.model.path);
        }
        if let Some(path) = &config.embeddings.path
            && path.is_relative()
        {
            config.embeddings.path = Some(base.join(path));
        }
        for plugin in &mut config.plugins {
            if plugin.path.is_relative() {
                plugin.path = base.join(&plugin.path);
            }
        }
        Ok(config)
    }

    /// Parses and validates TOML text.
    pub fn parse(text: &str) -> Result<Self, ConfigError> {
        let config: Config = toml::from_str(text)
            .map_err(|e| ConfigError::Parse { path: PathBuf::from("levee.toml"), message: e.to_string() })?;
        config.validate()?;
        Ok(config)
    }

    /// Checks ranges and cross-field rules.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let server = &self.server;
        if server.max_n == 0 || server.max_prompts == 0 || !(1024..=1 << 30).contains(&server.max_body_bytes) {
            return Err(ConfigError::Invalid(format!(
                "server.max-n and server.max-prompts must be ≥ 1 and server.max-body-bytes between 1024 and 1 GiB; \
                 got {}, {}, {}",
                server.max_n, server.max_prompts, server.max_body_bytes
            )));
        }
        if server.default_chat_max_tokens == 0 || server.default_completion_max_tokens == 0 {
            return Err(ConfigError::Invalid(format!(
                "server.default-chat-max-tokens and server.default-completion-max-tokens must be ≥ 1; got {} and {}",
                server.default_chat_max_tokens, server.default_completion_max_tokens
            )));
        }
        if !(server.shutdown_grace_secs >= 0.0 && server.shutdown_grace_secs <= 3600.0) {
            return Err(ConfigError::Invalid(format!(
                "server.shutdown-grace-secs must be between 0 and 3600, got {}",
                server.shutdown_grace_secs
            )));
        }
        for (name, secs) in [
            ("server.header-read-timeout-secs", server.header_read_timeout_secs),
            ("server.body-read-timeout-secs", server.body_read_timeout_secs),
            ("server.ready-stall-secs", server.ready_stall_secs),
            ("server.write-timeout-secs", server.write_timeout_secs),
        ] {
            if !(secs > 0.0 && secs <= 3600.0) {
                return Err(ConfigError::Invalid(format!("{name} must be > 0 and ≤ 3600, got {secs}")));
            }
        }
        if server.min_body_bytes_per_sec == 0 || server.max_connections == 0 || server.prepare_queue == 0 {
            return Err(ConfigError::Invalid(format!(
                "server.min-body-bytes-per-sec, server.max-connections and server.prepare-queue must be ≥ 1; \
                 got {}, {}, {}",
                server.min_body_bytes_per_sec, server.max_connections, server.prepare_queue
            )));
        }
        if server.prepare_threads > 1024 {
            return Err(ConfigError::Invalid(format!(
                "server.prepare-threads must be ≤ 1024, got {}",
                server.prepare_threads
            )));
        }
        let engine = &self.engine;
        if engine.kv_memory_mib == 0
            || engine.block_size == 0
            || engine.max_batch_tokens == 0
            || engine.max_running == 0
            || engine.max_queue_requests == 0
            || engine.max_queued_tokens == 0
        {
            return Err(ConfigError::Invalid(
                "engine.kv-memory-mib, engine.block-size, engine.max-batch-tokens, engine.max-running, \
                 engine.max-queue-requests and engine.max-queued-tokens must be ≥ 1"
                    .into(),
            ));
        }
        if let Err(e) = engine.device.parse::<levee_gpu::BackendKind>() {
            return Err(ConfigError::Invalid(format!("engine.device: {e}")));
        }
        if let Some(f) = engine.kv_device_fraction
            && !(f > 0.0 && f <= 1.0)
        {
            return Err(ConfigError::Invalid(format!("engine.kv-device-fraction must be in (0, 1], got {f}")));
        }
        if !(engine.queue_timeout_secs > 0.0 && engine.queue_timeout_secs <= 86_400.0) {
            return Err(ConfigError::Invalid(format!(
                "engine.queue-timeout-secs must be > 0 and ≤ 86400, got {}",
                engine.queue_timeout_secs
            )));
        }
        let mut keys = std::collections::HashSet::new();
        for (i, key) in self.api_keys.iter().enumerate() {
            if key.key.len() < 8 || key.tenant.is_empty() {
                return Err(ConfigError::Invalid(format!(
                    "api-keys[{i}]: key must have at least 8 characters and tenant must not be empty"
                )));
            }
            if !keys.insert(key.key.as_str()) {
                return Err(ConfigError::Invalid(format!("api-keys[{i}]: the same key is configured twice")));
            }
        }
        let runtime = &self.plugin_runtime;
        if runtime.epoch_tick_us == 0 || runtime.epoch_tick_us > 100_000 {
            return Err(ConfigError::Invalid(format!(
                "plugin-runtime.epoch-tick-us must be between 1 and 100000, got {}",
                runtime.epoch_tick_us
            )));
        }
        if !(1..=10_000).contains(&runtime.max_instances) {
            return Err(ConfigError::Invalid(format!(
                "plugin-runtime.max-instances must be between 1 and 10000, got {}",
                runtime.max_instances
            )));
        }
        if !(1..=65_536).contains(&runtime.max_memory_mib) {
            return Err(ConfigError::Invalid(format!(
                "plugin-runtime.max-memory-mib must be between 1 and 65536, got {}",
                runtime.max_memory_mib
            )));
        }
        if !(1024..=64 << 20).contains(&runtime.max_hit_bytes) {
            return Err(ConfigError::Invalid(format!(
                "plugin-runtime.max-hit-bytes must be between 1024 and 64 MiB, got {}",
                runtime.max_hit_bytes
            )));
        }
        if !(1..=1000).contains(&runtime.quarantine_after) {
            return Err(ConfigError::Invalid(format!(
                "plugin-runtime.quarantine-after must be between 1 and 1000 faults in a row, got {}",
                runtime.quarantine_after
            )));
        }
        if !(runtime.init_budget_ms > 0.0 && runtime.init_budget_ms <= 600_000.0) {
            return Err(ConfigError::Invalid(format!(
                "plugin-runtime.init-budget-ms must be in (0, 600000], got {}",
                runtime.init_budget_ms
            )));
        }
        if runtime.threads > 1024 {
            return Err(ConfigError::Invalid(format!(
                "plugin-runtime.threads must be between 0 (one per core) and 1024, got {}",
                runtime.threads
            )));
        }
        if !(1..=600_000).contains(&runtime.host_wait_ms) {
            return Err(ConfigError::Invalid(format!(
                "plugin-runtime.host-wait-ms must be between 1 and 600000, got {}",
                runtime.host_wait_ms
            )));
        }
        let shared = &self.shared_state;
        if !(1..=60_000).contains(&shared.timeout_ms) || !(10..=600_000).contains(&shared.retry_interval_ms) {
            return Err(ConfigError::Invalid(format!(
                "shared-state.timeout-ms must be between 1 and 60000 and shared-state.retry-interval-ms between 10 and 600000; got {} and {}",
                shared.timeout_ms, shared.retry_interval_ms
            )));
        }
        if shared.backend == StateBackend::Redis && !shared.redis_url.starts_with("redis://") {
            return Err(ConfigError::Invalid(format!(
                "shared-state.redis-url must start with redis://, got {:?}",
                shared.redis_url
            )));
        }
        if !(10..=600_000).contains(&shared.follow_timeout_ms) {
            return Err(ConfigError::Invalid(format!(
                "shared-state.follow-timeout-ms must be between 10 and 600000, got {}",
                shared.follow_timeout_ms
            )));
        }
        if shared.vector_stream_max_entries == 0 {
            return Err(ConfigError::Invalid("shared-state.vector-stream-max-entries must be at least 1".into()));
        }
        let scaling = &self.scaling;
        if !(50..=600_000).contains(&scaling.interval_ms) {
            return Err(ConfigError::Invalid(format!(
                "scaling.interval-ms must be between 50 and 600000, got {}",
                scaling.interval_ms
            )));
        }
        let window_ok = scaling.window_secs > 0.0 && scaling.window_secs <= 3600.0;
        let warmup_ok = scaling.warmup_secs >= 0.0 && scaling.warmup_secs <= 3600.0;
        if !(window_ok && warmup_ok) {
            return Err(ConfigError::Invalid(format!(
                "scaling.window-secs must be in (0, 3600] and scaling.warmup-secs in [0, 3600]; got {} and {}",
                scaling.window_secs, scaling.warmup_secs
            )));
        }
        if let Some(actuator) = &scaling.actuator {
            if actuator.command.first().is_none_or(|p| p.is_empty()) {
                return Err(ConfigError::Invalid("scaling.actuator.command must name a program".into()));
            }
            if !((0.0..=86_400.0).contains(&actuator.min_interval_secs)
                && actuator.timeout_secs > 0.0
                && actuator.timeout_secs <= 3600.0)
            {
                return Err(ConfigError::Invalid(format!(
                    "scaling.actuator.min-interval-secs must be in [0, 86400] and timeout-secs in (0, 3600]; got {} and {}",
                    actuator.min_interval_secs, actuator.timeout_secs
                )));
            }
        }
        let mut names = std::collections::HashSet::new();
        let shares: usize = self.plugins.iter().map(|p| p.max_instances).sum();
        if shares > runtime.max_instances as usize {
            return Err(ConfigError::Invalid(format!(
                "the plugins' max-instances add up to {shares}, more than plugin-runtime.max-instances ({}): \
                 raise it or lower their shares, so that each plugin can always have its own",
                runtime.max_instances
            )));
        }
        for (i, plugin) in self.plugins.iter().enumerate() {
            if plugin.name.is_empty() || !plugin.name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
            {
                return Err(ConfigError::Invalid(format!(
                    "plugins[{i}].name must be non-empty letters, digits, '-' or '_', got {:?}",
                    plugin.name
                )));
            }
            if !names.insert(plugin.name.as_str()) {
                return Err(ConfigError::Invalid(format!("plugins[{i}].name {:?} is used twice", plugin.name)));
            }
            let bounds_ok = (1024..=1 << 40).contains(&plugin.kv_max_bytes)
                && (128..=1 << 30).contains(&plugin.kv_max_value_bytes)
                && (1..=100_000_000).contains(&plugin.max_buckets)
                && (1..=1_000_000).contains(&plugin.vector_max_namespaces)
                && (1024..=1 << 40).contains(&plugin.vector_max_bytes);
            if !bounds_ok {
                return Err(ConfigError::Invalid(format!(
                    "plugins[{i}] ({}): kv-max-bytes and vector-max-bytes must be between 1 KiB and 1 TiB, \
                     kv-max-value-bytes between 128 and 1 GiB, max-buckets between 1 and 100000000, \
                     vector-max-namespaces between 1 and 1000000; got {}, {}, {}, {}, {}",
                    plugin.name,
                    plugin.kv_max_bytes,
                    plugin.vector_max_bytes,
                    plugin.kv_max_value_bytes,
                    plugin.max_buckets,
                    plugin.vector_max_namespaces
                )));
            }
            if !(1..=100_000).contains(&plugin.metric_series) {
                return Err(ConfigError::Invalid(format!(
                    "plugins[{i}] ({}): metric-series must be between 1 and 100000, got {}",
                    plugin.name, plugin.metric_series
                )));
            }
            if plugin.max_instances == 0 || plugin.max_instances > runtime.max_instances as usize {
                return Err(ConfigError::Invalid(format!(
                    "plugins[{i}] ({}): max-instances must be between 1 and plugin-runtime.max-instances ({}), got {}",
                    plugin.name, runtime.max_instances, plugin.max_instances
                )));
            }
            if !(plugin.log_lines_per_sec >= 0.0 && plugin.log_lines_per_sec <= 10_000.0) {
                return Err(ConfigError::Invalid(format!(
                    "plugins[{i}] ({}): log-lines-per-sec must be between 0 and 10000, got {}",
                    plugin.name, plugin.log_lines_per_sec
                )));
            }
            if !(plugin.time_budget_ms > 0.0 && plugin.time_budget_ms <= 10_000.0) {
                return Err(ConfigError::Invalid(format!(
                    "plugins[{i}] ({}): time-budget-ms must be > 0 and ≤ 10000, got {}",
                    plugin.name, plugin.time_budget_ms
                )));
            }
            if plugin.memory_mib == 0 || plugin.memory_mib > runtime.max_memory_mib {
                return Err(ConfigError::Invalid(format!(
                    "plugins[{i}] ({}): memory-mib must be between 1 and plugin-runtime.max-memory-mib ({}), got {}",
                    plugin.name, runtime.max_memory_mib, plugin.memory_mib
                )));
            }
            if !(plugin.memory_mib..=1 << 20).contains(&plugin.memory_total_mib()) {
                return Err(ConfigError::Invalid(format!(
                    "plugins[{i}] ({}): memory-total-mib must be at least memory-mib ({}) and at most 1048576, got {}",
                    plugin.name,
                    plugin.memory_mib,
                    plugin.memory_total_mib()
                )));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_a_chain_with_defaults() {
        let config = Config::parse(
            r#"
            [[plugins]]
            name = "limits"
            path = "limits.wasm"
            on-fault = "closed"
            config = { rpm = 60 }

            [[plugins]]
            name = "cache"
            path = "cache.wasm"
            mode = "shadow"
            time-budget-ms = 2.5
            "#,
        )
        .unwrap();
        assert_eq!(config.plugins.len(), 2);
        assert_eq!(config.plugins[0].on_fault, OnFault::Closed);
        assert_eq!(config.plugins[0].config["rpm"].as_integer(), Some(60));
        assert_eq!(config.plugins[1].mode, Mode::Shadow);
        assert_eq!(config.plugins[1].time_budget_ms, 2.5);
        assert_eq!(config.plugins[1].memory_mib, 64);
    }

    #[test]
    fn the_example_configuration_parses() {
        let config = Config::parse(include_str!("../../levee.example.toml")).unwrap();
        assert_eq!(config.server.listen, "127.0.0.1:8000");
        assert_eq!(config.model.served_name(), "SmolLM2-135M-Instruct");
        assert_eq!(config.engine.kv_memory_mib, 256);
    }

    #[test]
    fn the_kubernetes_configuration_parses() {
        let manifest = include_str!("../../deploy/kubernetes/configmap.yaml");
        let (_, block) = manifest.split_once("levee.toml: |\n").expect("a levee.toml block");
        let toml: String = block.lines().map(|l| l.strip_prefix("    ").unwrap_or(l)).collect::<Vec<_>>().join("\n");
        let config = Config::parse(&toml).unwrap();
        assert_eq!(config.shared_state.backend, StateBackend::Redis);
        assert_eq!(config.plugins.len(), 5);
    }

    #[test]
    fn unknown_fields_and_bad_values_name_the_field() {
        let err = Config::parse("[[plugins]]\nname = \"a\"\npath = \"a.wasm\"\nbudget = 3\n").unwrap_err();
        assert!(err.to_string().contains("budget"), "{err}");
        let err = Config::parse("[[plugins]]\nname = \"a\"\npath = \"a.wasm\"\nmemory-mib = 100000\n").unwrap_err();
        assert!(err.to_string().contains("memory-mib"), "{err}");
        let err = Config::parse(
            "[[plugins]]\nname = \"a\"\npath = \"a.wasm\"\n[[plugins]]\nname = \"a\"\npath = \"b.wasm\"\n",
        )
        .unwrap_err();
        assert!(err.to_string().contains("used twice"), "{err}");
    }

    #[test]
    fn values_that_would_break_serving_are_refused_by_name() {
        for (toml, field) in [
            ("[server]\ndefault-chat-max-tokens = 0\n", "default-chat-max-tokens"),
            ("[engine]\nmax-queue-requests = 0\n", "max-queue-requests"),
            ("[engine]\nmax-queued-tokens = 0\n", "max-queued-tokens"),
            ("[plugin-runtime]\ninit-budget-ms = -1.0\n", "init-budget-ms"),
            ("[plugin-runtime]\ninit-budget-ms = nan\n", "init-budget-ms"),
            ("[plugin-runtime]\nmax-memory-mib = 17592186044416\n", "max-memory-mib"),
            ("[plugin-runtime]\nmax-instances = 2000000000\n", "max-instances"),
            ("[scaling.actuator]\ncommand = [\"true\"]\nmin-interval-secs = inf\n", "min-interval-secs"),
        ] {
            let err = Config::parse(toml).expect_err(toml).to_string();
            assert!(err.contains(field), "{toml}: {err}");
        }
    }
}
