//! `levee`: the server binary.

use anyhow::Context;
use clap::{Parser, Subcommand};
use levee::admin::AdminState;
use levee::capabilities::Capabilities;
use levee::config::Config;
use levee::plugins::{PluginRuntime, PluginSystem};
use levee::server::{self, AppState};
use std::path::PathBuf;
use std::sync::Arc;

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
    /// Serve HTTP with the configured plugin chain.
    Serve(ServeArgs),
}

#[derive(clap::Args)]
struct ServeArgs {
    /// Configuration file (TOML). Missing and not given: built-in defaults, no plugins.
    #[arg(long, env = "LEVEE_CONFIG")]
    config: Option<PathBuf>,
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
    let caps = Arc::new(Capabilities::local());
    let runtime = Arc::new(PluginRuntime::new(&config.plugin_runtime, caps.clone())?);
    let plugins = PluginSystem::start(runtime, &config.plugin_runtime, config.plugins.clone()).await?;
    tracing::info!(plugins = config.plugins.len(), "plugin chain loaded");
    let app = AppState { policies: plugins.policies.clone(), caps };
    let admin = AdminState {
        policies: plugins.policies.clone(),
        reloader: plugins.reloader.clone(),
        token: config.admin.token.as_deref().map(Arc::from),
    };
    let listener = tokio::net::TcpListener::bind(&config.server.listen)
        .await
        .with_context(|| format!("cannot listen on {}", config.server.listen))?;
    tracing::info!(addr = %listener.local_addr()?, "listening");
    server::serve(listener, server::router(app, admin)).await?;
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_env("LEVEE_LOG").unwrap_or_else(|_| "info".into()))
        .init();
    match Cli::parse().command {
        Command::Serve(args) => serve(args).await,
    }
}
