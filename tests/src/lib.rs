//! Shared set-up for Levee's cross-crate tests and benchmarks: the paths of
//! the Wasm guests that `build.rs` compiled, and a plugin system over them.

use levee::capabilities::Capabilities;
use levee::config::{Mode, OnFault, PluginConfig, PluginRuntimeConfig};
use levee::plugins::{PluginError, PluginRuntime, PluginSystem};
use std::path::PathBuf;
use std::sync::Arc;

/// Paths of the built guests, one constant per crate.
pub mod guests {
    include!(concat!(env!("OUT_DIR"), "/guests.rs"));
}

/// A chain entry for `path` with a JSON `config` (an object), failing open
/// and enforcing, with a 64 MiB cap and a one-second budget: tests check
/// decisions, and a loaded CI machine must not turn them into deadline faults.
pub fn plugin(name: &str, path: impl Into<PathBuf>, config: serde_json::Value) -> PluginConfig {
    let config: toml::Table = match serde_json::from_value(config) {
        Ok(table) => table,
        Err(e) => panic!("test plugin config must be a JSON object: {e}"),
    };
    PluginConfig {
        name: name.to_string(),
        path: path.into(),
        config,
        on_fault: OnFault::Open,
        mode: Mode::Enforce,
        time_budget_ms: 1000.0,
        memory_mib: 64,
        memory_total_mib: None,
        log_lines_per_sec: 20.0,
        max_instances: 16,
        kv_max_bytes: 64 << 20,
        kv_max_value_bytes: 1 << 20,
        max_buckets: 100_000,
        vector_max_namespaces: 64,
        vector_max_bytes: 256 << 20,
        metric_series: 256,
    }
}

/// Settings for tests: no file watching unless asked, few instances.
pub fn runtime_settings(watch: bool) -> PluginRuntimeConfig {
    PluginRuntimeConfig {
        watch,
        watch_interval_ms: 50,
        max_instances: 64,
        quarantine_after: 3,
        ..PluginRuntimeConfig::default()
    }
}

/// Starts a plugin system over `plugins` with fresh local capabilities.
pub async fn start(
    plugins: Vec<PluginConfig>,
    settings: PluginRuntimeConfig,
) -> Result<(PluginSystem, Arc<Capabilities>), PluginError> {
    let caps = Arc::new(Capabilities::local());
    let runtime = Arc::new(PluginRuntime::new(&settings, caps.clone())?);
    let system = PluginSystem::start(runtime, &settings, plugins).await?;
    Ok((system, caps))
}

/// A greedy completions request from `tenant` with `prompt`.
pub fn request(tenant: &str, prompt: &str) -> Arc<levee::plugins::bindings::Request> {
    Arc::new(levee::plugins::bindings::Request {
        id: "req-1".to_string(),
        tenant: tenant.to_string(),
        tier: None,
        model: "SmolLM2-135M-Instruct".to_string(),
        route: levee::plugins::bindings::Route::Completions,
        prompt: prompt.to_string(),
        prompt_tokens: prompt.split_whitespace().count() as u32,
        max_tokens: 64,
        temperature: 0.0,
        top_p: 1.0,
        seed: None,
        n: 1,
        stop: Vec::new(),
        priority: 0,
        stream: false,
        headers: vec![("user-agent".to_string(), "levee-tests".to_string())],
        min_similarity: None,
    })
}

/// Scale signals of one replica under `load`.
pub fn signals(load: levee::plugins::bindings::Load) -> levee::plugins::bindings::ScaleSignals {
    levee::plugins::bindings::ScaleSignals {
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

/// The default model, fetched by `scripts/setup.sh`.
pub fn model_path() -> PathBuf {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(path.exists(), "{} is missing: run scripts/setup.sh first", path.display());
    path
}

/// A configuration from TOML (plugins and all), serving the default model
/// on one thread with a small KV cache.
pub fn config(toml_text: &str) -> levee::config::Config {
    let mut config = match levee::config::Config::parse(toml_text) {
        Ok(config) => config,
        Err(e) => panic!("test configuration: {e}"),
    };
    config.model.path = model_path();
    config.embeddings.path = Some(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/minilm"));
    config.engine.threads = 1;
    config.engine.kv_memory_mib = 64;
    config
}

/// A Levee server on an ephemeral loopback port.
pub struct TestServer {
    /// `http://127.0.0.1:PORT`.
    pub base: String,
    /// The running server's parts.
    pub levee: levee::server::Levee,
}

impl TestServer {
    /// Starts everything `config` describes and serves it.
    pub async fn start(config: levee::config::Config) -> TestServer {
        let levee = match levee::server::Levee::start(&config).await {
            Ok(levee) => levee,
            Err(e) => panic!("server start: {e}"),
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind a loopback port");
        let base = format!("http://{}", listener.local_addr().expect("local address"));
        let router = levee.router();
        let serving = levee.serving(std::time::Duration::ZERO);
        tokio::spawn(async move {
            levee::listener::serve(listener, router, serving, std::future::pending(), || {}, || {}).await
        });
        TestServer { base, levee }
    }

    /// `base` + `path`.
    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// Sequences the engine has started so far.
    pub fn sequences_started(&self) -> u64 {
        self.levee.app.pipeline.engine.stats().sequences_started
    }
}

/// Serves the admin routes of `system` behind `token` on a loopback port;
/// returns `http://127.0.0.1:PORT`.
pub async fn serve_admin(system: &PluginSystem, token: &str) -> String {
    let admin = levee::admin::AdminState {
        policies: system.policies.clone(),
        reloader: system.reloader.clone(),
        token: Some(Arc::from(token)),
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind a loopback port");
    let base = format!("http://{}", listener.local_addr().expect("local address"));
    let serving = levee::listener::Serving {
        header_read_timeout: std::time::Duration::from_secs(15),
        write_timeout: std::time::Duration::from_secs(30),
        max_connections: 64,
        grace: std::time::Duration::ZERO,
        stats: Arc::default(),
    };
    let router = levee::admin::router(admin);
    tokio::spawn(async move {
        levee::listener::serve(listener, router, serving, std::future::pending(), || {}, || {}).await
    });
    base
}

/// Serialises the tests that run the model, so that two engines never
/// share this machine's cores.
pub async fn exclusive() -> tokio::sync::MutexGuard<'static, ()> {
    static LOCK: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    LOCK.lock().await
}

/// A free loopback port (bound, then released).
pub fn free_port() -> u16 {
    match std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()) {
        Ok(addr) => addr.port(),
        Err(e) => panic!("no free loopback port: {e}"),
    }
}

/// A `redis-server` of the test's own on a loopback port, with nothing
/// persisted; stopped when dropped.
pub struct RedisServer {
    /// Its port.
    pub port: u16,
    child: Option<std::process::Child>,
}

impl RedisServer {
    /// Starts one on a free port and waits until it answers.
    pub fn start() -> RedisServer {
        let mut server = RedisServer { port: free_port(), child: None };
        server.restart();
        server
    }

    /// `redis://127.0.0.1:PORT/0`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    /// Kills the server (its data is gone with it).
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server again on the same port, empty.
    pub fn restart(&mut self) {
        self.kill();
        let child = std::process::Command::new("redis-server")
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .stdout(std::process::Stdio::null())
            .spawn();
        match child {
            Ok(child) => self.child = Some(child),
            Err(e) => panic!("cannot start redis-server ({e}): run scripts/setup.sh, which installs it"),
        }
        let started = std::time::Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(started.elapsed() < std::time::Duration::from_secs(10), "redis-server did not start");
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A real Levee process serving `levee.toml` text, on its own port; killed
/// when dropped.
pub struct Replica {
    /// `http://127.0.0.1:PORT`.
    pub base: String,
    child: std::process::Child,
    _dir: TempDir,
}

/// A directory removed when dropped.
pub struct TempDir(pub PathBuf);

impl TempDir {
    /// A fresh directory under the system's temporary directory.
    pub fn new(tag: &str) -> TempDir {
        static COUNT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = COUNT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("levee-{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        if let Err(e) = std::fs::create_dir_all(&dir) {
            panic!("cannot create {}: {e}", dir.display());
        }
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

impl Replica {
    /// Starts `binary` (the tests' `levee-replica`) with `toml_text` plus the
    /// default model, the embedding model, one thread and a free port, and
    /// waits until `/ready` answers 200.
    pub async fn start(binary: &str, toml_text: &str) -> Replica {
        Self::start_with(binary, toml_text, &[]).await
    }

    /// As [`Replica::start`], with extra command-line arguments.
    pub async fn start_with(binary: &str, toml_text: &str, args: &[&str]) -> Replica {
        let dir = TempDir::new("replica");
        let port = free_port();
        let models = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models");
        let text = format!(
            "{toml_text}\n[model]\npath = {:?}\n[embeddings]\npath = {:?}\n",
            model_path().display().to_string(),
            models.join("minilm").display().to_string()
        );
        let config = dir.0.join("levee.toml");
        if let Err(e) = std::fs::write(&config, text) {
            panic!("cannot write {}: {e}", config.display());
        }
        let child = std::process::Command::new(binary)
            .arg("serve")
            .arg("--config")
            .arg(&config)
            .args(["--listen", &format!("127.0.0.1:{port}"), "--threads", "1", "--kv-memory-mib", "64"])
            .args(args)
            .env("LEVEE_LOG", "warn")
            .current_dir(&dir.0)
            .stdout(std::process::Stdio::null())
            .spawn();
        let child = match child {
            Ok(child) => child,
            Err(e) => panic!("cannot start {binary}: {e}"),
        };
        let mut replica = Replica { base: format!("http://127.0.0.1:{port}"), child, _dir: dir };
        let started = std::time::Instant::now();
        loop {
            if let Ok(Some(status)) = replica.child.try_wait() {
                panic!("levee exited at start with {status}");
            }
            if ready(&replica.url("/ready")).await {
                return replica;
            }
            assert!(started.elapsed() < std::time::Duration::from_secs(120), "levee never became ready");
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    }

    /// `base` + `path`.
    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The child process, to signal or wait for.
    pub fn child(&mut self) -> &mut std::process::Child {
        &mut self.child
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn ready(url: &str) -> bool {
    let Some(rest) = url.strip_prefix("http://") else { return false };
    let Some((host, path)) = rest.split_once('/') else { return false };
    let Ok(mut stream) = tokio::net::TcpStream::connect(host).await else { return false };
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let request = format!("GET /{path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n");
    if stream.write_all(request.as_bytes()).await.is_err() {
        return false;
    }
    let mut head = [0u8; 12];
    stream.read_exact(&mut head).await.is_ok() && head.ends_with(b"200")
}

/// One sample's value from Prometheus text, by its full name with labels.
pub fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines().find_map(|line| line.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}
