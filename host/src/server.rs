//! The HTTP server: liveness, Prometheus metrics and the admin API, with
//! graceful shutdown on SIGTERM or Ctrl-C.

use crate::admin::{self, AdminState};
use crate::capabilities::Capabilities;
use crate::metrics::header;
use crate::plugins::bindings::Hook;
use crate::plugins::{FAULT_KINDS, Policies};
pub use axum::Router;
use axum::extract::State;
use axum::http::header::CONTENT_TYPE;
use axum::response::IntoResponse;
use axum::routing::get;
use std::fmt::Write;
use std::sync::Arc;

/// What the public routes need.
#[derive(Clone)]
pub struct AppState {
    /// The current chain.
    pub policies: Arc<Policies>,
    /// Shared host capabilities (plugin metrics).
    pub caps: Arc<Capabilities>,
}

async fn health() -> &'static str {
    "ok"
}

/// Renders the plugin runtime's metrics in Prometheus text format.
pub fn render_plugin_metrics(policies: &Policies, caps: &Capabilities, out: &mut String) {
    let chain = policies.snapshot();
    header(out, "levee_plugin_calls_total", "counter", "Hook calls per plugin and hook.");
    for p in chain.plugins() {
        for hook in Hook::ALL.iter().filter(|h| p.declares(**h)) {
            let _ = writeln!(
                out,
                "levee_plugin_calls_total{{plugin=\"{}\",hook=\"{}\"}} {}",
                p.name,
                hook.name(),
                p.stats.calls(*hook)
            );
        }
    }
    header(
        out,
        "levee_plugin_faults_total",
        "counter",
        "Plugin faults by kind (trap, deadline, over-memory, malformed, instantiate).",
    );
    for p in chain.plugins() {
        for (kind, n) in FAULT_KINDS.iter().zip(p.stats.faults_by_kind()) {
            let _ = writeln!(out, "levee_plugin_faults_total{{plugin=\"{}\",kind=\"{kind}\"}} {n}", p.name);
        }
    }
    header(out, "levee_plugin_quarantined", "gauge", "1 when the plugin is quarantined after repeated faults.");
    for p in chain.plugins() {
        let _ = writeln!(out, "levee_plugin_quarantined{{plugin=\"{}\"}} {}", p.name, u8::from(p.stats.quarantined()));
    }
    header(out, "levee_plugin_shadow_overrides_total", "counter", "Shadow-mode decisions that were not applied.");
    for p in chain.plugins() {
        let _ = writeln!(
            out,
            "levee_plugin_shadow_overrides_total{{plugin=\"{}\"}} {}",
            p.name,
            p.stats.shadow_overrides()
        );
    }
    header(
        out,
        "levee_plugin_hook_duration_seconds",
        "histogram",
        "Time of one hook call, including instance start-up.",
    );
    for p in chain.plugins() {
        for hook in Hook::ALL.iter().filter(|h| p.declares(**h)) {
            p.stats.latency(*hook).render(
                "levee_plugin_hook_duration_seconds",
                &format!("plugin=\"{}\",hook=\"{}\"", p.name, hook.name()),
                out,
            );
        }
    }
    caps.metrics.render(out);
}

async fn metrics(State(state): State<AppState>) -> impl IntoResponse {
    let mut out = String::new();
    render_plugin_metrics(&state.policies, &state.caps, &mut out);
    ([(CONTENT_TYPE, "text/plain; version=0.0.4")], out)
}

/// The whole router.
pub fn router(app: AppState, admin: AdminState) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .with_state(app)
        .merge(admin::router(admin))
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

/// Serves `router` on `listener` until SIGTERM or Ctrl-C, then lets
/// in-flight requests finish.
pub async fn serve(listener: tokio::net::TcpListener, router: Router) -> std::io::Result<()> {
    axum::serve(listener, router).with_graceful_shutdown(shutdown_signal()).await
}
