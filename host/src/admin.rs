//! Admin routes, behind their own bearer token: `GET /admin/plugins` lists
//! the chain, `POST /admin/plugins/reload` reloads it, and
//! `POST /admin/plugins/{name}/lift-quarantine` calls a quarantined plugin again.

use crate::plugins::bindings::Hook;
use crate::plugins::{FAULT_KINDS, Policies, ReloadHandle};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{Value, json};
use std::sync::Arc;

/// What the admin routes need.
#[derive(Clone)]
pub struct AdminState {
    /// The current chain.
    pub policies: Arc<Policies>,
    /// The reloader.
    pub reloader: ReloadHandle,
    /// The admin token; `None` disables the admin API.
    pub token: Option<Arc<str>>,
}

fn error(status: StatusCode, kind: &str, message: &str) -> Response {
    (status, Json(json!({ "error": { "message": message, "type": kind, "param": null, "code": null } })))
        .into_response()
}

/// The refusal for a caller without the admin token, or `None` to go ahead.
fn refuse(state: &AdminState, headers: &HeaderMap) -> Option<Response> {
    let Some(token) = state.token.as_deref() else {
        return Some(error(
            StatusCode::FORBIDDEN,
            "permission_error",
            "the admin API is disabled: set admin.token or LEVEE_ADMIN_TOKEN",
        ));
    };
    let given = headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    match given {
        None => Some(error(
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            "admin routes need `Authorization: Bearer <admin token>`",
        )),
        Some(given) if constant_time_eq(given.as_bytes(), token.as_bytes()) => None,
        Some(_) => Some(error(StatusCode::FORBIDDEN, "permission_error", "the admin token is not valid")),
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn list(State(state): State<AdminState>, headers: HeaderMap) -> Response {
    if let Some(denied) = refuse(&state, &headers) {
        return denied;
    }
    let chain = state.policies.snapshot();
    let plugins: Vec<Value> = chain
        .plugins()
        .iter()
        .map(|p| {
            let faults: serde_json::Map<String, Value> =
                FAULT_KINDS.iter().zip(p.stats.faults_by_kind()).map(|(k, n)| (k.to_string(), json!(n))).collect();
            let calls: serde_json::Map<String, Value> = Hook::ALL
                .iter()
                .filter(|h| p.declares(**h))
                .map(|h| (h.name().to_string(), json!(p.stats.calls(*h))))
                .collect();
            json!({
                "name": &*p.name,
                "version": p.version,
                "path": p.config.path,
                "manifest": { "name": p.manifest.name, "version": p.manifest.version },
                "hooks": p.manifest.hooks.iter().map(|h| h.name()).collect::<Vec<_>>(),
                "mode": p.mode(),
                "on_fault": p.on_fault(),
                "calls": calls,
                "faults": faults,
                "shadow_overrides": p.stats.shadow_overrides(),
                "quarantined": p.stats.quarantined(),
                "idle_instances": p.idle_instances(),
            })
        })
        .collect();
    Json(json!({ "plugins": plugins })).into_response()
}

async fn reload(State(state): State<AdminState>, headers: HeaderMap) -> Response {
    if let Some(denied) = refuse(&state, &headers) {
        return denied;
    }
    match state.reloader.reload().await {
        Ok(report) => Json(json!({ "reloaded": report.reloaded, "versions": report.versions })).into_response(),
        Err(message) => error(StatusCode::UNPROCESSABLE_ENTITY, "reload_rejected", &message),
    }
}

/// `POST /admin/plugins/{name}/lift-quarantine`: calls the plugin again
/// (for a fault that was outside it, such as a store outage).
async fn lift_quarantine(
    State(state): State<AdminState>,
    headers: HeaderMap,
    axum::extract::Path(name): axum::extract::Path<String>,
) -> Response {
    if let Some(denied) = refuse(&state, &headers) {
        return denied;
    }
    let chain = state.policies.snapshot();
    let Some(plugin) = chain.plugins().iter().find(|p| *p.name == *name) else {
        let names: Vec<&str> = chain.plugins().iter().map(|p| &*p.name).collect();
        return error(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            &format!("no plugin {name:?} (the chain has {names:?})"),
        );
    };
    let was = plugin.stats.reset_quarantine();
    if was {
        tracing::warn!(plugin = &*plugin.name, "quarantine lifted through the admin API");
    }
    Json(json!({ "name": &*plugin.name, "was_quarantined": was, "quarantined": false })).into_response()
}

/// The admin router.
pub fn router(state: AdminState) -> Router {
    Router::new()
        .route("/admin/plugins", get(list))
        .route("/admin/plugins/reload", post(reload))
        .route("/admin/plugins/{name}/lift-quarantine", post(lift_quarantine))
        .with_state(state)
}
