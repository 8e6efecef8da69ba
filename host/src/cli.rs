//! The `levee` command line: `levee serve` and its flags.

use crate::config::Config;
use crate::server::{self, Levee};
use anyhow::Context;
use clap::{Parser, Subcommand};
use std::path::PathBuf;
use std::time::Duration;

/// Levee: an LLM inference server whose traffic policies are hot-swappable
/// WebAssembly plugins.
#[derive(Parser)]
#[command(version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the model over the OpenAI-compatible API, through the configured plugin chain.
    Serve(ServeArgs),
}

#[derive(clap::Args)]
struct ServeArgs {
    /// Configuration file (TOML). Missing and not given: built-in defaults, no plugins.
    #[arg(long, env = "LEVEE_CONFIG")]
    config: Option<PathBuf>,
    /// Model file (GGUF) or directory (safetensors + config.json); overrides model.path.
    #[arg(long, env = "LEVEE_MODEL")]
    model: Option<PathBuf>,
    /// Name clients use for the model; overrides model.name.
    #[arg(long, env = "LEVEE_MODEL_NAME")]
    model_name: Option<String>,
    /// Backend: cpu, cuda or auto (CUDA when a GPU is usable); overrides engine.device.
    #[arg(long, env = "LEVEE_DEVICE")]
    device: Option<String>,
    /// KV cache memory in MiB; overrides engine.kv-memory-mib.
    #[arg(long, env = "LEVEE_KV_MEMORY_MIB")]
    kv_memory_mib: Option<usize>,
    /// Compute threads (0 = all cores); overrides engine.threads.
    #[arg(long, env = "LEVEE_THREADS")]
    threads: Option<usize>,
    /// Seconds in-flight requests get to finish after SIGTERM (overrides server.shutdown-grace-secs).
    #[arg(long, env = "LEVEE_SHUTDOWN_GRACE_SECS")]
    shutdown_grace_secs: Option<f64>,
    /// Address to listen on (overrides server.listen).
    #[arg(long, env = "LEVEE_LISTEN")]
    listen: Option<String>,
    /// Token for the admin API (overrides admin.token).
    #[arg(long, env = "LEVEE_ADMIN_TOKEN", hide_env_values = true)]
    admin_token: Option<String>,
}

fn load_config(args: &ServeArgs) -> anyhow::Result<Config> {
    let mut config = match &args.config {
        Some(path) => Config::load(path)?,
        None if std::path::Path::new("levee.toml").exists() => Config::load(std::path::Path::new("levee.toml"))?,
        None => Config::default(),
    };
    if let Some(model) = &args.model {
        config.model.path = model.clone();
    }
    if let Some(name) = &args.model_name {
        config.model.name = Some(name.clone());
    }
    if let Some(device) = &args.device {
        config.engine.device = device.clone();
    }
    if let Some(mib) = args.kv_memory_mib {
        config.engine.kv_memory_mib = mib;
    }
    if let Some(threads) = args.threads {
        config.engine.threads = threads;
    }
    if let Some(grace) = args.shutdown_grace_secs {
        config.server.shutdown_grace_secs = grace;
    }
    if let Some(listen) = &args.listen {
        config.server.listen = listen.clone();
    }
    if let Some(token) = &args.admin_token {
        config.admin.token = Some(token.clone());
    }
    config.validate()?;
    Ok(config)
}

async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let config = load_config(&args)?;
    let levee = Levee::start(&config).await?;
    let backlog = config.server.max_connections.clamp(1024, 65_535) as u32;
    let listener = crate::listener::bind(&config.server.listen, backlog)
        .await
        .with_context(|| format!("cannot listen on {}", config.server.listen))?;
    tracing::info!(addr = %listener.local_addr()?, "listening");
    match crate::listener::raise_open_files_limit() {
        Some(limit) if (limit as usize) < config.server.max_connections + 64 => tracing::warn!(
            limit,
            max_connections = config.server.max_connections,
            "the open-file limit is below server.max-connections; connections past it fail to be accepted"
        ),
        _ => {}
    }
    let app = levee.app.clone();
    let serving = levee.serving(Duration::from_secs_f64(config.server.shutdown_grace_secs));
    let drain_app = app.clone();
    let cut_app = app.clone();
    crate::listener::serve(
        listener,
        levee.router(),
        serving,
        server::shutdown_signal(),
        move || drain_app.drain(),
        move || cut_app.cut(),
    )
    .await?;
    app.scaling.leave().await;
    tracing::info!("stopped");
    Ok(())
}

/// Parses the command line and runs it: the whole of the `levee` binary.
pub fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_env("LEVEE_LOG").unwrap_or_else(|_| "info".into()))
        .init();
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().context("tokio runtime")?;
    let result = match Cli::parse().command {
        Command::Serve(args) => runtime.block_on(serve(args)),
    };
    // Connections still open (idle, half-sent) are dropped here, not waited for.
    runtime.shutdown_timeout(Duration::from_millis(500));
    result
}
